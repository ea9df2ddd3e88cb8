package deploy_test

// The Kubernetes manifests of deploy/k8s, checked with no cluster: every document of every
// file kustomization.yaml lists is decoded into typed objects, or validated against the
// operator's CRD schema, with unknown fields rejected (as `kubectl apply`, whose field
// validation is strict by default, would reject them), and then held to what the services'
// code needs: probes on the right port, the variables their config readers require,
// credentials that agree between the servers and the URLs, shutdown timing, security.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/santhosh-tekuri/jsonschema/v6"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/outboxkit/outbox-inbox/internal/platform"
)

var k8sDir = filepath.Join(root, "deploy", "k8s")

// measuredPeakRSS is the highest VmHWM the three services reached under load (notification
// sending to SMTP, 32,300 kB: the table at the top of deploy/k8s/order.yaml). Memory requests
// must be at least twice that; measure again when the services change much.
const measuredPeakRSS = 32300 * 1024

// shutdownContract is how long a service may take to exit after SIGTERM (platform.HardStop
// enforces it from inside).
const shutdownContract = 10

// The kinds the manifests may hold. Anything else fails the decoding test, so a new kind
// comes with a decision on how to check it.
type k8sManifests struct {
	configMaps   map[string]corev1.ConfigMap
	secrets      map[string]corev1.Secret
	services     map[string]corev1.Service
	deployments  map[string]appsv1.Deployment
	pdbs         []policyv1.PodDisruptionBudget
	accounts     map[string]corev1.ServiceAccount
	roles        map[string]rbacv1.Role
	roleBindings []rbacv1.RoleBinding
	rabbits      []rabbitmqCluster
	pgClusters   []cnpgCluster
	databases    []cnpgDatabase
	exchanges    []topologyExchange
	queues       []topologyQueue
	bindings     []topologyBinding
	rmqUsers     []topologyUser
	rmqPerms     []topologyPermission
	kust         kustomization
	// generated are the ConfigMaps of kustomization.yaml's generators, also in configMaps.
	generated map[string]configMapGenerator
}

// kustomization holds the fields deploy/k8s/kustomization.yaml may use; it is decoded
// strictly too, so a field added there is a field this test learns about.
type kustomization struct {
	APIVersion string      `json:"apiVersion"`
	Kind       string      `json:"kind"`
	Namespace  string      `json:"namespace,omitempty"`
	Generators []string    `json:"generators,omitempty"`
	Resources  []string    `json:"resources"`
	Images     []kustImage `json:"images,omitempty"`
}

// configMapGenerator is the configuration of kustomize's builtin ConfigMapGenerator, as a file
// listed under generators: holds it, in the fields config.yaml may use.
type configMapGenerator struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name string `json:"name"`
	} `json:"metadata"`
	Options struct {
		Labels                map[string]string `json:"labels,omitempty"`
		DisableNameSuffixHash bool              `json:"disableNameSuffixHash,omitempty"`
	} `json:"options"`
	Literals []string `json:"literals"`
}

type kustImage struct {
	Name    string `json:"name"`
	NewName string `json:"newName,omitempty"`
	NewTag  string `json:"newTag,omitempty"`
	Digest  string `json:"digest,omitempty"`
}

// The fields of the custom resources these tests look at. The whole documents are first
// validated against the CRD schemas (unknown fields rejected); these partial views are
// decoded leniently afterwards, only to read values.
type rabbitmqCluster struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Spec     struct {
		Replicas  *int32                       `json:"replicas"`
		Image     string                       `json:"image"`
		Resources *corev1.ResourceRequirements `json:"resources"`
		Rabbitmq  struct {
			AdditionalConfig string `json:"additionalConfig"`
		} `json:"rabbitmq"`
		SecretBackend struct {
			ExternalSecret struct {
				Name string `json:"name"`
			} `json:"externalSecret"`
		} `json:"secretBackend"`
	} `json:"spec"`
}

type cnpgCluster struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Spec     struct {
		Instances  int    `json:"instances"`
		ImageName  string `json:"imageName"`
		PostgreSQL struct {
			Parameters  map[string]string `json:"parameters"`
			PgHBA       []string          `json:"pg_hba"`
			Synchronous *struct {
				Method         string `json:"method"`
				Number         int    `json:"number"`
				DataDurability string `json:"dataDurability"`
				FailoverQuorum bool   `json:"failoverQuorum"`
			} `json:"synchronous"`
		} `json:"postgresql"`
		MinSyncReplicas int `json:"minSyncReplicas"`
		MaxSyncReplicas int `json:"maxSyncReplicas"`
		Managed         struct {
			Roles []cnpgRole `json:"roles"`
		} `json:"managed"`
		Resources corev1.ResourceRequirements `json:"resources"`
		Storage   struct {
			Size string `json:"size"`
		} `json:"storage"`
	} `json:"spec"`
}

type cnpgRole struct {
	Name           string `json:"name"`
	Ensure         string `json:"ensure"`
	Login          bool   `json:"login"`
	PasswordSecret *struct {
		Name string `json:"name"`
	} `json:"passwordSecret"`
}

type cnpgDatabase struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Spec     struct {
		Cluster struct {
			Name string `json:"name"`
		} `json:"cluster"`
		Name   string `json:"name"`
		Owner  string `json:"owner"`
		Ensure string `json:"ensure"`
	} `json:"spec"`
}

// The Messaging Topology Operator's resources. A field the CRD defaults (vhost, an exchange's
// type) is empty here when the manifest leaves it out.
type topologyClusterRef struct {
	Name             string `json:"name"`
	Namespace        string `json:"namespace"`
	ConnectionSecret *struct {
		Name string `json:"name"`
	} `json:"connectionSecret"`
}

type topologyExchange struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Spec     struct {
		Name                     string             `json:"name"`
		Vhost                    string             `json:"vhost"`
		Type                     string             `json:"type"`
		Durable                  bool               `json:"durable"`
		AutoDelete               bool               `json:"autoDelete"`
		Arguments                map[string]any     `json:"arguments"`
		RabbitmqClusterReference topologyClusterRef `json:"rabbitmqClusterReference"`
	} `json:"spec"`
}

type topologyQueue struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Spec     struct {
		Name                     string             `json:"name"`
		Vhost                    string             `json:"vhost"`
		Type                     string             `json:"type"`
		Durable                  *bool              `json:"durable"`
		AutoDelete               bool               `json:"autoDelete"`
		DeletionPolicy           string             `json:"deletionPolicy"`
		Arguments                map[string]any     `json:"arguments"`
		RabbitmqClusterReference topologyClusterRef `json:"rabbitmqClusterReference"`
	} `json:"spec"`
}

type topologyBinding struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Spec     struct {
		Vhost                    string             `json:"vhost"`
		Source                   string             `json:"source"`
		Destination              string             `json:"destination"`
		DestinationType          string             `json:"destinationType"`
		RoutingKey               string             `json:"routingKey"`
		Arguments                map[string]any     `json:"arguments"`
		RabbitmqClusterReference topologyClusterRef `json:"rabbitmqClusterReference"`
	} `json:"spec"`
}

type topologyUser struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Spec     struct {
		Tags                    []string `json:"tags"`
		ImportCredentialsSecret *struct {
			Name string `json:"name"`
		} `json:"importCredentialsSecret"`
		RabbitmqClusterReference topologyClusterRef `json:"rabbitmqClusterReference"`
	} `json:"spec"`
}

type topologyPermission struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Spec     struct {
		Vhost         string `json:"vhost"`
		User          string `json:"user"`
		UserReference *struct {
			Name string `json:"name"`
		} `json:"userReference"`
		Permissions struct {
			Configure string `json:"configure"`
			Write     string `json:"write"`
			Read      string `json:"read"`
		} `json:"permissions"`
		RabbitmqClusterReference topologyClusterRef `json:"rabbitmqClusterReference"`
	} `json:"spec"`
}

// loadK8s reads the manifests once for all the tests.
var loadK8s = sync.OnceValues(readK8sManifests)

func k8s(t *testing.T) *k8sManifests { t.Helper(); return loaded(t, loadK8s) }

