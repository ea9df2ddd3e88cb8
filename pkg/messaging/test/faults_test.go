package test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// The consumer's database session is killed in the middle of its transaction: nothing may be
// acknowledged, and the retry does the work exactly once.
func TestConsumerSessionKilledMidTransactionIsNotAcked(t *testing.T) {
	t.Parallel()
	b := setupWith(t, 1) // an admin connection
	b.createWorkTable(t)
	var attempts atomic.Int32
	inTx := make(chan int, 1)
	release := make(chan struct{})
	work := func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		if err := doWork(tx, p, msg); err != nil {
			return err
		}
		if attempts.Add(1) == 1 {
			var pid int
			if err := tx.Raw("SELECT pg_backend_pid()").Scan(&pid).Error; err != nil {
				return err
			}
			inTx <- pid
			<-release
		}
		return nil
	}
	b.consumer(t, testenv.AMQPURL(), b.drv, work, nil)
	msg := newMessage(t, 1)
	b.publishRaw(t, publishing(msg))

	pid := <-inTx
	// The work's transaction is open: the delivery must not be acknowledged yet. (The broker
	// refreshes its queue statistics every few seconds, hence the wait.)
	testenv.Eventually(t, 15*time.Second, func() bool { return unacked(t, b.queue) == 1 },
		"the delivery is not unacknowledged while its work's transaction is open: acked before its commit")
	admin := testenv.OpenPool(t, testenv.DatabaseURL(), 1)
	var killed bool
	if err := admin.Raw("SELECT pg_terminate_backend(?)", pid).Scan(&killed).Error; err != nil || !killed {
		t.Fatalf("terminate backend %d: %v %v", pid, killed, err)
	}
	close(release)

	testenv.Eventually(t, 15*time.Second, func() bool {
		return b.workDone(t) == 1 && testenv.QueueDepth(t, b.ch, b.queue) == 0
	}, "message not handled after its session was killed")
	if a := attempts.Load(); a < 2 {
		t.Fatalf("handler ran %d times; the killed attempt must have been retried", a)
	}
	if n := len(b.logs.Lines("retrying message", msg.ID.String())); n == 0 {
		t.Fatal("the failed attempt was not logged as retried")
	}
	acked := `consumer_messages_total{outcome="acked",queue="` + b.queue + `"} 1`
	testenv.Eventually(t, 5*time.Second, func() bool { return hasMetric(t, b.registry, acked) }, "the message was not acknowledged once")
}

// A batch's deliveries stay unacknowledged while its handlers run in its open transaction (an
// ack sent before them would show). The handler holds the first transaction that reaches a
// second message open; every message is with the consumer by then, so all that are not
// committed must be unacknowledged, that batch's included. Batches form from what the client has handed over at
// once, which is not certain: in each round a first message holds the only worker until the
// broker has sent the others, and rounds go on until one forms.
func TestConsumerBatchIsNotAckedBeforeItsCommit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	const n, rounds = 6, 10
	var mu sync.Mutex
	var lastTx int64
	inTx := 0
	opened, releaseOpener := make(chan struct{}), make(chan struct{})
	var holding sync.Once
	held, release := make(chan struct{}), make(chan struct{})
	work := func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		if err := doWork(tx, p, msg); err != nil {
			return err
		}
		// Each wait ends with the handler's context too: a failed test's consumer must stop.
		if p.N == 0 { // a round's opener
			select {
			case opened <- struct{}{}:
			case <-ctx.Done():
				return ctx.Err()
			}
			select {
			case <-releaseOpener:
			case <-ctx.Done():
				return ctx.Err()
			}
			return nil
		}
		var txid int64
		if err := tx.Raw("SELECT txid_current()").Scan(&txid).Error; err != nil {
			return err
		}
		mu.Lock()
		if txid != lastTx {
			lastTx, inTx = txid, 0
		}
		inTx++
		second := inTx == 2
		mu.Unlock()
		if second {
			holding.Do(func() {
				close(held)
				select {
				case <-release:
				case <-ctx.Done():
				}
			})
		}
		return nil
	}
	b.consumer(t, testenv.AMQPURL(), b.drv, work, func(c *messaging.SubscriptionConfig) { c.BatchSize, c.Concurrency = n, 1 })
	published := 0
	for round := 0; round < rounds; round++ {
		b.publishRaw(t, publishing(newMessage(t, 0)))
		select {
		case <-opened:
		case <-time.After(15 * time.Second):
			t.Fatalf("round %d's first message was not handled within 15 s", round)
		}
		for i := 1; i <= n; i++ {
			b.publishRaw(t, publishing(newMessage(t, round*n+i)))
		}
		published += n + 1
		testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == 0 },
			"the broker did not send the consumer the round's messages")
		releaseOpener <- struct{}{}
		if !batchFormed(t, b, held, published) {
			continue
		}
		committed := int(b.workDone(t))
		testenv.Eventually(t, 15*time.Second, func() bool { return unacked(t, b.queue) == published-committed },
			"%d messages not committed, a batch's among them, but not as many unacknowledged: acked before its commit", published-committed)
		close(release)
		testenv.Eventually(t, 15*time.Second, func() bool {
			return b.workDone(t) == int64(published) && unacked(t, b.queue) == 0
		}, "the messages were not all done and acknowledged after their commits")
		return
	}
	t.Fatalf("no batch of two or more formed in %d rounds", rounds)
}

