// Package bench measures the system against this machine's own limits: every figure is printed
// next to a baseline measured in the same run, because the machine is shared and noisy and the
// ratio is what counts. Run it with scripts/bench.sh.
package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// serviceSettings are the variables the three binaries read their settings from (the
// families by prefix, with the OpenTelemetry SDK's), and those of the Go runtime. The binaries
// inherit this process's environment, and every figure is of their defaults. Left out: the
// addresses the harness gives each (DATABASE_URL, AMQP_URL, HTTP_ADDR).
var serviceSettings = []string{"CONSUMER_", "NOTIFY_", "OTEL_", "OUTBOX_", "SMTP_",
	"DB_MAX_CONNS=", "HTTP_LATENCY_TARGET=", "HTTP_MAX_IN_FLIGHT=", "INBOX_RETENTION=", "LOG_FORMAT=", "LOG_LEVEL=", "PPROF_ADDR=",
	"GOMAXPROCS=", "GOGC=", "GOMEMLIMIT=", "GODEBUG="}

// refuseServiceSettings fails the run if the environment holds a setting of the binaries: they
// would run with it, and the table would call it their defaults. BENCH_ORDER_ENV and the like
// give a phase other settings, and its rows say so.
func refuseServiceSettings(t *testing.T) {
	t.Helper()
	for _, kv := range os.Environ() {
		for _, p := range serviceSettings {
			if strings.HasPrefix(kv, p) {
				t.Fatalf("%s is set: the binaries are measured with their defaults (BENCH_ORDER_ENV, BENCH_INVOICING_ENV and BENCH_NOTIFICATION_ENV give a phase others)", kv)
			}
		}
	}
}

// settingsFrom reads BENCH_<SERVICE>_ENV, the settings a phase gives service instead of its
// defaults, and says which the phase's rows measure.
func settingsFrom(service string) (env []string, label string) {
	env = strings.Fields(os.Getenv("BENCH_" + strings.ToUpper(service) + "_ENV"))
	if len(env) == 0 {
		return nil, "defaults"
	}
	return env, "with " + strings.Join(env, " ")
}

// row is one line of the final table.
type row struct {
	name, value, baseline, ratio, target, verdict string
}

type report struct {
	mu   sync.Mutex
	rows []row
}

func (r *report) add(name, value, baseline, ratio, target string, ok bool) {
	verdict := "ok"
	if !ok {
		verdict = "MISSED"
	}
	if target == "" {
		verdict = ""
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rows = append(r.rows, row{name, value, baseline, ratio, target, verdict})
}

// missed names the figures that missed their target.
func (r *report) missed() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, x := range r.rows {
		if x.verdict == "MISSED" {
			out = append(out, strings.TrimSpace(x.name))
		}
	}
	return out
}

func (r *report) print() {
	w := []int{0, 0, 0, 0, 0, 0}
	all := append([]row{{"figure", "measured", "baseline (same run)", "ratio", "target", ""}}, r.rows...)
	for _, x := range all {
		for i, c := range []string{x.name, x.value, x.baseline, x.ratio, x.target, x.verdict} {
			w[i] = max(w[i], len([]rune(c)))
		}
	}
	for i, x := range all {
		cells := []string{x.name, x.value, x.baseline, x.ratio, x.target, x.verdict}
		fmt.Print("|")
		for j, c := range cells {
			fmt.Printf(" %s%s |", c, strings.Repeat(" ", w[j]-len([]rune(c))))
		}
		fmt.Println()
		if i == 0 {
			fmt.Print("|")
			for j := range cells {
				fmt.Printf("%s|", strings.Repeat("-", w[j]+2))
			}
			fmt.Println()
		}
	}
}

