package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/messagingtest"
)

type testBundle struct {
	db          *gorm.DB
	sub         *platform.Subscription
	logs        *testenv.Logs
	alreadyDone *atomic.Int64
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	return setupOn(t, testenv.NewDatabase(t))
}

// setupOn is setup on d, migrated to the latest version from wherever it stands.
func setupOn(t *testing.T, d *testenv.Database) *testBundle {
	t.Helper()
	d.Migrate(t, platform.Library(messaging.MigrateInbox), platform.Library(messaging.MigrateOutbox), platform.Migrations(migrations, "migrations", "invoicing_schema"))
	log, logs := testenv.NewLogger(t)
	// Deliver needs no broker: the URL is never dialled.
	sub, err := messaging.NewSubscription(d.Driver(t), messaging.SubscriptionConfig{Name: Consumer, URL: "amqp://unused", Topology: events.Topology, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	var alreadyDone atomic.Int64
	if err := (invoicer{log: log, driver: d.Driver(t), alreadyDone: func() { alreadyDone.Add(1) }}).subscribe(sub); err != nil {
		t.Fatal(err)
	}
	// Each message counted as done already logs one line marked already_done=true, whatever its
	// wording, and no other line is: what a process did while it shut down, after the test read
	// its count, shows only in these lines (internal/systest counts them).
	t.Cleanup(func() {
		if n, marked := alreadyDone.Load(), len(logs.Lines("already_done=true")); int64(marked) != n {
			t.Errorf("%d messages counted as done already, and %d log lines marked already_done=true: want one each:\n%s", n, marked, logs)
		}
	})
	return &testBundle{db: d.DB, sub: sub, logs: logs, alreadyDone: &alreadyDone}
}

func orderPlaced(t *testing.T, orderID uuid.UUID, total int64) messaging.Message {
	t.Helper()
	return orderPlacedFor(t, orderID, "c-42", total)
}

// orderPlacedFor is an OrderPlaced of customer's.
func orderPlacedFor(t *testing.T, orderID uuid.UUID, customer string, total int64) messaging.Message {
	t.Helper()
	msg, err := events.OrderPlacedEvent.Message(events.OrderPlaced{
		OrderID: orderID, CustomerID: customer, TotalCents: total, PlacedAt: time.Now().UTC(),
		Lines: []events.Line{{SKU: "SKU-1", Quantity: 1, UnitPriceCents: total}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return msg
}

func orderCancelled(t *testing.T, orderID uuid.UUID) messaging.Message {
	t.Helper()
	return orderCancelledFor(t, orderID, "c-42")
}

// orderCancelledFor is an OrderCancelled of customer's.
func orderCancelledFor(t *testing.T, orderID uuid.UUID, customer string) messaging.Message {
	t.Helper()
	msg, err := events.OrderCancelledEvent.Message(events.OrderCancelled{OrderID: orderID, CustomerID: customer, Reason: "test", CancelledAt: time.Now().UTC()})
	if err != nil {
		t.Fatal(err)
	}
	return msg
}

func (b *testBundle) deliver(t *testing.T, msg messaging.Message) (bool, error) {
	t.Helper()
	return messagingtest.Deliver(context.Background(), b.sub, msg)
}

// invoiceOf returns the order's invoice and how many InvoiceIssued its outbox holds for it.
func (b *testBundle) invoiceOf(t *testing.T, orderID uuid.UUID) (Invoice, int64) {
	t.Helper()
	var inv Invoice
	if err := b.db.Take(&inv, "order_id = ?", orderID).Error; err != nil {
		t.Fatalf("invoice of %s: %v", orderID, err)
	}
	return inv, testenv.Count(t, b.db, "SELECT count(*) FROM outbox_messages WHERE type = ? AND payload->>'order_id' = ?",
		events.InvoiceIssuedType, orderID.String())
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
	if len(invoices) != 1 || invoices[0].OrderID != orderID || invoices[0].AmountCents != 2500 || invoices[0].MessageID != msg.ID ||
		invoices[0].Status != StatusIssued {
		t.Fatalf("invoices = %+v, want one issued of 2500 for the order, from the first message", invoices)
	}
	if _, issued := b.invoiceOf(t, orderID); issued != 1 {
		t.Fatalf("%d InvoiceIssued in the outbox, want 1", issued)
	}
	if n := len(b.logs.Lines("duplicate", "consumer=invoicing", "message_id="+msg.ID.String())); n != 1 {
		t.Fatalf("%d duplicate lines, want 1", n)
	}
	if n := len(b.logs.Lines("order already invoiced")); n != 1 || b.alreadyDone.Load() != 1 {
		t.Fatalf("%d 'already invoiced' lines and %d counted, want 1 of each", n, b.alreadyDone.Load())
	}
}

func TestMalformedOrderPlacedIsPermanentAndWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	good := orderPlaced(t, uuid.New(), 100)
	noOrder := orderPlaced(t, uuid.Nil, 100)
	wrongShape := good
	wrongShape.ID, wrongShape.Payload = uuid.New(), json.RawMessage(`{"order_id": 5}`)
	negative := orderPlaced(t, uuid.New(), -1)
	for name, msg := range map[string]messaging.Message{"no order id": noOrder, "wrong shape": wrongShape, "negative total": negative} {
		if _, err := b.deliver(t, msg); !messaging.IsPermanent(err) {
			t.Errorf("%s: err = %v, want a permanent error", name, err)
		}
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM invoices") + testenv.Count(t, b.db, "SELECT count(*) FROM inbox_messages") +
		testenv.Count(t, b.db, "SELECT count(*) FROM outbox_messages"); n != 0 {
		t.Fatalf("%d rows written for bad messages", n)
	}
}

// An OrderPlaced whose customer id holds a NUL, a control character (which the event's check
// refuses, and PostgreSQL's jsonb and text could not store either), is permanent when it is
// decoded: the harness's batch of it and a good one fails, where a consumer dead-letters it
// alone, before any transaction, and handles the rest. Nothing of it is written; the good
// message, delivered alone, is invoiced. (The database refusing a value is the library's test.)
func TestAnOrderPlacedWithANULIsPermanentAloneAndInABatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	goodOrder := uuid.New()
	good := orderPlaced(t, goodOrder, 100)
	bad, err := events.OrderPlacedEvent.Message(events.OrderPlaced{
		OrderID: uuid.New(), CustomerID: "c-\x00", TotalCents: 100, PlacedAt: time.Now().UTC(),
		Lines: []events.Line{{SKU: "SKU-1", Quantity: 1, UnitPriceCents: 100}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := messagingtest.DeliverBatch(context.Background(), b.sub, good, bad); err == nil {
		t.Fatal("DeliverBatch of a good and a refused OrderPlaced = nil, want the batch's error")
	}
	if _, err := b.deliver(t, bad); !messaging.IsPermanent(err) {
		t.Fatalf("the refused OrderPlaced alone: err = %v, want a permanent error", err)
	}
	if dup, err := b.deliver(t, good); err != nil || dup {
		t.Fatalf("the good OrderPlaced alone: duplicate %v, err %v; want it handled", dup, err)
	}
	if _, issued := b.invoiceOf(t, goodOrder); issued != 1 {
		t.Fatalf("%d InvoiceIssued for the good order, want 1", issued)
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM invoices") + testenv.Count(t, b.db, "SELECT count(*) FROM inbox_messages"); n != 2 {
		t.Fatalf("%d invoices and inbox records, want the good order's one of each", n)
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
	router.Get("/invoices", platform.ListByOrder(log, func(ctx context.Context, id *uuid.UUID, limit int) ([]Invoice, error) {
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
		if resp.StatusCode == http.StatusOK {
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
	for _, unknown := range []string{uuid.NewString(), uuid.Nil.String()} {
		if status, list := get("?order_id=" + unknown); status != 200 || list == nil || len(list) != 0 {
			t.Fatalf("order %s: %d %+v, want an empty array", unknown, status, list)
		}
	}
	// Given empty, as by a script whose variable is unset, given twice, or in a query that does
	// not parse (whose unreadable pairs url.Values drops): an error, not every order's invoices.
	for _, q := range []string{"?order_id=nope", "?order_id=", "?limit=0", "?limit=x", "?limit=", "?order_id=%zz",
		"?order_id=" + orderID.String() + ";", "?order_id=" + orderID.String() + "&order_id=" + uuid.NewString(), "?limit=1&limit=2"} {
		if status, _ := get(q); status != 400 {
			t.Errorf("%s: status %d, want 400", q, status)
		}
	}
}

// A cancellation that arrives first leaves a void invoice; the late OrderPlaced fills in its
// amount and never issues it.
func TestCancellationBeforeTheOrderNeverIssues(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orderID := uuid.New()
	for _, msg := range []messaging.Message{orderCancelled(t, orderID), orderPlaced(t, orderID, 900)} {
		if _, err := b.deliver(t, msg); err != nil {
			t.Fatal(err)
		}
	}
	inv, issued := b.invoiceOf(t, orderID)
	if inv.Status != StatusVoid || inv.AmountCents != 900 || inv.VoidedAt == nil || issued != 0 {
		t.Fatalf("invoice %+v with %d InvoiceIssued, want a void one of 900 and none issued", inv, issued)
	}
	if n := len(b.logs.Lines("cancellation remembered before its order")) + len(b.logs.Lines("its invoice stays void")); n != 2 {
		t.Fatalf("want both steps logged, got %d lines", n)
	}
}

// A cancellation after the invoice voids it; InvoiceIssued went out when it was issued.
func TestCancellationVoidsTheIssuedInvoice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orderID := uuid.New()
	cancel := orderCancelled(t, orderID)
	for _, msg := range []messaging.Message{orderPlaced(t, orderID, 900), cancel, cancel} {
		if _, err := b.deliver(t, msg); err != nil {
			t.Fatal(err)
		}
	}
	inv, issued := b.invoiceOf(t, orderID)
	if inv.Status != StatusVoid || inv.AmountCents != 900 || issued != 1 {
		t.Fatalf("invoice %+v with %d InvoiceIssued, want void, and issued once before", inv, issued)
	}
	if n := len(b.logs.Lines("invoice voided", "invoice_id="+inv.ID.String())); n != 1 {
		t.Fatalf("%d 'invoice voided' lines, want 1", n)
	}
}

// Another OrderPlaced for an order whose invoice was issued and then voided (a replay, a bug
// upstream) is a duplicate by the order's key: the void invoice keeps the amount it was issued
// with, and the message is counted as work done already. So is one more OrderPlaced for an
// order cancelled first, once the first gave the void row its amount. An invoice of 0 issued and
// then voided has no amount to tell it by: its voided_at, later than its created_at, does.
func TestOrderPlacedAgainAfterTheVoidChangesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	issuedFirst, cancelledFirst, issuedFree := uuid.New(), uuid.New(), uuid.New()
	for _, msg := range []messaging.Message{
		orderPlaced(t, issuedFirst, 2500), orderCancelled(t, issuedFirst), orderPlaced(t, issuedFirst, 9900),
		orderCancelled(t, cancelledFirst), orderPlaced(t, cancelledFirst, 900), orderPlaced(t, cancelledFirst, 9900),
		orderPlaced(t, issuedFree, 0), orderCancelled(t, issuedFree), orderPlaced(t, issuedFree, 9900),
	} {
		if dup, err := b.deliver(t, msg); err != nil || dup {
			t.Fatalf("%s: duplicate=%v err=%v", msg.Type, dup, err)
		}
	}
	if inv, issued := b.invoiceOf(t, issuedFirst); inv.Status != StatusVoid || inv.AmountCents != 2500 || issued != 1 {
		t.Fatalf("issued, then voided: invoice %+v with %d InvoiceIssued, want void of 2500, issued once", inv, issued)
	}
	if inv, issued := b.invoiceOf(t, cancelledFirst); inv.Status != StatusVoid || inv.AmountCents != 900 || issued != 0 {
		t.Fatalf("cancelled first: invoice %+v with %d InvoiceIssued, want void of 900, never issued", inv, issued)
	}
	if inv, issued := b.invoiceOf(t, issuedFree); inv.Status != StatusVoid || inv.AmountCents != 0 || issued != 1 {
		t.Fatalf("issued for 0, then voided: invoice %+v with %d InvoiceIssued, want void of 0, issued once", inv, issued)
	}
	if n := b.alreadyDone.Load(); n != 3 {
		t.Fatalf("%d messages counted as done already, want the 3 late OrderPlaced", n)
	}
	if n := len(b.logs.Lines("its invoice stays void")); n != 1 {
		t.Fatalf("%d 'cancelled before it arrived' lines, want 1 (the cancelled-first order's own OrderPlaced)", n)
	}
}

// gateInvoices makes each write of invoices that when names ("AFTER INSERT ON invoices") wait,
// once its row is written, until release, so the writing transaction stays open with its row,
// and another can run into it. held reports whether one waits there.
func gateInvoices(t *testing.T, db *gorm.DB, when string) (held func() bool, release func()) {
	t.Helper()
	release = testenv.HoldAt(t, db, when)
	held = func() bool {
		return testenv.Count(t, db, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event = 'advisory'") == 1
	}
	return held, release
}

// deliverCrossing delivers first until it is held at a gate (gateInvoices) with its row written,
// then second until it waits for first's transaction, then releases the gate, and requires
// both handled.
func (b *testBundle) deliverCrossing(t *testing.T, first, second messaging.Message, held func() bool, release func()) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	wg.Go(func() { _, err := b.deliver(t, first); errs <- err })
	testenv.Eventually(t, 10*time.Second, held, "the %s did not write its invoice row", first.Type) // written, not committed
	wg.Go(func() { _, err := b.deliver(t, second); errs <- err })
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, b.db, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'transactionid'") == 1
	}, "the %s did not wait for the %s's transaction", second.Type, first.Type)
	release()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// The placement and the cancellation of one order handled at the same moment, each in its own
// transaction: whichever writes first, the other waits for it on the order's invoice row, and
// no interleaving leaves an issued invoice for a cancelled order.
func TestPlacementAndCancellationTogether(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, 3*testenv.DefaultConnections) // three databases, one after another
	for _, first := range []string{events.OrderPlacedType, events.OrderCancelledType} {
		b := setup(t)
		held, release := gateInvoices(t, b.db, "AFTER INSERT ON invoices")
		orderID := uuid.New()
		msgs := map[string]messaging.Message{events.OrderPlacedType: orderPlaced(t, orderID, 500), events.OrderCancelledType: orderCancelled(t, orderID)}
		second := events.OrderCancelledType
		if first == second {
			second = events.OrderPlacedType
		}
		b.deliverCrossing(t, msgs[first], msgs[second], held, release)
		// Issued and announced, then voided; or void from the start, never announced, and
		// given its amount by the late OrderPlaced.
		wantIssued := map[string]int64{events.OrderPlacedType: 1, events.OrderCancelledType: 0}[first]
		if inv, issued := b.invoiceOf(t, orderID); inv.Status != StatusVoid || inv.AmountCents != 500 || issued != wantIssued {
			t.Fatalf("%s first, %s waiting: invoice %s of %d with %d InvoiceIssued, want void of 500 with %d",
				first, second, inv.Status, inv.AmountCents, issued, wantIssued)
		}
	}

	// And many times with nothing held: both at once, in whatever order the scheduler picks.
	b := setup(t)
	for range 50 {
		orderID := uuid.New()
		start := make(chan struct{})
		var wg sync.WaitGroup
		for _, msg := range []messaging.Message{orderPlaced(t, orderID, 500), orderCancelled(t, orderID)} {
			wg.Go(func() {
				<-start
				if _, err := b.deliver(t, msg); err != nil {
					t.Error(err)
				}
			})
		}
		close(start)
		wg.Wait()
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM invoices WHERE status <> 'void'"); n != 0 {
		t.Fatalf("%d of 50 cancelled orders have an issued invoice", n)
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM invoices"); n != 50 {
		t.Fatalf("%d invoice rows for 50 orders", n)
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM invoices WHERE amount_cents <> 500"); n != 0 {
		t.Fatalf("%d of 50 invoices without the order's amount", n)
	}
	// Announced once if issued before it was voided (voided later than created), else never.
	if n := testenv.Count(t, b.db, `SELECT count(*) FROM invoices i
		WHERE (SELECT count(*) FROM outbox_messages o WHERE o.type = ? AND o.payload->>'order_id' = i.order_id::text)
			<> CASE WHEN i.voided_at > i.created_at THEN 1 ELSE 0 END`, events.InvoiceIssuedType); n != 0 {
		t.Fatalf("%d of 50 orders announced other than once if issued first, never if cancelled first", n)
	}
}

// An invoice's times are the database's, the clock voided_at is read by: created_at is its
// transaction's now(), the inbox row's processed_at, for an issued row and for a cancellation's
// row (voided as created), and InvoiceIssued says the same time. They were the replica's clock:
// a replica whose clock ran ahead issued invoices "after" a later void of another's.
func TestAnInvoiceIsStampedByTheDatabasesClock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	placed, cancelled := orderPlaced(t, uuid.New(), 2500), orderCancelled(t, uuid.New())
	for _, msg := range []messaging.Message{placed, cancelled} {
		if dup, err := b.deliver(t, msg); err != nil || dup {
			t.Fatalf("%s: duplicate=%v err=%v", msg.Type, dup, err)
		}
		var atTheClaim bool
		if err := b.db.Raw(`SELECT v.created_at = i.processed_at AND (v.status = 'issued' OR v.voided_at = i.processed_at)
FROM invoices v JOIN inbox_messages i ON i.message_id = v.message_id WHERE v.message_id = ?`, msg.ID).Scan(&atTheClaim).Error; err != nil {
			t.Fatal(err)
		}
		if !atTheClaim {
			t.Errorf("%s: the invoice's times are not its transaction's now(), the inbox row's processed_at", msg.Type)
		}
	}
	var announced bool
	if err := b.db.Raw(`SELECT (o.payload->>'issued_at')::timestamptz = v.created_at AND o.occurred_at = v.created_at
FROM outbox_messages o JOIN invoices v ON o.payload->>'invoice_id' = v.id::text WHERE v.message_id = ?`, placed.ID).Scan(&announced).Error; err != nil {
		t.Fatal(err)
	}
	if !announced {
		t.Error("InvoiceIssued does not say the invoice's created_at")
	}
}

// An order cancelled before it arrived, whose total was 0, learns its amount from its first
// OrderPlaced only: another OrderPlaced for it (a replay upstream, with another total) changes
// nothing, is counted as done already, and says that the amounts differ. Its amount of 0 used to
// make it look as if it still awaited its order, and the second total replaced the first.
func TestAnOrderCancelledFirstLearnsItsAmountOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orderID := uuid.New()
	late := orderPlaced(t, orderID, 0)
	replay := orderPlaced(t, orderID, 500)
	for _, msg := range []messaging.Message{orderCancelled(t, orderID), late, replay} {
		if dup, err := b.deliver(t, msg); err != nil || dup {
			t.Fatalf("%s: duplicate=%v err=%v", msg.Type, dup, err)
		}
	}
	inv, issued := b.invoiceOf(t, orderID)
	if inv.Status != StatusVoid || inv.AmountCents != 0 || inv.PlacedMessageID == nil || *inv.PlacedMessageID != late.ID || issued != 0 {
		t.Fatalf("invoice %+v with %d InvoiceIssued, want void of 0 from message %s, never announced", inv, issued, late.ID)
	}
	if n := len(b.logs.Lines("order was cancelled before it arrived", "message_id="+late.ID.String())); n != 1 || b.alreadyDone.Load() != 1 {
		t.Fatalf("%d 'cancelled before it arrived' lines for the late order and %d counted as done, want 1 of each", n, b.alreadyDone.Load())
	}
	if n := len(b.logs.Lines("level=ERROR", "with another amount", "amount_cents=500", "invoice_amount_cents=0", "message_id="+replay.ID.String())); n != 1 {
		t.Fatalf("%d lines saying the replay's amount differs, want 1:\n%s", n, b.logs)
	}
}

// Two OrderPlaced of one order that was cancelled before it arrived, handled at the same moment:
// the first gives the void row its amount, and the second, once the first commits, finds it
// given. Both used to read the row as awaiting its order, and the second's total replaced the
// first's, each logged as the late order.
func TestTwoOrderPlacedAtOnceForAnOrderCancelledFirst(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orderID := uuid.New()
	if _, err := b.deliver(t, orderCancelled(t, orderID)); err != nil {
		t.Fatal(err)
	}
	held, release := gateInvoices(t, b.db, "AFTER UPDATE ON invoices")
	first, second := orderPlaced(t, orderID, 500), orderPlaced(t, orderID, 700)
	b.deliverCrossing(t, first, second, held, release)
	if inv, issued := b.invoiceOf(t, orderID); inv.Status != StatusVoid || inv.AmountCents != 500 || issued != 0 {
		t.Fatalf("invoice %s of %d with %d InvoiceIssued, want void of the first message's 500, never announced", inv.Status, inv.AmountCents, issued)
	}
	if n := len(b.logs.Lines("order was cancelled before it arrived")); n != 1 || b.alreadyDone.Load() != 1 {
		t.Fatalf("%d 'cancelled before it arrived' lines and %d counted as done, want 1 of each", n, b.alreadyDone.Load())
	}
}

// An OrderCancelled from another message (not a redelivery, which the inbox skips) finds the
// invoice void already: it changes nothing, voided_at included, and is counted as done already.
// For an order cancelled first, a second cancellation that moved voided_at off created_at would
// make the late OrderPlaced look like a duplicate: its amount would never be recorded.
func TestCancellationFromAnotherMessageChangesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	issuedFirst, cancelledFirst := uuid.New(), uuid.New()
	for _, msg := range []messaging.Message{
		orderPlaced(t, issuedFirst, 2500), orderCancelled(t, issuedFirst),
		orderCancelled(t, cancelledFirst),
	} {
		if _, err := b.deliver(t, msg); err != nil {
			t.Fatal(err)
		}
	}
	before, _ := b.invoiceOf(t, issuedFirst)
	for _, msg := range []messaging.Message{orderCancelled(t, issuedFirst), orderCancelled(t, cancelledFirst)} {
		if dup, err := b.deliver(t, msg); err != nil || dup {
			t.Fatalf("another OrderCancelled: duplicate=%v err=%v", dup, err)
		}
	}
	if after, _ := b.invoiceOf(t, issuedFirst); after.VoidedAt == nil || !after.VoidedAt.Equal(*before.VoidedAt) {
		t.Fatalf("voided_at moved from %v to %v by another OrderCancelled", before.VoidedAt, after.VoidedAt)
	}
	if n := len(b.logs.Lines("order already cancelled by another message")); n != 2 || b.alreadyDone.Load() != 2 {
		t.Fatalf("%d 'already cancelled' lines and %d counted, want 2 of each", n, b.alreadyDone.Load())
	}
	if _, err := b.deliver(t, orderPlaced(t, cancelledFirst, 900)); err != nil {
		t.Fatal(err)
	}
	if inv, issued := b.invoiceOf(t, cancelledFirst); inv.Status != StatusVoid || inv.AmountCents != 900 || issued != 0 {
		t.Fatalf("order cancelled twice before it arrived: invoice %+v with %d InvoiceIssued, want void with the amount 900, never issued", inv, issued)
	}
}

// Two batches holding the same orders in opposite orders both commit: insertNew takes the
// orders' rows in order_id order, so neither waits for the other in a circle (a deadlock,
// which PostgreSQL ends by aborting one).
func TestBatchesOfTheSameOrdersInOppositeOrdersDoNotDeadlock(t *testing.T) {
	t.Parallel()
	d := testenv.NewDatabase(t)
	d.Migrate(t, platform.Migrations(migrations, "migrations", "invoicing_schema"))
	const orders = 2000
	for round := range 3 {
		ids := make([]uuid.UUID, orders)
		for i := range ids {
			ids[i] = uuid.New()
		}
		slices.SortFunc(ids, func(a, b uuid.UUID) int { return strings.Compare(a.String(), b.String()) })
		batch := func(reversed bool) []Invoice {
			invs := make([]Invoice, orders)
			for i := range invs {
				id := ids[i]
				if reversed {
					id = ids[orders-1-i]
				}
				inv, err := newInvoice(id, "c-42", 100, StatusIssued, messaging.Message{ID: uuid.New()})
				if err != nil {
					t.Fatal(err)
				}
				invs[i] = inv
			}
			return invs
		}
		batches := [][]Invoice{batch(false), batch(true)}
		start := make(chan struct{})
		errs := make(chan error, len(batches))
		for _, invs := range batches {
			go func() {
				<-start
				errs <- d.DB.Transaction(func(tx *gorm.DB) error {
					_, err := insertNew(tx, invs)
					return err
				})
			}()
		}
		close(start)
		for range batches {
			if err := <-errs; err != nil {
				t.Fatalf("round %d: a batch failed: %v", round, err)
			}
		}
	}
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM invoices"); n != 3*orders {
		t.Fatalf("%d invoices, want %d: one per order", n, 3*orders)
	}
}

// A cancellation voids its own order's invoice and no other: the invoices of the orders around
// it stay issued.
func TestCancellationVoidsOnlyItsOrdersInvoice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cancelled, others := uuid.New(), []uuid.UUID{uuid.New(), uuid.New()}
	for _, msg := range []messaging.Message{orderPlaced(t, others[0], 100), orderPlaced(t, cancelled, 200), orderPlaced(t, others[1], 300), orderCancelled(t, cancelled)} {
		if _, err := b.deliver(t, msg); err != nil {
			t.Fatal(err)
		}
	}
	if inv, _ := b.invoiceOf(t, cancelled); inv.Status != StatusVoid {
		t.Fatalf("the cancelled order's invoice is %s, want void", inv.Status)
	}
	for _, id := range others {
		if inv, _ := b.invoiceOf(t, id); inv.Status != StatusIssued || inv.VoidedAt != nil {
			t.Errorf("order %s, never cancelled: invoice %s voided at %v, want issued", id, inv.Status, inv.VoidedAt)
		}
	}
}

// The InvoiceIssued written with an invoice describes that invoice: its id, order, customer,
// amount and time (to the microsecond, as the row keeps it), on the invoicing exchange, with
// the OrderPlaced's correlation id.
func TestInvoiceIssuedDescribesTheInvoice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orderID := uuid.New()
	msg := orderPlaced(t, orderID, 4200)
	msg.CorrelationID = orderID.String()
	if _, err := b.deliver(t, msg); err != nil {
		t.Fatal(err)
	}
	inv, issued := b.invoiceOf(t, orderID)
	if issued != 1 {
		t.Fatalf("%d InvoiceIssued in the outbox, want 1", issued)
	}
	var row struct {
		Type          string
		Payload       json.RawMessage
		CorrelationID string
		OccurredAt    time.Time
		Exchange      *string
	}
	if err := b.db.Table("outbox_messages").Take(&row, "type = ?", events.InvoiceIssuedType).Error; err != nil {
		t.Fatal(err)
	}
	var ev events.InvoiceIssued
	if err := json.Unmarshal(row.Payload, &ev); err != nil {
		t.Fatal(err)
	}
	if ev.InvoiceID != inv.ID || ev.OrderID != orderID || ev.CustomerID != inv.CustomerID || inv.CustomerID != "c-42" ||
		ev.AmountCents != 4200 || !ev.IssuedAt.Equal(inv.CreatedAt) {
		t.Errorf("InvoiceIssued %+v does not describe invoice %+v", ev, inv)
	}
	exchange := "(none)"
	if row.Exchange != nil {
		exchange = *row.Exchange
	}
	if row.CorrelationID != msg.CorrelationID || !row.OccurredAt.Equal(inv.CreatedAt) || exchange != events.InvoicingExchange {
		t.Errorf("InvoiceIssued's row: correlation id %q, occurred at %v, exchange %s; want %q, the invoice's %v, %s",
			row.CorrelationID, row.OccurredAt, exchange, msg.CorrelationID, inv.CreatedAt, events.InvoicingExchange)
	}
}

// A batch of OrderPlaced, handled together as a backlog is, issues each order its own invoice
// and announces each with its own InvoiceIssued: the batch's rows are not confused with each
// other.
func TestABatchIssuesEachOrderItsOwnInvoice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orders := []uuid.UUID{uuid.New(), uuid.New(), uuid.New()}
	msgs := make([]messaging.Message, len(orders))
	for i, id := range orders {
		msgs[i] = orderPlaced(t, id, int64(100*(i+1)))
	}
	if dups, err := messagingtest.DeliverBatch(context.Background(), b.sub, msgs...); err != nil || slices.Contains(dups, true) {
		t.Fatalf("DeliverBatch = %v, %v; want every message handled", dups, err)
	}
	for i, id := range orders {
		inv, issued := b.invoiceOf(t, id)
		var payload []byte
		if err := b.db.Raw("SELECT payload FROM outbox_messages WHERE type = ? AND payload->>'order_id' = ?", events.InvoiceIssuedType, id.String()).
			Row().Scan(&payload); err != nil {
			t.Fatal(err)
		}
		var ev events.InvoiceIssued
		if err := json.Unmarshal(payload, &ev); err != nil {
			t.Fatal(err)
		}
		if inv.AmountCents != int64(100*(i+1)) || inv.MessageID != msgs[i].ID || issued != 1 || ev.InvoiceID != inv.ID || ev.AmountCents != inv.AmountCents {
			t.Errorf("order %d: invoice %+v, %d InvoiceIssued %+v; want its own amount and message, announced once as itself", i, inv, issued, ev)
		}
	}
	if n := len(b.logs.Lines("invoice issued")); n != len(orders) {
		t.Errorf("%d 'invoice issued' lines, want %d", n, len(orders))
	}
}

// Two OrderPlaced of one order in one batch (an event published twice upstream, both waiting
// in the queue) issue one invoice, the earlier message's, as one delivery at a time would; the
// later is logged as done already. The batch holds many such pairs, because the INSERT sorts
// its rows and a sort need not keep the batch's order among rows of one order.
func TestABatchKeepsTheEarlierOfTwoMessagesForAnOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const pairs = 20
	orders := make([]uuid.UUID, pairs)
	msgs := make([]messaging.Message, 2*pairs)
	for i := range orders {
		orders[i] = uuid.New()
		msgs[i], msgs[pairs+i] = orderPlaced(t, orders[i], 100), orderPlaced(t, orders[i], 100)
	}
	if dups, err := messagingtest.DeliverBatch(context.Background(), b.sub, msgs...); err != nil || slices.Contains(dups, true) {
		t.Fatalf("DeliverBatch = %v, %v; want every message handled", dups, err)
	}
	for i, id := range orders {
		if inv, issued := b.invoiceOf(t, id); inv.MessageID != msgs[i].ID || issued != 1 {
			t.Errorf("order %d: invoice %+v, announced %d times; want the earlier message %s's, announced once", i, inv, issued, msgs[i].ID)
		}
	}
	if n := len(b.logs.Lines("already invoiced by another message")); n != pairs {
		t.Errorf("%d 'already invoiced' lines, want one per later message, %d", n, pairs)
	}
}

