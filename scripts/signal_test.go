package scripts_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
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
	for _, tool := range []string{"dirname", "mktemp", "mkfifo", "rm", "cat", "cp", "sleep", "seq", "flock", "env", "awk", "sed", "tr"} {
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
	// SIGINT at its default, whatever this test binary got: a shell started with it ignored (as
	// bash starts a background command) cannot trap it.
	r.cmd = exec.CommandContext(ctx, filepath.Join(h.bin, "env"), "--default-signal=INT", filepath.Join(h.bin, "bash"), filepath.Join(dir, "scripts", name))
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

// hangingGo puts on PATH a stand-in go that hangs (hangs), and returns the file of its pids.
func (h *host) hangingGo() string {
	h.t.Helper()
	pids := filepath.Join(h.t.TempDir(), "pids")
	h.with("go", hangs(pids))
	return pids
}

// hangs is the body of a stand-in that hangs as go test does: it starts a child, as go test
// starts a test binary, writes its own pid and the child's to pids, and waits.
func hangs(pids string) string { return "sleep 60 &\necho \"$$ $!\" >" + pids + "\nwait" }

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
	goPid, childPid := hanging(t, run, pidFile)
	terminate(t, run)
	testenv.Eventually(t, 5*time.Second, func() bool { return !running(goPid) && !running(childPid) },
		"the go the script ran (pid %d) or its child (pid %d) still runs 5 s after the script ended on SIGTERM:\n%s", goPid, childPid, run)
}

// hanging waits until the stand-in that hangs (hangs) has written its pid and its child's to
// pidFile, returns them, and has t kill both at its end if they still run (what the script left,
// if it left them).
func hanging(t *testing.T, run *lockedRun, pidFile string) (pid, childPid int) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, func() bool {
		b, err := os.ReadFile(pidFile)
		if err != nil || !strings.HasSuffix(string(b), "\n") {
			return false
		}
		_, err = fmt.Sscanf(string(b), "%d %d", &pid, &childPid)
		return err == nil
	}, "the script did not get to the stand-in that hangs:\n%s", run)
	for _, p := range []int{pid, childPid} {
		started := startTime(p)
		t.Cleanup(func() {
			if started != "" && startTime(p) == started { // not another process that got its pid since
				_ = syscall.Kill(p, syscall.SIGKILL)
			}
		})
	}
	return pid, childPid
}

