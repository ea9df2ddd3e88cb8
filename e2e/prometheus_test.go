package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.yaml.in/yaml/v4"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// The live Prometheus's clock. Production scrapes and evaluates every 15 s; here every second,
// and every duration of the rules (each alert's for: and each range window) is divided by
// timeCompression: 1m becomes 3s, 5m 15s, 10m 30s; so is a duration written as a number, which
// a rule writes so where it means its window (ConsumerDeadLettering's process started within
// it, < 10m). Nothing else of a rule changes: its metric names, labels, comparisons and
// thresholds are the ones of deploy/prometheus/alerts.yml. The thresholds on ages
// (OutboxBacklogAge's 300 s, ConsumerEventAgeHigh's 60 s) are written in seconds, real ones,
// so the faults that trip them still take that long.
const (
	promInterval    = time.Second
	timeCompression = 20
)

// rangeWindow is a range selector's duration in an expression: [10m]. durationLiteral is a
// duration outside one, used as a number of seconds: < 10m.
var (
	rangeWindow     = regexp.MustCompile(`\[(\d+(?:ms|[smhdwy]))\]`)
	durationLiteral = regexp.MustCompile(`(^|[^\[\w.])(\d+(?:ms|[smhdwy]))\b`)
)

// compress divides a Prometheus duration by timeCompression, in seconds, or milliseconds where
// that leaves a fraction.
func compress(t *testing.T, d string) string {
	t.Helper()
	parsed, err := time.ParseDuration(d)
	if err != nil || parsed%timeCompression != 0 {
		t.Fatalf("rule duration %q: want a Go-parsable duration divisible by %d (%v)", d, timeCompression, err)
	}
	c := parsed / timeCompression
	if c%time.Second != 0 {
		return fmt.Sprintf("%dms", c.Milliseconds())
	}
	return fmt.Sprintf("%ds", c/time.Second)
}

