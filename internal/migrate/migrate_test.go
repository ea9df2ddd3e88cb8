package migrate_test

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"github.com/pressly/goose/v3/lock"

	"github.com/outboxkit/outbox-inbox/internal/migrate"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// lockTimeout is the statement each service migration's Up starts with.
const lockTimeout = "SET LOCAL lock_timeout = '2s';"

// Every migration of every service starts its Up with the lock timeout, in a transaction (under
// goose's NO TRANSACTION, SET LOCAL would do nothing).
func TestEveryServiceMigrationBoundsItsWaitForALock(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("../../services/*/migrations/*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("no service migrations found: %v", err)
	}
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(raw), "+goose NO TRANSACTION") {
			t.Errorf("%s runs outside a transaction, where its lock timeout would do nothing", f)
		}
		if first := firstUpStatement(string(raw)); first != lockTimeout {
			t.Errorf("%s: its Up starts with %q, want %q", f, first, lockTimeout)
		}
	}
}

// firstUpStatement is the first line after "-- +goose Up" that is neither blank nor a comment.
func firstUpStatement(sql string) string {
	s := bufio.NewScanner(strings.NewReader(sql))
	up := false
	for s.Scan() {
		line := strings.TrimSpace(s.Text())
		switch {
		case line == "-- +goose Up":
			up = true
		case up && line != "" && !strings.HasPrefix(line, "--"):
			return line
		}
	}
	return ""
}

// A service migration that waits for its table's lock behind a long transaction (here a report
// reading orders) holds up no one: the readers and writers that come after it go first, each
// within its lock timeout, and the migration is applied once that transaction ends. It used to
// wait as long as the transaction lasted, every INSERT INTO orders queued behind it.
func TestAMigrationWaitingForALockDoesNotHoldUpTheWriters(t *testing.T) {
	t.Parallel()
	d, sqlDB := newDatabase(t)
	ctx := context.Background()
	orders := os.DirFS("../../services/order/migrations")
	first, err := os.ReadFile("../../services/order/migrations/00001_create_orders.sql")
	if err != nil {
		t.Fatal(err)
	}
	if err := migrate.Up(ctx, slog.New(slog.DiscardHandler), sqlDB, fstest.MapFS{"00001_create_orders.sql": {Data: first}}, "order_schema"); err != nil {
		t.Fatal(err)
	}
	report, err := sqlDB.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = report.Rollback() }()
	if _, err := report.ExecContext(ctx, `SELECT count(*) FROM orders`); err != nil {
		t.Fatal(err)
	}
	migrated, logs := upInBackground(t, sqlDB, orders, "order_schema")
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, d.DB, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%ALTER TABLE orders%'`) == 1
	}, "the migration never waited for the report's lock")

	// A writer, queued behind the waiting ALTER TABLE.
	ictx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	start := time.Now()
	if _, err := sqlDB.ExecContext(ictx, `INSERT INTO orders (id, customer_id, total_cents, created_at) VALUES (gen_random_uuid(), 'c-1', 100, now())`); err != nil {
		t.Fatalf("an insert while the migration waited: %v", err)
	}
	if waited := time.Since(start); waited > 4*time.Second {
		t.Errorf("an insert waited %s behind the migration, want at most its 2 s lock timeout and a margin", waited.Round(time.Millisecond))
	}
	select {
	case err := <-migrated:
		t.Fatalf("the migration ended while the report held its lock: %v", err)
	default:
	}
	// A start that seems to hang says what it waits for.
	testenv.Eventually(t, 10*time.Second, func() bool {
		return strings.Contains(logs.String(), `msg="migration waits for a lock another transaction holds; trying again" version_table=order_schema attempt=1`)
	}, "the migration's retry was not logged")

	if err := report.Commit(); err != nil {
		t.Fatal(err)
	}
	awaitUp(t, migrated, "the report's end")
	if n := testenv.Count(t, d.DB, `SELECT count(*) FROM orders WHERE status = 'placed'`); n != 1 {
		t.Errorf("%d placed orders after the migration, want the one inserted", n)
	}
}

