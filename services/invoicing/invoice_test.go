package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

type testBundle struct {
	db    *gorm.DB
	inbox *messaging.Inbox
	work  invoicer
	logs  *testenv.Logs
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	d := testenv.NewDatabase(t)
	d.Migrate(t, messaging.MigrateInbox, platform.Migrations(migrations, "migrations", "invoicing_schema"))
	log, logs := testenv.NewLogger(t)
	in, err := messaging.NewInbox(messaging.InboxConfig{DB: d.DB, Consumer: Consumer, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	return &testBundle{db: d.DB, inbox: in, work: invoicer{log: log}, logs: logs}
}

func orderPlaced(t *testing.T, orderID uuid.UUID, total int64) messaging.Message {
	t.Helper()
	msg, err := messaging.NewMessage(events.OrderPlacedType, events.OrderPlaced{
		OrderID: orderID, CustomerID: "c-42", TotalCents: total, PlacedAt: time.Now().UTC(),
		Lines: []events.Line{{SKU: "SKU-1", Quantity: 1, UnitPriceCents: total}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return msg
}

func (b *testBundle) deliver(t *testing.T, msg messaging.Message) (bool, error) {
	t.Helper()
	return b.inbox.Handle(context.Background(), msg, func(tx *gorm.DB) error { return b.work.handle(context.Background(), tx, msg) })
}

func TestOneInvoicePerOrderWhateverArrives(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orderID := uuid.New()
	msg := orderPlaced(t, orderID, 2500)

	if dup, err := b.deliver(t, msg); err != nil || dup {
		t.Fatalf("first delivery: duplicate=%v err=%v", dup, err)
	}
	if dup, err := b.deliver(t, msg); err != nil || !dup {
		t.Fatalf("redelivery: duplicate=%v err=%v, want a duplicate", dup, err)
	}
	// Another message announcing the same order (a bug upstream, a replay): still one invoice.
	if dup, err := b.deliver(t, orderPlaced(t, orderID, 2500)); err != nil || dup {
		t.Fatalf("second message for the order: duplicate=%v err=%v", dup, err)
	}

	var invoices []Invoice
	if err := b.db.Find(&invoices).Error; err != nil {
		t.Fatal(err)
	}
	if len(invoices) != 1 || invoices[0].OrderID != orderID || invoices[0].AmountCents != 2500 || invoices[0].MessageID != msg.ID {
		t.Fatalf("invoices = %+v, want one of 2500 for the order, from the first message", invoices)
	}
	if n := len(b.logs.Lines("duplicate", "consumer=invoicing", "message_id="+msg.ID.String())); n != 1 {
		t.Fatalf("%d duplicate lines, want 1", n)
	}
	if n := len(b.logs.Lines("order already invoiced")); n != 1 {
		t.Fatalf("%d 'already invoiced' lines, want 1", n)
	}
}

func TestMalformedOrderPlacedIsPermanentAndWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	good := orderPlaced(t, uuid.New(), 100)
	noOrder := orderPlaced(t, uuid.Nil, 100)
	wrongType := good
	wrongType.ID, wrongType.Type = uuid.New(), "OrderCancelled"
	wrongShape := good
	wrongShape.ID, wrongShape.Payload = uuid.New(), json.RawMessage(`{"order_id": 5}`)
	negative := orderPlaced(t, uuid.New(), -1)
	for name, msg := range map[string]messaging.Message{"no order id": noOrder, "wrong type": wrongType, "wrong shape": wrongShape, "negative total": negative} {
		if _, err := b.deliver(t, msg); !messaging.IsPermanent(err) {
			t.Errorf("%s: err = %v, want a permanent error", name, err)
		}
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM invoices") + testenv.Count(t, b.db, "SELECT count(*) FROM inbox_messages"); n != 0 {
		t.Fatalf("%d rows written for bad messages", n)
	}
}

func TestListInvoices(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orderID := uuid.New()
	for _, id := range []uuid.UUID{orderID, uuid.New(), uuid.New()} {
		if _, err := b.deliver(t, orderPlaced(t, id, 700)); err != nil {
			t.Fatal(err)
		}
	}
	log, _ := testenv.NewLogger(t)
	router := platform.NewRouter(log, prometheus.NewRegistry(), func(context.Context) error { return nil })
	router.Get("/invoices", platform.ListByOrder(log, func(ctx context.Context, id uuid.UUID, limit int) ([]Invoice, error) {
		return platform.ListRecent[Invoice](ctx, b.db, id, limit)
	}))
	srv := httptest.NewServer(router)
	t.Cleanup(srv.Close)
	get := func(query string) (int, []Invoice) {
		resp, err := http.Get(srv.URL + "/invoices" + query)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		var list []Invoice
		if resp.StatusCode == 200 {
			if err := json.Unmarshal(body, &list); err != nil {
				t.Fatalf("%s: %v", body, err)
			}
		}
		return resp.StatusCode, list
	}
	if status, list := get("?order_id=" + orderID.String()); status != 200 || len(list) != 1 || list[0].OrderID != orderID || list[0].AmountCents != 700 {
		t.Fatalf("by order: %d %+v", status, list)
	}
	if status, list := get(""); status != 200 || len(list) != 3 || list[0].CreatedAt.Before(list[2].CreatedAt) {
		t.Fatalf("recent: %d %+v, want 3 newest first", status, list)
	}
	if status, list := get("?order_id=" + uuid.NewString()); status != 200 || list == nil || len(list) != 0 {
		t.Fatalf("unknown order: %d %+v, want an empty array", status, list)
	}
	for _, q := range []string{"?order_id=nope", "?limit=0", "?limit=x"} {
		if status, _ := get(q); status != 400 {
			t.Errorf("%s: status %d, want 400", q, status)
		}
	}
}
