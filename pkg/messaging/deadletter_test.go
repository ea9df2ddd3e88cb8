package messaging_test

import (
	"context"
	"errors"
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
	if err := b.topology.Declare(testenv.Channel(t)); !errors.Is(err, messaging.ErrLegacyDeadLetterQueue) {
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
