package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// placed is the event of the redrive test.
type placed struct {
	OrderID uuid.UUID `json:"order_id"`
}

// background runs fn until the test ends, and checks it then stops within 10 s.
func background(t *testing.T, fn func(ctx context.Context) error) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	var once atomic.Bool
	stop = func() {
		if once.Swap(true) {
			return
		}
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run returned %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("did not stop within 10 s")
		}
	}
	t.Cleanup(stop)
	return stop
}

// brokerNames returns a fresh exchange and queue, deleted with their dead-letter queue when
// the test ends.
func brokerNames(t *testing.T) (exchange, queue string) {
	t.Helper()
	exchange, queue = testenv.UniqueName("orders"), testenv.UniqueName("ctl")
	testenv.CleanupBroker(t, []string{queue, messaging.DeadLetterQueue(queue)}, []string{exchange})
	return exchange, queue
}

func publishTo(t *testing.T, ch *amqp.Channel, exchange, key string, p amqp.Publishing) {
	t.Helper()
	if err := ch.PublishWithContext(context.Background(), exchange, key, true, false, p); err != nil {
		t.Fatal(err)
	}
}

// listed returns the message ids of a dlq list, in the order printed.
func listed(t *testing.T, out string) []string {
	t.Helper()
	var ids []string
	rows := false
	for line := range strings.SplitSeq(out, "\n") {
		switch {
		case strings.HasPrefix(line, "MESSAGE ID"):
			rows = true
		case rows && line != "":
			ids = append(ids, strings.Fields(line)[0])
		}
	}
	return ids
}

func deliveryIDs(deliveries []amqp.Delivery) []string {
	ids := make([]string, len(deliveries))
	for i, d := range deliveries {
		ids[i] = d.MessageId
	}
	return ids
}

// deadLettered fills queue's dead-letter queue with six messages and returns their ids in
// queue order: five a consumer dead-lettered with its reason, then one the broker dead-lettered
// itself, over the queue's delivery limit.
func deadLettered(t *testing.T) (queue string, ch *amqp.Channel, ids []string) {
	t.Helper()
	exchange, queue := brokerNames(t)
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{
		{Queue: queue, Bindings: []messaging.Binding{{Exchange: exchange, RoutingKey: "OrderPlaced"}}, DeliveryLimit: 2}}}
	if err := topology.Declare(testenv.Connection(t), nil); err != nil {
		t.Fatal(err)
	}
	ch = testenv.Channel(t)
	refuse := func(_ context.Context, msg messaging.Message) error {
		return messaging.Permanent(fmt.Errorf("cannot invoice order of message %s", msg.ID))
	}
	log, _ := testenv.NewLogger(t)
	c, err := messaging.NewConsumer(messaging.ConsumerConfig{URL: testenv.AMQPURL(), Queue: queue, Topology: topology, DeliveryLimit: 2, Logger: log}, refuse)
	if err != nil {
		t.Fatal(err)
	}
	stop := background(t, c.Run)
	dlq := messaging.DeadLetterQueue(queue)
	for range 5 {
		id := uuid.NewString()
		ids = append(ids, id)
		publishTo(t, ch, exchange, "OrderPlaced", amqp.Publishing{MessageId: id, Type: "OrderPlaced", ContentType: "application/json", Body: []byte(`{}`)})
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == 5 }, "the consumer did not dead-letter 5 messages")
	stop()

	last := uuid.NewString()
	ids = append(ids, last)
	publishTo(t, ch, exchange, "OrderPlaced", amqp.Publishing{MessageId: last, Type: "OrderPlaced", ContentType: "application/json", Body: []byte(`{}`)})
	// Handed back more often than the limit of 2 allows, the broker dead-letters it itself.
	testenv.Eventually(t, 10*time.Second, func() bool {
		if d, ok, err := ch.Get(queue, false); err == nil && ok {
			_ = d.Nack(false, true)
		}
		return testenv.QueueDepth(t, ch, dlq) == 6
	}, "the broker did not dead-letter the message over the delivery limit")
	return queue, ch, ids
}

