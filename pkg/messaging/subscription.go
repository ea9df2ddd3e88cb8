package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"go.opentelemetry.io/otel/trace"
	"gorm.io/gorm"
)

// Event names one kind of event: the exchange it is published to, and its type, which is also
// its routing key. T is the Go type of its payload.
type Event[T any] struct {
	Exchange string
	Type     string
	// Validate, if set, checks a decoded payload. Its error marks the message as one that can
	// never be handled: it is dead-lettered with that reason.
	Validate func(T) error
}

// Message builds a message of this event from payload, ready for [Enqueue]: published to the
// event's exchange.
func (e Event[T]) Message(payload T) (Message, error) {
	m, err := NewMessage(e.Type, payload)
	m.Exchange = e.Exchange
	return m, err
}

// Binding is what routes this event to a queue.
func (e Event[T]) Binding() Binding { return Binding{Exchange: e.Exchange, RoutingKey: e.Type} }

// Decode reads and checks a message of this event. Every error is [Permanent].
func (e Event[T]) Decode(msg Message) (T, error) {
	var zero T
	if msg.Type != e.Type {
		return zero, Permanent(fmt.Errorf("message of type %q is not %s", truncate(msg.Type), e.Type))
	}
	v, err := Decode[T](msg)
	if err != nil {
		return zero, err
	}
	if e.Validate != nil {
		if err := e.Validate(v); err != nil {
			return zero, Permanent(fmt.Errorf("invalid %s: %w", e.Type, err))
		}
	}
	return v, nil
}

// HandlerFunc does one message's work inside its inbox transaction: whatever it writes with tx
// commits together with the record that the message was handled.
type HandlerFunc func(ctx context.Context, tx *gorm.DB, msg Message) error

// Middleware wraps a HandlerFunc with a concern every message shares (see [Recover],
// [Timeout], [Observe]).
type Middleware func(next HandlerFunc) HandlerFunc

// SubscriptionConfig configures a [Subscription]. Name, URL and DB are required.
type SubscriptionConfig struct {
	// Name is the consumer's name: its queue, its inbox records and, with ".dlq", its
	// dead-letter queue.
	Name string
	URL  string   // RabbitMQ URL, vhost included; for a cluster, a comma-separated list (SplitURLs)
	DB   *gorm.DB // holds inbox_messages and the consumer's own tables
	// Concurrency is how many messages, or batches, are handled in parallel; each holds a
	// database connection. Default 8.
	Concurrency int
	// BatchSize is the most waiting messages that share one inbox transaction; 1 turns
	// batching off. Default 50.
	BatchSize int
	// Prefetch is how many unacknowledged deliveries the broker sends ahead. Default
	// Concurrency × BatchSize.
	Prefetch int
	// HandlerTimeout bounds one message's handler. Default 30 s.
	HandlerTimeout time.Duration
	// DeliveryLimit is the queue's x-delivery-limit, unless Topology gives the queue one.
	// Default [DefaultDeliveryLimit].
	DeliveryLimit int
	// Topology, if set, is the whole system's, declared at every (re)connect so that no
	// consumer's queue is missing when its first event is published (see [Topology]). Its
	// entry for Name must bind exactly the events the subscription handles. Without one, the
	// subscription declares its own queue, bound to what it handles.
	Topology Topology
	Logger   *slog.Logger
	Metrics  *Metrics // optional
	// TracerProvider makes each message's consumer span (see [InboxConfig.TracerProvider]).
	// Default: the global provider. Either way every handler's context carries the trace its
	// message came in, before the inbox's claim and after the commit as well, so its log lines
	// and what it enqueues belong to it.
	TracerProvider trace.TracerProvider
}

// Subscription owns one consumer's queue: the bindings of every event it handles, its inbox,
// its batching, and a typed handler per event type, behind an ordered middleware chain, from
// the outside in: logging and metrics ([Observe]), panic recovery ([Recover]), the per-message
// timeout ([Timeout]), then whatever [Subscription.Use] adds. Each runs inside the message's
// inbox transaction and its span.
// A message of a type without a handler is dead-lettered, with the reason logged.
type Subscription struct {
	cfg        SubscriptionConfig
	inbox      *Inbox
	routes     map[string]HandlerFunc
	bindings   []Binding
	middleware []Middleware
	consumer   *Consumer
}

