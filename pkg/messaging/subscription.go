package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
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

// Decode reads and checks a message of this event. Every error is [Permanent], a panic of the
// payload's UnmarshalJSON or of Validate included: the same bytes would panic again at every
// delivery, and a consumer's worker has no handler around it to recover. A consumer logs such a
// panic's stack (`decoding panicked`) before it dead-letters the message.
func (e Event[T]) Decode(msg Message) (v T, err error) {
	var zero T
	defer func() {
		if p := recover(); p != nil {
			v, err = zero, Permanent(&decodePanic{event: e.Type, value: p, stack: debug.Stack()})
		}
	}()
	if msg.Type != e.Type {
		return zero, Permanent(fmt.Errorf("message of type %q is not %s", truncate(msg.Type), e.Type))
	}
	v, err = decode[T](msg)
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

// decodePanic is a panic recovered while a message was decoded, with where it came from.
type decodePanic struct {
	event string
	value any
	stack []byte
}

func (p *decodePanic) Error() string {
	return fmt.Sprintf("decoding %s panicked: %v", p.event, p.value)
}

// Handler does one message's work in tx, the transaction that records in the inbox that the
// message was handled: whatever it writes with tx commits with that record, or not at all. It
// gets the decoded, checked payload and the envelope it came in. Return nil once done; mark
// errors no retry can fix with [Permanent] and dependency outages with [Unavailable]: every
// other error is tried again for seconds only (see [SubscriptionConfig.Retries]). ctx carries
// the message's trace and the handler's deadline: return when it ends, or the attempt is
// abandoned (see [SubscriptionConfig.HandlerTimeout]). Register work to run after the commit
// with [AfterCommit].
//
// A handler may run several times for one delivery: each retry, and each message of a failed
// batch tried again alone, runs it again after a rollback. So every write goes through tx (a
// write on another connection or transaction commits however the attempt ends, and is
// repeated), and other effects (a call out, an e-mail) go after the commit, as an outbox
// message or a row in tx that a worker carries out ([AfterCommit] runs at most once: a crash
// after the commit loses its hook, and the redelivery is a duplicate the inbox skips). Each
// attempt gets the payload decoded anew: changes an
// attempt that failed made to it do not reach the next. msg is the same for every attempt: do
// not change it (its Headers, its Payload's bytes).
type Handler[Tx, T any] func(ctx context.Context, tx Tx, payload T, msg Message) error

// Middleware wraps every handler of a subscription registered with [Handle] with a concern
// messages share. It sees the handler shape with the payload as any: the decoded payload of
// whatever event it is. A batch handler ([HandleBatch]) is not wrapped: work every transaction
// needs (a tenant's SET LOCAL, say) belongs in the batch handler itself.
type Middleware[Tx any] func(next Handler[Tx, any]) Handler[Tx, any]

// The defaults of a [SubscriptionConfig].
const (
	DefaultConcurrency    = 8
	DefaultBatchSize      = 50
	DefaultRetries        = 3
	DefaultHandlerTimeout = 30 * time.Second
	DefaultShutdownGrace  = 5 * time.Second
	DefaultHeartbeat      = 10 * time.Second
)

// SubscriptionConfig configures a [Subscription]. Name and URL are required.
type SubscriptionConfig struct {
	// Name is the consumer's name: its queue, its inbox records and, with ".dlq", its
	// dead-letter queue; at most 251 bytes, for AMQP to carry that one's. Renamed, a
	// subscription starts an inbox of its own: a message handled under the old name that comes
	// again (a redelivery, a redrive) is handled again.
	Name string
	// URL is RabbitMQ's, vhost included; for a cluster, a comma-separated list of them, one per
	// node, which the subscription tries in a random order at every (re)connect.
	URL string
	// Topology, if set, is the whole system's, declared at every (re)connect so that no
	// consumer's queue is missing when its first event is published (see [Topology]). Its
	// entry for Name must bind exactly the events the subscription handles. Without one, the
	// subscription declares its own queue, bound to what it handles.
	Topology Topology
	// Concurrency is how many messages, or batches, are handled in parallel, each by a worker
	// on an AMQP channel of its own; each holds a database connection. Default
	// [DefaultConcurrency].
	Concurrency int
	// BatchSize is the most waiting messages that share one inbox transaction; 1 turns
	// batching off. One HandlerTimeout bounds the whole batch: size the two together (see
	// HandlerTimeout). Default [DefaultBatchSize].
	BatchSize int
	// BatchByType gives each batch handler every message of its event in a transaction at
	// once, after the plain handlers' messages, rather than each run of consecutive ones in the
	// queue's order. Set it only where no handler depends on what a handler of another event
	// wrote: a backlog that interleaves event types then takes one statement per type, not one
	// per run (nearly twice as fast for the demo's notification service). Each event's
	// messages still come in their order.
	BatchByType bool
	// Prefetch is how many unacknowledged deliveries the broker sends ahead to each worker
	// (each has a channel of its own), at most 65535 (AMQP's 16 bits). Default 2 × BatchSize:
	// the batch in progress and the next.
	Prefetch int
	// HandlerTimeout bounds one attempt: a transaction, with its handlers, its commit and its
	// after-commit hooks; the handlers' ctx ends then. A batch is one attempt whatever its size
	// (up to BatchSize messages; a [HandleBatch] handler's call of them too), with one
	// HandlerTimeout for all: a stuck batch is given up, and a session that lost its channel ends,
	// as soon as a stuck message would be. Set it above BatchSize × the slowest message's
	// handling, or lower BatchSize: a batch that runs past it fails ("batch failed; processing its
	// messages one by one"), its work rolled back, and each of its messages is tried again alone,
	// its handler run a second time. An attempt that has not returned 5 s after its timeout (a
	// handler that ignores its ctx: a call without a timeout, a blocked channel send) is
	// abandoned, logged at error level ("handler did not return within its timeout"): its
	// transaction, begun under ctx, cannot commit (database/sql's ends once a statement running on
	// it returns), its message counts a failed attempt (an outage, if the database does not
	// answer), and its goroutine is left blocked, counted in the gauge consumer_attempts_abandoned
	// until it returns. Default [DefaultHandlerTimeout].
	HandlerTimeout time.Duration
	// Retries is how many times a failing message is tried on each delivery before it goes back
	// to the queue, which hands it straight back: nothing waits a failure out. With the
	// defaults (3 tries 100 and 200 ms apart, 20 deliveries) a message whose handler fails at
	// once on every try is dead-lettered about 6 s after its first delivery: a row that another
	// event brings later than that is not waited for. Return a dependency's outage as
	// [Unavailable], which waits for it without spending tries or deliveries. Default
	// [DefaultRetries].
	Retries int
	// RetryBackoff paces the tries of each delivery (afresh at every delivery), and the waits for
	// a dependency that is [Unavailable]. Default 100 ms doubling up to 5 s, jittered: a
	// delivery's 3 tries are 100 and 200 ms apart.
	RetryBackoff Backoff
	// DeliveryLimit is how many deliveries a failing message gets: still failing on its last,
	// it is dead-lettered with its reason. They follow each other at once, Retries tries each,
	// so the whole budget spans seconds, not minutes (see Retries). Without a Topology it is
	// also the queue's x-delivery-limit. With one, the queue's entry gives that
	// ([DefaultDeliveryLimit] if it gives none), and the subscription uses it, or DeliveryLimit
	// if set and smaller: past the broker's limit, the broker would dead-letter the message
	// itself, without its reason.
	// Default [DefaultDeliveryLimit].
	DeliveryLimit int
	// MaxMessageBytes: larger messages are dead-lettered. Default [DefaultMaxMessageBytes].
	MaxMessageBytes int
	// ShutdownGrace is how long messages in progress may go on after Run's context ends; a
	// handler that ignores its ctx is given up 2.5 s after it, so Run returns within about
	// ShutdownGrace + 3.5 s. Default [DefaultShutdownGrace].
	ShutdownGrace time.Duration
	// Reconnect paces reconnection attempts. Default 100 ms doubling up to 2 s, jittered: a
	// broker that comes back is found within about 2 s.
	Reconnect Backoff
	// Heartbeat is the AMQP heartbeat interval: a silent connection is declared dead after a
	// few missed beats. AMQP carries it in whole seconds: above 0 and under 1 s is refused, as
	// the client would send 0 and take the broker's interval (60 s by default). 0 or less takes
	// [DefaultHeartbeat].
	Heartbeat time.Duration
	Logger    *slog.Logger
	Metrics   *Metrics // optional
	// TracerProvider makes each message's consumer span, a child of the span that published
	// it. Default: the global provider. Either way the handler's context carries the message's
	// trace, read with Propagator (default: the global one).
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
}

// withDefaults fills in what cfg leaves unset.
func (cfg SubscriptionConfig) withDefaults() SubscriptionConfig {
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = DefaultBatchSize
	}
	if cfg.Prefetch <= 0 {
		cfg.Prefetch = 2 * cfg.BatchSize
	}
	if cfg.HandlerTimeout <= 0 {
		cfg.HandlerTimeout = DefaultHandlerTimeout
	}
	if cfg.Retries <= 0 {
		cfg.Retries = DefaultRetries
	}
	cfg.RetryBackoff = cfg.RetryBackoff.withDefaults(100*time.Millisecond, 5*time.Second)
	if cfg.DeliveryLimit <= 0 {
		cfg.DeliveryLimit = DefaultDeliveryLimit
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if cfg.ShutdownGrace <= 0 {
		cfg.ShutdownGrace = DefaultShutdownGrace
	}
	cfg.Reconnect = cfg.Reconnect.withDefaults(100*time.Millisecond, 2*time.Second)
	if cfg.Heartbeat <= 0 {
		cfg.Heartbeat = DefaultHeartbeat
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.Propagator = propagatorOr(cfg.Propagator)
	return cfg
}

// check refuses, once the defaults are filled in, what AMQP cannot carry as configured.
func (cfg SubscriptionConfig) check() error {
	// AMQP carries the prefetch in 16 bits: the client would send what is left of it, 65536 as
	// 0, no limit. (Twice a BatchSize near the int's range overflows below 1.)
	if cfg.Prefetch > math.MaxUint16 || cfg.Prefetch < 1 {
		return fmt.Errorf("subscription: Prefetch %d is outside AMQP's 1 to %d (the default is twice BatchSize)", cfg.Prefetch, math.MaxUint16)
	}
	// Its queue would be declared and its dead-letter queue refused, at every reconnect: never
	// ready.
	if err := checkQueueName(cfg.Name); err != nil {
		return fmt.Errorf("subscription: Name %w", err)
	}
	if err := checkHeartbeat(cfg.Heartbeat); err != nil {
		return fmt.Errorf("subscription: Heartbeat %w", err)
	}
	// Its consumer would dial, and fail, for ever: Run reconnecting, never ready.
	if err := checkURLs(cfg.URL); err != nil {
		return fmt.Errorf("subscription: URL %w", err)
	}
	return nil
}

// Subscription is one consumer: its queue, bound to every event it handles, its inbox, and a
// typed handler per event type behind the middleware. Each message is claimed in the
// consumer's inbox_messages table in the same transaction as its handler's work, and
// acknowledged only after that commits: a message that arrives again is recognised and skipped,
// with one "duplicate" line in the log. Waiting messages share a transaction, up to BatchSize.
// A message whose payload does not decode or validate is dead-lettered with its reason; one of
// a type without a handler goes back to the queue, for a replica that has one, and is
// dead-lettered only at its last allowed delivery.
type Subscription[Tx any] struct {
	cfg SubscriptionConfig
	// deliveryLimitSet: the configuration named a DeliveryLimit, rather than taking the default.
	deliveryLimitSet bool
	driver           Driver[Tx]
	routes           map[string]route[Tx]
	bindings         []Binding
	middleware       []Middleware[Tx]
	chain            Handler[Tx, any]
	// startMu makes Start happen once, whoever calls it first (Run, a test's deliveries, the
	// service); consumer is set last, and read by Ready while Run starts.
	startMu  sync.Mutex
	consumer atomic.Pointer[consumer]
	started  atomic.Bool
	running  atomic.Bool // a Run is under way
	log      *slog.Logger
	tracer   trace.Tracer
	// spanName and spanOptions are the same for every message's span: made once.
	spanName    string
	spanOptions []trace.SpanStartOption
}

// route is one event's handler, behind its decoder: handle for each message, or batch for
// each run of consecutive messages of the event in one transaction.
type route[Tx any] struct {
	decode func(Message) (any, error)
	handle Handler[Tx, any]
	batch  func(ctx context.Context, tx Tx, items []batchItem) error
}

// batchItem is one message of a run that a batch route is given.
type batchItem struct {
	ctx     context.Context
	payload any
	msg     Message
}

// Delivered is one message of a batch: its decoded, checked payload, its envelope, and Ctx,
// the context of its own span. Log what concerns one message with its Ctx, and enqueue what it
// causes with it, so both belong to the message's trace. As for a [Handler], each attempt gets
// the payload decoded anew, and Msg is the same for every attempt: do not change it.
type Delivered[T any] struct {
	Ctx     context.Context
	Payload T
	Msg     Message
}

// BatchHandler does the work of several messages of one event at once, in tx, the
// transaction that records all of them in the inbox: set-based statements (one INSERT for the
// batch) instead of round trips per message. It is given each run of consecutive messages of
// its event, since a transaction's messages are handled in their queue's order, whatever
// their handlers. ctx is the transaction's: [AfterCommit] works with it, or with any item's
// Ctx. An error fails the whole batch; the subscription then handles its messages one by
// one, each as a batch of one, so a single bad message cannot hold up the others.
type BatchHandler[Tx, T any] func(ctx context.Context, tx Tx, batch []Delivered[T]) error

// NewSubscription returns the subscription of cfg.Name on driver d's database. Register its
// handlers with [Handle], then [Subscription.Run] it.
func NewSubscription[Tx any](d Driver[Tx], cfg SubscriptionConfig) (*Subscription[Tx], error) {
	if d == nil || cfg.Name == "" || cfg.URL == "" {
		return nil, errors.New("subscription: a driver, Name and URL are required")
	}
	limitSet := cfg.DeliveryLimit > 0
	cfg = cfg.withDefaults()
	if err := cfg.check(); err != nil {
		return nil, err
	}
	log := cfg.Logger.With("component", "inbox", "consumer", cfg.Name)
	warnUnparseableURLs(log, "SubscriptionConfig.URL", cfg.URL)
	return &Subscription[Tx]{
		cfg: cfg, deliveryLimitSet: limitSet, driver: d, routes: map[string]route[Tx]{}, log: log,
		tracer: newTracer(cfg.TracerProvider), spanName: "process " + cfg.Name,
		spanOptions: []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(
			semconv.MessagingSystemRabbitMQ, semconv.MessagingOperationTypeProcess, semconv.MessagingOperationName("process"),
			semconv.MessagingConsumerGroupName(cfg.Name))},
	}, nil
}

// ErrHandlerRegistered is returned by [Handle] for an event type that has a handler already.
var ErrHandlerRegistered = errors.New("subscription: the event type has a handler already")

// Handle registers fn for the events ev names, and binds the subscription's queue to them. It
// fails, registering nothing, for a type that has a handler already, or once the subscription
// has started.
func Handle[Tx, T any](s *Subscription[Tx], ev Event[T], fn Handler[Tx, T]) error {
	return s.register(ev.Type, ev.Binding(), func(msg Message) (any, error) { return ev.Decode(msg) }, route[Tx]{
		handle: func(ctx context.Context, tx Tx, payload any, msg Message) error { return fn(ctx, tx, payload.(T), msg) },
	})
}

// HandleBatch registers fn for the events ev names, as [Handle] does, to be given each run of
// consecutive messages of ev that a transaction of the subscription holds (up to
// [SubscriptionConfig.BatchSize]) at once: the messages of one event type waiting in a backlog
// together. It runs inside the built-in logging, metrics and panic recovery, but not the
// middleware of [Subscription.Use], which wraps one message's handler.
func HandleBatch[Tx, T any](s *Subscription[Tx], ev Event[T], fn BatchHandler[Tx, T]) error {
	return s.register(ev.Type, ev.Binding(), func(msg Message) (any, error) { return ev.Decode(msg) }, route[Tx]{
		batch: func(ctx context.Context, tx Tx, items []batchItem) error {
			batch := make([]Delivered[T], len(items))
			for i, it := range items {
				batch[i] = Delivered[T]{Ctx: it.ctx, Payload: it.payload.(T), Msg: it.msg}
			}
			return fn(ctx, tx, batch)
		},
	})
}

// register adds r, the route of msgType, decoding with decode.
func (s *Subscription[Tx]) register(msgType string, b Binding, decode func(Message) (any, error), r route[Tx]) error {
	if s.started.Load() {
		return fmt.Errorf("subscription %s: handle %s: already started", s.cfg.Name, msgType)
	}
	if _, ok := s.routes[msgType]; ok {
		return fmt.Errorf("%w: %s in subscription %s", ErrHandlerRegistered, msgType, s.cfg.Name)
	}
	r.decode = decode
	s.bindings = append(s.bindings, b)
	s.routes[msgType] = r
	return nil
}

// Use adds middleware, in order: the first added runs first, inside the built-in logging,
// metrics and panic recovery. It wraps the handlers of [Handle], not those of [HandleBatch].
// It panics once the subscription has started ([Subscription.Start], Run, or a delivery of
// messagingtest): the handlers' chain is built then, and middleware added later would wrap
// nothing.
func (s *Subscription[Tx]) Use(mw ...Middleware[Tx]) {
	if s.started.Load() {
		panic(fmt.Sprintf("messaging: subscription %s: Use after it started", s.cfg.Name))
	}
	s.middleware = append(s.middleware, mw...)
}

// Topology is what the subscription declares on the broker: [SubscriptionConfig.Topology],
// or, without one, its queue bound to the type of every handled event and its dead-letter
// queue. It fails unless the configured topology's entry for the queue binds exactly the events
// the subscription handles: a missing binding would lose events, an extra one dead-letter them.
func (s *Subscription[Tx]) Topology() (Topology, error) {
	own := ConsumerTopology{Queue: s.cfg.Name, Bindings: s.bindings, DeliveryLimit: s.cfg.DeliveryLimit}
	if len(s.cfg.Topology.Queues) == 0 && len(s.cfg.Topology.Exchanges) == 0 {
		t := Topology{Queues: []ConsumerTopology{own}}
		if err := t.check(); err != nil {
			return Topology{}, fmt.Errorf("subscription %s: %w", s.cfg.Name, err)
		}
		return t, nil
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
	if err := s.cfg.Topology.check(); err != nil {
		return Topology{}, fmt.Errorf("subscription %s: %w", s.cfg.Name, err)
	}
	return s.cfg.Topology, nil
}

// Start checks the subscription and prepares its consumer; [Subscription.Run] calls it if
// nobody did. Call it once the handlers are registered, to fail early on a topology that does
// not match them. From then on its metrics export every series it counts (its queue's
// outcomes, each handled type's handler outcomes), at zero until the first event.
func (s *Subscription[Tx]) Start() error {
	s.startMu.Lock()
	defer s.startMu.Unlock()
	if s.consumer.Load() != nil {
		return nil
	}
	if len(s.routes) == 0 {
		return fmt.Errorf("subscription %s: no handler registered", s.cfg.Name)
	}
	topology, err := s.Topology()
	if err != nil {
		return err
	}
	q, _ := topology.Queue(s.cfg.Name)
	limit := q.deliveryLimit()
	if s.deliveryLimitSet {
		limit = min(limit, s.cfg.DeliveryLimit)
	}
	s.started.Store(true)
	s.chain = s.handlerChain()
	cfg := s.cfg
	cfg.Metrics.initSubscription(cfg.Name, slices.Sorted(maps.Keys(s.routes)))
	s.consumer.Store(newConsumer(consumerConfig{
		URL: cfg.URL, ConnectionName: cfg.Name, Queue: cfg.Name, Topology: topology,
		Concurrency: cfg.Concurrency, Prefetch: cfg.Prefetch, BatchSize: cfg.BatchSize, MaxBodyBytes: cfg.MaxMessageBytes,
		Retries: cfg.Retries, RetryBackoff: cfg.RetryBackoff, Reconnect: cfg.Reconnect,
		HandlerTimeout: cfg.HandlerTimeout, ShutdownGrace: cfg.ShutdownGrace, DeliveryLimit: limit, Heartbeat: cfg.Heartbeat,
		Logger: cfg.Logger, Metrics: cfg.Metrics, Propagator: cfg.Propagator, Tracer: s.tracer,
	}, work{decode: s.decode, process: func(ctx context.Context, jobs []job, committed func()) error {
		_, err := s.process(ctx, jobs, committed)
		return err
	}, answers: s.databaseAnswers}))
	return nil
}

// ErrRunning is returned by [Subscription.Run] called while another call of it runs.
var ErrRunning = errors.New("subscription: already running")

// Run consumes until ctx ends, reconnecting after every connection loss, and returns nil once
// the messages in progress are settled. One Run at a time: a call while another runs returns
// [ErrRunning] at once (for more workers, raise Concurrency); once it has returned, Run may
// be called again.
func (s *Subscription[Tx]) Run(ctx context.Context) error {
	if err := s.Start(); err != nil {
		return err
	}
	// Two runs would share one consumer: two sessions and reconnection loops racing over its
	// state.
	if !s.running.CompareAndSwap(false, true) {
		return fmt.Errorf("%w: %s", ErrRunning, s.cfg.Name)
	}
	defer s.running.Store(false)
	s.consumer.Load().run(ctx)
	return nil
}

// Ready reports whether the subscription is consuming.
func (s *Subscription[Tx]) Ready() bool {
	c := s.consumer.Load()
	return c != nil && c.live.Load() != nil
}

// handlerChain is each message's way to its handler, behind the middleware: logging and
// metrics outermost, then panic recovery, then what [Subscription.Use] added.
func (s *Subscription[Tx]) handlerChain() Handler[Tx, any] {
	mws := append([]Middleware[Tx]{observe[Tx](s.cfg.Name, s.cfg.Logger, s.cfg.Metrics), recoverPanics[Tx](s.cfg.Logger)}, s.middleware...)
	h := Handler[Tx, any](func(ctx context.Context, tx Tx, payload any, msg Message) error {
		return s.routes[msg.Type].handle(ctx, tx, payload, msg)
	})
	for i := len(mws) - 1; i >= 0; i-- {
		h = mws[i](h)
	}
	return h
}

// runBatch gives items to the batch handler of msgType, behind the built-in panic recovery,
// logging and metrics (each message counted with its share of the batch's time).
func (s *Subscription[Tx]) runBatch(ctx context.Context, tx Tx, msgType string, items []batchItem) (err error) {
	start := time.Now()
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("batch handler panicked: %v", r)
			// With one message (a failed batch's, tried alone, say), the message is named, in its
			// trace.
			logCtx, attrs := ctx, []any{"consumer", s.cfg.Name, "type", msgType, "size", len(items)}
			if len(items) == 1 {
				logCtx, attrs = items[0].ctx, append(attrs, "message_id", items[0].msg.ID)
			}
			s.cfg.Logger.ErrorContext(logCtx, "batch handler panicked", append(attrs, "panic", r, "stack", string(debug.Stack()))...)
		}
		// Each message's share, so that the histogram's sum is the time the handler took.
		handlerErr, took := err, time.Since(start)/time.Duration(len(items))
		whenObserved(ctx, func(txErr error) {
			outcome := finalOutcome(handlerErr, txErr)
			for _, it := range items {
				s.cfg.Metrics.recordHandled(s.cfg.Name, msgType, outcome, took)
				if outcome == handlerOK {
					s.cfg.Logger.DebugContext(it.ctx, "message handled", "consumer", s.cfg.Name, "message_id", it.msg.ID, "type", msgType, "batch", len(items))
				}
			}
		})
	}()
	return s.routes[msgType].batch(ctx, tx, items)
}