// An order placed and then cancelled, both in one batch (a backlog, the order cancelled soon
// after it was placed), ends as one delivery at a time would: the invoice issued and announced,
// then voided; and a cancellation before its order, in one batch, as it would too.
func TestABatchHandlesAPlacementAndItsCancellationInTheirOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	placedFirst, cancelledFirst := uuid.New(), uuid.New()
	msgs := []messaging.Message{
		orderPlaced(t, placedFirst, 700), orderCancelled(t, placedFirst),
		orderCancelled(t, cancelledFirst), orderPlaced(t, cancelledFirst, 800),
	}
	if dups, err := messagingtest.DeliverBatch(context.Background(), b.sub, msgs...); err != nil || slices.Contains(dups, true) {
		t.Fatalf("DeliverBatch = %v, %v; want every message handled", dups, err)
	}
	if inv, issued := b.invoiceOf(t, placedFirst); inv.Status != StatusVoid || inv.AmountCents != 700 || issued != 1 ||
		inv.MessageID != msgs[0].ID || inv.VoidedAt == nil || inv.VoidedAt.Equal(inv.CreatedAt) {
		t.Errorf("placed, then cancelled: invoice %+v with %d InvoiceIssued; want issued from the placement, announced once, then voided", inv, issued)
	}
	if inv, issued := b.invoiceOf(t, cancelledFirst); inv.Status != StatusVoid || inv.AmountCents != 800 || issued != 0 {
		t.Errorf("cancelled, then placed: invoice %+v with %d InvoiceIssued; want void from the start, never announced", inv, issued)
	}
	for _, line := range []string{"invoice voided", "cancellation remembered before its order", "its invoice stays void"} {
		if n := len(b.logs.Lines(line)); n != 1 {
			t.Errorf("%d %q lines, want 1", n, line)
		}
	}
}

