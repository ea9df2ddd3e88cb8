package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"
)

// DefaultDeliveryLimit is the x-delivery-limit of consumer queues: a backstop that
// dead-letters a message after this many failed deliveries (a message that crashes its
// consumer every time, say). RabbitMQ 3.x quorum queues have no limit unless one is set; 4.x
// has a default of 20. A [Subscription] returns a failed message with basic.reject, which every
// RabbitMQ version counts as a failed delivery (from 4.3 on, a basic.nack does not), and
// dead-letters by itself, with its reason, a message failing on its last allowed delivery.
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
// default limit of 20 deliveries.
var ErrLegacyDeadLetterQueue = errors.New("dead-letter queue declared earlier without x-delivery-limit")

// deadLetterSuffix ends the name of a consumer queue's dead-letter queue.
const deadLetterSuffix = ".dlq"

// DeadLetterQueue names the dead-letter queue of a consumer queue.
func DeadLetterQueue(queue string) string { return queue + deadLetterSuffix }

// maxQueueName is the longest consumer queue name, in bytes: AMQP carries a queue's name in a
// short string, and its dead-letter queue's is longer by deadLetterSuffix.
const maxQueueName = maxShortString - len(deadLetterSuffix)

// checkQueueName refuses a consumer queue name that AMQP cannot carry, its dead-letter queue's
// included: the queue would be declared, and its dead-letter queue refused at every connect.
func checkQueueName(name string) error {
	if len(name) > maxQueueName {
		return fmt.Errorf("%q is %d bytes, more than %d: AMQP carries a name in %d, and its dead-letter queue's adds %q",
			truncate(name), len(name), maxQueueName, maxShortString, deadLetterSuffix)
	}
	return nil
}

// Binding routes the messages of one exchange with one routing key to a queue.
type Binding struct {
	Exchange   string
	RoutingKey string
}

// ConsumerTopology is what one consumer needs on the broker: its own durable quorum queue
// bound to what it handles, and a dead-letter queue next to it.
type ConsumerTopology struct {
	Queue    string
	Bindings []Binding
	// DeliveryLimit defaults to DefaultDeliveryLimit; a Subscription of the queue never allows
	// more. It is one of the queue's arguments, which RabbitMQ fixes when the queue is first
	// declared: a different one for a queue that exists is refused (PRECONDITION_FAILED,
	// inequivalent arg 'x-delivery-limit'): publishers and consumers of that topology keep
	// trying, logging the refusal, and do not start until the value is put back or the queue
	// deleted and declared again.
	DeliveryLimit int
}

// Arguments are the queue's x-arguments: a quorum queue with its delivery limit, whose rejected
// messages go through the default exchange straight to its dead-letter queue. A deployment
// that declares the queue itself (broker definitions, an operator) must give exactly these: the
// broker refuses a declaration whose arguments differ from the queue's.
func (t ConsumerTopology) Arguments() amqp.Table {
	return amqp.Table{
		amqp.QueueTypeArg:           amqp.QueueTypeQuorum,
		"x-delivery-limit":          t.deliveryLimit(),
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": DeadLetterQueue(t.Queue),
	}
}

// deliveryLimit is the queue's x-delivery-limit, as Arguments declares it.
func (t ConsumerTopology) deliveryLimit() int {
	if t.DeliveryLimit > 0 {
		return t.DeliveryLimit
	}
	return DefaultDeliveryLimit
}

// DeadLetterArguments are the dead-letter queue's x-arguments: a quorum queue whose delivery
// limit is the largest 32-bit value, no limit in practice. Nothing consumes a dead-letter queue
// but an operator listing it, and each listing hands the messages back, which RabbitMQ 4.0 to
// 4.2 count against the limit (20 by default on 4.x). Not -1, which RabbitMQ 3.x reads as a
// limit below every count.
func (t ConsumerTopology) DeadLetterArguments() amqp.Table {
	return amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum, "x-delivery-limit": int32(deadLetterDeliveryLimit)}
}

// Topology is what a system needs on the broker: the exchanges its events are published to,
// and every consumer's queue with its bindings and dead-letter queue. Every process of the
// system declares all of it before it publishes or consumes anything: a message published
// before its consumer first started then waits in that consumer's queue, whatever order the
// processes start in. (mandatory only tells that at least one queue took a message: a queue
// that does not exist yet misses it silently.)
type Topology struct {
	Exchanges []string // durable topic exchanges; those the bindings name are declared too
	Queues    []ConsumerTopology
}

// Queue returns the entry of the named queue.
func (t Topology) Queue(name string) (ConsumerTopology, bool) {
	i := slices.IndexFunc(t.Queues, func(q ConsumerTopology) bool { return q.Queue == name })
	if i < 0 {
		return ConsumerTopology{}, false
	}
	return t.Queues[i], true
}

