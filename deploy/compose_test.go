// Package deploy_test checks the Docker packaging by inspection, with no Docker engine: it
// loads docker-compose.yml and deploy/compose.test.yml with the compose-spec loader (the one
// Docker Compose uses) and reads the Dockerfile, .dockerignore and the PostgreSQL init
// scripts, and asserts that they agree with each other and with what the services' code reads.
package deploy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"
	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"

	"github.com/outboxkit/outbox-inbox/internal/platform"
)

// root is the repository root, seen from this package's directory.
const root = ".."

// app describes one of our services as docker-compose.yml must run it.
type app struct {
	name     string
	port     uint32 // HTTP_ADDR, published as is, and the healthcheck's port
	database string
	role     string
	consumer bool     // ready only while its broker works: it waits for the broker too
	extra    []string // services it waits for besides postgres (and the brokers, for a consumer)
}

var apps = []app{
	{name: "order", port: 8080, database: "order_db", role: "order"},
	{name: "invoicing", port: 8081, database: "invoicing_db", role: "invoicing", consumer: true},
	{name: "notification", port: 8082, database: "notification_db", role: "notification", consumer: true, extra: []string{"mailpit"}},
}

// loadProject loads docker-compose.yml as `docker compose config` would, but without the
// process environment or any .env file, so the result depends on the repository alone.
func loadProject(t *testing.T) *types.Project {
	t.Helper()
	return loadCompose(t, "docker-compose.yml", nil)
}

// loadCompose loads the compose file at path (from the repository root) with only the
// variables in env set ("NAME=value").
func loadCompose(t *testing.T, path string, env []string) *types.Project {
	t.Helper()
	return loadComposeProfiles(t, path, env)
}

// loadComposeProfiles is loadCompose with the profiles named enabled, as
// `docker compose --profile NAME` would.
func loadComposeProfiles(t *testing.T, path string, env []string, profiles ...string) *types.Project {
	t.Helper()
	dir, err := filepath.Abs(root)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, path)
	opts, err := cli.NewProjectOptions(
		[]string{file},
		cli.WithWorkingDirectory(filepath.Dir(file)),
		cli.WithEnv(env),
		cli.WithDiscardEnvFile,
		cli.WithResolvedPaths(true),
		cli.WithProfiles(profiles),
	)
	if err != nil {
		t.Fatal(err)
	}
	project, err := opts.LoadProject(context.Background())
	if err != nil {
		t.Fatalf("%s does not load: %v", path, err)
	}
	return project
}

func service(t *testing.T, p *types.Project, name string) types.ServiceConfig {
	t.Helper()
	s, ok := p.Services[name]
	if !ok {
		t.Fatalf("docker-compose.yml has no service %q", name)
	}
	return s
}

func env(s types.ServiceConfig, name string) (string, bool) {
	v, ok := s.Environment[name]
	if !ok || v == nil {
		return "", false
	}
	return *v, true
}

// Each pool of every process of every profile fits in PostgreSQL's max_connections at once,
// with room for an administrator, as TestK8sDatabaseConnectionsFit checks for Kubernetes.
func TestComposeDatabaseConnectionsFit(t *testing.T) {
	t.Parallel()
	const reserve = 20
	p := loadComposeProfiles(t, "docker-compose.yml", nil, "*")
	maxConns := 0
	for _, arg := range service(t, p, "postgres").Command {
		if v, ok := strings.CutPrefix(arg, "max_connections="); ok {
			var err error
			if maxConns, err = strconv.Atoi(v); err != nil {
				t.Fatalf("postgres max_connections: %v", err)
			}
		}
	}
	if maxConns == 0 {
		t.Fatal("postgres: set max_connections in its command; the default 100 is sized for no one")
	}
	total := 0
	for name, s := range p.Services {
		if _, ok := env(s, "DATABASE_URL"); !ok {
			continue
		}
		conns := platform.DefaultDBMaxConns
		if v, ok := env(s, "DB_MAX_CONNS"); ok {
			var err error
			if conns, err = strconv.Atoi(v); err != nil {
				t.Fatalf("%s DB_MAX_CONNS: %v", name, err)
			}
		}
		replicas := 1
		if s.Deploy != nil && s.Deploy.Replicas != nil {
			replicas = *s.Deploy.Replicas
		}
		total += replicas * conns
	}
	if total+reserve > maxConns {
		t.Errorf("the pools can open %d connections (+%d reserved), over max_connections %d", total, reserve, maxConns)
	}
}

func TestComposeHasNoVersionKey(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile(filepath.Join(root, "docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	if regexp.MustCompile(`(?m)^version\s*:`).Match(raw) {
		t.Error("docker-compose.yml has a top-level version: key (obsolete in the Compose Specification)")
	}
}

func TestComposeServices(t *testing.T) {
	t.Parallel()
	p := loadProject(t)
	want := []string{"postgres", "rabbitmq", "mailpit"}
	for _, a := range apps {
		want = append(want, a.name)
	}
	got := p.ServiceNames()
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("services = %v, want %v", got, want)
	}
}

func TestComposeEveryContainerHasAHealthcheck(t *testing.T) {
	t.Parallel()
	// Every profile's containers too.
	p := loadEveryProfile(t)
	for name, s := range p.Services {
		hc := s.HealthCheck
		if hc == nil || hc.Disable || len(hc.Test) < 2 || (hc.Test[0] != "CMD" && hc.Test[0] != "CMD-SHELL") {
			t.Errorf("%s: no usable healthcheck (%+v)", name, hc)
			continue
		}
		if hc.Interval == nil || hc.Timeout == nil || hc.Retries == nil || hc.StartPeriod == nil {
			t.Errorf("%s: healthcheck needs interval, timeout, retries and start_period", name)
		}
	}
	checkPostgresHealthcheck(t, "docker-compose.yml", service(t, p, "postgres"))
	for _, node := range append([]string{"rabbitmq"}, clusterNodes...) {
		checkRabbitMQHealthcheck(t, "docker-compose.yml", service(t, p, node))
	}
	if test := service(t, p, "mailpit").HealthCheck.Test; !slices.Equal(test, types.HealthCheckTest{"CMD", "/mailpit", "readyz"}) {
		t.Errorf("mailpit healthcheck = %q, want [CMD /mailpit readyz]", test)
	}
}

