package main

import (
	"context"
	"embed"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

//go:embed migrations/*.sql
var migrations embed.FS

// An invoice's statuses.
const (
	StatusIssued = "issued"
	StatusVoid   = "void"
)

// Invoice bills one order; its amount is the order's total. An order has one invoice row at
// most: the unique order_id is what serialises the order's events (see invoicer).
type Invoice struct {
	ID          uuid.UUID  `json:"id" gorm:"type:uuid;primaryKey"`
	OrderID     uuid.UUID  `json:"order_id" gorm:"type:uuid"`
	CustomerID  string     `json:"customer_id"`
	AmountCents int64      `json:"amount_cents"`
	Status      string     `json:"status"`
	MessageID   uuid.UUID  `json:"message_id" gorm:"type:uuid"`
	CreatedAt   time.Time  `json:"created_at"`
	VoidedAt    *time.Time `json:"voided_at,omitempty"`
}

// TableName pins the table the migrations create.
func (Invoice) TableName() string { return "invoices" }

// invoicer keeps one invoice per order whatever order its events arrive in, and announces each
// invoice it issues with InvoiceIssued, written to its own outbox in the same transaction.
//
// OrderPlaced and OrderCancelled of one order may be handled at the same moment, in two
// transactions that cannot see each other. Both therefore start by inserting the order's one
// invoice row, and the unique order_id makes the second insert wait for the first transaction
// and then find its row: whichever commits first, the other acts on what it wrote. No
// check-then-insert, so no interleaving can issue an invoice for a cancelled order.
type invoicer struct {
	log         *slog.Logger
	alreadyDone func() // counts a message whose invoice another message made already
}

// subscribe registers the invoicer's handlers.
func (h invoicer) subscribe(sub *messaging.Subscription) {
	messaging.Handle(sub, events.OrderPlacedEvent, h.placed)
	messaging.Handle(sub, events.OrderCancelledEvent, h.cancelled)
}

// placed issues the order's invoice, unless the order is already known: cancelled first (its
// void row stays void, and only learns the amount), or invoiced by another message.
func (h invoicer) placed(ctx context.Context, tx *gorm.DB, ev events.OrderPlaced, msg messaging.Message) error {
	inv, err := newInvoice(ev.OrderID, ev.CustomerID, ev.TotalCents, StatusIssued, msg)
	if err != nil {
		return err
	}
	inserted, err := insertOnce(tx, &inv)
	if err != nil {
		return err
	}
	if !inserted {
		return h.alreadyKnown(ctx, tx, ev)
	}
	issued, err := events.InvoiceIssuedEvent.Message(events.InvoiceIssued{
		InvoiceID: inv.ID, OrderID: inv.OrderID, CustomerID: inv.CustomerID, AmountCents: inv.AmountCents, IssuedAt: inv.CreatedAt,
	})
	if err != nil {
		return err
	}
	issued.OccurredAt, issued.CorrelationID = inv.CreatedAt, msg.CorrelationID
	if err := messaging.Enqueue(tx, issued); err != nil {
		return err
	}
	return messaging.AfterCommit(tx, func() {
		h.log.InfoContext(ctx, "invoice issued", "invoice_id", inv.ID, "order_id", inv.OrderID, "amount_cents", inv.AmountCents, "message_id", msg.ID)
	})
}

// alreadyKnown handles an OrderPlaced whose order has its invoice row already.
func (h invoicer) alreadyKnown(ctx context.Context, tx *gorm.DB, ev events.OrderPlaced) error {
	var existing Invoice
	if err := tx.Take(&existing, "order_id = ?", ev.OrderID).Error; err != nil {
		return fmt.Errorf("load invoice of order %s: %w", ev.OrderID, err)
	}
	if existing.Status == StatusIssued {
		return messaging.AfterCommit(tx, func() {
			h.alreadyDone()
			h.log.WarnContext(ctx, "order already invoiced by another message; nothing to do", "order_id", ev.OrderID, "invoice_id", existing.ID)
		})
	}
	if err := tx.Model(&existing).Update("amount_cents", ev.TotalCents).Error; err != nil {
		return fmt.Errorf("record the amount of void invoice %s: %w", existing.ID, err)
	}
	return messaging.AfterCommit(tx, func() {
		h.log.InfoContext(ctx, "order was cancelled before it arrived; its invoice stays void", "order_id", ev.OrderID, "invoice_id", existing.ID)
	})
}

// cancelled voids the order's invoice; if the order has none yet, a void row remembers the
// cancellation, so that the order's OrderPlaced never issues one.
func (h invoicer) cancelled(ctx context.Context, tx *gorm.DB, ev events.OrderCancelled, msg messaging.Message) error {
	inv, err := newInvoice(ev.OrderID, ev.CustomerID, 0, StatusVoid, msg)
	if err != nil {
		return err
	}
	inv.VoidedAt = &inv.CreatedAt
	remembered, err := insertOnce(tx, &inv)
	if err != nil {
		return err
	}
	if remembered {
		return messaging.AfterCommit(tx, func() {
			h.log.InfoContext(ctx, "cancellation remembered before its order", "order_id", ev.OrderID, "invoice_id", inv.ID, "message_id", msg.ID)
		})
	}
	var voided Invoice
	res := tx.Model(&voided).Clauses(clause.Returning{}).Where("order_id = ? AND status = ?", ev.OrderID, StatusIssued).
		Updates(map[string]any{"status": StatusVoid, "voided_at": gorm.Expr("clock_timestamp()")})
	if res.Error != nil {
		return fmt.Errorf("void invoice of order %s: %w", ev.OrderID, res.Error)
	}
	if res.RowsAffected == 0 {
		// Void already: another message cancelled the order.
		return messaging.AfterCommit(tx, func() {
			h.alreadyDone()
			h.log.WarnContext(ctx, "order already cancelled by another message; nothing to do", "order_id", ev.OrderID, "message_id", msg.ID)
		})
	}
	return messaging.AfterCommit(tx, func() {
		h.log.InfoContext(ctx, "invoice voided", "invoice_id", voided.ID, "order_id", ev.OrderID, "message_id", msg.ID)
	})
}

func newInvoice(orderID uuid.UUID, customerID string, amount int64, status string, msg messaging.Message) (Invoice, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return Invoice{}, err
	}
	return Invoice{ID: id, OrderID: orderID, CustomerID: customerID, AmountCents: amount, Status: status,
		MessageID: msg.ID, CreatedAt: time.Now().UTC()}, nil
}

// insertOnce inserts the order's invoice row unless the order has one; a concurrent insert for
// the same order waits here for the other transaction, then finds its row.
func insertOnce(tx *gorm.DB, inv *Invoice) (bool, error) {
	res := tx.Clauses(clause.OnConflict{Columns: []clause.Column{{Name: "order_id"}}, DoNothing: true}).Create(inv)
	if res.Error != nil {
		return false, fmt.Errorf("insert invoice of order %s: %w", inv.OrderID, res.Error)
	}
	return res.RowsAffected == 1, nil
}