// Listing takes nothing away and changes no order: twice, with the flags before and after the
// queue name (the second through a list of two brokers, one down), then the queue is drained and
// holds the same messages in the same order.
func TestDlqListLosesAndReordersNothing(t *testing.T) {
	t.Parallel()
	queue, ch, ids := deadLettered(t)
	first := ok(t, "dlq", "list", queue, "--amqp", testenv.AMQPURL())
	// --amqp takes one URL per cluster node, as AMQP_URL does; a node that is down is passed over.
	down := testenv.Proxy(t, testenv.AMQPHost(t))
	down.Stop()
	second := ok(t, "dlq", "list", "--amqp", testenv.AMQPURLVia(t, down.Listen)+","+testenv.AMQPURL(), queue)
	if first != second {
		t.Fatalf("two listings differ:\n%s\n%s", first, second)
	}
	if got := listed(t, first); !slices.Equal(got, ids) {
		t.Fatalf("listed %q, want %q in that order:\n%s", got, ids, first)
	}
	for _, want := range []string{
		"6 messages in " + messaging.DeadLetterQueue(queue),
		ids[0] + "  OrderPlaced", "cannot invoice order of message " + ids[0],
		"delivery_limit: dead-lettered by the broker from queue " + queue,
	} {
		if !strings.Contains(first, want) {
			t.Errorf("listing lacks %q:\n%s", want, first)
		}
	}
	drained := testenv.Drain(t, ch, messaging.DeadLetterQueue(queue), 200*time.Millisecond)
	if got := deliveryIDs(drained); !slices.Equal(got, ids) {
		t.Fatalf("after listing, the dead-letter queue holds %q, want %q", got, ids)
	}
	if out := ok(t, "dlq", "list", queue, "--amqp", testenv.AMQPURL()); !strings.Contains(out, "is empty") {
		t.Errorf("listing an empty dead-letter queue: %q", out)
	}
	code, _, stderr := ctl(t, "dlq", "list", "no_such_queue", "--amqp", testenv.AMQPURL())
	if code != 1 || !strings.Contains(stderr, `"no_such_queue.dlq"`) {
		t.Errorf("listing a missing queue: exit %d, %q; want 1 naming it", code, stderr)
	}
}

// A redriven message is the message as first published: the same id, type and body, without
// the headers of its dead-lettering (x-death, the reason, the delivery count).
func TestDlqRedriveRestoresTheMessage(t *testing.T) {
	t.Parallel()
	queue, ch, ids := deadLettered(t)
	out := ok(t, "dlq", "redrive", queue, "--id", ids[5], "--amqp", testenv.AMQPURL())
	if !strings.Contains(out, "redriven "+ids[5]+" OrderPlaced") || !strings.Contains(out, "moved 1 messages") {
		t.Errorf("redrive said %q", out)
	}
	out = ok(t, "dlq", "redrive", "--id", strings.ToUpper(ids[0]), queue, "--amqp", testenv.AMQPURL())
	if !strings.Contains(out, "redriven "+ids[0]) {
		t.Errorf("redrive of an id in capitals said %q", out)
	}
	back := testenv.Drain(t, ch, queue, 200*time.Millisecond)
	if got := deliveryIDs(back); !slices.Equal(got, []string{ids[5], ids[0]}) {
		t.Fatalf("the queue holds %q, want the two redriven", got)
	}
	for _, d := range back {
		if d.Type != "OrderPlaced" || string(d.Body) != "{}" || d.ContentType != "application/json" {
			t.Errorf("redriven %s: type %q, body %q, content type %q changed", d.MessageId, d.Type, d.Body, d.ContentType)
		}
		for _, h := range []string{"x-death", messaging.HeaderDeadLetterReason, messaging.HeaderDeadLetteredAt, messaging.HeaderOriginalExchange} {
			if _, ok := d.Headers[h]; ok {
				t.Errorf("redriven %s still carries %s", d.MessageId, h)
			}
		}
	}
	rest := testenv.Drain(t, ch, messaging.DeadLetterQueue(queue), 200*time.Millisecond)
	if got := deliveryIDs(rest); !slices.Equal(got, ids[1:5]) {
		t.Fatalf("the dead-letter queue holds %q, want the others in their order %q", got, ids[1:5])
	}
}