// compressedRules writes into dir a copy of deploy/prometheus/alerts.yml with every for:, range
// window and duration literal divided by timeCompression, and returns its path and the alerts it defines.
func compressedRules(t *testing.T, dir string) (path string, alerts []string) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "deploy", "prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Groups []struct {
			Name  string           `yaml:"name"`
			Rules []map[string]any `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(raw, &file); err != nil {
		t.Fatalf("deploy/prometheus/alerts.yml: %v", err)
	}
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			if f, ok := r["for"].(string); ok {
				r["for"] = compress(t, f)
			}
			expr, _ := r["expr"].(string)
			expr = rangeWindow.ReplaceAllStringFunc(expr, func(w string) string {
				return "[" + compress(t, strings.Trim(w, "[]")) + "]"
			})
			r["expr"] = durationLiteral.ReplaceAllStringFunc(expr, func(d string) string {
				m := durationLiteral.FindStringSubmatch(d)
				return m[1] + compress(t, m[2])
			})
			if name, ok := r["alert"].(string); ok {
				alerts = append(alerts, name)
				after, _ := r["for"].(string)
				t.Logf("rule %s, time-compressed: %s (for: %q)", name, strings.Join(strings.Fields(r["expr"].(string)), " "), after)
			}
		}
	}
	out, err := yaml.Marshal(file)
	if err != nil {
		t.Fatal(err)
	}
	path = filepath.Join(dir, "alerts.yml")
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
	return path, alerts
}

// livePrometheus is a real Prometheus server scraping one system, with the project's rules.
type livePrometheus struct {
	URL    string
	Alerts []string // the alerts its rules define
	log    string   // its output
}

// startPrometheus runs the Prometheus of the Debian unstable root that scripts/sidroot.sh
// provisions (TEST_SIDROOT; its binary needs only libc) on a free port, with a data directory
// of its own, until the test ends. Its configuration is deploy/prometheus/prometheus.yml with
// each job's target replaced by the system's (the services, and the test broker's
// rabbitmq_prometheus endpoint, TEST_RABBITMQ_PROMETHEUS_URL), the queue depths limited to the
// system's vhost, and the clock of promInterval and compressedRules. The cluster profile's jobs
// stay as they are.
func startPrometheus(t *testing.T, s *systest.System) *livePrometheus {
	t.Helper()
	bin := filepath.Join(os.Getenv("TEST_SIDROOT"), "usr", "bin", "prometheus")
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("TEST_SIDROOT has no Prometheus (scripts/sidroot.sh provision installs it): %v", err)
	}
	plugin, err := url.Parse(os.Getenv("TEST_RABBITMQ_PROMETHEUS_URL"))
	if err != nil || plugin.Host == "" {
		t.Fatalf("TEST_RABBITMQ_PROMETHEUS_URL=%q: want the test broker's rabbitmq_prometheus URL (scripts/sidroot.sh env)", os.Getenv("TEST_RABBITMQ_PROMETHEUS_URL"))
	}
	dir := t.TempDir()
	rules, alerts := compressedRules(t, dir)
	addr := systest.FreeAddr(t)
	host := func(svc *systest.Service) string { return strings.TrimPrefix(svc.URL, "http://") }
	targets := map[string]string{
		"order": host(s.Order), "invoicing": host(s.Invoicing), "notification": host(s.Notification),
		"rabbitmq": plugin.Host, "rabbitmq-queues": plugin.Host, "prometheus": addr,
	}

	raw, err := os.ReadFile(filepath.Join("..", "deploy", "prometheus", "prometheus.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := yaml.Unmarshal(raw, &cfg); err != nil {
		t.Fatalf("deploy/prometheus/prometheus.yml: %v", err)
	}
	every := promInterval.String()
	cfg["global"] = map[string]any{"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every}
	cfg["rule_files"] = []string{rules}
	jobs, _ := cfg["scrape_configs"].([]any)
	for _, j := range jobs {
		job := j.(map[string]any)
		name, _ := job["job_name"].(string)
		if _, ok := job["dns_sd_configs"]; ok {
			// Compose's cluster profile, found by name through Docker's DNS: kept as it is.
			// Nothing answers those names here, so they must add no target (quiet counts them).
			continue
		}
		target, ok := targets[name]
		if !ok {
			t.Fatalf("deploy/prometheus/prometheus.yml scrapes job %q, which this test has no target for", name)
		}
		delete(targets, name)
		job["static_configs"] = []any{map[string]any{"targets": []string{target}}}
		if name == "rabbitmq-queues" {
			// Only the system's queues: other tests' dead-letter queues are not its faults.
			params, _ := job["params"].(map[string]any)
			if params == nil {
				t.Fatal("deploy/prometheus/prometheus.yml: job rabbitmq-queues has no params")
			}
			params["vhost"] = []string{s.VHost}
		}
	}
	if len(targets) != 0 {
		t.Fatalf("deploy/prometheus/prometheus.yml has no job %v", slices.Sorted(maps.Keys(targets)))
	}
	out, err := yaml.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	config := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(config, out, 0o644); err != nil {
		t.Fatal(err)
	}

	p := &livePrometheus{URL: "http://" + addr, Alerts: alerts, log: filepath.Join(dir, "prometheus.log")}
	logFile, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config.file="+config, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--log.level=warn")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// Tied to the test binary: no Prometheus outlives one killed or timed out.
	exited, err := systest.StartProcess(cmd)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var exitErr error
	go func() { exitErr = <-exited; logFile.Close(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
			if exitErr != nil {
				t.Errorf("Prometheus exited with %v after SIGTERM", exitErr)
			}
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			t.Errorf("Prometheus did not stop within 10 s of SIGTERM")
		}
		if t.Failed() {
			if log, err := os.ReadFile(p.log); err == nil {
				t.Logf("Prometheus's output:\n%s", log)
			}
		}
	})
	testenv.Eventually(t, 30*time.Second, func() bool {
		select {
		case <-done:
			log, _ := os.ReadFile(p.log)
			t.Fatalf("Prometheus exited while starting: %v\n%s", exitErr, log)
		default:
		}
		resp, err := http.Get(p.URL + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, "Prometheus not ready at %s", p.URL)
	return p
}

// lazy formats as what its function returns when the message is printed: a failure message
// then shows the state at the failure, not at the call.
type lazy func() string

func (l lazy) String() string { return l() }

// api GETs Prometheus's HTTP API at path with query and decodes its data into v.
func (p *livePrometheus) api(t *testing.T, path string, query url.Values, v any) {
	t.Helper()
	if err := p.get(context.Background(), path, query, v); err != nil {
		t.Fatal(err)
	}
}

// get is api for a caller that handles the error itself, within ctx.
func (p *livePrometheus) get(ctx context.Context, path string, query url.Values, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.URL+path+"?"+query.Encode(), nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", path, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var envelope struct {
		Status string          `json:"status"`
		Data   json.RawMessage `json:"data"`
		Error  string          `json:"error"`
	}
	if err := json.Unmarshal(body, &envelope); err != nil || envelope.Status != "success" {
		return fmt.Errorf("GET %s?%s = %d %s", path, query.Encode(), resp.StatusCode, body)
	}
	if err := json.Unmarshal(envelope.Data, v); err != nil {
		return fmt.Errorf("GET %s: %w: %s", path, err, envelope.Data)
	}
	return nil
}

// sample is one series of an instant vector.
type sample struct {
	Metric map[string]string
	Value  float64
}

// query evaluates expr now (/api/v1/query) and returns its instant vector.
func (p *livePrometheus) query(t *testing.T, expr string) []sample {
	t.Helper()
	var data struct {
		ResultType string `json:"resultType"`
		Result     []struct {
			Metric map[string]string `json:"metric"`
			Value  [2]any            `json:"value"`
		} `json:"result"`
	}
	p.api(t, "/api/v1/query", url.Values{"query": {expr}}, &data)
	if data.ResultType != "vector" {
		t.Fatalf("query %s: result type %q, want vector", expr, data.ResultType)
	}
	out := make([]sample, len(data.Result))
	for i, r := range data.Result {
		s, _ := r.Value[1].(string)
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			t.Fatalf("query %s: value %v: %v", expr, r.Value, err)
		}
		out[i] = sample{Metric: r.Metric, Value: v}
	}
	return out
}

// hasValue reports whether any sample is a number, not NaN (what histogram_quantile gives
// when nothing was observed).
func hasValue(samples []sample) bool {
	return slices.ContainsFunc(samples, func(s sample) bool { return !math.IsNaN(s.Value) })
}

// activeAlert is an alert of /api/v1/alerts: pending or firing.
type activeAlert struct {
	Labels map[string]string `json:"labels"`
	State  string            `json:"state"`
}

// ruleHolds returns how long each alert rule's condition must hold before it fires (its for:,
// as the scaled rules have it), by alert name.
func (p *livePrometheus) ruleHolds(t *testing.T) map[string]time.Duration {
	t.Helper()
	var data struct {
		Groups []struct {
			Rules []struct {
				Name     string  `json:"name"`
				Duration float64 `json:"duration"` // seconds
			} `json:"rules"`
		} `json:"groups"`
	}
	p.api(t, "/api/v1/rules", url.Values{"type": {"alert"}}, &data)
	holds := map[string]time.Duration{}
	for _, g := range data.Groups {
		for _, r := range g.Rules {
			holds[r.Name] = time.Duration(r.Duration * float64(time.Second))
		}
	}
	if len(holds) == 0 {
		t.Fatal("Prometheus lists no alert rule")
	}
	return holds
}

// checkRulesHealthy requires every alert of the rules to be loaded and evaluated without
// error.
func (p *livePrometheus) checkRulesHealthy(t *testing.T) {
	t.Helper()
	var data struct {
		Groups []struct {
			Rules []struct {
				Name      string `json:"name"`
				Health    string `json:"health"`
				LastError string `json:"lastError"`
			} `json:"rules"`
		} `json:"groups"`
	}
	p.api(t, "/api/v1/rules", url.Values{"type": {"alert"}}, &data)
	var loaded []string
	for _, g := range data.Groups {
		for _, r := range g.Rules {
			loaded = append(loaded, r.Name)
			if r.Health != "ok" {
				t.Errorf("alert %s: health %q: %s", r.Name, r.Health, r.LastError)
			}
		}
	}
	if !slices.Equal(slices.Sorted(slices.Values(loaded)), slices.Sorted(slices.Values(p.Alerts))) {
		t.Fatalf("Prometheus evaluates the alerts %v, want those of alerts.yml %v", loaded, p.Alerts)
	}
}

// episode is one alert, by its labels, from the moment it was seen firing to the moment it was
// seen gone (zero while it still fires).
type episode struct {
	Name            string
	Labels          map[string]string
	Fired, Resolved time.Time
}

// alertWatch polls /api/v1/alerts in the background, every 100 ms, and records each firing
// alert's episodes, so that a test can wait for an alert while other faults go on. A failed
// poll is recorded and the next one tried: it leaves the watch blind meanwhile, so what did
// not fire is asked of Prometheus instead (livePrometheus.alertsIn).
type alertWatch struct {
	mu       sync.Mutex
	episodes []*episode
	failure  string // the last failed poll's error, if one failed
}

func alertKey(name string, labels map[string]string) string {
	keys := slices.Sorted(maps.Keys(labels))
	var b strings.Builder
	b.WriteString(name)
	for _, k := range keys {
		fmt.Fprintf(&b, ",%s=%q", k, labels[k])
	}
	return b.String()
}

// watch starts an alertWatch on p until the test ends.
func (p *livePrometheus) watch(t *testing.T) *alertWatch {
	w := &alertWatch{}
	stop := make(chan struct{})
	stopped := make(chan struct{})
	t.Cleanup(func() { close(stop); <-stopped })
	go func() {
		defer close(stopped)
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			alerts, err := fetchAlerts(p.URL)
			now := time.Now()
			w.mu.Lock()
			if err != nil {
				w.failure = err.Error()
				w.mu.Unlock()
				continue
			}
			w.record(now, alerts)
			w.mu.Unlock()
		}
	}()
	return w
}

// alertsClient bounds a poll of the alerts: one that hangs fails, and the next is tried,
// instead of holding the watch, and the test's end, forever.
var alertsClient = &http.Client{Timeout: 5 * promInterval}

// fetchAlerts is alerts for a goroutine that may not fail the test.
func fetchAlerts(base string) ([]activeAlert, error) {
	resp, err := alertsClient.Get(base + "/api/v1/alerts")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Status string `json:"status"`
		Data   struct {
			Alerts []activeAlert `json:"alerts"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("GET /api/v1/alerts: %d: %w", resp.StatusCode, err)
	}
	if body.Status != "success" {
		return nil, fmt.Errorf("GET /api/v1/alerts: %d, status %q", resp.StatusCode, body.Status)
	}
	return body.Data.Alerts, nil
}