// errNoHandler means a message's type has no handler in this subscription.
var errNoHandler = errors.New("no handler for message type")

// decode finds msg's route and decodes its payload; an error is the message's own.
func (s *Subscription[Tx]) decode(msg Message) (any, error) {
	r, ok := s.routes[msg.Type]
	if !ok {
		return nil, fmt.Errorf("%w %q", errNoHandler, truncate(msg.Type))
	}
	return r.decode(msg)
}

// process does the work of jobs in one transaction: it claims them in the inbox, runs the
// handler of each that was not handled before, and commits, all or nothing. A duplicate runs
// nothing and is logged once, after the commit. Any failure while the database does not
// answer is wrapped with [Unavailable]: the outage is not the messages' fault. An attempt
// called off (ctx cancelled, not timed out) is not asked about: it is handed back.
//
// Each message has its own span, and its handler a context that carries it: one transaction,
// as many traces as messages. claimed reports which jobs were not duplicates. committed is
// called once the transaction has committed, before the after-commit hooks run.
func (s *Subscription[Tx]) process(ctx context.Context, jobs []job, committed func()) (claimed []bool, err error) {
	hooks := &afterCommitHooks{}
	ctx = context.WithValue(ctx, afterCommitKey{}, hooks)
	// The handlers' outcomes count, and are logged, once the transaction has ended: a handler
	// that succeeded in a transaction whose commit failed did not. A batch that fails is tried
	// again one message at a time, which counts each message's outcome then; one message's
	// transaction that fails counts its outcome with the failure.
	observed := &observations{}
	ctx = context.WithValue(ctx, observedKey{}, observed)
	spans := make([]msgSpan, len(jobs))
	for i, j := range jobs {
		spans[i].ctx, spans[i].span = s.startSpan(ctx, j.msg)
	}
	defer func() {
		for _, m := range spans {
			endSpan(m.span, err)
		}
	}()
	claimed, err = s.transact(ctx, jobs, spans)
	if err != nil {
		calledOff := errors.Is(ctx.Err(), context.Canceled)
		switch {
		case calledOff:
			// Called off (a shutdown's grace is over): no verdict to give, nor to wait for from
			// a database that may not answer, while the message waits to be handed back.
		case IsUnavailable(err):
		case databaseOutage(err):
			// Even if the handler called it permanent, as a lookup that failed may: the SQLSTATE
			// says the database could not take writes, no fault of the message. Only an error
			// that carries one: a connection that broke without one ("unexpected EOF", "driver:
			// bad connection") is judged below, where a Permanent stays the handler's verdict.
			err = Unavailable(err)
		case IsPermanent(err) && ctx.Err() == nil:
			// The handler's verdict, unless its attempt was cut off: then it is judged below, as
			// any attempt cut off, since the handler could not know why.
		case dataException(err):
			err = Permanent(err)
		case !s.databaseAnswers(context.WithoutCancel(ctx)):
			err = Unavailable(err)
		}
		// Called off, the attempt has no outcome to count: its message goes back uncounted, to be
		// handled again, and counts then. An attempt abandoned at the shutdown ends here too,
		// once it returns.
		if len(jobs) == 1 && !calledOff {
			observed.run(err)
		}
		return nil, err
	}
	committed()
	observed.run(nil)
	committedAt := time.Now()
	for i, j := range jobs {
		if !claimed[i] {
			s.skipped(spans[i].ctx, spans[i].span, j.msg)
			continue
		}
		s.cfg.Metrics.recordEventAge(s.cfg.Name, j.msg, committedAt)
	}
	for _, fn := range hooks.fns {
		s.runHook(ctx, fn)
	}
	return claimed, nil
}

