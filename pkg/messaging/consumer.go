package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Handler does a consumer's work for one message. Return nil once the work is committed;
// mark errors no retry can fix with [Permanent] and dependency outages with [Unavailable].
type Handler func(ctx context.Context, msg Message) error

// BatchHandler does the work of several messages at once, all or nothing: nil means every one
// is done and committed; an error means none is, and the consumer falls back to handling them
// one by one with its [Handler].
type BatchHandler func(ctx context.Context, msgs []Message) error

// ConsumerConfig configures a [Consumer]. URL and Queue are required.
type ConsumerConfig struct {
	URL            string // RabbitMQ URL, vhost included; for a cluster, a comma-separated list (SplitURLs)
	ConnectionName string // shown by the broker; helps find the connection in rabbitmqctl
	Queue          string // the queue to consume
	// Topology is declared on every new connection, before consuming (see [Topology.Declare]):
	// at least the consumer's queue, its bindings and its dead-letter queue.
	Topology Topology
	// Concurrency is how many messages are handled in parallel. Default 1.
	Concurrency int
	// Prefetch is how many unacknowledged messages the broker sends ahead. Default 2×Concurrency,
	// or Concurrency×BatchSize when batching.
	Prefetch int
	// BatchHandler, if set, handles up to BatchSize deliveries that are waiting at once in one
	// go (with an [Inbox], one transaction and one commit for all of them).
	BatchHandler BatchHandler
	// BatchSize is the most deliveries one BatchHandler call takes. Default 50.
	BatchSize int
	// MaxBodyBytes: larger messages are dead-lettered. Default [DefaultMaxMessageBytes].
	MaxBodyBytes int
	// Retries is how many times a failing message is tried in place before it goes back to
	// the queue (where the queue's delivery limit is the backstop). Default 3.
	Retries int
	// RetryBackoff paces retries in place. Default 100 ms doubling up to 5 s.
	RetryBackoff Backoff
	// HandlerTimeout bounds one attempt of the handler. Default 30 s.
	HandlerTimeout time.Duration
	// ShutdownGrace is how long handlers in progress may go on after Run's context ends.
	// Default 5 s.
	ShutdownGrace time.Duration
	// Reconnect paces reconnection attempts. Default 100 ms doubling up to 2 s, jittered: a
	// broker that comes back is found within about 2 s.
	Reconnect Backoff
	// DeliveryLimit is the queue's x-delivery-limit (default DefaultDeliveryLimit). A message
	// still failing on its last delivery is dead-lettered by the consumer itself, with its
	// reason: the broker's own dead-lettering at the limit would say only "delivery_limit".
	DeliveryLimit int
	// Heartbeat is the AMQP heartbeat interval (default 10 s): a silent connection is declared
	// dead after a few missed beats.
	Heartbeat time.Duration
	Logger    *slog.Logger
	Metrics   *Metrics // optional
}

// Consumer consumes a queue with manual acknowledgements and reconnects by itself. Each
// delivery is acknowledged only after its handler returned nil (after the commit, with an
// [Inbox]), moved to the dead-letter queue with its reason when it can never be handled, and
// otherwise retried: in place with backoff, then through the queue.
type Consumer struct {
	cfg     ConsumerConfig
	handler Handler
	log     *slog.Logger
	ready   atomic.Bool
	// deadLetters publishes on the current session's connection. A session sets it before its
	// workers start, and they have all stopped before the next session sets it again.
	deadLetters *deadLetterPublisher
}