// An OrderPlaced for another customer than the order's row has is upstream disagreeing with
// itself, as another amount is: logged at ERROR, naming neither customer (an id may be an
// address), the row kept as it was.
// An order cancelled before it arrived still learns its amount from it. A row that is void
// is said to be void, not invoiced: one cancelled first never was.
func TestAnOrderPlacedForAnotherCustomerIsADisagreement(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cancelledFirst, issuedFirst, voidAgain := uuid.New(), uuid.New(), uuid.New()
	late := orderPlacedFor(t, cancelledFirst, "c-7", 900)
	other := orderPlacedFor(t, issuedFirst, "c-7", 2500)
	again := orderPlaced(t, voidAgain, 300)
	for _, msg := range []messaging.Message{
		orderCancelled(t, cancelledFirst), late,
		orderPlaced(t, issuedFirst, 2500), other,
		orderCancelled(t, voidAgain), orderPlaced(t, voidAgain, 300), again,
	} {
		if dup, err := b.deliver(t, msg); err != nil || dup {
			t.Fatalf("%s: duplicate=%v err=%v", msg.Type, dup, err)
		}
	}
	inv, issued := b.invoiceOf(t, cancelledFirst)
	if inv.Status != StatusVoid || inv.AmountCents != 900 || inv.CustomerID != "c-42" || inv.PlacedMessageID == nil ||
		*inv.PlacedMessageID != late.ID || issued != 0 {
		t.Fatalf("cancelled first: invoice %+v with %d InvoiceIssued, want void of 900 for c-42 from message %s, never announced",
			inv, issued, late.ID)
	}
	if inv, issued := b.invoiceOf(t, issuedFirst); inv.Status != StatusIssued || inv.CustomerID != "c-42" || issued != 1 {
		t.Fatalf("issued first: invoice %+v with %d InvoiceIssued, want issued for c-42, once", inv, issued)
	}
	for _, want := range [][]string{
		{"level=ERROR", "order was cancelled before it arrived, for another customer; its invoice stays void",
			"message_id=" + late.ID.String()},
		{"level=ERROR", "order already invoiced by another message, with another customer; nothing done",
			"message_id=" + other.ID.String()},
		{"level=WARN", "order already cancelled, its invoice void; nothing to do", "message_id=" + again.ID.String()},
	} {
		if n := len(b.logs.Lines(want...)); n != 1 {
			t.Errorf("%d lines with %q, want 1:\n%s", n, want, b.logs)
		}
	}
	if n := len(b.logs.Lines("already invoiced", "message_id="+again.ID.String())); n != 0 {
		t.Errorf("%d lines saying the order cancelled first was invoiced, want none", n)
	}
	if n := len(b.logs.Lines("customer_id=")); n != 0 {
		t.Errorf("%d lines name the customer, want none: a customer's id may be an address", n)
	}
	if n := b.alreadyDone.Load(); n != 2 {
		t.Errorf("%d messages counted as done already, want 2: the issued order's and the void order's second OrderPlaced", n)
	}
}

