package test

import (
	"context"
	"errors"
	"fmt"
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
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// start runs fn in the background; stop cancels it and returns what it returned, failing t
// if that takes over 10 s.
func start(t *testing.T, fn func(ctx context.Context) error) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	t.Cleanup(cancel)
	return func() error {
		cancel()
		select {
		case err := <-done:
			return err
		case <-time.After(10 * time.Second):
			t.Fatal("did not stop within 10 s of cancellation")
			return nil
		}
	}
}

// startConsumer starts a subscription of b's queue, with work as its handler and cfg tweaked,
// waits until it consumes, and returns how to stop it.
func (b *testBundle) startConsumer(t *testing.T, work messaging.Handler[*gorm.DB, payload], tweak func(*messaging.SubscriptionConfig)) (stop func() error) {
	t.Helper()
	cfg := messaging.SubscriptionConfig{Name: b.queue, URL: testenv.AMQPURL(), Topology: b.topology, Logger: b.log, Metrics: b.metrics}
	tweak(&cfg)
	c, err := messaging.NewSubscription(b.drv, cfg)
	if err != nil {
		t.Fatal(err)
	}
	must(t, messaging.Handle(c, b.orderPlaced(), work))
	stop = start(t, c.Run)
	testenv.Eventually(t, 10*time.Second, c.Ready, "consumer not ready")
	return stop
}

// heldPublish holds the first Publish until released, after saying it has begun.
type heldPublish struct {
	messaging.Sender
	begun, release chan struct{}
	once           sync.Once
}

func (h *heldPublish) Publish(ctx context.Context, msgs []messaging.Message) []error {
	h.once.Do(func() {
		close(h.begun)
		<-h.release
	})
	return h.Sender.Publish(ctx, msgs)
}

// A batch in flight at shutdown is published and marked within the grace period, not
// abandoned to be sent again by the next relay.
func TestRelayFinishesTheBatchInFlightAtShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	held := &heldPublish{Sender: b.publisher(t, testenv.AMQPURL()), begun: make(chan struct{}), release: make(chan struct{})}
	r := b.relay(t, held, func(c *messaging.RelayConfig) { c.Lanes, c.ShutdownGrace = 1, 5*time.Second })
	ids := b.enqueue(t, 5)
	stop := start(t, r.Run)
	<-held.begun

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	select {
	case err := <-stopped:
		t.Fatalf("Run returned (%v) with a batch still publishing", err)
	case <-time.After(300 * time.Millisecond): // the shutdown is under way and must wait
	}
	close(held.release)
	if err := <-stopped; err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if n := b.unprocessed(t); n != 0 {
		t.Fatalf("%d of the 5 rows in flight at shutdown are unsent, want 0: the batch was abandoned", n)
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
}

// confirmedAtTheCut publishes its first window and then holds its verdicts until the grace
// ends: a broker whose confirms came just as it did.
type confirmedAtTheCut struct {
	messaging.Sender
	begun chan struct{}
	once  sync.Once
}

func (c *confirmedAtTheCut) Publish(ctx context.Context, msgs []messaging.Message) []error {
	first := false
	c.once.Do(func() { first = true })
	if !first {
		return c.Sender.Publish(ctx, msgs)
	}
	verdicts := c.Sender.Publish(context.WithoutCancel(ctx), msgs)
	close(c.begun)
	<-ctx.Done()
	return verdicts
}

