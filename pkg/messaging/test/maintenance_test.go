package test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/prometheus/client_golang/prometheus"
)

func TestOutboxStats(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	ids := b.enqueue(t, 4)
	db := b.db.DB
	// Two sent long ago, one sent just now, one still pending, failing, and 90 s old.
	exec := func(q string, args ...any) {
		t.Helper()
		if err := db.Exec(q, args...).Error; err != nil {
			t.Fatal(err)
		}
	}
	exec("UPDATE outbox_messages SET processed_at = now() - interval '8 days' WHERE id IN ?", ids[:2])
	exec("UPDATE outbox_messages SET processed_at = now() WHERE id = ?", ids[2])
	exec("UPDATE outbox_messages SET attempts = 6, occurred_at = now() - interval '90 seconds' WHERE id = ?", ids[3])

	s, err := messaging.ReadOutboxStats(ctx, b.drv.DB())
	if err != nil {
		t.Fatal(err)
	}
	if s.Pending != 1 || s.MaxAttempts != 6 || s.OldestPending < 89*time.Second || s.OldestPending > 100*time.Second {
		t.Fatalf("stats = %+v, want 1 pending, 6 attempts, about 90 s old", s)
	}

	must(t, messaging.RegisterOutboxStats(b.registry, "", b.drv.DB(), b.log))
	wantMetric(t, b.registry, "outbox_pending_messages 1")
	wantMetric(t, b.registry, "outbox_max_attempts 6")
	wantMetric(t, b.registry, "outbox_stats_errors_total 0") // exported before any failure
}

// The metrics register under the namespace given, once per registry: a second registration is
// an error that registers nothing, not a panic and not a second set of collectors.
func TestMetricsRegisterOncePerRegistry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reg := prometheus.NewRegistry()
	m, err := messaging.NewMetrics(reg, "shop")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := messaging.NewMetrics(reg, "shop"); err == nil {
		t.Fatal("a second NewMetrics on one registry succeeded")
	}
	// A registration refused half-way leaves none of the collectors behind.
	refusing := &refusingRegisterer{Registerer: prometheus.NewRegistry(), refuseAt: 3, registered: map[prometheus.Collector]bool{}}
	if _, err := messaging.NewMetrics(refusing, "shop"); err == nil {
		t.Fatal("NewMetrics succeeded on a registry that refused a collector")
	}
	if n := len(refusing.registered); n != 0 {
		t.Errorf("a failed NewMetrics left %d collectors registered", n)
	}
	must(t, messaging.RegisterOutboxStats(reg, "shop", b.drv.DB(), b.log))
	if err := messaging.RegisterOutboxStats(reg, "shop", b.drv.DB(), b.log); err == nil {
		t.Fatal("a second RegisterOutboxStats on one registry succeeded")
	}
	// Counted by the collectors registered first, under the namespace.
	res, err := messaging.DeleteSentOutboxMessages(context.Background(), b.drv.DB(), time.Hour, messaging.CleanupOptions{Metrics: m})
	if err != nil || res.Skipped {
		t.Fatalf("cleanup = %+v, %v", res, err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, f := range families {
		names[f.GetName()] = true
	}
	for _, name := range []string{"shop_outbox_cleanup_deleted_total", "shop_outbox_pending_messages", "shop_outbox_stats_errors_total"} {
		if !names[name] {
			t.Errorf("the registry has no %s: %v", name, names)
		}
	}
}

// refusingRegisterer refuses its refuseAt-th registration, and keeps track of what stays
// registered.
type refusingRegisterer struct {
	prometheus.Registerer
	refuseAt, calls int
	registered      map[prometheus.Collector]bool
}

func (r *refusingRegisterer) Register(c prometheus.Collector) error {
	if r.calls++; r.calls == r.refuseAt {
		return errors.New("refused")
	}
	r.registered[c] = true
	return r.Registerer.Register(c)
}

func (r *refusingRegisterer) Unregister(c prometheus.Collector) bool {
	delete(r.registered, c)
	return r.Registerer.Unregister(c)
}
