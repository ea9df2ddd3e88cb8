package test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// parkedOutbox is a database with the library's tables and n rows enqueued, oldest first.
func parkedOutbox(t *testing.T, n int) (*testenv.Database, messaging.DB, []uuid.UUID) {
	t.Helper()
	d := testenv.NewDatabase(t)
	d.MigrateLibrary(t)
	drv := d.Driver(t)
	ids := make([]uuid.UUID, n)
	err := d.DB.Transaction(func(tx *gorm.DB) error {
		for i := range ids {
			m, err := messaging.NewMessage("OrderPlaced", map[string]int{"n": i})
			if err != nil {
				return err
			}
			m.OccurredAt = time.Now().Add(time.Duration(i-n) * time.Minute)
			ids[i] = m.ID
			if err := messaging.Enqueue(context.Background(), drv, tx, m); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return d, drv.DB(), ids
}

// parkExec runs a statement on d, or fails the test.
func parkExec(t *testing.T, d *testenv.Database, query string, args ...any) {
	t.Helper()
	if err := d.DB.Exec(query, args...).Error; err != nil {
		t.Fatal(err)
	}
}

// claimed runs the relay's claim, as the relay does, in a transaction it rolls back, and
// returns the ids it took.
func claimed(t *testing.T, db messaging.DB) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, statements.ClaimPlan); err != nil {
		t.Fatal(err)
	}
	rows, err := tx.Query(ctx, `SELECT id FROM (`+statements.Claim+`) c`, 100)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var ids []uuid.UUID
	for rows.Next() {
		var id uuid.UUID
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return ids
}

// gauges reads the gauges reg exports, by name.
func gauges(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range families {
		if g := f.GetMetric()[0].GetGauge(); g != nil {
			out[f.GetName()] = g.GetValue()
		}
	}
	return out
}

// A parked row is never claimed, never retried with the others, counts apart in the stats and
// the gauges, and comes back due, with its history, when unparked.
func TestParkedRowIsSetApart(t *testing.T) {
	t.Parallel()
	d, db, ids := parkedOutbox(t, 4)
	ctx := context.Background()
	// Row 0, the oldest, fails forever; row 1 failed once and waits out its backoff.
	parkExec(t, d, `UPDATE outbox_messages SET attempts = 40, last_error = 'message too large', next_attempt_at = now() + interval '5 minutes' WHERE id = ?`, ids[0])
	parkExec(t, d, `UPDATE outbox_messages SET attempts = 1, last_error = 'nacked', next_attempt_at = now() + interval '2 seconds' WHERE id = ?`, ids[1])
	parkExec(t, d, `UPDATE outbox_messages SET processed_at = now() WHERE id = ?`, ids[3])

	row, err := messaging.ParkOutboxMessage(ctx, db, ids[0], "over the broker's limit")
	if err != nil {
		t.Fatal(err)
	}
	if !row.Parked() || *row.ParkedReason != "over the broker's limit" || !row.NextAttemptAt.IsZero() || row.Attempts != 40 || row.Payload == nil {
		t.Errorf("ParkOutboxMessage returned %+v", row)
	}
	if got := claimed(t, db); len(got) != 1 || got[0] != ids[2] {
		t.Errorf("the claim took %v, want only row 2 (row 0 parked, row 1 not due, row 3 sent)", got)
	}
	s, err := messaging.ReadOutboxStats(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	// Rows 0 to 3 occurred 4 to 1 minutes ago: the oldest unsent row, the parked one aside, is row 1.
	if s.Pending != 2 || s.Parked != 1 || s.MaxAttempts != 1 || s.OldestPending < 3*time.Minute || s.OldestPending >= 4*time.Minute {
		t.Errorf("stats %+v; want 2 pending, 1 parked, at most 1 attempt, the oldest 3 minutes old", s)
	}
	reg := prometheus.NewRegistry()
	if err := messaging.RegisterOutboxStats(reg, "", db, nil); err != nil {
		t.Fatal(err)
	}
	g := gauges(t, reg)
	if g["outbox_pending_messages"] != 2 || g["outbox_parked_messages"] != 1 || g["outbox_max_attempts"] != 1 {
		t.Errorf("gauges %v; want 2 pending, 1 parked, max attempts 1", g)
	}
	failing, err := messaging.FailingOutboxMessages(ctx, db, 10)
	if err != nil || len(failing) != 1 || failing[0].ID != ids[1] {
		t.Errorf("FailingOutboxMessages = %v, %v; want row 1 only", failing, err)
	}
	parked, err := messaging.ParkedOutboxMessages(ctx, db, 10)
	if err != nil || len(parked) != 1 || parked[0].ID != ids[0] || *parked[0].ParkedReason != "over the broker's limit" || parked[0].Payload != nil {
		t.Errorf("ParkedOutboxMessages = %+v, %v; want row 0 with its reason", parked, err)
	}
	waiting, err := messaging.WaitingOutboxMessages(ctx, db, messaging.OutboxFilter{})
	if err != nil || len(waiting) != 1 || waiting[0].ID != ids[1] {
		t.Errorf("WaitingOutboxMessages = %v, %v; want row 1 only", waiting, err)
	}
	for _, tc := range []struct {
		f    messaging.OutboxFilter
		want []uuid.UUID
	}{{messaging.OutboxFilter{}, ids[1:2]}, {messaging.OutboxFilter{Type: "NoSuchType"}, nil}} {
		if got, err := messaging.WaitingOutboxMessageIDs(ctx, db, tc.f); err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("WaitingOutboxMessageIDs(%+v) = %v, %v; want %v", tc.f, got, err, tc.want)
		}
	}
	listed, err := messaging.ListedOutboxMessages(ctx, db, []uuid.UUID{ids[3], ids[1], uuid.New()})
	if err != nil || len(listed) != 2 || listed[0].ID != ids[1] || listed[1].ID != ids[3] || listed[0].Attempts != 1 || listed[0].Payload != nil {
		t.Errorf("ListedOutboxMessages = %+v, %v; want rows 1 and 3, the oldest first, without payloads", listed, err)
	}
	if n, err := messaging.RetryOutboxMessages(ctx, db); err != nil || n != 1 {
		t.Errorf("RetryOutboxMessages = %d, %v; want row 1 only", n, err)
	}

	for _, tc := range []struct {
		what string
		err  error
		want error
	}{
		{"retry the parked row", second(messaging.RetryOutboxMessage(ctx, db, ids[0])), messaging.ErrOutboxMessageParked},
		{"park it again", second(messaging.ParkOutboxMessage(ctx, db, ids[0], "")), messaging.ErrOutboxMessageParked},
		{"unpark a row not parked", second(messaging.UnparkOutboxMessage(ctx, db, ids[1])), messaging.ErrOutboxMessageNotParked},
		{"park a sent row", second(messaging.ParkOutboxMessage(ctx, db, ids[3], "")), messaging.ErrNoUnsentMessage},
		{"drop a sent row", second(messaging.DropOutboxMessage(ctx, db, ids[3])), messaging.ErrNoUnsentMessage},
		{"park an unknown row", second(messaging.ParkOutboxMessage(ctx, db, uuid.New(), "")), messaging.ErrNoUnsentMessage},
		{"read an unknown row", second(messaging.OutboxMessageByID(ctx, db, uuid.New())), messaging.ErrNoOutboxMessage},
	} {
		if !errors.Is(tc.err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.what, tc.err, tc.want)
		}
	}
	// The table keeps the two in step: a parked row made due by hand is refused.
	err = d.DB.Exec(`UPDATE outbox_messages SET next_attempt_at = now() WHERE id = ?`, ids[0]).Error
	if err == nil || !strings.Contains(err.Error(), "outbox_messages_parked_never_due") {
		t.Errorf("a parked row made due without unparking it: %v; want the constraint to refuse it", err)
	}

	row, err = messaging.UnparkOutboxMessage(ctx, db, ids[0])
	if err != nil {
		t.Fatal(err)
	}
	if row.Parked() || row.ParkedReason != nil || row.NextAttemptAt.After(time.Now()) || row.Attempts != 40 || *row.LastError != "message too large" {
		t.Errorf("UnparkOutboxMessage returned %+v; want it due now, with its history", row)
	}
	if got := claimed(t, db); len(got) != 3 || got[0] != ids[0] {
		t.Errorf("after unpark the claim took %v, want row 0 first", got)
	}

	dropped, err := messaging.DropOutboxMessage(ctx, db, ids[0])
	if err != nil {
		t.Fatal(err)
	}
	var payload map[string]int
	if err := json.Unmarshal(dropped.Payload, &payload); err != nil || payload["n"] != 0 || dropped.ID != ids[0] {
		t.Errorf("DropOutboxMessage returned %+v (payload %v)", dropped, err)
	}
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE id = ?", ids[0]); n != 0 {
		t.Error("the dropped row is still there")
	}
}

