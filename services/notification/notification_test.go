package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/mail"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/messagingtest"
)

type testBundle struct {
	db    *gorm.DB
	drv   messaging.DB // db, for the library's interfaces
	sub   *platform.Subscription
	logs  *testenv.Logs
	smtp  *testenv.SMTPServer
	send  *sender
	wakes atomic.Int32 // how often a handler woke the sender
	// alreadyDone counts the messages whose notification another message had recorded.
	alreadyDone atomic.Int32
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	d := testenv.NewDatabase(t)
	d.Migrate(t, platform.Library(messaging.MigrateInbox), platform.Migrations(migrations, "migrations", "notification_schema"))
	log, logs := testenv.NewLogger(t)
	// Deliver needs no broker: the URL is never dialled.
	sub, err := messaging.NewSubscription(d.Driver(t), messaging.SubscriptionConfig{Name: Consumer, URL: "amqp://unused", Topology: events.Topology,
		BatchByType: batchByType, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	b := &testBundle{db: d.DB, drv: d.Driver(t).DB(), sub: sub, logs: logs, smtp: testenv.NewSMTPServer(t)}
	mailer := newSMTPDeliverer(b.smtp.Addr, "orders@shop.example", DefaultSMTPConns)
	t.Cleanup(mailer.Close)
	b.send = newSender(d.DB, mailer, DefaultConcurrency, 10*time.Second, log)
	b.send.backoff.Base = 200 * time.Millisecond
	if err := (notifier{log: log, domain: "customers.example", wake: func() { b.wakes.Add(1); b.send.Wake() },
		alreadyDone: func() { b.alreadyDone.Add(1) }}).subscribe(sub); err != nil {
		t.Fatal(err)
	}
	// Each message counted as done already logs one line marked already_done=true, whatever its
	// wording, and no other line is: what a process did while it shut down, after the test read
	// its count, shows only in these lines (internal/systest counts them).
	t.Cleanup(func() {
		if n, marked := b.alreadyDone.Load(), len(logs.Lines("already_done=true")); int(n) != marked {
			t.Errorf("%d messages counted as done already, and %d log lines marked already_done=true: want one each:\n%s", n, marked, logs)
		}
	})
	return b
}

func message[T any](t *testing.T, ev messaging.Event[T], payload T) messaging.Message {
	t.Helper()
	msg, err := ev.Message(payload)
	if err != nil {
		t.Fatal(err)
	}
	return msg
}

func orderPlaced(t *testing.T, orderID uuid.UUID, customer string) messaging.Message {
	t.Helper()
	return message(t, events.OrderPlacedEvent, events.OrderPlaced{
		OrderID: orderID, CustomerID: customer, TotalCents: 2599, PlacedAt: time.Now().UTC(),
		Lines: []events.Line{{SKU: "SKU-1", Quantity: 2, UnitPriceCents: 1250}, {SKU: "SKU-2", Quantity: 1, UnitPriceCents: 99}},
	})
}

func invoiceIssued(t *testing.T, orderID uuid.UUID, customer string) messaging.Message {
	t.Helper()
	return message(t, events.InvoiceIssuedEvent, events.InvoiceIssued{
		InvoiceID: uuid.New(), OrderID: orderID, CustomerID: customer, AmountCents: 2599, IssuedAt: time.Now().UTC(),
	})
}

func orderCancelled(t *testing.T, orderID uuid.UUID, customer string) messaging.Message {
	t.Helper()
	return message(t, events.OrderCancelledEvent, events.OrderCancelled{
		// The order service takes a line separator in a reason, and a run of spaces: the e-mail
		// folds them into one line.
		OrderID: orderID, CustomerID: customer, Reason: "changed\u2028my  mind", CancelledAt: time.Now().UTC(),
	})
}

// deliver hands msg to the subscription as a delivery from the queue would, and reports
// whether the inbox skipped it as a duplicate.
func (b *testBundle) deliver(t *testing.T, msg messaging.Message) (duplicate bool) {
	t.Helper()
	duplicate, err := messagingtest.Deliver(context.Background(), b.sub, msg)
	if err != nil {
		t.Fatalf("deliver %s %s: %v", msg.Type, msg.ID, err)
	}
	return duplicate
}

// kinds returns the order's notifications by kind.
func (b *testBundle) kinds(t *testing.T, orderID uuid.UUID) map[string]Notification {
	t.Helper()
	var list []Notification
	if err := b.db.Find(&list, "order_id = ?", orderID).Error; err != nil {
		t.Fatal(err)
	}
	byKind := map[string]Notification{}
	for _, n := range list {
		if _, ok := byKind[n.Kind]; ok {
			t.Fatalf("order %s has two %s notifications", orderID, n.Kind)
		}
		byKind[n.Kind] = n
	}
	return byKind
}

// row is the one notification the test recorded.
func (b *testBundle) row(t *testing.T) Notification {
	t.Helper()
	var n Notification
	if err := b.db.Take(&n).Error; err != nil {
		t.Fatal(err)
	}
	return n
}

// run runs the sender until the test ends, or until the function it returns is called: Run
// must be stopped before a test's own pass (deliverOne) that must find nothing left, so that
// Run cannot be leasing at the same time.
func (b *testBundle) run(t *testing.T) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.send.Run(ctx) }()
	stop = sync.OnceFunc(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	t.Cleanup(stop)
	return stop
}

// An order that gets all three events gets one e-mail of each kind, each with its
// notification's id as Message-ID, sent once.
func TestOneNotificationPerKindDeliveredByMailOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.smtp.Start()
	stopSender := b.run(t)
	orderID := uuid.New()
	invoice := invoiceIssued(t, orderID, "c-42")
	for _, msg := range []messaging.Message{orderPlaced(t, orderID, "c-42"), invoice, orderCancelled(t, orderID, "c-42")} {
		b.deliver(t, msg)
	}

	testenv.Eventually(t, 10*time.Second, func() bool { return len(b.smtp.Mail()) == 3 }, "not all three e-mails arrived")
	testenv.Eventually(t, 5*time.Second, func() bool {
		return testenv.Count(t, b.db, "SELECT count(*) FROM notifications WHERE status = 'sent' AND sent_at IS NOT NULL") == 3
	}, "notifications not marked sent")
	if n := b.wakes.Load(); n != 3 {
		t.Fatalf("the sender was woken %d times, want once per notification", n)
	}

	mails := map[string]testenv.Mail{}
	for _, m := range b.smtp.Mail() {
		mails[m.MessageID] = m
	}
	issued, err := events.InvoiceIssuedEvent.Decode(invoice)
	if err != nil {
		t.Fatal(err)
	}
	for kind, want := range map[string]struct{ subject, body string }{
		KindOrderConfirmation: {"Your order " + orderID.String(), "Total: 25.99"},
		KindInvoice:           {"Your invoice " + issued.InvoiceID.String(), "Amount: 25.99"},
		KindOrderCancelled:    {"Your order " + orderID.String() + " was cancelled", "Reason: changed my mind\r\n"},
	} {
		n, ok := b.kinds(t, orderID)[kind]
		if !ok {
			t.Fatalf("no %s notification", kind)
		}
		m, ok := mails["<"+n.ID.String()+"@"+MessageIDDomain+">"]
		if !ok {
			t.Fatalf("no e-mail with the Message-ID of the %s notification %s", kind, n.ID)
		}
		if m.To != "c-42@customers.example" || m.Header.Get("X-Order-Id") != orderID.String() ||
			m.Header.Get("Subject") != want.subject || !strings.Contains(m.Body, want.body) {
			t.Errorf("%s e-mail = %+v, want subject %q and %q in the body, to c-42@customers.example", kind, m, want.subject, want.body)
		}
	}
	// Nothing is left to send: another pass claims nothing and sends nothing.
	stopSender()
	if delivered, err := b.send.deliverOne(context.Background()); err != nil || delivered {
		t.Fatalf("another pass delivered %v (%v), want nothing", delivered, err)
	}
	if got := len(b.smtp.Mail()); got != 3 {
		t.Fatalf("%d e-mails, want 3", got)
	}
}

