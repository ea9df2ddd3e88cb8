package test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// An Enqueue through WithoutNotify commits its rows without a NOTIFY, and so without the
// server-wide lock a notifying commit takes; the plain driver's commit, the baseline, notifies.
// Notifications arrive in commit order, so the test's own NOTIFYs after each commit mark which
// commit a notification came from.
func TestEnqueueWithoutNotifyCommitsWithoutANotification(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1) // the LISTEN connection
	d := testenv.NewDatabase(t)
	d.MigrateLibrary(t)
	drv := d.Driver(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	testenv.Draw(t, 1)
	listener, err := pgx.Connect(ctx, d.URL)
	must(t, err)
	defer listener.Close(context.Background())
	_, err = listener.Exec(ctx, "LISTEN "+statements.NotifyChannel)
	must(t, err)

	enqueue := func(drv messaging.Driver[*gorm.DB], m messaging.Message, mark string) {
		t.Helper()
		must(t, d.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(ctx, drv, tx, m) }))
		must(t, d.DB.Exec("SELECT pg_notify(?, ?)", statements.NotifyChannel, mark).Error)
	}
	quiet, plain := sameMessage(t), sameMessage(t)
	enqueue(messaging.WithoutNotify[*gorm.DB](drv), quiet, "after the quiet commit")
	enqueue(drv, plain, "after the plain commit")

	var got []string
	for !slices.Contains(got, "after the plain commit") {
		n, err := listener.WaitForNotification(ctx)
		if err != nil {
			t.Fatalf("notifications so far %q, then: %v", got, err)
		}
		got = append(got, n.Payload)
	}
	if want := []string{"after the quiet commit", "", "after the plain commit"}; !slices.Equal(got, want) {
		t.Errorf("notifications %q, want %q: none from the quiet commit, the plain one's after it", got, want)
	}

	// The rows alike but for their ids and the times their transactions began.
	const row = `SELECT (to_jsonb(o) - 'id' - 'next_attempt_at')::text FROM outbox_messages o WHERE id = ?`
	var quietRow, plainRow string
	must(t, d.DB.Raw(row, quiet.ID).Scan(&quietRow).Error)
	must(t, d.DB.Raw(row, plain.ID).Scan(&plainRow).Error)
	if quietRow == "" || quietRow != plainRow {
		t.Errorf("the quiet enqueue stored\n%s\nthe plain one\n%s", quietRow, plainRow)
	}
}

// sameMessage is a message with every field set, the same in all but its id.
func sameMessage(t *testing.T) messaging.Message {
	t.Helper()
	m, err := messaging.NewMessage(eventType, map[string]any{"order_id": "o-1", "n": 1})
	must(t, err)
	m.CorrelationID = "c-1"
	m.OccurredAt = time.Date(2025, 1, 2, 3, 4, 5, 6000, time.UTC)
	m.TraceParent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	m.TraceState = "k=v"
	m.Exchange, m.RoutingKey = "orders", "orders.placed"
	m.Headers = map[string]string{"tenant": "t-1"}
	return m
}
