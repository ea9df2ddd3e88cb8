package test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
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
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/messagingtest"
)

// Two events on one queue, from two exchanges, as the subscription tests use them.
type (
	placed struct {
		OrderID uuid.UUID `json:"order_id"`
		N       int       `json:"n"`
	}
	cancelled struct {
		OrderID uuid.UUID `json:"order_id"`
	}
)

type subscriptionBundle struct {
	*testBundle
	other   string // a second exchange
	name    string // the subscription's consumer and queue
	placed  messaging.Event[placed]
	cancels messaging.Event[cancelled]
}

func setupSubscription(t *testing.T) *subscriptionBundle {
	t.Helper()
	b := &subscriptionBundle{testBundle: setup(t), other: testenv.UniqueName("invoicing"), name: testenv.UniqueName("sub")}
	testenv.CleanupBroker(t, []string{b.name, messaging.DeadLetterQueue(b.name)}, []string{b.other})
	b.placed = messaging.Event[placed]{Exchange: b.exchange, Type: "Placed", Validate: func(p placed) error {
		if p.OrderID == uuid.Nil {
			return errors.New("no order_id")
		}
		return nil
	}}
	b.cancels = messaging.Event[cancelled]{Exchange: b.other, Type: "Cancelled"}
	if err := b.db.DB.Exec("CREATE TABLE handled (message_id uuid NOT NULL, type text NOT NULL, txid bigint NOT NULL)").Error; err != nil {
		t.Fatal(err)
	}
	return b
}

// noDeadLetters fails t if b's dead-letter queue holds any message; when, if not empty, says
// at which point of the test.
func (b *subscriptionBundle) noDeadLetters(t *testing.T, ch *amqp.Channel, when string) {
	t.Helper()
	if n := testenv.QueueDepth(t, ch, messaging.DeadLetterQueue(b.name)); n != 0 {
		t.Fatalf("%d messages dead-lettered%s, want none", n, strings.TrimRight(" "+when, " "))
	}
}

func (b *subscriptionBundle) subscription(t *testing.T, tweak func(*messaging.SubscriptionConfig)) *messaging.Subscription[*gorm.DB] {
	t.Helper()
	cfg := messaging.SubscriptionConfig{Name: b.name, URL: testenv.AMQPURL(), Concurrency: 2, Logger: b.log, Metrics: b.metrics}
	if tweak != nil {
		tweak(&cfg)
	}
	s, err := messaging.NewSubscription(b.drv, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// record is a handler's work: one row per message, with the transaction it ran in.
func record(tx *gorm.DB, msg messaging.Message) error {
	return tx.Exec("INSERT INTO handled (message_id, type, txid) VALUES (?, ?, txid_current())", msg.ID, msg.Type).Error
}

func (b *subscriptionBundle) publish(t *testing.T, exchange string, msg messaging.Message) {
	t.Helper()
	if err := b.ch.PublishWithContext(context.Background(), exchange, msg.Type, true, false, publishing(msg)); err != nil {
		t.Fatal(err)
	}
}

func (b *subscriptionBundle) handled(t *testing.T, query string) int64 {
	t.Helper()
	return testenv.Count(t, b.db.DB, query)
}

// One queue carries two event types from two exchanges, each to its typed handler, in batches
// that share one transaction; a redelivered message is worked once.
func TestSubscriptionRoutesTwoTypesFromTwoExchangesInBatches(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, nil)
	var mu sync.Mutex
	got := map[string]int{}
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		mu.Lock()
		got["placed"]++
		mu.Unlock()
		return record(tx, msg)
	}))
	must(t, messaging.Handle(s, b.cancels, func(ctx context.Context, tx *gorm.DB, c cancelled, msg messaging.Message) error {
		mu.Lock()
		got["cancelled"]++
		mu.Unlock()
		return record(tx, msg)
	}))
	ch := testenv.Channel(t)
	declareSubscription(t, s)
	// The messages wait before the subscription starts, so batches form.
	const n = 200
	var first messaging.Message
	for i := range n {
		p, err := b.placed.Message(placed{OrderID: uuid.New(), N: i})
		if err != nil {
			t.Fatal(err)
		}
		c, err := b.cancels.Message(cancelled{OrderID: uuid.New()})
		if err != nil {
			t.Fatal(err)
		}
		b.publish(t, b.exchange, p)
		b.publish(t, b.other, c)
		if i == 0 {
			first = p
		}
	}
	b.publish(t, b.exchange, first) // a redelivery
	run(t, s.Run)

	testenv.Eventually(t, 30*time.Second, func() bool {
		return b.handled(t, "SELECT count(*) FROM handled") == 2*n && testenv.QueueDepth(t, ch, b.name) == 0
	}, "not every message was handled")
	if dup := b.handled(t, "SELECT count(*) FROM (SELECT message_id FROM handled GROUP BY message_id HAVING count(*) > 1) d"); dup != 0 {
		t.Fatalf("%d messages were worked twice", dup)
	}
	if b.handled(t, "SELECT count(*) FROM handled WHERE type = 'Placed'") != n || b.handled(t, "SELECT count(*) FROM handled WHERE type = 'Cancelled'") != n {
		t.Fatal("a type went to the wrong handler")
	}
	biggest := b.handled(t, "SELECT coalesce(max(c), 0) FROM (SELECT count(*) c FROM handled GROUP BY txid) t")
	if biggest < 2 {
		t.Fatalf("every message had a transaction of its own: no batch formed")
	}
	t.Logf("largest batch: %d messages in one transaction", biggest)
	b.noDeadLetters(t, ch, "")
	wantMetric(t, b.registry, `inbox_duplicates_total{consumer="`+b.name+`"} 1`)
}

