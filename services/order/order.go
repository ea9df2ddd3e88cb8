package main

import (
	"strconv"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/events"
)

// The domain: what an order is, what placing one takes, and the event it produces. Nothing
// here knows about HTTP, SQL or RabbitMQ.

// Limits on a place-order command; anything beyond is an absurd size, rejected with 422.
const (
	MaxLines          = 100
	MaxQuantity       = 10_000
	MaxUnitPriceCents = 100_000_000 // 1,000,000.00 in the currency's major unit
	MaxIDLength       = events.MaxIDLength
)

// Line is one line of an order. Money is integer cents. A body must give each of its fields
// (required, checked by the decoder): a price left out is not a price of 0.
type Line struct {
	SKU            string `json:"sku" required:"true"`
	Quantity       int64  `json:"quantity" required:"true"`
	UnitPriceCents int64  `json:"unit_price_cents" required:"true"`
}

// PlaceOrder is the command a customer sends.
type PlaceOrder struct {
	CustomerID string `json:"customer_id" required:"true"`
	Lines      []Line `json:"lines" required:"true"`
}

// Violation is one reason a command is invalid.
type Violation struct {
	Field   string
	Message string
}

// Validate returns every violation of the command's rules, or none.
func (c PlaceOrder) Validate() []Violation {
	var v []Violation
	if msg := events.IDProblem(c.CustomerID); msg != "" {
		v = append(v, Violation{"customer_id", msg})
	}
	switch {
	case len(c.Lines) == 0:
		v = append(v, Violation{"lines", "an order needs at least one line"})
	case len(c.Lines) > MaxLines:
		v = append(v, Violation{"lines", "at most 100 lines"})
		return v
	}
	for i, l := range c.Lines {
		field := func(name string) string { return "lines[" + strconv.Itoa(i) + "]." + name }
		if msg := events.IDProblem(l.SKU); msg != "" {
			v = append(v, Violation{field("sku"), msg})
		}
		if l.Quantity < 1 || l.Quantity > MaxQuantity {
			v = append(v, Violation{field("quantity"), "must be from 1 to 10000"})
		}
		if l.UnitPriceCents < 0 || l.UnitPriceCents > MaxUnitPriceCents {
			v = append(v, Violation{field("unit_price_cents"), "must be from 0 to 100000000"})
		}
	}
	return v
}

// An order's statuses.
const (
	StatusPlaced    = "placed"
	StatusCancelled = "cancelled"
)

// MaxReasonLength bounds a cancellation's reason, in characters.
const MaxReasonLength = events.MaxReasonLength

// Order is a placed order. Its total is computed here, never taken from the client.
type Order struct {
	ID           uuid.UUID  `json:"id"`
	CustomerID   string     `json:"customer_id"`
	Lines        []Line     `json:"lines"`
	TotalCents   int64      `json:"total_cents"`
	Status       string     `json:"status"`
	CreatedAt    time.Time  `json:"created_at"`
	CancelledAt  *time.Time `json:"cancelled_at,omitempty"`
	CancelReason string     `json:"cancel_reason,omitempty"`
}

// CancelOrder is the command that cancels an order; its reason is optional.
type CancelOrder struct {
	Reason string `json:"reason"`
}

// Validate returns every violation of the command's rules, or none.
func (c CancelOrder) Validate() []Violation {
	if msg := events.ReasonProblem(c.Reason); msg != "" {
		return []Violation{{"reason", msg}}
	}
	return nil
}

// Cancel marks the order cancelled at now, and reports whether that changed anything: an
// order cancelled before stays as it was.
func (o *Order) Cancel(cmd CancelOrder, now time.Time) bool {
	if o.Status == StatusCancelled {
		return false
	}
	at := now.UTC().Truncate(time.Microsecond)
	o.Status, o.CancelledAt, o.CancelReason = StatusCancelled, &at, cmd.Reason
	return true
}

// CancelledEvent returns the order's OrderCancelled event.
func (o Order) CancelledEvent() events.OrderCancelled {
	return events.OrderCancelled{OrderID: o.ID, CustomerID: o.CustomerID, Reason: o.CancelReason, CancelledAt: *o.CancelledAt}
}

// NewOrder places a valid command. Within the limits above the total cannot overflow
// (100 lines × 10,000 × 100,000,000 < 2⁶³).
func NewOrder(cmd PlaceOrder, id uuid.UUID, now time.Time) Order {
	o := Order{ID: id, CustomerID: cmd.CustomerID, Lines: cmd.Lines, Status: StatusPlaced, CreatedAt: now.UTC().Truncate(time.Microsecond)}
	for _, l := range cmd.Lines {
		o.TotalCents += l.Quantity * l.UnitPriceCents
	}
	return o
}

// Placed returns the order's OrderPlaced event.
func (o Order) Placed() events.OrderPlaced {
	lines := make([]events.Line, len(o.Lines))
	for i, l := range o.Lines {
		lines[i] = events.Line(l)
	}
	return events.OrderPlaced{OrderID: o.ID, CustomerID: o.CustomerID, Lines: lines, TotalCents: o.TotalCents, PlacedAt: o.CreatedAt}
}
