package test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
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

// deadLetters takes every message out of queue's dead-letter queue.
func deadLetters(t *testing.T, ch *amqp.Channel, queue string) []amqp.Delivery {
	t.Helper()
	return testenv.Drain(t, ch, messaging.DeadLetterQueue(queue), 100*time.Millisecond)
}

// wantReason fails unless d came to the dead-letter queue from the consumer, with a reason
// containing part and the time it was dead-lettered.
func wantReason(t *testing.T, d amqp.Delivery, part string) {
	t.Helper()
	reason, _ := d.Headers[messaging.HeaderDeadLetterReason].(string)
	if !strings.Contains(reason, part) {
		t.Errorf("message %q: dead-letter reason %q does not contain %q", d.MessageId, reason, part)
	}
	at, _ := d.Headers[messaging.HeaderDeadLetteredAt].(string)
	if when, err := time.Parse(time.RFC3339Nano, at); err != nil || time.Since(when) > time.Minute || time.Until(when) > time.Second {
		t.Errorf("message %q: dead-lettered at %q, want a time within the last minute", d.MessageId, at)
	}
}

// reasonsByID maps the message ids of deliveries to their dead-letter reasons.
func reasonsByID(deliveries []amqp.Delivery) map[string]string {
	out := make(map[string]string, len(deliveries))
	for _, d := range deliveries {
		out[d.MessageId], _ = d.Headers[messaging.HeaderDeadLetterReason].(string)
	}
	return out
}

// The copy in the dead-letter queue is the message as it came, id and properties unchanged,
// plus where it came from and why it can never be handled; it came by publish, not by the
// broker's dead-lettering (no x-death).
func TestConsumerDeadLetterCarriesTheMessageAndItsReason(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	// A queue the message's CC names, which its topic exchange does not route to, but the
	// default exchange, through which the copy goes, would.
	other := testenv.UniqueName("cc")
	testenv.CleanupBroker(t, []string{other}, nil)
	if _, err := b.ch.QueueDeclare(other, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	occurred := time.Now().Add(-time.Hour).Truncate(time.Second)
	sent := amqp.Publishing{
		MessageId: uuid.NewString(), Type: eventType, ContentType: "application/json", AppId: "order",
		CorrelationId: "corr-1", Timestamp: occurred, DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{"correlation_id": "corr-1", "tenant": "acme", "CC": []any{other}},
		Body:    []byte(`{"n":1}`), // no order_id: doWork says no retry can help
	}
	b.publishRaw(t, sent)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(b.queue)) == 1 },
		"message not dead-lettered")
	got := deadLetters(t, b.ch, b.queue)
	if len(got) != 1 {
		t.Fatalf("%d messages in the dead-letter queue, want 1", len(got))
	}
	d := got[0]
	wantReason(t, d, "payload has no order_id")
	if d.MessageId != sent.MessageId || d.Type != sent.Type || string(d.Body) != string(sent.Body) || d.ContentType != sent.ContentType ||
		d.AppId != sent.AppId || d.CorrelationId != sent.CorrelationId || !d.Timestamp.Equal(occurred) || d.DeliveryMode != amqp.Persistent {
		t.Errorf("dead letter %+v differs from what was published %+v", d, sent)
	}
	if d.Headers["tenant"] != "acme" || d.Headers[messaging.HeaderOriginalExchange] != b.exchange || d.Headers[messaging.HeaderOriginalRoutingKey] != eventType {
		t.Errorf("headers %v: want the original ones plus exchange %q and routing key %q", d.Headers, b.exchange, eventType)
	}
	if _, ok := d.Headers["x-death"]; ok {
		t.Errorf("x-death %v: the broker dead-lettered it, not the consumer", d.Headers["x-death"])
	}
	if n := testenv.QueueDepth(t, b.ch, other); n != 0 || d.Headers["CC"] != nil {
		t.Errorf("the dead-letter copy went to the queue its CC named too (%d there), or kept its CC (%v)", n, d.Headers["CC"])
	}
	// The consumer logs and counts it once the broker confirmed the copy, which the queue may
	// show a moment before.
	testenv.Eventually(t, 5*time.Second, func() bool {
		return hasMetric(t, b.registry, `consumer_messages_total{outcome="dead_lettered",queue="`+b.queue+`"} 1`)
	}, "not counted as dead-lettered")
	if lines := b.logs.Lines("level=ERROR", "message dead-lettered", "message_id="+sent.MessageId, "reason="); len(lines) != 1 {
		t.Errorf("want one dead-letter line with the reason, got %q", b.logs.Lines("message dead-lettered"))
	}
}