// checkPostgresHealthcheck holds a PostgreSQL container's healthcheck to pg_isready -U postgres
// over TCP (-h 127.0.0.1). While the image's entrypoint runs the init scripts (the databases and
// roles of deploy/postgres), its temporary server listens on the Unix socket only: over the
// socket pg_isready would answer ready then, and dependants would start while nothing listens
// on TCP and their databases may not exist yet.
func checkPostgresHealthcheck(t *testing.T, file string, s types.ServiceConfig) {
	t.Helper()
	test := healthcheckTest(s)
	if len(test) < 2 || test[0] != "CMD" || test[1] != "pg_isready" ||
		!hasOption(test[2:], "-U", "--username", "postgres") || !hasOption(test[2:], "-h", "--host", "127.0.0.1") {
		t.Errorf("%s: %s healthcheck = %q, want [CMD pg_isready -U postgres -h 127.0.0.1]: over TCP, which the server listens on only once its init scripts have run", file, s.Name, test)
	}
}

// checkRabbitMQHealthcheck holds a RabbitMQ node's healthcheck to rabbitmq-diagnostics
// check_port_connectivity, which passes once every listener of the node (AMQP's among them)
// accepts connections. rabbitmq-diagnostics ping passes as soon as the Erlang node answers its
// CLI tools, while the broker is still booting: its dependants would start, and fail, against
// a broker that refuses their connections.
func checkRabbitMQHealthcheck(t *testing.T, file string, s types.ServiceConfig) {
	t.Helper()
	test := healthcheckTest(s)
	if len(test) < 2 || test[0] != "CMD" || test[1] != "rabbitmq-diagnostics" || !slices.Contains(test[2:], "check_port_connectivity") {
		t.Errorf("%s: %s healthcheck = %q, want [CMD rabbitmq-diagnostics -q check_port_connectivity]: it passes once the listeners accept connections, ping while the node still boots", file, s.Name, test)
	}
}

func healthcheckTest(s types.ServiceConfig) types.HealthCheckTest {
	if s.HealthCheck == nil {
		return nil
	}
	return s.HealthCheck.Test
}

// hasOption reports whether args give value to the option written short (-h) or long
// (--host), as -h value, -hvalue, --host value or --host=value.
func hasOption(args []string, short, long, value string) bool {
	for i, a := range args {
		next := i+1 < len(args) && args[i+1] == value
		if ((a == short || a == long) && next) || a == short+value || a == long+"="+value {
			return true
		}
	}
	return false
}

// The services are the folders of services/ (the Dockerfile, run-local.sh and the system
// tests find them there): each must be described in apps, so that the tests below hold
// docker-compose.yml and the database init scripts to it.
func TestAppsAreTheServicesFolders(t *testing.T) {
	t.Parallel()
	entries, err := os.ReadDir(filepath.Join(root, "services"))
	if err != nil {
		t.Fatal(err)
	}
	var folders, described []string
	for _, e := range entries {
		if _, err := os.Stat(filepath.Join(root, "services", e.Name(), "main.go")); e.IsDir() && err == nil {
			folders = append(folders, e.Name())
		}
	}
	for _, a := range apps {
		described = append(described, a.name)
	}
	slices.Sort(folders)
	slices.Sort(described)
	if !slices.Equal(folders, described) {
		t.Fatalf("services/ holds %v, but the compose tests describe %v: describe every service in apps", folders, described)
	}
}

func TestComposeApps(t *testing.T) {
	t.Parallel()
	p := loadProject(t)
	defs := brokerDefinitions(t, p)
	roles := initScriptRoles(t, p)

	for _, a := range apps {
		t.Run(a.name, func(t *testing.T) {
			t.Parallel()
			s := service(t, p, a.name)
			checkApp(t, s, a, appTarget{brokers: []string{"rabbitmq"}, database: a.database}, defs, roles)
			// It publishes its HTTP port, as is.
			if !publishes(s, a.port, a.port) {
				t.Errorf("ports = %+v, want 127.0.0.1:%d:%d", s.Ports, a.port, a.port)
			}
		})
	}

	notification := service(t, p, "notification")
	if v, _ := env(notification, "SMTP_ADDR"); v != "mailpit:1025" {
		t.Errorf("notification SMTP_ADDR = %q, want mailpit:1025", v)
	}
	if v, _ := env(notification, "SMTP_FROM"); !strings.Contains(v, "@") {
		t.Errorf("notification SMTP_FROM = %q, want an address", v)
	}
}

// appTarget is where a compose service running app a connects: the broker services (one URL
// each in AMQP_URL) and its database.
type appTarget struct {
	brokers  []string
	database string
}