// second is the error of a two-value call.
func second[T any](_ T, err error) error { return err }

// An action on one row that a relay's batch holds waits for the batch's verdict, then finds
// the row sent: ErrNoUnsentMessage, not a change of no row. The batch is stood in for by a
// transaction that locks the row as the relay's claim does, waits until the action queues
// for the lock, then marks the row sent and commits.
func TestRowActionsWaitForTheRelaysVerdict(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		act  func(ctx context.Context, db messaging.DB, id uuid.UUID) (messaging.OutboxMessage, error)
	}{
		{"drop", messaging.DropOutboxMessage},
		{"park", func(ctx context.Context, db messaging.DB, id uuid.UUID) (messaging.OutboxMessage, error) {
			return messaging.ParkOutboxMessage(ctx, db, id, "over the broker's limit")
		}},
		{"retry", messaging.RetryOutboxMessage},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			d, db, ids := parkedOutbox(t, 1)
			batch := d.DB.Begin()
			defer batch.Rollback()
			if err := batch.Exec(`SELECT id FROM outbox_messages WHERE id = ? FOR UPDATE`, ids[0]).Error; err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			done := make(chan error, 1)
			go func() {
				_, err := tc.act(ctx, db, ids[0])
				done <- err
			}()
			testenv.Eventually(t, 10*time.Second, func() bool {
				return testenv.Count(t, d.DB, `SELECT count(*) FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock'`) == 1
			}, "the %s never waited for the batch's lock on the row", tc.name)
			if err := batch.Exec(`UPDATE outbox_messages SET processed_at = now() WHERE id = ?`, ids[0]).Error; err != nil {
				t.Fatal(err)
			}
			if err := batch.Commit().Error; err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-done:
				if !errors.Is(err, messaging.ErrNoUnsentMessage) {
					t.Errorf("%s of a row a relay's batch sent meanwhile: %v; want ErrNoUnsentMessage", tc.name, err)
				}
			case <-ctx.Done():
				t.Fatalf("the %s did not return once the batch committed", tc.name)
			}
			if n := testenv.Count(t, d.DB, `SELECT count(*) FROM outbox_messages WHERE id = ? AND processed_at IS NOT NULL AND parked_at IS NULL`, ids[0]); n != 1 {
				t.Errorf("after the %s, the row is not as the batch left it, sent", tc.name)
			}
		})
	}
}

