package e2e

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// The three services, two replicas of each consumer, on a three-node RabbitMQ cluster while
// orders arrive steadily: the node that leads the invoicing queue is SIGKILLed, then started
// again. Every order accepted before, during and after is invoiced and notified exactly once,
// POST /orders never fails, and nobody restarts anything.
func TestClusterLosesTheQueueLeaderUnderLoad(t *testing.T) {
	cluster := testenv.StartCluster(t)
	s := startSystem(t, systest.Options{Cluster: cluster, Invoicers: 2, Notifiers: 2})
	s.PoisonSent = true // one, published while the leader is gone, dead-lettered by the others
	for _, q := range []string{"invoicing", "notification"} {
		if m := members(t, cluster, s.VHost, q); len(m) != 3 {
			t.Fatalf("queue %s has replicas on %v, want all 3 nodes", q, m)
		}
	}

	traffic := s.StartTraffic(t, 2)
	traffic.WaitFor(t, 30)
	leader := invoicingLeader(t, cluster, s.VHost)
	t.Logf("node %d leads: %s", leader, strings.Join(ledBy(t, cluster, s.VHost, leader), ", "))

	cluster.Kill(t, leader)
	// After the script returns: the node is dead by then, and orders placed while the script
	// started (a few hundred ms on a busy machine) would otherwise count as placed after it.
	killed := time.Now()
	// A poison message while the node is gone: its dead-lettering must survive the loss too
	// (the consumer acks it only once the dead-letter queue confirmed the copy).
	poison := uuid.NewString()
	publishConfirmed(t, s, amqp.Publishing{MessageId: poison, Type: "OrderPlaced", ContentType: "application/json", Body: []byte("not json")})
	stall := untilInvoicedAfter(t, s, killed)
	t.Logf("stall: %s from the kill until an order placed after it was invoiced", stall.Round(time.Millisecond))
	traffic.WaitFor(t, 30) // orders flow on two nodes
	if now := invoicingLeader(t, cluster, s.VHost); now == leader {
		t.Fatalf("node %d still leads the invoicing queue after it was killed", leader)
	}

	cluster.Revive(t, leader)
	testenv.Eventually(t, 60*time.Second, func() bool {
		return len(members(t, cluster, s.VHost, "invoicing")) == 3 && len(members(t, cluster, s.VHost, "notification")) == 3
	}, "node %d's queue replicas did not come back", leader)
	traffic.WaitFor(t, 30)

	ids, cancelled, serverErrors := traffic.Stop(t)
	if serverErrors != 0 {
		t.Fatalf("%d requests got a 5xx while a broker node was lost", serverErrors)
	}
	if lost := s.CheckAccepted(t, ids); lost != 0 {
		t.Fatalf("%d orders committed without their 201 reaching the client", lost)
	}
	got := s.WaitExactlyOnce(t, int64(len(ids)), 120*time.Second)
	// Dead-lettered by both consumers, with its reason. At least once: an ack that went to the
	// dead leader is lost, the new leader delivers the message again, and it is dead-lettered
	// again; a redrive hands every copy to the inbox under the same message id.
	for _, q := range []string{"invoicing", "notification"} {
		dead := testenv.Drain(t, s.Channel(t), messaging.DeadLetterQueue(q), time.Second)
		if len(dead) == 0 {
			t.Fatalf("%s is empty: the poison message was lost", messaging.DeadLetterQueue(q))
		}
		for _, d := range dead {
			if reason, _ := d.Headers[messaging.HeaderDeadLetterReason].(string); d.MessageId != poison || reason == "" {
				t.Fatalf("%s holds message %q with reason %q, want only the poison message, with its reason", messaging.DeadLetterQueue(q), d.MessageId, reason)
			}
		}
		t.Logf("%s holds the poison message %d time(s), each with its reason", messaging.DeadLetterQueue(q), len(dead))
	}
	t.Logf("%d orders accepted before, during and after the loss of node %d, %d cancelled; %d invoices, %d notifications sent, %d duplicates suppressed, stall %s",
		len(ids), leader, cancelled, got.Invoices, got.Sent, s.DuplicatesSuppressed(t), stall.Round(time.Millisecond))
}

var clusterNode = regexp.MustCompile(`outbox-inbox-(\d)@`)

