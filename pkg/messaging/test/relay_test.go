package test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

func TestRelayPublishesWithConfirmsAndMarksRowsSent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	msg := newMessage(t, 7)
	msg.CorrelationID = "req-42"
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, msg) }); err != nil {
		t.Fatal(err)
	}
	ids := append([]uuid.UUID{msg.ID}, b.enqueue(t, 2)...)

	res, err := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil).ProcessBatch(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res != (messaging.BatchResult{Claimed: 3, Sent: 3}) {
		t.Fatalf("batch = %+v, want 3 claimed and sent", res)
	}
	if n := b.unprocessed(t); n != 0 {
		t.Fatalf("%d rows still unprocessed", n)
	}

	got := testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond)
	assertExactlyOnce(t, got, ids)
	var d amqp.Delivery
	for _, g := range got {
		if g.MessageId == msg.ID.String() {
			d = g
		}
	}
	var row outboxRow
	if err := b.db.DB.First(&row, "id = ?", msg.ID).Error; err != nil {
		t.Fatal(err)
	}
	checks := map[string]bool{
		"persistent":       d.DeliveryMode == amqp.Persistent,
		"content type":     d.ContentType == "application/json",
		"type":             d.Type == eventType,
		"routing key":      d.RoutingKey == eventType,
		"app id":           d.AppId == "order",
		"timestamp":        d.Timestamp.Equal(row.OccurredAt.Truncate(time.Second)),
		"correlation id":   d.CorrelationId == "req-42" && d.Headers["correlation_id"] == "req-42",
		"body is payload":  jsonEqual(t, d.Body, msg.Payload),
		"row processed_at": row.ProcessedAt != nil && row.Attempts == 0,
		"no trace context": d.Headers["traceparent"] == nil && row.TraceParent == "", // enqueued outside any trace
	}
	for what, ok := range checks {
		if !ok {
			t.Errorf("%s wrong: delivery %+v, row %+v", what, d, row)
		}
	}
}

// outboxRow is a row of outbox_messages, as the tests read it.
type outboxRow struct {
	ID            uuid.UUID
	Type          string
	CorrelationID string
	OccurredAt    time.Time
	ProcessedAt   *time.Time
	Attempts      int
	LastError     *string
	NextAttemptAt time.Time
	TraceParent   string
}

func (outboxRow) TableName() string { return "outbox_messages" }

func jsonEqual(t *testing.T, a, b []byte) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal(a, &x); err != nil {
		return false
	}
	if err := json.Unmarshal(b, &y); err != nil {
		return false
	}
	return fmt.Sprint(x) == fmt.Sprint(y)
}

func TestThreeRelaysDrainABacklogWithoutDuplicates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const rows = 6000
	ids := b.enqueue(t, rows)

	start := time.Now()
	for range 3 {
		r := b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) { c.BatchSize = 200 })
		run(t, r.Run)
	}
	b.waitAllSent(t, 2*time.Minute)
	elapsed := time.Since(start)
	t.Logf("3 relays drained %d rows in %s (%.0f msg/s)", rows, elapsed.Round(time.Millisecond), rows/elapsed.Seconds())

	got := testenv.Drain(t, b.ch, b.queue, 500*time.Millisecond)
	assertExactlyOnce(t, got, ids)
}

// The seed's experiment: the broker is gone for about 8 s while orders keep coming. The outage
// is the relay's, not the rows': it is logged once when it starts and once when it ends, no
// row's attempts move, and everything goes out within seconds of the broker's return.
func TestRelayWaitsOutABrokerOutageWithoutChargingTheRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	r := b.relay(t, b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen)), nil)
	run(t, r.Run)

	ids := b.enqueue(t, 3)
	b.waitAllSent(t, 10*time.Second)
	wantMetric(t, b.registry, `outbox_relay_broker_up{exchange="`+b.exchange+`"} 1`)

	proxy.Stop()
	outageEnds := time.Now().Add(8 * time.Second)
	for time.Now().Before(outageEnds) {
		ids = append(ids, b.enqueue(t, 1)...)
		time.Sleep(250 * time.Millisecond) // the pace of incoming orders, not a synchronisation
	}
	waiting := b.unprocessed(t)
	if waiting == 0 {
		t.Fatal("nothing waited in the outbox during the outage")
	}
	wantMetric(t, b.registry, `outbox_relay_broker_up{exchange="`+b.exchange+`"} 0`)
	if err := proxy.Start(); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	b.waitAllSent(t, 5*time.Second)
	t.Logf("%d rows waited out an 8 s outage; all sent %s after the broker came back", waiting, time.Since(back).Round(time.Millisecond))

	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 300*time.Millisecond), ids)
	b.wantNoRowCharged(t)
	if lines := b.logs.Lines("outbox publish failed"); len(lines) != 0 {
		t.Errorf("the outage was logged as %d per-row failures: %q", len(lines), lines[0])
	}
	if lines := b.logs.Lines("level=WARN", "broker unavailable; relay paused", "error="); len(lines) != 1 {
		t.Errorf("want the outage's start logged once, got %d lines", len(lines))
	}
	// The count runs once the outage has ended, while the other lane may already send: it is
	// every row that waited, or fewer, down to none.
	ended := b.logs.Lines("level=INFO", "broker available again; relay resumed", "outage=", "rows_waiting=")
	if len(ended) != 1 {
		t.Fatalf("want the outage's end logged once, got %q", b.logs.Lines("broker available again"))
	}
	if n, err := strconv.ParseInt(regexp.MustCompile(`rows_waiting=(\d+)`).FindStringSubmatch(ended[0])[1], 10, 64); err != nil || n < 0 || n > waiting {
		t.Errorf("the outage's end counted rows_waiting=%d (%v), want at most the %d that waited: %s", n, err, waiting, ended[0])
	}
	wantMetric(t, b.registry, `outbox_relay_broker_up{exchange="`+b.exchange+`"} 1`)
}

func TestBackoffDoublesUpToTheCapJitteredBelowEachStep(t *testing.T) {
	t.Parallel()
	steps := []time.Duration{2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second,
		64 * time.Second, 128 * time.Second, 256 * time.Second, 5 * time.Minute, 5 * time.Minute}
	for _, jitter := range []float64{0, 0.5} {
		share := jitter
		if share == 0 {
			share = messaging.DefaultJitter
		}
		b := messaging.Backoff{Base: 2 * time.Second, Max: 5 * time.Minute, Jitter: jitter}
		for i, step := range append(steps, 5*time.Minute) {
			failures := i + 1
			if i == len(steps) {
				failures = 10_000
			}
			lo, hi := step-time.Duration(share*float64(step)), step
			seen := map[time.Duration]bool{}
			for range 200 {
				d := b.Delay(failures)
				if d < lo || d > hi {
					t.Fatalf("jitter %.1f: Delay(%d) = %s, want within [%s, %s]", share, failures, d, lo, hi)
				}
				seen[d] = true
			}
			if len(seen) < 100 {
				t.Errorf("jitter %.1f: Delay(%d) took only %d values in 200 draws: replicas would retry in lockstep", share, failures, len(seen))
			}
		}
	}
	// A jitter past 1 is taken as 1: a delay below zero would retry at once.
	b := messaging.Backoff{Base: 2 * time.Second, Max: 5 * time.Minute, Jitter: 3}
	for range 200 {
		if d := b.Delay(1); d < 0 || d > 2*time.Second {
			t.Fatalf("jitter 3: Delay(1) = %s, want within [0, 2s]", d)
		}
	}
}

