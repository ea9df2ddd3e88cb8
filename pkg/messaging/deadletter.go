package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The headers a [Subscription] adds to the copy of a message it dead-letters, so that the reason
// travels with the message instead of living only in a log line. The broker's own x-death says
// no more than "rejected".
const (
	HeaderDeadLetterReason   = "x-outbox-dead-letter-reason"   // why no retry can help, truncated
	HeaderDeadLetteredAt     = "x-outbox-dead-lettered-at"     // when, RFC 3339 in UTC
	HeaderOriginalExchange   = "x-outbox-original-exchange"    // where the message was published
	HeaderOriginalRoutingKey = "x-outbox-original-routing-key" // and with which routing key
)

// deliveryCountHeader is where a quorum queue says how often it delivered a message before.
const deliveryCountHeader = "x-delivery-count"

// acquiredCountHeader is where a quorum queue from RabbitMQ 4.3 on says how often it delivered a
// message before, failed or not.
const acquiredCountHeader = "x-acquired-count"

// maxReasonBytes bounds the reason header: a reason quoting a large decoding error must not
// grow the message's headers past the broker's frame size.
const maxReasonBytes = 1024

// deadLetterTimeout bounds the wait for the confirm of a dead-letter copy, while no resource
// alarm blocks its connection.
const deadLetterTimeout = 15 * time.Second

// errDeadLetterNotConfirmed means the broker did not take the copy: the original stays
// unacknowledged and is tried again.
var errDeadLetterNotConfirmed = errors.New("dead-letter queue did not take the message")

// errUnroutable means the copy came back unroutable: its dead-letter queue does not exist.
var errUnroutable = errors.New("unroutable")