// A customer's e-mail address is personal data: it goes into the notification and the e-mail,
// not into the lines about recording and delivering them. (A server's refusal of a recipient
// may quote it, and its reply is logged as the failure's error.)
func TestLogsNeverCarryTheCustomersAddress(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.smtp.Start()
	b.run(t)
	orderID := uuid.New()
	b.deliver(t, orderPlaced(t, orderID, "ann@example.org"))
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, b.db, "SELECT count(*) FROM notifications WHERE order_id = ? AND status = 'sent'", orderID) == 1
	}, "the confirmation was not sent")
	if n := len(b.logs.Lines("notification recorded", "order_id="+orderID.String())); n != 1 {
		t.Fatalf("%d 'notification recorded' lines, want 1", n)
	}
	if lines := b.logs.Lines("ann@example.org"); len(lines) != 0 {
		t.Fatalf("the customer's address is logged:\n%s", strings.Join(lines, "\n"))
	}
}

// Every event delivered twice: the inbox skips each repeat, and the handlers never see it.
func TestRedeliveriesAreSkippedByTheInbox(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orderID := uuid.New()
	msgs := []messaging.Message{orderPlaced(t, orderID, "c-42"), invoiceIssued(t, orderID, "c-42"), orderCancelled(t, orderID, "c-42")}
	for _, msg := range msgs {
		if b.deliver(t, msg) {
			t.Fatalf("first delivery of %s reported a duplicate", msg.Type)
		}
	}
	for _, msg := range msgs {
		if !b.deliver(t, msg) {
			t.Fatalf("redelivery of %s not reported a duplicate", msg.Type)
		}
		if n := len(b.logs.Lines("duplicate message skipped", "message_id="+msg.ID.String())); n != 1 {
			t.Fatalf("%d duplicate lines for %s, want 1", n, msg.Type)
		}
	}
	if got := b.kinds(t, orderID); len(got) != 3 {
		t.Fatalf("notifications %+v, want one of each kind", got)
	}
	// Each message is in the inbox once, under this consumer's name: another consumer of the
	// same database keeps its own record of what it handled.
	for _, msg := range msgs {
		if n := testenv.Count(t, b.db, "SELECT count(*) FROM inbox_messages WHERE message_id = ? AND consumer = ?", msg.ID, Consumer); n != 1 {
			t.Fatalf("%s: %d inbox records for the consumer %q, want 1", msg.Type, n, Consumer)
		}
	}
	b.wantRecorded(t, 3, 0)
}

// wantRecorded requires n notifications in all, each having woken the sender once, and
// alreadyHad "already has a" lines, each counted as a message already done.
func (b *testBundle) wantRecorded(t *testing.T, n int64, alreadyHad int) {
	t.Helper()
	if got := testenv.Count(t, b.db, "SELECT count(*) FROM notifications"); got != n {
		t.Fatalf("%d notifications, want %d", got, n)
	}
	if got := len(b.logs.Lines("already has a")); got != alreadyHad {
		t.Fatalf("%d 'already has a' lines, want %d (the inbox stops a redelivery before the handler)", got, alreadyHad)
	}
	if got := int(b.alreadyDone.Load()); got != alreadyHad {
		t.Fatalf("%d messages counted as already done, want %d", got, alreadyHad)
	}
	if got := int64(b.wakes.Load()); got != n {
		t.Fatalf("the sender was woken %d times, want once per new notification, %d", got, n)
	}
}

