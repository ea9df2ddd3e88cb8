package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// ageOfBacklog is how long the backlog of the consumers' outage waits before they come back:
// every event in it is then older than ConsumerEventAgeHigh's 60 s, and past the 64 s bucket
// bound of consumer_event_age_seconds, so its 95th percentile reads above 60 whatever the
// interpolation.
const ageOfBacklog = 70 * time.Second

// alertsNotifyConcurrency bounds the e-mails the notification service sends at once, and so
// those its SIGKILL may send again (systest.System.RepeatedMails): the default, 128, would bound
// nothing.
const alertsNotifyConcurrency = 8

// The alerts of deploy/prometheus/alerts.yml, evaluated by a real Prometheus on the real
// services' metrics and the test broker's, each made to fire by a real fault and to resolve by
// its fix, and none firing while orders flow without a fault. The rules' durations are
// compressed (see timeCompression); their metric names and thresholds are the deployed ones, so
// a rule that reads a metric no service exports, or a threshold the fault does not cross, fails
// here. The Grafana dashboard's queries are evaluated on the same Prometheus under load. After
// every fault and its fix, the whole chain ends exactly once, as in every other scenario.
func TestAlertsOnRealFaults(t *testing.T) {
	if os.Getenv("TEST_SIDROOT") == "" {
		t.Skip("needs a real Prometheus: set TEST_SIDROOT (eval \"$(scripts/sidroot.sh env)\"), whose Debian unstable root has Prometheus 3.5")
	}
	t.Parallel()
	r := &faultRun{outboxctl: buildOutboxctl(t)}
	// The order relay retries a refused row every 2 s at most, so its attempts climb past
	// OutboxPoisonRows's 10 in about half a minute. Each consumer has 2 handlers, and the
	// connections its parts need besides.
	r.s = startSystem(t, systest.Options{Env: map[string][]string{
		"order":        {"OUTBOX_MAX_BACKOFF=2s", "OUTBOX_POLL_INTERVAL=250ms"},
		"invoicing":    {"DB_MAX_CONNS=12", "CONSUMER_CONCURRENCY=2"},
		"notification": {"DB_MAX_CONNS=9", "CONSUMER_CONCURRENCY=2", fmt.Sprintf("NOTIFY_CONCURRENCY=%d", alertsNotifyConcurrency)},
	}})
	r.prom = startPrometheus(t, r.s)
	r.watch = r.prom.watch(t)
	r.ch = r.s.Channel(t)
	t.Cleanup(func() {
		t.Logf("alerts on real faults (rule durations ÷ %d, scrape and evaluation every %s):\n%s",
			timeCompression, promInterval, strings.Join(r.report, "\n"))
	})

	traffic := r.quiet(t)
	killed, down := r.killConsumers(t, traffic)
	lastOrder := r.cutBroker(t)
	r.poisonRow(t)
	r.restartConsumers(t, killed, lastOrder, down)
	r.poisonMessage(t)

	// The whole chain, every fault fixed. The unroutable row went to the queue bound for it, not
	// to the consumers; the poison message was dropped; the order the trigger refused, redriven,
	// is one of the accepted orders, invoiced and notified like the others. The dead-letter
	// queues end empty (not PoisonSent): the poison message is dropped, the order redriven.
	unconfirmed := r.s.CheckAccepted(t, r.accepted)
	got := r.s.WaitExactlyOnce(t, int64(len(r.accepted))+unconfirmed, 3*time.Minute)
	r.note("exactly once over the whole chain: %d orders accepted (%d more committed whose answer was lost), %d cancelled; %d invoices, %d notifications sent, %d e-mails (%d repeated with their Message-ID)",
		len(r.accepted), unconfirmed, got.Cancelled, got.Invoices, got.Sent, got.Mails, got.DuplicateMails)

	// How close the scrapes came to their timeout (the interval): a slow one reads as a target
	// down.
	for _, d := range r.prom.query(t, fmt.Sprintf("max_over_time(scrape_duration_seconds[%ds])", int(time.Since(r.started).Seconds()))) {
		r.note("slowest scrape of %s: %.3f s", d.Metric["job"], d.Value)
	}
}

