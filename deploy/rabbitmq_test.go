package deploy_test

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/types"
)

// The RabbitMQ configuration docker-compose.yml mounts: a conf.d file that makes the broker
// import the definitions file at boot, and the definitions file itself.
const (
	definitionsConf      = "deploy/rabbitmq/30-definitions.conf"
	definitionsConfMount = "/etc/rabbitmq/conf.d/30-definitions.conf"
	definitionsFile      = "deploy/rabbitmq/definitions.json"
)

// definitions is the part of a RabbitMQ definitions file this project writes.
type definitions struct {
	VHosts      []defVHost      `json:"vhosts"`
	Users       []defUser       `json:"users"`
	Exchanges   []defExchange   `json:"exchanges"`
	Queues      []defQueue      `json:"queues"`
	Bindings    []defBinding    `json:"bindings"`
	Permissions []defPermission `json:"permissions"`
}

// The arguments of exchanges, queues and bindings hold their numbers as json.Number, as
// written (readDefinitions decodes with UseNumber).

type defExchange struct {
	Name       string         `json:"name"`
	VHost      string         `json:"vhost"`
	Type       string         `json:"type"`
	Durable    bool           `json:"durable"`
	AutoDelete bool           `json:"auto_delete"`
	Internal   bool           `json:"internal"`
	Arguments  map[string]any `json:"arguments"`
}

type defQueue struct {
	Name       string         `json:"name"`
	VHost      string         `json:"vhost"`
	Durable    bool           `json:"durable"`
	AutoDelete bool           `json:"auto_delete"`
	Arguments  map[string]any `json:"arguments"`
}

type defBinding struct {
	Source          string         `json:"source"`
	VHost           string         `json:"vhost"`
	Destination     string         `json:"destination"`
	DestinationType string         `json:"destination_type"`
	RoutingKey      string         `json:"routing_key"`
	Arguments       map[string]any `json:"arguments"`
}

type defVHost struct {
	Name string `json:"name"`
}

type defUser struct {
	Name             string   `json:"name"`
	PasswordHash     string   `json:"password_hash"`
	HashingAlgorithm string   `json:"hashing_algorithm"`
	Tags             []string `json:"tags"`
}

type defPermission struct {
	User      string `json:"user"`
	VHost     string `json:"vhost"`
	Configure string `json:"configure"`
	Write     string `json:"write"`
	Read      string `json:"read"`
}

func (d definitions) user(name string) (defUser, bool) {
	i := slices.IndexFunc(d.Users, func(u defUser) bool { return u.Name == name })
	if i < 0 {
		return defUser{}, false
	}
	return d.Users[i], true
}

func (d definitions) permissions(user, vhost string) (defPermission, bool) {
	i := slices.IndexFunc(d.Permissions, func(p defPermission) bool { return p.User == user && p.VHost == vhost })
	if i < 0 {
		return defPermission{}, false
	}
	return d.Permissions[i], true
}

// hashingAlgorithm is the one every user of the definitions file is hashed with: RabbitMQ's
// default, a 4-byte salt followed by SHA-256(salt || password), base64-encoded.
const hashingAlgorithm = "rabbit_password_hashing_sha256"

// passwordIs reports whether password is the one u's hash was made from.
func (u defUser) passwordIs(password string) bool {
	raw, err := base64.StdEncoding.DecodeString(u.PasswordHash)
	if err != nil || len(raw) != 4+sha256.Size || u.HashingAlgorithm != hashingAlgorithm {
		return false
	}
	sum := sha256.Sum256(append(slices.Clone(raw[:4]), password...))
	return subtle.ConstantTimeCompare(sum[:], raw[4:]) == 1
}

// hashPassword hashes password as RabbitMQ's rabbit_password_hashing_sha256 does, with a fresh
// salt.
func hashPassword(t testing.TB, password string) string {
	t.Helper()
	salt := make([]byte, 4)
	if _, err := rand.Read(salt); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(append(slices.Clone(salt), password...))
	return base64.StdEncoding.EncodeToString(append(salt, sum[:]...))
}

// readDefinitions parses the definitions file, refusing fields this project does not write:
// a plain "password" in particular.
func readDefinitions(t testing.TB) definitions {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(root, definitionsFile))
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	dec.UseNumber()
	var d definitions
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("%s: %v", definitionsFile, err)
	}
	return d
}

// brokerDefinitions checks that the rabbitmq service of p imports the definitions file at
// boot (the conf.d file and the file itself mounted, the path in one the target of the other)
// and returns the file's definitions.
func brokerDefinitions(t *testing.T, p *types.Project) definitions {
	t.Helper()
	return importedDefinitions(t, service(t, p, "rabbitmq"))
}

