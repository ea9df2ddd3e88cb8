package test

import (
	"context"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// The relay's drain rate only means something next to what the broker itself can take on this
// machine at that moment, so both are measured in the same run:
//
//	go test -run '^$' -bench 'BrokerConfirms|RelayDrain' -benchtime 3x ./pkg/messaging/test/
const benchMessages = 20_000

// BenchmarkBrokerConfirms is the baseline: persistent publishes of the same messages to the same
// kind of quorum queue, with a window of confirms in flight, no database involved.
func BenchmarkBrokerConfirms(b *testing.B) {
	tb := setup(b)
	msgs := make([]messaging.Message, benchMessages)
	for i := range msgs {
		msgs[i] = newMessage(b, i)
	}
	conn, err := amqp.Dial(testenv.AMQPURL())
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		b.Fatal(err)
	}
	const window = 500
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		for lo := 0; lo < len(msgs); lo += window {
			confirms := make([]*amqp.DeferredConfirmation, 0, window)
			for _, m := range msgs[lo:min(lo+window, len(msgs))] {
				dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), tb.exchange, m.Type, true, false,
					amqp.Publishing{DeliveryMode: amqp.Persistent, ContentType: "application/json", MessageId: m.ID.String(), Body: m.Payload})
				if err != nil {
					b.Fatal(err)
				}
				confirms = append(confirms, dc)
			}
			for _, dc := range confirms {
				if !dc.Wait() {
					b.Fatal("nack")
				}
			}
		}
		b.ReportMetric(float64(len(msgs))/time.Since(start).Seconds(), "msg/s")
		b.StopTimer()
		if _, err := ch.QueuePurge(tb.queue, false); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}

// BenchmarkRelayDrain: one relay drains a backlog of 20,000 rows (claim, publish with confirms,
// mark, commit), for a few batch sizes.
func BenchmarkRelayDrain(b *testing.B) {
	for _, batch := range []int{100, 500} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			tb := setup(b)
			r := tb.relay(b, tb.publisher(b, testenv.AMQPURL()), func(c *messaging.RelayConfig) { c.BatchSize = batch })
			for range b.N {
				b.StopTimer()
				tb.enqueue(b, benchMessages)
				b.StartTimer()
				start := time.Now()
				sent := 0
				for sent < benchMessages {
					res, err := r.ProcessBatch(context.Background())
					if err != nil || res.Failed > 0 {
						b.Fatalf("batch %+v: %v", res, err)
					}
					sent += res.Sent
				}
				b.ReportMetric(float64(sent)/time.Since(start).Seconds(), "msg/s")
				b.StopTimer()
				if _, err := tb.ch.QueuePurge(tb.queue, false); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
		})
	}
}
