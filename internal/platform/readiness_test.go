package platform

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// startBase starts a service base named svc on d with DB_MAX_CONNS conns, shared out as pools
// says, closed when t
// ends. Tests that call it cannot run in parallel: Start installs the global tracer provider.
func startBase(t *testing.T, d *testenv.Database, conns int, pools Pools, migrations ...Migration) (*Base, *testenv.Logs) {
	t.Helper()
	log, logs := testenv.NewLogger(t)
	b, err := Start(context.Background(), log, "svc", Common{DatabaseURL: d.URL, DBMaxConns: conns}, pools, migrations...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b, logs
}

type response struct {
	status      int
	contentType string
	body        string
	took        time.Duration
}

func get(t *testing.T, url string) response {
	t.Helper()
	r, err := fetch(url)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// fetch is get for other goroutines than the test's.
func fetch(url string) (response, error) {
	start := time.Now()
	resp, err := http.Get(url)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, err
	}
	return response{resp.StatusCode, resp.Header.Get("Content-Type"), string(body), time.Since(start)}, nil
}

// notReadyProblem fails t unless r is /readyz's 503 problem saying reason, and nothing else:
// none of the driver's words, addresses or names.
func notReadyProblem(t *testing.T, r response, reason string, secrets ...string) {
	t.Helper()
	if r.status != http.StatusServiceUnavailable || r.contentType != "application/problem+json" ||
		!strings.Contains(r.body, `"detail":"`+reason+`"`) {
		t.Fatalf("/readyz = %d %s %s, want a 503 problem saying %q", r.status, r.contentType, r.body, reason)
	}
	for _, s := range append(secrets, "sql:", "pgx", "SQLSTATE", "FATAL", "connect", "dial", "127.0.0.1") {
		if strings.Contains(r.body, s) {
			t.Fatalf("/readyz = %s, which shows %q", r.body, s)
		}
	}
}

// Requests that hold every connection of the pool do not make the service unready: readiness
// pings over a connection of its own, within DB_MAX_CONNS.
func TestReadinessIgnoresASaturatedPool(t *testing.T) {
	const conns = 4
	testenv.Connections(t, 2+conns) // the database's creation, the test's handle, the service
	d := testenv.NewDatabaseWithPool(t, 1)
	b, _ := startBase(t, d, conns, Pools{})
	srv := httptest.NewServer(NewRouter(b.log, b.Registry, b.DatabaseReady))
	t.Cleanup(srv.Close)

	for range conns - ReadinessConns {
		tx := b.DB.Begin()
		if err := tx.Exec("SELECT 1").Error; err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tx.Rollback() })
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := b.DB.WithContext(ctx).Exec("SELECT 1").Error; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a query on the saturated pool: %v, want it to wait out its deadline", err)
	}

	for range 3 {
		if r := get(t, srv.URL+"/readyz"); r.status != http.StatusOK || r.took > time.Second {
			t.Fatalf("/readyz with the pool saturated = %d %s after %s, want 200 at once", r.status, r.body, r.took)
		}
	}
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND application_name LIKE 'svc%'", d.Name); n != conns {
		t.Fatalf("the service has %d connections, want DB_MAX_CONNS = %d: the pool's and the readiness check's", n, conns)
	}
}