func TestPerformance(t *testing.T) {
	if os.Getenv("BENCH") != "1" {
		t.Skip("the benchmark suite takes minutes; run scripts/bench.sh (BENCH=1)")
	}
	// BENCH_BINARIES measures the binaries in that directory instead of this checkout's:
	// another revision's, built by scripts/bench-compare.sh.
	binDir := os.Getenv("BENCH_BINARIES")
	if binDir == "" {
		binDir = t.TempDir()
		if err := systest.Build(binDir, false); err != nil {
			t.Fatal(err)
		}
	}
	refuseServiceSettings(t)
	var r report
	// A missed target fails the test, after the table, so scripts/bench.sh exits non-zero.
	defer func() {
		r.print()
		if len(r.rows) == 0 {
			t.Error("no phase ran: BENCH_PHASES matches none of them")
		}
		if missed := r.missed(); len(missed) > 0 {
			t.Errorf("%d figure(s) missed their target:\n  %s", len(missed), strings.Join(missed, "\n  "))
		}
	}()

	// Each phase is a subtest, so its databases, queues and processes are gone before the next
	// one measures anything.
	phase := func(name string, fn func(t *testing.T)) {
		if !t.Run(name, fn) {
			t.FailNow()
		}
	}
	phase("relay", func(t *testing.T) { relayBinary(t, &r, binDir) })
	phase("relay-in-process", func(t *testing.T) { relayInProcess(t, &r) })
	var b2 float64
	phase("B2", func(t *testing.T) { b2 = databaseCeiling(t, &r) })
	phase("post", func(t *testing.T) { postThroughput(t, &r, binDir, b2) })
	phase("cleanup", func(t *testing.T) { postLatencyDuringCleanup(t, &r, binDir) })
	phase("latency-notify", func(t *testing.T) { endToEndLatency(t, &r, binDir, true) })
	phase("latency-poll", func(t *testing.T) { endToEndLatency(t, &r, binDir, false) })
	phase("overload", func(t *testing.T) { overload(t, &r, binDir) })
	phase("consumer", func(t *testing.T) { consumerVsDatabase(t, &r, binDir, invoicingDrain) })
	phase("consumer-notification", func(t *testing.T) { consumerVsDatabase(t, &r, binDir, notificationDrain) })
	phase("sender", func(t *testing.T) { senderThroughput(t, &r, binDir) })
}

func rate(n int, d time.Duration) float64 { return float64(n) / d.Seconds() }

// stages reads where an order's way to its invoice spends its time from the spans the services
// exported: the POST's own span, from its end to its event's publish span (the relay waking
// and claiming), the publish (its confirm), from the publish's start to the invoicing
// consumer's span (the broker's routing and delivery), and that span (the inbox transaction).
func stages(t *testing.T, r *report, spans *testenv.OTLPReceiver) {
	t.Helper()
	var request, toPublish, publish, toConsumer, process []time.Duration
	for _, tr := range orderTraces(spans) {
		if tr.request == nil || tr.publish == nil || tr.process == nil {
			continue
		}
		request = append(request, tr.request.End.Sub(tr.request.Start))
		toPublish = append(toPublish, tr.publish.Start.Sub(tr.request.End))
		publish = append(publish, tr.publish.End.Sub(tr.publish.Start))
		toConsumer = append(toConsumer, tr.process.Start.Sub(tr.publish.Start))
		process = append(process, tr.process.End.Sub(tr.process.Start))
	}
	for _, st := range []struct {
		name string
		d    []time.Duration
	}{
		{"POST /orders (its server span)", request}, {"commit → publish starts (NOTIFY, the relay's claim)", toPublish},
		{"publish, until the broker's confirm", publish}, {"publish starts → the consumer's span starts (routing, delivery)", toConsumer},
		{"the consumer's inbox transaction", process},
	} {
		slices.Sort(st.d)
		r.add("   stage: "+st.name+fmt.Sprintf(" (%d traces)", len(st.d)), fmt.Sprintf("p50 %s, p99 %s", ms(percentile(st.d, .5)), ms(percentile(st.d, .99))), "", "", "", true)
	}
}

// orderTrace is the spans of one order's trace that the latency phase reads: its POST's server
// span, its OrderPlaced's publish, and the invoicing service's span of that message, which
// ends once its inbox transaction has committed.
type orderTrace struct{ request, publish, process *testenv.Span }

// orderTraces groups the spans spans received by trace.
func orderTraces(spans *testenv.OTLPReceiver) map[string]*orderTrace {
	traces := map[string]*orderTrace{}
	all := spans.Spans()
	for i := range all {
		s := &all[i]
		tr := traces[s.TraceID]
		if tr == nil {
			tr = &orderTrace{}
			traces[s.TraceID] = tr
		}
		switch {
		case s.Service == "order" && s.Kind == "server" && s.Name == "POST /orders":
			tr.request = s
		case s.Service == "order" && s.Kind == "producer":
			tr.publish = s
		case s.Service == "invoicing" && s.Kind == "consumer" && (tr.process == nil || s.End.After(tr.process.End)):
			tr.process = s // the last attempt's: a batch that failed is tried again, message by message
		}
	}
	return traces
}

