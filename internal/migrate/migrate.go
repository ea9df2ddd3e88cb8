// Package migrate applies embedded, numbered SQL migrations (goose files) to PostgreSQL,
// safely when several replicas start at once.
package migrate

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"time"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"
	"github.com/pressly/goose/v3/lock"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// lockRetry is the pause between a migration's attempts to take its tables' locks.
var lockRetry = messaging.Backoff{Base: time.Second, Max: 30 * time.Second}

// lockPoll is how often a replica tries the advisory lock that serialises replicas while
// another's migrations hold it, so that it starts within about a second of their end; lockLog
// is how often it says it still waits.
const (
	lockPoll = time.Second
	lockLog  = time.Minute
)

// Up applies the migrations at the root of fsys that are not yet recorded in versionTable.
// A PostgreSQL advisory lock serialises replicas that start at the same moment; the losers
// wait, however long the winner's migrations take, until ctx ends, logging at once and then
// every minute that they do, then find nothing left to do.
//
// Each migration's Up starts with SET LOCAL lock_timeout = '2s': an ALTER TABLE waiting for its
// table behind a long transaction (a report, a pg_dump) holds up every reader and writer of the
// table queued behind it, for as long as that transaction lasts. A migration that could not have
// its locks in time was rolled back; Up logs it and tries again after a pause, until ctx ends:
// a start that seems to hang says what it waits for.
//
// The migrations run with statement_timeout off, whatever the pool's, the role's or the
// database's: a step that reads a whole table (a VALIDATE CONSTRAINT) would outlast it, and
// fail (57014, not retried) at every start. ctx bounds them instead.
func Up(ctx context.Context, log *slog.Logger, db *sql.DB, fsys fs.FS, versionTable string) error {
	store, err := database.NewStore(database.DialectPostgres, versionTable)
	if err != nil {
		return fmt.Errorf("migrations %s: create store: %w", versionTable, err)
	}
	provider, err := goose.NewProvider("", db, fsys,
		goose.WithStore(store),
		goose.WithSessionLocker(migrationLock{log: log, versionTable: versionTable}),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return fmt.Errorf("migrations %s: %w", versionTable, err)
	}
	for attempt := 1; ; attempt++ {
		_, err := provider.Up(ctx)
		if !lockNotAvailable(err) {
			if err != nil {
				return fmt.Errorf("migrations %s: up: %w", versionTable, err)
			}
			return nil
		}
		pause := lockRetry.Delay(attempt)
		log.WarnContext(ctx, "migration waits for a lock another transaction holds; trying again",
			"version_table", versionTable, "attempt", attempt, "retry_in", pause, "error", err)
		select {
		case <-ctx.Done():
			return fmt.Errorf("migrations %s: %w: after %d attempts, each waiting for a lock another transaction holds: %w", versionTable, ctx.Err(), attempt, err)
		case <-time.After(pause):
		}
	}
}

// migrationLock is goose's session lock on its advisory lock key, which the library's
// MigrateOutbox and MigrateInbox take too. Unlike goose's own locker, which gives up after a
// fixed number of polls with an error told apart only by its wording, it waits until ctx ends.
type migrationLock struct {
	log          *slog.Logger
	versionTable string
}

// SessionLock takes the lock on conn, polling every lockPoll while another session holds it.
func (l migrationLock) SessionLock(ctx context.Context, conn *sql.Conn) error {
	start := time.Now()
	var logged time.Time
	for attempt := 1; ; attempt++ {
		var locked bool
		if err := conn.QueryRowContext(ctx, "SELECT pg_try_advisory_lock($1)", lock.DefaultLockID).Scan(&locked); err != nil {
			// The lock may have been taken all the same (ctx ended between the server's answer
			// and the scan): back in the pool, the session would hold it, and the next Up on it
			// take it twice and release it once. Its connection is closed instead (goose's own
			// Close then adds "connection is already closed" to the error).
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
			return fmt.Errorf("take the migration lock: %w", err)
		}
		if locked {
			return withoutStatementTimeout(ctx, conn)
		}
		if time.Since(logged) >= lockLog {
			l.log.WarnContext(ctx, "migration waits for another replica's migrations",
				"version_table", l.versionTable, "attempt", attempt, "waited", time.Since(start).Round(time.Second))
			logged = time.Now()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for another replica's migrations: %w", ctx.Err())
		case <-time.After(lockPoll):
		}
	}
}

// withoutStatementTimeout switches statement_timeout off for the session on conn, which goose
// runs the migrations on: as a session setting, since goose gives no way into the transaction
// of a migration for a SET LOCAL. SessionUnlock restores it. When it fails, the connection is
// closed, releasing the lock: the session may be left with the setting or without it.
func withoutStatementTimeout(ctx context.Context, conn *sql.Conn) error {
	if _, err := conn.ExecContext(ctx, "SET statement_timeout = 0"); err != nil {
		_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		return fmt.Errorf("switch statement_timeout off for the migrations: %w", err)
	}
	return nil
}

// SessionUnlock restores the session's statement_timeout, for the connection goes back to the
// pool, then releases the lock on conn, once: pg_advisory_unlock fails only on a session that
// does not hold the lock, or on a broken connection, whose session's end releases it; a retry
// (goose's, for a minute) mends neither. goose's context here never ends, hence the bound.
func (migrationLock) SessionUnlock(ctx context.Context, conn *sql.Conn) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := conn.ExecContext(ctx, "RESET statement_timeout"); err != nil {
		// Back in the pool without its timeout, the session would run the service's statements
		// unbounded; closed, it releases the lock too.
		_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		return fmt.Errorf("restore the session's statement_timeout: %w", err)
	}
	var unlocked bool
	if err := conn.QueryRowContext(ctx, "SELECT pg_advisory_unlock($1)", lock.DefaultLockID).Scan(&unlocked); err != nil {
		return fmt.Errorf("release the migration lock: %w", err)
	}
	if !unlocked {
		return errors.New("release the migration lock: the session did not hold it")
	}
	return nil
}

// lockNotAvailable reports whether err carries SQLSTATE 55P03, a lock_timeout's.
func lockNotAvailable(err error) bool {
	var coded interface{ SQLState() string }
	return errors.As(err, &coded) && coded.SQLState() == "55P03"
}
