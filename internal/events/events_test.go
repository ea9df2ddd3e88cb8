package events

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// decoded builds a message of ev from payload, as the publisher does, and decodes it, as a
// consumer does: what a consumer is given, or the error that dead-letters the message.
func decoded[T any](t *testing.T, ev messaging.Event[T], payload T) error {
	t.Helper()
	msg, err := ev.Message(payload)
	if err != nil {
		t.Fatal(err)
	}
	_, err = ev.Decode(msg)
	if err != nil && !messaging.IsPermanent(err) {
		t.Fatalf("%s: %v, want a permanent error: the message will never become valid", ev.Type, err)
	}
	return err
}

// orderPlaced is a valid OrderPlaced of lines, its total theirs.
func orderPlaced(lines ...Line) OrderPlaced {
	ev := OrderPlaced{OrderID: uuid.New(), CustomerID: "c-1", Lines: lines, PlacedAt: time.Now().UTC()}
	for _, l := range lines {
		ev.TotalCents += l.Quantity * l.UnitPriceCents
	}
	return ev
}

// A sum of lines past an int64 matches no total: wrapped, it could come back to one. A line of
// 4 × 2^62 cents wraps to 0, and one of 3 × 3·2^61 to 2^61, which an order of that total would
// otherwise match; two lines of 2 × 2^62 wrap to 0 in their sum; so do three of MaxInt64,
// MaxInt64 and 2, whose products fit.
func TestLinesPastAnInt64MatchNoTotal(t *testing.T) {
	t.Parallel()
	half := int64(math.MaxInt64/2 + 1) // 2^62
	for _, lines := range [][]Line{
		{{SKU: "a", Quantity: 2, UnitPriceCents: half}},
		{{SKU: "a", Quantity: 4, UnitPriceCents: half}},
		{{SKU: "a", Quantity: 3, UnitPriceCents: 3 << 61}},
		{{SKU: "a", Quantity: 2, UnitPriceCents: half}, {SKU: "b", Quantity: 2, UnitPriceCents: half}},
		{{SKU: "a", Quantity: half, UnitPriceCents: 2}, {SKU: "b", Quantity: half, UnitPriceCents: 2}},
		{{SKU: "a", Quantity: 1, UnitPriceCents: math.MaxInt64}, {SKU: "b", Quantity: 1, UnitPriceCents: math.MaxInt64}, {SKU: "c", Quantity: 1, UnitPriceCents: 2}},
	} {
		if got := linesTotal(lines); got != -1 {
			t.Errorf("linesTotal(%+v) = %d, want -1: it overflows", lines, got)
		}
		ev := orderPlaced(lines...) // its total wraps as the lines' would
		if err := decoded(t, OrderPlacedEvent, ev); err == nil {
			t.Errorf("an OrderPlaced of %+v, total %d: taken, want it refused", lines, ev.TotalCents)
		}
	}
	// The most that fits is a sum all the same.
	most := []Line{{SKU: "a", Quantity: 1, UnitPriceCents: math.MaxInt64 - 1}, {SKU: "b", Quantity: 1, UnitPriceCents: 1}}
	if got := linesTotal(most); got != math.MaxInt64 {
		t.Errorf("linesTotal(%+v) = %d, want MaxInt64", most, got)
	}
	if err := decoded(t, OrderPlacedEvent, orderPlaced(most...)); err != nil {
		t.Errorf("an OrderPlaced of total MaxInt64: %v, want it taken", err)
	}
}

