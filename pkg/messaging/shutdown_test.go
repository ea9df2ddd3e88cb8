package messaging_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// start runs fn in the background; stop cancels it and returns what it returned, failing t
// if that takes over 10 s.
func start(t *testing.T, fn func(ctx context.Context) error) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	t.Cleanup(cancel)
	return func() error {
		cancel()
		select {
		case err := <-done:
			return err
		case <-time.After(10 * time.Second):
			t.Fatal("did not stop within 10 s of cancellation")
			return nil
		}
	}
}

// heldPublish holds the first Publish until released, after saying it has begun.
type heldPublish struct {
	messaging.Sender
	begun, release chan struct{}
	once           sync.Once
}

func (h *heldPublish) Publish(ctx context.Context, msgs []messaging.Message) []error {
	h.once.Do(func() {
		close(h.begun)
		<-h.release
	})
	return h.Sender.Publish(ctx, msgs)
}

// A batch in flight at shutdown is published and marked within the grace period, not
// abandoned to be sent again by the next relay.
func TestRelayFinishesTheBatchInFlightAtShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	held := &heldPublish{Sender: b.publisher(t, testenv.AMQPURL()), begun: make(chan struct{}), release: make(chan struct{})}
	r := b.relay(t, held, func(c *messaging.RelayConfig) { c.Lanes, c.ShutdownGrace = 1, 5*time.Second })
	ids := b.enqueue(t, 5)
	stop := start(t, r.Run)
	<-held.begun

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	select {
	case err := <-stopped:
		t.Fatalf("Run returned (%v) with a batch still publishing", err)
	case <-time.After(300 * time.Millisecond): // the shutdown is under way and must wait
	}
	close(held.release)
	if err := <-stopped; err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if n := b.unprocessed(t); n != 0 {
		t.Fatalf("%d of the 5 rows in flight at shutdown are unsent, want 0: the batch was abandoned", n)
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
}

// A message whose handler runs at shutdown is committed and acknowledged within the grace
// period: not requeued to be handled again.
func TestConsumerFinishesTheMessageInFlightAtShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	begun, release := make(chan struct{}), make(chan struct{})
	work := func(ctx context.Context, tx *gorm.DB, msg messaging.Message) error {
		close(begun)
		<-release
		return doWork(tx, msg)
	}
	in, err := messaging.NewInbox(messaging.InboxConfig{DB: b.db.DB, Consumer: consumerName, Logger: b.log, Metrics: b.metrics})
	if err != nil {
		t.Fatal(err)
	}
	c, err := messaging.NewConsumer(messaging.ConsumerConfig{
		URL: testenv.AMQPURL(), Queue: b.queue, Topology: b.topology, Logger: b.log, Metrics: b.metrics,
		ShutdownGrace: 5 * time.Second,
	}, in.Handler(work))
	if err != nil {
		t.Fatal(err)
	}
	stop := start(t, c.Run)
	testenv.Eventually(t, 10*time.Second, c.Ready, "consumer not ready")
	msg := newMessage(t, 1)
	b.publishRaw(t, publishing(msg))
	<-begun

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	select {
	case err := <-stopped:
		t.Fatalf("Run returned (%v) with a handler still running", err)
	case <-time.After(300 * time.Millisecond):
	}
	close(release)
	if err := <-stopped; err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if w := b.workDone(t); w != 1 {
		t.Fatalf("work done %d times, want the 1 in flight at shutdown", w)
	}
	// Acknowledged: with its consumer gone, nothing is left to redeliver.
	if n := testenv.QueueDepth(t, b.ch, b.queue); n != 0 {
		t.Fatalf("%d messages back in the queue after shutdown, want 0: the finished work was not acknowledged", n)
	}
}

// Two batches holding the same messages in opposite orders claim them in id order, so the
// second waits for the first instead of deadlocking with it.
func TestOverlappingBatchesDoNotDeadlock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	in := newInbox(t, b.db.DB, consumerName, b.log)
	m1, m2 := newMessage(t, 1), newMessage(t, 2)

	// Each batch's first message waits (up to 2 s) for the other batch to reach its own
	// first message: in the wrong order, both then hold one claim and want the other's.
	var reached atomic.Int32
	first := func() {
		reached.Add(1)
		deadline := time.Now().Add(2 * time.Second)
		for reached.Load() < 2 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
	}
	batch := func(msgs ...messaging.Message) error {
		n := 0
		return in.HandleBatch(context.Background(), msgs, func(tx *gorm.DB, msg messaging.Message) error {
			if n++; n == 1 {
				first()
			}
			return doWork(tx, msg)
		})
	}
	var wg sync.WaitGroup
	errs := make([]error, 2)
	wg.Go(func() { errs[0] = batch(m1, m2) })
	wg.Go(func() { errs[1] = batch(m2, m1) })
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("overlapping batches: %v", err)
	}
	if w := b.workDone(t); w != 2 {
		t.Fatalf("work done %d times, want once for each of the 2 messages", w)
	}
}
