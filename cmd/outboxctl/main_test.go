package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// ctl runs outboxctl in-process with args, with no terminal, and returns its exit status and
// output.
func ctl(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	return ctlAt(t, nil, args...)
}

// terminal is a person at a terminal who types answer.
type terminal struct{ answer string }

// ctlAt runs outboxctl as ctl does, at term if it is not nil.
func ctlAt(t *testing.T, term *terminal, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out, errOut bytes.Buffer
	s := streams{in: strings.NewReader(""), out: &out, err: &errOut}
	if term != nil {
		s.in, s.interactive = strings.NewReader(term.answer), true
	}
	code = run(ctx, args, s)
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

// okJSON runs outboxctl with -o json, fails the test unless it exits 0, and decodes what it
// printed into a new T.
func okJSON[T any](t *testing.T, args ...string) T {
	t.Helper()
	return decode[T](t, ok(t, append(args, "-o", "json")...))
}

// decode decodes out, all of it, into a new T; unknown fields fail it.
func decode[T any](t *testing.T, out string) T {
	t.Helper()
	var v T
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("decode %T: %v\n%s", v, err, out)
	}
	if dec.More() {
		t.Fatalf("more than one JSON value:\n%s", out)
	}
	return v
}

// wantExit runs outboxctl and fails the test unless it exits code with stderr holding each of
// want; it returns stdout.
func wantExit(t *testing.T, code int, args []string, want ...string) string {
	t.Helper()
	got, stdout, stderr := ctl(t, args...)
	if got != code {
		t.Errorf("outboxctl %s: exit %d, want %d; stderr %q", strings.Join(args, " "), got, code, stderr)
	}
	for _, w := range want {
		if !strings.Contains(stderr, w) {
			t.Errorf("outboxctl %s: stderr %q lacks %q", strings.Join(args, " "), stderr, w)
		}
	}
	return stdout
}

// outboxDB is a fresh database with the outbox table.
func outboxDB(t *testing.T) *testenv.Database {
	t.Helper()
	d := testenv.NewDatabase(t)
	d.Migrate(t, platform.Library(messaging.MigrateOutbox))
	return d
}

// Without --db or --amqp, and with the variable unset, each command says which variable.
// Not parallel: it unsets the process's variables.
func TestAMissingURLNamesItsVariable(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	t.Setenv("AMQP_URL", "")
	id := uuid.NewString()
	for _, tc := range []struct {
		args     []string
		variable string
	}{
		{[]string{"status"}, "DATABASE_URL"},
		{[]string{"retry"}, "DATABASE_URL"},
		{[]string{"retry", "--id", id}, "DATABASE_URL"},
		{[]string{"outbox", "park", "--id", id}, "DATABASE_URL"},
		{[]string{"outbox", "unpark", "--id", id}, "DATABASE_URL"},
		{[]string{"outbox", "drop", "--id", id}, "DATABASE_URL"},
		{[]string{"inbox", "show", "--id", id}, "DATABASE_URL"},
		{[]string{"dlq", "list", "invoicing"}, "AMQP_URL"},
		{[]string{"dlq", "redrive", "invoicing"}, "AMQP_URL"},
		{[]string{"dlq", "drop", "invoicing", "--id", id}, "AMQP_URL"},
	} {
		flagName := map[string]string{"DATABASE_URL": "--db", "AMQP_URL": "--amqp"}[tc.variable]
		wantExit(t, 2, tc.args, tc.variable, flagName)
	}
	// The variable is enough when it is set.
	d := outboxDB(t)
	t.Setenv("DATABASE_URL", d.URL)
	ok(t, "status")
}