// loaded is what load read, or t's end.
func loaded[T any](t *testing.T, load func() (T, error)) T {
	t.Helper()
	v, err := load()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func readK8sManifests() (*k8sManifests, error) {
	m := newK8sManifests()
	err := readKustomization(k8sDir, &m.kust, func() []string { return m.kust.Resources }, m.add)
	for _, file := range m.kust.Generators {
		docs, gerr := yamlDocuments(filepath.Join(k8sDir, file))
		if gerr != nil {
			err = errors.Join(err, fmt.Errorf("%s: %w", file, gerr))
			continue
		}
		for i, doc := range docs {
			if gerr := m.addGenerator(doc); gerr != nil {
				err = errors.Join(err, fmt.Errorf("%s, document %d: %w", file, i+1, gerr))
			}
		}
	}
	return m, err
}

// addGenerator decodes a ConfigMapGenerator strictly and files the ConfigMap kustomize makes
// of it, under the generator's name, which kustomize writes into the Deployments with its
// hash suffix.
func (m *k8sManifests) addGenerator(doc []byte) error {
	var g configMapGenerator
	if err := decodeJSONStrict(doc, &g); err != nil {
		return err
	}
	if g.APIVersion != "builtin" || g.Kind != "ConfigMapGenerator" {
		return fmt.Errorf("%s %s: want a builtin ConfigMapGenerator, the only generator the tests read", g.APIVersion, g.Kind)
	}
	if _, dup := m.configMaps[g.Metadata.Name]; dup || g.Metadata.Name == "" {
		return fmt.Errorf("ConfigMapGenerator %q: no name, or one another ConfigMap has", g.Metadata.Name)
	}
	data := map[string]string{}
	for _, lit := range g.Literals {
		// KEY=VALUE, split at the first =, the value as written: a quote would be kustomize's
		// to strip or keep.
		k, v, ok := strings.Cut(lit, "=")
		if !ok || k == "" || strings.ContainsAny(v[:min(len(v), 1)], `"'`) {
			return fmt.Errorf("ConfigMapGenerator %s: literal %q is not KEY=VALUE with an unquoted value", g.Metadata.Name, lit)
		}
		if _, dup := data[k]; dup {
			return fmt.Errorf("ConfigMapGenerator %s: %s given twice", g.Metadata.Name, k)
		}
		data[k] = v
	}
	m.configMaps[g.Metadata.Name] = corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: g.Metadata.Name, Labels: g.Options.Labels},
		Data:       data,
	}
	m.generated[g.Metadata.Name] = g
	return nil
}

func newK8sManifests() *k8sManifests {
	return &k8sManifests{
		configMaps: map[string]corev1.ConfigMap{}, secrets: map[string]corev1.Secret{},
		services: map[string]corev1.Service{}, deployments: map[string]appsv1.Deployment{},
		accounts: map[string]corev1.ServiceAccount{}, roles: map[string]rbacv1.Role{},
		generated: map[string]configMapGenerator{},
	}
}

// readKustomization decodes dir's kustomization.yaml strictly into kust, a kustomize
// Kustomization, then hands every document of every file resources lists to add, with the
// vendored CRDs; it returns every error met.
func readKustomization(dir string, kust any, resources func() []string, add func(map[string]*crd, []byte) error) error {
	name := filepath.Join(filepath.Base(dir), "kustomization.yaml")
	raw, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		return err
	}
	if err := decodeYAMLStrict(raw, kust); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	var head struct{ APIVersion, Kind string }
	if err := yaml.Unmarshal(raw, &head); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	if head.APIVersion != "kustomize.config.k8s.io/v1beta1" || head.Kind != "Kustomization" {
		return fmt.Errorf("%s: apiVersion %q kind %q, want kustomize.config.k8s.io/v1beta1 Kustomization", name, head.APIVersion, head.Kind)
	}
	crds, err := loadCRDs(filepath.Join(k8sDir, "testdata", "crds"))
	if err != nil {
		return err
	}
	var errs []error
	for _, file := range resources() {
		docs, err := yamlDocuments(filepath.Join(dir, file))
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", file, err))
			continue
		}
		for i, doc := range docs {
			if err := add(crds, doc); err != nil {
				errs = append(errs, fmt.Errorf("%s, document %d: %w", file, i+1, err))
			}
		}
	}
	return errors.Join(errs...)
}

// docHead is what every document says of itself.
type docHead struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
}

// readHead reads doc's head, which must name the document and no namespace: the manifests
// apply into whatever namespace kustomize or kubectl gives them.
func readHead(doc []byte) (head docHead, err error) {
	if err := json.Unmarshal(doc, &head); err != nil {
		return head, err
	}
	if head.Metadata.Name == "" {
		return head, fmt.Errorf("%s %s has no metadata.name", head.APIVersion, head.Kind)
	}
	if head.Metadata.Namespace != "" {
		return head, fmt.Errorf("%s %s names namespace %q; leave it to kustomization or kubectl", head.Kind, head.Metadata.Name, head.Metadata.Namespace)
	}
	return head, nil
}

// decodeNamed decodes doc strictly into a T and files it by its name, which no other document
// of its kind may have.
func decodeNamed[T any](doc []byte, head docHead, into map[string]T) error {
	var o T
	if err := decodeJSONStrict(doc, &o); err != nil {
		return fmt.Errorf("%s %s %s: %w", head.APIVersion, head.Kind, head.Metadata.Name, err)
	}
	if _, have := into[head.Metadata.Name]; have {
		return fmt.Errorf("%s %s is defined twice", head.Kind, head.Metadata.Name)
	}
	into[head.Metadata.Name] = o
	return nil
}

// decodeListed decodes doc strictly into a T and appends it to into.
func decodeListed[T any](doc []byte, head docHead, into *[]T) error {
	var o T
	if err := decodeJSONStrict(doc, &o); err != nil {
		return fmt.Errorf("%s %s %s: %w", head.APIVersion, head.Kind, head.Metadata.Name, err)
	}
	*into = append(*into, o)
	return nil
}

// add decodes one document (JSON) by its kind, strictly, and files it.
func (m *k8sManifests) add(crds map[string]*crd, doc []byte) error {
	head, err := readHead(doc)
	if err != nil {
		return err
	}
	what := head.APIVersion + " " + head.Kind
	name := head.Metadata.Name
	switch what {
	case "v1 ConfigMap":
		return decodeNamed(doc, head, m.configMaps)
	case "v1 Secret":
		return decodeNamed(doc, head, m.secrets)
	case "v1 Service":
		return decodeNamed(doc, head, m.services)
	case "apps/v1 Deployment":
		return decodeNamed(doc, head, m.deployments)
	case "policy/v1 PodDisruptionBudget":
		return decodeListed(doc, head, &m.pdbs)
	case "v1 ServiceAccount":
		return decodeNamed(doc, head, m.accounts)
	case "rbac.authorization.k8s.io/v1 Role":
		return decodeNamed(doc, head, m.roles)
	case "rbac.authorization.k8s.io/v1 RoleBinding":
		return decodeListed(doc, head, &m.roleBindings)
	}
	c, ok := crds[head.APIVersion+"/"+head.Kind]
	if !ok {
		return fmt.Errorf("%s: no check for this kind (the decoding test knows v1 ConfigMap, Secret, Service and ServiceAccount, apps/v1 Deployment, policy/v1 PodDisruptionBudget, rbac.authorization.k8s.io/v1 Role and RoleBinding, and the CRDs in deploy/k8s/testdata/crds)", what)
	}
	if err := c.validate(doc); err != nil {
		return fmt.Errorf("%s %s: %w", what, name, err)
	}
	var into any
	switch head.Kind {
	case "RabbitmqCluster":
		m.rabbits = append(m.rabbits, rabbitmqCluster{})
		into = &m.rabbits[len(m.rabbits)-1]
	case "Cluster":
		m.pgClusters = append(m.pgClusters, cnpgCluster{})
		into = &m.pgClusters[len(m.pgClusters)-1]
	case "Database":
		m.databases = append(m.databases, cnpgDatabase{})
		into = &m.databases[len(m.databases)-1]
	case "Exchange":
		m.exchanges = append(m.exchanges, topologyExchange{})
		into = &m.exchanges[len(m.exchanges)-1]
	case "Queue":
		m.queues = append(m.queues, topologyQueue{})
		into = &m.queues[len(m.queues)-1]
	case "Binding":
		m.bindings = append(m.bindings, topologyBinding{})
		into = &m.bindings[len(m.bindings)-1]
	case "User":
		m.rmqUsers = append(m.rmqUsers, topologyUser{})
		into = &m.rmqUsers[len(m.rmqUsers)-1]
	case "Permission":
		m.rmqPerms = append(m.rmqPerms, topologyPermission{})
		into = &m.rmqPerms[len(m.rmqPerms)-1]
	default:
		return fmt.Errorf("%s: validated, but no test reads it; add it to k8sManifests", what)
	}
	// Numbers as written: a queue argument must reach the comparison with events.Topology
	// unchanged.
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.UseNumber()
	return dec.Decode(into)
}

