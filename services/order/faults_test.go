package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// Another session holds an exclusive lock on orders: requests fail within their deadline with
// a 503, leave nothing behind, and succeed again once the lock is gone.
func TestLockedDatabaseGives503WithinTheDeadline(t *testing.T) {
	t.Parallel()
	b := setup(t)
	locker := b.db.Begin()
	t.Cleanup(func() { locker.Rollback() })
	if err := locker.Exec("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE").Error; err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	resp, body := b.post(t, validBody, "application/json", "")
	took := time.Since(start)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("POST against a locked table = %d %s", resp.StatusCode, body)
	}
	if took > requestTimeout+2*time.Second {
		t.Fatalf("the 503 took %s; the deadline is %s", took, requestTimeout)
	}
	if err := locker.Rollback().Error; err != nil {
		t.Fatal(err)
	}
	if c := b.counts(t); c != [3]int64{0, 0, 0} {
		t.Fatalf("the failed request left rows: %v", c)
	}
	if resp, body := b.post(t, validBody, "application/json", ""); resp.StatusCode != http.StatusCreated {
		t.Fatalf("after the lock: %d %s", resp.StatusCode, body)
	}
}

// serveAndDial serves srv on a port of its own until the test ends, and returns a connection to
// it, closed then too.
func serveAndDial(t *testing.T, srv *http.Server) net.Conn {
	t.Helper()
	ln, err := net.Listen("tcp", srv.Addr)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// A client that trickles its headers is cut off by ReadHeaderTimeout instead of holding a
// connection (slowloris).
func TestSlowHeadersAreCutOff(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	srv := platform.NewServer("127.0.0.1:0", platform.NewRouter(log, prometheus.NewRegistry(), func(context.Context) error { return nil }))
	conn := serveAndDial(t, srv)
	start := time.Now()
	if _, err := conn.Write([]byte("GET /healthz HTTP/1.1\r\nHost: x\r\n")); err != nil {
		t.Fatal(err)
	}
	closed := make(chan time.Duration, 1)
	go func() {
		buf := make([]byte, 512)
		for {
			if _, err := conn.Read(buf); err != nil {
				closed <- time.Since(start)
				return
			}
		}
	}()
	// One header byte every 500 ms, never finishing the request.
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(3 * platform.ReadHeaderTimeout)
	for {
		select {
		case took := <-closed:
			// Within ReadHeaderTimeout, not the longer ReadTimeout that net/http would apply to
			// the headers without it.
			if took < platform.ReadHeaderTimeout-time.Second || took > platform.ReadHeaderTimeout+2*time.Second {
				t.Fatalf("connection closed after %s, want at the header timeout, %s", took, platform.ReadHeaderTimeout)
			}
			return
		case <-tick.C:
			_, _ = conn.Write([]byte("X"))
		case <-deadline:
			t.Fatalf("a client trickling headers still holds its connection after %s", 3*platform.ReadHeaderTimeout)
		}
	}
}

// A client that sends its headers and then trickles its body, or stops sending it, is cut off
// by the server's ReadTimeout instead of holding a connection (and, its body read ahead of
// admission, a share of the body budget): the request is answered 408 once it runs out. The
// test runs the server at a tenth of the ReadTimeout NewServer sets, to be quick; none set is
// none cut.
func TestSlowBodiesAreCutOff(t *testing.T) {
	t.Parallel()
	h := withoutDatabase(t, 4)
	srv := platform.NewServer("127.0.0.1:0", h)
	srv.ReadTimeout /= 10
	conn := serveAndDial(t, srv)
	start := time.Now()
	// Headers complete, 10 of the 100 bytes declared, then nothing.
	if _, err := conn.Write([]byte("POST /orders HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"customer")); err != nil {
		t.Fatal(err)
	}
	const wait = 3 * time.Second
	if err := conn.SetReadDeadline(start.Add(wait)); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	took := time.Since(start)
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		t.Fatalf("a client that stopped sending its body still holds its connection after %s, with ReadTimeout %s", wait, srv.ReadTimeout)
	case err != nil:
		t.Fatalf("after %s, no response: %v; want a 408", took, err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout {
		t.Errorf("the stalled body was answered %d, want 408", resp.StatusCode)
	}
	if took < srv.ReadTimeout-250*time.Millisecond || took > srv.ReadTimeout+time.Second {
		t.Errorf("the stalled body was cut off after %s, want at the ReadTimeout, %s", took, srv.ReadTimeout)
	}
}

// The API is behind admission control, as main serves it: with every place taken, by a request
// held at a locked table, the next is shed at once with a 503 and Retry-After, not queued
// behind the lock until its database deadline.
func TestTheAPIIsBehindAdmission(t *testing.T) {
	t.Parallel()
	b := setup(t)
	o := b.place(t)
	srv := httptest.NewServer(b.asServed(t, 1)) // HTTP_MAX_IN_FLIGHT=1

	locker := b.db.Begin()
	t.Cleanup(func() { locker.Rollback() })
	if err := locker.Exec("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE").Error; err != nil {
		t.Fatal(err)
	}
	held := make(chan int, 1)
	go func() {
		resp, err := http.Get(srv.URL + "/orders/" + o.ID.String())
		if err != nil {
			held <- 0
			return
		}
		resp.Body.Close()
		held <- resp.StatusCode
	}()
	testenv.Eventually(t, 10*time.Second, func() bool { return len(b.lockWaits(t)) > 0 }, "the first request did not reach the locked table")

	start := time.Now()
	resp, raw := do(t, mustRequest(t, http.MethodGet, srv.URL+"/orders/"+o.ID.String()))
	took := time.Since(start)
	var p platform.Problem
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" || json.Unmarshal(raw, &p) != nil ||
		!strings.Contains(p.Detail, "capacity") || took > requestTimeout/2 {
		t.Errorf("a request with the one place taken: %d, Retry-After %q, %s after %s; want shed at once: a 503 at capacity with Retry-After",
			resp.StatusCode, resp.Header.Get("Retry-After"), raw, took)
	}
	if err := locker.Rollback().Error; err != nil {
		t.Fatal(err)
	}
	if status := <-held; status != http.StatusOK {
		t.Fatalf("the request that held the place: %d, want 200 once the lock is gone", status)
	}
}

// asServed is the service's handler on b's database, built as main builds it: the order API
// behind admission control of inFlight places (HTTP_MAX_IN_FLIGHT), no latency target.
func (b *testBundle) asServed(t *testing.T, inFlight int) http.Handler {
	t.Helper()
	return servedOn(t, inFlight, &platform.Base{DB: b.db, DatabaseReady: platform.DatabaseReady(b.readiness)}, b.store)
}

// chunked is a body of size bytes, sent without a Content-Length: head, then filler up to
// tail, generated as it is read.
func chunked(head string, filler byte, tail string, size int64) io.Reader {
	fill := size - int64(len(head)+len(tail))
	return io.MultiReader(strings.NewReader(head), io.LimitReader(repeated(filler), fill), strings.NewReader(tail))
}

// repeated reads as b, endlessly.
type repeated byte

func (r repeated) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = byte(r)
	}
	return len(p), nil
}

// countingReader counts the bytes read from r.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// A body over MaxBodyBytes sent without a Content-Length (chunked), which admission cannot
// refuse up front, is a 413 problem for a placement and a cancellation alike, through the
// whole stack as main serves it, and writes nothing. Admission reads a body up to its limit
// and leaves the rest to the handler: the handler's own limit is what stops it, and the body
// is not read much past the limit, however long it is (a body read whole was a 422 for its
// field's length, after the server had taken in every byte of it).
func TestChunkedBodiesOverTheLimitAre413(t *testing.T) {
	t.Parallel()
	b := setup(t)
	o := b.place(t)
	h := b.asServed(t, 4)
	ts := httptest.NewUnstartedServer(h)
	ts.Config = platform.NewServer("", h)
	ts.Start()
	t.Cleanup(ts.Close)
	before := b.counts(t)

	type request struct{ name, path, head, tail string }
	requests := []request{
		{"a placement", "/orders", `{"customer_id": "`, `", "lines": [{"sku": "s", "quantity": 1, "unit_price_cents": 1}]}`},
		{"a cancellation", "/orders/" + o.ID.String() + "/cancel", `{"reason": "`, `"}`},
	}
	for _, c := range requests {
		req, err := http.NewRequest(http.MethodPost, ts.URL+c.path, chunked(c.head, 'x', c.tail, 2<<20))
		if err != nil {
			t.Fatal(err)
		}
		req.ContentLength = -1 // unknown: sent chunked
		req.Header.Set("Content-Type", "application/json")
		resp, raw := do(t, req)
		var p platform.Problem
		if resp.StatusCode != http.StatusRequestEntityTooLarge || resp.Header.Get("Content-Type") != "application/problem+json" ||
			json.Unmarshal(raw, &p) != nil || p.Status != http.StatusRequestEntityTooLarge || !strings.Contains(p.Detail, "exceeds") {
			t.Errorf("%s of 2 MiB, chunked: %d %s %s; want a 413 problem", c.name, resp.StatusCode, resp.Header.Get("Content-Type"), raw)
		}
	}
	// In process, where what the handler reads is what it is given: a body of 64 MiB is read
	// to the limit, not whole.
	for _, c := range requests {
		body := &countingReader{r: chunked(c.head, 'x', c.tail, 64<<20)}
		req := httptest.NewRequest(http.MethodPost, c.path, body)
		req.ContentLength = -1
		req.Header.Set("Content-Type", "application/json")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusRequestEntityTooLarge || body.n > MaxBodyBytes+64<<10 {
			t.Errorf("%s of 64 MiB, chunked: %d %s after %d bytes read; want a 413 after at most %d", c.name, rec.Code, rec.Body, body.n, MaxBodyBytes+64<<10)
		}
	}

	if c := b.counts(t); c != before {
		t.Errorf("orders, lines, outbox = %v after bodies over the limit, want %v as before", c, before)
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM orders WHERE status <> 'placed'"); n != 0 {
		t.Error("a cancellation over the limit cancelled the order")
	}
}

// refuseCommits makes every later transaction that inserts an outbox row fail at its commit,
// after all its statements ran: whatever it wrote is rolled back with it, and only what was
// written in another transaction stays.
func (b *testBundle) refuseCommits(t *testing.T) {
	t.Helper()
	for _, stmt := range []string{
		`CREATE FUNCTION refuse_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'commit refused by the test'; END $$`,
		`CREATE CONSTRAINT TRIGGER refuse_commit AFTER INSERT ON outbox_messages DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_commit()`,
	} {
		if err := b.db.Exec(stmt).Error; err != nil {
			t.Fatal(err)
		}
	}
}

// A transaction that fails at its commit, once the order, its lines and its event are all
// written, leaves none of them: they are one transaction, not an order committed alone or an
// event committed on its own. Likewise for a cancellation and its OrderCancelled.
func TestFailedCommitLeavesNeitherOrderNorEvent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	placed := b.place(t)
	b.refuseCommits(t)

	resp, body := b.post(t, validBody, "application/json", "key-refused")
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("POST whose commit fails = %d %s, want a 503 problem", resp.StatusCode, body)
	}
	if c := b.counts(t); c != [3]int64{1, 2, 1} {
		t.Fatalf("orders, lines, outbox = %v after a placement whose commit failed, want only the first order's [1 2 1]", c)
	}

	resp, body = b.cancel(t, placed.ID.String(), `{"reason": "changed my mind"}`, "application/json")
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("cancel whose commit fails = %d %s, want a 503 problem", resp.StatusCode, body)
	}
	if n := b.cancellations(t); n != 0 {
		t.Fatalf("%d OrderCancelled events after a cancellation whose commit failed, want 0", n)
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM orders WHERE status <> 'placed'"); n != 0 {
		t.Fatal("a cancellation whose commit failed changed the order")
	}
}