// record notes at now which episodes started and which ended. The caller holds w.mu.
func (w *alertWatch) record(now time.Time, alerts []activeAlert) {
	firing := map[string]*episode{}
	for _, a := range alerts {
		e := &episode{Name: a.Labels["alertname"], Labels: maps.Clone(a.Labels), Fired: now}
		delete(e.Labels, "alertname")
		key := alertKey(e.Name, e.Labels)
		if a.State == "firing" {
			firing[key] = e
		}
	}
	open := map[string]bool{}
	for _, e := range w.episodes {
		key := alertKey(e.Name, e.Labels)
		if e.Resolved.IsZero() {
			if _, still := firing[key]; still {
				open[key] = true
			} else {
				e.Resolved = now
			}
		}
	}
	for key, e := range firing {
		if !open[key] {
			w.episodes = append(w.episodes, e)
		}
	}
}

// matches reports whether e is alert name with every label of want.
func (e *episode) matches(name string, want map[string]string) bool {
	if e.Name != name {
		return false
	}
	for k, v := range want {
		if e.Labels[k] != v {
			return false
		}
	}
	return true
}

// find returns the first episode of alert name, with the labels of want, that started firing
// after since; nil if none has yet.
func (w *alertWatch) find(name string, want map[string]string, since time.Time) *episode {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, e := range w.episodes {
		if e.matches(name, want) && !e.Fired.Before(since) {
			return e
		}
	}
	return nil
}