// batchFormed waits until held closes (a batch of two or more is held open: true) or all
// published messages are done, one at a time (false): the next round must not begin while a
// late batch could still hold the only worker.
func batchFormed(t *testing.T, b *testBundle, held <-chan struct{}, published int) bool {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		select {
		case <-held:
			return true
		case <-time.After(100 * time.Millisecond):
		}
		if b.workDone(t) == int64(published) {
			select {
			case <-held:
				return true
			default:
				return false
			}
		}
	}
	t.Fatalf("the round's %d messages were neither done nor held as a batch within 30 s", published)
	return false
}

// The queue is deleted under a running consumer: the broker cancels each of its workers'
// consumers, and it says so once, declares its topology again and carries on.
func TestConsumerRedeclaresItsQueueAfterItIsDeleted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	c := b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	b.publishRaw(t, publishing(newMessage(t, 1)))
	testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) == 1 }, "first message not handled")

	if _, err := b.ch.QueueDelete(b.queue, false, false, false); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return len(b.logs.Lines("consumer started")) >= 2 && c.Ready() },
		"consumer did not come back after its queue was deleted")
	if n := len(b.logs.Lines("level=WARN", "broker cancelled a consumer; starting a new session")); n != 1 {
		t.Errorf("the broker's cancel of the consumers was logged %d times, want once", n)
	}
	b.publishRaw(t, publishing(newMessage(t, 2)))
	testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) == 2 }, "message after the redeclare not handled")
}

// Connections reset in the middle of a batch and a slow link: the relay loses nothing and
// publishes everything (at least once) without help.
func TestRelayThroughResetsAndLatency(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	r := b.relay(t, b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen)), func(c *messaging.RelayConfig) {
		c.Backoff = messaging.Backoff{Base: 100 * time.Millisecond, Max: 500 * time.Millisecond}
		c.PollInterval = 100 * time.Millisecond
	})
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"slow","type":"latency","attributes":{"latency":50,"jitter":20}}`)); err != nil {
		t.Fatal(err)
	}
	// Every connection is reset 300 ms after it opens: batches break half-way, again and again.
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"reset","type":"reset_peer","stream":"upstream","attributes":{"timeout":300}}`)); err != nil {
		t.Fatal(err)
	}
	ids := b.enqueue(t, 3000)
	run(t, r.Run)
	testenv.Eventually(t, 30*time.Second, func() bool { return len(b.logs.Lines("broker unavailable; relay paused")) > 0 },
		"no batch broke on the resets")
	if err := proxy.Toxics.RemoveToxic(context.Background(), "reset"); err != nil {
		t.Fatal(err)
	}
	b.waitAllSent(t, 60*time.Second)
	b.wantNoRowCharged(t)
	missing, dups, unexpected := countIDs(t, testenv.Drain(t, b.ch, b.queue, 500*time.Millisecond), ids)
	t.Logf("through resets and 50 ms latency: %d missing, %d duplicates (absorbed by inboxes), %d unexpected", missing, dups, unexpected)
	if missing+unexpected > 0 {
		t.Fatalf("%d missing, %d unexpected", missing, unexpected)
	}
}

