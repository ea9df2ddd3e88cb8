package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// The path of one delivery, top to bottom:
//
//	amqp.Delivery ─► decode: a job (its Message and typed payload), or a dead-letter reason
//	              ─► process: inbox claim + handlers in one transaction, retried in place
//	              ─► settle: ack | reject (a counted failure, back to the queue) |
//	                 hand back (nack: not the message's fault) | dead-letter (confirmed, then ack)
//
// A consumer does the first and the last step; the work between is the subscription's.

// job is one delivery, decoded: its envelope and its payload, as its handler takes it.
type job struct {
	d       amqp.Delivery
	msg     Message
	payload any
}

// work is what a subscription gives its consumer: decode checks a message and decodes its
// payload (any error is the message's own: see undecodable); process does the work of jobs in
// one transaction, all or nothing, and calls committed once that transaction has committed,
// before the after-commit hooks run.
type work struct {
	decode  func(msg Message) (payload any, err error)
	process func(ctx context.Context, jobs []job, committed func()) error
	// answers, if set, says whether the database answers: an attempt abandoned while it does
	// not is an outage's, not its messages' failure.
	answers func(ctx context.Context) bool
}

// consumerConfig configures a consumer; a [SubscriptionConfig] fills it in.
type consumerConfig struct {
	URL, ConnectionName, Queue string
	Topology                   Topology
	Concurrency, Prefetch      int
	BatchSize, MaxBodyBytes    int
	Retries                    int
	RetryBackoff, Reconnect    Backoff
	HandlerTimeout             time.Duration
	ShutdownGrace              time.Duration
	DeliveryLimit              int
	Heartbeat                  time.Duration
	Logger                     *slog.Logger
	Metrics                    *Metrics
	Propagator                 propagation.TextMapPropagator
	// Tracer starts the trace of a delivery that came without one (see traceUntraced).
	Tracer trace.Tracer
}

// consumer consumes a queue with manual acknowledgements and reconnects by itself. Each
// delivery is acknowledged only after its work committed, moved to the dead-letter queue with
// its reason when it can never be handled, and otherwise retried: in place with backoff, then
// through the queue, up to the delivery limit.
type consumer struct {
	cfg  consumerConfig
	work work
	log  *slog.Logger
	// live is the connection of the session that is consuming, nil between sessions. A session
	// clears only its own: a goroutine of the last one, late, must not undo the next one's.
	live atomic.Pointer[amqp.Connection]
	// deadLetters is the current session's. A session sets it before its workers start, and
	// they have all stopped before the next session sets it again.
	deadLetters *deadLetterPublisher
}

func newConsumer(cfg consumerConfig, w work) *consumer {
	return &consumer{cfg: cfg, work: w, log: cfg.Logger.With("component", "consumer", "queue", cfg.Queue)}
}

// run consumes until ctx ends, reconnecting after every connection loss, and returns once
// in-flight messages are settled.
func (c *consumer) run(ctx context.Context) {
	reconnect(ctx, c.cfg.Reconnect, c.log, "consumer disconnected; reconnecting", c.session)
}

// session runs one connection's life. consumed reports whether it got as far as consuming.
func (c *consumer) session(ctx context.Context) (consumed bool, err error) {
	conn, err := dial(ctx, c.cfg.URL, c.cfg.ConnectionName, c.cfg.Heartbeat)
	if err != nil {
		return false, err
	}
	// The deadline is taken at return: the close handshake gets its second however long the
	// session lasted (an error only means the connection was already gone). At a shutdown, no
	// later than the shutdown closes the connection regardless (see stopAtShutdown): a worker
	// done before that, its stuck attempt given up, must not take Run past that bound when the
	// broker stopped answering.
	var shutdownClose atomic.Pointer[time.Time]
	stopClock := context.AfterFunc(ctx, func() {
		by := time.Now().Add(c.cfg.ShutdownGrace + closeMargin)
		shutdownClose.Store(&by)
	})
	defer func() {
		stopClock()
		deadline := time.Now().Add(time.Second)
		if by := shutdownClose.Load(); by != nil && by.Before(deadline) {
			deadline = *by
		}
		_ = conn.CloseDeadline(deadline)
	}()
	watchConnection(conn, c.log, slog.LevelWarn)
	// A shutdown stops the setup before its next consumer starts. A broker that stops answering
	// mid-setup would hold the shutdown up: past cancelWait, closing the connection ends every
	// call of the setup waiting on it.
	setupDone := make(chan struct{})
	setupOver := context.AfterFunc(ctx, func() {
		t := time.NewTimer(cancelWait)
		defer t.Stop()
		select {
		case <-t.C:
			_ = conn.CloseDeadline(time.Now())
		case <-setupDone:
		}
	})
	links, err := c.consume(ctx, conn)
	close(setupDone)
	setupOver()
	if ctx.Err() != nil {
		handBackSent(links)
		return false, fmt.Errorf("set up the consumer: %w", ctx.Err())
	}
	if err != nil {
		return false, err
	}
	c.deadLetters = &deadLetterPublisher{
		dial: func(ctx context.Context) (*amqp.Connection, error) {
			return dial(ctx, c.cfg.URL, c.cfg.ConnectionName+" (dead letters)", c.cfg.Heartbeat)
		},
		log:   c.log.With("connection", "dead letters"),
		queue: DeadLetterQueue(c.cfg.Queue),
		own:   c.ownQueue(),
	}
	defer c.deadLetters.close()
	c.log.Info("consumer started", "concurrency", c.cfg.Concurrency, "prefetch", c.cfg.Prefetch)
	c.live.Store(conn)
	defer c.live.CompareAndSwap(conn, nil)

	// session ends with the process (ctx) or with any channel: then no worker keeps retrying a
	// delivery it could no longer acknowledge. At shutdown it ends only once the consumers are
	// cancelled (see stopAtShutdown).
	session, endSession := context.WithCancel(context.WithoutCancel(ctx))
	over := make(chan struct{})
	defer close(over)
	defer endSession()
	closeErr := c.endWithChannels(session, endSession, conn, links)
	stopConsuming := c.stopAtShutdown(ctx, endSession, over, conn, links)
	defer stopConsuming()
	// Without the span of Run's context, if it has one: a delivery that came untraced starts a
	// trace of its own (see traceUntraced), not a child of a span as long as the process.
	workCtx, cancel := withGrace(trace.ContextWithSpanContext(ctx, trace.SpanContext{}), c.cfg.ShutdownGrace)
	defer cancel()
	closeDeadLettersWithSession(ctx, session, workCtx, over, c.deadLetters)

	c.workers(session, workCtx, ctx.Done(), links)
	if ctx.Err() != nil {
		return true, nil
	}
	if err := closeErr.Load(); err != nil {
		return true, fmt.Errorf("channel closed: %w", err)
	}
	// The broker cancelled a consumer (its queue was deleted, or a delivery outlived the
	// consumer timeout): reconnecting declares the queue again and consumes anew.
	return true, errors.New("delivery stream ended")
}

