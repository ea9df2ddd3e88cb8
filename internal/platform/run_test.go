package platform

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// The hard stop fires once, the given time after the context ends, and not before.
func TestHardStopFiresAfterTheSignal(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	fired := make(chan time.Time, 2)
	hardStop(ctx, time.Second, func() { fired <- time.Now() })
	select {
	case <-fired:
		t.Fatal("fired before the signal")
	case <-time.After(200 * time.Millisecond): // a wait for something that must not happen
	}
	signalled := time.Now()
	cancel()
	select {
	case at := <-fired:
		// Not much later either: the hard stop is what keeps a service's exit within 10 s. (The
		// margin is a busy machine's timer latency under -race.)
		if d := at.Sub(signalled); d < time.Second || d >= 1800*time.Millisecond {
			t.Fatalf("fired %s after the signal, want 1s (less than 1.8s)", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("did not fire within 5 s of the signal")
	}
}

// The hard stop's line is a log line like the others: key=value, or JSON with LOG_FORMAT=json.
func TestHardStopLineIsALogLine(t *testing.T) {
	var text, js bytes.Buffer
	logHardStop(&text, "order", "text", nil)
	logHardStop(&js, "order", "json", nil)
	if !strings.Contains(text.String(), `level=ERROR msg="still stopping after the signal; abandoning what is in flight (it was not acknowledged)" service=order after=9s`) {
		t.Errorf("text line %q", text.String())
	}
	var line map[string]any
	if err := json.Unmarshal(js.Bytes(), &line); err != nil || line["service"] != "order" || line["after"] != "9s" {
		t.Errorf("JSON line %q (%v)", js.String(), err)
	}
}

// The failure's line says what failed, so that a hard stop after a failure still shows why.
func TestHardStopLineAfterAFailureNamesIt(t *testing.T) {
	var text bytes.Buffer
	logHardStop(&text, "order", "text", errors.New("consumer: queue gone"))
	if !strings.Contains(text.String(), `level=ERROR msg="still stopping after a failure; abandoning what is in flight (it was not acknowledged)" service=order after=9s error="consumer: queue gone"`) {
		t.Errorf("text line %q", text.String())
	}
}

// A part's failure tells Main, through the context it gave run, that the stop has begun, so
// that the exit is bounded as after a signal; the signal itself does not.
func TestServeTellsMainOfAFailureNotOfTheSignal(t *testing.T) {
	t.Parallel()
	boom := errors.New("consumer: queue gone")
	for _, tc := range []struct {
		name   string
		worker Worker
		signal bool
		want   error
	}{
		{name: "a worker fails", worker: func(context.Context) error { return boom }, want: boom},
		{name: "the signal", worker: func(ctx context.Context) error { <-ctx.Done(); return nil }, signal: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var told []error
			ctx, cancel := context.WithCancel(context.WithValue(context.Background(), failureKey{},
				context.CancelCauseFunc(func(err error) { told = append(told, err) })))
			defer cancel()
			if tc.signal {
				cancel()
			}
			log, logs := testenv.NewLogger(t)
			err := Serve(ctx, log, NewServer("127.0.0.1:0", http.NotFoundHandler()), Workers{Others: []Worker{tc.worker}})
			if !errors.Is(err, tc.want) {
				t.Fatalf("Serve returned %v, want %v", err, tc.want)
			}
			// Serve calls it from one of its own parts, so it has happened by the time it returns.
			if tc.want == nil && len(told) != 0 {
				t.Fatalf("Main was told of a failure after the signal: %v", told)
			}
			if tc.want != nil && (len(told) != 1 || !errors.Is(told[0], tc.want)) {
				t.Fatalf("Main was told %v, want once %v", told, tc.want)
			}
			if tc.want != nil && len(logs.Lines("shutting down after a failure", "queue gone")) != 1 {
				t.Error("the failure that began the stop was not logged as it began")
			}
		})
	}
}

// net/http's own lines reach the service's log, as its others do: a handler that writes its
// status twice makes net/http say so, and the line is the service's, at WARN.
func TestTheHTTPServersOwnLinesAreTheServices(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	log, logs := testenv.NewLogger(t)
	twice := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.WriteHeader(http.StatusTeapot)
	})
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, log, NewServer("127.0.0.1:0", twice), Workers{}) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Error(err)
		}
	})
	var addr string
	testenv.Eventually(t, 10*time.Second, func() bool {
		lines := logs.Lines(`msg=listening`)
		if len(lines) == 1 {
			_, addr, _ = strings.Cut(lines[0], "addr=")
		}
		return addr != ""
	}, "the server did not say where it listens")
	resp, err := http.Get("http://" + strings.TrimSpace(addr))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(logs.Lines("level=WARN", "superfluous response.WriteHeader")) == 1
	}, "net/http's line did not reach the service's log:\n%s", logs)
}

