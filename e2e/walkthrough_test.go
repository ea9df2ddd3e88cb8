package e2e

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// TestWalkthrough is scripts/walkthrough.sh as a test: the seeds' experiment against the
// three real services.
func TestWalkthrough(t *testing.T) {
	t.Parallel()
	s := startSystem(t, systest.Options{})

	// 1. Three orders ⇒ three invoices, and per order a confirmation and an invoice notice.
	var ids []uuid.UUID
	for i := range 3 {
		ids = append(ids, s.PlaceOrder(t, fmt.Sprintf("c-%d", i)))
	}
	s.WaitExactlyOnce(t, 3, 30*time.Second)

	// 2. Make the order relay send an OrderPlaced again, as a broker redelivery would look:
	// both consumers skip the duplicate and nothing else changes.
	redeliver(t, s.Order.DB, "OrderPlaced", s.Invoicing, s.Notification)
	if got := s.WaitExactlyOnce(t, 3, 30*time.Second); got.Invoices != 3 {
		t.Fatalf("after the redelivery of an OrderPlaced: %+v", got)
	}

	// 3. The same one hop down the chain: the invoicing service's own relay sends an
	// InvoiceIssued again; notification skips it, and no order gets a second invoice notice.
	redeliver(t, s.Invoicing.DB, "InvoiceIssued", s.Notification)
	if got := s.WaitExactlyOnce(t, 3, 30*time.Second); got.Invoices != 3 {
		t.Fatalf("after the redelivery of an InvoiceIssued: %+v", got)
	}

	// 4. Cancel an order: its invoice turns void and the customer is told, once; cancelling
	// again answers 200 and writes no second event.
	cancelled := ids[2]
	s.CancelOrder(t, cancelled, "ordered by mistake")
	testenv.Eventually(t, 15*time.Second, func() bool {
		var invoices []struct{ Status string }
		s.Invoicing.GetJSON(t, "/invoices?order_id="+cancelled.String(), &invoices)
		var notices []struct{ Kind, Status string }
		s.Notification.GetJSON(t, "/notifications?order_id="+cancelled.String(), &notices)
		sent := 0
		for _, n := range notices {
			if n.Kind == "order_cancelled" && n.Status == "sent" {
				sent++
			}
		}
		return len(invoices) == 1 && invoices[0].Status == "void" && sent == 1
	}, "order %s's invoice is not void, or its cancellation notice not sent", cancelled)
	for _, l := range []struct {
		c     *systest.Service
		parts []string
	}{
		{s.Order, []string{`msg="order cancelled"`}},
		{s.Invoicing, []string{`msg="invoice voided"`}},
		{s.Notification, []string{`msg="notification recorded"`, "kind=order_cancelled"}},
	} {
		// The lines reach the test through a pipe: give them a moment.
		parts := append(slices.Clone(l.parts), "order_id="+cancelled.String())
		testenv.Eventually(t, 5*time.Second, func() bool { return len(l.c.Logs.Lines(parts...)) == 1 },
			"%s did not log one line with %q", l.c.Name, parts)
	}
	s.CancelOrder(t, cancelled, "ordered by mistake")
	if n := testenv.Count(t, s.Order.DB.DB, "SELECT count(*) FROM outbox_messages WHERE type = 'OrderCancelled' AND payload->>'order_id' = ?",
		cancelled.String()); n != 1 {
		t.Errorf("order %s has %d OrderCancelled events after two cancellations, want 1", cancelled, n)
	}
	if got := s.WaitExactlyOnce(t, 3, 30*time.Second); got.Cancelled != 1 {
		t.Fatalf("after the cancellation: %+v", got)
	}

	// 5. The broker goes away for about 8 s while orders keep coming: every order is accepted
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
	t.Logf("after an 8 s broker outage: %d orders, %d of them cancelled, %d invoices, %d notifications sent, %d e-mails",
		got.Orders, got.Cancelled, got.Invoices, got.Sent, got.Mails)
	rowsWaiting := checkOutageReported(t, s)
	t.Logf("rows_waiting=%d when the relay resumed; %d orders were placed during the outage", rowsWaiting, during)
}

// redeliver makes the relay of db's outbox send its oldest message of type typ again, with the
// same id, as a broker redelivery looks to a consumer, and requires each of consumers to log
// the duplicate once and count it in inbox_duplicates_total.
func redeliver(t *testing.T, db *testenv.Database, typ string, consumers ...*systest.Service) {
	t.Helper()
	counter := func(c *systest.Service) float64 {
		return c.Counter(t, `inbox_duplicates_total{consumer="`+c.Name+`"}`)
	}
	before := make([]float64, len(consumers))
	for i, c := range consumers {
		before[i] = counter(c)
	}
	var id string
	if err := db.DB.Raw(`UPDATE outbox_messages SET processed_at = NULL, next_attempt_at = now()
		WHERE id = (SELECT id FROM outbox_messages WHERE type = ? ORDER BY occurred_at LIMIT 1) RETURNING id`, typ).Scan(&id).Error; err != nil {
		t.Fatal(err)
	}
	if id == "" {
		t.Fatalf("no %s in the outbox", typ)
	}
	for i, c := range consumers {
		testenv.Eventually(t, 15*time.Second, func() bool {
			return len(c.Logs.Lines("level=INFO", "duplicate", "consumer="+c.Name, "message_id="+id)) == 1 && counter(c) == before[i]+1
		}, "%s did not log and count the duplicate of %s %s once", c.Name, typ, id)
	}
}

// Start order does not matter: on an empty vhost, the order service starts alone and its relay
// publishes every order's OrderPlaced before either consumer has ever run; then invoicing
// starts, invoices them all and publishes its InvoiceIssued; and only then does notification
// start, for the first time. Every event it handles was published before its first start, and
// it finds every one: the order service declared both consumers' queues and bindings before its
// first publish. (With invoicing running from the start, its own declaration of the whole
// topology would create notification's queue, and hide an order service that declared none.)
func TestAConsumerThatStartsLastMissesNothing(t *testing.T) {
	t.Parallel()
	s := startSystem(t, systest.Options{Held: []string{"invoicing", "notification"}})
	const orders = 20
	for i := range orders {
		s.PlaceOrder(t, fmt.Sprintf("early-%d", i))
	}
	// Sent at the first attempt: confirmed and routed. Returned as unroutable, for want of a
	// bound queue, a row would be charged an attempt and wait for its retry.
	testenv.Eventually(t, 30*time.Second, func() bool {
		return testenv.Count(t, s.Order.DB.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NOT NULL AND attempts = 0") == orders
	}, "the %d OrderPlaced were not all published, at their first attempt, with no consumer running", orders)
	s.Invoicing.Start(t)
	testenv.Eventually(t, 30*time.Second, func() bool {
		return testenv.Count(t, s.Invoicing.DB.DB, "SELECT count(*) FROM invoices WHERE status = 'issued'") == orders
	}, "the %d orders were not invoiced before notification started", orders)
	s.Notification.Start(t)
	got := s.WaitExactlyOnce(t, orders, 60*time.Second)
	confirmations := testenv.Count(t, s.Notification.DB.DB, "SELECT count(*) FROM notifications WHERE kind = 'order_confirmation' AND status = 'sent'")
	t.Logf("notification started after %d orders were invoiced: %d of %d order confirmations sent, %d notifications in all (%+v)",
		orders, confirmations, orders, got.Notifications, got)
	if confirmations != orders {
		t.Fatalf("%d of %d order confirmations", confirmations, orders)
	}
}
