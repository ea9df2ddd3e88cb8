package testenv

import (
	"net/url"
	"os"
	"strings"
	"testing"
)

// scripts/test.sh runs each phase against a broker that stands for a RabbitMQ version (3.10,
// the oldest the library supports; 4.0; 4.3, compose's) and says which in TEST_WANT_RABBITMQ, a
// version prefix such as "3.10.". A phase whose URL reached another broker (the machine's
// upgraded, TEST_AMQP_URL pointing elsewhere) would pass and test that version no longer: this
// fails it, on the version the server gave in the AMQP handshake. The script runs it before
// each phase and prints the version it logs.
func TestTheBrokerIsTheRabbitMQTheRunWants(t *testing.T) {
	want := os.Getenv("TEST_WANT_RABBITMQ")
	if want == "" {
		t.Skip("TEST_WANT_RABBITMQ is unset: scripts/test.sh sets it, in each phase, to the RabbitMQ version that phase stands for")
	}
	u, err := url.Parse(AMQPURL())
	if err != nil {
		t.Fatalf("parse TEST_AMQP_URL: %v", err)
	}
	version, _ := Connection(t).Properties["version"].(string)
	if !strings.HasPrefix(version, want) {
		t.Fatalf("the broker at %s is RabbitMQ %s, not the %s* this phase stands for (TEST_WANT_RABBITMQ; scripts/test.sh sets it from TEST_MACHINE_RABBITMQ for the machine's broker): it would not test that version", u.Host, version, want)
	}
	t.Logf("the broker at %s is RabbitMQ %s", u.Host, version)
}
