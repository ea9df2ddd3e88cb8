package messaging

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"

	"github.com/outboxkit/outbox-inbox/pkg/migrate"
)

// Schema holds the versioned SQL migrations of the package's own tables: schema/outbox for
// outbox_messages, schema/inbox for inbox_messages. They are goose files; a service that uses
// another migration tool can copy their Up sections.
//
//go:embed schema
var Schema embed.FS

// MigrateOutbox creates or upgrades outbox_messages. Its versions are recorded in the table
// messaging_outbox_schema, apart from the service's own migrations, so the two never collide.
func MigrateOutbox(ctx context.Context, db *sql.DB) error {
	return migrateSchema(ctx, db, "schema/outbox", "messaging_outbox_schema")
}

// MigrateInbox creates or upgrades inbox_messages, recording its versions in
// messaging_inbox_schema.
func MigrateInbox(ctx context.Context, db *sql.DB) error {
	return migrateSchema(ctx, db, "schema/inbox", "messaging_inbox_schema")
}

func migrateSchema(ctx context.Context, db *sql.DB, dir, versionTable string) error {
	sub, err := fs.Sub(Schema, dir)
	if err != nil {
		return fmt.Errorf("migrations %s: %w", versionTable, err)
	}
	return migrate.Up(ctx, db, sub, versionTable)
}
