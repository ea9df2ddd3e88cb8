package deploy_test

// Start order does not matter on Kubernetes either: an init container holds order's pods back
// until the topology operator has declared the whole topology, with the rights that takes and
// no more, and their token in that container alone.

import (
	"maps"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
)

// topologyWaiter is the service whose pods wait for the topology: its events start from its
// HTTP API, and its RabbitMQ user may not declare the consumers' queues. A consumer declares
// its own, and publishes only on an event, which came after that wait.
const topologyWaiter = "order"

// serviceAccountDir is where kubectl's in-cluster configuration reads the token, the CA and
// the namespace.
const serviceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"

// declaredOnce is the wait's --for: the resource's status.observedGeneration exists. The
// topology operator sets it to the resource's generation only once a declaration succeeded, and
// leaves it as it was when one fails; kubectl 1.28 and later wait for a jsonpath given no value
// to exist.
const declaredOnce = "jsonpath={.status.observedGeneration}"

// topologyResources are the resource names, group included, of the topology operator's kinds
// in rabbitmq-topology.yaml: Exchange, Queue and Binding, in that order.
var topologyResources = []string{"exchanges.rabbitmq.com", "queues.rabbitmq.com", "bindings.rabbitmq.com"}

func TestK8sOrderWaitsForTopology(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	for name, r := range brokerRoles {
		if (r.publishes != "" && r.consumes == "") != (name == topologyWaiter) {
			t.Errorf("service %s publishes to %q and consumes %q: the services that publish without consuming must be %s alone, whose pods wait for the topology (a consumer publishes only on a delivery, which comes after that wait)", name, r.publishes, r.consumes, topologyWaiter)
		}
	}
	d, ok := m.deployments[topologyWaiter]
	if !ok {
		t.Fatalf("no Deployment %s", topologyWaiter)
	}
	spec := d.Spec.Template.Spec
	if len(spec.InitContainers) != 1 || len(spec.Containers) != 1 {
		t.Fatalf("%d init containers and %d containers, want the wait for the topology, then the service", len(spec.InitContainers), len(spec.Containers))
	}
	wait, svc := spec.InitContainers[0], spec.Containers[0]

	// kubectl, of the release whose API types these tests decode the manifests with.
	if want := "registry.k8s.io/kubectl:" + kubectlTag(t); wait.Image != want {
		t.Errorf("init container image = %q, want %q", wait.Image, want)
	}
	if len(wait.Command) > 0 {
		t.Errorf("command = %q: the image's entrypoint is kubectl, give its arguments in args", wait.Command)
	}

	// kubectl wait for every exchange, queue and binding of the topology to have been declared
	// once, each by name: a name not found fails the wait, where a selector, listed once when
	// kubectl starts, would pass over the resources `kubectl apply -k` had not created yet.
	w := parseKubectlWait(t, wait.Args)
	switch {
	case w.condition == declaredOnce:
	case strings.HasPrefix(strings.ToLower(w.condition), "condition=ready"):
		t.Errorf("--for=%s, want %s: a resource whose last reconciliation failed is not Ready, so during a broker outage an order pod rescheduled, evicted or rolled out would not start, though order takes orders with RabbitMQ away", w.condition, declaredOnce)
	case strings.ContainsAny(w.condition, `'"`):
		t.Errorf("--for=%s, want %s: no shell reads these args, so quotes reach kubectl", w.condition, declaredOnce)
	default:
		t.Errorf("--for=%s, want %s: each resource declared at least once", w.condition, declaredOnce)
	}
	if w.timeout < 5*time.Minute {
		t.Errorf("--timeout=%s, want at least 5m: a fresh cluster starts RabbitMQ first, then the operator declares", w.timeout)
	}
	if len(m.exchanges) == 0 || len(m.queues) == 0 || len(m.bindings) == 0 {
		t.Fatalf("%d exchanges, %d queues, %d bindings: the topology is missing", len(m.exchanges), len(m.queues), len(m.bindings))
	}
	var topology []string
	for _, x := range m.exchanges {
		topology = append(topology, topologyResources[0]+"/"+x.Metadata.Name)
	}
	for _, q := range m.queues {
		topology = append(topology, topologyResources[1]+"/"+q.Metadata.Name)
	}
	for _, b := range m.bindings {
		topology = append(topology, topologyResources[2]+"/"+b.Metadata.Name)
	}
	for _, r := range topology {
		if !slices.Contains(w.resources, r) {
			t.Errorf("the wait does not name %s: order may start before it exists", r)
		}
	}
	for i, r := range w.resources {
		if !slices.Contains(topology, r) {
			t.Errorf("the wait names %s, which the manifests do not declare: it would never succeed", r)
		}
		if slices.Contains(w.resources[:i], r) {
			t.Errorf("the wait names %s twice", r)
		}
	}

	// Its ServiceAccount may read those resources, nothing else.
	account := spec.ServiceAccountName
	if _, ok := m.accounts[account]; !ok || account == "default" {
		t.Fatalf("serviceAccountName %q: want a ServiceAccount of these manifests", account)
	}
	want := map[string]bool{}
	for _, r := range topologyResources {
		resource, group, _ := strings.Cut(r, ".")
		for _, verb := range []string{"get", "list", "watch"} {
			want[group+" "+resource+" "+verb] = true
		}
	}
	granted := map[string]bool{}
	for _, rb := range m.roleBindings {
		if !slices.ContainsFunc(rb.Subjects, func(s rbacv1.Subject) bool { return bindsAccount(s, account) }) {
			continue
		}
		for _, s := range rb.Subjects {
			if s.Namespace != "" {
				t.Errorf("RoleBinding %s: subject %s names namespace %q; leave it out, the binding's own", rb.Name, s.Name, s.Namespace)
			}
		}
		role, ok := m.roles[rb.RoleRef.Name]
		if rb.RoleRef.APIGroup != rbacv1.GroupName || rb.RoleRef.Kind != "Role" || !ok {
			t.Errorf("RoleBinding %s: roleRef %+v, want a Role of these manifests", rb.Name, rb.RoleRef)
			continue
		}
		for _, rule := range role.Rules {
			if len(rule.ResourceNames) > 0 || len(rule.NonResourceURLs) > 0 {
				t.Errorf("Role %s: rule %+v names resources or URLs, which this test does not hold to the wait's names; grant the kinds", role.Name, rule)
			}
			for _, g := range rule.APIGroups {
				for _, r := range rule.Resources {
					for _, v := range rule.Verbs {
						granted[g+" "+r+" "+v] = true
					}
				}
			}
		}
	}
	for g := range granted {
		if !want[g] {
			t.Errorf("ServiceAccount %s may %q: more than the wait needs", account, g)
		}
	}
	for g := range want {
		if !granted[g] {
			t.Errorf("ServiceAccount %s may not %q, which the wait needs", account, g)
		}
	}

	// The token is mounted in the init container alone.
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("automountServiceAccountToken is not false: the service's container would get the token too")
	}
	if mounts := tokenMounts(m, spec, svc); len(mounts) > 0 {
		t.Errorf("the service's container mounts %v", mounts)
	}
	i := slices.IndexFunc(wait.VolumeMounts, func(vm corev1.VolumeMount) bool { return path.Clean(vm.MountPath) == serviceAccountDir })
	if i < 0 || !wait.VolumeMounts[i].ReadOnly || wait.VolumeMounts[i].SubPath != "" {
		t.Fatalf("init container mounts %+v, want a volume read-only at %s", wait.VolumeMounts, serviceAccountDir)
	}
	v := slices.IndexFunc(spec.Volumes, func(v corev1.Volume) bool { return v.Name == wait.VolumeMounts[i].Name })
	if v < 0 || spec.Volumes[v].Projected == nil {
		t.Fatalf("volume %s: want a projected volume", wait.VolumeMounts[i].Name)
	}
	files := map[string]string{}
	for _, src := range spec.Volumes[v].Projected.Sources {
		switch {
		case src.ServiceAccountToken != nil && src.ServiceAccountToken.Audience == "":
			files[src.ServiceAccountToken.Path] = "the token"
		case src.ConfigMap != nil && src.ConfigMap.Name == "kube-root-ca.crt":
			for _, it := range src.ConfigMap.Items {
				files[it.Path] = "ConfigMap kube-root-ca.crt key " + it.Key
			}
		case src.DownwardAPI != nil:
			for _, it := range src.DownwardAPI.Items {
				if it.FieldRef != nil {
					files[it.Path] = "field " + it.FieldRef.FieldPath
				}
			}
		default:
			files["?"] = "a source kubectl does not read"
		}
	}
	if want := map[string]string{
		"token": "the token", "ca.crt": "ConfigMap kube-root-ca.crt key ca.crt", "namespace": "field metadata.namespace",
	}; !maps.Equal(files, want) {
		t.Errorf("volume %s holds %v, want %v", spec.Volumes[v].Name, files, want)
	}

	// As strict as the service, and small.
	checkSecurity(t, spec, wait)
	req, svcReq := wait.Resources.Requests, svc.Resources.Requests
	limit, hasLimit := wait.Resources.Limits[corev1.ResourceMemory]
	switch {
	case req.Cpu().IsZero() || req.Memory().IsZero() || !hasLimit:
		t.Errorf("init container resources = %+v, want CPU and memory requests and a memory limit", wait.Resources)
	case req.Cpu().Cmp(*svcReq.Cpu()) > 0 || req.Memory().Cmp(*svcReq.Memory()) > 0:
		t.Errorf("init container requests %s CPU and %s memory, over the service's %s and %s: it would raise the pod's",
			req.Cpu(), req.Memory(), svcReq.Cpu(), svcReq.Memory())
	case limit.Cmp(*req.Memory()) < 0:
		t.Errorf("init container memory limit %s is under its request %s", limit.String(), req.Memory().String())
	}
}

