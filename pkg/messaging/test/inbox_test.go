package test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Shopify/toxiproxy/v2"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	amqp "github.com/rabbitmq/amqp091-go"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/messagingtest"
)

// payload is the bundle's event's: a handled message is one row of work_items.
type payload struct {
	OrderID uuid.UUID `json:"order_id"`
	N       int       `json:"n"`
}

// orderPlaced is the bundle's event: eventType messages on the bundle's exchange.
func (b *testBundle) orderPlaced() messaging.Event[payload] {
	return messaging.Event[payload]{Exchange: b.exchange, Type: eventType}
}

func (b *testBundle) createWorkTable(t testing.TB) {
	t.Helper()
	if err := b.db.DB.Exec("CREATE TABLE work_items (message_id uuid NOT NULL, n int NOT NULL)").Error; err != nil {
		t.Fatal(err)
	}
}

// doWork is the work under test: one row per handled message. A payload without an order id
// can never be handled.
func doWork(tx *gorm.DB, p payload, msg messaging.Message) error {
	if p.OrderID == uuid.Nil {
		return messaging.Permanent(errors.New("payload has no order_id"))
	}
	return tx.Exec("INSERT INTO work_items (message_id, n) VALUES (?, ?)", msg.ID, p.N).Error
}

func workFunc(_ context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
	return doWork(tx, p, msg)
}

func (b *testBundle) workDone(t *testing.T) int64 {
	t.Helper()
	return testenv.Count(t, b.db.DB, "SELECT count(*) FROM work_items")
}

// duplicateLines are the log lines of the bundle's consumer (named after its queue) skipping
// message id.
func (b *testBundle) duplicateLines(id uuid.UUID) []string {
	return b.logs.Lines("level=INFO", "duplicate", "consumer="+b.queue, "message_id="+id.String())
}

// inbox returns a subscription of consumer name, on drv's database, that handles the bundle's
// event with work: messagingtest.Deliver hands it messages as its queue would, no broker
// involved.
func (b *testBundle) inbox(t testing.TB, drv *gormdriver.Driver, name string, work messaging.Handler[*gorm.DB, payload]) *messaging.Subscription[*gorm.DB] {
	t.Helper()
	s, err := messaging.NewSubscription(drv, messaging.SubscriptionConfig{Name: name, URL: "amqp://unused", Logger: b.log, Metrics: b.metrics})
	if err != nil {
		t.Fatal(err)
	}
	if err := messaging.Handle(s, b.orderPlaced(), work); err != nil {
		t.Fatal(err)
	}
	return s
}

// deliver hands msg to s as its queue would.
func deliver(s *messaging.Subscription[*gorm.DB], msg messaging.Message) (duplicate bool, err error) {
	return messagingtest.Deliver(context.Background(), s, msg)
}

func TestInboxRunsWorkOnceForASequentialDuplicate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	in := b.inbox(t, b.drv, b.queue, workFunc)
	msg := newMessage(t, 1)
	for i, wantDup := range []bool{false, true} {
		dup, err := deliver(in, msg)
		if err != nil || dup != wantDup {
			t.Fatalf("delivery %d: duplicate=%v err=%v, want duplicate=%v", i+1, dup, err, wantDup)
		}
	}
	if n := b.workDone(t); n != 1 {
		t.Fatalf("work done %d times, want 1", n)
	}
	if n := len(b.duplicateLines(msg.ID)); n != 1 {
		t.Fatalf("%d duplicate log lines, want 1", n)
	}
	// Another consumer of the same message keeps its own record and does its own work.
	other := b.inbox(t, b.drv, "notification", func(context.Context, *gorm.DB, payload, messaging.Message) error { return nil })
	if dup, err := deliver(other, msg); err != nil || dup {
		t.Fatalf("other consumer: duplicate=%v err=%v, want a first delivery", dup, err)
	}
}

func TestInboxRunsWorkOnceForConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	in := b.inbox(t, b.drv, b.queue, func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		time.Sleep(10 * time.Millisecond) // widen the window in which the others arrive
		return doWork(tx, p, msg)
	})
	msg := newMessage(t, 1)
	const deliveries = 10
	var wg sync.WaitGroup
	var dups, errs atomic.Int32
	start := make(chan struct{})
	for range deliveries {
		wg.Go(func() {
			<-start
			dup, err := deliver(in, msg)
			if err != nil {
				errs.Add(1)
			}
			if dup {
				dups.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	if errs.Load() != 0 || dups.Load() != deliveries-1 || b.workDone(t) != 1 {
		t.Fatalf("errors=%d duplicates=%d work=%d, want 0, %d, 1", errs.Load(), dups.Load(), b.workDone(t), deliveries-1)
	}
	if n := len(b.duplicateLines(msg.ID)); n != deliveries-1 {
		t.Fatalf("%d duplicate log lines, want %d", n, deliveries-1)
	}
}

// A handler whose statement the database refuses for the value it was given (too long for its
// column, not valid in its type) fails the same way on every delivery: the failure is
// permanent, and the message is dead-lettered at once with the database's reason. A data
// exception the database's state can cause (a sequence run out, a counter past its range) is
// not, nor a constraint's refusal (a foreign key may be there by the next delivery).
func TestInboxTakesADataExceptionAsPermanent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	must(t, b.db.DB.Exec("CREATE TABLE codes (code varchar(3) PRIMARY KEY)").Error)
	must(t, b.db.DB.Exec("INSERT INTO codes VALUES ('abc')").Error)
	must(t, b.db.DB.Exec("CREATE SEQUENCE spent MINVALUE 1 MAXVALUE 2 START 2; SELECT nextval('spent')").Error)
	for _, tc := range []struct {
		name, stmt, sqlState string
		permanent            bool
	}{
		{"too long for its column", "INSERT INTO codes VALUES ('abcd')", "22001", true},
		{"not valid in its type", "SELECT 'twelve'::int", "22P02", true},
		{"a unique key taken", "INSERT INTO codes VALUES ('abc')", "23505", false},
		{"a sequence run out", "SELECT nextval('spent')", "2200H", false},
		{"a counter past its range", "SELECT 2147483647::int + 1", "22003", false},
	} {
		name := testenv.UniqueName("data")
		in := b.inbox(t, b.drv, name, func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
			return tx.Exec(tc.stmt).Error
		})
		_, err := deliver(in, newMessage(t, 1))
		if err == nil || messaging.IsPermanent(err) != tc.permanent || messaging.IsUnavailable(err) || !strings.Contains(err.Error(), tc.sqlState) {
			t.Errorf("%s: Deliver = %v; want permanent %v, with SQLSTATE %s", tc.name, err, tc.permanent, tc.sqlState)
		}
		// The handler's metric says what became of it.
		outcome := map[bool]string{true: "permanent", false: "error"}[tc.permanent]
		if n := metricValue(t, b.registry, "consumer_handler_seconds", map[string]string{"consumer": name, "outcome": outcome}); n != 1 {
			t.Errorf("%s: consumer_handler_seconds{outcome=%q} counts %v, want 1", tc.name, outcome, n)
		}
	}
}

func TestInboxRollsBackTheClaimWhenTheWorkFails(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	var fail atomic.Bool
	fail.Store(true)
	in := b.inbox(t, b.drv, b.queue, func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		if err := doWork(tx, p, msg); err != nil {
			return err
		}
		if fail.Load() {
			return errors.New("invoice numbering service said no")
		}
		return nil
	})
	msg := newMessage(t, 1)
	_, err := deliver(in, msg)
	if err == nil || messaging.IsUnavailable(err) || messaging.IsPermanent(err) {
		t.Fatalf("Deliver = %v, want the plain work error", err)
	}
	if w, c := b.workDone(t), testenv.Count(t, b.db.DB, "SELECT count(*) FROM inbox_messages"); w != 0 || c != 0 {
		t.Fatalf("after a failed handler: %d work rows, %d inbox rows; want nothing committed", w, c)
	}
	fail.Store(false)
	if dup, err := deliver(in, msg); err != nil || dup {
		t.Fatalf("redelivery: duplicate=%v err=%v, want the work done now", dup, err)
	}
	if w := b.workDone(t); w != 1 {
		t.Fatalf("work done %d times, want 1", w)
	}
}