// startTime is when pid started, as /proc gives it, or "" if it is gone.
func startTime(pid int) string {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	after := string(stat)[strings.LastIndex(string(stat), ") ")+2:] // after the command's name
	if fields := strings.Fields(after); len(fields) >= 20 {
		return fields[19]
	}
	return ""
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

// pinned returns the value scripts/test.sh gives name, on a line NAME=VALUE of its own.
func pinned(t *testing.T, name string) string {
	t.Helper()
	script, err := os.ReadFile("test.sh")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^` + name + `=(\S+)$`).FindSubmatch(script)
	if m == nil {
		t.Fatalf("no %s= line in scripts/test.sh", name)
	}
	return string(m[1])
}

// toThePhases readies h to take scripts/test.sh, copied into the directory it returns (with a
// stand-in scripts/sidroot.sh), past its checks and builds into its phases, where the step hang
// names hangs (hangs, its pids written to the file returned): "start", the start of the
// RabbitMQ 4.3 node (scripts/sidroot.sh start); "brokercheck", the check of that node's version;
// "suite", the go test -json of the first phase; "restart", the first go test of the server
// restarts, run alone (phase 3), after every other phase. Its go writes stand-ins for what it
// builds (a testreport that reads its input, and names a server-restart test skipped in the
// phases against the machine's broker; a brokercheck that finds the RabbitMQ the phase wants),
// and its GOPATH holds the golangci-lint and promtool test.sh pins. Its scripts/sidroot.sh stop,
// while DIR/hold-stop exists, makes DIR/stopping and waits for hold-stop to go.
func (h *host) toThePhases(hang string) (dir, pids string) { return h.toThePhasesDoing(hang, "") }

// toThePhasesDoing is toThePhases, with the step that hangs running first (shell commands)
// before it hangs.
func (h *host) toThePhasesDoing(hang, first string) (dir, pids string) {
	t := h.t
	t.Helper()
	h.answering().with("pg_isready", "exit 0").with("rabbitmq-diagnostics", "exit 0").
		with("psql", "exit 0").with("rabbitmqctl", "exit 0").with("gofmt", "exit 0")
	pids = filepath.Join(t.TempDir(), "pids")
	step := map[string]string{
		"start":       "exit 0",
		"brokercheck": `echo "    broker_test.go:29: the broker at 127.0.0.1:5672 is RabbitMQ ${TEST_WANT_RABBITMQ}0"`,
		"suite":       "exit 0",
		"restart":     "exit 0",
	}
	if _, ok := step[hang]; !ok {
		t.Fatalf("no step %q", hang)
	}
	step[hang] = first + "\n" + hangs(pids)
	dir, gopath, builds := inCopy(t, "test.sh", "servers.sh", "alone.sh"), t.TempDir(), t.TempDir()
	if err := os.Mkdir(filepath.Join(gopath, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	for path, body := range map[string]string{
		filepath.Join(gopath, "bin", "golangci-lint"): `[ "$1" != version ] || echo "golangci-lint has version ` + pinned(t, "GOLANGCI_LINT_VERSION") + ` built with go1.26.0"`,
		filepath.Join(gopath, "bin", "promtool"):      "exit 0",
		filepath.Join(builds, "testreport"): `while [ $# -gt 0 ]; do
  case "$1 $2" in
    "-skipped "*/restarts-machine) echo "./pkg/messaging/test ^(TestServerRestartBrokerStopAppThenStartApp)\$" >"$2" ;;
  esac
  shift
done
cat >/dev/null`,
		filepath.Join(builds, "brokercheck"): step["brokercheck"],
		filepath.Join(dir, "scripts", "sidroot.sh"): `case "$1" in
  start) ` + step["start"] + ` ;;
  version) if [ "${SIDROOT_SUITE:-}" = trixie ]; then echo "rabbitmq-server 4.0.9-1"; else echo "rabbitmq-server 4.3.0-1"; fi ;;
  compose) echo "RabbitMQ 4.3.0-1 (sid), as compose ships 4.3.6" ;;
  stop) [ ! -e hold-stop ] || { : >stopping; while [ -e hold-stop ]; do sleep 0.05; done; } ;;
esac`,
	} {
		if err := os.WriteFile(path, []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	h.with("go", `case "$1 $2" in
  "env GOPATH") echo `+gopath+` ;;
  "list -m") echo `+dir+` ;;
  "version -m") printf '%s: go1.26.0\n\tmod\tgithub.com/prometheus/prometheus\tv%s\n\tbuild\t-tags=%s\n' "$3" `+
		pinned(t, "PROMTOOL_VERSION")+" "+pinned(t, "PROMTOOL_TAGS")+` ;;
  "build -o") cp `+builds+`/testreport "$3" ;;
  "test -c") cp `+builds+`/brokercheck "$4" ;;
  "test -json") if [ "${TEST_SERVER_RESTARTS:-}" = 1 ]; then
    `+step["restart"]+`
  else
    `+step["suite"]+`
  fi ;;