// What the broker confirmed as the shutdown grace ended is recorded: the grace ended the
// batch's transaction with the wait for the confirms, and the confirmed rows, rolled back,
// went out again at the next start.
func TestRelayRecordsWhatWasConfirmedAsTheGraceEnded(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cut := &confirmedAtTheCut{Sender: b.publisher(t, testenv.AMQPURL()), begun: make(chan struct{})}
	r := b.relay(t, cut, func(c *messaging.RelayConfig) { c.Lanes, c.ShutdownGrace = 1, 200*time.Millisecond })
	ids := b.enqueue(t, 3)
	stop := start(t, r.Run)
	<-cut.begun
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if n := b.unprocessed(t); n != 0 {
		t.Fatalf("%d of the 3 rows confirmed as the grace ended are unsent, want 0: they would go out again", n)
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
}

// A handler the end of the grace cuts off did not fail on its own: the message is handed back
// (a nack), not rejected as failed, which would spend one of its deliveries (or, on its last,
// dead-letter it with "context canceled" as its reason). Also when the grace ends before the
// broker has confirmed the consumers' cancels (the broker-to-client stream slowed down to a
// second), while the session is still on.
func TestConsumerHandsBackAMessageTheGraceCutOff(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		latency   int  // ms, from the broker to the client, once the handler runs
		permanent bool // the handler calls its cut-off permanent, as a failed lookup may
	}{{"cancel confirmed at once", 0, false}, {"cancel confirmed after the grace", 1000, false}, {"the handler's cut-off called permanent", 0, true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			begun := make(chan struct{})
			var once sync.Once
			stuck := func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
				once.Do(func() { close(begun) })
				<-ctx.Done()
				if tc.permanent {
					return messaging.Permanent(fmt.Errorf("look the customer up: %w", ctx.Err()))
				}
				return ctx.Err()
			}
			proxy := testenv.Proxy(t, testenv.AMQPHost(t))
			stop := b.startConsumer(t, stuck, func(c *messaging.SubscriptionConfig) {
				c.URL = testenv.AMQPURLVia(t, proxy.Listen)
				c.Retries, c.ShutdownGrace = 1, 300*time.Millisecond
			})
			msg := newMessage(t, 0)
			b.publishRaw(t, publishing(msg))
			<-begun
			if tc.latency > 0 {
				toxic := fmt.Sprintf(`{"name":"slow","type":"latency","stream":"downstream","attributes":{"latency":%d}}`, tc.latency)
				if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(toxic)); err != nil {
					t.Fatal(err)
				}
			}
			b.stopWantHandedBack(t, stop, msg)
			testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == 1 },
				"the message is not back in its queue")
		})
	}
}

// Once the shutdown begins no new batch starts, even while the broker has yet to confirm the
// consumer's cancel (slowed here to 600 ms, within the second the consumer waits for it): the
// worker that finishes its message in that moment hands the deliveries waiting in its prefetch
// back, unstarted, rather than starting work the grace may cut off.
func TestConsumerStartsNoWorkOnceTheShutdownBegins(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	sub, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{Name: b.queue, URL: testenv.AMQPURLVia(t, proxy.Listen),
		Topology: b.topology, Logger: b.log, Metrics: b.metrics, Concurrency: 1, BatchSize: 1, Prefetch: 10, ShutdownGrace: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	begun, shutdown := make(chan struct{}), make(chan struct{})
	var started atomic.Int32
	must(t, messaging.Handle(sub, b.orderPlaced(), func(ctx context.Context, tx *gorm.DB, _ payload, _ messaging.Message) error {
		if started.Add(1) == 1 {
			close(begun)
			<-shutdown // finished once the shutdown began, while the cancel is on its way
		}
		return tx.Exec("SELECT 1").Error
	}))
	stop := start(t, func(ctx context.Context) error {
		context.AfterFunc(ctx, func() { close(shutdown) })
		return sub.Run(ctx)
	})
	testenv.Eventually(t, 10*time.Second, sub.Ready, "consumer not ready")
	msgs := make([]messaging.Message, 5)
	for i := range msgs {
		msgs[i] = newMessage(t, i)
		b.publishRaw(t, publishing(msgs[i]))
	}
	<-begun
	// Every message delivered, the first in hand and the rest in the worker's prefetch.
	testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == 0 }, "not every message was delivered")
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"slow","type":"latency","stream":"downstream","attributes":{"latency":600}}`)); err != nil {
		t.Fatal(err)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if n := started.Load(); n != 1 {
		t.Fatalf("work started on %d messages, want the one in hand when the shutdown began", n)
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == len(msgs)-1 },
		"the messages not started are not back in their queue")
}

// A message whose attempt the end of the grace cuts off while the database does not answer
// (its traffic swallowed) is handed back at once, uncharged: the attempt was called off, and
// asking the silent database whether it is there (up to 2 s, after a rollback that waits as
// long) would hold the hand-back until the attempt is abandoned, 2.5 s after the grace, half a
// second before the connection's close, which RabbitMQ 4.3 counts as a failure.
func TestConsumerHandsBackAMessageTheGraceCutOffWhileTheDatabaseIsSilent(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+2)
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.DatabaseHost(t))
	drv, err := gormdriver.New(testenv.OpenPool(t, testenv.URLVia(t, b.db.URL, proxy.Listen), 2))
	if err != nil {
		t.Fatal(err)
	}
	sub, err := messaging.NewSubscription(drv, messaging.SubscriptionConfig{Name: b.queue, URL: testenv.AMQPURL(), Topology: b.topology,
		Logger: b.log, Metrics: b.metrics, Retries: 1, ShutdownGrace: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	begun := make(chan struct{})
	var once sync.Once
	must(t, messaging.Handle(sub, b.orderPlaced(), func(ctx context.Context, tx *gorm.DB, _ payload, _ messaging.Message) error {
		if err := tx.WithContext(ctx).Exec("SELECT 1").Error; err != nil {
			return err
		}
		once.Do(func() { close(begun) })
		<-ctx.Done()
		return ctx.Err()
	}))
	stop := start(t, sub.Run)
	testenv.Eventually(t, 10*time.Second, sub.Ready, "consumer not ready")
	msg := newMessage(t, 0)
	b.publishRaw(t, publishing(msg))
	<-begun
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"silence","type":"timeout","attributes":{"timeout":0}}`)); err != nil {
		t.Fatal(err)
	}
	b.stopWantHandedBack(t, stop, msg)
	b.wantBackUncharged(t, []string{msg.ID.String()}, false)
}