// NewConsumer checks cfg and fills in its defaults.
func NewConsumer(cfg ConsumerConfig, handler Handler) (*Consumer, error) {
	if cfg.URL == "" || cfg.Queue == "" || handler == nil {
		return nil, errors.New("consumer: URL, Queue and a handler are required")
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = 1
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 50
	}
	if cfg.Prefetch <= 0 {
		cfg.Prefetch = 2 * cfg.Concurrency
		if cfg.BatchHandler != nil {
			cfg.Prefetch = cfg.Concurrency * cfg.BatchSize
		}
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxMessageBytes
	}
	if cfg.Retries <= 0 {
		cfg.Retries = 3
	}
	cfg.RetryBackoff = cfg.RetryBackoff.withDefaults(100*time.Millisecond, 5*time.Second)
	if cfg.HandlerTimeout <= 0 {
		cfg.HandlerTimeout = 30 * time.Second
	}
	if cfg.ShutdownGrace <= 0 {
		cfg.ShutdownGrace = 5 * time.Second
	}
	cfg.Reconnect = cfg.Reconnect.withDefaults(100*time.Millisecond, 2*time.Second)
	if cfg.DeliveryLimit <= 0 {
		cfg.DeliveryLimit = DefaultDeliveryLimit
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Consumer{cfg: cfg, handler: handler, log: cfg.Logger.With("component", "consumer", "queue", cfg.Queue)}, nil
}

// Ready reports whether the consumer is connected and consuming.
func (c *Consumer) Ready() bool { return c.ready.Load() }

// Run consumes until ctx ends, reconnecting after every connection loss, and returns nil once
// in-flight messages are settled.
func (c *Consumer) Run(ctx context.Context) error {
	reconnect(ctx, c.cfg.Reconnect, c.log, "consumer disconnected; reconnecting", c.session)
	return nil
}

// session runs one connection's life. consumed reports whether it got as far as consuming.
func (c *Consumer) session(ctx context.Context) (consumed bool, err error) {
	conn, err := dial(c.cfg.URL, c.cfg.ConnectionName, c.cfg.Heartbeat)
	if err != nil {
		return false, err
	}
	// The deadline is taken at return: the close handshake gets its second however long the
	// session lasted (an error only means the connection was already gone).
	defer func() { _ = conn.CloseDeadline(time.Now().Add(time.Second)) }()
	watchConnection(conn, c.log)
	link, err := c.consume(conn)
	if err != nil {
		return false, err
	}
	c.deadLetters = &deadLetterPublisher{conn: conn, queue: DeadLetterQueue(c.cfg.Queue)}
	c.log.Info("consumer started", "concurrency", c.cfg.Concurrency, "prefetch", c.cfg.Prefetch)
	c.ready.Store(true)
	defer c.ready.Store(false)

	// session ends with the process (ctx) or with the channel: then no worker keeps retrying a
	// delivery it could no longer acknowledge.
	session, endSession := context.WithCancel(ctx)
	defer endSession()
	closeErr := c.endWithChannel(session, endSession, link.closed)
	stopConsuming := c.stopAtShutdown(ctx, session, conn, link)
	defer stopConsuming()
	handlerCtx, cancel := withGrace(ctx, c.cfg.ShutdownGrace)
	defer cancel()

	c.work(session, handlerCtx, link.deliveries)
	if ctx.Err() != nil {
		return true, nil
	}
	if err := closeErr.Load(); err != nil {
		return true, fmt.Errorf("channel closed: %w", err)
	}
	// The broker cancelled the consumer (its queue was deleted, say): reconnecting declares it
	// again.
	return true, errors.New("delivery stream ended")
}

// consumerLink is the channel a session consumes on.
type consumerLink struct {
	ch         *amqp.Channel
	tag        string
	closed     <-chan *amqp.Error // the channel's close notification
	deliveries <-chan amqp.Delivery
}

// consume opens a channel on conn, declares the topology and starts consuming the queue.
func (c *Consumer) consume(conn *amqp.Connection) (consumerLink, error) {
	ch, err := c.declare(conn)
	if err != nil {
		return consumerLink{}, err
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	// Per-consumer prefetch: a global QoS is refused on quorum queues.
	if err := ch.Qos(c.cfg.Prefetch, 0, false); err != nil {
		return consumerLink{}, fmt.Errorf("set prefetch: %w", err)
	}
	tag := c.cfg.Queue + "-" + uuid.NewString()
	deliveries, err := ch.Consume(c.cfg.Queue, tag, false, false, false, false, nil)
	if err != nil {
		return consumerLink{}, fmt.Errorf("consume %q: %w", c.cfg.Queue, err)
	}
	return consumerLink{ch: ch, tag: tag, closed: closed, deliveries: deliveries}, nil
}

// declare declares the topology on conn and returns a channel to consume on. A dead-letter
// queue an earlier version declared is used as it is (see [ErrLegacyDeadLetterQueue]).
func (c *Consumer) declare(conn *amqp.Connection) (*amqp.Channel, error) {
	err := c.cfg.Topology.Declare(conn, c.log)
	if errors.Is(err, ErrLegacyDeadLetterQueue) {
		c.log.Warn("dead-letter queue has the broker's default delivery limit; using it as it is",
			"dead_letter_queue", DeadLetterQueue(c.cfg.Queue), "error", err)
	} else if err != nil {
		return nil, fmt.Errorf("declare topology: %w", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	return ch, nil
}

// endWithChannel marks the consumer not ready and ends the session once the channel closes,
// and returns where the broker's reason for closing it will be kept (nil for a clean close).
func (c *Consumer) endWithChannel(session context.Context, endSession context.CancelFunc, closed <-chan *amqp.Error) *atomic.Pointer[amqp.Error] {
	closeErr := new(atomic.Pointer[amqp.Error])
	go func() {
		select {
		case err, ok := <-closed:
			if ok && err != nil {
				closeErr.Store(err)
			}
			c.ready.Store(false)
			endSession()
		case <-session.Done():
		}
	}()
	return closeErr
}

// stopAtShutdown arranges that, once ctx ends, the flow of new deliveries stops (noWait: the
// cancel must not wait on a dead connection); the workers settle what they hold, within the
// grace period. Past it, the connection is closed regardless and the broker requeues whatever
// is unacknowledged. The returned function disarms it.
func (c *Consumer) stopAtShutdown(ctx, session context.Context, conn *amqp.Connection, link consumerLink) (stop func() bool) {
	return context.AfterFunc(ctx, func() {
		_ = link.ch.Cancel(link.tag, true)
		t := time.NewTimer(c.cfg.ShutdownGrace + time.Second)
		defer t.Stop()
		select {
		case <-t.C:
			_ = conn.CloseDeadline(time.Now())
		case <-session.Done():
		}
	})
}

// work runs Concurrency workers over deliveries and returns once the stream has ended (the
// consumer was cancelled or the channel closed) and every worker settled what it held.
func (c *Consumer) work(session, handlerCtx context.Context, deliveries <-chan amqp.Delivery) {
	var wg sync.WaitGroup
	for range c.cfg.Concurrency {
		wg.Go(func() {
			for d := range deliveries {
				if c.cfg.BatchHandler == nil {
					c.handle(session, handlerCtx, d)
					continue
				}
				c.handleBatch(session, handlerCtx, collect(d, deliveries, c.cfg.BatchSize))
			}
		})
	}
	wg.Wait()
}

// handle settles one delivery. session ends at shutdown or when the channel is lost; workCtx
// a grace period after shutdown.
func (c *Consumer) handle(session, workCtx context.Context, d amqp.Delivery) {
	msg, err := fromDelivery(d, c.cfg.MaxBodyBytes)
	if err != nil {
		c.deadLetter(session, workCtx, d, d.MessageId, err)
		return
	}
	// The handler works, and these lines are written, in the trace the message came with.
	ctx := msg.traced(workCtx)
	log := c.log.With("message_id", msg.ID, "type", msg.Type)
	failures, outages := 0, 0
	for {
		if session.Err() != nil {
			// Shutting down or disconnected: hand it back untouched for another consumer. A
			// nack, which RabbitMQ 4.3 does not count against the message: it did not fail.
			c.settle(ctx, log, "nack", d.Nack(false, true))
			return
		}
		err := c.attempt(ctx, msg)
		var delay time.Duration
		switch {
		case err == nil:
			// Only now, after the handler committed, may the broker forget the message.
			if c.settle(ctx, log, "ack", d.Ack(false)) {
				c.cfg.Metrics.recordSettled(c.cfg.Queue, "acked")
			}
			return
		case IsPermanent(err):
			c.deadLetter(session, workCtx, d, msg.ID.String(), err)
			return
		case IsUnavailable(err):
			// Not the message's fault: wait for the dependency without spending its retries.
			outages++
			delay = c.cfg.RetryBackoff.Delay(outages)
			log.WarnContext(ctx, "dependency unavailable; retrying message", "error", err, "retry_in", delay)
		default:
			failures++
			if failures >= c.cfg.Retries {
				if deliveryCount(d)+1 >= c.cfg.DeliveryLimit {
					c.deadLetter(session, workCtx, d, msg.ID.String(), fmt.Errorf("failed on each of %d deliveries, last: %w", c.cfg.DeliveryLimit, err))
					return
				}
				log.WarnContext(ctx, "handler failed; returning message to the queue", "error", err, "attempts", failures)
				// basic.reject, not basic.nack: from RabbitMQ 4.3 on only a reject counts as a
				// failed delivery, and without the count neither the queue's delivery limit nor
				// the check above ever fires: the message would come back forever.
				if c.settle(ctx, log, "reject", d.Reject(true)) {
					c.cfg.Metrics.recordSettled(c.cfg.Queue, "requeued")
				}
				return
			}
			delay = c.cfg.RetryBackoff.Delay(failures)
			log.WarnContext(ctx, "handler failed; retrying message", "error", err, "attempts", failures, "retry_in", delay)
		}
		Sleep(session, nil, delay)
	}
}

// deliveryCount is how many times the broker delivered d before (quorum queues count it in
// x-delivery-count).
func deliveryCount(d amqp.Delivery) int {
	switch v := d.Headers[deliveryCountHeader].(type) {
	case int64:
		return int(v)
	case int32:
		return int(v)
	case int:
		return v
	}
	return 0
}

// collect returns first and whatever else is waiting in deliveries right now, up to limit: a
// batch never waits for messages that have not arrived.
func collect(first amqp.Delivery, deliveries <-chan amqp.Delivery, limit int) []amqp.Delivery {
	batch := []amqp.Delivery{first}
	for len(batch) < limit {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return batch
			}
			batch = append(batch, d)
		default:
			return batch
		}
	}
	return batch
}

// handleBatch tries the batch handler once on the decodable deliveries; if it fails, each is
// handled on its own, with the usual retries, dead-lettering and outage handling.
func (c *Consumer) handleBatch(session, workCtx context.Context, batch []amqp.Delivery) {
	msgs := make([]Message, 0, len(batch))
	good := make([]amqp.Delivery, 0, len(batch))
	for _, d := range batch {
		msg, err := fromDelivery(d, c.cfg.MaxBodyBytes)
		if err != nil {
			c.deadLetter(session, workCtx, d, d.MessageId, err)
			continue
		}
		msgs, good = append(msgs, msg), append(good, d)
	}
	if len(good) == 0 {
		return
	}
	if len(good) > 1 && session.Err() == nil {
		ctx, cancel := context.WithTimeout(workCtx, c.cfg.HandlerTimeout)
		err := c.cfg.BatchHandler(ctx, msgs)
		cancel()
		if err == nil {
			for _, d := range good {
				if c.settle(workCtx, c.log, "ack", d.Ack(false)) {
					c.cfg.Metrics.recordSettled(c.cfg.Queue, "acked")
				}
			}
			return
		}
		c.log.Debug("batch failed; handling its messages one by one", "size", len(good), "error", err)
	}
	for _, d := range good {
		c.handle(session, workCtx, d)
	}
}

func (c *Consumer) attempt(ctx context.Context, msg Message) error {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.HandlerTimeout)
	defer cancel()
	return c.handler(ctx, msg)
}

// deadLetter moves d to the dead-letter queue, and the messages behind it carry on. A copy
// carrying the reason is published there with a confirm, and only then is d acknowledged. Until
// then d stays unacknowledged: a failed publish is tried again with backoff, and a session that
// ends first hands d back to the broker. Nothing is lost; a crash between the confirm and the
// ack leaves a second copy in the dead-letter queue, which a redrive hands to the inbox with the
// same message id. Its lines are in the message's trace.
func (c *Consumer) deadLetter(session, workCtx context.Context, d amqp.Delivery, messageID string, reason error) {
	ctx := deliveryTrace(d)
	log := c.log.With("message_id", truncate(messageID), "type", truncate(d.Type))
	for failures := 1; ; failures++ {
		err := c.deadLetters.publish(workCtx, d, reason)
		if err == nil {
			break
		}
		if session.Err() != nil {
			c.settle(ctx, log, "nack", d.Nack(false, true))
			return
		}
		delay := c.cfg.RetryBackoff.Delay(failures)
		log.WarnContext(ctx, "could not dead-letter message; retrying", "error", err, "reason", reason, "retry_in", delay)
		Sleep(session, nil, delay)
	}
	log.ErrorContext(ctx, "message dead-lettered", "dead_letter_queue", DeadLetterQueue(c.cfg.Queue), "reason", reason)
	if c.settle(ctx, log, "ack", d.Ack(false)) {
		c.cfg.Metrics.recordSettled(c.cfg.Queue, "dead_lettered")
	}
}

// settle logs a failed ack, nack or reject. It happens when the channel closed meanwhile; the
// broker then redelivers the message, and the inbox recognises it if it was handled.
func (c *Consumer) settle(ctx context.Context, log *slog.Logger, op string, err error) bool {
	if err != nil {
		log.WarnContext(ctx, "could not "+op+" message; the broker will redeliver it", "error", err)
		return false
	}
	return true
}