// yamlDocuments splits a YAML file into its documents, as JSON, skipping empty ones (a file
// may start with comments and ---).
func yamlDocuments(file string) ([][]byte, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r := utilyaml.NewYAMLReader(bufio.NewReader(f))
	var docs [][]byte
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, err
		}
		// YAMLToJSONStrict refuses duplicate keys, which a lenient parse would resolve
		// silently in favour of the last.
		js, err := yaml.YAMLToJSONStrict(doc)
		if err != nil {
			return nil, err
		}
		if t := bytes.TrimSpace(js); len(t) == 0 || string(t) == "null" {
			continue
		}
		docs = append(docs, js)
	}
}

// decodeJSONStrict decodes as the API server's strict field validation does: field names
// match case-sensitively, and unknown or duplicate fields are errors.
func decodeJSONStrict(js []byte, into any) error {
	strict, err := kjson.UnmarshalStrict(js, into, kjson.DisallowDuplicateFields, kjson.DisallowUnknownFields)
	if err != nil {
		return err
	}
	return errors.Join(strict...)
}

func decodeYAMLStrict(y []byte, into any) error {
	js, err := yaml.YAMLToJSONStrict(y)
	if err != nil {
		return err
	}
	return decodeJSONStrict(js, into)
}

// crd is one served version of a vendored CustomResourceDefinition, its OpenAPI schema
// compiled as a JSON schema.
type crd struct {
	source string
	schema *jsonschema.Schema
}

// loadCRDs compiles every served version of the CRDs in dir, keyed "group/version/Kind".
//
// A CRD's openAPIV3Schema is structural: the API server prunes (or, with strict field
// validation, rejects) any field its properties do not declare, unless a node says
// x-kubernetes-preserve-unknown-fields. JSON Schema allows undeclared fields by default, so
// each object node gets additionalProperties: false first. CEL rules
// (x-kubernetes-validations) are not evaluated here; the tests below check the values that
// matter by hand.
func loadCRDs(dir string) (map[string]*crd, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		return nil, fmt.Errorf("no CRDs in %s: %w", dir, err)
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no CRDs in %s", dir)
	}
	out := map[string]*crd{}
	for _, file := range files {
		raw, err := os.ReadFile(file)
		if err != nil {
			return nil, err
		}
		var def struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Spec       struct {
				Group string `json:"group"`
				Names struct {
					Kind string `json:"kind"`
				} `json:"names"`
				Versions []struct {
					Name   string `json:"name"`
					Served bool   `json:"served"`
					Schema struct {
						OpenAPIV3Schema json.RawMessage `json:"openAPIV3Schema"`
					} `json:"schema"`
				} `json:"versions"`
			} `json:"spec"`
		}
		js, err := yaml.YAMLToJSON(raw)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		if err := json.Unmarshal(js, &def); err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		if def.APIVersion != "apiextensions.k8s.io/v1" || def.Kind != "CustomResourceDefinition" {
			return nil, fmt.Errorf("%s: not an apiextensions.k8s.io/v1 CustomResourceDefinition", file)
		}
		for _, v := range def.Spec.Versions {
			if !v.Served {
				continue
			}
			doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(v.Schema.OpenAPIV3Schema))
			if err != nil {
				return nil, fmt.Errorf("%s %s: %w", file, v.Name, err)
			}
			root, ok := doc.(map[string]any)
			if !ok {
				return nil, fmt.Errorf("%s %s: openAPIV3Schema is not an object", file, v.Name)
			}
			structural(root)
			// metadata is the API server's ObjectMeta, which the schema leaves open:
			// crd.validate decodes it strictly into metav1.ObjectMeta instead.
			if props, ok := root["properties"].(map[string]any); ok {
				props["metadata"] = map[string]any{"type": "object"}
			}
			loc := "file:///" + path.Join(def.Spec.Group, v.Name, def.Spec.Names.Kind) + ".json"
			c := jsonschema.NewCompiler()
			if err := c.AddResource(loc, root); err != nil {
				return nil, fmt.Errorf("%s %s: %w", file, v.Name, err)
			}
			sch, err := c.Compile(loc)
			if err != nil {
				return nil, fmt.Errorf("%s %s: %w", file, v.Name, err)
			}
			out[def.Spec.Group+"/"+v.Name+"/"+def.Spec.Names.Kind] = &crd{source: filepath.Base(file), schema: sch}
		}
	}
	return out, nil
}

// structural closes every object node of a CRD schema to the fields it declares, as the API
// server treats them.
func structural(node map[string]any) {
	if preserve, _ := node["x-kubernetes-preserve-unknown-fields"].(bool); !preserve {
		_, hasAdditional := node["additionalProperties"]
		if _, hasProps := node["properties"]; (hasProps || node["type"] == "object") && !hasAdditional {
			node["additionalProperties"] = false
		}
	}
	if props, ok := node["properties"].(map[string]any); ok {
		for _, p := range props {
			if p, ok := p.(map[string]any); ok {
				structural(p)
			}
		}
	}
	for _, key := range []string{"items", "additionalProperties", "not"} {
		if sub, ok := node[key].(map[string]any); ok {
			structural(sub)
		}
	}
	for _, key := range []string{"allOf", "anyOf", "oneOf"} {
		if subs, ok := node[key].([]any); ok {
			for _, s := range subs {
				if s, ok := s.(map[string]any); ok {
					structural(s)
				}
			}
		}
	}
}

func (c *crd) validate(doc []byte) error {
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(doc))
	if err != nil {
		return err
	}
	if err := c.schema.Validate(inst); err != nil {
		return fmt.Errorf("against %s: %w", c.source, err)
	}
	var meta struct {
		APIVersion string            `json:"apiVersion"`
		Kind       string            `json:"kind"`
		Metadata   metav1.ObjectMeta `json:"metadata"`
		Spec       json.RawMessage   `json:"spec"`
	}
	return decodeJSONStrict(doc, &meta)
}

// Every file kustomization.yaml lists decodes, and every document in it is a kind the tests
// check.
func TestK8sManifestsDecodeStrictly(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	if len(m.deployments) != len(apps) || len(m.rabbits) != 1 || len(m.pgClusters) != 1 {
		t.Errorf("found %d Deployments, %d RabbitmqClusters and %d CloudNativePG Clusters; want one Deployment per service (%d), one of each server",
			len(m.deployments), len(m.rabbits), len(m.pgClusters), len(apps))
	}
}

// The unknown-field checks work: a misspelt field in a built-in kind and in each custom
// resource is refused, and so is a field of the wrong type.
func TestK8sStrictDecodingRejectsUnknownFields(t *testing.T) {
	t.Parallel()
	crds, err := loadCRDs(filepath.Join(k8sDir, "testdata", "crds"))
	if err != nil {
		t.Fatal(err)
	}
	bad := []string{
		`{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"x"},"spec":{"replica":2}}`,
		`{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"x"},"spec":{"Replicas":2}}`,
		`{"apiVersion":"v1","kind":"Service","metadata":{"name":"x","lables":{}}}`,
		`{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"Role","metadata":{"name":"x"},"rule":[]}`,
		`{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"ClusterRoleBinding","metadata":{"name":"x"},"roleRef":{"apiGroup":"rbac.authorization.k8s.io","kind":"ClusterRole","name":"admin"}}`,
		`{"apiVersion":"rabbitmq.com/v1beta1","kind":"RabbitmqCluster","metadata":{"name":"x"},"spec":{"replica":3}}`,
		`{"apiVersion":"rabbitmq.com/v1beta1","kind":"RabbitmqCluster","metadata":{"name":"x"},"spec":{"rabbitmq":{"additionalConfg":""}}}`,
		`{"apiVersion":"rabbitmq.com/v1beta1","kind":"RabbitmqCluster","metadata":{"name":"x","labls":{}},"spec":{}}`,
		`{"apiVersion":"postgresql.cnpg.io/v1","kind":"Cluster","metadata":{"name":"x"},"spec":{"instances":3,"postgresql":{"synchronous":{"method":"any","number":1,"durability":"required"}}}}`,
		`{"apiVersion":"postgresql.cnpg.io/v1","kind":"Cluster","metadata":{"name":"x"},"spec":{"instances":"three"}}`,
		`{"apiVersion":"postgresql.cnpg.io/v1","kind":"Cluster","metadata":{"name":"x"},"spec":{"instances":3,"postgresql":{"synchronous":{"method":"some","number":1}}}}`,
		`{"apiVersion":"postgresql.cnpg.io/v1","kind":"Database","metadata":{"name":"x"},"spec":{"cluster":{"name":"c"},"name":"d","owner":"o","ownr":"o"}}`,
		`{"apiVersion":"postgresql.cnpg.io/v1","kind":"Widget","metadata":{"name":"x"}}`,
		`{"apiVersion":"rabbitmq.com/v1beta1","kind":"Queue","metadata":{"name":"x"},"spec":{"name":"q","argument":{},"rabbitmqClusterReference":{"name":"r"}}}`,
		`{"apiVersion":"rabbitmq.com/v1beta1","kind":"Queue","metadata":{"name":"x"},"spec":{"name":"q","deletionPolicy":"keep","rabbitmqClusterReference":{"name":"r"}}}`,
		`{"apiVersion":"rabbitmq.com/v1beta1","kind":"Queue","metadata":{"name":"x"},"spec":{"name":"q"}}`,
		`{"apiVersion":"rabbitmq.com/v1beta1","kind":"Exchange","metadata":{"name":"x"},"spec":{"name":"e","durable":"yes","rabbitmqClusterReference":{"name":"r"}}}`,
		`{"apiVersion":"rabbitmq.com/v1beta1","kind":"Binding","metadata":{"name":"x"},"spec":{"destinationType":"topic","rabbitmqClusterReference":{"name":"r"}}}`,
		`{"apiVersion":"rabbitmq.com/v1beta1","kind":"User","metadata":{"name":"x"},"spec":{"tags":["admin"],"rabbitmqClusterReference":{"name":"r"}}}`,
		`{"apiVersion":"rabbitmq.com/v1beta1","kind":"Permission","metadata":{"name":"x"},"spec":{"vhost":"/","permission":{},"permissions":{},"rabbitmqClusterReference":{"name":"r"}}}`,
	}
	for _, doc := range bad {
		if err := newK8sManifests().add(crds, []byte(doc)); err == nil {
			t.Errorf("accepted %s", doc)
		}
	}
	for _, good := range []string{
		`{"apiVersion":"postgresql.cnpg.io/v1","kind":"Database","metadata":{"name":"x"},"spec":{"cluster":{"name":"c"},"name":"d","owner":"o"}}`,
		`{"apiVersion":"rabbitmq.com/v1beta1","kind":"Queue","metadata":{"name":"x"},"spec":{"name":"q","arguments":{"x-anything":1},"rabbitmqClusterReference":{"name":"r"}}}`,
	} {
		m := &k8sManifests{}
		if err := m.add(crds, []byte(good)); err != nil {
			t.Errorf("refused %s: %v", good, err)
		}
	}
}