// An unroutable message is confirmed by the broker but returned: it must not count as sent,
// must back off 2 s, 4 s, … up to the cap, and must not hold up the rows behind it.
func TestRelayBacksOffUnroutableRowsWithoutBlockingOthers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	unroutable := b.enqueueUnroutable(t)
	good := b.enqueue(t, 2)
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) {
		c.Backoff = messaging.Backoff{Base: 2 * time.Second, Max: 5 * time.Second}
	})

	type state struct {
		Attempts  int
		LastError string
		DueInMs   float64
		Processed bool
	}
	read := func() state {
		var s state
		if err := b.db.DB.Raw(`SELECT attempts, last_error, processed_at IS NOT NULL AS processed,
			extract(epoch FROM next_attempt_at - now()) * 1000 AS due_in_ms
			FROM outbox_messages WHERE id = ?`, unroutable.ID).Scan(&s).Error; err != nil {
			t.Fatal(err)
		}
		return s
	}
	for attempt, wantDelay := range []time.Duration{2 * time.Second, 4 * time.Second, 5 * time.Second} {
		res, err := r.ProcessBatch(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if res.Failed != 1 {
			t.Fatalf("attempt %d: batch = %+v, want one failure", attempt+1, res)
		}
		s := read()
		if s.Processed || s.Attempts != attempt+1 || !strings.Contains(s.LastError, "unroutable") {
			t.Fatalf("attempt %d: row = %+v, want unprocessed, attempts=%d, an unroutable error", attempt+1, s, attempt+1)
		}
		if ms := float64(wantDelay.Milliseconds()); s.DueInMs < ms*(1-messaging.DefaultJitter)-200 || s.DueInMs > ms+50 {
			t.Fatalf("attempt %d: next attempt in %.0f ms, want %s less at most %.0f%% jitter", attempt+1, s.DueInMs, wantDelay, 100*messaging.DefaultJitter)
		}
		// Make it due again at once instead of waiting for the backoff.
		if err := b.db.DB.Exec("UPDATE outbox_messages SET next_attempt_at = now() WHERE id = ?", unroutable.ID).Error; err != nil {
			t.Fatal(err)
		}
	}
	if n := b.unprocessed(t); n != 1 {
		t.Fatalf("unprocessed rows = %d, want only the unroutable one", n)
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), good)
	if lines := b.logs.Lines("outbox publish failed", "message_id="+unroutable.ID.String(), "attempts=3"); len(lines) != 1 {
		t.Errorf("want one failure line for the third attempt, got %d", len(lines))
	}
	wantMetric(t, b.registry, `outbox_publish_failures_total{type="NobodyListens"} 3`)
	wantMetric(t, b.registry, `outbox_messages_published_total{type="OrderPlaced"} 2`)
}

// The backoff never gives up on a row: one that failed a thousand times is still claimed when
// due, sent if it can be, and else backed off no longer than the cap. Nothing parks a row but
// an operator.
func TestRelayNeverGivesUpOnARow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.enqueueUnroutable(t)
	good := b.enqueue(t, 1)
	if err := b.db.DB.Exec("UPDATE outbox_messages SET attempts = 1000, last_error = 'unroutable', next_attempt_at = now()").Error; err != nil {
		t.Fatal(err)
	}
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) {
		c.Backoff = messaging.Backoff{Base: 2 * time.Second, Max: 5 * time.Second}
	})
	res, err := r.ProcessBatch(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res.Sent != 1 || res.Failed != 1 {
		t.Fatalf("batch of rows that failed 1000 times = %+v, want one sent and one failed", res)
	}
	var left struct {
		Attempts int
		DueInMs  float64
	}
	if err := b.db.DB.Raw(`SELECT attempts, extract(epoch FROM next_attempt_at - now()) * 1000 AS due_in_ms
		FROM outbox_messages WHERE processed_at IS NULL`).Scan(&left).Error; err != nil {
		t.Fatal(err)
	}
	if left.Attempts != 1001 || left.DueInMs > 5050 || left.DueInMs < 5000*(1-messaging.DefaultJitter)-200 {
		t.Errorf("the unroutable row after its 1001st failure: %+v, want attempts 1001, due within the 5 s cap", left)
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), good)
}

// enqueueUnroutable enqueues a message of a type no queue is bound to: the broker confirms it
// and returns it.
func (b *testBundle) enqueueUnroutable(t *testing.T) messaging.Message {
	t.Helper()
	unroutable, err := messaging.NewMessage("NobodyListens", map[string]int{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, unroutable) }); err != nil {
		t.Fatal(err)
	}
	return unroutable
}

// A broker that swallows traffic (a half-open connection) never confirms: the batch gives up
// after ConfirmTimeout, leaves its rows unprocessed, and everything is sent once it recovers.
func TestRelayLeavesUnconfirmedRowsUnprocessed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	pub := b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen), func(c *messaging.PublisherConfig) { c.ConfirmTimeout = time.Second })
	r := b.relay(t, pub, nil)
	warmUp := b.enqueue(t, 1)
	if res, err := r.ProcessBatch(context.Background()); err != nil || res.Sent != 1 {
		t.Fatalf("warm-up batch = %+v, %v", res, err)
	}

	// The publisher's connection is open; from now on nothing comes back through it.
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"blackhole","type":"timeout","stream":"downstream","attributes":{"timeout":0}}`)); err != nil {
		t.Fatal(err)
	}
	ids := b.enqueue(t, 5)
	res, err := r.ProcessBatch(context.Background())
	if !errors.Is(err, messaging.ErrBrokerUnavailable) || !strings.Contains(err.Error(), "no confirm within 1s") {
		t.Fatalf("batch through a black hole: error %v, want ErrBrokerUnavailable for the missing confirms", err)
	}
	if res != (messaging.BatchResult{Claimed: 5, Unsent: 5}) || b.unprocessed(t) != 5 {
		t.Fatalf("batch through a black hole = %+v with %d unprocessed, want 5 unsent", res, b.unprocessed(t))
	}
	b.wantNoRowCharged(t)

	if err := proxy.Toxics.RemoveToxic(context.Background(), "blackhole"); err != nil {
		t.Fatal(err)
	}
	proxy.Stop() // drop the stale connection that the black hole left behind
	if err := proxy.Start(); err != nil {
		t.Fatal(err)
	}
	run(t, r.Run)
	b.waitAllSent(t, 20*time.Second)
	got := testenv.Drain(t, b.ch, b.queue, 300*time.Millisecond)
	// The swallowed publishes may or may not have reached the broker: at least once, never lost.
	missing, _, unexpected := countIDs(t, got, append(warmUp, ids...))
	if missing+unexpected > 0 {
		t.Fatalf("after recovery: %d missing, %d unexpected", missing, unexpected)
	}
}

// A batch whose bytes the link cannot carry within a window's ConfirmTimeout (large rows, a
// slow link) still counts what the broker confirmed in time: taken as a whole for the broker's
// absence, it would be claimed again whole, time out again, and no row would ever go out.
func TestRelaySendsWhatALinkTooSlowForTheWindowCarriedInTime(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	pub := b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen), func(c *messaging.PublisherConfig) { c.ConfirmTimeout = 2 * time.Second })
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"slow","type":"bandwidth","stream":"upstream","attributes":{"rate":500}}`)); err != nil {
		t.Fatal(err)
	}
	// 16 rows of 100 KB: 3.2 s at 500 KB/s, past the 2 s.
	pad := strings.Repeat("x", 100<<10)
	msgs := make([]messaging.Message, 16)
	ids := make([]uuid.UUID, len(msgs))
	for i := range msgs {
		m, err := messaging.NewMessage(eventType, map[string]any{"order_id": uuid.NewString(), "pad": pad})
		if err != nil {
			t.Fatal(err)
		}
		msgs[i], ids[i] = m, m.ID
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, msgs...) }); err != nil {
		t.Fatal(err)
	}
	r := b.relay(t, pub, func(c *messaging.RelayConfig) {
		c.BatchSize, c.Lanes = len(msgs), 1
		c.BrokerRetry = messaging.Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}
	})
	run(t, r.Run)
	b.waitAllSent(t, 40*time.Second)
	// A window cut off may have reached the broker in part: at least once, never lost.
	missing, _, unexpected := countIDs(t, testenv.Drain(t, b.ch, b.queue, 500*time.Millisecond), ids)
	if missing+unexpected > 0 {
		t.Fatalf("%d rows missing from the queue, %d unexpected messages", missing, unexpected)
	}
}

