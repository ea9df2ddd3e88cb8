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
	// failOnce waits for a dial that fails, and returns when that publish returned: the
	// publisher set its next dial's time before then.
	failOnce := func() time.Time {
		t.Helper()
		var failed time.Time
		testenv.Eventually(t, 10*time.Second, func() bool {
			err := p.Publish(context.Background(), []messaging.Message{msg})[0]
			failed = time.Now()
			return err != nil && strings.Contains(err.Error(), "dial rabbitmq") && !strings.Contains(err.Error(), "next connection attempt")
		}, "the publisher did not dial again")
		return failed
	}
	// delayAfter publishes msg and returns at least how long the dial that failed by failed made
	// the next one wait: the time the publisher says is left, and the time gone since failed
	// (a stalled test would otherwise read a remainder as the delay). ok is false if the
	// publisher dialled again instead: the test stalled past the whole delay.
	delayAfter := func(failed time.Time) (d time.Duration, ok bool) {
		t.Helper()
		asked := time.Now()
		err := p.Publish(context.Background(), []messaging.Message{msg})[0]
		m := regexp.MustCompile(`next connection attempt in (\S+):`).FindStringSubmatch(fmt.Sprint(err))
		if m == nil {
			if err != nil && strings.Contains(err.Error(), "dial rabbitmq") {
				return 0, false
			}
			t.Fatalf("publish with the broker away: %v, want the time to the next connection attempt", err)
		}
		left, perr := time.ParseDuration(m[1])
		must(t, perr)
		// The publisher says what is left to the millisecond: up to half of one more than it is.
		return left - time.Millisecond/2 + asked.Sub(failed), true
	}
	proxy.Stop()
	failOnce()
	failOnce()
	failed := failOnce()
	for extra := 0; ; extra++ {
		d, ok := delayAfter(failed)
		if ok {
			if d <= base {
				t.Fatalf("after %d failed dials the next waits %s, want more than the base %s: nothing to start over", 3+extra, d, base)
			}
			break
		}
		if extra == 2 {
			t.Fatalf("the test stalled past the publisher's reconnect delay after each of %d failed dials: the machine is too busy to show anything", 3+extra)
		}
		failed = time.Now() // it dialled again, and failed: one more failure, a longer delay
	}
	// The check that the delays start over: a try in which the test stalled past the first
	// delay, so that the publisher dialled again, shows nothing and is made again.
	const tries = 3
	for try := 1; ; try++ {
		must(t, proxy.Start())
		testenv.Eventually(t, 10*time.Second, func() bool { return p.Connect(context.Background()) == nil },
			"the publisher did not reconnect")
		proxy.Stop()
		d, ok := delayAfter(failOnce())
		if ok {
			if d > base {
				t.Fatalf("after a connection that worked, a failed dial makes the next wait %s, want the base %s at most", d, base)
			}
			return
		}
		if try == tries {
			t.Fatalf("the test stalled past the publisher's first reconnect delay in each of %d tries: the machine is too busy to show anything", tries)
		}
		t.Logf("the test stalled past the first reconnect delay: tried again")
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