// A handler that ignores its context at shutdown is abandoned 2.5 s after the grace, and its
// message handed back, uncharged, before the connection closes. Closed a second after the grace,
// as it was, the connection took the message back itself, the nack failed ("could not nack"),
// and RabbitMQ 4.x counted that return as a failed delivery: a handler that hangs at every
// deploy spent one of its message's deliveries each time, with no reason recorded.
func TestConsumerHandsBackTheMessageOfAHandlerThatIgnoresTheShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	stuck, begun := ignoringTheShutdown(t)
	const grace = 300 * time.Millisecond
	stop := b.startConsumer(t, stuck, func(c *messaging.SubscriptionConfig) {
		c.HandlerTimeout, c.ShutdownGrace = time.Minute, grace
	})
	msg := newMessage(t, 0)
	b.publishRaw(t, publishing(msg))
	<-begun
	began := time.Now()
	b.stopWantHandedBack(t, stop, msg)
	wantReturnedWithinTheBound(t, time.Since(began), grace)
	if n := len(b.logs.Lines("handler did not return at the shutdown", msg.ID.String())); n != 1 {
		t.Fatalf("%d lines of the handler abandoned at the shutdown, want 1", n)
	}
	b.wantBackUncharged(t, []string{msg.ID.String()}, false)
}

// A broker that stops answering as the shutdown begins does not take Run past its bound either:
// the attempt of a handler that ignores its context is given up 2.5 s after the grace, and the
// connection's close, which waited its own second for an answer that never came, ends by the
// time the shutdown closes the connection regardless, 3 s after the grace. Run took 3.5 s past
// the grace: with the default grace, past a service's 8 s to stop.
func TestConsumerStaysWithinItsShutdownBoundWhenTheBrokerStopsAnswering(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fwd := newCountingForwarder(t, testenv.AMQPHost(t))
	stuck, begun := ignoringTheShutdown(t)
	const grace = 300 * time.Millisecond
	stop := b.startConsumer(t, stuck, func(c *messaging.SubscriptionConfig) {
		c.URL = testenv.AMQPURLVia(t, fwd.addr)
		c.HandlerTimeout, c.ShutdownGrace = time.Minute, grace
	})
	msg := newMessage(t, 0)
	b.publishRaw(t, publishing(msg))
	<-begun
	fwd.stall() // what the client sends still reaches the broker: the nack among it
	began := time.Now()
	b.stopWantHandedBack(t, stop, msg)
	wantReturnedWithinTheBound(t, time.Since(began), grace)
	b.wantBackUncharged(t, []string{msg.ID.String()}, false)
}

// ignoringTheShutdown is a handler that ignores its context, returning only once the test is
// over; begun closes when it is first called.
func ignoringTheShutdown(t *testing.T) (stuck messaging.Handler[*gorm.DB, payload], begun <-chan struct{}) {
	started, release := make(chan struct{}), make(chan struct{})
	t.Cleanup(func() { close(release) })
	var once sync.Once
	return func(context.Context, *gorm.DB, payload, messaging.Message) error {
		once.Do(func() { close(started) })
		<-release // its ctx ignored
		return nil
	}, started
}

