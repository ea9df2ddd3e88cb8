package e2e

import (
	"context"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// A missing or malformed variable stops a service at once with one line naming it, and never
// prints the password of a URL.
func TestConfigurationErrorsNameTheVariable(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-pa55"
	valid := map[string]string{
		"DATABASE_URL": "postgres://u:" + secret + "@127.0.0.1:1/db",
		"AMQP_URL":     "amqp://u:" + secret + "@127.0.0.1:1/",
	}
	cases := []struct {
		service, variable, value string
	}{
		{"order", "DATABASE_URL", ""},
		{"order", "DATABASE_URL", "mysql://u:" + secret + "@h/db"},
		{"order", "AMQP_URL", ""},
		{"order", "AMQP_URL", "not a url " + secret},
		{"order", "OUTBOX_BATCH_SIZE", "lots"},
		{"order", "OUTBOX_LANES", "0"},
		{"order", "OUTBOX_POLL_INTERVAL", "1 second"},
		{"order", "OUTBOX_MAX_BACKOFF", "1ms"},
		{"order", "LOG_LEVEL", "loud"},
		{"order", "LOG_FORMAT", "xml"},
		{"invoicing", "DATABASE_URL", ""},
		{"invoicing", "CONSUMER_CONCURRENCY", "0"},
		{"notification", "AMQP_URL", "http://u:" + secret + "@h/"},
		{"notification", "NOTIFY_MAX_BACKOFF", "forever"},
	}
	for _, c := range cases {
		env := []string{"PATH=/usr/bin:/bin"}
		for k, v := range valid {
			if k != c.variable {
				env = append(env, k+"="+v)
			}
		}
		if c.value != "" {
			env = append(env, c.variable+"="+c.value)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		cmd := exec.CommandContext(ctx, filepath.Join(binDir, c.service))
		cmd.Env = env
		out, err := systest.CombinedOutput(cmd)
		cancel()
		text := strings.TrimSpace(string(out))
		var exit *exec.ExitError
		if err == nil || !errors.As(err, &exit) || exit.ExitCode() != 1 {
			t.Errorf("%s with %s=%q: %v, want exit status 1", c.service, c.variable, c.value, err)
		}
		if strings.Count(text, "\n") != 0 || !strings.HasPrefix(text, c.service+": config: ") || !strings.Contains(text, c.variable) {
			t.Errorf("%s with %s=%q printed %q, want one line naming %s", c.service, c.variable, c.value, text, c.variable)
		}
		if strings.Contains(text, secret) {
			t.Errorf("%s printed a secret: %q", c.service, text)
		}
	}
}

// A service stopped by SIGTERM while it waits for its database exits 0 at once, having logged
// the wait: a clean exit, not a crash of a start cut short.
func TestASignalWhileWaitingForTheDatabaseExitsCleanly(t *testing.T) {
	t.Parallel()
	for _, service := range []string{"order", "invoicing", "notification"} {
		t.Run(service, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(filepath.Join(binDir, service))
			cmd.Env = []string{"PATH=/usr/bin:/bin", "DATABASE_URL=postgres://postgres@" + systest.FreeAddr(t) + "/db?sslmode=disable",
				"AMQP_URL=amqp://guest:guest@" + systest.FreeAddr(t) + "/", "HTTP_ADDR=127.0.0.1:0"}
			sigtermExitsZero(t, cmd, 10*time.Second, 10*time.Second, "its wait for the database logged",
				func(out string) bool { return strings.Contains(out, `msg="waiting for the database"`) })
		})
	}
}

// sigtermExitsZero starts cmd and, once ready (given its output so far) says it is under way,
// which it must within readyIn, sends it SIGTERM and wants exit status 0 within exitIn. The
// process is killed when the test ends, whatever happened, and dies with the test binary.
func sigtermExitsZero(t *testing.T, cmd *exec.Cmd, readyIn, exitIn time.Duration, what string, ready func(out string) bool) {
	t.Helper()
	out := new(testenv.Logs) // written by exec's copying goroutine, read here
	cmd.Stdout, cmd.Stderr = out, out
	exited, err := systest.StartProcess(cmd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	name := filepath.Base(cmd.Path)
	testenv.Eventually(t, readyIn, func() bool { return ready(out.String()) }, "%s: not under way (%s):\n%s", name, what, out)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("%s after SIGTERM (%s): %v, want exit 0\n%s", name, what, err, out)
		}
	case <-time.After(exitIn):
		t.Fatalf("%s still runs %s after SIGTERM (%s)\n%s", name, exitIn, what, out)
	}
}
