package deploy_test

// The Prometheus Operator resources of deploy/k8s/monitoring, checked with no cluster: every
// document of every file its kustomization.yaml lists is validated against the operator's CRD
// schema (vendored in deploy/k8s/testdata/crds), with unknown fields rejected, and then held
// to the compose setup it stands for: the ServiceMonitors scrape what
// deploy/prometheus/prometheus.yml scrapes, from the base's Services, under the same job names,
// and the PrometheusRule holds exactly the groups of deploy/prometheus/alerts.yml, whose rules
// group by those job names.

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

var monitoringDir = filepath.Join(k8sDir, "monitoring")

// monitoringKustomization is what deploy/k8s/monitoring/kustomization.yaml may hold, decoded
// strictly: no namespace (it applies where the base went), no labels (an overlay adds the ones
// a Prometheus selects).
type monitoringKustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Resources  []string `json:"resources"`
}

// The fields of a ServiceMonitor this test reads; the whole document is validated against the
// CRD first.
type serviceMonitor struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Spec     struct {
		JobLabel          string               `json:"jobLabel"`
		Selector          metav1.LabelSelector `json:"selector"`
		NamespaceSelector *struct {
			Any        bool     `json:"any"`
			MatchNames []string `json:"matchNames"`
		} `json:"namespaceSelector"`
		Endpoints []monitorEndpoint `json:"endpoints"`
	} `json:"spec"`
}

type monitorEndpoint struct {
	Port        string              `json:"port"`
	TargetPort  any                 `json:"targetPort"`
	Path        string              `json:"path"`
	Params      map[string][]string `json:"params"`
	Interval    string              `json:"interval"`
	Relabelings []relabeling        `json:"relabelings"`
}

// relabeling is one relabeling of a ServiceMonitor's endpoint (JSON, camelCase) or one of
// prometheus.yml's relabel_configs (YAML, snake_case): the same fields.
type relabeling struct {
	Action       string   `json:"action" yaml:"action"`
	SourceLabels []string `json:"sourceLabels" yaml:"source_labels"`
	Separator    *string  `json:"separator" yaml:"separator"`
	Regex        string   `json:"regex" yaml:"regex"`
	TargetLabel  string   `json:"targetLabel" yaml:"target_label"`
	Replacement  *string  `json:"replacement" yaml:"replacement"`
}

type prometheusRule struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Spec     struct {
		Groups any `json:"groups"`
	} `json:"spec"`
}

type monitoringManifests struct {
	kust     monitoringKustomization
	monitors []serviceMonitor
	rules    []prometheusRule
}

var loadMonitoring = sync.OnceValues(readMonitoring)

func monitoring(t *testing.T) *monitoringManifests { t.Helper(); return loaded(t, loadMonitoring) }

func readMonitoring() (*monitoringManifests, error) {
	m := &monitoringManifests{}
	seen := map[string]bool{}
	err := readKustomization(monitoringDir, &m.kust, func() []string { return m.kust.Resources },
		func(crds map[string]*crd, doc []byte) error { return m.add(crds, seen, doc) })
	if err != nil {
		err = fmt.Errorf("monitoring/: %w", err)
	}
	return m, err
}

// add validates one document (JSON) against its CRD and files it. k8sManifests.add is not
// used: the base must hold none of these kinds.
func (m *monitoringManifests) add(crds map[string]*crd, seen map[string]bool, doc []byte) error {
	head, err := readHead(doc)
	if err != nil {
		return err
	}
	what := head.APIVersion + " " + head.Kind
	key := head.Kind + "/" + head.Metadata.Name
	if seen[key] {
		return fmt.Errorf("%s %s is defined twice", head.Kind, head.Metadata.Name)
	}
	seen[key] = true
	c, ok := crds[head.APIVersion+"/"+head.Kind]
	if !ok {
		return fmt.Errorf("%s: no CRD for this kind in deploy/k8s/testdata/crds", what)
	}
	if err := c.validate(doc); err != nil {
		return fmt.Errorf("%s %s: %w", what, head.Metadata.Name, err)
	}
	switch head.Kind {
	case "ServiceMonitor":
		var o serviceMonitor
		if err := json.Unmarshal(doc, &o); err != nil {
			return err
		}
		m.monitors = append(m.monitors, o)
	case "PrometheusRule":
		var o prometheusRule
		if err := json.Unmarshal(doc, &o); err != nil {
			return err
		}
		m.rules = append(m.rules, o)
	default:
		return fmt.Errorf("%s: validated, but no test reads it; add it to monitoringManifests", what)
	}
	return nil
}

