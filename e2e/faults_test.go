package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// Several replicas of every service under concurrent load, every 4th order cancelled at once:
// exactly-once effects, and the relays publish next to no duplicates. (Their claim's row locks
// keep them apart; without SKIP LOCKED they would wait for each other instead of doubling, so
// the library's TestRelayLanesOverlapBatchesWithoutDuplicates guards SKIP LOCKED, not this.)
func TestReplicasUnderLoad(t *testing.T) {
	t.Parallel()
	// Seven processes, with pools smaller still than the other tests' (see smallPools): the
	// least invoicing's parts need with one worker.
	small := []string{"DB_MAX_CONNS=10", "CONSUMER_CONCURRENCY=1", "OUTBOX_LANES=1", "HTTP_MAX_IN_FLIGHT=64"}
	s := startSystem(t, systest.Options{Orders: 3, Invoicers: 2, Notifiers: 2,
		Env: map[string][]string{"order": small, "invoicing": small, "notification": small}})
	const orders = 2000
	start := time.Now()
	ids, cancelled := s.Load(t, orders, 16)
	took := time.Since(start)
	got := s.WaitExactlyOnce(t, int64(len(ids)), 3*time.Minute)
	t.Logf("3 order + 2 invoicing + 2 notification replicas: %d orders accepted in %s, %d of them cancelled; %d invoices, %d notifications sent, %d e-mails; consumers suppressed %d duplicates",
		len(ids), took.Round(time.Millisecond), got.Cancelled, got.Invoices, got.Sent, got.Mails, s.DuplicatesSuppressed(t))
	if len(ids) != orders {
		t.Fatalf("%d of %d orders accepted", len(ids), orders)
	}
	// Without a fault, the claim's locks keep the relays from publishing a row twice, and no
	// delivery is repeated: the consumers have nothing to suppress.
	if d := s.DuplicatesSuppressed(t); d != 0 {
		t.Errorf("the consumers suppressed %d duplicates in a run without faults, want 0", d)
	}
	if got.Cancelled != cancelled {
		t.Errorf("%d orders are cancelled, want the %d whose cancellation was answered 200", got.Cancelled, cancelled)
	}
}

// Messages that can never be handled, published straight to the exchange, land in each
// consumer's dead-letter queue with their reason logged; the orders behind them go through.
func TestPoisonMessagesAreDeadLettered(t *testing.T) {
	t.Parallel()
	s := startSystem(t, systest.Options{})
	s.PoisonSent = true
	ch := s.Channel(t)
	poison := []amqp.Publishing{
		{MessageId: uuid.NewString(), Type: "OrderPlaced", ContentType: "application/json", Body: []byte("not json")},
		{MessageId: uuid.NewString(), Type: "OrderPlaced", ContentType: "application/json", Body: []byte(`{"order_id": 42, "lines": "many"}`)},
		{Type: "OrderPlaced", ContentType: "application/json", Body: []byte(`{"order_id": "` + uuid.NewString() + `"}`)},
		{MessageId: uuid.NewString(), Type: "OrderPlaced", ContentType: "application/json", Body: []byte(`"` + strings.Repeat("x", 2<<20) + `"`)},
	}
	for _, p := range poison {
		if err := ch.PublishWithContext(context.Background(), "orders", "OrderPlaced", false, false, p); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		s.PlaceOrder(t, fmt.Sprintf("after-poison-%d", i))
	}
	s.WaitExactlyOnce(t, 3, 30*time.Second)
	testenv.Eventually(t, 10*time.Second, func() bool { return s.CheckQueuesEmpty(t) == 2*len(poison) },
		"the dead-letter queues do not hold %d poison messages each", len(poison))
	// Each is logged once the broker confirmed its copy, which the queue may show a moment before.
	testenv.Eventually(t, 5*time.Second, func() bool {
		return len(s.Invoicing.Logs.Lines("message dead-lettered")) >= len(poison) && len(s.Notification.Logs.Lines("message dead-lettered")) >= len(poison)
	}, "not every poison message was logged as dead-lettered")
	for _, c := range []*systest.Service{s.Invoicing, s.Notification} {
		if n := len(c.Logs.Lines("level=ERROR", "message dead-lettered", "reason=")); n != len(poison) {
			t.Errorf("%s logged %d dead-letter lines with a reason, want %d", c.Name, n, len(poison))
		}
	}
}

