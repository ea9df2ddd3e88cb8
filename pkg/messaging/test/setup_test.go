package test

import (
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
)

// TestMain installs the propagator a service installs (the platform's): W3C trace context and
// baggage. The library writes and reads a message's trace context with the global one, a
// no-op until set.
func TestMain(m *testing.M) {
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	os.Exit(m.Run())
}

const eventType = "OrderPlaced"

// testBundle is one test's private world: its own database (with both messaging tables) and
// its own exchange, queue and dead-letter queue on the shared broker.
type testBundle struct {
	db       *testenv.Database
	drv      *gormdriver.Driver // the library's adapter of db's GORM handle
	exchange string
	queue    string
	topology messaging.Topology
	ch       *amqp.Channel
	log      *slog.Logger
	logs     *testenv.Logs
	registry *prometheus.Registry
	metrics  *messaging.Metrics
}

// setupWith is setup for a test that opens extra connections of its own beyond the bundle's
// database pool (a child process's pool, an admin connection).
func setupWith(t testing.TB, extra int) *testBundle {
	t.Helper()
	testenv.Connections(t, testenv.DefaultConnections+extra)
	return setup(t)
}

func setup(t testing.TB) *testBundle {
	t.Helper()
	b := &testBundle{db: testenv.NewDatabase(t)}
	b.drv = b.db.Driver(t)
	b.db.MigrateLibrary(t)
	b.exchange = testenv.UniqueName("orders")
	b.queue = testenv.UniqueName("invoicing")
	b.topology = queueTopology(b.exchange, b.queue, eventType)
	testenv.CleanupBroker(t, []string{b.queue, messaging.DeadLetterQueue(b.queue)}, []string{b.exchange})
	b.ch = testenv.Channel(t)
	declare(t, b.topology)
	b.log, b.logs = testenv.NewLogger(t)
	b.registry = prometheus.NewRegistry()
	metrics, err := messaging.NewMetrics(b.registry, "")
	if err != nil {
		t.Fatal(err)
	}
	b.metrics = metrics
	return b
}

// must fails t on err: for a step of the test's setup.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// driverOf is the library's adapter of db, another pool than the bundle's.
func driverOf(t testing.TB, db *gorm.DB) *gormdriver.Driver {
	t.Helper()
	drv, err := gormdriver.New(db)
	if err != nil {
		t.Fatal(err)
	}
	return drv
}

// declare declares topology on the broker at TEST_AMQP_URL.
func declare(t testing.TB, topology messaging.Topology) {
	t.Helper()
	if err := topology.Declare(testenv.Connection(t), nil); err != nil {
		t.Fatalf("declare topology: %v", err)
	}
}

// queueTopology is a queue bound to keys of exchange.
func queueTopology(exchange, queue string, keys ...string) messaging.Topology {
	q := messaging.ConsumerTopology{Queue: queue}
	for _, k := range keys {
		q.Bindings = append(q.Bindings, messaging.Binding{Exchange: exchange, RoutingKey: k})
	}
	return messaging.Topology{Queues: []messaging.ConsumerTopology{q}}
}

// declareSubscription declares what s declares when it starts.
func declareSubscription[Tx any](t testing.TB, s *messaging.Subscription[Tx]) {
	t.Helper()
	topology, err := s.Topology()
	if err != nil {
		t.Fatal(err)
	}
	declare(t, topology)
}

// enqueue commits n OrderPlaced messages in transactions of up to 1,000 and returns their ids.
func (b *testBundle) enqueue(t testing.TB, n int) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, 0, n)
	for len(ids) < n {
		batch := make([]messaging.Message, 0, 1000)
		for len(batch) < cap(batch) && len(ids)+len(batch) < n {
			batch = append(batch, newMessage(t, len(ids)+len(batch)))
		}
		if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, batch...) }); err != nil {
			t.Fatalf("enqueue: %v", err)
		}
		for _, m := range batch {
			ids = append(ids, m.ID)
		}
	}
	return ids
}

