package test

import (
	"context"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// Prefetch bounds what a worker holds: with its handler stuck on one message, the broker sends
// it no more than Prefetch deliveries, and the rest stay ready in the queue for other replicas.
// Without the bound, one stuck worker would take the whole queue out of everyone's reach.
func TestAWorkerHoldsNoMoreThanItsPrefetch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	const n, prefetch = 10, 3
	for i := range n {
		b.publishRaw(t, publishing(newMessage(t, i)))
	}
	entered, release := make(chan struct{}, n), make(chan struct{})
	work := func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		entered <- struct{}{}
		select {
		case <-release:
		case <-ctx.Done():
		}
		return doWork(tx, p, msg)
	}
	b.consumer(t, testenv.AMQPURL(), b.drv, work, func(c *messaging.SubscriptionConfig) {
		c.Concurrency, c.BatchSize, c.Prefetch = 1, 1, prefetch
	})
	t.Cleanup(func() { close(release) }) // before the consumer's own cleanup stops it
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler never ran")
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == n-prefetch },
		"the queue does not keep %d of %d messages ready while the worker holds %d", n-prefetch, n, prefetch)
	// The broker delivers without being asked: what it holds back must stay held back.
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if ready := testenv.QueueDepth(t, b.ch, b.queue); ready != n-prefetch {
			t.Fatalf("%d of %d messages ready with the worker stuck, want %d: it took more than its prefetch of %d", ready, n, n-prefetch, prefetch)
		}
	}
}
