package platform

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A last pass whose batch settled none of its rows, leaving them unsent without an error (a
// Publisher gives a row whose earlier publish is still pending on its connection no verdict,
// which is no outage), stops there: the next batch would claim the same rows and get the same
// verdict, and the pass, with nothing to pause it, would claim and publish them in a loop as
// fast as the database answers until ShutdownTimeout after the signal. The rows wait for the
// next start, logged. One that settled some goes on: a row refused in a way that closes the
// channel leaves the others of its window unsent, and the next batch sends them.
func TestTheLastPassStopsAtABatchThatSettledNone(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name    string
		batches []messaging.BatchResult
		want    int32    // batches made
		line    []string // the line it ends with
	}{
		{"none settled", []messaging.BatchResult{{Claimed: 2, Unsent: 2}}, 1,
			[]string{"level=WARN", "could not send the outbox's last rows before stopping", "unsent=2"}},
		{"one refused, the rest unsent", []messaging.BatchResult{{Claimed: 3, Failed: 1, Unsent: 2}, {Claimed: 2, Sent: 2}, {}}, 3,
			[]string{"level=INFO", "sent the outbox's last rows before stopping", "sent=2"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			logs := &testenv.Logs{}
			r := &scriptedRelay{batches: c.batches}
			signal, cancel := context.WithCancel(context.Background())
			cancel()
			intakeStopped := make(chan struct{})
			close(intakeStopped)
			start := time.Now()
			if err := relayUntil(signal, slog.New(slog.NewTextHandler(logs, nil)), r, intakeStopped); err != nil {
				t.Fatal(err)
			}
			if n := r.passes.Load(); n != c.want {
				t.Fatalf("the last pass made %d batches in %s, want %d", n, time.Since(start).Round(time.Millisecond), c.want)
			}
			if len(logs.Lines(c.line...)) != 1 || c.line[0] == "level=INFO" && len(logs.Lines("level=WARN")) != 0 {
				t.Errorf("want one line %q and no other warning:\n%s", c.line, logs)
			}
		})
	}
}

// scriptedRelay is a relay whose Run returns once its context ends and whose batches are
// batches, the last of them again and again; past 100 batches it fails, which ends the last
// pass.
type scriptedRelay struct {
	batches []messaging.BatchResult
	passes  atomic.Int32
}

func (r *scriptedRelay) Run(ctx context.Context) error {
	<-ctx.Done()
	return nil
}

func (r *scriptedRelay) ProcessBatch(context.Context) (messaging.BatchResult, error) {
	n := int(r.passes.Add(1))
	if n > 100 {
		return messaging.BatchResult{}, errors.New("scriptedRelay: too many batches")
	}
	return r.batches[min(n, len(r.batches))-1], nil
}
