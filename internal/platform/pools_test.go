package platform

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
)

// Requests that hold every connection of their pool leave the relay its own: an event
// committed meanwhile is still published, and the process holds no more than DB_MAX_CONNS.
func TestRelayKeepsItsConnectionsWhenRequestsSaturateTheirs(t *testing.T) {
	relaying := RelaySettings{BatchSize: 10, Lanes: 2, PollInterval: 50 * time.Millisecond, MaxBackoff: time.Minute, Retention: time.Hour}
	pools := PoolsOf(&relaying, nil, 0)
	conns := ReadinessConns + pools.Background + pools.Work + MinRequestConns
	testenv.Connections(t, 3+conns) // the database's creation, the test's handle (2), the service
	d := testenv.NewDatabaseWithPool(t, 2)
	b, _ := startBase(t, d, conns, pools, Library(messaging.MigrateOutbox))
	exchange, queue := testenv.UniqueName("orders"), testenv.UniqueName("invoicing")
	testenv.CleanupBroker(t, []string{queue, messaging.DeadLetterQueue(queue)}, []string{exchange})
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: queue, Bindings: []messaging.Binding{{Exchange: exchange, RoutingKey: "Placed"}}}}}
	outbox, err := b.Outbox(b.log, testenv.AMQPURL(), exchange, "svc", topology, relaying)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(outbox.Publisher.Close)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- outbox.Relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("relay: %v", err)
		}
	})

	for range pools.Requests(Common{DBMaxConns: conns}) {
		tx := b.DB.Begin()
		if err := tx.Exec("SELECT 1").Error; err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tx.Rollback() })
	}
	waitCtx, stop := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer stop()
	if err := b.DB.WithContext(waitCtx).Exec("SELECT 1").Error; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a query on the requests' saturated pool: %v, want it to wait out its deadline", err)
	}
	// An event committed by another client of the database.
	if err := d.DB.Exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at) VALUES (gen_random_uuid(), 'Placed', '{}', now())`).Error; err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NOT NULL") == 1
	}, "the relay did not publish the event while requests held every connection of theirs")
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND application_name LIKE 'svc%'", d.Name); n > int64(conns) {
		t.Fatalf("the service has %d connections, more than DB_MAX_CONNS = %d", n, conns)
	}
}

// The sender's and the background pool's sessions plan by index from their start
// (IndexPlansURL; the relay is told so, and sets nothing per batch), and no other pool's do:
// the settings would cost the requests' and the consumers' statements their sequential scans.
func TestOnlyTheSendersAndTheBackgroundPoolPlanByIndex(t *testing.T) {
	t.Parallel()
	pools := PoolsOf(&RelaySettings{Lanes: 1}, &ConsumerSettings{Concurrency: 1}, 1)
	conns := ReadinessConns + pools.Background + pools.Work + pools.Sender + MinRequestConns
	testenv.Connections(t, 3+conns) // the database's creation, the test's handle (2), the service
	d := testenv.NewDatabaseWithPool(t, 2)
	b, _ := startBase(t, d, conns, pools)
	settings := func(db *gorm.DB) (s string) {
		t.Helper()
		if err := db.Raw(indexPlansSQL).Scan(&s).Error; err != nil {
			t.Fatal(err)
		}
		return s
	}
	if err := checkIndexPlans(context.Background(), b.Background, "background pool"); err != nil {
		t.Fatal(err)
	}
	if got := settings(b.Sender); got != "off,off,off" {
		t.Fatalf("the sender's sessions have enable_sort,enable_seqscan,jit %s, want off,off,off", got)
	}
	plain := settings(d.DB)
	for name, db := range map[string]*gorm.DB{"requests'": b.DB, "work": b.Work} {
		if got := settings(db); got != plain {
			t.Fatalf("the %s pool's sessions have enable_sort,enable_seqscan,jit %s, want the server's %s", name, got, plain)
		}
	}
}

// A pool whose sessions did not get the plan settings their connection string asks for (a
// connection pooler in between that drops startup parameters) stops the service at its start,
// with an error that names DATABASE_URL, instead of planning without them unseen.
func TestAPoolWithoutItsPlanSettingsIsRefused(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1) // the pool with the settings
	d := testenv.NewDatabase(t)
	err := checkIndexPlans(context.Background(), d.Driver(t).DB(), "background pool")
	if err == nil || !strings.Contains(err.Error(), "DATABASE_URL: the sessions of the background pool have enable_sort, enable_seqscan and jit") {
		t.Fatalf("a pool of plain sessions: %v, want refused", err)
	}
	dsn, err := IndexPlansURL(d.URL)
	if err != nil {
		t.Fatal(err)
	}
	pool := testenv.OpenPool(t, dsn, 1)
	drv, err := gormdriver.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	if err := checkIndexPlans(context.Background(), drv.DB(), "background pool"); err != nil {
		t.Fatalf("a pool opened through IndexPlansURL: %v", err)
	}
	// One setting short is refused too: the pool's one session, jit turned back on.
	if err := pool.Exec("SET jit = on").Error; err != nil {
		t.Fatal(err)
	}
	if err := checkIndexPlans(context.Background(), drv.DB(), "background pool"); err == nil {
		t.Fatal("a session with jit on was not refused")
	}
}
