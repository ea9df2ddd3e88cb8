package testenv

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

// ClusterSkip is the reason the cluster tests give when TEST_CLUSTER is not set.
const ClusterSkip = "starts a three-node RabbitMQ cluster (scripts/cluster.sh); set TEST_CLUSTER=1"

// Cluster is a three-node RabbitMQ cluster of scripts/cluster.sh on this host, of one test:
// its own node names, ports and data directory, stopped and deleted when the test ends.
type Cluster struct {
	URLs  []string // amqp://guest:guest@HOST:PORT/, one per node
	dir   string
	port  int
	netns bool         // each node in a network namespace of its own (CLUSTER_NETNS=1)
	cut   map[int]bool // the nodes cut off, in netns mode
}

// StartCluster starts the cluster on loopback, or skips t unless TEST_CLUSTER=1. It takes
// minutes on a busy machine, and the nodes' ports (CLUSTER_PORT, default 5681-5683) must be
// free.
func StartCluster(t testing.TB) *Cluster {
	t.Helper()
	if os.Getenv("TEST_CLUSTER") != "1" {
		t.Skip(ClusterSkip)
	}
	c := &Cluster{dir: t.TempDir(), port: 5681}
	if v := os.Getenv("CLUSTER_PORT"); v != "" {
		var err error
		if c.port, err = strconv.Atoi(v); err != nil {
			t.Fatalf("CLUSTER_PORT=%q: %v", v, err)
		}
	}
	c.start(t)
	return c
}

// netnsNet is the namespaced cluster's network: node N at netnsNet.N.2.
const netnsNet = "10.77"

// StartNetnsCluster starts the cluster with each node in a network namespace of its own
// (scripts/cluster.sh, CLUSTER_NETNS=1), so that Cut can partition it, or skips t unless
// TEST_CLUSTER=1; asked for without root (ip netns), it fails t rather than skip, a skip that
// the run's allowed reasons would let pass unseen. One such cluster runs at a time.
func StartNetnsCluster(t testing.TB) *Cluster {
	t.Helper()
	if os.Getenv("TEST_CLUSTER") != "1" {
		t.Skip(ClusterSkip)
	}
	if os.Geteuid() != 0 {
		t.Fatal("TEST_CLUSTER=1 asks for the partition test, whose namespaced cluster needs root (ip netns): run it as root")
	}
	c := &Cluster{dir: t.TempDir(), netns: true, cut: map[int]bool{}}
	c.start(t)
	return c
}

func (c *Cluster) start(t testing.TB) {
	t.Helper()
	t.Cleanup(func() { _, _ = c.script("stop") })
	out, err := c.script("start")
	if err != nil {
		t.Fatalf("scripts/cluster.sh start: %v\n%s", err, out)
	}
	for line := range strings.SplitSeq(out, "\n") {
		if list, ok := strings.CutPrefix(line, "AMQP_URL="); ok {
			c.URLs = strings.Split(list, ",")
		}
	}
	if len(c.URLs) != 3 {
		t.Fatalf("scripts/cluster.sh start printed no three URLs:\n%s", out)
	}
}