// An inbox the database cannot find (MigrateInbox not run yet), or that the role may not write,
// is the deployment's fault: the messages wait, each retried as for a dependency unavailable,
// instead of spending their deliveries to the dead-letter queue; once the table is there, they
// are handled.
func TestAnInboxTheDatabaseCannotFindIsAnOutage(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) {
		c.DeliveryLimit, c.Retries = 2, 1
		c.RetryBackoff = messaging.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond}
	})
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		return record(tx, msg)
	}))
	ch := testenv.Channel(t)
	declareSubscription(t, s)
	if err := b.db.DB.Exec("ALTER TABLE inbox_messages RENAME TO inbox_messages_later").Error; err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		m, err := b.placed.Message(placed{OrderID: uuid.New(), N: i})
		if err != nil {
			t.Fatal(err)
		}
		b.publish(t, b.exchange, m)
	}
	run(t, s.Run)
	// Past a delivery limit of 2, with one try per delivery: a failure each would have
	// dead-lettered them by now.
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines(`msg="dependency unavailable; retrying message"`, "MigrateInbox")) >= 6
	}, "the missing inbox was not waited out as an outage")
	b.noDeadLetters(t, ch, "for the missing inbox")
	if err := b.db.DB.Exec("ALTER TABLE inbox_messages_later RENAME TO inbox_messages").Error; err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return b.handled(t, "SELECT count(*) FROM handled") == 3 },
		"the messages were not handled once the inbox was there")
	b.noDeadLetters(t, ch, "")
}

// An attempt that fails leaves nothing to the next: its transaction rolls back, and the payload
// it was given, which its handler may have changed (here through a pointer), is decoded again
// for the next attempt: a message tried alone after its batch failed, and one retried in place.
func TestAnAttemptAfterAFailureGetsThePayloadAsItCame(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) {
		c.Concurrency = 1
		c.RetryBackoff = messaging.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond}
	})
	if err := b.db.DB.Exec("CREATE TABLE counted (message_id uuid NOT NULL, n int NOT NULL)").Error; err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	failed := map[uuid.UUID]bool{}
	failOnce := map[uuid.UUID]bool{}
	ev := messaging.Event[*placed]{Exchange: b.exchange, Type: b.placed.Type}
	must(t, messaging.Handle(s, ev, func(ctx context.Context, tx *gorm.DB, p *placed, msg messaging.Message) error {
		p.N++
		if err := tx.Exec("INSERT INTO counted (message_id, n) VALUES (?, ?)", msg.ID, p.N).Error; err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if failOnce[msg.ID] && !failed[msg.ID] {
			failed[msg.ID] = true
			return errors.New("test: the first attempt fails")
		}
		return nil
	}))
	declareSubscription(t, s)
	send := func(fail bool) {
		m, err := ev.Message(&placed{OrderID: uuid.New()})
		if err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		failOnce[m.ID] = fail
		mu.Unlock()
		b.publish(t, b.exchange, m)
	}
	// Waiting before the subscription starts, so that they are tried as a batch first.
	for i := range 10 {
		send(i == 5)
	}
	run(t, s.Run)
	testenv.Eventually(t, 10*time.Second, func() bool { return b.handled(t, "SELECT count(*) FROM counted") == 10 }, "not every message was handled")
	send(true) // alone: retried in place
	testenv.Eventually(t, 10*time.Second, func() bool { return b.handled(t, "SELECT count(*) FROM counted") == 11 }, "the last message was not handled")
	if n := b.handled(t, "SELECT count(*) FROM counted WHERE n <> 1"); n != 0 {
		t.Fatalf("%d messages were handled with the payload a failed attempt had changed", n)
	}
	if n := b.handled(t, "SELECT count(DISTINCT message_id) FROM counted"); n != 11 {
		t.Fatalf("%d messages handled, want 11 once each", n)
	}
}

