package deploy_test

import (
	"bufio"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/types"
)

// clusterProfile is the compose profile of a three-node RabbitMQ cluster and a second copy of
// the services on it: nothing of it starts with a plain `docker compose up`.
const clusterProfile = "cluster"

// clusterNodes are the cluster profile's RabbitMQ services. Each one's hostname is its service
// name, so its node name, rabbit@<hostname>, resolves on the compose network.
var clusterNodes = []string{"rabbitmq-1", "rabbitmq-2", "rabbitmq-3"}

// The conf.d file that makes the nodes find each other.
const (
	clusterConf      = "deploy/rabbitmq/40-cluster.conf"
	clusterConfMount = "/etc/rabbitmq/conf.d/40-cluster.conf"
)

// clusterReplicas is how many replicas of each service the profile runs: more than one, or
// it would show nothing that the default profile does not.
const clusterReplicas = 2

// clusterUI is the one port the profile publishes: the management UI of one node.
var clusterUI = struct {
	node      string
	port      uint32 // in the container
	published uint32 // on the host, with variable unset
	variable  string
}{"rabbitmq-1", 15672, 15680, "RABBITMQ_CLUSTER_UI_PORT"}

// clusterService is the name of app a's copy in the cluster profile.
func clusterService(a app) string { return a.name + "-cluster" }

// clusterDatabase is the database of app a's copy in the cluster profile: not a.database,
// since `docker compose --profile cluster up` starts the default services too, and two relays
// of one outbox publishing to two different brokers would split its events between them.
func clusterDatabase(a app) string { return strings.TrimSuffix(a.database, "_db") + "_cluster_db" }

// clusterServices are all the services of the cluster profile.
func clusterServices() []string {
	names := slices.Clone(clusterNodes)
	for _, a := range apps {
		names = append(names, clusterService(a))
	}
	return names
}

func loadCluster(t *testing.T, env ...string) *types.Project {
	t.Helper()
	return loadComposeProfiles(t, "docker-compose.yml", env, clusterProfile)
}

// loadEveryProfile loads docker-compose.yml with every profile its services name enabled, for
// the tests that hold every container to the same rules.
func loadEveryProfile(t *testing.T) *types.Project {
	t.Helper()
	var profiles []string
	for _, s := range loadProject(t).DisabledServices {
		for _, p := range s.Profiles {
			if !slices.Contains(profiles, p) {
				profiles = append(profiles, p)
			}
		}
	}
	for _, want := range []string{observabilityProfile, clusterProfile} {
		if !slices.Contains(profiles, want) {
			t.Fatalf("docker-compose.yml names the profiles %v, want %s among them", profiles, want)
		}
	}
	return loadComposeProfiles(t, "docker-compose.yml", nil, profiles...)
}

// The plain `docker compose up` runs none of the cluster profile; --profile cluster adds the
// three nodes and the three services' copies, and nothing else.
func TestComposeClusterProfile(t *testing.T) {
	t.Parallel()
	plain := loadProject(t)
	for _, name := range clusterServices() {
		if _, ok := plain.Services[name]; ok {
			t.Errorf("%s runs without the %s profile", name, clusterProfile)
		}
		if s, ok := plain.DisabledServices[name]; !ok || !slices.Equal(s.Profiles, []string{clusterProfile}) {
			t.Errorf("%s: profiles %v, want [%s]", name, s.Profiles, clusterProfile)
		}
	}
	p := loadCluster(t)
	if got, want := len(p.Services), len(plain.Services)+len(clusterServices()); got != want {
		t.Errorf("with the profile, %d services run, want %d", got, want)
	}
	for _, name := range clusterServices() {
		if s := service(t, p, name); s.Restart == "" || s.Restart == types.RestartPolicyNo {
			t.Errorf("%s: restart = %q, want a restart policy", name, s.Restart)
		}
	}
}