// kustomization.yaml lists exactly the manifest files of deploy/k8s, as resources or
// generators: none forgotten (kubectl apply -k would skip it), none missing.
func TestK8sKustomizationListsEveryFile(t *testing.T) {
	t.Parallel()
	kust := k8s(t).kust
	checkListsEveryManifest(t, k8sDir, slices.Concat(kust.Resources, kust.Generators))
}

// A service reads its environment at start only, so a changed setting must restart its pods:
// every ConfigMap a Deployment reads into an environment is generated, with the hash suffix that makes kustomize
// roll the Deployment out when its contents change. A plain ConfigMap would change under
// running pods that never see it.
func TestK8sConfigMapsRollTheDeployments(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	for _, name := range slices.Sorted(maps.Keys(m.deployments)) {
		spec := m.deployments[name].Spec.Template.Spec
		for _, cm := range configMapsReferenced(spec) {
			g, ok := m.generated[cm]
			switch {
			case !ok:
				t.Errorf("Deployment %s reads ConfigMap %s into its environment, and no generator makes it: a change to it would not roll the pods out", name, cm)
			case g.Options.DisableNameSuffixHash:
				t.Errorf("ConfigMap %s has disableNameSuffixHash: a change to it would not roll Deployment %s out", cm, name)
			}
		}
	}
	for _, a := range apps {
		if refs := configMapsReferenced(m.deployments[a.name].Spec.Template.Spec); len(refs) == 0 {
			t.Errorf("Deployment %s reads no ConfigMap; the test expects its settings in one", a.name)
		}
	}
	// The runbook that has a setting changed (SMTP_ADDR) says how it reaches the pods here too.
	doc, err := os.ReadFile(filepath.Join(root, "docs", "operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, runbook, _ := strings.Cut(string(doc), "\n### MailServerUnreachable\n")
	runbook, _, _ = strings.Cut(runbook, "\n### ")
	if !strings.Contains(strings.Join(strings.Fields(runbook), " "), "kubectl rollout restart deployment/notification") {
		t.Error("operations.md's MailServerUnreachable does not say how a changed SMTP_ADDR reaches the pods in Kubernetes (kubectl rollout restart deployment/notification)")
	}
}

// configMapsReferenced are the ConfigMaps spec's containers read into their environment, which
// a running container never reads again (a mounted one, such as kube-root-ca.crt, is updated in
// place).
func configMapsReferenced(spec corev1.PodSpec) []string {
	var names []string
	for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
		for _, from := range c.EnvFrom {
			if from.ConfigMapRef != nil {
				names = append(names, from.ConfigMapRef.Name)
			}
		}
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.ConfigMapKeyRef != nil {
				names = append(names, e.ValueFrom.ConfigMapKeyRef.Name)
			}
		}
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// The Secrets are not generated (a secret manager makes them), so nothing rolls the pods when
// one changes, while CloudNativePG applies a changed role password at once: secrets.yaml's
// header and deployment.md say to restart every Deployment that reads a Secret, right after.
func TestK8sSecretChangesSayToRestartTheDeployments(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	var deployments []string
	for _, a := range apps {
		deployments = append(deployments, "deployment/"+a.name)
	}
	for name, d := range m.deployments {
		for _, c := range d.Spec.Template.Spec.Containers {
			if len(secretsReferenced(c)) > 0 && !slices.Contains(deployments, "deployment/"+name) {
				t.Errorf("Deployment %s reads a Secret and is no service's: add it to the restart below", name)
			}
		}
	}
	restart := "kubectl rollout restart " + strings.Join(deployments, " ")
	for _, file := range []string{filepath.Join("deploy", "k8s", "secrets.yaml"), filepath.Join("docs", "deployment.md")} {
		raw, err := os.ReadFile(filepath.Join(root, file))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(strings.Join(strings.Fields(string(raw)), " "), restart) {
			t.Errorf("%s does not say to run %q after changing a Secret", file, restart)
		}
	}
}

// checkListsEveryManifest checks that resources, a kustomization's in dir, are the yaml files
// of dir, each once.
func checkListsEveryManifest(t *testing.T, dir string, resources []string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	for _, e := range entries {
		if ext := filepath.Ext(e.Name()); !e.IsDir() && (ext == ".yaml" || ext == ".yml") && e.Name() != "kustomization.yaml" {
			files = append(files, e.Name())
		}
	}
	listed := slices.Clone(resources)
	slices.Sort(files)
	slices.Sort(listed)
	if !slices.Equal(files, listed) {
		t.Errorf("%s/kustomization.yaml resources = %v, want every manifest of the folder: %v", dir, listed, files)
	}
	if len(slices.Compact(listed)) != len(resources) {
		t.Errorf("%s/kustomization.yaml lists a file twice: %v", dir, resources)
	}
}

func TestK8sDeployments(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	for _, a := range apps {
		t.Run(a.name, func(t *testing.T) {
			t.Parallel()
			d, ok := m.deployments[a.name]
			if !ok {
				t.Fatalf("no Deployment %s", a.name)
			}
			spec := d.Spec.Template.Spec
			// Order's wait for the topology is the one init container (TestK8sOrderWaitsForTopology).
			inits := 0
			if a.name == topologyWaiter {
				inits = 1
			}
			if len(spec.Containers) != 1 || len(spec.InitContainers) != inits {
				t.Fatalf("%d containers and %d init containers, want the service's and %d", len(spec.Containers), len(spec.InitContainers), inits)
			}
			c := spec.Containers[0]
			if d.Spec.Replicas == nil || *d.Spec.Replicas < 2 {
				t.Errorf("replicas = %v, want at least 2 (a drain or a rollout then keeps one serving)", d.Spec.Replicas)
			}
			sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
			if err != nil || sel.Empty() || !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
				t.Errorf("selector %v does not select the template's labels %v (%v)", d.Spec.Selector, d.Spec.Template.Labels, err)
			}

			// The image is the one the Dockerfile's comment tags, and kustomization.yaml
			// says where it really is.
			if want := "outbox-inbox/" + a.name; c.Image != want {
				t.Errorf("image = %q, want %q (kustomization.yaml's images: maps it to a registry)", c.Image, want)
			}
			if i := slices.IndexFunc(m.kust.Images, func(im kustImage) bool { return im.Name == c.Image }); i < 0 || m.kust.Images[i].NewName == "" || (m.kust.Images[i].NewTag == "" && m.kust.Images[i].Digest == "") {
				t.Errorf("kustomization.yaml images: has no newName and newTag (or digest) for %s", c.Image)
			}

			// The port: HTTP_ADDR's, named http; the probes ask it.
			env := containerEnv(t, m, c)
			_, portText, err := net.SplitHostPort(env["HTTP_ADDR"])
			if err != nil {
				t.Fatalf("HTTP_ADDR = %q: %v", env["HTTP_ADDR"], err)
			}
			port, _ := strconv.Atoi(portText)
			if i := slices.IndexFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.Name == "http" }); i < 0 || c.Ports[i].ContainerPort != int32(port) {
				t.Errorf("ports = %+v, want one named http on %d, HTTP_ADDR's port", c.Ports, port)
			}
			probes := []struct {
				name  string
				probe *corev1.Probe
				path  string
			}{
				{"startupProbe", c.StartupProbe, "/healthz"},
				{"livenessProbe", c.LivenessProbe, "/healthz"},
				{"readinessProbe", c.ReadinessProbe, "/readyz"},
			}
			for _, p := range probes {
				switch {
				case p.probe == nil || p.probe.HTTPGet == nil:
					t.Errorf("%s: none, or not an HTTP GET", p.name)
				case p.probe.HTTPGet.Path != p.path:
					t.Errorf("%s: path %q, want %s", p.name, p.probe.HTTPGet.Path, p.path)
				case resolvePort(c, p.probe.HTTPGet.Port) != int32(port):
					t.Errorf("%s: port %s, want the container's HTTP port %d", p.name, p.probe.HTTPGet.Port.String(), port)
				case p.probe.HTTPGet.Scheme != "" && p.probe.HTTPGet.Scheme != corev1.URISchemeHTTP:
					t.Errorf("%s: scheme %s, want HTTP (the services serve plain HTTP)", p.name, p.probe.HTTPGet.Scheme)
				}
			}
			// /healthz answers from the start of platform.Start, before the wait for the
			// database and the migrations (TestStartAnswersTheProbesWhileTheMigrationsWait):
			// the startup probe outwaits the process's own start only, and liveness watches a
			// migration however long it runs. The bound is for a start slowed by a busy node.
			if sp := c.StartupProbe; sp != nil && sp.PeriodSeconds*sp.FailureThreshold < 20 {
				t.Errorf("startupProbe allows %d s, want at least 20 (the process's start on a busy node)", sp.PeriodSeconds*sp.FailureThreshold)
			}

			// Shutdown: drain first (the services close their listener on SIGTERM, /readyz
			// never fails first), then the 10 s the service may take.
			var drain int64
			if c.Lifecycle == nil || c.Lifecycle.PreStop == nil || c.Lifecycle.PreStop.Sleep == nil || c.Lifecycle.PreStop.Sleep.Seconds < 5 {
				t.Errorf("lifecycle.preStop = %+v, want a sleep of at least 5 s (the image has no shell for an exec hook)", c.Lifecycle)
			} else {
				drain = c.Lifecycle.PreStop.Sleep.Seconds
			}
			hardStop := int64(math.Ceil(platform.HardStop.Seconds()))
			if g := spec.TerminationGracePeriodSeconds; g == nil || *g < drain+shutdownContract || *g < drain+hardStop {
				t.Errorf("terminationGracePeriodSeconds = %v, want at least the preStop drain (%d s) + the %d s a service may take to stop", deref64(g), drain, shutdownContract)
			}

			checkSecurity(t, spec, c)
			checkResources(t, c)
			if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
				t.Error("automountServiceAccountToken is not false (the services never call the Kubernetes API)")
			}
			if mounts := tokenMounts(m, spec, c); len(mounts) > 0 {
				t.Errorf("the service's container mounts a service-account token, or something at its path: %v", mounts)
			}

			// A Service in front, whose port leads to HTTP_ADDR's.
			svc, ok := m.services[a.name]
			if !ok {
				t.Fatalf("no Service %s", a.name)
			}
			if len(svc.Spec.Selector) == 0 || !labels.Set(svc.Spec.Selector).AsSelector().Matches(labels.Set(d.Spec.Template.Labels)) {
				t.Errorf("Service selector %v does not select the pods (labels %v)", svc.Spec.Selector, d.Spec.Template.Labels)
			}
			if len(svc.Spec.Ports) == 0 {
				t.Error("Service has no ports")
			}
			for _, p := range svc.Spec.Ports {
				target := p.TargetPort
				if target.Type == intstr.Int && target.IntVal == 0 {
					target = intstr.FromInt32(p.Port) // unset: the Service's own port
				}
				if got := resolvePort(c, target); got != int32(port) {
					t.Errorf("Service port %d: targetPort %s reaches container port %d, want %d", p.Port, target.String(), got, port)
				}
			}
		})
	}
}

