package test

import (
	"context"
	"database/sql"
	"io/fs"
	"log/slog"
	"net/url"
	"path"
	"strconv"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/outbox-inbox/internal/migrate"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/pgxdriver"
)

// Rows parked by outages before the relay stopped charging them are due at once after the
// upgrade; their attempts stay, and sent rows are left alone.
func TestUpgradeMakesParkedRowsDueNow(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	first, err := fs.ReadFile(messaging.Schema, "schema/outbox/00001_create_outbox_messages.sql")
	if err != nil {
		t.Fatal(err)
	}
	sqlDB, err := db.DB.DB()
	if err != nil {
		t.Fatal(err)
	}
	v1 := fstest.MapFS{"00001_create_outbox_messages.sql": {Data: first}}
	if err := migrate.Up(context.Background(), slog.New(slog.DiscardHandler), sqlDB, v1, "messaging_outbox_schema"); err != nil {
		t.Fatal(err)
	}
	if err := db.DB.Exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at, attempts, last_error, next_attempt_at, processed_at)
		VALUES (gen_random_uuid(), 'OrderPlaced', '{}', now(), 6, 'rabbitmq unavailable', now() + interval '1 hour', NULL),
		       (gen_random_uuid(), 'OrderPlaced', '{}', now(), 0, NULL, now() + interval '1 hour', now())`).Error; err != nil {
		t.Fatal(err)
	}

	if err := messaging.MigrateOutbox(context.Background(), db.Driver(t).DB()); err != nil {
		t.Fatal(err)
	}
	if n := testenv.Count(t, db.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL AND next_attempt_at <= now() AND attempts = 6"); n != 1 {
		t.Fatal("the parked row is not due now with its attempts kept")
	}
	if n := testenv.Count(t, db.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NOT NULL AND next_attempt_at > now()"); n != 1 {
		t.Fatal("the upgrade touched a sent row")
	}
}

// A migration that waits for a lock on outbox_messages (here behind a relay's batch that
// stays open) lets the callers' inserts through after migrationLockTimeout instead of holding
// them up for as long as that batch lasts, and is applied once the batch ends.
func TestAMigrationWaitingForALockDoesNotHoldUpTheWriters(t *testing.T) {
	t.Parallel()
	db, sqlDB := outboxDatabaseAt(t, 4)
	ctx := context.Background()
	const insert = `INSERT INTO outbox_messages (id, type, payload, occurred_at) VALUES (gen_random_uuid(), 'OrderPlaced', '{}', now())`
	if _, err := sqlDB.ExecContext(ctx, insert); err != nil {
		t.Fatal(err)
	}

	// A relay's batch: the unsent rows claimed, and the transaction open while it publishes.
	batch, err := sqlDB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = batch.Rollback() }()
	if _, err := batch.ExecContext(ctx, `SELECT id FROM outbox_messages WHERE processed_at IS NULL FOR UPDATE SKIP LOCKED`); err != nil {
		t.Fatal(err)
	}
	migrated := make(chan error, 1)
	go func() {
		mctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		migrated <- messaging.MigrateOutbox(mctx, db.Driver(t).DB())
	}()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, db.DB, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%ALTER TABLE outbox_messages%'`) == 1
	}, "the migration never waited for the batch's lock")

	// A caller's insert, queued behind the waiting ALTER TABLE.
	ictx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	start := time.Now()
	if _, err := sqlDB.ExecContext(ictx, insert); err != nil {
		t.Fatalf("an insert while the migration waited: %v", err)
	}
	if waited := time.Since(start); waited > 4*time.Second {
		t.Errorf("an insert waited %s behind the migration, want at most its 2 s lock timeout and a margin", waited.Round(time.Millisecond))
	}
	select {
	case err := <-migrated:
		t.Fatalf("the migration ended while the batch held its lock: %v", err)
	default:
	}

	if err := batch.Commit(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-migrated:
		if err != nil {
			t.Fatalf("the migration, once the batch ended: %v", err)
		}
	case <-time.After(45 * time.Second):
		t.Fatal("the migration was not applied within 45 s of the batch's end")
	}
	if n := testenv.Count(t, db.DB, `SELECT count(*) FROM messaging_outbox_schema WHERE version_id = 5 AND is_applied`); n != 1 {
		t.Errorf("version 5 recorded %d times, want once", n)
	}
}

