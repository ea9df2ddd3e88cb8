package scripts_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// brokerCheck runs test.sh's broker_version machine (with with_broker, forked, die and the line
// that reads TEST_MACHINE_RABBITMQ, taken from the script) and prints the version it sets, with a
// stand-in for internal/testenv's TestTheBrokerIsTheRabbitMQTheRunWants whose broker is RabbitMQ
// version: it says what that test says (its format strings, taken from
// internal/testenv/broker_test.go), and fails as it fails.
func brokerCheck(t *testing.T, version string, env ...string) (string, error) {
	t.Helper()
	script, err := os.ReadFile("test.sh")
	if err != nil {
		t.Fatal(err)
	}
	test, err := os.ReadFile("../internal/testenv/broker_test.go")
	if err != nil {
		t.Fatal(err)
	}
	var defs []string
	for _, re := range []string{`(?m)^die\(\) \{.*\}$`, `(?m)^forked\(\) \{.*\}$`, `(?m)^machine_rabbitmq=.*$`, `(?ms)^with_broker\(\) \{$.*?^\}$`, `(?ms)^broker_version\(\) \{$.*?^\}$`} {
		def := regexp.MustCompile(re).Find(script)
		if def == nil {
			t.Fatalf("no %s in scripts/test.sh", re)
		}
		defs = append(defs, string(def))
	}
	format := func(call string) string { // the format string of the test's call
		m := regexp.MustCompile(regexp.QuoteMeta(call) + `\("([^"]*)", u\.Host, version(?:, want)?\)`).FindSubmatch(test)
		if m == nil {
			t.Fatalf("no %s(\"…\", u.Host, version…) in internal/testenv/broker_test.go", call)
		}
		return string(m[1])
	}
	const host = "127.0.0.1:5672"
	report := t.TempDir()
	check := fmt.Sprintf(`#!/bin/sh
case %[1]q in
  "$TEST_WANT_RABBITMQ"*) echo "    broker_test.go:29: %[2]s"; echo PASS ;;
  *) echo "    broker_test.go:27: $(printf %%s "%[3]s" | sed "s/@want@/$TEST_WANT_RABBITMQ/")"; echo FAIL; exit 1 ;;
esac
`, version, fmt.Sprintf(format("t.Logf"), host, version), fmt.Sprintf(format("t.Fatalf"), host, version, "@want@"))
	if err := os.WriteFile(filepath.Join(report, "brokercheck"), []byte(check), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", "-c", "set -euo pipefail\n"+strings.Join(defs, "\n")+"\nbroker_version machine\nprintf %s \"$version\"")
	cmd.Env = append(os.Environ(), "report="+report, "machine_amqp_url=amqp://guest:guest@"+host+"/", "sidroot_env=", "trixie_env=")
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// The phases against the machine's broker stand for RabbitMQ 3.10: on a machine with another,
// the run stops, naming the variable that lets it stand for them, TEST_MACHINE_RABBITMQ (not
// TEST_WANT_RABBITMQ, which the script sets from it), and the version to give it.
func TestAnotherMachineBrokerNamesTheVariableThatTakesIt(t *testing.T) {
	t.Parallel()
	out, err := brokerCheck(t, "3.13.7", "TEST_MACHINE_RABBITMQ=")
	want := "scripts/test.sh: the machine's RabbitMQ is 3.13.7, not the 3.10 these phases stand for; set TEST_MACHINE_RABBITMQ=3.13 to run them against it anyway"
	if err == nil || !strings.Contains(out, want) {
		t.Errorf("broker_version machine against RabbitMQ 3.13.7: %v, %q; want a failure saying %q", err, out, want)
	}
	out, err = brokerCheck(t, "3.13.7", "TEST_MACHINE_RABBITMQ=3.13")
	if err != nil || out != "3.13.7" {
		t.Errorf("broker_version machine against RabbitMQ 3.13.7 with TEST_MACHINE_RABBITMQ=3.13: %v, %q; want 3.13.7", err, out)
	}
	out, err = brokerCheck(t, "3.10.8", "TEST_MACHINE_RABBITMQ=")
	if err != nil || out != "3.10.8" {
		t.Errorf("broker_version machine against RabbitMQ 3.10.8: %v, %q; want 3.10.8", err, out)
	}
}
