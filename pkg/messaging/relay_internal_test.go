package messaging

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

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

// A lane whose batch failed (the database away) tries again at BrokerRetry's pace (100 ms
// doubling to 2 s), whatever the poll: at a 10 ms poll it does not retry, and log, a database
// away about a hundred times a second; at an hour's it does not wait the hour, deaf to wakes,
// while the database is back.
func TestALaneWhoseBatchFailedRetriesAtTheBrokersPace(t *testing.T) {
	t.Parallel()
	for _, poll := range []time.Duration{10 * time.Millisecond, time.Hour} {
		t.Run(poll.String(), func(t *testing.T) {
			t.Parallel()
			db := &beginFailingDB{}
			r, err := NewRelay(RelayConfig{DB: db, Sender: nopSender{}, Exchange: "x", Lanes: 1, PollInterval: poll,
				DisableNotify: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			if err != nil {
				t.Fatal(err)
			}
			// 100, 200, 400, 800 ms then 1.6 s, each jittered below its step: the 5th batch
			// begins within 1.5 s, the 7th not before 4.1 s.
			ctx, cancel := context.WithTimeout(context.Background(), 2500*time.Millisecond)
			defer cancel()
			if err := r.Run(ctx); err != nil {
				t.Fatal(err)
			}
			if n := db.begins.Load(); n < 2 || n > 12 {
				t.Fatalf("%d batches began in 2.5 s of a database away, want 2 to 12: the pace of BrokerRetry (about 6)", n)
			}
		})
	}
}

// beginFailingDB is a database that cannot begin a transaction, counting the attempts.
type beginFailingDB struct {
	DB
	begins atomic.Int32
}

func (d *beginFailingDB) Begin(context.Context) (TxExecutor, error) {
	d.begins.Add(1)
	return nil, errors.New("beginFailingDB: the database is away")
}

// A row the broker refused is claimed again when its backoff runs out, not at the next poll:
// nothing NOTIFYs then. Nor does a wake taken meanwhile, for a batch of other rows, leave it to
// the poll: here the lane is woken at once after the refusal, sends another row, and must still
// come back for the refused one within its backoff, not the hour's poll.
func TestALaneClaimsARefusedRowAgainWhenItsBackoffRunsOut(t *testing.T) {
	t.Parallel()
	refused, other := uuid.New(), uuid.New()
	db := &scriptedDB{batches: [][]uuid.UUID{{refused}, {other}}, claimedAfter: make(chan time.Duration, 1)}
	sender := refusing{refused: refused}
	backoff := 300 * time.Millisecond
	r, err := NewRelay(RelayConfig{DB: db, Sender: sender, Exchange: "x", Lanes: 1, PollInterval: time.Hour,
		Backoff: Backoff{Base: backoff, Max: backoff}, DisableNotify: true,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	wake := newWakeup()
	wake.signal() // a NOTIFY, taken at the wait after the refusal
	db.start = time.Now()
	go func() {
		defer close(done)
		r.lane(ctx, wake)
	}()
	select {
	case after := <-db.claimedAfter:
		if after < time.Duration(float64(backoff)*(1-DefaultJitter))-10*time.Millisecond {
			t.Errorf("the third claim came %s after the first, before the refused row's backoff of %s ran out", after, backoff)
		}
	case <-time.After(5 * time.Second):
		t.Error("the lane did not claim again within 5 s of a refusal backed off 300 ms")
	}
	cancel()
	<-done
	if n := db.failures.Load(); n != 1 {
		t.Errorf("%d refusals recorded, want 1", n)
	}
}

// scriptedDB is its own transaction: its claims return the rows of batches in turn, then none;
// the first claim after them sends the time since start to claimedAfter. It records a refusal
// (counted in failures) and a marking, and fails whatever else it is asked.
type scriptedDB struct {
	DB
	batches      [][]uuid.UUID
	start        time.Time
	claims       atomic.Int32
	failures     atomic.Int32
	claimedAfter chan time.Duration
}

func (d *scriptedDB) Begin(context.Context) (TxExecutor, error) { return d, nil }
func (d *scriptedDB) Exec(_ context.Context, sql string, _ ...any) (int64, error) {
	switch sql {
	case statements.ClaimPlan, statements.MarkSent:
		return 0, nil
	}
	return 0, errors.New("scriptedDB: Exec")
}
func (d *scriptedDB) Query(_ context.Context, sql string, _ ...any) (Rows, error) {
	switch sql {
	case statements.Claim:
		n := int(d.claims.Add(1))
		if n > len(d.batches) {
			if n == len(d.batches)+1 {
				d.claimedAfter <- time.Since(d.start)
			}
			return &valueRows{}, nil
		}
		rows := &valueRows{}
		for _, id := range d.batches[n-1] {
			rows.rows = append(rows.rows, []any{id, "T", []byte(`{}`), "", time.Now(), 0, "", "",
				(*string)(nil), (*string)(nil), (*string)(nil)})
		}
		return rows, nil
	case statements.RecordFailure:
		d.failures.Add(1)
		return &valueRows{rows: [][]any{{time.Now()}}}, nil
	}
	return nil, errors.New("scriptedDB: Query")
}
func (d *scriptedDB) Commit(context.Context) error   { return nil }
func (d *scriptedDB) Rollback(context.Context) error { return nil }

// refusing is a Sender that refuses the message refused, and confirms the others.
type refusing struct{ refused uuid.UUID }

func (s refusing) Publish(_ context.Context, msgs []Message) []error {
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if m.ID == s.refused {
			errs[i] = errors.New("refusing: unroutable")
		}
	}
	return errs
}

// A relay stopped while its first look for the broker runs reports no outage: the look failed
// for the stop, not the broker. It logged "broker unavailable; relay paused" and dropped
// outbox_relay_broker_up to 0 at every shutdown during a slow dial.
func TestARelayStoppedDuringItsFirstConnectReportsNoOutage(t *testing.T) {
	t.Parallel()
	for name, connectErr := range map[string]func(context.Context) error{
		"the context's error": func(ctx context.Context) error { return ctx.Err() },
		"an outage's error": func(ctx context.Context) error {
			return fmt.Errorf("%w: dial: %w", ErrBrokerUnavailable, ctx.Err())
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var logs bytes.Buffer
			registry := prometheus.NewRegistry()
			metrics, err := NewMetrics(registry, "")
			if err != nil {
				t.Fatal(err)
			}
			sender := &dialingSender{dialing: make(chan struct{}), err: connectErr}
			r, err := NewRelay(RelayConfig{DB: failingDB{}, Sender: sender, Exchange: "x", DisableNotify: true,
				Metrics: metrics, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- r.Run(ctx) }()
			<-sender.dialing
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("Run stopped during its first Connect returned %v, want nil", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("Run did not return within 5 s of its context's end")
			}
			if strings.Contains(logs.String(), "level=WARN") || strings.Contains(logs.String(), "broker unavailable") {
				t.Errorf("a stop during the first Connect was logged as an outage:\n%s", logs.String())
			}
			if r.isBrokerDown() {
				t.Error("a stop during the first Connect started an outage")
			}
			families, err := registry.Gather()
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range families {
				if f.GetName() != "outbox_relay_broker_up" {
					continue
				}
				for _, m := range f.GetMetric() {
					if m.GetGauge().GetValue() == 0 {
						t.Errorf("outbox_relay_broker_up dropped to 0 by a stop during the first Connect: %v", m)
					}
				}
			}
		})
	}
}

// dialingSender is a Sender with a probe whose Connect dials until its context ends, then
// returns err's error for it; dialing is closed once it dials.
type dialingSender struct {
	nopSender
	dialing chan struct{}
	err     func(context.Context) error
}

func (s *dialingSender) Connect(ctx context.Context) error {
	close(s.dialing)
	<-ctx.Done()
	return s.err(ctx)
}

// The relay's LISTEN is attempted again no slower than the lanes retry a failed batch
// (BrokerRetry's Max): after a long database outage, the wakes are back with the lanes, not up
// to 30 s after them, while events wait for a long poll.
func TestTheRelayListensAgainAtTheLanesPace(t *testing.T) {
	t.Parallel()
	def, err := NewRelay(RelayConfig{DB: failingDB{}, Sender: nopSender{}, Exchange: "x"})
	if err != nil {
		t.Fatal(err)
	}
	if c, want := def.listenRetry().ceiling(100), def.cfg.BrokerRetry.Max; c > want || want > 2*time.Second {
		t.Fatalf("by default the LISTEN is attempted again after up to %s, want at most BrokerRetry's Max, %s (2 s)", c, want)
	}
	// A database that gives no connection: each attempt fails at once, and is logged with its wait.
	delays := &retryDelays{}
	retry := Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond}
	r, err := NewRelay(RelayConfig{DB: connFailingDB{}, Sender: nopSender{}, Exchange: "x", BrokerRetry: retry, Logger: slog.New(delays)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	r.listen(ctx, newWakeup())
	got := delays.all()
	if len(got) < 5 {
		t.Fatalf("%d attempts to listen again in 1 s, want at least 5 at BrokerRetry's pace (at most %s): %v", len(got), retry.Max, got)
	}
	for _, d := range got {
		if d > retry.Max {
			t.Fatalf("an attempt to listen again waited %s, longer than BrokerRetry's Max of %s: %v", d, retry.Max, got)
		}
	}
}

// connFailingDB is a database that gives no connection of its own.
type connFailingDB struct{ DB }

func (connFailingDB) Conn(context.Context) (Conn, error) {
	return nil, errors.New("connFailingDB: the database is away")
}