// AllExchanges lists every exchange of the topology once, in order: Exchanges, then those the
// bindings name.
func (t Topology) AllExchanges() []string {
	var all []string
	add := func(x string) {
		if x != "" && !slices.Contains(all, x) {
			all = append(all, x)
		}
	}
	for _, x := range t.Exchanges {
		add(x)
	}
	for _, q := range t.Queues {
		for _, b := range q.Bindings {
			add(b.Exchange)
		}
	}
	return all
}

// Declare declares the topology on conn, idempotently: the exchanges, then each queue, its
// bindings and its dead-letter queue.
//
// A deployment may declare the topology itself (broker definitions, an operator's resources)
// and give each service's user the right to configure only its own resources. A declaration the
// broker refuses for lack of that right is then accepted when the resource exists, and, for a
// binding, when its queue does: the deployment declared it. log (nil: none) says which, once
// per declaration, at debug level. A [Subscription] logs the bindings of its own queue taken so
// at warn level: AMQP gives no way to check a binding, and a queue missing one the deployment
// left out never gets that event (another queue's is its own subscription's to warn of). A
// resource that neither exists nor may be declared is an error.
//
// Where the user has no right at all on a refused resource, RabbitMQ from 4.2.6 and 4.3.0 on
// refuses the passive declaration that would tell whether it exists, whether it does or not
// (4.2.6 and 4.3.0 want configure, later releases any permission; earlier ones answer anyone).
// That refusal is accepted too, and logged: whether the resource exists is then the
// deployment's to guarantee.
//
// Dead-letter queues declared by an earlier version make it return an error wrapping
// [ErrLegacyDeadLetterQueue] that names each of them, once everything else is declared.
func (t Topology) Declare(conn *amqp.Connection, log *slog.Logger) error {
	_, err := t.declare(conn, log)
	return err
}

// declare is Declare, and returns the exchanges it took on trust: refused, and their existence
// hidden. Every other exchange of t was declared or seen to exist.
func (t Topology) declare(conn *amqp.Connection, log *slog.Logger) (trusted map[string]bool, err error) {
	return t.declareConsuming(conn, log, "")
}

// declareConsuming is declare for a consumer of queue consumed, which logs the bindings of that
// queue it takes on trust at warn level: a missing one means it never gets that event while it
// looks ready.
func (t Topology) declareConsuming(conn *amqp.Connection, log *slog.Logger, consumed string) (trusted map[string]bool, err error) {
	if err := t.check(); err != nil {
		return nil, err
	}
	d := &declarer{conn: conn, log: log}
	defer d.close()
	trusted = make(map[string]bool)
	for _, x := range t.AllExchanges() {
		_, hidden, err := d.declare("exchange "+x, func(ch *amqp.Channel) error {
			return ch.ExchangeDeclare(x, amqp.ExchangeTopic, true, false, false, false, nil)
		}, func(ch *amqp.Channel) error {
			return ch.ExchangeDeclarePassive(x, amqp.ExchangeTopic, true, false, false, false, nil)
		})
		if err != nil {
			return nil, err
		}
		if hidden {
			trusted[x] = true
		}
	}
	var legacy legacyQueues
	for _, q := range t.Queues {
		_, _, err := d.declare("queue "+q.Queue, func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclare(q.Queue, true, false, false, false, q.Arguments())
			return err
		}, passiveQueue(q.Queue))
		if err != nil {
			return nil, err
		}
		level := slog.LevelDebug
		if q.Queue == consumed {
			level = slog.LevelWarn
		}
		for _, b := range q.Bindings {
			if err := d.bind(q.Queue, b, level); err != nil {
				return nil, err
			}
		}
		_, _, err = d.deadLetterQueue(q)
		switch {
		case isLegacyDeadLetterQueue(err):
			legacy.names = append(legacy.names, DeadLetterQueue(q.Queue))
			legacy.errs = append(legacy.errs, err)
		case err != nil:
			return nil, err
		}
	}
	if len(legacy.names) > 0 {
		return trusted, &legacy
	}
	return trusted, nil
}

// check refuses what the broker cannot take as declared: a queue name too long for AMQP, its
// dead-letter queue's included (see checkQueueName); a binding to the default exchange,
// which takes none of its own (it routes each queue's name there, and refuses the bind for lack
// of permission, which Declare would take for the deployment's doing: the queue would be bound
// to nothing, its events lost); and a delivery limit past 32 bits, which AMQP carries in 32 (a
// larger one arrives negative, which RabbitMQ 3.x reads as a limit below every count).
func (t Topology) check() error {
	for _, q := range t.Queues {
		if err := checkQueueName(q.Queue); err != nil {
			return fmt.Errorf("queue name %w", err)
		}
		if q.DeliveryLimit > math.MaxInt32 {
			return fmt.Errorf("queue %q: DeliveryLimit %d is more than x-delivery-limit's 32 bits carry", q.Queue, q.DeliveryLimit)
		}
		for _, b := range q.Bindings {
			if b.Exchange == "" {
				return fmt.Errorf("queue %q: a binding of %q to the default exchange, which takes none (RabbitMQ routes each queue's name there): give the event its exchange",
					q.Queue, b.RoutingKey)
			}
		}
	}
	return nil
}