// hardStopChildEnv makes the test below its own child process: a service run by Main.
const hardStopChildEnv = "PLATFORM_TEST_FAILING_SERVICE"

// After a part fails, the process exits 1 within HardStop even when something it waits for
// never ends: here run's cleanup, as a pool's Close waits for a request stuck on the database.
func TestMainExitsWithinTheHardStopAfterAFailure(t *testing.T) {
	if os.Getenv(hardStopChildEnv) != "" {
		Main("order", func(ctx context.Context, _ *Env) error {
			defer func() { select {} }() // a cleanup that never ends
			log := NewLogger(os.Stdout, "order", "text", "info")
			return Serve(ctx, log, NewServer("127.0.0.1:0", http.NotFoundHandler()), Workers{
				Others: []Worker{func(context.Context) error { return errors.New("consumer: queue gone") }},
			})
		})
		return
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), HardStop+20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestMainExitsWithinTheHardStopAfterAFailure$")
	cmd.Env = append(os.Environ(), hardStopChildEnv+"=1")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	err := cmd.Run()
	took := time.Since(start)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("the service ended with %v after %s, want exit status 1 within %s of the failure\n%s", err, took.Round(time.Millisecond), HardStop, out.String())
	}
	if took < HardStop || took > HardStop+5*time.Second {
		t.Errorf("exited %s after it started, want %s after the failure (which came at once)", took.Round(time.Millisecond), HardStop)
	}
	if !strings.Contains(out.String(), `msg="still stopping after a failure; abandoning what is in flight (it was not acknowledged)" service=order after=9s error="consumer: queue gone"`) {
		t.Errorf("no hard stop line naming the failure in\n%s", out.String())
	}
}

// gatedListener holds the reads of the connections it accepts until gate closes, as a busy
// machine may hold a connection's goroutine; it tells of each accept, of each connection's
// first bytes read, and of its Close.
type gatedListener struct {
	net.Listener
	gate     <-chan struct{}
	accepted chan struct{}
	read     chan struct{}
	closed   chan struct{}
	once     sync.Once
}

func newGatedListener(t *testing.T, gate <-chan struct{}) *gatedListener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return &gatedListener{Listener: ln, gate: gate, accepted: make(chan struct{}, 8), read: make(chan struct{}, 8), closed: make(chan struct{})}
}

func (l *gatedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.accepted <- struct{}{}
	return &gatedConn{Conn: c, gate: l.gate, read: l.read}, nil
}

func (l *gatedListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

type gatedConn struct {
	net.Conn
	gate <-chan struct{}
	read chan<- struct{}
	once sync.Once
}

func (c *gatedConn) Read(p []byte) (int, error) {
	<-c.gate
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.once.Do(func() { c.read <- struct{}{} })
	}
	return n, err
}

// within waits for ch, failing the test after timeout with what.
func within[T any](t *testing.T, ch <-chan T, timeout time.Duration, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(timeout):
		t.Fatalf("after %s: %s", timeout, what)
		var zero T
		return zero
	}
}

// serveOn runs serve on ln until the returned signal, and gives what it returns on the
// returned channel.
func serveOn(t *testing.T, log *slog.Logger, srv *http.Server, ln net.Listener, workers Workers) (context.CancelFunc, <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	served := make(chan error, 1)
	go func() { served <- serve(ctx, log, srv, ln, nil, workers) }()
	return cancel, served
}

// A request whose connection was accepted before the signal, but not yet read, is answered:
// net/http's Shutdown alone closes such a connection once it reads the request, unanswered,
// and its client, which sent the request before the signal, reads EOF (as
// TestGracefulShutdownUnderLoad saw under load).
func TestARequestAcceptedBeforeTheSignalIsAnswered(t *testing.T) {
	t.Parallel()
	t.Run("plain", func(t *testing.T) {
		t.Parallel()
		answeredAfterTheSignal(t, nil)
	})
	// A ConnState hook of the server's own, slow as the connection turns active, runs in the
	// window between that turn and net/http's look at whether it is shutting down.
	t.Run("with a slow hook of the server's own", func(t *testing.T) {
		t.Parallel()
		answeredAfterTheSignal(t, func(_ net.Conn, state http.ConnState) {
			if state == http.StateActive {
				time.Sleep(50 * time.Millisecond)
			}
		})
	})
}