// A dead-letter queue deleted while the consumer runs (an operator purging it) is declared
// again, as the topology declares it, once a copy comes back unroutable, and takes the next
// try's copy: the consumer is not restarted. Left gone until the next connection, it refused
// every copy, and the worker retrying one held the messages behind it (here the one worker's
// good message, after the poison) for the whole session. Only the dead-letter queue is declared:
// a binding the operator removed meanwhile stays removed, as it does until the next connection.
func TestConsumerDeclaresADeletedDeadLetterQueueAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, func(c *messaging.SubscriptionConfig) { c.Concurrency = 1 })
	must(t, b.ch.QueueUnbind(b.queue, eventType, b.exchange, nil))
	dlq := messaging.DeadLetterQueue(b.queue)
	if _, err := b.ch.QueueDelete(dlq, false, false, false); err != nil {
		t.Fatal(err)
	}
	poison := amqp.Publishing{MessageId: uuid.NewString(), ContentType: "application/json", Body: []byte("<xml/>")}
	for _, p := range []amqp.Publishing{poison, publishing(newMessage(t, 1))} {
		// Straight to the queue, through the default exchange: the binding is gone.
		must(t, b.ch.PublishWithContext(context.Background(), "", b.queue, false, false, p))
	}
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines("message dead-lettered", poison.MessageId)) == 1 && b.workDone(t) == 1
	}, "the poison message did not reach a dead-letter queue declared again, nor the good one its handler, while the consumer ran")
	if n := len(b.logs.Lines("could not dead-letter message", poison.MessageId, "unroutable", "declared it again")); n == 0 {
		t.Errorf("no line of the copy that came back unroutable, and of the queue declared again: %q", b.logs.Lines("could not dead-letter message"))
	}
	if bindings := bindingsOf(t, b.queue); len(bindings) != 0 {
		t.Errorf("the binding the operator removed was declared again with the dead-letter queue: %q", bindings)
	}
	// With the library's arguments: a declaration with them is the same queue's, or refused.
	own, _ := b.topology.Queue(b.queue)
	if _, err := testenv.Channel(t).QueueDeclare(dlq, true, false, false, false, own.DeadLetterArguments()); err != nil {
		t.Fatalf("the dead-letter queue declared again is not as the topology declares it: %v", err)
	}
	wantPoisonDeadLetteredOnce(t, b, poison)
}

// bindingsOf lists queue's bindings in the virtual host /, as "exchange routing-key", but the
// default exchange's, which every queue has.
func bindingsOf(t *testing.T, queue string) []string {
	t.Helper()
	out, err := testenv.RabbitMQCtlCommand("-q", "list_bindings", "-p", "/", "source_name", "destination_name", "routing_key", "--formatter", "json").Output()
	if err != nil {
		t.Fatalf("rabbitmqctl list_bindings: %v", err)
	}
	var rows []struct {
		Source      string `json:"source_name"`
		Destination string `json:"destination_name"`
		RoutingKey  string `json:"routing_key"`
	}
	if err := json.Unmarshal(out, &rows); err != nil {
		t.Fatalf("rabbitmqctl list_bindings: %v\n%s", err, out)
	}
	var bindings []string
	for _, r := range rows {
		if r.Destination == queue && r.Source != "" {
			bindings = append(bindings, r.Source+" "+r.RoutingKey)
		}
	}
	return bindings
}