func checkSecurity(t *testing.T, spec corev1.PodSpec, c corev1.Container) {
	t.Helper()
	psc := spec.SecurityContext
	if psc == nil {
		psc = &corev1.PodSecurityContext{}
	}
	csc := c.SecurityContext
	if csc == nil {
		t.Fatal("the container has no securityContext")
	}
	// A container's setting wins over the pod's.
	nonRoot := csc.RunAsNonRoot
	if nonRoot == nil {
		nonRoot = psc.RunAsNonRoot
	}
	user := csc.RunAsUser
	if user == nil {
		user = psc.RunAsUser
	}
	seccomp := csc.SeccompProfile
	if seccomp == nil {
		seccomp = psc.SeccompProfile
	}
	if nonRoot == nil || !*nonRoot {
		t.Error("runAsNonRoot is not true")
	}
	// Numeric, so the kubelet can check runAsNonRoot without reading the image; distroless
	// nonroot is 65532.
	if user == nil || *user != 65532 {
		t.Errorf("runAsUser = %v, want 65532 (distroless nonroot)", deref64(user))
	}
	if seccomp == nil || seccomp.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("seccompProfile = %+v, want RuntimeDefault", seccomp)
	}
	if csc.AllowPrivilegeEscalation == nil || *csc.AllowPrivilegeEscalation {
		t.Error("allowPrivilegeEscalation is not false")
	}
	if csc.ReadOnlyRootFilesystem == nil || !*csc.ReadOnlyRootFilesystem {
		t.Error("readOnlyRootFilesystem is not true")
	}
	if csc.Privileged != nil && *csc.Privileged {
		t.Error("privileged")
	}
	if csc.Capabilities == nil || !slices.Contains(csc.Capabilities.Drop, "ALL") || len(csc.Capabilities.Add) > 0 {
		t.Errorf("capabilities = %+v, want drop [ALL] and nothing added", csc.Capabilities)
	}
}

func checkResources(t *testing.T, c corev1.Container) {
	t.Helper()
	req, lim := c.Resources.Requests, c.Resources.Limits
	cpu, hasCPU := req[corev1.ResourceCPU]
	mem, hasMem := req[corev1.ResourceMemory]
	memLimit, hasLimit := lim[corev1.ResourceMemory]
	if !hasCPU || cpu.IsZero() || !hasMem || !hasLimit {
		t.Fatalf("resources = %+v, want CPU and memory requests and a memory limit", c.Resources)
	}
	if mem.Value() < 2*measuredPeakRSS {
		t.Errorf("memory request %s is under twice the measured peak RSS (%d KiB)", mem.String(), measuredPeakRSS/1024)
	}
	if memLimit.Cmp(mem) <= 0 {
		t.Errorf("memory limit %s is not above the request %s", memLimit.String(), mem.String())
	}
}

// Every container of the Deployments is a Go binary (the services, kubectl): wherever one has
// a memory limit, GOMEMLIMIT sets the Go runtime's soft limit under it, so that the runtime
// collects harder as it nears the limit instead of being killed there. 85-95 % of it: the Go GC
// guide's headroom for memory the runtime does not count, and no less, or the runtime would
// work hard on memory the container may still use. Written out, it must follow the limit when
// that changes.
func TestK8sGoMemoryLimit(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	if len(m.deployments) == 0 {
		t.Fatal("no Deployments")
	}
	for name, d := range m.deployments {
		spec := d.Spec.Template.Spec
		for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
			limit, ok := c.Resources.Limits[corev1.ResourceMemory]
			if !ok {
				continue
			}
			v, set := containerEnv(t, m, c)["GOMEMLIMIT"]
			soft, valid := goMemLimit(v)
			switch {
			case !set:
				t.Errorf("Deployment %s, container %s: a memory limit of %s and no GOMEMLIMIT", name, c.Name, limit.String())
			case !valid:
				t.Errorf("Deployment %s, container %s: GOMEMLIMIT=%q, not a limit the Go runtime reads (a whole number of bytes, or of B, KiB, MiB, GiB or TiB)", name, c.Name, v)
			case float64(soft) < 0.85*float64(limit.Value()) || float64(soft) > 0.95*float64(limit.Value()):
				t.Errorf("Deployment %s, container %s: GOMEMLIMIT=%s is %.0f %% of the memory limit %s, want 85-95 %%", name, c.Name, v, 100*float64(soft)/float64(limit.Value()), limit.String())
			}
		}
	}
}

