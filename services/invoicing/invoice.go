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

// Invoice bills one order; its amount is the order's total.
type Invoice struct {
	ID          uuid.UUID `json:"id" gorm:"type:uuid;primaryKey"`
	OrderID     uuid.UUID `json:"order_id" gorm:"type:uuid"`
	CustomerID  string    `json:"customer_id"`
	AmountCents int64     `json:"amount_cents"`
	MessageID   uuid.UUID `json:"message_id" gorm:"type:uuid"`
	CreatedAt   time.Time `json:"created_at"`
}

// TableName pins the table the migrations create.
func (Invoice) TableName() string { return "invoices" }

// invoicer turns OrderPlaced events into invoices.
type invoicer struct{ log *slog.Logger }

// handle runs inside the inbox's transaction: the invoice and the inbox record commit
// together, and a redelivered message never gets here.
func (h invoicer) handle(ctx context.Context, tx *gorm.DB, msg messaging.Message) error {
	ev, err := events.DecodeOrderPlaced(msg)
	if err != nil {
		return err
	}
	id, err := uuid.NewV7()
	if err != nil {
		return err
	}
	inv := Invoice{ID: id, OrderID: ev.OrderID, CustomerID: ev.CustomerID, AmountCents: ev.TotalCents, MessageID: msg.ID, CreatedAt: time.Now().UTC()}
	res := tx.Clauses(clause.OnConflict{Columns: []clause.Column{{Name: "order_id"}}, DoNothing: true}).Create(&inv)
	if res.Error != nil {
		return fmt.Errorf("insert invoice: %w", res.Error)
	}
	if res.RowsAffected == 0 {
		messaging.AfterCommit(tx, func() {
			h.log.Warn("order already invoiced by another message; nothing to do", "order_id", ev.OrderID, "message_id", msg.ID)
		})
		return nil
	}
	messaging.AfterCommit(tx, func() {
		h.log.Info("invoice created", "invoice_id", inv.ID, "order_id", inv.OrderID, "amount_cents", inv.AmountCents, "message_id", msg.ID)
	})
	return nil
}
