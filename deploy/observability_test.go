package deploy_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/types"
)

// observabilityProfile is the compose profile of Prometheus, Grafana and Jaeger: nothing of
// it starts with a plain `docker compose up`.
const observabilityProfile = "observability"

// libraryVars are variables docker-compose.yml and deploy/k8s may give the services although
// no Env call in services/ or internal/platform reads them: the OpenTelemetry SDK reads them
// itself. They are those the OTLP/HTTP trace exporter (otlptracehttp's otlpconfig) and the
// batch span processor read, as docs/configuration.md tells operators; not ignoredOTELVars.
var libraryVars = []string{
	"OTEL_EXPORTER_OTLP_ENDPOINT",
	"OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
	"OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
	"OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
	"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
	"OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
	"OTEL_EXPORTER_OTLP_CERTIFICATE", "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
	"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
	"OTEL_EXPORTER_OTLP_CLIENT_KEY", "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
	"OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
}

// refusedVars are variables a service reads only to refuse them at start: a deployment that
// set one would not start.
var refusedVars = []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"}

// runtimeVars are the Go runtime's variables a deployment may set.
var runtimeVars = []string{"GOMEMLIMIT"}

// settable is what a deployment may give service svc: what it reads, its libraries and the Go
// runtime read, less refusedVars.
func settable(t *testing.T, svc string) []string {
	t.Helper()
	return slices.DeleteFunc(slices.Concat(readVars(t, svc), libraryVars, runtimeVars), func(v string) bool { return slices.Contains(refusedVars, v) })
}

// ignoredOTELVars are standard OpenTelemetry variables that internal/platform/tracing.go
// overrides (the service's name, the sampler, the propagators): set, they would be ignored
// without a word, so the deployments may not set them; docs/configuration.md names them as such.
var ignoredOTELVars = []string{"OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_PROPAGATORS"}

// The observability profile's services, their images (each pinned to a release) and the
// ports they publish, each with the variable that moves it.
var observabilityServices = []struct {
	name  string
	image *regexp.Regexp
	ports []publishedPort
}{
	{"prometheus", regexp.MustCompile(`^prom/prometheus:v3\.\d+\.\d+$`), []publishedPort{{9090, "PROMETHEUS_PORT"}}},
	{"grafana", regexp.MustCompile(`^grafana/grafana:\d+\.\d+\.\d+$`), []publishedPort{{3000, "GRAFANA_PORT"}}},
	{"jaeger", regexp.MustCompile(`^jaegertracing/jaeger:2\.\d+\.\d+$`), []publishedPort{{16686, "JAEGER_UI_PORT"}, {4317, "OTLP_GRPC_PORT"}, {4318, "OTLP_HTTP_PORT"}}},
}

type publishedPort struct {
	port     uint32
	variable string
}

func loadObservability(t *testing.T, env ...string) *types.Project {
	t.Helper()
	return loadComposeProfiles(t, "docker-compose.yml", env, observabilityProfile)
}

// bindMounts maps each bind mount's target in s to its source, and checks that the source
// exists in the repository and is mounted read-only.
func bindMounts(t *testing.T, s types.ServiceConfig) map[string]string {
	t.Helper()
	abs, _ := filepath.Abs(root)
	mounts := map[string]string{}
	for _, v := range s.Volumes {
		if v.Type != types.VolumeTypeBind {
			continue
		}
		rel, err := filepath.Rel(abs, v.Source)
		if err != nil || strings.HasPrefix(rel, "..") {
			t.Errorf("%s: mounts %s from outside the repository", s.Name, v.Source)
		}
		if _, err := os.Stat(v.Source); err != nil {
			t.Errorf("%s: mounts %s, which does not exist: %v", s.Name, rel, err)
		}
		if !v.ReadOnly {
			t.Errorf("%s: mounts %s read-write, want :ro", s.Name, rel)
		}
		mounts[v.Target] = v.Source
	}
	return mounts
}

// mountedAt returns the container path where the repository's file or folder rel is
// mounted in s.
func mountedAt(t *testing.T, s types.ServiceConfig, rel string) string {
	t.Helper()
	want, _ := filepath.Abs(filepath.Join(root, rel))
	for target, source := range bindMounts(t, s) {
		if source == want {
			return target
		}
	}
	t.Fatalf("%s does not mount %s", s.Name, rel)
	return ""
}

