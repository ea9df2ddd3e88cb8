package main

import (
	"context"
	"embed"
	"fmt"
	"log/slog"
	"net/mail"
	"strings"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/propagation"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

//go:embed migrations/*.sql
var migrations embed.FS

// Delivery states of a notification.
const (
	StatusPending = "pending"
	StatusSent    = "sent"
)

// The kinds of notification: at most one of each per order (the migrations' UNIQUE (order_id,
// kind)), whatever order and how often their events arrive.
const (
	KindOrderConfirmation = "order_confirmation" // from OrderPlaced
	KindInvoice           = "invoice"            // from InvoiceIssued
	KindOrderCancelled    = "order_cancelled"    // from OrderCancelled
)

// Notification is a message to a customer and where its delivery stands.
type Notification struct {
	ID            uuid.UUID  `json:"id" gorm:"type:uuid;primaryKey"`
	OrderID       uuid.UUID  `json:"order_id" gorm:"type:uuid"`
	CustomerID    string     `json:"customer_id"`
	Kind          string     `json:"kind"`
	Recipient     string     `json:"recipient"`
	Subject       string     `json:"subject"`
	Body          string     `json:"body"`
	Status        string     `json:"status"`
	Attempts      int        `json:"attempts"`
	LastError     *string    `json:"last_error,omitempty"`
	NextAttemptAt time.Time  `json:"-"`
	MessageID     uuid.UUID  `json:"message_id" gorm:"type:uuid"`
	CreatedAt     time.Time  `json:"created_at"`
	SentAt        *time.Time `json:"sent_at,omitempty"`
	// TraceParent and TraceState are the W3C trace context of the handling that recorded it,
	// which its delivery continues.
	TraceParent string `json:"-"`
	TraceState  string `json:"-"`
}

// TableName pins the table the migrations create.
func (Notification) TableName() string { return "notifications" }

// confirmation is the order confirmation for an OrderPlaced event.
func confirmation(ev events.OrderPlaced) Notification {
	var b strings.Builder
	fmt.Fprintf(&b, "Thank you for your order %s.\r\n\r\n", ev.OrderID)
	for _, l := range ev.Lines {
		fmt.Fprintf(&b, "  %d × %s at %s\r\n", l.Quantity, l.SKU, money(l.UnitPriceCents))
	}
	fmt.Fprintf(&b, "\r\nTotal: %s\r\n", money(ev.TotalCents))
	return Notification{OrderID: ev.OrderID, CustomerID: ev.CustomerID, Kind: KindOrderConfirmation,
		Subject: "Your order " + ev.OrderID.String(), Body: b.String()}
}

// invoiceNotice tells the customer about an InvoiceIssued event's invoice.
func invoiceNotice(ev events.InvoiceIssued) Notification {
	body := fmt.Sprintf("Your invoice %s for order %s.\r\n\r\nAmount: %s\r\n", ev.InvoiceID, ev.OrderID, money(ev.AmountCents))
	return Notification{OrderID: ev.OrderID, CustomerID: ev.CustomerID, Kind: KindInvoice,
		Subject: "Your invoice " + ev.InvoiceID.String(), Body: body}
}

// cancellation tells the customer about an OrderCancelled event.
func cancellation(ev events.OrderCancelled) Notification {
	body := fmt.Sprintf("Your order %s was cancelled.\r\n", ev.OrderID)
	// One line, whatever the publisher sent: a bare line break would break the e-mail's CRLF lines.
	if reason := strings.Join(strings.Fields(ev.Reason), " "); reason != "" {
		body += "\r\nReason: " + reason + "\r\n"
	}
	return Notification{OrderID: ev.OrderID, CustomerID: ev.CustomerID, Kind: KindOrderCancelled,
		Subject: "Your order " + ev.OrderID.String() + " was cancelled", Body: body}
}

// w3c writes and reads a notification's trace context, the W3C Trace Context of the messages.
var w3c propagation.TraceContext

func money(cents int64) string { return fmt.Sprintf("%d.%02d", cents/100, cents%100) }

// recipient is the customer id when it is an e-mail address, otherwise a mailbox derived from
// it at domain. Only letters, digits, '.', '-' and '_' survive: nothing from a message can
// inject an SMTP header.
func recipient(customerID, domain string) string {
	if a, err := mail.ParseAddress(customerID); err == nil && a.Address == customerID && !strings.ContainsAny(customerID, "\r\n<>") {
		return customerID
	}
	local := strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '-', r == '_':
			return r
		}
		return '_'
	}, customerID)
	if len(local) > 64 {
		local = local[:64]
	}
	return strings.Trim(local, ".") + "@" + domain
}

