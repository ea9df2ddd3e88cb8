// Package events defines the messages the services exchange: one Go type per event, shared by
// the publisher and its consumers, so the contract is written once.
package events

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

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
	case ev.PlacedAt.IsZero():
		return errors.New("OrderPlaced without placed_at")
	}
	if err := checkID(ev.CustomerID); err != nil {
		return fmt.Errorf("OrderPlaced with an invalid customer_id: %w", err)
	}
	// The lines first: linesTotal gives up on a negative one, which would read as a wrong sum.
	for i, l := range ev.Lines {
		if l.SKU == "" || l.Quantity < 1 || l.UnitPriceCents < 0 {
			return fmt.Errorf("OrderPlaced with an invalid line %d", i)
		}
		if err := checkID(l.SKU); err != nil {
			return fmt.Errorf("OrderPlaced with an invalid line %d: sku: %w", i, err)
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
	case ev.CancelledAt.IsZero():
		return errors.New("OrderCancelled without cancelled_at")
	}
	if err := checkID(ev.CustomerID); err != nil {
		return fmt.Errorf("OrderCancelled with an invalid customer_id: %w", err)
	}
	if p := reasonUnsafe(ev.Reason); p != "" {
		return fmt.Errorf("OrderCancelled with an invalid reason: %s", p)
	}
	return nil
}

// MaxReasonLength is the most characters of a cancellation's reason.
const MaxReasonLength = 500

// ReasonProblem says what is wrong with a cancellation's reason, or "": the order service
// refuses such a reason from a client. Beyond reasonUnsafe, a bidirectional embedding,
// override or isolate (U+202A-U+202E, U+2066-U+2069), which would show the rest of the
// reason, in the cancellation e-mail, in an order other than the one it was written in. Line
// and paragraph separators are taken: white space, which a consumer folds with the rest.
func ReasonProblem(s string) string {
	if p := reasonUnsafe(s); p != "" {
		return p
	}
	if strings.IndexFunc(s, bidiFormatting) >= 0 {
		return "must not contain bidirectional formatting characters"
	}
	return ""
}

// reasonUnsafe says what makes a reason unsafe to show as it is, or "": a control character
// could forge output where the reason is shown (an escape sequence, a NUL). A consumer refuses
// an event with such a reason, and only such: the order service has refused these since it
// took reasons, so no event it wrote has one, but it took bidirectional formatting characters
// before it refused them, and the events of those cancellations must still be handled.
func reasonUnsafe(s string) string { return unsafeText(s, MaxReasonLength) }

// bidiFormatting reports whether r is a bidirectional embedding, override or isolate, or the
// pop of one. The marks (U+200E, U+200F, U+061C) are not: they only set the direction of the
// neutral characters next to them, as mixed-direction text needs.
func bidiFormatting(r rune) bool {
	return '\u202a' <= r && r <= '\u202e' || '\u2066' <= r && r <= '\u2069'
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
	case ev.IssuedAt.IsZero():
		return errors.New("InvoiceIssued without issued_at")
	}
	if err := checkID(ev.CustomerID); err != nil {
		return fmt.Errorf("InvoiceIssued with an invalid customer_id: %w", err)
	}
	return nil
}

// MaxIDLength is the most characters of an id in an event (a customer's, a SKU): the order
// service takes none longer, and a consumer refuses one that is.
const MaxIDLength = 100

// IDProblem says what is wrong with an id (a customer's, a SKU), or "": the order service
// refuses such an id from a client. An id is compared and shown as sent (in an e-mail, a log):
// one with space around it, or an invisible character inside (see invisible), would be another
// id that looks the same, or an id that looks empty; a line or paragraph separator would break
// its line where shown; see idUnsafe for the rest.
func IDProblem(s string) string {
	if strings.TrimSpace(s) == "" {
		return "must not be empty"
	}
	if p := idUnsafe(s); p != "" {
		return p
	}
	switch {
	case strings.TrimSpace(s) != s:
		return "must not start or end with white space"
	case strings.IndexFunc(s, invisible) >= 0:
		return "must not contain invisible characters"
	case strings.IndexFunc(s, lineBreak) >= 0:
		return "must not contain line breaks"
	}
	return ""
}

// idUnsafe says what makes an id unsafe to show as it is, or "": a control character, a line
// break, could forge a line of its own. (The line and paragraph separators, which the order
// service took until it refused them, a consumer shows as spaces: OnOneLine.) A consumer
// refuses an event with such an id, and only such: the order service took ids with space around them, or invisible characters, before it
// refused them, and the events of those orders must still be handled.
func idUnsafe(s string) string { return unsafeText(s, MaxIDLength) }

// unsafeText says why s, at most limit characters, is unsafe to show as it is, or "".
func unsafeText(s string, limit int) string {
	switch {
	case !utf8.ValidString(s):
		return "must be valid UTF-8"
	case utf8.RuneCountInString(s) > limit:
		return fmt.Sprintf("at most %d characters", limit)
	case strings.IndexFunc(s, unicode.IsControl) >= 0:
		return "must not contain control characters"
	}
	return ""
}

// lineBreak reports whether r is the line or the paragraph separator: no control characters,
// but they break a line where they are shown.
func lineBreak(r rune) bool { return unicode.In(r, unicode.Zl, unicode.Zp) }

// OnOneLine is s with its line and paragraph separators as spaces: how a consumer shows an id
// the order service took before it refused them (IDProblem), on the one line it belongs to.
func OnOneLine(s string) string {
	return strings.Map(func(r rune) rune {
		if lineBreak(r) {
			return ' '
		}
		return r
	}, s)
}

// checkID is idUnsafe as an error.
func checkID(id string) error {
	if p := idUnsafe(id); p != "" {
		return errors.New(p)
	}
	return nil
}

// invisible reports whether r shows as nothing, or as a blank that is not white space: Unicode's
// default-ignorable code points, that is format characters (a zero-width space, a bidirectional
// override), variation selectors and the rest, such as the combining grapheme joiner and the
// Hangul fillers; and the braille blank, which looks like a space. An id that would need a
// variation selector (an emoji's presentation, an ideograph's variant, a Mongolian free
// variation selector) is refused too: ids are codes, where a look-alike costs more.
func invisible(r rune) bool {
	return r == '\u2800' || unicode.In(r, unicode.Cf, unicode.Variation_Selector, unicode.Other_Default_Ignorable_Code_Point)
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