// Every file monitoring/kustomization.yaml lists validates, document by document, and it lists
// every manifest of deploy/k8s/monitoring.
func TestK8sMonitoringManifestsValidate(t *testing.T) {
	t.Parallel()
	m := monitoring(t)
	if len(m.monitors) == 0 || len(m.rules) != 1 {
		t.Errorf("found %d ServiceMonitors and %d PrometheusRules; want the scrapes of prometheus.yml and one PrometheusRule", len(m.monitors), len(m.rules))
	}
	for _, sm := range m.monitors {
		// The base's Services are in the ServiceMonitor's own namespace; any other would
		// scrape someone else's services under these job names.
		if ns := sm.Spec.NamespaceSelector; ns != nil && (ns.Any || len(ns.MatchNames) > 0) {
			t.Errorf("ServiceMonitor %s: namespaceSelector %+v, want none (its own namespace, where the base is)", sm.Metadata.Name, *ns)
		}
	}
	checkListsEveryManifest(t, monitoringDir, m.kust.Resources)
}

// The validation refuses what the API server would: a misspelt field, a value of the wrong
// shape, anything outside an enum or a pattern.
func TestK8sMonitoringValidationRejectsUnknownFields(t *testing.T) {
	t.Parallel()
	crds, err := loadCRDs(filepath.Join(k8sDir, "testdata", "crds"))
	if err != nil {
		t.Fatal(err)
	}
	bad := []string{
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"ServiceMonitor","metadata":{"name":"x"},"spec":{"selector":{},"endpoints":[{"prot":"http"}]}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"ServiceMonitor","metadata":{"name":"x"},"spec":{"jobLable":"a","selector":{},"endpoints":[{"port":"http"}]}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"ServiceMonitor","metadata":{"name":"x","lables":{}},"spec":{"selector":{},"endpoints":[{"port":"http"}]}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"ServiceMonitor","metadata":{"name":"x"},"spec":{"selector":{},"endpoints":[{"port":"http","params":{"family":"queue_coarse_metrics"}}]}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"ServiceMonitor","metadata":{"name":"x"},"spec":{"selector":{},"endpoints":[{"port":"http","relabelings":[{"action":"rewrite","targetLabel":"job"}]}]}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"ServiceMonitor","metadata":{"name":"x"},"spec":{"selector":{},"endpoints":[{"port":"http","interval":"15 seconds"}]}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"ServiceMonitor","metadata":{"name":"x"}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"PrometheusRule","metadata":{"name":"x"},"spec":{"groups":[{"name":"g","rules":[{"alerts":"A","expr":"up"}]}]}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"PrometheusRule","metadata":{"name":"x"},"spec":{"groups":[{"name":"g","rules":[{"alert":"A","expr":"up","for":"5 minutes"}]}]}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"PrometheusRule","metadata":{"name":"x"},"spec":{"groups":[{"rules":[]}]}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"PrometheusRule","metadata":{"name":"x"},"spec":{"group":[]}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"ScrapeConfig","metadata":{"name":"x"},"spec":{}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"ServiceMonitor","metadata":{"name":"x","namespace":"monitoring"},"spec":{"selector":{},"endpoints":[{"port":"http"}]}}`,
	}
	for _, doc := range bad {
		if err := (&monitoringManifests{}).add(crds, map[string]bool{}, []byte(doc)); err == nil {
			t.Errorf("accepted %s", doc)
		}
	}
	for _, good := range []string{
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"ServiceMonitor","metadata":{"name":"x"},"spec":{"selector":{},"endpoints":[{"port":"http","interval":"15s","relabelings":[{"targetLabel":"job","replacement":"j"}]}]}}`,
		`{"apiVersion":"monitoring.coreos.com/v1","kind":"PrometheusRule","metadata":{"name":"x"},"spec":{"groups":[{"name":"g","rules":[{"alert":"A","expr":"up == 0","for":"1m","labels":{"severity":"warning"}}]}]}}`,
	} {
		if err := (&monitoringManifests{}).add(crds, map[string]bool{}, []byte(good)); err != nil {
			t.Errorf("refused %s: %v", good, err)
		}
	}
}