// The plain `docker compose up` runs what it always ran; --profile observability adds the
// three services, each pinned, restarted, healthchecked (TestComposeEveryContainerHasAHealthcheck)
// and configured from files of this repository.
func TestComposeObservabilityProfile(t *testing.T) {
	t.Parallel()
	plain := loadProject(t)
	for _, o := range observabilityServices {
		if _, ok := plain.Services[o.name]; ok {
			t.Errorf("%s runs without the %s profile", o.name, observabilityProfile)
		}
		if s, ok := plain.DisabledServices[o.name]; !ok || !slices.Equal(s.Profiles, []string{observabilityProfile}) {
			t.Errorf("%s: profiles %v, want [%s]", o.name, s.Profiles, observabilityProfile)
		}
	}
	for name, s := range plain.Services {
		if len(s.Profiles) > 0 {
			t.Errorf("%s has profiles %v: it would not start with a plain docker compose up", name, s.Profiles)
		}
	}

	p := loadObservability(t)
	if got, want := len(p.Services), len(plain.Services)+len(observabilityServices); got != want {
		t.Errorf("with the profile, %d services run, want %d", got, want)
	}
	for _, o := range observabilityServices {
		s := service(t, p, o.name)
		if !o.image.MatchString(s.Image) {
			t.Errorf("%s: image %q, want one matching %s", o.name, s.Image, o.image)
		}
		if s.Restart == "" || s.Restart == types.RestartPolicyNo {
			t.Errorf("%s: restart = %q, want a restart policy", o.name, s.Restart)
		}
		bindMounts(t, s)
	}

	// The rules are checked with the promtool of the Prometheus release the container runs.
	script, err := os.ReadFile(filepath.Join(root, "scripts", "test.sh"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^PROMTOOL_VERSION=0\.3(\d\d)\.(\d+)$`).FindSubmatch(script)
	if m == nil {
		t.Fatal("scripts/test.sh sets no PROMTOOL_VERSION=0.3XX.Y (Prometheus 3.XX.Y's Go module version)")
	}
	minor, _ := strconv.Atoi(string(m[1]))
	if want := fmt.Sprintf("prom/prometheus:v3.%d.%s", minor, m[2]); service(t, p, "prometheus").Image != want {
		t.Errorf("prometheus image %q, want %s, the release of scripts/test.sh's promtool (PROMTOOL_VERSION=0.3%s.%s)",
			service(t, p, "prometheus").Image, want, m[1], m[2])
	}
}

// Like the others, the profile's ports are published on 127.0.0.1 only and move with a
// variable each.
func TestComposeObservabilityPorts(t *testing.T) {
	t.Parallel()
	p := loadObservability(t)
	var env []string
	moved := map[string]uint32{}
	for i, o := range observabilityServices {
		s := service(t, p, o.name)
		if len(s.Ports) != len(o.ports) {
			t.Errorf("%s: publishes %d ports (%+v), want %d", o.name, len(s.Ports), s.Ports, len(o.ports))
		}
		for _, port := range s.Ports {
			if port.HostIP != "127.0.0.1" {
				t.Errorf("%s: port %d is published on %q, want 127.0.0.1 only", o.name, port.Target, port.HostIP)
			}
		}
		for j, pp := range o.ports {
			if !publishes(s, pp.port, pp.port) {
				t.Errorf("%s: ports = %+v, want 127.0.0.1:%d:%d with %s unset", o.name, s.Ports, pp.port, pp.port, pp.variable)
			}
			moved[pp.variable] = uint32(21000 + 10*i + j)
			env = append(env, fmt.Sprintf("%s=%d", pp.variable, moved[pp.variable]))
		}
	}
	// None of them takes a port the default services publish.
	for _, pp := range publishedPorts {
		for _, o := range observabilityServices {
			for _, op := range o.ports {
				if op.port == pp.port {
					t.Errorf("%s publishes %d, which %s publishes already", o.name, op.port, pp.service)
				}
			}
		}
	}
	p = loadObservability(t, env...)
	for _, o := range observabilityServices {
		for _, pp := range o.ports {
			if s := service(t, p, o.name); !publishes(s, pp.port, moved[pp.variable]) {
				t.Errorf("%s: with %s=%d, ports = %+v, want 127.0.0.1:%d:%d", o.name, pp.variable, moved[pp.variable], s.Ports, moved[pp.variable], pp.port)
			}
		}
	}
}

// The services export traces only when OTEL_EXPORTER_OTLP_ENDPOINT is set where compose runs;
// set to http://jaeger:4318, it reaches Jaeger's OTLP/HTTP port on the compose network.
func TestComposeOTLPEndpoint(t *testing.T) {
	t.Parallel()
	for _, a := range apps {
		if v, ok := env(service(t, loadProject(t), a.name), "OTEL_EXPORTER_OTLP_ENDPOINT"); v != "" {
			t.Errorf("%s: OTEL_EXPORTER_OTLP_ENDPOINT = %q (set %v) without the variable, want empty", a.name, v, ok)
		}
	}
	const endpoint = "http://jaeger:4318"
	p := loadObservability(t, "OTEL_EXPORTER_OTLP_ENDPOINT="+endpoint)
	for _, a := range apps {
		if v, _ := env(service(t, p, a.name), "OTEL_EXPORTER_OTLP_ENDPOINT"); v != endpoint {
			t.Errorf("%s: OTEL_EXPORTER_OTLP_ENDPOINT = %q with the variable set to %s", a.name, v, endpoint)
		}
	}
	u, _ := url.Parse(endpoint)
	port, _ := strconv.Atoi(u.Port())
	if !slices.ContainsFunc(service(t, p, u.Hostname()).Ports, func(pc types.ServicePortConfig) bool { return pc.Target == uint32(port) }) {
		t.Errorf("%s: the jaeger service has no OTLP/HTTP port %d", endpoint, port)
	}
}

// prometheusConfig is the part of prometheus.yml this project writes.
type prometheusConfig struct {
	RuleFiles     []string `yaml:"rule_files"`
	ScrapeConfigs []struct {
		JobName       string              `yaml:"job_name"`
		MetricsPath   string              `yaml:"metrics_path"`
		Params        map[string][]string `yaml:"params"`
		StaticConfigs []struct {
			Targets []string `yaml:"targets"`
		} `yaml:"static_configs"`
		DNSSDConfigs []struct {
			Names []string `yaml:"names"`
			Type  string   `yaml:"type"`
			Port  int      `yaml:"port"`
		} `yaml:"dns_sd_configs"`
		RelabelConfigs []relabeling `yaml:"relabel_configs"`
	} `yaml:"scrape_configs"`
}

// promTarget is one target of prometheus.yml as Prometheus makes it.
type promTarget struct {
	jobName string            // its scrape config's job_name
	host    string            // the static target's host, or the DNS name queried
	path    string            // its metrics_path
	labels  map[string]string // after relabel_configs
}

// prometheusTargets makes prometheus.yml's targets as Prometheus does: each starts with job
// (the job_name), __address__, __metrics_path__ and a __param_<name> per param; a DNS one with
// __meta_dns_name, the name queried, and as __address__ the address its A record answers,
// made up here (10.0.<config>.<name>:port). Then its relabel_configs apply in order (with
// relabel, as the ServiceMonitors' relabelings do), and an instance left unset is __address__.
func prometheusTargets(t *testing.T, cfg prometheusConfig) []promTarget {
	t.Helper()
	var out []promTarget
	for i, sc := range cfg.ScrapeConfigs {
		mp := sc.MetricsPath
		if mp == "" {
			mp = "/metrics"
		}
		base := map[string]string{"job": sc.JobName, "__metrics_path__": mp, "__scheme__": "http"}
		for k, v := range sc.Params {
			if len(v) > 0 {
				base["__param_"+k] = v[0]
			}
		}
		var targets []promTarget
		for _, st := range sc.StaticConfigs {
			for _, addr := range st.Targets {
				host, _, _ := strings.Cut(addr, ":")
				labels := maps.Clone(base)
				labels["__address__"] = addr
				targets = append(targets, promTarget{host: host, labels: labels})
			}
		}
		for _, sd := range sc.DNSSDConfigs {
			for j, name := range sd.Names {
				labels := maps.Clone(base)
				labels["__address__"] = fmt.Sprintf("10.0.%d.%d:%d", i, j+1, sd.Port)
				labels["__meta_dns_name"] = name
				targets = append(targets, promTarget{host: name, labels: labels})
			}
		}
		for _, tg := range targets {
			for _, rc := range sc.RelabelConfigs {
				if err := relabel(tg.labels, rc); err != nil {
					t.Errorf("prometheus.yml job %s: %v", sc.JobName, err)
				}
			}
			if tg.labels["instance"] == "" {
				tg.labels["instance"] = tg.labels["__address__"]
			}
			tg.jobName, tg.path = sc.JobName, mp
			out = append(out, tg)
		}
	}
	return out
}

// Prometheus loads deploy/prometheus/prometheus.yml and the rules beside it, and scrapes each
// service where it listens and RabbitMQ's plugin, the per-queue depths included; and, under
// jobs of their own, the cluster profile's copy. (`promtool check config` in scripts/test.sh
// checks the file's syntax and the rules.)
func TestPrometheusConfig(t *testing.T) {
	t.Parallel()
	p := loadObservability(t)
	prom := service(t, p, "prometheus")
	configAt := mountedAt(t, prom, "deploy/prometheus/prometheus.yml")
	if !slices.Contains(prom.Command, "--config.file="+configAt) {
		t.Errorf("prometheus: command %q, want --config.file=%s", prom.Command, configAt)
	}
	var cfg prometheusConfig
	readYAML(t, "deploy/prometheus/prometheus.yml", &cfg)
	if want := path.Join(path.Dir(configAt), "alerts.yml"); !slices.ContainsFunc(cfg.RuleFiles, func(f string) bool {
		return f == want || path.Join(path.Dir(configAt), f) == want
	}) || mountedAt(t, prom, "deploy/prometheus/alerts.yml") != want {
		t.Errorf("prometheus.yml rule_files %v, or the mounts, do not load deploy/prometheus/alerts.yml at %s", cfg.RuleFiles, want)
	}

	// job -> "path?family how target,target": how is static or dns.
	jobs := map[string]string{}
	for _, sc := range cfg.ScrapeConfigs {
		how, targets := "static", []string{}
		for _, st := range sc.StaticConfigs {
			targets = append(targets, st.Targets...)
		}
		for _, sd := range sc.DNSSDConfigs {
			how = "dns"
			if sd.Type != "A" || len(sc.StaticConfigs) != 0 {
				t.Errorf("prometheus.yml job %s: dns_sd_configs of type %q beside %d static configs, want type A alone (Docker's DNS answers a name with its replicas' addresses)", sc.JobName, sd.Type, len(sc.StaticConfigs))
			}
			for _, name := range sd.Names {
				targets = append(targets, fmt.Sprintf("%s:%d", name, sd.Port))
			}
		}
		mp := sc.MetricsPath
		if mp == "" {
			mp = "/metrics"
		}
		jobs[sc.JobName] = fmt.Sprintf("%s?%s %s %s", mp, strings.Join(sc.Params["family"], ","), how, strings.Join(targets, ","))
	}
	const queues = "/metrics/detailed?queue_coarse_metrics,queue_consumer_count"
	var nodes []string
	for _, n := range clusterNodes {
		nodes = append(nodes, n+":15692")
	}
	// The default stack's targets are static: one that does not answer is down. The cluster
	// profile's come from DNS, under jobs named after its services, so that the default stack
	// alone has no target down and no alert sums the two copies' queues of the same names.
	want := map[string]string{
		"rabbitmq":                "/metrics? static rabbitmq:15692",
		"rabbitmq-queues":         queues + " static rabbitmq:15692",
		"rabbitmq-cluster":        "/metrics? dns " + strings.Join(nodes, ","),
		"rabbitmq-cluster-queues": queues + " dns " + strings.Join(nodes, ","),
		"prometheus":              "/metrics? static 127.0.0.1:9090",
	}
	for _, a := range apps {
		// The job is named after the service: the alerts and the dashboard say job="order".
		want[a.name] = fmt.Sprintf("/metrics? static %s:%d", a.name, a.port)
		want[clusterService(a)] = fmt.Sprintf("/metrics? dns %s:%d", clusterService(a), a.port)
	}
	for job, w := range want {
		if jobs[job] != w {
			t.Errorf("prometheus.yml job %q scrapes %q, want %q", job, jobs[job], w)
		}
	}
	// After relabel_configs, each target has the labels job and instance alone: job is its
	// job_name (the alerts and the dashboard tell the jobs apart by it), and instance the address
	// it scrapes, but for the cluster's RabbitMQ nodes: their name (rabbitmq-1:15692), which
	// their alarms and the queues they lead are reported under, where Docker's address would
	// change with every new container.
	nodeNamed := map[string]bool{"rabbitmq-cluster": true, "rabbitmq-cluster-queues": true}
	for _, tg := range prometheusTargets(t, cfg) {
		instance := tg.labels["__address__"]
		if nodeNamed[tg.jobName] {
			instance = tg.host + ":15692"
		}
		want := map[string]string{"job": tg.jobName, "instance": instance}
		got := maps.Clone(tg.labels)
		maps.DeleteFunc(got, func(k, _ string) bool { return strings.HasPrefix(k, "__") })
		if !maps.Equal(got, want) {
			t.Errorf("prometheus.yml job %s, target %s: labels %v after relabel_configs, want %v", tg.jobName, tg.labels["__address__"], got, want)
		}
	}
	// Each target is a compose service, of either profile, on the port it listens on.
	both := loadComposeProfiles(t, "docker-compose.yml", nil, observabilityProfile, clusterProfile)
	for job, scrape := range jobs {
		if _, ok := want[job]; !ok {
			t.Errorf("prometheus.yml has a job %s this test does not know", job)
		}
		targets := strings.Fields(scrape)[2:]
		if len(targets) == 0 {
			t.Errorf("prometheus.yml job %s has no target", job)
			continue
		}
		for target := range strings.SplitSeq(targets[0], ",") {
			host, _, _ := strings.Cut(target, ":")
			if _, ok := both.Services[host]; !ok && host != "127.0.0.1" && host != "localhost" {
				t.Errorf("prometheus.yml job %s scrapes %s, which is no compose service", job, target)
			}
		}
	}
}

// Grafana's provisioned data source is the compose Prometheus, and its dashboard provider
// reads the folder docker-compose.yml mounts.
func TestGrafanaProvisioning(t *testing.T) {
	t.Parallel()
	p := loadObservability(t)
	grafana := service(t, p, "grafana")
	if d, ok := grafana.DependsOn["prometheus"]; !ok || d.Condition != types.ServiceConditionHealthy {
		t.Errorf("grafana: depends_on prometheus %+v, want service_healthy", d)
	}
	var ds struct {
		Datasources []struct {
			Name, UID, Type, URL string
			IsDefault            bool `yaml:"isDefault"`
		} `yaml:"datasources"`
	}
	readYAML(t, "deploy/grafana/provisioning/datasources/prometheus.yml", &ds)
	if len(ds.Datasources) != 1 {
		t.Fatalf("%d data sources provisioned, want 1", len(ds.Datasources))
	}
	src := ds.Datasources[0]
	if src.Type != "prometheus" || src.UID != dashboardDatasourceUID || !src.IsDefault || src.URL != "http://prometheus:9090" {
		t.Errorf("data source %+v, want the default, type prometheus, uid %s, url http://prometheus:9090", src, dashboardDatasourceUID)
	}
	if !slices.ContainsFunc(service(t, p, "prometheus").Ports, func(pc types.ServicePortConfig) bool { return pc.Target == 9090 }) {
		t.Error("the prometheus service does not listen on 9090")
	}
	if at := mountedAt(t, grafana, "deploy/grafana/provisioning/datasources"); at != "/etc/grafana/provisioning/datasources" {
		t.Errorf("grafana: data sources mounted at %s", at)
	}
	if at := mountedAt(t, grafana, "deploy/grafana/provisioning/dashboards"); at != "/etc/grafana/provisioning/dashboards" {
		t.Errorf("grafana: dashboard providers mounted at %s", at)
	}

	var providers struct {
		Providers []struct {
			Type    string
			Options struct{ Path string }
		} `yaml:"providers"`
	}
	readYAML(t, "deploy/grafana/provisioning/dashboards/outbox-inbox.yml", &providers)
	dashboards := mountedAt(t, grafana, "deploy/grafana/dashboards")
	if len(providers.Providers) != 1 || providers.Providers[0].Type != "file" || providers.Providers[0].Options.Path != dashboards {
		t.Errorf("dashboard providers %+v, want one of type file reading %s", providers.Providers, dashboards)
	}
	if home, _ := env(grafana, "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"); home != path.Join(dashboards, "outbox-inbox.json") {
		t.Errorf("grafana: GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH = %q, want the dashboard", home)
	}
}

// dashboardDatasourceUID is the uid of the provisioned Prometheus data source, which every
// panel of the dashboard names.
const dashboardDatasourceUID = "prometheus"

// dashboard is the part of a Grafana dashboard this project writes.
type dashboard struct {
	UID    string  `json:"uid"`
	Title  string  `json:"title"`
	Panels []panel `json:"panels"`
}

type panel struct {
	Type  string `json:"type"`
	Title string `json:"title"`
	// Panels are those of a collapsed row, which Grafana keeps inside it.
	Panels     []panel `json:"panels"`
	Datasource *struct {
		Type string `json:"type"`
		UID  string `json:"uid"`
	} `json:"datasource"`
	Targets []struct {
		RefID      string `json:"refId"`
		Expr       string `json:"expr"`
		Datasource *struct {
			UID string `json:"uid"`
		} `json:"datasource"`
	} `json:"targets"`
}

// Every query of the dashboard names metrics the services, RabbitMQ or Prometheus export, on
// the provisioned data source; the panels cover what an operator looks at first; and, where
// promtool is installed, every query parses.
func TestGrafanaDashboard(t *testing.T) {
	t.Parallel()
	d := readDashboard(t)
	if d.UID == "" || d.Title == "" {
		t.Errorf("dashboard uid %q, title %q: want both", d.UID, d.Title)
	}
	known := knownMetrics(t)
	used := map[string]bool{}
	var exprs []string
	titles := map[string]bool{}
	for _, p := range allPanels(d.Panels) {
		if p.Type == "row" {
			continue
		}
		if titles[p.Title] || p.Title == "" {
			t.Errorf("panel title %q is empty or used twice", p.Title)
		}
		titles[p.Title] = true
		if p.Datasource == nil || p.Datasource.UID != dashboardDatasourceUID || p.Datasource.Type != "prometheus" {
			t.Errorf("panel %q: data source %+v, want the provisioned Prometheus (uid %s)", p.Title, p.Datasource, dashboardDatasourceUID)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			if q.Datasource != nil && q.Datasource.UID != dashboardDatasourceUID {
				t.Errorf("panel %q query %s: data source %q", p.Title, q.RefID, q.Datasource.UID)
			}
			names := metricNames(q.Expr)
			if len(names) == 0 {
				t.Errorf("panel %q query %s names no metric: %s", p.Title, q.RefID, q.Expr)
			}
			if why := mergesJobs(q.Expr); why != "" {
				t.Errorf("panel %q query %s %s, so the cluster profile's copies (invoicing-cluster …) merge into the default stack's lines: %s", p.Title, q.RefID, why, q.Expr)
			}
			for _, n := range names {
				used[n] = true
				if !known[n] {
					t.Errorf("panel %q query %s: no service, RabbitMQ or Prometheus exports %s", p.Title, q.RefID, n)
				}
			}
			exprs = append(exprs, q.Expr)
		}
	}
	// What the dashboard is for: the outbox's backlog and age, publishing and its failures,
	// consumer outcomes, duplicates, dead letters, and the age of events when handled; and
	// whatever an alert watches, so that a firing alert has a panel to look at.
	for _, m := range []string{
		"outbox_pending_messages", "outbox_oldest_pending_age_seconds", "outbox_messages_published_total",
		"outbox_publish_failures_total", "consumer_messages_total", "inbox_duplicates_total",
		"rabbitmq_detailed_queue_messages", "consumer_event_age_seconds_bucket",
	} {
		if !used[m] {
			t.Errorf("no panel shows %s", m)
		}
	}
	var rules alertRules
	readYAML(t, "deploy/prometheus/alerts.yml", &rules)
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			for _, m := range metricNames(r.Expr) {
				if !used[m] && !used[m+"_bucket"] {
					t.Errorf("alert %s watches %s, which no panel shows", r.Alert, m)
				}
			}
		}
	}
	checkWithPromtool(t, "dashboard", exprs)
}

// readDashboard reads the provisioned dashboard.
func readDashboard(t *testing.T) dashboard {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(root, "deploy/grafana/dashboards/outbox-inbox.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	return d
}

// allPanels returns panels and, after each row, the panels of a collapsed row, which Grafana
// keeps inside it.
func allPanels(panels []panel) []panel {
	var out []panel
	for _, p := range panels {
		out = append(out, p)
		out = append(out, allPanels(p.Panels)...)
	}
	return out
}

// aggregation is a PromQL aggregation operator with its by or without clause before its
// argument, as the dashboard writes them; histogram_quantile, max_over_time and the like are
// not matched (the name must start a word).
var aggregation = regexp.MustCompile(`\b(sum|min|max|avg|count|group|stddev|stdvar|topk|bottomk|quantile|count_values)\s*(?:(by|without)\s*\(([^)]*)\))?\s*\(`)

// mergesJobs says how expr aggregates series of different jobs into one, "" if it does not:
// every aggregation must keep job (by (job, …)), as the same service runs under two jobs when
// both compose profiles run (order and order-cluster, …).
func mergesJobs(expr string) string {
	for _, m := range aggregation.FindAllStringSubmatch(expr, -1) {
		switch m[2] {
		case "":
			return fmt.Sprintf("aggregates with %s and no by (job, …)", m[1])
		case "without":
			return fmt.Sprintf("aggregates with %s without (…), which the dashboard does not use: write by (job, …)", m[1])
		}
		var labels []string
		for l := range strings.SplitSeq(m[3], ",") {
			labels = append(labels, strings.TrimSpace(l))
		}
		if !slices.Contains(labels, "job") {
			return fmt.Sprintf("aggregates %s by (%s), without job", m[1], m[3])
		}
	}
	return ""
}

// The dashboard's checks must find what they are for: an aggregation that drops job, in any
// form, and a panel inside a collapsed row.
func TestGrafanaDashboardChecker(t *testing.T) {
	t.Parallel()
	for expr, merges := range map[string]bool{
		"sum by (job, type) (rate(x_total[5m]))":                          false,
		"histogram_quantile(0.95, sum by (job, le) (rate(x_bucket[5m])))": false,
		"max by (job) (changes(process_start_time_seconds[15m]))":         false,
		"up":                                    false,
		"max_over_time(x[5m])":                  false,
		"rate(x_count[5m])":                     false,
		"sum(rate(x_total[5m]))":                true,
		"sum by (consumer) (rate(x_total[5m]))": true,
		"histogram_quantile(0.95, sum by (consumer, le) (rate(x_bucket[5m])))": true,
		"max without (instance) (x)":            true,
		"min by (job) (x) / sum by (queue) (y)": true,
	} {
		if got := mergesJobs(expr) != ""; got != merges {
			t.Errorf("mergesJobs(%q) = %q, want merging %v", expr, mergesJobs(expr), merges)
		}
	}
	var d dashboard
	if err := json.Unmarshal([]byte(`{"panels": [{"type": "row", "title": "r", "collapsed": true,
		"panels": [{"type": "timeseries", "title": "inside"}]}, {"type": "timeseries", "title": "after"}]}`), &d); err != nil {
		t.Fatal(err)
	}
	var titles []string
	for _, p := range allPanels(d.Panels) {
		titles = append(titles, p.Title)
	}
	if want := []string{"r", "inside", "after"}; !slices.Equal(titles, want) {
		t.Errorf("allPanels walked %q, want %q", titles, want)
	}
}