// A service migration after a table's first adds its checks NOT VALID: checking the rows there
// are reads the whole table, and under ALTER TABLE's lock every reader and writer would wait for
// it; a migration of its own validates them later, under a lock they pass.
func TestServiceMigrationsCheckOldRowsOutsideTheirLock(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("../../services/*/migrations/*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("no service migrations found: %v", err)
	}
	for _, f := range files {
		if strings.HasPrefix(filepath.Base(f), "00001_") { // creates its tables: no rows yet
			continue
		}
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		up, _, _ := strings.Cut(string(raw), "-- +goose Down")
		for stmt := range strings.SplitSeq(withoutComments(up), ";") {
			// A statement of several checks needs each NOT VALID: as many as it has checks.
			if checks := checkClause.FindAllString(stmt, -1); len(checks) > len(notValid.FindAllString(stmt, -1)) {
				t.Errorf("%s adds a check that reads the whole table under its lock:\n%s", f, strings.TrimSpace(stmt))
			}
		}
	}
}

// checkClause and notValid find a check constraint's clause and its NOT VALID in SQL, in any
// case and spacing.
var (
	checkClause = regexp.MustCompile(`(?i)\bcheck\s*\(`)
	notValid    = regexp.MustCompile(`(?i)\bnot\s+valid\b`)
)

// withoutComments drops the -- comments of sql.
func withoutComments(sql string) string {
	var b strings.Builder
	for line := range strings.Lines(sql) {
		code, _, _ := strings.Cut(line, "--")
		b.WriteString(code + "\n")
	}
	return b.String()
}

// Each service's migrations, applied to an empty database, leave no constraint unvalidated:
// each check added NOT VALID has the migration that validates it.
func TestServiceSchemasEndWithEveryConstraintValidated(t *testing.T) {
	t.Parallel()
	services, err := filepath.Glob("../../services/*/migrations")
	if err != nil || len(services) == 0 {
		t.Fatalf("no service migrations found: %v", err)
	}
	testenv.Connections(t, len(services)*testenv.DefaultConnections)
	for _, dir := range services {
		d, sqlDB := newDatabase(t)
		if err := migrate.Up(context.Background(), slog.New(slog.DiscardHandler), sqlDB, os.DirFS(dir), "schema_versions"); err != nil {
			t.Fatalf("%s: %v", dir, err)
		}
		var unvalidated []string
		if err := d.DB.Raw("SELECT conrelid::regclass || '.' || conname FROM pg_constraint WHERE NOT convalidated").Scan(&unvalidated).Error; err != nil {
			t.Fatal(err)
		}
		if len(unvalidated) > 0 {
			t.Errorf("%s leaves %v not validated", dir, unvalidated)
		}
	}
}

// A replica that starts while another's migrations run waits for them however long they take,
// until its context ends, as it waits for a table's lock, and starts within about a second of
// their end. goose's locker gave up on the advisory lock that serialises replicas after its
// polls, and Up's retry of it then paused up to 30 s with nothing polling.
func TestMigrationsWaitForAnotherReplicasMigrationsUntilTheContextEnds(t *testing.T) {
	t.Parallel()
	d, sqlDB := newDatabase(t)
	ctx := context.Background()
	migrations := fstest.MapFS{"00001_create_t.sql": {Data: []byte("-- +goose Up\nCREATE TABLE t (id int);\n")}}
	replica, err := sqlDB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = replica.Close() }()
	if _, err := replica.ExecContext(ctx, "SELECT pg_advisory_lock($1)", lock.DefaultLockID); err != nil {
		t.Fatal(err)
	}
	const waiting = `msg="migration waits for another replica's migrations" version_table=t_schema attempt=1 `

	log, logs := testenv.NewLogger(t)
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	start := time.Now()
	if err := migrate.Up(short, log, sqlDB, migrations, "t_schema"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Up while another replica migrated, until its context ended: %v, want context.DeadlineExceeded", err)
	}
	if waited := time.Since(start); waited < 3*time.Second {
		t.Errorf("Up gave up after %s, before its context ended", waited.Round(time.Millisecond))
	}
	// Said at once, then once a minute: not at each poll.
	if n := strings.Count(logs.String(), "migration waits for another replica's"); n != 1 || !strings.Contains(logs.String(), waiting) {
		t.Errorf("Up's wait logged %d times, want once as %q:\n%s", n, waiting, logs)
	}

	migrated, logs := upInBackground(t, sqlDB, migrations, "t_schema")
	testenv.Eventually(t, 10*time.Second, func() bool { return strings.Contains(logs.String(), waiting) },
		"Up did not say it waits for the other replica's migrations")
	// Long enough that a retry on Up's backoff (pauses of 1, 2, 4, 8 s) would be in a pause
	// longer than the margin allowed below.
	time.Sleep(11 * time.Second)
	select {
	case err := <-migrated:
		t.Fatalf("Up ended while another replica migrated: %v", err)
	default:
	}
	if _, err := replica.ExecContext(ctx, "SELECT pg_advisory_unlock($1)", lock.DefaultLockID); err != nil {
		t.Fatal(err)
	}
	unlocked := time.Now()
	awaitUp(t, migrated, "the other replica's migrations' end")
	if took := time.Since(unlocked); took > 2500*time.Millisecond {
		t.Errorf("Up applied the migrations %s after the other replica's ended, want within its 1 s poll and a margin", took.Round(time.Millisecond))
	}
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM pg_tables WHERE tablename = 't'"); n != 1 {
		t.Errorf("%d tables t after the migrations, want 1", n)
	}
}

