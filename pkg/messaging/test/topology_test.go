package test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A user that may configure nothing still declares the whole topology, once the deployment
// has declared it (broker definitions, an operator): each refusal is accepted because the
// resource exists. A resource that is missing is an error that names it.
func TestTopologyDeclareAcceptsWhatTheDeploymentDeclared(t *testing.T) {
	t.Parallel()
	v := restrictedVhost(t, "^$", ".*", ".*")
	err := declaredTopology.Declare(v.restricted, nil)
	if err == nil || !strings.Contains(err.Error(), `exchange orders: refused`) || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("declare on an empty vhost without permission = %v, want the exchange named as missing", err)
	}
	if err := declaredTopology.Declare(v.dial("guest:guest"), nil); err != nil {
		t.Fatalf("the deployment's declaration: %v", err)
	}
	if err := declaredTopology.Declare(v.restricted, nil); err != nil {
		t.Fatalf("declare what the deployment declared, without permission: %v", err)
	}
	ch, err := v.dial("guest:guest").Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDelete(messaging.DeadLetterQueue("invoicing"), false, false, false); err != nil {
		t.Fatal(err)
	}
	if err := declaredTopology.Declare(v.restricted, nil); err == nil || !strings.Contains(err.Error(), "dead-letter queue invoicing.dlq: refused") {
		t.Fatalf("declare with the dead-letter queue gone = %v, want it named as missing", err)
	}
}

// A user with no right at all on the deployment's resources (a producer that declares its
// consumers' queues, as each service does, under a user of its own) still declares the
// topology: RabbitMQ from 4.2.6 on refuses it even the passive declaration that would say
// whether a resource exists, and that refusal is accepted, and logged as the deployment's to
// guarantee. Earlier brokers answer the passive declaration: there each resource is found.
func TestTopologyDeclareAcceptsWhatItMayNotEvenSee(t *testing.T) {
	t.Parallel()
	v := restrictedVhost(t, "^$", "^$", "^$")
	if err := declaredTopology.Declare(v.dial("guest:guest"), nil); err != nil {
		t.Fatalf("the deployment's declaration: %v", err)
	}
	log, logs := testenv.NewLogger(t)
	if err := declaredTopology.Declare(v.restricted, log); err != nil {
		t.Fatalf("declare what the deployment declared, with no right on it: %v", err)
	}
	for _, what := range []string{"exchange orders", "exchange billing", "queue invoicing", "dead-letter queue invoicing.dlq"} {
		if len(logs.Lines("level=DEBUG", "not allowed to declare "+what+",", what+", nor"))+len(logs.Lines("level=DEBUG", "not allowed to declare "+what+";")) != 1 {
			t.Errorf("the refused declaration of %s was not logged once as accepted", what)
		}
	}
	// A binding is never seen to exist: each is named, as the deployment's to declare, at debug
	// level: no queue here is the caller's own, which a subscription warns of.
	for _, b := range declaredTopology.Queues[0].Bindings {
		if n := len(logs.Lines("level=DEBUG", "a binding cannot be checked", "binding_queue=invoicing", "exchange="+b.Exchange, "routing_key="+b.RoutingKey)); n != 1 {
			t.Errorf("the binding to %s/%s taken on trust was logged %d times at debug level, want once", b.Exchange, b.RoutingKey, n)
		}
	}
	version, _ := v.restricted.Properties["version"].(string)
	if hidden := len(logs.Lines("nor to see whether it exists")); hidden == 0 && hidesResources(version) {
		t.Errorf("RabbitMQ %s answered the passive declarations: the test shows nothing there", version)
	}
}

// A subscription whose user may not bind its queue cannot tell a binding the deployment left
// out from one it declared: AMQP has no passive bind. It starts, and consumes, and warns of each
// of its queue's bindings as the deployment's to declare: one left out means it never gets that
// event. It logged them at debug level only, as it logs an exchange seen to exist.
func TestASubscriptionWarnsOfTheBindingsItMayNotDeclare(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	v := restrictedVhost(t, "^$", "^$", ".*") // may consume, may not bind: no write on the queue
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: b.name, Bindings: []messaging.Binding{b.placed.Binding(), b.cancels.Binding()}}}}
	// The deployment declares it all but the binding to the cancellations.
	deployed := messaging.Topology{Exchanges: []string{b.cancels.Exchange},
		Queues: []messaging.ConsumerTopology{{Queue: b.name, Bindings: []messaging.Binding{b.placed.Binding()}}}}
	if err := deployed.Declare(v.dial("guest:guest"), nil); err != nil {
		t.Fatalf("the deployment's declaration: %v", err)
	}
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) { c.URL, c.Topology = v.url(v.user+":secret"), topology })
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error { return nil }))
	must(t, messaging.Handle(s, b.cancels, func(ctx context.Context, tx *gorm.DB, c cancelled, msg messaging.Message) error { return nil }))
	run(t, s.Run)
	testenv.Eventually(t, 10*time.Second, s.Ready, "the subscription did not start on the deployment's topology")
	for _, bound := range topology.Queues[0].Bindings {
		if n := len(b.logs.Lines("level=WARN", "a binding cannot be checked: the deployment must declare it", "binding_queue="+b.name,
			"exchange="+bound.Exchange, "routing_key="+bound.RoutingKey)); n != 1 {
			t.Errorf("the binding of queue %s to %s/%s, taken on trust, was warned of %d times, want once", b.name, bound.Exchange, bound.RoutingKey, n)
		}
	}
}