// Redrive end to end, into a running subscription: a message whose inbox record exists is
// skipped as a duplicate, the others are handled once; --id moves one and leaves the rest in
// order; an id not there is an error that names it and moves nothing.
func TestDlqRedriveIntoASubscription(t *testing.T) {
	t.Parallel()
	exchange, queue := brokerNames(t)
	db := testenv.NewDatabase(t)
	db.Migrate(t, messaging.MigrateInbox)
	if err := db.DB.Exec("CREATE TABLE handled (message_id uuid NOT NULL)").Error; err != nil {
		t.Fatal(err)
	}
	var refusing atomic.Bool // until the price list is fixed, every order is refused
	event := messaging.Event[placed]{Exchange: exchange, Type: "Placed", Validate: func(placed) error {
		if refusing.Load() {
			return errors.New("the price list is missing")
		}
		return nil
	}}
	log, logs := testenv.NewLogger(t)
	sub, err := messaging.NewSubscription(messaging.SubscriptionConfig{Name: queue, URL: testenv.AMQPURL(), DB: db.DB, Concurrency: 2, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	messaging.Handle(sub, event, func(ctx context.Context, tx *gorm.DB, _ placed, msg messaging.Message) error {
		return tx.Exec("INSERT INTO handled (message_id) VALUES (?)", msg.ID).Error
	})
	topology, err := sub.Topology()
	if err != nil {
		t.Fatal(err)
	}
	if err := topology.Declare(testenv.Connection(t), nil); err != nil {
		t.Fatal(err)
	}
	ch := testenv.Channel(t)
	background(t, sub.Run)
	handled := func(id uuid.UUID) int64 {
		return testenv.Count(t, db.DB, "SELECT count(*) FROM handled WHERE message_id = ?", id)
	}
	message := func() (messaging.Message, amqp.Publishing) {
		m, err := event.Message(placed{OrderID: uuid.New()})
		if err != nil {
			t.Fatal(err)
		}
		return m, amqp.Publishing{MessageId: m.ID.String(), Type: m.Type, ContentType: "application/json", Body: m.Payload}
	}
	dlq := messaging.DeadLetterQueue(queue)
	inDLQ := func() []string { return listed(t, ok(t, "dlq", "list", queue, "--amqp", testenv.AMQPURL())) }

	// A is handled. B and C are refused and dead-lettered. A copy of A lands in the
	// dead-letter queue too, as a crash between its dead-letter confirm and its ack would leave
	// one while the broker redelivered A to be handled.
	a, aPub := message()
	publishTo(t, ch, exchange, "Placed", aPub)
	testenv.Eventually(t, 10*time.Second, func() bool { return handled(a.ID) == 1 }, "A not handled")
	refusing.Store(true)
	b, bPub := message()
	c, cPub := message()
	publishTo(t, ch, exchange, "Placed", bPub)
	publishTo(t, ch, exchange, "Placed", cPub)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == 2 }, "B and C not dead-lettered")
	aPub.Headers = amqp.Table{messaging.HeaderDeadLetterReason: "the price list is missing"}
	publishTo(t, ch, "", dlq, aPub)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == 3 }, "A's copy not in the dead-letter queue")
	if got := inDLQ(); len(got) != 3 || !slices.Contains(got, b.ID.String()) || !slices.Contains(got, c.ID.String()) || got[2] != a.ID.String() {
		t.Fatalf("dead-letter queue holds %q, want B and C, then A", got)
	}
	order := inDLQ()

	refusing.Store(false) // the price list is fixed
	out := ok(t, "dlq", "redrive", queue, "--id", b.ID.String(), "--amqp", testenv.AMQPURL())
	if !strings.Contains(out, "redriven "+b.ID.String()+" Placed") {
		t.Errorf("redrive --id said %q", out)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return handled(b.ID) == 1 }, "B not handled after its redrive")
	if got, want := inDLQ(), slices.DeleteFunc(slices.Clone(order), func(id string) bool { return id == b.ID.String() }); !slices.Equal(got, want) {
		t.Fatalf("after redriving B the dead-letter queue holds %q, want %q", got, want)
	}

	unknown := uuid.NewString()
	code, _, stderr := ctl(t, "dlq", "redrive", queue, "--id", unknown, "--amqp", testenv.AMQPURL())
	if code != 1 || !strings.Contains(stderr, "no message with id "+unknown+" in "+dlq) {
		t.Errorf("redrive of an unknown id: exit %d, %q; want 1 naming it", code, stderr)
	}
	if got := len(inDLQ()); got != 2 {
		t.Fatalf("a failed redrive left %d messages, want 2", got)
	}

	out = ok(t, "dlq", "redrive", "--amqp", testenv.AMQPURL(), queue)
	if !strings.Contains(out, "moved 2 messages from "+dlq+" to "+queue) {
		t.Errorf("redrive said %q", out)
	}
	testenv.Eventually(t, 10*time.Second, func() bool {
		return handled(c.ID) == 1 && len(logs.Lines("duplicate message skipped", "message_id="+a.ID.String())) == 1
	}, "want C handled and A's copy skipped as a duplicate")
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, ch, queue) == 0 }, "the queue is not drained")
	for name, id := range map[string]uuid.UUID{"A": a.ID, "B": b.ID, "C": c.ID} {
		if n := handled(id); n != 1 {
			t.Errorf("%s handled %d times, want once", name, n)
		}
	}
	if n := testenv.QueueDepth(t, ch, dlq); n != 0 {
		t.Errorf("the dead-letter queue still holds %d", n)
	}
}
