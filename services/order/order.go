package main

import (
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

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
	MaxIDLength       = 100
)

// Line is one line of an order. Money is integer cents.
type Line struct {
	SKU            string `json:"sku"`
	Quantity       int64  `json:"quantity"`
	UnitPriceCents int64  `json:"unit_price_cents"`
}

// PlaceOrder is the command a customer sends.
type PlaceOrder struct {
	CustomerID string `json:"customer_id"`
	Lines      []Line `json:"lines"`
}

// Violation is one reason a command is invalid.
type Violation struct {
	Field   string
	Message string
}

// Validate returns every violation of the command's rules, or none.
func (c PlaceOrder) Validate() []Violation {
	var v []Violation
	if msg := checkID(c.CustomerID); msg != "" {
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
		if msg := checkID(l.SKU); msg != "" {
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

func checkID(s string) string {
	switch {
	case strings.TrimSpace(s) == "":
		return "must not be empty"
	case !utf8.ValidString(s):
		return "must be valid UTF-8"
	case utf8.RuneCountInString(s) > MaxIDLength:
		return "at most 100 characters"
	case strings.IndexFunc(s, unicode.IsControl) >= 0:
		return "must not contain control characters"
	}
	return ""
}

// Order is a placed order. Its total is computed here, never taken from the client.
type Order struct {
	ID         uuid.UUID `json:"id"`
	CustomerID string    `json:"customer_id"`
	Lines      []Line    `json:"lines"`
	TotalCents int64     `json:"total_cents"`
	CreatedAt  time.Time `json:"created_at"`
}

// NewOrder places a valid command. Within the limits above the total cannot overflow
// (100 lines × 10,000 × 100,000,000 < 2⁶³).
func NewOrder(cmd PlaceOrder, id uuid.UUID, now time.Time) Order {
	o := Order{ID: id, CustomerID: cmd.CustomerID, Lines: cmd.Lines, CreatedAt: now.UTC().Truncate(time.Microsecond)}
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