// SIGTERM under load (every 4th order cancelled): every service exits 0 within 10 s, no request
// accepted before the signal gets a 5xx, and after a restart every accepted order is invoiced
// and confirmed, and every cancellation voids and notifies, exactly once. (A graceful stop
// commits what it acknowledges, so an early ack would not show here: the library's
// TestConsumerProcessKilled guards ack after commit.)
func TestGracefulShutdownUnderLoad(t *testing.T) {
	t.Parallel()
	s := startSystem(t, systest.Options{})

	traffic := s.StartTraffic(t, 4)
	traffic.WaitFor(t, 50)
	for _, c := range []*systest.Service{s.Invoicing, s.Notification} {
		took := c.Stop(t)
		t.Logf("%s stopped in %s under load", c.Name, took.Round(time.Millisecond))
		c.Start(t)
	}
	traffic.WaitFor(t, 50)
	// A request in flight at the signal: its body is half sent. The listener closes, and the
	// request still completes, committed and answered, before the process exits.
	finish := s.Order.InFlightOrder(t, "in-flight")
	wait := s.Order.Terminate(t)
	testenv.Eventually(t, 5*time.Second, s.Order.Refuses, "order still takes new connections after SIGTERM")
	status, inFlight := finish()
	if status != http.StatusCreated {
		t.Fatalf("the request in flight at SIGTERM got %d, want 201: shutdown dropped it", status)
	}
	took := wait()
	t.Logf("order stopped in %s under load, finishing a request in flight at the signal", took.Round(time.Millisecond))
	// The relay stops last: what the drained requests committed went out before the exit, so a
	// single replica's consumers need not wait for its next start.
	if unsent := testenv.Count(t, s.Order.DB.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL"); unsent != 0 {
		t.Errorf("order exited leaving %d outbox rows unsent: the relay stopped before the requests it drained", unsent)
	}
	s.Order.Start(t)
	traffic.WaitFor(t, 50)
	ids, cancelled, serverErrors := traffic.Stop(t)
	ids = append(ids, inFlight)
	if serverErrors != 0 {
		t.Fatalf("%d requests got a 5xx during the shutdowns", serverErrors)
	}
	if lost := s.CheckAccepted(t, ids); lost != 0 {
		t.Fatalf("%d orders were committed without their 201 reaching the client across graceful shutdowns", lost)
	}
	got := s.WaitExactlyOnce(t, int64(len(ids)), 3*time.Minute) // slow on a busy machine
	if got.Cancelled != int(cancelled) {
		t.Errorf("%d orders are cancelled, want the %d whose cancellation was answered 200: an answer was lost across graceful shutdowns", got.Cancelled, cancelled)
	}
	t.Logf("%d orders accepted across three restarts, %d of them cancelled; %d invoices, %d notifications sent, %d duplicates suppressed",
		len(ids), got.Cancelled, got.Invoices, got.Sent, s.DuplicatesSuppressed(t))
}