// runHook runs one after-commit hook. Its transaction has committed and its messages are
// acknowledged whatever it does, so a panic is logged and goes no further: it would kill the
// process, and the redelivery, a duplicate, would not run the hook again either.
func (s *Subscription[Tx]) runHook(ctx context.Context, fn func()) {
	defer func() {
		if r := recover(); r != nil {
			s.log.ErrorContext(ctx, "after-commit hook panicked", "panic", r, "stack", string(debug.Stack()))
		}
	}()
	fn()
}

// transact runs the inbox transaction of jobs and reports which of them it claimed.
func (s *Subscription[Tx]) transact(ctx context.Context, jobs []job, spans []msgSpan) (claimed []bool, err error) {
	tx, txe, err := s.driver.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("begin inbox transaction: %w", err)
	}
	defer func() {
		if err != nil {
			rollback(ctx, txe)
		}
	}()
	if claimed, err = claim(ctx, txe, s.cfg.Name, jobs); err != nil {
		return nil, err
	}
	// Each message to its handler in the batch's order, as one at a time: a batch handler gets
	// each run of consecutive messages of its event, so that no message is handled before one
	// that came ahead of it (an order's cancellation before its placement, say). With
	// BatchByType, a batch handler's messages wait, to go to it together, by event type in the
	// order the types first came.
	var run []batchItem
	var byType []string
	gathered := map[string][]batchItem{}
	flush := func() error {
		if len(run) == 0 {
			return nil
		}
		err := s.runBatch(ctx, tx, run[0].msg.Type, run)
		err = runError(err, len(jobs), run)
		run = nil // not run[:0]: runBatch's outcomes, logged at the commit, keep the run's items
		return err
	}
	for i, j := range jobs {
		if !claimed[i] {
			continue
		}
		if len(run) > 0 && run[0].msg.Type != j.msg.Type {
			if err := flush(); err != nil {
				return nil, err
			}
		}
		if s.routes[j.msg.Type].batch != nil {
			item := batchItem{ctx: spans[i].ctx, payload: j.payload, msg: j.msg}
			switch {
			case !s.cfg.BatchByType:
				run = append(run, item)
			case gathered[j.msg.Type] == nil:
				byType = append(byType, j.msg.Type)
				fallthrough
			default:
				gathered[j.msg.Type] = append(gathered[j.msg.Type], item)
			}
			continue
		}
		if err := s.chain(spans[i].ctx, tx, j.payload, j.msg); err != nil {
			if len(jobs) > 1 {
				err = fmt.Errorf("message %s: %w", j.msg.ID, err)
			}
			return nil, err
		}
	}
	if err := flush(); err != nil {
		return nil, err
	}
	for _, t := range byType {
		if err := s.runBatch(ctx, tx, t, gathered[t]); err != nil {
			return nil, runError(err, len(jobs), gathered[t])
		}
	}
	if err := txe.Commit(ctx); err != nil {
		return nil, fmt.Errorf("commit inbox transaction: %w", err)
	}
	return claimed, nil
}

