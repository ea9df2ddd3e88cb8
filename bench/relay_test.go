package bench

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
)

// consumerQueues are the quorum queues the consumer services bind to the orders exchange.
var consumerQueues = []string{"invoicing", "notification"}

// ceilingWindow is how many confirms the ceiling keeps in flight, about the relay's batch (500).
const ceilingWindow = 512

// relayBinary is the headline: the real order binary, with its default settings, drains a
// committed backlog into the real topology, next to the broker's ceiling for the same messages.
func relayBinary(t *testing.T, r *report, binDir string) {
	t.Helper()
	sys := systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, DiscardLogs: true})
	// The consumers ran only to declare their queues as they do in production; running, they
	// would compete with the relay for the two cores. The order service starts again once its
	// backlog is committed.
	sys.Invoicing.Stop(t)
	sys.Notification.Stop(t)
	sys.Order.Stop(t)

	// The ceiling is measured right before and right after the drain, and the relay is compared
	// with their mean: on this noisy machine one measurement can land in a busy second, and the
	// two show how much the broker itself moved meanwhile. The backlog is committed first, so
	// nothing else happens between the ceilings and the drain.
	fillOutbox(t, sys.Order.DB.DB, 50_000)
	before, size := publishCeiling(t, sys, 50_000, ceilingWindow)
	d := drainBacklog(t, sys, 50_000)
	after, _ := publishCeiling(t, sys, 50_000, ceilingWindow)

	ceiling := (before + after) / 2
	// Two windows for reference: one confirm at a time, and twice the ceiling's, which shows
	// whether a relay that keeps more in flight could pass the ceiling.
	single, _ := publishCeiling(t, sys, 2_000, 1)
	double, _ := publishCeiling(t, sys, 50_000, 2*ceilingWindow)
	fillOutbox(t, sys.Order.DB.DB, 150_000)
	big := drainBacklog(t, sys, 150_000)
	// The relay before its lanes, last: one batch at a time (claim, publish, wait for every
	// confirm, mark, commit), the same binary with OUTBOX_LANES=1.
	fillOutbox(t, sys.Order.DB.DB, 50_000)
	sys.Order.SetEnv("OUTBOX_LANES=1")
	serial := drainBacklog(t, sys, 50_000)

	r.add(fmt.Sprintf("ceiling: %d B OrderPlaced, persistent, mandatory → orders → 2 quorum queues, %d confirms in flight, no DB", size, ceilingWindow),
		fmt.Sprintf("%.0f msg/s", ceiling), fmt.Sprintf("before %.0f, after the drain %.0f", before, after), "1.00", "", true)
	r.add("   the same, one confirm at a time", fmt.Sprintf("%.0f msg/s", single), "ceiling", fmt.Sprintf("%.2f", single/ceiling), "", true)
	r.add(fmt.Sprintf("   the same, %d confirms in flight", 2*ceilingWindow), fmt.Sprintf("%.0f msg/s", double), "ceiling", fmt.Sprintf("%.2f", double/ceiling), "", true)
	r.add(fmt.Sprintf("relay: order binary, defaults, drains 50,000 committed rows (%s; first sent %.2f s after start)", d.delivery(50_000), d.first.Seconds()),
		fmt.Sprintf("%.0f msg/s", d.rate), "ceiling", fmt.Sprintf("%.2f", d.rate/ceiling), "≥ 0.60 (aim 0.80)", d.rate/ceiling >= 0.60 && d.exact(50_000))
	r.add(fmt.Sprintf("   the same, OUTBOX_LANES=1: one batch at a time, as before the lanes (%s)", serial.delivery(50_000)),
		fmt.Sprintf("%.0f msg/s", serial.rate), "ceiling", fmt.Sprintf("%.2f", serial.rate/ceiling), "", true)
	r.add(fmt.Sprintf("   the same, 150,000 rows (%s; first sent %.2f s after start)", big.delivery(150_000), big.first.Seconds()),
		fmt.Sprintf("%.0f msg/s", big.rate), "ceiling", fmt.Sprintf("%.2f", big.rate/ceiling), "", true)
}

// placedEvent is an OrderPlaced event like the order service's, with one line.
func placedEvent() events.OrderPlaced {
	return events.OrderPlaced{OrderID: uuid.New(), CustomerID: "c-42", TotalCents: 2500,
		Lines: []events.Line{{SKU: "SKU-1", Quantity: 2, UnitPriceCents: 1250}}, PlacedAt: time.Now().UTC()}
}