// Each service binary SIGKILLed under load, then started again, as an orchestrator would: no
// grace, nothing finished. Every accepted order ends invoiced and notified exactly once over
// the whole chain; only an e-mail may arrive twice, with its Message-ID, if the kill fell between
// its SMTP send and its mark: at most as many as the sender delivers at once.
func TestKilledServicesUnderLoad(t *testing.T) {
	t.Parallel()
	// workers clients each have one request in flight at most: a kill of the order service cuts
	// off the answer to that many at most. notifyConcurrency bounds the e-mails in flight, so
	// the repeats a kill of the notification service may cause; the default, 128, would bound
	// nothing here (the sender's lease and mark are tested at it in services/notification).
	const workers, notifyConcurrency = 4, 8
	s := startSystem(t, systest.Options{Env: map[string][]string{"notification": {fmt.Sprintf("NOTIFY_CONCURRENCY=%d", notifyConcurrency)}}})
	traffic := s.StartTraffic(t, workers)
	traffic.WaitFor(t, 50)
	for _, c := range []*systest.Service{s.Invoicing, s.Notification, s.Order} {
		if c != s.Order {
			t.Logf("killing %s, unacknowledged messages in its queue: %d", c.Name, waitInFlight(t, s, c.Name))
		}
		if c == s.Notification {
			s.RepeatedMails += notifyConcurrency
		}
		c.Kill(t)
		if c != s.Order {
			traffic.WaitFor(t, 30) // orders keep coming while the consumer is dead
		}
		c.Start(t)
		traffic.WaitFor(t, 50)
	}
	ids, cancelled, serverErrors := traffic.Stop(t)
	unconfirmed := s.CheckAccepted(t, ids)
	got := s.WaitExactlyOnce(t, int64(len(ids))+unconfirmed, 3*time.Minute)
	checkCutOff(t, "the order service's kill", workers, unconfirmed, got.Cancelled, cancelled)
	t.Logf("3 SIGKILLs under load: %d orders accepted (%d more committed whose answer the kill cut off), %d cancelled, %d 5xx; %d invoices, %d notifications, %d e-mails (%d repeated with their Message-ID); %d duplicates suppressed",
		len(ids), unconfirmed, got.Cancelled, serverErrors, got.Invoices, got.Sent, got.Mails, got.DuplicateMails, s.DuplicatesSuppressed(t))
}

// waitInFlight waits until the broker counts messages of queue delivered and not yet
// acknowledged: work in its consumer's hands, which a kill right after cuts off. (A quorum
// queue's counts are those of its last tick, a few seconds old at most: under the test's
// steady traffic, its consumer still holds messages.)
func waitInFlight(t *testing.T, s *systest.System, queue string) (unacked int) {
	t.Helper()
	// rabbitmqctl starts an Erlang VM each time: not every 20 ms.
	// The count changes at the queue's metrics tick, every few seconds: a minute is some fifteen
	// of them under traffic.
	testenv.EventuallyEvery(t, 250*time.Millisecond, time.Minute, func() bool {
		n, listed := s.Unacknowledged(t, queue)
		unacked = n
		return listed && n > 0
	}, "the broker counts no message of queue %s unacknowledged under load (or does not list it): a kill would cut off no work in flight", queue)
	return unacked
}

// checkCutOff bounds what a fault cut off to the requests in flight when it struck, bound (one
// a traffic client, whose requests go one at a time, for each time it struck): the orders
// committed whose 201 was lost (unconfirmed) and the orders cancelled beyond the cancellations
// answered 200, together; none of the latter may be missing.
func checkCutOff(t *testing.T, fault string, bound int, unconfirmed int64, gotCancelled int, answered int64) {
	t.Helper()
	extra := int64(gotCancelled) - answered
	if extra < 0 {
		t.Errorf("%d orders are cancelled, fewer than the %d cancellations answered 200", gotCancelled, answered)
	}
	if cut := unconfirmed + max(extra, 0); cut > int64(bound) {
		t.Errorf("%d orders committed without their 201 and %d cancelled without their 200: more than the %d requests in flight at %s",
			unconfirmed, max(extra, 0), bound, fault)
	}
}

// The broker gone for a minute while orders keep coming.
func TestBrokerOutage60s(t *testing.T) {
	t.Parallel()
	testBrokerOutage(t, time.Minute)
}