// faultRun is one system under a live Prometheus, and what its faults did when.
type faultRun struct {
	s         *systest.System
	prom      *livePrometheus
	watch     *alertWatch
	ch        *amqp.Channel // the test's own, straight to the broker
	outboxctl func() string
	started   time.Time
	report    []string    // printed at the end, failed or not
	accepted  []uuid.UUID // the orders answered 201, for the whole-chain check at the end
}

func (r *faultRun) note(format string, args ...any) {
	r.report = append(r.report, fmt.Sprintf(format, args...))
}

// since is at − from to the millisecond: how long after a fault, or its fix, an alert's moment
// came.
func since(from, at time.Time) time.Duration { return at.Sub(from).Round(time.Millisecond) }

// quiet requires, under steady orders without a fault, every target up (the six of the
// default stack: the cluster profile's jobs, whose names nothing answers here, add none),
// every rule evaluated without error, every panel of the dashboard with data, and no alert
// firing. It returns the traffic, still running.
func (r *faultRun) quiet(t *testing.T) *systest.Traffic {
	t.Helper()
	r.started = time.Now()
	var up []sample
	testenv.Eventually(t, 30*time.Second, func() bool {
		up = r.prom.query(t, "up")
		return len(up) == 6 && !slices.ContainsFunc(up, func(s sample) bool { return s.Value != 1 })
	}, "not every target is up: %v", lazy(func() string { return fmt.Sprint(up) }))
	r.prom.checkRulesHealthy(t)
	traffic := r.s.StartTraffic(t, 2)
	traffic.WaitFor(t, 50)
	quiet := time.Now()
	checkDashboard(t, r.prom)
	traffic.WaitFor(t, 100)
	for time.Since(quiet) < 15*time.Second { // a window of observation, not a wait for anything
		time.Sleep(100 * time.Millisecond)
	}
	// Asked of Prometheus, not of the watch: its polls may be slow, or fail, on a busy machine,
	// and an alert could fire and resolve unseen between two of them.
	end := time.Now()
	fired, wasPending, err := r.prom.alertsIn(r.started, end, 30*promInterval)
	if err != nil {
		t.Fatalf("no alert firing in the window of steady orders without a fault proves nothing unless Prometheus says so: %v", err)
	}
	if len(fired) != 0 {
		t.Fatalf("alerts fired while orders flowed without a fault: %v", fired)
	}
	// The rules held for longer than this window (30 s and 3 min, scaled) cannot fire within
	// it: their condition must not hold at its end, or they would fire later without a fault.
	// (A shorter rule pending for a blip, a slow scrape, would have fired had it lasted.)
	window := time.Since(r.started)
	held := r.prom.ruleHolds(t)
	var pending []sample
	for _, a := range r.prom.query(t, "ALERTS") {
		if held[a.Metric["alertname"]] > window {
			pending = append(pending, a)
		}
	}
	if len(pending) != 0 {
		t.Fatalf("alerts held longer than the %s of steady orders without a fault are pending at its end: %v", window.Round(time.Second), pending)
	}
	if up = r.prom.query(t, "up"); len(up) != 6 {
		t.Fatalf("after %s, Prometheus scrapes %d targets, want the default stack's 6: %v", time.Since(r.started).Round(time.Second), len(up), up)
	}
	r.prom.checkRulesHealthy(t)
	r.note("quiet: no alert fired in %s of steady orders (%d placed); pending meanwhile: %v",
		end.Sub(r.started).Round(time.Second), traffic.Placed(), wasPending)
	return traffic
}

