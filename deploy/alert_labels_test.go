package deploy_test

import (
	"context"
	"encoding/json"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxkit/outbox-inbox/internal/platform"
)

// targetLabels are the labels Prometheus gives a target's series (its scrape configuration's,
// not the code's): a matcher on them is not checked here.
var targetLabels = []string{"job", "instance", "namespace"}

// codeLabels says, for each label of a metric the code exports that a rule or panel matches on
// a fixed value, where the values the code gives it are read: the Go constants that hold them,
// or the platform's router itself. A label of the code's metrics that is matched but not here
// fails the test, so a new matcher comes with its source.
var codeLabels = map[string]map[string]func(t *testing.T) []string{
	"consumer_messages_total": {
		"outcome": constants("pkg/messaging", "settledAcked", "settledRequeued", "settledDeadLettered"),
	},
	"consumer_handler_seconds": {
		"outcome": constants("pkg/messaging", "handlerOK", "handlerError", "handlerPermanent"),
	},
	"notification_deliveries_total": {
		"outcome": constants("services/notification", "deliverySent", "deliveryFailed", "deliveryUndeliverable"),
	},
	"http_requests_total":           {"route": routerLabel("route"), "code": routerLabel("code")},
	"http_request_duration_seconds": {"route": routerLabel("route")},
}

// Every label matcher of the alert rules (compose's and the PrometheusRule's) and of the
// dashboard on a metric the code exports names values the code gives that label: an alert on
// outcome="failure" where the code counts outcome="failed" would never fire, and a route!~
// listing a route that does not exist excludes nothing. A fixed value (=, !=) or each branch of
// a plain alternation (=~, !~ "a|b") must be one of the code's values; any other regex must
// match one.
func TestRuleLabelValuesAreTheCodes(t *testing.T) {
	t.Parallel()
	known := knownMetrics(t)
	values := map[string][]string{} // by metric/label, read once
	checked := 0
	for where, expr := range ruleAndPanelExprs(t) {
		for _, sel := range vectorSelectors(expr) {
			metric := codeMetric(sel.metric)
			if !known[sel.metric] || slices.Contains(rabbitmqMetrics, sel.metric) || sel.metric == "up" {
				continue // not the code's
			}
			for _, m := range sel.matchers {
				if m.err != nil {
					t.Errorf("%s: %s: %v", where, sel.metric, m.err)
					continue
				}
				if slices.Contains(targetLabels, m.label) {
					continue
				}
				source, ok := codeLabels[metric][m.label]
				if !ok {
					t.Errorf("%s: %s{%s%s%q}: codeLabels has no source for %s's %s values: add one", where, sel.metric, m.label, m.op, m.value, metric, m.label)
					continue
				}
				key := metric + "/" + m.label
				if values[key] == nil {
					values[key] = source(t)
				}
				if bad := unexported(m, values[key]); bad != "" {
					t.Errorf("%s: %s{%s%s%q}: %s, but the code gives %s only %v", where, sel.metric, m.label, m.op, m.value, bad, m.label, values[key])
				}
				checked++
			}
		}
	}
	// NotificationDeliveryFailures, ConsumerFailures, ConsumerDeadLettering and APIErrors match
	// on the code's labels, in both rule files: fewer means the rules were not read.
	if checked < 8 {
		t.Fatalf("checked %d matchers; have the rule files or the dashboard moved?", checked)
	}
}

// unexported says why m matches a value the code does not export, "" if it does not.
func unexported(m labelMatcher, values []string) string {
	if m.op == "=" || m.op == "!=" {
		if !slices.Contains(values, m.value) {
			return strconv.Quote(m.value) + " is not one of its values"
		}
		return ""
	}
	alternatives := strings.Split(m.value, "|")
	plain := !slices.ContainsFunc(alternatives, func(a string) bool { return a == "" || regexp.QuoteMeta(a) != a })
	if plain {
		for _, a := range alternatives {
			if !slices.Contains(values, a) {
				return strconv.Quote(a) + " is not one of its values"
			}
		}
		return ""
	}
	// Prometheus anchors a matcher's regex at both ends.
	re, err := regexp.Compile("^(?:" + m.value + ")$")
	if err != nil {
		return "the regex does not compile: " + err.Error()
	}
	if !slices.ContainsFunc(values, re.MatchString) {
		return "the regex matches none of its values"
	}
	return ""
}

// codeMetric is the metric a series belongs to: a histogram's _bucket, _sum and _count are its.
func codeMetric(series string) string {
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(series, suffix); ok {
			if _, declared := codeLabels[base]; declared {
				return base
			}
		}
	}
	return series
}