// A deleted exchange makes the broker close the publishing channel; the relay must not mark
// the rows, and the next batch must reconnect, declare the exchange again and send them.
func TestRelayRedeclaresTopologyAfterTheExchangeIsDeleted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil)
	first := b.enqueue(t, 1)
	if res, err := r.ProcessBatch(context.Background()); err != nil || res.Sent != 1 {
		t.Fatalf("first batch = %+v, %v", res, err)
	}
	if err := b.ch.ExchangeDelete(b.exchange, false, false); err != nil {
		t.Fatal(err)
	}
	ids := b.enqueue(t, 3)
	res, err := r.ProcessBatch(context.Background())
	if !errors.Is(err, messaging.ErrBrokerUnavailable) {
		t.Fatalf("batch to a deleted exchange: error %v, want ErrBrokerUnavailable (the channel closed)", err)
	}
	if res.Sent != 0 || res.Failed != 0 || b.unprocessed(t) != 3 {
		t.Fatalf("batch to a deleted exchange = %+v, %d unprocessed; want nothing marked sent or charged", res, b.unprocessed(t))
	}
	b.wantNoRowCharged(t)
	// The publisher declared the exchange again; the queue needs its binding back too (the
	// consumer's topology does that on reconnect; here the test plays the consumer).
	declare(t, b.topology)
	run(t, r.Run)
	b.waitAllSent(t, 20*time.Second)
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), append(first, ids...))
}

func TestRelayWakesOnNotifyWithoutWaitingForThePoll(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.runListeningRelay(t)
	ids := b.enqueue(t, 1)
	b.waitAllSent(t, 5*time.Second)
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
}

func TestRelayStopsWhenItsContextIsCancelled(t *testing.T) {
	t.Parallel()
	b := setup(t)
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var err error
	wg.Go(func() { err = r.Run(ctx) })
	b.enqueue(t, 10)
	b.waitAllSent(t, 10*time.Second)
	cancel()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("relay did not stop within 5 s")
	}
	if err != nil {
		t.Fatalf("Run = %v, want nil on cancellation", err)
	}
	testenv.Eventually(t, 5*time.Second, func() bool {
		return testenv.Count(t, b.db.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND query LIKE 'LISTEN%'", b.db.Name) == 0
	}, "a session still listens after Run returned")
}

// killAfterPublish publishes for real, then kills the relay's database session before its
// transaction can commit the marks: the crash the outbox must survive.
type killAfterPublish struct {
	messaging.Sender
	t      *testing.T
	db     *testenv.Database
	killed bool
}

func (k *killAfterPublish) Publish(ctx context.Context, msgs []messaging.Message) []error {
	errs := k.Sender.Publish(ctx, msgs)
	if !k.killed {
		k.killed = true
		admin := testenv.OpenPool(k.t, testenv.DatabaseURL(), 1)
		n := testenv.Count(k.t, admin, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE datname = ? AND state = 'idle in transaction'`, k.db.Name)
		if n != 1 {
			k.t.Errorf("killed %d sessions, want the relay's one", n)
		}
	}
	return errs
}

func TestRelayRepublishesWhenItDiesBetweenPublishAndCommit(t *testing.T) {
	t.Parallel()
	b := setupWith(t, 1) // an admin connection
	ids := b.enqueue(t, 10)
	r := b.relay(t, &killAfterPublish{Sender: b.publisher(t, testenv.AMQPURL()), t: t, db: b.db}, nil)

	if _, err := r.ProcessBatch(context.Background()); err == nil {
		t.Fatal("batch whose session was killed reported success")
	}
	if n := b.unprocessed(t); n != 10 {
		t.Fatalf("%d rows unprocessed after the crash, want all 10: their marks were never committed", n)
	}
	if res, err := r.ProcessBatch(context.Background()); err != nil || res.Sent != 10 {
		t.Fatalf("batch after the crash = %+v, %v; want all 10 sent again", res, err)
	}
	// At-least-once: every message is on the queue twice, none is lost. The inbox takes it from here.
	got := testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond)
	missing, dups, unexpected := countIDs(t, got, ids)
	if missing != 0 || dups != 10 || unexpected != 0 {
		t.Fatalf("%d missing, %d duplicated, %d unexpected; want 0, 10, 0", missing, dups, unexpected)
	}
}

// A broker that stops reading blocks the socket write itself; ConfirmTimeout must still end
// the batch, with its rows unsent, instead of holding the transaction and its locks.
func TestRelayGivesUpOnABrokerThatStopsReading(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	pub := b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen), func(c *messaging.PublisherConfig) { c.ConfirmTimeout = time.Second })
	// 500 rows of 40 KB in one batch: 20 MB, past the default MaxBatchBytes.
	r := b.relay(t, pub, func(c *messaging.RelayConfig) { c.MaxBatchBytes = 32 << 20 })
	b.enqueue(t, 1)
	if res, err := r.ProcessBatch(context.Background()); err != nil || res.Sent != 1 {
		t.Fatalf("warm-up batch = %+v, %v", res, err)
	}
	// 1 KB/s towards the broker, and 500 messages of about 40 KB each to push through it.
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"slow","type":"bandwidth","stream":"upstream","attributes":{"rate":1}}`)); err != nil {
		t.Fatal(err)
	}
	big := make([]messaging.Message, 500)
	for i := range big {
		m, err := messaging.NewMessage(eventType, map[string]string{"pad": strings.Repeat("x", 40_000)})
		if err != nil {
			t.Fatal(err)
		}
		big[i] = m
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, big...) }); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var res messaging.BatchResult
	var err error
	go func() {
		defer close(done)
		res, err = r.ProcessBatch(context.Background())
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the batch is still stuck writing to a broker that does not read, 10 s after a 1 s confirm timeout")
	}
	if !errors.Is(err, messaging.ErrBrokerUnavailable) {
		t.Fatalf("batch through a 1 KB/s link: error %v, want ErrBrokerUnavailable", err)
	}
	if res.Sent != 0 || res.Unsent != 500 || b.unprocessed(t) != 500 {
		t.Fatalf("batch = %+v with %d unprocessed; want all 500 unsent", res, b.unprocessed(t))
	}
	b.wantNoRowCharged(t)
}

// A row over the size limit is refused before publishing, a verdict on that one row: it parks
// alone, and the good rows around it go out.
func TestRelayParksAnOversizedRowAndSendsTheRest(t *testing.T) {
	t.Parallel()
	b := setup(t)
	before := b.enqueue(t, 2)
	big, err := messaging.NewMessage(eventType, map[string]string{"pad": strings.Repeat("x", messaging.DefaultMaxMessageBytes)})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, big) }); err != nil {
		t.Fatal(err)
	}
	after := b.enqueue(t, 2)

	res, err := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil).ProcessBatch(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res != (messaging.BatchResult{Claimed: 5, Sent: 4, Failed: 1}) {
		t.Fatalf("batch = %+v, want 4 sent and the oversized one failed", res)
	}
	var row outboxRow
	if err := b.db.DB.First(&row, "id = ?", big.ID).Error; err != nil {
		t.Fatal(err)
	}
	if row.ProcessedAt != nil || row.Attempts != 1 || row.LastError == nil || !strings.Contains(*row.LastError, "too large") ||
		time.Until(row.NextAttemptAt) < time.Second {
		lastError := "(none)"
		if row.LastError != nil {
			lastError = *row.LastError
		}
		t.Fatalf("oversized row = attempts %d, last error %q, due in %s; want parked with attempts 1 and a size error",
			row.Attempts, lastError, time.Until(row.NextAttemptAt).Round(time.Millisecond))
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), append(before, after...))
	if lines := b.logs.Lines("outbox publish failed", "message_id="+big.ID.String(), "attempts=1", "retry_in=", "too large"); len(lines) != 1 {
		t.Errorf("want one failure line for the oversized row, got %d", len(lines))
	}
}