// firing waits until alert name, with the labels of want, starts firing after since, and
// returns that episode.
func (w *alertWatch) firing(t *testing.T, timeout time.Duration, since time.Time, name string, want map[string]string) *episode {
	t.Helper()
	var found *episode
	testenv.Eventually(t, timeout, func() bool {
		found = w.find(name, want, since)
		return found != nil
	}, "alert %s %v did not fire (polling: %s)", name, want, lazy(w.lastFailure))
	return found
}

// resolved waits until e has resolved and returns when.
func (w *alertWatch) resolved(t *testing.T, timeout time.Duration, e *episode) time.Time {
	t.Helper()
	var at time.Time
	testenv.Eventually(t, timeout, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		at = e.Resolved
		return !at.IsZero()
	}, "alert %s %v still fires (polling: %s)", e.Name, e.Labels, lazy(w.lastFailure))
	return at
}

func (w *alertWatch) lastFailure() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.failure == "" {
		return "ok"
	}
	return w.failure
}

// alertsIn is what Prometheus itself recorded of the window (from, to], to the millisecond:
// the alerts firing at any evaluation of the rules in it (fired, as the alertWatch counts an
// alert: firing, not pending) and those pending at one, each as alertKey names it, sorted.
// Each evaluation writes a sample of ALERTS for every alert pending or firing at it, so
// max_over_time of ALERTS over the window, at to, misses none, however briefly it fired and
// however slowly anything answered meanwhile: unlike polls of /api/v1/alerts, it has no blind
// stretch. A group's lastEvaluation is set once its evaluation's samples are written, so it
// first waits until every rule group was evaluated after to: the window's last evaluation is
// then in. Past within, or on an answer that is not the vector asked for, it is an error,
// never "none fired".
func (p *livePrometheus) alertsIn(from, to time.Time, within time.Duration) (fired, pending []string, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	window := time.Duration(to.UnixMilli()-from.UnixMilli()) * time.Millisecond
	if window <= 0 {
		return nil, nil, fmt.Errorf("an empty window: from %s to %s", from.Format(time.RFC3339Nano), to.Format(time.RFC3339Nano))
	}
	var behind []string // the groups not evaluated after to, when last asked
	for {
		var rules struct {
			Groups []struct {
				Name           string    `json:"name"`
				LastEvaluation time.Time `json:"lastEvaluation"`
			} `json:"groups"`
		}
		err := p.get(ctx, "/api/v1/rules", url.Values{"type": {"alert"}}, &rules)
		if err == nil && len(rules.Groups) == 0 {
			err = errors.New("no alert rule group listed")
		}
		if err == nil {
			behind = nil
			for _, g := range rules.Groups {
				if !g.LastEvaluation.After(to) {
					behind = append(behind, fmt.Sprintf("group %s last at %s", g.Name, g.LastEvaluation.Format("15:04:05.000")))
				}
			}
			if len(behind) == 0 {
				break
			}
		}
		select {
		case <-ctx.Done():
			why := strings.Join(behind, ", ")
			if err != nil {
				why = strings.TrimPrefix(why+"; the last ask: ", "; ") + err.Error()
			}
			return nil, nil, fmt.Errorf("the rules were not evaluated past the window's end, %s, within %s: %s",
				to.Format("15:04:05.000"), within, why)
		case <-time.After(promInterval / 4):
		}
	}
	expr := fmt.Sprintf("max_over_time(ALERTS[%dms])", window.Milliseconds())
	var data struct {
		ResultType string `json:"resultType"`
		Result     []struct {
			Metric map[string]string `json:"metric"`
		} `json:"result"`
	}
	at := strconv.FormatFloat(float64(to.UnixMilli())/1000, 'f', 3, 64)
	if err := p.get(ctx, "/api/v1/query", url.Values{"query": {expr}, "time": {at}}, &data); err != nil {
		return nil, nil, err
	}
	if data.ResultType != "vector" {
		return nil, nil, fmt.Errorf("query %s at %s: result type %q, want vector", expr, at, data.ResultType)
	}
	for _, r := range data.Result {
		labels := maps.Clone(r.Metric)
		name, state := labels["alertname"], labels["alertstate"]
		delete(labels, "alertname")
		delete(labels, "alertstate")
		switch state {
		case "firing":
			fired = append(fired, alertKey(name, labels))
		case "pending":
			pending = append(pending, alertKey(name, labels))
		default:
			return nil, nil, fmt.Errorf("query %s at %s: a series of alertstate %q: %v", expr, at, state, r.Metric)
		}
	}
	slices.Sort(fired)
	slices.Sort(pending)
	return fired, pending, nil
}

