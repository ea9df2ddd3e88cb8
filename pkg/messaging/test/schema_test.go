package test

import (
	"context"
	"io/fs"
	"testing"
	"testing/fstest"

	"github.com/outboxkit/outbox-inbox/internal/migrate"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
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
	if err := migrate.Up(context.Background(), sqlDB, v1, "messaging_outbox_schema"); err != nil {
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
