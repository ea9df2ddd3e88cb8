// Package migrate applies embedded, numbered SQL migrations (goose files) to PostgreSQL,
// safely when several replicas start at once.
package migrate

import (
	"context"
	"database/sql"
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

// lockRetry is the pause between a migration's attempts to take its locks.
var lockRetry = messaging.Backoff{Base: time.Second, Max: 30 * time.Second}

// lockPolls is how many times, a second apart, goose tries the advisory lock that serialises
// replicas before it gives up; Up then logs that it waits and tries again, as for a table's
// lock, however long another replica's migrations take.
var lockPolls uint64 = 60

// Up applies the migrations at the root of fsys that are not yet recorded in versionTable.
// A PostgreSQL advisory lock serialises replicas that start at the same moment; the losers
// wait, however long the winner's migrations take, until ctx ends, logging now and then that
// they do, then find nothing left to do.
//
// Each migration's Up starts with SET LOCAL lock_timeout = '2s': an ALTER TABLE waiting for its
// table behind a long transaction (a report, a pg_dump) holds up every reader and writer of the
// table queued behind it, for as long as that transaction lasts. A migration that could not have
// its locks in time was rolled back; Up logs it and tries again after a pause, until ctx ends:
// a start that seems to hang says what it waits for.
func Up(ctx context.Context, log *slog.Logger, db *sql.DB, fsys fs.FS, versionTable string) error {
	for attempt := 1; ; attempt++ {
		err := up(ctx, db, fsys, versionTable)
		if !lockNotAvailable(err) && !errors.Is(err, errMigrationLockHeld) {
			if err != nil {
				return fmt.Errorf("migrations %s: %w", versionTable, err)
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

// up makes one attempt at the migrations, with a locker of its own: goose's counts its polls
// for as long as it lives, so one that gave up once would give up again after a single poll.
func up(ctx context.Context, db *sql.DB, fsys fs.FS, versionTable string) error {
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockTimeout(1, lockPolls))
	if err != nil {
		return fmt.Errorf("create locker: %w", err)
	}
	store, err := database.NewStore(database.DialectPostgres, versionTable)
	if err != nil {
		return fmt.Errorf("create store: %w", err)
	}
	provider, err := goose.NewProvider("", db, fsys,
		goose.WithStore(store),
		goose.WithSessionLocker(heldLocker{locker}),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return err
	}
	if _, err := provider.Up(ctx); err != nil {
		return fmt.Errorf("up: %w", err)
	}
	return nil
}

// errMigrationLockHeld marks goose's giving up on the advisory lock another replica's
// migrations hold.
var errMigrationLockHeld = errors.New("another replica holds the migration lock")

// heldLocker is goose's session locker, its giving up on the lock marked errMigrationLockHeld:
// goose says so only in its message (its other failures wrap a cause, or are ctx's).
type heldLocker struct{ lock.SessionLocker }

func (l heldLocker) SessionLock(ctx context.Context, conn *sql.Conn) error {
	err := l.SessionLocker.SessionLock(ctx, conn)
	if err != nil && err.Error() == "failed to acquire lock" {
		return fmt.Errorf("%w: %w", errMigrationLockHeld, err)
	}
	return err
}

// lockNotAvailable reports whether err carries SQLSTATE 55P03, a lock_timeout's.
func lockNotAvailable(err error) bool {
	var coded interface{ SQLState() string }
	return errors.As(err, &coded) && coded.SQLState() == "55P03"
}
