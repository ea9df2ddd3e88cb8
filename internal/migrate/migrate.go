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

// Up applies the migrations at the root of fsys that are not yet recorded in versionTable.
// A PostgreSQL advisory lock serialises replicas that start at the same moment; the losers
// wait, then find nothing left to do.
//
// Each migration's Up starts with SET LOCAL lock_timeout = '2s': an ALTER TABLE waiting for its
// table behind a long transaction (a report, a pg_dump) holds up every reader and writer of the
// table queued behind it, for as long as that transaction lasts. A migration that could not have
// its locks in time was rolled back; Up logs it and tries again after a pause, until ctx ends:
// a start that seems to hang says what it waits for.
func Up(ctx context.Context, log *slog.Logger, db *sql.DB, fsys fs.FS, versionTable string) error {
	// Poll the lock every second (the default is 5 s), for up to five minutes.
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockTimeout(1, 300))
	if err != nil {
		return fmt.Errorf("migrations %s: create locker: %w", versionTable, err)
	}
	store, err := database.NewStore(database.DialectPostgres, versionTable)
	if err != nil {
		return fmt.Errorf("migrations %s: create store: %w", versionTable, err)
	}
	provider, err := goose.NewProvider("", db, fsys,
		goose.WithStore(store),
		goose.WithSessionLocker(locker),
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

// lockNotAvailable reports whether err carries SQLSTATE 55P03, a lock_timeout's.
func lockNotAvailable(err error) bool {
	var coded interface{ SQLState() string }
	return errors.As(err, &coded) && coded.SQLState() == "55P03"
}