// consumer runs a subscription of the bundle's queue, named after it, on drv's database, with
// work as the handler of the bundle's event, and waits until it consumes.
func (b *testBundle) consumer(t *testing.T, url string, drv *gormdriver.Driver, work messaging.Handler[*gorm.DB, payload], tweak func(*messaging.SubscriptionConfig)) *messaging.Subscription[*gorm.DB] {
	t.Helper()
	cfg := messaging.SubscriptionConfig{
		Name: b.queue, URL: url, Topology: b.topology, Concurrency: 4, Logger: b.log, Metrics: b.metrics,
		RetryBackoff: messaging.Backoff{Base: 20 * time.Millisecond, Max: 200 * time.Millisecond},
		Reconnect:    messaging.Backoff{Base: 100 * time.Millisecond, Max: time.Second},
	}
	if tweak != nil {
		tweak(&cfg)
	}
	s, err := messaging.NewSubscription(drv, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := messaging.Handle(s, b.orderPlaced(), work); err != nil {
		t.Fatal(err)
	}
	run(t, s.Run)
	testenv.Eventually(t, 10*time.Second, s.Ready, "consumer not ready")
	return s
}

// publishRaw publishes straight to the exchange, bypassing the outbox, as a duplicate or a
// poison message would arrive.
func (b *testBundle) publishRaw(t *testing.T, p amqp.Publishing) {
	t.Helper()
	if err := b.ch.PublishWithContext(context.Background(), b.exchange, eventType, false, false, p); err != nil {
		t.Fatal(err)
	}
}

func publishing(msg messaging.Message) amqp.Publishing {
	return amqp.Publishing{MessageId: msg.ID.String(), Type: msg.Type, ContentType: "application/json", Body: msg.Payload}
}

func TestConsumerDoesTheWorkOnceWhenAMessageArrivesTwice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	msgs := []messaging.Message{newMessage(t, 1), newMessage(t, 2), newMessage(t, 3)}
	for _, m := range msgs {
		b.publishRaw(t, publishing(m))
	}
	b.publishRaw(t, publishing(msgs[1])) // the redelivery
	testenv.Eventually(t, 10*time.Second, func() bool { return len(b.duplicateLines(msgs[1].ID)) == 1 },
		"no duplicate line for the redelivered message")
	acked := `consumer_messages_total{outcome="acked",queue="` + b.queue + `"} 4`
	testenv.Eventually(t, 5*time.Second, func() bool { return hasMetric(t, b.registry, acked) }, "not all 4 deliveries were acked")
	if w := b.workDone(t); w != 3 {
		t.Fatalf("work done %d times for 3 messages, want 3", w)
	}
	if n := len(b.logs.Lines("duplicate")); n != 1 {
		t.Fatalf("%d duplicate lines in all, want 1", n)
	}
	wantMetric(t, b.registry, `inbox_duplicates_total{consumer="`+b.queue+`"} 1`)
	if n := testenv.QueueDepth(t, b.ch, b.queue); n != 0 {
		t.Fatalf("queue still holds %d", n)
	}
}

func wantMetric(t *testing.T, reg *prometheus.Registry, line string) {
	t.Helper()
	if !hasMetric(t, reg, line) {
		t.Fatalf("metrics lack %q", line)
	}
}

func hasMetric(t *testing.T, reg *prometheus.Registry, line string) bool {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var buf strings.Builder
	for _, f := range families {
		if _, err := expfmt.MetricFamilyToText(&buf, f); err != nil {
			t.Fatal(err)
		}
	}
	return strings.Contains(buf.String(), line)
}

func TestConsumerRunsConcurrentDuplicatesOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, func(c *messaging.SubscriptionConfig) { c.Concurrency, c.Prefetch = 8, 32 })
	const n, copies = 100, 3
	msgs := make([]messaging.Message, n)
	for i := range msgs {
		msgs[i] = newMessage(t, i)
	}
	for range copies {
		for _, m := range msgs {
			b.publishRaw(t, publishing(m))
		}
	}
	testenv.Eventually(t, 30*time.Second, func() bool {
		return testenv.Count(t, b.db.DB, "SELECT count(*) FROM inbox_messages") == n && len(b.logs.Lines("duplicate")) == n*(copies-1)
	}, "not all %d deliveries were settled", n*copies)
	if w := b.workDone(t); w != n {
		t.Fatalf("work done %d times for %d messages, want %d", w, n, n)
	}
	if d := testenv.Count(t, b.db.DB, "SELECT count(*) FROM (SELECT message_id FROM work_items GROUP BY message_id HAVING count(*) > 1) d"); d != 0 {
		t.Fatalf("%d messages were worked twice", d)
	}
}

func TestConsumerRetriesAFailingHandlerThroughTheQueue(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	var calls atomic.Int32
	flaky := func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		if err := doWork(tx, p, msg); err != nil {
			return err
		}
		if calls.Add(1) <= 3 {
			return errors.New("downstream hiccup")
		}
		return nil
	}
	b.consumer(t, testenv.AMQPURL(), b.drv, flaky, func(c *messaging.SubscriptionConfig) { c.Retries = 2 })
	msg := newMessage(t, 1)
	b.publishRaw(t, publishing(msg))
	testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) == 1 }, "message never handled")
	testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == 0 }, "queue not empty")
	// 2 tries in place, back to the queue, redelivered, failed once more, then handled. The
	// line's attempts tell 2 tries in place from 3, which would also end in 4 calls.
	if lines := b.logs.Lines("returning message to the queue", "message_id="+msg.ID.String(), "attempts=2"); len(lines) != 1 {
		t.Fatalf("want the message returned to the queue once, after 2 attempts: got %d such lines in %q", len(lines),
			b.logs.Lines("returning message to the queue"))
	}
	if c := calls.Load(); c != 4 {
		t.Fatalf("handler ran %d times, want 4", c)
	}
	if n := testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(b.queue)); n != 0 {
		t.Fatalf("dead-letter queue holds %d, want 0", n)
	}
}

