package main

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
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
	// PlacedMessageID is the OrderPlaced that gave the invoice its amount; nil on a row a
	// cancellation wrote, until its order arrives, and on every row written before 00004.
	PlacedMessageID *uuid.UUID `json:"placed_message_id,omitempty" gorm:"type:uuid"`
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
	driver      messaging.Driver[*gorm.DB]
	alreadyDone func() // counts a message whose invoice another message made already; its line carries alreadyDoneAttr
}

// subscribe registers the invoicer's handlers. OrderPlaced, the bulk of the traffic, is
// handled a batch at a time (each run of OrderPlaced in a backlog's batch): one INSERT for the
// batch's invoices, one Enqueue for their InvoiceIssued events.
func (h invoicer) subscribe(sub *platform.Subscription) error {
	return errors.Join(
		messaging.HandleBatch(sub, events.OrderPlacedEvent, h.placed),
		messaging.Handle(sub, events.OrderCancelledEvent, h.cancelled))
}

// placed issues each order's invoice, unless the order is already known: cancelled first (its
// void row stays void, and only learns the amount), or invoiced by another message.
func (h invoicer) placed(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[events.OrderPlaced]) error {
	invoices := make([]Invoice, len(batch))
	for i, d := range batch {
		var err error
		if invoices[i], err = newInvoice(d.Payload.OrderID, d.Payload.CustomerID, d.Payload.TotalCents, StatusIssued, d.Msg); err != nil {
			return fmt.Errorf("invoice order %s: %w", d.Payload.OrderID, err)
		}
		invoices[i].PlacedMessageID = &d.Msg.ID
	}
	inserted, err := insertNew(tx, invoices)
	if err != nil {
		return err
	}
	issued := make([]messaging.Message, 0, len(batch))
	for i, d := range batch {
		inv := invoices[i]
		createdAt, ok := inserted[inv.ID]
		if !ok {
			if err := h.alreadyKnown(d.Ctx, tx, d.Payload, d.Msg.ID); err != nil {
				return err
			}
			continue
		}
		inv.CreatedAt = createdAt.UTC() // pgx reads it in the local zone; events say UTC
		msg, err := events.InvoiceIssuedEvent.Message(events.InvoiceIssued{
			InvoiceID: inv.ID, OrderID: inv.OrderID, CustomerID: inv.CustomerID, AmountCents: inv.AmountCents, IssuedAt: inv.CreatedAt,
		})
		if err != nil {
			return fmt.Errorf("announce invoice %s of order %s: %w", inv.ID, inv.OrderID, err)
		}
		msg.OccurredAt, msg.CorrelationID = inv.CreatedAt, d.Msg.CorrelationID
		issued = append(issued, msg.WithTrace(d.Ctx))
		err = messaging.AfterCommit(d.Ctx, func() {
			h.log.InfoContext(d.Ctx, "invoice issued", "invoice_id", inv.ID, "order_id", inv.OrderID, "amount_cents", inv.AmountCents, "message_id", d.Msg.ID)
		})
		if err != nil {
			return err
		}
	}
	return messaging.Enqueue(ctx, h.driver, tx, issued...)
}

// alreadyKnown handles an OrderPlaced whose order has its invoice row already: the void row a
// cancellation wrote before its order arrived learns its amount from the first OrderPlaced to
// come (awaitsItsOrderSQL), and any other finds its work done. A message that disagrees with
// the row (another amount, another customer) is upstream disagreeing with itself: logged at
// ERROR; the row keeps its customer, and a void row awaiting its order takes the amount.
func (h invoicer) alreadyKnown(ctx context.Context, tx *gorm.DB, ev events.OrderPlaced, msgID uuid.UUID) error {
	var learned []struct {
		ID         uuid.UUID
		CustomerID string
	}
	err := tx.Raw("UPDATE invoices SET amount_cents = ?, placed_message_id = ? WHERE order_id = ? AND "+awaitsItsOrderSQL+" RETURNING id, customer_id",
		ev.TotalCents, msgID, ev.OrderID, StatusVoid).Scan(&learned).Error
	if err != nil {
		return fmt.Errorf("record the amount of the void invoice of order %s: %w", ev.OrderID, err)
	}
	if len(learned) == 1 {
		return messaging.AfterCommit(ctx, func() {
			// The amount is recorded all the same: the row stays void, and no invoice goes out.
			h.logVoid(ctx, "order was cancelled before it arrived", "; its invoice stays void", ev.CustomerID == learned[0].CustomerID, slog.LevelInfo,
				"order_id", ev.OrderID, "invoice_id", learned[0].ID, "amount_cents", ev.TotalCents, "message_id", msgID)
		})
	}
	var existing Invoice
	if err := tx.Take(&existing, "order_id = ?", ev.OrderID).Error; err != nil {
		return fmt.Errorf("load invoice of order %s: %w", ev.OrderID, err)
	}
	return messaging.AfterCommit(ctx, func() {
		h.alreadyDone()
		h.logAlreadyKnown(ctx, ev, existing, msgID)
	})
}

