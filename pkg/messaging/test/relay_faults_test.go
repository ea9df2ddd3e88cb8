package test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// idleMargin is what a relay lets a batch's transaction sit idle beyond its Sender's
// PublishTimeout (see messaging.Sender).
const idleMargin = 5 * time.Second

// lostPool is the pool of a relay whose host is lost, beside the bundle's.
const lostPool = 2

// A relay host lost mid-batch (a partition, a frozen machine: its connection to the database
// goes silent, neither closed nor answered) holds its rows no longer than its bound, the
// publisher's PublishTimeout of a batch and 5 s: its claim had the database end the
// transaction once it sits idle that long, and another relay sends the rows. Without the bound
// PostgreSQL kept the transaction, idle, and its locks, until TCP gave the connection up (two
// hours at Linux's default keepalive), and every other relay skipped the rows meanwhile. The
// bound is the server's: the lost relay's lane waits for its marks until its own connection
// fails.
func TestARelayLostMidBatchHoldsItsRowsNoLongerThanItsBound(t *testing.T) {
	t.Parallel()
	b := setupWith(t, lostPool)
	b.enqueue(t, 20)
	hole := newBlackHole(t, testenv.DatabaseHost(t))
	lost := driverOf(t, testenv.OpenPool(t, testenv.URLVia(t, b.db.URL, hole.addr), lostPool))
	pub := b.publisher(t, testenv.AMQPURL(), func(c *messaging.PublisherConfig) { c.ConfirmTimeout = time.Second })
	bound := pub.PublishTimeout(messaging.DefaultRelayBatchSize) + idleMargin
	sender := &silencingSender{Publisher: pub, hole: hole, silenced: make(chan struct{})}
	run(t, b.relay(t, sender, func(c *messaging.RelayConfig) {
		c.DB, c.Lanes, c.DisableNotify, c.PollInterval = lost.DB(), 1, true, time.Hour
	}).Run)
	select {
	case <-sender.silenced:
	case <-time.After(10 * time.Second):
		t.Fatal("the relay to be lost published nothing")
	}
	silenced := time.Now()
	// The other relay polls often: the rows are its as soon as they are free.
	run(t, b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) {
		c.DisableNotify, c.PollInterval = true, 100*time.Millisecond
	}).Run)
	const margin = 5 * time.Second
	b.waitAllSent(t, bound+margin)
	t.Logf("the rows of the lost relay were sent %s after its connection went silent (bound %s)",
		time.Since(silenced).Round(time.Millisecond), bound)
	hole.close() // the lost relay's connections fail, and it stops at once
}

// silencingSender is a Publisher that, at its first Publish, silences hole, its relay's only way
// to the database, and closes silenced; then it publishes. Embedded, the Publisher's
// PublishTimeout is the sender's: the relay bounds its batches by it.
type silencingSender struct {
	*messaging.Publisher
	hole     *blackHole
	once     sync.Once
	silenced chan struct{}
}

func (s *silencingSender) Publish(ctx context.Context, msgs []messaging.Message) []error {
	s.once.Do(func() {
		s.hole.silent.Store(true)
		close(s.silenced)
	})
	return s.Publisher.Publish(ctx, msgs)
}

// blackHole passes TCP connections on to upstream until silent is set; from then on it passes
// nothing either way and closes nothing, as a partition does: what either side sends is
// dropped, and a side's close is not passed on (toxiproxy's timeout toxic passes the server's
// close on, which a partition does not). close closes it, and every connection it holds.
type blackHole struct {
	addr   string
	ln     net.Listener
	silent atomic.Bool
	mu     sync.Mutex
	held   []net.Conn
}

func newBlackHole(t *testing.T, upstream string) *blackHole {
	t.Helper()
	h := &blackHole{}
	h.ln = forward(t, upstream, h.hold)
	h.addr = h.ln.Addr().String()
	t.Cleanup(h.close)
	return h
}

// hold keeps client and server for close, and pipes them to each other.
func (h *blackHole) hold(client, server net.Conn) {
	h.mu.Lock()
	h.held = append(h.held, client, server)
	h.mu.Unlock()
	go h.pipe(client, server)
	go h.pipe(server, client)
}

// pipe copies src to dst until src ends, then closes dst; once silent, it drops what it reads,
// and leaves dst open.
func (h *blackHole) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if err != nil {
			if !h.silent.Load() {
				_ = dst.Close()
			}
			return
		}
		if h.silent.Load() {
			continue
		}
		if _, err := dst.Write(buf[:n]); err != nil {
			return
		}
	}
}