// ownQueue is the topology's entry of the consumer's queue (a subscription's topology always
// has it).
func (c *consumer) ownQueue() ConsumerTopology {
	q, _ := c.cfg.Topology.Queue(c.cfg.Queue)
	return q
}

// closeDeadLettersWithSession closes the session's dead-letter connection once the session is
// lost, or once a shutdown's grace is over: a copy waiting on a broker that blocked that
// connection must not keep the session from ending, nor the process from stopping.
func closeDeadLettersWithSession(ctx, session, workCtx context.Context, over <-chan struct{}, dl *deadLetterPublisher) {
	go func() {
		select {
		case <-session.Done():
		case <-over:
			return
		}
		if ctx.Err() != nil { // a shutdown: the workers have their grace
			select {
			case <-workCtx.Done():
			case <-over:
				return
			}
		}
		dl.close()
	}()
}

// consumerLink is one worker's channel: a consumer of the queue of its own, with its own
// prefetch. A worker alone on its channel may acknowledge a whole batch with one basic.ack
// (multiple): every delivery up to the batch's last is the batch's, or settled already.
type consumerLink struct {
	ch         *amqp.Channel
	tag        string
	closed     <-chan *amqp.Error // the channel's close notification
	cancelled  <-chan string      // the broker's cancel of the consumer (closed with the channel)
	deliveries <-chan amqp.Delivery
}

// consume declares the topology on conn, then opens a channel per worker and starts consuming
// the queue on each. A dead-letter queue an earlier version declared is used as it is (see
// [ErrLegacyDeadLetterQueue]), with a warning that names it: the topology may hold other
// consumers' queues, whose dead-letter queues are the ones to fix then. Once ctx ends it starts
// no more consumers, and returns with the links of those it started, and ctx's error.
func (c *consumer) consume(ctx context.Context, conn *amqp.Connection) ([]consumerLink, error) {
	_, err := c.cfg.Topology.declareConsuming(conn, c.log, c.cfg.Queue)
	var legacy *legacyQueues
	if errors.As(err, &legacy) {
		for i, dlq := range legacy.names {
			c.log.Warn("dead-letter queue has the broker's default delivery limit; using it as it is",
				"dead_letter_queue", dlq, "error", legacy.errs[i])
		}
	} else if err != nil {
		return nil, fmt.Errorf("declare topology: %w", err)
	}
	// Every channel is open, with its prefetch, before the first consumer starts: a channel
	// refused after some consumers started (a user's channel limit, say) would close the
	// connection on the deliveries they held, and the broker would count each of them a
	// delivery, at every reconnection, up to the delivery limit.
	links := make([]consumerLink, c.cfg.Concurrency)
	for i := range links {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		ch, err := conn.Channel()
		if err != nil {
			return nil, fmt.Errorf("open channel: %w", err)
		}
		// Per-consumer prefetch: a global QoS is refused on quorum queues.
		if err := ch.Qos(c.cfg.Prefetch, 0, false); err != nil {
			return nil, fmt.Errorf("set prefetch: %w", err)
		}
		links[i] = consumerLink{ch: ch, closed: ch.NotifyClose(make(chan *amqp.Error, 1)), cancelled: ch.NotifyCancel(make(chan string, 1))}
	}
	return c.startConsumers(ctx, links)
}