// alertsIn asks Prometheus what its rules recorded of the whole window, whatever answered
// when meanwhile: an alert firing at one evaluation only, between any two moments a poll of
// /api/v1/alerts could have been answered, is in; so is one firing at the window's last
// millisecond, and one only pending is pending, not fired; what fired before the window or
// after it is not. It waits for the rules to be evaluated past the window, and a query or an
// evaluation that fails is an error, never "none fired". The Prometheus here is a stand-in
// that evaluates max_over_time(ALERTS[d]) at the query's time over the samples of ALERTS its
// rule evaluations wrote.
func TestAlertsInAsksPrometheusForTheWindowWhole(t *testing.T) {
	t.Parallel()
	from := time.Now().Add(-time.Minute).Truncate(time.Second).Add(250 * time.Millisecond)
	to := from.Add(10*time.Second + 500*time.Millisecond)
	type alertSample struct {
		at     time.Time
		labels map[string]string
	}
	down := func(at time.Time) alertSample {
		return alertSample{at, map[string]string{"alertname": "ServiceDown", "alertstate": "firing", "job": "order"}}
	}
	noConsumers := func(at time.Time) alertSample {
		return alertSample{at, map[string]string{"alertname": "QueueWithoutConsumers", "alertstate": "pending", "queue": "invoicing"}}
	}
	type prometheus struct {
		samples   []alertSample
		evaluated func(n int64) time.Time // the rule group's lastEvaluation at the nth ask (from 0)
		broken    string                  // what /api/v1/query answers instead, if anything
	}
	past := func(int64) time.Time { return to.Add(300 * time.Millisecond) }
	for _, c := range []struct {
		name           string
		prom           prometheus
		fired, pending []string
		wantErr        string
	}{
		{"nothing in the window", prometheus{samples: []alertSample{down(from.Add(-time.Second)), down(from), noConsumers(to.Add(time.Millisecond))}, evaluated: past}, nil, nil, ""},
		{"an alert fired at one evaluation", prometheus{samples: []alertSample{
			noConsumers(from.Add(2 * time.Second)), noConsumers(from.Add(3 * time.Second)), down(from.Add(4*time.Second + 300*time.Millisecond)),
		}, evaluated: past}, []string{`ServiceDown,job="order"`}, []string{`QueueWithoutConsumers,queue="invoicing"`}, ""},
		{"at the window's edges", prometheus{samples: []alertSample{down(from.Add(time.Millisecond)), noConsumers(to)}, evaluated: past},
			[]string{`ServiceDown,job="order"`}, []string{`QueueWithoutConsumers,queue="invoicing"`}, ""},
		{"rules evaluated past the window after a while", prometheus{samples: []alertSample{down(to)}, evaluated: func(n int64) time.Time {
			if n < 3 {
				return to.Add(-700 * time.Millisecond)
			}
			return to.Add(300 * time.Millisecond)
		}}, []string{`ServiceDown,job="order"`}, nil, ""},
		{"rules not evaluated past the window", prometheus{samples: []alertSample{down(to)}, evaluated: func(int64) time.Time { return to.Add(-700 * time.Millisecond) }},
			nil, nil, "not evaluated past"},
		{"the query fails", prometheus{evaluated: past, broken: `503 {"status":"error","errorType":"unavailable","error":"overloaded"}`}, nil, nil, "503"},
		{"an answer that is no vector", prometheus{evaluated: past, broken: `200 {"status":"success","data":{"resultType":"matrix","result":[]}}`}, nil, nil, "matrix"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var asked atomic.Int64
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				answer := func(status int, body any) {
					w.WriteHeader(status)
					_ = json.NewEncoder(w).Encode(body)
				}
				switch r.URL.Path {
				case "/api/v1/rules":
					answer(http.StatusOK, map[string]any{"status": "success", "data": map[string]any{"groups": []any{map[string]any{
						"name": "outbox-inbox", "lastEvaluation": c.prom.evaluated(asked.Add(1) - 1), "rules": []any{},
					}}}})
				case "/api/v1/query":
					if c.prom.broken != "" {
						status, body, _ := strings.Cut(c.prom.broken, " ")
						code, _ := strconv.Atoi(status)
						w.WriteHeader(code)
						fmt.Fprint(w, body)
						return
					}
					m := regexp.MustCompile(`^max_over_time\(ALERTS\[(\w+)\]\)$`).FindStringSubmatch(r.FormValue("query"))
					var d time.Duration
					if m != nil {
						d, _ = time.ParseDuration(m[1])
					}
					at := time.Now()
					if ts := r.FormValue("time"); ts != "" {
						f, err := strconv.ParseFloat(ts, 64)
						if err != nil {
							answer(http.StatusBadRequest, map[string]any{"status": "error", "errorType": "bad_data", "error": err.Error()})
							return
						}
						at = time.UnixMilli(int64(math.Round(f * 1000)))
					}
					if d <= 0 {
						answer(http.StatusBadRequest, map[string]any{"status": "error", "errorType": "bad_data", "error": "this stand-in answers max_over_time(ALERTS[d]) only, not " + r.FormValue("query")})
						return
					}
					series := map[string]map[string]string{}
					for _, s := range c.prom.samples {
						if s.at.After(at.Add(-d)) && !s.at.After(at) {
							series[alertKey("", s.labels)] = s.labels
						}
					}
					var result []any
					for _, labels := range series {
						result = append(result, map[string]any{"metric": labels, "value": []any{float64(at.UnixMilli()) / 1000, "1"}})
					}
					answer(http.StatusOK, map[string]any{"status": "success", "data": map[string]any{"resultType": "vector", "result": result}})
				default:
					http.NotFound(w, r)
				}
			}))
			t.Cleanup(srv.Close)
			fired, pending, err := (&livePrometheus{URL: srv.URL}).alertsIn(from, to, 2*time.Second)
			if err != nil {
				t.Logf("alertsIn: %v", err)
			}
			if c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)) {
				t.Errorf("alertsIn: err = %v, want one that says %q", err, c.wantErr)
			}
			if c.wantErr == "" && err != nil {
				t.Errorf("alertsIn: %v", err)
			}
			if !slices.Equal(fired, c.fired) || !slices.Equal(pending, c.pending) {
				t.Errorf("alertsIn = fired %q, pending %q; want fired %q, pending %q", fired, pending, c.fired, c.pending)
			}
		})
	}
}