// deadLetterCopy is what goes to the dead-letter queue for d: its body and properties, its
// message id unchanged (so a redriven message is still recognised by the inbox), and its
// headers plus the reason. Left out: x-delivery-count and x-acquired-count, which the
// dead-letter queue keeps for itself; expiration, which the broker too removes when it
// dead-letters, so that the copy does not expire there; user_id, which the broker checks
// against the user publishing it, here the consumer's and not the original publisher's; and
// the routing headers (CC), which would send the copy to the queues they name as well.
func deadLetterCopy(d amqp.Delivery, reason error, at time.Time) amqp.Publishing {
	headers := make(amqp.Table, len(d.Headers)+4)
	for k, v := range d.Headers {
		if k != deliveryCountHeader && k != acquiredCountHeader && !slices.Contains(routingHeaders, k) {
			headers[k] = v
		}
	}
	why := reason.Error()
	if len(why) > maxReasonBytes {
		why = cutUTF8(why, maxReasonBytes) + "…"
	}
	headers[HeaderDeadLetterReason] = why
	headers[HeaderDeadLetteredAt] = at.UTC().Format(time.RFC3339Nano)
	headers[HeaderOriginalExchange] = d.Exchange
	headers[HeaderOriginalRoutingKey] = d.RoutingKey
	return amqp.Publishing{
		Headers:         headers,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    d.DeliveryMode,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

// deadLetterPublisher publishes dead-letter copies on a confirm-mode channel of a connection of
// its own, dialled when first needed. Not the consumer's: a resource alarm stops the broker
// reading from every connection that publishes, acknowledgements and all, and consuming is how
// a broker comes out of a memory alarm.
type deadLetterPublisher struct {
	dial  func(ctx context.Context) (*amqp.Connection, error)
	log   *slog.Logger
	queue string // the dead-letter queue
	// own is the consumer's queue, whose dead-letter queue this is: declared again when a copy
	// comes back unroutable.
	own ConsumerTopology

	// mu makes it one copy at a time: dead letters are rare, and with one publish in flight a
	// basic.return on the channel can only be that publish's.
	mu      sync.Mutex
	watch   *connWatch
	ch      *amqp.Channel
	returns chan amqp.Return

	// connMu guards conn and over, and is never held across a call to the broker: close must
	// get through while a publish waits on a blocked one.
	connMu sync.Mutex
	conn   *amqp.Connection
	over   bool // closed for good: no connection is dialled again
}

// errDeadLettersClosed means the session's dead-letter connection was closed for good.
var errDeadLettersClosed = errors.New("dead-letter connection closed with its session")

// publish sends the copy of d through the default exchange to the dead-letter queue, mandatory,
// and returns nil only once the broker confirmed it and routed it to that queue. A copy that
// comes back unroutable has the dead-letter queue declared again, for the next try.
func (p *deadLetterPublisher) publish(ctx context.Context, d amqp.Delivery, reason error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := p.open(ctx); err != nil {
		return err
	}
	err := p.confirm(ctx, deadLetterCopy(d, reason, time.Now()))
	if err != nil {
		// A confirm or return still on its way must not be taken for the next copy's.
		p.discard()
	}
	if errors.Is(err, errUnroutable) {
		return p.declareAgain(ctx, err)
	}
	return err
}

// declareAgain declares the dead-letter queue again after a copy came back unroutable, and
// returns that error (unroutable) with how the declaration went. The queue was deleted after
// the session declared it (an operator purging it, say): left gone until the next connection,
// every copy would come back, and the worker retrying it would hold what its channel was sent
// for the whole session. Only the dead-letter queue, as the topology declares it: the rest of
// the consumer's topology was not missing, and a binding an operator removed stays removed
// until the next connection, as before.
func (p *deadLetterPublisher) declareAgain(ctx context.Context, unroutable error) error {
	conn, err := p.connection(ctx)
	if err != nil {
		return fmt.Errorf("%w; declaring it again: %w", unroutable, err)
	}
	// The client's calls have no deadline of their own: a broker that stopped answering would
	// hold mu, and every worker's dead letter behind it, for good. Past a copy's bound (see
	// await), closing the connection ends the declaration; the next copy dials again.
	declared, bounded := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(bounded)
		if p.await(ctx, declared) != nil {
			_ = conn.CloseDeadline(time.Now())
		}
	}()
	d := &declarer{conn: conn}
	refused, hidden, err := d.deadLetterQueue(p.own)
	d.close()
	close(declared)
	<-bounded
	switch {
	case isLegacyDeadLetterQueue(err):
		return fmt.Errorf("%w; it exists again, declared without x-delivery-limit", unroutable)
	case refused && err != nil:
		return fmt.Errorf("%w; not allowed to declare it: %w", unroutable, err)
	case err != nil:
		return fmt.Errorf("%w; declaring it again: %w", unroutable, err)
	case hidden:
		// RabbitMQ from 4.2.6 and 4.3.0 on: nothing was declared, nor seen.
		return fmt.Errorf("%w; not allowed to declare it, nor to see whether it exists: the deployment must declare it", unroutable)
	case refused:
		return fmt.Errorf("%w; not allowed to declare it, but it exists now", unroutable)
	}
	return fmt.Errorf("%w; declared it again", unroutable)
}

func (p *deadLetterPublisher) open(ctx context.Context) error {
	if p.ch != nil && !p.ch.IsClosed() {
		return nil
	}
	conn, err := p.connection(ctx)
	if err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open dead-letter channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return fmt.Errorf("enable confirms on the dead-letter channel: %w", err)
	}
	p.ch, p.returns = ch, ch.NotifyReturn(make(chan amqp.Return, 1))
	return nil
}

// connection returns the open connection, dialling one if there is none.
func (p *deadLetterPublisher) connection(ctx context.Context) (*amqp.Connection, error) {
	p.connMu.Lock()
	conn, over := p.conn, p.over
	p.connMu.Unlock()
	switch {
	case over:
		return nil, errDeadLettersClosed
	case conn != nil && !conn.IsClosed():
		return conn, nil
	}
	conn, err := p.dial(ctx)
	if err != nil {
		return nil, fmt.Errorf("connect for dead letters: %w", err)
	}
	p.connMu.Lock()
	defer p.connMu.Unlock()
	if p.over {
		_ = conn.CloseDeadline(time.Now().Add(time.Second))
		return nil, errDeadLettersClosed
	}
	p.conn, p.watch = conn, watchConnection(conn, p.log, slog.LevelWarn)
	return conn, nil
}