// startConsumers starts a consumer of the queue on each of links, whose channels are open. Once
// ctx ends it starts no more, and returns the links of those it started, and ctx's error. A
// consumer refused (its queue deleted meanwhile, say) ends the setup, and those started before
// it hand back what the broker sent them: left to the closing connection, each delivery would
// count as failed (RabbitMQ 4.3), as with a channel refused (see consume).
func (c *consumer) startConsumers(ctx context.Context, links []consumerLink) ([]consumerLink, error) {
	for i := range links {
		if ctx.Err() != nil { // shutting down: the consumers started so far, for their hand-back
			return links[:i], ctx.Err()
		}
		links[i].tag = consumerTag(c.cfg.Queue)
		deliveries, err := links[i].ch.Consume(c.cfg.Queue, links[i].tag, false, false, false, false, nil)
		if err != nil {
			handBackSent(links[:i])
			return nil, fmt.Errorf("consume %q: %w", c.cfg.Queue, err)
		}
		links[i].deliveries = deliveries
	}
	return links, nil
}

// consumerTag is a new tag for a consumer of queue: the queue's name, then a UUID that makes it
// unique. AMQP carries a tag in a short string, as it does the name, and the client refuses a
// longer one, closing the connection at every reconnect: the name is cut to leave the UUID
// room.
func consumerTag(queue string) string {
	id := uuid.NewString()
	return cutUTF8(queue, maxShortString-len(id)-1) + "-" + id
}

// endWithChannels marks the consumer not ready (unless a later session is live already) and
// ends the session once any of its channels closes, or the broker cancels any of its
// consumers, and returns where the broker's reason for closing a channel will be kept (nil for
// a clean close or a cancel). The other channels' consumers are cancelled first: their
// streams must end too, for the session to reconnect, and the deliveries their workers hand
// back must not come straight back to them. A cancel ends the session as a close does: RabbitMQ
// 4.3 cancels a consumer whose delivery outlived the consumer timeout where earlier versions
// closed its channel, and a session left with fewer workers would never get them back.
func (c *consumer) endWithChannels(session context.Context, endSession context.CancelFunc, conn *amqp.Connection, links []consumerLink) *atomic.Pointer[amqp.Error] {
	closeErr := new(atomic.Pointer[amqp.Error])
	var warn, cancel sync.Once // a deleted queue cancels every consumer at once
	for _, l := range links {
		go func() {
			ended, cancelled := awaitLinkEnd(session, l, closeErr)
			if !ended {
				return
			}
			if cancelled != "" {
				warn.Do(func() {
					c.log.Warn("broker cancelled a consumer; starting a new session", "consumer_tag", cancelled)
				})
			}
			c.live.CompareAndSwap(conn, nil)
			cancel.Do(func() { cancelConsumers(links) })
			endSession()
		}()
	}
	return closeErr
}

// awaitLinkEnd waits until l's channel closes (its reason kept in closeErr) or the broker
// cancels its consumer (tag, the consumer's), and reports whether either happened before the
// session ended.
func awaitLinkEnd(session context.Context, l consumerLink, closeErr *atomic.Pointer[amqp.Error]) (ended bool, tag string) {
	cancelled := l.cancelled
	for {
		select {
		case tag, ok := <-cancelled:
			if ok {
				return true, tag
			}
			cancelled = nil // closed with the channel, whose close notification says why
		case err, ok := <-l.closed:
			if ok && err != nil {
				closeErr.CompareAndSwap(nil, err)
			}
			return true, ""
		case <-session.Done():
			return false, ""
		}
	}
}

// cancelWait bounds the wait for the broker's confirmation of a consumer's cancel: a broker
// that does not answer must not hold a shutdown or a reconnection up.
const cancelWait = time.Second

// cancelConsumers stops the flow of new deliveries on every link, and returns once the broker
// has confirmed each cancel, or after cancelWait. Until its confirmation the broker may still
// send a consumer what it had on its way, and the client passes it on to the link's worker;
// a cancel that did not wait would make the client drop it, left unacknowledged for the
// closing connection to return, which RabbitMQ 4.3 counts as a failed delivery. Once
// confirmed, the link's delivery stream ends when what was delivered is taken; one the broker
// did not confirm in time is ended regardless. A dead channel or connection answers at once,
// with an error: it delivers nothing more anyway.
func cancelConsumers(links []consumerLink) {
	confirmed := make([]chan struct{}, len(links))
	for i, l := range links {
		confirmed[i] = make(chan struct{})
		go func() {
			_ = l.ch.Cancel(l.tag, false)
			close(confirmed[i])
		}()
	}
	wait, stop := context.WithTimeout(context.Background(), cancelWait)
	defer stop()
	for i, l := range links {
		select {
		case <-confirmed[i]:
		case <-wait.Done():
			// Unconfirmed in time: end its stream now, as a cancel that does not wait does, or a
			// broker that keeps the connection alive but never answers would keep it open for
			// good. (Confirmed just now, the second cancel is of a consumer gone: a no-op.)
			_ = l.ch.Cancel(l.tag, true)
		}
	}
}