// A nack on a channel that stays open is the broker's verdict on those messages: a queue that
// is full and rejects publishes nacks them. They are charged and parked; the channel goes on.
func TestRelayChargesRowsTheBrokerNacks(t *testing.T) {
	t.Parallel()
	b := setup(t)
	full := testenv.UniqueName("full")
	testenv.CleanupBroker(t, []string{full}, nil)
	if _, err := b.ch.QueueDeclare(full, true, false, false, false, amqp.Table{"x-max-length": 1, "x-overflow": "reject-publish"}); err != nil {
		t.Fatal(err)
	}
	if err := b.ch.QueueBind(full, "Full", b.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	var fills []messaging.Message
	for i := range 3 {
		m, err := messaging.NewMessage("Full", map[string]int{"n": i})
		if err != nil {
			t.Fatal(err)
		}
		fills = append(fills, m)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, fills...) }); err != nil {
		t.Fatal(err)
	}
	good := b.enqueue(t, 2)

	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil)
	res, err := r.ProcessBatch(context.Background())
	if err != nil {
		t.Fatalf("a nack is a verdict on the message, not a broker failure: %v", err)
	}
	if res != (messaging.BatchResult{Claimed: 5, Sent: 3, Failed: 2}) {
		t.Fatalf("batch = %+v, want the first of the full queue's messages and the 2 good ones sent, 2 nacked", res)
	}
	if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages WHERE attempts = 1 AND last_error LIKE '%nacked%' AND processed_at IS NULL"); n != 2 {
		t.Fatalf("%d rows charged with a nack, want 2", n)
	}
	// The same channel carries on: the next batch goes out without a reconnect.
	more := b.enqueue(t, 1)
	if res, err := r.ProcessBatch(context.Background()); err != nil || res.Sent != 1 {
		t.Fatalf("batch after the nacks = %+v, %v", res, err)
	}
	if n := len(b.logs.Lines("rabbitmq connection")); n != 0 {
		t.Errorf("the publisher reconnected after a nack: %q", b.logs.Lines("rabbitmq connection"))
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), append(good, more...))
}

// More messages than MaxInFlight go out in several windows, each confirmed before the next.
func TestPublisherSendsMoreThanMaxInFlightInWindows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pub := b.publisher(t, testenv.AMQPURL(), func(c *messaging.PublisherConfig) { c.MaxInFlight = 3 })
	msgs := make([]messaging.Message, 10)
	ids := make([]uuid.UUID, len(msgs))
	for i := range msgs {
		msgs[i] = newMessage(t, i)
		msgs[i].Exchange = b.exchange
		ids[i] = msgs[i].ID
	}
	for i, err := range pub.Publish(context.Background(), msgs) {
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
}

// Rows backed off into the future stay where they are until they are due.
func TestRelayLeavesRowsThatAreNotDueYet(t *testing.T) {
	t.Parallel()
	b := setup(t)
	later := b.enqueue(t, 3)
	if err := b.db.DB.Exec("UPDATE outbox_messages SET next_attempt_at = now() + interval '1 hour'").Error; err != nil {
		t.Fatal(err)
	}
	due := b.enqueue(t, 2)
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil)
	if res, err := r.ProcessBatch(context.Background()); err != nil || res != (messaging.BatchResult{Claimed: 2, Sent: 2}) {
		t.Fatalf("batch = %+v, %v; want only the 2 due rows", res, err)
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), due)
	if err := b.db.DB.Exec("UPDATE outbox_messages SET next_attempt_at = now() WHERE processed_at IS NULL").Error; err != nil {
		t.Fatal(err)
	}
	if res, err := r.ProcessBatch(context.Background()); err != nil || res.Sent != 3 {
		t.Fatalf("batch once due = %+v, %v", res, err)
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), later)
}

// concurrentSender counts the Publish calls in progress at once.
type concurrentSender struct {
	messaging.Sender
	now, most atomic.Int32
}

func (c *concurrentSender) Publish(ctx context.Context, msgs []messaging.Message) []error {
	n := c.now.Add(1)
	defer c.now.Add(-1)
	for m := c.most.Load(); n > m && !c.most.CompareAndSwap(m, n); m = c.most.Load() {
	}
	return c.Sender.Publish(ctx, msgs)
}

// The lanes overlap: while one batch waits for its confirms, the next is claimed and published
// in a transaction of its own, and SKIP LOCKED keeps their rows apart.
func TestRelayLanesOverlapBatchesWithoutDuplicates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.enqueue(t, 5000)
	sender := &concurrentSender{Sender: b.publisher(t, testenv.AMQPURL())}
	run(t, b.relay(t, sender, func(c *messaging.RelayConfig) { c.BatchSize = 100 }).Run)
	b.waitAllSent(t, time.Minute)
	if most := sender.most.Load(); most != 2 {
		t.Fatalf("at most %d batches were in flight at once, want the 2 lanes", most)
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 500*time.Millisecond), ids)
}

// One relay publishes each row to its own event's exchange: two event types of two exchanges
// arrive each in the queue bound to its exchange only, and a row that names no exchange (one
// enqueued before rows recorded it) goes to the relay's.
func TestRelayPublishesEachRowToItsEventsExchange(t *testing.T) {
	t.Parallel()
	b := setup(t)
	other, otherQueue := testenv.UniqueName("invoicing"), testenv.UniqueName("notification")
	testenv.CleanupBroker(t, []string{otherQueue, messaging.DeadLetterQueue(otherQueue)}, []string{other})
	declare(t, queueTopology(other, otherQueue, "InvoiceIssued"))

	placed := messaging.Event[map[string]int]{Exchange: b.exchange, Type: eventType}
	issued := messaging.Event[map[string]int]{Exchange: other, Type: "InvoiceIssued"}
	var toOrders, toOther []uuid.UUID
	err := b.db.DB.Transaction(func(tx *gorm.DB) error {
		for i := range 3 {
			p, err := placed.Message(map[string]int{"n": i})
			if err != nil {
				return err
			}
			inv, err := issued.Message(map[string]int{"n": i})
			if err != nil {
				return err
			}
			legacy := newMessage(t, i) // no exchange: the relay's
			toOrders, toOther = append(toOrders, p.ID, legacy.ID), append(toOther, inv.ID)
			if err := messaging.Enqueue(context.Background(), b.drv, tx, p, inv, legacy); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	pub := b.publisher(t, testenv.AMQPURL(), func(c *messaging.PublisherConfig) {
		c.Topology = messaging.Topology{Exchanges: []string{b.exchange, other}}
	})
	res, err := b.relay(t, pub, nil).ProcessBatch(context.Background())
	if err != nil || res.Sent != 9 {
		t.Fatalf("batch = %+v, %v; want 9 sent", res, err)
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), toOrders)
	assertExactlyOnce(t, testenv.Drain(t, b.ch, otherQueue, 200*time.Millisecond), toOther)
}

// A row naming an exchange that does not exist is that row's own failure: it backs off with
// the reason, and the rows beside it are sent on the same connection (a publish to a missing
// exchange would close the channel under them all).
func TestRelayBacksOffARowWhoseExchangeDoesNotExist(t *testing.T) {
	t.Parallel()
	b := setup(t)
	lost := newMessage(t, 0)
	lost.Exchange = testenv.UniqueName("nowhere")
	good := []messaging.Message{newMessage(t, 1), newMessage(t, 2)}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error {
		return messaging.Enqueue(context.Background(), b.drv, tx, good[0], lost, good[1])
	}); err != nil {
		t.Fatal(err)
	}
	res, err := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil).ProcessBatch(context.Background())
	if err != nil || res.Sent != 2 || res.Failed != 1 {
		t.Fatalf("batch = %+v, %v; want 2 sent, 1 failed", res, err)
	}
	var row outboxRow
	if err := b.db.DB.Take(&row, "id = ?", lost.ID).Error; err != nil {
		t.Fatal(err)
	}
	if row.ProcessedAt != nil || row.Attempts != 1 || row.LastError == nil || !strings.Contains(*row.LastError, "no such exchange") {
		t.Fatalf("row for a missing exchange: processed %v, attempts %d, last error %v", row.ProcessedAt, row.Attempts, row.LastError)
	}
	if lines := b.logs.Lines("outbox publish failed", "message_id="+lost.ID.String(), "attempts=1", "next_attempt_at="); len(lines) != 1 {
		t.Fatalf("want one failure line for the row, got %d", len(lines))
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), []uuid.UUID{good[0].ID, good[1].ID})
}

