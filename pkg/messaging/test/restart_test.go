package test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
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

// These tests stop or restart the real RabbitMQ and PostgreSQL, which would break every other
// test running at the same time. scripts/test.sh runs them alone, after the main suite, with
// TEST_SERVER_RESTARTS=1.
func requireServerRestarts(t *testing.T) {
	t.Helper()
	if os.Getenv("TEST_SERVER_RESTARTS") != "1" {
		t.Skip("restarts the shared servers; set TEST_SERVER_RESTARTS=1 and run alone (scripts/test.sh does)")
	}
}

func TestServerRestartBrokerStopAppThenStartApp(t *testing.T) {
	requireServerRestarts(t)
	b := setup(t)
	b.createWorkTable(t)
	t.Cleanup(func() { testenv.RabbitMQCtlQuietly("start_app") })
	c := b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	run(t, b.relay(t, b.publisher(t, testenv.AMQPURL()), nil).Run)

	ids := b.enqueue(t, 5)
	testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) == 5 }, "first messages not handled")

	testenv.RabbitMQCtl(t, "stop_app")
	testenv.Eventually(t, 20*time.Second, func() bool { return !c.Ready() }, "consumer did not notice the broker stop")
	ids = append(ids, b.enqueue(t, 20)...) // orders keep coming while the broker is down
	testenv.RabbitMQCtl(t, "start_app")
	testenv.RabbitMQCtl(t, "await_startup")

	testenv.Eventually(t, 60*time.Second, func() bool { return b.workDone(t) == int64(len(ids)) && b.unprocessed(t) == 0 },
		"not everything was handled after the broker came back")
	if d := testenv.Count(t, b.db.DB, "SELECT count(*) FROM (SELECT message_id FROM work_items GROUP BY message_id HAVING count(*) > 1) d"); d != 0 {
		t.Fatalf("%d messages were worked twice", d)
	}
}

// PostgreSQL restarted while the relay and a consumer are busy: both recover by themselves,
// the relay's LISTEN comes back (a row committed afterwards is sent without waiting for the
// poll), nothing is lost, done twice or dead-lettered.
func TestServerRestartPostgreSQLRestart(t *testing.T) {
	requireServerRestarts(t)
	cluster := testenv.PostgreSQLCluster(t)
	b := setup(t)
	b.createWorkTable(t)
	c := b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	run(t, b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) { c.PollInterval = time.Hour }).Run)
	// A restart that failed half-way leaves PostgreSQL stopped. Registered after the relay and
	// the consumer, so that it runs before they and the database are cleaned up.
	testenv.StartPostgreSQLAtCleanup(t, cluster, func() bool { return b.db.DB.Exec("SELECT 1").Error == nil })
	listening := func() bool {
		return testenv.Count(t, b.db.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND query LIKE 'LISTEN%'", b.db.Name) == 1
	}
	testenv.Eventually(t, 10*time.Second, listening, "relay is not listening")
	started := func() time.Time {
		var at time.Time
		if err := b.db.DB.Raw("SELECT pg_postmaster_start_time()").Scan(&at).Error; err != nil {
			t.Fatal(err)
		}
		return at
	}
	before := started()

	// Under load: rows keep coming while the server restarts. The loop reports its own failure
	// through loadErr, for the test's goroutine to fail on: t.Fatal from another goroutine
	// would not stop the test.
	var ids []uuid.UUID
	var loadErr error
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			msg, err := messaging.NewMessage(eventType, map[string]any{"order_id": uuid.NewString(), "n": len(ids)})
			if err != nil {
				loadErr = fmt.Errorf("new message %d: %w", len(ids), err)
				return
			}
			if b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, msg) }) == nil {
				ids = append(ids, msg.ID)
			}
			time.Sleep(20 * time.Millisecond) // the pace of incoming rows, not a synchronisation
		}
	}()
	// Stopped however the test ends, before the cleanups registered earlier (the database's).
	stopLoad := sync.OnceFunc(func() { close(stop); <-done })
	t.Cleanup(stopLoad)
	testenv.Eventually(t, 10*time.Second, func() bool { return b.workDone(t) >= 5 }, "no work done before the restart")
	out, err := exec.Command("pg_ctlcluster", "--skip-systemctl-redirect", cluster, "main", "restart", "-m", "fast").CombinedOutput()
	if err != nil {
		t.Fatalf("restart PostgreSQL: %v\n%s", err, out)
	}
	testenv.Eventually(t, 30*time.Second, func() bool { return b.db.DB.Exec("SELECT 1").Error == nil }, "PostgreSQL did not come back")
	if after := started(); !after.After(before) {
		t.Fatalf("the server at TEST_DATABASE_URL did not restart: started at %s, and still at %s", before, after)
	}
	testenv.Eventually(t, 30*time.Second, listening, "the relay did not LISTEN again after the restart")
	// The traffic goes on until work done after the restart shows it is handled again.
	resumed := b.workDone(t)
	testenv.Eventually(t, 30*time.Second, func() bool { return b.workDone(t) > resumed }, "no work done after the restart")
	stopLoad()
	if loadErr != nil {
		t.Fatal(loadErr)
	}

	// With the poll an hour away, only a NOTIFY on the new connection can send this one soon.
	ids = append(ids, b.enqueue(t, 1)...)
	// The load's one transaction in flight at the restart may have committed with its answer
	// cut off: its row is not among ids, and is to be handled all the same.
	rows := testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages")
	if rows < int64(len(ids)) || rows > int64(len(ids))+1 {
		t.Fatalf("%d outbox rows for %d messages enqueued: want them, and one more at most (a commit whose answer the restart cut off)", rows, len(ids))
	}
	testenv.Eventually(t, 60*time.Second, func() bool { return b.workDone(t) == rows && b.unprocessed(t) == 0 },
		"not everything was handled after PostgreSQL restarted")
	if d := testenv.Count(t, b.db.DB, "SELECT count(*) FROM (SELECT message_id FROM work_items GROUP BY message_id HAVING count(*) > 1) d"); d != 0 {
		t.Fatalf("%d messages were worked twice", d)
	}
	if !c.Ready() {
		t.Fatal("consumer not ready after the database restart")
	}
	if n := testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(b.queue)); n != 0 {
		t.Fatalf("dead-letter queue holds %d", n)
	}
	t.Logf("%d rows across a PostgreSQL restart (start time %s → %s), all handled once", rows, before.Format(time.RFC3339), started().Format(time.RFC3339))
}

