// Package e2e runs the three real service binaries against the local PostgreSQL and RabbitMQ
// and checks what a user of the system sees: orders in, exactly one invoice and one delivered
// confirmation out, whatever fails meanwhile.
package e2e

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/outboxkit/outbox-inbox/internal/systest"
)

var binDir string

// binDirPrefix starts the name of the directory each test binary builds the services into,
// followed by its pid: a binary killed before its deferred removal runs (by its -timeout, or
// SIGKILL) leaves it, and the next one removes it (sweepBinDirs).
const binDirPrefix = "e2e-bin-"

func TestMain(m *testing.M) {
	code := func() int {
		sweepBinDirs(os.TempDir())
		dir, err := os.MkdirTemp("", binDirPrefix+strconv.Itoa(os.Getpid())+"-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		if err := systest.Build(dir, true); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		binDir = dir
		return m.Run()
	}()
	os.Exit(code)
}

// sweepBinDirs removes the directories in tmp that test binaries no longer running built the
// services into. One whose pid runs is kept, though another process may have that pid now: a
// later binary removes it.
func sweepBinDirs(tmp string) {
	dirs, _ := filepath.Glob(filepath.Join(tmp, binDirPrefix+"*-*"))
	for _, dir := range dirs {
		pid, _, _ := strings.Cut(strings.TrimPrefix(filepath.Base(dir), binDirPrefix), "-")
		n, err := strconv.Atoi(pid)
		if err != nil || n <= 0 || !errors.Is(syscall.Kill(n, 0), syscall.ESRCH) {
			continue
		}
		if err := os.RemoveAll(dir); err != nil {
			fmt.Fprintf(os.Stderr, "e2e: could not remove %s, left by a killed test binary: %v\n", dir, err)
		}
	}
}

// The build directory a killed test binary left is removed by the next; those of binaries that
// still run, and what only looks like one, are not.
func TestBuildDirectoriesOfKilledBinariesAreRemoved(t *testing.T) {
	t.Parallel()
	ended := exec.Command("true")
	if err := ended.Run(); err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	left := filepath.Join(tmp, fmt.Sprintf("%s%d-1", binDirPrefix, ended.Process.Pid))
	kept := []string{
		filepath.Join(tmp, fmt.Sprintf("%s%d-2", binDirPrefix, os.Getpid())), // this binary's
		filepath.Join(tmp, binDirPrefix+"123456"),                            // named otherwise
		filepath.Join(tmp, binDirPrefix+"x-3"),
	}
	for _, dir := range append([]string{left}, kept...) {
		if err := os.MkdirAll(filepath.Join(dir, "bin"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	sweepBinDirs(tmp)
	if _, err := os.Stat(left); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the directory of an ended binary (pid %d) is still there: %v", ended.Process.Pid, err)
	}
	for _, dir := range kept {
		if _, err := os.Stat(dir); err != nil {
			t.Errorf("%s was removed: %v", dir, err)
		}
	}
}

// smallPools are the e2e tests' database pools, unless a test says otherwise. Each system
// reserves every connection it may open (testenv.Connections): 3 for each of the test's own
// handles on the three databases and each service's DB_MAX_CONNS, 9 + 3×12 = 45 here (69 at
// the services' default of 20). Even so two such systems do not fit side by side in the 87 that a server at the
// default max_connections of 100 leaves the suite (less its 3 superuser connections and
// testenv's margin of 10): they take turns, and the small pools leave the rest of the budget to
// the other packages' tests meanwhile. No queue orders the turns: a system waits until its 45
// are free at once, retrying, while smaller reservations take the slots freed meanwhile
// (TestReplicasUnderLoad waits for 79), so a system may wait long to start, which the
// -timeout of scripts/test.sh allows for. 12 is what invoicing's parts need at these settings:
// the readiness check 1, the relay 3, the cleanups 2, the consumer 4 and requests 2. The tests'
// clients outnumber those request connections, and are here to check exactly-once, not
// shedding (the admission tests and the overload benchmark do that): HTTP_MAX_IN_FLIGHT lets
// their requests queue for a connection instead, and HTTP_LATENCY_TARGET=0 keeps that limit
// where it is while -race makes them slow.
var smallPools = []string{"DB_MAX_CONNS=12", "CONSUMER_CONCURRENCY=3", "OUTBOX_LANES=1", "HTTP_MAX_IN_FLIGHT=64", "HTTP_LATENCY_TARGET=0"}

// startSystem starts the race-enabled binaries as opts describes.
func startSystem(t *testing.T, opts systest.Options) *systest.System {
	t.Helper()
	opts.BinDir = binDir
	env := map[string][]string{}
	for _, name := range []string{"order", "invoicing", "notification"} {
		env[name] = append(append([]string{}, smallPools...), opts.Env[name]...)
	}
	opts.Env = env
	s := systest.Start(t, opts)
	s.DumpOnFailure(t)
	return s
}
