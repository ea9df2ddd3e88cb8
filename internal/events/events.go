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

// Exchange is the topic exchange the order service publishes to.
const Exchange = "orders"

// OrderPlacedType is the type (and routing key) of OrderPlaced.
const OrderPlacedType = "OrderPlaced"

// Line is one order line in an event. Money is integer cents.
type Line struct {
	SKU            string `json:"sku"`
	Quantity       int64  `json:"quantity"`
	UnitPriceCents int64  `json:"unit_price_cents"`
}

// OrderPlaced says an order was saved (CONTRACT.md).
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
	if msg.Type != OrderPlacedType {
		return OrderPlaced{}, messaging.Permanent(errors.New("unexpected message type " + truncate(msg.Type)))
	}
	ev, err := messaging.Decode[OrderPlaced](msg)
	if err != nil {
		return OrderPlaced{}, err
	}
	switch {
	case ev.OrderID == uuid.Nil:
		err = errors.New("OrderPlaced without order_id")
	case ev.CustomerID == "":
		err = errors.New("OrderPlaced without customer_id")
	case ev.TotalCents < 0:
		err = errors.New("OrderPlaced with a negative total_cents")
	case len(ev.Lines) == 0:
		err = errors.New("OrderPlaced without lines")
	case ev.TotalCents != linesTotal(ev.Lines):
		err = errors.New("OrderPlaced whose total_cents is not the sum of its lines")
	}
	for _, l := range ev.Lines {
		if l.SKU == "" || l.Quantity < 1 || l.UnitPriceCents < 0 {
			err = errors.New("OrderPlaced with an invalid line")
		}
	}
	if err != nil {
		return OrderPlaced{}, messaging.Permanent(err)
	}
	return ev, nil
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

func truncate(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}
