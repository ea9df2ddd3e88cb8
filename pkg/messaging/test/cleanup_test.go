package test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/pgxdriver"
)

// cleanupEnv is a database with both messaging tables, and the metrics its cleanups count in.
type cleanupEnv struct {
	url      string
	db       *gorm.DB
	pool     messaging.DB // db's, for the library
	registry *prometheus.Registry
	opts     messaging.CleanupOptions
}

func newCleanupEnv(t *testing.T) *cleanupEnv {
	t.Helper()
	d := testenv.NewDatabase(t)
	d.MigrateLibrary(t)
	reg := prometheus.NewRegistry()
	metrics, err := messaging.NewMetrics(reg, "")
	if err != nil {
		t.Fatal(err)
	}
	e := &cleanupEnv{url: d.URL, db: d.DB, pool: d.Driver(t).DB(), registry: reg, opts: messaging.CleanupOptions{Metrics: metrics}}
	// The "random" bits of the test's UUIDv7 ids: distinct across all the rows it inserts.
	e.exec(t, "CREATE SEQUENCE test_ids")
	return e
}

func (e *cleanupEnv) exec(t *testing.T, q string, args ...any) {
	t.Helper()
	if err := e.db.Exec(q, args...).Error; err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

var outboxRowsSQL = `INSERT INTO outbox_messages (id, type, payload, occurred_at, processed_at, attempts)
SELECT ` + testenv.UUIDv7SQL("ts", "nextval('test_ids')") + `, 'OrderPlaced', '{}', ts, ts + CAST(@sent_after AS interval), @attempts
FROM generate_series(1, @n) g, LATERAL (SELECT now() - CAST(@from AS interval) + g * CAST(@every AS interval) AS ts) t`

// addOutboxRows inserts n outbox rows, the first created from ago plus every, the next every
// later, and so on, each with the UUIDv7 id of its creation time; each was sent sentAfter its
// creation, or, if sentAfter is "", is still unsent.
func (e *cleanupEnv) addOutboxRows(t *testing.T, n int, from, every, sentAfter string) {
	t.Helper()
	attempts := 0
	sent := any(sentAfter)
	if sentAfter == "" {
		sent, attempts = nil, 9 // parked: the broker refused it nine times
	}
	e.exec(t, outboxRowsSQL, map[string]any{"n": n, "from": from, "every": every, "sent_after": sent, "attempts": attempts})
}

var inboxRowsSQL = `INSERT INTO inbox_messages (message_id, consumer, processed_at)
SELECT ` + testenv.UUIDv7SQL("ts", "n") + `, consumer, ts + interval '10 ms'
FROM generate_series(1, @n) g,
     LATERAL (SELECT now() - CAST(@from AS interval) + (g / 64) * CAST(@every AS interval) AS ts, nextval('test_ids') AS n) m,
     unnest(ARRAY['invoicing', 'notification']) consumer`

// addInboxRecords inserts n messages, each recorded by two consumers, handled from ago on in
// transactions of 64 messages every every: the 128 records of one transaction share their
// processed_at.
func (e *cleanupEnv) addInboxRecords(t *testing.T, n int, from, every string) {
	t.Helper()
	e.exec(t, inboxRowsSQL, map[string]any{"n": n, "from": from, "every": every})
}

// deletedMetric returns outbox_cleanup_deleted_total for table.
func (e *cleanupEnv) deletedMetric(t *testing.T, table string) float64 {
	t.Helper()
	families, err := e.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "outbox_cleanup_deleted_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "table" && l.GetValue() == table {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

const week = 7 * 24 * time.Hour

// A million sent rows past the retention go, in bounded batches; every unsent row stays, the
// oldest too, and so does every row sent within the retention.
func TestDeleteSentOutboxMessagesInBatches(t *testing.T) {
	t.Parallel()
	e := newCleanupEnv(t)
	start := time.Now()
	e.addOutboxRows(t, 1_000_000, "10 days", "172.8 ms", "50 ms") // sent, 10 to 8 days ago
	e.addOutboxRows(t, 1_000, "10 days", "172.8 s", "")           // parked among them
	e.addOutboxRows(t, 1, "365 days", "1 s", "")                  // parked for a year: first in the key
	e.addOutboxRows(t, 1, "10 days", "1 s", "9 days")             // created long ago, sent yesterday
	e.addOutboxRows(t, 10_000, "6 days", "51.84 s", "50 ms")      // sent within the retention
	e.addOutboxRows(t, 100, "6 days", "5184 s", "")               // recent, unsent
	t.Logf("inserted 1,011,102 rows in %s", time.Since(start).Round(time.Millisecond))

	start = time.Now()
	res, err := messaging.DeleteSentOutboxMessages(context.Background(), e.pool, week, e.opts)
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("deleted %d rows in %d batches in %s", res.Deleted, res.Batches, took.Round(time.Millisecond))
	// 100 full batches, then one that finds nothing left, and one that finds no id far ahead.
	if res.Deleted != 1_000_000 || res.Batches != 102 || res.Skipped {
		t.Fatalf("cleanup = %+v, want 1,000,000 rows deleted in 102 batches", res)
	}
	if old := testenv.Count(t, e.db, "SELECT count(*) FROM outbox_messages WHERE processed_at < now() - interval '7 days'"); old != 0 {
		t.Errorf("%d rows sent more than 7 days ago are left", old)
	}
	if unsent := testenv.Count(t, e.db, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL"); unsent != 1_101 {
		t.Errorf("%d unsent rows left, want all 1,101", unsent)
	}
	if recent := testenv.Count(t, e.db, "SELECT count(*) FROM outbox_messages WHERE processed_at >= now() - interval '7 days'"); recent != 10_001 {
		t.Errorf("%d rows sent within the retention left, want all 10,001", recent)
	}
	if got := e.deletedMetric(t, "outbox_messages"); got != 1_000_000 {
		t.Errorf("outbox_cleanup_deleted_total{table=\"outbox_messages\"} = %v, want 1,000,000", got)
	}
}

// Old unsent rows first in the key, more of them than a batch holds (parked, or a backlog that
// waited out a long outage), do not end the run before the sent rows behind them: a batch
// takes sent rows alone. Had it taken every old row, and deleted only the sent ones, a batch of
// unsent rows alone would delete nothing and end every run there, for good.
func TestOldUnsentRowsDoNotStopTheOutboxCleanup(t *testing.T) {
	t.Parallel()
	e := newCleanupEnv(t)
	e.addOutboxRows(t, 50, "30 days", "1 s", "")    // unsent, the oldest
	e.addOutboxRows(t, 50, "20 days", "1 s", "1 s") // sent, past the retention
	e.opts.BatchSize = 10
	res, err := messaging.DeleteSentOutboxMessages(context.Background(), e.pool, week, e.opts)
	if err != nil {
		t.Fatal(err)
	}
	if res.Deleted != 50 {
		t.Errorf("cleanup = %+v, want the 50 sent rows deleted", res)
	}
	if unsent := testenv.Count(t, e.db, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL"); unsent != 50 {
		t.Errorf("%d unsent rows left, want all 50", unsent)
	}
}

// A sent row that an operator re-queues while a batch is deleting it stays, unsent: the
// DELETE waits for the re-queue's row lock, then looks at the row's new version, which it no
// longer takes. The rest of the batch goes. (PostgreSQL's current releases pass over that
// version for its changed ctid too; older ones by the DELETE's own test of processed_at.)
func TestARowRequeuedUnderTheOutboxCleanupStays(t *testing.T) {
	t.Parallel()
	e := newCleanupEnv(t)
	e.addOutboxRows(t, 20, "10 days", "1 s", "50 ms")
	var requeued string
	must(t, e.db.Raw("SELECT id::text FROM outbox_messages ORDER BY id LIMIT 1").Scan(&requeued).Error)

	requeue := e.db.Begin()
	defer requeue.Rollback()
	must(t, requeue.Exec("UPDATE outbox_messages SET processed_at = NULL, next_attempt_at = now() WHERE id = ?", requeued).Error)
	type outcome struct {
		res messaging.CleanupResult
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := messaging.DeleteSentOutboxMessages(context.Background(), e.pool, week, e.opts)
		done <- outcome{res, err}
	}()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, e.db, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'") == 1
	}, "the cleanup's batch is not waiting for the re-queued row")
	must(t, requeue.Commit().Error)

	var got outcome
	select {
	case got = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the cleanup did not finish within 30 s of the re-queue's commit")
	}
	if got.err != nil || got.res.Deleted != 19 {
		t.Fatalf("cleanup = %+v, %v; want the 19 rows still sent deleted", got.res, got.err)
	}
	if left := testenv.Count(t, e.db, "SELECT count(*) FROM outbox_messages WHERE id = ? AND processed_at IS NULL", requeued); left != 1 {
		t.Fatalf("the re-queued row %s is gone or sent: %d unsent rows of that id, want 1", requeued, left)
	}
	if left := testenv.Count(t, e.db, "SELECT count(*) FROM outbox_messages"); left != 1 {
		t.Errorf("%d rows left, want the re-queued one alone", left)
	}
}

