package platform

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// drainServer serves, through serve, a handler that answers 201 to every request; it holds
// /slow until release, and /slower until releaseSlower; /flushed it answers at once, but
// returns only on release; ln is the listener it serves on.
type drainServer struct {
	handled   sync.Map // request paths the handler ran
	slowIn    chan struct{}
	released  chan struct{}
	release   func()
	flushedIn chan struct{}
	// slower's
	slowerIn, slowerReleased chan struct{}
	releaseSlower            func()
	signal                   func()
	served                   <-chan error
	logs                     *testenv.Logs
}

func startDrainServer(t *testing.T, ln net.Listener) *drainServer {
	t.Helper()
	d := &drainServer{slowIn: make(chan struct{}, 1), released: make(chan struct{}),
		slowerIn: make(chan struct{}, 1), slowerReleased: make(chan struct{}), flushedIn: make(chan struct{}, 1)}
	var once, slowerOnce sync.Once
	d.release = func() { once.Do(func() { close(d.released) }) }
	d.releaseSlower = func() { slowerOnce.Do(func() { close(d.slowerReleased) }) }
	t.Cleanup(d.release)
	t.Cleanup(d.releaseSlower)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		d.handled.Store(r.URL.Path, true)
		if r.URL.Path == "/slow" {
			d.slowIn <- struct{}{}
			<-d.released
		}
		if r.URL.Path == "/flushed" {
			w.WriteHeader(http.StatusCreated)
			_ = http.NewResponseController(w).Flush()
			d.flushedIn <- struct{}{}
			<-d.released
			return
		}
		if r.URL.Path == "/slower" {
			d.slowerIn <- struct{}{}
			<-d.slowerReleased
		}
		w.WriteHeader(http.StatusCreated)
	})
	log, logs := testenv.NewLogger(t)
	d.logs = logs
	d.signal, d.served = serveOn(t, log, NewServer("", h), ln, Workers{})
	return d
}

func (d *drainServer) shutting() bool {
	return len(d.logs.Lines(`msg="shutting down"`)) == 1
}

func (d *drainServer) ran(path string) bool {
	_, ok := d.handled.Load(path)
	return ok
}

// postOn writes a POST of path on conn.
func postOn(t *testing.T, conn net.Conn, path string) {
	t.Helper()
	if _, err := io.WriteString(conn, "POST "+path+" HTTP/1.1\r\nHost: order\r\nContent-Length: 2\r\n\r\n{}"); err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
}