// runError says which messages of a batch of n a batch handler failed on, as a plain handler's
// error names its message: in a batch of more than one, those the handler was given.
func runError(err error, n int, items []batchItem) error {
	switch {
	case err == nil || n == 1:
		return err
	case len(items) == 1:
		return fmt.Errorf("message %s: %w", items[0].msg.ID, err)
	}
	return fmt.Errorf("%d %s messages, %s first: %w", len(items), items[0].msg.Type, items[0].msg.ID, err)
}

// claim records jobs in the inbox in one statement (see statements.ClaimInbox) and reports
// which it recorded: the others were handled already.
func claim(ctx context.Context, ex Executor, consumer string, jobs []job) ([]bool, error) {
	ids := make([]uuid.UUID, len(jobs))
	for i, j := range jobs {
		ids[i] = j.msg.ID
	}
	rows, err := ex.Query(ctx, statements.ClaimInbox, uuidArray(ids), consumer)
	if err != nil {
		return nil, inboxUnusable(fmt.Errorf("claim %d inbox messages: %w", len(jobs), err))
	}
	defer rows.Close()
	fresh := make(map[uuid.UUID]bool, len(jobs))
	for rows.Next() {
		var id uuid.UUID
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("claim inbox messages: %w", err)
		}
		fresh[id] = true
	}
	if err := rows.Err(); err != nil {
		return nil, inboxUnusable(fmt.Errorf("claim inbox messages: %w", err))
	}
	claimed := make([]bool, len(jobs))
	for i, j := range jobs {
		// A message twice in one batch is claimed once: its first copy does the work.
		claimed[i] = fresh[j.msg.ID]
		delete(fresh, j.msg.ID)
	}
	return claimed, nil
}