// checkApp checks that s runs app a as docker-compose.yml must, connected to target: built
// from the one Dockerfile, started once its dependencies are healthy (the order service never
// waits for a broker), configured with what the
// code reads, logged in to PostgreSQL and RabbitMQ as its own role and user, and
// healthchecked on its HTTP port. defs are the broker's definitions, roles the init scripts'.
func checkApp(t *testing.T, s types.ServiceConfig, a app, target appTarget, defs definitions, roles map[string]string) {
	t.Helper()

	// Build: the one Dockerfile, with the right SERVICE.
	abs, _ := filepath.Abs(root)
	switch {
	case s.Build == nil:
		t.Error("no build section")
	case filepath.Clean(s.Build.Context) != abs:
		t.Errorf("build context = %q, want the repository root %q", s.Build.Context, abs)
	case s.Build.Dockerfile != "" && s.Build.Dockerfile != "Dockerfile" && s.Build.Dockerfile != filepath.Join(abs, "Dockerfile"):
		t.Errorf("build dockerfile = %q, want the root Dockerfile", s.Build.Dockerfile)
	default:
		if arg := s.Build.Args["SERVICE"]; arg == nil || *arg != a.name {
			t.Errorf("build arg SERVICE = %v, want %q", deref(arg), a.name)
		}
	}

	// Start order: only once the dependencies are healthy, and nothing else. The order service
	// does not wait for the broker: a broker that never comes up must not keep it from taking
	// orders, which is what the outbox is for.
	wait := slices.Concat([]string{"postgres"}, a.extra)
	if a.consumer {
		wait = append(wait, target.brokers...)
	}
	for _, dep := range wait {
		if d, ok := s.DependsOn[dep]; !ok || d.Condition != types.ServiceConditionHealthy {
			t.Errorf("depends_on %s: %+v, want condition service_healthy", dep, d)
		}
	}
	for dep := range s.DependsOn {
		switch {
		case slices.Contains(wait, dep):
		case slices.Contains(target.brokers, dep):
			t.Errorf("depends_on %s: %s consumes nothing and must start whatever the broker does (its outbox keeps the events meanwhile)", dep, a.name)
		default:
			t.Errorf("depends_on %s, which it does not need (want %v)", dep, wait)
		}
	}
	if s.Restart == "" || s.Restart == types.RestartPolicyNo {
		t.Errorf("restart = %q, want a restart policy", s.Restart)
	}
	if s.StopGracePeriod == nil || time.Duration(*s.StopGracePeriod) < shutdownContract*time.Second {
		t.Errorf("stop_grace_period = %v, want at least the %d s a service may take to stop: Docker kills it after that", s.StopGracePeriod, shutdownContract)
	}

	// Configuration: what the code requires is there, and nothing it does not read.
	for _, name := range requiredVars(t, a.name) {
		if v, ok := env(s, name); !ok || v == "" {
			t.Errorf("required variable %s is not set", name)
		}
	}
	known := settable(t, a.name)
	for name := range s.Environment {
		if !slices.Contains(known, name) {
			t.Errorf("environment sets %s, which services/%s does not read (known: %v)", name, a.name, known)
		}
	}

	// DATABASE_URL: its database, as its own role, created by the init script.
	dbURL, _ := env(s, "DATABASE_URL")
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatalf("DATABASE_URL: %v", err)
	}
	pass, _ := u.User.Password()
	if u.Scheme != "postgres" || u.Hostname() != "postgres" || u.Port() != "5432" ||
		strings.TrimPrefix(u.Path, "/") != target.database || u.User.Username() != a.role ||
		u.Query().Get("sslmode") != "disable" {
		t.Errorf("DATABASE_URL = %q, want postgres://%s:...@postgres:5432/%s?sslmode=disable", dbURL, a.role, target.database)
	}
	if got, ok := roles[a.role]; !ok || got != pass {
		t.Errorf("DATABASE_URL password for %q does not match the role the init script creates", a.role)
	}

	// AMQP_URL: one URL per broker node (the code reads a comma-separated list), each as the
	// service's own user, whose password is the one the definitions file holds the hash of,
	// on the virtual host / where its permissions are.
	amqpURL, _ := env(s, "AMQP_URL")
	var hosts []string
	for _, raw := range strings.Split(amqpURL, ",") {
		u, err := url.Parse(raw)
		if err != nil {
			t.Errorf("AMQP_URL entry %q: %v", raw, err)
			continue
		}
		hosts = append(hosts, u.Hostname())
		pass, _ := u.User.Password()
		if u.Scheme != "amqp" || !slices.Contains(target.brokers, u.Hostname()) || u.Port() != "5672" ||
			u.User.Username() != a.name || (u.Path != "" && u.Path != "/") {
			t.Errorf("AMQP_URL entry %q, want amqp://%s:<its password>@<one of %v>:5672/", u.Redacted(), a.name, target.brokers)
		}
		if user, ok := defs.user(a.name); !ok {
			t.Errorf("deploy/rabbitmq/definitions.json has no user %q", a.name)
		} else if !user.passwordIs(pass) {
			t.Errorf("AMQP_URL's password for %q (%s) does not match its password_hash in deploy/rabbitmq/definitions.json", a.name, u.Hostname())
		}
	}
	slices.Sort(hosts)
	if want := slices.Sorted(slices.Values(target.brokers)); !slices.Equal(hosts, want) {
		t.Errorf("AMQP_URL names the brokers %v, want each of %v once", hosts, want)
	}
	if _, ok := defs.permissions(a.name, "/"); !ok {
		t.Errorf("deploy/rabbitmq/definitions.json gives %q no permissions on the virtual host /", a.name)
	}

	// HTTP: listens on its port, and the healthcheck asks that port.
	addr, _ := env(s, "HTTP_ADDR")
	if _, port, err := net.SplitHostPort(addr); err != nil || port != strconv.Itoa(int(a.port)) {
		t.Errorf("HTTP_ADDR = %q, want :%d", addr, a.port)
	}
	wantHC := types.HealthCheckTest{"CMD", "/healthcheck", fmt.Sprintf("http://127.0.0.1:%d/readyz", a.port)}
	if s.HealthCheck == nil || !slices.Equal(s.HealthCheck.Test, wantHC) {
		var got types.HealthCheckTest
		if s.HealthCheck != nil {
			got = s.HealthCheck.Test
		}
		t.Errorf("healthcheck test = %q, want %q", got, wantHC)
	}
}

// Every service of every profile built from the Dockerfile runs one of the apps, and its
// environment passes that app's own config readers.
func TestComposeServiceConfiguration(t *testing.T) {
	t.Parallel()
	for name, s := range loadEveryProfile(t).Services {
		if s.Build == nil {
			continue
		}
		arg := s.Build.Args["SERVICE"]
		i := slices.IndexFunc(apps, func(a app) bool { return arg != nil && a.name == *arg })
		if i < 0 {
			t.Errorf("%s: build arg SERVICE = %v, which names no service of services/", name, deref(arg))
			continue
		}
		vars := map[string]string{}
		for k, v := range s.Environment {
			if v != nil {
				vars[k] = *v
			}
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			checkConfigReaders(t, apps[i], vars)
		})
	}
}

// publishedPorts are the ports docker-compose.yml publishes: the container port, and the
// variable that moves the host port (the container port when unset).
var publishedPorts = []struct {
	service  string
	port     uint32
	variable string
}{
	{"order", 8080, "ORDER_PORT"},
	{"invoicing", 8081, "INVOICING_PORT"},
	{"notification", 8082, "NOTIFICATION_PORT"},
	{"rabbitmq", 15672, "RABBITMQ_UI_PORT"},
	{"mailpit", 8025, "MAILPIT_UI_PORT"},
}

func TestComposePublishedPorts(t *testing.T) {
	t.Parallel()
	p := loadProject(t)
	want := map[string]int{}
	for _, pp := range publishedPorts {
		want[pp.service]++
		if !publishes(service(t, p, pp.service), pp.port, pp.port) {
			t.Errorf("%s: ports = %+v, want 127.0.0.1:%d:%d with %s unset", pp.service, service(t, p, pp.service).Ports, pp.port, pp.port, pp.variable)
		}
	}
	// Nothing else is published, and nothing on all interfaces: the RabbitMQ UI is an
	// administrator login, Mailpit shows every e-mail.
	for name, s := range p.Services {
		if len(s.Ports) != want[name] {
			t.Errorf("%s: publishes %d ports (%+v), want %d", name, len(s.Ports), s.Ports, want[name])
		}
		for _, port := range s.Ports {
			if port.HostIP != "127.0.0.1" {
				t.Errorf("%s: port %d is published on %q, want 127.0.0.1 only", name, port.Target, port.HostIP)
			}
		}
	}

	// Each host port moves with its variable, the container port stays.
	var env []string
	for i, pp := range publishedPorts {
		env = append(env, fmt.Sprintf("%s=%d", pp.variable, 20000+i))
	}
	moved := loadCompose(t, "docker-compose.yml", env)
	for i, pp := range publishedPorts {
		if s := service(t, moved, pp.service); !publishes(s, pp.port, uint32(20000+i)) {
			t.Errorf("%s: with %s=%d, ports = %+v, want 127.0.0.1:%d:%d", pp.service, pp.variable, 20000+i, s.Ports, 20000+i, pp.port)
		}
	}
}