esac`)
	return dir, pids
}

// pkill sends SIGTERM to every process whose command line holds pattern, as `pkill -f` does,
// and fails t if there is none.
func pkill(t *testing.T, pattern string) {
	t.Helper()
	cmdlines, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	signalled := 0
	for _, path := range cmdlines {
		pid, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(path, "/proc/"), "/cmdline"))
		b, err := os.ReadFile(path)
		if err == nil && pid != os.Getpid() && strings.Contains(string(b), pattern) && syscall.Kill(pid, syscall.SIGTERM) == nil {
			signalled++
		}
	}
	if signalled == 0 {
		t.Fatalf("no process has %q in its command line", pattern)
	}
}

// ended waits up to 30 s for run's script to end, and returns its exit status.
func ended(t *testing.T, run *lockedRun) int {
	t.Helper()
	select {
	case err := <-run.done:
		var exit *exec.ExitError
		if err != nil && !errors.As(err, &exit) {
			t.Fatalf("the script: %v\n%s", err, run)
		}
		return run.cmd.ProcessState.ExitCode()
	case <-time.After(30 * time.Second):
		t.Fatalf("the script did not end within 30 s:\n%s", run)
		return 0
	}
}

// `pkill -f scripts/test.sh`, as a CI run is killed, signals every process with that command
// line: the run's shell and its forks, those that run its functions among them, which bash
// lets die at once. What the run runs ends all the same within 5 s, wherever it was: the start
// of the 4.3 node, the check of its version, the go test of a phase. Left running, it would go
// on (restarting servers, starting a node) under the next run's lock.
func TestAKillByNameEndsWhatTheTestCommandRuns(t *testing.T) {
	t.Parallel()
	for _, step := range []string{"start", "brokercheck", "suite"} {
		t.Run(step, func(t *testing.T) {
			t.Parallel()
			h := newHost(t)
			dir, pids := h.toThePhases(step)
			run := h.runScript(dir, "test.sh")
			pid, childPid := hanging(t, run, pids)
			pkill(t, filepath.Join(dir, "scripts", "test.sh"))
			testenv.Eventually(t, 5*time.Second, func() bool { return !running(pid) && !running(childPid) },
				"5 s after pkill -f scripts/test.sh, the %s stand-in (pid %d) or its child (pid %d) still runs:\n%s", step, pid, childPid, run)
			if status := ended(t, run); status == 0 {
				t.Fatalf("the script ended with status 0 on SIGTERM:\n%s", run)
			}
		})
	}
}

// SIGINT to the run's pid alone (not its process group, as a terminal's Ctrl-C is) ends the run
// as SIGTERM does, and its status is 130: bash would wait for the go test, and carry on when it
// ended. A second one, during the cleanup, does not cut it short: the cleanup stops the node it
// was stopping, and removes its report (in TMPDIR).
func TestASIGINTToTheTestCommandEndsTheGoItRuns(t *testing.T) {
	t.Parallel()
	h := newHost(t)
	tmp := t.TempDir()
	h.env = append(h.env, "TMPDIR="+tmp)
	dir, pids := h.toThePhases("suite")
	if err := os.WriteFile(filepath.Join(dir, "hold-stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	run := h.runScript(dir, "test.sh")
	pid, childPid := hanging(t, run, pids)
	if err := run.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return !running(pid) && !running(childPid) },
		"5 s after SIGINT to the script, the go it ran (pid %d) or its child (pid %d) still runs:\n%s", pid, childPid, run)
	testenv.Eventually(t, 10*time.Second, func() bool { _, err := os.Stat(filepath.Join(dir, "stopping")); return err == nil },
		"the cleanup did not get to stop the node:\n%s", run)
	if err := run.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return !pending(run.cmd.Process.Pid, syscall.SIGINT) },
		"the script did not take the second SIGINT:\n%s", run)
	if err := os.Remove(filepath.Join(dir, "hold-stop")); err != nil {
		t.Fatal(err)
	}
	if status := ended(t, run); status != 130 {
		t.Fatalf("the script ended with status %d on SIGINT, want 130:\n%s", status, run)
	}
	if left, _ := os.ReadDir(tmp); len(left) > 0 {
		t.Fatalf("the cleanup ended before it removed the run's report (%s left in TMPDIR): a second SIGINT cut it short:\n%s", left[0].Name(), run)
	}
}

// pending reports whether sig waits to be delivered to pid (by /proc/PID/status): once it is not,
// the process has taken it (run its handler) or ignored it.
func pending(pid int, sig syscall.Signal) bool {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(status), "\n") {
		name, mask, _ := strings.Cut(line, ":\t")
		if name != "SigPnd" && name != "ShdPnd" {
			continue
		}
		if bits, err := strconv.ParseUint(mask, 16, 64); err == nil && bits&(1<<(sig-1)) != 0 {
			return true
		}
	}
	return false
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

// with_broker and sidroot become the command they run (exec), in a fork of the run's shell: in
// the run's own shell they would end the run, so there they refuse, naming themselves.
func TestTheFunctionsThatBecomeTheirCommandRefuseTheRunsShell(t *testing.T) {
	t.Parallel()
	script, err := os.ReadFile("test.sh")
	if err != nil {
		t.Fatal(err)
	}
	var defs []string
	for _, re := range []string{`(?m)^die\(\) \{.*\}$`, `(?m)^forked\(\) \{.*\}$`, `(?ms)^with_broker\(\) \{$.*?^\}$`, `(?ms)^sidroot\(\) \{$.*?^\}$`} {
		def := regexp.MustCompile(re).Find(script)
		if def == nil {
			t.Fatalf("no %s in scripts/test.sh", re)
		}
		defs = append(defs, string(def))
	}
	for name, call := range map[string]string{"with_broker": "with_broker machine echo replaced", "sidroot": "sidroot sid version"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command("bash", "-c", "set -euo pipefail\n"+strings.Join(defs, "\n")+`