// With its connection cut and the database refusing new ones, the service is unready: a 503
// problem with fixed words, the cause logged once however many probes come, and ready again
// once the database is back. It stays live all along: /healthz answers 200, so that the
// orchestrator does not restart a process the database's outage would not mend.
func TestReadinessAnswersAProblemWhileTheDatabaseIsDown(t *testing.T) {
	const conns = 4
	testenv.Connections(t, 3+conns) // the database's creation, the test's handle, an admin one, the service
	d := testenv.NewDatabaseWithPool(t, 1)
	b, logs := startBase(t, d, conns, Pools{})
	srv := httptest.NewServer(NewRouter(b.log, b.Registry, b.DatabaseReady))
	t.Cleanup(srv.Close)
	if r := get(t, srv.URL+"/readyz"); r.status != http.StatusOK {
		t.Fatalf("/readyz = %d %s, want 200", r.status, r.body)
	}

	admin := testenv.OpenPool(t, testenv.DatabaseURL(), 1)
	allowConnections := func(allow bool) {
		t.Helper()
		verb := map[bool]string{true: "true", false: "false"}[allow]
		if err := admin.Exec("ALTER DATABASE " + d.Name + " WITH ALLOW_CONNECTIONS " + verb).Error; err != nil {
			t.Fatal(err)
		}
	}
	allowConnections(false)
	t.Cleanup(func() { allowConnections(true) })
	var killed int64
	if err := admin.Raw("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = ? AND application_name = 'svc-readiness'", d.Name).
		Scan(&killed).Error; err != nil || killed != 1 {
		t.Fatalf("terminated %d readiness sessions (%v), want 1", killed, err)
	}

	for range 3 {
		r := get(t, srv.URL+"/readyz")
		notReadyProblem(t, r, "the database does not answer", d.Name, "accepting")
		if r.took > 3*time.Second {
			t.Fatalf("/readyz took %s", r.took)
		}
		if r := get(t, srv.URL+"/healthz"); r.status != http.StatusOK || r.took > time.Second {
			t.Fatalf("/healthz with the database down = %d %s after %s, want 200 at once", r.status, r.body, r.took)
		}
	}
	if lines := logs.Lines("not ready"); len(lines) != 1 || !strings.Contains(lines[0], "not currently accepting connections") {
		t.Fatalf("log lines about readiness %q, want one with the cause", lines)
	}

	allowConnections(true)
	testenv.Eventually(t, 10*time.Second, func() bool { return get(t, srv.URL+"/readyz").status == http.StatusOK }, "not ready again")
	get(t, srv.URL+"/readyz")
	if n, m := len(logs.Lines("not ready")), len(logs.Lines("ready again")); n != 1 || m != 1 {
		t.Fatalf("%d lines not ready and %d ready again, want one each", n, m)
	}
}

// A database address nobody listens on: unready, and the answer does not show the dial error.
func TestReadinessHidesARefusedConnection(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	db, err := OpenReadinessDB("svc", "postgres://postgres@"+addr+"/nothing")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	log, logs := testenv.NewLogger(t)
	srv := httptest.NewServer(NewRouter(log, prometheus.NewRegistry(), DatabaseReady(db)))
	t.Cleanup(srv.Close)

	notReadyProblem(t, get(t, srv.URL+"/readyz"), "the database does not answer", addr, "refused")
	if lines := logs.Lines("not ready", "refused"); len(lines) != 1 {
		t.Fatalf("log lines %q, want one with the cause", logs.Lines("ready"))
	}
}

// /readyz answers a reason, never an error's text, and logs each change of reason once;
// service_ready on /metrics answers the same.
func TestReadinessLogsEachChangeOnce(t *testing.T) {
	t.Parallel()
	var (
		mu     sync.Mutex
		answer error
	)
	log, logs := testenv.NewLogger(t)
	srv := httptest.NewServer(NewRouter(log, prometheus.NewRegistry(), func(context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		return answer
	}))
	t.Cleanup(srv.Close)

	for _, step := range []struct {
		answer error
		detail string // "" for 200
	}{
		{nil, ""},
		{&NotReadyError{Reason: "not consuming from RabbitMQ"}, "not consuming from RabbitMQ"},
		{&NotReadyError{Reason: "not consuming from RabbitMQ"}, "not consuming from RabbitMQ"},
		{errors.New("internal secret"), "not ready"},
		{nil, ""},
		{nil, ""},
	} {
		mu.Lock()
		answer = step.answer
		mu.Unlock()
		// /metrics says the same as /readyz, so that an alert can see a service up but not ready.
		want := "service_ready 0\n"
		if step.detail == "" {
			want = "service_ready 1\n"
		}
		if m := get(t, srv.URL+"/metrics"); !strings.Contains(m.body, want) {
			t.Fatalf("/metrics lacks %q while /readyz should answer %q", want, step.detail)
		}
		r := get(t, srv.URL+"/readyz")
		if step.detail == "" {
			if r.status != http.StatusOK {
				t.Fatalf("/readyz = %d %s, want 200", r.status, r.body)
			}
			continue
		}
		notReadyProblem(t, r, step.detail, "secret")
	}
	if n, m := len(logs.Lines("not ready")), len(logs.Lines("ready again")); n != 2 || m != 1 {
		t.Fatalf("%d lines not ready and %d ready again, want 2 (one per reason) and 1:\n%s", n, m, logs.String())
	}
	if len(logs.Lines("not ready", "internal secret")) != 1 {
		t.Fatalf("the cause is not logged:\n%s", logs.String())
	}
}