func newMessage(t testing.TB, i int) messaging.Message {
	t.Helper()
	m, err := messaging.NewMessage(eventType, map[string]any{"order_id": uuid.NewString(), "n": i})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// publisher returns a publisher for the bundle's exchange through url (the broker or a proxy),
// its config adjusted by tweak.
func (b *testBundle) publisher(t testing.TB, url string, tweak ...func(*messaging.PublisherConfig)) *messaging.Publisher {
	t.Helper()
	cfg := messaging.PublisherConfig{
		URL: url, ConnectionName: testenv.UniqueName("publisher"), AppID: "order",
		Topology: messaging.Topology{Exchanges: []string{b.exchange}},
		Logger:   b.log,
	}
	for _, f := range tweak {
		f(&cfg)
	}
	p := messaging.NewPublisher(cfg)
	t.Cleanup(p.Close)
	return p
}

func (b *testBundle) relay(t testing.TB, sender messaging.Sender, tweak func(*messaging.RelayConfig)) *messaging.Relay {
	t.Helper()
	cfg := messaging.RelayConfig{DB: b.drv.DB(), Sender: sender, Exchange: b.exchange, Logger: b.log, Metrics: b.metrics}
	if tweak != nil {
		tweak(&cfg)
	}
	r, err := messaging.NewRelay(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// runListeningRelay runs a relay of one lane whose poll is an hour away, and returns once it
// listens for NOTIFY and its lane's two first (empty) batches are past: the one it starts with,
// and the look it takes once it listens, for rows committed while it did not. From then on only
// a NOTIFY, or a look after listening again, can pick up a row. Either batch, late on busy cores,
// would otherwise pick up a row committed after this returns, and a test of the NOTIFY would pass
// without one; with one lane, they are the first two batches ended. Each tweak is applied to the
// relay's configuration after those settings.
func (b *testBundle) runListeningRelay(t testing.TB, tweaks ...func(*messaging.RelayConfig)) {
	t.Helper()
	db := &countingDB{DB: b.drv.DB()}
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) {
		c.DB, c.Lanes, c.PollInterval = db, 1, time.Hour
		for _, tweak := range tweaks {
			tweak(c)
		}
	})
	run(t, r.Run)
	testenv.Eventually(t, 5*time.Second, func() bool {
		return db.ended.Load() >= 2 &&
			testenv.Count(t, b.db.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND query LIKE 'LISTEN%'", b.db.Name) == 1
	}, "relay is not listening, or its first batch and its look once listening are not past")
}

// run starts fn in the background and, at cleanup, cancels it and checks it returned nil
// within 10 s.
func run(t testing.TB, fn func(ctx context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run returned %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("run did not stop within 10 s of cancellation")
		}
	})
}

func (b *testBundle) unprocessed(t testing.TB) int64 {
	t.Helper()
	return testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL")
}

// waitAllSent waits until no outbox row is left unprocessed.
func (b *testBundle) waitAllSent(t testing.TB, timeout time.Duration) {
	t.Helper()
	testenv.Eventually(t, timeout, func() bool { return b.unprocessed(t) == 0 },
		"outbox still has unsent rows")
}

// countIDs counts the deliveries per message id, reporting duplicates and strangers.
func countIDs(t testing.TB, deliveries []amqp.Delivery, want []uuid.UUID) (missing, duplicates, unexpected int) {
	t.Helper()
	seen := make(map[string]int, len(deliveries))
	for _, d := range deliveries {
		seen[d.MessageId]++
	}
	wanted := make(map[string]bool, len(want))
	for _, id := range want {
		wanted[id.String()] = true
		switch n := seen[id.String()]; {
		case n == 0:
			missing++
		case n > 1:
			duplicates += n - 1
		}
	}
	for id := range seen {
		if !wanted[id] {
			unexpected++
		}
	}
	return missing, duplicates, unexpected
}

func assertExactlyOnce(t testing.TB, deliveries []amqp.Delivery, want []uuid.UUID) {
	t.Helper()
	missing, dups, unexpected := countIDs(t, deliveries, want)
	if missing+dups+unexpected > 0 {
		t.Fatalf("of %d messages: %d missing, %d duplicated, %d unexpected (%d deliveries)",
			len(want), missing, dups, unexpected, len(deliveries))
	}
}

// wantNoRowCharged fails if any row carries a failed attempt: what the broker's unavailability
// must never cost a row.
func (b *testBundle) wantNoRowCharged(t testing.TB) {
	t.Helper()
	if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages WHERE attempts > 0 OR last_error IS NOT NULL"); n != 0 {
		t.Fatalf("%d rows were charged an attempt for the broker's unavailability", n)
	}
}