// wantReturnedWithinTheBound fails t unless a subscription with a handler that ignores the
// shutdown returned (took after the shutdown began) within its grace and 3 s: the attempt is
// given up 2.5 s after the grace, and the connection closed 3 s after it at the latest. 300 ms
// are left for a loaded machine's scheduling: the fault this guards took 3.5 s.
func wantReturnedWithinTheBound(t *testing.T, took, grace time.Duration) {
	t.Helper()
	if bound := grace + 3*time.Second + 300*time.Millisecond; took > bound {
		t.Errorf("Run returned %s after the shutdown began, want within %s: the grace (%s) and 3 s",
			took.Round(10*time.Millisecond), bound, grace)
	}
}

// A shutdown in the middle of a session's setup hands back, uncharged, what the consumers that
// had started already were sent: the setup stops, and they are cancelled and their deliveries
// nacked, where closing the connection at once returned them counted on RabbitMQ 4.3. The link
// is slowed down both ways, so that the setup's calls take long enough to be cut in the middle.
func TestConsumerHandsBackWhatItsSetupWasSentWhenStoppedMidSetup(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := make([]string, 40)
	for i := range ids {
		msg := newMessage(t, i)
		ids[i] = msg.ID.String()
		b.publishRaw(t, publishing(msg))
	}
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	for _, stream := range []string{"upstream", "downstream"} {
		toxic := fmt.Sprintf(`{"name":"slow-%s","type":"latency","stream":%q,"attributes":{"latency":50}}`, stream, stream)
		if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(toxic)); err != nil {
			t.Fatal(err)
		}
	}
	sub, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{Name: b.queue, URL: testenv.AMQPURLVia(t, proxy.Listen),
		Topology: b.topology, Logger: b.log, Metrics: b.metrics, Concurrency: 8, Prefetch: 5})
	if err != nil {
		t.Fatal(err)
	}
	must(t, messaging.Handle(sub, b.orderPlaced(), workFunc))
	stop := start(t, sub.Run)
	// Some consumers started, and were sent their prefetch; not all of them yet.
	testenv.Eventually(t, 30*time.Second, func() bool {
		q, err := b.ch.QueueDeclarePassive(b.queue, true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		return q.Consumers > 0
	}, "no consumer started")
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if sub.Ready() {
		t.Fatal("the setup was not cut: the subscription became ready")
	}
	b.wantBackUncharged(t, ids, true) // the consumers that had not started were sent nothing
}