// importedDefinitions checks that the RabbitMQ node rabbit imports the definitions file at boot, as
// brokerDefinitions describes, and returns the file's definitions.
func importedDefinitions(t *testing.T, rabbit types.ServiceConfig) definitions {
	t.Helper()
	conf, err := os.ReadFile(filepath.Join(root, definitionsConf))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*load_definitions\s*=\s*(\S+)\s*$`).FindSubmatch(conf)
	if m == nil {
		t.Fatalf("%s does not set load_definitions", definitionsConf)
	}
	mounts := map[string]string{}
	for _, v := range rabbit.Volumes {
		if v.Type == types.VolumeTypeBind {
			if !v.ReadOnly {
				t.Errorf("%s: %s is mounted read-write, want :ro", rabbit.Name, v.Target)
			}
			mounts[v.Target] = v.Source
		}
	}
	for target, file := range map[string]string{definitionsConfMount: definitionsConf, string(m[1]): definitionsFile} {
		want, _ := filepath.Abs(filepath.Join(root, file))
		if mounts[target] != want {
			t.Errorf("%s: %s is bound to %q, want %s", rabbit.Name, target, mounts[target], file)
		}
	}
	return readDefinitions(t)
}

// The users docker-compose.yml's broker starts with: one per service, outboxctl for the
// operator, admin for the UI, and no guest. Each password is a salted hash.
func TestComposeRabbitMQUsers(t *testing.T) {
	t.Parallel()
	p := loadProject(t)
	defs := brokerDefinitions(t, p)
	rabbit := service(t, p, "rabbitmq")
	for _, name := range []string{"RABBITMQ_DEFAULT_USER", "RABBITMQ_DEFAULT_PASS"} {
		if v, ok := env(rabbit, name); ok {
			t.Errorf("rabbitmq: %s = %q; the users come from %s, and a node importing definitions at boot creates no default user", name, v, definitionsFile)
		}
	}
	if !slices.ContainsFunc(defs.VHosts, func(v defVHost) bool { return v.Name == "/" }) {
		t.Errorf("%s does not define the virtual host / (a node importing definitions at boot creates none)", definitionsFile)
	}

	var want []string
	for _, a := range apps {
		want = append(want, a.name)
	}
	want = append(want, "outboxctl", "admin")
	var got []string
	for _, u := range defs.Users {
		got = append(got, u.Name)
		if u.HashingAlgorithm != hashingAlgorithm {
			t.Errorf("user %s: hashing_algorithm %q, want %s", u.Name, u.HashingAlgorithm, hashingAlgorithm)
		}
		if raw, err := base64.StdEncoding.DecodeString(u.PasswordHash); err != nil || len(raw) != 4+sha256.Size {
			t.Errorf("user %s: password_hash is not a salted SHA-256 hash", u.Name)
		}
		// Only the UI's user may log in to the management UI or API.
		if u.Name == "admin" {
			if !slices.Equal(u.Tags, []string{"administrator"}) {
				t.Errorf("user admin: tags %v, want [administrator]", u.Tags)
			}
		} else if len(u.Tags) != 0 {
			t.Errorf("user %s: tags %v, want none: it needs no management access", u.Name, u.Tags)
		}
		perms := 0
		for _, p := range defs.Permissions {
			if p.User == u.Name {
				perms++
			}
		}
		if perms != 1 {
			t.Errorf("user %s has %d permission entries, want 1 (on /)", u.Name, perms)
		}
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("%s users = %v, want %v", definitionsFile, got, want)
	}
	// The local demo's passwords are the user names, as the PostgreSQL roles' are: people log
	// in with them (the UI as admin/admin, outboxctl as outboxctl), as the docs tell them to.
	for _, name := range []string{"admin", "outboxctl"} {
		if u, ok := defs.user(name); ok && !u.passwordIs(name) {
			t.Errorf("user %s: its password is not %q, as docs/deployment.md says", name, name)
		}
	}
	for _, p := range defs.Permissions {
		for _, re := range []string{p.Configure, p.Write, p.Read} {
			if _, err := regexp.Compile(re); err != nil {
				t.Errorf("permissions of %s: %q is not a regular expression: %v", p.User, re, err)
			}
		}
		if p.User != "admin" && (strings.Contains(p.Configure+p.Write+p.Read, ".*") || p.Configure == "" || p.Write == "" || p.Read == "") {
			t.Errorf("permissions of %s: %+v; want anchored expressions naming its resources (^$ for none)", p.User, p)
		}
	}
}

func TestPasswordHash(t *testing.T) {
	t.Parallel()
	u := defUser{PasswordHash: hashPassword(t, "secret"), HashingAlgorithm: hashingAlgorithm}
	if !u.passwordIs("secret") || u.passwordIs("Secret") || u.passwordIs("") {
		t.Error("passwordIs does not tell the hashed password from others")
	}
	// A hash RabbitMQ itself produced (rabbitmqctl export_definitions) for the password
	// "guest": the format is the broker's, not only this file's.
	rabbit := defUser{PasswordHash: "3kr9eX+ot3k9a98GWh+rKTr2D2RL3koCEwhtRwegJK/Xe3/7", HashingAlgorithm: hashingAlgorithm}
	if !rabbit.passwordIs("guest") {
		t.Error("passwordIs does not accept a hash RabbitMQ made")
	}
}