// orderPlaced is a message like the order service's.
func orderPlaced(t *testing.T) messaging.Message {
	t.Helper()
	m, err := messaging.NewMessage(events.OrderPlacedType, placedEvent())
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// publishCeiling publishes n OrderPlaced messages to the system's orders exchange as the relay's
// publisher does (persistent, mandatory, JSON, with confirms), on a connection of its own, with
// window confirms in flight: a sliding window, the next publish as soon as the oldest is
// confirmed. The messages are built before the clock starts, so it measures the broker. It
// requires every message in both consumer queues, empties them, and returns the rate and the
// body size.
func publishCeiling(t *testing.T, sys *systest.System, n, window int) (float64, int) {
	t.Helper()
	conn, err := amqp.Dial(sys.AMQPURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, 1))
	returned := make(chan int, 1) // the counter ends even if this test stops first
	go func() {
		count := 0
		for range returns {
			count++
		}
		returned <- count
	}()
	msgs := make([]amqp.Publishing, n)
	for i := range msgs {
		m := orderPlaced(t)
		msgs[i] = amqp.Publishing{ContentType: "application/json", DeliveryMode: amqp.Persistent, MessageId: m.ID.String(),
			Type: m.Type, Timestamp: m.OccurredAt, AppId: "order", Body: m.Payload}
	}
	confirms := make([]*amqp.DeferredConfirmation, 0, n)
	confirmed := 0
	wait := func() {
		if !confirms[confirmed].Wait() {
			t.Fatal("the broker nacked a ceiling publish")
		}
		confirmed++
	}
	start := time.Now()
	for _, m := range msgs {
		if len(confirms)-confirmed == window {
			wait()
		}
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), events.Exchange, events.OrderPlacedType, true, false, m)
		if err != nil {
			t.Fatal(err)
		}
		confirms = append(confirms, dc)
	}
	for confirmed < n {
		wait()
	}
	took := time.Since(start)
	if err := ch.Close(); err != nil {
		t.Fatal(err)
	}
	if unroutable := <-returned; unroutable > 0 {
		t.Fatalf("%d ceiling publishes were unroutable", unroutable)
	}
	for i, got := range takeQueued(t, sys) {
		if got != n {
			t.Fatalf("queue %s holds %d of the %d ceiling messages", consumerQueues[i], got, n)
		}
	}
	return rate(n, took), len(msgs[0].Body)
}

// takeQueued returns how many messages each consumer queue holds, and empties them. A quorum
// queue confirms a publish once it is enqueued, so the counts are final once every publish is
// confirmed.
func takeQueued(t *testing.T, sys *systest.System) []int {
	t.Helper()
	ch := sys.Channel(t)
	counts := make([]int, len(consumerQueues))
	for i, q := range consumerQueues {
		counts[i] = testenv.QueueDepth(t, ch, q)
		if _, err := ch.QueuePurge(q, false); err != nil {
			t.Fatalf("purge %s: %v", q, err)
		}
	}
	return counts
}

// backlogDrain is one run of the order binary through a committed backlog.
type backlogDrain struct {
	rate   float64
	first  time.Duration // from the start to the first processed_at: the start-up and one batch
	queued []int         // messages in each consumer queue afterwards
}

// exact reports whether each consumer queue got as many messages as there were rows: a count,
// which the end-to-end tests complete by checking every message.
func (d backlogDrain) exact(n int) bool {
	for _, got := range d.queued {
		if got != n {
			return false
		}
	}
	return true
}

// delivery tells what the queues got against n rows: lost and duplicated messages.
func (d backlogDrain) delivery(n int) string {
	if d.exact(n) {
		return "0 lost, 0 dup per queue"
	}
	parts := make([]string, len(d.queued))
	for i, got := range d.queued {
		parts[i] = fmt.Sprintf("%s %d lost, %d dup", consumerQueues[i], max(0, n-got), max(0, got-n))
	}
	return strings.Join(parts, "; ")
}