// goMemLimit parses a GOMEMLIMIT value as the Go runtime does: a whole number of bytes, with
// an optional unit B, KiB, MiB, GiB or TiB.
func goMemLimit(v string) (int64, bool) {
	units := map[string]int64{"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
	unit := strings.TrimLeft(v, "0123456789")
	n, err := strconv.ParseInt(strings.TrimSuffix(v, unit), 10, 64)
	scale, ok := units[unit]
	if err != nil || !ok {
		return 0, false
	}
	return n * scale, true
}

// goMemLimit must refuse what the Go runtime refuses: Kubernetes's units (Mi) crash it at start.
func TestGoMemLimitParser(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]int64{"115MiB": 115 << 20, "134217728": 134217728, "2GiB": 2 << 30, "64KiB": 64 << 10, "5B": 5} {
		if got, ok := goMemLimit(v); !ok || got != want {
			t.Errorf("goMemLimit(%q) = %d, %v; want %d", v, got, ok, want)
		}
	}
	for _, v := range []string{"", "115Mi", "115M", "1.5GiB", "+5MiB", "-1", "MiB", "off"} {
		if got, ok := goMemLimit(v); ok {
			t.Errorf("goMemLimit(%q) = %d, want refused", v, got)
		}
	}
}

// The environment the ConfigMap and Secret give each service passes the service's own config
// readers, and names only variables the service, or its OpenTelemetry exporter (libraryVars),
// reads.
func TestK8sServiceConfiguration(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	for _, a := range apps {
		t.Run(a.name, func(t *testing.T) {
			t.Parallel()
			d, ok := m.deployments[a.name]
			if !ok || len(d.Spec.Template.Spec.Containers) == 0 {
				t.Fatalf("no Deployment %s with a container", a.name)
			}
			vars := containerEnv(t, m, d.Spec.Template.Spec.Containers[0])

			checkConfigReaders(t, a, vars)
			// Variables read in a service's main.go alone (notification's SMTP_*, NOTIFY_*)
			// have no reader to call from here; the manifests leave them unset.
			for _, name := range requiredVars(t, a.name) {
				if vars[name] == "" {
					t.Errorf("required variable %s is not set", name)
				}
			}
			if _, ok := vars["HTTP_ADDR"]; !ok {
				t.Error("HTTP_ADDR is not set: the container port must not depend on a default")
			}
			known := settable(t, a.name)
			for name := range vars {
				if !slices.Contains(known, name) {
					t.Errorf("the environment sets %s, which services/%s does not read (known: %v)", name, a.name, known)
				}
			}
		})
	}
}

// The URLs the services dial lead to the servers these manifests run, with the credentials
// those servers are given.
func TestK8sCredentialsAgree(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	if len(m.pgClusters) != 1 || len(m.rabbits) != 1 {
		t.Fatalf("want one CloudNativePG Cluster and one RabbitmqCluster, have %d and %d", len(m.pgClusters), len(m.rabbits))
	}
	pg, rabbit := m.pgClusters[0], m.rabbits[0]

	for _, a := range apps {
		t.Run(a.name, func(t *testing.T) {
			t.Parallel()
			d := m.deployments[a.name]
			if len(d.Spec.Template.Spec.Containers) == 0 {
				t.Fatalf("no Deployment %s with a container", a.name)
			}
			c := d.Spec.Template.Spec.Containers[0]
			vars := containerEnv(t, m, c)

			// DATABASE_URL: the primary's Service, the service's database, as its role.
			u, err := url.Parse(vars["DATABASE_URL"])
			if err != nil {
				t.Fatalf("DATABASE_URL: %v", err)
			}
			pass, _ := u.User.Password()
			if u.Scheme != "postgres" || u.Hostname() != pg.Metadata.Name+"-rw" || u.Port() != "5432" ||
				strings.TrimPrefix(u.Path, "/") != a.database || u.User.Username() != a.role {
				t.Errorf("DATABASE_URL = %s, want postgres://%s:…@%s-rw:5432/%s (the primary, read-write)", platform.Redact(u.String()), a.role, pg.Metadata.Name, a.database)
			}
			// TLS, verified against the cluster's CA, mounted from the Secret the operator makes.
			q := u.Query()
			if q.Get("sslmode") != "verify-full" {
				t.Errorf("DATABASE_URL sslmode = %q, want verify-full", q.Get("sslmode"))
			}
			if ca := q.Get("sslrootcert"); !mountsSecretKey(d.Spec.Template.Spec, c, ca, pg.Metadata.Name+"-ca", "ca.crt") {
				t.Errorf("DATABASE_URL sslrootcert = %q, which is not key ca.crt of Secret %s-ca mounted in the container", ca, pg.Metadata.Name)
			}
			if !slices.ContainsFunc(m.databases, func(db cnpgDatabase) bool {
				return db.Spec.Cluster.Name == pg.Metadata.Name && db.Spec.Name == a.database && db.Spec.Owner == a.role &&
					(db.Spec.Ensure == "" || db.Spec.Ensure == "present")
			}) {
				t.Errorf("no Database %s owned by %s in Cluster %s", a.database, a.role, pg.Metadata.Name)
			}
			i := slices.IndexFunc(pg.Spec.Managed.Roles, func(r cnpgRole) bool { return r.Name == a.role })
			if i < 0 {
				t.Fatalf("Cluster %s manages no role %s", pg.Metadata.Name, a.role)
			}
			role := pg.Spec.Managed.Roles[i]
			if !role.Login || (role.Ensure != "" && role.Ensure != "present") || role.PasswordSecret == nil {
				t.Fatalf("role %s: login %v, ensure %q, passwordSecret %v; want a login role, present, with a password Secret", a.role, role.Login, role.Ensure, role.PasswordSecret)
			}
			s, ok := m.secrets[role.PasswordSecret.Name]
			if !ok {
				t.Fatalf("role %s: no Secret %s", a.role, role.PasswordSecret.Name)
			}
			if s.Type != corev1.SecretTypeBasicAuth || secretValue(s, "username") != a.role || secretValue(s, "password") != pass || pass == "" {
				t.Errorf("Secret %s: want type %s with username %s and the password DATABASE_URL uses", s.Name, corev1.SecretTypeBasicAuth, a.role)
			}
			// Only this role reaches this database (the compose init script's REVOKE CONNECT).
			hba := pg.Spec.PostgreSQL.PgHBA
			allow := slices.IndexFunc(hba, func(l string) bool {
				f := strings.Fields(l)
				return len(f) == 5 && f[0] == "hostssl" && f[1] == a.database && f[2] == a.role && f[4] == "scram-sha-256"
			})
			reject := slices.IndexFunc(hba, func(l string) bool {
				f := strings.Fields(l)
				return len(f) == 5 && f[0] == "host" && f[1] == "all" && slices.Contains(strings.Split(f[2], ","), a.role) && f[4] == "reject"
			})
			if allow < 0 || reject < allow {
				t.Errorf("pg_hba = %q, want `hostssl %s %s all scram-sha-256` before a `host all …%s… all reject`", hba, a.database, a.role, a.role)
			}

			// AMQP_URL: the broker's Service, as the service's own RabbitMQ user (the topology
			// operator's User named after it), with the password that User imports; never as
			// the cluster's default user.
			u, err = url.Parse(vars["AMQP_URL"])
			if err != nil {
				t.Fatalf("AMQP_URL: %v", err)
			}
			pass, _ = u.User.Password()
			user, userPass := rabbitUser(t, m, a.name)
			if u.Scheme != "amqp" || u.Hostname() != rabbit.Metadata.Name || u.Port() != "5672" ||
				u.User.Username() != user || pass != userPass || (u.Path != "" && u.Path != "/") {
				t.Errorf("AMQP_URL = %s, want amqp://%s:<its password>@%s:5672/ (User %s, Secret %s-rabbitmq-user)", platform.Redact(u.String()), user, rabbit.Metadata.Name, a.name, a.name)
			}
			defaultUser := rabbitDefaultUserSecret(rabbit)
			if slices.Contains(secretsReferenced(c), defaultUser) {
				t.Errorf("the container reads Secret %s, the cluster's default user: each service logs in as its own user", defaultUser)
			}
			if s, ok := m.secrets[defaultUser]; ok && secretValue(s, "username") == u.User.Username() {
				t.Errorf("AMQP_URL logs in as %s, the cluster's default user", u.User.Username())
			}
		})
	}
}

