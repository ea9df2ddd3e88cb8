package platform

import (
	"context"
	"errors"
	"fmt"
	stdlog "log"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// startingReason is what /readyz answers while the service starts: the log says what it waits
// for (the database, another replica's migrations, the broker).
const startingReason = "starting: not serving yet"

// startingKey holds, in the context Main gives run, the startingSlot Start and Serve share.
type startingKey struct{}

// startingSlot passes the server Start answers the probes with to Serve, which takes its
// listener over, or to Base.Close, if Serve never ran: whichever takes it first owns it.
type startingSlot struct {
	mu  sync.Mutex
	srv *startingServer
}

// withStarting is ctx with an empty startingSlot: a Start given it answers the probes on
// HTTP_ADDR from its beginning (see startingServer).
func withStarting(ctx context.Context) context.Context {
	return context.WithValue(ctx, startingKey{}, &startingSlot{})
}

// startingSlotOf is ctx's startingSlot, nil without one.
func startingSlotOf(ctx context.Context) *startingSlot {
	slot, _ := ctx.Value(startingKey{}).(*startingSlot)
	return slot
}

// put fills the slot with srv.
func (s *startingSlot) put(srv *startingServer) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.srv = srv
}

// take empties the slot, returning what it held (nil for a nil slot).
func (s *startingSlot) take() *startingServer {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	srv := s.srv
	s.srv = nil
	return srv
}

// startingServer answers on the service's HTTP port while Start waits for the database and
// runs the migrations, which take as long as another replica's take: /healthz 200, for the
// process runs, /readyz 503. So an orchestrator neither kills a replica that is migrating (its
// liveness holds) nor sends it requests (it is not ready). Any other request, a scrape of
// /metrics too, waits up to startingHold for the service to start, then is served by it, or
// answered 503 with a Retry-After (a long start is down to Prometheus, as before it listened):
// a client that took a live process for a started one (it polled /healthz, not /readyz) is
// served as it was when nothing listened before the start. Serve then serves on the same listener: no second bind,
// no connection refused between the two.
type startingServer struct {
	addr   string
	ln     *net.TCPListener
	accept *handoffListener
	srv    *http.Server
	served chan struct{}
	conns  *liveConns
	// started is closed once handler, the service's own, serves the requests held meanwhile;
	// stopping once the start failed or was stopped, and they are answered 503.
	started  chan struct{}
	stopping chan struct{}
	handler  http.Handler
	held     atomic.Int32 // requests waiting for the start, for tests
}

// startingHold is how long a request other than the probes waits for the start: well inside
// the server's write timeout, and long enough for a start on an empty database.
var startingHold = 5 * time.Second

// startingUnavailable answers 503 at once: the service is not started.
func startingUnavailable() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		WriteProblem(w, http.StatusServiceUnavailable, startingReason)
	})
}

// hold serves r by the service's handler once it has started, if it does within startingHold;
// otherwise it answers 503, with a spread Retry-After (held requests are answered together when
// a start fails), or, if r's client went away, nothing (AbandonResponse).
func (s *startingServer) hold(w http.ResponseWriter, r *http.Request) {
	s.held.Add(1)
	defer s.held.Add(-1)
	wait := time.NewTimer(startingHold)
	defer wait.Stop()
	select {
	case <-s.started:
		s.handler.ServeHTTP(w, r)
	case <-wait.C:
		SetRetryAfter(w)
		startingUnavailable().ServeHTTP(w, r)
	case <-s.stopping:
		SetRetryAfter(w)
		startingUnavailable().ServeHTTP(w, r)
	case <-r.Context().Done():
		AbandonResponse()
	}
}