func TestConsumerDeadLettersPoisonAndCarriesOn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, func(c *messaging.SubscriptionConfig) { c.Concurrency = 1 })
	id := func() string { return uuid.NewString() }
	// Each poison message, and what its dead-letter reason says.
	poison := map[string]struct {
		p      amqp.Publishing
		reason string
	}{
		"not json":      {amqp.Publishing{MessageId: id(), ContentType: "application/json", Body: []byte("<xml/>")}, "body is not valid JSON"},
		"no message id": {amqp.Publishing{ContentType: "application/json", Body: []byte(`{"order_id":"` + id() + `"}`)}, `invalid message_id ""`},
		"bad id":        {amqp.Publishing{MessageId: "42", ContentType: "application/json", Body: []byte(`{}`)}, `invalid message_id "42"`},
		"wrong shape":   {amqp.Publishing{MessageId: id(), ContentType: "application/json", Body: []byte(`{"order_id":12,"n":"x"}`)}, "decode OrderPlaced payload"},
		"missing field": {amqp.Publishing{MessageId: id(), ContentType: "application/json", Body: []byte(`{"n":1}`)}, "payload has no order_id"},
		"not JSON type": {amqp.Publishing{MessageId: id(), ContentType: "text/plain", Body: []byte(`{}`)}, `content type "text/plain" is not application/json`},
		"huge":          {amqp.Publishing{MessageId: id(), ContentType: "application/json", Body: []byte(`"` + strings.Repeat("x", 2<<20) + `"`)}, "exceeds the limit"},
	}
	for _, p := range poison {
		p.p.Type = eventType
		b.publishRaw(t, p.p)
	}
	good := newMessage(t, 1)
	b.publishRaw(t, publishing(good))

	dlq := messaging.DeadLetterQueue(b.queue)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == len(poison) },
		"dead-letter queue does not hold the %d poison messages", len(poison))
	testenv.Eventually(t, 5*time.Second, func() bool { return b.workDone(t) == 1 }, "the good message behind the poison was not handled")
	if n := testenv.QueueDepth(t, b.ch, b.queue); n != 0 {
		t.Fatalf("queue still holds %d", n)
	}
	// Each is logged once the broker confirmed its copy, which the queue may show a moment before.
	testenv.Eventually(t, 5*time.Second, func() bool {
		return len(b.logs.Lines("level=ERROR", "message dead-lettered", "reason=")) >= len(poison)
	}, "not every poison message was logged as dead-lettered")
	if lines := b.logs.Lines("level=ERROR", "message dead-lettered", "reason="); len(lines) != len(poison) {
		t.Fatalf("%d dead-letter lines with a reason, want %d", len(lines), len(poison))
	}
	if c := testenv.Count(t, b.db.DB, "SELECT count(*) FROM inbox_messages"); c != 1 {
		t.Fatalf("inbox holds %d rows, want only the good message", c)
	}
	reasons := reasonsByID(deadLetters(t, b.ch, b.queue))
	for name, p := range poison {
		if !strings.Contains(reasons[p.p.MessageId], p.reason) {
			t.Errorf("%s: dead-letter reason %q does not contain %q", name, reasons[p.p.MessageId], p.reason)
		}
	}
}

// The database going away is not the message's fault: the consumer waits for it, without
// sending the message back to the queue or to the dead-letter queue, whether the database
// refuses connections or swallows traffic. Meanwhile it still notices a lost broker connection.
func TestConsumerWaitsOutADatabaseOutageWithoutDeadLettering(t *testing.T) {
	t.Parallel()
	outages := map[string]struct {
		begin, end func(t *testing.T, p *toxiproxy.Proxy)
	}{
		"refused": {
			begin: func(_ *testing.T, p *toxiproxy.Proxy) { p.Stop() },
			end: func(t *testing.T, p *toxiproxy.Proxy) {
				if err := p.Start(); err != nil {
					t.Fatal(err)
				}
			},
		},
		"swallowed": {
			begin: func(t *testing.T, p *toxiproxy.Proxy) {
				if _, err := p.Toxics.AddToxicJson(strings.NewReader(`{"name":"blackhole","type":"timeout","attributes":{"timeout":0}}`)); err != nil {
					t.Fatal(err)
				}
			},
			end: func(t *testing.T, p *toxiproxy.Proxy) {
				if err := p.Toxics.RemoveToxic(context.Background(), "blackhole"); err != nil {
					t.Fatal(err)
				}
			},
		},
	}
	for name, outage := range outages {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setupWith(t, 4) // a pool through the proxy
			b.createWorkTable(t)
			proxy := testenv.Proxy(t, "127.0.0.1:5432")
			viaProxy := testenv.OpenPool(t, strings.Replace(b.db.URL, "127.0.0.1:5432", proxy.Listen, 1), 4)
			b.consumer(t, testenv.AMQPURL(), driverOf(t, viaProxy), workFunc, func(c *messaging.SubscriptionConfig) {
				c.Retries, c.HandlerTimeout = 2, 500*time.Millisecond
			})

			outage.begin(t, proxy)
			msg := newMessage(t, 1)
			b.publishRaw(t, publishing(msg))
			testenv.Eventually(t, 20*time.Second, func() bool { return len(b.logs.Lines("dependency unavailable", msg.ID.String())) >= 3 },
				"consumer did not report the database outage")

			// The broker drops the consumer while it waits: it must reconnect rather than hold
			// on to a delivery it can no longer acknowledge.
			if n := testenv.CloseConnectionsNamed(t, b.queue); n != 1 { // a subscription's connection has its name
				t.Fatalf("closed %d consumer connections, want 1", n)
			}
			testenv.Eventually(t, 20*time.Second, func() bool { return len(b.logs.Lines("consumer started")) >= 2 },
				"consumer did not reconnect while the database was down")

			outage.end(t, proxy)
			testenv.Eventually(t, 30*time.Second, func() bool { return b.workDone(t) == 1 }, "message not handled after the database came back")
			if n := len(b.logs.Lines("returning message to the queue")); n != 0 {
				t.Fatalf("message went back to the queue %d times during a database outage", n)
			}
			if n := testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(b.queue)); n != 0 {
				t.Fatalf("dead-letter queue holds %d", n)
			}
		})
	}
}