// Another message about an order and kind that already has its notification (an event
// published twice upstream) records nothing and says so once, after the commit.
func TestSameKindFromAnotherMessageIsNotRecordedAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orderID := uuid.New()
	eventOf := map[string]func(*testing.T, uuid.UUID, string) messaging.Message{
		KindOrderConfirmation: orderPlaced, KindInvoice: invoiceIssued, KindOrderCancelled: orderCancelled,
	}
	first := map[string]messaging.Message{}
	for kind, event := range eventOf {
		first[kind] = event(t, orderID, "c-42")
		b.deliver(t, first[kind])
	}
	for kind, event := range eventOf {
		again := event(t, orderID, "c-42")
		if b.deliver(t, again) {
			t.Fatalf("%s: a new message reported a duplicate", kind)
		}
		if n := len(b.logs.Lines("level=WARN", "already has a "+kind, "message_id="+again.ID.String())); n != 1 {
			t.Fatalf("%s: %d 'already has a %s' lines for the second message, want 1", kind, n, kind)
		}
	}
	got := b.kinds(t, orderID)
	for kind, msg := range first {
		if n, ok := got[kind]; !ok || n.MessageID != msg.ID {
			t.Errorf("%s notification = %+v, want the one from the first message %s", kind, n, msg.ID)
		}
	}
	b.wantRecorded(t, 3, 3)
}

// A batch of deliveries waiting together is recorded with one INSERT: each message gets its own
// order's notification, and a later message of the batch about the same order and kind is
// skipped as it would be one delivery at a time: the earlier message's notification stands,
// however many such pairs the batch holds (the INSERT sorts its rows, and a sort need not keep
// the batch's order among equal keys).
func TestABatchRecordsEachMessageItsOwnNotification(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first, second := uuid.New(), uuid.New()
	batch := []messaging.Message{
		orderPlaced(t, first, "c-1"), orderPlaced(t, second, "c-2"), invoiceIssued(t, first, "c-1"),
		orderPlaced(t, first, "c-1"), orderCancelled(t, second, "c-2"),
	}
	want := map[uuid.UUID]map[string]messaging.Message{
		first:  {KindOrderConfirmation: batch[0], KindInvoice: batch[2]},
		second: {KindOrderConfirmation: batch[1], KindOrderCancelled: batch[4]},
	}
	customer := map[uuid.UUID]string{first: "c-1", second: "c-2"}
	later := []messaging.Message{batch[3]}
	const pairs = 20
	for range pairs {
		order := uuid.New()
		earlier := orderPlaced(t, order, "c-3")
		batch = append(batch, earlier)
		later = append(later, orderPlaced(t, order, "c-3"))
		want[order], customer[order] = map[string]messaging.Message{KindOrderConfirmation: earlier}, "c-3"
	}
	batch = append(batch, later[1:]...)
	duplicates, err := messagingtest.DeliverBatch(context.Background(), b.sub, batch...)
	if err != nil || slices.Contains(duplicates, true) {
		t.Fatalf("DeliverBatch = %v, %v; want no duplicate and no error", duplicates, err)
	}
	for order, kinds := range want {
		got := b.kinds(t, order)
		if len(got) != len(kinds) {
			t.Fatalf("order %s has %d notifications, want %d", order, len(got), len(kinds))
		}
		for kind, msg := range kinds {
			if n := got[kind]; n.MessageID != msg.ID || n.CustomerID != customer[order] || n.Recipient != customer[order]+"@customers.example" {
				t.Errorf("order %s's %s notification = %+v, want the earlier message %s's, to %s", order, kind, n, msg.ID, customer[order])
			}
		}
	}
	for _, msg := range later {
		if n := len(b.logs.Lines("level=WARN", "already has a "+KindOrderConfirmation, "message_id="+msg.ID.String())); n != 1 {
			t.Fatalf("%d 'already has a %s' lines for the later message %s, want 1", n, KindOrderConfirmation, msg.ID)
		}
	}
	b.wantRecorded(t, 4+pairs, 1+pairs)
}

// A notification is created and due at the database's clock, the one its lease and the
// backlog's age are read by: at its transaction's now(), which also stamped the message's inbox
// row, not at a consumer replica's own time, which may run ahead or behind.
func TestANotificationIsCreatedAndDueByTheDatabasesClock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	msg := orderPlaced(t, uuid.New(), "c-1")
	if b.deliver(t, msg) {
		t.Fatal("the first delivery was skipped as a duplicate")
	}
	var atTheClaim bool
	if err := b.db.Raw(`SELECT n.created_at = i.processed_at AND n.next_attempt_at = i.processed_at
FROM notifications n JOIN inbox_messages i ON i.message_id = n.message_id WHERE n.message_id = ?`, msg.ID).Scan(&atTheClaim).Error; err != nil {
		t.Fatal(err)
	}
	if !atTheClaim {
		t.Fatal("the notification's created_at and next_attempt_at are not its transaction's now(), the inbox row's processed_at")
	}
}

// A backlog that interleaves event types is recorded with one INSERT per type, not one per
// message (see batchByType): each batch handler is given all of its event's messages at once.
func TestABatchRecordsEachEventTypeAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var batch []messaging.Message
	for range 3 {
		order := uuid.New()
		batch = append(batch, orderPlaced(t, order, "c-1"), invoiceIssued(t, order, "c-1"))
	}
	if dups, err := messagingtest.DeliverBatch(context.Background(), b.sub, batch...); err != nil || slices.Contains(dups, true) {
		t.Fatalf("DeliverBatch = %v, %v; want every message handled", dups, err)
	}
	for _, typ := range []string{events.OrderPlacedType, events.InvoiceIssuedType} {
		if n := len(b.logs.Lines(`msg="message handled"`, "type="+typ+" ", "batch=3")); n != 3 {
			t.Errorf("%d %s messages handled in a batch of 3, want all 3: one INSERT for the type", n, typ)
		}
	}
	b.wantRecorded(t, 6, 0)
}

