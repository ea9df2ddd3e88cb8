package bench

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// consumerBatch is what one transaction of the database ceiling writes: a batch of the
// consumer's default size.
const consumerBatch = messaging.DefaultBatchSize

// drained is a consumer binary whose drain of a backlog is measured against the database's
// rate for the same rows.
type drained struct {
	service string // the binary, whose queue bears its name
	// ceiling is its work for consumerBatch messages, written raw, set-based, as pgbench runs
	// it in one transaction.
	ceiling string
	// backlog makes the n messages that wait in its queue, each with the exchange it is
	// published to.
	backlog func(t *testing.T, n int) []published
	table   string // one row per message: the drain's clock starts at the first one's created_at
	// settled counts the binary's work left once its queue is drained (its relay's, its
	// sender's): its CPU is read when that is 0.
	settled string
	also    string // what else the binary does meanwhile, whose CPU counts too
	what    string // the backlog, in the table's words
	// held, when set, is the binary's settings that hold its other work back until the queue
	// is drained: the drain again so shows what that work costs it.
	held []string
	// heldCheck counts the held work done before the drain's end (its one argument): not 0,
	// the drain outlasted the hold.
	heldCheck string
}

// published is a message and the exchange it is published to.
type published struct {
	exchange string
	msg      messaging.Message
}

// v7 is a time-ordered id in SQL, as the services make them.
var v7 = testenv.UUIDv7SQL("clock_timestamp()", "(random() * 1e15)::bigint")

// invoicingDrain: OrderPlaced messages; the ceiling claims the batch's inbox rows, writes its
// invoices, and its InvoiceIssued outbox rows with the NOTIFY in the same statement, as
// messaging.Enqueue does.
var invoicingDrain = drained{
	service: events.InvoicingQueue,
	ceiling: fmt.Sprintf(`BEGIN;
INSERT INTO inbox_messages (message_id, consumer, processed_at) SELECT %[1]s, 'invoicing', now() FROM generate_series(1, %[2]d);
INSERT INTO invoices (id, order_id, customer_id, amount_cents, status, message_id, created_at, placed_message_id)
  SELECT %[1]s, %[1]s, 'c-42', 2500, 'issued', %[1]s, now(), %[1]s FROM generate_series(1, %[2]d);
WITH inserted AS (INSERT INTO outbox_messages (id, type, payload, occurred_at, exchange)
  SELECT %[1]s, 'InvoiceIssued', '{"customer_id":"c-42","amount_cents":2500}', now(), 'invoicing' FROM generate_series(1, %[2]d))
  SELECT pg_notify('outbox_messages', '');
COMMIT;
`, v7, consumerBatch),
	backlog: func(t *testing.T, n int) []published {
		out := make([]published, n)
		for i := range out {
			out[i] = published{events.Exchange, orderPlaced(t)}
		}
		return out
	},
	table:   "invoices",
	settled: "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL",
	also:    "relay",
	what:    "OrderPlaced",
	// The relay polls, without NOTIFY, every 30 s: the drain is over before its first pass
	// after the start.
	held:      []string{"OUTBOX_NOTIFY=false", "OUTBOX_POLL_INTERVAL=30s"},
	heldCheck: "SELECT count(*) FROM outbox_messages WHERE processed_at <= ?",
}

// notificationDrain: an OrderPlaced and an InvoiceIssued per order, one after the other, as two
// relays interleave them; the ceiling claims the batch's inbox rows and writes its
// notifications, one INSERT per kind as the binary does, with bodies of the same length.
var notificationDrain = drained{
	service: events.NotificationQueue,
	ceiling: fmt.Sprintf(`BEGIN;
INSERT INTO inbox_messages (message_id, consumer, processed_at) SELECT %[1]s, 'notification', now() FROM generate_series(1, %[2]d);
INSERT INTO notifications (id, order_id, customer_id, kind, recipient, subject, body, status, next_attempt_at, message_id, created_at)
  SELECT n.id, n.id, 'c-42', 'order_confirmation', 'c-42@customers.example', 'Your order ' || n.id, 'Thank you for your order ' || n.id
    || E'.\r\n\r\n  2 × SKU-1 at 12.50\r\n\r\nTotal: 25.00\r\n', 'pending', now(), %[1]s, now()
  FROM (SELECT %[1]s AS id FROM generate_series(1, %[3]d)) n;
INSERT INTO notifications (id, order_id, customer_id, kind, recipient, subject, body, status, next_attempt_at, message_id, created_at)
  SELECT n.id, n.id, 'c-42', 'invoice', 'c-42@customers.example', 'Your invoice ' || n.id, 'Your invoice ' || n.id || ' for order '
    || n.id || E'.\r\n\r\nAmount: 25.00\r\n', 'pending', now(), %[1]s, now()
  FROM (SELECT %[1]s AS id FROM generate_series(1, %[3]d)) n;
COMMIT;
`, v7, consumerBatch, consumerBatch/2),
	backlog: func(t *testing.T, n int) []published {
		out := make([]published, 0, n)
		for len(out) < n {
			ev := placedEvent()
			placed, err := messaging.NewMessage(events.OrderPlacedType, ev)
			if err != nil {
				t.Fatal(err)
			}
			issued, err := messaging.NewMessage(events.InvoiceIssuedType, events.InvoiceIssued{InvoiceID: uuid.New(), OrderID: ev.OrderID,
				CustomerID: ev.CustomerID, AmountCents: ev.TotalCents, IssuedAt: time.Now().UTC()})
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, published{events.Exchange, placed}, published{events.InvoicingExchange, issued})
		}
		return out[:n]
	},
	table:   "notifications",
	settled: "SELECT count(*) FROM notifications WHERE status = 'pending'",
	also:    "sender",
	what:    "OrderPlaced and InvoiceIssued",
}