// A sent row whose id's time is far ahead of the database's clock (a business time made into
// an id, a host whose clock was years out) goes with the rows sent before the cutoff, by its
// processed_at, in batches: the walk by the time in the ids would wait for that time, in 2100.
// One unsent stays, as does one sent within the retention, and one a little ahead (clocks that
// disagree), which waits for its time.
func TestSentRowsWhoseIDsAreFarAheadAreDeleted(t *testing.T) {
	t.Parallel()
	e := newCleanupEnv(t)
	e.exec(t, `INSERT INTO outbox_messages (id, type, payload, occurred_at, processed_at, attempts)
SELECT `+testenv.UUIDv7SQL("id_at", "nextval('test_ids')")+`, 'OrderPlaced', '{}', now(), sent, 0
FROM (SELECT timestamptz '2100-01-01' + g * interval '1 ms' AS id_at, now() - interval '8 days' AS sent
      FROM generate_series(1, 25) g
      UNION ALL VALUES (timestamptz '2100-06-01', NULL),
                       (timestamptz '2100-07-01', now() - interval '1 day'),
                       (now() + interval '10 minutes', now() - interval '8 days')) r`)
	e.opts.BatchSize = 10
	res, err := messaging.DeleteSentOutboxMessages(context.Background(), e.pool, week, e.opts)
	if err != nil {
		t.Fatal(err)
	}
	if res.Deleted != 25 {
		t.Errorf("cleanup = %+v, want the 25 rows of 2100 sent 8 days ago deleted", res)
	}
	if left := testenv.Count(t, e.db, "SELECT count(*) FROM outbox_messages"); left != 3 {
		t.Errorf("%d rows left, want 3: the unsent one, the one sent yesterday, the one 10 minutes ahead", left)
	}
}