// NewSubscription checks cfg and fills in its defaults. Register handlers with [Handle] before
// [Subscription.Run].
func NewSubscription(cfg SubscriptionConfig) (*Subscription, error) {
	if cfg.Name == "" || cfg.URL == "" || cfg.DB == nil {
		return nil, errors.New("subscription: Name, URL and DB are required")
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = 8
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 50
	}
	if cfg.HandlerTimeout <= 0 {
		cfg.HandlerTimeout = 30 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	inbox, err := NewInbox(InboxConfig{DB: cfg.DB, Consumer: cfg.Name, Logger: cfg.Logger, Metrics: cfg.Metrics, TracerProvider: cfg.TracerProvider})
	if err != nil {
		return nil, err
	}
	return &Subscription{cfg: cfg, inbox: inbox, routes: make(map[string]HandlerFunc)}, nil
}

// Handle registers fn for the events ev names, and binds the subscription's queue to them. fn
// gets the decoded, checked payload and the envelope it came in (its id, for one). A second
// handler for the same type replaces the first.
func Handle[T any](s *Subscription, ev Event[T], fn func(ctx context.Context, tx *gorm.DB, payload T, msg Message) error) {
	if _, ok := s.routes[ev.Type]; !ok {
		s.bindings = append(s.bindings, ev.Binding())
	}
	s.routes[ev.Type] = func(ctx context.Context, tx *gorm.DB, msg Message) error {
		payload, err := ev.Decode(msg)
		if err != nil {
			return err
		}
		return fn(ctx, tx, payload, msg)
	}
}

// Use adds middleware after the built-in chain, in order: the first added runs first.
func (s *Subscription) Use(mw ...Middleware) { s.middleware = append(s.middleware, mw...) }

// Topology is what the subscription declares on the broker: [SubscriptionConfig.Topology],
// or, without one, its queue bound to the type of every handled event and its dead-letter
// queue. It fails unless the configured topology's entry for the queue binds exactly the events
// the subscription handles: a missing binding would lose events, an extra one dead-letter them.
func (s *Subscription) Topology() (Topology, error) {
	own := ConsumerTopology{Queue: s.cfg.Name, Bindings: s.bindings, DeliveryLimit: s.cfg.DeliveryLimit}
	if len(s.cfg.Topology.Queues) == 0 && len(s.cfg.Topology.Exchanges) == 0 {
		return Topology{Queues: []ConsumerTopology{own}}, nil
	}
	q, ok := s.cfg.Topology.Queue(s.cfg.Name)
	if !ok {
		return Topology{}, fmt.Errorf("subscription %s: the topology has no queue %q", s.cfg.Name, s.cfg.Name)
	}
	for _, b := range s.bindings {
		if !slices.Contains(q.Bindings, b) {
			return Topology{}, fmt.Errorf("subscription %s handles %s from exchange %q, but the topology does not bind queue %q to it",
				s.cfg.Name, b.RoutingKey, b.Exchange, s.cfg.Name)
		}
	}
	for _, b := range q.Bindings {
		if !slices.Contains(s.bindings, b) {
			return Topology{}, fmt.Errorf("the topology binds queue %q to %s from exchange %q, which subscription %s has no handler for",
				s.cfg.Name, b.RoutingKey, b.Exchange, s.cfg.Name)
		}
	}
	return s.cfg.Topology, nil
}

// Ready reports whether the subscription is consuming.
func (s *Subscription) Ready() bool { return s.consumer != nil && s.consumer.Ready() }

// Start prepares the consumer; call it once, after the handlers are registered and before
// [Subscription.Run] or [Subscription.Ready] matter.
func (s *Subscription) Start() error {
	if len(s.routes) == 0 {
		return errors.New("subscription: no handler registered")
	}
	work := s.chain()
	var batch BatchHandler
	if s.cfg.BatchSize > 1 {
		batch = s.known(s.inbox.BatchHandler(work))
	}
	topology, err := s.Topology()
	if err != nil {
		return err
	}
	queue, _ := topology.Queue(s.cfg.Name)
	s.consumer, err = NewConsumer(ConsumerConfig{
		URL: s.cfg.URL, ConnectionName: s.cfg.Name, Queue: s.cfg.Name, Topology: topology,
		Concurrency: s.cfg.Concurrency, Prefetch: s.cfg.Prefetch,
		BatchHandler: batch, BatchSize: s.cfg.BatchSize,
		HandlerTimeout: s.cfg.HandlerTimeout, DeliveryLimit: queue.DeliveryLimit,
		Logger: s.cfg.Logger, Metrics: s.cfg.Metrics,
	}, s.inbox.Handler(work))
	return err
}

// Deliver handles msg as a delivery from the queue would be, through the inbox and the
// middleware, without a broker: for tests, and for tools that replay a message. duplicate
// reports that this consumer had handled it already.
func (s *Subscription) Deliver(ctx context.Context, msg Message) (duplicate bool, err error) {
	work := s.chain()
	return s.inbox.Handle(ctx, msg, func(tx *gorm.DB) error { return work(tx.Statement.Context, tx, msg) })
}

// Run consumes until ctx ends (see [Consumer.Run]). It calls Start if nobody did.
func (s *Subscription) Run(ctx context.Context) error {
	if s.consumer == nil {
		if err := s.Start(); err != nil {
			return err
		}
	}
	return s.consumer.Run(ctx)
}

// chain is the route of each message behind the middleware.
func (s *Subscription) chain() HandlerFunc {
	var mws []Middleware
	mws = append(mws, Observe(s.cfg.Name, s.cfg.Logger, s.cfg.Metrics), Recover(s.cfg.Logger), Timeout(s.cfg.HandlerTimeout))
	mws = append(mws, s.middleware...)
	h := HandlerFunc(s.route)
	for i := len(mws) - 1; i >= 0; i-- {
		h = mws[i](h)
	}
	return h
}

// route hands msg to the handler of its type.
func (s *Subscription) route(ctx context.Context, tx *gorm.DB, msg Message) error {
	h, ok := s.routes[msg.Type]
	if !ok {
		return Permanent(fmt.Errorf("no handler for message type %q", truncate(msg.Type)))
	}
	return h(ctx, tx, msg)
}

// known fails a batch holding a type without a handler before it opens a transaction; the
// consumer then handles its messages one by one, and dead-letters that one.
func (s *Subscription) known(batch BatchHandler) BatchHandler {
	return func(ctx context.Context, msgs []Message) error {
		for _, m := range msgs {
			if _, ok := s.routes[m.Type]; !ok {
				return Permanent(fmt.Errorf("no handler for message type %q", truncate(m.Type)))
			}
		}
		return batch(ctx, msgs)
	}
}
