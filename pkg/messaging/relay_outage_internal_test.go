package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// An outage that a probe cannot see (the broker took the messages and confirmed none in time: a
// quorum queue without a majority; or closed the channel for a reason of no known message) is
// one outage, logged once, until the broker gives a verdict. The probe that dials a new
// connection, which works, does not end it: it ended it, and the lanes claimed and published
// whole batches again, every ConfirmTimeout, for ever, with a line at each end. Meanwhile one
// lane at a time tries one row, the tries spaced out at BrokerRetry's pace; a verdict ends the
// outage, once, and the whole batches resume.
func TestAnOutageTheProbeCannotSeeEndsOnlyWithAVerdict(t *testing.T) {
	t.Parallel()
	retry := Backoff{Base: 100 * time.Millisecond, Max: 800 * time.Millisecond, Jitter: 0.01}
	const backlog = 50
	sender := &unconfirmingSender{}
	logs := &lockedLog{}
	r, err := NewRelay(RelayConfig{DB: &backlogDB{rows: backlog}, Sender: sender, Exchange: "x", Lanes: 2,
		PollInterval: time.Hour, DisableNotify: true, BrokerRetry: retry, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()

	// A lane publishes the backlog's head, and times out; so does the other, unless it comes
	// in after the outage began. Then the tries: BrokerRetry after the failures so far (the
	// lanes' batches and the tries before), 100 ms doubling to 800 ms.
	const tries = 5
	eventually(t, func() bool { return len(sender.calls()) >= 2+tries },
		"fewer publishes than the lanes' batches and %d tries", tries)
	calls := sender.calls()
	batches := 0
	for batches < len(calls) && calls[batches].size() == backlog {
		batches++
	}
	if batches < 1 || batches > 2 {
		t.Fatalf("%d whole batches before the tries, want one per lane at most, and one at least: %v", batches, calls)
	}
	for i, c := range calls[batches:] {
		if c.size() != trialBatch {
			t.Errorf("try %d took %d rows, want %d: %v", i+1, c.size(), trialBatch, calls)
		}
	}
	for i := batches; i < len(calls); i++ {
		failures := i // the batches and tries before this one
		gap := calls[i].at.Sub(calls[i-1].at)
		if least := time.Duration(float64(retry.ceiling(failures)) * (1 - retry.Jitter)); gap < least {
			t.Errorf("publish %d came %s after the one before, want at least %s (BrokerRetry after %d failures)", i+1, gap, least, failures)
		}
	}
	if n := logs.count(`msg="broker unavailable;`); n != 1 {
		t.Errorf("%d lines begin the outage, want 1:\n%s", n, logs)
	}
	if n := logs.count(`msg="broker available again`); n != 0 {
		t.Errorf("%d lines end the outage while nothing was confirmed, want 0", n)
	}
	if !r.isBrokerDown() {
		t.Error("the outage is over while nothing was confirmed")
	}

	sender.answerWith(nil)
	eventually(t, func() bool {
		calls := sender.calls()
		return calls[len(calls)-1].size() == backlog
	}, "the lanes do not publish whole batches again once the broker confirms")
	if n := logs.count(`msg="broker available again`); n != 1 {
		t.Errorf("%d lines end the outage, want 1:\n%s", n, logs)
	}
	if n := logs.count(`msg="broker unavailable;`); n != 1 {
		t.Errorf("%d lines begin an outage, want 1:\n%s", n, logs)
	}
}

// eventually fails t unless cond holds within 10 s, polling it.
func eventually(t *testing.T, cond func() bool, format string, args ...any) {
	t.Helper()
	const timeout = 10 * time.Second
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after %s: "+format, append([]any{timeout}, args...)...)
		}
	}
}

// lockedLog is a log's text, written to by every lane.
type lockedLog struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// count counts the lines that hold text.
func (l *lockedLog) count(text string) int { return strings.Count(l.String(), text) }