// answer reads the answer on conn, nil if the connection ended without one.
func answer(t *testing.T, conn net.Conn, r *bufio.Reader) *http.Response {
	t.Helper()
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(r, nil)
	if err != nil {
		return nil
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

// The drain takes no new work on a kept-alive connection: one idle at the signal is closed at
// once, and one whose request, begun before the signal, is answered after it is closed after
// that answer, while another request still holds the drain; neither's next request is handled.
func TestTheDrainTakesNoRequestOnAKeptAliveConnection(t *testing.T) {
	t.Parallel()
	ln := newGatedListener(t, closedChan())
	d := startDrainServer(t, ln)
	idle := dialed(t, ln.Addr().String())
	r := bufio.NewReader(idle)
	postOn(t, idle, "/first")
	if resp := answer(t, idle, r); resp == nil || resp.StatusCode != http.StatusCreated || resp.Close {
		t.Fatalf("the first request got %+v, want a 201 that keeps the connection", resp)
	}
	busy := dialed(t, ln.Addr().String())
	busyR := bufio.NewReader(busy)
	postOn(t, busy, "/slow")
	within(t, d.slowIn, 5*time.Second, "the slow request was not handled")
	postOn(t, dialed(t, ln.Addr().String()), "/slower")
	within(t, d.slowerIn, 5*time.Second, "the slower request was not handled")
	d.signal()
	within(t, ln.closed, 5*time.Second, "the listener was not closed at the signal")
	wantClosed(t, idle, r, "the idle connection, after the signal")
	_, _ = io.WriteString(idle, "POST /second HTTP/1.1\r\nHost: order\r\nContent-Length: 2\r\n\r\n{}")

	d.release()
	if resp := answer(t, busy, busyR); resp == nil || resp.StatusCode != http.StatusCreated || !resp.Close {
		t.Fatalf("the request begun before the signal got %+v, want a 201 with Connection: close", resp)
	}
	wantClosed(t, busy, busyR, "the connection answered during the drain, after the answer")
	_, _ = io.WriteString(busy, "POST /third HTTP/1.1\r\nHost: order\r\nContent-Length: 2\r\n\r\n{}")
	d.releaseSlower()
	if err := within(t, d.served, 10*time.Second, "Serve did not return"); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{"/second", "/third"} {
		if d.ran(path) {
			t.Errorf("%s, sent on a kept-alive connection during the drain, was handled", path)
		}
	}
}

// A request pipelined behind one whose answer was written before the signal, and which returns
// after it, is never handled: the connection turns idle during the drain, which closes it, and
// the request, already read, is parsed from net/http's buffer.
func TestARequestPipelinedBehindOneAnsweredBeforeTheSignalIsNotHandled(t *testing.T) {
	t.Parallel()
	ln := newGatedListener(t, closedChan())
	d := startDrainServer(t, ln)
	conn := dialed(t, ln.Addr().String())
	r := bufio.NewReader(conn)
	const pipelined = "POST /flushed HTTP/1.1\r\nHost: order\r\nContent-Length: 2\r\n\r\n{}" +
		"POST /next HTTP/1.1\r\nHost: order\r\nContent-Length: 2\r\n\r\n{}"
	if _, err := io.WriteString(conn, pipelined); err != nil {
		t.Fatal(err)
	}
	within(t, d.flushedIn, 5*time.Second, "the first request was not answered")
	d.signal()
	within(t, ln.closed, 5*time.Second, "the listener was not closed at the signal")
	d.release()
	if resp := answer(t, conn, r); resp == nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("the first request got %+v, want 201", resp)
	}
	resp := answer(t, conn, r)
	if err := within(t, d.served, 10*time.Second, "Serve did not return"); err != nil {
		t.Fatal(err)
	}
	if d.ran("/next") {
		t.Fatalf("the request pipelined behind one answered before the signal was handled during the drain (its client got %+v)", resp)
	}
}

// wantClosed checks that the server has closed conn, read through r.
func wantClosed(t *testing.T, conn net.Conn, r *bufio.Reader, what string) {
	t.Helper()
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if b, err := r.ReadByte(); err == nil {
		t.Fatalf("%s: read byte %d, want the connection closed", what, b)
	} else if ne := net.Error(nil); errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("%s: still open after 5 s, want it closed", what)
	}
}

// A request whose bytes the server is reading from an idle keep-alive connection as the drain
// begins is either answered or never handled: it is never handled on a connection the server
// has closed, committed with its client reading EOF. The connection's read holds the request's
// bytes until the connection is closed (or 3 s), as a busy machine may, in the instant between
// the read and net/http's look at the request.
func TestARequestReadAsTheDrainBeginsIsAnsweredOrNotHandled(t *testing.T) {
	t.Parallel()
	ln := newHoldingListener(t, 2)
	d := startDrainServer(t, ln)
	conn := dialed(t, ln.Addr().String())
	r := bufio.NewReader(conn)
	postOn(t, conn, "/first")
	if resp := answer(t, conn, r); resp == nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("the first request got %+v, want 201", resp)
	}
	busy := dialed(t, ln.Addr().String())
	postOn(t, busy, "/slow")
	within(t, d.slowIn, 5*time.Second, "the slow request was not handled")
	postOn(t, conn, "/second")
	held := within(t, ln.holding, 5*time.Second, "the second request's bytes were not read")
	d.signal()
	testenv.Eventually(t, 5*time.Second, d.shutting, "the server is not stopping")
	// The drain closes the idle connection at the signal, letting its read go; then it may end.
	within(t, held.freed, 5*time.Second, "the drain did not close the idle connection at the signal")
	d.release()
	resp := answer(t, conn, r)
	if err := within(t, d.served, 10*time.Second, "Serve did not return"); err != nil {
		t.Fatal(err)
	}
	if d.ran("/second") && (resp == nil || resp.StatusCode != http.StatusCreated) {
		t.Fatalf("the request read as the drain began was handled, and its client got %+v, want its 201", resp)
	}
}

