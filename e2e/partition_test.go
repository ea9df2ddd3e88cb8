package e2e

import (
	"encoding/json"
	"fmt"
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
// resumes by itself once the network heals: nobody restarts anything. That is RabbitMQ 3.x's
// (Mnesia's), the installed release scripts/cluster.sh runs here; 4.3 ignores pause_minority. Every order accepted
// before, during and after is invoiced and notified exactly once, and POST /orders never fails.
func TestClusterPartitionPausesTheMinority(t *testing.T) {
	cluster := testenv.StartNetnsCluster(t)
	s := startSystem(t, systest.Options{Cluster: cluster, Invoicers: 2, Notifiers: 2})
	for _, q := range []string{"invoicing", "notification"} {
		if m := members(t, cluster, s.VHost, q); len(m) != 3 {
			t.Fatalf("queue %s has replicas on %v, want all 3 nodes", q, m)
		}
	}

	traffic := s.StartTraffic(t, 2)
	traffic.WaitFor(t, 30)
	minority := invoicingLeader(t, cluster, s.VHost)
	t.Logf("node %d leads: %s", minority, strings.Join(ledBy(t, cluster, s.VHost, minority), ", "))
	for node := 1; node <= 3; node++ { // who loses their connection with the node decides the stall
		t.Logf("node %d's clients: %s", node, strings.Join(clientsOf(t, cluster, s.VHost, node), ", "))
	}

	var majority []int
	for node := 1; node <= 3; node++ {
		if node != minority {
			majority = append(majority, node)
		}
	}

	cutting := time.Now()
	cluster.Cut(t, minority)
	// Timed from when the command has returned, not from when it was issued: an order placed
	// while the script still starts (a fraction of a second on a loaded machine) reaches the
	// node as if nothing happened, and would pass for no stall at all.
	cut := time.Now()
	// The pause is watched beside the stall, which may well end first: a paused node closes
	// its AMQP listener.
	closed := make(chan time.Duration, 1)
	go func() {
		defer close(closed)
		for deadline := cut.Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			if listening, err := cluster.Listening(minority); err == nil && !listening { // an error: ask again
				closed <- time.Since(cut)
				return
			}
		}
	}()
	stall := untilInvoicedAfter(t, s, cut)
	listenerClosed, ok := <-closed
	if !ok {
		t.Fatalf("node %d, cut off from the other two, still listened 2 min later: not paused", minority)
	}
	// Paused, not crashed, nor gone on alone: it says why in its log, which also dates it to
	// the millisecond.
	paused, ok := cluster.Logged(t, minority, cut, "Cluster minority/secondary status detected", logDelay)
	if !ok {
		t.Fatalf("node %d closed its listener, but its log does not say it found itself in a minority", minority)
	}
	testenv.Eventually(t, 30*time.Second, func() bool { return !cluster.Running(minority) },
		"node %d closed its listener but went on running RabbitMQ", minority)
	t.Logf("invoicing's replicas while node %d is cut off: %v", minority, quorumStatus(t, cluster, s.VHost, "invoicing"))
	// The majority's new leader of invoicing logs when it took over: the part of the stall
	// that is the broker's.
	elected, first := "not in their logs", time.Time{}
	for _, node := range majority {
		at, ok := cluster.Logged(t, node, cut, "queue 'invoicing' in vhost '"+s.VHost+"': candidate -> leader", logDelay)
		if ok && (first.IsZero() || at.Before(first)) {
			elected, first = fmt.Sprintf("%s, on node %d", at.Sub(cut).Round(time.Millisecond), node), at
		}
	}
	t.Logf("cut off: node %d paused %s after the cut (its log), its listener closed after %s; invoicing's new leader elected after %s; stall %s from the cut until an order placed after it was invoiced (the cut command took %s)",
		minority, paused.Sub(cut).Round(time.Millisecond), listenerClosed.Round(time.Millisecond), elected, stall.Round(time.Millisecond), cut.Sub(cutting).Round(time.Millisecond))
	traffic.WaitFor(t, 30) // orders flow on the majority
	if now := invoicingLeader(t, cluster, s.VHost); now == minority {
		t.Fatalf("node %d still leads the invoicing queue while cut off", minority)
	}
	if listening, err := cluster.Listening(minority); err != nil || listening {
		t.Fatalf("node %d resumed while still cut off (or: %v)", minority, err)
	}

	cluster.Heal(t, minority)
	healed := time.Now()
	testenv.Eventually(t, 2*time.Minute, func() bool {
		listening, err := cluster.Listening(minority)
		return err == nil && listening
	}, "node %d did not resume after the network healed", minority)
	listenerBack := time.Since(healed)
	// It opens its listener a moment before it has finished starting.
	testenv.Eventually(t, 30*time.Second, func() bool { return cluster.Running(minority) },
		"node %d listens again but does not run RabbitMQ", minority)
	resumed, ok := cluster.Logged(t, minority, healed, "Server startup complete", logDelay)
	if !ok {
		t.Fatalf("node %d runs RabbitMQ again, but its log does not say it started", minority)
	}
	// Asked of the majority, which the replicas rejoin, rather than of the node just back.
	var seen string
	testenv.Eventually(t, 2*time.Minute, func() bool {
		invoicing := quorumStatus(t, cluster, s.VHost, "invoicing", majority...)
		notification := quorumStatus(t, cluster, s.VHost, "notification", majority...)
		if now := fmt.Sprint(invoicing, notification); now != seen { // how the replicas come back
			t.Logf("%s after the heal: invoicing %v, notification %v", time.Since(healed).Round(time.Millisecond), invoicing, notification)
			seen = now
		}
		return len(invoicing) == 3 && len(notification) == 3
	}, "node %d's queue replicas did not come back", minority)
	polled := time.Since(healed)
	requireWhole(t, cluster)
	// A replica that starts again logs when it first hears from its leader: when it rejoined,
	// to the millisecond, where the polls above take seconds each.
	var heard []string
	var rejoined time.Duration // the later of the two
	for _, q := range []string{"invoicing", "notification"} {
		at, ok := cluster.Logged(t, minority, healed, "queue '"+q+"' in vhost '"+s.VHost+"': detected a new leader", logDelay)
		if !ok {
			heard, rejoined = append(heard, q+" (not in its log)"), max(rejoined, polled)
			continue
		}
		heard, rejoined = append(heard, q+" "+at.Sub(healed).Round(time.Millisecond).String()), max(rejoined, at.Sub(healed))
	}
	t.Logf("healed: node %d resumed %s after the heal (its log; listening after %s); its replicas heard from their leaders after: %s (the CLI polls saw both within %s)",
		minority, resumed.Sub(healed).Round(time.Millisecond), listenerBack.Round(time.Millisecond), strings.Join(heard, ", "), polled.Round(time.Millisecond))
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

// logDelay bounds how long after an event a node's log holds its line: the log is written
// with a delay of its own.
const logDelay = 10 * time.Second

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