// handBackSent cancels links' consumers, which a setup cut short (by the shutdown, by a consumer
// refused) had started, and hands back, as not failed, what the broker sent them before any
// worker could take it: once a cancel is confirmed, every delivery of its consumer is
// outstanding on its channel, and a nack of all of them (tag 0, multiple) returns them
// uncounted, where the closing connection would count them (RabbitMQ 4.3).
func handBackSent(links []consumerLink) {
	cancelConsumers(links)
	for _, l := range links {
		_ = l.ch.Nack(0, true, true)
	}
}

// closeMargin is how long past a shutdown's grace the connection stays open: for an attempt
// the grace called off to be abandoned (stopMargin) and its message handed back. Closed sooner,
// the connection would take that message back itself, which RabbitMQ 4.x counts as a failed
// delivery: a handler that hangs at every deploy would spend one of its deliveries each time.
// The connection's close ends by then too (see session), so a session ends within
// ShutdownGrace + 3 s of the shutdown, even with a broker that stopped answering: within the
// ShutdownGrace + 3.5 s that SubscriptionConfig.ShutdownGrace promises.
const closeMargin = stopMargin + 500*time.Millisecond

// stopping reports whether the session's work is over: the session ended (a shutdown, a lost
// channel), or a shutdown's grace did, which can come first while the broker has yet to
// confirm the consumers' cancels. A message in hand then goes back uncounted.
func stopping(session, workCtx context.Context) bool {
	return session.Err() != nil || workCtx.Err() != nil
}

// stopAtShutdown arranges that, once ctx ends, the flow of new deliveries stops, and only then
// the session ends: a delivery a worker hands back goes after the cancel of every one of its
// consumers, so the broker does not deliver it to this consumer again, only for the closing
// connection to return it once more and count that against it. The workers settle what they
// hold, within the grace period. Past it and closeMargin, the connection is closed regardless
// and the broker requeues whatever is unacknowledged. over is closed when the session is over.
// The returned function disarms it.
func (c *consumer) stopAtShutdown(ctx context.Context, endSession context.CancelFunc, over <-chan struct{}, conn *amqp.Connection, links []consumerLink) (stop func() bool) {
	return context.AfterFunc(ctx, func() {
		t := time.NewTimer(c.cfg.ShutdownGrace + closeMargin)
		defer t.Stop()
		cancelConsumers(links)
		endSession()
		select {
		case <-t.C:
			_ = conn.CloseDeadline(time.Now())
		case <-over:
		}
	})
}

// workers runs a worker per channel and returns once every delivery stream has ended (the
// consumer was cancelled or a channel closed) and every worker settled what it held.
// shutdown closes when the process stops: from then on no worker starts on another batch.
func (c *consumer) workers(session, workCtx context.Context, shutdown <-chan struct{}, links []consumerLink) {
	var wg sync.WaitGroup
	for _, l := range links {
		wg.Go(func() {
			for d := range l.deliveries {
				batch := collect(d, l.deliveries, c.cfg.BatchSize)
				awaitSessionEndAtShutdown(session, workCtx, shutdown)
				c.handle(session, workCtx, batch)
			}
		})
	}
	wg.Wait()
}

// awaitSessionEndAtShutdown holds a worker that took deliveries after the shutdown began until
// the session ends (once the broker confirmed the consumers' cancels, see stopAtShutdown), so
// that it hands them back instead of starting their work, which the grace might cut off;
// handed back sooner, they could be delivered to this consumer again.
func awaitSessionEndAtShutdown(session, workCtx context.Context, shutdown <-chan struct{}) {
	select {
	case <-shutdown:
		select {
		case <-session.Done():
		case <-workCtx.Done():
		}
	default:
	}
}

// collect returns first and whatever else is waiting in deliveries right now, up to limit: a
// batch never waits for messages that have not arrived.
func collect(first amqp.Delivery, deliveries <-chan amqp.Delivery, limit int) []amqp.Delivery {
	batch := []amqp.Delivery{first}
	for len(batch) < limit {
		d, ok, waiting := next(deliveries)
		if !waiting {
			// The client hands its buffered deliveries over one at a time, from a goroutine of
			// its own that may not be back at the channel yet: let it run before concluding
			// that nothing is waiting.
			runtime.Gosched()
			d, ok, waiting = next(deliveries)
		}
		if !waiting || !ok {
			return batch
		}
		batch = append(batch, d)
	}
	return batch
}

// next receives from deliveries if a delivery (or its end) is there to take, without waiting.
func next(deliveries <-chan amqp.Delivery) (d amqp.Delivery, ok, waiting bool) {
	select {
	case d, ok = <-deliveries:
		return d, ok, true
	default:
		return d, false, false
	}
}

// handle takes deliveries from decoding to settling. session ends at shutdown or when the
// channel is lost; workCtx a grace period after shutdown. Several messages are first tried
// together, in one transaction; if that fails, each is processed on its own, so one bad
// message cannot hold up the others.
func (c *consumer) handle(session, workCtx context.Context, batch []amqp.Delivery) {
	jobs := make([]job, 0, len(batch))
	var receives []trace.Span
	defer func() {
		for _, span := range receives {
			span.End()
		}
	}()
	for _, d := range batch {
		j, err := c.decode(d)
		if span := c.traceUntraced(workCtx, &j); span != nil {
			receives = append(receives, span)
		}
		if err != nil {
			o := c.undecodable(d, err)
			c.traceUndecodable(workCtx, j, o)
			c.settle(session, workCtx, j, o)
			continue
		}
		jobs = append(jobs, j)
	}
	tried := false
	if len(jobs) > 1 && !stopping(session, workCtx) {
		err := c.attempt(workCtx, jobs)
		if err == nil {
			c.ackAll(workCtx, jobs)
			return
		}
		if !stopping(session, workCtx) {
			c.log.Warn("batch failed; processing its messages one by one", "size", len(jobs), "error", err)
		}
		tried = true
	}
	for _, j := range jobs {
		c.settle(session, workCtx, j, c.process(session, workCtx, j, tried))
	}
}