// A row AMQP cannot carry (written by something other than Enqueue, which refuses it) would
// make the client fail mid-frame or the broker close the connection, taking the rest of the
// batch with it, batch after batch. It is the row's own fault: it is charged and backed off,
// and the others go out.
func TestRelayBacksOffARowAMQPCannotCarryAndSendsTheRest(t *testing.T) {
	t.Parallel()
	b := setup(t)
	good := []messaging.Message{newMessage(t, 1), newMessage(t, 2)}
	bad := []messaging.Message{newMessage(t, 3), newMessage(t, 4)}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error {
		return messaging.Enqueue(context.Background(), b.drv, tx, good[0], bad[0], bad[1], good[1])
	}); err != nil {
		t.Fatal(err)
	}
	bad = append(bad, newMessage(t, 5))
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, bad[2]) }); err != nil {
		t.Fatal(err)
	}
	spoil := map[uuid.UUID]string{
		bad[0].ID: "UPDATE outbox_messages SET correlation_id = repeat('x', 300) WHERE id = ?",
		bad[1].ID: `UPDATE outbox_messages SET headers = jsonb_build_object('big', repeat('x', 200000)) WHERE id = ?`,
		// Written before Enqueue refused it: the broker closed the channel at its publish, and
		// the relay took that for an outage, for ever, sending nothing.
		bad[2].ID: `UPDATE outbox_messages SET headers = '{"CC": "audit"}' WHERE id = ?`,
	}
	for id, stmt := range spoil {
		if err := b.db.DB.Exec(stmt, id).Error; err != nil {
			t.Fatal(err)
		}
	}
	res, err := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil).ProcessBatch(context.Background())
	if err != nil || res != (messaging.BatchResult{Claimed: 5, Sent: 2, Failed: 3}) {
		t.Fatalf("batch = %+v, %v; want the 2 good rows sent and the 3 others failed", res, err)
	}
	for id := range spoil {
		var row outboxRow
		if err := b.db.DB.Take(&row, "id = ?", id).Error; err != nil {
			t.Fatal(err)
		}
		if row.ProcessedAt != nil || row.Attempts != 1 || row.LastError == nil || !strings.Contains(*row.LastError, "not valid for AMQP") ||
			time.Until(row.NextAttemptAt) < time.Second {
			t.Fatalf("row %s: processed %v, attempts %d, last error %v, due in %s; want backed off once with the envelope's fault",
				id, row.ProcessedAt, row.Attempts, row.LastError, time.Until(row.NextAttemptAt).Round(time.Millisecond))
		}
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), []uuid.UUID{good[0].ID, good[1].ID})
}

// A row whose headers are not a JSON object of strings (written by hand, or by another program:
// the column takes any JSON) cannot be read as a message. Failing the claim for it would roll
// the batch back and leave the row heading every claim, the relay sending nothing: the row is
// charged and backed off instead, and the others go out.
func TestRelayBacksOffARowWhoseHeadersCannotBeReadAndSendsTheRest(t *testing.T) {
	t.Parallel()
	b := setup(t)
	bad, good := newMessage(t, 0), []messaging.Message{newMessage(t, 1), newMessage(t, 2)}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error {
		return messaging.Enqueue(context.Background(), b.drv, tx, bad, good[0], good[1])
	}); err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Exec(`UPDATE outbox_messages SET headers = '{"retries": 1}' WHERE id = ?`, bad.ID).Error; err != nil {
		t.Fatal(err)
	}
	res, err := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil).ProcessBatch(context.Background())
	if err != nil || res != (messaging.BatchResult{Claimed: 3, Sent: 2, Failed: 1}) {
		t.Fatalf("batch = %+v, %v; want the 2 good rows sent and the other failed", res, err)
	}
	var row outboxRow
	if err := b.db.DB.Take(&row, "id = ?", bad.ID).Error; err != nil {
		t.Fatal(err)
	}
	if row.ProcessedAt != nil || row.Attempts != 1 || row.LastError == nil || !strings.Contains(*row.LastError, "headers are not a JSON object of strings") ||
		time.Until(row.NextAttemptAt) < time.Second {
		t.Fatalf("row: processed %v, attempts %d, last error %v, due in %s; want backed off once with the headers' fault",
			row.ProcessedAt, row.Attempts, row.LastError, time.Until(row.NextAttemptAt).Round(time.Millisecond))
	}
	if lines := b.logs.Lines("outbox publish failed", "message_id="+bad.ID.String(), "headers are not a JSON object"); len(lines) != 1 {
		t.Fatalf("want one failure line naming the headers, got %d", len(lines))
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), []uuid.UUID{good[0].ID, good[1].ID})
}

// A row naming an exchange the relay's user may not write to is the row's fault (a deployment
// that forgot a permission, or a row meant for another relay): the broker closes the channel at
// its publish, or refuses the check before it (RabbitMQ 4.2.6 and later, for a user with no
// permission on the exchange). Taken as the broker's absence, it would head every batch and the
// relay would send nothing: the row is charged and backed off, and the others go out.
func TestRelayBacksOffARowWhoseExchangeItMayNotWriteAndSendsTheRest(t *testing.T) {
	t.Parallel()
	b := setup(t)
	readOnly, refused := testenv.UniqueName("read-only"), testenv.UniqueName("refused")
	user := testenv.UniqueName("relayer")
	testenv.CleanupBroker(t, nil, []string{readOnly, refused})
	for _, x := range []string{readOnly, refused} {
		if err := b.ch.ExchangeDeclare(x, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { testenv.RabbitMQCtlQuietly("delete_user", user) })
	testenv.RabbitMQCtl(t, "add_user", user, "secret")
	testenv.RabbitMQCtl(t, "set_permissions", "-p", "/", user, "^$", "^"+b.exchange+"$", "^"+readOnly+"$")

	good := []messaging.Message{newMessage(t, 0), newMessage(t, 2), newMessage(t, 4)}
	bad := []messaging.Message{newMessage(t, 1), newMessage(t, 3)}
	bad[0].Exchange, bad[1].Exchange = readOnly, refused
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error {
		return messaging.Enqueue(context.Background(), b.drv, tx, good[0], bad[0], good[1], bad[1], good[2])
	}); err != nil {
		t.Fatal(err)
	}
	url := strings.Replace(testenv.AMQPURL(), "guest:guest@", user+":secret@", 1)
	b.sendPastChannelClosers(t, b.relay(t, b.publisher(t, url), nil), bad, good, "access refused")
}

// internalExchange declares an exchange of the test's that only other exchanges may route to.
func (b *testBundle) internalExchange(t *testing.T) string {
	t.Helper()
	internal := testenv.UniqueName("internal")
	testenv.CleanupBroker(t, nil, []string{internal})
	if err := b.ch.ExchangeDeclare(internal, amqp.ExchangeTopic, true, false, true, false, nil); err != nil {
		t.Fatal(err)
	}
	return internal
}

// A row naming an internal exchange (one only other exchanges route to, which the relay's check
// that the exchange exists does not tell apart) makes the broker close the channel at its
// publish. Taken as the broker's absence, it headed every batch and the relay sent nothing: it
// is charged and backed off, and the others go out.
func TestRelayBacksOffARowForAnInternalExchangeAndSendsTheRest(t *testing.T) {
	t.Parallel()
	b := setup(t)
	internal := b.internalExchange(t)
	good := []messaging.Message{newMessage(t, 0), newMessage(t, 2)}
	bad := []messaging.Message{newMessage(t, 1)}
	bad[0].Exchange = internal
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error {
		return messaging.Enqueue(context.Background(), b.drv, tx, good[0], bad[0], good[1])
	}); err != nil {
		t.Fatal(err)
	}
	b.sendPastChannelClosers(t, b.relay(t, b.publisher(t, testenv.AMQPURL()), nil), bad, good, "cannot publish to internal exchange")
}