// bindsAccount reports whether subject s of a RoleBinding takes in the ServiceAccount
// account of the binding's namespace: by name, or as one of the users or groups its token
// authenticates as.
func bindsAccount(s rbacv1.Subject, account string) bool {
	switch s.Kind {
	case rbacv1.ServiceAccountKind:
		return s.Name == account
	case rbacv1.UserKind:
		return strings.HasPrefix(s.Name, "system:serviceaccount:") && strings.HasSuffix(s.Name, ":"+account)
	case rbacv1.GroupKind:
		return s.Name == "system:authenticated" || strings.HasPrefix(s.Name, "system:serviceaccounts")
	}
	return false
}

// kubectlWait is what a kubectl wait command line asks.
type kubectlWait struct {
	resources []string // TYPE/NAME, as written
	condition string   // --for, as written
	timeout   time.Duration
}

// parseKubectlWait reads args, kubectl's arguments, as kubectl wait TYPE/NAME… with --for and
// --timeout, each once; any other flag fails the test, since it could change what is waited
// for (--selector, --all, --namespace, --field-selector), and so does a TYPE without a NAME.
func parseKubectlWait(t *testing.T, args []string) kubectlWait {
	t.Helper()
	if len(args) == 0 || args[0] != "wait" {
		t.Fatalf("args = %q, want kubectl wait …", args)
	}
	var w kubectlWait
	seen := map[string]bool{}
	for i := 1; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") {
			if kind, name, ok := strings.Cut(a, "/"); !ok || kind == "" || name == "" || strings.Contains(kind, ",") {
				t.Errorf("args: %q, want TYPE/NAME: a type alone waits for what exists when kubectl starts", a)
			}
			w.resources = append(w.resources, a)
			continue
		}
		name, value, inline := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !inline && i+1 < len(args) {
			i++
			value = args[i]
		}
		if seen[name] {
			t.Errorf("args: --%s given twice", name)
		}
		seen[name] = true
		switch name {
		case "for":
			w.condition = value
		case "timeout":
			d, err := time.ParseDuration(value)
			if err != nil {
				t.Errorf("--timeout=%s: %v", value, err)
			}
			w.timeout = d
		default:
			t.Errorf("args: %s, a flag this test does not check", a)
		}
	}
	if len(w.resources) == 0 {
		t.Fatal("args name no resource to wait for")
	}
	return w
}