var pgbenchTPS = regexp.MustCompile(`tps = ([0-9.]+)`)

// service is the system's first replica of the named kind.
func service(t *testing.T, sys *systest.System, name string) *systest.Service {
	t.Helper()
	s, ok := map[string]*systest.Service{"order": sys.Order, "invoicing": sys.Invoicing, "notification": sys.Notification}[name]
	if !ok {
		t.Fatalf("no service %q", name)
	}
	return s
}

// consumerCeiling is the database's rate for c's work: pgbench, 8 clients, for 10 s, on a
// database with c's schema, in messages per second.
func consumerCeiling(t *testing.T, binDir string, c drained) float64 {
	t.Helper()
	pgbench, err := exec.LookPath("pgbench")
	if err != nil {
		t.Fatalf("the database ceiling needs pgbench (PostgreSQL's client tools): %v", err)
	}
	// The binary migrates its database: start it on one, then stop it.
	sys := systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, DiscardLogs: true})
	sys.Order.Stop(t)
	sys.Notification.Stop(t)
	sys.Invoicing.Stop(t)
	script := filepath.Join(t.TempDir(), "consumer.sql")
	if err := os.WriteFile(script, []byte(c.ceiling), 0o644); err != nil {
		t.Fatal(err)
	}
	testenv.Draw(t, 8)
	out, err := exec.Command(pgbench, "-n", "-c", "8", "-j", "2", "-T", "10", "-f", script, service(t, sys, c.service).DB.URL).CombinedOutput()
	if err != nil {
		t.Fatalf("pgbench: %v\n%s", err, out)
	}
	m := pgbenchTPS.FindSubmatch(out)
	if m == nil {
		t.Fatalf("pgbench printed no tps:\n%s", out)
	}
	tps, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatal(err)
	}
	return tps * consumerBatch
}

// consumerDrain: c's n messages wait in its queue, then a tenth of them again (duplicates, sent
// after all the originals so that they land in other batches). c's binary then starts, alone
// and with its defaults, and drains them; the rate is the originals over the time from the
// first row's created_at (the process's start is not counted) to the acknowledgement of the
// last message, duplicates included (before 2026-12-05, to the last row's created_at, which left
// the last batches' commits and the duplicates out).
func consumerDrain(t *testing.T, binDir string, c drained, n int, settings []string) (perSecond float64, redundant int, cpu time.Duration) {
	t.Helper()
	// BENCH_PPROF_ADDR serves the binary's profiler there, to profile the drain;
	// BENCH_INVOICING_ENV or BENCH_NOTIFICATION_ENV adds to its environment.
	extra, _ := settingsFrom(c.service)
	extra = append(extra, settings...)
	env := map[string][]string{c.service: append([]string{"PPROF_ADDR=" + os.Getenv("BENCH_PPROF_ADDR")}, extra...)}
	sys := systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, DiscardLogs: true, Env: env})
	// Only the measured consumer runs: the others would compete for the two cores.
	sys.Invoicing.Stop(t)
	sys.Notification.Stop(t)
	sys.Order.Stop(t)
	svc := service(t, sys, c.service)
	ch := sys.Channel(t)
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	var confirms []*amqp.DeferredConfirmation
	publish := func(p published) {
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), p.exchange, p.msg.Type, true, false,
			amqp.Publishing{DeliveryMode: amqp.Persistent, ContentType: "application/json", MessageId: p.msg.ID.String(), Type: p.msg.Type, Body: p.msg.Payload})
		if err != nil {
			t.Fatal(err)
		}
		confirms = append(confirms, dc)
	}
	backlog := c.backlog(t, n)
	for _, p := range backlog {
		publish(p)
	}
	// Every tenth, the first or the second of its pair in turn: both of an interleaved
	// backlog's events come twice.
	for i := 0; i < n; i += 10 {
		publish(backlog[min(i+i/10%2, n-1)])
	}
	for _, dc := range confirms {
		if !dc.Wait() {
			t.Fatal("nack")
		}
	}
	// The other consumers' queues got their copies too: gone, they cost the broker nothing more.
	for _, q := range events.Topology.Queues {
		if q.Queue != c.service {
			if _, err := ch.QueuePurge(q.Queue, false); err != nil {
				t.Fatal(err)
			}
		}
	}
	svc.Start(t)
	// The queue's depth first, from the broker: a count(*) of the rows every 20 ms would take a
	// tenth of a core from the database being measured.
	testenv.Eventually(t, 10*time.Minute, func() bool { return testenv.QueueDepth(t, ch, c.service) == 0 }, "the queue was not drained")
	// The drain ends when the last message, duplicates included, is acknowledged, which the
	// consumer does once its batch has committed: read from its own count (a scrape of the
	// binary being measured, so only once the queue has no message left to hand out).
	acked := fmt.Sprintf(`consumer_messages_total{outcome="acked",queue=%q}`, c.service)
	testenv.Eventually(t, time.Minute, func() bool { return svc.Metric(t, acked) >= float64(n+duplicates(n)) }, "not all %d messages were acknowledged", n+duplicates(n))
	end := time.Now()
	if got := testenv.Count(t, svc.DB.DB, "SELECT count(*) FROM "+c.table); got != int64(n) {
		t.Fatalf("%d %s written for %d messages", got, c.table, n)
	}
	// From the first row, stamped in the first batch's transaction, on this machine's one clock.
	var first time.Time
	if err := svc.DB.DB.Raw("SELECT min(created_at) FROM " + c.table).Scan(&first).Error; err != nil {
		t.Fatal(err)
	}
	span := end.Sub(first).Seconds()
	// The binary's relay or sender has work left after the drain: the CPU it used is counted
	// once that is done.
	testenv.Eventually(t, 2*time.Minute, func() bool { return testenv.Count(t, svc.DB.DB, c.settled) == 0 }, "work still left: %s", c.settled)
	if settings != nil && c.heldCheck != "" {
		if early := testenv.Count(t, svc.DB.DB, c.heldCheck, end); early != 0 {
			t.Errorf("%s: %d done during the drain: %s did not hold it back", c.also, early, strings.Join(settings, " "))
		}
	}
	return float64(n) / span, int(svc.AlreadyDone(t)), svc.CPUTime(t) / time.Duration(n+duplicates(n))
}