// Records past the retention go in bounded batches, also when a batch ends inside a group of
// records that share their processed_at; the younger ones stay.
func TestDeleteInboxMessagesInBatches(t *testing.T) {
	t.Parallel()
	e := newCleanupEnv(t)
	e.addInboxRecords(t, 150_000, "40 days", "30 s") // 300,000 records, 40 to 31 days old
	e.addInboxRecords(t, 5_000, "20 days", "1 h")    // 10,000 records within the retention

	start := time.Now()
	res, err := messaging.DeleteInboxMessages(context.Background(), e.pool, 30*24*time.Hour, e.opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("deleted %d records in %d batches in %s", res.Deleted, res.Batches, time.Since(start).Round(time.Millisecond))
	if res.Deleted != 300_000 || res.Batches != 31 || res.Skipped {
		t.Fatalf("cleanup = %+v, want 300,000 records deleted in 31 batches", res)
	}
	if left := testenv.Count(t, e.db, "SELECT count(*) FROM inbox_messages"); left != 10_000 {
		t.Errorf("%d records left, want the 10,000 recent ones", left)
	}
	if got := e.deletedMetric(t, "inbox_messages"); got != 300_000 {
		t.Errorf("outbox_cleanup_deleted_total{table=\"inbox_messages\"} = %v, want 300,000", got)
	}
}

// An inbox cleanup without a retention (an unset setting) is refused and deletes nothing: it
// would delete the record of a batch whose ack has yet to reach the broker, and its
// redelivery would be handled again.
func TestInboxCleanupRefusesNoRetention(t *testing.T) {
	t.Parallel()
	e := newCleanupEnv(t)
	e.addInboxRecords(t, 10, "1 s", "1 ms")
	for _, olderThan := range []time.Duration{0, -time.Hour} {
		if _, err := messaging.DeleteInboxMessages(context.Background(), e.pool, olderThan, e.opts); err == nil || !strings.Contains(err.Error(), "olderThan") {
			t.Errorf("DeleteInboxMessages(%s) = %v, want an error naming olderThan", olderThan, err)
		}
	}
	if left := testenv.Count(t, e.db, "SELECT count(*) FROM inbox_messages"); left != 20 {
		t.Fatalf("%d records left, want all 20", left)
	}
}

// While one runner cleans the outbox, a second one (another replica) skips its turn without
// an error, and an inbox cleanup of the same database still runs. Once the first is done, the
// lock is free again.
func TestCleanupRunsOnceAcrossRunners(t *testing.T) {
	t.Parallel()
	e := newCleanupEnv(t)
	e.addOutboxRows(t, 20_000, "10 days", "1 s", "50 ms")
	e.addInboxRecords(t, 1_000, "40 days", "1 s")

	// Hold the oldest sent row: the first runner's first batch waits for it, lock in hand.
	blocker := e.db.Begin()
	if err := blocker.Exec("SELECT 1 FROM outbox_messages ORDER BY id LIMIT 1 FOR UPDATE").Error; err != nil {
		t.Fatal(err)
	}
	type outcome struct {
		res messaging.CleanupResult
		err error
	}
	first := make(chan outcome, 1)
	go func() {
		res, err := messaging.DeleteSentOutboxMessages(context.Background(), e.pool, week, e.opts)
		first <- outcome{res, err}
	}()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, e.db, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'") == 1
	}, "the first runner's batch is not waiting for the held row")

	// Bounded: a second runner that ignored the lock would wait on the held row, and the test
	// must fail saying so, not hang.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	second, err := messaging.DeleteSentOutboxMessages(ctx, e.pool, week, e.opts)
	if err != nil || !second.Skipped || second.Deleted != 0 || second.Batches != 0 {
		t.Fatalf("second runner: %+v, %v; want it skipped, without an error", second, err)
	}
	inbox, err := messaging.DeleteInboxMessages(context.Background(), e.pool, 30*24*time.Hour, e.opts)
	if err != nil || inbox.Skipped || inbox.Deleted != 2_000 {
		t.Fatalf("inbox cleanup beside it: %+v, %v; want its 2,000 records deleted", inbox, err)
	}

	if err := blocker.Rollback().Error; err != nil {
		t.Fatal(err)
	}
	var got outcome
	select {
	case got = <-first:
	case <-time.After(30 * time.Second):
		t.Fatal("the first runner did not finish within 30 s of the row's release")
	}
	if got.err != nil || got.res.Skipped || got.res.Deleted != 20_000 {
		t.Fatalf("first runner: %+v, %v; want all 20,000 rows deleted", got.res, got.err)
	}
	if m := e.deletedMetric(t, "outbox_messages"); m != 20_000 {
		t.Errorf("outbox_cleanup_deleted_total{table=\"outbox_messages\"} = %v, want 20,000: the first runner's rows only", m)
	}
	again, err := messaging.DeleteSentOutboxMessages(context.Background(), e.pool, week, e.opts)
	if err != nil || again.Skipped || again.Deleted != 0 {
		t.Fatalf("a run after both: %+v, %v; want it to take the lock and find nothing", again, err)
	}
}

