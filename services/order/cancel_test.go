package main

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

func (b *testBundle) cancel(t *testing.T, id, body, contentType string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, b.srv.URL+"/orders/"+id+"/cancel", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	return do(t, req)
}

func (b *testBundle) get(t *testing.T, id string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, b.srv.URL+"/orders/"+id, nil)
	if err != nil {
		t.Fatal(err)
	}
	return do(t, req)
}

func (b *testBundle) place(t *testing.T) Order {
	t.Helper()
	resp, body := b.post(t, validBody, "application/json", "")
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("place: %d %s", resp.StatusCode, body)
	}
	var o Order
	if err := json.Unmarshal(body, &o); err != nil {
		t.Fatal(err)
	}
	return o
}

func (b *testBundle) cancellations(t *testing.T) int64 {
	t.Helper()
	return testenv.Count(t, b.db, "SELECT count(*) FROM outbox_messages WHERE type = ?", events.OrderCancelledType)
}

// Cancelling writes the new status and one OrderCancelled event together; cancelling again
// answers the same order and writes nothing.
func TestCancelWritesTheStatusAndOneEvent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	placed := b.place(t)
	if placed.Status != StatusPlaced {
		t.Fatalf("a new order has status %q", placed.Status)
	}
	var first Order
	for i, body := range []string{`{"reason": "changed my mind"}`, `{"reason": "again"}`} {
		resp, raw := b.cancel(t, placed.ID.String(), body, "application/json")
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("cancel %d: %d %s", i+1, resp.StatusCode, raw)
		}
		var o Order
		if err := json.Unmarshal(raw, &o); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = o
		}
		if o.Status != StatusCancelled || o.CancelReason != "changed my mind" || o.CancelledAt == nil || !o.CancelledAt.Equal(*first.CancelledAt) {
			t.Fatalf("cancel %d answered %+v", i+1, o)
		}
	}
	if n := b.cancellations(t); n != 1 {
		t.Fatalf("%d OrderCancelled events, want 1", n)
	}
	// Each line is written before its response; the second cancel changed nothing to log.
	if lines := b.logs.Lines(`msg="order cancelled"`, "order_id="+placed.ID.String()); len(lines) != 1 {
		t.Fatalf("%d lines \"order cancelled\" for one order cancelled once and asked again, want 1; logs:\n%s", len(lines), b.logs)
	}
	ev, err := events.OrderCancelledEvent.Decode(outboxRowOf(t, b.db, events.OrderCancelledType).message())
	if err != nil {
		t.Fatal(err)
	}
	if ev.OrderID != placed.ID || ev.CustomerID != placed.CustomerID || ev.Reason != "changed my mind" || !ev.CancelledAt.Equal(*first.CancelledAt) {
		t.Fatalf("event %+v does not describe the cancellation", ev)
	}
	resp, raw := b.get(t, placed.ID.String())
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(raw), `"status":"cancelled"`) {
		t.Fatalf("GET after the cancel: %d %s", resp.StatusCode, raw)
	}
}

// A cancel without a body, or with an empty JSON object, has no reason.
func TestCancelWithoutABody(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, c := range []struct{ body, contentType string }{{"", ""}, {"", "application/json"}, {"{}", "application/json"}} {
		o := b.place(t)
		if resp, raw := b.cancel(t, o.ID.String(), c.body, c.contentType); resp.StatusCode != http.StatusOK {
			t.Fatalf("cancel with body %q, content type %q: %d %s", c.body, c.contentType, resp.StatusCode, raw)
		}
	}
	if n := b.cancellations(t); n != 3 {
		t.Fatalf("%d OrderCancelled events, want 3", n)
	}
}