// A half-open broker connection (traffic silently dropped) is detected by heartbeats in
// bounded time: the consumer reconnects by itself once the network heals.
func TestConsumerDetectsAHalfOpenConnectionByHeartbeat(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	c := b.consumer(t, testenv.AMQPURLVia(t, proxy.Listen), b.drv, workFunc, func(c *messaging.SubscriptionConfig) { c.Heartbeat = time.Second })
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"blackhole","type":"timeout","attributes":{"timeout":0}}`)); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	testenv.Eventually(t, 15*time.Second, func() bool { return !c.Ready() }, "the silent connection was not detected")
	t.Logf("half-open connection detected after %s (heartbeat 1 s)", time.Since(start).Round(100*time.Millisecond))
	if err := proxy.Toxics.RemoveToxic(context.Background(), "blackhole"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 15*time.Second, c.Ready, "consumer did not reconnect")
	b.publishRaw(t, publishing(newMessage(t, 1)))
	testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) == 1 }, "message after the reconnect not handled")
}

// unacked is how many of queue's deliveries (on the default vhost) are not acknowledged yet: a
// passive declare counts only the ready ones.
func unacked(t *testing.T, queue string) int {
	t.Helper()
	out := testenv.RabbitMQCtl(t, "list_queues", "-q", "-p", "/", "--no-table-headers", "name", "messages_unacknowledged")
	for line := range strings.SplitSeq(out, "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == queue {
			n, err := strconv.Atoi(f[1])
			if err != nil {
				t.Fatalf("list_queues: %q: %v", line, err)
			}
			return n
		}
	}
	t.Fatalf("list_queues has no queue %s", queue)
	return 0
}

// A channel the broker closes under one of the consumer's workers (a channel error) ends the
// whole session: the other workers' consumers are cancelled, so their deliveries are not handed
// back to them over and over, and the consumer reconnects and handles what comes next.
func TestConsumerReconnectsWhenOneOfItsChannelsCloses(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	c := b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	closeAConsumerChannel(t, b.queue)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines("consumer disconnected; reconnecting", "PRECONDITION_FAILED")) > 0
	}, "the closed channel did not end the session")
	testenv.Eventually(t, 10*time.Second, c.Ready, "the consumer did not reconnect after one of its channels closed")
	const n = 20
	for i := range n {
		b.publishRaw(t, publishing(newMessage(t, i)))
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) == n }, "messages after the channel's close not handled")
}

// A channel that closes ends the session even while a worker waits out an unavailable
// dependency in place: the worker stops retrying a delivery it could no longer acknowledge,
// and the consumer reconnects at once instead of when the dependency is back.
func TestAClosedChannelEndsAWorkersWaitForADependency(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	var down atomic.Bool
	down.Store(true)
	var attempts atomic.Int32
	c := b.consumer(t, testenv.AMQPURL(), b.drv, func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		if down.Load() {
			attempts.Add(1)
			return messaging.Unavailable(errors.New("test: the dependency is down"))
		}
		return workFunc(ctx, tx, p, msg)
	}, nil)
	b.publishRaw(t, publishing(newMessage(t, 1)))
	testenv.Eventually(t, 10*time.Second, func() bool { return attempts.Load() >= 3 }, "the handler is not waiting out its dependency")
	closeAConsumerChannel(t, b.queue)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines("consumer disconnected; reconnecting", "PRECONDITION_FAILED")) > 0 && c.Ready()
	}, "the consumer did not reconnect while a worker waited for its dependency")
	down.Store(false)
	testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) == 1 }, "the message was not handled once the dependency was back")
}

// RabbitMQ 4.3 cancels a consumer whose delivery outlived the consumer timeout, and leaves its
// channel open, where earlier versions closed the channel. Either way the session ends, and the
// consumer comes back with all its workers, instead of going on with one fewer for good. Before
// 4.3 the test closes one consumer's channel itself, as the broker then does (the test above).
func TestConsumerStartsANewSessionWhenTheBrokerCancelsOneOfItsConsumers(t *testing.T) {
	t.Parallel()
	version, _ := testenv.Connection(t).Properties["version"].(string)
	cancels := releaseAtLeast(version, 4, 3)
	b := setup(t)
	b.createWorkTable(t)
	if cancels {
		policy := testenv.UniqueName("consumer-timeout")
		testenv.RabbitMQCtl(t, "set_policy", "-p", "/", "--apply-to", "queues", "--priority", "100", policy,
			"^"+regexp.QuoteMeta(b.queue)+"$", `{"consumer-timeout":1000}`)
		t.Cleanup(func() { testenv.RabbitMQCtl(t, "clear_policy", "-p", "/", policy) })
	}
	var held atomic.Bool
	held.Store(!cancels) // before 4.3, no delivery is held
	release := make(chan struct{})
	const workers = 2
	c := b.consumer(t, testenv.AMQPURL(), b.drv, func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
		if held.CompareAndSwap(false, true) {
			<-release // the first delivery, past the consumer timeout
		}
		return workFunc(ctx, tx, p, msg)
	}, func(c *messaging.SubscriptionConfig) { c.Concurrency = workers })
	b.publishRaw(t, publishing(newMessage(t, 0)))
	consumers := func() int {
		q, err := b.ch.QueueDeclarePassive(b.queue, true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		return q.Consumers
	}
	ended := "broker cancelled a consumer; starting a new session"
	if cancels {
		testenv.Eventually(t, 30*time.Second, func() bool { return consumers() < workers }, "the broker did not cancel the consumer that held a delivery past its timeout")
	} else {
		testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) == 1 }, "the first message was not handled")
		closeAConsumerChannel(t, b.queue)
		ended = "consumer disconnected; reconnecting"
	}
	close(release)
	testenv.Eventually(t, 15*time.Second, func() bool {
		return len(b.logs.Lines("level=WARN", ended)) > 0 && consumers() == workers && c.Ready()
	}, "the consumer did not start a new session with its %d workers after the broker ended one (RabbitMQ %s)", workers, version)
	for i := 1; i <= 4; i++ {
		b.publishRaw(t, publishing(newMessage(t, i)))
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) == 5 }, "the messages were not each handled once")
}

// closeAConsumerChannel makes the broker close one of the channels consuming queue (on the
// default vhost), as it closes a channel after a channel error: it acknowledges, on that
// channel's behalf, a delivery tag the channel never had, as the connection hands a client's
// method to its channel. RabbitMQ 3.x lists a consumer as a tuple, 4.x as a property list.
func closeAConsumerChannel(t *testing.T, queue string) {
	t.Helper()
	out := testenv.RabbitMQCtl(t, "eval", fmt.Sprintf(`
