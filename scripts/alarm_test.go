package scripts_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// alarmedHost is a host whose broker answers and reports alarm (a line as
// rabbitmq-diagnostics check_alarms prints one) until its watermark is set again; its
// rabbitmqctl says the watermark is 0, and records what it is asked in the file it returns.
// Its gofmt finds a file to change: the run stops there, past the servers' checks, before it
// runs go.
func alarmedHost(t *testing.T, alarm string) (*host, string) {
	t.Helper()
	state := t.TempDir()
	restored, asked := filepath.Join(state, "restored"), filepath.Join(state, "asked")
	h := newHost(t).answering().with("pg_isready", "exit 0").with("psql", "exit 0").with("gofmt", "echo unformatted.go").with("go", "exit 1").
		with("rabbitmq-diagnostics", `[ "$*" = "-q check_alarms" ] || { echo "unexpected: $*"; exit 64; }
[ -e `+restored+` ] && exit 0
echo "`+alarm+`"
exit 69`).
		with("rabbitmqctl", `echo "$*" >>`+asked+`
case "$*" in
  *get_vm_memory_high_watermark*) echo 0.0 ;;
  *set_vm_memory_high_watermark*) : >`+restored+`; echo 0.4 ;;
esac`)
	return h, asked
}

// failed waits for run to end, fails t unless it failed, and returns what it wrote.
func failed(t *testing.T, run *lockedRun) string {
	t.Helper()
	select {
	case err := <-run.done:
		if err == nil {
			t.Fatalf("the script ended with status 0:\n%s", run)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("the script did not end within 30 s:\n%s", run)
	}
	return run.String()
}

// A memory alarm that a killed test left on the machine's broker (a watermark of 0) is undone
// before the suite runs, and the run says so.
func TestTheTestCommandUndoesAMemoryAlarmALeftWatermarkRaises(t *testing.T) {
	t.Parallel()
	h, _ := alarmedHost(t, "Memory alarm on node rabbit@localhost")
	out := failed(t, h.runScript(inCopy(t, "test.sh", "servers.sh", "alone.sh"), "test.sh"))
	for _, want := range []string{
		"RabbitMQ had a memory alarm at a watermark of 0.0 (a test binary killed before its cleanup leaves 0); set back to the node's configured 0.4",
		"gofmt would change: unformatted.go", // went on, past the servers' checks
	} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in:\n%s", want, out)
		}
	}
}

// Another alarm (the disk's) is not the tests' to undo: the run stops, naming it, and
// touches no watermark.
func TestTheTestCommandStopsOnADiskAlarm(t *testing.T) {
	t.Parallel()
	h, asked := alarmedHost(t, "Free disk space alarm on node rabbit@localhost")
	out := failed(t, h.runScript(inCopy(t, "test.sh", "servers.sh", "alone.sh"), "test.sh"))
	if !strings.Contains(out, "RabbitMQ reports an alarm") || !strings.Contains(out, "Free disk space alarm on node rabbit@localhost") || strings.Contains(out, "== gofmt") {
		t.Errorf("the run did not stop at the alarm, naming it:\n%s", out)
	}
	if b, _ := os.ReadFile(asked); strings.Contains(string(b), "watermark") {
		t.Errorf("rabbitmqctl was asked about the watermark: %s", b)
	}
}

// A memory alarm beside another (the disk's) is not undone either: the run stops at once,
// naming the other, and touches no watermark.
func TestTheTestCommandStopsOnADiskAlarmBesideAMemoryAlarm(t *testing.T) {
	t.Parallel()
	h, asked := alarmedHost(t, "Memory alarm on node rabbit@localhost\nFree disk space alarm on node rabbit@localhost")
	start := time.Now()
	out := failed(t, h.runScript(inCopy(t, "test.sh", "servers.sh", "alone.sh"), "test.sh"))
	if !strings.Contains(out, "RabbitMQ reports an alarm the tests do not raise, which is not theirs to undo: Free disk space alarm on node rabbit@localhost") ||
		strings.Contains(out, "set back to") || strings.Contains(out, "== gofmt") {
		t.Errorf("the run did not stop at the alarms, naming the disk's:\n%s", out)
	}
	if b, _ := os.ReadFile(asked); strings.Contains(string(b), "watermark") {
		t.Errorf("rabbitmqctl was asked about the watermark: %s", b)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("the run took %v to stop", took)
	}
}
