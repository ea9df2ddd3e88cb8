package test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// planNode is the part of EXPLAIN (FORMAT JSON) the claim's checks read.
type planNode struct {
	NodeType  string     `json:"Node Type"`
	IndexName string     `json:"Index Name"`
	HitBlocks int        `json:"Shared Hit Blocks"`
	ReadBlock int        `json:"Shared Read Blocks"`
	Plans     []planNode `json:"Plans"`
}

func (n planNode) buffers() int { return n.HitBlocks + n.ReadBlock }

// nodes lists the plan's node types, with the index of each index scan.
func (n planNode) nodes() []string {
	out := []string{n.NodeType + " " + n.IndexName}
	for _, c := range n.Plans {
		out = append(out, c.nodes()...)
	}
	return out
}

func (n planNode) find(nodeType string) *planNode {
	if n.NodeType == nodeType {
		return &n
	}
	for _, c := range n.Plans {
		if f := c.find(nodeType); f != nil {
			return f
		}
	}
	return nil
}

// explainClaim runs the relay's claim, bounded as it is with a Publisher, under EXPLAIN
// (ANALYZE, BUFFERS) in a transaction that is rolled back. Guarded, the settings the relay makes
// for its claims (statements.ClaimPlan) come first in that transaction.
func explainClaim(t *testing.T, db *gorm.DB, guarded bool) planNode {
	t.Helper()
	return explainRolledBack(t, db, func(ctx context.Context, tx *sql.Tx) (string, error) {
		if guarded {
			if _, err := tx.ExecContext(ctx, statements.ClaimPlan); err != nil {
				return "", err
			}
		}
		var out string
		err := tx.QueryRowContext(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+statements.ClaimBounded, 500, "60000").Scan(&out)
		return out, err
	})
}

// explainRolledBack runs explain, which returns an EXPLAIN (FORMAT JSON) result, in a
// transaction that is rolled back, and returns the plan's root.
func explainRolledBack(t *testing.T, db *gorm.DB, explain func(ctx context.Context, tx *sql.Tx) (string, error)) planNode {
	t.Helper()
	sqlDB, err := db.DB()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	tx, err := sqlDB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	out, err := explain(ctx, tx)
	if err != nil {
		t.Fatal(err)
	}
	var plans []struct{ Plan planNode }
	if err := json.Unmarshal([]byte(out), &plans); err != nil || len(plans) != 1 {
		t.Fatalf("parse plan %s: %v", out, err)
	}
	return plans[0].Plan
}

