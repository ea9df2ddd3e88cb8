package platform

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// ShutdownTimeout bounds how long in-flight HTTP requests may take to finish after a signal.
// The workers' grace periods are shorter still (consumer 5 s, its Run up to 8 s with a handler
// that ignores its end; the sender 4 s and 4 s to record). The relay stops only once the
// requests and the consumer are done, to send what they committed; its batches' publishes are
// cut off ShutdownTimeout after the signal too, whatever the broker does, and Serve waits for
// the relay no longer (see relayUntil), leaving the second before HardStop to record them and
// close. HardStop is what makes the 10 s of the contract hold whatever the parts do (a batch
// it cuts off is sent again at the next start, and its duplicates dropped by the inboxes).
const ShutdownTimeout = 8 * time.Second

// HardStop is how long after a signal the process exits, whatever is still running: a service
// must exit within 10 s of it (the tests require it, and Kubernetes' grace period counts on
// it), and this leaves a margin. What it cuts off was not acknowledged, so the broker delivers
// it again, or not marked, so it is sent again: abandoned safely, like the grace periods'
// leftovers.
const HardStop = 9 * time.Second

// repeatSignalDelay is how long after the first signal a second one kills the process at
// once; one sooner is the same stop, sent twice (a terminal's SIGINT and a script's SIGTERM).
const repeatSignalDelay = time.Second

// newConnWait bounds how long after the signal Serve waits for the first request of each
// connection accepted before it to begin arriving: those still silent then, that have sent no
// byte, are closed. One whose request has begun has the rest of ReadHeaderTimeout for its
// header, as it would without the signal.
const newConnWait = time.Second

// Main runs a service's run function with a context that ends on SIGINT or SIGTERM. If run
// fails, Main prints one line naming the service and exits 1. The exit comes at most HardStop
// after the signal, or after the failure of a part Serve runs, whatever is still running then.
func Main(service string, run func(ctx context.Context, env *Env) error) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// A second signal kills the process the default way, but only from repeatSignalDelay after
	// the first: Ctrl-C in scripts/run-local.sh sends SIGINT to the services and its trap
	// SIGTERM a millisecond later, which must not cut the drain short.
	context.AfterFunc(ctx, func() { time.AfterFunc(repeatSignalDelay, stop) })
	format := strings.ToLower(strings.TrimSpace(os.Getenv("LOG_FORMAT")))
	hardStop(ctx, HardStop, func() {
		logHardStop(os.Stderr, service, format, nil)
		os.Exit(0)
	})
	// A failure stops the service as a signal does, and is bounded the same way: what is left
	// in flight may hold the exit (a request stuck on the database holds its pool's Close).
	failed, fail := context.WithCancelCause(context.Background())
	hardStop(failed, HardStop, func() {
		logHardStop(os.Stderr, service, format, context.Cause(failed))
		os.Exit(1)
	})
	err := run(withStarting(context.WithValue(ctx, failureKey{}, fail)), NewEnv())
	if ctx.Err() != nil && errors.Is(err, context.Canceled) {
		err = nil // stopped by a signal while starting: a clean exit
	}
	stop()
	if err != nil {
		// One line, whatever the error holds (pgx errors span several).
		fmt.Fprintf(os.Stderr, "%s: %s\n", service, strings.Join(strings.Fields(err.Error()), " "))
		os.Exit(1)
	}
}

// logHardStop writes the hard stop's line as the service's other lines are written (key=value,
// or JSON with LOG_FORMAT=json), though the logger its run function made is out of reach here.
// failure is what began the stop, nil for the signal.
func logHardStop(w io.Writer, service, format string, failure error) {
	log := NewLogger(w, service, format, "info")
	if failure == nil {
		log.Error("still stopping after the signal; abandoning what is in flight (it was not acknowledged)", "after", HardStop)
		return
	}
	log.Error("still stopping after a failure; abandoning what is in flight (it was not acknowledged)", "after", HardStop, "error", failure)
}

// failureKey holds, in the context Main gives run, what Serve calls when a failure begins the
// stop: Main's hard stop for failures.
type failureKey struct{}

// failing tells Main, if it made ctx, that err has begun the stop.
func failing(ctx context.Context, err error) {
	if fail, ok := ctx.Value(failureKey{}).(context.CancelCauseFunc); ok {
		fail(err)
	}
}

// hardStop calls exit once after has passed since ctx ended, unless the process ended first.
func hardStop(ctx context.Context, after time.Duration, exit func()) {
	context.AfterFunc(ctx, func() { time.AfterFunc(after, exit) })
}