func (h *blackHole) close() {
	_ = h.ln.Close()
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range h.held {
		_ = c.Close()
	}
}

// The bounded claim ends its transaction, and frees its rows, once the transaction sits idle
// longer than it says: the setting, local to the transaction, is read when the session goes
// idle in it. The rows are then another transaction's to claim.
func TestTheBoundedClaimEndsItsTransactionLeftIdle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.enqueue(t, 3)
	sqlDB, err := b.db.DB.DB()
	must(t, err)
	ctx := context.Background()
	tx, err := sqlDB.BeginTx(ctx, nil)
	must(t, err)
	defer func() { _ = tx.Rollback() }()
	var pid int
	must(t, tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid))
	must(t, claimAll(ctx, tx, 10, 300*time.Millisecond))
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, b.db.DB, "SELECT count(*) FROM pg_stat_activity WHERE pid = ?", pid) == 0
	}, "the session left idle in its claim's transaction is still there")
	if _, err := tx.ExecContext(ctx, "SELECT 1"); err == nil {
		t.Error("the transaction ended by the database took another statement")
	}
	other, err := sqlDB.BeginTx(ctx, nil)
	must(t, err)
	defer func() { _ = other.Rollback() }()
	n := 0
	rows, err := other.QueryContext(ctx, statements.Claim, 10)
	must(t, err)
	for rows.Next() {
		n++
	}
	must(t, rows.Err())
	if n != 3 {
		t.Errorf("another transaction claimed %d rows, want the 3 the ended one held", n)
	}
}

