package messaging

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"
)

// A session that got as far as connecting starts the backoff over: a consumer that lost its
// connection after hours of work reconnects at the base delay, not at the delay its failures
// before that session had reached.
func TestReconnectStartsTheBackoffOverAfterASessionThatConnected(t *testing.T) {
	t.Parallel()
	retry := Backoff{Base: time.Millisecond, Max: time.Second}
	delays := &retryDelays{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Three failed dials, a session that connected and then ended, and one more failed dial.
	connected := []bool{false, false, false, true, false}
	calls := 0
	reconnect(ctx, retry, slog.New(delays), "reconnecting", func(context.Context) (bool, error) {
		if calls == len(connected) {
			cancel()
			return false, ctx.Err()
		}
		calls++
		return connected[calls-1], errors.New("connection lost")
	})
	got := delays.all()
	if len(got) != len(connected) {
		t.Fatalf("%d retries logged, want %d: %v", len(got), len(connected), got)
	}
	// The third failure waits out the third step, more than the base; the session after it
	// connected, so the next wait is the first step's again, and the one after it the second's.
	if got[2] <= 2*retry.Base {
		t.Fatalf("third retry in %s, want the third step (over %s): %v", got[2], 2*retry.Base, got)
	}
	if got[3] > retry.Base || got[4] > 2*retry.Base {
		t.Fatalf("retries after the session that connected in %s and %s, want at most %s and %s: %v",
			got[3], got[4], retry.Base, 2*retry.Base, got)
	}
}

// retryDelays is a slog handler that keeps the retry_in of every line.
type retryDelays struct {
	mu     sync.Mutex
	delays []time.Duration
}

func (h *retryDelays) Enabled(context.Context, slog.Level) bool { return true }
func (h *retryDelays) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *retryDelays) WithGroup(string) slog.Handler            { return h }

func (h *retryDelays) Handle(_ context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "retry_in" {
			h.mu.Lock()
			h.delays = append(h.delays, a.Value.Duration())
			h.mu.Unlock()
		}
		return true
	})
	return nil
}

func (h *retryDelays) all() []time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]time.Duration(nil), h.delays...)
}