// killConsumers SIGKILLs both consumers while traffic goes on: ServiceDown fires for each, and
// QueueWithoutConsumers for each of their queues. They stay down while 400 more orders fill
// their queues, and the traffic stops. down holds each alert's episode, by what it names.
func (r *faultRun) killConsumers(t *testing.T, traffic *systest.Traffic) (killed time.Time, down map[string]*episode) {
	t.Helper()
	killed = time.Now()
	r.s.Invoicing.Kill(t)
	// Killed between an e-mail's send and its mark, the sender sends it again after its restart.
	r.s.RepeatedMails += alertsNotifyConcurrency
	r.s.Notification.Kill(t)
	down = map[string]*episode{}
	for _, job := range []string{"invoicing", "notification"} {
		name := "ServiceDown{job=" + job + "}"
		down[name] = r.watch.firing(t, 30*time.Second, killed, "ServiceDown", map[string]string{"job": job})
		r.note("%s: fired %s after the SIGKILL", name, since(killed, down[name].Fired))
	}
	for _, queue := range []string{"invoicing", "notification"} {
		name := "QueueWithoutConsumers{queue=" + queue + "}"
		down[name] = r.watch.firing(t, 60*time.Second, killed, "QueueWithoutConsumers", map[string]string{"queue": queue})
		r.note("%s: fired %s after the SIGKILL", name, since(killed, down[name].Fired))
	}
	traffic.WaitFor(t, 400)
	accepted, _, serverErrors := traffic.Stop(t)
	if serverErrors != 0 {
		t.Errorf("%d orders got a 5xx while the consumers were down", serverErrors)
	}
	r.accepted = append(r.accepted, accepted...)
	return killed, down
}

// cutBroker stops the broker's proxy while orders come: the order relay sees it gone and
// BrokerUnavailable fires; it resolves once the broker is back. It returns when the last order
// was placed.
func (r *faultRun) cutBroker(t *testing.T) (lastOrder time.Time) {
	t.Helper()
	cut := time.Now()
	r.s.Broker.Stop()
	var unavailable *episode
	testenv.Eventually(t, time.Minute, func() bool {
		r.accepted = append(r.accepted, r.s.PlaceOrder(t, "during-broker-outage"))
		lastOrder = time.Now()
		time.Sleep(250 * time.Millisecond) // pacing: four orders a second
		unavailable = r.watch.find("BrokerUnavailable", map[string]string{"job": "order", "exchange": "orders"}, cut)
		return unavailable != nil
	}, "BrokerUnavailable did not fire for the order relay")
	back := time.Now()
	if err := r.s.Broker.Start(); err != nil {
		t.Fatal(err)
	}
	resolved := r.watch.resolved(t, 30*time.Second, unavailable)
	r.note("BrokerUnavailable{job=order}: fired %s after the broker was cut off; resolved %s after it was back",
		since(cut, unavailable.Fired), since(back, resolved))
	return lastOrder
}

