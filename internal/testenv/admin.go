package testenv

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// ComposeSkip is the reason every test gives that skips because the test servers run in
// deploy/compose.test.yml, where this host has no admin tools for them. scripts/test.sh
// allows it in that mode only.
const ComposeSkip = "TEST_SERVERS=compose"

// composeMode reports whether scripts/test.sh runs the suite against the servers of
// deploy/compose.test.yml.
func composeMode() bool { return os.Getenv("TEST_SERVERS") == "compose" }

// composeFile is deploy/compose.test.yml of this repository.
func composeFile() string {
	_, here, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(here), "..", "..", "deploy", "compose.test.yml")
}

// RabbitMQCtlCommand is rabbitmqctl for the broker at TEST_AMQP_URL: the command
// TEST_RABBITMQCTL names (scripts/sidroot.sh's for the node of its root), in compose mode the
// one inside the test broker's container, or else this host's own.
func RabbitMQCtlCommand(args ...string) *exec.Cmd {
	if composeMode() {
		return exec.Command("docker", append([]string{"compose", "-f", composeFile(), "exec", "-T", "rabbitmq", "rabbitmqctl"}, args...)...)
	}
	if custom := strings.Fields(os.Getenv("TEST_RABBITMQCTL")); len(custom) > 0 {
		return exec.Command(custom[0], append(custom[1:], args...)...)
	}
	return exec.Command("rabbitmqctl", args...)
}

// RabbitMQImportDefinitions imports a definitions document into the broker at TEST_AMQP_URL
// with rabbitmqctl import_definitions (see RabbitMQCtlCommand), returning its output. The
// document goes on stdin, but for the node of scripts/sidroot.sh (TEST_SIDROOT, its root):
// that root's rabbitmqctl cannot read stdin under its Erlang (it fails in prim_tty), nor a
// pipe given as a file, so the document goes in a file in the root's /tmp, removed after.
func RabbitMQImportDefinitions(defs []byte) ([]byte, error) {
	root := os.Getenv("TEST_SIDROOT")
	if root == "" || composeMode() {
		cmd := RabbitMQCtlCommand("-q", "import_definitions")
		cmd.Stdin = bytes.NewReader(defs)
		return cmd.CombinedOutput()
	}
	f, err := os.CreateTemp(filepath.Join(root, "tmp"), "definitions-*.json")
	if err != nil {
		return nil, fmt.Errorf("a file for the definitions in %s: %w", root, err)
	}
	defer func() { _ = os.Remove(f.Name()) }()
	if _, err := f.Write(defs); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("write %s: %w", f.Name(), err)
	}
	if err := f.Close(); err != nil {
		return nil, fmt.Errorf("write %s: %w", f.Name(), err)
	}
	// The root's rabbitmqctl runs as its rabbitmq user.
	if err := os.Chmod(f.Name(), 0o644); err != nil {
		return nil, fmt.Errorf("chmod %s: %w", f.Name(), err)
	}
	return RabbitMQCtlCommand("-q", "import_definitions", "/tmp/"+filepath.Base(f.Name())).CombinedOutput()
}

// RabbitMQCtl runs rabbitmqctl (see RabbitMQCtlCommand) and returns its output.
func RabbitMQCtl(t testing.TB, args ...string) string {
	t.Helper()
	out, err := RabbitMQCtlCommand(args...).CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// RabbitMQCtlQuietly runs rabbitmqctl for a cleanup, where a failure has nobody to tell.
func RabbitMQCtlQuietly(args ...string) { _ = RabbitMQCtlCommand(args...).Run() }

// PostgreSQLCluster returns the version of the local PostgreSQL cluster, to restart with
// pg_ctlcluster. Compose's test server has no such tool here: the test skips in that mode,
// and fails anywhere else without one.
func PostgreSQLCluster(t testing.TB) string {
	t.Helper()
	if composeMode() {
		t.Skipf("restarts PostgreSQL with pg_ctlcluster, which this host lacks: the test servers run in deploy/compose.test.yml (%s)", ComposeSkip)
		return ""
	}
	versions, _ := filepath.Glob("/etc/postgresql/*")
	if _, err := exec.LookPath("pg_ctlcluster"); err != nil || len(versions) == 0 {
		t.Fatal("restarts PostgreSQL with pg_ctlcluster, and no local cluster is installed (/etc/postgresql); run it on the machine of the PostgreSQL at TEST_DATABASE_URL")
	}
	return filepath.Base(versions[0])
}

// StartPostgreSQLAtCleanup registers a cleanup that starts the local cluster again, should a
// restart have failed half-way and left it stopped, and waits until answers says the database
// answers. Register it after the cleanups that need the database, so that it runs before them.
func StartPostgreSQLAtCleanup(t testing.TB, cluster string, answers func() bool) {
	t.Helper()
	t.Cleanup(func() {
		out, err := exec.Command("pg_ctlcluster", "--skip-systemctl-redirect", cluster, "main", "start").CombinedOutput()
		// It exits 2 when the cluster runs already: the restart went through.
		var exit *exec.ExitError
		if err != nil && (!errors.As(err, &exit) || exit.ExitCode() != 2) {
			t.Errorf("start PostgreSQL again: %v\n%s", err, out)
		}
		Eventually(t, time.Minute, answers, "PostgreSQL does not answer after the test")
	})
}