// duplicates is how many of a backlog of n consumerDrain publishes again: every tenth.
func duplicates(n int) int { return (n + 9) / 10 }

// consumerVsDatabase: c's binary's drain rate beside the database's own rate for the same rows,
// measured in the same run.
func consumerVsDatabase(t *testing.T, r *report, binDir string, c drained) {
	t.Helper()
	n := 20_000
	if v, err := strconv.Atoi(os.Getenv("BENCH_CONSUMER_N")); err == nil { // a longer drain, to profile it
		n = v
	}
	// Each in a subtest of its own: a system's connections are reserved, and given back, per
	// test.
	var ceiling, perSecond float64
	var redundant int
	var cpu time.Duration
	t.Run("ceiling", func(t *testing.T) { ceiling = consumerCeiling(t, binDir, c) })
	t.Run("drain", func(t *testing.T) { perSecond, redundant, cpu = consumerDrain(t, binDir, c, n, nil) })
	var held float64
	var heldRedundant int
	if c.held != nil {
		t.Run("drain, held", func(t *testing.T) { held, heldRedundant, _ = consumerDrain(t, binDir, c, n, c.held) })
	}
	if t.Failed() {
		return
	}
	_, settingsLabel := settingsFrom(c.service)
	baseline := fmt.Sprintf("%.0f msg/s pgbench: the same rows, set-based, batches of %d, 8 clients", ceiling, consumerBatch)
	if ceiling == 0 {
		baseline = "ceiling not run (BENCH_PHASES must name it too)"
	}
	ratio := perSecond / ceiling
	r.add(fmt.Sprintf("%s binary, %s, drains %d waiting %s + %d duplicates (%d worked twice)", c.service, settingsLabel, n, c.what, duplicates(n), redundant),
		fmt.Sprintf("%.0f msg/s", perSecond), baseline,
		ratioOf(perSecond, ceiling), "≥ 0.25", ceiling > 0 && ratio >= 0.25 && redundant == 0)
	r.add(fmt.Sprintf("   %s CPU per message (its start, consumer and %s)", c.service, c.also),
		fmt.Sprintf("%d µs", cpu.Microseconds()), "", "", "", true)
	if held > 0 { // 0: not run (BENCH_PHASES)
		r.add(fmt.Sprintf("   the same, its %s held back until the queue is drained (%s; %d worked twice)", c.also, strings.Join(c.held, " "), heldRedundant),
			fmt.Sprintf("%.0f msg/s", held), "pgbench", ratioOf(held, ceiling), "", true)
	}
}

// ratioOf is value over baseline for the table, or "n/a" when the baseline did not run.
func ratioOf(value, baseline float64) string {
	if baseline == 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.2f", value/baseline)
}