// With every profile, each port is published on 127.0.0.1 only and no two take the same host
// port by default: `docker compose --profile observability --profile cluster up` starts.
func TestComposeHostPortsWithEveryProfile(t *testing.T) {
	t.Parallel()
	takenBy := map[string]string{}
	for name, s := range loadEveryProfile(t).Services {
		for _, port := range s.Ports {
			if port.HostIP != "127.0.0.1" {
				t.Errorf("%s: port %d is published on %q, want 127.0.0.1 only", name, port.Target, port.HostIP)
			}
			if by, ok := takenBy[port.Published]; ok {
				t.Errorf("%s and %s both publish host port %s", by, name, port.Published)
			}
			takenBy[port.Published] = name
		}
	}
}

// The images still get updates: RabbitMQ 3.13 images stopped in December 2025, distroless
// debian12 reached its end of life in September 2026. PostgreSQL is pinned to a major
// version, RabbitMQ to one patch release (see rabbitImageOK), neither to latest.
func TestComposeImages(t *testing.T) {
	t.Parallel()
	p := loadProject(t)
	if img := service(t, p, "rabbitmq").Image; !rabbitImageOK(img) {
		t.Errorf("rabbitmq image = %q, want rabbitmq:4.<minor>.<patch>-management, 4.3.1 or later", img)
	}
	if img := service(t, p, "postgres").Image; !regexp.MustCompile(`^postgres:\d+-alpine$`).MatchString(img) {
		t.Errorf("postgres image = %q, want postgres:<major>-alpine", img)
	}
	// The cluster profile's nodes run the single broker's release.
	cluster := loadCluster(t)
	for _, node := range clusterNodes {
		if got, want := service(t, cluster, node).Image, service(t, p, "rabbitmq").Image; got != want {
			t.Errorf("%s image = %q, want %q as the rabbitmq service", node, got, want)
		}
	}
	// The test servers are the same versions as the system's.
	test := loadCompose(t, "deploy/compose.test.yml", nil)
	for _, name := range []string{"postgres", "rabbitmq"} {
		if got, want := service(t, test, name).Image, service(t, p, name).Image; got != want {
			t.Errorf("deploy/compose.test.yml %s image = %q, want %q as in docker-compose.yml", name, got, want)
		}
	}
}

// rabbitImageOK reports whether img is RabbitMQ's management image pinned to a patch release
// of 4.3.1 or later. The minor tag (4.3) moves under a deployment; 4.3.0 refuses a passive
// queue.declare without configure permission, which outboxctl dlq needs with its narrow user.
func rabbitImageOK(img string) bool {
	m := regexp.MustCompile(`^rabbitmq:(\d+)\.(\d+)\.(\d+)-management$`).FindStringSubmatch(img)
	if m == nil {
		return false
	}
	var v [3]int
	for i := range v {
		v[i], _ = strconv.Atoi(m[i+1])
	}
	return slices.Compare(v[:], []int{4, 3, 1}) >= 0 && v[0] == 4
}

func TestRabbitImageOK(t *testing.T) {
	t.Parallel()
	for img, want := range map[string]bool{
		"rabbitmq:4.3.6-management": true, "rabbitmq:4.3.1-management": true, "rabbitmq:4.4.0-management": true,
		"rabbitmq:4.3.0-management": false, "rabbitmq:4.3-management": false, "rabbitmq:4.2.9-management": false,
		"rabbitmq:4.3.6": false, "rabbitmq:latest": false, "rabbitmq:5.0.0-management": false,
	} {
		if got := rabbitImageOK(img); got != want {
			t.Errorf("rabbitImageOK(%q) = %v, want %v", img, got, want)
		}
	}
}

// deploy/compose.test.yml runs the two servers scripts/test.sh needs where the tests look for
// them by default.
func TestComposeTestServers(t *testing.T) {
	t.Parallel()
	p := loadCompose(t, "deploy/compose.test.yml", nil)
	got := p.ServiceNames()
	slices.Sort(got)
	if want := []string{"postgres", "rabbitmq"}; !slices.Equal(got, want) {
		t.Fatalf("deploy/compose.test.yml services = %v, want %v", got, want)
	}

	for name, s := range p.Services {
		if len(s.Ports) != 1 {
			t.Errorf("%s: ports = %+v, want exactly one", name, s.Ports)
		}
		for _, port := range s.Ports {
			if port.HostIP != "127.0.0.1" {
				t.Errorf("%s: port %d is published on %q, want 127.0.0.1 only (the logins are open)", name, port.Target, port.HostIP)
			}
		}
		hc := s.HealthCheck
		if hc == nil || hc.Disable || len(hc.Test) < 2 || hc.Test[0] != "CMD" ||
			hc.Interval == nil || hc.Timeout == nil || hc.Retries == nil || hc.StartPeriod == nil {
			t.Errorf("%s: healthcheck = %+v, want a CMD test with interval, timeout, retries and start_period (up --wait waits on it)", name, hc)
		}
	}

	// PostgreSQL: postgres without a password, as TEST_DATABASE_URL's default logs in.
	pg := service(t, p, "postgres")
	dbURL := testURLDefault(t, "TEST_DATABASE_URL")
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	if _, hasPass := u.User.Password(); u.Hostname() != "127.0.0.1" || u.Port() != "5432" || u.User.Username() != "postgres" || hasPass {
		t.Fatalf("TEST_DATABASE_URL defaults to %q; this test expects postgres without a password at 127.0.0.1:5432", dbURL)
	}
	if !publishes(pg, 5432, 5432) {
		t.Errorf("postgres: ports = %+v, want 127.0.0.1:5432:5432", pg.Ports)
	}
	if v, _ := env(pg, "POSTGRES_HOST_AUTH_METHOD"); v != "trust" {
		t.Errorf("postgres: POSTGRES_HOST_AUTH_METHOD = %q, want trust (%s has no password)", v, dbURL)
	}
	checkPostgresHealthcheck(t, "deploy/compose.test.yml", pg)

	// RabbitMQ: guest/guest, as TEST_AMQP_URL's default logs in.
	rabbit := service(t, p, "rabbitmq")
	amqpURL := testURLDefault(t, "TEST_AMQP_URL")
	if u, err = url.Parse(amqpURL); err != nil {
		t.Fatal(err)
	}
	pass, _ := u.User.Password()
	if u.Hostname() != "127.0.0.1" || u.Port() != "5672" || u.User.Username() != "guest" || pass != "guest" {
		t.Fatalf("TEST_AMQP_URL defaults to %q; this test expects guest:guest at 127.0.0.1:5672", amqpURL)
	}
	if !publishes(rabbit, 5672, 5672) {
		t.Errorf("rabbitmq: ports = %+v, want 127.0.0.1:5672:5672", rabbit.Ports)
	}
	user, _ := env(rabbit, "RABBITMQ_DEFAULT_USER")
	pass, _ = env(rabbit, "RABBITMQ_DEFAULT_PASS")
	if user != "guest" || pass != "guest" {
		t.Errorf("rabbitmq: RABBITMQ_DEFAULT_USER/RABBITMQ_DEFAULT_PASS = %q/%q, want guest/guest", user, pass)
	}
	checkRabbitMQHealthcheck(t, "deploy/compose.test.yml", rabbit)
}