func answeredAfterTheSignal(t *testing.T, hook func(net.Conn, http.ConnState)) {
	gate := make(chan struct{})
	ln := newGatedListener(t, gate)
	created := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusCreated)
	})
	log, _ := testenv.NewLogger(t)
	srv := NewServer("", created)
	srv.ConnState = hook
	signal, served := serveOn(t, log, srv, ln, Workers{})
	conn := dialed(t, ln.Addr().String())
	if _, err := io.WriteString(conn, "POST /orders HTTP/1.1\r\nHost: order\r\nContent-Length: 2\r\n\r\n{}"); err != nil {
		t.Fatal(err)
	}
	within(t, ln.accepted, 5*time.Second, "the connection was not accepted")
	signal()
	within(t, ln.closed, 5*time.Second, "the listener still accepts after the signal")
	close(gate) // the server reads the request only now, stopping
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("the request sent before the signal got no answer: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || !resp.Close {
		t.Fatalf("the request sent before the signal got %d (Connection: close %v), want 201 on a connection that closes", resp.StatusCode, resp.Close)
	}
	if err := within(t, served, 5*time.Second, "Serve did not return after the request was answered"); err != nil {
		t.Fatal(err)
	}
}

// A connection that sends nothing holds the stop no longer than newConnWait: it is closed then,
// where Shutdown would wait 5 s for its request.
func TestASilentConnectionDoesNotHoldTheStop(t *testing.T) {
	t.Parallel()
	open := make(chan struct{})
	close(open)
	ln := newGatedListener(t, open)
	log, _ := testenv.NewLogger(t)
	signal, served := serveOn(t, log, NewServer("", http.NotFoundHandler()), ln, Workers{})
	conn := dialed(t, ln.Addr().String())
	within(t, ln.accepted, 5*time.Second, "the connection was not accepted")
	signalled := time.Now()
	signal()
	if err := within(t, served, 10*time.Second, "Serve did not return"); err != nil {
		t.Fatal(err)
	}
	// The margin is a busy machine's, under -race.
	if took := time.Since(signalled); took < newConnWait || took > newConnWait+time.Second {
		t.Fatalf("Serve returned %s after the signal with a silent connection open, want %s (within 1 s more)", took.Round(time.Millisecond), newConnWait)
	}
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := conn.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("the silent connection read %d bytes, %v; want it closed", n, err)
	}
}

