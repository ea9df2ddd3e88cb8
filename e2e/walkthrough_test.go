package e2e

import (
	"fmt"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// TestWalkthrough is scripts/walkthrough.sh as a test: the seeds' experiment against the
// three real services.
func TestWalkthrough(t *testing.T) {
	t.Parallel()
	s := startSystem(t, systest.Options{})

	// 1. Three orders ⇒ three invoices and three confirmations.
	for i := range 3 {
		s.PlaceOrder(t, fmt.Sprintf("c-%d", i))
	}
	s.WaitExactlyOnce(t, 3, 30*time.Second)

	// 2. Make the relay send one message again, as a broker redelivery would look: the
	// consumers log the duplicate and nothing else changes.
	var id string
	if err := s.Order.DB.DB.Raw(`UPDATE outbox_messages SET processed_at = NULL, next_attempt_at = now()
		WHERE id = (SELECT id FROM outbox_messages ORDER BY occurred_at LIMIT 1) RETURNING id`).Scan(&id).Error; err != nil {
		t.Fatal(err)
	}
	for _, c := range []*systest.Service{s.Invoicing, s.Notification} {
		testenv.Eventually(t, 15*time.Second, func() bool {
			return len(c.Logs.Lines("level=INFO", "duplicate", "consumer="+c.Name, "message_id="+id)) == 1
		}, "%s did not log the duplicate of %s", c.Name, id)
	}
	if got := s.WaitExactlyOnce(t, 3, 10*time.Second); got.Invoices != 3 {
		t.Fatalf("after the redelivery: %+v", got)
	}

	// 3. The broker goes away for about 8 s while orders keep coming: every order is accepted
	// (the outbox holds the events), the order service stays ready, the relay logs the outage
	// once as it starts and once as it ends without charging any row for it, and everything is
	// invoiced exactly once when the broker is back, with no restart.
	s.Broker.Stop()
	placed, during := int64(3), 0
	end := time.Now().Add(8 * time.Second)
	for time.Now().Before(end) {
		s.PlaceOrder(t, "during-outage")
		placed++
		during++
		if st := s.Order.Status(t, "/readyz"); st != 200 {
			t.Fatalf("order service not ready during a broker outage: %d", st)
		}
		time.Sleep(400 * time.Millisecond) // the pace of customers, not a synchronisation
	}
	if err := s.Broker.Start(); err != nil {
		t.Fatal(err)
	}
	got := s.WaitExactlyOnce(t, placed, 60*time.Second)
	t.Logf("after an 8 s broker outage: %d orders, %d invoices, %d notifications sent, %d e-mails", got.Orders, got.Invoices, got.Sent, got.Mails)
	rowsWaiting := checkOutageReported(t, s)
	t.Logf("rows_waiting=%d when the relay resumed; %d orders were placed during the outage", rowsWaiting, during)
}