// Worker is a long-running part of a service (a consumer, a cleanup job). It returns nil when
// its context ends.
type Worker func(ctx context.Context) error

// Workers are what a service runs beside its HTTP server, grouped by when Serve stops them.
type Workers struct {
	// Intake takes work in, as the server does: a subscription's Run. It is stopped at the
	// signal, with the server, and settles what it has in progress.
	Intake []Worker
	// Relay, if set, sends what the requests and the intake commit (the service's outbox). It
	// runs until the server has drained and the intake has stopped, then sends what they
	// committed last: stopped at the signal, it would leave those rows to the next start.
	Relay *messaging.Relay
	// Others are stopped at the signal (cleanup jobs, the profiler, the admission limit).
	Others []Worker
}

// Serve runs srv and the workers under one errgroup until ctx ends or one of them fails, then
// stops them in order: the server stops accepting and finishes the requests in flight while
// the intake settles its messages in progress, and only then does the relay stop, once it has
// sent what they committed. srv serves on the listener Start answered the probes on, if it
// did on srv.Addr (see startingServer).
func Serve(ctx context.Context, log *slog.Logger, srv *http.Server, workers Workers) error {
	if s := startingSlotOf(ctx).take(); s != nil {
		if s.addr == srv.Addr {
			ln, drain := s.handOff(log, srv.Handler)
			return serve(ctx, log, srv, ln, drain, workers)
		}
		s.close() // srv listens elsewhere: the start's port is done with
	}
	ln, err := net.Listen("tcp", srv.Addr)
	if err != nil {
		return fmt.Errorf("HTTP_ADDR: listen on %s: %w", srv.Addr, err)
	}
	return serve(ctx, log, srv, ln, nil, workers)
}

// serve is Serve on a listener already open, whose shutdown also drains held, if not nil: the
// requests of the start's server (see handOff).
func serve(ctx context.Context, log *slog.Logger, srv *http.Server, ln net.Listener, held func(context.Context), workers Workers) error {
	log.Info("listening", "addr", ln.Addr().String())
	ln = heardListener{ln}
	if srv.ErrorLog == nil {
		srv.ErrorLog = serverErrorLog(log)
	}
	conns := trackConns(srv)
	closeAfterTheSignal(srv, conns)
	g, gctx := errgroup.WithContext(ctx)
	var intake sync.WaitGroup
	goIntake := func(f func() error) {
		intake.Add(1)
		g.Go(func() error {
			defer intake.Done()
			return f()
		})
	}
	served := make(chan struct{})
	g.Go(func() error {
		defer close(served)
		err := srv.Serve(ln)
		// Once stopping, the listener's error is the stop's own: shutdownHTTP closed it.
		if errors.Is(err, http.ErrServerClosed) || (gctx.Err() != nil && errors.Is(err, net.ErrClosed)) {
			return nil
		}
		return fmt.Errorf("http server: %w", err)
	})
	goIntake(func() error {
		<-gctx.Done()
		// gctx ends before Wait returns only by the signal or by a part's failure; its cause
		// tells which came first, though the other may have followed by now.
		if cause := context.Cause(gctx); !errors.Is(cause, context.Cause(ctx)) {
			failing(ctx, cause)
			log.Error("shutting down after a failure", "error", cause)
		} else {
			log.Info("shutting down")
		}
		shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ShutdownTimeout)
		defer cancel()
		// The start's held requests drain beside srv's own: each has its 1 s for a connection
		// not read yet from the signal, not one after the other.
		var drained sync.WaitGroup
		if held != nil {
			drained.Go(func() { held(shutdownCtx) })
		}
		shutdownHTTP(shutdownCtx, log, srv, ln, served, conns)
		drained.Wait()
		return nil
	})
	for _, w := range workers.Intake {
		goIntake(func() error { return w(gctx) })
	}
	for _, w := range workers.Others {
		g.Go(func() error { return w(gctx) })
	}
	if workers.Relay != nil {
		intakeStopped := make(chan struct{})
		go func() {
			intake.Wait()
			close(intakeStopped)
		}()
		g.Go(func() error { return relayUntil(gctx, log, workers.Relay, intakeStopped, ShutdownTimeout) })
	}
	if err := g.Wait(); err != nil {
		return err
	}
	log.Info("stopped")
	return nil
}