// A message that fails on every delivery is dead-lettered by the consumer on its last allowed
// delivery, not left to the broker's limit (which RabbitMQ 4.3+ no longer counts on requeue).
func TestConsumerDeadLettersAMessageThatFailsOnEveryDelivery(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	broken := func(context.Context, *gorm.DB, payload, messaging.Message) error { return errors.New("always fails") }
	b.consumer(t, testenv.AMQPURL(), b.drv, broken, func(c *messaging.SubscriptionConfig) { c.Retries, c.DeliveryLimit = 1, 3 })
	msg := newMessage(t, 1)
	b.publishRaw(t, publishing(msg))
	// Logged once the broker confirmed the copy, which the queue may show a moment before.
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(b.queue)) == 1 && len(b.logs.Lines("message dead-lettered")) > 0
	}, "message not dead-lettered")
	// The queue's own limit is 20: the third delivery was dead-lettered by the consumer, not by
	// the broker, and the two before it were returned to the queue.
	settled := `consumer_messages_total{outcome="%s",queue="` + b.queue + `"} %d`
	for outcome, n := range map[string]int{"requeued": 2, "dead_lettered": 1} {
		if !hasMetric(t, b.registry, fmt.Sprintf(settled, outcome, n)) {
			t.Errorf("want %s", fmt.Sprintf(settled, outcome, n))
		}
	}
	got := deadLetters(t, b.ch, b.queue)
	if len(got) != 1 || got[0].MessageId != msg.ID.String() {
		t.Fatalf("dead-letter queue held %d messages, want the failing one", len(got))
	}
	wantReason(t, got[0], "failed on each of 3 deliveries, last: always fails")
}