// testURLDefault returns the default of a TEST_*_URL variable, checking that the tests
// (internal/testenv) and scripts/test.sh agree on it.
func testURLDefault(t *testing.T, name string) string {
	t.Helper()
	read := func(path string) string {
		src, err := os.ReadFile(filepath.Join(root, path))
		if err != nil {
			t.Fatal(err)
		}
		return string(src)
	}
	q := regexp.QuoteMeta(name)
	goDefault := regexp.MustCompile(`envOr\("` + q + `",\s*"([^"]+)"\)`).FindStringSubmatch(read("internal/testenv/testenv.go"))
	shDefault := regexp.MustCompile(`\$\{` + q + `:-([^}]+)\}`).FindStringSubmatch(read("scripts/test.sh"))
	if goDefault == nil || shDefault == nil {
		t.Fatalf("%s: no default found in internal/testenv/testenv.go (%v) or scripts/test.sh (%v)", name, goDefault, shDefault)
	}
	if goDefault[1] != shDefault[1] {
		t.Fatalf("%s defaults to %q in internal/testenv but %q in scripts/test.sh", name, goDefault[1], shDefault[1])
	}
	return goDefault[1]
}

func TestComposePostgresInit(t *testing.T) {
	t.Parallel()
	p := loadProject(t)
	pg := service(t, p, "postgres")
	if v, _ := env(pg, "POSTGRES_PASSWORD"); v == "" {
		t.Error("postgres: POSTGRES_PASSWORD is not set (the image refuses to start without it)")
	}
	var data bool
	for _, v := range pg.Volumes {
		if v.Target == "/var/lib/postgresql/data" && v.Type == types.VolumeTypeVolume {
			data = true
		}
	}
	if !data {
		t.Error("postgres: no named volume at /var/lib/postgresql/data")
	}

	sql := initScripts(t, p)
	for _, a := range apps {
		role := `"?` + regexp.QuoteMeta(a.role) + `"?`
		if !regexp.MustCompile(`(?is)CREATE\s+(ROLE|USER)\s+`+role+`\s[^;]*\bLOGIN\b[^;]*\bPASSWORD\s+'[^']+'`).MatchString(sql) &&
			!regexp.MustCompile(`(?is)CREATE\s+USER\s+`+role+`\s[^;]*\bPASSWORD\s+'[^']+'`).MatchString(sql) {
			t.Errorf("init script does not create the login role %s with a password", a.role)
		}
		// Its database, and the one of its copy in the cluster profile.
		for _, db := range []string{a.database, clusterDatabase(a)} {
			if !regexp.MustCompile(`(?is)CREATE\s+DATABASE\s+"?` + db + `"?\s[^;]*\bOWNER\s*=?\s*` + role + `\s*;`).MatchString(sql) {
				t.Errorf("init script does not create database %s owned by %s", db, a.role)
			}
		}
	}
	// "order" is reserved in SQL: unquoted, CREATE ROLE order fails and the init stops.
	if regexp.MustCompile(`(?i)(ROLE|USER|OWNER)\s*=?\s*order\b`).MatchString(sql) {
		t.Error(`init script uses the role order unquoted; it must be "order"`)
	}
}

