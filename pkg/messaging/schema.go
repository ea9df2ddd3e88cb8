package messaging

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"
	"github.com/pressly/goose/v3/lock"
)

// Schema holds the versioned SQL migrations of the package's own tables: schema/outbox for
// outbox_messages, schema/inbox for inbox_messages. They are goose files; a service that uses
// another migration tool can copy their Up sections.
//
//go:embed schema
var Schema embed.FS

// MigrateOutbox creates or upgrades outbox_messages. Its versions are recorded in the table
// messaging_outbox_schema, so they never collide with the service's own migrations.
func MigrateOutbox(ctx context.Context, db *sql.DB) error {
	return migrate(ctx, db, "schema/outbox", "messaging_outbox_schema")
}

// MigrateInbox creates or upgrades inbox_messages, recording its versions in
// messaging_inbox_schema.
func MigrateInbox(ctx context.Context, db *sql.DB) error {
	return migrate(ctx, db, "schema/inbox", "messaging_inbox_schema")
}

// RunMigrations applies the goose migrations found at the root of fsys, recording them in
// versionTable. A PostgreSQL advisory lock serialises replicas that start at the same moment.
func RunMigrations(ctx context.Context, db *sql.DB, fsys fs.FS, versionTable string) error {
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

func migrate(ctx context.Context, db *sql.DB, dir, versionTable string) error {
	sub, err := fs.Sub(Schema, dir)
	if err != nil {
		return fmt.Errorf("migrations %s: %w", versionTable, err)
	}
	return RunMigrations(ctx, db, sub, versionTable)
}
