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
			if took < platform.ReadHeaderTimeout-time.Second {
				t.Fatalf("connection closed after %s, before the header timeout", took)
			}
			return
		case <-tick.C:
			_, _ = conn.Write([]byte("X"))
		case <-deadline:
			t.Fatalf("a client trickling headers still holds its connection after %s", 3*platform.ReadHeaderTimeout)
		}
	}
}