func TestDockerfile(t *testing.T) {
	t.Parallel()
	instrs := dockerfile(t)

	var froms []string
	for _, in := range instrs {
		if in.cmd == "FROM" {
			froms = append(froms, in.args)
		}
	}
	if len(froms) < 2 {
		t.Fatalf("Dockerfile has %d stages, want a multi-stage build", len(froms))
	}
	goMod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	goVersion := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(goMod)
	if len(goVersion) < 2 || !strings.HasPrefix(froms[0], "golang:"+string(goVersion[1])) {
		t.Errorf("build stage FROM %q, want golang:%s (go.mod's version)", froms[0], goVersion[1])
	}
	runtime := strings.Fields(froms[len(froms)-1])[0]
	// Static binaries need no libc; debian12 reached its end of life in September 2026.
	if m := regexp.MustCompile(`^gcr\.io/distroless/static-debian(\d+):`).FindStringSubmatch(runtime); m == nil {
		t.Errorf("runtime stage FROM %q, want gcr.io/distroless/static-debianN (the binaries are static)", runtime)
	} else if n, _ := strconv.Atoi(m[1]); n < 13 {
		t.Errorf("runtime stage FROM %q: debian%d gets no more updates, want static-debian13 or later", runtime, n)
	}

	last := instrs[lastIndex(instrs, "FROM"):]
	build := instrs[:lastIndex(instrs, "FROM")]
	switch u := lastArgs(last, "USER"); {
	case u == "" && !strings.HasSuffix(runtime, ":nonroot"):
		t.Errorf("runtime stage runs as root: no USER, image %s", runtime)
	case u == "root" || u == "0" || strings.HasPrefix(u, "root:") || strings.HasPrefix(u, "0:"):
		t.Errorf("runtime stage USER %q is root", u)
	}
	if e := lastArgs(last, "ENTRYPOINT"); e != `["/service"]` {
		t.Errorf("ENTRYPOINT %s, want [\"/service\"]", e)
	}
	for _, bin := range []string{"/service", "/healthcheck", "/outboxctl"} {
		if !slices.ContainsFunc(last, func(in instr) bool {
			return in.cmd == "COPY" && strings.HasPrefix(in.args, "--from=") && strings.HasSuffix(in.args, " "+bin)
		}) {
			t.Errorf("runtime stage does not COPY --from the build stage to %s", bin)
		}
	}

	// The RUN that builds the service sees ARG SERVICE, declared in its own stage.
	buildAt := slices.IndexFunc(build, func(in instr) bool {
		return in.cmd == "RUN" && strings.Contains(in.args, "./services/${SERVICE}")
	})
	if buildAt < 0 {
		t.Fatal("no RUN builds ./services/${SERVICE}")
	}
	stageAt := lastIndex(build[:buildAt], "FROM")
	if !slices.ContainsFunc(build[stageAt:buildAt], func(in instr) bool {
		return in.cmd == "ARG" && (in.args == "SERVICE" || strings.HasPrefix(in.args, "SERVICE="))
	}) {
		t.Error("the build stage does not declare ARG SERVICE before building ./services/${SERVICE}")
	}
	all := func(cmd string) string {
		var b strings.Builder
		for _, in := range build {
			if in.cmd == cmd {
				b.WriteString(in.args + "\n")
			}
		}
		return b.String()
	}
	runs := all("RUN")
	if !strings.Contains(all("ENV")+all("ARG")+runs, "CGO_ENABLED=0") {
		t.Error("build stage does not set CGO_ENABLED=0")
	}
	for _, want := range []string{"-trimpath", `-ldflags="-s -w"`, `./services/${SERVICE}`, "./cmd/healthcheck", "./cmd/outboxctl"} {
		if !strings.Contains(runs, want) {
			t.Errorf("build stage RUN does not contain %s", want)
		}
	}

	// go mod download runs on the go.mod and go.sum files alone, before the sources are copied
	// in: the root module's, and those of every module a replace of its go.mod points at in this
	// tree, each where the replace expects it (without one, the download fails).
	download := slices.IndexFunc(build, func(in instr) bool { return in.cmd == "RUN" && strings.Contains(in.args, "go mod download") })
	srcCopy := slices.IndexFunc(build, func(in instr) bool { return in.cmd == "COPY" && strings.HasPrefix(in.args, ". ") })
	if download < 0 || srcCopy < download {
		t.Errorf("want RUN go mod download, then COPY . (at %d, %d)", download, srcCopy)
	}
	if download >= 0 {
		copied := copiedBefore(t, build, download)
		for _, f := range goModFiles(t) {
			if !slices.Contains(copied, f) {
				t.Errorf("%s is not copied to <WORKDIR>/%s before RUN go mod download", f, f)
			}
		}
	}
}

// goModFiles returns the files `go mod download` reads, from the repository root: the root
// module's go.mod and go.sum, and the go.mod (and go.sum, if any) of each module a replace
// directive of the root go.mod points at in this tree.
func goModFiles(t *testing.T) []string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	files := []string{"go.mod", "go.sum"}
	block := false
	for line := range strings.SplitSeq(string(raw), "\n") {
		line, _, _ = strings.Cut(line, "//")
		line = strings.TrimSpace(line)
		switch rest, ok := strings.CutPrefix(line, "replace"); {
		case ok && strings.TrimSpace(rest) == "(":
			block = true
			continue
		case block && line == ")":
			block = false
			continue
		case ok:
			line = rest
		case !block:
			continue
		}
		_, target, _ := strings.Cut(line, "=>")
		dir := strings.TrimSpace(target)
		if !strings.HasPrefix(dir, "./") && !strings.HasPrefix(dir, "../") && !strings.HasPrefix(dir, "/") {
			continue // a module version, which go mod download fetches
		}
		if dir = path.Clean(dir); strings.HasPrefix(dir, "../") || path.IsAbs(dir) {
			t.Errorf("go.mod replaces a module with %s, outside the build context", dir)
			continue
		}
		files = append(files, path.Join(dir, "go.mod"))
		if _, err := os.Stat(filepath.Join(root, dir, "go.sum")); err == nil {
			files = append(files, path.Join(dir, "go.sum"))
		}
	}
	return files
}

// copiedBefore returns the files the COPY instructions of the stage that holds instrs[end]
// copy from the build context before it, by their path from the repository root, each only
// if it lands where the same path under the WORKDIR of the moment would be.
func copiedBefore(t *testing.T, instrs []instr, end int) []string {
	t.Helper()
	var copied []string
	workdir := "/"
	for _, in := range instrs[lastIndex(instrs[:end], "FROM")+1 : end] {
		args := strings.Fields(in.args)
		switch in.cmd {
		case "WORKDIR":
			dir := in.args
			if !path.IsAbs(dir) {
				dir = path.Join(workdir, dir)
			}
			workdir = path.Clean(dir)
		case "COPY":
			for len(args) > 0 && strings.HasPrefix(args[0], "--") {
				if strings.HasPrefix(args[0], "--from=") {
					args = nil // from another stage or image, not the context
				} else {
					args = args[1:]
				}
			}
			if len(args) < 2 {
				continue
			}
			srcs, dest := args[:len(args)-1], args[len(args)-1]
			// Into a folder: the sources keep their names there.
			folder := len(srcs) > 1 || strings.HasSuffix(dest, "/") || dest == "."
			if !path.IsAbs(dest) {
				dest = path.Join(workdir, dest)
			}
			for _, src := range srcs {
				target := dest
				if folder {
					target = path.Join(dest, path.Base(src))
				}
				if rel := path.Clean(src); target == path.Join(workdir, rel) {
					copied = append(copied, rel)
				}
			}
		}
	}
	return copied
}