// traceUntraced gives a delivery that came without a trace context a trace of its own: a
// receive span, the root of that trace, whose children are the spans of its attempts, and in
// which the consumer logs its lines about it (a retry, a return, a dead-lettering). It returns
// the span, to be ended once its batch is settled; nil for a delivery that has a trace, or
// without a tracer provider (a no-op span has no trace to give).
func (c *consumer) traceUntraced(ctx context.Context, j *job) trace.Span {
	// A traceparent is the common case: the subscription's span parses it, not this check too.
	if c.cfg.Tracer == nil || j.msg.TraceParent != "" || trace.SpanContextFromContext(j.msg.traced(ctx, c.cfg.Propagator)).IsValid() {
		return nil
	}
	spanCtx, span := c.cfg.Tracer.Start(ctx, "receive "+c.cfg.Queue, trace.WithNewRoot(), trace.WithSpanKind(trace.SpanKindConsumer))
	if !span.SpanContext().IsValid() {
		span.End()
		return nil
	}
	j.msg.withTraceOf(spanCtx, c.cfg.Propagator)
	return span
}

// traceUndecodable records a delivery that did not decode as a span of its trace (under the
// receive span, for one that came without): no handler's span starts for it, and one
// dead-lettered so must show among the trace's errors.
func (c *consumer) traceUndecodable(ctx context.Context, j job, o outcome) {
	if c.cfg.Tracer == nil {
		return
	}
	_, span := c.cfg.Tracer.Start(j.msg.traced(ctx, c.cfg.Propagator), "process "+c.cfg.Queue, trace.WithSpanKind(trace.SpanKindConsumer))
	if j.msg.ID != uuid.Nil { // an envelope that did not decode has none
		messageAttributes(span, j.msg)
	}
	var failed error
	if o.settle == settleDeadLetter {
		failed = o.reason
	}
	endSpan(span, failed)
}

// ackAll acknowledges jobs, a batch whose work committed, with one basic.ack of its last
// delivery (multiple): on the worker's own channel, every delivery before it is the batch's or
// settled already. Only now, after the commit, may the broker forget them.
func (c *consumer) ackAll(workCtx context.Context, jobs []job) {
	last := jobs[0].d
	for _, j := range jobs[1:] {
		if j.d.DeliveryTag > last.DeliveryTag {
			last = j.d
		}
	}
	if err := last.Ack(true); err != nil {
		c.log.WarnContext(workCtx, "could not ack a batch; the broker will redeliver it", "size", len(jobs), "error", err)
		return
	}
	for range jobs {
		c.cfg.Metrics.recordSettled(c.cfg.Queue, settledAcked)
	}
}

// decode is the one place a delivery becomes a job: its envelope (message id, JSON body) and
// its payload, checked. An error is the message's own: no retry changes its bytes, though
// another replica may have the handler this one lacks (see undecodable).
func (c *consumer) decode(d amqp.Delivery) (job, error) {
	j := job{d: d, msg: deliveryMessage(d)}
	msg, err := fromDelivery(d, c.cfg.MaxBodyBytes)
	if err != nil {
		return j, err
	}
	j.msg = msg
	if j.payload, err = c.work.decode(msg); err != nil {
		return j, Permanent(err)
	}
	return j, nil
}

// undecodable says how to settle a delivery that did not decode: dead-lettered, since no retry
// changes its bytes, unless only a handler for its type is missing here. In a rolling deploy that
// adds an event, the replicas of the older version share the queue with the newer ones that bound
// it: such a message goes back to the queue at once, for one of them that has room for it then,
// and is dead-lettered at its last allowed delivery (which as many older workers as the limit
// allows can reach first: deploy a new event's consumers before its producers). Neither waits: the
// messages behind it go on, and a type no replica handles reaches the dead-letter queue within its
// deliveries' round trips. A queue that does not count deliveries (not a quorum queue) would give
// it back for ever: there it is dead-lettered at its first redelivery.
func (c *consumer) undecodable(d amqp.Delivery, err error) outcome {
	if !errors.Is(err, errNoHandler) {
		return deadLetter(err)
	}
	if last, why := c.lastDelivery(d); last {
		return deadLetter(fmt.Errorf("%s: %w", why, err))
	}
	return outcome{settle: settleElsewhere, reason: err}
}