// A payload its event's checks refuse goes to the dead-letter queue at once, and a type nobody
// on the queue handles at its last allowed delivery, within seconds and without holding up the
// messages behind it, each with its reason logged; the messages around them are handled.
func TestSubscriptionDeadLettersUnknownTypesAndInvalidPayloads(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, nil)
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		return record(tx, msg)
	}))
	ch := testenv.Channel(t)
	declareSubscription(t, s)
	// Routed to the queue by hand: the subscription binds only what it handles.
	if err := ch.QueueBind(b.name, "Refunded", b.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	unknown, err := messaging.NewMessage("Refunded", map[string]string{"order_id": uuid.NewString()})
	if err != nil {
		t.Fatal(err)
	}
	invalid, err := messaging.NewMessage("Placed", map[string]int{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	const behind = 5
	msgs := []messaging.Message{unknown, invalid}
	for range behind {
		good, err := b.placed.Message(placed{OrderID: uuid.New()})
		must(t, err)
		msgs = append(msgs, good)
	}
	run(t, s.Run)
	testenv.Eventually(t, 10*time.Second, s.Ready, "subscription not ready")
	start := time.Now()
	for _, m := range msgs {
		b.publish(t, b.exchange, m)
	}
	// Each is logged once the broker confirmed its copy, which the queue may show a moment before.
	testenv.Eventually(t, 5*time.Second, func() bool {
		return testenv.QueueDepth(t, ch, messaging.DeadLetterQueue(b.name)) == 2 && b.handled(t, "SELECT count(*) FROM handled") == behind &&
			len(b.logs.Lines("message dead-lettered")) >= 2
	}, "want the unknown and the invalid message dead-lettered and the good ones handled, within 5 s")
	t.Logf("all settled %s after the first publish", time.Since(start).Round(time.Millisecond))
	if lines := b.logs.Lines("message dead-lettered", "message_id="+unknown.ID.String(), `on each of 20 deliveries: no handler for message type \"Refunded\"`); len(lines) != 1 {
		t.Errorf("want the unknown type dead-lettered once with its reason logged, got %d such lines of: %q", len(lines), b.logs.Lines("message dead-lettered"))
	}
	if lines := b.logs.Lines("message dead-lettered", "message_id="+invalid.ID.String(), "invalid Placed: no order_id"); len(lines) != 1 {
		t.Errorf("want the invalid payload dead-lettered once with its reason logged, got %d such lines of: %q", len(lines), b.logs.Lines("message dead-lettered"))
	}
	reasons := reasonsByID(deadLetters(t, ch, b.name))
	if n := len(b.logs.Lines("no handler here; returning message to the queue", "message_id="+unknown.ID.String())); n != 19 {
		t.Errorf("the unknown type went back to the queue %d times before its last delivery, want 19", n)
	}
	if r := reasons[unknown.ID.String()]; !strings.Contains(r, `on each of 20 deliveries: no handler for message type "Refunded"`) {
		t.Errorf("the unknown type's dead-letter reason is %q", r)
	}
	if r := reasons[invalid.ID.String()]; !strings.Contains(r, "invalid Placed: no order_id") {
		t.Errorf("the invalid payload's dead-letter reason is %q", r)
	}
}

// olderAndNewer are two replicas of b's subscription, not started: the older handles Placed,
// the newer Placed and Cancelled, the event its version adds.
func (b *subscriptionBundle) olderAndNewer(t *testing.T) (older, newer *messaging.Subscription[*gorm.DB]) {
	t.Helper()
	older, newer = b.subscription(t, nil), b.subscription(t, nil)
	work := func(ctx context.Context, tx *gorm.DB, _ placed, msg messaging.Message) error { return record(tx, msg) }
	must(t, messaging.Handle(older, b.placed, work))
	must(t, messaging.Handle(newer, b.placed, work))
	must(t, messaging.Handle(newer, b.cancels, func(ctx context.Context, tx *gorm.DB, _ cancelled, msg messaging.Message) error {
		return record(tx, msg)
	}))
	return older, newer
}

// In a rolling deploy that adds an event, the replicas of the older version share the queue
// with the newer ones, which bound it to the new event's exchange. A message of the new type
// that an older replica gets goes back to the queue, and a newer replica handles it: none is
// dead-lettered, none handled twice.
func TestSubscriptionLeavesATypeItHasNoHandlerForToAReplicaThatHas(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	older, newer := b.olderAndNewer(t)
	for _, s := range []*messaging.Subscription[*gorm.DB]{older, newer} {
		run(t, s.Run)
		testenv.Eventually(t, 10*time.Second, s.Ready, "subscription not ready")
	}
	const each = 20
	for range each {
		p, err := b.placed.Message(placed{OrderID: uuid.New()})
		must(t, err)
		c, err := b.cancels.Message(cancelled{OrderID: uuid.New()})
		must(t, err)
		b.publish(t, b.exchange, p)
		b.publish(t, b.other, c)
	}
	testenv.Eventually(t, 20*time.Second, func() bool { return b.handled(t, "SELECT count(*) FROM handled") == 2*each },
		"not every message was handled")
	if n := b.handled(t, "SELECT count(DISTINCT message_id) FROM handled WHERE type = 'Cancelled'"); n != each {
		t.Fatalf("%d distinct Cancelled handled, want %d", n, each)
	}
	if n := testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(b.name)); n != 0 {
		t.Fatalf("%d messages dead-lettered", n)
	}
	// Both replicas consume in turn: the older one got some of the new type, and gave them back.
	if n := len(b.logs.Lines("no handler here; returning message to the queue", `type=Cancelled`)); n == 0 {
		t.Fatal("the older replica was given no message of the new type: the test proves nothing")
	}
}

// A message handed back before with a nack (a replica that shut down holding it) is redelivered
// without x-delivery-count by RabbitMQ 4.3, which does not count a nack: a type without a
// handler is still given back for its deliveries, not dead-lettered as if its queue could not
// count them. (RabbitMQ 3.10 counts the nack: there the test passes either way.)
func TestSubscriptionGivesBackATypeItHasNoHandlerForAfterAHandBack(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	older, newer := b.olderAndNewer(t)
	declareSubscription(t, newer)
	c, err := b.cancels.Message(cancelled{OrderID: uuid.New()})
	must(t, err)
	b.publish(t, b.other, c)
	ch := testenv.Channel(t)
	var d amqp.Delivery
	testenv.Eventually(t, 5*time.Second, func() bool {
		var ok bool
		d, ok, err = ch.Get(b.name, false)
		must(t, err)
		return ok
	}, "the message did not reach the queue")
	must(t, d.Nack(false, true))

	run(t, older.Run)
	testenv.Eventually(t, 10*time.Second, func() bool { return len(b.logs.Lines("message dead-lettered", "message_id="+c.ID.String())) == 1 },
		"the message was not dead-lettered")
	if n := len(b.logs.Lines("no handler here; returning message to the queue", "message_id="+c.ID.String())); n < 18 {
		t.Errorf("given back %d times before it was dead-lettered, want 18 or more", n)
	}
	if r := reasonsByID(deadLetters(t, ch, b.name))[c.ID.String()]; !strings.Contains(r, `on each of 20 deliveries: no handler for message type "Cancelled"`) {
		t.Errorf("dead-lettered with the reason %q", r)
	}
}

// A handler that panics fails that message only: its transaction rolls back, the process and
// the other messages carry on, and the message is dead-lettered at its delivery limit.
func TestSubscriptionSurvivesAPanickingHandler(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) { c.DeliveryLimit = 2 })
	var bomb uuid.UUID
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		if err := record(tx, msg); err != nil {
			return err
		}
		if p.OrderID == bomb {
			panic("boom")
		}
		return nil
	}))
	bomb = uuid.New()
	ch := testenv.Channel(t)
	declareSubscription(t, s)
	for i := range 10 {
		order := uuid.New()
		if i == 4 {
			order = bomb
		}
		m, err := b.placed.Message(placed{OrderID: order, N: i})
		if err != nil {
			t.Fatal(err)
		}
		b.publish(t, b.exchange, m)
	}
	run(t, s.Run)
	testenv.Eventually(t, 30*time.Second, func() bool {
		return testenv.QueueDepth(t, ch, messaging.DeadLetterQueue(b.name)) == 1 && b.handled(t, "SELECT count(*) FROM handled") == 9
	}, "want 9 messages handled and the panicking one dead-lettered")
	if lines := b.logs.Lines("level=ERROR", `msg="handler panicked"`, "panic=boom", "stack="); len(lines) == 0 {
		t.Error("the panic was not logged with its stack")
	}
	if n := metricValue(t, b.registry, "consumer_handler_seconds", map[string]string{"consumer": b.name, "outcome": "error", "type": "Placed"}); n == 0 {
		t.Error("the panic was not counted as an error")
	}
	got := deadLetters(t, ch, b.name)
	if len(got) != 1 {
		t.Fatalf("dead-letter queue held %d messages, want the panicking one", len(got))
	}
	wantReason(t, got[0], "failed on each of 2 deliveries, last: handler panicked: boom")
}