// Up says so when its session lost the migration lock before releasing it (here a migration
// released it), at once: goose's locker retried the release for a minute, which cannot mend it.
func TestMigrationsReportALostMigrationLockAtOnce(t *testing.T) {
	t.Parallel()
	_, sqlDB := newDatabase(t)
	unlock := fmt.Sprintf("-- +goose Up\nSELECT pg_advisory_unlock(%d);\n", lock.DefaultLockID)
	migrations := fstest.MapFS{"00001_unlock.sql": {Data: []byte(unlock)}}
	start := time.Now()
	err := migrate.Up(context.Background(), slog.New(slog.DiscardHandler), sqlDB, migrations, "t_schema")
	if err == nil || !strings.Contains(err.Error(), "release the migration lock: the session did not hold it") {
		t.Errorf("Up whose session lost the migration lock: %v, want it said", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Up said so after %s, want at once", took.Round(time.Millisecond))
	}
}

// A migration outlasts a statement_timeout set for the database (or the role), as one that
// validates a check over a large table does: with it, such an upgrade failed (57014) at every
// start. The connection goes back to the pool with the database's timeout.
func TestAMigrationOutlastsTheDatabasesStatementTimeout(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1) // the migrating pool
	d, _ := newDatabase(t)
	if err := d.DB.Exec("ALTER DATABASE " + d.Name + " SET statement_timeout = '50ms'").Error; err != nil {
		t.Fatal(err)
	}
	// A pool of one, opened after the ALTER: its session has the timeout, and Up and the check
	// after it share that session.
	sqlDB, err := testenv.OpenPool(t, d.URL, 1).DB()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	slow := fstest.MapFS{"00001_slow.sql": {Data: []byte("-- +goose Up\n" + lockTimeout + "\nSELECT pg_sleep(0.2);\n")}}
	if err := migrate.Up(ctx, slog.New(slog.DiscardHandler), sqlDB, slow, "t_schema"); err != nil {
		t.Fatalf("Up of a 200 ms migration under a statement_timeout of 50 ms: %v", err)
	}
	var timeout string
	if err := sqlDB.QueryRowContext(ctx, "SHOW statement_timeout").Scan(&timeout); err != nil {
		t.Fatal(err)
	}
	if timeout != "50ms" {
		t.Errorf("statement_timeout after Up is %s, want the database's 50ms back", timeout)
	}
}

// newDatabase is a database of the test's own, and its database/sql pool, which Up takes.
func newDatabase(t *testing.T) (*testenv.Database, *sql.DB) {
	t.Helper()
	d := testenv.NewDatabase(t)
	sqlDB, err := d.DB.DB()
	if err != nil {
		t.Fatal(err)
	}
	return d, sqlDB
}

// upInBackground runs Up of fsys, for a minute at most, and returns the channel of its result
// and its log.
func upInBackground(t *testing.T, db *sql.DB, fsys fs.FS, versionTable string) (<-chan error, *testenv.Logs) {
	t.Helper()
	migrated := make(chan error, 1)
	log, logs := testenv.NewLogger(t)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		migrated <- migrate.Up(ctx, log, db, fsys, versionTable)
	}()
	return migrated, logs
}

// awaitUp fails t unless Up succeeds within 40 s of after, what it waited for.
func awaitUp(t *testing.T, migrated <-chan error, after string) {
	t.Helper()
	select {
	case err := <-migrated:
		if err != nil {
			t.Fatalf("the migrations, after %s: %v", after, err)
		}
	case <-time.After(40 * time.Second):
		t.Fatalf("the migrations were not applied within 40 s of %s", after)
	}
}