// The broker gone for five minutes while orders keep coming: rows charged for an outage this
// long would climb the backoff to its 5 min cap and be parked far past the broker's return.
func TestLongBrokerOutage5m(t *testing.T) {
	if os.Getenv("TEST_LONG") != "1" {
		t.Skip("a 5 min broker outage, about 6 min in all: set TEST_LONG=1 to run it")
	}
	t.Parallel()
	testBrokerOutage(t, 5*time.Minute)
}

// brokerUpGauge is the relay's view of the broker on the order service's /metrics.
const brokerUpGauge = `outbox_relay_broker_up{exchange="orders"}`

// backlogGaugeWithin is how long a read of the outbox backlog gauges asks again: a scrape
// whose backlog query overran its second (a busy machine) goes without them.
const backlogGaugeWithin = 5 * time.Second

// testBrokerOutage cuts the broker off for outage while an order arrives every second, every
// 4th cancelled at once. Every order and cancellation is accepted, the order service stays
// ready, the relay says the broker is down and charges no row for it, and within 5 s of the
// broker's return both consumers have handled every order and cancellation, exactly once.
func testBrokerOutage(t *testing.T, outage time.Duration) {
	s := startSystem(t, systest.Options{})
	ids := []uuid.UUID{s.PlaceOrder(t, "before")}
	s.WaitExactlyOnce(t, 1, 30*time.Second)
	if up := s.Order.Metric(t, brokerUpGauge); up != 1 {
		t.Fatalf("%s = %v before the outage, want 1", brokerUpGauge, up)
	}

	s.Broker.Stop()
	during := 0
	var cancelled []uuid.UUID
	for end := time.Now().Add(outage); time.Now().Before(end); {
		id := s.PlaceOrder(t, fmt.Sprintf("during-%d", during))
		ids = append(ids, id)
		during++
		if during%4 == 0 && s.CancelOrder(t, id, "changed my mind during the outage") {
			cancelled = append(cancelled, id)
		}
		if st := s.Order.Status(t, "/readyz"); st != 200 {
			t.Fatalf("order service not ready %d orders into the outage: %d", during, st)
		}
		if n := s.Order.MetricSoon(t, "outbox_max_attempts", backlogGaugeWithin); n != 0 {
			t.Fatalf("outbox_max_attempts = %v %d orders into the outage: a row was charged for it", n, during)
		}
		time.Sleep(time.Second) // pacing: one customer a second
	}
	// The broker is still away: the consumers, which cannot consume, are not ready; the relay
	// has noticed, and every row of the outage waits.
	for _, svc := range []*systest.Service{s.Invoicing, s.Notification} {
		if st := svc.Status(t, "/readyz"); st != http.StatusServiceUnavailable {
			t.Errorf("%s's /readyz = %d with the broker away, want 503", svc.Name, st)
		}
	}
	if up := s.Order.Metric(t, brokerUpGauge); up != 0 {
		t.Errorf("%s = %v during the outage, want 0", brokerUpGauge, up)
	}
	if n := len(s.Order.Logs.Lines(relayPaused...)); n != 1 {
		t.Errorf("the relay logged %d outage-start lines during the outage, want 1", n)
	}
	if n := s.Order.MetricSoon(t, "outbox_pending_messages", backlogGaugeWithin); n != float64(during+len(cancelled)) {
		t.Errorf("outbox_pending_messages = %v at the end of the outage, want the %d orders placed and %d cancelled during it", n, during, len(cancelled))
	}

	back := time.Now()
	if err := s.Broker.Start(); err != nil {
		t.Fatal(err)
	}
	// A generous deadline, so that a slow recovery is measured and reported, not cut short.
	testenv.Eventually(t, time.Minute, func() bool {
		invoices, notifications := s.Unhandled(t, ids, cancelled)
		return invoices == 0 && notifications == 0
	}, "the consumers have not handled all %d orders and %d cancellations since the broker came back", len(ids), len(cancelled))
	took := time.Since(back)
	t.Logf("after a %s outage: broker back → last event handled in %s (%d orders placed during the outage, %d of them cancelled, %d in all)",
		outage, took.Round(time.Millisecond), during, len(cancelled), len(ids))
	if took > 5*time.Second {
		t.Errorf("both consumers handled every order %s after the broker came back, want within 5 s", took.Round(time.Millisecond))
	}

	for _, svc := range []*systest.Service{s.Invoicing, s.Notification} {
		if st := svc.Status(t, "/readyz"); st != http.StatusOK {
			t.Errorf("%s's /readyz = %d once it consumed again, want 200", svc.Name, st)
		}
	}
	rowsWaiting := checkOutageReported(t, s)
	t.Logf("rows_waiting=%d when the relay resumed; %d orders were placed and %d cancelled during the outage", rowsWaiting, during, len(cancelled))
	if up := s.Order.Metric(t, brokerUpGauge); up != 1 {
		t.Errorf("%s = %v after the outage, want 1", brokerUpGauge, up)
	}
	// OutboxPoisonRows fires above 10; an outage must not even start the count.
	if n := s.Order.MetricSoon(t, "outbox_max_attempts", backlogGaugeWithin); n != 0 {
		t.Errorf("outbox_max_attempts = %v after the outage, want 0", n)
	}
	got := s.WaitExactlyOnce(t, int64(len(ids)), time.Minute)
	if got.Cancelled != len(cancelled) {
		t.Errorf("%d orders are cancelled, want the %d cancelled during the outage", got.Cancelled, len(cancelled))
	}
	t.Logf("after a %s outage: %d orders, %d of them cancelled, %d invoices, %d notifications sent, %d e-mails",
		outage, got.Orders, got.Cancelled, got.Invoices, got.Sent, got.Mails)
}