// While the dead-letter queue cannot take a message (here it is gone, and the consumer's user
// may not declare it again, which the consumer says: the publish comes back unroutable), the
// message is not acknowledged: a consumer that stops hands it back to the queue, and once the
// dead-letter queue is back the message lands there, once.
func TestConsumerKeepsAMessageTheDeadLetterQueueDoesNotTake(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	user := testenv.UniqueName("consumer")
	t.Cleanup(func() { testenv.RabbitMQCtlQuietly("delete_user", user) })
	testenv.RabbitMQCtl(t, "add_user", user, "secret")
	// No right at all on the dead-letter queue: RabbitMQ from 4.2.6 on hides from this user
	// whether it exists (publishing to it through the default exchange needs none).
	own := "^(" + regexp.QuoteMeta(b.queue) + "|" + regexp.QuoteMeta(b.exchange) + ")$"
	testenv.RabbitMQCtl(t, "set_permissions", "-p", "/", user,
		own, "^("+regexp.QuoteMeta(b.queue)+"|"+regexp.QuoteMeta(b.exchange)+"|amq\\.default)$", own)
	c, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{
		Name: b.queue, URL: strings.Replace(testenv.AMQPURL(), "guest:guest@", user+":secret@", 1),
		Topology: b.topology, Logger: b.log, Metrics: b.metrics,
		RetryBackoff: messaging.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	must(t, messaging.Handle(c, b.orderPlaced(), workFunc))
	stop := start(t, c.Run)
	testenv.Eventually(t, 10*time.Second, c.Ready, "consumer not ready")
	dlq := messaging.DeadLetterQueue(b.queue)
	if _, err := b.ch.QueueDelete(dlq, false, false, false); err != nil {
		t.Fatal(err)
	}
	poison := amqp.Publishing{MessageId: uuid.NewString(), ContentType: "application/json", Body: []byte("<xml/>")}
	b.publishRaw(t, poison)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines("could not dead-letter message", poison.MessageId, "unroutable", "not allowed to declare it")) >= 3
	}, "the consumer did not report the dead-letter queue refusing the message, and that it may not declare it")
	// RabbitMQ from 4.2.6 on refuses this user the question whether the queue exists, too:
	// that was taken for a declaration, and claimed at every try.
	if lines := b.logs.Lines("could not dead-letter message", "declared it again"); len(lines) != 0 {
		t.Errorf("claimed a declaration the broker refused: %q", lines)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run returned %v", err)
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == 1 },
		"the stopped consumer did not hand the message back to the queue")
	if n := metricValue(t, b.registry, "consumer_messages_total", map[string]string{"queue": b.queue, "outcome": "dead_lettered"}); n != 0 {
		t.Fatalf("counted %v times as dead-lettered while no dead-letter queue took it", n)
	}

	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil) // guest's connection declares the dead-letter queue again
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == 1 }, "message not dead-lettered")
	wantPoisonDeadLetteredOnce(t, b, poison)
}

// wantPoisonDeadLetteredOnce fails unless poison, a body that is not JSON, is in the dead-letter
// queue once with its reason, and b's queue holds nothing.
func wantPoisonDeadLetteredOnce(t *testing.T, b *testBundle, poison amqp.Publishing) {
	t.Helper()
	got := deadLetters(t, b.ch, b.queue)
	if len(got) != 1 || got[0].MessageId != poison.MessageId {
		t.Fatalf("dead-letter queue held %d messages, want the poison message once", len(got))
	}
	wantReason(t, got[0], "body is not valid JSON")
	if n := testenv.QueueDepth(t, b.ch, b.queue); n != 0 {
		t.Fatalf("queue still holds %d", n)
	}
}

// A dead-letter queue an earlier version declared, without x-delivery-limit, cannot be declared
// again with it: the consumer says so, and uses it as it is.
func TestConsumerUsesADeadLetterQueueDeclaredWithoutALimit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	if _, err := b.ch.QueueDelete(dlq, false, false, false); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ch.QueueDeclare(dlq, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum}); err != nil {
		t.Fatal(err)
	}
	if err := b.topology.Declare(testenv.Connection(t), nil); !errors.Is(err, messaging.ErrLegacyDeadLetterQueue) {
		t.Fatalf("Declare = %v, want ErrLegacyDeadLetterQueue", err)
	}
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	if n := len(b.logs.Lines("level=WARN", "default delivery limit", "dead_letter_queue="+dlq)); n != 1 {
		t.Fatalf("%d warnings about the dead-letter queue's limit, want 1", n)
	}
	poison := amqp.Publishing{MessageId: uuid.NewString(), Type: eventType, ContentType: "application/json", Body: []byte(`{"n":1}`)}
	b.publishRaw(t, poison)
	good := newMessage(t, 2)
	b.publishRaw(t, publishing(good))
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == 1 && b.workDone(t) == 1 },
		"want the poison message dead-lettered and the good one handled")
	got := deadLetters(t, b.ch, b.queue)
	wantReason(t, got[0], "payload has no order_id")
}

// The dead-letter queue has no delivery limit: a message handed back more often than RabbitMQ
// 4.x's default limit (20) stays. With x-delivery-limit -1 (unlimited on 4.x) RabbitMQ 3.x
// drops it the first time.
func TestDeadLetterQueueHasNoDeliveryLimit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	if err := b.ch.PublishWithContext(context.Background(), "", dlq, true, false, amqp.Publishing{MessageId: "kept", Body: []byte("{}")}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == 1 }, "message not in the dead-letter queue")
	for i := range 25 {
		d, ok, err := b.ch.Get(dlq, false)
		if err != nil || !ok {
			t.Fatalf("get %d: ok=%v err=%v: the message is gone", i+1, ok, err)
		}
		if err := d.Nack(false, true); err != nil {
			t.Fatal(err)
		}
	}
	if got := deadLetters(t, b.ch, b.queue); len(got) != 1 || got[0].MessageId != "kept" {
		t.Fatalf("after 25 deliveries the dead-letter queue holds %d messages, want the one", len(got))
	}
}

