package test

import (
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A user that may configure nothing still declares the whole topology, once the deployment
// has declared it (broker definitions, an operator): each refusal is accepted because the
// resource exists. A resource that is missing is an error that names it.
func TestTopologyDeclareAcceptsWhatTheDeploymentDeclared(t *testing.T) {
	t.Parallel()
	vhost, user := testenv.UniqueName("topology"), testenv.UniqueName("declarer")
	t.Cleanup(func() {
		testenv.RabbitMQCtlQuietly("delete_vhost", vhost)
		testenv.RabbitMQCtlQuietly("delete_user", user)
	})
	testenv.RabbitMQCtl(t, "add_vhost", vhost)
	testenv.RabbitMQCtl(t, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
	testenv.RabbitMQCtl(t, "add_user", user, "secret")
	testenv.RabbitMQCtl(t, "set_permissions", "-p", vhost, user, "^$", ".*", ".*")
	topology := messaging.Topology{Exchanges: []string{"orders"}, Queues: []messaging.ConsumerTopology{
		{Queue: "invoicing", Bindings: []messaging.Binding{{Exchange: "orders", RoutingKey: "OrderPlaced"}, {Exchange: "billing", RoutingKey: "Refund"}}},
	}}
	dial := func(login string) *amqp.Connection {
		t.Helper()
		url := strings.Replace(testenv.AMQPURL(), "guest:guest@", login+"@", 1) + vhost
		conn, err := amqp.Dial(url)
		if err != nil {
			t.Fatalf("dial as %s: %v", login, err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	restricted := dial(user + ":secret")
	err := topology.Declare(restricted, nil)
	if err == nil || !strings.Contains(err.Error(), `exchange orders: refused`) || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("declare on an empty vhost without permission = %v, want the exchange named as missing", err)
	}
	if err := topology.Declare(dial("guest:guest"), nil); err != nil {
		t.Fatalf("the deployment's declaration: %v", err)
	}
	if err := topology.Declare(restricted, nil); err != nil {
		t.Fatalf("declare what the deployment declared, without permission: %v", err)
	}
	ch, err := dial("guest:guest").Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDelete(messaging.DeadLetterQueue("invoicing"), false, false, false); err != nil {
		t.Fatal(err)
	}
	if err := topology.Declare(restricted, nil); err == nil || !strings.Contains(err.Error(), "dead-letter queue invoicing.dlq: refused") {
		t.Fatalf("declare with the dead-letter queue gone = %v, want it named as missing", err)
	}
}
