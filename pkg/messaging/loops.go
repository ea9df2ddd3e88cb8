package messaging

import (
	"context"
	"log/slog"
	"time"
)

// reconnect runs session again and again until ctx ends, with backoff between the failures;
// a session that got somewhere (connected reports true) starts the backoff afresh. Each break is
// logged as what, with its error and the wait.
func reconnect(ctx context.Context, retry Backoff, log *slog.Logger, what string, session func(context.Context) (connected bool, err error)) {
	failures := 0
	for {
		connected, err := session(ctx)
		if ctx.Err() != nil {
			return
		}
		if connected {
			failures = 0
		}
		failures++
		delay := retry.Delay(failures)
		log.Warn(what, "error", err, "retry_in", delay)
		if !sleep(ctx, nil, delay) {
			return
		}
	}
}

// sleep waits for d, a signal on wake (nil: none) or the end of ctx, and reports whether ctx is
// still live: the wait of a worker between rounds that a commit may cut short.
func sleep(ctx context.Context, wake <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-wake:
	case <-t.C:
	}
	return true
}