// An exchange outside the publisher's Topology, deleted after its connection found it, makes
// the broker close the channel at a publish to it. Taken as the broker's absence, it cost an
// outage and the rows before it were sent again: it is charged and backed off as a missing
// exchange, and the others go out. (A Topology's exchange is declared again by the next
// connection instead: TestRelayRedeclaresTopologyAfterTheExchangeIsDeleted.)
func TestRelayBacksOffARowForAnExchangeDeletedSinceItConnected(t *testing.T) {
	t.Parallel()
	b := setup(t)
	gone, elsewhere := "gone-"+uuid.NewString(), "elsewhere-"+uuid.NewString()
	must(t, b.ch.ExchangeDeclare(gone, amqp.ExchangeTopic, true, false, false, false, nil))
	_, err := b.ch.QueueDeclare(elsewhere, true, false, false, false, nil)
	must(t, err)
	must(t, b.ch.QueueBind(elsewhere, "#", gone, false, nil))
	t.Cleanup(func() { _, _ = testenv.Channel(t).QueueDelete(elsewhere, false, false, false) })
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil)
	found := newMessage(t, 9)
	found.Exchange = gone
	must(t, b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, found) }))
	if res, err := r.ProcessBatch(context.Background()); err != nil || res.Sent != 1 {
		t.Fatalf("the batch that found %s = %+v, %v; want it sent", gone, res, err)
	}
	must(t, b.ch.ExchangeDelete(gone, false, false))
	good := []messaging.Message{newMessage(t, 0), newMessage(t, 2)}
	bad := []messaging.Message{newMessage(t, 1)}
	bad[0].Exchange = gone
	must(t, b.db.DB.Transaction(func(tx *gorm.DB) error {
		return messaging.Enqueue(context.Background(), b.drv, tx, good[0], bad[0], good[1])
	}))
	b.sendPastChannelClosers(t, r, bad, good, "no such exchange")
}

// callTimes is a Sender that notes when each of its calls began.
type callTimes struct {
	messaging.Sender
	mu    sync.Mutex
	began []time.Time
}

func (s *callTimes) Publish(ctx context.Context, msgs []messaging.Message) []error {
	s.mu.Lock()
	s.began = append(s.began, time.Now())
	s.mu.Unlock()
	return s.Sender.Publish(ctx, msgs)
}

// A full batch whose rows the broker answered for but took nowhere (the channel it closed for
// another row's refusal took them) is not followed at once by the next: the lane paces it as a
// retry. Signalled as a full batch, it claimed the same rows again at once, in a tight loop
// while they could not go (a row whose earlier publish is still in flight).
func TestRelayPacesTheBatchAfterRowsTheBrokerTookNowhere(t *testing.T) {
	t.Parallel()
	b := setup(t)
	internal := b.internalExchange(t)
	bad := newMessage(t, 0)
	bad.Exchange = internal
	msgs := []messaging.Message{bad, newMessage(t, 1), newMessage(t, 2), newMessage(t, 3)}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, msgs...) }); err != nil {
		t.Fatal(err)
	}
	const pace = 300 * time.Millisecond
	sender := &callTimes{Sender: b.publisher(t, testenv.AMQPURL())}
	r := b.relay(t, sender, func(c *messaging.RelayConfig) {
		c.BatchSize, c.Lanes = len(msgs), 1
		c.BrokerRetry = messaging.Backoff{Base: pace, Max: pace, Jitter: 0.01}
	})
	run(t, r.Run)
	testenv.Eventually(t, 10*time.Second, func() bool { return b.unprocessed(t) == 1 }, "the good rows were not sent")
	sender.mu.Lock()
	defer sender.mu.Unlock()
	if len(sender.began) < 2 {
		t.Fatalf("%d batches published, want the refused row's and the next", len(sender.began))
	}
	if gap := sender.began[1].Sub(sender.began[0]); gap < pace*9/10 {
		t.Fatalf("the next batch began %s after the one the closed channel cut short, want a retry's %s", gap.Round(time.Millisecond), pace)
	}
}

