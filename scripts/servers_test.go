// Package scripts_test exercises the decisions of scripts/test.sh (scripts/servers.sh) with
// stand-in commands on PATH: no Docker engine runs here, so compose mode is checked by what
// the script decides, not by a run.
package scripts_test

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// host is a PATH of stand-ins: only the commands a scenario puts there exist.
type host struct {
	t    *testing.T
	bin  string
	env  []string
	pg   string // TEST_DATABASE_URL
	amqp string // TEST_AMQP_URL
}

func newHost(t *testing.T) *host {
	t.Helper()
	h := &host{t: t, bin: t.TempDir(), pg: "postgres://postgres@127.0.0.1:" + closedPort(t) + "/postgres", amqp: "amqp://guest:guest@127.0.0.1:" + closedPort(t) + "/"}
	for _, tool := range []string{"bash", "timeout", "grep"} { // what servers.sh itself runs
		path, err := exec.LookPath(tool)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(path, filepath.Join(h.bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	return h
}

// closedPort returns a port nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(l.Addr().String())
	_ = l.Close()
	return port
}

// answering makes both servers answer: listeners on loopback for the TCP checks.
func (h *host) answering() *host {
	h.t.Helper()
	for _, url := range []*string{&h.pg, &h.amqp} {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			h.t.Fatal(err)
		}
		h.t.Cleanup(func() { _ = l.Close() })
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				_ = c.Close()
			}
		}()
		scheme, rest, _ := strings.Cut(*url, "://")
		creds, _, _ := strings.Cut(rest, "@")
		*url = scheme + "://" + creds + "@" + l.Addr().String() + "/"
	}
	return h
}

// with puts a stand-in command on PATH that runs script.
func (h *host) with(name, script string) *host {
	h.t.Helper()
	if err := os.WriteFile(filepath.Join(h.bin, name), []byte("#!/bin/sh\n"+script+"\n"), 0o755); err != nil {
		h.t.Fatal(err)
	}
	return h
}

// mode runs servers_mode and returns its output and whether it succeeded.
func (h *host) mode() (string, bool) {
	h.t.Helper()
	bash, err := exec.LookPath("bash")
	if err != nil {
		h.t.Fatal(err)
	}
	cmd := exec.Command(bash, "-c", ". scripts/servers.sh && servers_mode")
	cmd.Dir = ".."
	cmd.Env = append([]string{"PATH=" + h.bin, "TEST_DATABASE_URL=" + h.pg, "TEST_AMQP_URL=" + h.amqp}, h.env...)
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err == nil
}

func TestServersMode(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name      string
		host      func(*host) *host
		wantOK    bool
		wantStart string // the start of what it prints
	}{
		{"servers answer here", func(h *host) *host { return h.answering().with("rabbitmqctl", "exit 0") }, true, "local: PostgreSQL and RabbitMQ answer"},
		{"installed here but stopped", func(h *host) *host { return h.with("pg_ctlcluster", "exit 0").with("rabbitmqctl", "exit 1") }, true, "local: the servers are installed here"},
		{"only Docker", func(h *host) *host { return h.with("docker", "exit 0") }, true, "compose: no server answers or is installed here"},
		{"compose's servers already up", func(h *host) *host {
			return h.answering().with("docker", `[ "$1 $4" = "compose ps" ] && echo 0123abcd`)
		}, true, "compose: the servers that answer are deploy/compose.test.yml's"},
		{"servers answer, Docker but no compose project", func(h *host) *host { return h.answering().with("docker", "exit 0") }, true, "local:"},
		{"TEST_SERVERS=compose", func(h *host) *host { h.env = append(h.env, "TEST_SERVERS=compose"); return h }, true, "compose: TEST_SERVERS says so"},
		{"TEST_SERVERS=podman", func(h *host) *host { h.env = append(h.env, "TEST_SERVERS=podman"); return h }, false, `TEST_SERVERS must be local or compose, got "podman"`},
		{"nothing at all", func(h *host) *host { return h }, false, "neither PostgreSQL"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			out, ok := c.host(newHost(t)).mode()
			if ok != c.wantOK || !strings.HasPrefix(out, c.wantStart) {
				t.Fatalf("servers_mode: ok=%v %q, want ok=%v and a start of %q", ok, out, c.wantOK, c.wantStart)
			}
		})
	}
}

// With neither way at hand, one message names both.
func TestNoServersMessageNamesBothWays(t *testing.T) {
	t.Parallel()
	out, ok := newHost(t).mode()
	if ok {
		t.Fatal("servers_mode succeeded with no server, no install and no Docker")
	}
	for _, want := range []string{"install PostgreSQL 15+ and RabbitMQ 3.10+ locally", "stand for 3.10", "TEST_MACHINE_RABBITMQ", "install Docker", "docker compose -f deploy/compose.test.yml up -d --wait"} {
		if !strings.Contains(out, want) {
			t.Errorf("message %q does not say %q", out, want)
		}
	}
}

func TestHostPortOfURLsWithAndWithoutPorts(t *testing.T) {
	t.Parallel()
	for url, want := range map[string]string{
		"postgres://postgres@db.internal/postgres?sslmode=disable": "db.internal:5432",
		"postgresql://u:p@127.0.0.1:6543/x":                        "127.0.0.1:6543",
		"amqp://guest:guest@mq/":                                   "mq:5672",
		"amqps://user:pass@mq.example":                             "mq.example:5671",
		"amqp://guest:guest@[::1]:5673/vhost":                      "[::1]:5673",
	} {
		out, err := hostPort(url)
		if err != nil {
			t.Fatalf("host_port %s: %v", url, err)
		}
		if got := string(out); got != want {
			t.Errorf("host_port %s = %q, want %q", url, got, want)
		}
	}
}

func hostPort(url string) ([]byte, error) {
	cmd := exec.Command("bash", "-c", `. scripts/servers.sh && host_port "$1"`, "host_port", url)
	cmd.Dir = ".."
	return cmd.Output()
}

// A shell that holds scripts/sidroot.sh env's variables, as a focused test leaves it, is refused
// before the run starts anything: its phases meant for the machine's broker would reach the 4.3
// node.
func TestTheTestCommandRefusesAShellWithTheSidrootVariables(t *testing.T) {
	t.Parallel()
	cmd := exec.Command("bash", "test.sh")
	cmd.Env = append(os.Environ(), "TEST_SIDROOT=/nowhere")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(string(out), "TEST_SIDROOT is set") || strings.Contains(string(out), "==") {
		t.Errorf("scripts/test.sh with TEST_SIDROOT set: %v, %q; want exit 1 at once, naming the variable", err, out)
	}
}