// A table the planner has no statistics for (a new deployment whose first minutes bring a
// burst) must not make the claim fetch and sort the whole backlog: it walks the partial index in
// order and reads the batch, whatever autovacuum did or did not do.
func TestClaimReadsTheBatchNotTheBacklogWithoutStatistics(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	db.MigrateLibrary(t)
	for _, q := range []string{
		`ALTER TABLE outbox_messages SET (autovacuum_enabled = off)`,
		`INSERT INTO outbox_messages (id, type, payload, occurred_at)
		 SELECT gen_random_uuid(), 'OrderPlaced',
		        jsonb_build_object('order_id', gen_random_uuid(), 'customer_id', 'c-42', 'total_cents', g),
		        now() - (100000 - g) * interval '1 millisecond'
		 FROM generate_series(1, 100000) g`,
	} {
		if err := db.DB.Exec(q).Error; err != nil {
			t.Fatal(err)
		}
	}
	if n := testenv.Count(t, db.DB, "SELECT count(*) FROM pg_stats WHERE tablename = 'outbox_messages'"); n != 0 {
		t.Fatalf("the table has statistics (%d columns): the test needs a table never analyzed", n)
	}
	tableBlocks := testenv.Count(t, db.DB, "SELECT pg_relation_size('outbox_messages') / current_setting('block_size')::int")

	unguarded := explainClaim(t, db.DB, false)
	t.Logf("claim without the plan setting: sort=%v, %d buffers (the table has %d blocks)",
		unguarded.find("Sort") != nil, unguarded.buffers(), tableBlocks)

	// The scan is what reads; locking then touches each claimed row once more (twice on a page
	// that vacuum marked all-visible: the lock clears the mark).
	plan := explainClaim(t, db.DB, true)
	scan := plan.find("Index Scan")
	if plan.find("Sort") != nil || scan == nil || scan.IndexName != "outbox_messages_unprocessed_idx" {
		t.Fatalf("claim plan sorts or does not walk the partial index: %+v", plan)
	}
	// 500 rows of about 200 bytes fill some 15 heap blocks; a few index blocks lead to them.
	const batchBlocks = 60
	if b := scan.buffers(); b > batchBlocks {
		t.Fatalf("the claim's scan read %d buffers for a batch of 500 out of %d blocks: more than the batch", b, tableBlocks)
	}
	t.Logf("claim with the plan setting: index scan of %d buffers, %d with the row locks", scan.buffers(), plan.buffers())

	// A long drain between vacuums: the sent rows leave dead entries at the head of the
	// partial index, which every claim steps over until vacuum removes them.
	if err := db.DB.Exec(`UPDATE outbox_messages SET processed_at = now()
		WHERE id IN (SELECT id FROM outbox_messages ORDER BY occurred_at, id LIMIT 50000)`).Error; err != nil {
		t.Fatal(err)
	}
	first, second := explainClaim(t, db.DB, true), explainClaim(t, db.DB, true)
	if first.find("Sort") != nil || second.find("Sort") != nil {
		t.Fatal("the claim sorts after the drain")
	}
	t.Logf("after 50,000 rows sent without a vacuum: the first claim's scan reads %d buffers, the next %d (the first marks the dead entries)",
		first.find("Index Scan").buffers(), second.find("Index Scan").buffers())
	if err := db.DB.Exec("VACUUM outbox_messages").Error; err != nil {
		t.Fatal(err)
	}
	vacuumed := explainClaim(t, db.DB, true).find("Index Scan")
	if vacuumed == nil || vacuumed.buffers() > batchBlocks {
		t.Fatalf("after vacuum the claim's scan is %+v", vacuumed)
	}
	t.Logf("after VACUUM: the scan reads %d buffers", vacuumed.buffers())
}

// The marking finds its rows by primary key however much the table grew since its plan was
// cached: a generic plan made while the table was nearly empty (what a prepared statement gets
// after its first executions) scans it whole, and keeps scanning as it grows until an ANALYZE.
// The relay's plan setting, first in each batch's transaction, rules that out; so do the same
// settings made for the whole session (RelayConfig.SessionsPlanByIndex), with none in the
// transaction.
func TestMarkSentFindsItsRowsByKeyWhateverPlanWasCached(t *testing.T) {
	t.Parallel()
	for _, guard := range []string{"none", "transaction", "session"} {
		t.Run("guarded by "+guard, func(t *testing.T) { markSentPlanAfterGrowth(t, guard) })
	}
}