machine_rabbitmq=3.10 machine_amqp_url=amqp://guest:guest@127.0.0.1:5672/ sidroot_env= trixie_env=
(with_broker machine printenv TEST_WANT_RABBITMQ)
`+call+`
echo survived`)
			cmd.Dir = t.TempDir() // no scripts/sidroot.sh to run
			out, err := cmd.CombinedOutput()
			want := "3.10.\nscripts/test.sh: " + name + " was called in the run's own shell, which it would replace\n"
			if err == nil || string(out) != want {
				t.Errorf("%s in the run's shell: %v, %q; want exit 1 and %q (with_broker in a fork first)", call, err, out, want)
			}
		})
	}
}

// scripts/walkthrough.sh in local mode stops the machine's broker: it waits while another run
// holds the lock (scripts/alone.sh), before it asks the services anything, and goes on once that
// run has ended. In compose mode it stops compose's broker, and does not wait.
func TestTheWalkthroughWaitsForARunInLocalMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"local", "compose"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			asked := filepath.Join(t.TempDir(), "asked")
			h := newHost(t).with("curl", `echo "$*" >>`+asked+"\nexit 7") // no service answers
			h.env = append(h.env, "WALKTHROUGH_MODE="+mode)
			dir := inCopy(t, "walkthrough.sh", "alone.sh")
			other := holdLock(t, filepath.Join(dir, "tests.lock"))
			run := h.runScript(dir, "walkthrough.sh")
			const waiting = "scripts/walkthrough.sh: waiting for another run on this machine to end"
			if mode == "local" {
				run.waitFor(t, waiting)
				if _, err := os.Stat(asked); err == nil {
					t.Fatalf("the walkthrough asked the services while another run held the lock:\n%s", run)
				}
				if err := other.Close(); err != nil {
					t.Fatal(err)
				}
			}
			out := failed(t, run)
			if !strings.Contains(out, "/readyz is not 200") || (mode == "compose") != !strings.Contains(out, waiting) {
				t.Errorf("the walkthrough in %s mode, beside another run: want it to wait only in local mode, then ask the services:\n%s", mode, out)
			}
		})
	}
}

// A broker for the test's stand-ins: its app runs (the port answers) unless DIR/app says
// "stopped", and its memory watermark is DIR/watermark. Its rabbitmqctl logs each call to
// DIR/calls; its rabbitmq-diagnostics check_alarms reports a memory alarm at a watermark of 0.
type standInBroker struct{ dir, amqp string }

// standInBroker puts h's rabbitmqctl and rabbitmq-diagnostics on PATH, and has the broker's port
// follow DIR/app until t ends.
func (h *host) standInBroker() *standInBroker {
	t := h.t
	t.Helper()
	b := &standInBroker{dir: t.TempDir()}
	if err := os.WriteFile(filepath.Join(b.dir, "watermark"), []byte("0.4\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	h.with("rabbitmqctl", `echo "$*" >>`+b.dir+`/calls
