// Package bench measures the system against this machine's own limits: every figure is printed
// next to a baseline measured in the same run, because the machine is shared and noisy and the
// ratio is what counts. Run it with scripts/bench.sh.
package bench

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// row is one line of the final table.
type row struct {
	name, value, baseline, ratio, target, verdict string
}

type report struct {
	mu   sync.Mutex
	rows []row
}

func (r *report) add(name, value, baseline, ratio, target string, ok bool) {
	verdict := "ok"
	if !ok {
		verdict = "MISSED"
	}
	if target == "" {
		verdict = ""
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rows = append(r.rows, row{name, value, baseline, ratio, target, verdict})
}

func (r *report) print() {
	w := []int{0, 0, 0, 0, 0, 0}
	all := append([]row{{"figure", "measured", "baseline (same run)", "ratio", "target", ""}}, r.rows...)
	for _, x := range all {
		for i, c := range []string{x.name, x.value, x.baseline, x.ratio, x.target, x.verdict} {
			w[i] = max(w[i], len([]rune(c)))
		}
	}
	for i, x := range all {
		cells := []string{x.name, x.value, x.baseline, x.ratio, x.target, x.verdict}
		fmt.Print("|")
		for j, c := range cells {
			fmt.Printf(" %s%s |", c, strings.Repeat(" ", w[j]-len([]rune(c))))
		}
		fmt.Println()
		if i == 0 {
			fmt.Print("|")
			for j := range cells {
				fmt.Printf("%s|", strings.Repeat("-", w[j]+2))
			}
			fmt.Println()
		}
	}
}

func TestPerformance(t *testing.T) {
	if os.Getenv("BENCH") != "1" {
		t.Skip("the benchmark suite takes minutes; run scripts/bench.sh (BENCH=1)")
	}
	binDir := t.TempDir()
	if err := systest.Build(binDir, false); err != nil {
		t.Fatal(err)
	}
	var r report
	defer r.print()

	// Each phase is a subtest, so its databases, queues and processes are gone before the next
	// one measures anything.
	var b1, b2 float64
	phase := func(name string, fn func(t *testing.T)) {
		if !t.Run(name, fn) {
			t.FailNow()
		}
	}
	phase("B1", func(t *testing.T) { b1 = brokerCeiling(t, &r) })
	phase("B2", func(t *testing.T) { b2 = databaseCeiling(t, &r) })
	phase("relay", func(t *testing.T) { relayDrain(t, &r, b1) })
	phase("post", func(t *testing.T) { postThroughput(t, &r, binDir, b2) })
	phase("latency-notify", func(t *testing.T) { endToEndLatency(t, &r, binDir, true) })
	phase("latency-poll", func(t *testing.T) { endToEndLatency(t, &r, binDir, false) })
	var oneByOne float64
	phase("consumer-baseline", func(t *testing.T) { oneByOne = consumerThroughput(t, nil, binDir, 0, "CONSUMER_BATCH_SIZE=1") })
	phase("consumer", func(t *testing.T) { consumerThroughput(t, &r, binDir, oneByOne) })
}

func rate(n int, d time.Duration) float64 { return float64(n) / d.Seconds() }

// brokerCeiling (B1): persistent publishes to a durable quorum queue with confirms, 500 in
// flight (the relay's batch), no database; and one confirm at a time, for reference.
func brokerCeiling(t *testing.T, r *report) float64 {
	t.Helper()
	exchange, queue := testenv.UniqueName("bench"), testenv.UniqueName("bench")
	testenv.CleanupBroker(t, []string{queue, queue + ".dlq"}, []string{exchange})
	ch := testenv.Channel(t)
	if err := (messaging.ConsumerTopology{Exchange: exchange, Queue: queue, RoutingKeys: []string{"B"}}).Declare(ch); err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	body := []byte(`{"order_id":"` + uuid.NewString() + `","customer_id":"c-42","lines":[{"sku":"SKU-1","quantity":2,"unit_price_cents":1250}],"total_cents":2500}`)
	publish := func(n, window int) time.Duration {
		start := time.Now()
		for sent := 0; sent < n; {
			batch := make([]*amqp.DeferredConfirmation, 0, window)
			for ; len(batch) < window && sent < n; sent++ {
				dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), exchange, "B", true, false,
					amqp.Publishing{DeliveryMode: amqp.Persistent, ContentType: "application/json", MessageId: uuid.NewString(), Body: body})
				if err != nil {
					t.Fatal(err)
				}
				batch = append(batch, dc)
			}
			for _, dc := range batch {
				if !dc.Wait() {
					t.Fatal("nack")
				}
			}
		}
		took := time.Since(start)
		if _, err := ch.QueuePurge(queue, false); err != nil {
			t.Fatal(err)
		}
		return took
	}
	windowed := rate(50_000, publish(50_000, 500))
	single := rate(2_000, publish(2_000, 1))
	r.add("B1 broker ceiling: persistent, quorum queue, 500 confirms in flight", fmt.Sprintf("%.0f msg/s", windowed), "", "1.00", "", true)
	r.add("   the same, one confirm at a time", fmt.Sprintf("%.0f msg/s", single), "B1", fmt.Sprintf("%.2f", single/windowed), "", true)
	return windowed
}

