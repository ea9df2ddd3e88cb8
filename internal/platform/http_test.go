package platform

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// A 405 says in Allow which methods the resource has (RFC 9110, section 15.5.6), in
// subrouters too, though chi does not hand a MethodNotAllowed handler of one's own the list.
func TestMethodNotAllowedSaysWhichAre(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	r := NewRouter(log, prometheus.NewRegistry(), func(context.Context) error { return nil })
	ok := func(http.ResponseWriter, *http.Request) {}
	r.Post("/orders", ok)
	r.Get("/orders/{id}", ok)
	r.Post("/orders/{id}/cancel", ok)
	r.Route("/things", func(s chi.Router) {
		s.Get("/{id}", ok)
		s.Put("/{id}", ok)
		s.Delete("/{id}", ok)
	})
	for _, c := range []struct{ method, path, allow string }{
		{http.MethodGet, "/orders", "POST"},
		{http.MethodDelete, "/orders/42", "GET, HEAD"},
		{http.MethodHead, "/orders/42/cancel", "POST"},
		{http.MethodGet, "/orders/42/cancel", "POST"},
		{http.MethodPost, "/healthz", "GET, HEAD"},
		{http.MethodPut, "/readyz", "GET, HEAD"},
		{http.MethodPost, "/things/7", "GET, HEAD, PUT, DELETE"},
	} {
		rec := httptest.NewRecorder()
		r.ServeHTTP(rec, httptest.NewRequest(c.method, c.path, nil))
		if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Content-Type") != "application/problem+json" || rec.Header().Get("Allow") != c.allow {
			t.Errorf("%s %s = %d %s, Allow %q; want a 405 problem with Allow %q", c.method, c.path, rec.Code, rec.Header().Get("Content-Type"), rec.Header().Get("Allow"), c.allow)
		}
	}
}