// raiseMemoryAlarm raises the broker's memory alarm (a watermark of 0); the function it returns
// clears it again, and so does the test's cleanup.
func raiseMemoryAlarm(t *testing.T) (clearAlarm func()) {
	t.Helper()
	previous := strings.TrimSpace(testenv.RabbitMQCtl(t, "eval", "vm_memory_monitor:get_vm_memory_high_watermark()."))
	t.Cleanup(func() { testenv.RabbitMQCtlQuietly("set_vm_memory_high_watermark", previous) })
	testenv.RabbitMQCtl(t, "set_vm_memory_high_watermark", "0")
	return func() { testenv.RabbitMQCtl(t, "set_vm_memory_high_watermark", previous) }
}

// A memory alarm blocks every publisher of the broker. The relay learns it from the broker's
// connection.blocked, and pauses: no transaction stays open and no row stays locked through the
// alarm (the 15 s confirm timeout is not waited out), no row is charged, and everything goes out
// once the alarm clears.
func TestServerRestartMemoryAlarmBlocksPublishers(t *testing.T) {
	requireServerRestarts(t)
	b := setup(t)
	run(t, b.relay(t, b.publisher(t, testenv.AMQPURL()), nil).Run)
	ids := b.enqueue(t, 5)
	b.waitAllSent(t, 10*time.Second)

	clearAlarm := raiseMemoryAlarm(t)
	ids = append(ids, b.enqueue(t, 10)...)
	testenv.Eventually(t, 30*time.Second, func() bool { return len(b.logs.Lines("rabbitmq blocked the connection")) > 0 },
		"the publisher was not told it is blocked")
	testenv.Eventually(t, 5*time.Second, func() bool { return len(b.logs.Lines("broker unavailable; relay paused", "blocked")) == 1 },
		"the relay did not pause on the blocked connection")
	// Watch the relay through the alarm for longer than the confirm timeout: it holds nothing.
	for end := time.Now().Add(16 * time.Second); time.Now().Before(end); {
		if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND state LIKE 'idle in transaction%'", b.db.Name); n != 0 {
			t.Fatalf("%d transactions held open during the alarm", n)
		}
		if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM (SELECT id FROM outbox_messages WHERE processed_at IS NULL FOR UPDATE SKIP LOCKED) free"); n != 10 {
			t.Fatalf("%d of the 10 waiting rows are free to claim during the alarm: the others are locked", n)
		}
		time.Sleep(200 * time.Millisecond) // sampling pace
	}
	b.wantNoRowCharged(t)

	clearAlarm()
	b.waitAllSent(t, 30*time.Second)
	missing, _, unexpected := countIDs(t, testenv.Drain(t, b.ch, b.queue, 500*time.Millisecond), ids)
	if missing+unexpected > 0 {
		t.Fatalf("after the alarm: %d missing, %d unexpected", missing, unexpected)
	}
	if lines := b.logs.Lines("broker available again; relay resumed", "rows_waiting=10"); len(lines) != 1 {
		t.Fatalf("want one line for the end of the alarm with 10 rows waiting, got %q", b.logs.Lines("broker available again"))
	}
}