// TestDockerignore holds .dockerignore to the build: read and matched as Docker and BuildKit
// read and match it (github.com/moby/patternmatcher, their own code: `**`, a leading `/`, `!`
// exceptions, and a pattern that excludes a folder excluding everything in it), it keeps in the
// context every file the image's build reads, and leaves .git out.
func TestDockerignore(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile(filepath.Join(root, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	patterns := dockerignorePatterns(t, string(raw))
	if excluded, err := excludedByDockerignore(patterns, ".git/HEAD"); err != nil || !excluded {
		t.Errorf(".dockerignore does not exclude .git (%v)", err)
	}
	for _, problem := range dockerignoreProblems(patterns, buildInputs(t)) {
		t.Errorf(".dockerignore: %s", problem)
	}
}

// The check refuses what would break the build, however the pattern is written, and accepts
// exceptions that bring the files back.
func TestDockerignoreChecker(t *testing.T) {
	t.Parallel()
	needed := buildInputs(t)
	for _, c := range []struct {
		ignore string // .dockerignore's text
		ok     bool
	}{
		{"**/healthcheck", false},                  // cmd/healthcheck, at any depth
		{"services/order", false},                  // a folder, and so everything in it
		{"/services/order", false},                 // a leading / changes nothing
		{"**/*.sql", false},                        // the migrations the services embed
		{"**/migrations", false},                   // their folders
		{"pkg/messaging/schema", false},            // the library's embedded schema
		{"cmd/*/main.go", false},                   // one * per path element
		{"*\n!go.mod\n!go.sum", false},             // everything but the go.mod files
		{"services\n!services/order", false},       // invoicing and notification stay out
		{"services\n!services/**", true},           // the exception brings back all of it
		{"*\n!**", true},                           // so does this
		{"order\n**/*_test.go\n**/testdata", true}, // the binary at the root, the tests
	} {
		problems := dockerignoreProblems(dockerignorePatterns(t, c.ignore), needed)
		if ok := len(problems) == 0; ok != c.ok {
			t.Errorf(".dockerignore %q: accepted %v, want %v (%q)", c.ignore, ok, c.ok, problems)
		}
	}
}

// dockerignorePatterns reads a .dockerignore's text as Docker does: comments and blank lines
// dropped, each pattern cleaned, a leading / removed.
func dockerignorePatterns(t *testing.T, text string) []string {
	t.Helper()
	patterns, err := ignorefile.ReadAll(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	return patterns
}

// excludedByDockerignore reports whether patterns leave file (slash-separated, from the
// context's root) out of the build context: whether it or a folder above it matches, and no
// later exception brings it back.
func excludedByDockerignore(patterns []string, file string) (bool, error) {
	pm, err := patternmatcher.New(patterns)
	if err != nil {
		return false, err
	}
	return pm.MatchesOrParentMatches(file)
}

// dockerignoreProblems lists each file of needed that patterns leave out of the context, with
// the patterns that would exclude it on their own.
func dockerignoreProblems(patterns, needed []string) []string {
	var problems []string
	for _, file := range needed {
		excluded, err := excludedByDockerignore(patterns, file)
		if err != nil {
			return []string{err.Error()}
		}
		if !excluded {
			continue
		}
		var by []string
		for _, p := range patterns {
			if alone, _ := excludedByDockerignore([]string{p}, file); alone {
				by = append(by, p)
			}
		}
		problems = append(problems, fmt.Sprintf("%s is excluded (by %q), and the build reads it", file, by))
	}
	return problems
}

// dockerBuilds are the packages the Dockerfile's build stage builds: every folder of services/
// (the SERVICE build argument picks one) and the two tools (TestDockerfile holds its RUN to
// them).
var dockerBuilds = []string{"./services/...", "./cmd/healthcheck", "./cmd/outboxctl"}

// buildInputs lists the files of this repository the image's build reads, from its root: the
// go.mod and go.sum files it copies first, and, as `go list` reports them with the build's
// settings (GOWORK=off, CGO_ENABLED=0, linux), the Go files and embedded files of every package
// dockerBuilds depend on, with their modules' go.mod. Those of the module cache and GOROOT are
// outside the context.
func buildInputs(t *testing.T) []string {
	t.Helper()
	abs, err := filepath.Abs(root)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", append([]string{"list", "-deps", "-json=Dir,GoFiles,EmbedFiles,Module,Standard"}, dockerBuilds...)...)
	cmd.Dir = abs
	cmd.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED=0", "GOOS=linux")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list %v: %v\n%s", dockerBuilds, err, stderr.String())
	}
	files := goModFiles(t)
	add := func(p string) {
		r, err := filepath.Rel(abs, p)
		if err != nil || r == ".." || strings.HasPrefix(r, ".."+string(filepath.Separator)) {
			return // the module cache or GOROOT
		}
		if r = filepath.ToSlash(r); !slices.Contains(files, r) {
			files = append(files, r)
		}
	}
	dec := json.NewDecoder(bytes.NewReader(out))
	for dec.More() {
		var pkg struct {
			Dir                 string
			GoFiles, EmbedFiles []string
			Standard            bool
			Module              *struct{ GoMod string }
		}
		if err := dec.Decode(&pkg); err != nil {
			t.Fatalf("go list: %v", err)
		}
		if pkg.Standard {
			continue
		}
		for _, f := range slices.Concat(pkg.GoFiles, pkg.EmbedFiles) {
			add(filepath.Join(pkg.Dir, f))
		}
		if pkg.Module != nil && pkg.Module.GoMod != "" {
			add(pkg.Module.GoMod)
		}
	}
	for _, must := range []string{"services/order/main.go", "cmd/healthcheck/main.go", "pkg/messaging/go.mod"} {
		if !slices.Contains(files, must) {
			t.Fatalf("the build's files %v lack %s (has go list's output changed?)", files, must)
		}
	}
	return files
}

// Helpers.

func deref(s *string) any {
	if s == nil {
		return nil
	}
	return *s
}

// publishes reports whether s publishes its port target as host port published on 127.0.0.1.
func publishes(s types.ServiceConfig, target, published uint32) bool {
	return slices.ContainsFunc(s.Ports, func(p types.ServicePortConfig) bool {
		return p.Target == target && p.Published == strconv.Itoa(int(published)) && p.HostIP == "127.0.0.1"
	})
}

// checkConfigReaders runs the config readers services/<a.name>/main.go calls on vars, the
// environment a deployment gives it, and fails t if the service would refuse to start with
// them. Variables read in a main.go alone (notification's SMTP_*, NOTIFY_*) have no reader to
// call from here.
func checkConfigReaders(t *testing.T, a app, vars map[string]string) {
	t.Helper()
	src, err := os.ReadFile(filepath.Join(root, "services", a.name, "main.go"))
	if err != nil {
		t.Fatal(err)
	}
	env := platform.EnvFrom(vars)
	common := platform.ReadCommon(env, ":1")
	var relaying *platform.RelaySettings
	var consuming *platform.ConsumerSettings
	if strings.Contains(string(src), "platform.ReadRelaySettings(") {
		s := platform.ReadRelaySettings(env)
		relaying = &s
	}
	if strings.Contains(string(src), "platform.ReadConsumerSettings(") {
		s := platform.ReadConsumerSettings(env)
		consuming = &s
	}
	// The senders main.go gives PoolsOf, a literal count.
	m := regexp.MustCompile(`platform\.PoolsOf\([^,()]+,[^,()]+,\s*(\d+)\)`).FindSubmatch(src)
	if m == nil {
		t.Fatalf("services/%s/main.go: no platform.PoolsOf(relay, consumer, <senders>) call found (has it changed?)", a.name)
	}
	senders, _ := strconv.Atoi(string(m[1]))
	platform.PoolsOf(relaying, consuming, senders).Check(env, common)
	if err := env.Err(); err != nil {
		t.Errorf("the service would refuse to start: %v", err)
	}
}

// goSources returns the non-test Go files the service's binary reads its configuration in.
func goSources(t *testing.T, svc string) string {
	t.Helper()
	var b strings.Builder
	for _, dir := range []string{filepath.Join(root, "services", svc), filepath.Join(root, "internal", "platform")} {
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil || len(files) == 0 {
			t.Fatalf("no Go files in %s (%v)", dir, err)
		}
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			src, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			b.Write(src)
		}
	}
	return b.String()
}