// A body larger than the broker's max_message_size (16 MiB by default on RabbitMQ 4.x; 128 MiB
// on 3.x, which takes this one) makes the broker close the channel at its publish, when the
// publisher's MaxMessageBytes allows more: the row is charged as too large, not taken for an
// outage that heads every batch for ever.
func TestRelayBacksOffARowLargerThanTheBrokerTakes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	good := []messaging.Message{newMessage(t, 0), newMessage(t, 2)}
	big := newMessage(t, 1)
	big.Payload = []byte(`"` + strings.Repeat("x", 16<<20) + `"`)
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error {
		if err := messaging.Enqueue(context.Background(), b.drv, tx, good[0]); err != nil {
			return err
		}
		// By hand, as an older version or an operator wrote it: Enqueue refuses a payload this large.
		if err := tx.Exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at) VALUES (?, ?, ?::jsonb, ?)`,
			big.ID, big.Type, string(big.Payload), big.OccurredAt).Error; err != nil {
			return fmt.Errorf("insert the large row by hand: %w", err)
		}
		return messaging.Enqueue(context.Background(), b.drv, tx, good[1])
	}); err != nil {
		t.Fatal(err)
	}
	// The three rows in one batch: the large one alone is past the default MaxBatchBytes.
	relay := b.relay(t, b.publisher(t, testenv.AMQPURL(), func(c *messaging.PublisherConfig) { c.MaxMessageBytes = 32 << 20 }),
		func(c *messaging.RelayConfig) { c.MaxBatchBytes = 32 << 20 })
	if version, _ := testenv.Connection(t).Properties["version"].(string); strings.HasPrefix(version, "3.") {
		if _, err := relay.ProcessBatch(context.Background()); err != nil || b.unprocessed(t) != 0 {
			t.Fatalf("RabbitMQ %s: %d rows unsent, %v; want all three sent under its 128 MiB limit", version, b.unprocessed(t), err)
		}
		return
	}
	b.sendPastChannelClosers(t, relay, []messaging.Message{big}, good, "the broker's limit is")
}

// sendPastChannelClosers runs relay's batches until every row but the bad ones is sent, each of
// those charged once with an error that holds errText: a channel the broker closes takes the
// confirms still awaited with it, and the publishes after it, so those rows wait for the next
// batch, uncharged. The broker answered: no batch reports it unavailable, which would pause the
// relay for an outage at each retry of a refused row.
func (b *testBundle) sendPastChannelClosers(t *testing.T, relay *messaging.Relay, bad, good []messaging.Message, errText string) {
	t.Helper()
	charged := func() bool {
		return testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages WHERE attempts > 0") == int64(len(bad))
	}
	for i := 0; b.unprocessed(t) > int64(len(bad)) || !charged(); i++ {
		if i == 5 {
			t.Fatalf("%d rows unsent after %d batches; want only the %d refused ones, each charged", b.unprocessed(t), i, len(bad))
		}
		res, err := relay.ProcessBatch(context.Background())
		t.Logf("batch %d: %+v, %v", i, res, err)
		if err != nil {
			t.Fatalf("batch %d: %v; want the rows the closed channel took left for the next batch, no outage", i, err)
		}
	}
	for _, m := range bad {
		var row outboxRow
		if err := b.db.DB.Take(&row, "id = ?", m.ID).Error; err != nil {
			t.Fatal(err)
		}
		if row.ProcessedAt != nil || row.Attempts != 1 || row.LastError == nil || !strings.Contains(*row.LastError, errText) ||
			!strings.Contains(*row.LastError, m.Exchange) || time.Until(row.NextAttemptAt) <= 0 {
			t.Fatalf("row for %q: processed %v, attempts %d, last error %v, due in %s; want backed off once with %q",
				m.Exchange, row.ProcessedAt, row.Attempts, row.LastError, time.Until(row.NextAttemptAt).Round(time.Millisecond), errText)
		}
	}
	ids := make([]uuid.UUID, len(good))
	for i, m := range good {
		ids[i] = m.ID
	}
	missing, _, unexpected := countIDs(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
	if missing > 0 || unexpected > 0 {
		t.Fatalf("%d good rows missing from the queue, %d unexpected messages", missing, unexpected)
	}
}

// A topic permission that refuses a row's routing key (the relay's user may write to the
// exchange, but not with every key) closes the channel at that row's publish, as a refused
// exchange does: the row is charged and backed off, and the others go out. Taken as the
// broker's absence, it would close every batch's channel, for ever.
func TestRelayBacksOffARowWhoseRoutingKeyItMayNotWriteAndSendsTheRest(t *testing.T) {
	t.Parallel()
	relayBacksOffARowWhoseRoutingKeyItMayNotWrite(t, "Refused")
}

// A routing key long enough that the broker's reason, which quotes it, is cut at 255 bytes
// ("..."): the refusal is read all the same.
func TestRelayBacksOffARowWhoseLongRoutingKeyItMayNotWrite(t *testing.T) {
	t.Parallel()
	relayBacksOffARowWhoseRoutingKeyItMayNotWrite(t, "Refused."+strings.Repeat("k", 200))
}

func relayBacksOffARowWhoseRoutingKeyItMayNotWrite(t *testing.T, key string) {
	b := setup(t)
	user := testenv.UniqueName("relayer")
	t.Cleanup(func() { testenv.RabbitMQCtlQuietly("delete_user", user) })
	testenv.RabbitMQCtl(t, "add_user", user, "secret")
	testenv.RabbitMQCtl(t, "set_permissions", "-p", "/", user, "^$", "^"+b.exchange+"$", "^$")
	testenv.RabbitMQCtl(t, "set_topic_permissions", "-p", "/", user, b.exchange, "^"+eventType+"$", ".*")

	good := []messaging.Message{newMessage(t, 0), newMessage(t, 2), newMessage(t, 3)}
	bad := newMessage(t, 1)
	bad.RoutingKey = key
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error {
		return messaging.Enqueue(context.Background(), b.drv, tx, good[0], bad, good[1], good[2])
	}); err != nil {
		t.Fatal(err)
	}
	url := strings.Replace(testenv.AMQPURL(), "guest:guest@", user+":secret@", 1)
	relay := b.relay(t, b.publisher(t, url), nil)
	charged := func() bool {
		return testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages WHERE attempts > 0") == 1
	}
	for i := 0; b.unprocessed(t) > 1 || !charged(); i++ {
		if i == 5 {
			t.Fatalf("%d rows unsent after %d batches; want only the refused one, charged", b.unprocessed(t), i)
		}
		res, err := relay.ProcessBatch(context.Background())
		t.Logf("batch %d: %+v, %v", i, res, err)
		if err != nil {
			t.Fatalf("batch %d: %v; want the rows the closed channel took left for the next batch, no outage", i, err)
		}
	}
	var row outboxRow
	if err := b.db.DB.Take(&row, "id = ?", bad.ID).Error; err != nil {
		t.Fatal(err)
	}
	if row.ProcessedAt != nil || row.Attempts != 1 || row.LastError == nil || !strings.Contains(*row.LastError, "access refused") ||
		!strings.Contains(*row.LastError, "'Refused") || time.Until(row.NextAttemptAt) <= 0 {
		t.Fatalf("refused row: processed %v, attempts %d, last error %v, due in %s; want backed off once as refused, naming its key",
			row.ProcessedAt, row.Attempts, row.LastError, time.Until(row.NextAttemptAt).Round(time.Millisecond))
	}
	// The closed channel took the confirms of messages the broker had routed already: those go
	// again, and the inboxes skip the copies.
	missing, _, unexpected := countIDs(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), []uuid.UUID{good[0].ID, good[1].ID, good[2].ID})
	if missing > 0 || unexpected > 0 {
		t.Fatalf("%d good rows missing from the queue, %d unexpected messages", missing, unexpected)
	}
}

// A relay's exchange or a publisher's app id AMQP cannot carry is the configuration's fault,
// not each row's: NewRelay refuses the one; the other keeps the publisher from connecting
// (Connect says why, and Run returns it), so the relay charges no row for it.
func TestConfigurationAMQPCannotCarryIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	long := strings.Repeat("x", 256)
	if _, err := messaging.NewRelay(messaging.RelayConfig{DB: b.drv.DB(), Sender: b.publisher(t, testenv.AMQPURL()), Exchange: long}); err == nil ||
		!strings.Contains(err.Error(), "Exchange") {
		t.Fatalf("NewRelay with a 256-byte exchange: %v, want an error naming Exchange", err)
	}
	pub := b.publisher(t, testenv.AMQPURL(), func(c *messaging.PublisherConfig) { c.AppID = long })
	if err := pub.Connect(context.Background()); err == nil || !strings.Contains(err.Error(), "AppID") || errors.Is(err, messaging.ErrBrokerUnavailable) {
		t.Fatalf("Connect with a 256-byte app id: %v, want an error naming AppID, not the broker unavailable", err)
	}
	// Run returns it, rather than waiting for a broker for ever.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := b.relay(t, pub, nil).Run(ctx); err == nil || !strings.Contains(err.Error(), "AppID") || ctx.Err() != nil {
		t.Fatalf("Run with a 256-byte app id: %v (context: %v), want at once an error naming AppID", err, ctx.Err())
	}
	// So is a Topology no broker takes, a binding to the default exchange.
	wrong := b.publisher(t, testenv.AMQPURL(), func(c *messaging.PublisherConfig) {
		c.Topology = messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: "q", Bindings: []messaging.Binding{{RoutingKey: "OrderPlaced"}}}}}
	})
	if err := b.relay(t, wrong, nil).Run(ctx); err == nil || !strings.Contains(err.Error(), "Topology") || ctx.Err() != nil {
		t.Fatalf("Run with a binding to the default exchange: %v (context: %v), want at once an error naming Topology", err, ctx.Err())
	}
	ids := b.enqueue(t, 1)
	res, err := b.relay(t, pub, nil).ProcessBatch(context.Background())
	if res.Sent != 0 || res.Failed != 0 || !errors.Is(err, messaging.ErrBrokerUnavailable) {
		t.Fatalf("batch with a 256-byte app id = %+v, %v; want nothing sent or charged, the broker unavailable", res, err)
	}
	var row outboxRow
	if err := b.db.DB.Take(&row, "id = ?", ids[0]).Error; err != nil {
		t.Fatal(err)
	}
	if row.Attempts != 0 || row.ProcessedAt != nil {
		t.Fatalf("row after the batch: attempts %d, processed %v; want untouched", row.Attempts, row.ProcessedAt)
	}
}

// timedSender notes when the broker's verdicts on the last Publish came back.
type timedSender struct {
	messaging.Sender
	returned time.Time
}

func (s *timedSender) Publish(ctx context.Context, msgs []messaging.Message) []error {
	errs := s.Sender.Publish(ctx, msgs)
	s.returned = time.Now()
	return errs
}

// A batch's rows are dated by the clock when the broker's verdict came, not when the batch's
// transaction began: behind a broker that takes a second to answer, a sent row's processed_at,
// and a refused row's next attempt (its backoff counted from the refusal), are not a second
// early.
func TestRelayDatesRowsByTheVerdictNotTheBatchStart(t *testing.T) {
	t.Parallel()
	b := setup(t)
	refused, err := messaging.NewMessage("NobodyListens", map[string]int{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, refused) }); err != nil {
		t.Fatal(err)
	}
	sent := b.enqueue(t, 1)[0]
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	pub := b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen))
	if err := pub.Connect(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"slow","type":"latency","stream":"downstream","attributes":{"latency":1000}}`)); err != nil {
		t.Fatal(err)
	}
	const backoff = 10 * time.Second
	sender := &timedSender{Sender: pub}
	r := b.relay(t, sender, func(c *messaging.RelayConfig) {
		c.Backoff = messaging.Backoff{Base: backoff, Max: backoff, Jitter: 0.001}
	})
	if res, err := r.ProcessBatch(context.Background()); err != nil || res.Sent != 1 || res.Failed != 1 {
		t.Fatalf("batch = %+v, %v; want one row sent and one refused", res, err)
	}
	var processedAt, nextAttemptAt time.Time
	if err := b.db.DB.Raw("SELECT processed_at FROM outbox_messages WHERE id = ?", sent).Row().Scan(&processedAt); err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Raw("SELECT next_attempt_at FROM outbox_messages WHERE id = ?", refused.ID).Row().Scan(&nextAttemptAt); err != nil {
		t.Fatal(err)
	}
	// The database runs on the test's clock; the margin is for rounding, far below the second.
	const margin = 50 * time.Millisecond
	if early := sender.returned.Sub(processedAt); early > margin {
		t.Errorf("processed_at is %s before the broker's verdict came: dated from the batch's start", early)
	}
	if early := sender.returned.Add(backoff * 999 / 1000).Sub(nextAttemptAt); early > margin {
		t.Errorf("next attempt is %s less than %s after the refusal: the backoff was counted from the batch's start", early, backoff)
	}
}