// Consuming is how a broker comes out of a memory alarm, and the alarm stops the broker reading
// from every connection that publishes: its acknowledgements wait too. So a consumer publishes
// its dead letters on a connection of its own. A poison message during the alarm holds that
// connection and its own worker, and only them: the other worker goes on handling and
// acknowledging. The copy waits for the alarm to clear, however long it lasts, and lands in
// the dead-letter queue once.
func TestServerRestartMemoryAlarmLeavesTheConsumerAcknowledging(t *testing.T) {
	requireServerRestarts(t)
	b := setup(t)
	b.createWorkTable(t)
	poison := amqp.Publishing{MessageId: uuid.NewString(), ContentType: "application/json", Body: []byte("<xml/>")}
	b.publishRaw(t, poison)
	const healthy = 200
	for i := range healthy {
		b.publishRaw(t, publishing(newMessage(t, i)))
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == healthy+1 }, "messages not queued")

	clearAlarm := raiseMemoryAlarm(t)
	// One delivery at a time per worker: each needs the broker to have read the ack before it.
	stop := b.startConsumer(t, workFunc, func(cfg *messaging.SubscriptionConfig) { cfg.Concurrency, cfg.Prefetch = 2, 1 })
	testenv.Eventually(t, 20*time.Second, func() bool { return b.workDone(t) == healthy },
		"the consumer stopped handling messages during the memory alarm")
	blocked := func() bool {
		return len(b.logs.Lines("rabbitmq blocked the connection", `connection="dead letters"`)) > 0
	}
	testenv.Eventually(t, 10*time.Second, blocked, "the dead-letter publish did not meet the alarm")
	// Through the alarm, for longer than the wait for a confirm is bounded otherwise: the copy
	// is not given up on and published again, which would leave a second one behind it.
	dlq := messaging.DeadLetterQueue(b.queue)
	for end := time.Now().Add(17 * time.Second); time.Now().Before(end); {
		if n := testenv.QueueDepth(t, b.ch, dlq); n != 0 {
			t.Fatalf("the dead-letter queue took %d messages during the alarm", n)
		}
		time.Sleep(500 * time.Millisecond) // sampling pace
	}
	if lines := b.logs.Lines("could not dead-letter message"); len(lines) != 0 {
		t.Fatalf("the copy was given up on during the alarm: %q", lines)
	}

	clearAlarm()
	testenv.Eventually(t, 30*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) >= 1 }, "poison message not dead-lettered after the alarm")
	if err := stop(); err != nil {
		t.Fatalf("Run returned %v", err)
	}
	wantPoisonDeadLetteredOnce(t, b, poison)
	if n := testenv.Count(t, b.db.DB, "SELECT count(DISTINCT message_id) FROM work_items"); n != healthy || b.workDone(t) != healthy {
		t.Fatalf("%d rows of work for %d distinct messages, want %d once each", b.workDone(t), n, healthy)
	}
}

