package deploy_test

// The system's topology on the broker is written three times: events.Topology, which every
// service declares at start; deploy/rabbitmq/definitions.json, which the compose broker imports
// at boot; and the Messaging Topology Operator's resources in deploy/k8s. The deployments must
// declare exactly what the services do. A queue or binding missing there exists only once a
// service allowed to declare it has started, and an event published before that is lost for
// it; a queue with other arguments makes the broker refuse the services' own declarations
// (PRECONDITION_FAILED), and they do not start.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// brokerTopology is a topology as the broker holds it, whoever declared it.
type brokerTopology struct {
	exchanges map[string]exchangeDecl
	queues    map[string]queueDecl
	bindings  map[bindingDecl]bool
	twice     []string // resources declared more than once
}

type exchangeDecl struct {
	VHost, Type                   string
	Durable, AutoDelete, Internal bool
	Arguments                     string // canonicalArgs
}

type queueDecl struct {
	VHost               string
	Durable, AutoDelete bool
	Arguments           string // canonicalArgs
}

type bindingDecl struct {
	VHost, Source, Destination, DestinationType, RoutingKey string
	Arguments                                               string // canonicalArgs
}

func newBrokerTopology() *brokerTopology {
	return &brokerTopology{exchanges: map[string]exchangeDecl{}, queues: map[string]queueDecl{}, bindings: map[bindingDecl]bool{}}
}

func (b *brokerTopology) exchange(name string, d exchangeDecl) {
	if _, ok := b.exchanges[name]; ok {
		b.twice = append(b.twice, "exchange "+name)
	}
	b.exchanges[name] = d
}

func (b *brokerTopology) queue(name string, d queueDecl) {
	if _, ok := b.queues[name]; ok {
		b.twice = append(b.twice, "queue "+name)
	}
	b.queues[name] = d
}

func (b *brokerTopology) binding(d bindingDecl) {
	if b.bindings[d] {
		b.twice = append(b.twice, fmt.Sprintf("binding %+v", d))
	}
	b.bindings[d] = true
}