// A subscription given a topology dead-letters a failing message itself, with its reason, at
// its queue's x-delivery-limit, or at its own DeliveryLimit if that is set and smaller: past the
// queue's, the broker would dead-letter the message without the reason.
func TestSubscriptionDeadLettersWithinTheQueuesDeliveryLimit(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct{ queue, own, want int }{
		"own limit above the queue's default": {0, messaging.DefaultDeliveryLimit + 5, messaging.DefaultDeliveryLimit},
		"the queue's limit, none of its own":  {messaging.DefaultDeliveryLimit + 5, 0, messaging.DefaultDeliveryLimit + 5},
		"own limit below the queue's":         {4, 2, 2},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setupSubscription(t)
			topology := queueTopology(b.exchange, b.name, "Placed")
			topology.Queues[0].DeliveryLimit = c.queue
			s := b.subscription(t, func(cfg *messaging.SubscriptionConfig) {
				cfg.Topology, cfg.DeliveryLimit, cfg.Retries = topology, c.own, 1
				cfg.RetryBackoff = messaging.Backoff{Base: time.Millisecond, Max: time.Millisecond}
			})
			must(t, messaging.Handle(s, b.placed, func(context.Context, *gorm.DB, placed, messaging.Message) error {
				return errors.New("always fails")
			}))
			_, dead := b.deadLetterOne(t, s, 60*time.Second)
			wantReason(t, dead, fmt.Sprintf("failed on each of %d deliveries, last: always fails", c.want))
		})
	}
}

// runOnOne runs s on one Placed message, published once its queue is declared, and returns
// the message and a channel to look at the queues with.
func (b *subscriptionBundle) runOnOne(t *testing.T, s *messaging.Subscription[*gorm.DB]) (messaging.Message, *amqp.Channel) {
	t.Helper()
	ch := testenv.Channel(t)
	declareSubscription(t, s)
	m, err := b.placed.Message(placed{OrderID: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	b.publish(t, b.exchange, m)
	run(t, s.Run)
	return m, ch
}

// deadLetterOne runs s on one Placed message, which s must dead-letter within timeout, and
// returns the message and its dead letter.
func (b *subscriptionBundle) deadLetterOne(t *testing.T, s *messaging.Subscription[*gorm.DB], timeout time.Duration) (messaging.Message, amqp.Delivery) {
	t.Helper()
	m, ch := b.runOnOne(t, s)
	testenv.Eventually(t, timeout, func() bool { return testenv.QueueDepth(t, ch, messaging.DeadLetterQueue(b.name)) == 1 },
		"the message was not dead-lettered")
	got := deadLetters(t, ch, b.name)
	if len(got) != 1 || got[0].MessageId != m.ID.String() {
		t.Fatalf("dead-letter queue held %d messages, want message %s alone", len(got), m.ID)
	}
	return m, got[0]
}

// A database that refuses writes while SELECT 1 still answers (a read-only standby during a
// failover, a full disk) is an outage, not the message's fault: the message waits in place,
// spending none of its deliveries, and is handled once writes come back, even where the
// handler called the failure permanent, as a lookup that failed may. Counted against it, it
// would be dead-lettered within a second here (one try, two deliveries); taken for permanent,
// at once.
func TestDatabaseRefusingWritesIsAnOutageNotTheMessagesFault(t *testing.T) {
	t.Parallel()
	for _, permanent := range []bool{false, true} {
		t.Run(fmt.Sprintf("called permanent %v", permanent), func(t *testing.T) {
			t.Parallel()
			databaseRefusingWrites(t, permanent)
		})
	}
}

func databaseRefusingWrites(t *testing.T, permanent bool) {
	b := setupSubscription(t)
	// The handler's writes fail as on a read-only database, until the outage is over.
	if err := b.db.DB.Exec(`CREATE TABLE outage (on_now boolean NOT NULL);
INSERT INTO outage VALUES (true);
CREATE FUNCTION refuse_writes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF (SELECT on_now FROM outage) THEN
    RAISE EXCEPTION 'cannot execute INSERT in a read-only transaction' USING ERRCODE = 'read_only_sql_transaction';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER refuse_writes BEFORE INSERT ON handled FOR EACH ROW EXECUTE FUNCTION refuse_writes();`).Error; err != nil {
		t.Fatal(err)
	}
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) {
		c.Retries, c.DeliveryLimit = 1, 2
		c.RetryBackoff = messaging.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond}
	})
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		err := record(tx, msg)
		if err != nil && permanent {
			return messaging.Permanent(fmt.Errorf("record it: %w", err))
		}
		return err
	}))
	m, ch := b.runOnOne(t, s)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines("dependency unavailable; retrying message", "message_id="+m.ID.String(), "read-only")) >= 5
	}, "the refused writes were not taken for an outage")
	b.noDeadLetters(t, ch, "during the outage")
	if err := b.db.DB.Exec("UPDATE outage SET on_now = false").Error; err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return b.handled(t, "SELECT count(*) FROM handled") == 1 },
		"the message was not handled once writes came back")
	b.noDeadLetters(t, ch, "")
}