// claimAll runs in tx the bounded claim of up to limit rows, its transaction idle for idle at
// most, and reads its rows.
func claimAll(ctx context.Context, tx *sql.Tx, limit int, idle time.Duration) error {
	rows, err := tx.QueryContext(ctx, statements.ClaimBounded, limit, strconv.FormatInt(idle.Milliseconds(), 10))
	if err != nil {
		return err
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		n++
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if n == 0 {
		return errors.New("the claim took no row")
	}
	return nil
}

// The rows the broker refused in a batch are backed off in one statement, each with its own
// error, as it came (quotes, backslashes, a line separator: what a JSON document carries
// escaped), its attempt counted and its own delay; the rows confirmed beside them are marked.
func TestABatchsRefusalsAreEachRecordedWithItsOwnErrorAndDelay(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.enqueue(t, 4)
	refusals := map[uuid.UUID]error{
		ids[0]: errors.New(`refused: "quoted" \ back\slash`),
		ids[1]: errors.New("refused:\u2028a line separator, and ünïcode"),
		ids[3]: messaging.ErrUnroutable,
	}
	// ids[3] has failed twice before: its delay is the third step's.
	must(t, b.db.DB.Exec("UPDATE outbox_messages SET attempts = 2 WHERE id = ?", ids[3]).Error)
	r := b.relay(t, refusingSender{refuse: refusals}, func(c *messaging.RelayConfig) {
		c.Backoff = messaging.Backoff{Base: 10 * time.Second, Max: time.Hour, Jitter: 0.01}
	})
	res, err := r.ProcessBatch(context.Background())
	if err != nil || res != (messaging.BatchResult{Claimed: 4, Sent: 1, Failed: 3}) {
		t.Fatalf("batch = %+v, %v; want 3 rows refused and one sent", res, err)
	}
	for id, refusal := range refusals {
		var row outboxRow
		must(t, b.db.DB.First(&row, "id = ?", id).Error)
		want := map[uuid.UUID]struct {
			attempts int
			delay    time.Duration
		}{ids[0]: {1, 10 * time.Second}, ids[1]: {1, 10 * time.Second}, ids[3]: {3, 40 * time.Second}}[id]
		delay := time.Until(row.NextAttemptAt)
		if row.LastError == nil || *row.LastError != refusal.Error() || row.Attempts != want.attempts || row.ProcessedAt != nil ||
			delay > want.delay || delay < want.delay*98/100-5*time.Second {
			t.Errorf("refused row: attempts %d, last_error %v, due in %s, sent %v; want %d attempts, %q, due in %s, unsent",
				row.Attempts, row.LastError, delay, row.ProcessedAt != nil, want.attempts, refusal.Error(), want.delay)
		}
	}
	var sent outboxRow
	if err := b.db.DB.First(&sent, "id = ?", ids[2]).Error; err != nil || sent.ProcessedAt == nil || sent.Attempts != 0 {
		t.Errorf("confirmed row: sent %v, attempts %d (%v); want it marked sent, no attempt charged", sent.ProcessedAt != nil, sent.Attempts, err)
	}
}

// The backoff of refused rows finds them by primary key however much the table grew since its
// plan was cached (a prepared statement's generic plan, made on a nearly empty table), under
// the relay's plan settings, as the marking does.
func TestRecordFailuresFindsItsRowsByKeyWhateverPlanWasCached(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	db.MigrateLibrary(t)
	must(t, db.DB.Exec(`ALTER TABLE outbox_messages SET (autovacuum_enabled = off)`).Error)
	sqlDB, err := db.DB.DB()
	must(t, err)
	ctx := context.Background()
	conn, err := sqlDB.Conn(ctx)
	must(t, err)
	defer func() { _ = conn.Close() }()
	exec := func(q string) {
		t.Helper()
		if _, err := conn.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	exec("SET plan_cache_mode = force_generic_plan")
	exec("PREPARE refuse(uuid[], jsonb) AS " + statements.RecordFailures)
	exec("BEGIN")
	exec(statements.ClaimPlan)
	exec("EXECUTE refuse('{}', '{}')") // the plan, cached on the empty table
	exec("COMMIT")
	exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at)
		SELECT gen_random_uuid(), 'OrderPlaced', '{}', now() FROM generate_series(1, 20000)`)
	var id string
	must(t, conn.QueryRowContext(ctx, "SELECT id FROM outbox_messages LIMIT 1").Scan(&id))
	exec("BEGIN")
	exec(statements.ClaimPlan)
	var out string
	must(t, conn.QueryRowContext(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE refuse(ARRAY['"+id+"']::uuid[], "+
		`'{"`+id+`": {"error": "refused", "delay_ms": 1000}}')`).Scan(&out))
	exec("ROLLBACK")
	var plans []struct{ Plan planNode }
	must(t, json.Unmarshal([]byte(out), &plans))
	plan := plans[0].Plan
	scan := plan.find("Index Scan")
	if scan == nil {
		scan = plan.find("Bitmap Index Scan")
	}
	if plan.find("Seq Scan") != nil || scan == nil || scan.IndexName != "outbox_messages_pkey" {
		t.Fatalf("the cached backoff of refused rows does not find them by primary key: %v", plan.nodes())
	}
}

// slowSender confirms every message after taking wait over it, and says that a Publish takes
// bound at most (its PublishTimeout, by which the relay bounds its batches' transactions).
type slowSender struct{ wait, bound time.Duration }

func (s slowSender) Publish(ctx context.Context, msgs []messaging.Message) []error {
	t := time.NewTimer(s.wait)
	defer t.Stop()
	select {
	case <-t.C:
		return make([]error, len(msgs))
	case <-ctx.Done():
		errs := make([]error, len(msgs))
		for i := range errs {
			errs[i] = messaging.ErrBrokerUnavailable
		}
		return errs
	}
}

func (s slowSender) PublishTimeout(int) time.Duration { return s.bound }

// A batch whose publish takes nearly its Sender's whole PublishTimeout still commits: the
// bound its claim sets on the transaction's idle time leaves it that long, and a margin. A
// bound any tighter would end the transaction of every batch that waits its confirms out, the
// rows to be sent again at the next batch, and waited for again, for ever.
func TestABatchThatWaitsNearlyItsPublishTimeoutCommits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.enqueue(t, 3)
	const timeout = 2 * time.Second
	r := b.relay(t, slowSender{wait: timeout - 200*time.Millisecond, bound: timeout}, nil)
	res, err := r.ProcessBatch(context.Background())
	if err != nil || res != (messaging.BatchResult{Claimed: 3, Sent: 3}) {
		t.Fatalf("batch = %+v, %v; want its 3 rows sent", res, err)
	}
	if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages WHERE id IN ? AND processed_at IS NOT NULL", ids); n != 3 {
		t.Fatalf("%d rows marked sent, want 3", n)
	}
}

// The relay gives a batch's statements no deadline of its own: a claim that waits longer than
// the batch's bound for a lock (a migration's ACCESS EXCLUSIVE) goes on waiting, and the batch
// goes out once the lock is gone. With one, the driver (pgx) closed its socket and sent no
// cancel request, and the server's session waited on, unaware, holding its place in the lock
// queue; in a commit waiting for a synchronous standby, holding the rows' locks too, while the
// lane claimed more on another session, one abandoned session every bound until none was left.
func TestABatchWaitsForALockLongerThanItsBound(t *testing.T) {
	t.Parallel()
	b := setupWith(t, 1)
	ids := b.enqueue(t, 3)
	// A bound of 5 s and a millisecond: the margin, and the Sender's timeout.
	const bound = idleMargin + time.Millisecond
	r := b.relay(t, slowSender{bound: time.Millisecond}, nil)
	sqlDB, err := b.db.DB.DB()
	must(t, err)
	ctx := context.Background()
	migration, err := sqlDB.BeginTx(ctx, nil)
	must(t, err)
	defer func() { _ = migration.Rollback() }()
	_, err = migration.ExecContext(ctx, "LOCK TABLE outbox_messages IN ACCESS EXCLUSIVE MODE")
	must(t, err)

	type outcome struct {
		res messaging.BatchResult
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := r.ProcessBatch(ctx)
		done <- outcome{res, err}
	}()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, b.db.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND wait_event_type = 'Lock'", b.db.Name) == 1
	}, "the batch's claim does not wait for the lock")
	select {
	case o := <-done:
		t.Fatalf("the batch gave up waiting for the lock: %+v, %v", o.res, o.err)
	case <-time.After(bound + time.Second):
	}
	must(t, migration.Commit())
	select {
	case o := <-done:
		if o.err != nil || o.res != (messaging.BatchResult{Claimed: 3, Sent: 3}) {
			t.Fatalf("batch = %+v, %v; want its 3 rows sent once the lock is gone", o.res, o.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the batch is not done 10 s after the lock is gone")
	}
	if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages WHERE id IN ? AND processed_at IS NOT NULL", ids); n != 3 {
		t.Fatalf("%d rows marked sent, want 3", n)
	}
}

// A batch's publish spans end after its commit: a span processor that exports each span as it
// ends (a slow exporter) must not hold the transaction idle, its rows locked, nor past its
// bound, which would end every batch. Each span still ends with its row's outcome.
func TestPublishSpansEndAfterTheBatchCommits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.enqueue(t, 3)
	refused := ids[1]
	spans := &committedAtEnd{db: b.db, ids: ids}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	r := b.relay(t, refusingSender{refuse: map[uuid.UUID]error{refused: messaging.ErrUnroutable}}, func(c *messaging.RelayConfig) {
		c.TracerProvider = tp
	})
	res, err := r.ProcessBatch(context.Background())
	if err != nil || res != (messaging.BatchResult{Claimed: 3, Sent: 2, Failed: 1}) {
		t.Fatalf("batch = %+v, %v; want 2 rows sent, 1 refused", res, err)
	}
	ended := spans.ended()
	if len(ended) != 3 {
		t.Fatalf("%d publish spans ended, want 3", len(ended))
	}
	for _, e := range ended {
		if e.settled != 3 {
			t.Errorf("the span of %s ended with %d of the batch's rows settled in the database, want all 3: before the commit", e.id, e.settled)
		}
		if wantErr := e.id == refused.String(); (e.status == codes.Error) != wantErr {
			t.Errorf("the span of %s ended with status %v, want an error %t", e.id, e.status, wantErr)
		}
	}
}

// committedAtEnd is a span processor that, as each span ends, counts (on a connection of its
// own) the rows of ids that are settled, marked sent or backed off, and notes the span's
// message id and status.
type committedAtEnd struct {
	db  *testenv.Database
	ids []uuid.UUID
	mu  sync.Mutex
	all []endedSpan
}

type endedSpan struct {
	id      string
	status  codes.Code
	settled int64
}

func (p *committedAtEnd) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (p *committedAtEnd) OnEnd(s sdktrace.ReadOnlySpan) {
	e := endedSpan{status: s.Status().Code}
	for _, a := range s.Attributes() {
		if a.Key == semconv.MessagingMessageIDKey {
			e.id = a.Value.AsString()
		}
	}
	var settled int64
	if err := p.db.DB.Raw("SELECT count(*) FROM outbox_messages WHERE id IN ? AND (processed_at IS NOT NULL OR attempts > 0)", p.ids).
		Scan(&settled).Error; err != nil {
		settled = -1
	}
	e.settled = settled
	p.mu.Lock()
	defer p.mu.Unlock()
	p.all = append(p.all, e)
}
func (p *committedAtEnd) Shutdown(context.Context) error   { return nil }
func (p *committedAtEnd) ForceFlush(context.Context) error { return nil }

func (p *committedAtEnd) ended() []endedSpan {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]endedSpan(nil), p.all...)
}