// Events of one order arrive in any order: a cancellation ahead of its OrderPlaced still
// leaves both notifications.
func TestCancellationBeforeTheOrderStillNotifiesBoth(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orderID := uuid.New()
	b.deliver(t, orderCancelled(t, orderID, "ann@example.org"))
	b.deliver(t, orderPlaced(t, orderID, "ann@example.org"))
	got := b.kinds(t, orderID)
	if len(got) != 2 || got[KindOrderCancelled].Recipient != "ann@example.org" || got[KindOrderConfirmation].Status != StatusPending {
		t.Fatalf("notifications = %+v, want a pending confirmation and cancellation to ann@example.org", got)
	}
}

// An invoice ahead of its OrderPlaced still leaves the order one confirmation and one invoice,
// the same rows as when the order comes first: neither handler waits for the other's row. The
// redeliveries of both are skipped by the inbox and record nothing more.
func TestInvoiceBeforeTheOrderStillNotifiesBoth(t *testing.T) {
	t.Parallel()
	b := setup(t)
	invoiceFirst, placedFirst := uuid.New(), uuid.New()
	sent := map[uuid.UUID]map[string]messaging.Message{}
	for _, order := range []uuid.UUID{invoiceFirst, placedFirst} {
		sent[order] = map[string]messaging.Message{KindInvoice: invoiceIssued(t, order, "c-42"), KindOrderConfirmation: orderPlaced(t, order, "c-42")}
	}
	arrivals := []messaging.Message{
		sent[invoiceFirst][KindInvoice], sent[invoiceFirst][KindOrderConfirmation],
		sent[placedFirst][KindOrderConfirmation], sent[placedFirst][KindInvoice],
	}
	for _, msg := range arrivals {
		if b.deliver(t, msg) {
			t.Fatalf("first delivery of %s %s reported a duplicate", msg.Type, msg.ID)
		}
	}
	for _, msg := range arrivals {
		if !b.deliver(t, msg) {
			t.Fatalf("redelivery of %s %s not reported a duplicate", msg.Type, msg.ID)
		}
	}
	// Four notifications, each recorded once; no redelivery reached a handler to be skipped there.
	b.wantRecorded(t, 4, 0)

	// shape is an order's notification of kind with its ids blanked, in its text too: what must
	// not depend on which event came first.
	shape := func(order uuid.UUID, kind string) Notification {
		t.Helper()
		n, ok := b.kinds(t, order)[kind]
		if msg := sent[order][kind]; !ok || n.OrderID != order || n.MessageID != msg.ID || n.CustomerID != "c-42" ||
			n.Recipient != "c-42@customers.example" || n.Status != StatusPending || n.Attempts != 0 {
			t.Fatalf("order %s's %s notification = %+v, want message %s's, pending, to c-42@customers.example", order, kind, n, msg.ID)
		}
		invoice, err := events.InvoiceIssuedEvent.Decode(sent[order][KindInvoice])
		if err != nil {
			t.Fatal(err)
		}
		ids := strings.NewReplacer(order.String(), "<order>", invoice.InvoiceID.String(), "<invoice>")
		n.Subject, n.Body = ids.Replace(n.Subject), ids.Replace(n.Body)
		n.ID, n.OrderID, n.MessageID, n.TraceParent, n.TraceState = uuid.Nil, uuid.Nil, uuid.Nil, "", ""
		n.CreatedAt, n.NextAttemptAt = time.Time{}, time.Time{}
		return n
	}
	for _, order := range []uuid.UUID{invoiceFirst, placedFirst} {
		if got := b.kinds(t, order); len(got) != 2 {
			t.Fatalf("order %s has notifications %+v, want a confirmation and an invoice", order, got)
		}
	}
	for _, kind := range []string{KindOrderConfirmation, KindInvoice} {
		if got, want := shape(invoiceFirst, kind), shape(placedFirst, kind); got != want {
			t.Errorf("%s notification with the invoice first = %+v, with the order first = %+v; want the same", kind, got, want)
		}
	}
}

// A message that can never become a notification is a permanent error (the consumer
// dead-letters it), and the rolled-back transaction leaves neither a notification nor an inbox
// record.
func TestInvalidInvoiceIssuedIsPermanentAndWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	valid := events.InvoiceIssued{InvoiceID: uuid.New(), OrderID: uuid.New(), CustomerID: "c-42", AmountCents: 100, IssuedAt: time.Now().UTC()}
	noInvoice, noCustomer, negative := valid, valid, valid
	noInvoice.InvoiceID, noCustomer.CustomerID, negative.AmountCents = uuid.Nil, "", -1
	wrongShape := message(t, events.InvoiceIssuedEvent, valid)
	wrongShape.Payload = json.RawMessage(`{"invoice_id": 5}`)
	for name, msg := range map[string]messaging.Message{
		"no invoice id":   message(t, events.InvoiceIssuedEvent, noInvoice),
		"no customer id":  message(t, events.InvoiceIssuedEvent, noCustomer),
		"negative amount": message(t, events.InvoiceIssuedEvent, negative),
		"wrong shape":     wrongShape,
	} {
		if _, err := messagingtest.Deliver(context.Background(), b.sub, msg); !messaging.IsPermanent(err) {
			t.Errorf("%s: err = %v, want a permanent error", name, err)
		}
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM notifications") + testenv.Count(t, b.db, "SELECT count(*) FROM inbox_messages"); n != 0 {
		t.Fatalf("%d rows written for invalid messages", n)
	}
}

