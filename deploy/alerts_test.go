package deploy_test

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v4"
)

// readYAML parses the repository's file rel into v.
func readYAML(t *testing.T, rel string, v any) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, v); err != nil {
		t.Fatalf("%s: %v", rel, err)
	}
}

// alertRules is the part of a Prometheus rule file this project writes.
type alertRules struct {
	Groups []struct {
		Name  string      `yaml:"name"`
		Rules []alertRule `yaml:"rules"`
	} `yaml:"groups"`
}

type alertRule struct {
	Alert       string            `yaml:"alert"`
	Record      string            `yaml:"record"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

// ruleTests is the part of a promtool test file this project writes.
type ruleTests struct {
	RuleFiles []string `yaml:"rule_files"`
	Tests     []struct {
		AlertRuleTests []struct {
			EvalTime  string           `yaml:"eval_time"`
			AlertName string           `yaml:"alertname"`
			ExpAlerts []map[string]any `yaml:"exp_alerts"`
		} `yaml:"alert_rule_test"`
	} `yaml:"tests"`
}

// runbookURL is where an alert's runbook_url leads: the repository's docs/operations.md, whose
// Runbook section has an entry, a heading named after the alert, for each.
const runbookURL = "https://github.com/outboxkit/outbox-inbox/blob/main/docs/operations.md"

// alertChecks are what an alert is held to besides its expression: its cases in a promtool
// test file, its row in the Alerts table of docs/operations.md, its runbook entry there, and
// the metrics that exist.
type alertChecks struct {
	testFile     string
	fires, quiet map[string]bool
	section      string
	runbook      map[string]bool
	known        map[string]bool
}

// newAlertChecks reads testFile, a promtool test file of ruleFile, and docs/operations.md.
func newAlertChecks(t *testing.T, testFile, ruleFile string, known map[string]bool) *alertChecks {
	t.Helper()
	c := &alertChecks{testFile: testFile, fires: map[string]bool{}, quiet: map[string]bool{}, known: known}
	var tests ruleTests
	readYAML(t, testFile, &tests)
	if !slices.Equal(tests.RuleFiles, []string{ruleFile}) {
		t.Errorf("%s tests rule files %v, want [%s]", testFile, tests.RuleFiles, ruleFile)
	}
	for _, tc := range tests.Tests {
		for _, at := range tc.AlertRuleTests {
			if len(at.ExpAlerts) > 0 {
				c.fires[at.AlertName] = true
			} else {
				c.quiet[at.AlertName] = true
			}
		}
	}
	operations := filepath.Join(root, "docs", "operations.md")
	doc, err := os.ReadFile(operations)
	if err != nil {
		t.Fatal(err)
	}
	_, c.section, _ = strings.Cut(string(doc), "\n## Alerts\n")
	c.section, _, _ = strings.Cut(c.section, "\n## ")
	if c.runbook, err = anchors(operations); err != nil {
		t.Fatal(err)
	}
	return c
}

// check holds the alert r to c.
func (c *alertChecks) check(t *testing.T, r alertRule) {
	t.Helper()
	if s := r.Labels["severity"]; s != "warning" && s != "critical" {
		t.Errorf("alert %s: severity %q, want warning or critical", r.Alert, s)
	}
	if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
		t.Errorf("alert %s: want a summary and a description", r.Alert)
	}
	ms := metricNames(r.Expr)
	if len(ms) == 0 {
		t.Errorf("alert %s names no metric: %s", r.Alert, r.Expr)
	}
	for _, m := range ms {
		if !c.known[m] {
			t.Errorf("alert %s: nothing this system runs or reads exports %s", r.Alert, m)
		}
	}
	if !c.fires[r.Alert] || !c.quiet[r.Alert] {
		t.Errorf("alert %s: %s has a case where it fires: %v, where it stays quiet: %v; want both", r.Alert, c.testFile, c.fires[r.Alert], c.quiet[r.Alert])
	}
	if !strings.Contains(c.section, "`"+r.Alert+"`") {
		t.Errorf("alert %s is not described in the Alerts section of docs/operations.md", r.Alert)
	}
	if want := runbookURL + "#" + headingSlug(r.Alert); r.Annotations["runbook_url"] != want {
		t.Errorf("alert %s: runbook_url %q, want %q", r.Alert, r.Annotations["runbook_url"], want)
	} else if !c.runbook[headingSlug(r.Alert)] {
		t.Errorf("alert %s: docs/operations.md has no runbook entry (a heading %q) for its runbook_url", r.Alert, r.Alert)
	}
}

// Every alert names metrics that exist, has a severity, a summary, a description and a
// runbook_url that leads to its runbook entry, a case where it fires and one where it stays
// quiet in alerts_test.yml (promtool runs them), and a row in the Alerts table of
// docs/operations.md.
func TestAlertRules(t *testing.T) {
	t.Parallel()
	var rules alertRules
	readYAML(t, "deploy/prometheus/alerts.yml", &rules)
	c := newAlertChecks(t, "deploy/prometheus/alerts_test.yml", "alerts.yml", knownMetrics(t))
	var names, exprs []string
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				t.Errorf("group %s: a rule that is no alert (record %q)", g.Name, r.Record)
				continue
			}
			if slices.Contains(names, r.Alert) {
				t.Errorf("alert %s is defined twice", r.Alert)
			}
			names = append(names, r.Alert)
			exprs = append(exprs, r.Expr)
			c.check(t, r)
		}
	}
	for name := range c.fires {
		if !slices.Contains(names, name) {
			t.Errorf("alerts_test.yml tests %s, which alerts.yml does not define", name)
		}
	}
	// (scripts/test.sh checks alerts.yml with promtool itself; here the expressions alone,
	// so that go test ./deploy/ catches a typo too.)
	defer checkWithPromtool(t, "alerts", exprs)
	// The signals the production checklist of docs/operations.md promises an alert on.
	for _, m := range []string{
		"outbox_oldest_pending_age_seconds", "outbox_max_attempts", "outbox_publish_failures_total",
		"outbox_relay_broker_up", "consumer_messages_total", "rabbitmq_detailed_queue_messages",
		"consumer_event_age_seconds_bucket", "up",
	} {
		if !slices.ContainsFunc(exprs, func(e string) bool { return slices.Contains(metricNames(e), m) }) {
			t.Errorf("no alert watches %s", m)
		}
	}
}

// rabbitmqMetrics are the series of the rabbitmq_prometheus plugin that the rules read: those
// of /metrics/detailed?family=queue_coarse_metrics,queue_consumer_count, each labelled vhost
// and queue, and the alarms of its aggregated /metrics (on RabbitMQ 3.10 and 4.x alike).
var rabbitmqMetrics = []string{
	"rabbitmq_detailed_queue_messages", "rabbitmq_detailed_queue_messages_ready", "rabbitmq_detailed_queue_messages_unacked",
	"rabbitmq_detailed_queue_consumers", "rabbitmq_alarms_memory_used_watermark", "rabbitmq_alarms_free_disk_space_watermark",
}

// processMetrics are the series of the process collector, which every service registers
// (internal/platform) and RabbitMQ and Prometheus export too.
var processMetrics = []string{"process_start_time_seconds"}

// knownMetrics returns every series name the services can export (codeMetrics), the plugin's
// queue series, the process collector's and Prometheus's up.
func knownMetrics(t *testing.T) map[string]bool {
	t.Helper()
	known := map[string]bool{"up": true}
	for name := range codeMetrics(t) {
		known[name] = true
	}
	for _, name := range append(rabbitmqMetrics, processMetrics...) {
		known[name] = true
	}
	return known
}

// codeMetrics maps every series name the services can export to the folder, relative to the
// repository, of the file that declares it. They are read from the collectors their code
// declares (prometheus.NewCounter/Gauge/Histogram/Summary[Vec|Func] with Opts{Name: "..."},
// and prometheus.NewDesc("...")) in pkg/, internal/platform and services/, with a histogram's
// _bucket, _sum and _count.
func codeMetrics(t *testing.T) map[string]string {
	t.Helper()
	opts := regexp.MustCompile(`(?s)prometheus\.New(Counter|Gauge|Histogram|Summary)(?:Vec|Func)?\(\s*prometheus\.(?:Counter|Gauge|Histogram|Summary)Opts\{[^}]*?\bName:\s*"([a-zA-Z_:][a-zA-Z0-9_:]*)"`)
	// A descriptor's name may be wrapped in a call that adds a namespace (name("...")).
	desc := regexp.MustCompile(`prometheus\.NewDesc\(\s*(?:\w+\(\s*)?"([a-zA-Z_:][a-zA-Z0-9_:]*)"`)
	declaredIn := map[string]string{}
	add := func(kind, name, dir string) {
		declaredIn[name] = dir
		switch kind {
		case "Histogram":
			declaredIn[name+"_bucket"], declaredIn[name+"_sum"], declaredIn[name+"_count"] = dir, dir, dir
		case "Summary":
			declaredIn[name+"_sum"], declaredIn[name+"_count"] = dir, dir
		}
	}
	declared := 0
	for _, dir := range []string{"pkg", "internal/platform", "services"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			src, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			rel, err := filepath.Rel(root, filepath.Dir(p))
			if err != nil {
				return err
			}
			rel = filepath.ToSlash(rel)
			for _, m := range opts.FindAllStringSubmatch(string(src), -1) {
				add(m[1], m[2], rel)
				declared++
			}
			for _, m := range desc.FindAllStringSubmatch(string(src), -1) {
				add("Gauge", m[1], rel)
				declared++
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// The messaging package alone declares nine; fewer means the pattern no longer matches.
	if _, ok := declaredIn["outbox_oldest_pending_age_seconds"]; declared < 9 || !ok || declaredIn["consumer_messages_total"] == "" {
		t.Fatalf("found %d metric declarations (%v); has the way collectors are declared changed?", declared, declaredIn)
	}
	return declaredIn
}

// checkWithPromtool has promtool parse exprs, as recording rules, when it is installed
// (scripts/test.sh installs it and sets PROMTOOL). Grafana's interval variables become 5m.
func checkWithPromtool(t *testing.T, what string, exprs []string) {
	t.Helper()
	promtool := promtoolPath()
	if promtool == "" {
		t.Skipf("promtool is not installed, so the %s's queries were not parsed (scripts/test.sh installs it)", what)
	}
	type rule struct {
		Record string `json:"record"`
		Expr   string `json:"expr"`
	}
	var rules []rule
	vars := strings.NewReplacer("$__rate_interval", "5m", "$__interval", "5m", "$__range", "5m")
	for i, e := range exprs {
		rules = append(rules, rule{Record: fmt.Sprintf("%s:query_%d", what, i), Expr: vars.Replace(e)})
	}
	// JSON is YAML: promtool reads it as a rule file.
	raw, err := json.Marshal(map[string]any{"groups": []any{map[string]any{"name": what, "rules": rules}}})
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), what+"-rules.yml")
	if err := os.WriteFile(file, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "check", "rules", file).CombinedOutput(); err != nil {
		t.Errorf("promtool check rules on the %s's queries: %v\n%s", what, err, out)
	}
}

// promtoolPath is promtool's path: PROMTOOL's, or the one on PATH or in GOPATH/bin; "" if
// none is installed.
func promtoolPath() string {
	if p := os.Getenv("PROMTOOL"); p != "" {
		return p
	}
	if p, err := exec.LookPath("promtool"); err == nil {
		return p
	}
	if gopath, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
		if p := filepath.Join(strings.TrimSpace(string(gopath)), "bin", "promtool"); fileExists(p) {
			return p
		}
	}
	return ""
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// The alerts docs/operations.md and docs/testing.md say the live test (e2e/alerts_test.go)
// fires are the ones it waits for, no more and no fewer: a runbook reader trusts "proven live".
func TestLiveAlertsDocumented(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile(filepath.Join(root, "e2e", "alerts_test.go"))
	if err != nil {
		t.Fatal(err)
	}
	var live []string
	for _, m := range regexp.MustCompile(`\.(?:firing|find)\([^)]*?"([A-Z][A-Za-z]+)"`).FindAllStringSubmatch(string(src), -1) {
		if !slices.Contains(live, m[1]) {
			live = append(live, m[1])
		}
	}
	if len(live) < 5 {
		t.Fatalf("e2e/alerts_test.go: found the alerts %v waited for (firing, find); has the test changed?", live)
	}
	slices.Sort(live)
	var rules alertRules
	readYAML(t, "deploy/prometheus/alerts.yml", &rules)
	var all []string
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			all = append(all, r.Alert)
		}
	}
	named := regexp.MustCompile("`([A-Z][A-Za-z]+)`")
	// names returns the alerts of alerts.yml that text names.
	names := func(text string) []string {
		var out []string
		for _, m := range named.FindAllStringSubmatch(text, -1) {
			if slices.Contains(all, m[1]) && !slices.Contains(out, m[1]) {
				out = append(out, m[1])
			}
		}
		slices.Sort(out)
		return out
	}
	read := func(rel string) string {
		raw, err := os.ReadFile(filepath.Join(root, rel))
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(strings.Fields(string(raw)), " ")
	}
	// operations.md: "It makes A, B … fire on a real fault".
	m := regexp.MustCompile(`It makes (.*?) fire on a real fault`).FindStringSubmatch(read("docs/operations.md"))
	if m == nil {
		t.Fatal("docs/operations.md: no sentence \"It makes … fire on a real fault\" found")
	}
	if got := names(m[1]); !slices.Equal(got, live) {
		t.Errorf("docs/operations.md says the live test fires %v; e2e/alerts_test.go waits for %v", got, live)
	}
	// testing.md: its TestAlertsOnRealFaults item, up to the phase it runs in.
	_, item, _ := strings.Cut(read("docs/testing.md"), "(`TestAlertsOnRealFaults`")
	item, _, _ = strings.Cut(item, "It runs in phase")
	if got := names(item); !slices.Equal(got, live) {
		t.Errorf("docs/testing.md's TestAlertsOnRealFaults item names the alerts %v; e2e/alerts_test.go waits for %v", got, live)
	}
}

// unwatched are the metrics docs/operations.md documents that no alert reads and no panel of
// the dashboard shows, each with why.
var unwatched = map[string]string{
	"outbox_cleanup_deleted_total":            "housekeeping: the rows it counts were sent long ago, and nothing waits on them",
	"notification_oldest_pending_age_seconds": "notification_pending has the panel; NotificationSenderStalled's runbook reads the age",
}

// Every metric the Metrics section of docs/operations.md documents is read by an alert or
// shown on the dashboard, or is in unwatched with the reason: a metric documented for the
// operator is one an operator can see.
func TestDocumentedMetricsWatched(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile(filepath.Join(root, "docs", "operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(doc), "\n## Metrics\n")
	section, _, _ = strings.Cut(section, "\n## ")
	known := knownMetrics(t)
	var documented []string
	for _, m := range regexp.MustCompile("`([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\\{[^`}]*\\})?`").FindAllStringSubmatch(section, -1) {
		if known[m[1]] && !slices.Contains(documented, m[1]) {
			documented = append(documented, m[1])
		}
	}
	if len(documented) < 15 {
		t.Fatalf("docs/operations.md's Metrics section documents %v; has the section changed?", documented)
	}

	read := map[string]bool{}
	var rules alertRules
	readYAML(t, "deploy/prometheus/alerts.yml", &rules)
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			for _, m := range metricNames(r.Expr) {
				read[m] = true
			}
		}
	}
	d := readDashboard(t)
	for _, p := range allPanels(d.Panels) {
		for _, q := range p.Targets {
			for _, m := range metricNames(q.Expr) {
				read[m] = true
			}
		}
	}

	for _, m := range documented {
		seen := read[m] || read[m+"_bucket"] || read[m+"_count"] || read[m+"_sum"]
		why, exempt := unwatched[m]
		switch {
		case !seen && !exempt:
			t.Errorf("docs/operations.md documents %s, which no alert reads and no panel shows: add a panel, or say why not in unwatched", m)
		case seen && exempt:
			t.Errorf("%s is read by an alert or a panel, yet unwatched says %q: remove it from there", m, why)
		}
	}
	for m := range unwatched {
		if !slices.Contains(documented, m) {
			t.Errorf("unwatched names %s, which docs/operations.md's Metrics section does not document", m)
		}
	}
}