// serveWhileStarting listens on addr and answers the probes there until Serve takes the
// listener over (handOff) or the start fails (close).
func serveWhileStarting(log *slog.Logger, addr string) (*startingServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("HTTP_ADDR: listen on %s: %w", addr, err)
	}
	tcp, ok := ln.(*net.TCPListener)
	if !ok {
		_ = ln.Close()
		return nil, fmt.Errorf("HTTP_ADDR: listen on %s: not a TCP listener", addr)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", healthz)
	// Not logged: the start is no change of state, and the service's readiness, which begins
	// ready, would never log its end.
	mux.Handle("GET /readyz", &readiness{log: slog.New(slog.DiscardHandler), ready: func(context.Context) error {
		return &NotReadyError{Reason: startingReason}
	}})
	s := &startingServer{addr: addr, ln: tcp, accept: &handoffListener{TCPListener: tcp}, srv: NewServer(addr, mux),
		served: make(chan struct{}), started: make(chan struct{}), stopping: make(chan struct{})}
	mux.HandleFunc("/", s.hold)
	// Each answer closes its connection: none is idle at the hand-over, where a request already
	// on its way on an idle one would be lost.
	s.srv.SetKeepAlivesEnabled(false)
	s.srv.ErrorLog = serverErrorLog(log)
	s.conns = trackConns(s.srv)
	log.Info("live, not ready until started", "addr", ln.Addr().String())
	go func() {
		defer close(s.served)
		if err := s.srv.Serve(s.accept); !errors.Is(err, net.ErrClosed) && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("the probes' server while starting stopped", "error", err)
		}
	}()
	return s, nil
}

// handOff gives the requests s holds to handler and returns s's listener, open, as soon as s's
// server accepts no more: the connections that arrive meanwhile wait in its backlog for Serve's
// server. The requests s's server has already read are answered meanwhile, by handler, as long
// as they take, and its connections yet to send one get Serve's server's ReadHeaderTimeout;
// drain, for Serve's shutdown, gives those still silent newConnWait, as Serve's server gives
// its own, and waits for the requests until its context ends, then cuts them off.
func (s *startingServer) handOff(log *slog.Logger, handler http.Handler) (ln net.Listener, drain func(context.Context)) {
	s.handler = handler
	close(s.started)
	_ = s.accept.Close()
	<-s.served
	_ = s.ln.SetDeadline(time.Time{}) // the deadline that stopped s's Accept
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.conns.settle(context.Background(), ReadHeaderTimeout)
		_ = s.srv.Shutdown(context.Background()) // none left: it returns at once
	}()
	return s.ln, func(ctx context.Context) {
		// Once the connections settle here, the settle above finds none left and ends too.
		s.conns.settle(ctx, newConnWait)
		select {
		case <-done:
		case <-ctx.Done():
			log.Warn("requests made while starting still running at the shutdown deadline were cut off")
			_ = s.srv.Close()
		}
	}
}

// serverErrorLog is where an HTTP server of the service writes net/http's own lines (an accept
// error, a superfluous WriteHeader, a handler's panic): the service's log at WARN,
// key=value or JSON as its other lines, not the log package's format on stderr.
func serverErrorLog(log *slog.Logger) *stdlog.Logger {
	return slog.NewLogLogger(log.Handler(), slog.LevelWarn)
}

// close answers the requests s holds 503, stops s's server and closes its listener: the start
// failed, or Serve never ran.
func (s *startingServer) close() {
	close(s.stopping)
	_ = s.accept.Close()
	<-s.served
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if s.srv.Shutdown(ctx) != nil {
		_ = s.srv.Close()
	}
	_ = s.ln.Close()
}

// handoffListener is the starting server's view of the listener: its Close ends the server's
// Accept, by a deadline, and leaves the listener open for Serve's server. Its connections
// record whether their client has sent anything, so that the drain leaves one whose request's
// header is still arriving to finish it, as Serve's server's (see heardConn).
type handoffListener struct {
	*net.TCPListener
	closed atomic.Bool
}

func (l *handoffListener) Accept() (net.Conn, error) {
	c, err := l.TCPListener.Accept()
	if err != nil {
		if l.closed.Load() {
			return nil, net.ErrClosed
		}
		return nil, err
	}
	return &heardConn{Conn: c, accepted: time.Now()}, nil
}

func (l *handoffListener) Close() error {
	if l.closed.Swap(true) {
		return nil
	}
	if err := l.SetDeadline(time.Now()); err != nil {
		return fmt.Errorf("stop accepting: %w", err)
	}
	return nil
}