// notifier turns events into pending notifications. Its handlers run inside the inbox's
// transaction and only record; sending is the sender's job, after the commit.
type notifier struct {
	log      *slog.Logger
	domain   string
	recorded func() // called after a new notification committed: wakes the sender
	// alreadyDone, if set, counts a message whose notification another message recorded already.
	alreadyDone func()
}

// subscribe registers a handler per event the notifier turns into a notification; the
// subscription's queue is bound to each.
func (h notifier) subscribe(sub *messaging.Subscription) {
	messaging.Handle(sub, events.OrderPlacedEvent, h.orderPlaced)
	messaging.Handle(sub, events.InvoiceIssuedEvent, h.invoiceIssued)
	messaging.Handle(sub, events.OrderCancelledEvent, h.orderCancelled)
}

func (h notifier) orderPlaced(ctx context.Context, tx *gorm.DB, ev events.OrderPlaced, msg messaging.Message) error {
	return h.record(ctx, tx, msg, confirmation(ev))
}

func (h notifier) invoiceIssued(ctx context.Context, tx *gorm.DB, ev events.InvoiceIssued, msg messaging.Message) error {
	return h.record(ctx, tx, msg, invoiceNotice(ev))
}

func (h notifier) orderCancelled(ctx context.Context, tx *gorm.DB, ev events.OrderCancelled, msg messaging.Message) error {
	return h.record(ctx, tx, msg, cancellation(ev))
}

// record inserts n as pending, unless its order already has a notification of its kind: a
// redelivery never gets here (the inbox skips it), so that is another message about the same
// order and kind, and the customer must not hear about it twice. n keeps ctx's trace context
// for its delivery.
func (h notifier) record(ctx context.Context, tx *gorm.DB, msg messaging.Message, n Notification) error {
	id, err := uuid.NewV7()
	if err != nil {
		return fmt.Errorf("notification id: %w", err)
	}
	now := time.Now().UTC()
	n.ID, n.MessageID, n.Recipient = id, msg.ID, recipient(n.CustomerID, h.domain)
	n.Status, n.CreatedAt, n.NextAttemptAt = StatusPending, now, now
	carrier := propagation.MapCarrier{}
	w3c.Inject(ctx, carrier)
	n.TraceParent, n.TraceState = carrier.Get("traceparent"), carrier.Get("tracestate")
	res := tx.Clauses(clause.OnConflict{Columns: []clause.Column{{Name: "order_id"}, {Name: "kind"}}, DoNothing: true}).Create(&n)
	if res.Error != nil {
		return fmt.Errorf("insert %s notification for order %s: %w", n.Kind, n.OrderID, res.Error)
	}
	if res.RowsAffected == 0 {
		return messaging.AfterCommit(tx, func() {
			if h.alreadyDone != nil {
				h.alreadyDone()
			}
			h.log.WarnContext(ctx, "order already has a "+n.Kind+" notification from another message; nothing to do",
				"order_id", n.OrderID, "kind", n.Kind, "message_id", msg.ID)
		})
	}
	return messaging.AfterCommit(tx, func() {
		h.log.InfoContext(ctx, "notification recorded", "notification_id", n.ID, "order_id", n.OrderID, "kind", n.Kind, "recipient", n.Recipient, "message_id", msg.ID)
		if h.recorded != nil {
			h.recorded()
		}
	})
}
