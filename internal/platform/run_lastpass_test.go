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
			if err := relayUntil(signal, slog.New(slog.NewTextHandler(logs, nil)), r, intakeStopped, ShutdownTimeout); err != nil {
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

// A last pass whose batch outlives its context by seconds (a Relay's waits ShutdownGrace, 5 s,
// past it for its confirms, as for a dial to a broker that accepts the connection and never
// answers) does not hold the stop past the pass's bound, ShutdownTimeout after the signal in
// a service, nor, so, until the hard stop: relayUntil returns at the bound, saying the batch
// was left, and the batch's context says it is cut off (see cutSender), so that a Relay's
// publish ends then and the batch records what it has, before the pools close.
func TestTheLastPassEndsAtItsBoundWhateverItsBatchDoes(t *testing.T) {
	t.Parallel()
	logs := &testenv.Logs{}
	r := &stuckRelay{hold: 5 * time.Second, cut: make(chan time.Time, 1), release: make(chan struct{})}
	t.Cleanup(func() { close(r.release) })
	signal, cancel := context.WithCancel(context.Background())
	intakeStopped := make(chan struct{})
	close(intakeStopped)
	const bound = 500 * time.Millisecond
	signalled := time.Now()
	cancel()
	if err := relayUntil(signal, slog.New(slog.NewTextHandler(logs, nil)), r, intakeStopped, bound); err != nil {
		t.Fatal(err)
	}
	// The margin is a busy machine's timer latency under -race.
	if took := time.Since(signalled); took < bound || took > bound+400*time.Millisecond {
		t.Fatalf("relayUntil returned %s after the signal, its last batch still running; want at its bound, %s", took.Round(time.Millisecond), bound)
	}
	select {
	case at := <-r.cut:
		if d := at.Sub(signalled); d < bound || d > bound+400*time.Millisecond {
			t.Errorf("the batch's publish was cut off %s after the signal, want at the bound, %s", d.Round(time.Millisecond), bound)
		}
	case <-time.After(time.Second):
		t.Error("the batch's context did not say it was cut off")
	}
	if len(logs.Lines("level=WARN", "the outbox's last batch was still running at the shutdown deadline")) != 1 || len(logs.Lines("level=ERROR")) != 0 {
		t.Errorf("want one warning that the last batch was left, and no error:\n%s", logs)
	}
}

// stuckRelay is a relay whose Run returns once its context ends and whose batch goes on for
// hold whatever its context does (or until release closes), reporting on cut when the cut
// its context carries (see relayCut) ends.
type stuckRelay struct {
	hold    time.Duration
	cut     chan time.Time
	release chan struct{}
}

func (r *stuckRelay) Run(ctx context.Context) error {
	<-ctx.Done()
	return nil
}

func (r *stuckRelay) ProcessBatch(ctx context.Context) (messaging.BatchResult, error) {
	if cut, ok := ctx.Value(relayCutKey{}).(context.Context); ok {
		context.AfterFunc(cut, func() { r.cut <- time.Now() })
	}
	select {
	case <-time.After(r.hold):
	case <-r.release:
	}
	return messaging.BatchResult{Claimed: 1, Sent: 1}, nil
}

// A relay whose intake is still running at the cut (a consumer's Run may take up to 8 s after
// the signal too) stops there: its publishes are cut off then, and a lane still running would
// take that for a broker outage, logging it and setting outbox_relay_broker_up to 0.
func TestTheRelayStopsAtTheCutThoughTheIntakeRuns(t *testing.T) {
	t.Parallel()
	r := &scriptedRelay{}
	signal, cancel := context.WithCancel(context.Background())
	cancel()
	const within = 200 * time.Millisecond
	returned := make(chan error, 1)
	go func() { returned <- relayUntil(signal, slog.New(slog.DiscardHandler), r, make(chan struct{}), within) }()
	select {
	case err := <-returned:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * within):
		t.Fatalf("the relay still ran %s after the signal, %s past its cut, its intake running", 10*within, 9*within)
	}
}
