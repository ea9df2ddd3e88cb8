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

// Binding routes the messages of one exchange with one routing key to a queue.
type Binding struct {
	Exchange   string
	RoutingKey string
}

// ConsumerTopology is what one consumer needs on the broker: its own durable quorum queue
// bound to what it handles, the exchanges those come from, and a dead-letter queue next to it.
// Exchange with RoutingKeys binds keys of one exchange; Bindings adds any others.
type ConsumerTopology struct {
	Exchange      string
	Queue         string
	RoutingKeys   []string
	Bindings      []Binding
	DeliveryLimit int // default DefaultDeliveryLimit; give the consumer the same value
}

// bindings lists every binding, RoutingKeys first.
func (t ConsumerTopology) bindings() []Binding {
	all := make([]Binding, 0, len(t.RoutingKeys)+len(t.Bindings))
	for _, key := range t.RoutingKeys {
		all = append(all, Binding{Exchange: t.Exchange, RoutingKey: key})
	}
	return append(all, t.Bindings...)
}

// Declare declares the exchanges, the dead-letter queue, the queue and its bindings.
// Rejected messages go through the default exchange straight to the dead-letter queue, so no
// extra exchange is needed.
func (t ConsumerTopology) Declare(ch *amqp.Channel) error {
	declared := map[string]bool{}
	for _, b := range append([]Binding{{Exchange: t.Exchange}}, t.bindings()...) {
		if b.Exchange == "" || declared[b.Exchange] {
			continue
		}
		if err := DeclareExchange(ch, b.Exchange); err != nil {
			return err
		}
		declared[b.Exchange] = true
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
	for _, b := range t.bindings() {
		if err := ch.QueueBind(t.Queue, b.RoutingKey, b.Exchange, false, nil); err != nil {
			return fmt.Errorf("bind queue %q to %q/%q: %w", t.Queue, b.Exchange, b.RoutingKey, err)
		}
	}
	return nil
}