// The relay's two lines about an outage, as the order service logs them.
var (
	relayPaused  = []string{"level=WARN", `msg="broker unavailable; relay paused, rows wait in the outbox"`, "component=relay", "exchange=orders", "error="}
	relayResumed = []string{"level=INFO", `msg="broker available again; relay resumed"`, "component=relay", "exchange=orders", "outage=", "rows_waiting="}
)

var rowsWaitingRE = regexp.MustCompile(`rows_waiting=(-?\d+)`)

// checkOutageReported requires, once the broker is back after one outage, that the relay
// logged its start and its end once each, that nothing else logged the outage or a row's
// failure, and that no outbox row was charged for it. It returns the rows_waiting the relay reported when it resumed.
func checkOutageReported(t *testing.T, s *systest.System) (rowsWaiting int) {
	t.Helper()
	logs := s.Order.Logs
	// The line is written before the waiting rows go out, but it reaches the test through a
	// pipe: give it a moment.
	testenv.Eventually(t, 5*time.Second, func() bool { return len(logs.Lines(relayResumed...)) > 0 },
		"the relay did not log its resumption")
	paused, resumed := logs.Lines(relayPaused...), logs.Lines(relayResumed...)
	if len(paused) != 1 {
		t.Errorf("the relay logged %d outage-start lines, want 1:\n%s", len(paused), strings.Join(paused, "\n"))
	}
	if len(resumed) != 1 {
		t.Errorf("the relay logged %d outage-end lines, want 1:\n%s", len(resumed), strings.Join(resumed, "\n"))
	}
	t.Logf("order service:\n%s\n%s", strings.Join(paused, "\n"), resumed[0])
	m := rowsWaitingRE.FindStringSubmatch(resumed[0])
	if m == nil {
		t.Fatalf("no rows_waiting in %q", resumed[0])
	}
	rowsWaiting, _ = strconv.Atoi(m[1])
	if rowsWaiting <= 0 {
		t.Errorf("rows_waiting=%d when the relay resumed, want the rows of the outage", rowsWaiting)
	}
	// Nothing else of the order service repeats the outage above debug level (the tests run
	// it at debug): not the publisher's lost connection, nor its attempts to reconnect.
	var again []string
	for _, l := range logs.Lines("rabbitmq connection") {
		if !strings.Contains(l, "level=DEBUG") {
			again = append(again, l)
		}
	}
	if len(again) != 0 {
		t.Errorf("the order service logged %d more lines of the outage, want 0:\n%s", len(again), strings.Join(again, "\n"))
	}
	if failed := logs.Lines("outbox publish failed"); len(failed) != 0 {
		t.Errorf("the relay logged %d per-row publish failures for a broker outage, want 0; first: %s", len(failed), failed[0])
	}
	// Nor does the relay report it otherwise (a failed batch is an ERROR of its own).
	var relayed []string
	for _, l := range logs.Lines("component=relay") {
		if (strings.Contains(l, "level=WARN") || strings.Contains(l, "level=ERROR")) && !slices.Contains(paused, l) {
			relayed = append(relayed, l)
		}
	}
	if len(relayed) != 0 {
		t.Errorf("the relay logged %d more warnings or errors for the outage, want 0:\n%s", len(relayed), strings.Join(relayed, "\n"))
	}
	if n := testenv.Count(t, s.Order.DB.DB, "SELECT count(*) FROM outbox_messages WHERE attempts <> 0 OR last_error IS NOT NULL"); n != 0 {
		t.Errorf("%d outbox rows were charged an attempt or an error for the outage, want 0", n)
	}
	return rowsWaiting
}

