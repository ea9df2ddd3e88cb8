package messaging_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// deadLetters takes every message out of queue's dead-letter queue.
func deadLetters(t *testing.T, ch *amqp.Channel, queue string) []amqp.Delivery {
	t.Helper()
	return testenv.Drain(t, ch, messaging.DeadLetterQueue(queue), 100*time.Millisecond)
}

// wantReason fails unless d came to the dead-letter queue from the consumer, with a reason
// containing part and the time it was dead-lettered.
func wantReason(t *testing.T, d amqp.Delivery, part string) {
	t.Helper()
	reason, _ := d.Headers[messaging.HeaderDeadLetterReason].(string)
	if !strings.Contains(reason, part) {
		t.Errorf("message %q: dead-letter reason %q does not contain %q", d.MessageId, reason, part)
	}
	at, _ := d.Headers[messaging.HeaderDeadLetteredAt].(string)
	if when, err := time.Parse(time.RFC3339Nano, at); err != nil || time.Since(when) > time.Minute || time.Until(when) > time.Second {
		t.Errorf("message %q: dead-lettered at %q, want a time within the last minute", d.MessageId, at)
	}
}

// reasonsByID maps the message ids of deliveries to their dead-letter reasons.
func reasonsByID(deliveries []amqp.Delivery) map[string]string {
	out := make(map[string]string, len(deliveries))
	for _, d := range deliveries {
		out[d.MessageId], _ = d.Headers[messaging.HeaderDeadLetterReason].(string)
	}
	return out
}

// The copy in the dead-letter queue is the message as it came, id and properties unchanged,
// plus where it came from and why it can never be handled; it came by publish, not by the
// broker's dead-lettering (no x-death).
func TestConsumerDeadLetterCarriesTheMessageAndItsReason(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	b.consumer(t, testenv.AMQPURL(), b.db.DB, workFunc, nil)
	occurred := time.Now().Add(-time.Hour).Truncate(time.Second)
	sent := amqp.Publishing{
		MessageId: uuid.NewString(), Type: eventType, ContentType: "application/json", AppId: "order",
		CorrelationId: "corr-1", Timestamp: occurred, DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{"correlation_id": "corr-1", "tenant": "acme"},
		Body:    []byte(`{"n":1}`), // no order_id: doWork says no retry can help
	}
	b.publishRaw(t, sent)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(b.queue)) == 1 },
		"message not dead-lettered")
	got := deadLetters(t, b.ch, b.queue)
	if len(got) != 1 {
		t.Fatalf("%d messages in the dead-letter queue, want 1", len(got))
	}
	d := got[0]
	wantReason(t, d, "payload has no order_id")
	if d.MessageId != sent.MessageId || d.Type != sent.Type || string(d.Body) != string(sent.Body) || d.ContentType != sent.ContentType ||
		d.AppId != sent.AppId || d.CorrelationId != sent.CorrelationId || !d.Timestamp.Equal(occurred) || d.DeliveryMode != amqp.Persistent {
		t.Errorf("dead letter %+v differs from what was published %+v", d, sent)
	}
	if d.Headers["tenant"] != "acme" || d.Headers[messaging.HeaderOriginalExchange] != b.exchange || d.Headers[messaging.HeaderOriginalRoutingKey] != eventType {
		t.Errorf("headers %v: want the original ones plus exchange %q and routing key %q", d.Headers, b.exchange, eventType)
	}
	if _, ok := d.Headers["x-death"]; ok {
		t.Errorf("x-death %v: the broker dead-lettered it, not the consumer", d.Headers["x-death"])
	}
	// The consumer logs and counts it once the broker confirmed the copy, which the queue may
	// show a moment before.
	testenv.Eventually(t, 5*time.Second, func() bool {
		return hasMetric(t, b.registry, `consumer_messages_total{outcome="dead_lettered",queue="`+b.queue+`"} 1`)
	}, "not counted as dead-lettered")
	if lines := b.logs.Lines("level=ERROR", "message dead-lettered", "message_id="+sent.MessageId, "reason="); len(lines) != 1 {
		t.Errorf("want one dead-letter line with the reason, got %q", b.logs.Lines("message dead-lettered"))
	}
}