// drainBacklog starts the stopped order service on the n rows committed to its outbox, waits
// until every one is sent, stops it, and takes what reached the consumer queues.
func drainBacklog(t *testing.T, sys *systest.System, n int) backlogDrain {
	t.Helper()
	db := sys.Order.DB.DB
	// The time runs on the database's clock, from just before the binary starts to the last
	// processed_at. So the rate includes the binary's start-up, as after a restart with a
	// backlog waiting, and not the polling of the wait.
	start := dbNow(t, db)
	sys.Order.Start(t)
	waitDrained(t, db, n)
	sys.Order.Stop(t)
	rows, first, last := sentSince(t, db, start)
	if rows != n {
		t.Fatalf("%d rows were sent, want %d", rows, n)
	}
	return backlogDrain{rate: rate(n, last), first: first, queued: takeQueued(t, sys)}
}

// fillOutbox commits n unsent OrderPlaced rows in transactions of 1,000.
func fillOutbox(t *testing.T, db *gorm.DB, n int) {
	t.Helper()
	drv, err := gormdriver.New(db)
	if err != nil {
		t.Fatal(err)
	}
	for done := 0; done < n; {
		batch := make([]messaging.Message, 0, 1000)
		for ; len(batch) < cap(batch) && done < n; done++ {
			batch = append(batch, orderPlaced(t))
		}
		if err := db.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), drv, tx, batch...) }); err != nil {
			t.Fatal(err)
		}
	}
}

// dbNow is the database's clock, the one processed_at is stamped with.
func dbNow(t *testing.T, db *gorm.DB) time.Time {
	t.Helper()
	var now time.Time
	if err := db.Raw("SELECT clock_timestamp()").Scan(&now).Error; err != nil {
		t.Fatal(err)
	}
	return now
}

// waitDrained waits until no outbox row is left unsent. EXISTS stops at the first unsent row of
// the partial index, so polling costs the database little while the relay is measured.
func waitDrained(t *testing.T, db *gorm.DB, n int) {
	t.Helper()
	testenv.Eventually(t, 5*time.Minute, func() bool {
		var unsent bool
		if err := db.Raw("SELECT EXISTS (SELECT 1 FROM outbox_messages WHERE processed_at IS NULL)").Scan(&unsent).Error; err != nil {
			t.Fatal(err)
		}
		return !unsent
	}, "the relay did not drain %d rows", n)
}

// sentSince counts the rows sent since start, and how long after start the first and the last
// were marked.
func sentSince(t *testing.T, db *gorm.DB, start time.Time) (rows int, first, last time.Duration) {
	t.Helper()
	var s struct {
		Rows        int
		First, Last float64
	}
	if err := db.Raw(`SELECT count(*) AS rows, extract(epoch FROM min(processed_at) - @start) AS first,
		extract(epoch FROM max(processed_at) - @start) AS last FROM outbox_messages WHERE processed_at >= @start`,
		map[string]any{"start": start}).Scan(&s).Error; err != nil {
		t.Fatal(err)
	}
	return s.Rows, time.Duration(s.First * float64(time.Second)), time.Duration(s.Last * float64(time.Second))
}

// drainSetup is a database with the outbox and a queue bound to take what in-process relays send.
type drainSetup struct {
	db       *testenv.Database
	exchange string
	queue    string
	ch       *amqp.Channel
}

func newDrainSetup(t *testing.T) *drainSetup {
	t.Helper()
	d := &drainSetup{db: testenv.NewDatabase(t), exchange: testenv.UniqueName("bench"), queue: testenv.UniqueName("bench")}
	d.db.Migrate(t, platform.Library(messaging.MigrateOutbox))
	testenv.CleanupBroker(t, []string{d.queue, d.queue + ".dlq"}, []string{d.exchange})
	d.ch = testenv.Channel(t)
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{
		{Queue: d.queue, Bindings: []messaging.Binding{{Exchange: d.exchange, RoutingKey: events.OrderPlacedType}}}}}
	if err := topology.Declare(testenv.Connection(t), nil); err != nil {
		t.Fatal(err)
	}
	return d
}