// An OrderPlaced whose SKU holds a line break, which would forge a line of the confirmation
// (a total of its own), is a permanent error, and writes nothing: no e-mail shows it.
func TestOrderPlacedWithALineBreakInASKUIsPermanentAndWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ev := events.OrderPlaced{OrderID: uuid.New(), CustomerID: "c-42", TotalCents: 100000, PlacedAt: time.Now().UTC(),
		Lines: []events.Line{{SKU: "SKU-1 at 0.00\r\n\r\nTotal: 0.00\r\n\r\n", Quantity: 1, UnitPriceCents: 100000}}}
	if _, err := messagingtest.Deliver(context.Background(), b.sub, message(t, events.OrderPlacedEvent, ev)); !messaging.IsPermanent(err) {
		t.Errorf("err = %v, want a permanent error", err)
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM notifications") + testenv.Count(t, b.db, "SELECT count(*) FROM inbox_messages"); n != 0 {
		t.Fatalf("%d rows written for an OrderPlaced whose SKU forges lines", n)
	}
}

// The system's topology binds the notification queue to exactly the events the notifier
// handles, each on the exchange it comes from: the subscription starts.
func TestSubscriptionBindsEveryEvent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if _, err := b.sub.Topology(); err != nil {
		t.Fatal(err)
	}
	q, _ := events.Topology.Queue(Consumer)
	want := []messaging.Binding{
		{Exchange: events.Exchange, RoutingKey: events.OrderPlacedType},
		{Exchange: events.InvoicingExchange, RoutingKey: events.InvoiceIssuedType},
		{Exchange: events.Exchange, RoutingKey: events.OrderCancelledType},
	}
	if !slices.Equal(q.Bindings, want) {
		t.Fatalf("bindings = %+v, want %+v", q.Bindings, want)
	}
}

// Migration 00002 keeps the confirmations written under 00001; from then on an order holds one
// notification of each known kind, and no other.
func TestMigrationToKindsKeepsExistingConfirmations(t *testing.T) {
	t.Parallel()
	d := testenv.NewDatabase(t)
	d.MigrateTo(t, migrations, "migrations", "notification_schema", 1)
	orderID := uuid.New()
	insert := func(kind string) error {
		return d.DB.Exec(`INSERT INTO notifications (id, order_id, customer_id, kind, recipient, subject, body, message_id)
VALUES (?, ?, 'c-1', ?, 'c-1@customers.example', 'subject', 'body', ?)`, uuid.New(), orderID, kind, uuid.New()).Error
	}
	if err := insert(KindOrderConfirmation); err != nil {
		t.Fatal(err)
	}

	d.Migrate(t, platform.Migrations(migrations, "migrations", "notification_schema"))
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM notifications WHERE order_id = ? AND kind = ?", orderID, KindOrderConfirmation); n != 1 {
		t.Fatalf("%d confirmations after the migration, want the 1 from before", n)
	}
	for _, kind := range []string{KindInvoice, KindOrderCancelled} {
		if err := insert(kind); err != nil {
			t.Fatalf("insert %s next to the confirmation: %v", kind, err)
		}
	}
	if err := insert(KindOrderConfirmation); err == nil || !strings.Contains(err.Error(), "notifications_order_id_kind_key") {
		t.Fatalf("second confirmation: err = %v, want the unique (order_id, kind) violated", err)
	}
	if err := insert("sms"); err == nil || !strings.Contains(err.Error(), "notifications_kind_check") {
		t.Fatalf("unknown kind: err = %v, want the kind check violated", err)
	}
}

// Migrations 00006 and 00007 let a notification be undeliverable, and no other new status,
// keeping the rows written before as they were; the replaced check ends validated.
func TestMigrationToUndeliverableKeepsTheRows(t *testing.T) {
	t.Parallel()
	d := testenv.NewDatabase(t)
	d.MigrateTo(t, migrations, "migrations", "notification_schema", 5)
	insert := func(status string) error {
		return d.DB.Exec(`INSERT INTO notifications (id, order_id, customer_id, kind, recipient, subject, body, status, message_id)
VALUES (?, ?, 'c-1', ?, 'c-1@customers.example', 'subject', 'body', ?, ?)`, uuid.New(), uuid.New(), KindOrderConfirmation, status, uuid.New()).Error
	}
	for _, status := range []string{StatusPending, StatusSent} {
		if err := insert(status); err != nil {
			t.Fatal(err)
		}
	}
	if err := insert(StatusUndeliverable); err == nil || !strings.Contains(err.Error(), "notifications_status_check") {
		t.Fatalf("undeliverable before 00006: err = %v, want the status check violated", err)
	}

	d.Migrate(t, platform.Migrations(migrations, "migrations", "notification_schema"))
	for _, status := range []string{StatusPending, StatusSent} {
		if n := testenv.Count(t, d.DB, "SELECT count(*) FROM notifications WHERE status = ?", status); n != 1 {
			t.Fatalf("%d %s notifications after the migrations, want the 1 from before", n, status)
		}
	}
	if err := insert(StatusUndeliverable); err != nil {
		t.Fatalf("undeliverable after 00006: %v", err)
	}
	if err := insert("bounced"); err == nil || !strings.Contains(err.Error(), "notifications_status_check") {
		t.Fatalf("unknown status: err = %v, want the status check violated", err)
	}
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM pg_constraint WHERE conname = 'notifications_status_check' AND convalidated"); n != 1 {
		t.Fatalf("%d validated status checks, want 1", n)
	}
}

