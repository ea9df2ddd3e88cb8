package messaging

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// DefaultDeliveryLimit is the x-delivery-limit of consumer queues: a backstop that
// dead-letters a message after this many deliveries (a message that crashes its consumer
// every time, say). RabbitMQ 3.x quorum queues have no limit unless one is set; from 4.3 a
// requeue no longer counts towards it, so the [Consumer] also dead-letters by itself a message
// that fails on its last allowed delivery.
const DefaultDeliveryLimit = 20

// DeclareExchange declares a durable topic exchange. Declaring is idempotent, so every
// (re)connect does it.
func DeclareExchange(ch *amqp.Channel, name string) error {
	if err := ch.ExchangeDeclare(name, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %q: %w", name, err)
	}
	return nil
}

// DeadLetterQueue names the dead-letter queue of a consumer queue.
func DeadLetterQueue(queue string) string { return queue + ".dlq" }

// ConsumerTopology is what one consumer needs on the broker: its exchange, its own durable
// quorum queue bound to the routing keys it handles, and a dead-letter queue next to it.
type ConsumerTopology struct {
	Exchange      string
	Queue         string
	RoutingKeys   []string
	DeliveryLimit int // default DefaultDeliveryLimit; give the consumer the same value
}

// Declare declares the exchange, the dead-letter queue, the queue and its bindings.
// Rejected messages go through the default exchange straight to the dead-letter queue, so no
// extra exchange is needed.
func (t ConsumerTopology) Declare(ch *amqp.Channel) error {
	if err := DeclareExchange(ch, t.Exchange); err != nil {
		return err
	}
	dlq := DeadLetterQueue(t.Queue)
	if _, err := ch.QueueDeclare(dlq, true, false, false, false, amqp.Table{
		amqp.QueueTypeArg: amqp.QueueTypeQuorum,
	}); err != nil {
		return fmt.Errorf("declare dead-letter queue %q: %w", dlq, err)
	}
	limit := t.DeliveryLimit
	if limit <= 0 {
		limit = DefaultDeliveryLimit
	}
	if _, err := ch.QueueDeclare(t.Queue, true, false, false, false, amqp.Table{
		amqp.QueueTypeArg:           amqp.QueueTypeQuorum,
		"x-delivery-limit":          limit,
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": dlq,
	}); err != nil {
		return fmt.Errorf("declare queue %q: %w", t.Queue, err)
	}
	for _, key := range t.RoutingKeys {
		if err := ch.QueueBind(t.Queue, key, t.Exchange, false, nil); err != nil {
			return fmt.Errorf("bind queue %q to %q/%q: %w", t.Queue, t.Exchange, key, err)
		}
	}
	return nil
}