// A start that fails, or is stopped by a signal while it waits for the database, returns its
// error (a service then exits cleanly) and closes what it had opened: no panic, no connection
// left behind.
func TestStartThatFailsClosesWhatItOpened(t *testing.T) {
	log, _ := testenv.NewLogger(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "postgres://postgres@" + ln.Addr().String() + "/none?sslmode=disable"
	_ = ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if _, err := Start(ctx, log, "svc-stopped", Common{DatabaseURL: closed, DBMaxConns: 10}, Pools{}); err == nil || !strings.Contains(err.Error(), "waiting for the database") {
		t.Fatalf("Start stopped while waiting for the database: %v, want its error", err)
	}

	d := testenv.NewDatabase(t)
	failing := func(context.Context, *slog.Logger, *gorm.DB) error { return errors.New("migration refused") }
	pools := Pools{Work: 2, Background: 2}
	if _, err := Start(context.Background(), log, "svc-failed", Common{DatabaseURL: d.URL, DBMaxConns: 10}, pools, failing); err == nil || !strings.Contains(err.Error(), "migration refused") {
		t.Fatalf("Start with a failing migration: %v, want its error", err)
	}
	testenv.Eventually(t, 5*time.Second, func() bool {
		return testenv.Count(t, d.DB, "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'svc-failed%'") == 0
	}, "the failed start left connections open")
}

// A consumer service is not ready while its subscription does not consume, whatever the
// database says.
func TestConsumerIsNotReadyUntilItConsumes(t *testing.T) {
	t.Parallel()
	d := testenv.NewDatabase(t)
	sub, err := messaging.NewSubscription(d.Driver(t), messaging.SubscriptionConfig{Name: testenv.UniqueName("consumer"), URL: "amqp://unused"})
	if err != nil {
		t.Fatal(err)
	}
	b := &Base{DatabaseReady: func(context.Context) error { return nil }}
	var nr *NotReadyError
	if err := b.ConsumerReady(sub)(context.Background()); !errors.As(err, &nr) || nr.Reason != "not consuming from RabbitMQ" {
		t.Fatalf("readiness of a subscription that never ran = %v, want not consuming from RabbitMQ", err)
	}
}

// A consumer service whose subscription consumes is not ready while its database does not
// answer: its handlers could commit nothing, and a working broker connection must not make it
// look ready. Once the database answers, it is.
func TestAConsumingConsumerIsNotReadyWithoutItsDatabase(t *testing.T) {
	t.Parallel()
	d := testenv.NewDatabase(t)
	d.MigrateLibrary(t)
	queue, exchange := testenv.UniqueName("consumer"), testenv.UniqueName("orders")
	testenv.CleanupBroker(t, []string{queue, messaging.DeadLetterQueue(queue)}, []string{exchange})
	log, _ := testenv.NewLogger(t)
	sub, err := messaging.NewSubscription(d.Driver(t), messaging.SubscriptionConfig{Name: queue, URL: testenv.AMQPURL(), Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	if err := messaging.Handle(sub, messaging.Event[json.RawMessage]{Exchange: exchange, Type: "Placed"},
		func(context.Context, *gorm.DB, json.RawMessage, messaging.Message) error { return nil }); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- sub.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-ran; err != nil {
			t.Errorf("the subscription's run: %v", err)
		}
	})
	testenv.Eventually(t, 10*time.Second, sub.Ready, "the subscription does not consume")
	var answers atomic.Bool
	b := &Base{DatabaseReady: func(context.Context) error {
		if answers.Load() {
			return nil
		}
		return &NotReadyError{Reason: "the database does not answer", Err: errors.New("connection refused")}
	}}
	var nr *NotReadyError
	if err := b.ConsumerReady(sub)(ctx); !errors.As(err, &nr) || nr.Reason != "the database does not answer" {
		t.Fatalf("readiness of a consuming subscription without its database = %v, want the database does not answer", err)
	}
	answers.Store(true)
	if err := b.ConsumerReady(sub)(ctx); err != nil {
		t.Fatalf("readiness of a consuming subscription with its database = %v, want ready", err)
	}
}

// Unless HTTP_MAX_IN_FLIGHT says, admission control admits as many requests at once as their
// pool has connections: what DB_MAX_CONNS leaves them, not all of it.
func TestAdmissionAdmitsWhatTheRequestsPoolHolds(t *testing.T) {
	s := startDrainService(t, testenv.AMQPURL())
	if got := s.b.Admission.Places(); got != MinRequestConns {
		t.Fatalf("%d places, want %d: the requests' pool", got, MinRequestConns)
	}
}