// The three nodes run the single broker's image with its users, find each other from the
// list in deploy/rabbitmq/40-cluster.conf, share one Erlang cookie and keep their data apart.
func TestComposeClusterNodes(t *testing.T) {
	t.Parallel()
	p := loadCluster(t)
	conf := readRabbitConf(t, clusterConf)

	// Peer discovery from the config file, which lists exactly the three nodes by the names
	// they take.
	if b := conf["cluster_formation.peer_discovery_backend"]; b != "classic_config" && b != "rabbit_peer_discovery_classic_config" {
		t.Errorf("%s: cluster_formation.peer_discovery_backend = %q, want classic_config", clusterConf, b)
	}
	var listed, want []string
	nodeKey := regexp.MustCompile(`^cluster_formation\.classic_config\.nodes\.\d+$`)
	for key, value := range conf {
		if nodeKey.MatchString(key) {
			listed = append(listed, value)
		}
	}
	for _, node := range clusterNodes {
		want = append(want, "rabbit@"+service(t, p, node).Hostname)
	}
	slices.Sort(listed)
	slices.Sort(want)
	if !slices.Equal(listed, want) {
		t.Errorf("%s lists the nodes %v, want %v (rabbit@ and each node's hostname, once)", clusterConf, listed, want)
	}
	checkNoPartitionHandling(t, clusterConf, conf)
	// The definitions' queues are declared by the first node alone; the others must get
	// replicas when they join.
	if conf["quorum_queue.continuous_membership_reconciliation.enabled"] != "true" ||
		conf["quorum_queue.continuous_membership_reconciliation.target_group_size"] != strconv.Itoa(len(clusterNodes)) {
		t.Errorf("%s: want quorum_queue.continuous_membership_reconciliation enabled with target_group_size %d", clusterConf, len(clusterNodes))
	}
	// The single broker stays alone.
	for target := range bindMounts(t, service(t, p, "rabbitmq")) {
		if target == clusterConfMount {
			t.Errorf("rabbitmq mounts %s: the default profile's broker is no cluster member", clusterConfMount)
		}
	}

	var cookie string
	volumes := map[string]string{}
	for i, node := range clusterNodes {
		s := service(t, p, node)
		if s.Hostname != node {
			t.Errorf("%s: hostname %q, want %q: the node name rabbit@<hostname> must resolve on the compose network, and the data directory is named after it", node, s.Hostname, node)
		}
		if v, ok := env(s, "RABBITMQ_NODENAME"); ok && v != "rabbit@"+s.Hostname {
			t.Errorf("%s: RABBITMQ_NODENAME = %q, which %s does not list", node, v, clusterConf)
		}
		// The users and permissions of the single broker, and no default user.
		importedDefinitions(t, s)
		for _, name := range []string{"RABBITMQ_DEFAULT_USER", "RABBITMQ_DEFAULT_PASS"} {
			if v, ok := env(s, name); ok {
				t.Errorf("%s: %s = %q; the users come from %s", node, name, v, definitionsFile)
			}
		}
		if at := mountedAt(t, s, clusterConf); at != clusterConfMount {
			t.Errorf("%s: %s is mounted at %s, want %s", node, clusterConf, at, clusterConfMount)
		}

		// A named volume of its own: the node's identity and its queue replicas live there.
		data := ""
		for _, v := range s.Volumes {
			if v.Target == "/var/lib/rabbitmq" && v.Type == types.VolumeTypeVolume {
				data = v.Source
			}
		}
		switch _, declared := p.Volumes[data]; {
		case data == "" || !declared:
			t.Errorf("%s: no named volume at /var/lib/rabbitmq (%q)", node, data)
		case data == "rabbitmq-data":
			t.Errorf("%s: uses the single broker's volume %s", node, data)
		case volumes[data] != "":
			t.Errorf("%s: shares the volume %s with %s", node, data, volumes[data])
		}
		volumes[data] = node

		c := erlangCookie(t, s)
		if i == 0 {
			cookie = c
		} else if c != cookie {
			t.Errorf("%s: its Erlang cookie differs from %s's: the nodes could not cluster", node, clusterNodes[0])
		}
	}
}

// erlangCookie returns the Erlang cookie node s runs with, checking that the CLI tools in its
// container (the healthcheck's, `docker compose exec`'s) use the same one. RabbitMQ 4.x applies
// RABBITMQ_ERLANG_COOKIE in the server and in the CLI tools over any other cookie; without it,
// -setcookie in their VM arguments; without either, the node generates one at its first boot,
// different on every node.
func erlangCookie(t *testing.T, s types.ServiceConfig) string {
	t.Helper()
	setcookie := func(variable string) string {
		v, _ := env(s, variable)
		args := strings.Fields(v)
		if i := slices.Index(args, "-setcookie"); i >= 0 && i+1 < len(args) {
			return args[i+1]
		}
		return ""
	}
	server, cli := setcookie("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"), setcookie("RABBITMQ_CTL_ERL_ARGS")
	if v, ok := env(s, "RABBITMQ_ERLANG_COOKIE"); ok {
		server, cli = v, v
	}
	switch {
	case server == "":
		t.Errorf("%s: no Erlang cookie set: each node would generate its own and none could join another", s.Name)
	case cli != server:
		t.Errorf("%s: the CLI tools' Erlang cookie differs from the server's: the healthcheck could not reach the node", s.Name)
	case !regexp.MustCompile(`^[A-Za-z0-9]{1,255}$`).MatchString(server):
		t.Errorf("%s: the Erlang cookie is not 1 to 255 letters and digits", s.Name)
	}
	return server
}

