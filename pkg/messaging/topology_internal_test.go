package messaging

import (
	"math"
	"strings"
	"testing"
)

// A binding to the default exchange (an Event without an Exchange), a delivery limit past 32
// bits and a queue name whose dead-letter queue's name is past AMQP's 255 bytes are refused
// before anything is declared: RabbitMQ refuses the first for lack of permission, which Declare
// took for the deployment's doing, leaving the queue bound to nothing; AMQP carries the second
// in 32 bits, and it arrived negative; the queue of the third was declared, and the declaration
// of its dead-letter queue failed at every connect.
func TestATopologyTheBrokerCannotTakeIsRefused(t *testing.T) {
	t.Parallel()
	for want, topology := range map[string]Topology{
		"the default exchange": {Queues: []ConsumerTopology{{Queue: "q", Bindings: []Binding{{RoutingKey: "OrderPlaced"}}}}},
		"32 bits":              {Queues: []ConsumerTopology{{Queue: "q", DeliveryLimit: math.MaxInt32 + 1}}},
		"queue name":           {Queues: []ConsumerTopology{{Queue: strings.Repeat("q", maxQueueName+1)}}},
	} {
		if err := topology.Declare(nil, nil); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Declare of %+v = %v, want an error about %s", topology, err, want)
		}
	}
	if err := (Topology{Queues: []ConsumerTopology{{Queue: "q", DeliveryLimit: math.MaxInt32}}}).check(); err != nil {
		t.Errorf("a delivery limit of 32 bits: %v, want taken", err)
	}
	if err := (Topology{Queues: []ConsumerTopology{{Queue: strings.Repeat("q", maxQueueName)}}}).check(); err != nil {
		t.Errorf("a queue name of %d bytes: %v, want taken", maxQueueName, err)
	}
}
