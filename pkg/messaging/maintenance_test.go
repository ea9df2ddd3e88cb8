package messaging_test

import (
	"context"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

func TestOutboxStatsAndCleanup(t *testing.T) {
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

	messaging.RegisterOutboxStats(b.registry, db)
	wantMetric(t, b.registry, "outbox_pending_messages 1")
	wantMetric(t, b.registry, "outbox_max_attempts 6")

	n, err := messaging.DeleteSentOutboxMessages(ctx, db, 7*24*time.Hour)
	if err != nil || n != 2 {
		t.Fatalf("deleted %d (%v), want the 2 rows sent 8 days ago", n, err)
	}
	exec("UPDATE outbox_messages SET occurred_at = now() - interval '30 days' WHERE id = ?", ids[3])
	if n, err := messaging.DeleteSentOutboxMessages(ctx, db, time.Hour); err != nil || n != 0 {
		t.Fatalf("deleted %d (%v), want 0: the recent one is too young, the unsent one is never deleted", n, err)
	}
	if left := testenv.Count(t, db, "SELECT count(*) FROM outbox_messages"); left != 2 {
		t.Fatalf("%d rows left, want 2", left)
	}

	exec("INSERT INTO inbox_messages (message_id, consumer, processed_at) VALUES (?, 'a', now() - interval '31 days'), (?, 'a', now())", ids[0], ids[1])
	if n, err := messaging.DeleteInboxMessages(ctx, db, 30*24*time.Hour); err != nil || n != 1 {
		t.Fatalf("deleted %d inbox rows (%v), want 1", n, err)
	}
}