// kubectlTag is the kubectl release of the API types (k8s.io/api v0.X.Y in go.mod, kubectl
// v1.X.Y) these tests decode the manifests with.
func kubectlTag(t *testing.T) string {
	t.Helper()
	goMod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	v := regexp.MustCompile(`(?m)^\s*k8s\.io/api v0\.(\d+\.\d+)\s*$`).FindSubmatch(goMod)
	if v == nil {
		t.Fatal("go.mod requires no k8s.io/api v0.X.Y")
	}
	return "v1." + string(v[1])
}

// tokenMounts lists what in container c could give it a service-account token: a mount at or
// around the path kubectl reads it from, a projected token, or a Secret of a token.
func tokenMounts(m *k8sManifests, spec corev1.PodSpec, c corev1.Container) []string {
	var found []string
	for _, vm := range c.VolumeMounts {
		mounted, tokens := path.Clean(vm.MountPath)+"/", serviceAccountDir+"/"
		// At the path, under it, or above it (a mount of /var/run holds the path too).
		if strings.HasPrefix(mounted, tokens) || strings.HasPrefix(tokens, mounted) {
			found = append(found, vm.Name+" at "+vm.MountPath)
		}
		for _, v := range spec.Volumes {
			if v.Name != vm.Name {
				continue
			}
			if v.Projected != nil && slices.ContainsFunc(v.Projected.Sources, func(s corev1.VolumeProjection) bool { return s.ServiceAccountToken != nil }) {
				found = append(found, vm.Name+", a projected token")
			}
			if v.Secret != nil && m.secrets[v.Secret.SecretName].Type == corev1.SecretTypeServiceAccountToken {
				found = append(found, vm.Name+", a token Secret")
			}
		}
	}
	return found
}