// rabbitUser returns the username and password the topology operator's User name imports,
// checking that the Secret is one the operator reads.
func rabbitUser(t *testing.T, m *k8sManifests, name string) (user, pass string) {
	t.Helper()
	i := slices.IndexFunc(m.rmqUsers, func(u topologyUser) bool { return u.Metadata.Name == name })
	if i < 0 {
		t.Fatalf("no RabbitMQ User %s", name)
	}
	u := m.rmqUsers[i]
	if u.Spec.ImportCredentialsSecret == nil {
		t.Fatalf("User %s: no importCredentialsSecret; the operator would generate credentials nothing here knows", name)
	}
	secret := u.Spec.ImportCredentialsSecret.Name
	s, ok := m.secrets[secret]
	if !ok {
		t.Fatalf("User %s: no Secret %s", name, secret)
	}
	// The operator's cache holds only Secrets with this label, and its webhook refuses a User
	// whose Secret lacks it.
	if s.Labels["rabbitmq.com/topology-operator"] != "true" {
		t.Errorf("Secret %s: no label rabbitmq.com/topology-operator: \"true\"; the operator would not read it", secret)
	}
	// passwordHash, when present, wins over password: the URL's password would not log in.
	if _, hashed := s.StringData["passwordHash"]; hashed || len(s.Data["passwordHash"]) > 0 {
		t.Errorf("Secret %s: passwordHash is set; the URLs hold the password, and the hash would win over it", secret)
	}
	user, pass = secretValue(s, "username"), secretValue(s, "password")
	if user == "" || pass == "" {
		t.Fatalf("Secret %s: username or password is empty", secret)
	}
	return user, pass
}

// rabbitDefaultUserSecret is the Secret that holds the RabbitmqCluster's default user: the
// external one it names, or the one the cluster operator generates.
func rabbitDefaultUserSecret(r rabbitmqCluster) string {
	if name := r.Spec.SecretBackend.ExternalSecret.Name; name != "" {
		return name
	}
	return r.Metadata.Name + "-default-user"
}

// secretsReferenced lists the Secrets a container's environment reads.
func secretsReferenced(c corev1.Container) []string {
	var names []string
	for _, from := range c.EnvFrom {
		if from.SecretRef != nil {
			names = append(names, from.SecretRef.Name)
		}
	}
	for _, e := range c.Env {
		if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
			names = append(names, e.ValueFrom.SecretKeyRef.Name)
		}
	}
	return names
}

// The RabbitMQ users of the Kubernetes base are compose's, each with exactly the permissions
// deploy/rabbitmq/definitions.json gives it: one per service and outboxctl, management tags
// for none. Compose's admin, the management UI's user, is the cluster's default user here.
func TestK8sRabbitMQUsers(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	if len(m.rabbits) != 1 {
		t.Fatalf("want one RabbitmqCluster, have %d", len(m.rabbits))
	}
	cluster := m.rabbits[0].Metadata.Name
	want := map[string]defPermission{}
	for _, p := range readDefinitions(t).Permissions {
		if p.User != "admin" {
			want[p.User] = p
		}
	}

	usernames := map[string]string{} // User resource name → RabbitMQ username
	for _, u := range m.rmqUsers {
		checkClusterRef(t, "User "+u.Metadata.Name, u.Spec.RabbitmqClusterReference, cluster)
		if len(u.Spec.Tags) != 0 {
			t.Errorf("User %s: tags %v, want none: it needs no management access", u.Metadata.Name, u.Spec.Tags)
		}
		user, _ := rabbitUser(t, m, u.Metadata.Name)
		if user != u.Metadata.Name {
			t.Errorf("User %s logs in as %q; name the resource after its user", u.Metadata.Name, user)
		}
		usernames[u.Metadata.Name] = user
	}
	got := map[string]defPermission{}
	for _, p := range m.rmqPerms {
		checkClusterRef(t, "Permission "+p.Metadata.Name, p.Spec.RabbitmqClusterReference, cluster)
		if p.Spec.UserReference == nil || p.Spec.User != "" {
			t.Errorf("Permission %s: want userReference alone (the operator then waits for the User)", p.Metadata.Name)
			continue
		}
		user, ok := usernames[p.Spec.UserReference.Name]
		if !ok {
			t.Errorf("Permission %s: userReference %s is no User here", p.Metadata.Name, p.Spec.UserReference.Name)
			continue
		}
		if _, dup := got[user]; dup {
			t.Errorf("user %s has two Permissions", user)
		}
		perms := p.Spec.Permissions
		got[user] = defPermission{User: user, VHost: p.Spec.Vhost, Configure: perms.Configure, Write: perms.Write, Read: perms.Read}
	}
	for user, w := range want {
		if g, ok := got[user]; !ok {
			t.Errorf("user %s: no User with a Permission, want %+v as in %s", user, w, definitionsFile)
		} else if g != w {
			t.Errorf("user %s: Permission %+v, want %+v as in %s", user, g, w, definitionsFile)
		}
	}
	for user := range got {
		if _, ok := want[user]; !ok {
			t.Errorf("user %s has a Permission but is no user of %s", user, definitionsFile)
		}
	}
	if len(usernames) != len(got) {
		t.Errorf("%d Users and %d Permissions, want one Permission per User", len(usernames), len(got))
	}
}

// Each pool of every pod a rollout may run at once fits in PostgreSQL's max_connections, with
// room for the operator and an administrator. The Deployment controller does not count
// terminating pods against maxSurge: an old pod it scales down keeps its connections through
// preStop and shutdown (up to terminationGracePeriodSeconds) while the next surge pod starts.
// With 2 replicas and maxSurge 1 a rollout runs, for a moment, 2 running pods, the surge pod and
// the old pod still terminating: replicas + 2 × maxSurge, 4. In general, new pods that get ready
// faster than the grace period leave every old pod terminating beside every new one, so a
// rollout (or a drain, a terminating pod and its replacement) runs at most 2 × replicas.
func TestK8sDatabaseConnectionsFit(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	if len(m.pgClusters) != 1 {
		t.Fatalf("want one CloudNativePG Cluster, have %d", len(m.pgClusters))
	}
	const reserve = 20
	maxConns, err := strconv.Atoi(m.pgClusters[0].Spec.PostgreSQL.Parameters["max_connections"])
	if err != nil {
		t.Fatalf("max_connections: %v (set it: the default 100 is sized for no one)", err)
	}
	total := 0
	for _, a := range apps {
		d := m.deployments[a.name]
		if d.Spec.Replicas == nil || len(d.Spec.Template.Spec.Containers) == 0 {
			t.Fatalf("Deployment %s: no replicas or no container", a.name)
		}
		conns := platform.DefaultDBMaxConns
		if v, ok := containerEnv(t, m, d.Spec.Template.Spec.Containers[0])["DB_MAX_CONNS"]; ok {
			if conns, err = strconv.Atoi(v); err != nil {
				t.Fatalf("%s DB_MAX_CONNS: %v", a.name, err)
			}
		}
		// Whatever maxSurge and maxUnavailable say: at most every old pod and every new one.
		pods := 2 * int(*d.Spec.Replicas)
		total += pods * conns
	}
	if total+reserve > maxConns {
		t.Errorf("the pools of a rollout's pods, terminating ones included, can open %d connections (+%d reserved), over max_connections %d", total, reserve, maxConns)
	}
}

func TestK8sPodDisruptionBudgets(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	for _, a := range apps {
		d := m.deployments[a.name]
		pods := labels.Set(d.Spec.Template.Labels)
		var matching []policyv1.PodDisruptionBudget
		for _, p := range m.pdbs {
			if sel, err := metav1.LabelSelectorAsSelector(p.Spec.Selector); err == nil && !sel.Empty() && sel.Matches(pods) {
				matching = append(matching, p)
			}
		}
		// Kubernetes refuses evictions of a pod that more than one budget selects.
		if len(matching) != 1 {
			t.Errorf("%s: %d PodDisruptionBudgets select its pods, want exactly 1", a.name, len(matching))
			continue
		}
		s := matching[0].Spec
		one := intstr.FromInt32(1)
		switch {
		case s.MaxUnavailable != nil && s.MinAvailable == nil && *s.MaxUnavailable == one:
		case s.MinAvailable != nil && s.MaxUnavailable == nil && *s.MinAvailable == one && d.Spec.Replicas != nil && *d.Spec.Replicas >= 2:
		default:
			t.Errorf("%s: PodDisruptionBudget %s has minAvailable %v, maxUnavailable %v; want maxUnavailable: 1 (or minAvailable: 1 with 2+ replicas)",
				a.name, matching[0].Name, s.MinAvailable, s.MaxUnavailable)
		}
	}
}

