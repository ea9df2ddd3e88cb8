package test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// stallingBroker is a proxy to the test's broker that passes the conversation on until the
// client sends a frame on a channel for which stall reports true, and from then on passes
// nothing either way, holding the connection open: a broker that hangs at that point. stalled
// receives a value each time a connection stalls; release closes the connections it holds (as
// the test's end does). Channel 0 carries the handshake, the first other channel a client opens
// is its first channel.open.
func stallingBroker(t *testing.T, stall func(channel uint16) bool) (url string, stalled <-chan struct{}, release func()) {
	t.Helper()
	signal := make(chan struct{}, 16)
	var mu sync.Mutex
	var held []net.Conn
	hold := func(c ...net.Conn) {
		mu.Lock()
		defer mu.Unlock()
		held = append(held, c...)
	}
	release = func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			_ = c.Close()
		}
	}
	// Registered before forward's cleanup, so that it runs after the listener is closed: no
	// connection is accepted once the held ones are closed.
	t.Cleanup(release)
	ln := forward(t, testenv.AMQPHost(t), func(client, server net.Conn) {
		hold(client, server)
		var isStalled atomic.Bool
		go func() { // server to client, until the stall
			buf := make([]byte, 32<<10)
			for {
				n, err := server.Read(buf)
				if isStalled.Load() || err != nil {
					return
				}
				if _, err := client.Write(buf[:n]); err != nil {
					return
				}
			}
		}()
		go func() { // client to server, frame by frame, until the stall
			if stalledAt(client, server, stall) {
				isStalled.Store(true)
				signal <- struct{}{}
			}
		}()
	})
	return testenv.AMQPURLVia(t, ln.Addr().String()), signal, release
}

// stalledAt passes the protocol header, then whole frames from client to server, and reports
// true at the first frame on a channel stall names, which it keeps; false if the conversation
// ended first.
func stalledAt(client io.Reader, server io.Writer, stall func(channel uint16) bool) bool {
	header := make([]byte, 8)
	if _, err := io.ReadFull(client, header); err != nil {
		return false
	}
	if _, err := server.Write(header); err != nil {
		return false
	}
	for {
		frame, err := readFrame(client)
		if err != nil {
			return false
		}
		if stall(binary.BigEndian.Uint16(frame[1:3])) {
			return true
		}
		if _, err := server.Write(frame); err != nil {
			return false
		}
	}
}

// runUntilStalled runs s against a broker that stalls where stall says, cancels its context
// once the connection stalled, and returns how long Run then took to return.
func runUntilStalled(t *testing.T, b *testBundle, stall func(channel uint16) bool) time.Duration {
	t.Helper()
	url, stalled, _ := stallingBroker(t, stall)
	s, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{Name: b.queue, URL: url, Topology: b.topology, Logger: b.log})
	if err != nil {
		t.Fatal(err)
	}
	must(t, messaging.Handle(s, b.orderPlaced(), workFunc))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	select {
	case <-stalled:
	case <-time.After(15 * time.Second):
		t.Fatal("the subscription's connection never reached the point where the broker stalls")
	}
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run = %v, want nil at a shutdown", err)
		}
		return time.Since(start)
	case <-time.After(time.Minute):
		t.Fatal("Run did not return within a minute of its context's end")
		return 0
	}
}

// A broker that accepts the connection and never finishes the handshake holds no shutdown up:
// the dial and the handshake end with Run's context, not at their 10 s timeout.
func TestSubscriptionStopsWhileItsBrokerStallsTheHandshake(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if took := runUntilStalled(t, b, func(uint16) bool { return true }); took > 2*time.Second {
		t.Fatalf("Run returned %s after its context ended, during a stalled handshake; want at once", took.Round(time.Millisecond))
	}
}

// Nor one that stalls once connected, while the subscription declares its topology and opens its
// channels: the connection is closed when Run's context ends, not when heartbeats give up on it.
func TestSubscriptionStopsWhileItsBrokerStallsTheSetup(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if took := runUntilStalled(t, b, func(channel uint16) bool { return channel != 0 }); took > 2*time.Second {
		t.Fatalf("Run returned %s after its context ended, during a stalled setup; want at once", took.Round(time.Millisecond))
	}
}

