package scripts_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// lockedRun runs script with scripts/alone.sh sourced and the lock at lock, in the background.
type lockedRun struct {
	cmd  *exec.Cmd
	out  testenv.Logs // what it writes, read while it runs
	done chan error
}

// String is what the run has written so far; a failure message given r reads it when it fails.
func (r *lockedRun) String() string { return r.out.String() }

func startLocked(t *testing.T, lock, script string) *lockedRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	r := &lockedRun{done: make(chan error, 1)}
	r.cmd = exec.CommandContext(ctx, "bash", "-c", ". scripts/alone.sh\n"+script)
	r.cmd.Dir = ".."
	// Not the holder of the run this test may be part of (scripts/test.sh holds its own lock).
	r.cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, "RUN_ALONE_") })
	r.cmd.Env = append(r.cmd.Env, "RUN_ALONE_LOCK="+lock)
	// A holder still waiting for the lock keeps the output open until it gives up.
	r.cmd.WaitDelay = 5 * time.Second
	r.cmd.Stdout, r.cmd.Stderr = &r.out, &r.out
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { r.done <- r.cmd.Wait() }()
	return r
}

// waitFor waits up to 10 s for want in r's output.
func (r *lockedRun) waitFor(t *testing.T, want string) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, func() bool { return strings.Contains(r.String(), want) },
		"no %q in:\n%s", want, r)
}

// holdLock takes the lock as another run would; closing the file ends that run.
func holdLock(t *testing.T, lock string) *os.File {
	t.Helper()
	f, err := os.OpenFile(lock, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	return f
}

// waitFree fails t with msg unless the lock is free within 10 s.
func waitFree(t *testing.T, lock, msg string) {
	t.Helper()
	f, err := os.Open(lock)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil
	}, "%s", msg)
}

// A second run waits while the first holds the lock, says which run it waits for, and goes on
// once the first has ended.
func TestASecondRunWaitsForTheFirst(t *testing.T) {
	t.Parallel()
	lock := filepath.Join(t.TempDir(), "tests.lock")
	first := holdLock(t, lock)
	if err := os.WriteFile(lock+".holder", []byte("pid 1, scripts/test.sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	second := startLocked(t, lock, "alone scripts/bench.sh\necho started")
	second.waitFor(t, "scripts/bench.sh: waiting for another run on this machine to end (pid 1, scripts/test.sh")
	if strings.Contains(second.String(), "started") {
		t.Fatalf("the second run went on while the first held the lock:\n%s", second.String())
	}
	if err := first.Close(); err != nil { // the first run ends: its descriptor closes
		t.Fatal(err)
	}
	second.waitFor(t, "started")
	if err := <-second.done; err != nil {
		t.Fatalf("second run: %v\n%s", err, second.String())
	}
	if b, _ := os.ReadFile(lock + ".holder"); !regexp.MustCompile(`^pid [0-9]+, scripts/bench.sh\n$`).Match(b) {
		t.Errorf("the holder file says %q, want the second run's pid and name", b)
	}
}

// A script the run starts (scripts/sidroot.sh from scripts/test.sh) holds the lock already, and
// does not wait for the run that started it.
func TestAScriptOfTheRunDoesNotWaitForIt(t *testing.T) {
	t.Parallel()
	lock := filepath.Join(t.TempDir(), "tests.lock")
	run := startLocked(t, lock, `alone scripts/test.sh
bash -c '. scripts/alone.sh; alone "scripts/sidroot.sh start"; echo inner passed'
echo outer done`)
	if err := <-run.done; err != nil {
		t.Fatalf("run: %v\n%s", err, run.String())
	}
	if out := run.String(); !strings.Contains(out, "inner passed") || !strings.Contains(out, "outer done") || strings.Contains(out, "waiting") {
		t.Fatalf("output:\n%s", out)
	}
	if b, _ := os.ReadFile(lock + ".holder"); !strings.HasSuffix(string(b), ", scripts/test.sh\n") {
		t.Errorf("the holder file says %q, want the run that holds it", b)
	}
}

// The lock is held while the run goes on; what the run starts may outlive it (a server a test
// restarted, a node), and the lock must not go with that: it is free once the run's shell has
// ended, though a process it started still runs.
func TestTheLockIsHeldForTheRunAndEndsWithIt(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	lock, done := filepath.Join(dir, "tests.lock"), filepath.Join(dir, "done")
	run := startLocked(t, lock, `alone scripts/test.sh
sleep 60 >/dev/null 2>&1 &
echo "daemon $!"
while [ ! -e '`+done+`' ]; do sleep 0.05; done`)
	run.waitFor(t, "daemon ")
	var daemon int
	if _, err := fmt.Sscanf(run.String(), "daemon %d", &daemon); err != nil {
		t.Fatalf("output %q: %v", run.String(), err)
	}
	t.Cleanup(func() { _ = syscall.Kill(daemon, syscall.SIGKILL) })
	f, err := os.Open(lock)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil {
		t.Fatal("the lock is free while the run goes on")
	}
	if err := os.WriteFile(done, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := <-run.done; err != nil {
		t.Fatalf("run: %v\n%s", err, run.String())
	}
	waitFree(t, lock, "the lock is still held 10 s after the run ended, while a process it started runs")
	if syscall.Kill(daemon, 0) != nil {
		t.Fatal("the process the run started is gone: the test shows nothing")
	}
}

// A run killed while it waits for the lock leaves no holder behind to take it for nobody: once
// the first run ends, the lock is free.
func TestARunKilledWhileItWaitsLeavesTheLockFree(t *testing.T) {
	t.Parallel()
	lock := filepath.Join(t.TempDir(), "tests.lock")
	first := holdLock(t, lock)
	second := startLocked(t, lock, "alone scripts/bench.sh\necho started")
	second.waitFor(t, "scripts/bench.sh: waiting for another run on this machine to end")
	if err := second.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := <-second.done; err == nil {
		t.Fatal("the second run ended by itself before it was killed")
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	waitFree(t, lock, "the lock is held 10 s after the only live run ended: the killed run's holder took it")
	if b, _ := os.ReadFile(lock + ".holder"); strings.Contains(string(b), "scripts/bench.sh") {
		t.Fatalf("the killed run's holder took the lock after it died (the holder file says %q)", b)
	}
}