// markSentPlanAfterGrowth caches the marking's generic plan on an empty table, fills the table,
// and looks at the plan the marking then runs with, the plan settings made where guard says.
func markSentPlanAfterGrowth(t *testing.T, guard string) {
	t.Helper()
	db := testenv.NewDatabase(t)
	db.MigrateLibrary(t)
	must(t, db.DB.Exec(`ALTER TABLE outbox_messages SET (autovacuum_enabled = off)`).Error)
	sqlDB, err := db.DB.DB()
	must(t, err)
	ctx := context.Background()
	conn, err := sqlDB.Conn(ctx)
	must(t, err)
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := conn.ExecContext(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	guarded := guard == "transaction"
	if guard == "session" {
		exec("SET enable_sort = off")
		exec("SET enable_seqscan = off")
	}
	// In a transaction of the relay's shape: its plan setting (if guarded), then the
	// marking.
	inBatch := func(stmt string) {
		t.Helper()
		exec("BEGIN")
		if guarded {
			exec(statements.ClaimPlan)
		}
		exec(stmt)
		exec("COMMIT")
	}
	exec("SET plan_cache_mode = force_generic_plan")
	exec("PREPARE mark(uuid[]) AS " + strings.Replace(statements.MarkSent, "$1::uuid[]", "$1", 1))
	inBatch("EXECUTE mark('{}')") // the plan, cached on the empty table
	exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at)
		SELECT gen_random_uuid(), 'OrderPlaced', '{}', now() FROM generate_series(1, 20000)`)
	var id string
	must(t, conn.QueryRowContext(ctx, "SELECT id FROM outbox_messages LIMIT 1").Scan(&id))
	exec("BEGIN")
	if guarded {
		exec(statements.ClaimPlan)
	}
	var out string
	must(t, conn.QueryRowContext(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE mark(ARRAY['"+id+"']::uuid[])").Scan(&out))
	exec("ROLLBACK")
	_ = conn.Close()
	var plans []struct{ Plan planNode }
	must(t, json.Unmarshal([]byte(out), &plans))
	seq := plans[0].Plan.find("Seq Scan") != nil
	switch {
	case guard != "none" && seq:
		t.Fatalf("with the relay's plan setting (in the %s) the marking scans the table: %s", guard, out)
	case guard == "none":
		t.Logf("without the plan setting, the marking's cached plan scans the table: %v", seq)
	}
}

// The outbox gauges cost the same at any backlog: each scrape walks the partial index from the
// oldest row and reads 100,000 rows at most, even on a table without statistics, where an
// exact count of every unsent row took 0.3-0.4 s for 3 million and outlasted the query's 1 s
// timeout for 6 million on a busy machine, dropping the gauges while the backlog was largest.
// The oldest row's age stays exact; the counts stop at 100,000; the attempts are the oldest
// rows' (ReadOutboxStats, for outboxctl, counts every row).
func TestOutboxGaugesReadTheOldestRowsAtAnyBacklog(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+2) // the gauges' pool besides the bundle's
	b := setup(t)
	db := b.db.DB
	for _, q := range []string{
		`ALTER TABLE outbox_messages SET (autovacuum_enabled = off)`,
		`INSERT INTO outbox_messages (id, type, payload, occurred_at, attempts)
		 SELECT gen_random_uuid(), 'OrderPlaced', jsonb_build_object('n', g),
		        now() - (150000 - g) * interval '1 millisecond' - interval '1 hour',
		        CASE g WHEN 1 THEN 7 WHEN 150000 THEN 30 ELSE 0 END
		 FROM generate_series(1, 150000) g`,
	} {
		must(t, db.Exec(q).Error)
	}

	plan := explainRolledBack(t, db, func(ctx context.Context, tx *sql.Tx) (string, error) {
		if _, err := tx.ExecContext(ctx, statements.ClaimPlan); err != nil {
			return "", err
		}
		var out string
		err := tx.QueryRowContext(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+statements.OutboxStatsHead, 100000).Scan(&out)
		return out, err
	})
	scan := plan.find("Index Scan")
	if plan.find("Sort") != nil || plan.find("Seq Scan") != nil || scan == nil || scan.IndexName != "outbox_messages_unprocessed_idx" || plan.find("Limit") == nil {
		t.Fatalf("the gauges' query does not walk the partial index to a limit: %v", plan.nodes())
	}

	// The gauges' own sessions may not spill a sort to disk: a sort of the backlog fails their
	// query, and the gauges drop out.
	must(t, db.Exec(fmt.Sprintf("ALTER DATABASE %q SET work_mem = '64kB'", b.db.Name)).Error)
	must(t, db.Exec(fmt.Sprintf("ALTER DATABASE %q SET temp_file_limit = 0", b.db.Name)).Error)
	gauges := driverOf(t, testenv.OpenPool(t, b.db.URL, 2))
	must(t, messaging.RegisterOutboxStats(b.registry, "", gauges.DB(), b.log))
	wantMetric(t, b.registry, "outbox_pending_messages 100000")
	wantMetric(t, b.registry, "outbox_max_attempts 7")
	wantMetric(t, b.registry, "outbox_stats_errors_total 0")
	var oldest float64
	must(t, db.Raw("SELECT extract(epoch FROM now() - min(occurred_at))::float8 FROM outbox_messages").Scan(&oldest).Error)
	if age := metricValue(t, b.registry, "outbox_oldest_pending_age_seconds", nil); age < oldest-1 || age > oldest+30 {
		t.Errorf("outbox_oldest_pending_age_seconds = %.1f, want the oldest row's age, %.1f s", age, oldest)
	}

	exact, err := messaging.ReadOutboxStats(context.Background(), b.drv.DB())
	if err != nil || exact.Pending != 150000 || exact.MaxAttempts != 30 {
		t.Fatalf("ReadOutboxStats = %+v, %v; want every row counted: 150000 pending, 30 attempts", exact, err)
	}
}

// The relay keeps its claim on the partial index, in order, either way it can be told to: by
// setting the plan for each batch's transaction, or, with SessionsPlanByIndex, on sessions
// that start with the settings, when it sends no statement for them. The backlog is 100,000
// rows the planner has no statistics for; the plan is the one the relay's claim gets, in its
// own transaction.
func TestRelayClaimsByIndexWhicheverWayItPlans(t *testing.T) {
	t.Parallel()
	for _, sessions := range []bool{false, true} {
		t.Run(fmt.Sprintf("SessionsPlanByIndex=%t", sessions), func(t *testing.T) {
			t.Parallel()
			rec := recordedOutbox(t, sessions, 100000)
			relay, err := messaging.NewRelay(messaging.RelayConfig{DB: rec, Sender: boundedConfirmAll{}, Exchange: "orders", BatchSize: 500,
				SessionsPlanByIndex: sessions})
			must(t, err)
			res, err := relay.ProcessBatch(context.Background())
			if err != nil || res.Sent != 500 {
				t.Fatalf("batch: %+v, %v; want 500 sent", res, err)
			}
			if set := rec.setPlan.Load(); set == sessions {
				t.Errorf("the relay set the plan in its transaction: %t, want %t", set, !sessions)
			}
			scan := rec.plan.find("Index Scan")
			if rec.plan.find("Sort") != nil || scan == nil || scan.IndexName != "outbox_messages_unprocessed_idx" {
				t.Fatalf("the relay's claim sorts or does not walk the partial index: %v", rec.plan.nodes())
			}
		})
	}
}

// At the end of a broker outage the relay counts the rows still waiting, every one of them: on
// sessions that plan by index, in a transaction that lets the count scan the table
// (statements.ScanPlan), which with statistics reads a large backlog in a third of the time
// of the index walk.
func TestRelayCountsTheRowsThatWaitedWithATableScan(t *testing.T) {
	t.Parallel()
	for _, sessions := range []bool{false, true} {
		t.Run(fmt.Sprintf("SessionsPlanByIndex=%t", sessions), func(t *testing.T) {
			t.Parallel()
			rec := recordedOutbox(t, sessions, 10)
			log, logs := testenv.NewLogger(t)
			relay, err := messaging.NewRelay(messaging.RelayConfig{DB: rec, Sender: &outageFirst{}, Exchange: "orders",
				BatchSize: 5, Lanes: 1, DisableNotify: true, PollInterval: 50 * time.Millisecond,
				BrokerRetry:         messaging.Backoff{Base: 10 * time.Millisecond, Max: 10 * time.Millisecond},
				SessionsPlanByIndex: sessions, Logger: log})
			must(t, err)
			run(t, relay.Run)
			// The first batch found the broker away; the second sent 5 of the 10 rows.
			testenv.Eventually(t, 10*time.Second, func() bool {
				return len(logs.Lines("broker available again; relay resumed", "rows_waiting=5")) == 1
			}, "the relay did not say how many rows waited")
			if scanned := rec.scanPlan.Load(); scanned != sessions {
				t.Errorf("the count let itself scan the table: %t, want %t", scanned, sessions)
			}
			// On sessions that plan by index, the count runs in the recorded transaction, with
			// sequential scans allowed again; otherwise on the pool, as the session has it.
			got, _ := rec.countPlan.Load().(string)
			if want := map[bool]string{false: "", true: "on,on"}[sessions]; got != want {
				t.Errorf("the count ran in a transaction with enable_seqscan,enable_sort %q, want %q", got, want)
			}
		})
	}
}

// recordedOutbox makes a database with rows unsent outbox rows, which the planner has no
// statistics for (each a millisecond older than the next), and returns a pool on it for a
// relay, whose sessions start with the plan settings if sessions, recording its statements.
func recordedOutbox(t *testing.T, sessions bool, rows int) *claimRecorder {
	t.Helper()
	testenv.Connections(t, testenv.DefaultConnections+2) // the relay's pool besides the database's
	db := testenv.NewDatabase(t)
	db.MigrateLibrary(t)
	must(t, db.DB.Exec(`ALTER TABLE outbox_messages SET (autovacuum_enabled = off)`).Error)
	must(t, db.DB.Exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at)
		SELECT gen_random_uuid(), 'OrderPlaced', jsonb_build_object('n', g), now() - ($1 - g) * interval '1 millisecond'
		FROM generate_series(1, $1) g`, rows).Error)
	dsn, err := url.Parse(db.URL)
	must(t, err)
	if sessions {
		q := dsn.Query()
		q.Set("enable_sort", "off")
		q.Set("enable_seqscan", "off")
		q.Set("jit", "off")
		dsn.RawQuery = q.Encode()
	}
	return &claimRecorder{DB: driverOf(t, testenv.OpenPool(t, dsn.String(), 2)).DB()}
}