// scrape is what one ServiceMonitor endpoint makes of one Service: a scrape of its pods,
// under a job name.
type scrape struct {
	Job, Path, Params, Interval string
}

func (s scrape) String() string {
	return fmt.Sprintf("job %q %s%s every %s", s.Job, s.Path, s.Params, s.Interval)
}

// prometheusScrapes are the jobs of deploy/prometheus/prometheus.yml as scrapes, by job name,
// but for the cluster profile's (found through Docker's DNS).
func prometheusScrapes(t *testing.T) map[string]scrape {
	t.Helper()
	var cfg prometheusConfig
	readYAML(t, "deploy/prometheus/prometheus.yml", &cfg)
	var global struct {
		Global struct {
			ScrapeInterval string `yaml:"scrape_interval"`
		} `yaml:"global"`
	}
	readYAML(t, "deploy/prometheus/prometheus.yml", &global)
	out := map[string]scrape{}
	for _, sc := range cfg.ScrapeConfigs {
		if len(sc.DNSSDConfigs) != 0 {
			continue // compose's cluster profile, which Kubernetes has no copy of
		}
		p := sc.MetricsPath
		if p == "" {
			p = "/metrics"
		}
		out[sc.JobName] = scrape{Job: sc.JobName, Path: p, Params: encodeParams(sc.Params), Interval: global.Global.ScrapeInterval}
	}
	return out
}

// encodeParams writes params as a query, in a stable order ("" for none).
func encodeParams(params map[string][]string) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(params)) {
		for _, v := range params[k] {
			parts = append(parts, k+"="+v)
		}
	}
	if len(parts) == 0 {
		return ""
	}
	return "?" + strings.Join(parts, "&")
}

// k8sService is the part of a Service a ServiceMonitor looks at.
type k8sService struct {
	name   string
	labels map[string]string
	ports  []string // port names
}

// scrapesOf lists what the ServiceMonitors make of svc, as the Prometheus Operator (v0.93.0,
// pkg/prometheus/promcfg.go) generates it: an endpoint applies to a Service its selector
// matches and that has a port of the endpoint's port name; the job is the Service's name, or
// the value of its jobLabel label when it has one, and then the endpoint's relabelings apply.
// selectedBy names the ServiceMonitors whose selector matches svc, whether or not one of their
// endpoints names a port it has (the headless Service of RabbitMQ is selected, and has none).
func scrapesOf(t *testing.T, monitors []serviceMonitor, svc k8sService) (out []scrape, selectedBy []string) {
	t.Helper()
	for _, sm := range monitors {
		sel, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
		if err != nil {
			t.Errorf("ServiceMonitor %s: selector: %v", sm.Metadata.Name, err)
			continue
		}
		if !sel.Matches(labels.Set(svc.labels)) {
			continue
		}
		selectedBy = append(selectedBy, sm.Metadata.Name)
		for i, ep := range sm.Spec.Endpoints {
			if ep.Port == "" {
				t.Errorf("ServiceMonitor %s endpoint %d: no port, want the name of the Service's port (targetPort %v bypasses the Service's ports)", sm.Metadata.Name, i, ep.TargetPort)
				continue
			}
			if !slices.Contains(svc.ports, ep.Port) {
				continue
			}
			job := svc.name
			if v := svc.labels[sm.Spec.JobLabel]; sm.Spec.JobLabel != "" && v != "" {
				job = v
			}
			target := map[string]string{"job": job, "__meta_kubernetes_service_name": svc.name}
			for k, v := range svc.labels {
				target["__meta_kubernetes_service_label_"+sanitizeLabelName(k)] = v
			}
			for _, rc := range ep.Relabelings {
				if err := relabel(target, rc); err != nil {
					t.Errorf("ServiceMonitor %s endpoint %d: %v", sm.Metadata.Name, i, err)
				}
			}
			p := ep.Path
			if p == "" {
				p = "/metrics"
			}
			out = append(out, scrape{Job: target["job"], Path: p, Params: encodeParams(ep.Params), Interval: ep.Interval})
		}
	}
	slices.SortFunc(out, func(a, b scrape) int { return strings.Compare(a.String(), b.String()) })
	return out, selectedBy
}