// shutdownHTTP stops srv, which serves on ln until served closes, within ctx. Shutdown alone
// would drop, unanswered, a connection accepted before it whose first request net/http had not
// read yet (conn.serve returns as it reads one once shutting down): its client, which sent the
// request before the signal, would read EOF. So the listener closes first, the idle connections
// close and the answers from then on close theirs (see drain), and Shutdown comes only once
// every connection has been answered and closed (see settle).
// HTTP/1 only, as NewServer serves: "Connection: close" does not end an HTTP/2 connection.
func shutdownHTTP(ctx context.Context, log *slog.Logger, srv *http.Server, ln net.Listener, served <-chan struct{}, conns *liveConns) {
	conns.drain()
	_ = ln.Close() // already closed if srv.Serve failed
	<-served       // nothing is accepted any more: conns only shrink
	conns.settle(ctx, newConnWait)
	if err := srv.Shutdown(ctx); err != nil {
		// A request still running at the deadline is cut off; that is the deadline's
		// purpose, not a failure of the service (nothing it did was committed half-way).
		log.Warn("HTTP requests still running at the shutdown deadline were cut off", "error", err)
		_ = srv.Close()
	}
}

// liveConns are a server's open connections and their states: new (accepted, no request read
// yet), active (a request read and being answered) or idle (kept alive between requests).
type liveConns struct {
	mu       sync.Mutex
	state    map[net.Conn]http.ConnState
	draining atomic.Bool // set, under mu, by drain
}

// trackConns tracks srv's connections, through its ConnState hook, which goes on calling the
// hook srv had; once draining, it closes each connection that turns idle.
func trackConns(srv *http.Server) *liveConns {
	n := &liveConns{state: map[net.Conn]http.ConnState{}}
	next := srv.ConnState
	srv.ConnState = func(c net.Conn, state http.ConnState) {
		// Recorded before the server's own hook runs: a slow one must not keep a connection
		// that turned active counted as new, for settle to end, or as idle, for drain to close.
		n.mu.Lock()
		switch {
		case state == http.StateIdle && n.draining.Load():
			// A request begun before the signal, answered since, kept its connection:
			// its client's next request would be new work.
			closeDrained(c)
			delete(n.state, c)
		case state == http.StateNew || state == http.StateActive || state == http.StateIdle:
			n.state[c] = state
		default:
			delete(n.state, c)
		}
		n.mu.Unlock()
		if next != nil {
			next(c, state)
		}
	}
	return n
}

// drain closes the idle connections, and from now on each as it turns idle, so that their
// clients take their next requests elsewhere. Not srv.SetKeepAlivesEnabled(false), which closes
// them too: it does so before Shutdown has told net/http it is shutting down, and a request read
// from one in that instant would be handled on a closed connection, committed with nobody
// answered (Go issue 65802). Here a connection is closed only while its state is idle, under
// the lock its turn to active takes, and marked: its request, read as it closed, is never handled
// (see closeAfterTheSignal); its client reads the connection's end, as with any HTTP/1.1 server
// (a client retries it only if it is idempotent, or carries an Idempotency-Key).
func (n *liveConns) drain() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.draining.Store(true)
	for c, state := range n.state {
		if state == http.StateIdle {
			closeDrained(c)
			delete(n.state, c)
		}
	}
}

// closeDrained marks c closed by the drain, then closes it.
func closeDrained(c net.Conn) {
	if hc, ok := c.(*heardConn); ok {
		hc.drained.Store(true)
	}
	_ = c.Close()
}

// connPoll is how often settle looks at the connections.
const connPoll = 5 * time.Millisecond

// settle waits, within ctx, until no connection is new or active: once draining, each is closed
// once answered, and no request is read after. A connection that leaves StateNew is marked
// active before net/http looks whether the server is shutting down, and stays so until it is
// closed, so Shutdown after settle finds none it would drop. Those still new after newWait whose
// client has sent nothing, silent since before the signal, have their reads ended (Shutdown
// would wait 5 s for them); one still sending its request's header stays new until it has sent
// it all, and is left to finish it (see heardConn).
func (n *liveConns) settle(ctx context.Context, newWait time.Duration) {
	silentBy := time.Now().Add(newWait)
	tick := time.NewTicker(connPoll)
	defer tick.Stop()
	for {
		n.mu.Lock()
		live := 0
		for c, state := range n.state {
			if state == http.StateIdle { // none once drain has run; never counted as live
				continue
			}
			live++
			if state == http.StateNew && time.Now().After(silentBy) {
				// Set at each look: net/http's own header deadline may replace it.
				endIfSilent(c)
			}
		}
		n.mu.Unlock()
		if live == 0 {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// closeAfterTheSignal puts in front of srv's handler one that never handles a request read from
// a connection the drain closed, and whose answers, once conns drain, say "Connection: close"
// (see closingWriter); and has each of srv's requests carry its connection, to tell.
func closeAfterTheSignal(srv *http.Server, conns *liveConns) {
	h := srv.Handler
	if h == nil {
		h = http.DefaultServeMux
	}
	srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hc, _ := r.Context().Value(connKey{}).(*heardConn); hc != nil && hc.drained.Load() {
			AbandonResponse()
		}
		cw := &closingWriter{ResponseWriter: w, conns: conns}
		h.ServeHTTP(cw, r)
		cw.closeIfDraining() // nothing written: net/http answers 200 now
	})
	next := srv.ConnContext
	srv.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		if next != nil {
			ctx = next(ctx, c)
		}
		return context.WithValue(ctx, connKey{}, c)
	}
}