// While the mail server is away the notification waits in the backlog gauges, charged nothing:
// no attempt, no error, no delivery counted in notification_deliveries_total, no backoff; the
// outage is logged once at each end, and notification_mail_server_unreachable reads 1 until it
// ends. Once the server is back, the sender's probes find it
// within seconds, with the production backoff (which, charged for the outage, would have put
// the e-mail off for up to NOTIFY_MAX_BACKOFF), and the e-mail goes out once.
func TestConfirmationIsDeliveredOnceTheMailServerComesBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reg := prometheus.NewRegistry()
	if err := b.send.registerMetrics(reg); err != nil {
		t.Fatal(err)
	}
	if err := registerBacklog(reg, b.drv, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	deliveries := func(outcome string) float64 {
		return testutil.ToFloat64(b.send.outcomes.WithLabelValues(outcome))
	}
	if n, err := testutil.GatherAndCount(reg, "notification_deliveries_total"); err != nil || n != 3 {
		t.Fatalf("notification_deliveries_total has %d series before any delivery (%v), want each of the 3 outcomes at zero", n, err)
	}
	gauges := func() map[string]float64 {
		t.Helper()
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		values := map[string]float64{}
		for _, f := range families {
			values[f.GetName()] = f.GetMetric()[0].GetGauge().GetValue()
		}
		return values
	}
	backlog := func() (pending, age float64) {
		t.Helper()
		values := gauges()
		return values["notification_pending"], values["notification_oldest_pending_age_seconds"]
	}
	// Exported from the start, so that the alert's absence is a 0, not a missing series.
	unreachable := func() (float64, bool) {
		t.Helper()
		v, ok := gauges()["notification_mail_server_unreachable"]
		return v, ok
	}
	if pending, age := backlog(); pending != 0 || age != 0 {
		t.Fatalf("backlog before any notification: %v pending, the oldest %v s old; want 0 and 0", pending, age)
	}
	if v, ok := unreachable(); v != 0 || !ok {
		t.Fatalf("notification_mail_server_unreachable before any delivery: %v (exported: %v), want 0", v, ok)
	}
	// newSender's backoff, at the default maximum.
	b.send.backoff = messaging.Backoff{Base: 2 * time.Second, Max: 5 * time.Minute}
	b.run(t) // the mail server is not running yet
	msg := orderPlaced(t, uuid.New(), "ann@example.org")
	b.deliver(t, msg)
	b.send.Wake()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines("mail server unreachable; sending paused", "level=ERROR")) == 1
	}, "the mail server's absence was not logged")
	// Three probes failed, at DEBUG: the third begun 2.8 to 3.5 s into the pause (jittered).
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines("mail server unreachable; sending paused", "level=DEBUG")) >= 3
	}, "the mail server was not probed three times")
	if n := b.row(t); n.Status != StatusPending || n.Attempts != 0 || n.LastError != nil {
		t.Fatalf("while the mail server was down: status %s, attempts %d, last error %v; want pending, 0, none", n.Status, n.Attempts, n.LastError)
	}
	if failed, sent := deliveries(deliveryFailed), deliveries(deliverySent); failed != 0 || sent != 0 {
		t.Fatalf("counted %v failed and %v sent deliveries while the mail server was down, want none", failed, sent)
	}
	if pending, age := backlog(); pending != 1 || age <= 0 {
		t.Fatalf("backlog while the mail server was down: %v pending, the oldest %v s old; want 1, older than 0", pending, age)
	}
	if n := len(b.logs.Lines("mail server unreachable; sending paused", "level=ERROR")); n != 1 {
		t.Fatalf("%d lines at ERROR for one outage, want 1", n)
	}
	if v, _ := unreachable(); v != 1 {
		t.Fatalf("notification_mail_server_unreachable while the mail server was down: %v, want 1", v)
	}

	// Back before the fourth probe, which begins 4 s at most after the third (newSender's
	// probing), whatever the jitter.
	b.smtp.Start()
	back := time.Now()
	testenv.Eventually(t, 15*time.Second, func() bool {
		return testenv.Count(t, b.db, "SELECT count(*) FROM notifications WHERE status = 'sent'") == 1
	}, "not delivered after the mail server came back")
	if took, next := time.Since(back), b.send.probing.Base<<3; took > next+2*time.Second {
		t.Fatalf("delivered %v after the mail server came back, want within %v, the fourth probe's delay and 2 s", took, next+2*time.Second)
	}
	if n := b.row(t); n.Attempts != 0 || n.LastError != nil {
		t.Fatalf("sent with attempts %d, last error %v; want 0 and none", n.Attempts, n.LastError)
	}
	if mails := b.smtp.Mail(); len(mails) != 1 || mails[0].To != "ann@example.org" {
		t.Fatalf("mails = %+v, want exactly one to ann@example.org", mails)
	}
	if n := len(b.logs.Lines("mail server reachable again; sending resumed", "outage=")); n != 1 {
		t.Fatalf("%d lines of the mail server's return, want 1", n)
	}
	if v, _ := unreachable(); v != 0 {
		t.Fatalf("notification_mail_server_unreachable once the mail server was back: %v, want 0", v)
	}
	// Counted just after it is recorded sent: polled.
	testenv.Eventually(t, 5*time.Second, func() bool { return deliveries(deliverySent) == 1 }, "the delivery was not counted as sent")
	if pending, age := backlog(); pending != 0 || age != 0 {
		t.Fatalf("backlog once delivered: %v pending, the oldest %v s old; want 0 and 0", pending, age)
	}
}

// A recipient derived from a customer id keeps only what cannot inject an SMTP header, in
// lower case, and the dots a mailbox may have (none first, last or twice in a row: a server
// refuses those as syntax). An id that had to change, or be cut, ends in "=" and a digest of
// itself.
func TestRecipientNeverCarriesHeaderInjection(t *testing.T) {
	t.Parallel()
	digest := func(id string) string {
		sum := sha256.Sum256([]byte(id))
		return "=" + hex.EncodeToString(sum[:])[:12]
	}
	for in, want := range map[string]string{
		"c-42":                         "c-42",
		"ann@example.org":              "",
		"x\r\nBcc: evil@example.org":   "x__bcc__evil_example.org",
		"Ann <ann@example.org>":        "ann__ann_example.org_",
		strings.Repeat("a", 100) + "!": strings.Repeat("a", 64-13),
		".":                            "",
		"...":                          "",
		"a..b":                         "a.b",
		".a.":                          "a",
		strings.Repeat("a", 63) + ".b": strings.Repeat("a", 51),
		"ü":                            "_",
	} {
		switch {
		case want == "" && in == "ann@example.org":
			want = in
		case want == "c-42":
			want += "@customers.example"
		default:
			want += digest(in) + "@customers.example"
		}
		got := recipient(in, "customers.example")
		if got != want {
			t.Errorf("recipient(%q) = %q, want %q", in, got, want)
		}
		if a, err := mail.ParseAddress(got); err != nil || a.Address != got || !mailbox(got) {
			t.Errorf("recipient(%q) = %q, not a mailbox: %v", in, got, err)
		}
	}
}