// The cleanup lock is a schema's: while a runner cleans one service's outbox (in public), a
// second service's, in a schema of its own in the same database, is cleaned all the same, and
// a second runner of the first service's still skips. Keyed by the table alone, the lock kept
// every other service's cleanup out.
func TestCleanupsOfTwoSchemasInOneDatabaseDoNotKeepEachOtherOut(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1) // the second service's pool
	e := newCleanupEnv(t)
	e.addOutboxRows(t, 2_000, "10 days", "1 s", "50 ms")
	e.exec(t, "CREATE SCHEMA billing")
	billing := pgxdriver.New(billingPool(t, e.url)).DB()
	ctx := context.Background()
	must(t, messaging.MigrateOutbox(ctx, billing))
	must(t, e.db.Transaction(func(tx *gorm.DB) error {
		if err := tx.Exec("SET LOCAL search_path = billing, public").Error; err != nil {
			return err
		}
		return tx.Exec(outboxRowsSQL, map[string]any{"n": 1_000, "from": "10 days", "every": "1 s", "sent_after": "50 ms", "attempts": 0}).Error
	}))

	// Hold public's oldest sent row: the first runner's first batch waits for it, lock in hand.
	blocker := e.db.Begin()
	defer blocker.Rollback()
	must(t, blocker.Exec("SELECT 1 FROM public.outbox_messages ORDER BY id LIMIT 1 FOR UPDATE").Error)
	first := make(chan error, 1)
	go func() {
		_, err := messaging.DeleteSentOutboxMessages(ctx, e.pool, week, e.opts)
		first <- err
	}()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, e.db, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'") == 1
	}, "the first runner's batch is not waiting for the held row")

	bctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	other, err := messaging.DeleteSentOutboxMessages(bctx, billing, week, messaging.CleanupOptions{})
	if err != nil || other.Skipped || other.Deleted != 1_000 {
		t.Errorf("billing's cleanup beside public's: %+v, %v; want its 1,000 rows deleted", other, err)
	}
	second, err := messaging.DeleteSentOutboxMessages(bctx, e.pool, week, e.opts)
	if err != nil || !second.Skipped {
		t.Errorf("a second runner of public's: %+v, %v; want it skipped", second, err)
	}

	must(t, blocker.Rollback().Error)
	select {
	case err := <-first:
		must(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the first runner did not finish within 30 s of the row's release")
	}
}

