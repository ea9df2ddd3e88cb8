package main

import (
	"context"
	"net"
	"net/http"
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

// A client that trickles its headers is cut off by ReadHeaderTimeout instead of holding a
// connection (slowloris).
func TestSlowHeadersAreCutOff(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	srv := platform.NewServer("127.0.0.1:0", platform.NewRouter(log, prometheus.NewRegistry(), func(context.Context) error { return nil }))
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
	defer conn.Close()
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