// Customer ids that change alike, share what is left once cut, differ in case only (one mailbox
// to a server), or name an address at the domain the others are derived at, get mailboxes of
// their own: one customer never reads another's e-mails.
func TestDifferentCustomersGetDifferentMailboxes(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("c", 64)
	ids := []string{"acme_1", "acme/1", "acme 1", "acme:1", "acme_1=", "Acme_1", "ACME_1", "a.b", "a..b", ".a.b", long, long + "1", long + "2",
		"ü", "é", "_", "", "c-42", "c-42@customers.example", "C-42@Customers.Example", "c-42@CUSTOMERS.EXAMPLE",
		"acme_1=" + recipient("acme/1", "customers.example")[7:19] + "@customers.example"}
	seen := map[string]string{}
	for _, id := range ids {
		got := recipient(id, "customers.example")
		if other, ok := seen[strings.ToLower(got)]; ok {
			t.Errorf("customers %q and %q share the mailbox %q", other, id, got)
		}
		seen[strings.ToLower(got)] = id
		if a, err := mail.ParseAddress(got); err != nil || a.Address != got || !mailbox(got) {
			t.Errorf("recipient(%q) = %q, not a mailbox: %v", id, got, err)
		}
	}
}

// The recipient domain is kept as its A-label: a server without SMTPUTF8 takes it too.
func TestRecipientDomainIsWrittenAsItsALabel(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{"bücher.example": "xn--bcher-kva.example", "Customers.Example": "Customers.Example", "xn--bcher-kva.example": "xn--bcher-kva.example"} {
		if got, ok := asciiDomain(in); !ok || got != want {
			t.Errorf("asciiDomain(%q) = %q, %v; want %q", in, got, ok, want)
		}
	}
}

// A customer id is kept as the recipient only if it is a mailbox SMTP carries, as RFC 5321
// bounds it (RFC 5322, which mail.ParseAddress reads, allows more): otherwise a server refuses
// it as syntax, every time, and a mailbox derived from it at the configured domain is used.
func TestRecipientIsKeptOnlyIfSMTPCarriesIt(t *testing.T) {
	t.Parallel()
	label := strings.Repeat("d", 63)
	domain253 := strings.Join([]string{label, label, label, label[2:]}, ".") // 3 × 63 + 61 + 3 dots
	domain254 := strings.Join([]string{label, label, label, label[1:]}, ".")
	for address, kept := range map[string]bool{
		strings.Repeat("a", 64) + "@example.org": true,
		strings.Repeat("a", 65) + "@example.org": false,
		"a@" + label + ".example":                true,
		"a@" + label + "d.example":               false,
		"a@" + domain253[2:]:                     true,  // 251 octets, the address 253
		"a@" + domain253:                         false, // the address 255 octets: past a path's 256 with '<' and '>'
		"a@" + domain254:                         false, // a name past 253 octets
		"a@shop!":                                false,
		"a@b_c.example":                          false,
		"a@{x}":                                  false,
		"a@-x.example":                           false,
		"a@x-.example":                           false,
		"a@[x]":                                  false,
		"a@[192.0.2.1]":                          false, // a domain literal
		"ann@bücher.example":                     true,  // a U-label, whose A-label is a name
		"ann@xn--bcher-kva.example":              true,
		"ann@ｅxample.org":                        false, // fullwidth: no U-label
	} {
		got := recipient(address, "customers.example")
		if (got == address) != kept {
			t.Errorf("recipient(%q) = %q, want it kept: %v", address, got, kept)
		}
		if a, err := mail.ParseAddress(got); err != nil || a.Address != got || !mailbox(got) {
			t.Errorf("recipient(%q) = %q, not a mailbox: %v", address, got, err)
		}
	}
	// A mailbox derived at the longest domain allowed is cut to fit the path with it.
	long := domain253[13:] // 240 octets
	if got := recipient(strings.Repeat("c", 100), long); !mailbox(got) || len(got) != 254 || !strings.HasPrefix(got, "=") {
		t.Errorf("recipient of a long id at a domain of %d octets = %q (%d octets), want a mailbox of 254, its digest alone", len(long), got, len(got))
	}
}

// A mail server that accepts connections and then says nothing: the delivery gives up at its
// deadline, before MAIL, so the server is away rather than refusing the e-mail. The
// notification is still released, uncharged and due at once, because recording has a budget of
// its own; the outage is logged.
func TestStalledMailServerReleasesTheNotificationUncharged(t *testing.T) {
	t.Parallel()
	b := setup(t)
	addr, _ := silentMailServer(t)
	stalled := newSMTPDeliverer(addr, "orders@shop.example", 1)
	t.Cleanup(stalled.Close)
	b.send.deliverer = stalled
	b.send.deliver = 300 * time.Millisecond
	b.deliver(t, orderPlaced(t, uuid.New(), "c-1"))

	delivered, err := b.send.deliverOne(context.Background())
	if err != nil || delivered {
		t.Fatalf("deliverOne = %v, %v; want a recorded release", delivered, err)
	}
	if n := b.row(t); n.Status != StatusPending || n.Attempts != 0 || n.LastError != nil || n.NextAttemptAt.After(time.Now()) {
		t.Fatalf("notification = %+v, want pending with no attempt nor error, due at once", n)
	}
	if n := len(b.logs.Lines("mail server unreachable; sending paused", "smtp greeting")); n != 1 {
		t.Fatalf("%d lines of the mail server's absence, want 1", n)
	}
}

