package test

import (
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A window whose ConfirmTimeout ran out closes its connection. The returns of its unroutable
// messages still come after its places among the MaxInFlight were given back; on the same
// connection they filled the returns' buffer (MaxInFlight long) beside the next window's, and
// the client held the next window's returns, and its confirms behind them, up to 5 s before it
// dropped them: that window timed out too (or, with a longer timeout, counted an unroutable
// message routed). Here the first window's confirms and returns come 3 s late, past its 1 s;
// the next window's, on a new connection, at once.
func TestAWindowThatTimedOutClosesItsConnection(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	fwd := newCountingForwarder(t, proxy.Listen)
	p := b.publisher(t, testenv.AMQPURLVia(t, fwd.addr), func(c *messaging.PublisherConfig) {
		c.MaxInFlight, c.ConfirmTimeout = 2, time.Second
	})
	must(t, p.Connect(context.Background()))
	unroutable := func() []messaging.Message {
		msgs := []messaging.Message{newMessage(t, 1), newMessage(t, 2)}
		for i := range msgs {
			msgs[i].Exchange, msgs[i].RoutingKey = b.exchange, "NobodyListens"
		}
		return msgs
	}
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"late","type":"latency","stream":"downstream","attributes":{"latency":3000}}`)); err != nil {
		t.Fatal(err)
	}
	for i, err := range p.Publish(context.Background(), unroutable()) {
		if !errors.Is(err, messaging.ErrBrokerUnavailable) {
			t.Fatalf("message %d of the late window: %v, want no verdict (ErrBrokerUnavailable) at its timeout", i, err)
		}
	}
	must(t, proxy.Toxics.RemoveToxic(context.Background(), "late"))
	for i, err := range p.Publish(context.Background(), unroutable()) {
		if !errors.Is(err, messaging.ErrUnroutable) {
			t.Errorf("message %d of the next window: %v, want ErrUnroutable", i, err)
		}
	}
	testenv.Eventually(t, 5*time.Second, func() bool {
		closed := fwd.closed()
		return len(closed) == 2 && closed[0] && !closed[1]
	}, "the publisher did not close the timed-out window's connection alone (and open one for the next)")
}

// One caller's context ending leaves the other calls' windows on the shared connection alone:
// it closed the connection, and every other window still waiting for its confirms got
// ErrBrokerUnavailable. The ended call's places among the MaxInFlight are given back once its
// confirms come. Here every confirm comes 3 s late, after the closing connection would have
// given up its close (1 s).
func TestACallersEndLeavesTheOtherCallsWindowsAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	p := b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen), func(c *messaging.PublisherConfig) {
		c.MaxInFlight, c.ConfirmTimeout = 2*windowLen, 10*time.Second
	})
	must(t, p.Connect(context.Background()))
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"late","type":"latency","stream":"downstream","attributes":{"latency":3000}}`)); err != nil {
		t.Fatal(err)
	}
	ended, end := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var endedErrs, otherErrs []error
	wg.Go(func() { endedErrs = p.Publish(ended, b.routed(t)) })
	wg.Go(func() { otherErrs = p.Publish(context.Background(), b.routed(t)) })
	// Both windows are written once the queue holds their messages; their confirms are 3 s
	// away.
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == 2*windowLen },
		"the two windows did not reach the queue")
	end()
	wg.Wait()
	for i, err := range otherErrs {
		if err != nil {
			t.Errorf("message %d of the call that waited: %v, want confirmed", i, err)
		}
	}
	for i, err := range endedErrs {
		if err != nil && !errors.Is(err, messaging.ErrBrokerUnavailable) {
			t.Errorf("message %d of the call that stopped waiting: %v, want confirmed or no verdict", i, err)
		}
	}
	// Every place is back: a window as large as MaxInFlight finds room.
	must(t, proxy.Toxics.RemoveToxic(context.Background(), "late"))
	all := append(b.routed(t), b.routed(t)...)
	for i, err := range p.Publish(context.Background(), all) {
		if err != nil {
			t.Fatalf("message %d of a window of MaxInFlight after the ended call: %v, want confirmed", i, err)
		}
	}
}