// inboxUnusable makes err, a claim's failure, an outage when the database says that the inbox
// cannot be used at all (class 42: no table, a column missing, no right on it; 3F000: no such
// schema): the deployment's fault (MigrateInbox not run, the role's grants), which no message
// should pay for with its deliveries, all the way to the dead-letter queue.
func inboxUnusable(err error) error {
	if code := sqlState(err); strings.HasPrefix(code, "42") || code == "3F000" {
		return Unavailable(fmt.Errorf("the inbox cannot be used (is MigrateInbox run, may the role write inbox_messages?): %w", err))
	}
	return err
}

// msgSpan is one message's span and the context that carries it.
type msgSpan struct {
	ctx  context.Context
	span trace.Span
}

// startSpan starts msg's consumer span, a child of the trace context msg came with, or of
// ctx's span when it came without one (a new trace when neither has one).
func (s *Subscription[Tx]) startSpan(ctx context.Context, msg Message) (context.Context, trace.Span) {
	ctx, span := s.tracer.Start(msg.traced(ctx, s.cfg.Propagator), s.spanName, s.spanOptions...)
	messageAttributes(span, msg)
	return ctx, span
}

// skipped counts and logs a duplicate, in its span.
func (s *Subscription[Tx]) skipped(ctx context.Context, span trace.Span, msg Message) {
	s.cfg.Metrics.recordDuplicate(s.cfg.Name)
	span.AddEvent("duplicate message skipped")
	s.log.InfoContext(ctx, "duplicate message skipped", "message_id", msg.ID, "type", msg.Type)
}