// An OrderCancelled for another customer than the invoice it voids is upstream disagreeing with
// itself, as an OrderPlaced for another customer than its order's void row is: logged at ERROR,
// naming neither customer, the row keeping its own. The same cancellation for the invoice's
// customer is the usual "invoice voided", at INFO.
func TestAnOrderCancelledForAnotherCustomerIsADisagreement(t *testing.T) {
	t.Parallel()
	b := setup(t)
	other, same := uuid.New(), uuid.New()
	otherCancel, sameCancel := orderCancelledFor(t, other, "c-7"), orderCancelled(t, same)
	for _, msg := range []messaging.Message{orderPlaced(t, other, 2500), otherCancel, orderPlaced(t, same, 700), sameCancel} {
		if dup, err := b.deliver(t, msg); err != nil || dup {
			t.Fatalf("%s: duplicate=%v err=%v", msg.Type, dup, err)
		}
	}
	if inv, issued := b.invoiceOf(t, other); inv.Status != StatusVoid || inv.CustomerID != "c-42" || inv.AmountCents != 2500 || issued != 1 {
		t.Fatalf("invoice %+v with %d InvoiceIssued, want void, for c-42 still, issued once before", inv, issued)
	}
	for _, want := range [][]string{
		{"level=ERROR", "invoice voided, for another customer", "message_id=" + otherCancel.ID.String()},
		{"level=INFO", `msg="invoice voided"`, "message_id=" + sameCancel.ID.String()},
	} {
		if n := len(b.logs.Lines(want...)); n != 1 {
			t.Errorf("%d lines with %q, want 1:\n%s", n, want, b.logs)
		}
	}
	if n := len(b.logs.Lines("invoice voided", "message_id="+otherCancel.ID.String())); n != 1 {
		t.Errorf("%d lines of the voiding for another customer, want 1:\n%s", n, b.logs)
	}
	if n := len(b.logs.Lines("customer_id=")) + len(b.logs.Lines("=c-7")); n != 0 {
		t.Errorf("%d lines name a customer, want none: a customer's id may be an address", n)
	}
}