// declaredTopology is what the deployment declares in the tests of a restricted user.
var declaredTopology = messaging.Topology{Exchanges: []string{"orders"}, Queues: []messaging.ConsumerTopology{
	{Queue: "invoicing", Bindings: []messaging.Binding{{Exchange: "orders", RoutingKey: "OrderPlaced"}, {Exchange: "billing", RoutingKey: "Refund"}}},
}}

// vhostOf is a vhost of its own and a connection to it as a user of restricted permissions.
type vhostOf struct {
	t          *testing.T
	name, user string // the user of restricted permissions, whose password is "secret"
	restricted *amqp.Connection
}

// restrictedVhost makes a vhost where guest may do anything and a new user only what the
// permissions' regular expressions allow.
func restrictedVhost(t *testing.T, configure, write, read string) vhostOf {
	t.Helper()
	vhost, user := testenv.UniqueName("topology"), testenv.UniqueName("declarer")
	t.Cleanup(func() {
		testenv.RabbitMQCtlQuietly("delete_vhost", vhost)
		testenv.RabbitMQCtlQuietly("delete_user", user)
	})
	testenv.RabbitMQCtl(t, "add_vhost", vhost)
	testenv.RabbitMQCtl(t, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
	testenv.RabbitMQCtl(t, "add_user", user, "secret")
	testenv.RabbitMQCtl(t, "set_permissions", "-p", vhost, user, configure, write, read)
	v := vhostOf{t: t, name: vhost, user: user}
	v.restricted = v.dial(user + ":secret")
	return v
}

// url is the vhost's URL for login, a user:password.
func (v vhostOf) url(login string) string {
	return strings.Replace(testenv.AMQPURL(), "guest:guest@", login+"@", 1) + v.name
}

func (v vhostOf) dial(login string) *amqp.Connection {
	v.t.Helper()
	conn, err := amqp.Dial(v.url(login))
	if err != nil {
		v.t.Fatalf("dial as %s: %v", login, err)
	}
	v.t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// hidesResources reports whether RabbitMQ version refuses a passive declaration to a user
// with no permission on the resource: 4.2.6 and later 4.2 releases, 4.3 and later.
func hidesResources(version string) bool {
	return releaseAtLeast(version, 4, 2, 6)
}

// releaseAtLeast reports whether version, a broker's major.minor.patch, is release or later;
// false if it does not read as one.
func releaseAtLeast(version string, release ...int) bool {
	var v [3]int
	if _, err := fmt.Sscanf(version, "%d.%d.%d", &v[0], &v[1], &v[2]); err != nil {
		return false
	}
	return slices.Compare(v[:len(release)], release) >= 0
}

// The queue's own delivery limit is the backstop behind the consumer's: a message that fails
// on every delivery it gets (here a client that rejects it, as a consumer that crashes on it
// is charged) is moved by the broker to the dead-letter queue at the limit, with the broker's
// reason, instead of coming back for ever or being dropped.
func TestTheQueueDeadLettersAMessageAtItsDeliveryLimit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	queue := testenv.UniqueName("limited")
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: queue, DeliveryLimit: 2}}}
	testenv.CleanupBroker(t, []string{queue, messaging.DeadLetterQueue(queue)}, nil)
	declare(t, topology)
	msg := newMessage(t, 1)
	must(t, b.ch.PublishWithContext(context.Background(), "", queue, true, false, publishing(msg)))
	rejects := 0
	testenv.Eventually(t, 10*time.Second, func() bool {
		d, ok, err := b.ch.Get(queue, false)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			rejects++
			must(t, d.Reject(true))
		}
		return testenv.QueueDepth(t, b.ch, messaging.DeadLetterQueue(queue)) == 1
	}, "the message was not dead-lettered by its queue")
	if rejects > 3 {
		t.Fatalf("rejected %d times before it was dead-lettered, want the limit of 2 (3 on brokers that count from 0)", rejects)
	}
	got := deadLetters(t, b.ch, queue)
	if len(got) != 1 || got[0].MessageId != msg.ID.String() {
		t.Fatalf("dead-letter queue held %d messages, want the rejected message", len(got))
	}
	deaths, _ := got[0].Headers["x-death"].([]any)
	if len(deaths) == 0 {
		t.Fatalf("the dead-lettered message has no x-death: headers %v", got[0].Headers)
	}
	if death, _ := deaths[0].(amqp.Table); death["queue"] != queue || death["reason"] != "delivery_limit" {
		t.Fatalf("x-death %v, want the broker's delivery_limit from queue %s", deaths[0], queue)
	}
}
