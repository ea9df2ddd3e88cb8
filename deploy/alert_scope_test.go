package deploy_test

// What the alert rules keep apart: their job matchers must take in every scrape job that
// exports the metric they select (a job name misspelt, or a "(-cluster)?" dropped, silences an
// alert for those jobs, and promtool's cases, written with the right names, still pass), and
// their groupings must keep namespace (two installs in one Prometheus are two alerts, not one
// sum). Both hold for alerts.yml and for the PrometheusRule of deploy/k8s/monitoring.

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// scrapeJob is one job label a scrape gives its targets, after relabelling, with what its
// targets serve: an app's name (its /metrics), "rabbitmq" (the plugin's aggregated /metrics)
// or "rabbitmq-queues" (its /metrics/detailed).
type scrapeJob struct {
	where, job, exporter string
}

func (j scrapeJob) String() string { return fmt.Sprintf("%s job %s (%s)", j.where, j.job, j.exporter) }

// exporterRabbitMQ and exporterQueues are what a RabbitMQ node's plugin serves: its
// aggregated /metrics, and the per-queue families of /metrics/detailed (only those asked for).
const (
	exporterRabbitMQ = "rabbitmq"
	exporterQueues   = "rabbitmq-queues"
)

// rabbitmqExporter says which of the plugin's endpoints path is.
func rabbitmqExporter(path string) string {
	if path == "/metrics/detailed" {
		return exporterQueues
	}
	return exporterRabbitMQ
}

// composeScrapeJobs are the jobs of prometheus.yml's targets, with what each scrapes, told by
// the compose service of its host. Prometheus's own job is left out: the rules watch this
// system, not the Prometheus that runs them (Kubernetes has no such job).
func composeScrapeJobs(t *testing.T) []scrapeJob {
	t.Helper()
	var cfg prometheusConfig
	readYAML(t, "deploy/prometheus/prometheus.yml", &cfg)
	brokers := append([]string{"rabbitmq"}, clusterNodes...)
	var out []scrapeJob
	for _, tg := range prometheusTargets(t, cfg) {
		job := scrapeJob{where: "prometheus.yml", job: tg.labels["job"]}
		switch {
		case slices.Contains(brokers, tg.host):
			job.exporter = rabbitmqExporter(tg.path)
		case tg.host == "127.0.0.1" && tg.jobName == "prometheus":
			continue
		default:
			for _, a := range apps {
				if tg.host == a.name || tg.host == clusterService(a) {
					job.exporter = a.name
				}
			}
		}
		if job.exporter == "" {
			t.Errorf("prometheus.yml job %s scrapes %s, which this test cannot tell: say in composeScrapeJobs what it exports", tg.jobName, tg.host)
			continue
		}
		if !slices.Contains(out, job) {
			out = append(out, job)
		}
	}
	return out
}

// k8sScrapeJobs are the jobs the ServiceMonitors give the Services they scrape, as
// TestK8sMonitoringCoversEveryJob derives them, with what each scrapes.
func k8sScrapeJobs(t *testing.T) []scrapeJob {
	t.Helper()
	m := monitoring(t)
	services := monitoredServices(t)
	var out []scrapeJob
	for i, svc := range services {
		got, _ := scrapesOf(t, m.monitors, svc)
		for _, sc := range got {
			job := scrapeJob{where: "deploy/k8s/monitoring", job: sc.Job}
			if i == 0 { // the RabbitMQ operator's Service
				job.exporter = rabbitmqExporter(sc.Path)
			} else if slices.ContainsFunc(apps, func(a app) bool { return a.name == svc.name }) {
				job.exporter = svc.name
			} else {
				t.Errorf("deploy/k8s/monitoring scrapes Service %s as job %s, which this test cannot tell: say in k8sScrapeJobs what it exports", svc.name, sc.Job)
				continue
			}
			if !slices.Contains(out, job) {
				out = append(out, job)
			}
		}
	}
	return out
}