// A request whose client went away before it was answered, and to which nothing was written
// (admission's wait, a database call its going cut short), is counted as 499, not as the 200
// net/http would have sent nobody.
func TestARequestWhoseClientWentAwayIsCountedAs499(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	reg := prometheus.NewRegistry()
	r := NewRouter(log, reg, func(context.Context) error { return nil })
	r.Get("/slow", func(http.ResponseWriter, *http.Request) { AbandonResponse() })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if p := serveRecovering(r, httptest.NewRecorder(), httptest.NewRequestWithContext(ctx, http.MethodGet, "/slow", nil)); !isAbort(p) {
		t.Fatalf("panic %v reached net/http, want http.ErrAbortHandler, which aborts the response", p)
	}
	want := `
# HELP http_requests_total HTTP requests by route, method and status code.
# TYPE http_requests_total counter
http_requests_total{code="499",method="GET",route="/slow"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "http_requests_total"); err != nil {
		t.Fatal(err)
	}
}

// A client that half-closes its connection after its request ends the request's context, yet
// still reads: an abandoned response must reach it as a closed connection, never as the 200
// net/http sends for a handler that wrote nothing (a failed order read as placed).
func TestAnAbandonedResponseReachesAHalfClosedClientAsNoAnswer(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	r := NewRouter(log, prometheus.NewRegistry(), func(context.Context) error { return nil })
	r.Get("/wait", func(_ http.ResponseWriter, req *http.Request) {
		<-req.Context().Done()
		AbandonResponse()
	})
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	if got, err := readHalfClosed(t, srv.Listener.Addr().String(), "GET /wait HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil || len(got) != 0 {
		t.Fatalf("the half-closed client read %q (%v), want the connection closed without an answer", got, err)
	}
}

// readHalfClosed sends request to addr, closes its side for writing, as a client done sending
// does, and reads what comes back until the server closes the connection.
func readHalfClosed(t *testing.T, addr, request string) ([]byte, error) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte(request)); err != nil {
		t.Fatal(err)
	}
	if err := conn.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	return io.ReadAll(conn)
}

// A database failure is a 503 with a Retry-After, logged as the operation's failure; the same
// failure of a request whose client went away is no answer at all, logged as abandoned.
func TestUnavailableAnswersOrAbandons(t *testing.T) {
	t.Parallel()
	log, logs := testenv.NewLogger(t)
	var failures FailureLog
	failed := errors.New("database stalled")
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		failures.Unavailable(w, r, log, "list", "the database is unavailable", failed)
	})
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	if rec.Code != http.StatusServiceUnavailable || rec.Header().Get("Retry-After") == "" || len(logs.Lines("level=ERROR", `msg="list failed"`)) != 1 {
		t.Fatalf("with its client there: %d, Retry-After %q, logs:\n%s; want a 503 with a Retry-After, logged as failed", rec.Code, rec.Header().Get("Retry-After"), logs)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	rec = httptest.NewRecorder()
	if p := serveRecovering(h, rec, httptest.NewRequestWithContext(ctx, http.MethodGet, "/", nil)); !isAbort(p) || rec.Body.Len() != 0 ||
		len(logs.Lines("level=WARN", `msg="list abandoned: its client went away"`)) != 1 {
		t.Fatalf("with its client gone: panic %v, %d bytes written, logs:\n%s; want the response abandoned, logged at WARN", p, rec.Body.Len(), logs)
	}
}

// serveRecovering serves req with h, and returns what h panicked with, as net/http would
// recover it (nil if nothing).
func serveRecovering(h http.Handler, w http.ResponseWriter, req *http.Request) (p any) {
	defer func() { p = recover() }()
	h.ServeHTTP(w, req)
	return nil
}

// isAbort reports whether p, a recovered panic, is the one that aborts a response.
func isAbort(p any) bool {
	err, ok := p.(error)
	return ok && errors.Is(err, http.ErrAbortHandler)
}

// HEAD is answered as GET is, without the body (RFC 9110, section 9.3.2): an uptime checker
// that probes with it finds the service up.
func TestHeadIsAnsweredAsGet(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	r := NewRouter(log, prometheus.NewRegistry(), func(context.Context) error { return nil })
	r.Get("/orders/{id}", func(w http.ResponseWriter, _ *http.Request) {
		WriteJSON(w, http.StatusOK, map[string]string{"id": "42"})
	})
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	for _, path := range []string{"/healthz", "/readyz", "/orders/42"} {
		resp, err := http.Head(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/json" || len(body) != 0 {
			t.Errorf("HEAD %s = %d %q with %d bytes, want 200 application/json without a body", path, resp.StatusCode, resp.Header.Get("Content-Type"), len(body))
		}
	}
}

// Every request is counted in http_requests_total and timed, with the status net/http sent:
// one whose handler panicked after its response started (aborted, the panic passed on to
// net/http) as well, and one whose handler wrote nothing as the 200 net/http answers, never
// as a code "0".
func TestEveryRequestIsCountedWithTheStatusSent(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	reg := prometheus.NewRegistry()
	r := NewRouter(log, reg, func(context.Context) error { return nil })
	r.Get("/started", func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusOK)
		panic("after the response started")
	})
	r.Get("/silent", func(http.ResponseWriter, *http.Request) {})
	for _, path := range []string{"/started", "/silent"} {
		func() {
			defer func() { _ = recover() }() // net/http's to take
			r.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, path, nil))
		}()
	}
	want := `
# HELP http_requests_total HTTP requests by route, method and status code.
# TYPE http_requests_total counter
http_requests_total{code="200",method="GET",route="/silent"} 1
http_requests_total{code="200",method="GET",route="/started"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "http_requests_total"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(reg, "http_request_duration_seconds"); n != 2 {
		t.Errorf("http_request_duration_seconds has %d series, want one per route, 2", n)
	}
}

// order_id is a UUID in its canonical text only, in either case: x<id>y, {<id>}, urn:uuid:<id>
// and the bare 32 digits, which uuid.Parse takes, are a 400 that lists nothing.
func TestListByOrderTakesOnlyCanonicalUUIDs(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	var listed []uuid.UUID
	h := ListByOrder(log, func(_ context.Context, orderID *uuid.UUID, _ int) ([]string, error) {
		listed = append(listed, *orderID)
		return []string{}, nil
	})
	id := uuid.New()
	for _, other := range []string{"x" + id.String() + "y", "{" + id.String() + "}", "urn:uuid:" + id.String(), strings.ReplaceAll(id.String(), "-", "")} {
		rec := httptest.NewRecorder()
		h(rec, httptest.NewRequest(http.MethodGet, "/things?order_id="+url.QueryEscape(other), nil))
		if rec.Code != http.StatusBadRequest || rec.Header().Get("Content-Type") != "application/problem+json" || !strings.Contains(rec.Body.String(), "order_id") {
			t.Errorf("order_id=%s: %d %s, want a 400 problem that names order_id", other, rec.Code, rec.Body)
		}
	}
	if len(listed) != 0 {
		t.Fatalf("ids not in canonical form listed the items of %v", listed)
	}
	for _, canonical := range []string{id.String(), strings.ToUpper(id.String())} {
		rec := httptest.NewRecorder()
		h(rec, httptest.NewRequest(http.MethodGet, "/things?order_id="+canonical, nil))
		if rec.Code != http.StatusOK {
			t.Errorf("order_id=%s: %d %s, want 200", canonical, rec.Code, rec.Body)
		}
	}
	if len(listed) != 2 || listed[0] != id || listed[1] != id {
		t.Fatalf("canonical ids listed the items of %v, want %s twice", listed, id)
	}
}

// A parameter other than order_id and limit, such as a misspelt filter, is a 400 that names it
// and lists nothing: ignored, it would list the most recent items of every order.
func TestListByOrderRefusesUnknownParameters(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	calls := 0
	h := ListByOrder(log, func(context.Context, *uuid.UUID, int) ([]string, error) {
		calls++
		return []string{}, nil
	})
	id := uuid.NewString()
	for query, unknown := range map[string]string{
		"orderId=" + id:                  "orderId",
		"Order_ID=" + id:                 "Order_ID",
		"order=" + id:                    "order",
		"order_id=" + id + "&limt=5":     "limt",
		"order_id%20=" + id:              "order_id ",
		"=" + id:                         "",
		"limit=5&zz=1&aa=2":              "aa",
		"order_id=" + id + "&order_id2=": "order_id2",
	} {
		rec := httptest.NewRecorder()
		h(rec, httptest.NewRequest(http.MethodGet, "/things?"+query, nil))
		var p Problem
		if rec.Code != http.StatusBadRequest || rec.Header().Get("Content-Type") != "application/problem+json" {
			t.Errorf("?%s: %d %s, want a 400 problem", query, rec.Code, rec.Body)
		} else if err := json.Unmarshal(rec.Body.Bytes(), &p); err != nil || !strings.Contains(p.Detail, strconv.Quote(unknown)) {
			t.Errorf("?%s: %s (%v), want a problem that names %q", query, rec.Body, err, unknown)
		}
	}
	if calls != 0 {
		t.Fatalf("unknown parameters listed items %d times, want none", calls)
	}
	rec := httptest.NewRecorder()
	h(rec, httptest.NewRequest(http.MethodGet, "/things?order_id="+id+"&limit=5", nil))
	if rec.Code != http.StatusOK || calls != 1 {
		t.Fatalf("order_id and limit: %d %s after %d calls, want 200 and one call", rec.Code, rec.Body, calls)
	}
}

// At most maxScrapesInFlight scrapes of /metrics are at work at once, each of which pings the
// database: one more is answered 503 at once. A scrape stuck past scrapeTimeout is answered
// 503 then, and keeps its place until its gather ends; once the scrapes end, /metrics serves
// again.
func TestScrapesPastTheCapAreRefusedAtOnce(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	var holding atomic.Bool
	holding.Store(true)
	// Room for a scrape past the cap, should one be let in, so that it cannot hold srv.Close.
	entered, release := make(chan struct{}, 2*maxScrapesInFlight), make(chan struct{})
	srv := httptest.NewServer(NewRouter(log, prometheus.NewRegistry(), func(context.Context) error {
		if holding.Load() {
			entered <- struct{}{}
			<-release
		}
		return nil
	}))
	t.Cleanup(srv.Close)
	releaseAll := sync.OnceFunc(func() { holding.Store(false); close(release) })
	t.Cleanup(releaseAll) // before srv.Close, which waits for the scrapes
	client := &http.Client{Timeout: scrapeTimeout + 3*time.Second}
	scrape := func() (int, string, time.Duration) {
		start := time.Now()
		resp, err := client.Get(srv.URL + "/metrics")
		if err != nil {
			return 0, err.Error(), time.Since(start)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body), time.Since(start)
	}

	held := make(chan time.Duration, maxScrapesInFlight)
	for range maxScrapesInFlight {
		go func() {
			status, body, took := scrape()
			if status != http.StatusServiceUnavailable || !strings.Contains(body, "timeout") {
				t.Errorf("a scrape stuck in its gather: %d %q after %s, want a 503 at the timeout", status, body, took)
			}
			held <- took
		}()
	}
	for range maxScrapesInFlight {
		within(t, entered, 5*time.Second, "the scrapes did not all reach the readiness check")
	}
	if status, body, took := scrape(); status != http.StatusServiceUnavailable || took > time.Second {
		t.Fatalf("a scrape past the %d at work: %d %q after %s, want a 503 at once", maxScrapesInFlight, status, body, took)
	}
	for range maxScrapesInFlight {
		if took := within(t, held, scrapeTimeout+5*time.Second, "a stuck scrape was not answered"); took < scrapeTimeout || took > scrapeTimeout+2*time.Second {
			t.Errorf("a stuck scrape was answered after %s, want %s", took, scrapeTimeout)
		}
	}
	if status, _, took := scrape(); status != http.StatusServiceUnavailable || took > time.Second {
		t.Fatalf("a scrape while the timed-out gathers still run: %d after %s, want a 503 at once", status, took)
	}
	releaseAll()
	testenv.Eventually(t, 5*time.Second, func() bool { status, _, _ := scrape(); return status == http.StatusOK },
		"/metrics did not serve again once the gathers ended")
}
