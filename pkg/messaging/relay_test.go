package messaging_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
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
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(tx, msg) }); err != nil {
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
	var row messaging.OutboxMessage
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
	}
	for what, ok := range checks {
		if !ok {
			t.Errorf("%s wrong: delivery %+v, row %+v", what, d, row)
		}
	}
}

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

func TestRelayDeliversEverythingAfterABrokerOutage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	r := b.relay(t, b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen)), nil)
	run(t, r.Run)

	ids := b.enqueue(t, 3)
	b.waitAllSent(t, 10*time.Second)

	// The seed's experiment: the broker is gone for about 8 s while orders keep coming.
	proxy.Stop()
	outageEnds := time.Now().Add(8 * time.Second)
	for time.Now().Before(outageEnds) {
		ids = append(ids, b.enqueue(t, 1)...)
		time.Sleep(250 * time.Millisecond) // the pace of incoming orders, not a synchronisation
	}
	if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages WHERE attempts > 0 AND processed_at IS NULL"); n == 0 {
		t.Fatal("no row recorded a failed attempt during the outage")
	}
	if err := proxy.Start(); err != nil {
		t.Fatal(err)
	}

	// Backoff of the most-tried row is at most 16 s after an 8 s outage; no manual action.
	b.waitAllSent(t, 45*time.Second)
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 300*time.Millisecond), ids)
	if lines := b.logs.Lines("outbox publish failed", "message_id=", "attempts=", "next_attempt_at="); len(lines) == 0 {
		t.Error("no publish failure was logged with message id, attempts and next attempt")
	}
}

func TestBackoffDoublesFromTwoSecondsUpToTheCap(t *testing.T) {
	t.Parallel()
	b := messaging.Backoff{Base: 2 * time.Second, Max: 5 * time.Minute}
	want := []time.Duration{2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second,
		64 * time.Second, 128 * time.Second, 256 * time.Second, 5 * time.Minute, 5 * time.Minute}
	for i, w := range want {
		if got := b.Delay(i + 1); got != w {
			t.Errorf("Delay(%d) = %s, want %s", i+1, got, w)
		}
	}
	if got := b.Delay(10_000); got != 5*time.Minute {
		t.Errorf("Delay(10000) = %s, want the 5 min cap", got)
	}
}

// An unroutable message is confirmed by the broker but returned: it must not count as sent,
// must back off 2 s, 4 s, … up to the cap, and must not hold up the rows behind it.
func TestRelayBacksOffUnroutableRowsWithoutBlockingOthers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	unroutable, err := messaging.NewMessage("NobodyListens", map[string]int{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(tx, unroutable) }); err != nil {
		t.Fatal(err)
	}
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
		if ms := float64(wantDelay.Milliseconds()); s.DueInMs < ms-1000 || s.DueInMs > ms+50 {
			t.Fatalf("attempt %d: next attempt in %.0f ms, want about %s", attempt+1, s.DueInMs, wantDelay)
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
	if err != nil {
		t.Fatal(err)
	}
	if res.Sent != 0 || res.Failed != 5 || b.unprocessed(t) != 5 {
		t.Fatalf("batch through a black hole = %+v with %d unprocessed, want 5 failed and unprocessed", res, b.unprocessed(t))
	}
	if lines := b.logs.Lines("outbox publish failed", "wait for confirm"); len(lines) != 5 {
		t.Fatalf("want 5 confirm-timeout failures logged, got %d", len(lines))
	}

	if err := proxy.Toxics.RemoveToxic(context.Background(), "blackhole"); err != nil {
		t.Fatal(err)
	}
	proxy.Stop() // drop the stale connection that the black hole left behind
	if err := proxy.Start(); err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Exec("UPDATE outbox_messages SET next_attempt_at = now()").Error; err != nil {
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
	if err != nil {
		t.Fatal(err)
	}
	if res.Sent != 0 || b.unprocessed(t) != 3 {
		t.Fatalf("batch to a deleted exchange = %+v, %d unprocessed; want nothing marked sent", res, b.unprocessed(t))
	}
	// The publisher declared the exchange again; the queue needs its binding back too (the
	// consumer's Setup does that on reconnect; here the test plays the consumer).
	if err := b.topology.Declare(b.ch); err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Exec("UPDATE outbox_messages SET next_attempt_at = now()").Error; err != nil {
		t.Fatal(err)
	}
	run(t, r.Run)
	b.waitAllSent(t, 20*time.Second)
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), append(first, ids...))
}

func TestRelayWakesOnNotifyWithoutWaitingForThePoll(t *testing.T) {
	t.Parallel()
	b := setup(t)
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) { c.PollInterval = time.Hour })
	run(t, r.Run)
	// Let the first (empty) batch pass, so only a NOTIFY can pick up the next row.
	testenv.Eventually(t, 5*time.Second, func() bool {
		return testenv.Count(t, b.db.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND query LIKE 'LISTEN%'", b.db.Name) == 1
	}, "relay is not listening")
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

func (k *killAfterPublish) Publish(ctx context.Context, exchange string, msgs []messaging.Message) []error {
	errs := k.Sender.Publish(ctx, exchange, msgs)
	if !k.killed {
		k.killed = true
		admin, err := testenv.OpenGORM(testenv.DatabaseURL())
		if err != nil {
			k.t.Error(err)
			return errs
		}
		defer func() {
			if sqlDB, err := admin.DB(); err == nil {
				_ = sqlDB.Close()
			}
		}()
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
	b := setup(t)
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
	r := b.relay(t, pub, nil)
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
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(tx, big...) }); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var res messaging.BatchResult
	go func() {
		defer close(done)
		res, _ = r.ProcessBatch(context.Background())
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the batch is still stuck writing to a broker that does not read, 10 s after a 1 s confirm timeout")
	}
	if res.Sent != 0 || b.unprocessed(t) != 500 {
		t.Fatalf("batch = %+v with %d unprocessed; want nothing sent", res, b.unprocessed(t))
	}
}
