// Package e2e runs the three real service binaries against the local PostgreSQL and RabbitMQ
// and checks what a user of the system sees: orders in, exactly one invoice and one delivered
// confirmation out, whatever fails meanwhile.
package e2e

import (
	"fmt"
	"os"
	"testing"

	"github.com/outboxkit/outbox-inbox/internal/systest"
)

var binDir string

func TestMain(m *testing.M) {
	code := func() int {
		dir, err := os.MkdirTemp("", "e2e-bin-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		if err := systest.Build(dir, true); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		binDir = dir
		return m.Run()
	}()
	os.Exit(code)
}

// smallPools are the e2e tests' database pools, unless a test says otherwise: each system
// reserves every connection its services may open, and at the services' default of 20 two
// systems would not fit the suite's share of PostgreSQL beside each other. 12 is what
// invoicing's parts need at these settings: the readiness check 1, the relay 3, the cleanups
// 2, the consumer 4 and requests 2. The tests' clients outnumber those request connections, and
// are here to check exactly-once, not shedding (the admission tests and the overload benchmark
// do that): HTTP_MAX_IN_FLIGHT lets their requests queue for a connection instead, and
// HTTP_LATENCY_TARGET=0 keeps that limit where it is while -race makes them slow.
var smallPools = []string{"DB_MAX_CONNS=12", "CONSUMER_CONCURRENCY=3", "OUTBOX_LANES=1", "HTTP_MAX_IN_FLIGHT=64", "HTTP_LATENCY_TARGET=0"}

// startSystem starts the race-enabled binaries as opts describes.
func startSystem(t *testing.T, opts systest.Options) *systest.System {
	t.Helper()
	opts.BinDir = binDir
	env := map[string][]string{}
	for _, name := range []string{"order", "invoicing", "notification"} {
		env[name] = append(append([]string{}, smallPools...), opts.Env[name]...)
	}
	opts.Env = env
	s := systest.Start(t, opts)
	s.DumpOnFailure(t)
	return s
}
