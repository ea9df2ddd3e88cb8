package platform

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/google/uuid"
	"github.com/pressly/goose/v3/lock"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// startingAddr is the address the server of ctx's start answers on, once Start put it in the
// slot ("" until then).
func startingAddr(ctx context.Context) string {
	slot := startingSlotOf(ctx)
	slot.mu.Lock()
	defer slot.mu.Unlock()
	if slot.srv == nil {
		return ""
	}
	return slot.srv.ln.Addr().String()
}

// startingInSlot is a starting server on a port of its own, in the slot of the context it
// returns, as Start leaves it for Serve; cancel ends that context.
func startingInSlot(t *testing.T, log *slog.Logger) (_ context.Context, cancel context.CancelFunc, _ *startingServer) {
	t.Helper()
	ctx, cancel := context.WithCancel(withStarting(context.Background()))
	t.Cleanup(cancel)
	s, err := serveWhileStarting(log, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	startingSlotOf(ctx).put(s)
	return ctx, cancel, s
}

// holdRequests posts n orders to s and returns, once s holds them all, where their answers
// come (nil for one that failed, which fails t).
func holdRequests(t *testing.T, s *startingServer, n int) <-chan *http.Response {
	t.Helper()
	answers := make(chan *http.Response, n)
	for range n {
		go func() {
			resp, err := http.Post("http://"+s.ln.Addr().String()+"/orders", "application/json", strings.NewReader("{}"))
			if err != nil {
				t.Errorf("a request made while starting: %v", err)
			}
			answers <- resp
		}()
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return s.held.Load() == int32(n) }, "the requests made while starting are not held")
	return answers
}

// spreadRetryAfter reports whether resp's Retry-After is one of the 1 to 3 s SetRetryAfter draws.
func spreadRetryAfter(resp *http.Response) bool {
	retry, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	return err == nil && retry >= 1 && retry <= 3
}

// notStarting fails t unless the service at url answers what a service does while it starts:
// live, not ready.
func notStarting(t *testing.T, url string) {
	t.Helper()
	resp, err := http.Get(url + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !resp.Close {
		t.Fatalf("/healthz while starting = %d, Connection: close %v; want 200 (the process runs), and no connection kept idle for the hand-over to lose",
			resp.StatusCode, resp.Close)
	}
	notReadyProblem(t, get(t, url+"/readyz"), startingReason)
}

// A replica whose migrations wait for another's (here a session holding the migration lock)
// is live and not ready all along: an orchestrator's liveness probe must not kill it
// mid-migration, and no request reaches it. Once migrated, Serve serves on the same listener.
func TestStartAnswersTheProbesWhileTheMigrationsWait(t *testing.T) {
	const conns = MinRequestConns + ReadinessConns
	testenv.Connections(t, 2+conns) // the database's creation, the test's handle (the lock's session), the service
	d := testenv.NewDatabaseWithPool(t, 1)
	release := holdMigrationLock(t, d)

	log, logs := testenv.NewLogger(t)
	ctx, cancel := context.WithCancel(withStarting(context.Background()))
	defer cancel()
	migrations := Migrations(fstest.MapFS{"m/00001_t.sql": {Data: []byte("-- +goose Up\nCREATE TABLE t (id int);\n")}}, "m", "t_schema")
	started := make(chan *Base, 1)
	go func() {
		b, err := Start(ctx, log, "svc", Common{DatabaseURL: d.URL, DBMaxConns: conns, HTTPAddr: "127.0.0.1:0"}, Pools{}, migrations)
		if err != nil {
			t.Errorf("Start: %v", err)
		}
		started <- b
	}()
	testenv.Eventually(t, 10*time.Second, func() bool { return startingAddr(ctx) != "" }, "Start does not answer the probes")
	url := "http://" + startingAddr(ctx)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(logs.Lines("migration waits for another replica's migrations")) == 1
	}, "the migrations do not wait for the lock")
	notStarting(t, url)
	if len(logs.Lines(`msg="not ready"`)) != 0 {
		t.Errorf("the start logged a not ready that nothing would pair with a ready again:\n%s", logs)
	}

	release()
	var b *Base
	select {
	case b = <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("Start did not return within 10 s of the lock's release")
	}
	if b == nil {
		t.FailNow()
	}
	defer b.Close()
	served := make(chan error, 1)
	go func() {
		served <- Serve(ctx, log, NewServer("127.0.0.1:0", NewRouter(log, b.Registry, b.DatabaseReady)), Workers{})
	}()
	testenv.Eventually(t, 10*time.Second, func() bool {
		r, err := fetch(url + "/readyz")
		return err == nil && r.status == http.StatusOK
	}, "the service is not ready at the start's address once started")
	cancel()
	if err := within(t, served, 10*time.Second, "Serve did not return"); err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