// A request whose bytes the server is reading, on a connection accepted before the signal, as
// the drain ends the silent ones is answered: the read holds them until the connection is
// closed or its read deadline set (or 3 s).
func TestARequestReadAsTheSilentConnectionsEndIsAnswered(t *testing.T) {
	t.Parallel()
	ln := newHoldingListener(t, 1)
	d := startDrainServer(t, ln)
	conn := dialed(t, ln.Addr().String())
	postOn(t, conn, "/first")
	within(t, ln.holding, 5*time.Second, "the request's bytes were not read")
	d.signal()
	resp := answer(t, conn, bufio.NewReader(conn))
	if err := within(t, d.served, 10*time.Second, "Serve did not return"); err != nil {
		t.Fatal(err)
	}
	if !d.ran("/first") || resp == nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("the request read as the silent connections were ended: handled %t, its client got %+v; want it handled and its 201", d.ran("/first"), resp)
	}
}

// A request whose header's first bytes the server is reading, on a connection accepted before
// the signal, as the drain ends the silent ones, has the rest of a header's time for the rest:
// the read holds the first bytes until the connection's read deadline is set.
func TestARequestBegunAsTheSilentConnectionsEndIsAnswered(t *testing.T) {
	t.Parallel()
	ln := newHoldingListener(t, 1)
	d := startDrainServer(t, ln)
	conn := dialed(t, ln.Addr().String())
	if _, err := io.WriteString(conn, "POST /begun HTTP/1.1\r\nHost: order\r\n"); err != nil {
		t.Fatal(err)
	}
	held := within(t, ln.holding, 5*time.Second, "the request's beginning was not read")
	d.signal()
	within(t, held.freed, newConnWait+5*time.Second, "the drain did not end the silent connection's reads")
	if _, err := io.WriteString(conn, "Content-Length: 2\r\n\r\n{}"); err != nil {
		t.Fatalf("the request begun before the signal could not be finished: %v", err)
	}
	resp := answer(t, conn, bufio.NewReader(conn))
	if resp == nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("the request begun as the silent connections were ended got %+v, want 201", resp)
	}
	if err := within(t, d.served, 10*time.Second, "Serve did not return"); err != nil {
		t.Fatal(err)
	}
}

func closedChan() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}

// holdingListener's connections hold the bytes of their nth read that returns any until the
// connection is closed or given a past read deadline, or for 3 s; holding tells of each hold.
type holdingListener struct {
	net.Listener
	nth     int32
	holding chan *holdingConn
}

func newHoldingListener(t *testing.T, nth int32) *holdingListener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return &holdingListener{Listener: ln, nth: nth, holding: make(chan *holdingConn, 8)}
}

func (l *holdingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &holdingConn{Conn: c, l: l, freed: make(chan struct{})}, nil
}

type holdingConn struct {
	net.Conn
	l     *holdingListener
	reads atomic.Int32
	mu    sync.Mutex
	held  bool          // the read holds its bytes
	freed chan struct{} // closed by Close or a past read deadline while the read holds
}

func (c *holdingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 && c.reads.Add(1) == c.l.nth {
		c.mu.Lock()
		c.held = true
		c.mu.Unlock()
		c.l.holding <- c
		select {
		case <-c.freed:
		case <-time.After(3 * time.Second):
		}
	}
	return n, err
}

// free lets a held read go; net/http's own past deadlines before the hold (ending a
// background read) let none go.
func (c *holdingConn) free() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.held {
		c.held = false
		close(c.freed)
	}
}

func (c *holdingConn) Close() error {
	c.free()
	return c.Conn.Close()
}

func (c *holdingConn) SetReadDeadline(t time.Time) error {
	if !t.IsZero() && !t.After(time.Now()) {
		c.free()
	}
	return c.Conn.SetReadDeadline(t)
}

// heardFrom reports whether c is a heardConn whose client has sent something.
func heardFrom(c net.Conn) bool {
	hc, ok := c.(*heardConn)
	if !ok {
		return false
	}
	hc.mu.Lock()
	defer hc.mu.Unlock()
	return hc.heard
}