// Nothing but a verdict ends such an outage: not a probe that found a connection, nor a batch
// the Sender took and gave no verdict on (its rows unsent for a reason that is no outage, say
// an earlier publish of the same row still in flight).
func TestOnlyAVerdictEndsAnOutageTheProbeCannotSee(t *testing.T) {
	t.Parallel()
	r, err := NewRelay(RelayConfig{DB: failingDB{}, Sender: nopSender{}, Exchange: "x", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	r.brokerDown(unavailable("no confirm within 15s: %w", errUnconfirmed))
	r.brokerDown(unavailable("dial: connection refused")) // still one the probe cannot see
	r.brokerUp(context.Background(), time.Now(), false)
	if !r.isBrokerDown() {
		t.Fatal("an outage the probe cannot see ended without a verdict")
	}
	r.brokerUp(context.Background(), time.Now(), true)
	if r.isBrokerDown() {
		t.Fatal("a verdict did not end the outage")
	}
	r.brokerDown(unavailable("dial: connection refused"))
	r.brokerUp(context.Background(), time.Now(), false)
	if r.isBrokerDown() {
		t.Fatal("the probe did not end an outage it can see, after a silent one ended")
	}
}

// unconfirmingSender is a Sender whose Connect always succeeds, and whose Publish gives no
// verdict, as a Publisher does when no confirm comes in time on a connection that stays up,
// until answerWith is called: then every message gets that verdict. It records its calls.
type unconfirmingSender struct {
	answer atomic.Pointer[error]
	mu     sync.Mutex
	all    []publishCall
}

type publishCall struct {
	at  time.Time
	ids []uuid.UUID
}

func (c publishCall) size() int { return len(c.ids) }

func (s *unconfirmingSender) Connect(context.Context) error { return nil }

func (s *unconfirmingSender) Publish(_ context.Context, msgs []Message) []error {
	call := publishCall{at: time.Now()}
	for _, m := range msgs {
		call.ids = append(call.ids, m.ID)
	}
	s.mu.Lock()
	s.all = append(s.all, call)
	s.mu.Unlock()
	verdict := unavailable("no confirm within 15s: %w: %w", context.DeadlineExceeded, errUnconfirmed)
	if answer := s.answer.Load(); answer != nil {
		verdict = *answer
	}
	errs := make([]error, len(msgs))
	fill(errs, verdict)
	return errs
}

// answerWith has the broker answer every message from now on with verdict.
func (s *unconfirmingSender) answerWith(verdict error) { s.answer.Store(&verdict) }

func (s *unconfirmingSender) calls() []publishCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]publishCall(nil), s.all...)
}

// backlogDB is its own transaction over a backlog of rows that never shrinks: each claim
// returns as many as it asks for, up to rows, each to exchange with routingKey (nil: none).
// Markings and backoffs succeed; whatever else it is asked fails.
type backlogDB struct {
	DB
	failureCount
	rows                 int
	exchange, routingKey *string
}

func (d *backlogDB) Begin(context.Context) (TxExecutor, error) { return d, nil }
func (d *backlogDB) Exec(_ context.Context, sql string, _ ...any) (int64, error) {
	switch sql {
	case statements.ClaimPlan, statements.MarkSent:
		return 0, nil
	}
	return 0, errors.New("backlogDB: Exec")
}
func (d *backlogDB) Query(_ context.Context, sql string, args ...any) (Rows, error) {
	switch sql {
	case statements.RecordFailures:
		return d.recordNow(args)
	case statements.Claim:
	default:
		return nil, fmt.Errorf("backlogDB: Query %.30q", sql)
	}
	rows := &valueRows{}
	for range min(args[0].(int), d.rows) {
		rows.rows = append(rows.rows, []any{uuid.New(), "T", []byte(`{}`), "", time.Now(), 0, "", "",
			d.exchange, d.routingKey, (*string)(nil)})
	}
	return rows, nil
}
func (d *backlogDB) Commit(context.Context) error   { return nil }
func (d *backlogDB) Rollback(context.Context) error { return nil }