func TestCommandLineMistakesExit2WithTheUsage(t *testing.T) {
	t.Parallel()
	db, amqpURL, id := "postgres://127.0.0.1/x", testenv.AMQPURL(), uuid.NewString()
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"dlq"},
		{"dlq", "peek", "invoicing"},
		{"outbox"},
		{"outbox", "bury", "--id", id},
		{"dlq", "list"},
		{"dlq", "list", "a", "b", "--amqp", amqpURL},
		{"status", "extra", "--db", db},
		{"status", "--db", db, "-o", "yaml"},
		{"status", "--nope"},
		{"retry", "--id", "not-a-uuid", "--db", db},
		{"retry", "--id", id, "--type", "OrderPlaced", "--db", db},
		{"retry", "--limit", "-1", "--db", db},
		{"retry", "--limit", "many", "--db", db},
		{"retry", "--batch", "0", "--db", db},
		{"retry", "--id", id, "--batch", "5", "--db", db},
		{"outbox", "park", "--db", db},
		{"outbox", "drop", "--id", "42", "--db", db},
		{"inbox", "show", "--db", db},
		{"dlq", "redrive", "invoicing", "--id", "", "--amqp", amqpURL},
		{"dlq", "redrive", "invoicing", "--type", "", "--yes", "--amqp", amqpURL},
		{"retry", "--id", "", "--yes", "--db", db},
		{"dlq", "drop", "invoicing", "--id", "x", "--without-id", "--amqp", amqpURL},
		{"dlq", "redrive", "invoicing", "--id", id, "--reason", "x", "--amqp", amqpURL},
		{"dlq", "drop", "invoicing", "--amqp", amqpURL},
		{"dlq", "drop", "invoicing", "--without-id=false", "--yes", "--amqp", amqpURL},
		{"dlq", "list", "invoicing", "--limit", "-5", "--amqp", amqpURL},
		{"dlq", "drop", "invoicing", "--id", id, "--limit", "0", "--yes", "--amqp", amqpURL},
		{"dlq", "drop", "invoicing", "--id", id, "--limit", "-1", "--yes", "--amqp", amqpURL},
		{"status", "--db", "http://127.0.0.1/x"},
		{"status", "--db", "postgres://127.0.0.1:99999/x"},
		{"status", "--db", "postgres:///x?host=/run/postgresql&port=0"},
		{"dlq", "list", "invoicing", "--amqp", "amqp://127.0.0.1:0/"},
		{"version", "extra"},
		{"dlq", "list", "invoicing", "--amqp", ","},
		{"dlq", "redrive", "invoicing", "--amqp", " "},
		{"dlq", "list", "", "--amqp", amqpURL},
		{"dlq", "drop", " ", "--id", id, "--yes", "--amqp", amqpURL},
		{"retry", "--limit", "3000000000", "--db", db},
		{"retry", "--batch", "3000000000", "--db", db},
	} {
		code, stdout, stderr := ctl(t, args...)
		if code != 2 || !strings.Contains(stderr, "Usage:") || stdout != "" {
			t.Errorf("outboxctl %q: exit %d, stdout %q, stderr %q; want 2 with the usage on stderr", args, code, stdout, stderr)
		}
	}
	// Go's flag package took -db for --db: say what was meant.
	if code, _, stderr := ctl(t, "status", "-db", db); code != 2 || !strings.Contains(stderr, "a long flag takes two dashes: --db") {
		t.Errorf("outboxctl status -db: exit %d, stderr %q; want 2 saying --db", code, stderr)
	}
}

// A flag given a blank value is refused as an empty one, by name, before anything is read or
// changed: --reason " " is in nearly every reason, and --type " " would pick no type.
func TestABlankFlagIsRefusedAsAnEmptyOne(t *testing.T) {
	t.Parallel()
	db, amqpURL, id := "postgres://127.0.0.1/x", testenv.AMQPURL(), uuid.NewString()
	for _, c := range []struct {
		flag string
		args []string
	}{
		{"--reason", []string{"dlq", "redrive", "q", "--reason", " ", "--dry-run", "--amqp", amqpURL}},
		{"--reason", []string{"dlq", "list", "q", "--reason", "\t", "--amqp", amqpURL}},
		{"--type", []string{"dlq", "redrive", "q", "--type", "  ", "--yes", "--amqp", amqpURL}},
		{"--type", []string{"retry", "--type", " ", "--yes", "--db", db}},
		{"--id", []string{"retry", "--id", " ", "--db", db}},
		{"--reason", []string{"outbox", "park", "--id", id, "--reason", " ", "--db", db}},
		{"--consumer", []string{"inbox", "show", "--id", id, "--consumer", " ", "--db", db}},
	} {
		wantExit(t, exitUsage, c.args, c.flag+" given an empty or blank value")
	}
}