// A replica whose pool sets a lock_timeout (as docs/library.md suggests for a consumer's) or a
// statement_timeout waits for another replica's migration to end, rather than failing its
// start at the lock.
func TestAMigrationWaitsForAnotherUnderThePoolsTimeouts(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1) // the migrating replica's pool
	db := testenv.NewDatabase(t)
	ctx := context.Background()
	sqlDB, err := db.DB.DB()
	must(t, err)
	other, err := sqlDB.Conn(ctx) // another replica, migrating
	must(t, err)
	defer other.Close()
	_, err = other.ExecContext(ctx, `SELECT pg_advisory_lock(4097083626)`)
	must(t, err)
	u, err := url.Parse(db.URL)
	must(t, err)
	q := u.Query()
	q.Set("lock_timeout", "200") // milliseconds
	q.Set("statement_timeout", "200")
	q.Set("pool_max_conns", "1")
	u.RawQuery = q.Encode()
	pool, err := pgxpool.New(ctx, u.String())
	must(t, err)
	defer pool.Close()
	migrated := make(chan error, 1)
	go func() {
		mctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		migrated <- messaging.MigrateOutbox(mctx, pgxdriver.New(pool).DB())
	}()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, db.DB, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event = 'advisory'`) == 1
	}, "the migration never waited for the other's lock")
	select {
	case err := <-migrated:
		t.Fatalf("the migration ended while another held the lock, past its pool's 200 ms lock_timeout and statement_timeout: %v", err)
	case <-time.After(time.Second): // five timeouts; a wrong end comes within one
	}
	_, err = other.ExecContext(ctx, `SELECT pg_advisory_unlock(4097083626)`)
	must(t, err)
	select {
	case err := <-migrated:
		must(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the migration did not end within 30 s of the other's")
	}
	if n := testenv.Count(t, db.DB, `SELECT count(*) FROM messaging_outbox_schema WHERE version_id > 0 AND is_applied`); n == 0 {
		t.Error("no migration recorded")
	}
}

// A migration that reads or writes the whole table (00006 makes due the rows a version before
// 00002 left never due, then validates 00005's check) outlasts the statement_timeout of the
// pool it runs through: with the pool's, such an upgrade would fail at every start.
func TestAMigrationOutlastsThePoolsStatementTimeout(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1) // the migrating pool
	db, sqlDB := outboxDatabaseAt(t, 4)
	ctx := context.Background()
	// 100,000 rows: 00006 updates them all (over a second here, on two cores), then reads them
	// to validate; the pool allows a statement 50 ms.
	_, err := sqlDB.ExecContext(ctx, `INSERT INTO outbox_messages (id, type, payload, occurred_at, next_attempt_at)
		SELECT gen_random_uuid(), 'OrderPlaced', '{}', now(), 'infinity' FROM generate_series(1, 100000)`)
	must(t, err)
	u, err := url.Parse(db.URL)
	must(t, err)
	q := u.Query()
	q.Set("statement_timeout", "50") // milliseconds
	q.Set("pool_max_conns", "1")
	u.RawQuery = q.Encode()
	pool, err := pgxpool.New(ctx, u.String())
	must(t, err)
	defer pool.Close()
	mctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := messaging.MigrateOutbox(mctx, pgxdriver.New(pool).DB()); err != nil {
		t.Fatalf("MigrateOutbox through a pool whose statement_timeout is 50 ms: %v", err)
	}
	if n := testenv.Count(t, db.DB, `SELECT count(*) FROM messaging_outbox_schema WHERE version_id = 6 AND is_applied`); n != 1 {
		t.Errorf("version 6 recorded %d times, want once", n)
	}
	if n := testenv.Count(t, db.DB, `SELECT count(*) FROM outbox_messages WHERE next_attempt_at = 'infinity'`); n != 0 {
		t.Errorf("%d rows left never due, want 0", n)
	}
}

// A version table in goose's layout says what is applied by its latest row per version: a
// version goose rolled back (its Down run, then a row with is_applied false, as goose has
// written it) is applied again, not taken as applied by its first row.
func TestAVersionRolledBackInGoosesLayoutIsAppliedAgain(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	ctx := context.Background()
	drv := db.Driver(t).DB()
	must(t, messaging.MigrateInbox(ctx, drv))
	must(t, db.DB.Exec(`DROP TABLE inbox_messages`).Error) // 00001's Down
	must(t, db.DB.Exec(`INSERT INTO messaging_inbox_schema (version_id, is_applied) VALUES (1, false)`).Error)
	must(t, messaging.MigrateInbox(ctx, drv))
	if n := testenv.Count(t, db.DB, `SELECT count(*) FROM pg_tables WHERE tablename = 'inbox_messages'`); n != 1 {
		t.Fatal("the rolled back version 1 was not applied again: no inbox_messages")
	}
}

// outboxDatabaseAt is a new database whose outbox is migrated up to version last, and its
// database/sql handle.
func outboxDatabaseAt(t *testing.T, last int) (*testenv.Database, *sql.DB) {
	t.Helper()
	db := testenv.NewDatabase(t)
	sqlDB, err := db.DB.DB()
	if err != nil {
		t.Fatal(err)
	}
	if err := migrate.Up(context.Background(), slog.New(slog.DiscardHandler), sqlDB, outboxMigrationsUpTo(t, last), "messaging_outbox_schema"); err != nil {
		t.Fatal(err)
	}
	return db, sqlDB
}

// outboxMigrationsUpTo is the outbox's migrations up to version last, as files for goose.
func outboxMigrationsUpTo(t *testing.T, last int) fstest.MapFS {
	t.Helper()
	files, err := fs.Glob(messaging.Schema, "schema/outbox/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	upTo := fstest.MapFS{}
	for _, f := range files {
		name := path.Base(f)
		if version, err := strconv.Atoi(name[:5]); err != nil || version > last {
			continue
		}
		raw, err := fs.ReadFile(messaging.Schema, f)
		if err != nil {
			t.Fatal(err)
		}
		upTo[name] = &fstest.MapFile{Data: raw}
	}
	if len(upTo) != last {
		t.Fatalf("%d outbox migrations up to version %d, want %d", len(upTo), last, last)
	}
	return upTo
}

// The library's tables end their migrations with every constraint validated: one added NOT
// VALID (00005's, so as not to read the table under ALTER TABLE's lock) is validated by a
// migration of its own, which first makes due a row that would fail it (never due and not
// parked, as a version before 00002 could leave it), so that the check cannot stop the upgrade.
func TestTheLibrarysTablesEndWithEveryConstraintValidated(t *testing.T) {
	t.Parallel()
	db, _ := outboxDatabaseAt(t, 4)
	ctx := context.Background()
	must(t, db.DB.Exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at, next_attempt_at)
		VALUES (gen_random_uuid(), 'OrderPlaced', '{}', now(), 'infinity')`).Error)
	must(t, messaging.MigrateOutbox(ctx, db.Driver(t).DB()))
	must(t, messaging.MigrateInbox(ctx, db.Driver(t).DB()))
	if n := testenv.Count(t, db.DB, `SELECT count(*) FROM pg_constraint
		WHERE NOT convalidated AND conrelid IN ('outbox_messages'::regclass, 'inbox_messages'::regclass)`); n != 0 {
		t.Errorf("%d constraints of the library's tables not validated after the migrations, want 0", n)
	}
	if n := testenv.Count(t, db.DB, "SELECT count(*) FROM outbox_messages WHERE next_attempt_at <= now()"); n != 1 {
		t.Errorf("the row never due and not parked is not due after the upgrade")
	}
}