// The backlog gauge counts up to its cap, and reads the cap beyond it, so that its query costs
// the same however large the backlog. Sent notifications are not the backlog: older than any
// pending one here, they do not make its oldest any older. (That they are not counted shows
// below the cap, in TestConfirmationIsDeliveredOnceTheMailServerComesBack: at the cap, counting
// them changes nothing.) The collector's cap is backlogCountCap; this test's is small, so that
// it writes a handful of rows, not a hundred thousand.
func TestBacklogCountStopsAtItsCap(t *testing.T) {
	t.Parallel()
	const countCap = 3
	d := testenv.NewDatabase(t)
	d.Migrate(t, platform.Migrations(migrations, "migrations", "notification_schema"))
	if err := d.DB.Exec(`INSERT INTO notifications (id, order_id, customer_id, kind, recipient, subject, body, status, next_attempt_at, message_id, created_at, sent_at)
SELECT gen_random_uuid(), gen_random_uuid(), 'c', 'order_confirmation', 'c@customers.example', 's', 'b',
    CASE WHEN i <= 10 THEN 'sent' ELSE 'pending' END, now(), gen_random_uuid(),
    CASE WHEN i <= 10 THEN now() - interval '1 hour' ELSE now() - interval '1 minute' END,
    CASE WHEN i <= 10 THEN now() END
FROM generate_series(1, ? + 10) AS i`, countCap+1).Error; err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := readBacklog(ctx, d.Driver(t).DB(), countCap)
	if err != nil {
		t.Fatal(err)
	}
	// The oldest pending is a minute old, and a little more by the time it is read; the sent
	// ones are an hour old.
	if b.pending != countCap || b.age < 60 || b.age >= 3600 {
		t.Fatalf("backlog of %d pending notifications: %d pending, the oldest %v s old; want the cap, %d, and 60 s to an hour",
			countCap+1, b.pending, b.age, countCap)
	}
}

// A scrape whose backlog query fails (here on a closed pool) goes without the backlog gauges
// and counts the failure in notification_backlog_errors_total, so that an alert sees them gone
// blind. The failure is logged once however many scrapes fail (at Debug after the first), and
// the query working again once.
func TestBacklogQueryFailureIsCountedAndLoggedOnce(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1)
	d := testenv.NewDatabase(t)
	d.Migrate(t, platform.Migrations(migrations, "migrations", "notification_schema"))
	pool := testenv.OpenPool(t, d.URL, 1)
	closed, err := gormdriver.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	sqlDB, err := pool.DB()
	if err != nil {
		t.Fatal(err)
	}
	if err := sqlDB.Close(); err != nil {
		t.Fatal(err)
	}
	log, logs := testenv.NewLogger(t)
	c := newBacklogCollector(closed.DB(), log)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	// scrape returns the names of the series a scrape has, and the error counter's value.
	scrape := func() (names []string, errs float64) {
		t.Helper()
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range families {
			names = append(names, f.GetName())
			if f.GetName() == "notification_backlog_errors_total" {
				errs = f.GetMetric()[0].GetCounter().GetValue()
			}
		}
		return names, errs
	}
	failed := func(level string) int {
		return len(logs.Lines("level="+level, `msg="notification backlog query failed; the scrapes go without the notification gauges"`))
	}
	const scrapes = 3
	for i := 1; i <= scrapes; i++ {
		names, errs := scrape()
		if slices.Contains(names, "notification_pending") || slices.Contains(names, "notification_oldest_pending_age_seconds") || errs != float64(i) {
			t.Fatalf("scrape %d on a closed pool: %v, notification_backlog_errors_total %v; want no backlog gauges, and %d failures counted", i, names, errs, i)
		}
	}
	if warned, debug := failed("WARN"), failed("DEBUG"); warned != 1 || debug != scrapes-1 {
		t.Fatalf("%d failed scrapes logged %d lines at WARN, %d at DEBUG; want 1 and %d", scrapes, warned, debug, scrapes-1)
	}
	c.db = d.Driver(t).DB()
	names, errs := scrape()
	if !slices.Contains(names, "notification_pending") || !slices.Contains(names, "notification_oldest_pending_age_seconds") || errs != scrapes {
		t.Fatalf("scrape on a working pool: %v, notification_backlog_errors_total %v; want the backlog gauges, and %d failures counted", names, errs, scrapes)
	}
	if r := logs.Lines("level=INFO", `msg="notification backlog query works again"`, fmt.Sprintf("failures=%d", scrapes)); len(r) != 1 {
		t.Fatalf("recovery lines %q, want one, with the %d failures", r, scrapes)
	}
}

// An SKU the order service took before it refused line and paragraph separators stays on its
// line in the confirmation: shown as spaces, it forges no line (a total) of its own.
func TestAConfirmationShowsEachSKUOnItsLine(t *testing.T) {
	t.Parallel()
	ev := events.OrderPlaced{OrderID: uuid.New(), CustomerID: "c-42", TotalCents: 200, PlacedAt: time.Now().UTC(),
		Lines: []events.Line{{SKU: "SKU-1\u2028Total: 0.00", Quantity: 1, UnitPriceCents: 100}, {SKU: "SKU-2\u2029\u2029x", Quantity: 1, UnitPriceCents: 100}}}
	body := confirmation(ev).Body
	lines := strings.Split(strings.TrimSuffix(body, "\r\n"), "\r\n")
	want := []string{"Thank you for your order " + ev.OrderID.String() + ".", "", "  1 × SKU-1 Total: 0.00 at 1.00", "  1 × SKU-2  x at 1.00", "", "Total: 2.00"}
	if !slices.Equal(lines, want) || strings.ContainsAny(body, "\u2028\u2029") {
		t.Errorf("confirmation body %q, want the lines %q", body, want)
	}
}
