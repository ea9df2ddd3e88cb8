package messaging

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/testhook"
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
		if got, _ := jsonbRefusal([]byte(tc.json)); (got != "") != tc.refuse {
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
		if _, err := outboxRows(context.Background(), []Message{m}, time.Now(), enqueueBatchBytes); err != nil {
			f.Fatalf("outboxRows refused a valid message: %v", err)
		}
	}
	f.Fuzz(func(t *testing.T, typ, corr, traceParent, traceState, exchange, routingKey, hk, hv string) {
		m := Message{ID: uuid.Must(uuid.NewV7()), Type: typ, Payload: []byte(`{}`), CorrelationID: corr,
			TraceParent: traceParent, TraceState: traceState, Exchange: exchange, RoutingKey: routingKey,
			Headers: map[string]string{hk: hv}}
		batches, err := outboxRows(context.Background(), []Message{m}, time.Now(), enqueueBatchBytes)
		if err != nil {
			return // refused: nothing to read back
		}
		if len(batches) != 1 {
			t.Fatalf("outboxRows wrote one message in %d batches", len(batches))
		}
		rows := batches[0].rows
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

// Rows past the bound go in several batches, in order, each a JSON array within the bound
// unless it holds a single message larger, and none split sooner than it must: one jsonb value
// holds at most 256 MiB, and a value the server refuses aborts the caller's transaction. Under
// the bound, one batch.
func TestOutboxRowsSplitsPastTheBound(t *testing.T) {
	msgs := make([]Message, 40)
	for i := range msgs {
		msgs[i] = Message{ID: uuid.Must(uuid.NewV7()), Type: "T", Payload: []byte(`"` + strings.Repeat("x", i*10) + `"`)}
	}
	msgs[25].Payload = []byte(`"` + strings.Repeat("y", 2000) + `"`) // alone past the bound

	all, err := outboxRows(context.Background(), msgs, time.Now(), enqueueBatchBytes)
	if err != nil || len(all) != 1 || all[0].first != 0 || all[0].n != len(msgs) {
		t.Fatalf("outboxRows under the bound = %d batches, %v; want one of every message", len(all), err)
	}

	const bound = 1000
	batches, err := outboxRows(context.Background(), msgs, time.Now(), bound)
	if err != nil {
		t.Fatal(err)
	}
	if len(batches) < 3 {
		t.Fatalf("%d batches of %d bytes of rows over a bound of %d, want several", len(batches), len(all[0].rows), bound)
	}
	next := 0
	for k, b := range batches {
		var rows []json.RawMessage // each row's text as written
		if err := json.Unmarshal([]byte(b.rows), &rows); err != nil {
			t.Fatalf("batch of messages %d to %d is not a JSON array: %v", b.first, b.first+b.n-1, err)
		}
		if b.first != next || len(rows) != b.n || b.n == 0 {
			t.Fatalf("a batch of %d rows says it holds messages %d to %d, want from message %d on", len(rows), b.first, b.first+b.n-1, next)
		}
		for i, r := range rows {
			var row struct {
				ID uuid.UUID `json:"id"`
			}
			if err := json.Unmarshal(r, &row); err != nil || row.ID != msgs[next+i].ID {
				t.Fatalf("row %d of the batch from message %d is message %s (%v), want %s", i, b.first, row.ID, err, msgs[next+i].ID)
			}
		}
		if len(b.rows) > bound && b.n > 1 {
			t.Errorf("a batch of %d messages takes %d bytes, past the bound of %d", b.n, len(b.rows), bound)
		}
		if b.first <= 25 && 25 < b.first+b.n && b.n != 1 {
			t.Errorf("the message larger than the bound shares its batch with %d others", b.n-1)
		}
		if k+1 < len(batches) {
			// The next batch's first row, after a comma, would have taken this one past the bound.
			var following []json.RawMessage
			if err := json.Unmarshal([]byte(batches[k+1].rows), &following); err != nil || len(following) == 0 {
				t.Fatalf("the batch after message %d: %v", next+b.n-1, err)
			}
			if len(b.rows)+1+len(following[0]) <= bound {
				t.Errorf("the batch of messages %d to %d (%d bytes) ends before message %d (%d bytes), which fits under the bound of %d",
					b.first, b.first+b.n-1, len(b.rows), next+b.n, len(following[0]), bound)
			}
		}
		next += b.n
	}
	if next != len(msgs) {
		t.Fatalf("the batches hold %d messages, want %d", next, len(msgs))
	}
}

// An Enqueue of several inserts writes all of its messages or none: an insert that fails after
// others succeeded (here one whose context ended before it reached the server, which leaves the
// transaction usable) takes them back, lest a caller that commits all the same commit some of
// the messages only. One insert needs no savepoint: it is all or nothing already.
func TestAnEnqueueOfSeveralInsertsIsAllOrNothing(t *testing.T) {
	t.Parallel()
	msgs := make([]Message, 30)
	for i := range msgs {
		msgs[i] = Message{ID: uuid.Must(uuid.NewV7()), Type: "T", Payload: []byte(`"` + strings.Repeat("x", 100) + `"`)}
	}
	const bound = 1000
	batches, err := outboxRows(context.Background(), msgs, time.Now(), bound)
	if err != nil || len(batches) < 3 {
		t.Fatalf("%d messages of 100 bytes in %d batches of at most %d bytes (%v), want several", len(msgs), len(batches), bound, err)
	}
	small := testhook.WithEnqueueBatchBytes(context.Background(), bound)
	for _, c := range []struct {
		name      string
		ctx       context.Context
		failAt    int // the insert that fails, from 1; 0 for none
		wantRows  int
		wantSaves bool // whether the enqueue sets a savepoint
	}{
		{"one insert", context.Background(), 0, len(msgs), false},
		{"one insert that fails", context.Background(), 1, 0, false},
		{"several inserts", small, 0, len(msgs), true},
		{"several inserts, the second failing", small, 2, 0, true},
		{"several inserts, the last failing", small, len(batches), 0, true},
	} {
		tx := &savepointTx{failAt: c.failAt}
		err := Enqueue(c.ctx, savepointDriver{}, tx, msgs...)
		if c.failAt == 0 && err != nil {
			t.Errorf("%s: %v", c.name, err)
		}
		if c.failAt > 0 && !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s: %v, want the insert's error", c.name, err)
		}
		if c.failAt == 0 && c.wantSaves && tx.inserts != len(batches) {
			t.Errorf("%s: %d inserts, want %d", c.name, tx.inserts, len(batches))
		}
		if tx.rows != c.wantRows {
			t.Errorf("%s: %d of %d messages left written, want %d", c.name, tx.rows, len(msgs), c.wantRows)
		}
		if tx.savepoints != c.wantSaves || len(tx.open) != 0 {
			t.Errorf("%s: savepoints set %v, %d left open; want set %v, none left", c.name, tx.savepoints, len(tx.open), c.wantSaves)
		}
	}
}

// An insert whose failure ended the transaction (pgx closes the connection of a statement whose
// context ends mid-flight; database/sql rolls back a transaction begun with that context) leaves
// no savepoint to undo: the error is the insert's still, and says the transaction is unusable,
// not that the messages were undone; nothing more is tried on it.
func TestAnEnqueueWhoseFailureEndedTheTransactionSaysItIsUnusable(t *testing.T) {
	t.Parallel()
	msgs := make([]Message, 30)
	for i := range msgs {
		msgs[i] = Message{ID: uuid.Must(uuid.NewV7()), Type: "T", Payload: []byte(`"` + strings.Repeat("x", 100) + `"`)}
	}
	tx := &savepointTx{failAt: 2, dead: true}
	err := Enqueue(testhook.WithEnqueueBatchBytes(context.Background(), 1000), savepointDriver{}, tx, msgs...)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "the transaction is unusable, roll it back") {
		t.Fatalf("Enqueue = %v, want the insert's error, saying the transaction is unusable", err)
	}
	if tx.released != 0 || tx.inserts != 2 {
		t.Fatalf("%d inserts and %d savepoints released after the failed rollback, want 2 and none", tx.inserts, tx.released)
	}
}