// databaseOutage reports whether err carries a SQLSTATE (an error with a SQLState method, as
// pgx's are) that says the database cannot take writes now, whatever the message: a connection
// lost (class 08), resources exhausted (53: disk full, out of memory, too many connections), an
// operator or a crash stopping it (57P), an I/O error (58), a read-only standby or a failover
// under way (25006), a lock_timeout behind another's lock (55P03, a migration, say). SELECT 1
// still answers during most of these: counted against each message, they would dead-letter
// healthy messages within seconds.
func databaseOutage(err error) bool {
	code := sqlState(err)
	if code == "" {
		return false
	}
	for _, prefix := range []string{"08", "53", "57P", "58", "25006", "55P03"} {
		if strings.HasPrefix(code, prefix) {
			return true
		}
	}
	return false
}

// dataException reports whether err carries one of the SQLSTATEs of class 22, data exception,
// that only the value given can cause: too long for its column (22001), not valid in its type
// (22P02, 22007, 22008) or in the database's encoding (22021, 22P05). The same message fails
// the same way on every delivery, so it is dead-lettered at once, with the database's reason,
// rather than after every retry of every delivery. Not the rest of the class, which the
// database's state can cause too (a sequence run out, 2200H; a counter past its type's range,
// 22003; a division by a count of rows, 22012), nor class 23 (a referenced row being written
// may be there by a later try, within the seconds the tries span).
func dataException(err error) bool {
	switch sqlState(err) {
	case "22001", "22P02", "22007", "22008", "22021", "22P05":
		return true
	}
	return false
}

