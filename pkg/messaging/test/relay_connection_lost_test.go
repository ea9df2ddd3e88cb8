package test

import (
	"bufio"
	"context"
	"encoding/binary"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A connection lost while a batch waits for its confirms is an outage a probe can see end: the
// pending confirms resolve, unacked, on a closed channel of a closed connection, and that is
// no verdict on a connection still up (the silent kind, which only a trial row the broker
// answers for ends). Here the broker withholds every confirm, on every connection, and the link
// is cut while the batch waits: the relay's probe finds a new connection, which ends the
// outage, and no row is published while it lasts. Taken for the silent kind, the outage went
// on one trial row at a time, each left unconfirmed in turn, for as long as the confirms were
// withheld, however healthy the new connection.
func TestAConnectionLostAwaitingConfirmsEndsOnTheNewConnection(t *testing.T) {
	t.Parallel()
	b := setup(t)
	link := &cuttableLink{published: make(chan struct{})}
	ln := forward(t, testenv.AMQPHost(t), link.pair)
	pub := b.publisher(t, testenv.AMQPURLVia(t, ln.Addr().String()), func(c *messaging.PublisherConfig) {
		c.ConfirmTimeout = 30 * time.Second // the cut, not the timeout, ends the wait
	})
	sender := &outageWatchingSender{Publisher: pub, registry: b.registry, exchange: b.exchange}
	b.enqueue(t, 1)
	run(t, b.relay(t, sender, func(c *messaging.RelayConfig) {
		c.Lanes, c.DisableNotify, c.PollInterval = 1, true, 50*time.Millisecond
		c.BrokerRetry = messaging.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond}
		c.ShutdownGrace = 200 * time.Millisecond
	}).Run)

	select {
	case <-link.published:
	case <-time.After(10 * time.Second):
		t.Fatal("the relay published no row")
	}
	link.cut()
	const paused, resumed = "broker unavailable; relay paused", "broker available again; relay resumed"
	testenv.Eventually(t, 10*time.Second, func() bool {
		if n := sender.duringOutage.Load(); n > 0 {
			t.Fatalf("%d rows published during the outage of a lost connection, a new one at hand: taken for one no probe can see end (%q)",
				n, b.logs.Lines(paused))
		}
		return len(b.logs.Lines(resumed)) > 0
	}, "the outage of the lost connection did not end on the new one: %q", b.logs.Lines(paused))
	if n := len(b.logs.Lines(paused)); n != 1 {
		t.Fatalf("%d outages began, want the lost connection's: %q", n, b.logs.Lines(paused))
	}
	if n := sender.duringOutage.Load(); n > 0 {
		t.Fatalf("%d rows published during the outage of a lost connection", n)
	}
}

// cuttableLink passes AMQP connections on to the broker, but the broker's confirms, as
// confirmlessBroker does; published closes at the first basic.publish a client sends, and cut
// closes every connection it passed on so far, both ends. The connections after it pass too.
type cuttableLink struct {
	mu        sync.Mutex
	conns     []net.Conn
	once      sync.Once
	published chan struct{}
}

func (l *cuttableLink) pair(client, server net.Conn) {
	l.mu.Lock()
	l.conns = append(l.conns, client, server)
	l.mu.Unlock()
	go func() {
		l.watchPublishes(server, client)
		_ = server.Close()
	}()
	go func() {
		withoutConfirms(client, server)
		_ = client.Close()
	}()
}

// watchPublishes copies the frames client sends to server until either ends, and closes
// published at the first basic.publish.
func (l *cuttableLink) watchPublishes(server net.Conn, client net.Conn) {
	const (
		methodFrame  = 1
		basic        = 60
		basicPublish = 40
		methodLen    = 4 // a method's class and method ids
	)
	r := bufio.NewReader(client)
	if _, err := r.Discard(8); err != nil { // the protocol header, "AMQP" 0 0 9 1
		return
	}
	if _, err := server.Write([]byte{'A', 'M', 'Q', 'P', 0, 0, 9, 1}); err != nil {
		return
	}
	for {
		frame, err := readFrame(r)
		if err != nil {
			return
		}
		if _, err := server.Write(frame); err != nil {
			return
		}
		if frame[0] == methodFrame && len(frame) > frameHeaderLen+methodLen &&
			binary.BigEndian.Uint16(frame[7:9]) == basic && binary.BigEndian.Uint16(frame[9:11]) == basicPublish {
			l.once.Do(func() { close(l.published) })
		}
	}
}

func (l *cuttableLink) cut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.conns {
		_ = c.Close()
	}
	l.conns = nil
}

// outageWatchingSender is a Publisher (its Connect and PublishTimeout too) that counts the
// Publish calls made while outbox_relay_broker_up of exchange is 0: with one lane, a silent
// outage's trial rows.
type outageWatchingSender struct {
	*messaging.Publisher
	registry     *prometheus.Registry
	exchange     string
	duringOutage atomic.Int32
}

func (s *outageWatchingSender) Publish(ctx context.Context, msgs []messaging.Message) []error {
	if brokerDownNow(s.registry, s.exchange) {
		s.duringOutage.Add(1)
	}
	return s.Publisher.Publish(ctx, msgs)
}

// brokerDownNow says whether outbox_relay_broker_up of exchange is 0.
func brokerDownNow(registry *prometheus.Registry, exchange string) bool {
	families, err := registry.Gather()
	if err != nil {
		return false
	}
	for _, f := range families {
		if f.GetName() != "outbox_relay_broker_up" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "exchange" && l.GetValue() == exchange {
					return m.GetGauge().GetValue() == 0
				}
			}
		}
	}
	return false
}