// --help, of outboxctl and of each command, and the help command, print that command's help
// on stdout and exit 0; the root's lists every command with its flags.
func TestHelpOfEachCommand(t *testing.T) {
	t.Parallel()
	root := ok(t, "--help")
	for _, want := range append(strings.Split(synopsis, "\n"), "Exit status:", "3  nothing matched", "4  not confirmed",
		"a dead-letter queue too long to take without --limit") {
		if !strings.Contains(root, want) {
			t.Errorf("outboxctl --help lacks %q:\n%s", want, root)
		}
	}
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"status", "--help"}, []string{"outboxctl status [flags]", "--db string", "parked"}},
		{[]string{"retry", "-h"}, []string{"outboxctl retry [flags]", "--dry-run", "--yes", "--limit int", "--type string", "Exit status 3"}},
		{[]string{"outbox", "--help"}, []string{"outboxctl outbox COMMAND", "park", "unpark", "drop"}},
		{[]string{"outbox", "park", "--help"}, []string{"outboxctl outbox park --id UUID [flags]", "--reason string", "outbox_parked_messages"}},
		{[]string{"outbox", "unpark", "--help"}, []string{"outboxctl outbox unpark --id UUID [flags]"}},
		{[]string{"outbox", "drop", "--help"}, []string{"outboxctl outbox drop --id UUID [flags]", "--yes", "payload"}},
		{[]string{"inbox", "show", "--help"}, []string{"outboxctl inbox show --id UUID [flags]", "--consumer string", "status 3"}},
		{[]string{"dlq", "list", "--help"}, []string{"outboxctl dlq list QUEUE [flags]", "--show-body", "--show-headers", "(default: all of them, if no more than 10000 wait)"}},
		{[]string{"dlq", "redrive", "invoicing", "--help"}, []string{"outboxctl dlq redrive QUEUE [flags]", "--reason string", "--dry-run"}},
		{[]string{"help", "dlq", "drop"}, []string{"outboxctl dlq drop QUEUE (--id ID | --without-id) [flags]", "purge_queue", "--limit int"}},
		{[]string{"version", "--help"}, []string{"outboxctl version [flags]", "-buildvcs"}},
	} {
		out := ok(t, tc.args...)
		for _, want := range append(tc.want, "-o, --output string") {
			if !strings.Contains(out, want) {
				t.Errorf("outboxctl %s lacks %q:\n%s", strings.Join(tc.args, " "), want, out)
			}
		}
		if strings.Contains(out, "outboxctl dlq redrive QUEUE [--id") {
			t.Errorf("outboxctl %s prints the global usage:\n%s", strings.Join(tc.args, " "), out)
		}
	}
}

// The package comment shows the commands as the help does.
func TestPackageCommentListsEveryCommand(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	var documented []string
	for line := range strings.SplitSeq(string(src), "\n") {
		if rest, ok := strings.CutPrefix(line, "//\toutboxctl "); ok {
			documented = append(documented, "  outboxctl "+rest)
		}
	}
	if got := strings.Join(documented, "\n"); got != synopsis {
		t.Errorf("the package comment lists\n%s\nthe help\n%s", got, synopsis)
	}
}

