package deploy_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"go.yaml.in/yaml/v4"
)

// kubeStateMetrics are the series of kube-state-metrics that the Kubernetes-only rules read.
var kubeStateMetrics = []string{"kube_deployment_status_replicas_available"}

// k8sAlertsTest is the promtool test file of the PrometheusRule's k8sOnlyGroups, which it
// reads as kubernetes-alerts.yml.
const k8sAlertsTest = "deploy/k8s/testdata/kubernetes-alerts_test.yml"

// The alerts only the PrometheusRule has (k8sOnlyGroups) are held to what alerts.yml's are
// (TestAlertRules), with kube-state-metrics' series and up as the metrics that exist, and
// their cases in k8sAlertsTest pass in promtool.
func TestK8sOnlyAlerts(t *testing.T) {
	t.Parallel()
	m := monitoring(t)
	if len(m.rules) != 1 {
		t.Fatalf("want one PrometheusRule, have %d", len(m.rules))
	}
	all, _ := m.rules[0].Spec.Groups.([]any)
	var groups []any
	for _, g := range all {
		if name, _ := g.(map[string]any)["name"].(string); slices.Contains(k8sOnlyGroups, name) {
			groups = append(groups, g)
		}
	}
	if len(groups) != len(k8sOnlyGroups) {
		t.Fatalf("the PrometheusRule has %d of the groups %v", len(groups), k8sOnlyGroups)
	}
	// JSON is YAML: promtool reads it as a rule file, and the test's types read it too.
	ruleFile, err := json.Marshal(map[string]any{"groups": groups})
	if err != nil {
		t.Fatal(err)
	}
	var rules alertRules
	if err := yaml.Unmarshal(ruleFile, &rules); err != nil {
		t.Fatal(err)
	}

	known := map[string]bool{"up": true}
	for _, name := range kubeStateMetrics {
		known[name] = true
	}
	c := newAlertChecks(t, k8sAlertsTest, "kubernetes-alerts.yml", known)
	var names []string
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				t.Errorf("group %s: a rule that is no alert (record %q)", g.Name, r.Record)
				continue
			}
			names = append(names, r.Alert)
			c.check(t, r)
		}
	}
	for name := range c.fires {
		if !slices.Contains(names, name) {
			t.Errorf("%s tests %s, which the groups %v do not define", k8sAlertsTest, name, k8sOnlyGroups)
		}
	}

	promtool := promtoolPath()
	if promtool == "" {
		t.Skip("promtool is not installed, so the cases were not run (scripts/test.sh installs it)")
	}
	dir := t.TempDir()
	cases, err := os.ReadFile(filepath.Join(root, k8sAlertsTest))
	if err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string][]byte{"kubernetes-alerts.yml": ruleFile, "kubernetes-alerts_test.yml": cases} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command(promtool, "test", "rules", filepath.Join(dir, "kubernetes-alerts_test.yml")).CombinedOutput(); err != nil {
		t.Errorf("promtool test rules %s: %v\n%s", k8sAlertsTest, err, out)
	}
}