// connKey is the key of a request's connection in its context.
type connKey struct{}

// closingWriter says "Connection: close" in its answer's header if conns drain by the time the
// header is written: a request in flight at the signal, answered after it, is answered so too,
// and its client dials afresh (another replica) rather than reuse a connection the drain then
// closes under its next request.
type closingWriter struct {
	http.ResponseWriter
	conns *liveConns
	wrote bool // the header is written
}

func (w *closingWriter) closeIfDraining() {
	if w.wrote {
		return
	}
	w.wrote = true
	if w.conns.draining.Load() {
		w.Header().Set("Connection", "close")
	}
}

func (w *closingWriter) WriteHeader(code int) {
	if code >= 200 { // not an informational answer, after which the header may still change
		w.closeIfDraining()
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *closingWriter) Write(p []byte) (int, error) {
	w.closeIfDraining()
	return w.ResponseWriter.Write(p)
}

// ReadFrom keeps net/http's own (sendfile from a file), which embedding would hide.
func (w *closingWriter) ReadFrom(r io.Reader) (int64, error) {
	w.closeIfDraining()
	return io.Copy(w.ResponseWriter, r)
}

// Flush keeps the writer a Flusher, for a handler that streams.
func (w *closingWriter) Flush() {
	w.closeIfDraining()
	_ = http.NewResponseController(w.ResponseWriter).Flush()
}

// Hijack keeps the writer a Hijacker: a hijacked connection is the handler's own.
func (w *closingWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return http.NewResponseController(w.ResponseWriter).Hijack()
}

// Unwrap gives http.ResponseController the writer beneath.
func (w *closingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// heardListener accepts connections that record whether their client has sent a byte (see
// heardConn).
type heardListener struct{ net.Listener }

func (l heardListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &heardConn{Conn: c, accepted: time.Now()}, nil
}

// heardConn is a connection that records whether its client has sent anything: net/http counts
// a connection new until it has read a whole request header, so one whose client is still
// sending it (a slow link, a large header) looks to settle as silent as one that sent nothing,
// and ending its reads would answer a request begun before the signal with EOF.
type heardConn struct {
	net.Conn
	accepted time.Time
	drained  atomic.Bool // closed by the drain (see drain)
	mu       sync.Mutex
	heard    bool // its client has sent a byte
	ended    bool // settle ended its reads while it was silent
}

func (c *heardConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.mu.Lock()
		if !c.heard {
			c.heard = true
			if c.ended {
				// Its first bytes came as settle ended its reads: the request is its
				// client's from before, and gets what is left of a header's time.
				_ = c.SetReadDeadline(c.accepted.Add(ReadHeaderTimeout))
			}
		}
		c.mu.Unlock()
	}
	return n, err
}

// CloseWrite half-closes the connection, as net/http does a TCP connection's after its last
// answer, before closing it, so that a client still sending is not reset before it reads the
// answer: net/http looks for the method on the connection the listener gave it.
func (c *heardConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// ReadFrom copies r to the connection by its own ReadFrom, if it has one: net/http sends a
// response's body so (sendfile from a file, on a TCP connection), which embedding net.Conn
// would hide, leaving it a buffered copy.
func (c *heardConn) ReadFrom(r io.Reader) (int64, error) {
	if rf, ok := c.Conn.(io.ReaderFrom); ok {
		return rf.ReadFrom(r)
	}
	return io.Copy(c.Conn, r)
}

// endIfSilent ends the reads of c, a connection of a server's, if it is a heardConn whose
// client has sent nothing: a past deadline, not a close, so that a request whose bytes a read is
// returning just now is answered on an open connection, not handled on a closed one; with none,
// net/http's read fails and it closes the connection. The check and the deadline are one step
// against the read's record of its bytes.
func endIfSilent(c net.Conn) {
	hc, ok := c.(*heardConn)
	if !ok { // no record of its bytes (a listener not serve's or the start's): ended as silent
		_ = c.SetReadDeadline(time.Now())
		return
	}
	hc.mu.Lock()
	defer hc.mu.Unlock()
	if !hc.heard {
		hc.ended = true
		_ = hc.SetReadDeadline(time.Now())
	}
}

// relayer is what relayUntil runs: a [messaging.Relay].
type relayer interface {
	Run(ctx context.Context) error
	ProcessBatch(ctx context.Context) (messaging.BatchResult, error)
}

// relayUntil runs r until intakeStopped closes, then makes a last pass over the outbox for the
// rows committed since the relay last looked: a lane asleep at the stop would leave them. The
// last pass begins no batch later than within after the signal (ShutdownTimeout in Serve, when
// the intake must be done), nor after a batch that left rows unsent: the broker gave no verdict
// on them (an error), or it settled none of the batch (no error: an earlier publish of each row
// still pending on the connection, say, which the next batch would claim again at once, for
// the same answer). A batch that settled some goes on: rows a neighbour's refusal left unsent on
// its closed channel go out in the next. A relay that cannot publish neither holds the exit
// nor spins: the rows wait for the next start, or another replica.
//
// Nor does a batch outlive the bound: a Relay's waits ShutdownGrace (5 s) past its context's
// end for its confirms, and a broker that accepts the connection and never answers holds its
// dial that long, past the hard stop. The contexts r gets carry a cut that ends within after the
// signal (see relayCut): the relay's Sender (cutSender) ends its publishes then, so the batch
// records what it has at once, and relayUntil returns, leaving the batch to do so. The service
// closes the publisher and the pools after Serve: both wait for that batch (the publisher's
// lock, the batch's connection), not long.
func relayUntil(signal context.Context, log *slog.Logger, r relayer, intakeStopped <-chan struct{}, within time.Duration) error {
	// WithoutCancel: the relay outlives the signal, though not the intake, nor the cut. Its
	// contexts are the cut's children, ended with it: an intake still running at the cut (a
	// consumer's Run takes up to 8 s too) would otherwise have the lanes take their publishes,
	// cut off, for a broker outage.
	cut, cutOff := context.WithCancel(context.WithoutCancel(signal))
	defer cutOff()
	context.AfterFunc(signal, func() { time.AfterFunc(within, cutOff) })
	relaying := context.WithValue(cut, relayCutKey{}, cut)
	runCtx, stop := context.WithCancel(relaying)
	defer stop()
	go func() {
		select {
		case <-intakeStopped:
			stop()
		case <-runCtx.Done():
		}
	}()
	if err := r.Run(runCtx); err != nil {
		return fmt.Errorf("outbox relay: %w", err)
	}

	lastPass, cancel := context.WithCancel(relaying)
	defer cancel()
	type outcome struct {
		res messaging.BatchResult
		err error
	}
	sent := 0
	for cut.Err() == nil {
		done := make(chan outcome, 1)
		go func() {
			res, err := r.ProcessBatch(lastPass)
			done <- outcome{res, err}
		}()
		var o outcome
		select {
		case o = <-done:
		case <-cut.Done():
			select {
			case o = <-done: // ended as the cut came
			default:
				log.Warn("the outbox's last batch was still running at the shutdown deadline; left to record what the broker confirmed, the rest waits for the next start",
					"after", within, "sent", sent)
				return nil
			}
		}
		res, err := o.res, o.err
		sent += res.Sent
		if err != nil {
			log.Warn("could not send the outbox's last rows before stopping; they wait for the next start", "error", err, "sent", sent)
			return nil
		}
		if res.Unsent > 0 && res.Sent+res.Failed == 0 {
			log.Warn("could not send the outbox's last rows before stopping; they wait for the next start", "unsent", res.Unsent, "sent", sent)
			return nil
		}
		if res.Claimed == 0 {
			break
		}
	}
	if sent > 0 {
		log.Info("sent the outbox's last rows before stopping", "sent", sent)
	}
	return nil
}

// relayCutKey holds, in the contexts relayUntil gives the relay, the cut: a context that ends
// when relayUntil stops waiting for the relay's batches.
type relayCutKey struct{}

// relayCut is the cut ctx carries (see relayCutKey), nil if none.
func relayCut(ctx context.Context) context.Context {
	cut, _ := ctx.Value(relayCutKey{}).(context.Context)
	return cut
}