// settle leaves the table as it is between bursts: vacuumed, with fresh statistics, and its
// dirty pages written out, so that a drain does not pay for the writes of the setup before it
// (a million rows inserted and vacuumed dirty more pages than shared_buffers holds).
func (d *drainSetup) settle(t *testing.T) {
	t.Helper()
	for _, stmt := range []string{"VACUUM ANALYZE outbox_messages", "CHECKPOINT"} {
		if err := d.db.DB.Exec(stmt).Error; err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
}

// inProcessBacklog is the rows each in-process drain sends.
const inProcessBacklog = 50_000

// drain runs relays until none of the inProcessBacklog committed rows is left unsent, and returns the rate
// (on the database's clock, from the relays' start to the last processed_at) and how many
// messages reached the queue, duplicates included.
func (d *drainSetup) drain(t *testing.T, relays int) (float64, int) {
	t.Helper()
	const n = inProcessBacklog
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	start := dbNow(t, d.db.DB)
	for range relays {
		pub := messaging.NewPublisher(messaging.PublisherConfig{URL: testenv.AMQPURL(),
			Topology: messaging.Topology{Exchanges: []string{d.exchange}}})
		t.Cleanup(pub.Close)
		relay, err := messaging.NewRelay(messaging.RelayConfig{DB: d.db.Driver(t).DB(), Sender: pub, Exchange: d.exchange, PollInterval: 10 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() { _ = relay.Run(ctx) })
	}
	waitDrained(t, d.db.DB, n)
	cancel()
	wg.Wait()
	rows, _, last := sentSince(t, d.db.DB, start)
	if rows != n {
		t.Fatalf("%d rows were sent, want %d", rows, n)
	}
	got := testenv.QueueDepth(t, d.ch, d.queue)
	if _, err := d.ch.QueuePurge(d.queue, false); err != nil {
		t.Fatal(err)
	}
	return rate(n, last), got
}

// relayInProcess: secondary figures with relays run in this process (messaging.NewRelay), one
// queue bound, to compare relays with relays.
func relayInProcess(t *testing.T, r *report) {
	t.Helper()
	const n = inProcessBacklog
	d := newDrainSetup(t)
	// The first drain on a new database is cold (new connections, empty caches, no statistics).
	// Every compared drain comes after an earlier one, on a settled table, with its rows
	// committed then: warm is compared with warm.
	fillOutbox(t, d.db.DB, n)
	cold, gotCold := d.drain(t, 1)
	d.settle(t)
	fillOutbox(t, d.db.DB, n)
	warm, got := d.drain(t, 1)
	d.settle(t)
	fillOutbox(t, d.db.DB, n)
	three, got3 := d.drain(t, 3)
	if gotCold != n || got != n {
		t.Errorf("1 relay: the queue got %d and %d messages, want %d each", gotCold, got, n)
	}

	// The same drain with a million sent rows in the table: the partial index keeps the claim
	// as cheap as on an empty table.
	if err := d.db.DB.Exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at, processed_at, next_attempt_at)
		SELECT gen_random_uuid(), 'OrderPlaced', '{"order_id":"x"}', now() - interval '1 day', now() - interval '1 day', now() - interval '1 day'
		FROM generate_series(1, 1000000)`).Error; err != nil {
		t.Fatal(err)
	}
	d.settle(t)
	fillOutbox(t, d.db.DB, n)
	var plan []string
	if err := d.db.DB.Raw(`EXPLAIN SELECT id, type, payload, correlation_id, occurred_at, attempts FROM outbox_messages
		WHERE processed_at IS NULL AND next_attempt_at <= now() ORDER BY occurred_at, id LIMIT 500 FOR UPDATE SKIP LOCKED`).Scan(&plan).Error; err != nil {
		t.Fatal(err)
	}
	fmt.Printf("EXPLAIN of the claim with 1,000,000 sent and %d unsent rows:\n  %s\n", n, strings.Join(plan, "\n  "))
	usesIndex := strings.Contains(strings.Join(plan, " "), "outbox_messages_unprocessed_idx")
	scale, gotScale := d.drain(t, 1)

	r.add("in-process: 1 relay drains 50,000 rows, warm (claim, publish, confirm, mark)", fmt.Sprintf("%.0f msg/s", warm), "", "", "", true)
	r.add("   the same, the first drain on a new database (cold)", fmt.Sprintf("%.0f msg/s", cold), "1 relay, warm", fmt.Sprintf("%.2f", cold/warm), "", true)
	r.add(fmt.Sprintf("in-process: 3 relays drain 50,000 rows (%d duplicates on the queue)", got3-n), fmt.Sprintf("%.0f msg/s", three), "1 relay, warm",
		fmt.Sprintf("%.2f", three/warm), "> 1.00, 0 dup", three > warm && got3 == n)
	r.add("in-process: 1 relay, 50,000 rows next to 1,000,000 sent ones (plan: partial index)", fmt.Sprintf("%.0f msg/s", scale), "1 relay, warm",
		fmt.Sprintf("%.2f", scale/warm), "≥ 0.90", scale/warm >= 0.90 && usesIndex && gotScale == n)
}
