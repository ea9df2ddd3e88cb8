package testenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// ClusterSkip is the reason the cluster tests give when TEST_CLUSTER is not set.
const ClusterSkip = "starts a three-node RabbitMQ cluster (scripts/cluster.sh); set TEST_CLUSTER=1"

// Cluster is a three-node RabbitMQ cluster of scripts/cluster.sh on this host, of one test:
// its own node names, ports and data directory, stopped and deleted when the test ends.
type Cluster struct {
	URLs []string // amqp://guest:guest@127.0.0.1:PORT/, one per node
	dir  string
	port int
}

// StartCluster starts the cluster, or skips t unless TEST_CLUSTER=1. It takes minutes on a
// busy machine, and the nodes' ports (CLUSTER_PORT, default 5681-5683) must be free.
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
	return c
}

func (c *Cluster) script(args ...string) (string, error) {
	_, here, _, _ := runtime.Caller(0)
	cmd := exec.Command(filepath.Join(filepath.Dir(here), "..", "..", "scripts", "cluster.sh"), args...)
	cmd.Env = append(os.Environ(), "CLUSTER_DIR="+c.dir, "CLUSTER_PORT="+strconv.Itoa(c.port))
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

// Node is the node name of node (1-3), as rabbitmqctl prints it.
func (c *Cluster) Node(node int) string { return "outbox-inbox-" + strconv.Itoa(node) + "@localhost" }

func (c *Cluster) must(t testing.TB, args ...string) string {
	t.Helper()
	out, err := c.script(args...)
	if err != nil {
		t.Fatalf("scripts/cluster.sh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}