// ruleAndPanelExprs are the expressions of compose's alert rules, of the PrometheusRule and of
// the dashboard's panels, by where they are.
func ruleAndPanelExprs(t *testing.T) map[string]string {
	t.Helper()
	exprs := map[string]string{}
	for _, r := range alertRuleExprs(t) {
		exprs[r.where] = r.expr
	}
	d := readDashboard(t)
	for _, p := range allPanels(d.Panels) {
		for _, q := range p.Targets {
			exprs["dashboard panel "+strconv.Quote(p.Title)+" "+q.RefID] = q.Expr
		}
	}
	return exprs
}

// ruleExpr is one alert rule of compose's alerts.yml or of the PrometheusRule.
type ruleExpr struct {
	where   string // "alerts.yml ServiceDown", "PrometheusRule outbox-inbox ServiceDown"
	alert   string
	expr    string
	k8sOnly bool // in one of the PrometheusRule's k8sOnlyGroups, which compose's Prometheus does not load
}

// alertRuleExprs are the alert rules of alerts.yml, then those of the PrometheusRule.
func alertRuleExprs(t *testing.T) []ruleExpr {
	t.Helper()
	var out []ruleExpr
	var rules alertRules
	readYAML(t, "deploy/prometheus/alerts.yml", &rules)
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			out = append(out, ruleExpr{where: "alerts.yml " + r.Alert, alert: r.Alert, expr: r.Expr})
		}
	}
	for _, pr := range monitoring(t).rules {
		raw, err := json.Marshal(pr.Spec.Groups)
		if err != nil {
			t.Fatal(err)
		}
		var groups []struct {
			Name  string `json:"name"`
			Rules []struct {
				Alert string `json:"alert"`
				Expr  string `json:"expr"`
			} `json:"rules"`
		}
		if err := json.Unmarshal(raw, &groups); err != nil {
			t.Fatalf("PrometheusRule %s: %v", pr.Metadata.Name, err)
		}
		for _, g := range groups {
			for _, r := range g.Rules {
				out = append(out, ruleExpr{where: "PrometheusRule " + pr.Metadata.Name + " " + r.Alert, alert: r.Alert, expr: r.Expr,
					k8sOnly: slices.Contains(k8sOnlyGroups, g.Name)})
			}
		}
	}
	return out
}

// constants reads the string constants names declares in dir's Go files (tests aside): the
// values the code labels a series with.
func constants(dir string, names ...string) func(t *testing.T) []string {
	return func(t *testing.T) []string {
		t.Helper()
		found := map[string]string{}
		entries, err := os.ReadDir(filepath.Join(root, dir))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			if e.IsDir() || !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
				continue
			}
			f, err := parser.ParseFile(token.NewFileSet(), filepath.Join(root, dir, e.Name()), nil, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			for _, decl := range f.Decls {
				g, ok := decl.(*ast.GenDecl)
				if !ok || g.Tok != token.CONST {
					continue
				}
				for _, spec := range g.Specs {
					vs, ok := spec.(*ast.ValueSpec)
					if !ok {
						continue
					}
					for i, n := range vs.Names {
						if i >= len(vs.Values) || !slices.Contains(names, n.Name) {
							continue
						}
						if lit, ok := vs.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
							if found[n.Name], err = strconv.Unquote(lit.Value); err != nil {
								t.Fatal(err)
							}
						}
					}
				}
			}
		}
		var values []string
		for _, n := range names {
			v, ok := found[n]
			if !ok {
				t.Fatalf("%s declares no string constant %s: codeLabels names the constants that hold a label's values", dir, n)
			}
			values = append(values, v)
		}
		return values
	}
}

// routerLabel is the values platform.NewRouter gives label of http_requests_total and
// http_request_duration_seconds, read from its registry after a request to each operational
// endpoint and to a path it does not route. A service's own routes (its package main's) are
// not among them: an alert that names one is to add it here.
func routerLabel(label string) func(t *testing.T) []string {
	return func(t *testing.T) []string {
		t.Helper()
		reg := prometheus.NewRegistry()
		notReady := func(context.Context) error { return errors.New("not ready") }
		router := platform.NewRouter(slog.New(slog.DiscardHandler), reg, notReady)
		for _, path := range []string{"/healthz", "/readyz", "/metrics", "/no/such/route"} {
			router.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, path, nil))
		}
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		var values []string
		for _, f := range families {
			if f.GetName() != "http_requests_total" && f.GetName() != "http_request_duration_seconds" {
				continue
			}
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == label && !slices.Contains(values, l.GetValue()) {
						values = append(values, l.GetValue())
					}
				}
			}
		}
		if len(values) == 0 {
			t.Fatalf("the router's metrics have no label %s", label)
		}
		slices.Sort(values)
		return values
	}
}