// Each event's checks refuse what a consumer could not act on, and take a valid one.
func TestEventsAreValidated(t *testing.T) {
	t.Parallel()
	line := Line{SKU: "SKU-1", Quantity: 2, UnitPriceCents: 150}
	for _, tc := range []struct {
		name string
		edit func(*OrderPlaced)
		want string // "" for taken
	}{
		{"valid", func(*OrderPlaced) {}, ""},
		{"free", func(ev *OrderPlaced) { ev.Lines[0].UnitPriceCents, ev.TotalCents = 0, 0 }, ""},
		{"no order_id", func(ev *OrderPlaced) { ev.OrderID = uuid.Nil }, "without order_id"},
		{"no customer_id", func(ev *OrderPlaced) { ev.CustomerID = "" }, "without customer_id"},
		{"negative total", func(ev *OrderPlaced) { ev.TotalCents = -1 }, "negative total_cents"},
		{"no lines", func(ev *OrderPlaced) { ev.Lines, ev.TotalCents = nil, 0 }, "without lines"},
		{"no placed_at", func(ev *OrderPlaced) { ev.PlacedAt = time.Time{} }, "without placed_at"},
		{"wrong total", func(ev *OrderPlaced) { ev.TotalCents++ }, "not the sum of its lines"},
		{"no SKU", func(ev *OrderPlaced) { ev.Lines[0].SKU = "" }, "invalid line"},
		// Shown as sent in the confirmation e-mail: a line break would forge a line of its own.
		{"SKU with a line break", func(ev *OrderPlaced) { ev.Lines[0].SKU = "SKU-1\r\nTotal: 0.00" }, "invalid line 0: sku: must not contain control characters"},
		// Taken by the order service until it refused them: shown on one line (OnOneLine).
		{"SKU with a line separator", func(ev *OrderPlaced) { ev.Lines[0].SKU = "SKU-1\u2028Total: 0.00" }, ""},
		{"SKU with a paragraph separator", func(ev *OrderPlaced) { ev.Lines[0].SKU = "SKU-1\u2029Total: 0.00" }, ""},
		{"SKU too long", func(ev *OrderPlaced) { ev.Lines[0].SKU = strings.Repeat("ß", MaxIDLength+1) }, "invalid line 0: sku: at most 100 characters"},
		{"SKU of the most characters", func(ev *OrderPlaced) { ev.Lines[0].SKU = strings.Repeat("ß", MaxIDLength) }, ""},
		{"customer_id with a control character", func(ev *OrderPlaced) { ev.CustomerID = "c-1\x1b[2J" }, "invalid customer_id: must not contain control characters"},
		{"customer_id too long", func(ev *OrderPlaced) { ev.CustomerID = strings.Repeat("c", MaxIDLength+1) }, "invalid customer_id: at most 100 characters"},
		{"customer_id not ASCII", func(ev *OrderPlaced) { ev.CustomerID = "Jürgen Groß" }, ""},
		// Taken from clients before the order service refused them: their orders' events are
		// handled still.
		{"customer_id with space around it", func(ev *OrderPlaced) { ev.CustomerID = " c-1 " }, ""},
		{"SKU with an invisible character", func(ev *OrderPlaced) { ev.Lines[0].SKU = "SKU\u200b-1" }, ""},
		{"no quantity", func(ev *OrderPlaced) { ev.Lines[0].Quantity, ev.TotalCents = 0, 0 }, "invalid line"},
		{"negative quantity and price", func(ev *OrderPlaced) { ev.Lines[0].Quantity, ev.Lines[0].UnitPriceCents = -2, -150 }, "invalid line"},
		// Its total the lines' sum: refused for the line, not the sum.
		{"negative price", func(ev *OrderPlaced) {
			ev.Lines = append(ev.Lines, Line{SKU: "SKU-2", Quantity: 1, UnitPriceCents: -300})
			ev.TotalCents = 0
		}, "invalid line"},
	} {
		ev := orderPlaced(line)
		tc.edit(&ev)
		switch err := decoded(t, OrderPlacedEvent, ev); {
		case tc.want == "" && err != nil:
			t.Errorf("OrderPlaced %s: %v, want it taken", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("OrderPlaced %s: %v, want %q", tc.name, err, tc.want)
		}
	}

	cancelled := func(edit func(*OrderCancelled)) error {
		ev := OrderCancelled{OrderID: uuid.New(), CustomerID: "c-1", Reason: "changed my mind", CancelledAt: time.Now().UTC()}
		edit(&ev)
		return decoded(t, OrderCancelledEvent, ev)
	}
	if err := cancelled(func(ev *OrderCancelled) { ev.Reason = "" }); err != nil {
		t.Errorf("OrderCancelled without a reason: %v, want it taken", err)
	}
	if err := cancelled(func(ev *OrderCancelled) { ev.OrderID = uuid.Nil }); err == nil || !strings.Contains(err.Error(), "without order_id") {
		t.Errorf("OrderCancelled without order_id: %v, want it refused", err)
	}
	if err := cancelled(func(ev *OrderCancelled) { ev.CustomerID = "" }); err == nil || !strings.Contains(err.Error(), "without customer_id") {
		t.Errorf("OrderCancelled without customer_id: %v, want it refused", err)
	}
	if err := cancelled(func(ev *OrderCancelled) { ev.CancelledAt = time.Time{} }); err == nil || !strings.Contains(err.Error(), "without cancelled_at") {
		t.Errorf("OrderCancelled without cancelled_at: %v, want it refused", err)
	}
	if err := cancelled(func(ev *OrderCancelled) { ev.CustomerID = "c-1\n" }); err == nil || !strings.Contains(err.Error(), "invalid customer_id: must not contain control characters") {
		t.Errorf("OrderCancelled with a line break in customer_id: %v, want it refused", err)
	}
	// Shown in the cancellation e-mail: a control character could forge output there. Refused
	// as the order service refuses it from a client, and only so: every reason it took passes.
	for name, tc := range map[string]struct{ reason, want string }{
		"reason with an escape sequence":     {"x\x1b[2J", "invalid reason: must not contain control characters"},
		"reason with a NUL":                  {"x\x00y", "invalid reason: must not contain control characters"},
		"reason with a C1 control character": {"x\u009by", "invalid reason: must not contain control characters"},
		"reason too long":                    {strings.Repeat("ß", MaxReasonLength+1), "invalid reason: at most 500 characters"},
		"reason of the most characters":      {strings.Repeat("ß", MaxReasonLength), ""},
		"reason with a line separator":       {"changed\u2028my mind", ""},
		"reason with an invisible character": {"changed\u200bmy mind", ""},
		// Refused by the order service since (ReasonProblem), taken from the events before it.
		"reason with a right-to-left override": {"changed \u202ednim ym", ""},
	} {
		switch err := cancelled(func(ev *OrderCancelled) { ev.Reason = tc.reason }); {
		case tc.want == "" && err != nil:
			t.Errorf("OrderCancelled %s: %v, want it taken", name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("OrderCancelled %s: %v, want %q", name, err, tc.want)
		}
	}

	issued := func(edit func(*InvoiceIssued)) error {
		ev := InvoiceIssued{InvoiceID: uuid.New(), OrderID: uuid.New(), CustomerID: "c-1", AmountCents: 300, IssuedAt: time.Now().UTC()}
		edit(&ev)
		return decoded(t, InvoiceIssuedEvent, ev)
	}
	for name, tc := range map[string]struct {
		edit func(*InvoiceIssued)
		want string
	}{
		"valid":                                {func(*InvoiceIssued) {}, ""},
		"free":                                 {func(ev *InvoiceIssued) { ev.AmountCents = 0 }, ""},
		"no invoice_id":                        {func(ev *InvoiceIssued) { ev.InvoiceID = uuid.Nil }, "without invoice_id or order_id"},
		"no order_id":                          {func(ev *InvoiceIssued) { ev.OrderID = uuid.Nil }, "without invoice_id or order_id"},
		"no customer_id":                       {func(ev *InvoiceIssued) { ev.CustomerID = "" }, "without customer_id"},
		"no issued_at":                         {func(ev *InvoiceIssued) { ev.IssuedAt = time.Time{} }, "without issued_at"},
		"customer_id with a control character": {func(ev *InvoiceIssued) { ev.CustomerID = "c-1\u0085" }, "invalid customer_id: must not contain control characters"},
		"negative":                             {func(ev *InvoiceIssued) { ev.AmountCents = -1 }, "negative amount_cents"},
	} {
		switch err := issued(tc.edit); {
		case tc.want == "" && err != nil:
			t.Errorf("InvoiceIssued %s: %v, want it taken", name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("InvoiceIssued %s: %v, want %q", name, err, tc.want)
		}
	}

	// A message of one event is not another's, whatever its payload.
	msg, err := OrderCancelledEvent.Message(OrderCancelled{OrderID: uuid.New(), CustomerID: "c-1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := DecodeOrderPlaced(msg); !messaging.IsPermanent(err) {
		t.Errorf("an OrderCancelled decoded as OrderPlaced: %v, want a permanent error", err)
	}
}

// The order service refuses a reason with a bidirectional embedding, override or isolate,
// which would show the reason, in the cancellation e-mail, in an order other than its own;
// the marks, which only set a neutral character's direction, and the rest are taken.
func TestReasonProblemRefusesBidiFormatting(t *testing.T) {
	t.Parallel()
	for _, r := range []rune{'\u202a', '\u202b', '\u202c', '\u202d', '\u202e', '\u2066', '\u2067', '\u2068', '\u2069'} {
		if got := ReasonProblem("changed " + string(r) + "my mind"); got != "must not contain bidirectional formatting characters" {
			t.Errorf("a reason with %U: %q, want it refused", r, got)
		}
	}
	for _, reason := range []string{"", "changed my mind", "\u05e9\u05d9\u05e0\u05d9\u05ea\u05d9 \u200fdecision", "changed\u2028my mind", strings.Repeat("ß", MaxReasonLength)} {
		if got := ReasonProblem(reason); got != "" {
			t.Errorf("reason %q: %q, want it taken", reason, got)
		}
	}
	if got := ReasonProblem("x\x1b[2J"); got != "must not contain control characters" {
		t.Errorf("a reason with an escape sequence: %q, want it refused", got)
	}
}
