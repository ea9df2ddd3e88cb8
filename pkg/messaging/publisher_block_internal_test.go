package messaging

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The late wait for a window abandoned to a block ends ConfirmTimeout after the broker unblocks
// the connection, or when it closes; never while it is blocked, however long (a resource
// alarm), and a block again before the time runs out starts it over.
func TestTheLateWaitForABlockedWindowEndsOnlyOnceUnblocked(t *testing.T) {
	t.Parallel()
	const d = 100 * time.Millisecond
	start := func(w *connWatch) (<-chan time.Time, func()) {
		expired, done, over := make(chan time.Time), make(chan struct{}), make(chan struct{})
		go func() {
			defer close(over)
			w.unblockedFor(d, expired, done)
		}()
		return expired, func() { close(done); <-over }
	}
	notWithin := func(expired <-chan time.Time, wait time.Duration, when string) {
		t.Helper()
		select {
		case <-expired:
			t.Fatalf("%s: the late wait expired", when)
		case <-time.After(wait):
		}
	}
	within := func(expired <-chan time.Time, wait time.Duration, when string) {
		t.Helper()
		select {
		case <-expired:
		case <-time.After(wait):
			t.Fatalf("%s: the late wait did not expire within %s", when, wait)
		}
	}

	w := newConnWatch()
	w.set(amqp.Blocking{Active: true, Reason: "test"})
	expired, stop := start(w)
	notWithin(expired, 3*d, "blocked")
	w.set(amqp.Blocking{Active: false})
	notWithin(expired, d/10, "unblocked for a tenth of the time")
	w.set(amqp.Blocking{Active: true, Reason: "test"})
	notWithin(expired, 2*d, "blocked again")
	unblocked := time.Now() // before: the wait may start its count at once
	w.set(amqp.Blocking{Active: false})
	within(expired, 20*d, "unblocked")
	if waited := time.Since(unblocked); waited < d {
		t.Errorf("the late wait expired %s after the unblock, want %s", waited, d)
	}
	stop()

	w = newConnWatch()
	w.set(amqp.Blocking{Active: true, Reason: "test"})
	expired, stop = start(w)
	close(w.closed)
	within(expired, 20*d, "closed while blocked")
	stop()

	// Settled in time: the wait gives up, and expires nothing.
	w = newConnWatch()
	expired, stop = start(w)
	stop()
	notWithin(expired, 2*d, "given up")
}

// A window abandoned to a block whose confirms never come, on a connection the broker
// unblocks and keeps up (a quorum queue without its majority confirms nothing), gives its
// places among the MaxInFlight and its ids back, and retires the connection, ConfirmTimeout
// after the unblock: it held them until the connection closed, which nothing did, and every
// later window waited for room in vain, its rows refused for good as still unsettled.
func TestABlockedWindowNeverConfirmedIsRetiredOnceUnblocked(t *testing.T) {
	t.Parallel()
	const timeout = 300 * time.Millisecond
	ctx := context.Background()
	msgs := routedMessages(t, 2)
	cfg := testPublisher(t).cfg
	cfg.ConfirmTimeout, cfg.MaxInFlight = timeout, len(msgs)
	p := NewPublisher(cfg)
	t.Cleanup(p.Close)
	if err := p.inFlight.Acquire(ctx, int64(len(msgs))); err != nil {
		t.Fatal(err)
	}
	errs := make([]error, len(msgs))
	s, confirms := p.write(ctx, msgs, errs)
	if s == nil {
		t.Fatalf("nothing published: %v", errs)
	}
	for i := range confirms {
		<-confirms[i].Done()
		confirms[i] = &amqp.DeferredConfirmation{} // its confirm never comes
	}
	closes := s.conn.NotifyClose(make(chan *amqp.Error, 1))
	s.watch.set(amqp.Blocking{Active: true, Reason: "test"})
	p.settle(ctx, time.Now().Add(timeout), s, msgs, confirms, errs)
	for i, err := range errs {
		if !errors.Is(err, ErrBrokerUnavailable) {
			t.Fatalf("message %d, its confirm awaited at the block: %v, want no verdict", i, err)
		}
	}
	// Blocked, however long: the confirms are still awaited, the connection kept.
	select {
	case err := <-closes:
		t.Fatalf("the connection was closed while blocked: %v", err)
	case <-time.After(3 * timeout):
	}
	s.watch.set(amqp.Blocking{Active: false})

	deadline := time.Now().Add(10 * timeout)
	for !p.inFlight.TryAcquire(int64(len(msgs))) {
		if time.Now().After(deadline) {
			t.Fatalf("the window's places among the MaxInFlight were not given back within %s of the unblock", 10*timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
	p.inFlight.Release(int64(len(msgs)))
	if !s.conn.IsClosed() {
		t.Error("the connection that withheld the confirms was kept")
	}
	for _, m := range msgs {
		if !s.reserve(m.ID) {
			t.Errorf("message %s is still unsettled on the retired connection", m.ID)
		}
	}
	for i, err := range p.Publish(ctx, msgs) {
		if err != nil {
			t.Errorf("message %d, published again after: %v, want sent", i, err)
		}
	}
}