// metricExporters says what exports each metric the rules may filter by job:
//   - up, every target (Prometheus writes it);
//   - the process collector's series, every service (internal/platform registers it) and
//     RabbitMQ's aggregated /metrics (processMetrics);
//   - the plugin's series: rabbitmq_detailed_* from /metrics/detailed, the others from the
//     aggregated /metrics (rabbitmqMetrics);
//   - the code's series (codeMetrics): one declared in services/<app> is that app's; one of
//     the library (pkg/) or of internal/platform, every service's (a rule that means some
//     services only says so in narrowedExporters).
//
// nil for any other metric.
func metricExporters(t *testing.T) func(metric string) []string {
	t.Helper()
	code := codeMetrics(t)
	var services []string
	for _, a := range apps {
		services = append(services, a.name)
	}
	return func(metric string) []string {
		switch {
		case metric == "up":
			return append(slices.Clone(services), exporterRabbitMQ, exporterQueues)
		case slices.Contains(processMetrics, metric):
			return append(slices.Clone(services), exporterRabbitMQ)
		case slices.Contains(rabbitmqMetrics, metric):
			if strings.HasPrefix(metric, "rabbitmq_detailed_") {
				return []string{exporterQueues}
			}
			return []string{exporterRabbitMQ}
		}
		dir, ok := code[metric]
		if !ok {
			return nil
		}
		if app, ok := strings.CutPrefix(dir, "services/"); ok {
			app, _, _ = strings.Cut(app, "/")
			return []string{app}
		}
		return services
	}
}

// narrowedExporters are the rules whose job matcher on a metric means only some of its
// exporters, by alert and metric, each with why.
var narrowedExporters = map[string]map[string][]string{
	// ServiceNotRunning: the up of a Deployment's pods, which kube-state-metrics reports on;
	// RabbitMQ runs in the operator's StatefulSet.
	"ServiceNotRunning": {"up": {"order", "invoicing", "notification"}},
}

// matcherKeeps reports whether matcher m (a job matcher) keeps a series whose label is value.
// Prometheus anchors a regex at both ends.
func matcherKeeps(m labelMatcher, value string) (bool, error) {
	switch m.op {
	case "=":
		return value == m.value, nil
	case "!=":
		return value != m.value, nil
	}
	re, err := regexp.Compile("^(?:" + m.value + ")$")
	if err != nil {
		return false, err
	}
	return re.MatchString(value) == (m.op == "=~"), nil
}

// jobMatcherErrors checks every selector of expr that has a job matcher: it must keep each of
// jobs whose exporter exports the selector's metric (exporters), and some job must. checked
// counts the matchers checked.
func jobMatcherErrors(expr string, jobs []scrapeJob, exporters func(metric string) []string) (errs []string, checked int) {
	for _, sel := range vectorSelectors(expr) {
		for _, m := range sel.matchers {
			if m.err != nil {
				errs = append(errs, fmt.Sprintf("%s: %v", sel.metric, m.err))
				continue
			}
			if m.label != "job" {
				continue
			}
			checked++
			what := fmt.Sprintf("%s{job%s%q}", sel.metric, m.op, m.value)
			from := exporters(sel.metric)
			if from == nil {
				errs = append(errs, what+": this test does not know what exports "+sel.metric+": say so in metricExporters")
				continue
			}
			exported := false
			for _, j := range jobs {
				if !slices.Contains(from, j.exporter) {
					continue
				}
				exported = true
				keeps, err := matcherKeeps(m, j.job)
				switch {
				case err != nil:
					errs = append(errs, fmt.Sprintf("%s: %v", what, err))
				case !keeps:
					errs = append(errs, fmt.Sprintf("%s leaves out %s, which exports %s", what, j, sel.metric))
				}
			}
			if !exported {
				errs = append(errs, fmt.Sprintf("%s: no scrape job exports %s (exported by %v)", what, sel.metric, from))
			}
		}
	}
	return errs, checked
}