// A release of the savepoint that fails once every insert is in (its context ended before it was
// sent: the transaction goes on) undoes them: an error with the messages written would commit
// them for a caller that logs it and commits.
func TestAnEnqueueWhoseReleaseFailedWritesNothing(t *testing.T) {
	t.Parallel()
	msgs := make([]Message, 30)
	for i := range msgs {
		msgs[i] = Message{ID: uuid.Must(uuid.NewV7()), Type: "T", Payload: []byte(`"` + strings.Repeat("x", 100) + `"`)}
	}
	tx := &savepointTx{releaseFails: true}
	err := Enqueue(testhook.WithEnqueueBatchBytes(context.Background(), 1000), savepointDriver{}, tx, msgs...)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Enqueue = %v, want the release's error", err)
	}
	if tx.rows != 0 || len(tx.open) != 0 {
		t.Fatalf("%d of %d messages left written, %d savepoints open; want none", tx.rows, len(msgs), len(tx.open))
	}
}

// savepointDriver hands out the savepointTx it is given.
type savepointDriver struct{ Driver[*savepointTx] }

func (savepointDriver) Executor(tx *savepointTx) (Executor, error) { return tx, nil }

// savepointTx is a transaction that counts the rows its inserts write and keeps its
// savepoints. Its failAt-th insert fails as one whose context ended before it reached the
// server does: it writes nothing, and the transaction stays usable.
type savepointTx struct {
	Executor
	failAt, inserts, rows int
	savepoints            bool
	open                  []int // the rows at each savepoint still open
	dead                  bool  // its failed insert ended it: nothing runs after, the rollback included
	released              int   // the savepoints released
	releaseFails          bool  // its first release fails as one whose context ended before it was sent
}

func (tx *savepointTx) Exec(_ context.Context, query string, args ...any) (int64, error) {
	switch {
	case strings.HasPrefix(query, "SAVEPOINT "):
		tx.savepoints = true
		tx.open = append(tx.open, tx.rows)
	case tx.dead && tx.inserts >= tx.failAt:
		return 0, errors.New("conn closed")
	case strings.HasPrefix(query, "ROLLBACK TO SAVEPOINT "):
		tx.rows = tx.open[len(tx.open)-1]
	case strings.HasPrefix(query, "RELEASE SAVEPOINT ") && tx.releaseFails:
		tx.releaseFails = false
		return 0, context.Canceled
	case strings.HasPrefix(query, "RELEASE SAVEPOINT "):
		tx.open = tx.open[:len(tx.open)-1]
		tx.released++
	case query == statements.InsertOutbox:
		tx.inserts++
		if tx.inserts == tx.failAt {
			return 0, context.DeadlineExceeded
		}
		var rows []json.RawMessage
		if err := json.Unmarshal([]byte(args[0].(string)), &rows); err != nil {
			return 0, err
		}
		tx.rows += len(rows)
		return int64(len(rows)), nil
	default:
		return 0, errors.New("savepointTx: unexpected statement " + query)
	}
	return 0, nil
}