// quorumStatus returns each replica of queue that answers, with its raft state, by node number,
// as the first node that answers sees them: one of prefer if it can, never one cut off.
func quorumStatus(t *testing.T, c *testenv.Cluster, vhost, queue string, prefer ...int) map[int]string {
	t.Helper()
	status := map[int]string{}
	for _, node := range slices.Concat(prefer, []int{1, 2, 3}) {
		if c.IsCut(node) {
			continue // it would only know itself, or wait for the others
		}
		out, err := c.TryQueues(node, "quorum_status", queue, "--vhost", vhost)
		if err != nil {
			continue // that node is down: ask another
		}
		for line := range strings.SplitSeq(out, "\n") {
			m := clusterNode.FindStringSubmatch(line)
			if m == nil {
				continue
			}
			for _, state := range []string{"leader", "follower"} {
				if strings.Contains(line, state) {
					status[int(m[1][0]-'0')] = state
				}
			}
		}
		return status
	}
	t.Fatalf("no node answered quorum_status for %s", queue)
	return nil
}

// members lists the nodes whose replica of queue is a leader or a follower.
func members(t *testing.T, c *testenv.Cluster, vhost, queue string) []int {
	t.Helper()
	var nodes []int
	for node := range quorumStatus(t, c, vhost, queue) {
		nodes = append(nodes, node)
	}
	return nodes
}

// invoicingLeader is the node that leads the invoicing queue: the one both cluster tests take
// away.
func invoicingLeader(t *testing.T, c *testenv.Cluster, vhost string) int {
	t.Helper()
	const queue = "invoicing"
	var leader int
	testenv.Eventually(t, 60*time.Second, func() bool {
		for node, state := range quorumStatus(t, c, vhost, queue) {
			if state == "leader" {
				leader = node
				return true
			}
		}
		return false
	}, "queue %s has no leader", queue)
	return leader
}

// ledBy lists the queues of vhost whose leader is node.
func ledBy(t *testing.T, c *testenv.Cluster, vhost string, node int) []string {
	t.Helper()
	out := c.CtlAny(t, "list_queues", "-q", "-p", vhost, "--no-table-headers", "name", "leader")
	var led []string
	for line := range strings.SplitSeq(out, "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[1] == c.Node(node) {
			led = append(led, f[0])
		}
	}
	return led
}

// untilInvoicedAfter waits for the first invoice of an order placed after since, and returns
// how long after since it appeared: the stall of the whole chain when the broker lost a node.
func untilInvoicedAfter(t *testing.T, s *systest.System, since time.Time) time.Duration {
	t.Helper()
	var at time.Time
	testenv.Eventually(t, 120*time.Second, func() bool {
		var ids []uuid.UUID
		if err := s.Order.DB.DB.Raw("SELECT id FROM orders WHERE created_at > ?", since).Scan(&ids).Error; err != nil {
			t.Fatal(err)
		}
		if len(ids) == 0 || testenv.Count(t, s.Invoicing.DB.DB, "SELECT count(*) FROM invoices WHERE order_id IN ?", ids) == 0 {
			return false
		}
		at = time.Now()
		return true
	}, "no order placed after the node was lost got its invoice")
	return at.Sub(since)
}

// publishConfirmed publishes p to the orders exchange through the first node that takes it
// and confirms it, trying the nodes again until one does.
func publishConfirmed(t *testing.T, s *systest.System, p amqp.Publishing) {
	t.Helper()
	testenv.Eventually(t, 60*time.Second, func() bool {
		for _, u := range strings.Split(s.AMQPURL, ",") {
			if publishOnce(u, p) == nil {
				return true
			}
		}
		return false
	}, "no node confirmed the poison message")
}

func publishOnce(url string, p amqp.Publishing) error {
	conn, err := amqp.Dial(url)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Confirm(false); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	confirm, err := ch.PublishWithDeferredConfirmWithContext(ctx, "orders", "OrderPlaced", true, false, p)
	if err != nil {
		return err
	}
	ok, err := confirm.WaitContext(ctx)
	if err != nil {
		return fmt.Errorf("wait for the confirm: %w", err)
	}
	if !ok {
		return errors.New("nacked")
	}
	return nil
}