func TestVersion(t *testing.T) {
	t.Parallel()
	want := regexp.MustCompile(`^outboxctl \S+( \(revision [0-9a-f]+(, modified)?\))? go1\.\d+\S*\n$`)
	for _, args := range [][]string{{"--version"}, {"-v"}, {"version"}} {
		if out := ok(t, args...); !want.MatchString(out) {
			t.Errorf("outboxctl %s printed %q", args[0], out)
		}
	}
	v := okJSON[buildVersion](t, "version")
	if v.Version == "" || !strings.HasPrefix(v.Go, "go1.") {
		t.Errorf("version -o json: %+v", v)
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
	id := uuid.NewString()
	runs := [][]string{
		{"status", "--db", withPassword},
		{"status", "--db", withPassword, "-o", "json"},
		{"status", "--db", "postgres://postgres:" + secret + "@127.0.0.1:1/x?sslmode=disable"},
		{"retry", "--db=postgres://postgres@127.0.0.1:1/x?password=" + secret},
		{"status", "--db", "postgres://postgres@127.0.0.1:1,127.0.0.1:2/x?sslmode=disable&password=" + secret},
		{"outbox", "drop", "--id", id, "--db", withPassword, "--yes"},
		{"inbox", "show", "--id", id, "--db", withPassword},
		{"dlq", "list", "invoicing", "--amqp", strings.Replace(testenv.AMQPURL(), "guest:guest", "guest:"+secret, 1)},
		{"dlq", "redrive", "invoicing", "--amqp", "amqp://guest:" + secret + "@127.0.0.1:1/"},
		{"dlq", "drop", "invoicing", "--id", id, "--amqp", "amqp://guest:" + secret + "@127.0.0.1:1/"},
	}
	// A password with a / ? or # left unescaped ends the authority early, so the URL has no
	// password to hide: it is refused before anything prints it.
	unescaped := [][]string{
		{"status", "--db", "postgres://postgres:12/" + secret + "@127.0.0.1:1/x"},
		{"status", "--db", "postgres://postgres:12?" + secret + "@127.0.0.1:1/x", "-o", "json"},
		{"retry", "--db=postgres://postgres:12#" + secret + "@127.0.0.1:1/x"},
		{"dlq", "list", "invoicing", "--amqp", "amqp://guest@127.0.0.1:1/,amqp://guest:5/" + secret + "@127.0.0.1:2/"},
		{"dlq", "redrive", "invoicing", "--amqp", "amqp://guest:5#" + secret + "@127.0.0.1:1/"},
	}
	for _, args := range append(runs, unescaped...) {
		_, stdout, stderr := ctl(t, args...)
		if strings.Contains(stdout+stderr, secret) {
			t.Errorf("outboxctl %s printed the password: %q %q", strings.Join(args[:2], " "), stdout, stderr)
		}
	}
	for _, args := range unescaped {
		code, _, stderr := ctl(t, args...)
		source := "--db"
		if args[0] == "dlq" {
			source = "--amqp"
		}
		if code != exitUsage || !strings.Contains(stderr, source+" has an @ after its host: percent-encode") {
			t.Errorf("outboxctl %s with a password left unescaped: exit %d, %q; want a usage error saying to percent-encode it", strings.Join(args[:2], " "), code, stderr)
		}
	}
	if out := ok(t, "status", "--db", withPassword); !strings.Contains(out, "postgres:xxxxx@") {
		t.Errorf("status with a password: %q; want the URL masked", out)
	}
	if s := okJSON[statusResult](t, "status", "--db", withPassword); !strings.Contains(s.Database, "postgres:xxxxx@") {
		t.Errorf("status -o json with a password: database %q; want the URL masked", s.Database)
	}
}

// A driver's error is not trusted to leave a password out, however the URL wrote it: pgx sends
// a parameter it does not know, PassWord= say, to the server as a setting, and another driver or
// version may quote it back.
func TestErrorsHideEveryPasswordParameter(t *testing.T) {
	t.Parallel()
	const secret = "hunter2-s3cret"
	for _, arg := range []string{
		"--db=postgres://postgres@db/x?PassWord=" + secret,
		"postgres://postgres@db/x?SSLPASSWORD=" + secret,
		"postgres://postgres@db/x?password=first&password=" + secret,
	} {
		msg := hideSecrets(`connect: unrecognized configuration parameter "PassWord" = "`+secret+`"`, []string{"status", "--db", arg})
		if strings.Contains(msg, secret) {
			t.Errorf("with %s: %q; want the password hidden", arg, msg)
		}
	}
}

// pgx quotes the URL outboxctl rebuilt (application_name added), not the one given, and
// masks only password= in lower case: a password written otherwise is hidden all the same. The
// unreadable CA file fails the command before any connection.
func TestAPasswordInTheRebuiltURLIsHidden(t *testing.T) {
	t.Parallel()
	for _, param := range []string{"Password=hunter2%21s3cr%2fet", "PASSWORD=hunter2%20s3cret", "SSLPASSWORD=hunter2!s3cret"} {
		code, stdout, stderr := ctl(t, "status", "--db", "postgres://u@db.invalid/db?"+param+"&sslrootcert=/nowhere/ca.crt")
		if code != exitFailure || strings.Contains(stdout+stderr, "hunter2") || !strings.Contains(stderr, "ca.crt") {
			t.Errorf("status with %s and an unreadable CA file: exit %d, %q %q; want 1 naming the file, the password hidden", param, code, stdout, stderr)
		}
	}
}

// Hiding a password hides it as a word, not the words that contain it, nor a user's name that
// is also the password (compose's invoicing:invoicing): the in-doubt message names the queue,
// its dead-letter queue and the consumer, and must stay readable. Not parallel: it sets the
// process's variables.
func TestHidingPasswordsKeepsTheMessageReadable(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	t.Setenv("AMQP_URL", "")
	for _, c := range []struct{ url, msg, want string }{
		{"postgres://invoicing:invoicing@db/invoicing_db", "may be in both invoicing and invoicing.dlq: outboxctl inbox show --consumer invoicing",
			"may be in both invoicing and invoicing.dlq: outboxctl inbox show --consumer invoicing"},
		{"amqp://u:p@h/", `dial tcp 127.0.0.1:1: "p" refused`, `dial tcp 127.0.0.1:1: "xxxxx" refused`},
		{"amqp://u:s3cret@h/", "user=u password=s3cret, s3cret2 x-s3cret", "user=u password=xxxxx, s3cret2 x-xxxxx"},
		{"postgres://u:-%21@h/", "a-! b", "axxxxx b"},
	} {
		if got := hideSecrets(c.msg, []string{"status", "--db", c.url}); got != c.want {
			t.Errorf("with %s: %q, want %q", c.url, got, c.want)
		}
	}
}

// A URL whose parameters the client refuses is a usage error, found before anything connects,
// that names the flag and its variable and never shows the password. Not parallel: it sets the
// process's variables.
func TestAURLTheClientRefusesIsAUsageError(t *testing.T) {
	const secret = "hunter2-s3cret"
	t.Setenv("DATABASE_URL", "postgres://u:"+secret+"@h/db?connect_timeout=x")
	t.Setenv("AMQP_URL", "amqp://g@127.0.0.1:1/,amqp://u:"+secret+"@h/v?channel_max=x")
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"status"}, []string{"DATABASE_URL (the default of --db) does not parse: invalid connect_timeout"}},
		{[]string{"retry", "--db", "postgres://u:" + secret + "@h/db?sslmode=bogus"}, []string{"--db does not parse: ", "sslmode is invalid", "$DATABASE_URL"}},
		{[]string{"dlq", "list", "q"}, []string{"AMQP_URL (the default of --amqp) does not parse: channel_max"}},
		{[]string{"dlq", "redrive", "q", "--amqp", "amqp://u:" + secret + "@h/v?heartbeat=abc", "-o", "json"}, []string{"--amqp does not parse: heartbeat", "$AMQP_URL"}},
	} {
		code, stdout, stderr := ctl(t, tc.args...)
		if code != exitUsage || stdout != "" || strings.Contains(stderr, secret) {
			t.Errorf("outboxctl %s: exit %d, stdout %q, stderr %q; want 2, nothing on stdout, no password", strings.Join(tc.args, " "), code, stdout, stderr)
		}
		for _, w := range tc.want {
			if !strings.Contains(stderr, w) {
				t.Errorf("outboxctl %s: stderr %q lacks %q", strings.Join(tc.args, " "), stderr, w)
			}
		}
	}
	// A file the URL names that cannot be read is the environment's fault: exit 1, as when
	// the database cannot be reached, not a mistake in the command line.
	code, _, stderr := ctl(t, "status", "--db", "postgres://u:"+secret+"@127.0.0.1:1/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem")
	if code != exitFailure || !strings.Contains(stderr, "unable to read CA file") || strings.Contains(stderr, secret) {
		t.Errorf("status with a CA file that does not exist: exit %d, stderr %q; want 1 naming the file's fault, no password", code, stderr)
	}
}

