package platform

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// PPROF_ADDR is unset unless given, and without it the profiler serves nothing: its worker
// returns at once, listening on nothing.
func TestTheProfilerServesNothingWithoutPPROF_ADDR(t *testing.T) {
	t.Parallel()
	env := EnvFrom(map[string]string{"DATABASE_URL": "postgres://db/x", "AMQP_URL": "amqp://mq/"})
	if c := ReadCommon(env, ":8080"); c.PprofAddr != "" || env.Err() != nil {
		t.Fatalf("PPROF_ADDR unset: %q, %v; want the profiler off", c.PprofAddr, env.Err())
	}
	log, logs := testenv.NewLogger(t)
	done := make(chan error, 1)
	go func() { done <- Profiler(log, "")(context.Background()) }()
	if err := within(t, done, time.Second, "the profiler's worker without PPROF_ADDR did not return"); err != nil {
		t.Fatal(err)
	}
	if lines := logs.Lines("profiler listening"); len(lines) != 0 {
		t.Fatalf("lines %q, want none: nothing listens", lines)
	}
}

var profilerAddr = regexp.MustCompile(`msg="profiler listening" addr=(\S+)`)

// With PPROF_ADDR, the profiler is served there, on a listener of its own, until the worker's
// context ends; never on HTTP_ADDR's router, whose API the public reaches.
func TestTheProfilerIsServedOnlyAtPPROF_ADDR(t *testing.T) {
	t.Parallel()
	log, logs := testenv.NewLogger(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Profiler(log, "127.0.0.1:0")(ctx) }()
	var addr string
	testenv.Eventually(t, 5*time.Second, func() bool {
		m := profilerAddr.FindStringSubmatch(logs.String())
		if m != nil {
			addr = m[1]
		}
		return m != nil
	}, "the profiler did not say where it listens")
	if r := get(t, "http://"+addr+"/debug/pprof/"); r.status != http.StatusOK || !strings.Contains(r.body, "goroutine") {
		t.Fatalf("GET /debug/pprof/ at PPROF_ADDR = %d, want the profiles' index", r.status)
	}

	srv := httptest.NewServer(NewRouter(log, prometheus.NewRegistry(), func(context.Context) error { return nil }))
	t.Cleanup(srv.Close)
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/cmdline", "/debug/pprof/goroutine"} {
		if r := get(t, srv.URL+path); r.status != http.StatusNotFound {
			t.Errorf("GET %s on HTTP_ADDR's router = %d, want 404: the profiler is not the API's", path, r.status)
		}
	}

	cancel()
	if err := within(t, done, 5*time.Second, "the profiler did not stop with its context"); err != nil {
		t.Fatalf("the profiler stopped with %v, want nil", err)
	}
}

// net/http's own lines about the profiler's server (here an accept error, as when the process
// runs out of file descriptors) are the service's, at WARN, as its servers' are, not the log
// package's on stderr.
func TestTheProfilersServerLinesAreTheServices(t *testing.T) {
	t.Parallel()
	log, logs := testenv.NewLogger(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serveProfiler(ctx, log, &failingOnce{Listener: ln}) }()
	t.Cleanup(func() {
		cancel()
		if err := within(t, done, 5*time.Second, "the profiler did not stop with its context"); err != nil {
			t.Error(err)
		}
	})
	testenv.Eventually(t, 5*time.Second, func() bool {
		return len(logs.Lines("level=WARN", "http: Accept error: too many open files")) == 1
	}, "net/http's line did not reach the service's log:\n%s", logs)
}

// failingOnce is a listener whose first Accept fails with a temporary error, which net/http
// logs, then retries.
type failingOnce struct {
	net.Listener
	failed atomic.Bool
}

func (l *failingOnce) Accept() (net.Conn, error) {
	if !l.failed.Swap(true) {
		return nil, tooManyFiles{}
	}
	return l.Listener.Accept()
}

// tooManyFiles is the temporary error of an Accept out of file descriptors.
type tooManyFiles struct{}

func (tooManyFiles) Error() string   { return "too many open files" }
func (tooManyFiles) Timeout() bool   { return false }
func (tooManyFiles) Temporary() bool { return true }

// A PPROF_ADDR the profiler cannot listen on fails its worker, and with it the service, with an
// error that names the variable.
func TestAProfilerThatCannotListenNamesPPROF_ADDR(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = taken.Close() })
	done := make(chan error, 1)
	go func() { done <- Profiler(log, taken.Addr().String())(context.Background()) }()
	if err := within(t, done, 5*time.Second, "the profiler's worker did not fail"); err == nil || !strings.HasPrefix(err.Error(), "PPROF_ADDR: ") {
		t.Fatalf("the profiler on an address taken: %v, want an error naming PPROF_ADDR", err)
	}
}