// varsMatching returns the distinct variable names captured by re in the service's sources.
func varsMatching(t *testing.T, svc string, re *regexp.Regexp) []string {
	t.Helper()
	var names []string
	for _, m := range re.FindAllStringSubmatch(goSources(t, svc), -1) {
		if !slices.Contains(names, m[1]) {
			names = append(names, m[1])
		}
	}
	slices.Sort(names)
	return names
}

// requiredVars are the variables read with Env.URL or Env.URLList, the only required kinds (config.go).
func requiredVars(t *testing.T, svc string) []string {
	t.Helper()
	names := varsMatching(t, svc, regexp.MustCompile(`\.URL(?:List)?\(\s*"([A-Z][A-Z0-9_]*)"`))
	for _, must := range []string{"DATABASE_URL", "AMQP_URL"} {
		if !slices.Contains(names, must) {
			t.Fatalf("services/%s: found required variables %v, expected %s among them (has config.go changed?)", svc, names, must)
		}
	}
	return names
}

// readVars are all the variables the service reads through Env.
func readVars(t *testing.T, svc string) []string {
	t.Helper()
	return varsMatching(t, svc, regexp.MustCompile(`\.(?:`+strings.Join(envAccessors(t), "|")+`)\(\s*"([A-Z][A-Z0-9_]*)"`))
}

// envAccessors are the methods of internal/platform's Env whose first parameter is the
// variable's name, found in its source rather than listed here, so that a new kind of
// variable (DurationOrOff was missed once) is not taken for one the services do not read.
func envAccessors(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "internal", "platform", "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range file.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Recv == nil || len(fn.Recv.List) != 1 || !fn.Name.IsExported() {
				continue
			}
			star, ok := fn.Recv.List[0].Type.(*ast.StarExpr)
			if !ok {
				continue
			}
			if id, ok := star.X.(*ast.Ident); !ok || id.Name != "Env" {
				continue
			}
			if params := fn.Type.Params.List; len(params) > 0 && len(params[0].Names) > 0 && params[0].Names[0].Name == "name" {
				if typ, ok := params[0].Type.(*ast.Ident); ok && typ.Name == "string" {
					names = append(names, fn.Name.Name)
				}
			}
		}
	}
	for _, must := range []string{"String", "URL", "Int", "Duration", "DurationOrOff", "Bool"} {
		if !slices.Contains(names, must) {
			t.Fatalf("internal/platform: found Env accessors %v, expected %s among them (has the Env reader changed?)", names, must)
		}
	}
	slices.Sort(names)
	return names
}

// initScripts returns the text of the SQL and shell scripts mounted as the postgres image's
// /docker-entrypoint-initdb.d, checking the mount on the way.
func initScripts(t *testing.T, p *types.Project) string {
	t.Helper()
	var dir string
	for _, v := range service(t, p, "postgres").Volumes {
		if v.Target == "/docker-entrypoint-initdb.d" && v.Type == types.VolumeTypeBind {
			dir = v.Source
		}
	}
	abs, _ := filepath.Abs(filepath.Join(root, "deploy", "postgres"))
	if dir != abs {
		t.Fatalf("postgres: /docker-entrypoint-initdb.d is bound to %q, want %q", dir, abs)
	}
	files, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, f := range files {
		if ext := filepath.Ext(f.Name()); f.IsDir() || (ext != ".sql" && ext != ".sh") {
			continue
		}
		src, err := os.ReadFile(filepath.Join(dir, f.Name()))
		if err != nil {
			t.Fatal(err)
		}
		b.Write(src)
		b.WriteString("\n")
	}
	if b.Len() == 0 {
		t.Fatalf("no .sql or .sh init script in %s", dir)
	}
	return b.String()
}

// initScriptRoles maps each role the init scripts create to its password.
func initScriptRoles(t *testing.T, p *types.Project) map[string]string {
	t.Helper()
	roles := map[string]string{}
	re := regexp.MustCompile(`(?is)CREATE\s+(?:ROLE|USER)\s+"?([a-z_][a-z0-9_]*)"?\s[^;]*\bPASSWORD\s+'([^']*)'`)
	for _, m := range re.FindAllStringSubmatch(initScripts(t, p), -1) {
		roles[m[1]] = m[2]
	}
	return roles
}

// instr is one Dockerfile instruction, continuation lines joined.
type instr struct{ cmd, args string }

func dockerfile(t *testing.T) []instr {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	var out []instr
	var cur strings.Builder
	for line := range strings.SplitSeq(string(raw), "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") || (trimmed == "" && cur.Len() == 0) {
			continue
		}
		if s, ok := strings.CutSuffix(trimmed, `\`); ok {
			cur.WriteString(s + " ")
			continue
		}
		cur.WriteString(trimmed)
		cmd, args, _ := strings.Cut(strings.TrimSpace(cur.String()), " ")
		out = append(out, instr{cmd: strings.ToUpper(cmd), args: strings.Join(strings.Fields(args), " ")})
		cur.Reset()
	}
	if cur.Len() > 0 {
		t.Fatal("Dockerfile ends in a line continuation")
	}
	return out
}

func lastIndex(instrs []instr, cmd string) int {
	for i := len(instrs) - 1; i >= 0; i-- {
		if instrs[i].cmd == cmd {
			return i
		}
	}
	return -1
}

func lastArgs(instrs []instr, cmd string) string {
	if i := lastIndex(instrs, cmd); i >= 0 {
		return instrs[i].args
	}
	return ""
}
