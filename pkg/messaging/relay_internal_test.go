package messaging

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"reflect"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// The count of the rows that waited out an outage reads every unsent row: seconds for millions.
// The lanes ask whether the broker is down at every turn, so the count must not hold the lock
// they ask under.
func TestTheOutagesEndCountsWithoutHoldingTheLanes(t *testing.T) {
	t.Parallel()
	db := &slowCount{entered: make(chan struct{}), release: make(chan struct{})}
	r, err := NewRelay(RelayConfig{DB: db, Sender: nopSender{}, Exchange: "x", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	r.brokerDown(errors.New("test outage"))
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.brokerUp(context.Background(), time.Now())
	}()
	<-db.entered
	asked := make(chan bool)
	go func() { asked <- r.isBrokerDown() }()
	select {
	case down := <-asked:
		if down {
			t.Error("the outage is still on while its end is counted")
		}
	case <-time.After(5 * time.Second):
		t.Error("a lane waited for the count of the waiting rows")
	}
	close(db.release)
	<-done
}

// A batch that began before another lane found the broker gone, and whose confirms came in
// all the same, does not end that outage: it says nothing of the broker since. Only what began
// after the outage did, a probe or a batch, ends it.
func TestABatchBegunBeforeAnOutageDoesNotEndIt(t *testing.T) {
	t.Parallel()
	r, err := NewRelay(RelayConfig{DB: failingDB{}, Sender: nopSender{}, Exchange: "x", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	begun := time.Now().Add(-time.Millisecond) // before the outage on any clock
	r.brokerDown(errors.New("test outage"))
	r.brokerUp(context.Background(), begun)
	if !r.isBrokerDown() {
		t.Fatal("a batch begun before the outage ended it")
	}
	r.brokerUp(context.Background(), time.Now())
	if r.isBrokerDown() {
		t.Fatal("a batch begun after the outage began did not end it")
	}
}

// failingDB is a database whose every query fails at once.
type failingDB struct{ DB }

func (failingDB) Query(context.Context, string, ...any) (Rows, error) {
	return nil, errors.New("failingDB")
}

// slowCount is a database whose every query waits until released, then fails.
type slowCount struct {
	DB
	entered, release chan struct{}
}

func (d *slowCount) Query(ctx context.Context, _ string, _ ...any) (Rows, error) {
	close(d.entered)
	<-d.release
	return nil, errors.New("released")
}

type nopSender struct{}

func (nopSender) Publish(_ context.Context, msgs []Message) []error { return make([]error, len(msgs)) }

// A batch of rows that could not be read reaches no Sender, and so says nothing of the broker:
// it must not end an outage that a Sender without a probe would learn the end of only from a
// publish. Not ended, the lanes would claim rows at full pace while the broker is still gone.
func TestABatchThatReachedNoSenderDoesNotEndAnOutage(t *testing.T) {
	t.Parallel()
	db := &unreadableDB{claimedAgain: make(chan struct{})}
	sender := &countingSender{}
	r, err := NewRelay(RelayConfig{DB: db, Sender: sender, Exchange: "x", Lanes: 1, PollInterval: time.Millisecond,
		DisableNotify: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	r.brokerDown(errors.New("test outage"))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.lane(ctx, newWakeup())
	}()
	select {
	case <-db.claimedAgain: // the batch of the unreadable row is over
	case <-time.After(10 * time.Second):
		t.Error("the lane claimed no second batch")
	}
	cancel()
	<-done
	if calls, failures := sender.calls.Load(), db.failures.Load(); calls != 0 || failures != 1 {
		t.Fatalf("the Sender was called %d times and %d rows backed off, want the unreadable row backed off unsent", calls, failures)
	}
	if !r.isBrokerDown() {
		t.Fatal("a batch that reached no Sender ended the outage")
	}
}

// unreadableDB is its own transaction: its first claim finds one row whose headers are not a
// JSON object, which the relay backs off without publishing it (counted in failures); every
// later claim finds nothing, the first of them closing claimedAgain. Whatever else it is asked
// fails.
type unreadableDB struct {
	DB
	claims, failures atomic.Int32
	claimedAgain     chan struct{}
}

func (d *unreadableDB) Begin(context.Context) (TxExecutor, error) { return d, nil }
func (d *unreadableDB) Exec(_ context.Context, sql string, _ ...any) (int64, error) {
	if sql == statements.ClaimPlan {
		return 0, nil
	}
	return 0, errors.New("unreadableDB: Exec")
}
func (d *unreadableDB) Query(_ context.Context, sql string, _ ...any) (Rows, error) {
	switch sql {
	case statements.Claim:
		if n := d.claims.Add(1); n > 1 {
			if n == 2 {
				close(d.claimedAgain)
			}
			return &valueRows{}, nil
		}
		headers := `"not an object"`
		return &valueRows{rows: [][]any{{uuid.New(), "T", []byte(`{}`), "", time.Now(), 0, "", "",
			(*string)(nil), (*string)(nil), &headers}}}, nil
	case statements.RecordFailure:
		d.failures.Add(1)
		return &valueRows{rows: [][]any{{time.Now()}}}, nil
	}
	return nil, errors.New("unreadableDB: Query")
}
func (d *unreadableDB) Commit(context.Context) error   { return nil }
func (d *unreadableDB) Rollback(context.Context) error { return nil }

// valueRows returns rows, each scanned into destinations of its values' types.
type valueRows struct {
	rows [][]any
	next int
}

func (r *valueRows) Next() bool {
	r.next++
	return r.next <= len(r.rows)
}
func (r *valueRows) Scan(dest ...any) error {
	for i, v := range r.rows[r.next-1] {
		reflect.ValueOf(dest[i]).Elem().Set(reflect.ValueOf(v))
	}
	return nil
}
func (r *valueRows) Err() error { return nil }
func (r *valueRows) Close()     {}

// countingSender confirms every message, counting its calls.
type countingSender struct{ calls atomic.Int32 }

func (s *countingSender) Publish(_ context.Context, msgs []Message) []error {
	s.calls.Add(1)
	return make([]error, len(msgs))
}