// wantDeadLetteredAtOnce fails unless the message id, dead-lettered by now with the reason in
// reasons, got there as the design promises for a permanent error: the handler ran it ran
// times, want (once on its own, and once for each failed batch that held it); nothing retried it
// in place or returned it to the queue, so it had one delivery; and its copy carries reason,
// the handler's own.
func wantDeadLetteredAtOnce(t *testing.T, b *testBundle, id string, ran, want int, reasons map[string]string, reason string) {
	t.Helper()
	if ran != want {
		t.Errorf("message %s: the handler ran it %d times before it was dead-lettered, want %d: a permanent error was retried", id, ran, want)
	}
	if lines := b.logs.Lines("message_id="+id, "retrying message"); len(lines) != 0 {
		t.Errorf("message %s: a permanent error was retried in place: %q", id, lines)
	}
	if lines := b.logs.Lines("message_id="+id, "returning message to the queue"); len(lines) != 0 {
		t.Errorf("message %s: a permanent error was returned to the queue for another delivery: %q", id, lines)
	}
	if r, ok := reasons[id]; !ok || r != reason {
		t.Errorf("message %s: dead-letter reason %q (in the queue: %v), want the handler's own %q", id, r, ok, reason)
	}
}

// wantNothingRequeued fails if the consumer of queue returned any message to it.
func wantNothingRequeued(t *testing.T, b *testBundle, queue string) {
	t.Helper()
	if n := metricValue(t, b.registry, "consumer_messages_total", map[string]string{"outcome": "requeued", "queue": queue}); n != 0 {
		t.Errorf("metrics count %v requeues on %s: a message had more than one delivery", n, queue)
	}
}

// A handler's permanent error dead-letters its message on the first try, with batching off:
// no retry in place, no return to the queue, no waiting for the delivery limit, and the
// handler's reason as it was. (The delivery limit here is small so that a consumer that did
// retry it would still dead-letter it within seconds, and the counts would say how often it
// ran.)
func TestConsumerDeadLettersAPermanentErrorOnTheFirstTry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	msg := newMessage(t, 1)
	const reason = "order belongs to no customer"
	var attempts atomic.Int32
	refuse := func(_ context.Context, tx *gorm.DB, p payload, m messaging.Message) error {
		if m.ID == msg.ID {
			attempts.Add(1)
			return messaging.Permanent(errors.New(reason))
		}
		return doWork(tx, p, m)
	}
	b.consumer(t, testenv.AMQPURL(), b.drv, refuse, func(c *messaging.SubscriptionConfig) { c.BatchSize, c.DeliveryLimit = 1, 3 })
	b.publishRaw(t, publishing(msg))
	id := msg.ID.String()
	testenv.Eventually(t, 20*time.Second, func() bool { return len(b.logs.Lines("message dead-lettered", "message_id="+id)) > 0 },
		"the message was not dead-lettered")
	wantDeadLetteredAtOnce(t, b, id, int(attempts.Load()), 1, reasonsByID(deadLetters(t, b.ch, b.queue)), reason)
	wantNothingRequeued(t, b, b.queue)
}

