package test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A redrive that fails on a message (here its queue is deleted once the messages are held:
// the copy comes back unroutable) leaves that message, and every one it had not come to yet,
// in the dead-letter queue, in their order: the operator can run it again.
func TestAFailedRedriveLeavesTheDeadLetterQueueInOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	ids := make([]string, 40)
	for i := range ids {
		ids[i] = uuid.NewString()
		must(t, b.ch.PublishWithContext(context.Background(), "", dlq, true, false,
			amqp.Publishing{MessageId: ids[i], Type: eventType, ContentType: "application/json", Body: []byte(`{}`)}))
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == len(ids) }, "the messages did not reach %s", dlq)
	moved, err := messaging.RedriveDeadLetters(context.Background(), messaging.DeadLetterConfig{URL: testenv.AMQPURL(), Queue: b.queue},
		messaging.DeadLetterSelection{
			Match: func(d messaging.DeadLetter) bool { return d.MessageID != ids[0] }, // all but the first
			Confirm: func([]messaging.DeadLetter, int) error {
				_, err := b.ch.QueueDelete(b.queue, false, false, false)
				return err
			},
		})
	if err == nil || len(moved) != 0 {
		t.Fatalf("redrive into a deleted queue moved %d messages, error %v: want none moved and an error", len(moved), err)
	}
	got := make([]string, 0, len(ids))
	for _, d := range testenv.Drain(t, b.ch, dlq, 200*time.Millisecond) {
		got = append(got, d.MessageId)
	}
	if !slices.Equal(got, ids) {
		first := 0
		for first < min(len(got), len(ids)) && got[first] == ids[first] {
			first++
		}
		t.Fatalf("after the failed redrive %s holds %d of the %d messages, the first out of order at %d", dlq, len(got), len(ids), first)
	}
}

// A listing's limit is an upper bound, not a size: a limit far above what waits (an operator's
// --limit 1000000000) lists what waits, and holds no room for the rest.
func TestAListingLimitAboveTheQueueListsWhatWaits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	ids := []string{uuid.NewString(), uuid.NewString()}
	for _, id := range ids {
		must(t, b.ch.PublishWithContext(context.Background(), "", dlq, true, false,
			amqp.Publishing{MessageId: id, Type: eventType, ContentType: "application/json", Body: []byte(`{}`)}))
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == len(ids) }, "the messages did not reach %s", dlq)
	listed, waiting, err := messaging.ListDeadLetters(context.Background(), messaging.DeadLetterConfig{URL: testenv.AMQPURL(), Queue: b.queue}, 1<<40)
	if err != nil || waiting != len(ids) || len(listed) != len(ids) {
		t.Fatalf("listed %d of %d waiting, error %v: want the %d that wait", len(listed), waiting, err, len(ids))
	}
}

// A drop removes one message, the first that matches, and shows its confirmation only that
// one, even when the dead-letter queue holds two copies of it (a message dead-lettered again
// after a crash before its acknowledgement): the second copy stays, in its place.
func TestADropShowsAndRemovesTheFirstMatchOnly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	twice, other := uuid.NewString(), uuid.NewString()
	ids := []string{other, twice, twice}
	for _, id := range ids {
		must(t, b.ch.PublishWithContext(context.Background(), "", dlq, true, false,
			amqp.Publishing{MessageId: id, Type: eventType, ContentType: "application/json", Body: []byte(`{}`)}))
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == len(ids) }, "the messages did not reach %s", dlq)
	var shown int
	_, err := messaging.DropDeadLetter(context.Background(), messaging.DeadLetterConfig{URL: testenv.AMQPURL(), Queue: b.queue},
		messaging.DeadLetterSelection{
			Match:   func(d messaging.DeadLetter) bool { return d.MessageID == twice },
			Confirm: func(picked []messaging.DeadLetter, _ int) error { shown = len(picked); return nil },
		})
	if err != nil || shown != 1 {
		t.Fatalf("drop showed %d messages to confirm, error %v: want the one it drops", shown, err)
	}
	got := make([]string, 0, len(ids))
	for _, d := range testenv.Drain(t, b.ch, dlq, 200*time.Millisecond) {
		got = append(got, d.MessageId)
	}
	if !slices.Equal(got, []string{other, twice}) {
		t.Fatalf("after the drop %s holds %q, want the other message and the second copy", dlq, got)
	}
}