// Every job matcher of the rules takes in every scrape job, of prometheus.yml and of the
// ServiceMonitors, whose targets export the metric it filters: the rules of alerts.yml, and
// their copy in the PrometheusRule, against both; the PrometheusRule's own (k8sOnlyGroups)
// against the ServiceMonitors' alone.
func TestAlertJobMatchersTakeInTheScrapeJobs(t *testing.T) {
	t.Parallel()
	compose, cluster := composeScrapeJobs(t), k8sScrapeJobs(t)
	if len(compose) < 10 || len(cluster) < 5 {
		t.Fatalf("found the scrape jobs %v and %v; have prometheus.yml or the ServiceMonitors moved?", compose, cluster)
	}
	exporters := metricExporters(t)
	checked, narrowed := 0, map[string]bool{}
	for _, r := range alertRuleExprs(t) {
		jobs := slices.Concat(compose, cluster)
		if r.k8sOnly {
			jobs = cluster
		}
		ruleExporters := func(metric string) []string {
			if from, ok := narrowedExporters[r.alert][metric]; ok {
				narrowed[r.alert+" "+metric] = true
				return from
			}
			return exporters(metric)
		}
		errs, n := jobMatcherErrors(r.expr, jobs, ruleExporters)
		for _, e := range errs {
			t.Errorf("%s: %s", r.where, e)
		}
		checked += n
	}
	for alert, metrics := range narrowedExporters {
		for metric := range metrics {
			if !narrowed[alert+" "+metric] {
				t.Errorf("narrowedExporters names %s's %s, which no job matcher of that rule filters", alert, metric)
			}
		}
	}
	// ServiceDown, ServiceNotReady, ServiceRestarting, APIErrors (3), the RabbitMQ group's (4)
	// in both files, and ServiceNotRunning's: fewer means the rules were not read.
	if checked < 21 {
		t.Fatalf("checked %d job matchers; have the rule files moved?", checked)
	}
}

// The check fails on what a slip in a rule does: a job name misspelt, a "(-cluster)?" or an
// alternative dropped, in one selector of several.
func TestAlertJobMatchersChecker(t *testing.T) {
	t.Parallel()
	compose, cluster := composeScrapeJobs(t), k8sScrapeJobs(t)
	jobs := slices.Concat(compose, cluster)
	exporters := metricExporters(t)
	rules := map[string]string{}
	for _, r := range alertRuleExprs(t) {
		if !r.k8sOnly && strings.HasPrefix(r.where, "alerts.yml ") {
			rules[r.alert] = r.expr
		}
	}
	for _, c := range []struct {
		alert, from, to string
		n               int // which occurrence of from, from 1
	}{
		{"ServiceDown", "(order|", "(orders|", 1},
		{"ServiceRestarting", "(-cluster)?", "", 1},
		{"DeadLetterQueueNotEmpty", "rabbitmq(-cluster)?-queues", "rabbitmq-queues", 1},
		{"QueueWithoutConsumers", "-queues", "", 1},
		{"BrokerResourceAlarm", `rabbitmq(-cluster)?"`, `rabbitmq"`, 2},
		{"APIErrors", "|notification)(-cluster)?", "|notification)", 3},
		{"ServiceNotReady", "|invoicing|", "|", 1},
	} {
		expr, ok := rules[c.alert]
		if !ok {
			t.Errorf("alerts.yml has no rule %s", c.alert)
			continue
		}
		broken, ok := replaceNth(expr, c.from, c.to, c.n)
		if !ok {
			t.Errorf("%s: no occurrence %d of %q in %s", c.alert, c.n, c.from, expr)
			continue
		}
		if errs, _ := jobMatcherErrors(expr, jobs, exporters); len(errs) > 0 {
			t.Errorf("%s as it is: %v", c.alert, errs)
		}
		if errs, _ := jobMatcherErrors(broken, jobs, exporters); len(errs) == 0 {
			t.Errorf("%s with %q for the %d. %q passes: %s", c.alert, c.to, c.n, c.from, broken)
		}
	}
	// In a PrometheusRule's own rules, checked against the ServiceMonitors' jobs alone.
	const notRunning = `kube_deployment_status_replicas_available == 0 unless on (namespace, job) up{job=~"order|invoicing|notification"}`
	narrow := func(string) []string { return narrowedExporters["ServiceNotRunning"]["up"] }
	if errs, _ := jobMatcherErrors(notRunning, cluster, narrow); len(errs) > 0 {
		t.Errorf("ServiceNotRunning as it is: %v", errs)
	}
	if errs, _ := jobMatcherErrors(strings.Replace(notRunning, "|notification", "", 1), cluster, narrow); len(errs) == 0 {
		t.Error("ServiceNotRunning without notification in its job matcher passes")
	}
}

// replaceNth replaces the nth occurrence (from 1) of old in s with repl.
func replaceNth(s, old, repl string, n int) (string, bool) {
	at := 0
	for range n {
		i := strings.Index(s[at:], old)
		if i < 0 {
			return s, false
		}
		at += i + len(old)
	}
	at -= len(old)
	return s[:at] + repl + s[at+len(old):], true
}

