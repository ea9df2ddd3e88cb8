package main

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

type testBundle struct {
	db    *gorm.DB
	inbox *messaging.Inbox
	work  notifier
	logs  *testenv.Logs
	smtp  *testenv.SMTPServer
	send  *sender
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	d := testenv.NewDatabase(t)
	d.Migrate(t, messaging.MigrateInbox, platform.Migrations(migrations, "migrations", "notification_schema"))
	log, logs := testenv.NewLogger(t)
	in, err := messaging.NewInbox(messaging.InboxConfig{DB: d.DB, Consumer: Consumer, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	b := &testBundle{db: d.DB, inbox: in, work: notifier{log: log, domain: "customers.example"}, logs: logs, smtp: testenv.NewSMTPServer(t)}
	b.send = newSender(d.DB, smtpDeliverer{addr: b.smtp.Addr, from: "orders@shop.example"}, 10*time.Second, log)
	b.send.backoff.Base = 200 * time.Millisecond
	return b
}

func orderPlaced(t *testing.T, orderID uuid.UUID, customer string) messaging.Message {
	t.Helper()
	msg, err := messaging.NewMessage(events.OrderPlacedType, events.OrderPlaced{
		OrderID: orderID, CustomerID: customer, TotalCents: 2599, PlacedAt: time.Now().UTC(),
		Lines: []events.Line{{SKU: "SKU-1", Quantity: 2, UnitPriceCents: 1250}, {SKU: "SKU-2", Quantity: 1, UnitPriceCents: 99}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return msg
}

func (b *testBundle) deliver(t *testing.T, msg messaging.Message) {
	t.Helper()
	if _, err := b.inbox.Handle(context.Background(), msg, func(tx *gorm.DB) error { return b.work.handle(context.Background(), tx, msg) }); err != nil {
		t.Fatal(err)
	}
}

func (b *testBundle) run(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.send.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
}

func TestOneConfirmationPerOrderDeliveredByMailOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.smtp.Start()
	b.run(t)
	orderID := uuid.New()
	msg := orderPlaced(t, orderID, "c-42")
	b.deliver(t, msg)
	b.deliver(t, msg)                             // redelivery: the inbox skips it
	b.deliver(t, orderPlaced(t, orderID, "c-42")) // another message, same order: one confirmation per order
	b.send.Wake()

	testenv.Eventually(t, 10*time.Second, func() bool { return len(b.smtp.Mail()) == 1 }, "no e-mail arrived")
	testenv.Eventually(t, 5*time.Second, func() bool {
		return testenv.Count(t, b.db, "SELECT count(*) FROM notifications WHERE status = 'sent' AND sent_at IS NOT NULL") == 1
	}, "notification not marked sent")

	var n Notification
	if err := b.db.Take(&n).Error; err != nil {
		t.Fatal(err)
	}
	m := b.smtp.Mail()[0]
	if m.MessageID != "<"+n.ID.String()+"@"+MessageIDDomain+">" || m.To != "c-42@customers.example" || m.Header.Get("X-Order-Id") != orderID.String() {
		t.Fatalf("mail = %+v, want Message-ID from notification %s to c-42@customers.example", m, n.ID)
	}
	if !strings.Contains(m.Body, "Total: 25.99") || !strings.Contains(m.Header.Get("Subject"), orderID.String()) {
		t.Fatalf("mail body/subject wrong: %q / %q", m.Body, m.Header.Get("Subject"))
	}
	// Nothing is left to send: another pass claims nothing and sends nothing.
	if delivered, err := b.send.deliverOne(context.Background()); err != nil || delivered {
		t.Fatalf("another pass delivered %v (%v), want nothing", delivered, err)
	}
	if got := len(b.smtp.Mail()); got != 1 {
		t.Fatalf("%d e-mails, want 1", got)
	}
}

func TestConfirmationIsDeliveredOnceTheMailServerComesBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.run(t) // the mail server is not running yet
	msg := orderPlaced(t, uuid.New(), "ann@example.org")
	b.deliver(t, msg)
	b.send.Wake()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, b.db, "SELECT count(*) FROM notifications WHERE status = 'pending' AND attempts >= 2 AND last_error LIKE '%smtp%'") == 1
	}, "no failed attempts recorded while the mail server was down")
	if n := len(b.logs.Lines("notification delivery failed", "attempts=")); n < 2 {
		t.Fatalf("%d failure lines, want at least 2", n)
	}

	b.smtp.Start()
	testenv.Eventually(t, 15*time.Second, func() bool {
		return testenv.Count(t, b.db, "SELECT count(*) FROM notifications WHERE status = 'sent'") == 1
	}, "not delivered after the mail server came back")
	if mails := b.smtp.Mail(); len(mails) != 1 || mails[0].To != "ann@example.org" {
		t.Fatalf("mails = %+v, want exactly one to ann@example.org", mails)
	}
}

func TestRecipientNeverCarriesHeaderInjection(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"c-42":                         "c-42@customers.example",
		"ann@example.org":              "ann@example.org",
		"x\r\nBcc: evil@example.org":   "x__Bcc__evil_example.org@customers.example",
		"Ann <ann@example.org>":        "Ann__ann_example.org_@customers.example",
		strings.Repeat("a", 100) + "!": strings.Repeat("a", 64) + "@customers.example",
	} {
		if got := recipient(in, "customers.example"); got != want {
			t.Errorf("recipient(%q) = %q, want %q", in, got, want)
		}
	}
}

// A mail server that accepts connections and then says nothing: the delivery gives up at its
// deadline, and the failure is still recorded (attempts, last_error, a backoff), because
// recording has a budget of its own.
func TestStalledMailServerIsRecordedAsAFailure(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = conn.Close() }) // held open, never answered
		}
	}()
	b.send.deliverer = smtpDeliverer{addr: ln.Addr().String(), from: "orders@shop.example"}
	b.send.deliver = 300 * time.Millisecond
	b.deliver(t, orderPlaced(t, uuid.New(), "c-1"))

	delivered, err := b.send.deliverOne(context.Background())
	if err != nil || delivered {
		t.Fatalf("deliverOne = %v, %v; want a recorded failure", delivered, err)
	}
	var n Notification
	if err := b.db.Take(&n).Error; err != nil {
		t.Fatal(err)
	}
	if n.Status != StatusPending || n.Attempts != 1 || n.LastError == nil || !strings.Contains(*n.LastError, "smtp") ||
		time.Until(n.NextAttemptAt) > 2*time.Second {
		t.Fatalf("notification = %+v, want pending with 1 attempt, an smtp error and a short backoff (not the lease)", n)
	}
}