// outageFirst is a broker that is away at the first publish, and confirms every message after.
type outageFirst struct{ calls atomic.Int32 }

func (o *outageFirst) Publish(_ context.Context, msgs []messaging.Message) []error {
	verdicts := make([]error, len(msgs))
	if o.calls.Add(1) == 1 {
		for i := range verdicts {
			verdicts[i] = fmt.Errorf("connection refused: %w", messaging.ErrBrokerUnavailable)
		}
	}
	return verdicts
}

// claimRecorder passes a relay's statements on to DB, and notes, in the batch's transaction,
// whether the plan settings came first, and the plan the claim got.
type claimRecorder struct {
	messaging.DB
	setPlan, scanPlan atomic.Bool  // ClaimPlan, ScanPlan sent in a transaction
	countPlan         atomic.Value // enable_seqscan,enable_sort in the transaction of the count of unsent rows
	plan              planNode
}

func (c *claimRecorder) Begin(ctx context.Context) (messaging.TxExecutor, error) {
	tx, err := c.DB.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return recordingTx{TxExecutor: tx, c: c}, nil
}

type recordingTx struct {
	messaging.TxExecutor
	c *claimRecorder
}

func (r recordingTx) Exec(ctx context.Context, sql string, args ...any) (int64, error) {
	switch sql {
	case statements.ClaimPlan:
		r.c.setPlan.Store(true)
	case statements.ScanPlan:
		r.c.scanPlan.Store(true)
	}
	return r.TxExecutor.Exec(ctx, sql, args...)
}

