package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// ctl runs outboxctl in-process with args and returns its exit status and output.
func ctl(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out, errOut bytes.Buffer
	code = run(ctx, args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// ok runs outboxctl and fails the test unless it exits 0; it returns what it printed.
func ok(t *testing.T, args ...string) string {
	t.Helper()
	code, stdout, stderr := ctl(t, args...)
	if code != 0 {
		t.Fatalf("outboxctl %s exited %d: %s", strings.Join(args, " "), code, stderr)
	}
	return stdout
}

// outboxDB is a fresh database with the outbox table.
func outboxDB(t *testing.T) *testenv.Database {
	t.Helper()
	d := testenv.NewDatabase(t)
	d.Migrate(t, messaging.MigrateOutbox)
	return d
}

// Flags may come before or after the positional arguments; -- ends the flags.
func TestParseTakesFlagsWhereverTheyStand(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"invoicing", "--amqp", "A", "--id", "I"},
		{"--amqp", "A", "invoicing", "--id", "I"},
		{"--amqp=A", "--id=I", "invoicing"},
		{"--id", "I", "--amqp", "A", "--", "invoicing"},
	} {
		fs := newFlags("test")
		amqpURL, id := fs.String("amqp", "", ""), fs.String("id", "", "")
		pos, err := parse(fs, args, "QUEUE")
		if err != nil || !slices.Equal(pos, []string{"invoicing"}) || *amqpURL != "A" || *id != "I" {
			t.Errorf("parse(%q) = %q, %v with amqp=%q id=%q; want [invoicing], amqp A, id I", args, pos, err, *amqpURL, *id)
		}
	}
	fs := newFlags("test")
	if pos, err := parse(fs, []string{"--", "-odd-name"}, "QUEUE"); err != nil || !slices.Equal(pos, []string{"-odd-name"}) {
		t.Errorf("after --: %q, %v; want the name as it is", pos, err)
	}
	var usageErr usageError
	if _, err := parse(newFlags("test"), []string{"a", "b"}, "QUEUE"); !errors.As(err, &usageErr) {
		t.Errorf("two arguments for one: %v, want a usage error", err)
	}
	if _, err := parse(newFlags("test"), []string{"--nope"}); !errors.As(err, &usageErr) {
		t.Errorf("an unknown flag: %v, want a usage error", err)
	}
	if _, err := parse(newFlags("test"), []string{"-h"}); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h: %v, want flag.ErrHelp", err)
	}
}

// Without --db or --amqp, and with the variable unset, each command says which variable.
// Not parallel: it unsets the process's variables.
func TestAMissingURLNamesItsVariable(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	t.Setenv("AMQP_URL", "")
	for _, tc := range []struct {
		args     []string
		variable string
	}{
		{[]string{"status"}, "DATABASE_URL"},
		{[]string{"retry"}, "DATABASE_URL"},
		{[]string{"retry", "--id", uuid.NewString()}, "DATABASE_URL"},
		{[]string{"dlq", "list", "invoicing"}, "AMQP_URL"},
		{[]string{"dlq", "redrive", "invoicing"}, "AMQP_URL"},
	} {
		code, _, stderr := ctl(t, tc.args...)
		if code == 0 || !strings.Contains(stderr, tc.variable) || !strings.Contains(stderr, "--"+map[string]string{"DATABASE_URL": "db", "AMQP_URL": "amqp"}[tc.variable]) {
			t.Errorf("outboxctl %s: exit %d, stderr %q; want non-zero naming %s and its flag", strings.Join(tc.args, " "), code, stderr, tc.variable)
		}
	}
	// The variable is enough when it is set.
	d := outboxDB(t)
	t.Setenv("DATABASE_URL", d.URL)
	ok(t, "status")
}

func TestCommandLineMistakesExit2WithTheUsage(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"dlq"},
		{"dlq", "peek", "invoicing"},
		{"dlq", "list"},
		{"dlq", "list", "a", "b", "--amqp", testenv.AMQPURL()},
		{"status", "extra", "--db", "postgres://127.0.0.1/x"},
		{"retry", "--id", "not-a-uuid", "--db", "postgres://127.0.0.1/x"},
		{"dlq", "redrive", "invoicing", "--id", "42", "--amqp", testenv.AMQPURL()},
		{"status", "--db", "http://127.0.0.1/x"},
	} {
		code, _, stderr := ctl(t, args...)
		if code != 2 || !strings.Contains(stderr, "usage:") {
			t.Errorf("outboxctl %q: exit %d, stderr %q; want 2 with the usage", args, code, stderr)
		}
	}
	if code, stdout, _ := ctl(t, "--help"); code != 0 || !strings.Contains(stdout, "dlq redrive QUEUE") {
		t.Errorf("--help: exit %d, %q", code, stdout)
	}
}

// No password of a URL shows in what outboxctl prints, whether it worked or not.
func TestOutputNeverShowsAPassword(t *testing.T) {
	t.Parallel()
	const secret = "hunter2-s3cret"
	d := outboxDB(t)
	// The test server trusts local connections, so this password is accepted, and unused.
	withPassword := strings.Replace(d.URL, "postgres@", "postgres:"+secret+"@", 1)
	if !strings.Contains(withPassword, secret) {
		t.Fatalf("test URL %q has no password", withPassword)
	}
	runs := [][]string{
		{"status", "--db", withPassword},
		{"status", "--db", "postgres://postgres:" + secret + "@127.0.0.1:1/x?sslmode=disable"},
		{"retry", "--db=postgres://postgres@127.0.0.1:1/x?password=" + secret},
		{"dlq", "list", "invoicing", "--amqp", strings.Replace(testenv.AMQPURL(), "guest:guest", "guest:"+secret, 1)},
		{"dlq", "redrive", "invoicing", "--amqp", "amqp://guest:" + secret + "@127.0.0.1:1/"},
	}
	for _, args := range runs {
		code, stdout, stderr := ctl(t, args...)
		if strings.Contains(stdout+stderr, secret) {
			t.Errorf("outboxctl %s printed the password: %q %q", args[0], stdout, stderr)
		}
		if args[1] == "--db" && args[2] == withPassword && (code != 0 || !strings.Contains(stdout, "postgres:xxxxx@")) {
			t.Errorf("status with a password: exit %d, %q; want it to work and show the URL masked", code, stdout+stderr)
		}
	}
}

// The built binary exits 0 on success and non-zero on failure, saying why.
func TestBinaryExitStatus(t *testing.T) {
	t.Parallel()
	bin := filepath.Join(t.TempDir(), "outboxctl")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	d := outboxDB(t)
	if out, err := exec.Command(bin, "status", "--db", d.URL).CombinedOutput(); err != nil || !strings.Contains(string(out), "unsent rows:") {
		t.Fatalf("status: %v\n%s", err, out)
	}
	id := uuid.NewString()
	out, err := exec.Command(bin, "retry", "--db", d.URL, "--id", id).CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(string(out), id) {
		t.Fatalf("retry of an unknown id: %v, %q; want exit 1 naming the id", err, out)
	}
}