// The relay bounds a batch's transaction by its Sender's PublishTimeout, and idleMargin: the
// claim tells the database to end the transaction when it sits idle longer (in milliseconds,
// as text). Without the method, it sets nothing, and claims as it always did.
func TestTheClaimBoundsTheTransactionByThePublishTimeout(t *testing.T) {
	t.Parallel()
	p := NewPublisher(PublisherConfig{URL: "amqp://localhost/", ConfirmTimeout: 2 * time.Second, MaxInFlight: 300})
	for name, c := range map[string]struct {
		sender Sender
		want   []any
	}{
		// 500 rows are two windows of 300 at most, each 2 s and its overrun.
		"a Publisher":            {sender: p, want: []any{500, fmt.Sprint((2*(2*time.Second+windowOverrun) + idleMargin).Milliseconds())}},
		"a Sender without bound": {sender: nopSender{}, want: []any{500}},
		"a timeout of 0":         {sender: boundedSender(0), want: []any{500}},
		"a timeout too long":     {sender: boundedSender(math.MaxInt64), want: []any{500, "2147483647"}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := &claimArgsDB{}
			r, err := NewRelay(RelayConfig{DB: db, Sender: c.sender, Exchange: "x", Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := r.ProcessBatch(context.Background()); err != nil {
				t.Fatal(err)
			}
			want := statements.Claim
			if len(c.want) > 1 {
				want = statements.ClaimBounded
			}
			if db.sql != want || fmt.Sprint(db.args) != fmt.Sprint(c.want) {
				t.Errorf("claimed with %q %v, want %q %v", boundLine(db.sql), db.args, boundLine(want), c.want)
			}
		})
	}
}

// claimArgsDB is its own transaction, whose claim finds nothing and records its statement
// and arguments.
type claimArgsDB struct {
	DB
	sql  string
	args []any
}

func (d *claimArgsDB) Begin(context.Context) (TxExecutor, error) { return d, nil }
func (d *claimArgsDB) Exec(context.Context, string, ...any) (int64, error) {
	return 0, nil
}
func (d *claimArgsDB) Query(_ context.Context, sql string, args ...any) (Rows, error) {
	d.sql, d.args = sql, args
	return &valueRows{}, nil
}
func (d *claimArgsDB) Commit(context.Context) error   { return nil }
func (d *claimArgsDB) Rollback(context.Context) error { return nil }

// boundLine is a claim's fourth line: where Claim and ClaimBounded differ.
func boundLine(sql string) string {
	lines := strings.Split(sql, "\n")
	return lines[min(4, len(lines))-1]
}

// The rows the broker refused in a batch are backed off in one statement, each with its own
// error and delay: it was one statement, one round trip, per row, all in the batch's
// transaction, its locks held meanwhile (500 round trips for a batch of a type no queue takes).
func TestABatchsRefusalsAreRecordedInOneStatement(t *testing.T) {
	t.Parallel()
	db := &refusalsDB{backlogDB: backlogDB{rows: 500}}
	r, err := NewRelay(RelayConfig{DB: db, Sender: refusingAll{}, Exchange: "x", Logger: slog.New(slog.DiscardHandler),
		Backoff: Backoff{Base: time.Second, Max: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.ProcessBatch(context.Background())
	if err != nil || res.Failed != 500 {
		t.Fatalf("batch = %+v, %v; want 500 rows refused", res, err)
	}
	if len(db.calls) != 1 || len(db.calls[0]) != 500 {
		t.Fatalf("the refusals were recorded in %d statements, want 500 rows in one", len(db.calls))
	}
	for id, delay := range db.calls[0] {
		if delay < 800*time.Millisecond || delay > time.Second {
			t.Fatalf("row %s backed off %s, want its first attempt's, 1 s less jitter", id, delay)
		}
	}
}

// refusingAll is a broker that refuses every message.
type refusingAll struct{}

func (refusingAll) Publish(_ context.Context, msgs []Message) []error {
	errs := make([]error, len(msgs))
	fill(errs, ErrUnroutable)
	return errs
}

// refusalsDB is a backlogDB that records each RecordFailures statement's refusals, and
// returns its rows.
type refusalsDB struct {
	backlogDB
	calls []map[uuid.UUID]time.Duration
}

func (d *refusalsDB) Begin(context.Context) (TxExecutor, error) { return d, nil }
func (d *refusalsDB) Query(ctx context.Context, sql string, args ...any) (Rows, error) {
	if sql != statements.RecordFailures {
		return d.backlogDB.Query(ctx, sql, args...)
	}
	refused, err := refusals(args)
	if err != nil {
		return nil, err
	}
	d.calls = append(d.calls, refused)
	rows := &valueRows{}
	for id, delay := range refused {
		rows.rows = append(rows.rows, []any{id, time.Now().Add(delay)})
	}
	return rows, nil
}

// boundedSender is nopSender with a PublishTimeout of its own, whatever the batch.
type boundedSender time.Duration

func (boundedSender) Publish(_ context.Context, msgs []Message) []error {
	return make([]error, len(msgs))
}
func (b boundedSender) PublishTimeout(int) time.Duration { return time.Duration(b) }

// The bound of a batch's transaction is the Sender's PublishTimeout and idleMargin; none for a
// Sender without the method, or whose timeout is 0 or less (a bound of 5 s, or less, would end
// every batch that waits for its confirms longer); and no more than the longest
// idle_in_transaction_session_timeout PostgreSQL takes (an int of milliseconds), which it
// would refuse, failing every claim.
func TestTheIdleBoundIsThePublishTimeoutAndTheMarginWithinPostgreSQLsRange(t *testing.T) {
	t.Parallel()
	p := NewPublisher(PublisherConfig{URL: "amqp://localhost/", ConfirmTimeout: 2 * time.Second, MaxInFlight: 300})
	for _, c := range []struct {
		name   string
		sender Sender
		want   time.Duration
	}{
		{"a Publisher, 500 rows in two windows", p, 2*(2*time.Second+windowOverrun) + idleMargin},
		{"a Sender without the method", nopSender{}, 0},
		{"a timeout of 0", boundedSender(0), 0},
		{"a negative timeout", boundedSender(-time.Second), 0},
		{"a timeout of 1 ns", boundedSender(1), idleMargin + 1},
		{"the longest within range", boundedSender(maxIdleBound - idleMargin - time.Millisecond), maxIdleBound - time.Millisecond},
		{"the longest, exactly", boundedSender(maxIdleBound - idleMargin), maxIdleBound},
		{"a timeout beyond range", boundedSender(maxIdleBound), maxIdleBound},
		{"the longest duration", boundedSender(math.MaxInt64), maxIdleBound},
	} {
		if got := idleBoundOf(c.sender, 500); got != c.want {
			t.Errorf("%s: bound %s, want %s", c.name, got, c.want)
		}
	}
	if maxIdleBound.Milliseconds() != 2147483647 {
		t.Errorf("the longest bound is %d ms, want PostgreSQL's INT_MAX", maxIdleBound.Milliseconds())
	}
}

// Only the broker's answer to a publish says that it confirms again: a confirm, a nack, a
// return, or the reason it closed the channel for the message; not a verdict of a check made
// before the publish, the same error or not.
func TestOnlyTheBrokersAnswerToAPublishCounts(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		verdict error
		want    bool
	}{
		{nil, true},
		{ErrNacked, true},
		{fmt.Errorf("%w: exchange %q routing key %q: 312 NO_ROUTE", ErrUnroutable, "x", "k"), true},
		{closedFor{fmt.Errorf("%w: 20 bytes, the broker's limit is 10", ErrTooLarge)}, true},
		{fmt.Errorf("wrapped: %w", closedFor{fmt.Errorf("%w: exchange %q", ErrAccessRefused, "x")}), true},
		{fmt.Errorf("%w: 20 bytes, the limit is 10", ErrTooLarge), false},
		{fmt.Errorf("%w: a header name over 255 bytes", ErrInvalidEnvelope), false},
		{fmt.Errorf("%w: %q", ErrNoExchange, "x"), false},
		{fmt.Errorf("%w: exchange %q: refused", ErrAccessRefused, "x"), false},
		{unavailable("no confirm within 15s: %w", errUnconfirmed), false},
		{unavailable("another message's refusal: %w", errNotAnOutage), false},
	} {
		if got := brokerAnswered(c.verdict); got != c.want {
			t.Errorf("brokerAnswered(%v) = %t, want %t", c.verdict, got, c.want)
		}
	}
}

// A trial whose row gets a verdict of a check made before the publish (too large for
// MaxMessageBytes) heard nothing from the broker: the outage goes on, one row at a time, each
// such row backed off. It ended it, and the lanes published whole batches, which the broker
// confirmed nothing of again, and the outage began once more: logged at each end, every few
// seconds. A verdict the broker gave (the reason it closed the channel for the row) ends it.
func TestATrialRowRefusedBeforeItsPublishDoesNotEndTheOutage(t *testing.T) {
	t.Parallel()
	sender := &unconfirmingSender{}
	logs := &lockedLog{}
	db := &backlogDB{rows: 50}
	r, err := NewRelay(RelayConfig{DB: db, Sender: sender, Exchange: "x", Lanes: 2,
		PollInterval: time.Hour, DisableNotify: true, BrokerRetry: Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	stop := runRelay(t, r)
	defer stop()
	eventually(t, func() bool {
		calls := sender.calls()
		return len(calls) > 0 && calls[len(calls)-1].size() == trialBatch
	}, "no trial began")

	sender.answerWith(fmt.Errorf("%w: 2000000 bytes, the limit is 1048576", ErrTooLarge))
	before := len(sender.calls())
	eventually(t, func() bool { return db.failures.Load() >= 5 }, "fewer than 5 trial rows backed off")
	for i, c := range sender.calls()[before+1:] { // the call under way at the switch may be any
		if c.size() != trialBatch {
			t.Fatalf("publish %d after the rows were refused before their publish took %d rows, want a trial's %d", before+1+i, c.size(), trialBatch)
		}
	}
	if !r.isBrokerDown() || logs.count(`msg="broker available again`) != 0 {
		t.Fatalf("a row refused before its publish ended the outage:\n%s", logs)
	}

	sender.answerWith(closedFor{fmt.Errorf("%w: 2000000 bytes, the broker's limit is 1048576", ErrTooLarge)})
	eventually(t, func() bool { return !r.isBrokerDown() }, "the broker's own verdict did not end the outage")
	if n := logs.count(`msg="broker available again`); n != 1 {
		t.Errorf("%d lines end the outage, want 1:\n%s", n, logs)
	}
}

// runRelay runs r until the returned function is called, which checks that Run returned nil.
func runRelay(t *testing.T, r *Relay) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	return func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
}

// The row of a failed trial is logged, at warn level, once an outage: its id, its exchange and
// its routing key. Every trial claims the oldest due row again, and if the broker cannot
// confirm that row (its quorum queue lost its majority), no row moves, whatever its queue,
// until the row is parked: the line says which.
func TestAFailedTrialsRowIsLoggedOnceAnOutage(t *testing.T) {
	t.Parallel()
	sender := &unconfirmingSender{}
	logs := &lockedLog{}
	exchange, key := "billing", "invoice.due"
	r, err := NewRelay(RelayConfig{DB: &backlogDB{rows: 50, exchange: &exchange, routingKey: &key}, Sender: sender, Exchange: "x",
		Lanes: 2, PollInterval: 20 * time.Millisecond, DisableNotify: true, BrokerRetry: Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	stop := runRelay(t, r)
	defer stop()
	const line = `level=WARN msg="the broker confirms nothing of the row the relay tries`
	firstTrial := func(calls []publishCall) (uuid.UUID, int) {
		for i, c := range calls {
			if c.size() == trialBatch {
				return c.ids[0], i
			}
		}
		return uuid.Nil, -1
	}
	const tries = 4
	eventually(t, func() bool {
		_, i := firstTrial(sender.calls())
		return i >= 0 && len(sender.calls()) >= i+tries
	}, "fewer than %d trials", tries)
	id, _ := firstTrial(sender.calls())
	lines := logs.lines(line)
	if len(lines) != 1 {
		t.Fatalf("%d lines name a failed trial's row after %d trials, want 1:\n%s", len(lines), tries, logs)
	}
	for _, want := range []string{"message_id=" + id.String(), "message_exchange=" + exchange, "routing_key=" + key, "outboxctl outbox park"} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("the line of the failed trial does not say %s: %s", want, lines[0])
		}
	}

	// A new outage, which a poll finds, logs its own.
	sender.answerWith(nil)
	eventually(t, func() bool { return !r.isBrokerDown() }, "the outage did not end")
	sender.answerWith(unavailable("no confirm within 15s: %w", errUnconfirmed))
	eventually(t, func() bool { return len(logs.lines(line)) == 2 }, "the next outage's failed trial did not log its row:\n%s", logs)
}

// lines are the lines that hold text.
func (l *lockedLog) lines(text string) []string {
	var out []string
	for line := range strings.Lines(l.String()) {
		if strings.Contains(line, text) {
			out = append(out, line)
		}
	}
	return out
}

// An outage the probe cannot see ends when a trial finds no row due: none is held back, none is
// left to confirm. With the row the broker confirmed nothing of parked, and nothing else due,
// every trial claimed nothing, which never ended it: outbox_relay_broker_up stayed at 0, and
// BrokerUnavailable fired, until the next row was enqueued and confirmed.
func TestATrialThatFindsNoRowDueEndsTheOutage(t *testing.T) {
	t.Parallel()
	registry := prometheus.NewRegistry()
	metrics, err := NewMetrics(registry, "")
	if err != nil {
		t.Fatal(err)
	}
	db := &emptyingDB{backlogDB: backlogDB{rows: 50}}
	r, logs := runSilentOutage(t, db, metrics)
	if up := brokerUpGauge(t, registry); up != 0 {
		t.Fatalf("outbox_relay_broker_up is %v during the outage, want 0", up)
	}

	db.empty.Store(true) // the row parked, nothing else due
	eventually(t, func() bool { return !r.isBrokerDown() }, "a trial that found no row due did not end the outage:\n%s", logs)
	if n := logs.count(`msg="broker available again`); n != 1 {
		t.Errorf("%d lines end the outage, want 1:\n%s", n, logs)
	}
	if up := brokerUpGauge(t, registry); up != 1 {
		t.Errorf("outbox_relay_broker_up is %v once the outage ended, want 1", up)
	}
}

// runSilentOutage runs a relay of two lanes on db, counted in metrics (nil: none), whose broker
// confirms nothing (an unconfirmingSender), until a failed trial's row is logged: the outage a
// probe cannot see is on, and its trials under way. Once it is over, a lane that claims nothing
// polls again within 10 ms. The relay stops at the test's end.
func runSilentOutage(t *testing.T, db DB, metrics *Metrics) (*Relay, *lockedLog) {
	t.Helper()
	logs := &lockedLog{}
	r, err := NewRelay(RelayConfig{DB: db, Sender: &unconfirmingSender{}, Exchange: "x", Lanes: 2, PollInterval: 10 * time.Millisecond,
		DisableNotify: true, BrokerRetry: Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		Metrics: metrics, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(runRelay(t, r))
	eventually(t, func() bool { return len(logs.lines(`msg="the broker confirms nothing of the row`)) == 1 },
		"no trial's row was logged:\n%s", logs)
	return r, logs
}

// A trial whose claim finds no row because another replica holds the due row locked (its
// trial, or its whole batch: SKIP LOCKED skips it) ends nothing: the row is due, and waits for
// the broker. It ended the outage, and this relay's next whole batch claimed the row once let
// go, failed, and began a new one, while the replica's trial found the row locked in turn and
// ended its own: two replicas ended and began their outages by turns, none lasting long enough
// for BrokerUnavailable to fire. Once no row is due, locked or not (the row parked), a trial
// that finds none ends it. Only a trial that claimed nothing asks whether a row is due: not a
// batch that claimed rows, nor a whole batch that claimed none.
func TestATrialThatFindsTheRowAnotherRelayHoldsEndsNothing(t *testing.T) {
	t.Parallel()
	db := &emptyingDB{backlogDB: backlogDB{rows: 50}}
	r, logs := runSilentOutage(t, db, nil)
	if n := db.asked.Load(); n != 0 {
		t.Fatalf("%d batches that claimed rows asked whether a row is due, want none", n)
	}

	db.held.Store(true) // another replica's trial holds the due row
	db.empty.Store(true)
	claims := db.claims.Load()
	eventually(t, func() bool { return db.claims.Load() >= claims+5 || !r.isBrokerDown() },
		"fewer than 5 trials claimed after the row was locked")
	if !r.isBrokerDown() || logs.count(`msg="broker available again`) != 0 {
		t.Fatalf("a trial that found the due row another relay holds ended the outage:\n%s", logs)
	}

	db.held.Store(false) // the row parked: none is due
	eventually(t, func() bool { return !r.isBrokerDown() }, "the outage did not end once no row was due:\n%s", logs)
	if n := logs.count(`msg="broker available again`); n != 1 {
		t.Errorf("%d lines end the outage, want 1:\n%s", n, logs)
	}

	asked, claims := db.asked.Load(), db.claims.Load()
	eventually(t, func() bool { return db.claims.Load() >= claims+5 }, "fewer than 5 whole batches after the outage ended")
	if n := db.asked.Load() - asked; n != 0 {
		t.Errorf("%d whole batches that claimed nothing asked whether a row is due, want none", n)
	}
}

// A trial whose claim finds no row because another lane's whole batch, begun as the outage
// did, holds them locked (SKIP LOCKED skips them) ends nothing: those rows are due, and wait
// for the broker. Once that batch is over, with no verdict, a trial that finds no row ends it.
func TestATrialThatFindsTheRowsLockedByALaneEndsNothing(t *testing.T) {
	t.Parallel()
	sender := &holdingSender{arrived: make(chan struct{}), release: make(chan struct{})}
	logs := &lockedLog{}
	db := &emptyingDB{backlogDB: backlogDB{rows: 50}}
	r, err := NewRelay(RelayConfig{DB: db, Sender: sender, Exchange: "x", Lanes: 2, PollInterval: time.Hour,
		DisableNotify: true, BrokerRetry: Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	stop := runRelay(t, r)
	defer stop()
	var once sync.Once
	release := func() { once.Do(func() { close(sender.release) }) }
	defer release() // before stop, which waits for the held batch
	eventually(t, func() bool { return len(logs.lines(`msg="the broker confirms nothing of the row`)) == 1 },
		"no trial's row was logged:\n%s", logs)

	db.empty.Store(true) // every due row is the held batch's
	claims := db.claims.Load()
	eventually(t, func() bool { return db.claims.Load() >= claims+5 || !r.isBrokerDown() },
		"fewer than 5 trials claimed after the rows were locked")
	if !r.isBrokerDown() || logs.count(`msg="broker available again`) != 0 {
		t.Fatalf("a trial that found the rows another lane holds ended the outage:\n%s", logs)
	}
	if n := db.asked.Load(); n != 0 {
		t.Errorf("%d trials asked the database whether a row is due while a lane's batch held the rows, want none: the batch says so", n)
	}

	release()
	eventually(t, func() bool { return !r.isBrokerDown() }, "the outage did not end once the held batch was over:\n%s", logs)
	if n := logs.count(`msg="broker available again`); n != 1 {
		t.Errorf("%d lines end the outage, want 1:\n%s", n, logs)
	}
}

// emptyingDB is a backlogDB whose claims find no row once empty is set; it counts its claims.
// Asked whether a row is due (statements.AnyDue, which it counts), it says held: a row another
// transaction holds locked is, none else.
type emptyingDB struct {
	backlogDB
	empty, held   atomic.Bool
	claims, asked atomic.Int32
}

func (d *emptyingDB) Begin(context.Context) (TxExecutor, error) { return d, nil }
func (d *emptyingDB) Query(ctx context.Context, sql string, args ...any) (Rows, error) {
	switch sql {
	case statements.Claim:
		d.claims.Add(1)
		if d.empty.Load() {
			return &valueRows{}, nil
		}
	case statements.AnyDue:
		d.asked.Add(1)
		return &valueRows{rows: [][]any{{d.held.Load()}}}, nil
	}
	return d.backlogDB.Query(ctx, sql, args...)
}

// holdingSender confirms nothing: its first whole batch, once a second has arrived, at once; the
// second (and any later whole batch) only once release is closed; a trial's row at once.
type holdingSender struct {
	unconfirmingSender
	whole            atomic.Int32
	arrived, release chan struct{}
}

func (s *holdingSender) Publish(ctx context.Context, msgs []Message) []error {
	if len(msgs) > trialBatch {
		switch s.whole.Add(1) {
		case 1:
			<-s.arrived // both lanes claimed before the outage began
		case 2:
			close(s.arrived)
			<-s.release
		default:
			<-s.release
		}
	}
	return s.unconfirmingSender.Publish(ctx, msgs)
}

// brokerUpGauge reads outbox_relay_broker_up of the exchange "x".
func brokerUpGauge(t *testing.T, registry *prometheus.Registry) float64 {
	t.Helper()
	up, ok := sampleOf(t, registry, "outbox_relay_broker_up", "exchange", "x")
	if !ok {
		t.Fatal("no outbox_relay_broker_up for the exchange x")
	}
	return up
}

// sampleOf reads the counter or gauge name whose label is value; ok is false if it has none.
func sampleOf(t *testing.T, registry *prometheus.Registry, name, label, value string) (v float64, ok bool) {
	t.Helper()
	families, err := registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					if m.GetCounter() != nil {
						return m.GetCounter().GetValue(), true
					}
					return m.GetGauge().GetValue(), true
				}
			}
		}
	}
	return 0, false
}