// canonicalArgs writes x-arguments as JSON with sorted keys, numbers as written: the int
// and int32 of an amqp.Table, a JSON number of the definitions file and a YAML number of a
// manifest compare equal when they are the same number. No arguments at all is {}.
func canonicalArgs(t testing.TB, args any) string {
	t.Helper()
	raw, err := json.Marshal(args)
	if err != nil {
		t.Fatalf("arguments %v: %v", args, err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var m map[string]any
	if err := dec.Decode(&m); err != nil {
		t.Fatalf("arguments %s are not an object: %v", raw, err)
	}
	if len(m) == 0 {
		return "{}"
	}
	out, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// systemTopology is events.Topology as messaging.Topology.Declare declares it on the virtual
// host the services connect to (/): durable topic exchanges, each queue with Arguments() and
// its dead-letter queue with DeadLetterArguments(), both durable, and the queue's bindings,
// none with arguments.
func systemTopology(t testing.TB) *brokerTopology {
	t.Helper()
	b := newBrokerTopology()
	for _, x := range events.Topology.AllExchanges() {
		b.exchange(x, exchangeDecl{VHost: "/", Type: "topic", Durable: true, Arguments: "{}"})
	}
	for _, q := range events.Topology.Queues {
		b.queue(q.Queue, queueDecl{VHost: "/", Durable: true, Arguments: canonicalArgs(t, q.Arguments())})
		b.queue(messaging.DeadLetterQueue(q.Queue), queueDecl{VHost: "/", Durable: true, Arguments: canonicalArgs(t, q.DeadLetterArguments())})
		for _, bind := range q.Bindings {
			b.binding(bindingDecl{VHost: "/", Source: bind.Exchange, Destination: q.Queue, DestinationType: "queue", RoutingKey: bind.RoutingKey, Arguments: "{}"})
		}
	}
	return b
}

// definitionsTopology is what a broker importing defs declares.
func definitionsTopology(t testing.TB, defs definitions) *brokerTopology {
	t.Helper()
	b := newBrokerTopology()
	for _, x := range defs.Exchanges {
		b.exchange(x.Name, exchangeDecl{VHost: x.VHost, Type: x.Type, Durable: x.Durable, AutoDelete: x.AutoDelete, Internal: x.Internal, Arguments: canonicalArgs(t, x.Arguments)})
	}
	for _, q := range defs.Queues {
		b.queue(q.Name, queueDecl{VHost: q.VHost, Durable: q.Durable, AutoDelete: q.AutoDelete, Arguments: canonicalArgs(t, q.Arguments)})
	}
	for _, bind := range defs.Bindings {
		b.binding(bindingDecl{VHost: bind.VHost, Source: bind.Source, Destination: bind.Destination,
			DestinationType: bind.DestinationType, RoutingKey: bind.RoutingKey, Arguments: canonicalArgs(t, bind.Arguments)})
	}
	return b
}

// withoutArguments is b with every x-argument left out.
func (b *brokerTopology) withoutArguments() *brokerTopology {
	out := newBrokerTopology()
	for name, x := range b.exchanges {
		x.Arguments = ""
		out.exchange(name, x)
	}
	for name, q := range b.queues {
		q.Arguments = ""
		out.queue(name, q)
	}
	for bind := range b.bindings {
		bind.Arguments = ""
		out.binding(bind)
	}
	return out
}

// diff lists how got differs from b, the topology wanted, one line per resource, sorted; nil
// if they are the same.
func (b *brokerTopology) diff(got *brokerTopology) []string {
	want := b
	var out []string
	for name, w := range want.exchanges {
		if g, ok := got.exchanges[name]; !ok {
			out = append(out, fmt.Sprintf("exchange %s is missing (want %+v)", name, w))
		} else if g != w {
			out = append(out, fmt.Sprintf("exchange %s is %+v, want %+v", name, g, w))
		}
	}
	for name, w := range want.queues {
		if g, ok := got.queues[name]; !ok {
			out = append(out, fmt.Sprintf("queue %s is missing (want %+v)", name, w))
		} else if g != w {
			out = append(out, fmt.Sprintf("queue %s is %+v, want %+v", name, g, w))
		}
	}
	for name := range got.exchanges {
		if _, ok := want.exchanges[name]; !ok {
			out = append(out, "exchange "+name+" is not in events.Topology")
		}
	}
	for name := range got.queues {
		if _, ok := want.queues[name]; !ok {
			out = append(out, "queue "+name+" is not in events.Topology")
		}
	}
	for bind := range want.bindings {
		if !got.bindings[bind] {
			out = append(out, fmt.Sprintf("binding %+v is missing", bind))
		}
	}
	for bind := range got.bindings {
		if !want.bindings[bind] {
			out = append(out, fmt.Sprintf("binding %+v is not in events.Topology", bind))
		}
	}
	for _, r := range got.twice {
		out = append(out, r+" is declared twice")
	}
	slices.Sort(out)
	return out
}

// topologyDiff prints got's differences from want when it is printed, not before.
type topologyDiff struct{ want, got *brokerTopology }

func (d *topologyDiff) String() string { return strings.Join(d.want.diff(d.got), "\n") }

// The compose broker's definitions declare exactly events.Topology: both exchanges, both
// queues and their dead-letter queues with the services' arguments, every binding.
func TestComposeTopology(t *testing.T) {
	t.Parallel()
	got := definitionsTopology(t, readDefinitions(t))
	if d := systemTopology(t).diff(got); d != nil {
		t.Errorf("%s does not declare events.Topology:\n%s", definitionsFile, strings.Join(d, "\n"))
	}
}

// The Messaging Topology Operator's resources declare exactly events.Topology, on the
// RabbitmqCluster of these manifests, and deleting a Queue resource keeps its messages.
func TestK8sTopology(t *testing.T) {
	t.Parallel()
	m := k8s(t)
	if len(m.rabbits) != 1 {
		t.Fatalf("want one RabbitmqCluster, have %d", len(m.rabbits))
	}
	cluster := m.rabbits[0].Metadata.Name
	got := newBrokerTopology()
	for _, x := range m.exchanges {
		checkClusterRef(t, "Exchange "+x.Metadata.Name, x.Spec.RabbitmqClusterReference, cluster)
		s := x.Spec
		got.exchange(s.Name, exchangeDecl{VHost: orDefault(s.Vhost, "/"), Type: orDefault(s.Type, "direct"), Durable: s.Durable, AutoDelete: s.AutoDelete, Arguments: canonicalArgs(t, s.Arguments)})
	}
	for _, q := range m.queues {
		checkClusterRef(t, "Queue "+q.Metadata.Name, q.Spec.RabbitmqClusterReference, cluster)
		s := q.Spec
		if s.DeletionPolicy != "retain" {
			t.Errorf("Queue %s: deletionPolicy %q, want retain: deleting the resource must not delete the messages", q.Metadata.Name, s.DeletionPolicy)
		}
		// The operator sends spec.type as the x-queue-type argument.
		args := maps.Clone(s.Arguments)
		if s.Type != "" {
			if args == nil {
				args = map[string]any{}
			}
			if v, ok := args["x-queue-type"]; ok && v != s.Type {
				t.Errorf("Queue %s: type %q and argument x-queue-type %v disagree", q.Metadata.Name, s.Type, v)
			}
			args["x-queue-type"] = s.Type
		}
		durable := s.Durable != nil && *s.Durable
		got.queue(s.Name, queueDecl{VHost: orDefault(s.Vhost, "/"), Durable: durable, AutoDelete: s.AutoDelete, Arguments: canonicalArgs(t, args)})
	}
	for _, b := range m.bindings {
		checkClusterRef(t, "Binding "+b.Metadata.Name, b.Spec.RabbitmqClusterReference, cluster)
		s := b.Spec
		got.binding(bindingDecl{VHost: orDefault(s.Vhost, "/"), Source: s.Source, Destination: s.Destination,
			DestinationType: s.DestinationType, RoutingKey: s.RoutingKey, Arguments: canonicalArgs(t, s.Arguments)})
	}
	if d := systemTopology(t).diff(got); d != nil {
		t.Errorf("deploy/k8s does not declare events.Topology:\n%s", strings.Join(d, "\n"))
	}
}

// The comparison sees every kind of difference: a resource missing, one too many, one
// declared twice, and a field or an argument changed.
func TestBrokerTopologyDiff(t *testing.T) {
	t.Parallel()
	want := systemTopology(t)
	if d := want.diff(systemTopology(t)); d != nil {
		t.Fatalf("events.Topology differs from itself: %v", d)
	}
	var someBinding bindingDecl
	for b := range want.bindings {
		someBinding = b
		break
	}
	q := events.Topology.Queues[0]
	dlq := messaging.DeadLetterQueue(q.Queue)
	x := events.Topology.AllExchanges()[0]
	changes := map[string]func(b *brokerTopology){
		"binding missing": func(b *brokerTopology) { delete(b.bindings, someBinding) },
		"binding routing key": func(b *brokerTopology) {
			delete(b.bindings, someBinding)
			other := someBinding
			other.RoutingKey = "#"
			b.binding(other)
		},
		"binding twice": func(b *brokerTopology) { b.binding(someBinding) },
		"queue missing": func(b *brokerTopology) { delete(b.queues, dlq) },
		"queue extra":   func(b *brokerTopology) { b.queue("extra", b.queues[q.Queue]) },
		"queue argument": func(b *brokerTopology) {
			other := q
			other.DeliveryLimit = 5
			b.queues[q.Queue] = queueDecl{VHost: "/", Durable: true, Arguments: canonicalArgs(t, other.Arguments())}
		},
		"queue not durable": func(b *brokerTopology) {
			d := b.queues[dlq]
			d.Durable = false
			b.queues[dlq] = d
		},
		"exchange type": func(b *brokerTopology) {
			d := b.exchanges[x]
			d.Type = "direct"
			b.exchanges[x] = d
		},
		"exchange vhost": func(b *brokerTopology) {
			d := b.exchanges[x]
			d.VHost = "other"
			b.exchanges[x] = d
		},
	}
	for name, change := range changes {
		got := systemTopology(t)
		change(got)
		if d := want.diff(got); d == nil {
			t.Errorf("%s: not seen", name)
		}
	}
}

// checkClusterRef checks that a topology resource goes to the RabbitmqCluster cluster of these
// manifests, in their namespace, through the operator's default user.
func checkClusterRef(t *testing.T, what string, ref topologyClusterRef, cluster string) {
	t.Helper()
	if ref.Name != cluster || ref.Namespace != "" || ref.ConnectionSecret != nil {
		t.Errorf("%s: rabbitmqClusterReference %+v, want name %s alone (the RabbitmqCluster beside it)", what, ref, cluster)
	}
}

// orDefault is v, or def when v is empty: the value the API server stores for a field its CRD
// defaults.
func orDefault(v, def string) string {
	if v == "" {
		return def
	}
	return v
}