// Shutdown must finish within its grace period even when the broker connection went silent.
func TestConsumerStopsWithinItsGraceOnASilentConnection(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	c, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{
		Name: b.queue, URL: testenv.AMQPURLVia(t, proxy.Listen), Topology: b.topology, ShutdownGrace: time.Second, Logger: b.log,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := messaging.Handle(c, b.orderPlaced(), workFunc); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	testenv.Eventually(t, 10*time.Second, c.Ready, "consumer not ready")
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"blackhole","type":"timeout","attributes":{"timeout":0}}`)); err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run = %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("consumer still running 5 s after cancel with a 1 s grace period")
	}
}

// The broker closes both connections; the publisher and the consumer come back by themselves.
func TestPublisherAndConsumerReconnectAfterTheBrokerClosesTheirConnections(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	c := b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	publisherConn := testenv.UniqueName("publisher")
	pub := b.publisher(t, testenv.AMQPURL(), func(c *messaging.PublisherConfig) { c.ConnectionName = publisherConn })
	publish := func(i int) {
		t.Helper()
		msg := newMessage(t, i)
		msg.Exchange = b.exchange
		errs := pub.Publish(context.Background(), []messaging.Message{msg})
		if errs[0] != nil {
			t.Fatalf("publish %d: %v", i, errs[0])
		}
	}
	publish(1)
	testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) == 1 }, "first message not handled")

	closed := testenv.CloseConnectionsNamed(t, b.queue) // a subscription's connection has its name
	closed += testenv.CloseConnectionsNamed(t, publisherConn)
	if closed < 2 {
		t.Fatalf("closed %d connections, want the consumer's and the publisher's", closed)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return len(b.logs.Lines("consumer disconnected; reconnecting")) > 0 },
		"consumer did not notice")
	testenv.Eventually(t, 10*time.Second, c.Ready, "consumer did not reconnect")

	// The publisher's first call after the close may fail (it learns of the close then), with
	// ErrBrokerUnavailable: no verdict on the message. It must succeed again without outside help.
	testenv.Eventually(t, 10*time.Second, func() bool {
		msg := newMessage(t, 2)
		msg.Exchange = b.exchange
		return pub.Publish(context.Background(), []messaging.Message{msg})[0] == nil
	}, "publisher did not reconnect")
	testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) >= 2 }, "message after reconnect not handled")
}

func TestAfterCommitRunsOnlyForCommittedWork(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	var fail atomic.Bool
	var mu sync.Mutex
	var ran []string
	in := b.inbox(t, b.drv, b.queue, func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		failing := fail.Load()
		if err := messaging.AfterCommit(ctx, func() {
			mu.Lock()
			defer mu.Unlock()
			ran = append(ran, fmt.Sprint("fail=", failing))
		}); err != nil {
			t.Errorf("AfterCommit refused the handler's context: %v", err)
			return err
		}
		if failing {
			return errors.New("roll back")
		}
		return doWork(tx, p, msg)
	})
	msg := newMessage(t, 1)
	fail.Store(true)
	_, _ = deliver(in, msg)
	fail.Store(false)
	if _, err := deliver(in, msg); err != nil {
		t.Fatal(err)
	}
	if dup, _ := deliver(in, msg); !dup {
		t.Fatal("third delivery is not a duplicate")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(ran) != 1 || ran[0] != "fail=false" {
		t.Fatalf("hooks ran %v, want only the committed delivery's", ran)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error {
		if err := messaging.AfterCommit(tx.Statement.Context, func() {}); !errors.Is(err, messaging.ErrNotInInbox) {
			t.Errorf("AfterCommit in a transaction that is not a handler's: %v, want ErrNotInInbox", err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// A hook that panics runs after the commit: the panic is logged, the message counts as handled,
// the other hooks still run, and the process lives on.
func TestAfterCommitHookPanicIsLoggedAndContained(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	var after atomic.Bool
	in := b.inbox(t, b.drv, b.queue, func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		if err := messaging.AfterCommit(ctx, func() { panic("hook boom") }); err != nil {
			return err
		}
		if err := messaging.AfterCommit(ctx, func() { after.Store(true) }); err != nil {
			return err
		}
		return doWork(tx, p, msg)
	})
	msg := newMessage(t, 1)
	if dup, err := deliver(in, msg); dup || err != nil {
		t.Fatalf("deliver = %v, %v; want handled", dup, err)
	}
	if !after.Load() {
		t.Error("the hook after the panicking one did not run")
	}
	if n := b.workDone(t); n != 1 {
		t.Errorf("work rows = %d, want 1", n)
	}
	if lines := b.logs.Lines("level=ERROR", `msg="after-commit hook panicked"`, "panic=\"hook boom\"", "stack="); len(lines) != 1 {
		t.Errorf("want the panic logged once with its stack, got %q", b.logs.Lines("after-commit hook panicked"))
	}
}

// Batching: many waiting messages are handled in shared transactions; duplicates (even two
// copies in one batch) are still skipped, and a message whose work fails permanently sends its
// batch back to one-by-one handling, where only that message is dead-lettered.
func TestConsumerBatchesWaitingMessages(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	bad := newMessage(t, -1)
	work := func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		if msg.ID == bad.ID {
			return messaging.Permanent(errors.New("this one can never be invoiced"))
		}
		if err := tx.Exec("INSERT INTO batches (message_id, txid) VALUES (?, txid_current())", msg.ID).Error; err != nil {
			return err
		}
		return doWork(tx, p, msg)
	}
	// The transaction each committed message's work ran in: the batching must be seen to happen.
	if err := b.db.DB.Exec("CREATE TABLE batches (message_id uuid NOT NULL, txid bigint NOT NULL)").Error; err != nil {
		t.Fatal(err)
	}
	// Everything waits in the queue before the consumer starts, so batches fill up.
	const n = 300
	msgs := make([]messaging.Message, n)
	for i := range msgs {
		msgs[i] = newMessage(t, i)
		b.publishRaw(t, publishing(msgs[i]))
		if i%10 == 0 {
			b.publishRaw(t, publishing(msgs[i]))
		}
		if i == n/2 {
			b.publishRaw(t, publishing(bad))
			b.publishRaw(t, amqp.Publishing{MessageId: "poison", Body: []byte("x")})
		}
	}
	b.consumer(t, testenv.AMQPURL(), b.drv, work, func(c *messaging.SubscriptionConfig) { c.Concurrency, c.BatchSize = 2, 20 })

	testenv.Eventually(t, 30*time.Second, func() bool {
		return b.workDone(t) == n && testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(b.queue)) == 2
	}, "not every message was settled")
	acked := fmt.Sprintf(`consumer_messages_total{outcome="acked",queue="%s"} %d`, b.queue, n+n/10)
	testenv.Eventually(t, 10*time.Second, func() bool { return hasMetric(t, b.registry, acked) }, "not every good delivery was acknowledged")
	if d := testenv.Count(t, b.db.DB, "SELECT count(*) FROM (SELECT message_id FROM work_items GROUP BY message_id HAVING count(*) > 1) d"); d != 0 {
		t.Fatalf("%d messages were worked twice", d)
	}
	if got := len(b.logs.Lines("duplicate message skipped")); got != n/10 {
		t.Fatalf("%d duplicate lines, want %d", got, n/10)
	}
	// Hundreds wait: the consumer holds as many as its prefetch allows, and its batches fill (a
	// batch of 20 deliveries holds a duplicate or two, which run no handler).
	if got := testenv.Count(t, b.db.DB, "SELECT coalesce(max(c), 0) FROM (SELECT count(*) c FROM batches GROUP BY txid) t"); got < 15 {
		t.Fatalf("the largest batch committed handled %d message(s), want a batch of 20 nearly full: hundreds were waiting", got)
	}
	reasons := reasonsByID(deadLetters(t, b.ch, b.queue))
	if r := reasons[bad.ID.String()]; !strings.Contains(r, "this one can never be invoiced") {
		t.Errorf("the permanently failing message's dead-letter reason is %q", r)
	}
	if r := reasons["poison"]; !strings.Contains(r, `invalid message_id "poison"`) {
		t.Errorf("the undecodable message's dead-letter reason is %q", r)
	}
}

// A batch whose work committed is acknowledged whole: the one basic.ack (multiple) that settles
// it covers every one of its deliveries, so none comes back to the queue when the consumer stops.
// The messages wait in the queue before the subscription starts, so batches form. (The broker's
// own count of unacknowledged deliveries is refreshed only every few seconds: the queue after
// the consumer's connection closed is what tells.)
func TestConsumerAcknowledgesEveryMessageOfACommittedBatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	if err := b.db.DB.Exec("CREATE TABLE batches (message_id uuid NOT NULL, txid bigint NOT NULL)").Error; err != nil {
		t.Fatal(err)
	}
	work := func(_ context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		if err := tx.Exec("INSERT INTO batches (message_id, txid) VALUES (?, txid_current())", msg.ID).Error; err != nil {
			return err
		}
		return doWork(tx, p, msg)
	}
	const n = 30
	for i := range n {
		b.publishRaw(t, publishing(newMessage(t, i)))
	}
	s, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{
		Name: b.queue, URL: testenv.AMQPURL(), Topology: b.topology, Concurrency: 1, Logger: b.log, Metrics: b.metrics,
	})
	if err != nil {
		t.Fatal(err)
	}
	must(t, messaging.Handle(s, b.orderPlaced(), work))
	stop := start(t, s.Run)
	testenv.Eventually(t, 20*time.Second, func() bool { return b.workDone(t) == n }, "not every message was handled")
	if got := testenv.Count(t, b.db.DB, "SELECT coalesce(max(c), 0) FROM (SELECT count(*) c FROM batches GROUP BY txid) t"); got < 2 {
		t.Fatalf("every message had a transaction of its own: no batch formed, nothing to check")
	}
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if back := testenv.Drain(t, b.ch, b.queue, 500*time.Millisecond); len(back) != 0 {
		t.Fatalf("%d of the %d handled messages came back to the queue when the consumer stopped: their batch's work committed, but they were never acknowledged", len(back), n)
	}
}

// A batch is all or nothing: one failing message rolls back every claim, every piece of work
// and every after-commit hook of its batch; the consumer then handles its messages one by one,
// and each good one is worked, and hooked, once.
func TestConsumerBatchIsAllOrNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	const n = 40
	msgs := make([]messaging.Message, n)
	for i := range msgs {
		msgs[i] = newMessage(t, i)
	}
	// The failing message is the first whose handler runs after another's in one transaction:
	// where the batches begin depends on how fast the client hands deliveries over, and a
	// message that begins its batch would fail it before any other work to roll back.
	var bad uuid.UUID
	var lastTx int64
	var mu sync.Mutex
	calls := map[uuid.UUID][]int64{} // the transactions each message's handler ran in
	hooks := map[uuid.UUID]int{}
	queue := testenv.Channel(t) // the handler's own, to look at the queue
	var held atomic.Bool
	work := func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		if held.CompareAndSwap(false, true) {
			// The first transaction waits (up to 5 s) until the broker has sent every other
			// message: they are all in the consumer then, and the next batch takes them.
			for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				if q, err := queue.QueueDeclarePassive(b.queue, true, false, false, false, nil); err != nil || q.Messages == 0 {
					break
				}
			}
		}
		var txid int64
		if err := tx.Raw("SELECT txid_current()").Scan(&txid).Error; err != nil {
			return err
		}
		mu.Lock()
		calls[msg.ID] = append(calls[msg.ID], txid)
		if bad == uuid.Nil && txid == lastTx {
			bad = msg.ID
		}
		lastTx = txid
		fails := msg.ID == bad
		mu.Unlock()
		if err := messaging.AfterCommit(ctx, func() {
			mu.Lock()
			defer mu.Unlock()
			hooks[msg.ID]++
		}); err != nil {
			return err
		}
		if err := doWork(tx, p, msg); err != nil {
			return err
		}
		if fails {
			return messaging.Permanent(errors.New("fails after its work"))
		}
		return nil
	}
	// They wait in the queue before the consumer starts, so the failing message is in a batch.
	for _, m := range msgs {
		b.publishRaw(t, publishing(m))
	}
	b.consumer(t, testenv.AMQPURL(), b.drv, work, func(c *messaging.SubscriptionConfig) { c.Concurrency, c.BatchSize = 1, n })
	testenv.Eventually(t, 20*time.Second, func() bool {
		return b.workDone(t) == n-1 && testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(b.queue)) == 1 &&
			testenv.QueueDepth(t, b.ch, b.queue) == 0
	}, "want the %d good messages worked and the failing one dead-lettered", n-1)

	mu.Lock()
	defer mu.Unlock()
	var inFailedBatch int // good messages whose handler ran in the failed batch's transaction
	for _, txid := range calls[bad] {
		for _, m := range msgs {
			if m.ID != bad && slices.Contains(calls[m.ID], txid) {
				inFailedBatch++
			}
		}
	}
	if inFailedBatch == 0 {
		t.Fatalf("the failing message was never in a batch with others: nothing to check (handler calls %v)", calls[bad])
	}
	for _, m := range msgs {
		want := 1
		if m.ID == bad {
			want = 0
		}
		if hooks[m.ID] != want {
			t.Errorf("message %s: %d after-commit hooks ran, want %d (handler ran in transactions %v)", m.ID, hooks[m.ID], want, calls[m.ID])
		}
	}
	if d := testenv.Count(t, b.db.DB, "SELECT count(*) FROM (SELECT message_id FROM work_items GROUP BY message_id HAVING count(*) > 1) d"); d != 0 {
		t.Fatalf("%d messages were worked twice: the failed batch's work was committed", d)
	}
	if c := testenv.Count(t, b.db.DB, "SELECT count(*) FROM inbox_messages"); c != n-1 {
		t.Fatalf("%d inbox records, want the %d good messages': the failed batch's claims were committed", c, n-1)
	}
	if w := testenv.Count(t, b.db.DB, "SELECT count(*) FROM work_items WHERE message_id = ?", bad); w != 0 {
		t.Fatalf("the failing message's work was committed")
	}
	t.Logf("%d good messages shared the failed batch's transaction", inFailedBatch)
}

// Every transaction of the inbox is READ COMMITTED, whatever the database's default: on a
// database whose default isolation is SERIALIZABLE, concurrent duplicates must still be told
// apart without errors.
func TestInboxUsesReadCommittedWhateverTheDatabaseDefault(t *testing.T) {
	t.Parallel()
	b := setupWith(t, 10) // a second pool, opened after the setting
	b.createWorkTable(t)
	if err := b.db.DB.Exec("ALTER DATABASE " + b.db.Name + " SET default_transaction_isolation = 'serializable'").Error; err != nil {
		t.Fatal(err)
	}
	// The setting applies to sessions that start after it: a new pool.
	db := testenv.OpenPool(t, b.db.URL, 10)
	isolation := func(tx *gorm.DB) string {
		var level string
		if err := tx.Raw("SHOW transaction_isolation").Scan(&level).Error; err != nil {
			t.Error(err)
		}
		return level
	}
	_ = db.Transaction(func(tx *gorm.DB) error {
		if got := isolation(tx); got != "serializable" {
			t.Fatalf("a plain transaction runs at %q, want the database's default, serializable", got)
		}
		return nil
	})

	var levels sync.Map
	in := b.inbox(t, driverOf(t, db), b.queue, func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		levels.Store(isolation(tx), true)
		time.Sleep(10 * time.Millisecond) // widen the window in which the others arrive
		return doWork(tx, p, msg)
	})
	msgs := []messaging.Message{newMessage(t, 1), newMessage(t, 2)}
	const deliveries = 10
	var wg sync.WaitGroup
	var dups, errs atomic.Int32
	start := make(chan struct{})
	for i := range 2 * deliveries {
		wg.Go(func() {
			<-start
			dup, err := deliver(in, msgs[i%2])
			if err != nil {
				t.Errorf("Deliver: %v", err)
				errs.Add(1)
			}
			if dup {
				dups.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	if errs.Load() != 0 || dups.Load() != 2*(deliveries-1) || b.workDone(t) != 2 {
		t.Fatalf("errors=%d duplicates=%d work=%d, want 0, %d, 2", errs.Load(), dups.Load(), b.workDone(t), 2*(deliveries-1))
	}
	for _, m := range msgs {
		if n := len(b.duplicateLines(m.ID)); n != deliveries-1 {
			t.Fatalf("%d duplicate log lines for message %s, want %d", n, m.ID, deliveries-1)
		}
	}
	levels.Range(func(level, _ any) bool {
		if level != "read committed" {
			t.Errorf("inbox work ran at %q, want read committed", level)
		}
		return true
	})
}
