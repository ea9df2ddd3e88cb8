package testenv

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// In compose mode rabbitmqctl runs inside the test broker's container, and a test that needs
// pg_ctlcluster skips with the reason scripts/test.sh allows in that mode. No Docker engine is
// needed to check that: a stand-in docker on PATH records what it was asked to run.
func TestComposeModeRunsRabbitMQCtlInTheContainerAndSkipsPGCtlCluster(t *testing.T) {
	bin := t.TempDir()
	record := filepath.Join(bin, "args")
	script := "#!/bin/sh\nprintf '%s\\n' \"$@\" > " + record + "\necho 'stand-in output'\n"
	if err := os.WriteFile(filepath.Join(bin, "docker"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	t.Setenv("TEST_SERVERS", "compose")

	if out := RabbitMQCtl(t, "list_queues", "-p", "/"); !strings.Contains(out, "stand-in output") {
		t.Fatalf("output %q, want the container's", out)
	}
	got, err := os.ReadFile(record)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"compose", "-f", composeFile(), "exec", "-T", "rabbitmq", "rabbitmqctl", "list_queues", "-p", "/"}
	if strings.Join(strings.Fields(string(got)), " ") != strings.Join(want, " ") {
		t.Fatalf("docker %s, want docker %s", strings.Fields(string(got)), want)
	}
	if _, err := os.Stat(composeFile()); err != nil {
		t.Fatalf("the compose file rabbitmqctl is run through: %v", err)
	}

	r := &recorder{TB: t}
	PostgreSQLCluster(r)
	if !strings.Contains(r.skip, ComposeSkip) {
		t.Fatalf("a test that restarts PostgreSQL with pg_ctlcluster: skip reason %q, want one naming %s", r.skip, ComposeSkip)
	}
}
