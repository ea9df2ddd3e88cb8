package messaging

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
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
		r.brokerUp(context.Background(), time.Now(), false)
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
	r.brokerUp(context.Background(), begun, false)
	if !r.isBrokerDown() {
		t.Fatal("a batch begun before the outage ended it")
	}
	r.brokerUp(context.Background(), time.Now(), false)
	if r.isBrokerDown() {
		t.Fatal("a batch begun after the outage began did not end it")
	}
}

// Nor does what began before the outage's latest failure: a probe begun during the outage
// that found the broker, its answer in only after another lane's batch failed (begun before
// the outage, or when the lane last looked), says nothing of the broker since that failure.
// Ended on it, the outage would let the lanes claim whole batches again, into a broker that
// just failed one.
func TestWhatBeganBeforeAnOutagesLatestFailureDoesNotEndIt(t *testing.T) {
	t.Parallel()
	r, err := NewRelay(RelayConfig{DB: failingDB{}, Sender: nopSender{}, Exchange: "x", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	r.brokerDown(errors.New("test outage"))
	time.Sleep(time.Millisecond) // distinct times on any clock
	probed := time.Now()
	time.Sleep(time.Millisecond)
	r.brokerDown(errors.New("another lane's batch failed"))
	r.brokerUp(context.Background(), probed, false)
	if !r.isBrokerDown() {
		t.Fatal("a probe begun before the outage's latest failure ended it")
	}
	r.brokerUp(context.Background(), time.Now(), false)
	if r.isBrokerDown() {
		t.Fatal("a probe begun after the outage's latest failure did not end it")
	}
}

func (r *Relay) isBrokerDown() bool {
	down, _ := r.outageState()
	return down
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
	failureCount
	claims       atomic.Int32
	claimedAgain chan struct{}
}

func (d *unreadableDB) Begin(context.Context) (TxExecutor, error) { return d, nil }
func (d *unreadableDB) Exec(_ context.Context, sql string, _ ...any) (int64, error) {
	if sql == statements.ClaimPlan {
		return 0, nil
	}
	return 0, errors.New("unreadableDB: Exec")
}
func (d *unreadableDB) Query(_ context.Context, sql string, args ...any) (Rows, error) {
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
	case statements.RecordFailures:
		return d.recordNow(args)
	}
	return nil, errors.New("unreadableDB: Query")
}
func (d *unreadableDB) Commit(context.Context) error   { return nil }
func (d *unreadableDB) Rollback(context.Context) error { return nil }

// failureCount counts the rows a database was told to back off.
type failureCount struct{ failures atomic.Int32 }

// recordNow counts the rows the arguments of statements.RecordFailures back off, and returns
// them, each due now.
func (c *failureCount) recordNow(args []any) (Rows, error) {
	refused, err := refusals(args)
	if err != nil {
		return nil, err
	}
	rows := &valueRows{}
	for id := range refused {
		c.failures.Add(1)
		rows.rows = append(rows.rows, []any{id, time.Now()})
	}
	return rows, nil
}

// refusals reads the arguments of statements.RecordFailures: each row's delay, by id. The ids
// listed and those of the JSON object must be the same.
func refusals(args []any) (map[uuid.UUID]time.Duration, error) {
	var byID map[string]struct {
		DelayMS int64 `json:"delay_ms"`
	}
	if err := json.Unmarshal([]byte(args[1].(string)), &byID); err != nil {
		return nil, fmt.Errorf("RecordFailures's refusals %q: %w", args[1], err)
	}
	listed := strings.Split(strings.Trim(args[0].(string), "{}"), ",")
	out := make(map[uuid.UUID]time.Duration, len(byID))
	for _, id := range listed {
		r, ok := byID[id]
		if !ok || len(listed) != len(byID) {
			return nil, fmt.Errorf("RecordFailures's ids %s and refusals %s differ", args[0], args[1])
		}
		out[uuid.MustParse(id)] = time.Duration(r.DelayMS) * time.Millisecond
	}
	return out, nil
}

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
	failureCount
	batches      [][]uuid.UUID
	start        time.Time
	claims       atomic.Int32
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
func (d *scriptedDB) Query(_ context.Context, sql string, args ...any) (Rows, error) {
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
	case statements.RecordFailures:
		return d.recordNow(args)
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

// Every row the broker refused in a batch is claimed again when its own backoff runs out, not
// only the first due: the claim at the first one's time finds only that row, and the lane that
// then forgot the others left them to the poll, an hour here. Rows A and B, refused together,
// are backed off 200 ms and 400 ms (B had failed before); both must be sent well within 1.5 s.
func TestALaneClaimsEachRefusedRowOfABatchAgainWhenItsBackoffRunsOut(t *testing.T) {
	t.Parallel()
	a, b := uuid.New(), uuid.New()
	db := &dueDB{due: map[uuid.UUID]time.Time{a: {}, b: {}}, attempts: map[uuid.UUID]int{a: 0, b: 1}}
	sender := &refusingOnce{refused: map[uuid.UUID]bool{}, sent: make(chan uuid.UUID, 2)}
	r, err := NewRelay(RelayConfig{DB: db, Sender: sender, Exchange: "x", Lanes: 1, PollInterval: time.Hour,
		Backoff: Backoff{Base: 200 * time.Millisecond, Max: time.Second, Jitter: 0.01}, DisableNotify: true,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.lane(ctx, newWakeup())
	}()
	deadline := time.After(1500 * time.Millisecond)
	pending := map[uuid.UUID]string{a: "A (backed off 200 ms)", b: "B (backed off 400 ms)"}
	for len(pending) > 0 {
		select {
		case id := <-sender.sent:
			delete(pending, id)
		case <-deadline:
			for _, row := range pending {
				t.Errorf("row %s, refused once, was not sent within 1.5 s: left to the hour's poll", row)
			}
			pending = nil
		}
	}
	cancel()
	<-done
	if n := db.failures.Load(); n != 2 {
		t.Errorf("%d refusals recorded, want 2", n)
	}
}

// dueDB is its own transaction over a table of rows: a claim returns those due by now (each
// with its attempts), a refusal backs one off by the delay it is given (counted in failures),
// and a marking removes the rows. It fails whatever else it is asked.
type dueDB struct {
	DB
	mu       sync.Mutex
	due      map[uuid.UUID]time.Time // the unsent rows, and when each is due
	attempts map[uuid.UUID]int
	failures atomic.Int32
}

func (d *dueDB) Begin(context.Context) (TxExecutor, error) { return d, nil }
func (d *dueDB) Exec(_ context.Context, sql string, args ...any) (int64, error) {
	switch sql {
	case statements.ClaimPlan:
		return 0, nil
	case statements.MarkSent:
		d.mu.Lock()
		defer d.mu.Unlock()
		for _, id := range strings.Split(strings.Trim(args[0].(string), "{}"), ",") {
			delete(d.due, uuid.MustParse(id))
		}
		return 0, nil
	}
	return 0, errors.New("dueDB: Exec")
}
func (d *dueDB) Query(_ context.Context, sql string, args ...any) (Rows, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch sql {
	case statements.Claim:
		rows, now := &valueRows{}, time.Now()
		for id, at := range d.due {
			if !at.After(now) {
				rows.rows = append(rows.rows, []any{id, "T", []byte(`{}`), "", time.Now(), d.attempts[id], "", "",
					(*string)(nil), (*string)(nil), (*string)(nil)})
			}
		}
		return rows, nil
	case statements.RecordFailures:
		refused, err := refusals(args)
		if err != nil {
			return nil, err
		}
		rows := &valueRows{}
		for id, delay := range refused {
			d.failures.Add(1)
			at := time.Now().Add(delay)
			d.due[id] = at
			d.attempts[id]++
			rows.rows = append(rows.rows, []any{id, at})
		}
		return rows, nil
	}
	return nil, errors.New("dueDB: Query")
}
func (d *dueDB) Commit(context.Context) error   { return nil }
func (d *dueDB) Rollback(context.Context) error { return nil }

// refusingOnce is a Sender that refuses each message the first time, and confirms it after,
// sending its id to sent.
type refusingOnce struct {
	mu      sync.Mutex
	refused map[uuid.UUID]bool
	sent    chan uuid.UUID
}

func (s *refusingOnce) Publish(_ context.Context, msgs []Message) []error {
	s.mu.Lock()
	defer s.mu.Unlock()
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if !s.refused[m.ID] {
			s.refused[m.ID] = true
			errs[i] = errors.New("refusingOnce: unroutable")
			continue
		}
		s.sent <- m.ID
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
// to 30 s after them, while events wait for a long poll. Nor faster than every 500 ms or so,
// however small that Max: at 10 ms the listener tried, and logged, a database away a hundred
// times a second.
func TestTheRelayListensAgainAtTheLanesPace(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		retry       Backoff
		run         time.Duration
		want        []time.Duration // the ceilings of the waits logged while it runs, the last repeated
		least, most int             // waits logged
	}{
		// 500 ms, 1 s, then 2 s (logged at 1.5 s at most): capped at BrokerRetry's default Max.
		"default": {run: 2 * time.Second, want: []time.Duration{500 * time.Millisecond, time.Second, 2 * time.Second},
			least: 3, most: 3},
		// 500 ms (400 ms at least, jittered) whatever the step: 2 or 3 in 1 s, not a hundred.
		"floor": {retry: Backoff{Base: 10 * time.Millisecond, Max: 10 * time.Millisecond}, run: time.Second,
			want: []time.Duration{500 * time.Millisecond}, least: 2, most: 3},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// A database that gives no connection: each attempt fails at once, and is logged
			// with its wait.
			delays := &retryDelays{}
			r, err := NewRelay(RelayConfig{DB: connFailingDB{}, Sender: nopSender{}, Exchange: "x", BrokerRetry: c.retry,
				Logger: slog.New(delays)})
			if err != nil {
				t.Fatal(err)
			}
			if got, want := r.listenRetry().ceiling(100), c.want[len(c.want)-1]; got != want {
				t.Fatalf("the LISTEN is attempted again after up to %s, want %s", got, want)
			}
			ctx, cancel := context.WithTimeout(context.Background(), c.run)
			defer cancel()
			r.listen(ctx, newWakeup())
			got := delays.all()
			if len(got) < c.least || len(got) > c.most {
				t.Fatalf("%d attempts to listen again in %s, want %d to %d: %v", len(got), c.run, c.least, c.most, got)
			}
			for i, d := range got {
				ceiling := c.want[min(i, len(c.want)-1)]
				if d > ceiling || d < time.Duration(float64(ceiling)*(1-DefaultJitter)) {
					t.Fatalf("attempt %d to listen again waited %s, want %s less its jitter: %v", i+1, d, ceiling, got)
				}
			}
		})
	}
}

// connFailingDB is a database that gives no connection of its own.
type connFailingDB struct{ DB }

func (connFailingDB) Conn(context.Context) (Conn, error) {
	return nil, errors.New("connFailingDB: the database is away")
}

// addDue keeps due in order, never earlier than a row's time nor later than its grain, and
// short however many rows a storm of refusals backs off: 100,000 rows refused over a minute,
// each for about five minutes, share a few dozen times.
func TestAddDueKeepsFewTimesNeverEarly(t *testing.T) {
	t.Parallel()
	start := time.Now()
	var due []time.Time
	for i := range 100_000 {
		refused := start.Add(time.Duration(i) * 600 * time.Microsecond)
		delay := 5*time.Minute - time.Duration(i%60)*time.Second // jittered below its step
		at := refused.Add(delay)
		due = addDue(due, at, delay)
		j := sort.Search(len(due), func(k int) bool { return !due[k].Before(at) })
		if j == len(due) || due[j].Sub(at) > delay/20 {
			t.Fatalf("row %d due at %v: no kept time from then to a grain later (%d kept)", i, at, len(due))
		}
		if !strings.Contains(due[j].String(), " m=") {
			t.Fatalf("kept time %v has no monotonic reading: a step of the wall clock would move it", due[j])
		}
	}
	if !slices.IsSortedFunc(due, time.Time.Compare) || len(due) > 100 {
		t.Fatalf("%d times kept for 100,000 rows (sorted: %v): want a few dozen, in order", len(due), slices.IsSortedFunc(due, time.Time.Compare))
	}
	t.Logf("%d times kept for 100,000 rows", len(due))
}

// A batch whose commit fails recorded nothing: its rows are due again, as they were, and go out
// at a later batch. Its confirms and refusals are neither counted nor logged, or
// outbox_messages_published_total would count each such row once more at its next publish, and
// an "outbox publish failed" line would report a backoff the database does not hold.
func TestABatchWhoseCommitFailsReportsNothing(t *testing.T) {
	t.Parallel()
	var logs lockedLog
	registry := prometheus.NewRegistry()
	metrics, err := NewMetrics(registry, "")
	if err != nil {
		t.Fatal(err)
	}
	db := &commitFailingDB{backlogDB: backlogDB{rows: 2}}
	r, err := NewRelay(RelayConfig{DB: db, Sender: halfRefusing{}, Exchange: "x", Metrics: metrics, Types: []string{"T"},
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.ProcessBatch(context.Background()); err == nil || !strings.Contains(err.Error(), "commit") {
		t.Fatalf("batch error %v, want the commit's", err)
	}
	if db.failures.Load() != 1 {
		t.Fatalf("%d refusals recorded before the commit, want 1: the test no longer reaches it", db.failures.Load())
	}
	for _, name := range []string{"outbox_messages_published_total", "outbox_publish_failures_total"} {
		if got, _ := sampleOf(t, registry, name, "type", "T"); got != 0 {
			t.Errorf(`%s{type="T"} = %v after a batch whose commit failed, want 0`, name, got)
		}
	}
	if n := logs.count("outbox publish failed"); n != 0 {
		t.Errorf("%d 'outbox publish failed' lines for a batch whose commit failed, want none:\n%s", n, logs.String())
	}
}

// commitFailingDB is a backlogDB whose commits fail.
type commitFailingDB struct{ backlogDB }

func (d *commitFailingDB) Begin(context.Context) (TxExecutor, error) { return d, nil }
func (d *commitFailingDB) Commit(context.Context) error {
	return errors.New("commitFailingDB: the connection was lost at the commit")
}

// halfRefusing confirms the messages at even places and refuses, unroutable, the others.
type halfRefusing struct{}

func (halfRefusing) Publish(_ context.Context, msgs []Message) []error {
	errs := make([]error, len(msgs))
	for i := 1; i < len(errs); i += 2 {
		errs[i] = ErrUnroutable
	}
	return errs
}