// Each bad cancel gets its status as problem+json and writes nothing.
func TestBadCancelsGetProblemsAndWriteNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	o := b.place(t)
	id := o.ID.String()
	cases := []struct {
		name, id, body, contentType string
		status                      int
	}{
		{"unknown order", uuid.NewString(), "", "", http.StatusNotFound},
		{"id not a UUID", "42", "", "", http.StatusBadRequest},
		{"text body", id, "please", "text/plain", http.StatusUnsupportedMediaType},
		{"body without a content type", id, `{"reason": "x"}`, "", http.StatusUnsupportedMediaType},
		{"a charset other than UTF-8", id, `{"reason": "x"}`, "application/json; charset=utf-16", http.StatusUnsupportedMediaType},
		{"malformed JSON", id, `{"reason": `, "application/json", http.StatusBadRequest},
		{"unknown field", id, `{"why": "x"}`, "application/json", http.StatusBadRequest},
		{"trailing data", id, `{} {}`, "application/json", http.StatusBadRequest},
		{"field name in another case", id, `{"Reason": "x"}`, "application/json", http.StatusBadRequest},
		{"field twice", id, `{"reason": "x", "reason": "y"}`, "application/json", http.StatusBadRequest},
		{"invalid UTF-8", id, "{\"reason\": \"a\xffb\"}", "application/json", http.StatusBadRequest},
		{"reason not a string", id, `{"reason": 42}`, "application/json", http.StatusUnprocessableEntity},
		{"control character", id, `{"reason": "a\u0007b"}`, "application/json", http.StatusUnprocessableEntity},
		{"reason too long", id, `{"reason": "` + strings.Repeat("x", MaxReasonLength+1) + `"}`, "application/json", http.StatusUnprocessableEntity},
		{"2 MiB body", id, `{"reason": "` + strings.Repeat("x", 2<<20) + `"}`, "application/json", http.StatusRequestEntityTooLarge},
	}
	for _, c := range cases {
		resp, raw := b.cancel(t, c.id, c.body, c.contentType)
		if resp.StatusCode != c.status || resp.Header.Get("Content-Type") != "application/problem+json" {
			t.Errorf("%s: %d %s %s, want %d problem+json", c.name, resp.StatusCode, resp.Header.Get("Content-Type"), raw, c.status)
		}
	}
	if n := b.cancellations(t); n != 0 {
		t.Fatalf("%d OrderCancelled events after bad cancels, want 0", n)
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM orders WHERE status <> 'placed'"); n != 0 {
		t.Fatal("a bad cancel changed an order")
	}
}

// Ten cancels of one order at once write one event: the order's row lock decides.
func TestConcurrentCancelsWriteOneEvent(t *testing.T) {
	t.Parallel()
	cancelConcurrently(t, setup(t))
}

// The row lock decides under READ COMMITTED, where a cancel that waited for another's commit
// then reads the order it cancelled: the store's transactions ask for it, so a database whose
// default is REPEATABLE READ answers the waiting cancels with the order, not serialization
// failures.
func TestConcurrentCancelsWriteOneEventWhateverTheDatabasesDefaultIsolation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.repeatableReadByDefault(t)
	cancelConcurrently(t, b)
}

// cancelConcurrently cancels one order ten times at once: each must be answered 200, and one
// OrderCancelled written.
func cancelConcurrently(t *testing.T, b *testBundle) {
	t.Helper()
	o := b.place(t)
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() {
			if resp, raw := b.cancel(t, o.ID.String(), "", ""); resp.StatusCode != http.StatusOK {
				t.Errorf("cancel: %d %s", resp.StatusCode, raw)
			}
		})
	}
	wg.Wait()
	if n := b.cancellations(t); n != 1 {
		t.Fatalf("%d OrderCancelled events from 10 concurrent cancels, want 1", n)
	}
}

// holdOutboxInserts makes every later insert into the test database's outbox_messages wait,
// inside its transaction, until the returned release is called (it is also called at cleanup).
func (b *testBundle) holdOutboxInserts(t *testing.T) (release func()) {
	t.Helper()
	return testenv.HoldAt(t, b.db, "BEFORE INSERT ON outbox_messages")
}

// lockWaits lists the statements of the test database that wait for a lock other than the
// gate's advisory lock.
func (b *testBundle) lockWaits(t *testing.T) []string {
	t.Helper()
	var queries []string
	if err := b.db.Raw(`SELECT query FROM pg_stat_activity
WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event <> 'advisory'`).Scan(&queries).Error; err != nil {
		t.Fatal(err)
	}
	return queries
}