// Migration 00004 adds placed_message_id, NULL on every row written before it. Of the void rows
// among those, only the one a cancellation wrote before its order, voided as it was created and
// with no amount yet, awaits its order: an OrderPlaced after the migration gives it its amount.
// The others keep theirs, and the OrderPlaced finds its work done: a row issued and voided later
// (for an amount, or for 0: voided after it was created), and a row cancelled first whose order
// came before the migration (its amount known).
func TestMigrationToPlacedMessageKeepsTheAmountsKnown(t *testing.T) {
	t.Parallel()
	d := testenv.NewDatabase(t)
	d.MigrateTo(t, migrations, "migrations", "invoicing_schema", 3)
	issued, issuedFree, learned, waiting := uuid.New(), uuid.New(), uuid.New(), uuid.New()
	// As the invoicer wrote them then: a void row of a cancellation that came first is voided as
	// it is created; an issued one is voided later.
	for _, row := range []struct {
		order       uuid.UUID
		amount      int64
		voidedLater bool
	}{{issued, 2500, true}, {issuedFree, 0, true}, {learned, 900, false}, {waiting, 0, false}} {
		if err := d.DB.Exec(`INSERT INTO invoices (id, order_id, customer_id, amount_cents, status, message_id, created_at, voided_at)
VALUES (?, ?, 'c-42', ?, 'void', ?, now(), now() + CASE WHEN ? THEN interval '1 second' ELSE interval '0' END)`,
			uuid.New(), row.order, row.amount, uuid.New(), row.voidedLater).Error; err != nil {
			t.Fatal(err)
		}
	}

	b := setupOn(t, d)
	late := orderPlaced(t, waiting, 700)
	for _, msg := range []messaging.Message{orderPlaced(t, issued, 700), orderPlaced(t, issuedFree, 700), orderPlaced(t, learned, 700), late} {
		if dup, err := b.deliver(t, msg); err != nil || dup {
			t.Fatalf("%s: duplicate=%v err=%v", msg.Type, dup, err)
		}
	}
	for _, want := range []struct {
		order  uuid.UUID
		what   string
		amount int64
		placed *uuid.UUID
	}{
		{issued, "issued, then voided", 2500, nil},
		{issuedFree, "issued for 0, then voided", 0, nil},
		{learned, "cancelled first, its amount known", 900, nil},
		{waiting, "cancelled first, awaiting its order", 700, &late.ID},
	} {
		inv, announced := b.invoiceOf(t, want.order)
		placedOK := (inv.PlacedMessageID == nil) == (want.placed == nil) && (want.placed == nil || *inv.PlacedMessageID == *want.placed)
		if inv.Status != StatusVoid || inv.AmountCents != want.amount || !placedOK || announced != 0 {
			t.Errorf("%s: invoice %+v with %d InvoiceIssued, want void of %d, placed by %v, never announced", want.what, inv, announced, want.amount, want.placed)
		}
	}
	if n := b.alreadyDone.Load(); n != 3 {
		t.Errorf("%d messages counted as done already, want the 3 whose rows knew their amount", n)
	}
	if n := len(b.logs.Lines("its invoice stays void")); n != 1 {
		t.Errorf("%d 'cancelled before it arrived' lines, want 1 (the awaiting row's order)", n)
	}
}