// lastDelivery reports whether d is the last delivery its queue allows, and why: its count,
// or a redelivery by a queue that does not count deliveries (not a quorum queue, declared by
// a deployment), which would give a failing message back for ever.
func (c *consumer) lastDelivery(d amqp.Delivery) (bool, string) {
	switch {
	case d.Redelivered && !counted(d):
		return true, "on a redelivery by a queue that does not count deliveries"
	case deliveryCount(d) >= c.cfg.DeliveryLimit-1: // not count+1, which a count of math.MaxInt wraps
		return true, fmt.Sprintf("on each of %d deliveries", c.cfg.DeliveryLimit)
	}
	return false, ""
}

// process processes one job, retrying it in place, and says how to settle it: acked once its
// work committed; dead-lettered on a permanent error or a failure on its last allowed
// delivery; rejected back to the queue after Retries failures; handed back when the session
// ends first. tried says that an attempt (its batch's) had j already.
func (c *consumer) process(session, workCtx context.Context, j job, tried bool) outcome {
	ctx := j.msg.traced(workCtx, c.cfg.Propagator)
	failures, outages := 0, 0
	for ; ; tried = true {
		if stopping(session, workCtx) {
			return handedBack
		}
		if tried {
			// A failed attempt's rollback does not undo what its handler changed in the payload
			// it was given (through a pointer, a slice, a map): each attempt decodes its own.
			payload, err := c.work.decode(j.msg)
			if err != nil {
				return c.undecodable(j.d, Permanent(err))
			}
			j.payload = payload
		}
		err := c.attempt(workCtx, []job{j})
		var delay time.Duration
		// Stopping and Unavailable before Permanent: a handler that called its failed lookup
		// permanent could not know that the shutdown cut it off, or that the database was away.
		// Stopping first: an attempt the shutdown called off may say Unavailable too (its
		// lookup's ctx.Err(), wrapped), and no retry follows then.
		switch {
		case err == nil:
			return acked
		case stopping(session, workCtx):
			// The shutdown or a lost channel may be what cut it off: not the message's failure
			// to count (a reject would spend one of its deliveries, or dead-letter it).
			return handedBack
		case IsUnavailable(err):
			// Not the message's fault: wait for the dependency without spending its retries.
			outages++
			delay = c.cfg.RetryBackoff.Delay(outages)
			c.log.WarnContext(ctx, "dependency unavailable; retrying message", "message_id", j.msg.ID, "type", j.msg.Type, "error", err, "retry_in", delay)
		case IsPermanent(err):
			return deadLetter(err)
		default:
			failures++
			if failures >= c.cfg.Retries {
				if last, why := c.lastDelivery(j.d); last {
					return deadLetter(fmt.Errorf("failed %s, last: %w", why, err))
				}
				return rejected(err, failures)
			}
			delay = c.cfg.RetryBackoff.Delay(failures)
			c.log.WarnContext(ctx, "handler failed; retrying message", "message_id", j.msg.ID, "type", j.msg.Type, "error", err, "attempts", failures, "retry_in", delay)
		}
		sleep(session, nil, delay)
	}
}

// abandonMargin is how long past its context's end an attempt may go on before its worker gives
// it up: time for a handler that watches its context to return, for the rollback
// (rollbackWait), and for the check whether the database answers (answerWait), which tells a
// silent database from a stuck handler.
const abandonMargin = rollbackWait + answerWait + time.Second

// stopMargin is abandonMargin once the shutdown called the attempt off: no check follows then,
// and the shutdown's own bounds (a service's hard stop) leave no time to spare.
const stopMargin = rollbackWait + 500*time.Millisecond

// The states of an attempt's goroutine, for consumer_attempts_abandoned to count each abandoned
// one until it returns.
const (
	attemptRunning int32 = iota
	attemptReturned
	attemptAbandoned
)

// attempt runs the work of jobs once, within the handler timeout. An attempt still running
// abandonMargin after its context ended (a handler or an after-commit hook that ignores its
// context: a call without a timeout, a channel send) is abandoned: waited for, it would hold
// its worker, and at the next lost channel its whole session, for good. Its goroutine runs on
// but touches no delivery (the worker settles them), and its transaction, begun under ctx, is
// rolled back by the driver once ctx ends: it cannot commit later.
func (c *consumer) attempt(workCtx context.Context, jobs []job) error {
	ctx, cancel := context.WithTimeout(workCtx, c.cfg.HandlerTimeout)
	defer cancel()
	var committed atomic.Bool
	var state atomic.Int32      // running, returned, or abandoned: which of the two ends came first
	done := make(chan error, 1) // the abandoned goroutine's result, which nobody takes
	go func() {
		done <- c.work.process(ctx, jobs, func() { committed.Store(true) })
		if !state.CompareAndSwap(attemptRunning, attemptReturned) {
			c.cfg.Metrics.addAbandoned(c.cfg.Queue, -1)
		}
	}()
	var err error
	select {
	case err = <-done:
	case <-ctx.Done():
		var returned bool
		if returned, err = waitPast(workCtx, done); !returned {
			// Counted before the state changes, so the goroutine's -1 never comes first.
			c.cfg.Metrics.addAbandoned(c.cfg.Queue, 1)
			if state.CompareAndSwap(attemptRunning, attemptAbandoned) {
				return c.abandon(workCtx, jobs, committed.Load(), ctx.Err())
			}
			c.cfg.Metrics.addAbandoned(c.cfg.Queue, -1)
			err = <-done // it returned just now: not abandoned after all
		}
	}
	if IsPermanent(err) && !IsUnavailable(err) && ctx.Err() != nil && workCtx.Err() == nil {
		// Cut off by the timeout: a failure to count, as any stuck attempt's, whatever the
		// handler called it (the next attempt may not be stuck). Its text stays, not its mark.
		return fmt.Errorf("timed out after %s: %s", c.cfg.HandlerTimeout, err.Error())
	}
	return err
}