func (r recordingTx) Query(ctx context.Context, sql string, args ...any) (messaging.Rows, error) {
	switch sql {
	case statements.OutboxStats:
		settings, err := r.text(ctx, "SELECT current_setting('enable_seqscan') || ',' || current_setting('enable_sort')")
		if err != nil {
			return nil, err
		}
		r.c.countPlan.Store(settings)
	case statements.Claim, statements.ClaimBounded:
		out, err := r.text(ctx, "EXPLAIN (FORMAT JSON) "+sql, args...)
		if err != nil {
			return nil, err
		}
		var plans []struct{ Plan planNode }
		if err := json.Unmarshal([]byte(out), &plans); err != nil {
			return nil, fmt.Errorf("parse plan %s: %w", out, err)
		}
		if len(plans) != 1 {
			return nil, fmt.Errorf("%d plans in %s, want one", len(plans), out)
		}
		r.c.plan = plans[0].Plan
	}
	return r.TxExecutor.Query(ctx, sql, args...)
}

// text runs a query of one text value in the transaction, and returns the value.
func (r recordingTx) text(ctx context.Context, sql string, args ...any) (string, error) {
	rows, err := r.TxExecutor.Query(ctx, sql, args...)
	if err != nil {
		return "", err
	}
	defer rows.Close()
	var out string
	for rows.Next() {
		if err := rows.Scan(&out); err != nil {
			return "", err
		}
	}
	return out, rows.Err()
}

// confirmAll is a broker that confirms every message: the test is of the database's side.
type confirmAll struct{}

func (confirmAll) Publish(_ context.Context, msgs []messaging.Message) []error {
	return make([]error, len(msgs))
}

// boundedConfirmAll is confirmAll with a PublishTimeout, as a Publisher has: the relay's claim
// bounds the transaction's idle time, as it does with a Publisher.
type boundedConfirmAll struct{ confirmAll }

func (boundedConfirmAll) PublishTimeout(int) time.Duration { return 15 * time.Second }
