package e2e

import (
	"fmt"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// TestWalkthrough is scripts/walkthrough.sh as a test: the seeds' experiment against the
// three real services.
func TestWalkthrough(t *testing.T) {
	t.Parallel()
	s := startSystem(t, options{})
	s.dumpOnFailure(t)

	// 1. Three orders ⇒ three invoices and three confirmations.
	for i := range 3 {
		s.placeOrder(t, fmt.Sprintf("c-%d", i))
	}
	s.waitExactlyOnce(t, 3, 30*time.Second)

	// 2. Make the relay send one message again, as a broker redelivery would look: the
	// consumers log the duplicate and nothing else changes.
	var id string
	if err := s.order.db.DB.Raw(`UPDATE outbox_messages SET processed_at = NULL, next_attempt_at = now()
		WHERE id = (SELECT id FROM outbox_messages ORDER BY occurred_at LIMIT 1) RETURNING id`).Scan(&id).Error; err != nil {
		t.Fatal(err)
	}
	for _, c := range []*service{s.invoicing, s.notification} {
		testenv.Eventually(t, 15*time.Second, func() bool {
			return len(c.logs.Lines("level=INFO", "duplicate", "consumer="+c.name, "message_id="+id)) == 1
		}, "%s did not log the duplicate of %s", c.name, id)
	}
	if got := s.waitExactlyOnce(t, 3, 10*time.Second); got.invoices != 3 {
		t.Fatalf("after the redelivery: %+v", got)
	}

	// 3. The broker goes away for about 8 s while orders keep coming: every order is accepted
	// (the outbox holds the events), the order service stays ready, and everything is invoiced
	// exactly once when the broker is back, with no restart.
	s.broker.Stop()
	placed := int64(3)
	end := time.Now().Add(8 * time.Second)
	for time.Now().Before(end) {
		s.placeOrder(t, "during-outage")
		placed++
		if st := s.order.status(t, "/readyz"); st != 200 {
			t.Fatalf("order service not ready during a broker outage: %d", st)
		}
		time.Sleep(400 * time.Millisecond) // the pace of customers, not a synchronisation
	}
	if err := s.broker.Start(); err != nil {
		t.Fatal(err)
	}
	got := s.waitExactlyOnce(t, placed, 60*time.Second)
	t.Logf("after an 8 s broker outage: %d orders, %d invoices, %d confirmations sent, %d e-mails", got.orders, got.invoices, got.sent, got.mails)
	if n := len(s.order.logs.Lines("outbox publish failed", "message_id=", "attempts=", "next_attempt_at=")); n == 0 {
		t.Error("the relay logged no publish failure during the outage")
	}
}