// A handler cut off by its timeout because the database went silent, which called its failed
// lookup permanent, has the message wait out the outage like any other, spending none of its
// deliveries: the handler could not know why its lookup failed. Taken for the handler's
// verdict, it would be retried as a failure and dead-lettered within two deliveries.
func TestAnAttemptCutOffByASilentDatabaseIsAnOutageWhateverTheHandlerCalledIt(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+2)
	b := setupSubscription(t)
	proxy := testenv.Proxy(t, testenv.DatabaseHost(t))
	drv, err := gormdriver.New(testenv.OpenPool(t, testenv.URLVia(t, b.db.URL, proxy.Listen), 2))
	if err != nil {
		t.Fatal(err)
	}
	s, err := messaging.NewSubscription(drv, messaging.SubscriptionConfig{Name: b.name, URL: testenv.AMQPURL(), Logger: b.log, Metrics: b.metrics,
		Concurrency: 1, Retries: 1, DeliveryLimit: 2, HandlerTimeout: 300 * time.Millisecond,
		RetryBackoff: messaging.Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	var silenced atomic.Bool
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, _ placed, msg messaging.Message) error {
		if silenced.CompareAndSwap(false, true) {
			if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"silence","type":"timeout","attributes":{"timeout":0}}`)); err != nil {
				return err
			}
		}
		if err := tx.WithContext(ctx).Exec("SELECT 1").Error; err != nil {
			return messaging.Permanent(fmt.Errorf("look the customer up: %w", err))
		}
		return record(tx, msg)
	}))
	m, ch := b.runOnOne(t, s)
	testenv.Eventually(t, 20*time.Second, func() bool {
		return len(b.logs.Lines("dependency unavailable; retrying message", "message_id="+m.ID.String())) >= 1
	}, "the silent database was not taken for an outage")
	// Before the database comes back: an attempt cut off after it would rightly be a failure.
	if lines := b.logs.Lines("handler failed", "message_id="+m.ID.String()); len(lines) != 0 {
		t.Fatalf("the outage was counted against the message: %q", lines)
	}
	b.noDeadLetters(t, ch, "during the outage")
	if err := proxy.Toxics.RemoveToxic(context.Background(), "silence"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 20*time.Second, func() bool { return b.handled(t, "SELECT count(*) FROM handled") == 1 },
		"the message was not handled once the database answered")
	b.noDeadLetters(t, ch, "")
}

// An attempt the timeout cut off is a failure to count and retry, even where the handler called
// its cut-off permanent: the next attempt, not stuck, handles the message.
func TestAnAttemptCutOffByTheTimeoutIsRetriedWhateverTheHandlerCalledIt(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) {
		c.HandlerTimeout, c.DeliveryLimit = 300*time.Millisecond, 2
		c.RetryBackoff = messaging.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond}
	})
	var attempts atomic.Int32
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		if attempts.Add(1) == 1 {
			<-ctx.Done()
			return messaging.Permanent(fmt.Errorf("look the customer up: %w", ctx.Err()))
		}
		return record(tx, msg)
	}))
	m, ch := b.runOnOne(t, s)
	testenv.Eventually(t, 10*time.Second, func() bool { return b.handled(t, "SELECT count(*) FROM handled") == 1 },
		"the message was not handled after its first attempt timed out")
	b.noDeadLetters(t, ch, "")
	if lines := b.logs.Lines("handler failed; retrying message", "message_id="+m.ID.String(), "timed out after 300ms"); len(lines) != 1 {
		t.Fatalf("want one retry, logged as timed out: %q", b.logs.Lines("handler failed"))
	}
}

// The per-message timeout cuts off a handler stuck in the database.
func TestSubscriptionTimesOutAStuckHandler(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) { c.HandlerTimeout = 500 * time.Millisecond; c.DeliveryLimit = 2 })
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		return tx.Exec("SELECT pg_sleep(30)").Error
	}))
	m, dead := b.deadLetterOne(t, s, 30*time.Second)
	if lines := b.logs.Lines("handler failed", "message_id="+m.ID.String(), "deadline exceeded"); len(lines) == 0 {
		t.Errorf("want the handler's failures logged as cut off by the timeout: %q", b.logs.Lines("handler failed"))
	}
	wantReason(t, dead, "deadline exceeded")
}

// A handler that ignores its context (blocked on a channel, as on a call without a timeout)
// is abandoned past its timeout: its worker goes on to the queue's other message, and its own
// message is not acknowledged but redelivered, as any whose attempts fail, then handed back at
// shutdown, which does not wait for it. The abandoned attempts' transactions are rolled back
// when their contexts end: once the handler returns, they commit nothing. Waited for, the
// handler held its worker for good, and Run never returned.
func TestAHandlerThatIgnoresItsContextIsAbandoned(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(unblock)
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) {
		c.Concurrency, c.BatchSize, c.HandlerTimeout, c.Retries, c.DeliveryLimit = 1, 1, 200*time.Millisecond, 1, 3
		c.RetryBackoff = messaging.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond}
	})
	stuck := messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()})
	other := messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()})
	var stuckAttempts, returned atomic.Int32
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, _ placed, msg messaging.Message) error {
		if err := record(tx, msg); err != nil {
			return err
		}
		if msg.ID == stuck.ID {
			stuckAttempts.Add(1)
			<-release // its context ignored
			returned.Add(1)
		}
		return nil
	}))
	ch := testenv.Channel(t)
	declareSubscription(t, s)
	b.publish(t, b.exchange, stuck)
	b.publish(t, b.exchange, other)
	stop := start(t, s.Run)

	testenv.Eventually(t, 30*time.Second, func() bool {
		return stuckAttempts.Load() == 2 && b.handled(t, "SELECT count(*) FROM handled WHERE message_id = '"+other.ID.String()+"'") == 1
	}, "the stuck message was not redelivered, or the other message not handled meanwhile")
	if lines := b.logs.Lines("level=ERROR", "handler did not return within its timeout; abandoning it", "message_id="+stuck.ID.String()); len(lines) != 1 {
		t.Fatalf("want the first delivery's attempt abandoned, logged once: %q", lines)
	}
	stopping := time.Now()
	if err := stop(); err != nil { // the second delivery's attempt stuck
		t.Fatalf("Run = %v", err)
	}
	t.Logf("Run returned %s after its cancellation", time.Since(stopping).Round(time.Millisecond))
	testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, ch, b.name) == 1 },
		"the stuck message is not back in the queue after the shutdown")
	b.noDeadLetters(t, ch, "")
	acked := `consumer_messages_total{outcome="acked",queue="` + b.name + `"} 1`
	if !hasMetric(t, b.registry, acked) {
		t.Fatalf("want only the other message acknowledged (%s)", acked)
	}

	// Let the abandoned attempts go on: each handler returns, and its attempt ends without a
	// commit (its outcome an error).
	unblock()
	failed := map[string]string{"consumer": b.name, "type": "Placed", "outcome": "error"}
	testenv.Eventually(t, 10*time.Second, func() bool {
		return returned.Load() == 2 && metricValue(t, b.registry, "consumer_handler_seconds", failed) == 2
	}, "the abandoned attempts did not end once their handlers returned")
	if n := b.handled(t, "SELECT count(*) FROM handled WHERE message_id = '"+stuck.ID.String()+"'"); n != 0 {
		t.Fatalf("an abandoned attempt committed the stuck message's work (%d rows)", n)
	}
	if n := b.handled(t, "SELECT count(*) FROM inbox_messages WHERE message_id = '"+stuck.ID.String()+"'"); n != 0 {
		t.Fatal("an abandoned attempt committed the stuck message's inbox claim")
	}
}

// A subscription given the system's topology starts only if that topology binds its queue to
// exactly the events it handles: a missing binding would lose events, an extra one
// dead-letter them. Start says which.
func TestSubscriptionRefusesATopologyThatDoesNotMatchItsHandlers(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	both := []messaging.Binding{b.placed.Binding(), b.cancels.Binding()}
	for _, c := range []struct {
		name     string
		bindings []messaging.Binding
		want     string
	}{
		{"matching", both, ""},
		{"missing a binding", both[:1], "does not bind queue"},
		{"an unhandled binding", append(both, messaging.Binding{Exchange: b.other, RoutingKey: "Refunded"}), "has no handler for"},
	} {
		s := b.subscription(t, func(cfg *messaging.SubscriptionConfig) {
			cfg.Topology = messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: b.name, Bindings: c.bindings}}}
		})
		must(t, messaging.Handle(s, b.placed, func(context.Context, *gorm.DB, placed, messaging.Message) error { return nil }))
		must(t, messaging.Handle(s, b.cancels, func(context.Context, *gorm.DB, cancelled, messaging.Message) error { return nil }))
		err := s.Start()
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: Start = %v, want %q", c.name, err, c.want)
		}
	}
}

// One handler per event type: a second registration for a type is refused, and changes
// nothing.
func TestSubscriptionRefusesASecondHandlerForAType(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, nil)
	var second bool
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, _ placed, msg messaging.Message) error {
		return record(tx, msg)
	}))
	err := messaging.Handle(s, b.placed, func(context.Context, *gorm.DB, placed, messaging.Message) error {
		second = true
		return nil
	})
	if !errors.Is(err, messaging.ErrHandlerRegistered) {
		t.Fatalf("a second handler for %s: %v, want ErrHandlerRegistered", b.placed.Type, err)
	}
	topology, err := s.Topology()
	if err != nil {
		t.Fatal(err)
	}
	if q, _ := topology.Queue(b.name); len(q.Bindings) != 1 {
		t.Fatalf("the queue is bound %d times, want once: the refused handler added a binding", len(q.Bindings))
	}
	msg, err := b.placed.Message(placed{OrderID: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	if dup, err := messagingtest.Deliver(context.Background(), s, msg); err != nil || dup {
		t.Fatalf("Deliver = %v, %v", dup, err)
	}
	if second || b.handled(t, "SELECT count(*) FROM handled") != 1 {
		t.Fatal("the message did not go to the first handler alone")
	}
}

// A permanent error dead-letters its message on the first try on the path a subscription takes
// by default, with batching: a batch it fails is handled message by message, and there it is
// handled once and dead-lettered, with the handler's reason as it was.
func TestSubscriptionDeadLettersAPermanentErrorOnTheFirstTry(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) { c.DeliveryLimit = 3 })
	const reason = "order belongs to no customer"
	refused := make(map[uuid.UUID]*atomic.Int32)
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		if n, ok := refused[msg.ID]; ok {
			n.Add(1)
			return messaging.Permanent(errors.New(reason))
		}
		return record(tx, msg)
	}))
	ch := testenv.Channel(t)
	declareSubscription(t, s)
	// The messages wait before the subscription starts, so batches form around the refused ones.
	const n, every = 200, 20
	var bad []messaging.Message
	for i := range n {
		m, err := b.placed.Message(placed{OrderID: uuid.New(), N: i})
		if err != nil {
			t.Fatal(err)
		}
		if i%every == every/2 {
			bad = append(bad, m)
			refused[m.ID] = new(atomic.Int32)
		}
		b.publish(t, b.exchange, m)
	}
	run(t, s.Run)
	testenv.Eventually(t, 30*time.Second, func() bool {
		return b.handled(t, "SELECT count(*) FROM handled") == int64(n-len(bad)) && len(b.logs.Lines("message dead-lettered")) >= len(bad)
	}, "want the good messages handled and the refused ones dead-lettered")
	reasons := reasonsByID(deadLetters(t, ch, b.name))
	inBatches := 0
	for _, m := range bad {
		id := m.ID.String()
		batches := len(b.logs.Lines("batch failed; processing its messages one by one", id))
		inBatches += batches
		wantDeadLetteredAtOnce(t, b.testBundle, id, int(refused[m.ID].Load()), batches+1, reasons, reason)
	}
	wantNothingRequeued(t, b.testBundle, b.name)
	t.Logf("%d of the %d refused messages were tried in a failed batch first", inBatches, len(bad))
}

// A message a handler enqueues wakes the relays when the handler's transaction commits, as
// one enqueued outside a handler does: with the relay's poll an hour away, only the NOTIFY of
// that commit can send it.
func TestHandlerEnqueueWakesTheRelayOnCommit(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	b.runListeningRelay(t)
	next := newMessage(t, 0)
	s := b.subscription(t, nil)
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, _ placed, _ messaging.Message) error {
		return messaging.Enqueue(ctx, b.drv, tx, next)
	}))
	declareSubscription(t, s)
	run(t, s.Run)
	p, err := b.placed.Message(placed{OrderID: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	b.publish(t, b.exchange, p)
	testenv.Eventually(t, 5*time.Second, func() bool {
		return testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NOT NULL") == 1
	}, "the relay did not send the row a handler enqueued")
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), []uuid.UUID{next.ID})
}

// AMQP carries a prefetch in 16 bits: a larger one, set or made by the default (twice
// BatchSize), is refused, not sent as what is left of it (65536 as 0, no limit at all).
func TestNewSubscriptionRefusesAPrefetchAMQPCannotCarry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, cfg := range []messaging.SubscriptionConfig{{Prefetch: 65536}, {Prefetch: 80000}, {BatchSize: 32768}, {BatchSize: math.MaxInt/2 + 1}} {
		cfg.Name, cfg.URL = "sub", "amqp://unused"
		if _, err := messaging.NewSubscription(b.drv, cfg); err == nil || !strings.Contains(err.Error(), "Prefetch") {
			t.Errorf("NewSubscription(Prefetch %d, BatchSize %d) = %v, want an error naming Prefetch", cfg.Prefetch, cfg.BatchSize, err)
		}
	}
	if _, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{Name: "sub", URL: "amqp://unused", Prefetch: 65535}); err != nil {
		t.Fatalf("NewSubscription(Prefetch 65535) = %v, want nil", err)
	}
}

// A handler that passes its message's correlation id on to the messages its work enqueues, as
// the services do, handles a delivery whose correlation id no message could carry (a header of
// 300 bytes, a property holding a NUL) at the first try: it reads as none, instead of making
// every Enqueue of it fail until the message is dead-lettered.
func TestACorrelationIDThatCannotTravelOnDoesNotStopTheWork(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) { c.DeliveryLimit = 2 })
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, _ placed, msg messaging.Message) error {
		next := newMessage(t, 0)
		next.CorrelationID = msg.CorrelationID
		if err := messaging.Enqueue(ctx, b.drv, tx, next); err != nil {
			return err
		}
		return record(tx, msg)
	}))
	ch := testenv.Channel(t)
	declareSubscription(t, s)
	sent := map[string]amqp.Publishing{}
	for name, set := range map[string]func(*amqp.Publishing){
		"long header":   func(p *amqp.Publishing) { p.Headers = amqp.Table{"correlation_id": strings.Repeat("c", 300)} },
		"NUL property":  func(p *amqp.Publishing) { p.CorrelationId = "a\x00b" },
		"one that does": func(p *amqp.Publishing) { p.CorrelationId = "req-7" },
	} {
		m, err := b.placed.Message(placed{OrderID: uuid.New()})
		if err != nil {
			t.Fatal(err)
		}
		p := publishing(m)
		set(&p)
		sent[name] = p
		if err := b.ch.PublishWithContext(context.Background(), b.exchange, m.Type, true, false, p); err != nil {
			t.Fatal(err)
		}
	}
	run(t, s.Run)
	testenv.Eventually(t, 10*time.Second, func() bool { return b.handled(t, "SELECT count(*) FROM handled") == 3 },
		"not every message was handled")
	b.noDeadLetters(t, ch, "")
	if n := b.handled(t, "SELECT count(*) FROM outbox_messages WHERE correlation_id = 'req-7'"); n != 1 {
		t.Fatalf("%d enqueued messages carry the correlation id that can travel, want 1", n)
	}
	if lines := b.logs.Lines("batch failed"); len(lines) != 0 {
		t.Fatalf("a batch failed: %s", lines[0])
	}
}

// messagingtest.DeliverBatch hands a batch handler the messages given together, in one
// transaction with their inbox claims, and runs their after-commit hooks once it commits: a
// message handled already is skipped and reported a duplicate, and a batch that fails commits
// nothing of it, so that it can be delivered again.
func TestDeliverBatchHandsABatchHandlerItsMessagesTogether(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, nil)
	var sizes []int
	var hooks atomic.Int32
	refuse := false
	must(t, messaging.HandleBatch(s, b.placed, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[placed]) error {
		sizes = append(sizes, len(batch))
		for _, d := range batch {
			if err := record(tx, d.Msg); err != nil {
				return err
			}
			if err := messaging.AfterCommit(d.Ctx, func() { hooks.Add(1) }); err != nil {
				return err
			}
		}
		if refuse {
			return errors.New("the batch is refused")
		}
		return nil
	}))
	msgs := make([]messaging.Message, 5)
	for i := range msgs {
		msgs[i] = messagingtest.Message(t, b.placed, placed{OrderID: uuid.New(), N: i})
	}
	ctx := context.Background()
	if dup, err := messagingtest.Deliver(ctx, s, msgs[0]); err != nil || dup {
		t.Fatalf("Deliver = %v, %v", dup, err)
	}
	dups, err := messagingtest.DeliverBatch(ctx, s, msgs[:3]...)
	if err != nil || !slices.Equal(dups, []bool{true, false, false}) {
		t.Fatalf("DeliverBatch = %v, %v; want the first a duplicate, the other two handled", dups, err)
	}
	if !slices.Equal(sizes, []int{1, 2}) || hooks.Load() != 3 {
		t.Fatalf("batches of %v, %d after-commit hooks run; want [1 2] and 3", sizes, hooks.Load())
	}
	if n := b.handled(t, "SELECT count(DISTINCT txid) FROM handled"); n != 2 {
		t.Fatalf("the messages were handled in %d transactions, want 2: one per delivery", n)
	}
	refuse = true
	if _, err := messagingtest.DeliverBatch(ctx, s, msgs[3:]...); err == nil {
		t.Fatal("a refused batch: DeliverBatch = nil, want its error")
	}
	if n := b.handled(t, "SELECT count(*) FROM handled"); n != 3 || hooks.Load() != 3 {
		t.Fatalf("%d messages handled and %d hooks run after a refused batch, want 3 and 3: nothing of it committed", n, hooks.Load())
	}
	refuse = false
	if dups, err := messagingtest.DeliverBatch(ctx, s, msgs[3:]...); err != nil || !slices.Equal(dups, []bool{false, false}) {
		t.Fatalf("the refused batch again: DeliverBatch = %v, %v; want both handled", dups, err)
	}
	if n := b.handled(t, "SELECT count(*) FROM handled"); n != 5 {
		t.Fatalf("%d messages handled, want 5", n)
	}
}

// Middleware wraps the handlers of Handle in the order it was added, the first outermost, and
// sees each message and its decoded payload; a batch handler is not wrapped. Use once the
// subscription has started panics, rather than adding middleware that would wrap nothing.
func TestSubscriptionMiddlewareWrapsPlainHandlersInOrder(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, nil)
	var calls []string
	trace := func(name string) messaging.Middleware[*gorm.DB] {
		return func(next messaging.Handler[*gorm.DB, any]) messaging.Handler[*gorm.DB, any] {
			return func(ctx context.Context, tx *gorm.DB, payload any, msg messaging.Message) error {
				calls = append(calls, fmt.Sprintf("%s %s %T in", name, msg.Type, payload))
				err := next(ctx, tx, payload, msg)
				calls = append(calls, name+" out")
				return err
			}
		}
	}
	s.Use(trace("first"), trace("second"))
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, _ placed, msg messaging.Message) error {
		calls = append(calls, "handler")
		return record(tx, msg)
	}))
	must(t, messaging.HandleBatch(s, b.cancels, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[cancelled]) error {
		calls = append(calls, "batch handler")
		return nil
	}))
	ctx := context.Background()
	for _, msg := range []messaging.Message{
		messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()}),
		messagingtest.Message(t, b.cancels, cancelled{OrderID: uuid.New()}),
	} {
		if _, err := messagingtest.Deliver(ctx, s, msg); err != nil {
			t.Fatal(err)
		}
	}
	want := []string{"first Placed test.placed in", "second Placed test.placed in", "handler", "second out", "first out", "batch handler"}
	if !slices.Equal(calls, want) {
		t.Errorf("calls = %q, want %q", calls, want)
	}
	defer func() {
		if p := recover(); p == nil || !strings.Contains(fmt.Sprint(p), "Use after it started") {
			t.Errorf("Use after the subscription started: panic %v, want one saying so", p)
		}
	}()
	s.Use(trace("late"))
}
