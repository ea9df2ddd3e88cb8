package test

import (
	"context"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// After a relay and a consumer went through broken, reset and half-open connections and were
// stopped, no goroutine of theirs is left behind. Not parallel: Go runs it before the parallel
// tests resume, so the goroutine count is this test's alone.
func TestNoGoroutineLeftAfterFaultsAndShutdown(t *testing.T) {
	b := setup(t)
	b.createWorkTable(t)
	runtime.GC()
	before := goroutinesNotOfTheProxy()

	func() {
		proxy := testenv.Proxy(t, testenv.AMQPHost(t))
		url := testenv.AMQPURLVia(t, proxy.Listen)
		pub := b.publisher(t, url, func(c *messaging.PublisherConfig) { c.ConfirmTimeout = time.Second })
		relay := b.relay(t, pub, func(c *messaging.RelayConfig) {
			c.PollInterval, c.Backoff = 50*time.Millisecond, messaging.Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}
		})
		consumer, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{Name: b.queue, URL: url, Topology: b.topology,
			Heartbeat: time.Second, ShutdownGrace: time.Second, Logger: b.log,
			Reconnect: messaging.Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		must(t, messaging.Handle(consumer, b.orderPlaced(), workFunc))
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		wg.Go(func() { _ = relay.Run(ctx) })
		wg.Go(func() { _ = consumer.Run(ctx) })

		b.enqueue(t, 50)
		testenv.Eventually(t, 20*time.Second, func() bool { return b.workDone(t) == 50 }, "first messages not handled")
		proxy.Stop() // broken
		b.enqueue(t, 50)
		if err := proxy.Start(); err != nil {
			t.Fatal(err)
		}
		testenv.Eventually(t, 15*time.Second, consumer.Ready, "consumer did not reconnect")
		if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"blackhole","type":"timeout","attributes":{"timeout":0}}`)); err != nil {
			t.Fatal(err)
		}
		testenv.Eventually(t, 15*time.Second, func() bool { return !consumer.Ready() }, "half-open connection not detected")
		if err := proxy.Toxics.RemoveToxic(context.Background(), "blackhole"); err != nil {
			t.Fatal(err)
		}
		testenv.Eventually(t, 30*time.Second, func() bool { return b.workDone(t) == 100 }, "messages after the faults not handled")
		cancel()
		wg.Wait()
		pub.Close()
		proxy.Stop()
	}()

	deadline := time.Now().Add(10 * time.Second)
	for {
		runtime.GC()
		after := goroutinesNotOfTheProxy()
		if after <= before {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("goroutines left behind: %d before, %d after:\n%s", before, after, allStacks())
		}
		time.Sleep(50 * time.Millisecond) // the stopped components' goroutines are on their way out
	}
}

// goroutinesNotOfTheProxy counts the goroutines, leaving out the test proxy's own: a toxiproxy
// link cut while bytes are in flight can leave its toxic blocked on a send for good, a leak of
// the test's tool, not of the code under test.
func goroutinesNotOfTheProxy() int {
	n := 0
	for _, g := range strings.Split(allStacks(), "\n\n") {
		if !strings.Contains(g, "github.com/Shopify/toxiproxy") {
			n++
		}
	}
	return n
}

// allStacks is every goroutine's stack, whole: a buffer too small would cut the list short and
// undercount.
func allStacks() string {
	for size := 1 << 20; ; size *= 2 {
		buf := make([]byte, size)
		if n := runtime.Stack(buf, true); n < size {
			return string(buf[:n])
		}
	}
}