// databaseCeiling (B2): the order service's own transaction (order + line + outbox row +
// NOTIFY) on its own schema (its migrations: their checks and index cost what they cost it),
// issued directly with pgx from 8 connections for 10 s.
func databaseCeiling(t *testing.T, r *report) float64 {
	t.Helper()
	const conns, duration = 8, 10 * time.Second
	testenv.Connections(t, testenv.DefaultConnections+conns)
	db := testenv.NewDatabase(t)
	db.Migrate(t, platform.Library(messaging.MigrateOutbox), platform.Migrations(os.DirFS("../services/order"), "migrations", "order_schema"))
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = conns
	testenv.Draw(t, conns)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var done, failed atomic.Int64
	ctx, cancel := context.WithTimeout(context.Background(), duration)
	defer cancel()
	var wg sync.WaitGroup
	start := time.Now()
	for range conns {
		wg.Go(func() {
			for ctx.Err() == nil {
				id, _ := uuid.NewV7()
				msgID, _ := uuid.NewV7()
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `INSERT INTO orders (id, customer_id, total_cents, created_at) VALUES ($1, 'c-42', 2500, now())`, id); err != nil {
						return err
					}
					if _, err := tx.Exec(ctx, `INSERT INTO order_lines VALUES ($1, 1, 'SKU-1', 2, 1250)`, id); err != nil {
						return err
					}
					// The row and the NOTIFY in one statement, as messaging.Enqueue writes them.
					_, err := tx.Exec(ctx, `WITH inserted AS (INSERT INTO outbox_messages (id, type, payload, occurred_at)
						VALUES ($1, 'OrderPlaced', $2, now())) SELECT pg_notify('outbox_messages', '')`,
						msgID, `{"order_id":"`+id.String()+`"}`)
					return err
				})
				switch {
				case err == nil:
					done.Add(1)
				case ctx.Err() == nil: // not the end of the run
					failed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	b2 := rate(int(done.Load()), time.Since(start))
	// A failing transaction would lower the ceiling, and raise every ratio to it.
	r.add(fmt.Sprintf("B2 database ceiling: order transaction with pgx, 8 connections (%d failed)", failed.Load()), fmt.Sprintf("%.0f tx/s", b2), "", "1.00",
		"0 failed", failed.Load() == 0)
	return b2
}

// percentile of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, int(p*float64(len(sorted))))]
}

const orderBody = `{"customer_id":"c-42","lines":[{"sku":"SKU-1","quantity":2,"unit_price_cents":1250}]}`

// postThroughput: concurrent keep-alive clients for 10 s against the order service alone (its
// relay included; the consumers stopped so they do not compete for the two cores).
func postThroughput(t *testing.T, r *report, binDir string, b2 float64) {
	t.Helper()
	sys := systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, DiscardLogs: true})
	sys.Invoicing.Stop(t)
	sys.Notification.Stop(t)
	started := sys.Order.PeakRSS(t) // its peak before the load: the RSS row's baseline
	const clients, duration = 16, 10 * time.Second
	transport := &http.Transport{MaxIdleConnsPerHost: clients}
	client := &http.Client{Transport: transport, Timeout: 10 * time.Second}
	var got outcomes
	deadline := time.Now().Add(duration)
	start := time.Now()
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				if post(client, sys.Order.URL, &got).status == http.StatusServiceUnavailable {
					time.Sleep(shedPause) // as the saturation clients do (see shedPause)
				}
			}
		})
	}
	wg.Wait()
	took := time.Since(start)
	latencies, errs := got.split(http.StatusCreated)
	rps := rate(len(latencies), took)
	baseline := "B2"
	if b2 == 0 {
		baseline = "B2 not run (BENCH_PHASES must name it too)"
	}
	r.add(fmt.Sprintf("POST /orders, %d keep-alive clients, 10 s (errors %s)", clients, got.errors()), fmt.Sprintf("%.0f req/s", rps), baseline,
		ratioOf(rps, b2), "≥ 0.50, 0 err", b2 > 0 && rps/b2 >= 0.5 && errs == 0)
	r.add("   POST /orders latency p50 / p99", fmt.Sprintf("%s / %s", percentile(latencies, .5).Round(100*time.Microsecond), percentile(latencies, .99).Round(100*time.Microsecond)), "", "", "", true)
	rss := sys.Order.PeakRSS(t)
	r.add("   order service peak RSS during the POST load", mib(rss), mib(started)+" before the load", ratioOf(float64(rss), float64(started)), "≤ 64 MiB", rss <= 64<<20)
}