// Cancelling the context stops a cleanup promptly, with whole batches deleted and counted, and
// the lock released for the next run, which deletes the rest.
func TestCleanupStopsWhenCancelled(t *testing.T) {
	t.Parallel()
	e := newCleanupEnv(t)
	const rows, batch = 200_000, 500
	e.addOutboxRows(t, rows, "10 days", "1 s", "50 ms")
	opts := e.opts
	opts.BatchSize = batch

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type outcome struct {
		res messaging.CleanupResult
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := messaging.DeleteSentOutboxMessages(ctx, e.pool, week, opts)
		done <- outcome{res, err}
	}()
	testenv.Eventually(t, 30*time.Second, func() bool { return e.deletedMetric(t, "outbox_messages") > 0 },
		"no batch was deleted")
	cancel()
	cancelled := time.Now()
	var got outcome
	select {
	case got = <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the cleanup did not stop within 5 s of the cancellation")
	}
	t.Logf("stopped %s after the cancellation, after %d batches", time.Since(cancelled).Round(time.Microsecond), got.res.Batches)
	if !errors.Is(got.err, context.Canceled) {
		t.Fatalf("cleanup returned %v, want context.Canceled", got.err)
	}
	if got.res.Deleted == 0 || got.res.Deleted >= rows || got.res.Deleted%batch != 0 {
		t.Fatalf("cancelled cleanup deleted %d rows, want some whole batches of %d and not all %d", got.res.Deleted, batch, rows)
	}
	if left := testenv.Count(t, e.db, "SELECT count(*) FROM outbox_messages"); left != rows-got.res.Deleted {
		t.Fatalf("%d rows left after deleting %d of %d", left, got.res.Deleted, rows)
	}
	if m := e.deletedMetric(t, "outbox_messages"); m != float64(got.res.Deleted) {
		t.Fatalf("outbox_cleanup_deleted_total = %v, want the %d rows deleted", m, got.res.Deleted)
	}

	// An interrupted batch runs on in its server session until it finds its client gone; the
	// lock goes with that session, a batch's time later.
	var rest messaging.CleanupResult
	testenv.Eventually(t, 10*time.Second, func() bool {
		var err error
		if rest, err = messaging.DeleteSentOutboxMessages(context.Background(), e.pool, week, opts); err != nil {
			t.Fatal(err)
		}
		return !rest.Skipped
	}, "the lock was not released")
	if rest.Deleted != rows-got.res.Deleted {
		t.Fatalf("the next run deleted %d rows, want the %d left", rest.Deleted, rows-got.res.Deleted)
	}
}