Field = fun(C, Key, _) when is_list(C) -> proplists:get_value(Key, C); (C, _, Pos) -> element(Pos, C) end,
case [Field(C, channel_pid, 2) || C <- rabbit_amqqueue:consumers_all(<<"/">>), element(4, Field(C, queue_name, 1)) =:= <<%q>>] of
  [Ch | _] -> gen_server2:cast(Ch, {method, {'basic.ack', 999999, false}, none, noflow}), closed;
  [] -> no_consumer
end.`, queue))
	if strings.TrimSpace(out) != "closed" {
		t.Fatalf("no channel consumes %s: %s", queue, out)
	}
}

// A relay that starts while the broker is away reports it down, and reports it back as soon as
// it is, with no row to send: BrokerUnavailable reads that gauge, and must not keep firing
// until the next event, which may be a quiet night away.
func TestRelayStartedInAnOutageSeesTheBrokerBackWithoutARow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	proxy.Stop()
	run(t, b.relay(t, b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen)), nil).Run)
	gauge := `outbox_relay_broker_up{exchange="` + b.exchange + `"}`
	testenv.Eventually(t, 10*time.Second, func() bool { return hasMetric(t, b.registry, gauge+" 0") }, "the relay did not report the broker down")
	must(t, proxy.Start())
	// The gauge is set before the line is logged: both are polled.
	testenv.Eventually(t, 10*time.Second, func() bool {
		return hasMetric(t, b.registry, gauge+" 1") && len(b.logs.Lines("broker available again; relay resumed")) > 0
	}, "the broker is back, and the relay, with no row to send, still reports it down")
	if lines := b.logs.Lines("broker available again; relay resumed"); len(lines) != 1 {
		t.Fatalf("want one line for the end of the outage, got %q", lines)
	}
}

// A relay started in an outage, with rows due, claims none of them until its probe finds the
// broker: a claim would hold them locked while the publish dials a broker known to be gone.
// Once it is back, they go.
func TestRelayStartedInAnOutageClaimsNothingUntilTheBrokerIsBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	proxy.Stop()
	ids := b.enqueue(t, 2)
	db := &countingDB{DB: b.drv.DB()}
	run(t, b.relay(t, b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen)), func(c *messaging.RelayConfig) { c.DB = db }).Run)
	gauge := `outbox_relay_broker_up{exchange="` + b.exchange + `"}`
	testenv.Eventually(t, 10*time.Second, func() bool { return hasMetric(t, b.registry, gauge+" 0") }, "the relay did not report the broker down")
	began := time.Now()
	for time.Since(began) < time.Second { // a window of observation, not a wait for anything
		time.Sleep(100 * time.Millisecond)
	}
	if n := db.begun.Load(); n != 0 {
		t.Fatalf("%d transactions begun while the broker was known to be down; want none", n)
	}
	must(t, proxy.Start())
	testenv.Eventually(t, 10*time.Second, func() bool { return b.unprocessed(t) == 0 }, "the rows were not sent once the broker was back")
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
}

// A relay with nothing to send sees the broker go, as it sees it come back: the outage is
// logged and outbox_relay_broker_up says so when it begins, not at the next row.
func TestRelayWithNothingToSendSeesTheBrokerGo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	run(t, b.relay(t, b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen)), nil).Run)
	gauge := `outbox_relay_broker_up{exchange="` + b.exchange + `"}`
	testenv.Eventually(t, 10*time.Second, func() bool { return hasMetric(t, b.registry, gauge+" 1") }, "the relay did not report the broker up")
	proxy.Stop()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return hasMetric(t, b.registry, gauge+" 0") && len(b.logs.Lines("broker unavailable; relay paused")) == 1
	}, "the broker went, and the relay, with no row to send, did not notice")
	must(t, proxy.Start())
	testenv.Eventually(t, 10*time.Second, func() bool {
		return hasMetric(t, b.registry, gauge+" 1") && len(b.logs.Lines("broker available again; relay resumed")) == 1
	}, "the broker is back, and the relay still reports it down")
	if lines := b.logs.Lines("broker unavailable; relay paused"); len(lines) != 1 {
		t.Fatalf("want one line for the start of the outage, got %q", lines)
	}
}

// countingDB counts the transactions begun on a DB, and the Commits and Rollbacks that ended
// them.
type countingDB struct {
	messaging.DB
	begun, ended atomic.Int64
}

func (d *countingDB) Begin(ctx context.Context) (messaging.TxExecutor, error) {
	d.begun.Add(1)
	tx, err := d.DB.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return countedTx{TxExecutor: tx, ended: &d.ended}, nil
}

// countedTx is a transaction of a countingDB.
type countedTx struct {
	messaging.TxExecutor
	ended *atomic.Int64
}

func (tx countedTx) Commit(ctx context.Context) error {
	defer tx.ended.Add(1)
	return tx.TxExecutor.Commit(ctx)
}

func (tx countedTx) Rollback(ctx context.Context) error {
	defer tx.ended.Add(1)
	return tx.TxExecutor.Rollback(ctx)
}

// A Sender that cannot be probed for the broker: its relay's retries during an outage, each a
// claim of a batch and a publish, double as BrokerRetry says (100 ms, 200, 400, … up to 2 s).
// They stayed at the first step, a batch claimed every 100 ms for as long as the outage lasted.
func TestRelayWithoutAProbeBacksOffDuringAnOutage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	unprobed := struct{ messaging.Sender }{b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen))}
	proxy.Stop()
	db := &countingDB{DB: b.drv.DB()}
	b.enqueue(t, 1)
	run(t, b.relay(t, unprobed, func(c *messaging.RelayConfig) { c.DB, c.Lanes, c.DisableNotify = db, 1, true }).Run)
	began := time.Now()
	for time.Since(began) < 3*time.Second { // a window of observation, not a wait for anything
		time.Sleep(100 * time.Millisecond)
	}
	// 100 + 200 + 400 + 800 + 1,600 ms, jittered below each step: about 6; at 100 ms, about 30.
	if n := db.begun.Load(); n > 10 {
		t.Fatalf("%d batches in 3 s of an outage, want the broker retry's doubling (about 6)", n)
	}
	if n := b.unprocessed(t); n != 1 {
		t.Fatalf("%d rows unsent, want the one enqueued, waiting", n)
	}
}

// A Sender that cannot be probed for the broker: its relay learns the broker is back from the
// next row's publish, and meanwhile, with nothing to send, claims at its poll's pace, not at
// the broker retry's.
func TestRelayWithoutAProbeIdlesAtItsPollAfterAnOutage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	unprobed := struct{ messaging.Sender }{b.publisher(t, testenv.AMQPURLVia(t, proxy.Listen))}
	db := &countingDB{DB: b.drv.DB()}
	const poll = time.Second
	run(t, b.relay(t, unprobed, func(c *messaging.RelayConfig) { c.DB, c.Lanes, c.PollInterval = db, 1, poll }).Run)
	proxy.Stop()
	b.enqueue(t, 1)
	gauge := `outbox_relay_broker_up{exchange="` + b.exchange + `"}`
	testenv.Eventually(t, 10*time.Second, func() bool { return hasMetric(t, b.registry, gauge+" 0") }, "the relay did not report the broker down")
	must(t, b.db.DB.Exec("DELETE FROM outbox_messages").Error) // the row went another way
	must(t, proxy.Start())

	before, began := db.begun.Load(), time.Now()
	for time.Since(began) < 3*poll { // a window of observation, not a wait for anything
		time.Sleep(100 * time.Millisecond)
	}
	// A poll is jittered; the broker retry's pace would be about 30.
	if n := db.begun.Load() - before; n > 3*2+2 {
		t.Fatalf("%d transactions in %s with nothing to send, polling every %s", n, 3*poll, poll)
	}
}
