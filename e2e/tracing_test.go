package e2e

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// One trace follows an order through the three binaries: the order's request, which came
// with a traceparent, its OrderPlaced through the outbox and the relay to both consumers, the
// InvoiceIssued the invoicing service writes to its own outbox, and both e-mails. The log lines
// of each step carry its trace id, and the spans reach an OTLP receiver with the shape the
// trace should have. An order without a traceparent gets a trace of its own, followed the same
// way.
func TestOneTraceFollowsAnOrderThroughTheThreeServices(t *testing.T) {
	t.Parallel()
	receiver := testenv.NewOTLPReceiver(t)
	// The batch processor exports every 100 ms instead of every 5 s: the test waits less.
	export := []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + receiver.URL, "OTEL_BSP_SCHEDULE_DELAY=100"}
	s := startSystem(t, systest.Options{Env: map[string][]string{"order": export, "invoicing": export, "notification": export}})

	traceID, callerSpan := randomHex(t, 16), randomHex(t, 8)
	traced := s.Order.PlaceOrderWith(t, "traced", http.Header{"Traceparent": {"00-" + traceID + "-" + callerSpan + "-01"}})
	untraced := s.PlaceOrder(t, "untraced")
	s.WaitExactlyOnce(t, 2, 30*time.Second)

	requireTraceInLogs(t, s, traced.String(), traceID)
	spans := waitForTrace(t, receiver, traceID, 8)
	t.Logf("the trace of order %s (%d spans):\n%s", traced, len(spans), render(spans, callerSpan, 0))
	want := []string{
		"order POST /orders (server) ← caller",
		"order publish orders (producer) ← order POST /orders",
		"invoicing process invoicing (consumer) ← order publish orders",
		"notification process notification (consumer) ← order publish orders",
		"invoicing publish invoicing (producer) ← invoicing process invoicing",
		"notification process notification (consumer) ← invoicing publish invoicing",
		"notification deliver notification (client) ← notification process notification",
		"notification deliver notification (client) ← notification process notification",
	}
	if got := edges(spans, callerSpan); !slices.Equal(sorted(got), sorted(want)) {
		t.Fatalf("spans of trace %s:\n%s\nwant:\n%s", traceID, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	for _, sp := range spans {
		if sp.Error {
			t.Errorf("span %s of %s failed", sp.Name, sp.Service)
		}
	}

	// The order without a traceparent: its request started a trace, and the chain follows it.
	line := s.Order.Logs.Lines(`msg="order placed"`, "order_id="+untraced.String())
	if len(line) != 1 {
		t.Fatalf("%d 'order placed' lines for order %s, want 1", len(line), untraced)
	}
	m := regexp.MustCompile(`trace_id=([0-9a-f]{32})`).FindStringSubmatch(line[0])
	if len(m) < 2 || m[1] == traceID {
		t.Fatalf("the untraced order's line %q has no trace id of its own", line[0])
	}
	requireTraceInLogs(t, s, untraced.String(), m[1])
}

// requireTraceInLogs requires every line about order orderID that each service writes while
// handling its request or its messages to carry trace_id=traceID: the order's HTTP line, the
// invoice, both notifications recorded and both delivered (the confirmation, and the invoice
// notice that came through InvoiceIssued).
func requireTraceInLogs(t *testing.T, s *systest.System, orderID, traceID string) {
	t.Helper()
	for _, l := range []struct {
		service *systest.Service
		parts   []string
		want    int
	}{
		{s.Order, []string{`msg="order placed"`}, 1},
		{s.Invoicing, []string{`msg="invoice issued"`}, 1},
		{s.Notification, []string{`msg="notification recorded"`, "kind=order_confirmation"}, 1},
		{s.Notification, []string{`msg="notification recorded"`, "kind=invoice"}, 1},
		{s.Notification, []string{`msg="notification delivered"`}, 2},
	} {
		about := append(slices.Clone(l.parts), "order_id="+orderID)
		// The lines reach the test through a pipe: give them a moment.
		testenv.Eventually(t, 5*time.Second, func() bool { return len(l.service.Logs.Lines(about...)) == l.want },
			"%s did not log %d lines with %q", l.service.Name, l.want, about)
		if inTrace := l.service.Logs.Lines(append(about, "trace_id="+traceID)...); len(inTrace) != l.want {
			t.Errorf("%s: %d of the lines %q carry trace_id=%s, want %d:\n%s", l.service.Name, len(inTrace), about, traceID,
				l.want, strings.Join(l.service.Logs.Lines(about...), "\n"))
		}
	}
}

// waitForTrace waits until the receiver holds at least n spans of the trace.
func waitForTrace(t *testing.T, r *testenv.OTLPReceiver, traceID string, n int) []testenv.Span {
	t.Helper()
	testenv.Eventually(t, 15*time.Second, func() bool { return len(r.Trace(traceID)) >= n },
		"the receiver has %s spans of trace %s, want %d", lazy(func() string { return fmt.Sprint(len(r.Trace(traceID))) }), traceID, n)
	return r.Trace(traceID)
}

// edges describes each span as "service name (kind) ← its parent's service and name".
func edges(spans []testenv.Span, caller string) []string {
	byID := map[string]testenv.Span{}
	for _, sp := range spans {
		byID[sp.SpanID] = sp
	}
	var out []string
	for _, sp := range spans {
		parent := "caller"
		if p, ok := byID[sp.Parent]; ok {
			parent = p.Service + " " + p.Name
		} else if sp.Parent != caller {
			parent = "unknown span " + sp.Parent
		}
		out = append(out, fmt.Sprintf("%s %s (%s) ← %s", sp.Service, sp.Name, sp.Kind, parent))
	}
	return out
}

// render draws the spans under parent as an indented tree.
func render(spans []testenv.Span, parent string, depth int) string {
	var b strings.Builder
	for _, sp := range spans {
		if sp.Parent == parent {
			fmt.Fprintf(&b, "%s%-12s %-22s %-9s span %s parent %s\n", strings.Repeat("  ", depth), sp.Service, sp.Name, sp.Kind, sp.SpanID, sp.Parent)
			b.WriteString(render(spans, sp.SpanID, depth+1))
		}
	}
	return b.String()
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}