func TestK8sRabbitmqCluster(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	if len(m.rabbits) != 1 {
		t.Fatalf("want one RabbitmqCluster, have %d", len(m.rabbits))
	}
	r := m.rabbits[0]
	if r.Spec.Replicas == nil || *r.Spec.Replicas != 3 {
		t.Fatalf("replicas = %v, want 3 (a quorum queue keeps working with one node gone)", deref64(r.Spec.Replicas))
	}
	if want := service(t, loadProject(t), "rabbitmq").Image; r.Spec.Image != want {
		t.Errorf("image = %q, want %q, the image docker-compose.yml runs", r.Spec.Image, want)
	}
	conf := parseRabbitConf(t, "deploy/k8s/rabbitmq.yaml additionalConfig", r.Spec.Rabbitmq.AdditionalConfig)
	checkNoPartitionHandling(t, "deploy/k8s/rabbitmq.yaml additionalConfig", conf)
	// The topology operator may declare the queues before every node has joined.
	if conf["quorum_queue.continuous_membership_reconciliation.enabled"] != "true" ||
		conf["quorum_queue.continuous_membership_reconciliation.target_group_size"] != strconv.Itoa(int(*r.Spec.Replicas)) {
		t.Errorf("additionalConfig = %q, want quorum_queue.continuous_membership_reconciliation enabled with target_group_size %d", r.Spec.Rabbitmq.AdditionalConfig, *r.Spec.Replicas)
	}
	if res := r.Spec.Resources; res == nil || res.Requests.Memory().IsZero() || res.Limits.Memory().IsZero() || res.Requests.Cpu().IsZero() {
		t.Errorf("resources = %+v, want CPU and memory requests and a memory limit", res)
	}
}

func TestK8sPostgresCluster(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	if len(m.pgClusters) != 1 {
		t.Fatalf("want one CloudNativePG Cluster, have %d", len(m.pgClusters))
	}
	c := m.pgClusters[0]
	if c.Spec.Instances != 3 {
		t.Errorf("instances = %d, want 3", c.Spec.Instances)
	}
	// Synchronous and required: an inbox row whose message was acked, or an order whose event
	// was published, must survive a failover (postgres.yaml says why).
	s := c.Spec.PostgreSQL.Synchronous
	switch {
	case s == nil:
		t.Error("postgresql.synchronous is not set: replication is asynchronous")
	case s.Method != "any" && s.Method != "first", s.Number < 1, s.Number >= c.Spec.Instances:
		t.Errorf("synchronous = %+v, want method any or first and 1 to instances-1 standbys", *s)
	case s.DataDurability != "required":
		t.Errorf("synchronous.dataDurability = %q, want required (preferred lets the primary commit alone)", s.DataDurability)
	case !s.FailoverQuorum:
		t.Error("synchronous.failoverQuorum is not true: a failover could promote the standby that lacks the latest commits")
	}
	if c.Spec.MinSyncReplicas != 0 || c.Spec.MaxSyncReplicas != 0 {
		t.Error("minSyncReplicas/maxSyncReplicas are the deprecated form; use postgresql.synchronous alone")
	}
	// A client lost without a word is found, and the rows its transaction locked freed, within
	// minutes, not the kernel's two hours (postgres.yaml says why).
	params := c.Spec.PostgreSQL.Parameters
	keepalive := map[string]int{}
	for _, name := range []string{"tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count", "tcp_user_timeout"} {
		n, err := strconv.Atoi(params[name])
		if err != nil || n <= 0 {
			t.Errorf("postgresql.parameters.%s = %q, want a positive number: the kernel's default finds a lost client after 2 h", name, params[name])
		}
		keepalive[name] = n
	}
	if found := keepalive["tcp_keepalives_idle"] + keepalive["tcp_keepalives_interval"]*keepalive["tcp_keepalives_count"]; found > 300 || keepalive["tcp_user_timeout"] > 300000 {
		t.Errorf("postgresql.parameters find a lost client after %d s of silence, or %d ms of unacknowledged data: want 5 min at most", found, keepalive["tcp_user_timeout"])
	}
	// The PostgreSQL major version docker-compose.yml runs.
	composeImage := service(t, loadProject(t), "postgres").Image
	major := regexp.MustCompile(`^postgres:(\d+)`).FindStringSubmatch(composeImage)
	if len(major) < 2 || !regexp.MustCompile(`^ghcr\.io/cloudnative-pg/postgresql:`+major[1]+`[.-]`).MatchString(c.Spec.ImageName) {
		t.Errorf("imageName = %q, want CloudNativePG's PostgreSQL %v, the major version of %s", c.Spec.ImageName, major, composeImage)
	}
	if c.Spec.Resources.Requests.Memory().IsZero() || c.Spec.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources = %+v, want a memory request and limit", c.Spec.Resources)
	}
	if _, err := resource.ParseQuantity(c.Spec.Storage.Size); err != nil {
		t.Errorf("storage.size = %q: %v", c.Spec.Storage.Size, err)
	}
	for _, db := range m.databases {
		if db.Spec.Cluster.Name != c.Metadata.Name {
			t.Errorf("Database %s is for Cluster %q, which is not here", db.Metadata.Name, db.Spec.Cluster.Name)
		}
	}
}

// Helpers.

// containerEnv is the environment the kubelet gives the container: envFrom (ConfigMaps and
// Secrets of these manifests), then env, which wins.
func containerEnv(t *testing.T, m *k8sManifests, c corev1.Container) map[string]string {
	t.Helper()
	vars := map[string]string{}
	for _, from := range c.EnvFrom {
		var data map[string]string
		switch {
		case from.ConfigMapRef != nil:
			cm, ok := m.configMaps[from.ConfigMapRef.Name]
			if !ok {
				t.Fatalf("envFrom: no ConfigMap %s", from.ConfigMapRef.Name)
			}
			data = cm.Data
		case from.SecretRef != nil:
			s, ok := m.secrets[from.SecretRef.Name]
			if !ok {
				t.Fatalf("envFrom: no Secret %s", from.SecretRef.Name)
			}
			data = map[string]string{}
			for k := range s.Data {
				data[k] = secretValue(s, k)
			}
			for k := range s.StringData {
				data[k] = secretValue(s, k)
			}
		}
		for k, v := range data {
			vars[from.Prefix+k] = v
		}
	}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			vars[e.Name] = e.Value
		case e.ValueFrom.ConfigMapKeyRef != nil:
			vars[e.Name] = m.configMaps[e.ValueFrom.ConfigMapKeyRef.Name].Data[e.ValueFrom.ConfigMapKeyRef.Key]
		case e.ValueFrom.SecretKeyRef != nil:
			vars[e.Name] = secretValue(m.secrets[e.ValueFrom.SecretKeyRef.Name], e.ValueFrom.SecretKeyRef.Key)
		default:
			t.Fatalf("env %s: a valueFrom this test cannot resolve", e.Name)
		}
	}
	return vars
}

// secretValue is a Secret's key as the pod sees it: stringData is written over data.
func secretValue(s corev1.Secret, key string) string {
	if v, ok := s.StringData[key]; ok {
		return v
	}
	return string(s.Data[key])
}

// resolvePort is the container port a named or numbered port refers to, or 0.
func resolvePort(c corev1.Container, p intstr.IntOrString) int32 {
	if p.Type == intstr.Int {
		return p.IntVal
	}
	for _, cp := range c.Ports {
		if cp.Name == p.StrVal {
			return cp.ContainerPort
		}
	}
	return 0
}

// mountsSecretKey reports whether file, in container c, is key of Secret secret.
func mountsSecretKey(spec corev1.PodSpec, c corev1.Container, file, secret, key string) bool {
	for _, vm := range c.VolumeMounts {
		rel, err := filepath.Rel(vm.MountPath, file)
		if err != nil || strings.HasPrefix(rel, "..") || vm.SubPath != "" {
			continue
		}
		for _, v := range spec.Volumes {
			if v.Name != vm.Name || v.Secret == nil || v.Secret.SecretName != secret {
				continue
			}
			if len(v.Secret.Items) == 0 {
				return rel == key
			}
			for _, it := range v.Secret.Items {
				if it.Key == key && it.Path == rel {
					return true
				}
			}
		}
	}
	return false
}

func deref64[T int64 | int32](p *T) any {
	if p == nil {
		return nil
	}
	return *p
}