// sqlState is the SQLSTATE err carries (an error with a SQLState method, as pgx's are), or "".
func sqlState(err error) string {
	var coded interface{ SQLState() string }
	if !errors.As(err, &coded) {
		return ""
	}
	return coded.SQLState()
}

// answerWait bounds databaseAnswers' question.
const answerWait = 2 * time.Second

// databaseAnswers asks the database directly, on a context of its own: a database that
// swallows traffic shows up as the handler's deadline passing, and that must not count as the
// message's fault.
func (s *Subscription[Tx]) databaseAnswers(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, answerWait)
	defer cancel()
	_, err := s.driver.DB().Exec(ctx, "SELECT 1")
	return err == nil
}

// deliver runs msgs through the inbox and the handlers as one batch of deliveries from the
// queue would be, without a broker (see messagingtest.Deliver and DeliverBatch), and reports
// which were duplicates. Each message is checked as a consumer checks a delivery, with the
// content type a relay publishes it with.
func (s *Subscription[Tx]) deliver(ctx context.Context, msgs []Message) (duplicates []bool, err error) {
	if err := s.Start(); err != nil {
		return nil, err
	}
	jobs := make([]job, len(msgs))
	for i, msg := range msgs {
		err := checkReceived(msg.ID, contentTypeJSON, msg.Payload, s.cfg.MaxMessageBytes)
		var payload any
		if err == nil {
			payload, err = s.decode(msg)
		}
		if err != nil {
			if len(msgs) > 1 {
				err = fmt.Errorf("message %s: %w", msg.ID, err)
			}
			return nil, Permanent(err)
		}
		jobs[i] = job{msg: msg, payload: payload}
	}
	claimed, err := s.process(ctx, jobs, func() {})
	if err != nil {
		return nil, err
	}
	duplicates = make([]bool, len(claimed))
	for i, c := range claimed {
		duplicates[i] = !c
	}
	return duplicates, nil
}

