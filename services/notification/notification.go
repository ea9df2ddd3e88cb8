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

// KindOrderConfirmation is the only notification this service sends.
const KindOrderConfirmation = "order_confirmation"

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
}

// TableName pins the table the migrations create.
func (Notification) TableName() string { return "notifications" }

// confirmation builds the order confirmation for an OrderPlaced event.
func confirmation(id, messageID uuid.UUID, ev events.OrderPlaced, domain string, now time.Time) Notification {
	var b strings.Builder
	fmt.Fprintf(&b, "Thank you for your order %s.\r\n\r\n", ev.OrderID)
	for _, l := range ev.Lines {
		fmt.Fprintf(&b, "  %d × %s at %s\r\n", l.Quantity, l.SKU, money(l.UnitPriceCents))
	}
	fmt.Fprintf(&b, "\r\nTotal: %s\r\n", money(ev.TotalCents))
	return Notification{
		ID: id, OrderID: ev.OrderID, CustomerID: ev.CustomerID, Kind: KindOrderConfirmation,
		Recipient: recipient(ev.CustomerID, domain), Subject: "Your order " + ev.OrderID.String(),
		Body: b.String(), Status: StatusPending, MessageID: messageID, CreatedAt: now, NextAttemptAt: now,
	}
}

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

// notifier turns OrderPlaced events into pending order confirmations.
type notifier struct {
	log      *slog.Logger
	domain   string
	recorded func() // called after a new confirmation committed: wakes the sender
}

// handle runs inside the inbox's transaction; it only records the notification. Sending it is
// the sender's job, after the commit.
func (h notifier) handle(ctx context.Context, tx *gorm.DB, msg messaging.Message) error {
	ev, err := events.DecodeOrderPlaced(msg)
	if err != nil {
		return err
	}
	id, err := uuid.NewV7()
	if err != nil {
		return err
	}
	n := confirmation(id, msg.ID, ev, h.domain, time.Now().UTC())
	res := tx.Clauses(clause.OnConflict{Columns: []clause.Column{{Name: "order_id"}}, DoNothing: true}).Create(&n)
	if res.Error != nil {
		return fmt.Errorf("insert notification: %w", res.Error)
	}
	if res.RowsAffected == 0 {
		messaging.AfterCommit(tx, func() {
			h.log.Warn("order already has a confirmation from another message; nothing to do", "order_id", ev.OrderID, "message_id", msg.ID)
		})
		return nil
	}
	messaging.AfterCommit(tx, func() {
		h.log.Info("notification recorded", "notification_id", n.ID, "order_id", n.OrderID, "recipient", n.Recipient, "message_id", msg.ID)
		if h.recorded != nil {
			h.recorded()
		}
	})
	return nil
}