// databaseCeiling (B2): the order service's own transaction (order + line + outbox row +
// NOTIFY), issued directly with pgx from 8 connections for 10 s.
func databaseCeiling(t *testing.T, r *report) float64 {
	t.Helper()
	db := testenv.NewDatabase(t)
	db.Migrate(t, messaging.MigrateOutbox, func(ctx context.Context, sqlDB *sql.DB) error {
		_, err := sqlDB.ExecContext(ctx, `CREATE TABLE orders (id uuid PRIMARY KEY, customer_id text NOT NULL, total_cents bigint NOT NULL,
			created_at timestamptz NOT NULL, idempotency_key text UNIQUE, request_hash text);
			CREATE TABLE order_lines (order_id uuid NOT NULL REFERENCES orders (id), line_no int NOT NULL, sku text NOT NULL,
			quantity bigint NOT NULL, unit_price_cents bigint NOT NULL, PRIMARY KEY (order_id, line_no))`)
		return err
	})
	pool, err := pgxpool.New(context.Background(), db.URL+"&pool_max_conns=8")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	const conns, duration = 8, 10 * time.Second
	var done atomic.Int64
	ctx, cancel := context.WithTimeout(context.Background(), duration)
	defer cancel()
	var wg sync.WaitGroup
	start := time.Now()
	for range conns {
		wg.Go(func() {
			for ctx.Err() == nil {
				id, _ := uuid.NewV7()
				msgID, _ := uuid.NewV7()
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `INSERT INTO orders (id, customer_id, total_cents, created_at) VALUES ($1, 'c-42', 2500, now())`, id); err != nil {
						return err
					}
					if _, err := tx.Exec(ctx, `INSERT INTO order_lines VALUES ($1, 1, 'SKU-1', 2, 1250)`, id); err != nil {
						return err
					}
					if _, err := tx.Exec(ctx, `INSERT INTO outbox_messages (id, type, payload, occurred_at) VALUES ($1, 'OrderPlaced', $2, now())`,
						msgID, `{"order_id":"`+id.String()+`"}`); err != nil {
						return err
					}
					_, err := tx.Exec(ctx, `SELECT pg_notify('outbox_messages', '')`)
					return err
				})
				if err == nil {
					done.Add(1)
				}
			}
		})
	}
	wg.Wait()
	b2 := rate(int(done.Load()), time.Since(start))
	r.add("B2 database ceiling: order transaction with pgx, 8 connections", fmt.Sprintf("%.0f tx/s", b2), "", "1.00", "", true)
	return b2
}

// drainSetup is a database with the outbox and a queue bound to take what the relays send.
type drainSetup struct {
	db       *testenv.Database
	exchange string
	queue    string
	ch       *amqp.Channel
}

func newDrainSetup(t *testing.T) *drainSetup {
	t.Helper()
	d := &drainSetup{db: testenv.NewDatabase(t), exchange: testenv.UniqueName("bench"), queue: testenv.UniqueName("bench")}
	d.db.Migrate(t, messaging.MigrateOutbox)
	testenv.CleanupBroker(t, []string{d.queue, d.queue + ".dlq"}, []string{d.exchange})
	d.ch = testenv.Channel(t)
	if err := (messaging.ConsumerTopology{Exchange: d.exchange, Queue: d.queue, RoutingKeys: []string{events.OrderPlacedType}}).Declare(d.ch); err != nil {
		t.Fatal(err)
	}
	return d
}

// fill inserts n unsent OrderPlaced rows in transactions of 1,000.
func (d *drainSetup) fill(t *testing.T, n int) {
	t.Helper()
	for done := 0; done < n; {
		batch := make([]messaging.Message, 0, 1000)
		for ; len(batch) < cap(batch) && done < n; done++ {
			m, err := messaging.NewMessage(events.OrderPlacedType, map[string]any{"order_id": uuid.NewString(), "customer_id": "c-42", "total_cents": 2500})
			if err != nil {
				t.Fatal(err)
			}
			batch = append(batch, m)
		}
		if err := d.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(tx, batch...) }); err != nil {
			t.Fatal(err)
		}
	}
}

