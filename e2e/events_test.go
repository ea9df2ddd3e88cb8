package e2e

import (
	"encoding/json"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// The events as the binaries publish them, read from a queue of the test's own bound to both
// exchanges: each on its own exchange, routed by its type, persistent, JSON, with the outbox
// row's id as its message id, its type, its occurred_at as its timestamp, its app id, a
// traceparent, and the body's fields the contract names. Any other consumer of the events
// relies on each of these.
func TestPublishedEventsCarryTheContractsProperties(t *testing.T) {
	t.Parallel()
	s := startSystem(t, systest.Options{})
	ch := s.Channel(t)
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, exchange := range []string{"orders", "invoicing"} {
		testenv.Eventually(t, 30*time.Second, func() bool { return exchangeExists(t, s, exchange) },
			"the %s exchange was not declared", exchange)
		if err := ch.QueueBind(q.Name, "#", exchange, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	deliveries, err := ch.Consume(q.Name, "", true, true, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]amqp.Delivery{}
	receive := func(types ...string) {
		timeout := time.After(60 * time.Second)
		for _, typ := range types {
			for got[typ].Type == "" {
				select {
				case d := <-deliveries:
					if _, seen := got[d.Type]; seen {
						t.Fatalf("%s delivered twice to one queue", d.Type)
					}
					got[d.Type] = d
				case <-timeout:
					t.Fatalf("got %v of the events, want %v", slices.Sorted(maps.Keys(got)), types)
				}
			}
		}
	}
	// Cancelled once invoiced, so that the invoice is issued, and announced, first.
	orderID := s.PlaceOrder(t, "c-events")
	receive("OrderPlaced", "InvoiceIssued")
	if !s.CancelOrder(t, orderID, "changed my mind") {
		t.Fatal("the order was not cancelled")
	}
	receive("OrderCancelled")

	want := map[string]struct {
		exchange, appID string // the app id names the service, whose outbox the row is in
		body            []string
	}{
		"OrderPlaced":    {"orders", "order", []string{"order_id", "customer_id", "lines", "total_cents", "placed_at"}},
		"OrderCancelled": {"orders", "order", []string{"order_id", "customer_id", "reason", "cancelled_at"}},
		"InvoiceIssued":  {"invoicing", "invoicing", []string{"invoice_id", "order_id", "customer_id", "amount_cents", "issued_at"}},
	}
	for typ, w := range want {
		d := got[typ]
		db := s.Order.DB
		if w.appID == "invoicing" {
			db = s.Invoicing.DB
		}
		id, err := uuid.Parse(d.MessageId)
		if err != nil || id.Version() != 7 {
			t.Errorf("%s: message_id %q, want a UUIDv7", typ, d.MessageId)
		}
		var occurred time.Time
		if err := db.DB.Raw("SELECT occurred_at FROM outbox_messages WHERE id = ? AND type = ?", id, typ).Scan(&occurred).Error; err != nil || occurred.IsZero() {
			t.Errorf("%s: message_id %s is no %s outbox row of the %s service (%v)", typ, id, typ, w.appID, err)
		}
		if d.Exchange != w.exchange || d.RoutingKey != typ || d.AppId != w.appID || d.DeliveryMode != amqp.Persistent ||
			d.ContentType != "application/json" || !d.Timestamp.Equal(occurred.Truncate(time.Second)) {
			t.Errorf("%s: exchange %q, routing key %q, app_id %q, delivery_mode %d, content_type %q, timestamp %v; want %q, %q, %q, 2, application/json, %v",
				typ, d.Exchange, d.RoutingKey, d.AppId, d.DeliveryMode, d.ContentType, d.Timestamp, w.exchange, typ, w.appID, occurred.Truncate(time.Second))
		}
		if tp, _ := d.Headers["traceparent"].(string); len(tp) != 55 {
			t.Errorf("%s: traceparent %q, want one", typ, tp)
		}
		var body map[string]json.RawMessage
		if err := json.Unmarshal(d.Body, &body); err != nil {
			t.Errorf("%s: body %s: %v", typ, d.Body, err)
		}
		for _, field := range w.body {
			if _, ok := body[field]; !ok {
				t.Errorf("%s: body %s has no %s", typ, d.Body, field)
			}
		}
		if body["order_id"] == nil || string(body["order_id"]) != `"`+orderID.String()+`"` {
			t.Errorf("%s: order_id %s, want %s", typ, body["order_id"], orderID)
		}
	}
}

// exchangeExists reports whether the system's vhost has the exchange, on a channel of its own:
// a passive declare of a missing one closes its channel.
func exchangeExists(t *testing.T, s *systest.System, name string) bool {
	t.Helper()
	conn, err := amqp.Dial(s.AMQPURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	return ch.ExchangeDeclarePassive(name, "topic", true, false, false, false, nil) == nil
}