// waitPast waits for the result of an attempt whose context ended, abandonMargin at most, and
// no more than stopMargin from when workCtx ends (the shutdown). returned is false if it never
// came.
func waitPast(workCtx context.Context, done <-chan error) (returned bool, err error) {
	deadline := time.Now().Add(abandonMargin)
	t := time.NewTimer(abandonMargin)
	defer t.Stop()
	stopping := workCtx.Done()
	for {
		select {
		case err = <-done:
			return true, err
		case <-t.C:
			return false, nil
		case <-stopping:
			stopping = nil
			t.Reset(min(time.Until(deadline), stopMargin))
		}
	}
}

// abandon logs an attempt given up, and says what it comes to: a failure, as any attempt the
// timeout cut off; or, when only an after-commit hook is left running, its work committed,
// a success, for its messages to be acknowledged (the hook's at most once is kept).
func (c *consumer) abandon(workCtx context.Context, jobs []job, committed bool, cause error) error {
	ctx := workCtx
	waited := abandonMargin
	if workCtx.Err() != nil {
		waited = stopMargin // at most
	}
	attrs := []any{"handler_timeout", c.cfg.HandlerTimeout, "waited", waited, "error", cause}
	if len(jobs) == 1 {
		ctx = jobs[0].msg.traced(workCtx, c.cfg.Propagator)
		attrs = append(attrs, "message_id", jobs[0].msg.ID, "type", jobs[0].msg.Type)
	} else {
		ids, types := make([]string, len(jobs)), make([]string, 0, 1)
		for i, j := range jobs {
			ids[i] = j.msg.ID.String()
			if !slices.Contains(types, j.msg.Type) {
				types = append(types, j.msg.Type)
			}
		}
		attrs = append(attrs, "size", len(jobs), "message_ids", ids, "types", types)
	}
	if committed {
		c.log.ErrorContext(ctx, "after-commit hook did not return within the handler timeout; abandoning it (the work committed)", attrs...)
		return nil
	}
	if workCtx.Err() != nil {
		c.log.ErrorContext(ctx, "handler did not return at the shutdown; abandoning it", attrs...)
		return fmt.Errorf("handler did not return at the shutdown; abandoned: %w", cause)
	}
	c.log.ErrorContext(ctx, "handler did not return within its timeout; abandoning it", attrs...)
	err := fmt.Errorf("handler did not return within %s of its timeout (%s); abandoned: %w", abandonMargin, c.cfg.HandlerTimeout, cause)
	if c.work.answers != nil && !c.work.answers(workCtx) && workCtx.Err() == nil {
		// A database that does not answer (a partition under a driver whose statements and
		// rollback ignore their context) holds every attempt: not the message's failure. (A
		// shutdown during the question is no verdict: the message is handed back.)
		return Unavailable(err)
	}
	return err
}

// outcome says how a delivery is settled.
type outcome struct {
	settle   settleKind
	reason   error // why it is rejected or dead-lettered
	attempts int   // the failed attempts of a rejected message
}

type settleKind int

const (
	settleAck settleKind = iota
	settleReject
	settleNack
	settleElsewhere // back to the queue, for a consumer that has a handler for its type
	settleDeadLetter
)

var (
	acked      = outcome{settle: settleAck}
	handedBack = outcome{settle: settleNack}
)

func rejected(reason error, attempts int) outcome {
	return outcome{settle: settleReject, reason: reason, attempts: attempts}
}

func deadLetter(reason error) outcome { return outcome{settle: settleDeadLetter, reason: reason} }

// settle is the one place a delivery is settled. Its lines are in the message's trace.
func (c *consumer) settle(session, workCtx context.Context, j job, o outcome) {
	ctx := j.msg.traced(workCtx, c.cfg.Propagator)
	if o.settle == settleElsewhere && stopping(session, workCtx) {
		o = handedBack // shutting down: back uncounted, as any message in hand
	}
	log := c.log.With("message_id", j.msg.ID, "type", truncate(j.msg.Type))
	if j.msg.ID == uuid.Nil {
		log = c.log.With("message_id", truncate(j.d.MessageId), "type", truncate(j.d.Type))
	}
	switch o.settle {
	case settleAck:
		// Only now, after the work committed, may the broker forget the message.
		c.confirm(ctx, log, "ack", j.d.Ack(false), settledAcked)
	case settleReject:
		log.WarnContext(ctx, "handler failed; returning message to the queue", "error", o.reason, "attempts", o.attempts)
		c.requeue(ctx, log, j.d)
	case settleElsewhere:
		log.WarnContext(ctx, "no handler here; returning message to the queue for a consumer that has one", "error", o.reason)
		c.requeue(ctx, log, j.d)
	case settleNack:
		// Shutting down or disconnected: back to the queue untouched, for another consumer. A
		// nack, which RabbitMQ 4.3 does not count against the message: it did not fail.
		c.confirm(ctx, log, "nack", j.d.Nack(false, true), "")
	case settleDeadLetter:
		if p := (*decodePanic)(nil); errors.As(o.reason, &p) {
			// The reason carries the panic; where it came from is for the developer.
			log.ErrorContext(ctx, "decoding panicked", "panic", p.value, "stack", string(p.stack))
		}
		c.deadLetter(ctx, session, workCtx, log, j.d, o.reason)
	}
}