// alreadyDoneAttr marks the log line of each message counted by alreadyDone, whatever its
// wording or level: the count a test reads before it stops the process misses what the process
// did while it shut down, which the marked lines still show (internal/systest counts them).
var alreadyDoneAttr = slog.Bool("already_done", true)

// logVoid logs what a later message of an order (its OrderPlaced, or an OrderCancelled) made of
// its void invoice, head then tail: at level; or, if that message names another customer than
// the row, at ERROR, with ", for another customer" after head: upstream disagrees with itself,
// whichever came first. The row keeps the customer it was written with; neither id is logged (a
// customer's id may be an address).
func (h invoicer) logVoid(ctx context.Context, head, tail string, sameCustomer bool, level slog.Level, attrs ...any) {
	if !sameCustomer {
		h.log.ErrorContext(ctx, head+", for another customer"+tail, attrs...)
		return
	}
	h.log.Log(ctx, level, head+tail, attrs...)
}

// logAlreadyKnown logs an OrderPlaced that found its order's row there, done by another
// message: issued, or void (cancelled, whether it was ever invoiced or not).
func (h invoicer) logAlreadyKnown(ctx context.Context, ev events.OrderPlaced, existing Invoice, msgID uuid.UUID) {
	msg := "order already invoiced by another message"
	if existing.Status == StatusVoid {
		msg = "order already cancelled, its invoice void"
	}
	attrs := []any{"order_id", ev.OrderID, "invoice_id", existing.ID, "status", existing.Status,
		"amount_cents", ev.TotalCents, "invoice_amount_cents", existing.AmountCents, "message_id", msgID, alreadyDoneAttr}
	var differs []string
	if ev.TotalCents != existing.AmountCents {
		differs = append(differs, "another amount")
	}
	if ev.CustomerID != existing.CustomerID {
		differs = append(differs, "another customer") // its ids left out: a customer's id may be an address
	}
	if len(differs) > 0 { // not a harmless duplicate: upstream disagrees with itself
		h.log.ErrorContext(ctx, msg+", with "+strings.Join(differs, " and ")+"; nothing done", attrs...)
		return
	}
	h.log.WarnContext(ctx, msg+"; nothing to do", attrs...)
}

// awaitsItsOrderSQL matches (with its one argument StatusVoid) the void row a cancellation
// wrote before its order arrived, which no OrderPlaced has given its amount yet: no
// placed_message_id. Rows written before that column (00004) have none either; among them the
// awaiting row is the one voided as it was created (cancelled sets voided_at to created_at)
// with no amount yet. A row issued first and voided later, at clock_timestamp(), is none; but a
// row of before 00004 whose late order's total was 0 still looks as if it awaited it, as it did
// then (another OrderPlaced for it would be taken for the late order). The
// WHERE of an UPDATE, so that of two OrderPlaced at once the second, once the first commits,
// finds the row taken.
const awaitsItsOrderSQL = "status = ? AND placed_message_id IS NULL AND voided_at = created_at AND amount_cents = 0"

// cancelled voids the order's invoice; if the order has none yet, a void row remembers the
// cancellation, so that the order's OrderPlaced never issues one. A cancellation for another
// customer than the invoice's voids it all the same, and is logged at ERROR (logVoid), as an
// OrderPlaced for another customer than its cancellation's is in the other order of arrival,
// and as a second cancellation for another customer than the void invoice's is.
func (h invoicer) cancelled(ctx context.Context, tx *gorm.DB, ev events.OrderCancelled, msg messaging.Message) error {
	inv, err := newInvoice(ev.OrderID, ev.CustomerID, 0, StatusVoid, msg)
	if err != nil {
		return fmt.Errorf("remember the cancellation of order %s: %w", ev.OrderID, err)
	}
	var remembered []uuid.UUID
	err = tx.Raw(rememberSQL, inv.ID, inv.OrderID, inv.CustomerID, inv.Status, inv.MessageID).Scan(&remembered).Error
	if err != nil {
		return fmt.Errorf("remember the cancellation of order %s: %w", ev.OrderID, err)
	}
	if len(remembered) == 1 {
		return messaging.AfterCommit(ctx, func() {
			h.log.InfoContext(ctx, "cancellation remembered before its order", "order_id", ev.OrderID, "invoice_id", inv.ID, "message_id", msg.ID)
		})
	}
	var voided Invoice
	res := tx.Model(&voided).Clauses(clause.Returning{Columns: []clause.Column{{Name: "id"}, {Name: "customer_id"}}}).Where("order_id = ? AND status = ?", ev.OrderID, StatusIssued).
		// Later than created by construction, even if the database's clock steps back: a void row
		// voided as it was created is the one a cancellation wrote before its order.
		Updates(map[string]any{"status": StatusVoid, "voided_at": gorm.Expr("greatest(clock_timestamp(), created_at + interval '1 microsecond')")})
	if res.Error != nil {
		return fmt.Errorf("void invoice of order %s: %w", ev.OrderID, res.Error)
	}
	if res.RowsAffected == 0 {
		// Void already: another message cancelled the order. One for another customer is the
		// same disagreement as a first cancellation for another customer.
		var void Invoice
		if err := tx.Select("customer_id").Where("order_id = ?", ev.OrderID).Take(&void).Error; err != nil {
			return fmt.Errorf("read the void invoice of order %s: %w", ev.OrderID, err)
		}
		return messaging.AfterCommit(ctx, func() {
			h.alreadyDone()
			h.logVoid(ctx, "order already cancelled by another message", "; nothing to do", ev.CustomerID == void.CustomerID, slog.LevelWarn,
				"order_id", ev.OrderID, "message_id", msg.ID, alreadyDoneAttr)
		})
	}
	return messaging.AfterCommit(ctx, func() {
		h.logVoid(ctx, "invoice voided", "", ev.CustomerID == voided.CustomerID, slog.LevelInfo, "invoice_id", voided.ID, "order_id", ev.OrderID, "message_id", msg.ID)
	})
}

