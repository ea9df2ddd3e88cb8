// Package migrate applies embedded, numbered SQL migrations (goose files) to PostgreSQL,
// safely when several replicas start at once.
package migrate

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"
	"github.com/pressly/goose/v3/lock"
)

// Up applies the migrations at the root of fsys that are not yet recorded in versionTable.
// A PostgreSQL advisory lock serialises replicas that start at the same moment; the losers
// wait, then find nothing left to do.
func Up(ctx context.Context, db *sql.DB, fsys fs.FS, versionTable string) error {
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
	if _, err := provider.Up(ctx); err != nil {
		return fmt.Errorf("migrations %s: up: %w", versionTable, err)
	}
	return nil
}