// A row that was unroutable goes out, and counts as sent, once a queue is bound to take it,
// through the same publisher: the return of the failed attempt is forgotten once matched, and
// the next publish of the message is judged on its own.
func TestRelaySendsAnUnroutableRowOnceAQueueIsBound(t *testing.T) {
	t.Parallel()
	b := setup(t)
	late, err := messaging.NewMessage("NobodyListensYet", map[string]int{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, late) }); err != nil {
		t.Fatal(err)
	}
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil)
	if res, err := r.ProcessBatch(context.Background()); err != nil || res.Failed != 1 {
		t.Fatalf("batch with no queue bound = %+v, %v; want the row refused", res, err)
	}
	if err := b.ch.QueueBind(b.queue, late.Type, b.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Exec("UPDATE outbox_messages SET next_attempt_at = now() WHERE id = ?", late.ID).Error; err != nil {
		t.Fatal(err)
	}
	if res, err := r.ProcessBatch(context.Background()); err != nil || res != (messaging.BatchResult{Claimed: 1, Sent: 1}) {
		t.Fatalf("batch once a queue is bound = %+v, %v; want the row sent", res, err)
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), []uuid.UUID{late.ID})
}

// refusingSender is a Sender of its own, as a library user may write one: it refuses the
// messages named in refuse with their error, and accepts the others.
type refusingSender struct {
	refuse map[uuid.UUID]error
}

func (s refusingSender) Publish(_ context.Context, msgs []messaging.Message) []error {
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		errs[i] = s.refuse[m.ID]
	}
	return errs
}

// A refusal's text may hold what a text column cannot (a server's reply quoted as it came, a
// reason cut inside a character): the row is backed off all the same, with its error made
// storable, and the batch's other rows are marked sent, once.
func TestRelayRecordsARefusalWhoseTextPostgreSQLCannotStore(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.enqueue(t, 2)
	refused, sent := ids[0], ids[1]
	r := b.relay(t, refusingSender{refuse: map[uuid.UUID]error{refused: errors.New("refused: \xff\x00 by the server")}}, nil)
	res, err := r.ProcessBatch(context.Background())
	if err != nil || res != (messaging.BatchResult{Claimed: 2, Sent: 1, Failed: 1}) {
		t.Fatalf("batch = %+v, %v; want one row sent and one refused", res, err)
	}
	var row outboxRow
	if err := b.db.DB.First(&row, "id = ?", refused).Error; err != nil {
		t.Fatal(err)
	}
	lastError := ""
	if row.LastError != nil {
		lastError = *row.LastError
	}
	if row.Attempts != 1 || lastError != "refused: \uFFFD by the server" || row.ProcessedAt != nil {
		t.Errorf("refused row: attempts %d, last_error %q, sent %v; want one attempt, its error stored, unsent", row.Attempts, lastError, row.ProcessedAt != nil)
	}
	var accepted outboxRow
	if err := b.db.DB.First(&accepted, "id = ?", sent).Error; err != nil || accepted.ProcessedAt == nil {
		t.Errorf("accepted row: sent %v (%v); want it marked sent", accepted.ProcessedAt != nil, err)
	}
}

// verdictless is a Sender of its own with a bug: it answers for none of the messages.
type verdictless struct{}

func (verdictless) Publish(context.Context, []messaging.Message) []error { return nil }

// A Sender that answers for fewer messages than it was given leaves no verdict to match to a
// row: the batch fails with an error that says so, every row stays due with its attempts
// untouched, and a row carrying a trace context (whose publish span ends with its verdict)
// does not crash the relay.
func TestRelayRefusesASenderThatGivesTheWrongNumberOfVerdicts(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.enqueue(t, 2)
	if err := b.db.DB.Exec("UPDATE outbox_messages SET trace_parent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01' WHERE id = ?", ids[0]).Error; err != nil {
		t.Fatal(err)
	}
	r := b.relay(t, verdictless{}, nil)
	res, err := r.ProcessBatch(context.Background())
	if err == nil || !strings.Contains(err.Error(), "the Sender gave 0 verdicts for 2 messages") {
		t.Fatalf("batch = %+v, %v; want an error naming the verdicts missing", res, err)
	}
	var rows []outboxRow
	if err := b.db.DB.Find(&rows, "id IN ?", ids).Error; err != nil {
		t.Fatal(err)
	}
	for _, row := range rows {
		if row.Attempts != 0 || row.ProcessedAt != nil || row.LastError != nil {
			t.Errorf("row %s: attempts %d, sent %v, last_error %v; want it due as it was", row.ID, row.Attempts, row.ProcessedAt != nil, row.LastError)
		}
	}
	if len(rows) != 2 {
		t.Errorf("%d rows; want 2", len(rows))
	}
}

// A payload within the publisher's limit when it was enqueued is sent, though PostgreSQL gives
// its jsonb back half as long again (a space after every ',' and ':'): measured compact, as the
// consumer's own limit measures what arrives.
func TestRelaySendsAPayloadThatOnlyTheDatabasesSpacingTakesOverTheLimit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	payload := "[" + strings.Repeat("0,", 450_000) + "0]" // 900,003 bytes; about 1.35 MB as jsonb prints it
	m := newMessage(t, 0)
	m.Payload = json.RawMessage(payload)
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, m) }); err != nil {
		t.Fatal(err)
	}
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil)
	if res, err := r.ProcessBatch(context.Background()); err != nil || res != (messaging.BatchResult{Claimed: 1, Sent: 1}) {
		t.Fatalf("batch = %+v, %v; want the row sent", res, err)
	}
	got := testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond)
	assertExactlyOnce(t, got, []uuid.UUID{m.ID})
	if string(got[0].Body) != payload {
		t.Errorf("body of %d bytes; want the payload as enqueued, %d bytes", len(got[0].Body), len(payload))
	}
}

// A lane whose batch failed (the database away for a moment) tries again paced as the
// broker's checks, not after a whole poll deaf to wakes: where the poll is an hour away and
// NOTIFY carries the traffic, a failed lane slept the hour, its rows waiting, and with every
// lane failed at once (a restart) nothing was sent.
func TestALaneWhoseBatchFailedTriesAgainSoon(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.runListeningRelay(t)
	exec := func(q string) {
		t.Helper()
		if err := b.db.DB.Exec(q).Error; err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	exec("ALTER TABLE outbox_messages RENAME TO outbox_messages_away")
	exec("SELECT pg_notify('outbox_messages', '')")
	testenv.Eventually(t, 5*time.Second, func() bool { return len(b.logs.Lines("relay batch failed")) > 0 },
		"the relay's batch did not fail without its table")
	exec("ALTER TABLE outbox_messages_away RENAME TO outbox_messages")
	b.enqueue(t, 1)
	b.waitAllSent(t, 5*time.Second)
}

// A row the broker refused is tried again once its backoff runs out, not at the next poll:
// nothing NOTIFYs then, and with the poll an hour away a row whose queue was bound meanwhile
// waited the hour, though its line said retry_in=2s.
func TestARefusedRowIsTriedAgainWhenItsBackoffRunsOutNotAtThePoll(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.runListeningRelay(t, func(c *messaging.RelayConfig) {
		c.Backoff = messaging.Backoff{Base: 100 * time.Millisecond, Max: 500 * time.Millisecond}
	})
	late, err := messaging.NewMessage("NobodyListensYet", map[string]int{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, late) }); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, func() bool {
		return len(b.logs.Lines("outbox publish failed", "message_id="+late.ID.String())) > 0
	}, "the relay did not refuse the row of a type no queue is bound to")
	if err := b.ch.QueueBind(b.queue, late.Type, b.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	b.waitAllSent(t, 5*time.Second)
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), []uuid.UUID{late.ID})
}
