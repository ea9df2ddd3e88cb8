package messaging

import (
	"context"
	"encoding/json"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
)

// What jsonb refuses in JSON that encoding/json's Valid accepts, each case checked against
// PostgreSQL 15 ('…'::jsonb): a NUL, an unpaired surrogate, invalid UTF-8, a number beyond
// numeric's range. An escaped backslash before u0000 is text, and the numbers at the limits
// are stored.
func TestJSONBRefusals(t *testing.T) {
	for _, tc := range []struct {
		json   string
		refuse bool
	}{
		{`{"a":"x","n":[1,-2.5,3e5,true,null]}`, false},
		{`{"a":"\u0000"}`, true},
		{`{"\u0000":1}`, true},
		{`{"a":"x\u00001"}`, true},
		{`{"a":"\\u0000"}`, false},
		{`{"a":"\\\u0000"}`, true},
		{`{"a":"\u00e9\n\"\\","b":"\u0001"}`, false},
		{`{"a":"\ud83d\ude00"}`, false},
		{`{"a":"\ud800"}`, true},
		{`{"a":"\ud800x"}`, true},
		{`{"a":"\ud800\u0041"}`, true},
		{`{"a":"\udc00"}`, true},
		{"{\"a\":\"\xff\"}", true},
		{`[1e131071, 10e131070, 1.0e131071, 0.0001e131075, 0e999999, 1e-16383, 0.1e-16382, -1E+5]`, false},
		{`[1e131072]`, true},
		{`[123e131070]`, true},
		{`[1e-16384]`, true},
		{`[1.5e-16383]`, true},
		{`[0e-99999]`, true},
		{`[0.000e-16381]`, true},
		{`{"a":"1e999999"}`, false},
		{`[0e1073741822, -0.0E+0, 0e-0]`, false},
		{`[0e1073741823]`, true},
		{`{"a":-0.0E+9999999999}`, true},
	} {
		if got := jsonbRefusal([]byte(tc.json)); (got != "") != tc.refuse {
			t.Errorf("jsonbRefusal(%s) = %q, want refused: %v", tc.json, got, tc.refuse)
		}
	}
}

// What Enqueue writes is the JSON of its messages, each text as given: any type, correlation
// id, trace field, exchange, routing key or header it accepts reads back unchanged, and the
// rest are refused. appendJSONString escapes bytes and leaves UTF-8 alone, which holds only
// because unstorable refused invalid UTF-8 first.
func FuzzOutboxRows(f *testing.F) {
	f.Add("OrderPlaced", "corr-1", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "k=v", "orders", "order.placed", "tenant", "a\"b\\c")
	f.Add("T\t\n", "\u2028 é 漢 😀", "", "", "", "", "x", "\x7f")
	f.Add("T", "\xff", "", "", "", "", "h", "v")
	f.Add("T", "", "", "", "", "", "h", "a\xffb")
	// What is valid is taken: a refusal of it would pass the fuzzing unseen.
	for _, corr := range []string{"corr-1", "\u2028 é 漢 😀 \"\\ \t"} {
		m := Message{ID: uuid.Must(uuid.NewV7()), Type: "T", Payload: []byte(`{}`), CorrelationID: corr, Headers: map[string]string{"x": corr}}
		if _, err := outboxRows(context.Background(), []Message{m}, time.Now()); err != nil {
			f.Fatalf("outboxRows refused a valid message: %v", err)
		}
	}
	f.Fuzz(func(t *testing.T, typ, corr, traceParent, traceState, exchange, routingKey, hk, hv string) {
		m := Message{ID: uuid.Must(uuid.NewV7()), Type: typ, Payload: []byte(`{}`), CorrelationID: corr,
			TraceParent: traceParent, TraceState: traceState, Exchange: exchange, RoutingKey: routingKey,
			Headers: map[string]string{hk: hv}}
		rows, err := outboxRows(context.Background(), []Message{m}, time.Now())
		if err != nil {
			return // refused: nothing to read back
		}
		if !utf8.ValidString(rows) || !json.Valid([]byte(rows)) {
			t.Fatalf("outboxRows wrote what is not valid UTF-8 JSON: %q", rows)
		}
		var got []struct {
			Type          string            `json:"type"`
			CorrelationID string            `json:"correlation_id"`
			TraceParent   string            `json:"trace_parent"`
			TraceState    string            `json:"trace_state"`
			Exchange      *string           `json:"exchange"`
			RoutingKey    *string           `json:"routing_key"`
			Headers       map[string]string `json:"headers"`
		}
		if err := json.Unmarshal([]byte(rows), &got); err != nil || len(got) != 1 {
			t.Fatalf("outboxRows wrote %q: %v", rows, err)
		}
		g := got[0]
		deref := func(s *string) string {
			if s == nil {
				return ""
			}
			return *s
		}
		if g.Type != typ || g.CorrelationID != corr || deref(g.Exchange) != exchange || deref(g.RoutingKey) != routingKey || g.Headers[hk] != hv ||
			(traceParent != "" && (g.TraceParent != traceParent || g.TraceState != traceState)) {
			t.Fatalf("read back %+v from %q; want the message's own texts", g, rows)
		}
	})
}
