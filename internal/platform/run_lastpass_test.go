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

// A last pass whose batch left rows unsent without an error (a Publisher gives a row whose
// earlier publish is still pending on its connection no verdict, which is no outage) stops
// there: the next batch would claim the same rows and get the same verdict, and the pass, with
// nothing to pause it, would claim and publish them in a loop as fast as the database answers
// until ShutdownTimeout after the signal. The rows wait for the next start, logged.
func TestTheLastPassStopsAtABatchThatLeftRowsUnsent(t *testing.T) {
	t.Parallel()
	logs := &testenv.Logs{}
	r := &unsentRelay{}
	signal, cancel := context.WithCancel(context.Background())
	cancel()
	intakeStopped := make(chan struct{})
	close(intakeStopped)
	start := time.Now()
	if err := relayUntil(signal, slog.New(slog.NewTextHandler(logs, nil)), r, intakeStopped); err != nil {
		t.Fatal(err)
	}
	if n := r.passes.Load(); n != 1 {
		t.Fatalf("the last pass made %d batches in %s after one that left its rows unsent, want 1",
			n, time.Since(start).Round(time.Millisecond))
	}
	if len(logs.Lines("level=WARN", "could not send the outbox's last rows before stopping", "unsent=2")) != 1 {
		t.Errorf("the rows left unsent were not logged:\n%s", logs)
	}
}

// unsentRelay is a relay whose Run returns once its context ends and whose every batch claims
// two rows and leaves them unsent, with no error; past 100 batches it fails, which ends the
// last pass.
type unsentRelay struct{ passes atomic.Int32 }

func (r *unsentRelay) Run(ctx context.Context) error {
	<-ctx.Done()
	return nil
}

func (r *unsentRelay) ProcessBatch(context.Context) (messaging.BatchResult, error) {
	if r.passes.Add(1) > 100 {
		return messaging.BatchResult{}, errors.New("unsentRelay: too many batches")
	}
	return messaging.BatchResult{Claimed: 2, Unsent: 2}, nil
}
