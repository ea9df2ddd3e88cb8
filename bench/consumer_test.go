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

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// consumerBatch is what one transaction of the database ceiling writes: a batch of the
// consumer's default size.
const consumerBatch = messaging.DefaultBatchSize

// consumerCeilingScript is the invoicing consumer's work for consumerBatch messages, written
// raw, set-based, as pgbench runs it: claim the batch's inbox rows, write its invoices, and its
// InvoiceIssued outbox rows with the NOTIFY in the same statement, as messaging.Enqueue does.
// Ids are time-ordered, as the services make them.
func consumerCeilingScript() string {
	v7 := testenv.UUIDv7SQL("clock_timestamp()", "(random() * 1e15)::bigint")
	return fmt.Sprintf(`BEGIN;
INSERT INTO inbox_messages (message_id, consumer, processed_at) SELECT %[1]s, 'invoicing', now() FROM generate_series(1, %[2]d);
INSERT INTO invoices (id, order_id, customer_id, amount_cents, status, message_id, created_at)
  SELECT %[1]s, %[1]s, 'c-42', 2500, 'issued', %[1]s, now() FROM generate_series(1, %[2]d);
WITH inserted AS (INSERT INTO outbox_messages (id, type, payload, occurred_at, exchange)
  SELECT %[1]s, 'InvoiceIssued', '{"customer_id":"c-42","amount_cents":2500}', now(), 'invoicing' FROM generate_series(1, %[2]d))
  SELECT pg_notify('outbox_messages', '');
COMMIT;
`, v7, consumerBatch)
}

var pgbenchTPS = regexp.MustCompile(`tps = ([0-9.]+)`)

// consumerCeiling is the database's rate for the consumer's work: pgbench, 8 clients, for 10 s,
// on a database with the invoicing service's schema, in messages per second.
func consumerCeiling(t *testing.T, binDir string) float64 {
	t.Helper()
	pgbench, err := exec.LookPath("pgbench")
	if err != nil {
		t.Fatalf("the database ceiling needs pgbench (PostgreSQL's client tools): %v", err)
	}
	// The invoicing binary migrates its database: start it on one, then stop it.
	sys := systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, DiscardLogs: true})
	sys.Order.Stop(t)
	sys.Notification.Stop(t)
	sys.Invoicing.Stop(t)
	script := filepath.Join(t.TempDir(), "consumer.sql")
	if err := os.WriteFile(script, []byte(consumerCeilingScript()), 0o644); err != nil {
		t.Fatal(err)
	}
	testenv.Draw(t, 8)
	out, err := exec.Command(pgbench, "-n", "-c", "8", "-j", "2", "-T", "10", "-f", script, sys.Invoicing.DB.URL).CombinedOutput()
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

// consumerDrain: n OrderPlaced messages wait in the invoicing queue, then a tenth of them again
// (duplicates, sent after all the originals so that they land in other batches). The invoicing
// binary then starts, alone and with its defaults, and drains them; the rate is taken from the
// first invoice's created_at to the last's, so the process's start is not counted.
func consumerDrain(t *testing.T, binDir string, n int) (perSecond float64, redundant int, cpu time.Duration) {
	t.Helper()
	// BENCH_PPROF_ADDR serves the invoicing binary's profiler there, to profile the drain.
	env := map[string][]string{"invoicing": append([]string{"PPROF_ADDR=" + os.Getenv("BENCH_PPROF_ADDR")}, strings.Fields(os.Getenv("BENCH_INVOICING_ENV"))...)}
	sys := systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, DiscardLogs: true, Env: env})
	// Only invoicing runs: the others would compete for the two cores (notification would
	// consume the same messages from its own queue).
	sys.Invoicing.Stop(t)
	sys.Notification.Stop(t)
	sys.Order.Stop(t)
	ch := sys.Channel(t)
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	var confirms []*amqp.DeferredConfirmation
	publish := func(m messaging.Message) {
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), events.Exchange, events.OrderPlacedType, true, false,
			amqp.Publishing{DeliveryMode: amqp.Persistent, ContentType: "application/json", MessageId: m.ID.String(), Type: m.Type, Body: m.Payload})
		if err != nil {
			t.Fatal(err)
		}
		confirms = append(confirms, dc)
	}
	msgs := make([]messaging.Message, n)
	for i := range msgs {
		msgs[i] = orderPlaced(t)
		publish(msgs[i])
	}
	for i := 0; i < n; i += 10 {
		publish(msgs[i])
	}
	for _, dc := range confirms {
		if !dc.Wait() {
			t.Fatal("nack")
		}
	}
	sys.Invoicing.Start(t)
	// The queue's depth first, from the broker: a count(*) of the invoices every 20 ms would
	// take a tenth of a core from the database being measured.
	testenv.Eventually(t, 10*time.Minute, func() bool { return testenv.QueueDepth(t, ch, "invoicing") == 0 }, "the queue was not drained")
	testenv.Eventually(t, time.Minute, func() bool {
		return testenv.Count(t, sys.Invoicing.DB.DB, "SELECT count(*) FROM invoices") == int64(n)
	}, "not all %d invoices were created", n)
	var span float64
	if err := sys.Invoicing.DB.DB.Raw("SELECT extract(epoch FROM max(created_at) - min(created_at)) FROM invoices").Scan(&span).Error; err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, time.Minute, func() bool { return testenv.QueueDepth(t, ch, "invoicing") == 0 }, "duplicates still waiting")
	// Its relay has InvoiceIssued rows left to send: the CPU it used is counted once they are.
	testenv.Eventually(t, time.Minute, func() bool {
		return testenv.Count(t, sys.Invoicing.DB.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL") == 0
	}, "InvoiceIssued rows still unsent")
	return float64(n) / span, int(sys.Invoicing.AlreadyDone(t)), sys.Invoicing.CPUTime(t) / time.Duration(n+n/10)
}

// consumerVsDatabase: the invoicing binary's drain rate beside the database's own rate for the
// same rows, measured in the same run.
func consumerVsDatabase(t *testing.T, r *report, binDir string) {
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
	t.Run("ceiling", func(t *testing.T) { ceiling = consumerCeiling(t, binDir) })
	t.Run("drain", func(t *testing.T) { perSecond, redundant, cpu = consumerDrain(t, binDir, n) })
	if t.Failed() {
		return
	}
	ratio := perSecond / ceiling
	r.add(fmt.Sprintf("invoicing binary, defaults, drains %d waiting OrderPlaced + %d duplicates (%d worked twice)", n, n/10, redundant),
		fmt.Sprintf("%.0f msg/s", perSecond),
		fmt.Sprintf("%.0f msg/s pgbench: the same rows, set-based, batches of %d, 8 clients", ceiling, consumerBatch),
		fmt.Sprintf("%.2f", ratio), "≥ 0.25", ratio >= 0.25 && redundant == 0)
	r.add("   invoicing CPU per message (its start, consumer and relay)", fmt.Sprintf("%d µs", cpu.Microseconds()), "", "", "", true)
}
