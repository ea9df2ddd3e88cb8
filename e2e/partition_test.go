package e2e

import (
	"encoding/json"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// The three services, two replicas of each consumer, on a three-node cluster whose nodes each
// have a network of their own, while orders arrive steadily: the node that leads the invoicing
// queue is cut off the network, from the other two nodes and from every client at once, and
// connected again later. pause_minority pauses it rather than letting it go on alone, and it
// resumes by itself once the network heals: nobody restarts anything. Every order accepted
// before, during and after is invoiced and notified exactly once, and POST /orders never fails.
func TestClusterPartitionPausesTheMinority(t *testing.T) {
	cluster := testenv.StartNetnsCluster(t)
	s := startSystem(t, systest.Options{Cluster: cluster, Invoicers: 2, Notifiers: 2})
	for _, q := range []string{"invoicing", "notification"} {
		if m := members(t, cluster, s.VHost, q); len(m) != 3 {
			t.Fatalf("queue %s has replicas on %v, want all 3 nodes", q, m)
		}
	}

	traffic := s.StartTraffic(2)
	traffic.WaitFor(t, 30)
	minority := leaderOf(t, cluster, s.VHost, "invoicing")
	t.Logf("node %d leads: %s; its clients: %s", minority, strings.Join(ledBy(t, cluster, s.VHost, minority), ", "),
		strings.Join(clientsOf(t, cluster, s.VHost, minority), ", "))

	cut := time.Now()
	cluster.Cut(t, minority)
	// The pause is watched beside the stall, which may well end first.
	seenPaused := make(chan time.Duration, 1)
	go func() {
		defer close(seenPaused)
		for deadline := cut.Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			if !cluster.Running(minority) {
				seenPaused <- time.Since(cut)
				return
			}
		}
	}()
	stall := untilInvoicedAfter(t, s, cut)
	pauseSeen, ok := <-seenPaused
	if !ok {
		t.Fatalf("node %d, cut off from the other two, still ran RabbitMQ 2 min later: not paused", minority)
	}
	// The node's log dates the pause to the millisecond (it logs the decision, then stops
	// RabbitMQ within milliseconds); the CLI, a few seconds a call, only bounds it.
	paused, ok := cluster.Logged(t, minority, cut, "Cluster minority/secondary status detected")
	if !ok {
		t.Fatalf("node %d no longer runs RabbitMQ, but its log does not say it found itself in a minority", minority)
	}
	t.Logf("cut off: node %d paused %s after the cut (its log; seen by the CLI after %s); stall %s from the cut until an order placed after it was invoiced",
		minority, paused.Sub(cut).Round(time.Millisecond), pauseSeen.Round(time.Millisecond), stall.Round(time.Millisecond))
	traffic.WaitFor(t, 30) // orders flow on the majority
	if now := leaderOf(t, cluster, s.VHost, "invoicing"); now == minority {
		t.Fatalf("node %d still leads the invoicing queue while cut off", minority)
	}
	if cluster.Running(minority) {
		t.Fatalf("node %d resumed while still cut off", minority)
	}

	healed := time.Now()
	cluster.Heal(t, minority)
	testenv.Eventually(t, 2*time.Minute, func() bool { return cluster.Running(minority) },
		"node %d did not resume after the network healed", minority)
	resumed, ok := cluster.Logged(t, minority, healed, "Server startup complete")
	if !ok {
		t.Fatalf("node %d runs RabbitMQ again, but its log does not say it started", minority)
	}
	testenv.Eventually(t, 2*time.Minute, func() bool {
		return len(members(t, cluster, s.VHost, "invoicing")) == 3 && len(members(t, cluster, s.VHost, "notification")) == 3
	}, "node %d's queue replicas did not come back", minority)
	rejoined := time.Since(healed)
	requireWhole(t, cluster)
	t.Logf("healed: node %d resumed %s after the heal (its log), its replicas were back in both queues within %s",
		minority, resumed.Sub(healed).Round(time.Millisecond), rejoined.Round(time.Millisecond))
	traffic.WaitFor(t, 30)

	ids, cancelled, serverErrors := traffic.Stop(t)
	if serverErrors != 0 {
		t.Fatalf("%d requests got a 5xx while a broker node was cut off", serverErrors)
	}
	if lost := s.CheckAccepted(t, ids); lost != 0 {
		t.Fatalf("%d orders committed without their 201 reaching the client", lost)
	}
	got := s.WaitExactlyOnce(t, int64(len(ids)), 120*time.Second)
	t.Logf("%d orders accepted before, during and after the partition of node %d, %d cancelled; %d invoices, %d notifications sent, %d duplicates suppressed; pause %s, stall %s, resumed %s, replicas back %s",
		len(ids), minority, cancelled, got.Invoices, got.Sent, s.DuplicatesSuppressed(t), paused.Sub(cut).Round(time.Millisecond),
		stall.Round(time.Millisecond), resumed.Sub(healed).Round(time.Millisecond), rejoined.Round(time.Millisecond))
}

var connectionName = regexp.MustCompile(`\{"connection_name","([^"]+)"\}`)

// clientsOf names the connections of vhost to node (the service's connection name, or a
// connection's peer port when it gives none), sorted: whose connections a node takes with it.
func clientsOf(t *testing.T, c *testenv.Cluster, vhost string, node int) []string {
	t.Helper()
	out := c.CtlAny(t, "list_connections", "-q", "--no-table-headers", "vhost", "pid", "peer_port", "client_properties")
	var names []string
	for line := range strings.SplitSeq(out, "\n") {
		f := strings.SplitN(line, "\t", 4)
		// A connection's pid names its node: <outbox-inbox-2@10.77.2.2.1685.0>.
		if len(f) != 4 || f[0] != vhost || !strings.HasPrefix(f[1], "<"+c.Node(node)+".") {
			continue
		}
		if m := connectionName.FindStringSubmatch(f[3]); m != nil {
			names = append(names, m[1])
		} else {
			names = append(names, "port "+f[2])
		}
	}
	sort.Strings(names)
	return names
}

// requireWhole fails t unless every node runs and the cluster records no partition: with
// pause_minority the nodes heal by themselves, where ignore would stay split.
func requireWhole(t *testing.T, c *testenv.Cluster) {
	t.Helper()
	var status struct {
		RunningNodes []string `json:"running_nodes"`
		Partitions   any      `json:"partitions"`
	}
	out := c.CtlAny(t, "cluster_status", "-q", "--formatter", "json")
	if err := json.Unmarshal([]byte(out), &status); err != nil {
		t.Fatalf("cluster_status: %v\n%s", err, out)
	}
	split := false
	switch p := status.Partitions.(type) {
	case map[string]any:
		split = len(p) != 0
	case []any:
		split = len(p) != 0
	}
	if len(status.RunningNodes) != 3 || split {
		t.Fatalf("the cluster is not whole again: running %v, partitions %v", status.RunningNodes, status.Partitions)
	}
}