// A list of brokers' URLs whose entries name different vhosts is a usage error that names
// where it came from, as the services refuse it: the library dials the entries in random
// order, so the command would act on whichever vhost answered. Nothing listens on the ports:
// refused, the command reaches no broker. Not parallel: it sets AMQP_URL.
func TestABrokerListOfDifferentVhostsIsAUsageError(t *testing.T) {
	const secret = "hunter2-s3cret"
	mixed := "amqp://u:" + secret + "@127.0.0.1:1/prod,amqp://u:" + secret + "@127.0.0.1:2/staging"
	id := uuid.NewString()
	commands := [][]string{
		{"dlq", "list", "invoicing"},
		{"dlq", "redrive", "invoicing", "--yes"},
		{"dlq", "drop", "invoicing", "--id", id, "--yes"},
	}
	t.Setenv("AMQP_URL", "")
	for _, args := range commands {
		stdout := wantExit(t, exitUsage, append(args, "--amqp", mixed), `--amqp names different vhosts, "prod" and "staging"`, "Usage:")
		if stdout != "" {
			t.Errorf("outboxctl %s: stdout %q; want nothing", strings.Join(args, " "), stdout)
		}
	}
	t.Setenv("AMQP_URL", mixed)
	for _, args := range commands {
		wantExit(t, exitUsage, args, `AMQP_URL (the default of --amqp) names different vhosts, "prod" and "staging"`)
	}
	for _, args := range commands {
		if _, _, stderr := ctl(t, args...); strings.Contains(stderr, secret) {
			t.Errorf("outboxctl %s: stderr %q shows the password", strings.Join(args, " "), stderr)
		}
	}
	// The default vhost has three spellings, all the same vhost: the list passes, and the
	// command fails at the brokers that are not there.
	t.Setenv("AMQP_URL", "amqp://u:p@127.0.0.1:1,amqp://u:p@127.0.0.1:2/,amqp://u:p@127.0.0.1:3/%2F")
	wantExit(t, exitFailure, []string{"dlq", "list", "invoicing"}, "connection refused")
}