var invalidLabelChars = regexp.MustCompile(`[^a-zA-Z0-9_]`)

func sanitizeLabelName(name string) string { return invalidLabelChars.ReplaceAllString(name, "_") }

// relabel applies one relabeling of the replace action, as Prometheus does; the other actions
// are refused, as this test does not model them.
func relabel(target map[string]string, rc relabeling) error {
	if rc.Action != "" && !strings.EqualFold(rc.Action, "replace") {
		return fmt.Errorf("relabeling action %s: this test evaluates replace alone", rc.Action)
	}
	if strings.Contains(rc.TargetLabel, "$") || rc.TargetLabel == "" {
		return fmt.Errorf("relabeling targetLabel %q: want a plain label name", rc.TargetLabel)
	}
	sep, expr, repl := ";", "(.*)", "$1"
	if rc.Separator != nil {
		sep = *rc.Separator
	}
	if rc.Regex != "" {
		expr = rc.Regex
	}
	if rc.Replacement != nil {
		repl = *rc.Replacement
	}
	re, err := regexp.Compile("^(?s:" + expr + ")$")
	if err != nil {
		return fmt.Errorf("relabeling regex %q: %w", rc.Regex, err)
	}
	var values []string
	for _, l := range rc.SourceLabels {
		values = append(values, target[l])
	}
	value := strings.Join(values, sep)
	idx := re.FindStringSubmatchIndex(value)
	if idx == nil {
		return nil
	}
	if res := string(re.ExpandString(nil, repl, value, idx)); res == "" {
		delete(target, rc.TargetLabel)
	} else {
		target[rc.TargetLabel] = res
	}
	return nil
}

// Each service's Service is scraped exactly as prometheus.yml scrapes the service, under the
// job name alerts.yml's rules group by: the service's name.
func TestK8sMonitoringServices(t *testing.T) {
	t.Parallel()
	m, base := monitoring(t), k8s(t)
	want := prometheusScrapes(t)
	for _, a := range apps {
		svc, ok := base.services[a.name]
		if !ok {
			t.Errorf("the base has no Service %s", a.name)
			continue
		}
		var ports []string
		for _, p := range svc.Spec.Ports {
			ports = append(ports, p.Name)
		}
		w, ok := want[a.name]
		if !ok {
			t.Errorf("prometheus.yml has no job %s", a.name)
			continue
		}
		got, by := scrapesOf(t, m.monitors, k8sService{name: svc.Name, labels: svc.Labels, ports: ports})
		if len(got) != 1 || got[0] != w {
			t.Errorf("Service %s (labels %v, ports %v), selected by ServiceMonitors %v, is scraped as %v; want once, as prometheus.yml's %v",
				a.name, svc.Labels, ports, by, got, w)
		}
	}
}

