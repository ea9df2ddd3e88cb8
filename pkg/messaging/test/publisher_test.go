package test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A publisher that failed to connect dials again only after its reconnect delay: meanwhile
// every call gets ErrBrokerUnavailable at once, and a broker that refuses connections (here a
// listener that closes each one) is not dialled by every call of every lane.
func TestPublisherDialsAgainOnlyAfterItsReconnectDelay(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	var dials atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			dials.Add(1)
			_ = c.Close()
		}
	}()
	p := messaging.NewPublisher(messaging.PublisherConfig{
		URL: "amqp://guest:guest@" + ln.Addr().String() + "/", Logger: quiet,
		Reconnect: messaging.Backoff{Base: time.Minute, Max: time.Minute},
	})
	t.Cleanup(p.Close)
	msg := newMessage(t, 1)
	for i := range 5 {
		if errs := p.Publish(context.Background(), []messaging.Message{msg}); !errors.Is(errs[0], messaging.ErrBrokerUnavailable) {
			t.Fatalf("publish %d: %v, want ErrBrokerUnavailable", i+1, errs[0])
		}
	}
	if n := dials.Load(); n != 1 {
		t.Fatalf("%d connections for 5 publishes within the reconnect delay, want 1", n)
	}
}

// A connection that worked starts the reconnect delays over: after an outage of several failed
// dials and a recovery, the next loss of the broker is retried at the base delay again, not at
// the delay the earlier outage had reached.
func TestPublisherStartsItsReconnectDelaysOverAfterAConnection(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	const base = 200 * time.Millisecond
	p := b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen), func(c *messaging.PublisherConfig) {
		c.Reconnect = messaging.Backoff{Base: base, Max: time.Minute}
	})
	msg := newMessage(t, 1)
	// nextDial publishes msg and returns how long the publisher says it waits before its next dial.
	nextDial := func() time.Duration {
		t.Helper()
		err := p.Publish(context.Background(), []messaging.Message{msg})[0]
		m := regexp.MustCompile(`next connection attempt in (\S+):`).FindStringSubmatch(fmt.Sprint(err))
		if m == nil {
			t.Fatalf("publish with the broker away: %v, want the time to the next connection attempt", err)
		}
		d, perr := time.ParseDuration(m[1])
		must(t, perr)
		return d
	}
	failOnce := func() { // a dial that fails, and how long it makes the next one wait
		t.Helper()
		testenv.Eventually(t, 10*time.Second, func() bool {
			err := p.Publish(context.Background(), []messaging.Message{msg})[0]
			return err != nil && strings.Contains(err.Error(), "dial rabbitmq") && !strings.Contains(err.Error(), "next connection attempt")
		}, "the publisher did not dial again")
	}
	proxy.Stop()
	for range 3 {
		failOnce()
	}
	if d := nextDial(); d <= base {
		t.Fatalf("after 3 failed dials the next waits %s, want more than the base %s: nothing to start over", d, base)
	}
	must(t, proxy.Start())
	testenv.Eventually(t, 10*time.Second, func() bool { return p.Connect(context.Background()) == nil },
		"the publisher did not reconnect")
	proxy.Stop()
	failOnce()
	if d := nextDial(); d > base {
		t.Fatalf("after a connection that worked, a failed dial makes the next wait %s, want the base %s at most", d, base)
	}
}

// A connection lost while a window waits for its confirms gives its messages no verdict: the
// broker may have routed them or not, so they are unsent, not refused, and a relay charges
// them no attempt. (Confirms come back late here, and the link is cut before they do.)
func TestAConnectionLostBeforeTheConfirmsIsNoVerdict(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	p := b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen))
	must(t, p.Connect(context.Background()))
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"late","type":"latency","stream":"downstream","attributes":{"latency":3000}}`)); err != nil {
		t.Fatal(err)
	}
	msgs := make([]messaging.Message, 20)
	for i := range msgs {
		msgs[i] = newMessage(t, i)
		msgs[i].Exchange = b.exchange
	}
	cut := time.AfterFunc(500*time.Millisecond, proxy.Stop)
	defer cut.Stop()
	for i, err := range p.Publish(context.Background(), msgs) {
		if !errors.Is(err, messaging.ErrBrokerUnavailable) || errors.Is(err, messaging.ErrNacked) {
			t.Fatalf("message %d: verdict %v, want no verdict (ErrBrokerUnavailable)", i, err)
		}
	}
}

// Every message of a window may come back unroutable: each gets its own ErrUnroutable, at the
// speed of its confirms, however few of the returns the client could hold before they are read.
func TestAWindowOfUnroutableMessagesGetsItsVerdictsAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p := b.publisher(t, testenv.AMQPURL(), func(c *messaging.PublisherConfig) { c.ConfirmTimeout = 5 * time.Second })
	msgs := make([]messaging.Message, 50)
	for i := range msgs {
		msgs[i] = newMessage(t, i)
		msgs[i].Exchange, msgs[i].RoutingKey = b.exchange, "NobodyListens"
	}
	start := time.Now()
	for i, err := range p.Publish(context.Background(), msgs) {
		if !errors.Is(err, messaging.ErrUnroutable) {
			t.Fatalf("message %d: verdict %v after %s, want ErrUnroutable", i, err, time.Since(start).Round(time.Millisecond))
		}
	}
}