// A batch that holds a message with a permanent error, on a subscription's default path: the
// batch fails once, on that message; its messages are then handled one by one, and the refused
// one runs once on its own and goes to the dead-letter queue with its handler's reason, while
// the others are done, each once. The messages wait in the queue before the subscription starts,
// so they come as a batch; the first one's handler holds its transaction until the broker has
// sent every other message, so that, should the first batch not hold the refused message, the
// next one takes it with the rest.
func TestSubscriptionBatchWithAPermanentErrorDeadLettersItOnItsFirstTryAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	const n, reason = 7, "order belongs to no customer"
	msgs := make([]messaging.Message, n)
	for i := range msgs {
		msgs[i] = newMessage(t, i)
	}
	first, bad := msgs[0], msgs[n/2]
	queue := testenv.Channel(t) // the handler's own, to look at the queue
	var attempts atomic.Int32
	work := func(_ context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		switch msg.ID {
		case bad.ID:
			attempts.Add(1)
			return messaging.Permanent(errors.New(reason))
		case first.ID:
			for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				if q, err := queue.QueueDeclarePassive(b.queue, true, false, false, false, nil); err != nil || q.Messages == 0 {
					break
				}
			}
		}
		return doWork(tx, p, msg)
	}
	for _, m := range msgs {
		b.publishRaw(t, publishing(m))
	}
	s, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{
		Name: b.queue, URL: testenv.AMQPURL(), Topology: b.topology, Concurrency: 1, DeliveryLimit: 3, Logger: b.log, Metrics: b.metrics,
	})
	if err != nil {
		t.Fatal(err)
	}
	must(t, messaging.Handle(s, b.orderPlaced(), work))
	stop := start(t, s.Run)
	id := bad.ID.String()
	testenv.Eventually(t, 20*time.Second, func() bool {
		return b.workDone(t) == n-1 && len(b.logs.Lines("message dead-lettered", "message_id="+id)) > 0
	}, "want the other %d messages handled and the refused one dead-lettered", n-1)
	// Whatever was not settled goes back to the queue with the connection.
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}

	if lines := b.logs.Lines("batch failed; processing its messages one by one"); len(lines) != 1 || !strings.Contains(lines[0], id) {
		t.Fatalf("want the batch to fail once, on the refused message %s, got %q", id, lines)
	}
	dead := deadLetters(t, b.ch, b.queue)
	if len(dead) != 1 {
		t.Errorf("dead-letter queue held %d messages, want the refused one alone", len(dead))
	}
	wantDeadLetteredAtOnce(t, b, id, int(attempts.Load()), 2, reasonsByID(dead), reason)
	wantNothingRequeued(t, b, b.queue)
	if d := testenv.Count(t, b.db.DB, "SELECT count(*) FROM (SELECT message_id FROM work_items GROUP BY message_id HAVING count(*) > 1) d"); d != 0 {
		t.Errorf("%d messages were worked twice", d)
	}
	if depth := testenv.QueueDepth(t, b.ch, b.queue); depth != 0 {
		t.Errorf("%d messages back in the queue, want every one settled", depth)
	}
}

// A reason of any length reaches the dead-letter queue, cut to about a kilobyte: a handler's
// error quoting a large document must not grow the copy's headers past the broker's frame
// size (128 KiB), where the copy could never be published and the message would stay in the
// queue for ever.
func TestADeadLetterReasonIsCutToAKilobyte(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	msg := newMessage(t, 1)
	long := "no customer: " + strings.Repeat("x", 200_000)
	refuse := func(context.Context, *gorm.DB, payload, messaging.Message) error {
		return messaging.Permanent(errors.New(long))
	}
	b.consumer(t, testenv.AMQPURL(), b.drv, refuse, func(c *messaging.SubscriptionConfig) { c.BatchSize = 1 })
	b.publishRaw(t, publishing(msg))
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(b.queue)) == 1 },
		"the message with a long reason was not dead-lettered")
	reason := reasonsByID(deadLetters(t, b.ch, b.queue))[msg.ID.String()]
	if !strings.HasPrefix(reason, "no customer: xxx") || len(reason) > 1024+len("…") {
		t.Fatalf("dead-letter reason of %d bytes starting %.20q, want the start of the handler's error cut to 1,024 bytes", len(reason), reason)
	}
}

