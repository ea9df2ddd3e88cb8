package scripts_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// inCopy copies the scripts named into DIR/scripts, DIR a new directory, and returns DIR: a
// script run from there sources the copies, and runs the stand-ins put beside them (a
// scripts/sidroot.sh that starts no node), never the repository's.
func inCopy(t *testing.T, names ...string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "scripts"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		b, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "scripts", name), b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// runScript starts bash DIR/scripts/NAME in the background with h's stand-ins and the few real
// tools the scripts run as its only commands, h's server URLs, and a lock of its own.
func (h *host) runScript(dir, name string) *lockedRun {
	h.t.Helper()
	for _, tool := range []string{"dirname", "mktemp", "mkfifo", "rm", "cat", "sleep", "seq", "flock", "env"} {
		path, err := exec.LookPath(tool)
		if err != nil {
			h.t.Fatal(err)
		}
		if err := os.Symlink(path, filepath.Join(h.bin, tool)); err != nil && !os.IsExist(err) {
			h.t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	h.t.Cleanup(cancel)
	r := &lockedRun{done: make(chan error, 1)}
	r.cmd = exec.CommandContext(ctx, filepath.Join(h.bin, "bash"), filepath.Join(dir, "scripts", name))
	r.cmd.Env = append([]string{"PATH=" + h.bin, "TEST_DATABASE_URL=" + h.pg, "TEST_AMQP_URL=" + h.amqp,
		"TEST_SERVERS=local", "RUN_ALONE_LOCK=" + filepath.Join(dir, "tests.lock")}, h.env...)
	r.cmd.WaitDelay = 5 * time.Second
	r.cmd.Stdout, r.cmd.Stderr = &r.out, &r.out
	if err := r.cmd.Start(); err != nil {
		h.t.Fatal(err)
	}
	go func() { r.done <- r.cmd.Wait() }()
	return r
}

// hangingGo puts on PATH a stand-in go that starts a child, as go test starts a test binary,
// writes its own pid and the child's to the file it returns, and waits.
func (h *host) hangingGo() string {
	h.t.Helper()
	pids := filepath.Join(h.t.TempDir(), "pids")
	h.with("go", "sleep 60 &\necho \"$$ $!\" >"+pids+"\nwait")
	return pids
}

// running reports whether pid runs: it exists, and is not a zombie (one that ended, which its
// parent, or whoever inherited it, has not reaped yet).
func running(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	_, fields, _ := strings.Cut(string(stat), ") ") // after the command's name
	return !strings.HasPrefix(fields, "Z")
}

// signalEndsTheGoItRuns waits until run's stand-in go (hangingGo) and its child run, sends run
// SIGTERM, and fails t unless both are gone within 5 s: left running, a go test would go on
// with its tests, under the lock of the next run.
func signalEndsTheGoItRuns(t *testing.T, run *lockedRun, pidFile string) {
	t.Helper()
	var goPid, childPid int
	testenv.Eventually(t, 10*time.Second, func() bool {
		b, err := os.ReadFile(pidFile)
		if err != nil || !strings.HasSuffix(string(b), "\n") {
			return false
		}
		_, err = fmt.Sscanf(string(b), "%d %d", &goPid, &childPid)
		return err == nil
	}, "the script did not get to go:\n%s", run)
	t.Cleanup(func() { // what the script left, if it left them
		_ = syscall.Kill(goPid, syscall.SIGKILL)
		_ = syscall.Kill(childPid, syscall.SIGKILL)
	})
	terminate(t, run)
	testenv.Eventually(t, 5*time.Second, func() bool { return !running(goPid) && !running(childPid) },
		"the go the script ran (pid %d) or its child (pid %d) still runs 5 s after the script ended on SIGTERM:\n%s", goPid, childPid, run)
}

// A signal to scripts/test.sh ends the go it runs, and what that runs, before the run ends.
func TestASignalToTheTestCommandEndsTheGoItRuns(t *testing.T) {
	t.Parallel()
	h := newHost(t).answering().
		with("pg_isready", "exit 0").with("rabbitmq-diagnostics", "exit 0").
		with("psql", "exit 0").with("rabbitmqctl", "exit 0").with("gofmt", "exit 0")
	pids := h.hangingGo()
	signalEndsTheGoItRuns(t, h.runScript(inCopy(t, "test.sh", "servers.sh", "alone.sh"), "test.sh"), pids)
}

// So does a signal to scripts/bench.sh (its node's scripts/sidroot.sh a stand-in).
func TestASignalToTheBenchmarkEndsTheGoItRuns(t *testing.T) {
	t.Parallel()
	h := newHost(t)
	pids := h.hangingGo()
	dir := inCopy(t, "bench.sh", "alone.sh")
	if err := os.WriteFile(filepath.Join(dir, "scripts", "sidroot.sh"), []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	signalEndsTheGoItRuns(t, h.runScript(dir, "bench.sh"), pids)
}

// terminate sends run's script SIGTERM and fails t unless it ends within 30 s, with a status
// other than 0.
func terminate(t *testing.T, run *lockedRun) {
	t.Helper()
	if err := run.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-run.done:
		if err == nil {
			t.Fatalf("the script ended with status 0 on SIGTERM:\n%s", run)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("the script did not end within 30 s of SIGTERM:\n%s", run)
	}
}

// A go that keeps starting children, as go test starts one test binary after another and a
// test binary what it runs: those it starts while the script looks for what to end, and those
// it starts as it ends, end too. The children sleep for a time of this test's own, by which
// they, and the go by its path, are told from any other process.
func TestASignalEndsWhatTheGoStartsWhileItIsEnded(t *testing.T) {
	t.Parallel()
	h := newHost(t).answering().
		with("pg_isready", "exit 0").with("rabbitmq-diagnostics", "exit 0").
		with("psql", "exit 0").with("rabbitmqctl", "exit 0").with("gofmt", "exit 0")
	started := filepath.Join(t.TempDir(), "started")
	nap := fmt.Sprintf("300.%09d", time.Now().UnixNano()%1e9)
	// Bounded, that a script that fails to end it cannot take every pid of the machine.
	h.with("go", "i=0; while [ $i -lt 3000 ]; do sleep "+nap+" & echo >>"+started+"; i=$((i+1)); done; wait")
	goCmd := filepath.Join(h.bin, "go")
	left := func() (goPids, children []int) { // what still runs of the go and its children
		stats, _ := filepath.Glob("/proc/[0-9]*/cmdline")
		for _, stat := range stats {
			pid, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(stat, "/proc/"), "/cmdline"))
			cmdline, err := os.ReadFile(stat)
			switch {
			case err != nil || !running(pid):
			case string(cmdline) == "sleep\x00"+nap+"\x00":
				children = append(children, pid)
			case strings.Contains(string(cmdline), "\x00"+goCmd+"\x00"):
				goPids = append(goPids, pid)
			}
		}
		return goPids, children
	}
	t.Cleanup(func() { // what the script left, if it left them: the go first, which starts more
		goPids, _ := left()
		for _, pid := range goPids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
		_, children := left()
		for _, pid := range children {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	run := h.runScript(inCopy(t, "test.sh", "servers.sh", "alone.sh"), "test.sh")
	testenv.Eventually(t, 10*time.Second, func() bool { b, _ := os.ReadFile(started); return len(b) > 50 },
		"the script did not get to go:\n%s", run)
	terminate(t, run)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		goPids, children := left()
		if len(goPids)+len(children) == 0 {
			return
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(started)
			t.Fatalf("5 s after the script ended on SIGTERM, %d of the %d children the go started still run (and of the go, pids %v):\n%s",
				len(children), len(b), goPids, run)
		}
	}
}

// The end of a run's processes reads every process of the machine, whatever its name: one
// with a newline in it (its /proc stat line read cut short) must not stop the cleanup under
// set -u, which would leave the run's nodes running.
func TestTheEndOfARunsProcessesTakesAnyProcessName(t *testing.T) {
	t.Parallel()
	odd := filepath.Join(t.TempDir(), "a\nb")
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(sleep)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(odd, b, 0o755); err != nil {
		t.Fatal(err)
	}
	other := exec.Command(odd, "30")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Process.Kill(); _ = other.Wait() })
	out, err := exec.Command("bash", "-c", "set -euo pipefail; . ./alone.sh; alone_end_processes; echo ended").CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "ended" {
		t.Fatalf("alone_end_processes beside a process named %q: %v\n%s", "a\\nb", err, out)
	}
}