// requeue returns d to its queue as a failed delivery. basic.reject, not basic.nack: from
// RabbitMQ 4.3 on only a reject counts, and without the count neither the queue's delivery
// limit nor the consumer's own check at its last delivery ever fires: it would come back for
// ever.
func (c *consumer) requeue(ctx context.Context, log *slog.Logger, d amqp.Delivery) {
	c.confirm(ctx, log, "reject", d.Reject(true), settledRequeued)
}

// confirm logs a failed ack, nack or reject, and counts a settled one as outcome (if any). A
// settlement fails when the channel closed meanwhile; the broker then redelivers the message,
// and the inbox recognises it if its work was done.
func (c *consumer) confirm(ctx context.Context, log *slog.Logger, op string, err error, outcome string) {
	if err != nil {
		log.WarnContext(ctx, "could not "+op+" message; the broker will redeliver it", "error", err)
		return
	}
	if outcome != "" {
		c.cfg.Metrics.recordSettled(c.cfg.Queue, outcome)
	}
}

// deadLetter moves d to the dead-letter queue, and the messages behind it carry on. A copy
// carrying the reason is published there with a confirm, and only then is d acknowledged. Until
// then d stays unacknowledged: a failed publish is tried again with backoff, and a session that
// ends first hands d back to the broker. Nothing is lost; a crash between the confirm and the
// ack, or a session that ends while an alarm holds the copy unread, leaves a second copy in the
// dead-letter queue, which a redrive hands to the inbox with the same message id.
func (c *consumer) deadLetter(ctx, session, workCtx context.Context, log *slog.Logger, d amqp.Delivery, reason error) {
	said := false // that the copy leaves d's headers out
	for failures := 1; ; failures++ {
		err := c.deadLetters.publish(workCtx, d, reason, &said)
		if err == nil {
			break
		}
		if !stopping(session, workCtx) {
			delay := c.cfg.RetryBackoff.Delay(failures)
			log.WarnContext(ctx, "could not dead-letter message; retrying", "error", err, "reason", reason, "retry_in", delay)
			sleep(session, nil, delay)
		}
		// A session that ended, before the failure or during the wait (which its end cuts
		// short), hands d back: a copy published after it could be confirmed while d, its
		// channel gone, can no longer be acknowledged, and its redelivery would be dead-lettered
		// a second time.
		if stopping(session, workCtx) {
			c.confirm(ctx, log, "nack", d.Nack(false, true), "")
			return
		}
	}
	log.ErrorContext(ctx, "message dead-lettered", "dead_letter_queue", DeadLetterQueue(c.cfg.Queue), "reason", reason)
	c.confirm(ctx, log, "ack", d.Ack(false), settledDeadLettered)
}

// deliveryCount is how many times the broker counted d as failed before (quorum queues count it
// in x-delivery-count). The broker sends a long, but a shovel or a plugin that sets the header
// again may give it any integer type, each of which the client decodes to its own Go type: read
// as 0, the count would never reach the last delivery. A negative count is 0.
func deliveryCount(d amqp.Delivery) int {
	switch v := d.Headers[deliveryCountHeader].(type) {
	case int:
		return nonNegative(v)
	case int8:
		return nonNegative(v)
	case int16:
		return nonNegative(v)
	case int32:
		return nonNegative(v)
	case int64:
		return nonNegative(v)
	case uint:
		return nonNegative(v)
	case uint8:
		return nonNegative(v)
	case uint16:
		return nonNegative(v)
	case uint32:
		return nonNegative(v)
	case uint64:
		return nonNegative(v)
	}
	return 0
}

// integer is every Go integer type.
type integer interface {
	~int | ~int8 | ~int16 | ~int32 | ~int64 | ~uint | ~uint8 | ~uint16 | ~uint32 | ~uint64
}

// nonNegative is v as an int: 0 if negative, math.MaxInt past it (a uint64, or an int64 on a
// 32-bit platform), which is past every delivery limit.
func nonNegative[T integer](v T) int {
	switch {
	case v <= 0:
		return 0
	case uint64(v) > math.MaxInt:
		return math.MaxInt
	}
	return int(v)
}

// counted reports whether d's queue counts its deliveries: a quorum queue marks each
// redelivery with x-delivery-count, or, from RabbitMQ 4.3 on, at least with x-acquired-count
// (there a nack is no failure: a message nacked before its first reject or lost channel comes
// back without x-delivery-count).
func counted(d amqp.Delivery) bool {
	_, failures := d.Headers[deliveryCountHeader]
	_, acquisitions := d.Headers[acquiredCountHeader]
	return failures || acquisitions
}