// Each service's copy runs as the default one does, two replicas of it, but on the three
// nodes, on databases of its own, and publishing no port.
func TestComposeClusterApps(t *testing.T) {
	t.Parallel()
	plain := loadProject(t)
	p := loadCluster(t)
	defs := readDefinitions(t) // which every node imports (TestComposeClusterNodes)
	roles := initScriptRoles(t, p)

	// The databases the default profile's services use.
	usedBy := map[string]string{}
	for name, s := range plain.Services {
		if v, ok := env(s, "DATABASE_URL"); ok {
			if u, err := url.Parse(v); err == nil {
				usedBy[strings.TrimPrefix(u.Path, "/")] = name
			}
		}
	}

	for _, a := range apps {
		t.Run(a.name, func(t *testing.T) {
			t.Parallel()
			s := service(t, p, clusterService(a))
			checkApp(t, s, a, appTarget{brokers: clusterNodes, database: clusterDatabase(a)}, defs, roles)
			if by, ok := usedBy[clusterDatabase(a)]; ok {
				t.Errorf("its database %s is %s's too: two relays of one outbox publishing to two brokers would split its events", clusterDatabase(a), by)
			}
			if _, ok := s.DependsOn["rabbitmq"]; ok {
				t.Error("depends on the single broker, which it does not use")
			}

			// Replicas: a fixed host port or container name would let only one of them start.
			if n := s.GetScale(); n != clusterReplicas {
				t.Errorf("%d replicas, want %d (deploy.replicas)", n, clusterReplicas)
			}
			if len(s.Ports) != 0 {
				t.Errorf("publishes %+v, want no port", s.Ports)
			}
			if s.ContainerName != "" {
				t.Errorf("container_name %q, want none", s.ContainerName)
			}

			// The same configuration as the default service but for where it connects.
			def := service(t, plain, a.name)
			for name, v := range def.Environment {
				if name == "AMQP_URL" || name == "DATABASE_URL" {
					continue
				}
				if got, ok := s.Environment[name]; !ok || deref(got) != deref(v) {
					t.Errorf("%s = %v, want %v as %s has it", name, deref(got), deref(v), a.name)
				}
			}
			for name := range s.Environment {
				if _, ok := def.Environment[name]; !ok {
					t.Errorf("sets %s, which %s does not", name, a.name)
				}
			}
		})
	}
}

// Only the cluster's management UI is published, on 127.0.0.1, moved by its variable.
func TestComposeClusterPorts(t *testing.T) {
	t.Parallel()
	p := loadCluster(t)
	for _, name := range clusterServices() {
		s := service(t, p, name)
		want := 0
		if name == clusterUI.node {
			want = 1
		}
		if len(s.Ports) != want {
			t.Errorf("%s: publishes %d ports (%+v), want %d", name, len(s.Ports), s.Ports, want)
		}
	}
	if s := service(t, p, clusterUI.node); !publishes(s, clusterUI.port, clusterUI.published) {
		t.Errorf("%s: ports = %+v, want 127.0.0.1:%d:%d with %s unset", clusterUI.node, s.Ports, clusterUI.published, clusterUI.port, clusterUI.variable)
	}
	const moved = 21500
	if s := service(t, loadCluster(t, fmt.Sprintf("%s=%d", clusterUI.variable, moved)), clusterUI.node); !publishes(s, clusterUI.port, moved) {
		t.Errorf("%s: with %s=%d, ports = %+v, want 127.0.0.1:%d:%d", clusterUI.node, clusterUI.variable, moved, s.Ports, moved, clusterUI.port)
	}
}

// readRabbitConf reads a RabbitMQ configuration file of the repository into a map.
func readRabbitConf(t *testing.T, rel string) map[string]string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		t.Fatal(err)
	}
	return parseRabbitConf(t, rel, string(raw))
}

// parseRabbitConf parses RabbitMQ configuration (key = value lines, # comments) read from
// where, refusing a key set twice.
func parseRabbitConf(t *testing.T, where, text string) map[string]string {
	t.Helper()
	conf := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(text))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		key, value, ok := strings.Cut(line, "=")
		key, value = strings.TrimSpace(key), strings.TrimSpace(value)
		if !ok || key == "" || value == "" {
			t.Fatalf("%s:%d: not key = value: %q", where, n, line)
		}
		if _, dup := conf[key]; dup {
			t.Fatalf("%s:%d: %s is set twice", where, n, key)
		}
		conf[key] = value
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return conf
}

// checkNoPartitionHandling fails t if conf, configuration for nodes of the release compose
// runs (4.3 or later: TestComposeImages), sets a cluster_partition_handling key: RabbitMQ 4.3
// accepts them but they have no effect, Mnesia being gone, and a reader would trust them.
func checkNoPartitionHandling(t *testing.T, where string, conf map[string]string) {
	t.Helper()
	for key := range conf {
		if key == "cluster_partition_handling" || strings.HasPrefix(key, "cluster_partition_handling.") {
			t.Errorf("%s sets %s, which RabbitMQ 4.3 ignores (Khepri and the quorum queues follow Raft): remove it", where, key)
		}
	}
}