// A dead-letter queue that nacks the copy (here it is full, and rejects what comes beyond its
// length) has not taken it: the message stays unacknowledged in its queue, is counted and
// logged as nothing else, and lands in the dead-letter queue once that has room again.
func TestConsumerKeepsAMessageTheDeadLetterQueueNacks(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	// A policy makes the dead-letter queue full with what it holds, and nack what comes next;
	// it applies in the background, so filler goes in until the queue refuses one.
	policy := testenv.UniqueName("dlq-full")
	testenv.RabbitMQCtl(t, "set_policy", "-p", "/", "--apply-to", "queues", "--priority", "100", policy,
		"^"+regexp.QuoteMeta(dlq)+"$", `{"max-length":1,"overflow":"reject-publish"}`)
	cleared := false
	clearPolicy := func() {
		if !cleared {
			cleared = true
			testenv.RabbitMQCtl(t, "clear_policy", "-p", "/", policy)
		}
	}
	t.Cleanup(clearPolicy)
	confirms := testenv.Channel(t)
	must(t, confirms.Confirm(false))
	testenv.Eventually(t, 10*time.Second, func() bool {
		dc, err := confirms.PublishWithDeferredConfirmWithContext(context.Background(), "", dlq, true, false,
			amqp.Publishing{MessageId: "filler", Body: []byte("{}")})
		return err == nil && !dc.Wait()
	}, "the dead-letter queue never refused a publish")
	filler := testenv.QueueDepth(t, b.ch, dlq)

	poison := amqp.Publishing{MessageId: uuid.NewString(), ContentType: "application/json", Body: []byte("<xml/>")}
	b.publishRaw(t, poison)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines("could not dead-letter message", poison.MessageId, "nacked")) >= 2
	}, "the consumer did not report the dead-letter queue refusing the message")
	if lines := b.logs.Lines("message dead-lettered", poison.MessageId); len(lines) != 0 {
		t.Fatalf("logged as dead-lettered while the dead-letter queue refused it: %q", lines)
	}
	if n := metricValue(t, b.registry, "consumer_messages_total", map[string]string{"queue": b.queue, "outcome": "dead_lettered"}); n != 0 {
		t.Fatalf("counted %v times as dead-lettered while the dead-letter queue refused it", n)
	}

	clearPolicy()
	testenv.Eventually(t, 10*time.Second, func() bool { return len(b.logs.Lines("message dead-lettered", poison.MessageId)) == 1 },
		"the message was not dead-lettered once the dead-letter queue had room")
	got := deadLetters(t, b.ch, b.queue)
	if len(got) != filler+1 || got[len(got)-1].MessageId != poison.MessageId {
		t.Fatalf("dead-letter queue held %d messages, want the %d fillers and the poison message last", len(got), filler)
	}
	wantReason(t, got[len(got)-1], "body is not valid JSON")
	if n := testenv.QueueDepth(t, b.ch, b.queue); n != 0 {
		t.Fatalf("queue still holds %d", n)
	}
}

// Declare names every dead-letter queue an earlier version declared, and the consumer warns
// about each by its own name: here another consumer's, in a topology that holds both queues,
// as every service of a system declares the whole of it.
func TestConsumerNamesTheDeadLetterQueueDeclaredWithoutALimit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	other := testenv.UniqueName("notification")
	legacy := messaging.DeadLetterQueue(other)
	testenv.CleanupBroker(t, []string{other, legacy}, nil)
	if _, err := b.ch.QueueDeclare(legacy, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum}); err != nil {
		t.Fatal(err)
	}
	b.topology.Queues = append(b.topology.Queues, messaging.ConsumerTopology{Queue: other})
	err := b.topology.Declare(testenv.Connection(t), nil)
	if !errors.Is(err, messaging.ErrLegacyDeadLetterQueue) || !strings.Contains(err.Error(), legacy) {
		t.Fatalf("Declare = %v, want ErrLegacyDeadLetterQueue naming %s", err, legacy)
	}
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	warnings := b.logs.Lines("level=WARN", "default delivery limit")
	if len(warnings) != 1 || !strings.Contains(warnings[0], "dead_letter_queue="+legacy+" ") {
		t.Fatalf("warnings about a dead-letter queue's limit: %q; want one naming %s", warnings, legacy)
	}
}

// The inbox knows a message by its id: messages that all carry the nil UUID would be taken,
// after the first, for duplicates of it, and acknowledged with their work undone. Each is
// dead-lettered instead, and the messages behind them are handled.
func TestConsumerDeadLettersMessagesOfTheNilID(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	for i := range 2 {
		p := publishing(newMessage(t, i))
		p.MessageId = uuid.Nil.String()
		b.publishRaw(t, p)
	}
	b.publishRaw(t, publishing(newMessage(t, 2)))
	dlq := messaging.DeadLetterQueue(b.queue)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == 2 && b.workDone(t) == 1 },
		"want both messages of the nil id dead-lettered and the third handled")
	for _, d := range deadLetters(t, b.ch, b.queue) {
		wantReason(t, d, "message_id is the nil UUID")
	}
	if n := b.workDone(t); n != 1 {
		t.Fatalf("work done %d times, want once (the message with an id of its own)", n)
	}
}