// Parked rows at the head of the backlog leave the claim's plan as it was: a walk of the
// partial index in order, with no sort, on a table the planner has no statistics for.
func TestClaimPlanWithParkedRows(t *testing.T) {
	t.Parallel()
	d, db, _ := parkedOutbox(t, 0)
	parkExec(t, d, `ALTER TABLE outbox_messages SET (autovacuum_enabled = off)`)
	parkExec(t, d, `INSERT INTO outbox_messages (id, type, payload, occurred_at, parked_at, next_attempt_at)
		SELECT gen_random_uuid(), 'OrderPlaced', '{}', now() - (100000 - g) * interval '1 millisecond',
		       CASE WHEN g <= 1000 THEN now() END, CASE WHEN g <= 1000 THEN 'infinity'::timestamptz ELSE now() END
		FROM generate_series(1, 100000) g`)
	plan := explainClaim(t, d.DB, true)
	if ix := plan.find("Index Scan"); plan.find("Sort") != nil || ix == nil || ix.IndexName != "outbox_messages_unprocessed_idx" {
		t.Fatalf("the claim's plan with parked rows: %s; want the partial index walked, no sort", strings.Join(plan.nodes(), ", "))
	}
	if n := testenv.Count(t, d.DB, `SELECT count(*) FROM outbox_messages WHERE parked_at IS NOT NULL`); n != 1000 {
		t.Fatalf("%d rows parked, want 1000", n)
	}
	for _, id := range claimed(t, db) {
		if testenv.Count(t, d.DB, `SELECT count(*) FROM outbox_messages WHERE id = ? AND parked_at IS NOT NULL`, id) != 0 {
			t.Fatalf("the claim took the parked row %s", id)
		}
	}
}

// FindInboxRecords answers for one consumer or for all, through the primary key.
func TestFindInboxRecords(t *testing.T) {
	t.Parallel()
	d, db, _ := parkedOutbox(t, 0)
	id := uuid.New()
	parkExec(t, d, `INSERT INTO inbox_messages (message_id, consumer, processed_at) VALUES
		(?, 'notification', now() - interval '1 minute'), (?, 'invoicing', now()), (?, 'invoicing', now())`, id, id, uuid.New())
	ctx := context.Background()
	all, err := messaging.FindInboxRecords(ctx, db, id, "")
	if err != nil || len(all) != 2 || all[0].Consumer != "invoicing" || all[1].Consumer != "notification" || all[0].MessageID != id {
		t.Errorf("FindInboxRecords(any) = %+v, %v; want invoicing and notification", all, err)
	}
	one, err := messaging.FindInboxRecords(ctx, db, id, "notification")
	if err != nil || len(one) != 1 || time.Since(one[0].ProcessedAt) < time.Minute {
		t.Errorf("FindInboxRecords(notification) = %+v, %v", one, err)
	}
	if none, err := messaging.FindInboxRecords(ctx, db, id, "billing"); err != nil || len(none) != 0 {
		t.Errorf("FindInboxRecords(billing) = %+v, %v; want none", none, err)
	}
}