// No relabeling of a ServiceMonitor reads a pod's state. Prometheus gives an endpoints or
// endpointslice target the meta labels of its pod as the pod was when it last built the target
// group, which it rebuilds on a change to the Endpoints or EndpointSlice (with the endpoints
// role also on a change to the pod since v2.51.0; with endpointslice never). A pod is an
// endpoint, not ready, from when it has an IP, before its containers start; when it moves on to
// Running and stays not ready (waiting for its database, stuck in its start) the slice does not
// change, and its __meta_kubernetes_pod_phase still reads Pending. A drop of Pending pods (so
// that order's, in its init container waiting for the topology, reads no up == 0) would leave
// such a pod unscraped, with no up series: ServiceDown and ServiceNotReady silent for it, and,
// with other replicas running, ServiceNotRunning too. Of a pod's meta labels only its name, uid
// and node, which it keeps for life, may be read; the endpoint's conditions come from the slice
// itself, and are current.
func TestK8sMonitoringReadsNoPodState(t *testing.T) {
	t.Parallel()
	for _, sm := range monitoring(t).monitors {
		for i, ep := range sm.Spec.Endpoints {
			for _, rc := range ep.Relabelings {
				for _, l := range rc.SourceLabels {
					if podState(l) {
						t.Errorf("ServiceMonitor %s endpoint %d: relabeling %+v reads %s, which Prometheus does not refresh when the pod changes (a pod Running for long may still read as it was when its endpoint appeared)",
							sm.Metadata.Name, i, rc, l)
					}
				}
			}
		}
	}
}

// podState reports whether a meta label is a pod's, other than its name, uid and node.
func podState(label string) bool {
	const pod = "__meta_kubernetes_pod_"
	return strings.HasPrefix(label, pod) && !slices.Contains([]string{"name", "uid", "node_name"}, strings.TrimPrefix(label, pod))
}

// The Service the RabbitMQ Cluster Operator makes for the base's RabbitmqCluster is scraped as
// prometheus.yml's rabbitmq and rabbitmq-queues jobs scrape the broker; its headless Service
// is not scraped.
func TestK8sMonitoringRabbitMQ(t *testing.T) {
	t.Parallel()
	m, base := monitoring(t), k8s(t)
	svc, headless := operatorRabbitServices(t, base)
	want := prometheusScrapes(t)
	var w []scrape
	for _, job := range []string{"rabbitmq", "rabbitmq-queues"} {
		s, ok := want[job]
		if !ok {
			t.Fatalf("prometheus.yml has no job %s", job)
		}
		w = append(w, s)
	}
	slices.SortFunc(w, func(a, b scrape) int { return strings.Compare(a.String(), b.String()) })
	if got, by := scrapesOf(t, m.monitors, svc); !slices.Equal(got, w) {
		t.Errorf("the operator's Service %s (labels %v, ports %v), selected by ServiceMonitors %v, is scraped as %v; want as prometheus.yml's %v",
			svc.name, svc.labels, svc.ports, by, got, w)
	}
	if got, _ := scrapesOf(t, m.monitors, headless); len(got) > 0 {
		t.Errorf("the headless Service %s is scraped as %v; want not at all (each node would count twice)", headless.name, got)
	}
}

// Every job of prometheus.yml but Prometheus's own has its scrape in Kubernetes, so every
// rule of alerts.yml has its series.
func TestK8sMonitoringCoversEveryJob(t *testing.T) {
	t.Parallel()
	m := monitoring(t)
	jobs := map[string]bool{}
	for _, s := range monitoredServices(t) {
		got, _ := scrapesOf(t, m.monitors, s)
		for _, sc := range got {
			jobs[sc.Job] = true
		}
	}
	for job := range prometheusScrapes(t) {
		// Prometheus scraping itself is the Prometheus Operator's setup, not this project's.
		if job != "prometheus" && !jobs[job] {
			t.Errorf("prometheus.yml's job %q has no ServiceMonitor scrape in deploy/k8s/monitoring", job)
		}
		delete(jobs, job)
	}
	for job := range jobs {
		t.Errorf("deploy/k8s/monitoring scrapes job %q, which prometheus.yml does not have", job)
	}
}

