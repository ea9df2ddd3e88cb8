package platform

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"strings"
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