// Serve takes over the listener the start answered on: a client that keeps asking across the
// handover is always answered, never refused, first by the start's server, then by Serve's.
func TestServeTakesOverTheStartsListener(t *testing.T) {
	t.Parallel()
	log, logs := testenv.NewLogger(t)
	ctx, cancel, s := startingInSlot(t, log)
	url := "http://" + s.ln.Addr().String()
	notStarting(t, url)
	// A client that took the live process for a started one: its request waits for the start.
	early := holdRequests(t, s, 1)

	var (
		stop      atomic.Bool
		wg        sync.WaitGroup
		mu        sync.Mutex
		failures  []error
		sawServed atomic.Bool
	)
	for range 4 {
		wg.Go(func() {
			client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}
			for !stop.Load() {
				resp, err := client.Get(url + "/healthz")
				if err != nil {
					mu.Lock()
					failures = append(failures, err)
					mu.Unlock()
					continue
				}
				_ = resp.Body.Close()
				if resp.Header.Get("X-Served") != "" {
					sawServed.Store(true)
				}
			}
		})
	}
	served := make(chan error, 1)
	go func() {
		h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Header().Set("X-Served", "1") })
		served <- Serve(ctx, log, NewServer("127.0.0.1:0", h), Workers{})
	}()
	testenv.Eventually(t, 10*time.Second, sawServed.Load, "Serve's server never answered at the start's address")
	if resp := <-early; resp != nil {
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Served") == "" {
			t.Errorf("the request made while starting was answered %d, X-Served %q: want the service's answer", resp.StatusCode, resp.Header.Get("X-Served"))
		}
	}
	stop.Store(true)
	wg.Wait()
	if len(failures) > 0 {
		t.Errorf("%d requests failed across the handover, the first: %v", len(failures), failures[0])
	}
	if lines := logs.Lines("listening", "addr="+s.ln.Addr().String()); len(lines) != 1 {
		t.Errorf("Serve did not say it listens on the start's address:\n%s", logs)
	}
	cancel()
	if err := within(t, served, 10*time.Second, "Serve did not return"); err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

// A replica is live, not ready, while it waits for the database too, and a start that fails
// (here stopped while waiting) frees the port it answered on: Base.Close closes the listener.
func TestAFailedStartFreesItsListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "postgres://postgres@" + ln.Addr().String() + "/none?sslmode=disable"
	_ = ln.Close()
	log, _ := testenv.NewLogger(t)
	ctx, cancel := context.WithTimeout(withStarting(context.Background()), 3*time.Second)
	defer cancel()
	failed := make(chan error, 1)
	go func() {
		_, err := Start(ctx, log, "svc", Common{DatabaseURL: closed, DBMaxConns: 10, HTTPAddr: "127.0.0.1:0"}, Pools{})
		failed <- err
	}()
	testenv.Eventually(t, 2*time.Second, func() bool { return startingAddr(ctx) != "" }, "Start does not answer the probes")
	addr := startingAddr(ctx)
	notStarting(t, "http://"+addr)
	if err := within(t, failed, 10*time.Second, "Start did not return"); err == nil || !strings.Contains(err.Error(), "waiting for the database") {
		t.Fatalf("Start stopped while waiting for the database: %v, want its error", err)
	}
	again, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("the failed start left its port taken: %v", err)
	}
	_ = again.Close()
}