func (p *deadLetterPublisher) confirm(ctx context.Context, pub amqp.Publishing) error {
	dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, "", p.queue, true, false, pub)
	if err != nil {
		return fmt.Errorf("publish to %q: %w", p.queue, err)
	}
	acked, err := p.wait(ctx, dc)
	switch {
	case err != nil:
		return fmt.Errorf("%w: no confirm from %q: %w", errDeadLetterNotConfirmed, p.queue, err)
	case !acked:
		return fmt.Errorf("%w: %q nacked it, or the channel closed", errDeadLetterNotConfirmed, p.queue)
	}
	// The broker sends a basic.return before the confirm, and the client hands it over before
	// it resolves the confirm: if there is one, it is here now.
	if r, ok := returnedNow(p.returns); ok {
		return fmt.Errorf("%w: %w, does queue %q exist? %d %s", errDeadLetterNotConfirmed, errUnroutable, p.queue, r.ReplyCode, r.ReplyText)
	}
	return nil
}

// returnedNow returns the basic.return waiting in returns after a confirm, if there is one.
// The client closes returns when the channel closes (the connection was lost after the
// confirm): that is no return, not one of zero values.
func returnedNow(returns <-chan amqp.Return) (amqp.Return, bool) {
	select {
	case r, ok := <-returns:
		return r, ok
	default:
		return amqp.Return{}, false
	}
}

// wait waits for the confirm of dc, within await's bound.
func (p *deadLetterPublisher) wait(ctx context.Context, dc *amqp.DeferredConfirmation) (acked bool, err error) {
	if err := p.await(ctx, dc.Done()); err != nil {
		return false, err
	}
	return dc.Acked(), nil
}

// await waits until done closes, up to deadLetterTimeout, and on for as long as an alarm blocks
// the connection, and deadLetterTimeout beyond its end: the broker reads what was sent once the
// alarm clears, and a copy published again meanwhile would only queue a second one behind it.
// Closing the connection (close) ends the wait on a call to the broker.
func (p *deadLetterPublisher) await(ctx context.Context, done <-chan struct{}) error {
	timeout := time.NewTimer(deadLetterTimeout)
	defer timeout.Stop()
	for {
		select {
		case <-done:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-timeout.C:
			blocked, unblockedAt := p.watch.state()
			more := confirmWait(blocked, unblockedAt, time.Now())
			if more <= 0 {
				return fmt.Errorf("none within %s", deadLetterTimeout)
			}
			timeout.Reset(more)
		}
	}
}

// confirmWait is how much longer a copy's confirm is waited for, at a timeout of the wait: on
// while the connection is blocked, and until deadLetterTimeout after it was unblocked.
func confirmWait(blocked bool, unblockedAt, now time.Time) time.Duration {
	if blocked {
		return deadLetterTimeout
	}
	return deadLetterTimeout - now.Sub(unblockedAt)
}

// discard drops the channel; it is closed in the background, since closing waits for the
// broker's answer, and a broker that stopped answering must not hold the worker.
func (p *deadLetterPublisher) discard() {
	if p.ch != nil {
		go func(ch *amqp.Channel) { _ = ch.Close() }(p.ch)
		p.ch = nil
	}
}

// close closes the connection for good, if one was dialled: a publish that waits on it, even on
// a blocked broker, whose calls have no deadline of their own, fails then.
func (p *deadLetterPublisher) close() {
	p.connMu.Lock()
	conn := p.conn
	p.over, p.conn = true, nil
	p.connMu.Unlock()
	if conn != nil {
		_ = conn.CloseDeadline(time.Now().Add(time.Second))
	}
}