// A PostgreSQL URL may name several hosts, tried in turn, as the services take it (only a
// broker's URL is a comma-separated list of URLs).
func TestADatabaseURLOfSeveralHosts(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	u, err := url.Parse(d.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = "127.0.0.1:1," + u.Host // nothing listens on the first
	if s := okJSON[statusResult](t, "status", "--db", u.String()); s.Unsent != 0 {
		t.Errorf("status of an empty outbox through a URL of two hosts: %+v", s)
	}
}

// A PostgreSQL URL that gives its host in host= (as a Unix socket's directory is given:
// postgres:///db?host=/var/run/postgresql) is a URL, as the services take it.
func TestADatabaseURLWithItsHostInTheQuery(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	inQuery := testenv.HostInQuery(t, d.URL)
	if s := okJSON[statusResult](t, "status", "--db", inQuery); s.Unsent != 0 {
		t.Errorf("status of an empty outbox through %s: %+v", inQuery, s)
	}
}

// A PostgreSQL URL whose parameters are percent-escaped reaches the server as written: a service
// that keeps its tables in a schema of its own (options=-c%20search_path%3Dapp, or
// search_path="my app") has outboxctl act on that schema's outbox, not public's. Rebuilt through
// url.Values, the %20 became a +, which pgx reads as a plus: the server refused -c+search_path,
// and search_path="my+app", naming no schema, left public's table in use.
func TestADatabaseURLsSearchPathPicksTheOutbox(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+2) // and a pool of one in each schema
	d := outboxDB(t)
	enqueue(t, d.DB, 1) // public's
	for i, tc := range []struct{ schema, param string }{
		{"app", "options=-c%20search_path%3Dapp"},
		{`"my app"`, "search_path=%22my%20app%22,public"},
	} {
		execSQL(t, d.DB, "CREATE SCHEMA "+tc.schema)
		withParam := d.URL + "?" + tc.param
		if strings.Contains(d.URL, "?") {
			withParam = d.URL + "&" + tc.param
		}
		inSchema := testenv.OpenPool(t, withParam, 1)
		if err := platform.Library(messaging.MigrateOutbox)(context.Background(), slog.New(slog.DiscardHandler), inSchema); err != nil {
			t.Fatalf("migrate %s: %v", tc.schema, err)
		}
		enqueue(t, inSchema, i+2)
		if n := testenv.Count(t, d.DB, "SELECT count(*) FROM "+tc.schema+".outbox_messages"); n != int64(i+2) {
			t.Fatalf("%s.outbox_messages has %d rows, want %d", tc.schema, n, i+2)
		}
		code, out, stderr := ctl(t, "status", "-o", "json", "--db", withParam)
		if code != 0 {
			t.Errorf("status through ?%s: exit %d: %s", tc.param, code, stderr)
			continue
		}
		if s := decode[statusResult](t, out); s.Unsent != int64(i+2) {
			t.Errorf("status through ?%s counts %d unsent rows, want the %d of %s.outbox_messages", tc.param, s.Unsent, i+2, tc.schema)
		}
	}
}