// poisonRow enqueues an outbox row the broker refuses (no queue is bound to its type): its
// attempts climb past 10 and OutboxPoisonRows fires. The runbook's fix, a queue bound to it and
// outboxctl retry, resolves it.
func (r *faultRun) poisonRow(t *testing.T) {
	t.Helper()
	row := enqueueUnroutable(t, r.s)
	enqueued := time.Now()
	poison := r.watch.firing(t, 2*time.Minute, enqueued, "OutboxPoisonRows", map[string]string{"job": "order"})
	if _, err := r.ch.QueueDeclare("unroutable-fix", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := r.ch.QueueBind("unroutable-fix", row.Type, "orders", false, nil); err != nil {
		t.Fatal(err)
	}
	fixed := time.Now()
	// The relay retries the row every 2 s by itself: it may have sent it before outboxctl runs,
	// which then finds no unsent row with that id (exit 3). Either way, it went out.
	args := []string{"retry", "--id", row.ID.String(), "--yes", "--db", r.s.Order.DB.URL}
	out, err := outboxctl(r.outboxctl(), args...)
	var exit *exec.ExitError
	sent := testenv.Count(t, r.s.Order.DB.DB, "SELECT count(*) FROM outbox_messages WHERE id = ? AND processed_at IS NOT NULL", row.ID) == 1
	sentFirst := errors.As(err, &exit) && exit.ExitCode() == 3 && sent
	if err != nil && !sentFirst {
		t.Fatalf("outboxctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	t.Logf("outboxctl retry (the row sent by then: %v):\n%s", sent, out)
	resolved := r.watch.resolved(t, 30*time.Second, poison)
	r.note("OutboxPoisonRows{job=order}: fired %s after the unroutable row was enqueued; resolved %s after a queue was bound and outboxctl retry",
		since(enqueued, poison.Fired), since(fixed, resolved))
}

// restartConsumers brings the consumers back once their backlog is over a minute old, with one
// handler each, so that it takes a while to drain: ServiceDown resolves, ConsumerEventAgeHigh
// fires while they work it off and resolves once the old events are out of its window.
func (r *faultRun) restartConsumers(t *testing.T, killed, lastOrder time.Time, down map[string]*episode) {
	t.Helper()
	time.Sleep(time.Until(lastOrder.Add(ageOfBacklog))) // the backlog ages: real seconds
	restarted := time.Now()
	for _, c := range []*systest.Service{r.s.Invoicing, r.s.Notification} {
		c.SetEnv("CONSUMER_CONCURRENCY=1", "CONSUMER_BATCH_SIZE=1", "CONSUMER_PREFETCH=1")
		c.Start(t)
	}
	for _, name := range slices.Sorted(maps.Keys(down)) {
		r.note("%s: resolved %s after the restart", name, since(restarted, r.watch.resolved(t, 30*time.Second, down[name])))
	}
	var aged *episode
	var drained time.Duration
	ageHigh := map[string]string{"job": "invoicing", "consumer": "invoicing"}
	testenv.Eventually(t, 3*time.Minute, func() bool {
		if drained == 0 && testenv.QueueDepth(t, r.ch, "invoicing") == 0 {
			drained = time.Since(restarted)
		}
		if aged == nil {
			aged = r.watch.find("ConsumerEventAgeHigh", ageHigh, restarted)
		}
		return aged != nil && drained != 0
	}, "ConsumerEventAgeHigh %v fired: %v; the invoicing backlog drained after: %v", ageHigh,
		lazy(func() string { return fmt.Sprint(aged != nil) }), lazy(func() string { return drained.String() }))
	resolved := r.watch.resolved(t, time.Minute, aged)
	r.note("ConsumerEventAgeHigh{job=invoicing}: fired %s after the SIGKILL (%s after the restart; backlog drained in %s); resolved %s after the restart",
		since(killed, aged.Fired), since(restarted, aged.Fired), drained.Round(time.Millisecond), since(restarted, resolved))
}

// poisonMessage publishes an undecodable message into the invoicing queue, the first dead-letter
// since that consumer started (the zero series exported at its start let increase() see it):
// ConsumerDeadLettering and DeadLetterQueueNotEmpty fire. A good order that the consumer fails
// on at every delivery (its database refuses the invoice) joins it there. The fix: the database
// takes invoices again, the poison message is dropped and the order redriven, and handled: the
// dead-letter queue ends empty, and both alerts resolve.
func (r *faultRun) poisonMessage(t *testing.T) {
	t.Helper()
	deadLettered := `consumer_messages_total{job="invoicing",queue="invoicing",outcome="dead_lettered"}`
	testenv.Eventually(t, 10*time.Second, func() bool { return len(r.prom.query(t, deadLettered+" == 0")) == 1 },
		"Prometheus has no %s = 0 since the consumer's restart: without the zero series, increase() misses its first dead-letter", deadLettered)
	poison := uuid.NewString()
	poisoned := time.Now()
	if err := r.ch.PublishWithContext(context.Background(), "", "invoicing", false, false, amqp.Publishing{
		MessageId: poison, Type: "OrderPlaced", ContentType: "application/json", Body: []byte("not json"),
	}); err != nil {
		t.Fatal(err)
	}
	deadLetters := r.watch.firing(t, 30*time.Second, poisoned, "ConsumerDeadLettering", map[string]string{"job": "invoicing", "queue": "invoicing"})
	dlq := r.watch.firing(t, 30*time.Second, poisoned, "DeadLetterQueueNotEmpty", map[string]string{"queue": "invoicing.dlq", "vhost": r.s.VHost})
	r.note("ConsumerDeadLettering{job=invoicing}: fired %s after the first poison message since the consumer started", since(poisoned, deadLetters.Fired))
	r.note("DeadLetterQueueNotEmpty{queue=invoicing.dlq}: fired %s after it", since(poisoned, dlq.Fired))

	refuseInvoices(t, r.s.Invoicing.DB.DB, "blocked-customer")
	blocked := r.s.PlaceOrder(t, "blocked-customer")
	r.accepted = append(r.accepted, blocked)
	testenv.Eventually(t, 2*time.Minute, func() bool { return testenv.QueueDepth(t, r.ch, "invoicing.dlq") == 2 },
		"the order the database refuses was not dead-lettered")
	lastDeadLetter := time.Now()

	allowInvoices(t, r.s.Invoicing.DB.DB)
	runOutboxctl(t, r.outboxctl, "dlq", "drop", "invoicing", "--id", poison, "--yes", "--amqp", r.s.AMQPURL)
	runOutboxctl(t, r.outboxctl, "dlq", "redrive", "invoicing", "--yes", "--amqp", r.s.AMQPURL)
	redriven := time.Now()
	resolved := r.watch.resolved(t, 30*time.Second, dlq)
	r.note("DeadLetterQueueNotEmpty{queue=invoicing.dlq}: resolved %s after outboxctl dlq drop (the poison message) and dlq redrive (the order, handled now)",
		since(redriven, resolved))
	testenv.Eventually(t, 30*time.Second, func() bool {
		var invoices []struct{ Status string }
		r.s.Invoicing.GetJSON(t, "/invoices?order_id="+blocked.String(), &invoices)
		return len(invoices) == 1 && invoices[0].Status == "issued"
	}, "the redriven order %s has no invoice", blocked)
	if n := testenv.QueueDepth(t, r.ch, "invoicing.dlq"); n != 0 {
		t.Errorf("invoicing.dlq holds %d messages after the fix, want 0", n)
	}
	resolved = r.watch.resolved(t, time.Minute, deadLetters)
	r.note("ConsumerDeadLettering{job=invoicing}: resolved %s after the last dead-letter (its window)", since(lastDeadLetter, resolved))
}

// checkDashboard evaluates every query of the Grafana dashboard on p, $__rate_interval being
// what Grafana makes of it for p's scrape interval (4 of them), and requires each to return
// data: at least one series with a value.
func checkDashboard(t *testing.T, p *livePrometheus) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "deploy", "grafana", "dashboards", "outbox-inbox.json"))
	if err != nil {
		t.Fatal(err)
	}
	type panel struct {
		Title   string `json:"title"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
		Panels []json.RawMessage `json:"panels"`
	}
	var queries []string
	var walk func([]json.RawMessage)
	walk = func(raws []json.RawMessage) {
		for _, r := range raws {
			var p panel
			if err := json.Unmarshal(r, &p); err != nil {
				t.Fatal(err)
			}
			for _, q := range p.Targets {
				queries = append(queries, p.Title+": "+q.Expr)
			}
			walk(p.Panels)
		}
	}
	var dashboard struct {
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(raw, &dashboard); err != nil {
		t.Fatal(err)
	}
	walk(dashboard.Panels)
	rate := (4 * promInterval).String()
	empty := 0
	// A rate needs two samples in its window, which a fresh load has only after a few scrapes:
	// each query is asked again until it answers, or the shared deadline passes.
	deadline := time.Now().Add(15 * promInterval)
	for _, q := range queries {
		title, expr, _ := strings.Cut(q, ": ")
		expr = strings.ReplaceAll(expr, "$__rate_interval", rate)
		for !hasValue(p.query(t, expr)) {
			if time.Now().After(deadline) {
				t.Errorf("dashboard panel %q: %s returns no data under load", title, expr)
				empty++
				break
			}
			time.Sleep(promInterval / 4) // the poll's interval
		}
	}
	t.Logf("dashboard: %d of %d queries return data under load ($__rate_interval = %s)", len(queries)-empty, len(queries), rate)
}

// buildOutboxctl builds cmd/outboxctl in the background; the returned function waits for it
// and returns its path.
func buildOutboxctl(t *testing.T) func() string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "outboxctl")
	done := make(chan error, 1)
	go func() {
		out, err := exec.Command("go", "build", "-o", bin, "github.com/outboxkit/outbox-inbox/cmd/outboxctl").CombinedOutput()
		if err != nil {
			err = fmt.Errorf("%w\n%s", err, out)
		}
		done <- err
	}()
	var err error
	var waited bool
	return func() string {
		if !waited {
			err, waited = <-done, true
		}
		if err != nil {
			t.Fatalf("build outboxctl: %v", err)
		}
		return bin
	}
}

// outboxctlTimeout bounds a run of outboxctl, which here handles a row or two messages: one
// that hangs (on a broker or a database that never answers) must not take the package's
// -timeout with it.
const outboxctlTimeout = time.Minute

// outboxctl runs the outboxctl at bin with args, without a terminal, and returns its output. A
// run past outboxctlTimeout is killed, and is an error that says so.
func outboxctl(bin string, args ...string) ([]byte, error) {
	return runWithin(outboxctlTimeout, bin, args...)
}

// runWithin runs bin with args and returns its output. Past timeout, bin is SIGKILLed; what
// it started and left holding its output has 5 s more before the output is no longer waited
// for. Either way the run is an error that says it was killed.
func runWithin(timeout time.Duration, bin string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil && ctx.Err() != nil {
		err = fmt.Errorf("killed after %s: %w", timeout, err)
	}
	return out, err
}

// runOutboxctl runs outboxctl with args, without a terminal, and requires it to succeed within
// outboxctlTimeout.
func runOutboxctl(t *testing.T, bin func() string, args ...string) {
	t.Helper()
	out, err := outboxctl(bin(), args...)
	if err != nil {
		t.Fatalf("outboxctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	t.Logf("outboxctl %s:\n%s", args[0]+" "+args[1], out)
}

// enqueueUnroutable commits a row to the order service's outbox whose type no queue is bound
// to: the broker returns it at every attempt.
func enqueueUnroutable(t *testing.T, s *systest.System) messaging.Message {
	t.Helper()
	msg, err := messaging.NewMessage("NobodyBindsThis", map[string]string{"note": "a type no queue is bound to"})
	if err != nil {
		t.Fatal(err)
	}
	msg.Exchange = "orders"
	drv := s.Order.DB.Driver(t)
	if err := s.Order.DB.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), drv, tx, msg) }); err != nil {
		t.Fatal(err)
	}
	return msg
}

// refuseInvoices makes the invoicing database refuse the invoices of customer: a dependency
// that fails at every delivery, until allowInvoices.
func refuseInvoices(t *testing.T, db *gorm.DB, customer string) {
	t.Helper()
	for _, stmt := range []string{
		fmt.Sprintf(`CREATE FUNCTION refuse_invoice() RETURNS trigger LANGUAGE plpgsql AS $$
			BEGIN
				IF NEW.customer_id = '%s' THEN RAISE EXCEPTION 'invoices of %s refused (a test fault)'; END IF;
				RETURN NEW;
			END $$`, customer, customer),
		"CREATE TRIGGER refuse_invoice BEFORE INSERT ON invoices FOR EACH ROW EXECUTE FUNCTION refuse_invoice()",
	} {
		if err := db.Exec(stmt).Error; err != nil {
			t.Fatal(err)
		}
	}
}

func allowInvoices(t *testing.T, db *gorm.DB) {
	t.Helper()
	if err := db.Exec("DROP TRIGGER refuse_invoice ON invoices").Error; err != nil {
		t.Fatal(err)
	}
}

// A command that outlives its bound is killed, and its run is an error that says so, at once:
// a hung outboxctl does not hold the test until the package's -timeout.
func TestRunWithinKillsACommandPastItsBound(t *testing.T) {
	t.Parallel()
	hang := filepath.Join(t.TempDir(), "hang")
	if err := os.WriteFile(hang, []byte("#!/bin/sh\necho started\nexec sleep 20\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	out, err := runWithin(300*time.Millisecond, hang)
	took := time.Since(start)
	if err == nil || !strings.Contains(err.Error(), "killed after 300ms") {
		t.Errorf("a run past its bound: err = %v, want one that says it was killed after 300ms", err)
	}
	if took > 5*time.Second {
		t.Errorf("a run bounded to 300ms returned after %s", took.Round(time.Millisecond))
	}
	if !strings.Contains(string(out), "started") {
		t.Errorf("the output before the kill is lost: %q", out)
	}
	if out, err := runWithin(10*time.Second, "true"); err != nil {
		t.Errorf("a run within its bound: %v %s", err, out)
	}
}