// PostgreSQL restarted while all three services run under load: each recovers by itself,
// nothing is lost or doubled, and no good message is dead-lettered. It restarts the shared
// server, so scripts/test.sh runs it alone (TEST_SERVER_RESTARTS=1).
func TestServerRestartPostgreSQLUnderLoad(t *testing.T) {
	if os.Getenv("TEST_SERVER_RESTARTS") != "1" {
		t.Skip("restarts the shared PostgreSQL; set TEST_SERVER_RESTARTS=1 and run alone")
	}
	cluster := testenv.PostgreSQLCluster(t)
	s := startSystem(t, systest.Options{})
	// A restart that failed half-way leaves PostgreSQL stopped. Registered after startSystem,
	// so that it runs before the system's cleanups drop its databases.
	testenv.StartPostgreSQLAtCleanup(t, cluster, func() bool { return s.Order.DB.DB.Exec("SELECT 1").Error == nil })
	started := func() time.Time {
		var at time.Time
		if err := s.Order.DB.DB.Raw("SELECT pg_postmaster_start_time()").Scan(&at).Error; err != nil {
			t.Fatal(err)
		}
		return at
	}
	before := started()
	const workers = 4 // each with one request in flight at most when the server restarts
	traffic := s.StartTraffic(t, workers)
	traffic.WaitFor(t, 50)
	if out, err := exec.Command("pg_ctlcluster", "--skip-systemctl-redirect", cluster, "main", "restart", "-m", "fast").CombinedOutput(); err != nil {
		traffic.Stop(t)
		t.Fatalf("restart PostgreSQL: %v\n%s", err, out)
	}
	traffic.WaitFor(t, 50) // the order service takes orders again without a restart
	if after := started(); !after.After(before) {
		t.Fatalf("the server the services use did not restart: started at %s, and still at %s", before, after)
	}
	ids, cancelled, _ := traffic.Stop(t)
	unconfirmed := s.CheckAccepted(t, ids)
	n := int64(len(ids)) + unconfirmed
	got := s.WaitExactlyOnce(t, n, 90*time.Second) // none dead-lettered during the restart either
	// An order or a cancellation whose answer the restart cut off may be committed too.
	checkCutOff(t, "the restart", workers, unconfirmed, got.Cancelled, cancelled)
	t.Logf("PostgreSQL restarted under load: %d orders accepted (%d more committed whose answer was lost), %d cancelled, %d invoices, %d notifications sent, %d duplicates suppressed",
		len(ids), unconfirmed, got.Cancelled, got.Invoices, got.Sent, s.DuplicatesSuppressed(t))
}