// A broker slower to confirm the consumers' cancels than the consumer waits for (a second)
// does not hold the shutdown up until it does: the streams it has not confirmed are ended
// regardless, and Run returns within that second and the connection's close deadline (another).
func TestConsumerStopsWithoutTheBrokersLateCancelConfirmation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	stop := b.startConsumer(t, workFunc, func(c *messaging.SubscriptionConfig) {
		c.URL = testenv.AMQPURLVia(t, proxy.Listen)
		c.ShutdownGrace = 5 * time.Second
	})
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"slow","type":"latency","stream":"downstream","attributes":{"latency":4000}}`)); err != nil {
		t.Fatal(err)
	}
	begin := time.Now()
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if took := time.Since(begin); took > 3*time.Second {
		t.Fatalf("Run returned %s after the cancellation, waiting for the broker's confirmations (4 s away); want within the cancels' 1 s and the close's 1 s", took.Round(time.Millisecond))
	}
}

// A message whose handler runs at shutdown is committed and acknowledged within the grace
// period: not requeued to be handled again.
func TestConsumerFinishesTheMessageInFlightAtShutdown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	begun, release := make(chan struct{}), make(chan struct{})
	work := func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		close(begun)
		<-release
		return doWork(tx, p, msg)
	}
	stop := b.startConsumer(t, work, func(c *messaging.SubscriptionConfig) { c.ShutdownGrace = 5 * time.Second })
	msg := newMessage(t, 1)
	b.publishRaw(t, publishing(msg))
	<-begun

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	select {
	case err := <-stopped:
		t.Fatalf("Run returned (%v) with a handler still running", err)
	case <-time.After(300 * time.Millisecond):
	}
	close(release)
	if err := <-stopped; err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if w := b.workDone(t); w != 1 {
		t.Fatalf("work done %d times, want the 1 in flight at shutdown", w)
	}
	// Acknowledged: with its consumer gone, nothing is left to redeliver.
	if n := testenv.QueueDepth(t, b.ch, b.queue); n != 0 {
		t.Fatalf("%d messages back in the queue after shutdown, want 0: the finished work was not acknowledged", n)
	}
}

// Two batches holding the same messages in opposite orders claim them in id order, so the
// second waits for the first instead of deadlocking with it. A batch's messages are claimed in
// one statement (statements.ClaimInbox), row after row: a trigger that pauses before each row
// makes the two claims interleave, as a busy database may, for as long as it takes each to hold
// one row and want the other's.
func TestOverlappingBatchesDoNotDeadlock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, q := range []string{
		`CREATE FUNCTION pause() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.3); RETURN NEW; END $$`,
		`CREATE TRIGGER pause BEFORE INSERT ON inbox_messages FOR EACH ROW EXECUTE FUNCTION pause()`,
	} {
		if err := b.db.DB.Exec(q).Error; err != nil {
			t.Fatal(err)
		}
	}
	m1, m2 := newMessage(t, 1), newMessage(t, 2)
	claim := func(ids ...uuid.UUID) (claimed int, err error) {
		ctx := context.Background()
		tx, err := b.drv.DB().Begin(ctx)
		if err != nil {
			return 0, err
		}
		defer func() { _ = tx.Rollback(ctx) }()
		list := make([]string, len(ids))
		for i, id := range ids {
			list[i] = id.String()
		}
		rows, err := tx.Query(ctx, statements.ClaimInbox, "{"+strings.Join(list, ",")+"}", b.queue)
		if err != nil {
			return 0, err
		}
		for rows.Next() {
			claimed++
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return 0, err
		}
		return claimed, tx.Commit(ctx)
	}
	var wg sync.WaitGroup
	errs, claimed := make([]error, 2), make([]int, 2)
	wg.Go(func() { claimed[0], errs[0] = claim(m1.ID, m2.ID) })
	wg.Go(func() { claimed[1], errs[1] = claim(m2.ID, m1.ID) })
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("overlapping batches: %v", err)
	}
	if claimed[0]+claimed[1] != 2 {
		t.Fatalf("the batches claimed %d and %d messages, want each of the 2 claimed once", claimed[0], claimed[1])
	}
	if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM inbox_messages"); n != 2 {
		t.Fatalf("%d inbox records, want 2", n)
	}
}

// timesDelivered is a quorum queue's count of d's earlier deliveries that it holds against it.
func timesDelivered(d amqp.Delivery) int64 {
	n, _ := d.Headers["x-delivery-count"].(int64)
	return n
}

// Messages that their consumer still holds at shutdown, waiting out a dependency, are handed
// back as not failed: a nack, not a reject, and only once every consumer of the subscription is
// cancelled, so that the broker neither delivers them to it again nor gets them back a second
// time from the closing connection, and charges them no more than any other hand-back. RabbitMQ
// 4.3 counts only rejects towards the delivery limit; the test compares the consumer's
// hand-back with a plain nack, which each broker counts its own way. Each worker holds one
// message (prefetch 1), so that every worker's hand-back races the cancels.
func TestConsumerHandsBackMessagesAtShutdownUncharged(t *testing.T) {
	t.Parallel()
	b := setup(t)
	away := func(context.Context, *gorm.DB, payload, messaging.Message) error {
		return messaging.Unavailable(errors.New("database away"))
	}
	const workers = 8
	stop := b.startConsumer(t, away, func(c *messaging.SubscriptionConfig) {
		c.Concurrency, c.Prefetch = workers, 1
		c.RetryBackoff = messaging.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond}
	})
	ids := make([]string, workers)
	for i := range ids {
		msg := newMessage(t, i)
		ids[i] = msg.ID.String()
		b.publishRaw(t, publishing(msg))
	}
	testenv.Eventually(t, 10*time.Second, func() bool {
		for _, id := range ids {
			if len(b.logs.Lines("dependency unavailable", id)) == 0 {
				return false
			}
		}
		return true
	}, "not every worker started waiting out the dependency")
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if lines := b.logs.Lines("could not nack"); len(lines) != 0 {
		t.Fatalf("a hand-back failed, so the broker took the message back by itself: %q", lines)
	}
	b.wantBackUncharged(t, ids, false)
}

// stopWantHandedBack stops a consumer that holds msg and fails t unless msg was handed back:
// not returned to the queue as failed, nor dead-lettered, nor left to the closing connection.
func (b *testBundle) stopWantHandedBack(t *testing.T, stop func() error, msg messaging.Message) {
	t.Helper()
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	id := "message_id=" + msg.ID.String()
	var lines []string
	for _, charged := range []string{"returning message to the queue", "dead-lettered", "could not nack"} {
		lines = append(lines, b.logs.Lines(id, charged)...)
	}
	if len(lines) != 0 {
		t.Fatalf("the message cut off by the shutdown was not handed back: %q", lines)
	}
}

// wantBackUncharged takes the messages ids back from the queue, where a stopped consumer
// handed them back, and fails t for each whose delivery count grew more than a plain nack
// makes it grow: the broker counted its return as a failure. It grew less only for a message
// never delivered, which fails t too unless someUndelivered allows it.
func (b *testBundle) wantBackUncharged(t *testing.T, ids []string, someUndelivered bool) {
	t.Helper()
	// takeAll gets every message back from the queue, by id.
	takeAll := func() map[string]amqp.Delivery {
		t.Helper()
		got := make(map[string]amqp.Delivery, len(ids))
		testenv.Eventually(t, 5*time.Second, func() bool {
			d, ok, err := b.ch.Get(b.queue, false)
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				got[d.MessageId] = d
			}
			return len(got) == len(ids)
		}, "the messages are not all back in the queue")
		return got
	}
	afterShutdown := takeAll()
	for _, d := range afterShutdown {
		if err := d.Nack(false, true); err != nil {
			t.Fatal(err)
		}
	}
	afterNack := takeAll()
	for _, d := range afterNack {
		if err := d.Ack(false); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range ids {
		byConsumer, byNack := timesDelivered(afterShutdown[id]), timesDelivered(afterNack[id])-timesDelivered(afterShutdown[id])
		switch {
		case byConsumer > byNack:
			t.Errorf("message %s: the hand-back at shutdown added %d to its delivery count, a nack adds %d: it was charged as a failure", id, byConsumer, byNack)
		case byConsumer < byNack && !someUndelivered:
			t.Errorf("message %s: the shutdown added %d to its delivery count, a nack adds %d: it was never delivered, and the test shows nothing", id, byConsumer, byNack)
		}
	}
}

// Deliveries still on the wire when the consumers are cancelled at shutdown reach the workers
// and are handed back as not failed, as those they held already: a cancel that did not wait for
// the broker's confirmation made the client drop them, unacknowledged until the closing
// connection returned them, which RabbitMQ 4.3 counts as failed deliveries. The
// broker-to-client stream is slowed down, so that they are sent before the cancel and arrive
// after it; the handler waits out a dependency, so that none is done before the hand-back.
func TestConsumerHandsBackDeliveriesOnTheWireAtShutdownUncharged(t *testing.T) {
	t.Parallel()
	b := setup(t)
	away := func(context.Context, *gorm.DB, payload, messaging.Message) error {
		return messaging.Unavailable(errors.New("database away"))
	}
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	stop := b.startConsumer(t, away, func(c *messaging.SubscriptionConfig) {
		c.URL = testenv.AMQPURLVia(t, proxy.Listen)
		c.Concurrency, c.Prefetch = 1, 10
	})
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"slow","type":"latency","stream":"downstream","attributes":{"latency":300}}`)); err != nil {
		t.Fatal(err)
	}
	ids := make([]string, 5)
	for i := range ids {
		msg := newMessage(t, i)
		ids[i] = msg.ID.String()
		b.publishRaw(t, publishing(msg))
	}
	// Delivered, as far as the broker knows: none is left ready in the queue.
	testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == 0 }, "the messages were not delivered")
	if err := stop(); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if lines := b.logs.Lines("could not nack"); len(lines) != 0 {
		t.Fatalf("a hand-back failed, so the broker took the message back by itself: %q", lines)
	}
	b.wantBackUncharged(t, ids, false)
}