// A broker that stalls right after the handshake, before its first answer to the setup, is
// given up within the heartbeats' bound and dialled again. The client sets no read deadline
// until a frame arrives after its handshake: on RabbitMQ 4.3 the subscription waited for its
// first channel for ever, neither consuming nor trying another connection.
func TestSubscriptionDialsAgainABrokerThatStallsItsSetup(t *testing.T) {
	t.Parallel()
	b := setup(t)
	url, stalled, _ := stallingBroker(t, func(channel uint16) bool { return channel != 0 })
	s, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{Name: b.queue, URL: url, Topology: b.topology, Logger: b.log,
		Heartbeat: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	must(t, messaging.Handle(s, b.orderPlaced(), workFunc))
	stop := start(t, s.Run)
	for i := 1; i <= 2; i++ {
		select {
		case <-stalled:
		case <-time.After(15 * time.Second):
			t.Fatalf("connection %d never stalled within 15 s: the one before was not given up (2 s heartbeats)", i)
		}
	}
	if err := stop(); err != nil {
		t.Errorf("Run = %v, want nil at a shutdown", err)
	}
}

// A caller whose context ends during a dial says nothing about the broker: the next caller
// dials at once, not after a failure's reconnect backoff (a minute here).
func TestPublisherDoesNotCountACallersEndedContextAsABrokerFailure(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var stalling atomic.Bool
	stalling.Store(true)
	url, _, _ := stallingBroker(t, func(uint16) bool { return stalling.Load() })
	p := b.publisher(t, url, func(c *messaging.PublisherConfig) {
		c.Reconnect = messaging.Backoff{Base: time.Minute, Max: time.Minute}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	err := p.Connect(ctx)
	cancel()
	if !errors.Is(err, messaging.ErrBrokerUnavailable) {
		t.Fatalf("Connect with 300 ms to a broker that stalls = %v, want ErrBrokerUnavailable", err)
	}
	stalling.Store(false)
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Connect(ctx); err != nil {
		t.Fatalf("Connect after an earlier caller gave up = %v, want a connection at once", err)
	}
}

// A publisher whose broker stalls, in the handshake or once connected, gives up when its
// caller's context ends: Connect and Publish are bounded by it, not by the dial's timeout.
func TestPublisherGivesUpAStalledConnectionWithItsContext(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for what, stall := range map[string]func(uint16) bool{
		"the handshake": func(uint16) bool { return true },
		"the setup":     func(channel uint16) bool { return channel != 0 },
	} {
		url, _, _ := stallingBroker(t, stall)
		p := b.publisher(t, url)
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		start := time.Now()
		err := p.Connect(ctx)
		cancel()
		if took := time.Since(start); !errors.Is(err, messaging.ErrBrokerUnavailable) || took > 2*time.Second {
			t.Errorf("Connect with 500 ms to a broker that stalls %s: %v after %s; want ErrBrokerUnavailable at its deadline", what, err, took.Round(time.Millisecond))
		}
	}
}

// A relay's lane that claimed its rows waits for the connection another call is opening no
// longer than its own context: a broker that accepts the connection and then stalls held the
// publisher's lock, and the lane's transaction with its row locks, as long as the Connect
// lasted: until heartbeats gave up on it, or for ever after a stall right after the handshake.
func TestPublishDoesNotWaitBehindAStalledConnect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	url, stalled, release := stallingBroker(t, func(channel uint16) bool { return channel != 0 })
	p := b.publisher(t, url, func(c *messaging.PublisherConfig) { c.Heartbeat = 2 * time.Second })
	connected := make(chan error, 1)
	go func() { connected <- p.Connect(context.Background()) }()
	select {
	case <-stalled:
	case <-time.After(10 * time.Second):
		t.Fatal("the publisher's connection never reached the point where the broker stalls")
	}
	m, err := messaging.NewMessage(eventType, map[string]string{"n": "1"})
	if err != nil {
		t.Fatal(err)
	}
	m.RoutingKey = b.queue
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	errs := p.Publish(ctx, []messaging.Message{m})
	if took := time.Since(start); !errors.Is(errs[0], messaging.ErrBrokerUnavailable) || took > time.Second {
		t.Errorf("Publish with 200 ms behind a Connect to a broker that stalls: %v after %s; want ErrBrokerUnavailable at its deadline", errs[0], took.Round(time.Millisecond))
	}
	select {
	case err := <-connected:
		if !errors.Is(err, messaging.ErrBrokerUnavailable) {
			t.Errorf("Connect to a broker that stalls = %v, want ErrBrokerUnavailable", err)
		}
	case <-time.After(15 * time.Second):
		release() // so that Connect ends, and the publisher can be closed at the cleanup
		t.Error("Connect still waiting for a broker that stalls, 15 s after, with 2 s heartbeats")
	}
}

// A broker that stops reading in the middle of a window larger than the socket's buffers (a
// partition, a half-open connection) holds the write; the client's reader gives the connection
// up at its missed heartbeats, before the window's timeout, and waits for the channel the write
// holds. Closing the connection then did nothing (it was closed already): Publish hung until TCP
// gave up, minutes later, and with it the relay's lane, its transaction and its shutdown.
func TestPublishGivesUpAWriteTheBrokerStoppedReading(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var armed atomic.Bool
	url, stalled, release := stallingBroker(t, func(channel uint16) bool { return armed.Load() && channel != 0 })
	p := b.publisher(t, url, func(c *messaging.PublisherConfig) { c.ConfirmTimeout, c.Heartbeat = 6*time.Second, time.Second })
	must(t, p.Connect(context.Background()))
	armed.Store(true)
	msgs := make([]messaging.Message, 500) // 20 MB: more than the sockets' buffers hold
	for i := range msgs {
		m, err := messaging.NewMessage(eventType, map[string]string{"pad": strings.Repeat("x", 40_000)})
		if err != nil {
			t.Fatal(err)
		}
		m.RoutingKey = b.queue // through the default exchange, which needs no check
		msgs[i] = m
	}
	done := make(chan []error, 1)
	go func() { done <- p.Publish(context.Background(), msgs) }()
	select {
	case <-stalled:
	case <-time.After(10 * time.Second):
		t.Fatal("the publisher's connection never reached the point where the broker stalls")
	}
	select {
	case errs := <-done:
		for i, err := range errs {
			if !errors.Is(err, messaging.ErrBrokerUnavailable) {
				t.Fatalf("message %d's verdict = %v, want no verdict", i, err)
			}
		}
	case <-time.After(20 * time.Second):
		release() // so that the publisher, stuck, can be closed at the cleanup
		t.Fatal("Publish still writing to a broker that stopped reading, 20 s after, with a 6 s confirm timeout")
	}
}