case "$*" in
  *stop_app) echo stopped >`+b.dir+`/app ;;
  *start_app) echo started >`+b.dir+`/app ;;
  *"set_vm_memory_high_watermark 0") echo 0 >`+b.dir+`/watermark ;;
  *"get_vm_memory_high_watermark()."*) cat `+b.dir+`/watermark ;;
  *"application:get_env(rabbit, vm_memory_high_watermark)"*) echo 0.4 >`+b.dir+`/watermark; echo 0.4 ;;
esac
exit 0`)
	h.with("rabbitmq-diagnostics", `if [ "$(cat `+b.dir+`/watermark)" = 0 ]; then echo "Memory alarm on node rabbit@here"; exit 1; fi`)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	b.amqp = "amqp://guest:guest@" + addr + "/"
	serve := func(l net.Listener) {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}
	go serve(l)
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			select {
			case <-done:
				if l != nil {
					_ = l.Close()
				}
				return
			case <-time.After(10 * time.Millisecond):
			}
			app, _ := os.ReadFile(filepath.Join(b.dir, "app"))
			switch up := strings.TrimSpace(string(app)) != "stopped"; {
			case !up && l != nil:
				_ = l.Close()
				l = nil
			case up && l == nil:
				if l, err = net.Listen("tcp", addr); err == nil {
					go serve(l)
				} else {
					l = nil // taken meanwhile: tried again
				}
			}
		}
	}()
	t.Cleanup(func() { close(done); <-stopped })
	return b
}

// file returns what the stand-in broker's file name holds, trimmed.
func (b *standInBroker) file(name string) string {
	s, _ := os.ReadFile(filepath.Join(b.dir, name))
	return strings.TrimSpace(string(s))
}

// A signal (SIGINT or SIGTERM) during the server restarts, run alone (phase 3), ends the test
// binary before its cleanups, which would start the broker's app again or set its memory
// watermark back: the run's cleanup does it, as the run's end would (ensure_rabbitmq). (Its
// PostgreSQL start, pg_ctlcluster, looks for /etc/postgresql on the real machine: not checked
// here.)
func TestASignalDuringTheServerRestartsLeavesTheServersUp(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct{ do, want string }{
		"broker app stopped": {"rabbitmqctl stop_app", "start_app"},
		"memory alarm":       {"rabbitmqctl set_vm_memory_high_watermark 0", "set_vm_memory_high_watermark(W)"},
	} {
		for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
			t.Run(name+"/"+sig.String(), func(t *testing.T) {
				t.Parallel()
				h := newHost(t)
				dir, pids := h.toThePhasesDoing("restart", c.do)
				broker := h.standInBroker()
				h.amqp = broker.amqp
				run := h.runScript(dir, "test.sh")
				pid, childPid := hanging(t, run, pids)
				if app, watermark := broker.file("app"), broker.file("watermark"); app != "stopped" && watermark != "0" {
					t.Fatalf("the stand-in go test did not stop the broker's app or raise its memory alarm (app %q, watermark %q):\n%s", app, watermark, run)
				}
				if err := run.cmd.Process.Signal(sig); err != nil {
					t.Fatal(err)
				}
				if status := ended(t, run); status == 0 || (sig == syscall.SIGINT && status != 130) {
					t.Fatalf("the script ended with status %d on %v, want 130 on SIGINT, not 0 on SIGTERM:\n%s", status, sig, run)
				}
				if running(pid) || running(childPid) {
					t.Fatalf("the go test (pid %d) or its child (pid %d) still runs after the script ended:\n%s", pid, childPid, run)
				}
				calls := broker.file("calls")
				if _, after, _ := strings.Cut(calls, c.do[len("rabbitmqctl "):]); !strings.Contains(after, c.want) ||
					broker.file("app") == "stopped" || broker.file("watermark") != "0.4" {
					t.Fatalf("after %v during the server restarts, the broker's app is %q and its watermark %q (want it running at 0.4, a rabbitmqctl call with %q after the test's)\nrabbitmqctl calls:\n%s\nthe script:\n%s",
						sig, broker.file("app"), broker.file("watermark"), c.want, calls, run)
				}
			})
		}
	}
}