// mib is a size in bytes for the table.
func mib(bytes int64) string { return fmt.Sprintf("%.1f MiB", float64(bytes)/(1<<20)) }

// The latency target's rate, and the floor's: the same path at a rate that leaves the machine
// mostly idle, the baseline that shows what the path itself takes.
const (
	latencyRate, latencyDuration = 200, time.Minute
	floorRate, floorDuration     = 25, 30 * time.Second
)

// endToEndLatency: a steady 200 orders/s for a minute, open loop (a request starts every 5 ms
// whatever the previous ones do); latency from the start of the order's POST (its server span)
// to the end of the invoicing service's span of its OrderPlaced, which ends once the invoice's
// transaction has committed: both stamped by the services from this machine's one clock. The
// services run with their defaults and their spans exported (to a receiver in this process), as
// a user who traces runs them; with notify, beside the same at 25 orders/s (the floor);
// without, with LISTEN/NOTIFY off, for comparison. Each run also prints how busy the machine's cores
// were, and each process's CPU per order.
func endToEndLatency(t *testing.T, r *report, binDir string, notify bool) {
	t.Helper()
	baseline := ""
	if notify {
		t.Run("floor", func(t *testing.T) {
			sys, spans := latencySystem(t, binDir, notify)
			sent, errs := placeAtRate(sys, floorRate, floorDuration)
			lat := invoiceLatencies(t, sys, spans)
			baseline = fmt.Sprintf("at %d/s for %s (%d orders, %d errors): p50 %s, p99 %s", floorRate, floorDuration, sent, errs,
				ms(percentile(lat, .5)), ms(percentile(lat, .99)))
		})
	}
	sys, spans := latencySystem(t, binDir, notify)
	services := []*systest.Service{sys.Order, sys.Invoicing, sys.Notification}
	cpu := make([]time.Duration, len(services))
	started := make([]int64, len(services)) // each one's peak RSS before the load, its baseline
	for i, s := range services {
		cpu[i] = -s.CPUTime(t)
		started[i] = s.PeakRSS(t)
	}
	busy, total := machineCPU(t)
	sent, errs := placeAtRate(sys, latencyRate, latencyDuration)
	busyEnd, totalEnd := machineCPU(t)
	for i, s := range services {
		cpu[i] += s.CPUTime(t)
	}
	lat := invoiceLatencies(t, sys, spans)
	mode := "LISTEN/NOTIFY, spans exported"
	if !notify {
		mode = "polling only (1 s), spans exported"
	}
	p50, p99 := percentile(lat, .5), percentile(lat, .99)
	ok := errs == 0 && (!notify || (p50 <= 5*time.Millisecond && p99 <= 25*time.Millisecond))
	target := "p50 ≤ 5 ms, p99 ≤ 25 ms, 0 errors"
	if !notify {
		target = "0 errors" // a comparison, but an order that failed is a miss all the same
	}
	r.add(fmt.Sprintf("order → invoice latency at %d/s for %s, %s (%d orders, %d errors)", latencyRate, latencyDuration, mode, sent, errs),
		fmt.Sprintf("p50 %s, p99 %s", ms(p50), ms(p99)), baseline, "", target, ok)
	rows := rowLatencies(t, sys)
	r.add("   the same orders timed from the rows' created_at to the invoice's (stamped before the commits; the method before 2026-12-05)",
		fmt.Sprintf("p50 %s, p99 %s", ms(percentile(rows, .5)), ms(percentile(rows, .99))), "", "", "", true)
	r.add("   the machine's cores during the run (busy: all but idle, waiting for I/O, and stolen)",
		fmt.Sprintf("%.0f %% busy", 100*float64(busyEnd-busy)/float64(totalEnd-total)), "", "", "", true)
	// The machine's busy time less the services' is PostgreSQL's, RabbitMQ's, this test's
	// (the load, the spans' receiver), the kernel's for them, and anything else running.
	rest := time.Duration(busyEnd-busy)*10*time.Millisecond - cpu[0] - cpu[1] - cpu[2]
	perOrder := func(d time.Duration) string { return ms(d / time.Duration(max(sent-errs, 1))) } // per order accepted
	r.add("   CPU per order: order, invoicing, notification; the rest (PostgreSQL, RabbitMQ, this test)",
		fmt.Sprintf("%s, %s, %s; %s", perOrder(cpu[0]), perOrder(cpu[1]), perOrder(cpu[2]), perOrder(rest)), "", "", "", true)
	if !notify {
		return
	}
	stages(t, r, spans)
	for i, s := range services {
		rss := s.PeakRSS(t)
		r.add(fmt.Sprintf("   %s service peak RSS during the latency run", s.Name), mib(rss), mib(started[i])+" before the load",
			ratioOf(float64(rss), float64(started[i])), "≤ 64 MiB", rss <= 64<<20)
	}
}