// monitoredServices are the Services a ServiceMonitor may scrape: the one the RabbitMQ Cluster
// Operator makes for the base's RabbitmqCluster, first, then the base's own.
func monitoredServices(t *testing.T) []k8sService {
	t.Helper()
	base := k8s(t)
	svc, _ := operatorRabbitServices(t, base)
	services := []k8sService{svc}
	for _, s := range base.services {
		var ports []string
		for _, p := range s.Spec.Ports {
			ports = append(ports, p.Name)
		}
		services = append(services, k8sService{name: s.Name, labels: s.Labels, ports: ports})
	}
	return services
}

// operatorRabbitServices are the Services the RabbitMQ Cluster Operator (v2.22.3,
// internal/resource/service.go and headless_service.go, internal/metadata/label.go) makes for
// the base's RabbitmqCluster: one named after it with the client and metrics ports, and the
// headless <name>-nodes for clustering, both labelled app.kubernetes.io/name: <name>,
// app.kubernetes.io/component: rabbitmq, app.kubernetes.io/part-of: rabbitmq, plus the
// cluster's own labels outside app.kubernetes.io/ and then spec.service.labels.
func operatorRabbitServices(t *testing.T, base *k8sManifests) (svc, headless k8sService) {
	t.Helper()
	if len(base.rabbits) != 1 {
		t.Fatalf("want one RabbitmqCluster in the base, have %d", len(base.rabbits))
	}
	name := base.rabbits[0].Metadata.Name
	var cluster struct {
		Metadata metav1.ObjectMeta `json:"metadata"`
		Spec     struct {
			TLS struct {
				SecretName string `json:"secretName"`
			} `json:"tls"`
			Service struct {
				Labels map[string]string `json:"labels"`
			} `json:"service"`
			Override struct {
				Service json.RawMessage `json:"service"`
			} `json:"override"`
		} `json:"spec"`
	}
	found := false
	for _, file := range base.kust.Resources {
		docs, err := yamlDocuments(filepath.Join(k8sDir, file))
		if err != nil {
			t.Fatal(err)
		}
		for _, doc := range docs {
			var head struct {
				Kind     string `json:"kind"`
				Metadata struct {
					Name string `json:"name"`
				} `json:"metadata"`
			}
			if err := json.Unmarshal(doc, &head); err != nil {
				t.Fatal(err)
			}
			if head.Kind == "RabbitmqCluster" && head.Metadata.Name == name {
				if err := json.Unmarshal(doc, &cluster); err != nil {
					t.Fatal(err)
				}
				found = true
			}
		}
	}
	if !found {
		t.Fatalf("RabbitmqCluster %s: not found in the base's files", name)
	}
	if cluster.Spec.TLS.SecretName != "" {
		t.Fatalf("RabbitmqCluster %s has TLS: the operator's Service then has port prometheus-tls (15691), not prometheus; update rabbitmq.yaml of deploy/k8s/monitoring and this test", name)
	}
	if len(cluster.Spec.Override.Service) > 0 {
		t.Fatalf("RabbitmqCluster %s overrides its Service: this test cannot tell its labels and ports", name)
	}
	lbls := map[string]string{
		"app.kubernetes.io/name":      name,
		"app.kubernetes.io/component": "rabbitmq",
		"app.kubernetes.io/part-of":   "rabbitmq",
	}
	for k, v := range cluster.Metadata.Labels {
		if !strings.HasPrefix(k, "app.kubernetes.io") {
			lbls[k] = v
		}
	}
	headlessLabels := maps.Clone(lbls)
	for k, v := range cluster.Spec.Service.Labels {
		if _, ok := lbls[k]; !ok {
			lbls[k] = v
		}
	}
	return k8sService{name: name, labels: lbls, ports: []string{"amqp", "management", "prometheus"}},
		k8sService{name: name + "-nodes", labels: headlessLabels, ports: []string{"epmd", "cluster-rpc"}}
}

// k8sOnlyGroups are the PrometheusRule's groups after alerts.yml's, in order: alerts only a
// cluster can have (kube-state-metrics' series), tested by TestK8sOnlyAlerts.
var k8sOnlyGroups = []string{"kubernetes"}