// A call that stopped waiting for its confirms leaves its messages' places among the
// MaxInFlight held until the confirms come, but no longer than its window's ConfirmTimeout:
// then the connection is closed, as for a window that timed out. A broker that keeps the
// connection and withholds the confirms held them for good: every later window found no room,
// failed without writing, and so closed nothing, and the publisher was wedged (until a missed
// heartbeat). Here the broker's side of the first connection goes silent once it is open.
func TestACallersEndHoldsItsPlacesNoLongerThanItsConfirmTimeout(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fwd := newCountingForwarder(t, testenv.AMQPHost(t))
	confirmTimeout := 2 * time.Second
	p := b.publisher(t, testenv.AMQPURLVia(t, fwd.addr), func(c *messaging.PublisherConfig) {
		// The heartbeat, a minute at least before the client gives a silent broker up, is not
		// what frees the places.
		c.MaxInFlight, c.ConfirmTimeout, c.Heartbeat = windowLen, confirmTimeout, 30*time.Second
	})
	must(t, p.Connect(context.Background()))
	fwd.stall()
	ended, end := context.WithCancel(context.Background())
	defer end()
	started := time.Now()
	done := make(chan []error, 1)
	go func() { done <- p.Publish(ended, b.routed(t)) }()
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == windowLen },
		"the window did not reach the queue")
	end()
	for i, err := range <-done {
		if !errors.Is(err, messaging.ErrBrokerUnavailable) {
			t.Fatalf("message %d of the call that stopped waiting: %v, want no verdict", i, err)
		}
	}
	// The places are back once the window's ConfirmTimeout is over, and its connection closed
	// (within a second, its close unanswered): a window of MaxInFlight goes, on a new one.
	testenv.Eventually(t, confirmTimeout+8*time.Second, func() bool {
		return !slices.ContainsFunc(p.Publish(context.Background(), b.routed(t)), func(err error) bool { return err != nil })
	}, "no window of MaxInFlight is confirmed after the ended call's ConfirmTimeout: its places are still held")
	t.Logf("a window of MaxInFlight was confirmed %s after the ended call began", time.Since(started).Round(time.Millisecond))
	if closed := fwd.closed(); len(closed) < 2 || !closed[0] {
		t.Errorf("the publisher did not close the silent connection and open another: closed %v", closed)
	}
}

// windowLen is how many messages a window of routed holds.
const windowLen = 5

// routed is a window of messages to b's exchange, which routes them to b's queue.
func (b *testBundle) routed(t *testing.T) []messaging.Message {
	t.Helper()
	msgs := make([]messaging.Message, windowLen)
	for i := range msgs {
		msgs[i] = newMessage(t, i)
		msgs[i].Exchange = b.exchange
	}
	return msgs
}

// countingForwarder passes TCP connections on to upstream, and tells which of them the client
// closed. stall makes the connections open so far drop what the server sends, as a broker that
// keeps a connection and sends nothing on it.
type countingForwarder struct {
	addr    string
	mu      sync.Mutex
	conns   []bool // closed by the client, in the order accepted
	stalled []*atomic.Bool
}

func newCountingForwarder(t *testing.T, upstream string) *countingForwarder {
	t.Helper()
	f := &countingForwarder{}
	var held []net.Conn
	// Registered before forward's cleanup, so that it runs after the listener is closed: no
	// connection is accepted once the held ones are closed.
	t.Cleanup(func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		for _, c := range held {
			_ = c.Close()
		}
	})
	f.addr = forward(t, upstream, func(client, server net.Conn) {
		stalled := &atomic.Bool{}
		f.mu.Lock()
		i := len(f.conns)
		f.conns = append(f.conns, false)
		f.stalled = append(f.stalled, stalled)
		held = append(held, client, server)
		f.mu.Unlock()
		go downstream(client, server, stalled)
		go func() {
			copyThenClose(server, client)
			f.mu.Lock()
			f.conns[i] = true
			f.mu.Unlock()
		}()
	}).Addr().String()
	return f
}

// downstream copies what server sends to client until either ends, dropping it while stalled.
func downstream(client, server net.Conn, stalled *atomic.Bool) {
	buf := make([]byte, 32<<10)
	for {
		n, err := server.Read(buf)
		if err != nil {
			return
		}
		if stalled.Load() {
			continue
		}
		if _, err := client.Write(buf[:n]); err != nil {
			return
		}
	}
}

// closed says, for each connection in the order accepted, whether the client closed it.
func (f *countingForwarder) closed() []bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]bool(nil), f.conns...)
}

// stall drops, from now on, what the server sends on the connections open so far.
func (f *countingForwarder) stall() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, s := range f.stalled {
		s.Store(true)
	}
}
