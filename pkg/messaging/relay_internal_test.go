package messaging

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"
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