// A payload whose decoding panics (its UnmarshalJSON, or here the event's Validate) would panic
// at every delivery: the message is dead-lettered with the panic as its reason, and the
// consumer, its process alive, handles the messages behind it.
func TestConsumerDeadLettersAMessageWhoseDecodingPanics(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	ev := b.orderPlaced()
	ev.Validate = func(p payload) error {
		if p.N == 13 {
			panic(fmt.Sprintf("no rule for n=%d", p.N)) // a validator's bug
		}
		return nil
	}
	s, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{
		Name: b.queue, URL: testenv.AMQPURL(), Topology: b.topology, Logger: b.log, Metrics: b.metrics,
	})
	if err != nil {
		t.Fatal(err)
	}
	must(t, messaging.Handle(s, ev, workFunc))
	run(t, s.Run)
	testenv.Eventually(t, 10*time.Second, s.Ready, "consumer not ready")
	bad := newMessage(t, 13)
	b.publishRaw(t, publishing(bad))
	b.publishRaw(t, publishing(newMessage(t, 2)))
	dlq := messaging.DeadLetterQueue(b.queue)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == 1 && b.workDone(t) == 1 },
		"want the message whose validation panics dead-lettered and the other handled")
	got := deadLetters(t, b.ch, b.queue)
	if len(got) != 1 || got[0].MessageId != bad.ID.String() {
		t.Fatalf("dead-letter queue held %d messages, want the one whose validation panics", len(got))
	}
	wantReason(t, got[0], "decoding "+eventType+" panicked: no rule for n=13")
	// The developer learns where: the stack, down to the validator.
	if lines := b.logs.Lines("level=ERROR", `msg="decoding panicked"`, "message_id="+bad.ID.String(), "TestConsumerDeadLettersAMessageWhoseDecodingPanics"); len(lines) != 1 {
		t.Errorf("%d lines with the panic's stack, want 1", len(lines))
	}
}

// A message whose headers fill nearly all of a frame, as another publisher may send it (the
// library's publisher leaves room for what the broker adds), is dead-lettered without them:
// with the reason and the rest added, its copy took more than a frame, the broker closed the
// dead-letter connection at every try, and the worker retried it for ever ("could not
// dead-letter message; retrying"), holding the message behind it. The copy keeps the reason,
// what tells the message apart and where it was published, and says that its headers were left
// out; the worker goes on to the next message.
func TestConsumerDeadLettersAMessageWhoseHeadersFillAFrame(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, func(c *messaging.SubscriptionConfig) { c.Concurrency = 1 })
	frame := testenv.Connection(t).Config.FrameSize
	id := uuid.NewString()
	poison := amqp.Publishing{
		MessageId: id, Type: eventType, ContentType: "application/json", AppId: "order",
		Timestamp: time.Now().Add(-time.Hour).Truncate(time.Second), DeliveryMode: amqp.Persistent,
		Body: []byte(`{"n":1}`), // no order_id: doWork says no retry can help
	}
	// Its content header frame: the frame's header and end (8 bytes); class, weight, body size
	// and property flags (14); each short string with its length byte; delivery mode (1) and
	// timestamp (8); the headers' table (4), each a name with its length byte, a type byte and a
	// long string (4 and its bytes). 64 bytes short of the frame: room for the x-delivery-count
	// and x-acquired-count (26 bytes each) its queue adds when it delivers it, none for the copy's
	// reason, time, exchange and routing key.
	size := 8 + 14 + 1 + len(id) + 1 + len(eventType) + 1 + len(poison.ContentType) + 1 + len(poison.AppId) + 1 + 8 + 4 +
		1 + len("tenant") + 5 + len("acme") + 1 + len("pad") + 5
	poison.Headers = amqp.Table{"tenant": "acme", "pad": strings.Repeat("x", frame-64-size)}
	b.publishRaw(t, poison)
	next := amqp.Publishing{MessageId: uuid.NewString(), Type: eventType, ContentType: "application/json", AppId: "order",
		Timestamp: time.Now(), DeliveryMode: amqp.Persistent, Body: fmt.Appendf(nil, `{"order_id":%q,"n":2}`, uuid.NewString())}
	b.publishRaw(t, next)

	testenv.Eventually(t, 15*time.Second, func() bool {
		return testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(b.queue)) == 1 && b.workDone(t) == 1
	}, "want the message whose headers fill a frame dead-lettered and the one behind it handled")
	got := deadLetters(t, b.ch, b.queue)
	if len(got) != 1 || got[0].MessageId != id {
		t.Fatalf("dead-letter queue held %d messages, want the one whose headers fill a frame", len(got))
	}
	d := got[0]
	wantReason(t, d, "payload has no order_id")
	if d.Type != eventType || d.AppId != "order" || !d.Timestamp.Equal(poison.Timestamp) || string(d.Body) != string(poison.Body) {
		t.Errorf("dead letter %+v lost the message's properties or body", d)
	}
	if d.Headers[messaging.HeaderOriginalHeadersDropped] != true || d.Headers["pad"] != nil || d.Headers["tenant"] != nil ||
		d.Headers[messaging.HeaderOriginalExchange] != b.exchange || d.Headers[messaging.HeaderOriginalRoutingKey] != eventType {
		t.Errorf("headers %s: want the message's own left out, that said, and where it was published", brief(d.Headers))
	}
	if lines := b.logs.Lines("level=WARN", "leaves the message's headers out", "message_id="+id); len(lines) != 1 {
		t.Errorf("%d lines saying the copy leaves the headers out, want 1", len(lines))
	}
	if n := len(b.logs.Lines("could not dead-letter message; retrying", "message_id="+id)); n != 0 {
		t.Errorf("%d tries to dead-letter the message failed, want none", n)
	}
}

