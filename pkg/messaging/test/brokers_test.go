package test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A list of broker URLs may have spaces around its entries, and empty ones: each node it names
// is tried, and nothing else; a list that names none says so.
func TestBrokerListIsTrimmedOfSpacesAndEmptyEntries(t *testing.T) {
	t.Parallel()
	dead := testenv.Proxy(t, testenv.AMQPHost(t))
	dead.Stop()
	connect := func(list string) error {
		p := messaging.NewPublisher(messaging.PublisherConfig{URL: list, Logger: quiet})
		defer p.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		return p.Connect(ctx)
	}
	if err := connect(" " + testenv.AMQPURL() + " ,, "); err != nil {
		t.Fatalf("connect to a node named with spaces around it: %v", err)
	}
	deadURL := testenv.AMQPURLVia(t, dead.Listen)
	if err := connect(" " + deadURL + " ,," + deadURL + ", "); err == nil || strings.Count(err.Error(), dead.Listen) != 2 || strings.Contains(err.Error(), "scheme") {
		t.Fatalf("connect to two nodes down: %v, want an error naming both, and no other entry", err)
	}
	if err := connect(" , ,"); err == nil || !strings.Contains(err.Error(), "PublisherConfig.URL names no broker") || errors.Is(err, messaging.ErrBrokerUnavailable) {
		t.Fatalf("connect to an empty list: %v, want it said, not the broker unavailable", err)
	}
}

// A node that does not answer is passed over, wherever it comes in the list.
func TestPublisherConnectsToTheNodeThatAnswers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dead := testenv.Proxy(t, testenv.AMQPHost(t))
	dead.Stop()
	list := testenv.AMQPURLVia(t, dead.Listen) + "," + testenv.AMQPURL()
	for range 8 { // the order is random each time: both orders come up
		p := b.publisher(t, list)
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		err := p.Connect(ctx)
		cancel()
		if err != nil {
			t.Fatalf("connect with one node down: %v", err)
		}
		p.Close()
	}
	none := b.publisher(t, testenv.AMQPURLVia(t, dead.Listen)+","+testenv.AMQPURLVia(t, dead.Listen))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := none.Connect(ctx); err == nil || strings.Count(err.Error(), dead.Listen) != 2 {
		t.Fatalf("connect with every node down: %v, want an error naming both", err)
	}
}

// The consumer's node fails: it moves to another node of the list by itself and goes on.
func TestConsumerMovesToAnotherNodeWhenItsNodeFails(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	nodes := []*toxiproxy.Proxy{testenv.Proxy(t, testenv.AMQPHost(t)), testenv.Proxy(t, testenv.AMQPHost(t))}
	list := testenv.AMQPURLVia(t, nodes[0].Listen) + "," + testenv.AMQPURLVia(t, nodes[1].Listen)
	c := b.consumer(t, list, b.drv, workFunc, nil)

	handled := int64(0)
	deliver := func(step string) {
		t.Helper()
		b.publishRaw(t, publishing(newMessage(t, int(handled))))
		handled++
		testenv.Eventually(t, 30*time.Second, func() bool { return b.workDone(t) == handled }, "%s: message not handled", step)
	}
	deliver("both nodes up")
	// Each node fails in turn while the other is up: whichever the consumer was on, it has to
	// move at least once.
	for i, n := range nodes {
		n.Stop()
		deliver(fmt.Sprintf("node %d down", i+1))
		if err := n.Start(); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, 10*time.Second, c.Ready, "consumer not ready")
	if n := len(b.logs.Lines("consumer started")); n < 2 {
		t.Fatalf("consumer started %d times, want a move to the other node", n)
	}
}