// While the dead-letter queue cannot take a message (here it is gone: the publish comes back
// unroutable), the message is not acknowledged: a consumer that stops hands it back to the
// queue, and once the dead-letter queue is back the message lands there, once.
func TestConsumerKeepsAMessageTheDeadLetterQueueDoesNotTake(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	if _, err := b.ch.QueueDelete(dlq, false, false, false); err != nil {
		t.Fatal(err)
	}
	in := newInbox(t, b.db.DB, consumerName, b.log)
	c, err := messaging.NewConsumer(messaging.ConsumerConfig{
		URL: testenv.AMQPURL(), Queue: b.queue, Logger: b.log, Metrics: b.metrics, // no Setup: the queue stays gone
		RetryBackoff: messaging.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond},
	}, in.Handler(workFunc))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- c.Run(ctx) }()
	poison := amqp.Publishing{MessageId: uuid.NewString(), ContentType: "application/json", Body: []byte("<xml/>")}
	b.publishRaw(t, poison)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines("could not dead-letter message", poison.MessageId, "unroutable")) >= 3
	},
		"the consumer did not report the dead-letter queue refusing the message")
	cancel()
	select {
	case err := <-stopped:
		if err != nil {
			t.Fatalf("Run returned %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("consumer did not stop")
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == 1 },
		"the stopped consumer did not hand the message back to the queue")
	if hasMetric(t, b.registry, `outcome="dead_lettered"`) {
		t.Fatal("counted as dead-lettered while no dead-letter queue took it")
	}

	declare(t, b.topology) // the dead-letter queue is back
	b.consumer(t, testenv.AMQPURL(), b.db.DB, workFunc, nil)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == 1 }, "message not dead-lettered")
	got := deadLetters(t, b.ch, b.queue)
	if len(got) != 1 || got[0].MessageId != poison.MessageId {
		t.Fatalf("dead-letter queue held %d messages, want the poison message once", len(got))
	}
	wantReason(t, got[0], "body is not valid JSON")
	if n := testenv.QueueDepth(t, b.ch, b.queue); n != 0 {
		t.Fatalf("queue still holds %d", n)
	}
}

// A dead-letter queue an earlier version declared, without x-delivery-limit, cannot be declared
// again with it: the consumer says so, and uses it as it is.
func TestConsumerUsesADeadLetterQueueDeclaredWithoutALimit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	if _, err := b.ch.QueueDelete(dlq, false, false, false); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ch.QueueDeclare(dlq, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum}); err != nil {
		t.Fatal(err)
	}
	if err := b.topology.Declare(testenv.Connection(t), nil); !errors.Is(err, messaging.ErrLegacyDeadLetterQueue) {
		t.Fatalf("Declare = %v, want ErrLegacyDeadLetterQueue", err)
	}
	b.consumer(t, testenv.AMQPURL(), b.db.DB, workFunc, nil)
	if n := len(b.logs.Lines("level=WARN", "default delivery limit", "dead_letter_queue="+dlq)); n != 1 {
		t.Fatalf("%d warnings about the dead-letter queue's limit, want 1", n)
	}
	poison := amqp.Publishing{MessageId: uuid.NewString(), ContentType: "application/json", Body: []byte(`{"n":1}`)}
	b.publishRaw(t, poison)
	good := newMessage(t, 2)
	b.publishRaw(t, publishing(good))
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == 1 && b.workDone(t) == 1 },
		"want the poison message dead-lettered and the good one handled")
	got := deadLetters(t, b.ch, b.queue)
	wantReason(t, got[0], "payload has no order_id")
}

// The dead-letter queue has no delivery limit: a message handed back more often than RabbitMQ
// 4.x's default limit (20) stays. With x-delivery-limit -1 (unlimited on 4.x) RabbitMQ 3.x
// drops it the first time.
func TestDeadLetterQueueHasNoDeliveryLimit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	if err := b.ch.PublishWithContext(context.Background(), "", dlq, true, false, amqp.Publishing{MessageId: "kept", Body: []byte("{}")}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == 1 }, "message not in the dead-letter queue")
	for i := range 25 {
		d, ok, err := b.ch.Get(dlq, false)
		if err != nil || !ok {
			t.Fatalf("get %d: ok=%v err=%v: the message is gone", i+1, ok, err)
		}
		if err := d.Nack(false, true); err != nil {
			t.Fatal(err)
		}
	}
	if got := deadLetters(t, b.ch, b.queue); len(got) != 1 || got[0].MessageId != "kept" {
		t.Fatalf("after 25 deliveries the dead-letter queue holds %d messages, want the one", len(got))
	}
}