// A connection whose client has begun its request before the signal, and is still sending
// its header after newConnWait, is not closed with the silent ones: net/http counts it new
// until the whole header is read, and closing it then would answer a POST already begun with
// EOF. ReadHeaderTimeout still bounds how long it may take.
func TestARequestBegunBeforeTheSignalIsAnswered(t *testing.T) {
	t.Parallel()
	open := make(chan struct{})
	close(open)
	ln := newGatedListener(t, open)
	log, _ := testenv.NewLogger(t)
	created := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusCreated)
	})
	signal, served := serveOn(t, log, NewServer("", created), ln, Workers{})
	conn := dialed(t, ln.Addr().String())
	if _, err := io.WriteString(conn, "POST /x HTTP/1.1\r\nHost: a\r\n"); err != nil {
		t.Fatal(err)
	}
	within(t, ln.accepted, 5*time.Second, "the connection was not accepted")
	within(t, ln.read, 5*time.Second, "the server did not read the request's beginning")
	// A connection that sends nothing: its close shows that settle has closed the silent ones.
	silent := dialed(t, ln.Addr().String())
	within(t, ln.accepted, 5*time.Second, "the silent connection was not accepted")
	signal()
	_ = silent.SetReadDeadline(time.Now().Add(newConnWait + 5*time.Second))
	if n, err := silent.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("the silent connection read %d bytes (%v), want it closed", n, err)
	}
	// The rest of the request comes only now.
	if _, err := io.WriteString(conn, "Content-Length: 2\r\n\r\n{}"); err != nil {
		t.Fatalf("the request begun before the signal could not be finished: %v", err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("the request begun before the signal got no answer: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("the request begun before the signal got %d, want 201", resp.StatusCode)
	}
	if err := within(t, served, 5*time.Second, "Serve did not return after the request was answered"); err != nil {
		t.Fatal(err)
	}
}

// readFromConn is a connection whose ReadFrom tells it ran, as a TCP connection's would
// sendfile.
type readFromConn struct {
	net.Conn
	readFrom bool
}

func (c *readFromConn) ReadFrom(r io.Reader) (int64, error) {
	c.readFrom = true
	return io.Copy(io.Discard, r)
}

// A connection of the services' servers keeps its TCP connection's ReadFrom, which net/http
// sends a response's body by (sendfile for a file): one that hid it would have each copied
// through a buffer.
func TestAHeardConnWritesByItsConnectionsReadFrom(t *testing.T) {
	t.Parallel()
	under := &readFromConn{}
	var c net.Conn = &heardConn{Conn: under}
	rf, ok := c.(io.ReaderFrom)
	if !ok {
		t.Fatal("a heardConn is no io.ReaderFrom: net/http copies every body through a buffer")
	}
	if n, err := rf.ReadFrom(strings.NewReader("body")); n != 4 || err != nil || !under.readFrom {
		t.Fatalf("ReadFrom = %d, %v, by the connection's own %v; want 4 bytes by the connection's own", n, err, under.readFrom)
	}
}

// signalChildEnv makes the test below its own child process: a service run by Main whose drain
// lasts until its stdin closes.
const signalChildEnv = "PLATFORM_TEST_SIGNALLED_SERVICE"

// Ctrl-C in scripts/run-local.sh sends SIGINT to the services, and the script's trap SIGTERM a
// few milliseconds later: the same stop, twice. The service drains and exits 0. A signal repeated
// repeatSignalDelay after the first kills it at once.
func TestASecondSignalSoonAfterTheFirstDoesNotCutTheDrain(t *testing.T) {
	if os.Getenv(signalChildEnv) != "" {
		Main("order", func(ctx context.Context, _ *Env) error {
			log := NewLogger(os.Stdout, "order", "text", "info")
			drain := Worker(func(ctx context.Context) error {
				<-ctx.Done()
				_, err := io.Copy(io.Discard, os.Stdin)
				return err
			})
			return Serve(ctx, log, NewServer("127.0.0.1:0", http.NotFoundHandler()), Workers{Intake: []Worker{drain}})
		})
		return
	}
	t.Parallel()
	t.Run("within a second", func(t *testing.T) {
		t.Parallel()
		c := startSignalChild(t)
		signalled := time.Now()
		c.signal(t, os.Interrupt)
		c.shuttingDown(t)
		c.signal(t, syscall.SIGTERM)
		if d := time.Since(signalled); d >= repeatSignalDelay {
			t.Fatalf("SIGTERM came %s after SIGINT, not within %s: the test proves nothing", d, repeatSignalDelay)
		}
		_ = c.stdin.Close() // the drain ends
		if err := within(t, c.done, 10*time.Second, "the service did not exit"); err != nil {
			t.Fatalf("the service ended with %v after SIGINT and SIGTERM, want exit status 0\n%s", err, c.out)
		}
		if len(c.out.Lines("msg=stopped")) != 1 {
			t.Fatalf("no stopped line: the drain was cut short\n%s", c.out)
		}
	})
	t.Run("a second later", func(t *testing.T) {
		t.Parallel()
		c := startSignalChild(t)
		signalled := time.Now()
		c.signal(t, os.Interrupt)
		c.shuttingDown(t)
		var err error
		for deadline := time.Now().Add(HardStop / 2); ; {
			_ = c.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case err = <-c.done:
			case <-time.After(20 * time.Millisecond):
				if time.Now().Before(deadline) {
					continue
				}
				t.Fatalf("still running %s after SIGINT, and SIGTERM since\n%s", HardStop/2, c.out)
			}
			break
		}
		took := time.Since(signalled)
		var exit *exec.ExitError
		if !errors.As(err, &exit) || !exit.Sys().(syscall.WaitStatus).Signaled() || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGTERM {
			t.Fatalf("the service ended with %v, want killed by SIGTERM\n%s", err, c.out)
		}
		if took < repeatSignalDelay {
			t.Fatalf("killed %s after the first signal, want no sooner than %s", took.Round(time.Millisecond), repeatSignalDelay)
		}
	})
}

// signalChild is the test binary run as the service of signalChildEnv.
type signalChild struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *testenv.Logs
	done  chan error
}

func startSignalChild(t *testing.T) *signalChild {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), HardStop+20*time.Second)
	t.Cleanup(cancel)
	c := &signalChild{out: &testenv.Logs{}, done: make(chan error, 1)}
	c.cmd = exec.CommandContext(ctx, os.Args[0], "-test.run=^TestASecondSignalSoonAfterTheFirstDoesNotCutTheDrain$")
	c.cmd.Env = append(os.Environ(), signalChildEnv+"=1")
	c.cmd.Stdout, c.cmd.Stderr = c.out, c.out
	var err error
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { c.done <- c.cmd.Wait() }()
	t.Cleanup(func() { _ = c.stdin.Close() })
	testenv.Eventually(t, 10*time.Second, func() bool { return len(c.out.Lines("msg=listening")) == 1 }, "the service does not listen\n%s", c.out)
	return c
}

func (c *signalChild) signal(t *testing.T, sig os.Signal) {
	t.Helper()
	if err := c.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
}

// shuttingDown waits until the service says it is stopping: the first signal has arrived.
func (c *signalChild) shuttingDown(t *testing.T) {
	t.Helper()
	testenv.Eventually(t, 5*time.Second, func() bool { return len(c.out.Lines(`msg="shutting down"`)) == 1 }, "the service is not stopping\n%s", c.out)
}

// dialed is a TCP connection to addr, closed at the test's end.
func dialed(t *testing.T, addr string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}