// Two cancels of one order at once: the first is held inside its transaction after it read
// and updated the order (at its outbox insert), and the second, started then, must wait for
// it at its locking read, not read "placed" and go on to cancel the order a second time.
func TestSecondCancelWaitsForTheFirstAtItsLockingRead(t *testing.T) {
	t.Parallel()
	b := setup(t)
	o := b.place(t)
	release := b.holdOutboxInserts(t)
	type result struct {
		changed bool
		err     error
	}
	cancel := func(reason string) <-chan result {
		done := make(chan result, 1)
		go func() {
			_, changed, err := b.store.Cancel(context.Background(), o.ID, CancelOrder{Reason: reason})
			done <- result{changed, err}
		}()
		return done
	}
	first := cancel("first")
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, b.db, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'advisory'") == 1
	}, "the first cancel did not reach its outbox insert")
	second := cancel("second")
	var waits []string
	testenv.Eventually(t, 10*time.Second, func() bool { waits = b.lockWaits(t); return len(waits) > 0 },
		"the second cancel did not wait for the first")
	if len(waits) != 1 || !strings.Contains(waits[0], "FOR UPDATE") {
		t.Errorf("the second cancel waits at %q, want its locking read (SELECT ... FOR UPDATE): it read the order without locking its row", waits)
	}
	release()
	r1, r2 := <-first, <-second
	if r1.err != nil || r2.err != nil {
		t.Fatalf("cancels returned %v and %v", r1.err, r2.err)
	}
	if !r1.changed || r2.changed {
		t.Errorf("changed: first %v, second %v; want true, false", r1.changed, r2.changed)
	}
	if n := b.cancellations(t); n != 1 {
		t.Fatalf("%d OrderCancelled events from two overlapping cancels, want 1", n)
	}
}

// The customer id becomes the customer's mailbox, personal data: the lines about an order name
// the order, never its customer.
func TestTheLogNamesNoCustomer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const customer = "cust-5f1d-only-here"
	resp, raw := b.post(t, strings.Replace(validBody, "c-42", customer, 1), "application/json", "")
	var o Order
	if resp.StatusCode != http.StatusCreated || json.Unmarshal(raw, &o) != nil || o.CustomerID != customer {
		t.Fatalf("place: %d %s", resp.StatusCode, raw)
	}
	if resp, raw := b.cancel(t, o.ID.String(), `{"reason": "changed my mind"}`, "application/json"); resp.StatusCode != http.StatusOK {
		t.Fatalf("cancel: %d %s", resp.StatusCode, raw)
	}
	// Each line is written before its response.
	for _, msg := range []string{`msg="order placed"`, `msg="order cancelled"`} {
		if lines := b.logs.Lines(msg, "order_id="+o.ID.String()); len(lines) != 1 {
			t.Errorf("%d lines %s about the order, want 1; logs:\n%s", len(lines), msg, b.logs)
		}
	}
	if lines := b.logs.Lines(`msg="order placed"`, "total_cents=2599"); len(lines) != 1 {
		t.Errorf("the line about the placed order gives no total; logs:\n%s", b.logs)
	}
	if strings.Contains(b.logs.String(), customer) {
		t.Errorf("the log names the customer:\n%s", b.logs)
	}
}

// A cancellation changes its own order and no other: the orders placed around it stay placed,
// and each can still be cancelled, with its own event.
func TestCancelChangesOnlyItsOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	before, cancelled, after := b.place(t), b.place(t), b.place(t)
	if resp, raw := b.cancel(t, cancelled.ID.String(), `{"reason": "changed my mind"}`, "application/json"); resp.StatusCode != http.StatusOK {
		t.Fatalf("cancel: %d %s", resp.StatusCode, raw)
	}
	for _, o := range []Order{before, after} {
		resp, raw := b.get(t, o.ID.String())
		var got Order
		if resp.StatusCode != http.StatusOK || json.Unmarshal(raw, &got) != nil || got.Status != StatusPlaced || got.CancelledAt != nil || got.CancelReason != "" {
			t.Errorf("order %s, never cancelled: %d %s, want it placed", o.ID, resp.StatusCode, raw)
		}
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM orders WHERE status = 'cancelled'"); n != 1 {
		t.Fatalf("%d orders cancelled by one cancellation, want 1", n)
	}
	if resp, raw := b.cancel(t, after.ID.String(), "", ""); resp.StatusCode != http.StatusOK || !strings.Contains(string(raw), `"status":"cancelled"`) {
		t.Fatalf("cancel of another order: %d %s", resp.StatusCode, raw)
	}
	if n := b.cancellations(t); n != 2 {
		t.Fatalf("%d OrderCancelled events from cancelling two orders, want 2", n)
	}
}