// The PrometheusRule's groups are alerts.yml's, exactly, then k8sOnlyGroups.
func TestK8sMonitoringPrometheusRule(t *testing.T) {
	t.Parallel()
	m := monitoring(t)
	if len(m.rules) != 1 {
		t.Fatalf("want one PrometheusRule, have %d", len(m.rules))
	}
	raw, err := os.ReadFile(filepath.Join(root, "deploy", "prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	js, err := yaml.YAMLToJSONStrict(raw)
	if err != nil {
		t.Fatalf("alerts.yml: %v", err)
	}
	var alerts map[string]any
	if err := json.Unmarshal(js, &alerts); err != nil {
		t.Fatalf("alerts.yml: %v", err)
	}
	groups, _ := m.rules[0].Spec.Groups.([]any)
	want, _ := alerts["groups"].([]any)
	if len(want) == 0 {
		t.Fatal("alerts.yml has no groups")
	}
	got := groups[:min(len(groups), len(want))]
	var extra []string
	for _, g := range groups[len(got):] {
		name, _ := g.(map[string]any)["name"].(string)
		extra = append(extra, name)
	}
	if !slices.Equal(extra, k8sOnlyGroups) {
		t.Errorf("PrometheusRule %s: the groups after alerts.yml's are %q, want %q", m.rules[0].Metadata.Name, extra, k8sOnlyGroups)
	}
	if !reflect.DeepEqual(got, want) {
		var diffs []string
		valueDiff("groups", got, want, &diffs)
		t.Errorf("PrometheusRule %s: spec.groups differ from alerts.yml's groups (copy them again):\n%s",
			m.rules[0].Metadata.Name, strings.Join(diffs, "\n"))
	}
}

// valueDiff lists where got and want (generic JSON values) differ, up to 20 places, naming list
// elements by their name or alert when they have one.
func valueDiff(at string, got, want any, out *[]string) {
	const limit = 20
	if len(*out) >= limit {
		return
	}
	switch w := want.(type) {
	case map[string]any:
		g, ok := got.(map[string]any)
		if !ok {
			break
		}
		keys := slices.Collect(maps.Keys(w))
		for k := range g {
			if _, ok := w[k]; !ok {
				keys = append(keys, k)
			}
		}
		slices.Sort(keys)
		for _, k := range keys {
			gv, gok := g[k]
			wv, wok := w[k]
			switch {
			case !gok:
				*out = append(*out, fmt.Sprintf("  %s.%s: missing; alerts.yml has %s", at, k, short(wv)))
			case !wok:
				*out = append(*out, fmt.Sprintf("  %s.%s: %s, which alerts.yml does not have", at, k, short(gv)))
			default:
				valueDiff(at+"."+k, gv, wv, out)
			}
		}
		return
	case []any:
		g, ok := got.([]any)
		if !ok {
			break
		}
		for i := range max(len(g), len(w)) {
			switch {
			case i >= len(g):
				*out = append(*out, fmt.Sprintf("  %s: missing; alerts.yml has %s", element(at, i, w[i]), short(w[i])))
			case i >= len(w):
				*out = append(*out, fmt.Sprintf("  %s: %s, which alerts.yml does not have", element(at, i, g[i]), short(g[i])))
			default:
				valueDiff(element(at, i, w[i]), g[i], w[i], out)
			}
		}
		return
	default:
		if reflect.DeepEqual(got, want) {
			return
		}
	}
	*out = append(*out, fmt.Sprintf("  %s: %s, alerts.yml has %s", at, short(got), short(want)))
}

func element(at string, i int, v any) string {
	if o, ok := v.(map[string]any); ok {
		for _, k := range []string{"alert", "record", "name"} {
			if s, ok := o[k].(string); ok {
				return fmt.Sprintf("%s[%d](%s)", at, i, s)
			}
		}
	}
	return fmt.Sprintf("%s[%d]", at, i)
}

func short(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	if len(b) > 160 {
		return string(b[:160]) + "…"
	}
	return string(b)
}