// isLegacyDeadLetterQueue reports whether err is the broker's refusal of a dead-letter queue's
// declaration because the queue exists without x-delivery-limit: an earlier version declared it.
func isLegacyDeadLetterQueue(err error) bool {
	var refused *amqp.Error
	return errors.As(err, &refused) && refused.Code == amqp.PreconditionFailed &&
		strings.Contains(refused.Reason, "inequivalent arg 'x-delivery-limit'")
}

// legacyQueues is Declare's error when dead-letter queues an earlier version declared are used
// as they are: it is ErrLegacyDeadLetterQueue, and names them.
type legacyQueues struct {
	names []string
	errs  []error // the broker's refusal of each
}

func (l *legacyQueues) Error() string {
	return fmt.Sprintf("%v: %s: %v", ErrLegacyDeadLetterQueue, strings.Join(l.names, ", "), errors.Join(l.errs...))
}

func (l *legacyQueues) Unwrap() []error { return append([]error{ErrLegacyDeadLetterQueue}, l.errs...) }

func passiveQueue(name string) func(ch *amqp.Channel) error {
	return func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		return err
	}
}

// declarer runs declarations on a channel of conn, opening a new one after the broker closed
// the last (it closes the channel of every refused declaration).
type declarer struct {
	conn *amqp.Connection
	log  *slog.Logger
	ch   *amqp.Channel
}

// declare runs do; if the broker refuses it for lack of permission (refused), exists tells
// whether the resource is there all the same. hidden says that it was taken on trust: refused,
// and whether it exists hidden too.
func (d *declarer) declare(what string, do, exists func(ch *amqp.Channel) error) (refused, hidden bool, err error) {
	refused, hidden, err = d.try(what, do, exists)
	if err != nil || !refused || d.log == nil {
		return refused, hidden, err
	}
	if hidden {
		d.log.Debug("not allowed to declare " + what + ", nor to see whether it exists; the deployment must declare it")
	} else {
		d.log.Debug("not allowed to declare " + what + "; it exists, declared by the deployment")
	}
	return refused, hidden, nil
}

// deadLetterQueue declares q's dead-letter queue, with its DeadLetterArguments, as declare
// does: the one declaration of it, for the topology's and for a consumer's after the queue
// was deleted (see deadLetterPublisher.declareAgain).
func (d *declarer) deadLetterQueue(q ConsumerTopology) (refused, hidden bool, err error) {
	dlq := DeadLetterQueue(q.Queue)
	return d.declare("dead-letter queue "+dlq, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(dlq, true, false, false, false, q.DeadLetterArguments())
		return err
	}, passiveQueue(dlq))
}

// bind binds queue to b. Refused for lack of permission, the binding is taken on trust once
// its queue is there (or hidden): AMQP has no passive bind, so nothing shows it exists. That is
// logged at level, naming it, whether the queue was seen or not.
func (d *declarer) bind(queue string, b Binding, level slog.Level) error {
	refused, _, err := d.try(fmt.Sprintf("binding of queue %s to %s/%s", queue, b.Exchange, b.RoutingKey), func(ch *amqp.Channel) error {
		return ch.QueueBind(queue, b.RoutingKey, b.Exchange, false, nil)
	}, passiveQueue(queue))
	if err == nil && refused && d.log != nil {
		d.log.Log(context.Background(), level, "not allowed to declare a binding, and a binding cannot be checked: the deployment must declare it, or the queue never gets these events",
			"binding_queue", queue, "exchange", b.Exchange, "routing_key", b.RoutingKey)
	}
	return err
}

// try runs do; if the broker refuses it for lack of permission (refused), exists tells
// whether the resource is there all the same, unless that is refused too (hidden). A resource
// refused and missing is an error.
func (d *declarer) try(what string, do, exists func(ch *amqp.Channel) error) (refused, hidden bool, err error) {
	ch, err := d.channel()
	if err != nil {
		return false, false, err
	}
	err = do(ch)
	var denied *amqp.Error
	if !errors.As(err, &denied) || denied.Code != amqp.AccessRefused {
		if err != nil {
			return false, false, fmt.Errorf("declare %s: %w", what, err)
		}
		return false, false, nil
	}
	if ch, err = d.channel(); err != nil {
		return true, false, err
	}
	err = exists(ch)
	var unseen *amqp.Error
	switch {
	case errors.As(err, &unseen) && unseen.Code == amqp.AccessRefused:
		return true, true, nil
	case err != nil:
		return true, false, fmt.Errorf("declare %s: refused (%w), and it does not exist: give the user the right to configure it, or declare it with the deployment", what, denied)
	}
	return true, false, nil
}

func (d *declarer) channel() (*amqp.Channel, error) {
	if d.ch != nil && !d.ch.IsClosed() {
		return d.ch, nil
	}
	ch, err := d.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	d.ch = ch
	return ch, nil
}

func (d *declarer) close() {
	if d.ch != nil && !d.ch.IsClosed() {
		_ = d.ch.Close()
	}
}
