package platform

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// A periodic job runs at start, before its first tick; a failure (the database away at the
// hourly cleanup) is logged and the job runs again at the next tick, where it succeeds: the
// service goes on, and the worker returns nil once its context ends. A worker that returned the
// failure would stop the service for one blip.
func TestAPeriodicJobOutlivesAFailure(t *testing.T) {
	t.Parallel()
	failure := errors.New("connection refused")
	for _, c := range []struct {
		situation string
		interval  time.Duration
		runs      int // before the context ends
	}{
		{"no tick before the end: the run at start", time.Hour, 1},
		{"the failure, then a tick", 10 * time.Millisecond, 2},
	} {
		t.Run(c.situation, func(t *testing.T) {
			t.Parallel()
			log, logs := testenv.NewLogger(t)
			ran := make(chan struct{}, c.runs)
			calls := 0 // the worker's goroutine only
			job := Periodic(log, "test cleanup", c.interval, func(ctx context.Context) error {
				calls++
				select {
				case ran <- struct{}{}:
				default: // runs past those the test waits for
				}
				if calls == 1 {
					return failure
				}
				return nil
			})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- job(ctx) }()
			for i := range c.runs {
				select {
				case <-ran:
				case err := <-done:
					t.Fatalf("the worker returned %v after %d runs, before its context ended", err, i)
				case <-time.After(5 * time.Second):
					t.Fatalf("%d runs in 5 s at an interval of %s, want %d", i, c.interval, c.runs)
				}
			}
			// The job sends on ran before it returns its failure, which is logged only while
			// the context lives: the end must wait for the line.
			testenv.Eventually(t, 5*time.Second, func() bool { return len(logs.Lines("test cleanup failed")) > 0 },
				"the failure was not logged")
			cancel()
			if err := within(t, done, 5*time.Second, "the worker did not return once its context ended"); err != nil {
				t.Fatalf("the worker returned %v at the end of its context, want nil", err)
			}
			if n := len(logs.Lines("test cleanup failed", "connection refused")); n != 1 {
				t.Errorf("%d lines of the failure, want 1:\n%s", n, logs)
			}
		})
	}
}