// The built binary: its exit statuses, its version, and, with no terminal on stdin, a drop
// refused without --yes and a retry of more than one row done.
func TestBinary(t *testing.T) {
	t.Parallel()
	bin := buildCtl(t)
	exitOf := func(err error) int { return processExit(t, err) }
	d := outboxDB(t)
	if out, err := exec.Command(bin, "status", "--db", d.URL).CombinedOutput(); err != nil || !strings.Contains(string(out), "unsent rows:") {
		t.Fatalf("status: %v\n%s", err, out)
	}
	id := uuid.NewString()
	out, err := exec.Command(bin, "retry", "--db", d.URL, "--id", id).CombinedOutput()
	if exitOf(err) != exitNoMatch || !strings.Contains(string(out), id) {
		t.Errorf("retry of an unknown id: %v, %q; want exit 3 naming the id", err, out)
	}
	out, err = exec.Command(bin, "status", "--db").CombinedOutput()
	if exitOf(err) != exitUsage || !strings.Contains(string(out), "Usage:") {
		t.Errorf("a flag without its value: %v, %q; want exit 2 with the usage", err, out)
	}

	// stdin is /dev/null: no terminal to ask on.
	ids := enqueue(t, d.DB, 2)
	fail(t, d.DB, ids[0], 3, "message nacked by the broker")
	fail(t, d.DB, ids[1], 3, "message nacked by the broker")
	before := outboxState(t, d)
	out, err = exec.Command(bin, "outbox", "drop", "--id", ids[0].String(), "--db", d.URL).CombinedOutput()
	if exitOf(err) != exitNotConfirmed || !strings.Contains(string(out), "no terminal to ask on") || !strings.Contains(string(out), "--yes") {
		t.Errorf("drop without a terminal: %v, %q; want exit 4 asking for --yes", err, out)
	}
	if after := outboxState(t, d); after != before {
		t.Errorf("a refused drop changed the outbox:\n%s\n%s", before, after)
	}
	out, err = exec.Command(bin, "retry", "--db", d.URL).CombinedOutput()
	if exitOf(err) != 0 || !strings.Contains(string(out), "2 failed outbox rows were waiting") {
		t.Errorf("retry of 2 rows without a terminal: %v, %q; want both retried", err, out)
	}

	// A hang-up (the terminal or the SSH session closed) stops a command as an interrupt does:
	// a drop waiting for its row's lock changes nothing and exits 1. Killed by the signal, a
	// redrive would have left what it held to the broker's order, and its output unwritten.
	beforeHangUp := outboxState(t, d)
	batch := d.DB.Begin()
	defer batch.Rollback()
	if err := batch.Exec(`SELECT id FROM outbox_messages WHERE id = ? FOR UPDATE`, ids[0]).Error; err != nil {
		t.Fatal(err)
	}
	drop := exec.Command(bin, "outbox", "drop", "--id", ids[0].String(), "--yes", "--db", d.URL)
	var dropOut bytes.Buffer
	drop.Stdout, drop.Stderr = &dropOut, &dropOut
	if err := drop.Start(); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool {
		return lockWaiters(t, d) == 1
	}, "the drop never waited for the row's lock")
	if err := drop.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	if code := exitOf(drop.Wait()); code != exitFailure || !strings.Contains(dropOut.String(), "context canceled") {
		t.Errorf("drop hung up while it waited: exit %d, %q; want 1, stopped as by an interrupt", code, dropOut.String())
	}
	// The drop's session may outlive it, still queued for the lock (the server does not notice
	// a closed client while it waits): end it, so that the next waiter counted is the next drop.
	execSQL(t, d.DB, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return lockWaiters(t, d) == 0
	}, "the hung-up drop's session still waits")
	// Under nohup the hang-up is ignored, as asked: the drop goes on once the lock is free.
	nohup := exec.Command("nohup", bin, "outbox", "drop", "--id", ids[0].String(), "--yes", "--db", d.URL)
	var nohupOut bytes.Buffer
	nohup.Stdout, nohup.Stderr = &nohupOut, &nohupOut
	if err := nohup.Start(); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool {
		return lockWaiters(t, d) == 1
	}, "the drop under nohup never waited for the row's lock")
	if err := nohup.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	if after := outboxState(t, d); after != beforeHangUp {
		t.Errorf("a drop hung up changed the outbox:\n%s\n%s", beforeHangUp, after)
	}
	batch.Rollback()
	if code := exitOf(nohup.Wait()); code != exitOK || !strings.Contains(nohupOut.String(), "dropped outbox row "+ids[0].String()) {
		t.Errorf("a drop under nohup, hung up while it waited: exit %d, %q; want it to go on and drop the row", code, nohupOut.String())
	}

	// --version says what the go command recorded: the revision, where it stamped one (not in
	// a git worktree, whose .git is a file).
	version, err := exec.Command(bin, "--version").Output()
	if err != nil {
		t.Fatal(err)
	}
	info, err := exec.Command("go", "version", "-m", bin).Output()
	if err != nil {
		t.Fatal(err)
	}
	stamped := regexp.MustCompile(`vcs\.revision=([0-9a-f]+)`).FindSubmatch(info)
	switch {
	case len(stamped) == 2 && !strings.Contains(string(version), "(revision "+string(stamped[1])):
		t.Errorf("--version %q lacks the revision the build recorded, %s", version, stamped[1])
	case stamped == nil && strings.Contains(string(version), "revision"):
		t.Errorf("--version %q shows a revision the build did not record", version)
	}
	t.Logf("--version: %s", version)
}