// latencySystem starts the three services for a latency run, with their spans exported to the
// receiver it returns; without notify, with the order service's LISTEN/NOTIFY off.
func latencySystem(t *testing.T, binDir string, notify bool) (*systest.System, *testenv.OTLPReceiver) {
	t.Helper()
	env := map[string][]string{"order": {fmt.Sprintf("OUTBOX_NOTIFY=%t", notify)}}
	spans := testenv.NewOTLPReceiver(t)
	for _, name := range []string{"order", "invoicing", "notification"} {
		env[name] = append(env[name], "OTEL_EXPORTER_OTLP_ENDPOINT="+spans.URL)
	}
	return systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, DiscardLogs: true, Env: env}), spans
}

// placeAtRate places perSecond orders a second for d, open loop, and returns how many it sent
// and how many of them got no 201.
func placeAtRate(sys *systest.System, perSecond int, d time.Duration) (sent, errs int) {
	got, _ := openLoop(sys.Order.URL, perSecond, d)
	created, errs := got.split(http.StatusCreated)
	return len(created) + errs, errs
}

// invoiceLatencies waits until every order has its invoice and the spans of each have come,
// and returns, sorted, each order's time from the start of its POST to the end of the span in
// which its invoice was committed (rowLatencies, which it was timed from before, leaves that
// commit out).
func invoiceLatencies(t *testing.T, sys *systest.System, spans *testenv.OTLPReceiver) []time.Duration {
	t.Helper()
	orders := testenv.Count(t, sys.Order.DB.DB, "SELECT count(*) FROM orders")
	testenv.Eventually(t, 2*time.Minute, func() bool {
		return testenv.Count(t, sys.Invoicing.DB.DB, "SELECT count(*) FROM invoices") == orders
	}, "not every order was invoiced")
	var lat []time.Duration
	testenv.Eventually(t, time.Minute, func() bool { // the exporters send every 5 s
		lat = lat[:0]
		for _, tr := range orderTraces(spans) {
			if tr.request != nil && tr.process != nil {
				lat = append(lat, tr.process.End.Sub(tr.request.Start))
			}
		}
		return int64(len(lat)) == orders
	}, "the spans of some of the %d orders did not come", orders)
	slices.Sort(lat)
	return lat
}

// rowLatencies returns, sorted, each invoiced order's time from its row's created_at to its
// invoice's: both stamped before their transactions commit, so the invoice's commit is left out.
func rowLatencies(t *testing.T, sys *systest.System) []time.Duration {
	t.Helper()
	var placed, invoiced []struct {
		ID        uuid.UUID
		CreatedAt time.Time
	}
	if err := sys.Order.DB.DB.Raw("SELECT id, created_at FROM orders").Scan(&placed).Error; err != nil {
		t.Fatal(err)
	}
	if err := sys.Invoicing.DB.DB.Raw("SELECT order_id AS id, created_at FROM invoices").Scan(&invoiced).Error; err != nil {
		t.Fatal(err)
	}
	at := make(map[uuid.UUID]time.Time, len(invoiced))
	for _, inv := range invoiced {
		at[inv.ID] = inv.CreatedAt
	}
	lat := make([]time.Duration, 0, len(placed))
	for _, o := range placed {
		if inv, ok := at[o.ID]; ok {
			lat = append(lat, inv.Sub(o.CreatedAt))
		}
	}
	slices.Sort(lat)
	return lat
}

// machineCPU is the machine's CPU time so far, from /proc/stat, in ticks of 10 ms summed over
// its cores: busy (all but idle, waiting for I/O and stolen by the hypervisor) and in all.
func machineCPU(t *testing.T) (busy, total int64) {
	t.Helper()
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		t.Fatalf("the machine's CPU time: %v", err)
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	fields := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	if len(fields) < 9 || fields[0] != "cpu" {
		t.Fatalf("/proc/stat begins %q", line)
	}
	for i, f := range fields[1:9] {
		n, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			t.Fatalf("/proc/stat: %v", err)
		}
		total += n
		if i != 3 && i != 4 && i != 7 { // idle, iowait, steal
			busy += n
		}
	}
	return busy, total
}

func drainBody(resp *http.Response) {
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
}