func (c *Cluster) script(args ...string) (string, error) {
	_, here, _, _ := runtime.Caller(0)
	cmd := exec.Command(filepath.Join(filepath.Dir(here), "..", "..", "scripts", "cluster.sh"), args...)
	cmd.Env = append(os.Environ(), "CLUSTER_DIR="+c.dir, "CLUSTER_PORT="+strconv.Itoa(c.port), "CLUSTER_NETNS=0")
	if c.netns {
		cmd.Env = append(cmd.Env, "CLUSTER_NETNS=1", "CLUSTER_NET="+netnsNet)
	}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// CtlAny runs rabbitmqctl against the first node that answers, for what any node can tell.
func (c *Cluster) CtlAny(t testing.TB, args ...string) string {
	t.Helper()
	var failures []string
	for node := 1; node <= 3; node++ {
		out, err := c.script(append([]string{"ctl", strconv.Itoa(node)}, args...)...)
		if err == nil {
			return out
		}
		failures = append(failures, out)
	}
	t.Fatalf("rabbitmqctl %s failed on every node:\n%s", strings.Join(args, " "), strings.Join(failures, "\n"))
	return ""
}

// TryQueues runs rabbitmq-queues against node (1-3), which may be down.
func (c *Cluster) TryQueues(node int, args ...string) (string, error) {
	return c.script(append([]string{"queues", strconv.Itoa(node)}, args...)...)
}

// Kill SIGKILLs node, as a crash would.
func (c *Cluster) Kill(t testing.TB, node int) { t.Helper(); c.must(t, "kill", strconv.Itoa(node)) }

// Revive starts node again; it rejoins the cluster.
func (c *Cluster) Revive(t testing.TB, node int) { t.Helper(); c.must(t, "revive", strconv.Itoa(node)) }

// Cut cuts node off the network (netns mode): from the other nodes and from every client.
func (c *Cluster) Cut(t testing.TB, node int) {
	t.Helper()
	c.must(t, "cut", strconv.Itoa(node))
	c.cut[node] = true
}

// Heal connects node again.
func (c *Cluster) Heal(t testing.TB, node int) {
	t.Helper()
	c.must(t, "heal", strconv.Itoa(node))
	delete(c.cut, node)
}

// IsCut reports whether node is cut off: a question to it says nothing about the cluster.
func (c *Cluster) IsCut(node int) bool { return c.cut[node] }

// Running reports whether RabbitMQ runs on node: not down, not booting, not paused (a node
// that pause_minority paused keeps its Erlang VM up, with the RabbitMQ application stopped).
// It asks from inside node's network, so a node cut off answers too.
func (c *Cluster) Running(node int) bool {
	_, err := c.script("diagnostics", strconv.Itoa(node), "-q", "check_running")
	return err == nil
}

// Logged returns when node's log first says text at or after since, waiting up to wait for it:
// the node's own time of an event, where polling it with the CLI tools (seconds a call) would
// only bound it. The node writes its log with a delay, so a line may come after the event shows.
func (c *Cluster) Logged(t testing.TB, node int, since time.Time, text string, wait time.Duration) (time.Time, bool) {
	t.Helper()
	for deadline := time.Now().Add(wait); ; time.Sleep(100 * time.Millisecond) {
		if at, ok := c.logged(t, node, since, text); ok || time.Now().After(deadline) {
			return at, ok
		}
	}
}

func (c *Cluster) logged(t testing.TB, node int, since time.Time, text string) (time.Time, bool) {
	t.Helper()
	f, err := os.Open(filepath.Join(c.dir, "node"+strconv.Itoa(node), "log", c.Node(node)+".log"))
	if err != nil {
		t.Fatalf("node %d's log: %v", node, err)
	}
	defer f.Close()
	lines := bufio.NewScanner(f)
	lines.Buffer(make([]byte, 64<<10), 1<<20)
	for lines.Scan() {
		// 2026-01-02 15:04:05.123456+00:00 [info] <0.1.0> text
		fields := strings.Fields(lines.Text())
		if len(fields) < 2 || !strings.Contains(lines.Text(), text) {
			continue
		}
		at, err := time.Parse("2006-01-02 15:04:05.999999-07:00", fields[0]+" "+fields[1])
		if err == nil && !at.Before(since) {
			return at, true
		}
	}
	if err := lines.Err(); err != nil {
		t.Fatalf("node %d's log: %v", node, err)
	}
	return time.Time{}, false
}

// Listening reports whether node's AMQP listener is open (netns mode), as seen inside node's
// network: a node that pause_minority paused has closed it. Cheap enough to poll often. An
// error is a failure to tell, not a closed listener.
func (c *Cluster) Listening(node int) (bool, error) {
	out, err := c.script("listening", strconv.Itoa(node))
	if err != nil {
		return false, fmt.Errorf("scripts/cluster.sh listening %d: %w\n%s", node, err, out)
	}
	return strings.TrimSpace(out) == "yes", nil
}

// Node is the node name of node (1-3), as rabbitmqctl prints it.
func (c *Cluster) Node(node int) string {
	if c.netns {
		return "outbox-inbox-" + strconv.Itoa(node) + "@" + netnsNet + "." + strconv.Itoa(node) + ".2"
	}
	return "outbox-inbox-" + strconv.Itoa(node) + "@localhost"
}

func (c *Cluster) must(t testing.TB, args ...string) string {
	t.Helper()
	out, err := c.script(args...)
	if err != nil {
		t.Fatalf("scripts/cluster.sh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}