// buildCtl builds outboxctl into a directory of t's and returns its path.
func buildCtl(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "outboxctl")
	// The VCS stamp when the checkout allows it (the test machines' GOFLAGS turn it off).
	if out, err := exec.Command("go", "build", "-buildvcs=auto", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// runIntoPipe runs the built outboxctl with args, its stdout a pipe whose reader is closed at
// once, or, if afterALine, once the first line is read: it returns the exit status (-1 if a
// signal killed it) and stderr.
func runIntoPipe(t *testing.T, afterALine bool, args ...string) (int, string) {
	t.Helper()
	read, write, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer read.Close()
	if !afterALine {
		read.Close()
	}
	cmd := exec.Command(buildCtl(t), args...)
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = write, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	write.Close() // the process holds its own copy
	if afterALine {
		if _, err := bufio.NewReader(read).ReadString('\n'); err != nil {
			t.Fatalf("read the first line: %v", err)
		}
		read.Close()
	}
	return processExit(t, cmd.Wait()), stderr.String()
}

// exitWithin is the exit status codes gives within 30 s; failing t with what, if none comes.
func exitWithin(t *testing.T, codes <-chan int, what string) int {
	t.Helper()
	select {
	case code := <-codes:
		return code
	case <-time.After(30 * time.Second):
		t.Fatal(what)
		return 0
	}
}

// processExit is the exit status of a process that ended with err: -1 if a signal killed it.
func processExit(t *testing.T, err error) int {
	t.Helper()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.ExitCode()
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0
}

// The first signal stops a command in order, which may wait on a database that does not
// answer (here a drop's commit, which an interrupt lets finish); a second one kills it at once.
func TestASecondSignalKills(t *testing.T) {
	t.Parallel()
	bin := buildCtl(t)
	d := outboxDB(t)
	id := enqueue(t, d.DB, 1)[0]
	waiting, _ := holdCommits(t, d)
	drop := exec.Command(bin, "outbox", "drop", "--id", id.String(), "--yes", "--db", d.URL)
	var stderr testenv.Logs // a buffer the process writes while the test reads it
	drop.Stderr = &stderr
	if err := drop.Start(); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, waiting, "the drop never reached its commit")
	if err := drop.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return strings.Contains(stderr.String(), "a second signal stops it at once") },
		"outboxctl did not say that it is stopping")
	if err := drop.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- drop.Wait() }()
	select {
	case err := <-exited:
		if code := processExit(t, err); code != -1 {
			t.Errorf("a drop sent SIGTERM twice while its commit waited: exit %d; want killed by the second", code)
		}
	case <-time.After(10 * time.Second):
		_ = drop.Process.Kill()
		t.Error("a drop sent SIGTERM twice while its commit waited still ran 10 s later; want killed by the second")
	}
}

// lockWaiters counts the sessions of d's database that wait for a lock.
func lockWaiters(t *testing.T, d *testenv.Database) int64 {
	t.Helper()
	return testenv.Count(t, d.DB, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`)
}

// A failure is printed on one line without control characters: its error may quote what an
// operator did not type (a message id from the broker, a database name escaped in a URL from a
// script), and a terminal would act on an escape sequence in it.
func TestAFailurePrintsNoControlCharacters(t *testing.T) {
	t.Parallel()
	code, _, stderr := ctl(t, "status", "--db", "postgres://postgres@127.0.0.1:1/nowhere%1B%5D0%3Bowned%07")
	if code != 1 || !strings.Contains(stderr, "nowhere") {
		t.Fatalf("status of a database that does not answer: exit %d, stderr %q; want a failure naming it", code, stderr)
	}
	if strings.ContainsAny(stderr, "\x1b\a") {
		t.Errorf("the failure's line holds control characters: %q", stderr)
	}
}

// A dry run or a listing of a dead-letter queue moves and deletes nothing, but the messages it
// looks at and hands back may change place in the queue: the help says so, and no longer that it
// changes nothing.
func TestADlqDryRunIsNotSaidToChangeNothing(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	comment, _, _ := strings.Cut(string(src), "\npackage main")
	for _, tc := range []struct {
		what, text string
		want       []string
	}{
		{"outboxctl --help", ok(t, "--help"), []string{"may change place in the queue"}},
		{"the package comment", strings.ReplaceAll(comment, "\n// ", " "), []string{"may change place in the queue"}},
		{"outboxctl dlq redrive --help", ok(t, "dlq", "redrive", "--help"), []string{"list the messages it would move, and move nothing", "may change place in the queue"}},
		{"outboxctl dlq drop --help", ok(t, "dlq", "drop", "--help"), []string{"show the message it would drop, and drop nothing", "may change place in the queue"}},
		{"outboxctl dlq list --help", ok(t, "dlq", "list", "--help"), []string{"may move back in the queue"}},
	} {
		for _, want := range tc.want {
			if !strings.Contains(tc.text, want) {
				t.Errorf("%s lacks %q:\n%s", tc.what, want, tc.text)
			}
		}
		for _, untrue := range []string{"--dry-run and changes nothing then", "--dry-run, and changes nothing then", "and change nothing", "which changes nothing"} {
			if strings.Contains(tc.text, untrue) {
				t.Errorf("%s still says %q:\n%s", tc.what, untrue, tc.text)
			}
		}
	}
}