// A dead-letter copy that an alarm holds holds neither the consumer's reconnection nor its
// shutdown: the session's dead-letter connection is closed when the session is lost, or when
// a shutdown's grace is over. The poison message is not lost; the copies the broker reads once
// the alarm clears are all of it (a session that ends with its copy unread leaves one more).
func TestServerRestartMemoryAlarmHoldsNeitherReconnectionNorShutdown(t *testing.T) {
	requireServerRestarts(t)
	b := setup(t)
	b.createWorkTable(t)
	// Two, in one worker's hands: after the first copy is given up on at the end of the grace,
	// the second must not hang on the blocked connection (either the context's end or the
	// connection closed with the grace stops it; without both, Run does not return).
	poison := map[string]bool{uuid.NewString(): true, uuid.NewString(): true}
	for id := range poison {
		b.publishRaw(t, amqp.Publishing{MessageId: id, ContentType: "application/json", Body: []byte("<xml/>")})
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, b.queue) == 2 }, "messages not queued")

	clearAlarm := raiseMemoryAlarm(t)
	const grace = 2 * time.Second
	stop := b.startConsumer(t, workFunc, func(cfg *messaging.SubscriptionConfig) {
		cfg.Concurrency, cfg.Prefetch, cfg.ShutdownGrace = 1, 2, grace
		cfg.Reconnect = messaging.Backoff{Base: 100 * time.Millisecond, Max: time.Second}
	})
	blocked := func(times int) func() bool {
		return func() bool {
			return len(b.logs.Lines("rabbitmq blocked the connection", `connection="dead letters"`)) >= times
		}
	}
	testenv.Eventually(t, 10*time.Second, blocked(1), "the dead-letter publish did not meet the alarm")

	if n := testenv.CloseConnectionsNamed(t, b.queue); n != 1 {
		t.Fatalf("closed %d connections named %q, want the consumer's one", n, b.queue)
	}
	testenv.Eventually(t, 15*time.Second, func() bool { return len(b.logs.Lines("consumer started")) == 2 },
		"the consumer did not reconnect during the alarm")
	testenv.Eventually(t, 10*time.Second, blocked(2), "the next session's dead-letter publish did not meet the alarm")

	began := time.Now()
	if err := stop(); err != nil {
		t.Fatalf("Run returned %v", err)
	}
	if took := time.Since(began); took > grace+3*time.Second {
		t.Fatalf("the consumer stopped %s after the shutdown began, with a grace of %s", took.Round(time.Millisecond), grace)
	}

	clearAlarm()
	stop = b.startConsumer(t, workFunc, func(cfg *messaging.SubscriptionConfig) {})
	dlq := messaging.DeadLetterQueue(b.queue)
	testenv.Eventually(t, 30*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) >= 2 }, "poison messages not dead-lettered after the alarm")
	if err := stop(); err != nil {
		t.Fatalf("Run returned %v", err)
	}
	if n := testenv.QueueDepth(t, b.ch, b.queue); n != 0 {
		t.Fatalf("queue still holds %d after the consumer stopped", n)
	}
	copies := deadLetters(t, b.ch, b.queue)
	seen := map[string]bool{}
	for _, d := range copies {
		if !poison[d.MessageId] {
			t.Fatalf("dead-letter queue holds message %q, want only copies of the poison messages", d.MessageId)
		}
		seen[d.MessageId] = true
	}
	if len(seen) != len(poison) {
		t.Fatalf("dead-letter queue holds copies of %d poison messages, want %d", len(seen), len(poison))
	}
	t.Logf("%d copies of the 2 poison messages in the dead-letter queue after two sessions ended during the alarm", len(copies))
}