// A second OrderCancelled for another customer than the void invoice's is the same disagreement
// as the first for another customer would be: one ERROR line, naming neither customer, the row
// kept as it was and the message counted as done already. So whether the invoice was issued and
// voided, or the first cancellation came before its order.
func TestASecondOrderCancelledForAnotherCustomerIsADisagreement(t *testing.T) {
	t.Parallel()
	b := setup(t)
	issuedFirst, cancelledFirst := uuid.New(), uuid.New()
	issuedOther, cancelledOther := orderCancelledFor(t, issuedFirst, "c-7"), orderCancelledFor(t, cancelledFirst, "c-7")
	for _, msg := range []messaging.Message{
		orderPlaced(t, issuedFirst, 2500), orderCancelled(t, issuedFirst), issuedOther,
		orderCancelled(t, cancelledFirst), cancelledOther,
	} {
		if dup, err := b.deliver(t, msg); err != nil || dup {
			t.Fatalf("%s: duplicate=%v err=%v", msg.Type, dup, err)
		}
	}
	for _, order := range []uuid.UUID{issuedFirst, cancelledFirst} {
		if inv, _ := b.invoiceOf(t, order); inv.Status != StatusVoid || inv.CustomerID != "c-42" {
			t.Errorf("invoice %+v, want void, for c-42 still", inv)
		}
	}
	for _, msg := range []messaging.Message{issuedOther, cancelledOther} {
		want := []string{"level=ERROR", "order already cancelled by another message, for another customer; nothing to do", "message_id=" + msg.ID.String()}
		if n := len(b.logs.Lines(want...)); n != 1 {
			t.Errorf("%d lines with %q, want 1:\n%s", n, want, b.logs)
		}
		if n := len(b.logs.Lines("level=WARN", "message_id="+msg.ID.String())); n != 0 {
			t.Errorf("%d WARN lines of message %s besides the ERROR, want none:\n%s", n, msg.ID, b.logs)
		}
	}
	if n := len(b.logs.Lines("customer_id=")) + len(b.logs.Lines("=c-7")); n != 0 {
		t.Errorf("%d lines name a customer, want none: a customer's id may be an address", n)
	}
	if n := b.alreadyDone.Load(); n != 2 {
		t.Errorf("%d messages counted as done already, want the 2 second cancellations", n)
	}
}
