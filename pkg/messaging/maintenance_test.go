package messaging_test

import (
	"context"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

func TestOutboxStats(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	ids := b.enqueue(t, 4)
	db := b.db.DB
	// Two sent long ago, one sent just now, one still pending, failing, and 90 s old.
	exec := func(q string, args ...any) {
		t.Helper()
		if err := db.Exec(q, args...).Error; err != nil {
			t.Fatal(err)
		}
	}
	exec("UPDATE outbox_messages SET processed_at = now() - interval '8 days' WHERE id IN ?", ids[:2])
	exec("UPDATE outbox_messages SET processed_at = now() WHERE id = ?", ids[2])
	exec("UPDATE outbox_messages SET attempts = 6, occurred_at = now() - interval '90 seconds' WHERE id = ?", ids[3])

	s, err := messaging.ReadOutboxStats(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if s.Pending != 1 || s.MaxAttempts != 6 || s.OldestPending < 89*time.Second || s.OldestPending > 100*time.Second {
		t.Fatalf("stats = %+v, want 1 pending, 6 attempts, about 90 s old", s)
	}

	messaging.RegisterOutboxStats(b.registry, db, b.log)
	wantMetric(t, b.registry, "outbox_pending_messages 1")
	wantMetric(t, b.registry, "outbox_max_attempts 6")
	wantMetric(t, b.registry, "outbox_stats_errors_total 0") // exported before any failure
}