type afterCommitKey struct{}

// observedKey carries, in an inbox transaction, the handlers' log lines and metrics, held
// until it ends (see whenObserved).
type observedKey struct{}

// observations are the handlers' outcomes of one inbox transaction, to log and count once it
// has ended.
type observations struct {
	fns []func(txErr error)
}

// run logs and counts the outcomes, given how the transaction ended (nil: committed).
func (o *observations) run(txErr error) {
	for _, fn := range o.fns {
		fn(txErr)
	}
}

// whenObserved holds fn, which logs and counts a handler's outcome given how its transaction
// ended, until the transaction has ended.
func whenObserved(ctx context.Context, fn func(txErr error)) {
	observed, _ := ctx.Value(observedKey{}).(*observations)
	observed.fns = append(observed.fns, fn)
}

// finalOutcome is the outcome of a handler that returned err in a transaction that ended with
// txErr: its own failure, or else the transaction's.
func finalOutcome(err, txErr error) string {
	if err != nil {
		return outcomeOf(err)
	}
	return outcomeOf(txErr)
}

// afterCommitHooks is what a handler's transaction owes after its work: the functions to run
// once it has committed.
type afterCommitHooks struct {
	fns []func()
}

// ErrNotInInbox is returned by [AfterCommit] outside a handler.
var ErrNotInInbox = errors.New("after commit: not in a handler's transaction")

// AfterCommit registers fn to run once the inbox transaction of the handler whose context is
// ctx has committed: the place to log what the work did, or to wake work recorded in the
// database, so that neither happens for a transaction that rolls back. It runs at most once
// (a process that dies after the commit never runs it, so an effect that must happen is a row
// of tx or an outbox message, not a hook): its message is acknowledged even if fn panics (the
// panic is logged). It runs before that acknowledgement, within the attempt's
// [SubscriptionConfig.HandlerTimeout]: keep it short. One still running 5 s past the timeout
// is abandoned, logged at error level, and the message acknowledged. Outside a handler it
// returns [ErrNotInInbox] and drops fn: return that error, and the message is retried instead of
// losing its hook.
func AfterCommit(ctx context.Context, fn func()) error {
	hooks, ok := ctx.Value(afterCommitKey{}).(*afterCommitHooks)
	if !ok {
		return ErrNotInInbox
	}
	hooks.fns = append(hooks.fns, fn)
	return nil
}
