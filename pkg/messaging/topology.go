package messaging

import (
	"errors"
	"fmt"
	"math"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"
)

// DefaultDeliveryLimit is the x-delivery-limit of consumer queues: a backstop that
// dead-letters a message after this many deliveries (a message that crashes its consumer
// every time, say). RabbitMQ 3.x quorum queues have no limit unless one is set; from 4.3 a
// requeue no longer counts towards it, so the [Consumer] also dead-letters by itself a message
// that fails on its last allowed delivery.
const DefaultDeliveryLimit = 20

// deadLetterDeliveryLimit is the x-delivery-limit of dead-letter queues: no limit in practice.
// Nothing consumes a dead-letter queue but an operator listing it, and every listing hands its
// messages back, which RabbitMQ 4.0 to 4.2 count against a quorum queue's limit (4.x's default
// is 20, and the dead-letter queue has nowhere to dead-letter to: the message would be dropped).
// Not -1, which 4.x reads as "no limit": RabbitMQ 3.x reads it as a limit below every count and
// drops each message the first time it is handed back. Omitting it means no limit on 3.x but 20
// on 4.x. The largest 32-bit value means the same on both.
const deadLetterDeliveryLimit = math.MaxInt32

// ErrLegacyDeadLetterQueue means the dead-letter queue exists already, declared by an earlier
// version without x-delivery-limit: RabbitMQ refuses a declaration with other arguments, and
// closes the channel it came on. The queue works as before; on RabbitMQ 4.0 to 4.2 it has the
// default limit of 20 deliveries (see the README's "When something goes wrong").
var ErrLegacyDeadLetterQueue = errors.New("dead-letter queue declared earlier without x-delivery-limit")

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

// Declare declares the exchanges, the queue, its bindings and, last, its dead-letter queue,
// which has no delivery limit. Rejected messages, and those over the queue's delivery limit, go
// through the default exchange straight to the dead-letter queue, so no extra exchange is
// needed. A dead-letter queue declared by an earlier version makes it return an error wrapping
// [ErrLegacyDeadLetterQueue], once everything else is declared, on a channel the broker closed.
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
	return declareDeadLetterQueue(ch, dlq)
}

// declareDeadLetterQueue declares dlq without a delivery limit (see deadLetterDeliveryLimit).
func declareDeadLetterQueue(ch *amqp.Channel, dlq string) error {
	_, err := ch.QueueDeclare(dlq, true, false, false, false, amqp.Table{
		amqp.QueueTypeArg:  amqp.QueueTypeQuorum,
		"x-delivery-limit": int32(deadLetterDeliveryLimit),
	})
	var refused *amqp.Error
	switch {
	case err == nil:
		return nil
	case errors.As(err, &refused) && refused.Code == amqp.PreconditionFailed &&
		strings.Contains(refused.Reason, "inequivalent arg 'x-delivery-limit'"):
		return fmt.Errorf("%w: %q: %w", ErrLegacyDeadLetterQueue, dlq, err)
	default:
		return fmt.Errorf("declare dead-letter queue %q: %w", dlq, err)
	}
}