// newInvoice makes an invoice row to insert. The database stamps its created_at (now(), the
// transaction's start), as it stamps voided_at: one clock for the rows of every replica.
func newInvoice(orderID uuid.UUID, customerID string, amount int64, status string, msg messaging.Message) (Invoice, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return Invoice{}, err
	}
	return Invoice{ID: id, OrderID: orderID, CustomerID: customerID, AmountCents: amount, Status: status, MessageID: msg.ID}, nil
}

// rememberSQL inserts the void row that remembers a cancellation, unless the order has its row
// already (a concurrent insert for the same order waits here for the other transaction, then
// finds its row), and returns its id if it did. Voided as it was created, by the one clock:
// what tells the row of a cancellation that came first from one voided later.
const rememberSQL = `INSERT INTO invoices (id, order_id, customer_id, amount_cents, status, message_id, created_at, voided_at)
VALUES (?, ?, ?, 0, ?, ?, now(), now())
ON CONFLICT (order_id) DO NOTHING
RETURNING id`

// insertNewSQL inserts the invoices of a JSON array, in order_id order, skipping those whose
// order has one already, and returns the ids and created_at of those it inserted. A concurrent insert for the
// same order waits for the other transaction, then skips; the order keeps two batches' inserts
// from waiting for each other in a circle. A cancellation in the same transaction, or a second
// run of OrderPlaced after it, can still cross another batch's insert: PostgreSQL then aborts
// one of the two, and the consumer retries its messages one by one. Among the array's own rows
// of one order, ord (the batch's order, which a sort need not keep) lets the earlier message's
// stand, as it would one delivery at a time.
const insertNewSQL = `INSERT INTO invoices (id, order_id, customer_id, amount_cents, status, message_id, created_at, placed_message_id)
SELECT id, order_id, customer_id, amount_cents, status, message_id, now(), placed_message_id
FROM jsonb_to_recordset(?::jsonb) AS r(id uuid, order_id uuid, customer_id text, amount_cents bigint, status text, message_id uuid,
    placed_message_id uuid, ord int)
ORDER BY order_id, ord
ON CONFLICT (order_id) DO NOTHING
RETURNING id, created_at`

// invoiceRow is an invoice as insertNewSQL reads it, with its place in the batch.
type invoiceRow struct {
	Invoice
	Ord int `json:"ord"`
}

// insertNew inserts the invoices whose order has none, in one statement, and returns the
// created_at of each it inserted, by id.
func insertNew(tx *gorm.DB, invoices []Invoice) (map[uuid.UUID]time.Time, error) {
	rows := make([]invoiceRow, len(invoices))
	for i, inv := range invoices {
		rows[i] = invoiceRow{Invoice: inv, Ord: i}
	}
	doc, err := json.Marshal(rows)
	if err != nil {
		return nil, fmt.Errorf("insert %d invoices: %w", len(invoices), err)
	}
	var written []struct {
		ID        uuid.UUID
		CreatedAt time.Time
	}
	if err := tx.Raw(insertNewSQL, string(doc)).Scan(&written).Error; err != nil {
		return nil, fmt.Errorf("insert %d invoices: %w", len(invoices), err)
	}
	inserted := make(map[uuid.UUID]time.Time, len(written))
	for _, w := range written {
		inserted[w.ID] = w.CreatedAt
	}
	return inserted, nil
}
