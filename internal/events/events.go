// Package events defines the messages the services exchange: one Go type per event, shared by
// the publisher and its consumers, so the contract is written once.
package events

import (
	"errors"
	"math"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// The exchanges: each publishing service owns one, named after it.
const (
	Exchange          = "orders"    // the order service's
	InvoicingExchange = "invoicing" // the invoicing service's
)

// The event types, which are also their routing keys.
const (
	OrderPlacedType    = "OrderPlaced"
	OrderCancelledType = "OrderCancelled"
	InvoiceIssuedType  = "InvoiceIssued"
)

// The events, each with the exchange it comes from and the checks its payload must pass.
var (
	OrderPlacedEvent    = messaging.Event[OrderPlaced]{Exchange: Exchange, Type: OrderPlacedType, Validate: OrderPlaced.validate}
	OrderCancelledEvent = messaging.Event[OrderCancelled]{Exchange: Exchange, Type: OrderCancelledType, Validate: OrderCancelled.validate}
	InvoiceIssuedEvent  = messaging.Event[InvoiceIssued]{Exchange: InvoicingExchange, Type: InvoiceIssuedType, Validate: InvoiceIssued.validate}
)

// The consumers' queues, each also the consumer's name.
const (
	InvoicingQueue    = "invoicing"
	NotificationQueue = "notification"
)

// Topology is the whole system on the broker: both exchanges, and each consumer's queue bound
// to the events it handles. Every service declares all of it at start, before it publishes or
// consumes, so an event published before a consumer first started waits in that consumer's
// queue, whatever order the services start in. The compose definitions and the Kubernetes
// resources declare the same (deploy's tests hold them to it), and each consumer's handlers
// must match its entry: its subscription refuses to start otherwise.
var Topology = messaging.Topology{
	Exchanges: []string{Exchange, InvoicingExchange},
	Queues: []messaging.ConsumerTopology{
		{Queue: InvoicingQueue, Bindings: []messaging.Binding{OrderPlacedEvent.Binding(), OrderCancelledEvent.Binding()}},
		{Queue: NotificationQueue, Bindings: []messaging.Binding{
			OrderPlacedEvent.Binding(), InvoiceIssuedEvent.Binding(), OrderCancelledEvent.Binding()}},
	},
}

// Line is one order line in an event. Money is integer cents.
type Line struct {
	SKU            string `json:"sku"`
	Quantity       int64  `json:"quantity"`
	UnitPriceCents int64  `json:"unit_price_cents"`
}

// OrderPlaced says an order was saved.
type OrderPlaced struct {
	OrderID    uuid.UUID `json:"order_id"`
	CustomerID string    `json:"customer_id"`
	Lines      []Line    `json:"lines"`
	TotalCents int64     `json:"total_cents"`
	PlacedAt   time.Time `json:"placed_at"`
}

// DecodeOrderPlaced reads and checks an OrderPlaced message. Every error is
// [messaging.Permanent]: a message of another type or shape will never become valid, so the
// consumer dead-letters it.
func DecodeOrderPlaced(msg messaging.Message) (OrderPlaced, error) {
	return OrderPlacedEvent.Decode(msg)
}

func (ev OrderPlaced) validate() error {
	switch {
	case ev.OrderID == uuid.Nil:
		return errors.New("OrderPlaced without order_id")
	case ev.CustomerID == "":
		return errors.New("OrderPlaced without customer_id")
	case ev.TotalCents < 0:
		return errors.New("OrderPlaced with a negative total_cents")
	case len(ev.Lines) == 0:
		return errors.New("OrderPlaced without lines")
	}
	// The lines first: linesTotal gives up on a negative one, which would read as a wrong sum.
	for _, l := range ev.Lines {
		if l.SKU == "" || l.Quantity < 1 || l.UnitPriceCents < 0 {
			return errors.New("OrderPlaced with an invalid line")
		}
	}
	if ev.TotalCents != linesTotal(ev.Lines) {
		return errors.New("OrderPlaced whose total_cents is not the sum of its lines")
	}
	return nil
}

// OrderCancelled says an order was cancelled. It may reach a consumer before the order's
// OrderPlaced does.
type OrderCancelled struct {
	OrderID     uuid.UUID `json:"order_id"`
	CustomerID  string    `json:"customer_id"`
	Reason      string    `json:"reason"`
	CancelledAt time.Time `json:"cancelled_at"`
}

func (ev OrderCancelled) validate() error {
	switch {
	case ev.OrderID == uuid.Nil:
		return errors.New("OrderCancelled without order_id")
	case ev.CustomerID == "":
		return errors.New("OrderCancelled without customer_id")
	}
	return nil
}

// InvoiceIssued says the invoicing service issued an order's invoice.
type InvoiceIssued struct {
	InvoiceID   uuid.UUID `json:"invoice_id"`
	OrderID     uuid.UUID `json:"order_id"`
	CustomerID  string    `json:"customer_id"`
	AmountCents int64     `json:"amount_cents"`
	IssuedAt    time.Time `json:"issued_at"`
}

func (ev InvoiceIssued) validate() error {
	switch {
	case ev.InvoiceID == uuid.Nil || ev.OrderID == uuid.Nil:
		return errors.New("InvoiceIssued without invoice_id or order_id")
	case ev.CustomerID == "":
		return errors.New("InvoiceIssued without customer_id")
	case ev.AmountCents < 0:
		return errors.New("InvoiceIssued with a negative amount_cents")
	}
	return nil
}

// linesTotal sums the lines; a sum that overflows cannot match any total.
func linesTotal(lines []Line) int64 {
	var total int64
	for _, l := range lines {
		if l.Quantity > 0 && l.UnitPriceCents > math.MaxInt64/l.Quantity {
			return -1
		}
		sub := l.Quantity * l.UnitPriceCents
		if total > math.MaxInt64-sub {
			return -1
		}
		total += sub
	}
	return total
}
