package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
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
	HeaderDeadLetteredAt     = "x-outbox-dead-lettered-at"     // when, RFC 3339 in UTC, to the nanosecond
	HeaderOriginalExchange   = "x-outbox-original-exchange"    // where the message was published
	HeaderOriginalRoutingKey = "x-outbox-original-routing-key" // and with which routing key
	// HeaderOriginalHeadersDropped is true on a copy that leaves the message's own headers out:
	// with the headers above they would not fit in a frame, less the room the dead-letter queue
	// takes at delivery, and a connection would be closed on every try. Its body, properties and
	// message id are kept.
	HeaderOriginalHeadersDropped = "x-outbox-original-headers-dropped"
)

// deliveryCountHeader is where a quorum queue says how often it delivered a message before.
const deliveryCountHeader = "x-delivery-count"

// acquiredCountHeader is where a quorum queue from RabbitMQ 4.3 on says how often it delivered a
// message before, failed or not.
const acquiredCountHeader = "x-acquired-count"

// deadLetteredAtLayout is how a copy says when it was dead-lettered: RFC 3339 with all nine
// digits of the nanoseconds, not RFC3339Nano, which drops trailing zeros. The copy's size would
// change with the clock, and a copy near its limit kept or dropped its headers from one try of
// the same delivery to the next.
const deadLetteredAtLayout = "2006-01-02T15:04:05.000000000Z07:00"

// deadLetterQueueHeadroom is the part of a frame a dead-letter copy's properties leave free for
// what the dead-letter queue adds to it: x-delivery-count and, from RabbitMQ 4.3 on,
// x-acquired-count at each delivery (26 bytes each), and an operator's message interceptors'
// timestamp_in_ms and x-routed-by when the copy is published (at most 297); 512 keeps some 160
// bytes over that. Less than brokerHeadroom, which also keeps room for the headers the broker
// adds when it dead-letters a message itself: nothing dead-letters a message out of the
// dead-letter queue (it has no dead-letter target, and no delivery limit in practice: see
// [ConsumerTopology.DeadLetterArguments]), and a redrive takes the x-outbox-* headers off again,
// so the message goes back no larger than it came. A message the library published, held to
// brokerHeadroom, keeps its headers in its copy, with a reason of maxReasonBytes and an exchange
// and routing key of 255 bytes (1,698 bytes at most, beside the 297 interceptors may have added).
const deadLetterQueueHeadroom = 512

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
//
// A copy whose properties would not fit in one frame of frameSize bytes (0 or less: no limit)
// less deadLetterQueueHeadroom leaves all of d's headers out, and says so (dropped): d's
// headers can fill that much by themselves (another publisher's, not held to brokerHeadroom),
// and the reason and the rest added to them would take the copy past it. Past the frame the
// broker closes the connection, on every try, for as long as the worker tries; past the
// headroom the client closes it at every basic.get of the copy, which the dead-letter queue
// counts, and a listing or redrive stops at it.
func deadLetterCopy(d amqp.Delivery, reason error, at time.Time, frameSize int) (copied amqp.Publishing, dropped bool) {
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
	added := amqp.Table{
		HeaderDeadLetterReason:   why,
		HeaderDeadLetteredAt:     at.UTC().Format(deadLetteredAtLayout),
		HeaderOriginalExchange:   d.Exchange,
		HeaderOriginalRoutingKey: d.RoutingKey,
	}
	maps.Copy(headers, added)
	copied = amqp.Publishing{
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
	if frameSize <= 0 || contentHeaderSize(copied) <= frameSize-deadLetterQueueHeadroom {
		return copied, false
	}
	// What is left takes under 3.6 KB (its properties are short strings, the reason is cut to a
	// kilobyte): with the two delivery counts the dead-letter queue adds (nothing dead-letters
	// a message from it), it fits in AMQP's smallest frame, 4,096 bytes.
	added[HeaderOriginalHeadersDropped] = true
	copied.Headers = added
	return copied, true
}

// contentHeaderSize is the size of the content header frame that carries p's properties, as
// the client writes it: its frame header and end (8 bytes); class, weight, body size and
// property flags (14); each property that is set: a short string with its length byte, the
// headers' table, delivery mode and priority (1 byte each), timestamp (8). Not checkEnvelope's
// estimate, made for what toPublishing writes: a delivery may carry any property, and header
// values of any type.
func contentHeaderSize(p amqp.Publishing) int {
	size := 8 + 14
	for _, s := range []string{p.ContentType, p.ContentEncoding, p.CorrelationId, p.ReplyTo, p.Expiration,
		p.MessageId, p.Type, p.UserId, p.AppId} {
		if s != "" {
			size += 1 + len(s)
		}
	}
	if len(p.Headers) > 0 {
		size += tableSize(p.Headers)
	}
	if p.DeliveryMode > 0 {
		size++
	}
	if p.Priority > 0 {
		size++
	}
	if !p.Timestamp.IsZero() {
		size += 8
	}
	return size
}

// tableSize is the size of t as AMQP encodes it: a long string of its names and values.
func tableSize(t amqp.Table) int {
	size := 4
	for k, v := range t {
		size += 1 + len(k) + fieldSize(v)
	}
	return size
}

// fieldSize is the size of v as AMQP encodes it in a table, its type byte included, for each
// type the client decodes a field to, and writes.
func fieldSize(v any) int {
	switch v := v.(type) {
	case nil:
		return 1
	case bool, byte, int8:
		return 2
	case int16, uint16:
		return 3
	case int, int32, uint32, float32:
		return 5
	case amqp.Decimal:
		return 6
	case int64, float64, time.Time:
		return 9
	case string:
		return 5 + len(v)
	case []byte:
		return 5 + len(v)
	case []any:
		size := 5
		for _, e := range v {
			size += fieldSize(e)
		}
		return size
	case amqp.Table:
		return 1 + tableSize(v)
	}
	// The client refuses to write any other type: the publish fails before anything is sent.
	return 0
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
	// frameSize is the one ch's connection negotiated, which a copy's properties must fit in.
	frameSize int

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
// comes back unroutable has the dead-letter queue declared again, for the next try. A copy that
// leaves d's headers out is logged once per delivery: said records it, for the worker's next
// try of the same d.
func (p *deadLetterPublisher) publish(ctx context.Context, d amqp.Delivery, reason error, said *bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := p.open(ctx); err != nil {
		return err
	}
	copied, dropped := deadLetterCopy(d, reason, time.Now(), p.frameSize)
	if dropped && !*said {
		*said = true
		p.log.WarnContext(ctx, "dead-letter copy leaves the message's headers out: with the reason they would fill the frame",
			"message_id", truncate(d.MessageId), "headers", len(d.Headers), "frame_size", p.frameSize)
	}
	err := p.confirm(ctx, copied)
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
	p.ch, p.returns, p.frameSize = ch, ch.NotifyReturn(make(chan amqp.Return, 1)), conn.Config.FrameSize
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