// A channel refused while the consumer sets up (a user's channel limit, met by a replica of a
// rolling deploy) charges no message: every channel is open before the first consumer starts.
// Consumers started first held their prefetch when the connection closed on the refusal, and
// the broker counted each of those messages a delivery at every reconnection, up to the
// delivery limit.
func TestAChannelRefusedAtSetupChargesNoMessage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	user := testenv.UniqueName("limited")
	t.Cleanup(func() { testenv.RabbitMQCtlQuietly("delete_user", user) })
	testenv.RabbitMQCtl(t, "add_user", user, "secret")
	testenv.RabbitMQCtl(t, "set_permissions", "-p", "/", user, ".*", ".*", ".*")
	testenv.RabbitMQCtl(t, "set_user_limits", user, `{"max-channels": 2}`)
	url := strings.Replace(testenv.AMQPURL(), "guest:guest@", user+":secret@", 1)
	untilChannelLimit(t, url, 2)
	must(t, b.topology.Declare(testenv.Connection(t), b.log))
	for i := range 10 {
		b.publishRaw(t, publishing(newMessage(t, i)))
	}
	s, err := messaging.NewSubscription(b.drv, messaging.SubscriptionConfig{
		Name: b.queue, URL: url, Topology: b.topology,
		Concurrency: 3, Prefetch: 10, Logger: b.log, Reconnect: messaging.Backoff{Base: 100 * time.Millisecond, Max: 500 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	must(t, messaging.Handle(s, b.orderPlaced(), workFunc))
	stop := start(t, s.Run)
	testenv.Eventually(t, 20*time.Second, func() bool { return len(b.logs.Lines("open channel")) >= 3 },
		"the consumer did not try to set up three times")
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	held := testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond)
	if len(held) != 10 {
		t.Fatalf("%d messages in the queue after the refused setups, want the 10 published", len(held))
	}
	for _, d := range held {
		if n := timesDelivered(d); n > 0 {
			t.Fatalf("message %s was charged %d deliveries by setups that never consumed", d.MessageId, n)
		}
	}
}

// untilChannelLimit waits until the broker refuses url's user a channel past n: set_user_limits
// may return before the broker enforces the limit (a consumer set up at once on RabbitMQ 4.0.5
// got all three of its channels).
func untilChannelLimit(t *testing.T, url string, n int) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, func() bool {
		conn, err := amqp.Dial(url)
		if err != nil {
			return false
		}
		defer conn.Close()
		for range n + 1 {
			if _, err := conn.Channel(); err != nil {
				return true
			}
		}
		return false
	}, "the broker does not refuse a channel past the user's limit of %d", n)
}

// A redrive during a memory alarm: its first copy gets the connection blocked, after which the
// broker reads nothing from it, neither the acknowledgement nor the hand-back nor the question
// after them. It ends within seconds, saying so, rather than when the alarm clears; and once
// it has, every message is in one queue or the other, none lost.
func TestServerRestartMemoryAlarmEndsARedrive(t *testing.T) {
	requireServerRestarts(t)
	b := setup(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	ids := fillDeadLetterQueue(t, b.ch, dlq, 3)
	type result struct {
		moved []messaging.DeadLetter
		err   error
	}
	held, raised, done := make(chan struct{}), make(chan struct{}), make(chan result, 1)
	var raise sync.Once
	defer raise.Do(func() { close(raised) }) // a failed test lets the redrive go on too
	go func() {
		moved, err := messaging.RedriveDeadLetters(context.Background(), messaging.DeadLetterConfig{URL: testenv.AMQPURL(), Queue: b.queue},
			messaging.DeadLetterSelection{Confirm: func([]messaging.DeadLetter, int) error {
				close(held) // the messages are held; the first copy goes once the alarm is up
				<-raised
				return nil
			}})
		done <- result{moved, err}
	}()
	select {
	case <-held:
	case r := <-done:
		t.Fatalf("the redrive ended before it held its messages: moved %d, error %v", len(r.moved), r.err)
	case <-time.After(30 * time.Second):
		t.Fatal("the redrive did not hold its messages within 30 s")
	}
	clearAlarm := raiseMemoryAlarm(t) // cleared by the test's cleanup too, which a hung redrive waits for
	raise.Do(func() { close(raised) })
	var r result
	select {
	case r = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the redrive still waits for the blocked connection 20 s into the alarm")
	}
	clearAlarm()
	if !errors.Is(r.err, messaging.ErrRedriveInDoubt) || !strings.Contains(r.err.Error(), "blocked the connection") {
		t.Fatalf("redrive in a memory alarm: moved %d, error %v; want the message under way in doubt, and the block named", len(r.moved), r.err)
	}
	testenv.Eventually(t, 30*time.Second, func() bool {
		return testenv.QueueDepth(t, b.ch, dlq)+testenv.QueueDepth(t, b.ch, b.queue) >= len(ids)
	}, "messages missing from both queues after the alarm")
	in := map[string]bool{}
	for _, q := range []string{dlq, b.queue} {
		for _, d := range testenv.Drain(t, b.ch, q, 300*time.Millisecond) {
			in[d.MessageId] = true
		}
	}
	for _, id := range ids {
		if !in[id] {
			t.Errorf("message %s is in neither queue after the redrive in the alarm", id)
		}
	}
}