// A message as large as the publisher lets it be keeps its headers (its traceparent, say) in its
// dead-letter copy: nothing dead-letters the copy again, and the dead-letter queue adds no more
// than its delivery counts. The copy is listed twice (the second basic.get adds its delivery
// count), redriven, and dead-lettered again whole. (Held to the room the broker may take when it
// dead-letters a message, the copy left all the message's headers out.)
func TestConsumerDeadLetterCopyOfAMessageAtThePublishLimitKeepsItsHeaders(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	p := b.publisher(t, testenv.AMQPURL())
	poison, err := messaging.NewMessage(eventType, map[string]any{"n": 1}) // no order_id: doWork says no retry can help
	must(t, err)
	poison.Exchange = b.exchange
	poison.TraceParent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	// The largest headers the publisher takes: it refuses, unsent, any that do not leave room
	// for what the broker may add.
	for n := 128 << 10; ; n-- {
		poison.Headers = map[string]string{"tenant": "acme", "pad": strings.Repeat("x", n)}
		err := p.Publish(context.Background(), []messaging.Message{poison})[0]
		if err == nil {
			break
		}
		if !errors.Is(err, messaging.ErrInvalidEnvelope) || n < 120<<10 {
			t.Fatalf("publish with headers of %d bytes: %v", n, err)
		}
	}
	id := poison.ID.String()
	dlq := messaging.DeadLetterQueue(b.queue)
	cfg := messaging.DeadLetterConfig{URL: testenv.AMQPURL(), Queue: b.queue}
	wantWhole := func(when string, headers amqp.Table) {
		t.Helper()
		if headers["pad"] != poison.Headers["pad"] || headers["tenant"] != "acme" || headers["traceparent"] != poison.TraceParent ||
			headers[messaging.HeaderOriginalHeadersDropped] != nil {
			t.Errorf("%s: the copy's headers are %s, want the message's own kept", when, brief(headers))
		}
	}
	testenv.Eventually(t, 15*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == 1 }, "message not dead-lettered")
	for listing := 1; listing <= 2; listing++ {
		listed, _, err := messaging.ListDeadLetters(context.Background(), cfg, 0)
		if err != nil || len(listed) != 1 || listed[0].MessageID != id {
			t.Fatalf("listing %d: %d dead letters, %v: want the message's copy", listing, len(listed), err)
		}
		wantWhole(fmt.Sprintf("listing %d", listing), listed[0].Headers)
	}
	moved, err := messaging.RedriveDeadLetters(context.Background(), cfg, messaging.DeadLetterSelection{})
	if err != nil || len(moved) != 1 {
		t.Fatalf("redrive moved %d messages: %v", len(moved), err)
	}
	testenv.Eventually(t, 15*time.Second, func() bool {
		return len(b.logs.Lines("message dead-lettered", "message_id="+id)) == 2 && testenv.QueueDepth(t, b.ch, dlq) == 1
	}, "redriven message not dead-lettered again")
	got := deadLetters(t, b.ch, b.queue)
	if len(got) != 1 || got[0].MessageId != id {
		t.Fatalf("dead-letter queue held %d messages, want the message's copy", len(got))
	}
	wantReason(t, got[0], "payload has no order_id")
	wantWhole("dead-lettered again", got[0].Headers)
	if n := len(b.logs.Lines("could not dead-letter message; retrying", "message_id="+id)); n != 0 {
		t.Errorf("%d tries to dead-letter the message failed, want none", n)
	}
}

// brief is headers as %v prints them, a string over 100 bytes (a pad) as its length: it would
// bury the rest.
func brief(headers amqp.Table) string {
	short := make(amqp.Table, len(headers))
	for k, v := range headers {
		if s, ok := v.(string); ok && len(s) > 100 {
			v = fmt.Sprintf("(%d bytes)", len(s))
		}
		short[k] = v
	}
	return fmt.Sprint(short)
}