// drain runs relays until no row is left unsent and returns the time it took and how many
// messages reached the queue (duplicates included).
func (d *drainSetup) drain(t *testing.T, relays, n int) (time.Duration, int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	start := time.Now()
	for range relays {
		pub := messaging.NewPublisher(messaging.PublisherConfig{URL: testenv.AMQPURL(),
			Setup: func(ch *amqp.Channel) error { return messaging.DeclareExchange(ch, d.exchange) }})
		defer pub.Close()
		relay, err := messaging.NewRelay(messaging.RelayConfig{DB: d.db.DB, Sender: pub, Exchange: d.exchange, PollInterval: 10 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() { _ = relay.Run(ctx) })
	}
	testenv.Eventually(t, 5*time.Minute, func() bool {
		return testenv.Count(t, d.db.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL") == 0
	}, "relays did not drain %d rows", n)
	took := time.Since(start)
	cancel()
	wg.Wait()
	q, err := d.ch.QueueDeclarePassive(d.queue, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.ch.QueuePurge(d.queue, false); err != nil {
		t.Fatal(err)
	}
	return took, q.Messages
}

func relayDrain(t *testing.T, r *report, b1 float64) {
	t.Helper()
	const n = 50_000
	d := newDrainSetup(t)
	d.fill(t, n)
	one, got := d.drain(t, 1, n)
	oneRate := rate(n, one)
	r.add("1 relay drains 50,000 rows (claim, publish, confirm, mark)", fmt.Sprintf("%.0f msg/s", oneRate), "B1",
		fmt.Sprintf("%.2f", oneRate/b1), "≥ 0.40", oneRate/b1 >= 0.40 && got == n)

	d.fill(t, n)
	three, got3 := d.drain(t, 3, n)
	threeRate := rate(n, three)
	r.add(fmt.Sprintf("3 relays drain 50,000 rows (%d duplicates on the queue)", got3-n), fmt.Sprintf("%.0f msg/s", threeRate), "1 relay",
		fmt.Sprintf("%.2f", threeRate/oneRate), "> 1.00, 0 dup", threeRate > oneRate && got3 == n)

	// The same drain with a million sent rows in the table: the partial index keeps the claim
	// as cheap as on an empty table.
	if err := d.db.DB.Exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at, processed_at, next_attempt_at)
		SELECT gen_random_uuid(), 'OrderPlaced', '{"order_id":"x"}', now() - interval '1 day', now() - interval '1 day', now() - interval '1 day'
		FROM generate_series(1, 1000000)`).Error; err != nil {
		t.Fatal(err)
	}
	if err := d.db.DB.Exec("VACUUM ANALYZE outbox_messages").Error; err != nil {
		t.Fatal(err)
	}
	d.fill(t, n)
	var plan []string
	if err := d.db.DB.Raw(`EXPLAIN SELECT id, type, payload, correlation_id, occurred_at, attempts FROM outbox_messages
		WHERE processed_at IS NULL AND next_attempt_at <= now() ORDER BY occurred_at, id LIMIT 500 FOR UPDATE SKIP LOCKED`).Scan(&plan).Error; err != nil {
		t.Fatal(err)
	}
	fmt.Printf("EXPLAIN of the claim with 1,000,000 sent and %d unsent rows:\n  %s\n", n, strings.Join(plan, "\n  "))
	usesIndex := strings.Contains(strings.Join(plan, " "), "outbox_messages_unprocessed_idx")
	scale, gotScale := d.drain(t, 1, n)
	scaleRate := rate(n, scale)
	r.add("1 relay, 50,000 rows next to 1,000,000 sent ones (plan: partial index)", fmt.Sprintf("%.0f msg/s", scaleRate), "1 relay, empty",
		fmt.Sprintf("%.2f", scaleRate/oneRate), "≥ 0.90", scaleRate/oneRate >= 0.90 && usesIndex && gotScale == n)
}

// percentile of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, int(p*float64(len(sorted))))]
}

const orderBody = `{"customer_id":"c-42","lines":[{"sku":"SKU-1","quantity":2,"unit_price_cents":1250}]}`

// postThroughput: concurrent keep-alive clients for 10 s against the order service alone (its
// relay included; the consumers stopped so they do not compete for the two cores).
func postThroughput(t *testing.T, r *report, binDir string, b2 float64) {
	t.Helper()
	sys := systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, Env: map[string][]string{"order": {"LOG_LEVEL=warn"}}})
	sys.Invoicing.Stop(t)
	sys.Notification.Stop(t)
	const clients, duration = 16, 10 * time.Second
	transport := &http.Transport{MaxIdleConnsPerHost: clients}
	client := &http.Client{Transport: transport, Timeout: 10 * time.Second}
	var mu sync.Mutex
	var latencies []time.Duration
	var errs atomic.Int64
	deadline := time.Now().Add(duration)
	start := time.Now()
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			var mine []time.Duration
			for time.Now().Before(deadline) {
				t0 := time.Now()
				resp, err := client.Post(sys.Order.URL+"/orders", "application/json", strings.NewReader(orderBody))
				if err != nil {
					errs.Add(1)
					continue
				}
				_, _ = drainBody(resp)
				if resp.StatusCode != http.StatusCreated {
					errs.Add(1)
					continue
				}
				mine = append(mine, time.Since(t0))
			}
			mu.Lock()
			latencies = append(latencies, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	took := time.Since(start)
	slices.Sort(latencies)
	rps := rate(len(latencies), took)
	r.add(fmt.Sprintf("POST /orders, %d keep-alive clients, 10 s (%d errors)", clients, errs.Load()), fmt.Sprintf("%.0f req/s", rps), "B2",
		fmt.Sprintf("%.2f", rps/b2), "≥ 0.50, 0 err", rps/b2 >= 0.5 && errs.Load() == 0)
	r.add("   POST /orders latency p50 / p99", fmt.Sprintf("%s / %s", percentile(latencies, .5).Round(100*time.Microsecond), percentile(latencies, .99).Round(100*time.Microsecond)), "", "", "", true)
	rss := sys.Order.PeakRSS(t)
	r.add("   order service peak RSS during the POST load", fmt.Sprintf("%.1f MiB", float64(rss)/(1<<20)), "", "", "≤ 64 MiB", rss <= 64<<20)
}

// endToEndLatency: a steady 200 orders/s for 20 s, open loop (a request starts every 5 ms
// whatever the previous ones do); latency from the order's created_at to its invoice's
// created_at, both stamped by the services from this machine's one clock.
func endToEndLatency(t *testing.T, r *report, binDir string, notify bool) {
	t.Helper()
	env := map[string][]string{"order": {"LOG_LEVEL=warn", fmt.Sprintf("OUTBOX_NOTIFY=%t", notify)}, "invoicing": {"LOG_LEVEL=warn"}, "notification": {"LOG_LEVEL=warn"}}
	sys := systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, Env: env})
	const perSecond, duration = 200, 20 * time.Second
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: 10 * time.Second}
	var errs atomic.Int64
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / perSecond)
	end := time.Now().Add(duration)
	sent := 0
	for now := range tick.C {
		if now.After(end) {
			break
		}
		sent++
		wg.Go(func() {
			resp, err := client.Post(sys.Order.URL+"/orders", "application/json", strings.NewReader(orderBody))
			if err != nil {
				errs.Add(1)
				return
			}
			_, _ = drainBody(resp)
			if resp.StatusCode != http.StatusCreated {
				errs.Add(1)
			}
		})
	}
	tick.Stop()
	wg.Wait()
	orders := testenv.Count(t, sys.Order.DB.DB, "SELECT count(*) FROM orders")
	testenv.Eventually(t, 2*time.Minute, func() bool {
		return testenv.Count(t, sys.Invoicing.DB.DB, "SELECT count(*) FROM invoices") == orders
	}, "not every order was invoiced")
	var placed []struct {
		ID        uuid.UUID
		CreatedAt time.Time
	}
	if err := sys.Order.DB.DB.Raw("SELECT id, created_at FROM orders").Scan(&placed).Error; err != nil {
		t.Fatal(err)
	}
	var invoiced []struct {
		OrderID   uuid.UUID
		CreatedAt time.Time
	}
	if err := sys.Invoicing.DB.DB.Raw("SELECT order_id, created_at FROM invoices").Scan(&invoiced).Error; err != nil {
		t.Fatal(err)
	}
	at := make(map[uuid.UUID]time.Time, len(invoiced))
	for _, inv := range invoiced {
		at[inv.OrderID] = inv.CreatedAt
	}
	var lat []time.Duration
	for _, o := range placed {
		lat = append(lat, at[o.ID].Sub(o.CreatedAt))
	}
	slices.Sort(lat)
	mode := "LISTEN/NOTIFY"
	if !notify {
		mode = "polling only (1 s)"
	}
	p50, p99 := percentile(lat, .5), percentile(lat, .99)
	ok := errs.Load() == 0 && (!notify || (p50 <= 15*time.Millisecond && p99 <= 100*time.Millisecond))
	target := "p50 ≤ 15 ms, p99 ≤ 100 ms"
	if !notify {
		target = "(comparison)"
	}
	r.add(fmt.Sprintf("order → invoice latency at %d/s for 20 s, %s (%d orders, %d errors)", perSecond, mode, sent, errs.Load()),
		fmt.Sprintf("p50 %s, p99 %s", p50.Round(100*time.Microsecond), p99.Round(100*time.Microsecond)), "", "", target, ok)
	if notify {
		for _, s := range []*systest.Service{sys.Order, sys.Invoicing, sys.Notification} {
			rss := s.PeakRSS(t)
			r.add(fmt.Sprintf("   %s service peak RSS during the latency run", s.Name), fmt.Sprintf("%.1f MiB", float64(rss)/(1<<20)), "", "", "≤ 64 MiB", rss <= 64<<20)
		}
	}
}

// consumerThroughput: 20,000 OrderPlaced messages wait in the invoicing queue, then 2,000
// duplicates of some of them, sent after all the originals so that they land in other batches.
// Only the invoicing service runs. The rate is taken from the first to the last invoice's
// created_at, so the process start is not counted. With r nil it only returns the rate: the
// baseline run, one message per transaction (CONSUMER_BATCH_SIZE=1).
func consumerThroughput(t *testing.T, r *report, binDir string, baseline float64, env ...string) float64 {
	t.Helper()
	sys := systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, Env: map[string][]string{"invoicing": append([]string{"LOG_LEVEL=warn"}, env...)}})
	// Only invoicing runs: the other services would compete for the two cores (notification
	// would consume the same messages from its own queue).
	sys.Invoicing.Stop(t)
	sys.Notification.Stop(t)
	sys.Order.Stop(t)
	ch := sys.Channel(t)
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	const n = 20_000
	var confirms []*amqp.DeferredConfirmation
	publish := func(m messaging.Message) {
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), events.Exchange, events.OrderPlacedType, true, false,
			amqp.Publishing{DeliveryMode: amqp.Persistent, ContentType: "application/json", MessageId: m.ID.String(), Type: m.Type, Body: m.Payload})
		if err != nil {
			t.Fatal(err)
		}
		confirms = append(confirms, dc)
	}
	msgs := make([]messaging.Message, n)
	for i := range msgs {
		m, err := messaging.NewMessage(events.OrderPlacedType, events.OrderPlaced{OrderID: uuid.New(), CustomerID: "c-42", TotalCents: 2500,
			Lines: []events.Line{{SKU: "SKU-1", Quantity: 2, UnitPriceCents: 1250}}, PlacedAt: time.Now()})
		if err != nil {
			t.Fatal(err)
		}
		msgs[i] = m
		publish(m)
	}
	for i := 0; i < n; i += 10 {
		publish(msgs[i]) // a duplicate
	}
	for _, dc := range confirms {
		if !dc.Wait() {
			t.Fatal("nack")
		}
	}
	sys.Invoicing.Start(t)
	testenv.Eventually(t, 5*time.Minute, func() bool {
		return testenv.Count(t, sys.Invoicing.DB.DB, "SELECT count(*) FROM invoices") == n
	}, "not all %d invoices were created", n)
	var span float64
	if err := sys.Invoicing.DB.DB.Raw("SELECT extract(epoch FROM max(created_at) - min(created_at)) FROM invoices").Scan(&span).Error; err != nil {
		t.Fatal(err)
	}
	perSec := float64(n) / span
	testenv.Eventually(t, time.Minute, func() bool {
		return testenv.QueueDepth(t, ch, "invoicing") == 0
	}, "duplicates still waiting")
	redundant := len(sys.Invoicing.Logs.Lines("already invoiced by another message"))
	if r != nil {
		r.add(fmt.Sprintf("invoicing drains 20,000 waiting messages + 2,000 duplicates, batches of 50 (%d worked twice)", redundant),
			fmt.Sprintf("%.0f msg/s", perSec), fmt.Sprintf("%.0f msg/s one per transaction", baseline),
			fmt.Sprintf("%.2f", perSec/baseline), "≥ 2,500 msg/s", perSec >= 2500 && redundant == 0)
	}
	return perSec
}

func drainBody(resp *http.Response) (int64, error) {
	defer resp.Body.Close()
	return io.Copy(io.Discard, resp.Body)
}