// labelPreserving are the aggregations that return their input's series as they are, labels
// and all, whatever their by or without.
var labelPreserving = map[string]bool{"topk": true, "bottomk": true, "limitk": true, "limit_ratio": true}

// dropsNamespace says how g loses the namespace label, "" if it keeps it.
func dropsNamespace(g grouping) string {
	if labelPreserving[g.op] {
		return ""
	}
	listed := slices.Contains(g.labels, "namespace")
	switch {
	case g.clause == "":
		return fmt.Sprintf("%s aggregates with no by (namespace, …)", g)
	case (g.clause == "by" || g.clause == "on") && !listed:
		return fmt.Sprintf("%s leaves out namespace", g)
	case (g.clause == "without" || g.clause == "ignoring") && listed:
		return fmt.Sprintf("%s drops namespace", g)
	}
	return ""
}

// Every aggregation of the rules keeps namespace (by (namespace, …), or a without that does
// not name it), and every vector matching matches on it (on (namespace, …), or an ignoring
// that does not name it): in a Prometheus that scrapes two installs (deploy/k8s/monitoring in
// two namespaces), an aggregation without it sums the two into one alert, and a matching
// without it pairs one install's series with the other's. promtool's cases have two
// namespaces for two rules only; this holds every rule to it.
func TestAlertRulesKeepNamespace(t *testing.T) {
	t.Parallel()
	checked := 0
	for _, r := range alertRuleExprs(t) {
		for _, g := range groupings(r.expr) {
			if why := dropsNamespace(g); why != "" {
				t.Errorf("%s: %s: %s", r.where, why, r.expr)
			}
			checked++
		}
	}
	// The 18 rules that aggregate, some of them several times, in both files.
	if checked < 2*18 {
		t.Fatalf("checked %d groupings; have the rule files moved?", checked)
	}
}

// The check sees namespace removed from any one grouping of any rule, and the groupings'
// forms this test knows.
func TestAlertRulesKeepNamespaceChecker(t *testing.T) {
	t.Parallel()
	for expr, drops := range map[string]bool{
		`max by (namespace, job) (x) > 300`:              false,
		`sum(rate(x[5m])) by (namespace, job) > 0`:       false,
		`sum without (instance) (x)`:                     false,
		`a and on (namespace, job) b`:                    false,
		`a / ignoring (instance) group_left (version) b`: false,
		`topk(3, x)`:                    false,
		`up == 0`:                       false,
		`sum(x)`:                        true,
		`max by (job) (x)`:              true,
		`sum(rate(x[5m])) by (job)`:     true,
		`count without (namespace) (x)`: true,
		`a and on (job) b`:              true,
		`a / ignoring (namespace) b`:    true,
		`histogram_quantile(0.95, sum by (namespace, job) (max by (le) (x)))`: true,
	} {
		got := slices.ContainsFunc(groupings(expr), func(g grouping) bool { return dropsNamespace(g) != "" })
		if got != drops {
			t.Errorf("%s: drops namespace %v, want %v (groupings %v)", expr, got, drops, groupings(expr))
		}
	}
	// Each rule with namespace taken out of one of its lists, in turn.
	list := regexp.MustCompile(`\b(by|on)\s*\(([^)]*)\)`)
	mutated := 0
	for _, r := range alertRuleExprs(t) {
		for _, loc := range list.FindAllStringSubmatchIndex(r.expr, -1) {
			labels := strings.Split(r.expr[loc[4]:loc[5]], ",")
			kept := slices.DeleteFunc(slices.Clone(labels), func(l string) bool { return strings.TrimSpace(l) == "namespace" })
			if len(kept) == len(labels) {
				continue
			}
			broken := r.expr[:loc[4]] + strings.Join(kept, ",") + r.expr[loc[5]:]
			if !slices.ContainsFunc(groupings(broken), func(g grouping) bool { return dropsNamespace(g) != "" }) {
				t.Errorf("%s with namespace taken out of %q passes: %s", r.where, r.expr[loc[0]:loc[1]], broken)
			}
			mutated++
		}
	}
	if mutated < 2*18 {
		t.Errorf("took namespace out of %d lists; have the rules moved?", mutated)
	}
}