// A request the start holds longer than startingHold, a scrape too, is answered 503, with a
// Retry-After, and changes nothing: the service has not started.
func TestARequestTheStartHoldsTooLongIsAnsweredUnavailable(t *testing.T) {
	was := startingHold
	startingHold = 100 * time.Millisecond
	t.Cleanup(func() { startingHold = was })
	log, _ := testenv.NewLogger(t)
	s, err := serveWhileStarting(log, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	for _, ask := range []struct{ method, path string }{{http.MethodPost, "/orders"}, {http.MethodGet, "/metrics"}} {
		path := ask.path
		asked := time.Now()
		req, err := http.NewRequest(ask.method, "http://"+s.ln.Addr().String()+path, strings.NewReader("{}"))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if took := time.Since(asked); resp.StatusCode != http.StatusServiceUnavailable || !spreadRetryAfter(resp) ||
			resp.Header.Get("Content-Type") != "application/problem+json" || took < startingHold {
			t.Fatalf("%s held past the hold = %d after %v, Retry-After %q, Content-Type %q; want 503 after the hold, 1 to 3, problem+json",
				path, resp.StatusCode, took, resp.Header.Get("Retry-After"), resp.Header.Get("Content-Type"))
		}
	}
}

// The hand-over waits for nobody: a request held during the start and still being answered by
// the service does not keep Serve's server from accepting (a probe meanwhile is answered), and
// the service's shutdown waits for it.
func TestTheHandOverDoesNotWaitForTheRequestsItHeld(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	ctx, cancel, s := startingInSlot(t, log)
	url := "http://" + s.ln.Addr().String()
	release := make(chan struct{})
	slow := holdRequests(t, s, 1)
	h := http.NewServeMux()
	h.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { w.Header().Set("X-Served", "1") })
	h.HandleFunc("POST /orders", func(w http.ResponseWriter, _ *http.Request) {
		<-release
		w.Header().Set("X-Served", "1")
	})
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, log, NewServer("127.0.0.1:0", h), Workers{}) }()
	client := &http.Client{Timeout: time.Second}
	testenv.Eventually(t, 5*time.Second, func() bool {
		resp, err := client.Get(url + "/healthz")
		if err != nil {
			return false
		}
		_ = resp.Body.Close()
		return resp.Header.Get("X-Served") != ""
	}, "Serve's server did not answer while a request held during the start was still answered")
	cancel()
	select {
	case err := <-served:
		t.Fatalf("Serve returned (%v) while a request held during the start was still answered", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	if resp := <-slow; resp != nil {
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Served") == "" {
			t.Errorf("the held request was answered %d, X-Served %q; want the service's answer", resp.StatusCode, resp.Header.Get("X-Served"))
		}
	}
	if err := within(t, served, 10*time.Second, "Serve did not return"); err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

// A start that fails, or is stopped, answers the requests it held 503, not a closed connection,
// all at once: with Retry-Afters spread over 1 to 3 s, so that their clients do not all come back
// in the same second.
func TestAStoppedStartAnswersTheRequestsItHeld(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	s, err := serveWhileStarting(log, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// Twenty draws of three values all alike: one chance in 3^19.
	const held = 20
	answers := holdRequests(t, s, held)
	s.close()
	retries := map[string]bool{}
	for range held {
		resp := <-answers
		if resp == nil {
			continue
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || !spreadRetryAfter(resp) {
			t.Errorf("a held request of a start that stopped = %d, Retry-After %q; want 503, 1 to 3", resp.StatusCode, resp.Header.Get("Retry-After"))
		}
		retries[resp.Header.Get("Retry-After")] = true
	}
	if len(retries) < 2 {
		t.Errorf("the %d held requests were all told Retry-After %v; want them spread", held, retries)
	}
}

// A request the start holds whose client goes away (here it half-closes its connection after
// a cancel without a body, as nc -N does) is answered by none: net/http would otherwise send the
// client, which can still read, a 200 for a cancel that never ran.
func TestAHeldRequestWhoseClientLeftIsNotAnswered(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	s, err := serveWhileStarting(log, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	got, err := readHalfClosed(t, s.ln.Addr().String(), "POST /orders/"+uuid.NewString()+"/cancel HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
	if err != nil || len(got) != 0 {
		t.Fatalf("the half-closed client read %q (%v), want the connection closed without an answer", got, err)
	}
}

// A connection the start's server accepted and that never sends a request holds the shutdown
// newConnWait, as one of Serve's server's does, not the ReadHeaderTimeout it has until then:
// the relay's last pass, which comes after, must fit in HardStop.
func TestASilentConnectionOfTheStartHoldsTheShutdownNoLongerThanServesOwn(t *testing.T) {
	t.Parallel()
	log, logs := testenv.NewLogger(t)
	ctx, cancel, s := startingInSlot(t, log)
	silent := dialed(t, s.ln.Addr().String())
	testenv.Eventually(t, 5*time.Second, func() bool {
		s.conns.mu.Lock()
		defer s.conns.mu.Unlock()
		return len(s.conns.state) == 1
	}, "the start's server did not accept the connection")
	// And one the serving server accepted: the two waits run side by side, not in turn.
	srv := NewServer("127.0.0.1:0", http.NotFoundHandler())
	accepted := make(chan struct{}, 1)
	srv.ConnState = func(_ net.Conn, state http.ConnState) {
		if state == http.StateNew {
			accepted <- struct{}{}
		}
	}
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, log, srv, Workers{}) }()
	testenv.Eventually(t, 5*time.Second, func() bool { return len(logs.Lines("msg=listening")) == 1 }, "Serve did not take the listener over")
	silentToo := dialed(t, s.ln.Addr().String())
	select {
	case <-accepted:
	case <-time.After(5 * time.Second):
		t.Fatal("the serving server did not accept the second connection")
	}
	cancel()
	signalled := time.Now()
	if err := within(t, served, 10*time.Second, "Serve did not return"); err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if took := time.Since(signalled); took < newConnWait || took > newConnWait+500*time.Millisecond {
		t.Fatalf("Serve returned %v after the stop with a silent connection of each server's; want newConnWait (%v) and little more", took, newConnWait)
	}
	for _, c := range []net.Conn{silent, silentToo} {
		_ = c.SetReadDeadline(time.Now().Add(time.Second))
		if n, err := c.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
			t.Fatalf("a silent connection read %d bytes (%v), want it closed", n, err)
		}
	}
}

// A connection the start's server accepted whose client has begun its request, and is still
// sending its header when the drain closes the silent ones, is left to finish it and is
// answered by the service, as one of Serve's server's is (TestARequestBegunBeforeTheSignalIsAnswered).
func TestARequestBegunWhileStartingIsAnsweredAfterTheSignal(t *testing.T) {
	t.Parallel()
	log, logs := testenv.NewLogger(t)
	ctx, cancel, s := startingInSlot(t, log)
	begun := dialed(t, s.ln.Addr().String())
	if _, err := io.WriteString(begun, "POST /orders HTTP/1.1\r\nHost: a\r\n"); err != nil {
		t.Fatal(err)
	}
	// A connection that sends nothing: its close shows that the drain has closed the silent ones.
	silent := dialed(t, s.ln.Addr().String())
	testenv.Eventually(t, 5*time.Second, func() bool {
		s.conns.mu.Lock()
		defer s.conns.mu.Unlock()
		heardOnes := 0
		for c := range s.conns.state {
			if heardFrom(c) {
				heardOnes++
			}
		}
		return len(s.conns.state) == 2 && heardOnes == 1
	}, "the start's server did not accept both connections and read the request's beginning")
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusCreated)
	})
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, log, NewServer("127.0.0.1:0", h), Workers{}) }()
	testenv.Eventually(t, 5*time.Second, func() bool { return len(logs.Lines("msg=listening")) == 1 }, "Serve did not take the listener over")
	cancel()
	_ = silent.SetReadDeadline(time.Now().Add(newConnWait + 5*time.Second))
	if n, err := silent.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("the silent connection read %d bytes (%v), want it closed", n, err)
	}
	// The rest of the request comes only now.
	if _, err := io.WriteString(begun, "Content-Length: 2\r\n\r\n{}"); err != nil {
		t.Fatalf("the request begun while starting could not be finished: %v", err)
	}
	_ = begun.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(begun), nil)
	if err != nil {
		t.Fatalf("the request begun while starting got no answer: %v", err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("the request begun while starting got %d, want the service's 201", resp.StatusCode)
	}
	if err := within(t, served, 10*time.Second, "Serve did not return after the request was answered"); err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

// The messaging library's migrations take the same lock as a service's, silently: a start that
// waits on them (here a session holding the migration lock, as another replica's migrations
// do) says so within about a second, not only once they are done. One that does not wait
// says nothing.
func TestLibraryMigrationsSayTheStartWaitsForThem(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, 3) // the database's creation, the lock's session, the migrations'
	d := testenv.NewDatabaseWithPool(t, 2)
	release := holdMigrationLock(t, d)

	log, logs := testenv.NewLogger(t)
	const line = "the messaging library's migrations have not finished"
	migrated := make(chan error, 1)
	go func() { migrated <- Library(messaging.MigrateOutbox)(context.Background(), log, d.DB) }()
	testenv.Eventually(t, 3*time.Second, func() bool { return len(logs.Lines("level=WARN", line, "waited=")) == 1 },
		"no line says the start waits for the library's migrations")
	release()
	if err := within(t, migrated, 10*time.Second, "the library's migrations did not end within 10 s of the lock's release"); err != nil {
		t.Fatalf("the library's migrations: %v", err)
	}

	quiet, quietLogs := testenv.NewLogger(t)
	if err := Library(messaging.MigrateOutbox)(context.Background(), quiet, d.DB); err != nil {
		t.Fatal(err)
	}
	time.Sleep(libraryWaitLog + 500*time.Millisecond) // a line that must not come
	if len(quietLogs.Lines(line)) != 0 {
		t.Errorf("migrations that did not wait said they did:\n%s", quietLogs)
	}
}

// holdMigrationLock takes the migrations' advisory lock in a session of d's own, as another
// replica's migrations would, until release (or the test's end).
func holdMigrationLock(t *testing.T, d *testenv.Database) (release func()) {
	t.Helper()
	sqlDB, err := d.DB.DB()
	if err != nil {
		t.Fatal(err)
	}
	other, err := sqlDB.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	if _, err := other.ExecContext(context.Background(), "SELECT pg_advisory_lock($1)", lock.DefaultLockID); err != nil {
		t.Fatal(err)
	}
	return func() {
		t.Helper()
		if _, err := other.ExecContext(context.Background(), "SELECT pg_advisory_unlock($1)", lock.DefaultLockID); err != nil {
			t.Fatal(err)
		}
	}
}
