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

// DeadLetter is one message waiting in a dead-letter queue.
type DeadLetter struct {
	MessageID string
	Type      string
	// Reason says why: the consumer's reason header, or, for a message the broker dead-lettered
	// itself (at the queue's delivery limit), the broker's reason from x-death.
	Reason         string
	DeadLetteredAt time.Time // zero when unknown
	ContentType    string
	Headers        amqp.Table // all of them, those of the dead-lettering too
	Body           []byte
}

// DeadLetterConfig names a consumer queue whose dead-letter queue ([DeadLetterQueue]) is to be
// listed or redriven.
type DeadLetterConfig struct {
	URL            string // RabbitMQ URL, vhost included
	Queue          string // the consumer queue, e.g. "invoicing"
	ConnectionName string // shown by the broker
}

// ErrDeadLetterNotFound is returned by [RedriveDeadLetters] and [DropDeadLetter] when no
// message matched.
var ErrDeadLetterNotFound = errors.New("no such message in the dead-letter queue")

// ErrRedriveInDoubt is wrapped by the error of [RedriveDeadLetters] when the message it was
// moving may be in both queues: its copy was published but no confirm came (none within 15 s,
// or within 5 s of an interrupt; a lost connection), or the broker confirmed it and its
// acknowledgement in the dead-letter queue failed or went unanswered (an acknowledgement has
// none of its own: the answer to the next method on its channel says the broker took it). It is
// the first of the picked messages not among those moved.
var ErrRedriveInDoubt = errors.New("the message may be in both queues")

// ErrDropInDoubt is wrapped by the error of [DropDeadLetter] when the message's acknowledgement
// was sent but the broker's answer after it never came: the message may be gone. The message is
// returned with it, the last record of it.
var ErrDropInDoubt = errors.New("the message may have been dropped")

// The headers that record a dead-lettering: the broker's and the consumer's. A redriven message
// goes without them, so that it is handled like any other.
var deadLetterHeaders = []string{
	"x-death", "x-first-death-queue", "x-first-death-reason", "x-first-death-exchange",
	"x-last-death-queue", "x-last-death-reason", "x-last-death-exchange", deliveryCountHeader, acquiredCountHeader,
	HeaderDeadLetterReason, HeaderDeadLetteredAt, HeaderOriginalExchange, HeaderOriginalRoutingKey,
}

// ListDeadLetters returns the first limit messages of the dead-letter queue (all, if limit is
// 0), in queue order, and how many were waiting when it started. It leaves them all there.
// AMQP cannot peek: it takes the messages without acknowledging them, never more than limit at
// once, then hands each back, in the order it came. The dead-letter queue has no delivery limit
// (see [ConsumerTopology.DeadLetterArguments]), so listing costs the messages nothing.
// Messages another client holds unacknowledged at the time are not listed.
//
// A listing of the whole queue leaves it in its order. One of fewer messages than wait may
// move them back in the queue: a quorum queue may put the messages handed back behind the
// others (seen on RabbitMQ 3.10 and 4.x alike).
func ListDeadLetters(ctx context.Context, cfg DeadLetterConfig, limit int) (listed []DeadLetter, waiting int, err error) {
	return ListDeadLettersWith(ctx, cfg, DeadLetterSelection{Limit: limit})
}

// ListDeadLettersWith is [ListDeadLetters] for a selection: it looks at the first sel.Limit
// messages (all, if 0), calls sel.BeforeTake and sel.Taken as [RedriveDeadLetters] does (a
// caller's brake on a queue too long to hold, and how many it took), and returns those of them
// sel.Match picks (all, if nil), in queue order, and how many were waiting when it started;
// sel.Confirm, unless nil, sees them first, and an error from it is returned. It leaves them all
// there, as ListDeadLetters does.
func ListDeadLettersWith(ctx context.Context, cfg DeadLetterConfig, sel DeadLetterSelection) (listed []DeadLetter, waiting int, err error) {
	err = withDeadLetterQueue(ctx, cfg, 0, func(ch *amqp.Channel, dlq string, ready int) error {
		waiting = ready
		held, picked, err := sel.pick(ctx, ch, dlq, ready)
		defer handBack(ch, dlq, held)
		for _, i := range picked {
			listed = append(listed, readDeadLetter(held[i]))
		}
		return err
	})
	return listed, waiting, err
}

// window is how many of the waiting messages an operation takes, given its limit (0: all).
func window(waiting, limit int) int {
	if limit > 0 {
		return min(waiting, limit)
	}
	return waiting
}

// DeadLetterSelection says which messages of a dead-letter queue [RedriveDeadLetters] and
// [DropDeadLetter] act on, and lets their caller see those before anything is done to them.
type DeadLetterSelection struct {
	// Limit makes it look at the first Limit messages that wait, no more, and hold no more
	// unacknowledged at once; 0 looks at all of them. A limit that leaves some behind may move
	// those it looked at back in the queue (see [ListDeadLetters]).
	Limit int
	// BeforeTake, unless nil, is called with how many messages wait before any is taken: an
	// error from it takes none, and is returned. It is a caller's brake on a queue too long to
	// hold: each message taken is held in memory until the operation ends.
	BeforeTake func(waiting int) error
	// Taken, unless nil, is called with how many messages were taken, once they are held and
	// before Match sees them: no more than Limit, nor than waited; fewer when the queue ran
	// short, as when another client took some since they were counted.
	Taken func(n int)
	// Match picks, of those, the messages to act on; nil picks them all.
	Match func(DeadLetter) bool
	// Confirm, unless nil, is called with the messages picked, in queue order, and how many
	// waited in the queue, while they are held and before anything is done to them: an error
	// from it does nothing, hands them all back in order, and is returned. It is not called
	// when nothing was picked.
	Confirm func(picked []DeadLetter, waiting int) error
}

// pick holds the messages sel looks at, and returns them with the indexes of those it picks,
// confirmed. The held messages are for the caller to hand back.
func (sel DeadLetterSelection) pick(ctx context.Context, ch *amqp.Channel, dlq string, waiting int) (held []amqp.Delivery, picked []int, err error) {
	if sel.BeforeTake != nil {
		if err := sel.BeforeTake(waiting); err != nil {
			return nil, nil, err
		}
	}
	held, err = take(ctx, ch, dlq, window(waiting, sel.Limit))
	if err != nil {
		return held, nil, err
	}
	if sel.Taken != nil {
		sel.Taken(len(held))
	}
	var shown []DeadLetter
	for i, d := range held {
		if dl := readDeadLetter(d); sel.Match == nil || sel.Match(dl) {
			picked, shown = append(picked, i), append(shown, dl)
		}
	}
	if len(picked) > 0 && sel.Confirm != nil {
		if err := sel.Confirm(shown, waiting); err != nil {
			return held, nil, err
		}
	}
	return held, picked, nil
}

// RedriveDeadLetters moves the messages sel picks from the dead-letter queue back to the
// consumer queue, through the default exchange, with their properties and message ids
// unchanged (so the inbox still recognises one already handled) and without the headers of
// their dead-lettering. Each is acknowledged in the dead-letter queue only once the broker
// confirmed and routed its copy: a failure leaves it there, and at worst (a crash in between)
// it is in both queues, which the inbox tells apart. The others it looked at are handed back in
// their order. It returns the moved messages; [ErrDeadLetterNotFound] if sel.Match was given
// and picked none. An error after some moved leaves them moved; one that wraps
// [ErrRedriveInDoubt] says the next picked may be in both queues. Cancelling ctx stops it
// before the next message is published; the confirm of one published already is waited for,
// so that an interrupt leaves that message moved, not in doubt, but for 5 s at most once ctx
// has ended, nor 15 s in all: a confirm that does not come by then leaves that message in
// doubt, and the others held are handed back in their order all the same. A connection the
// broker blocks for a resource alarm is closed after 5 s of it: the message under way is then
// in doubt, and the broker takes back the others it held, in an order of its own.
func RedriveDeadLetters(ctx context.Context, cfg DeadLetterConfig, sel DeadLetterSelection) ([]DeadLetter, error) {
	var moved []DeadLetter
	err := withDeadLetterQueue(ctx, cfg, redriveConfirmGrace, func(ch *amqp.Channel, dlq string, waiting int) error {
		// The queue must exist: publishing to a missing one would only come back unroutable.
		if _, err := ch.QueueDeclarePassive(cfg.Queue, true, false, false, false, nil); err != nil {
			return fmt.Errorf("queue %q: %w", cfg.Queue, err)
		}
		if err := ch.Confirm(false); err != nil {
			return fmt.Errorf("enable publisher confirms: %w", err)
		}
		returns := ch.NotifyReturn(make(chan amqp.Return, 1))
		held, picked, err := sel.pick(ctx, ch, dlq, waiting)
		kept := held
		defer func() { handBack(ch, dlq, kept) }()
		if err != nil {
			return err
		}
		if sel.Match != nil && len(picked) == 0 {
			return ErrDeadLetterNotFound
		}
		kept = nil
		next := 0 // of picked
		for i, d := range held {
			if next == len(picked) || picked[next] != i {
				kept = append(kept, d)
				continue
			}
			next++
			dl := readDeadLetter(d)
			if err := redrive(ctx, ch, returns, cfg.Queue, d); err != nil {
				kept = append(kept, held[i:]...)
				return fmt.Errorf("redrive message %s: %w", dl.MessageID, err)
			}
			// Taken before the next copy goes, so that a failure leaves one message in doubt.
			if err := d.Ack(false); err != nil {
				return fmt.Errorf("message %s is in %q now, but could not be removed from %q (the inbox recognises the second copy): %w: %w",
					dl.MessageID, cfg.Queue, dlq, ErrRedriveInDoubt, err)
			}
			if err := acknowledged(ch, dlq); err != nil {
				return fmt.Errorf("message %s is in %q now, but the broker did not answer after its acknowledgement in %q (the inbox recognises a second copy): %w: %w",
					dl.MessageID, cfg.Queue, dlq, ErrRedriveInDoubt, err)
			}
			moved = append(moved, dl)
		}
		return nil
	})
	return moved, err
}

// acknowledged asks the broker a question on ch: an acknowledgement has no answer, but the
// broker answers a channel's methods in order, so an answer says those sent before were taken.
func acknowledged(ch *amqp.Channel, queue string) error {
	_, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	return err
}

// DropDeadLetter removes from the dead-letter queue the first message sel.Match picks (it must
// be given), for good, and hands the others it looked at back in their order; sel.Confirm sees
// that one message. Give it no limit unless the queue is too long to hold: a limit that leaves
// messages behind may move those it looked at back in the queue. It returns the message it
// removed, or [ErrDeadLetterNotFound]; the message with an error wrapping [ErrDropInDoubt] when
// it may have been removed.
func DropDeadLetter(ctx context.Context, cfg DeadLetterConfig, sel DeadLetterSelection) (DeadLetter, error) {
	if sel.Match == nil {
		return DeadLetter{}, errors.New("drop a dead letter: no match given")
	}
	found := false
	match := sel.Match
	sel.Match = func(d DeadLetter) bool { // the first only
		if found || !match(d) {
			return false
		}
		found = true
		return true
	}
	var dropped DeadLetter
	err := withDeadLetterQueue(ctx, cfg, 0, func(ch *amqp.Channel, dlq string, waiting int) error {
		held, picked, err := sel.pick(ctx, ch, dlq, waiting)
		kept := held
		defer func() { handBack(ch, dlq, kept) }()
		if err != nil {
			return err
		}
		if len(picked) == 0 {
			return ErrDeadLetterNotFound
		}
		d := held[picked[0]]
		if err := d.Ack(false); err != nil {
			return fmt.Errorf("acknowledge message %s: %w", d.MessageId, err)
		}
		kept = slices.Delete(slices.Clone(held), picked[0], picked[0]+1)
		dropped = readDeadLetter(d) // from here on it may be gone: the caller keeps its record
		if err := acknowledged(ch, dlq); err != nil {
			return fmt.Errorf("message %s was acknowledged, but the broker did not answer after it (list %q to see whether it is gone): %w: %w",
				d.MessageId, dlq, ErrDropInDoubt, err)
		}
		return nil
	})
	return dropped, err
}

// withDeadLetterQueue connects, checks that the dead-letter queue exists, and runs fn with a
// channel, the queue's name, and how many messages wait in it now. Once ctx has ended, fn may
// go on for settle with what it has under way (a redrive's confirm), then hand back what it
// holds.
func withDeadLetterQueue(ctx context.Context, cfg DeadLetterConfig, settle time.Duration, fn func(ch *amqp.Channel, dlq string, waiting int) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	conn, err := dial(ctx, cfg.URL, cfg.ConnectionName, 0)
	if err != nil {
		return err
	}
	defer func() { _ = conn.CloseDeadline(time.Now().Add(time.Second)) }()
	// An interrupt ends the operation, which then settles what it has under way and hands
	// back what it holds, in order. The connection is closed only if that takes longer than it
	// may (a broker that does not answer, or tens of thousands of messages held): the broker
	// then takes back whatever is still held, in an order of its own.
	done := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		select {
		case <-time.After(settle + handBackWait + time.Second):
			_ = conn.CloseDeadline(time.Now())
		case <-done:
		}
	})
	defer func() { close(done); stop() }()
	blocked := closeWhileBlocked(conn, done)
	err = withChannel(conn, cfg, fn)
	if reason := blocked(); reason != "" && err != nil {
		return fmt.Errorf("%w (the broker blocked the connection for a resource alarm, %s: it takes no publishes until the alarm clears)", err, reason)
	}
	return err
}

// blockedWait is how long a dead-letter operation waits for the broker to unblock its
// connection before it closes it.
const blockedWait = 5 * time.Second

// closeWhileBlocked closes conn once the broker has blocked it (a memory or disk alarm, met
// at a publish) for blockedWait, until done: the broker then reads nothing more from it, and an
// acknowledgement, a hand-back or the question after them would wait for the alarm to clear,
// however long that takes. It returns what tells the block's reason, once it closed conn
// for it ("" if it did not).
func closeWhileBlocked(conn *amqp.Connection, done <-chan struct{}) (reason func() string) {
	watch := watchConnection(conn, slog.New(slog.DiscardHandler), slog.LevelDebug)
	var mu sync.Mutex
	var why string
	go func() {
		for {
			select {
			case <-watch.blockedC():
			case <-done:
				return
			}
			// A block that clears and comes back starts its wait again.
			r, since := watch.block()
			if r == "" {
				continue
			}
			select {
			case <-time.After(time.Until(since.Add(blockedWait))):
			case <-done:
				return
			}
			if now, again := watch.block(); now != "" && again.Equal(since) {
				mu.Lock()
				why = now
				mu.Unlock()
				_ = conn.CloseDeadline(time.Now())
				return
			}
		}
	}()
	return func() string {
		mu.Lock()
		defer mu.Unlock()
		return why
	}
}

// withChannel opens a channel on conn, checks that the dead-letter queue of cfg.Queue exists,
// and runs fn with it.
func withChannel(conn *amqp.Connection, cfg DeadLetterConfig, fn func(ch *amqp.Channel, dlq string, waiting int) error) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	dlq := DeadLetterQueue(cfg.Queue)
	q, err := ch.QueueDeclarePassive(dlq, true, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("dead-letter queue %q: %w", dlq, err)
	}
	return fn(ch, dlq, q.Messages)
}

// take gets up to n messages from queue without acknowledging them: of those that waited when
// it was counted, not those that came after.
func take(ctx context.Context, ch *amqp.Channel, queue string, n int) ([]amqp.Delivery, error) {
	held := make([]amqp.Delivery, 0, n)
	for len(held) < n {
		if err := ctx.Err(); err != nil {
			return held, err
		}
		d, ok, err := ch.Get(queue, false)
		if err != nil {
			return held, fmt.Errorf("get from %q: %w", queue, err)
		}
		if !ok {
			break
		}
		held = append(held, d)
	}
	return held, nil
}

// handBackWait bounds how long handBack waits for the broker to count a chunk of messages again.
const handBackWait = 5 * time.Second

// handBackChunk is how many messages handBack returns at once. A quorum queue puts the messages
// of a larger return back in an order of its own: returned one by one or together, 200 came
// back in order up to the 33rd and shuffled after it, on RabbitMQ 3.10.8, 4.0.5 and 4.3.6
// alike; in returns of 32, each counted back before the next, they kept their order.
const handBackChunk = 32

// handBack returns the held messages to queue in the order they came, handBackChunk at a time,
// each chunk counted as waiting again before the next goes: a quorum queue applies the returns
// after it answered (on RabbitMQ 3.10, a count read right after always fell short), and a
// listing started then would miss them. If the channel is gone, the broker took them back
// already.
func handBack(ch *amqp.Channel, queue string, held []amqp.Delivery) {
	if len(held) == 0 {
		return
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return
	}
	waiting := q.Messages
	for chunk := range slices.Chunk(held, handBackChunk) {
		for _, d := range chunk {
			if err := d.Nack(false, true); err != nil {
				return
			}
		}
		waiting += len(chunk)
		if !countedBack(ch, queue, waiting, time.Now().Add(handBackWait)) {
			return
		}
	}
}

// countedBack waits until queue counts at least waiting messages, or deadline.
func countedBack(ch *amqp.Channel, queue string, waiting int, deadline time.Time) bool {
	for ; time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			return false
		}
		if q.Messages >= waiting {
			return true
		}
	}
	return false
}

// redriveConfirmGrace is how long a redrive, once its context has ended, still waits for the
// confirm of the copy it published already. A broker that answers confirms within
// milliseconds; one that does not confirm by then leaves the message in doubt, and the
// messages held are handed back, in order, before the connection is closed.
const redriveConfirmGrace = 5 * time.Second

// redrive publishes d to queue through the default exchange, unless ctx has ended, and waits
// for the broker to confirm it and route it. Once published, the copy's confirm is waited for
// even if ctx ends meanwhile, for redriveConfirmGrace more: given up, it would leave the
// message in both queues, where the confirm, which comes within milliseconds of a broker that
// answers, settles where it is.
func redrive(ctx context.Context, ch *amqp.Channel, returns <-chan amqp.Return, queue string, d amqp.Delivery) error {
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, redriveCopy(d))
	if err != nil {
		return fmt.Errorf("publish to %q: %w", queue, err)
	}
	waitCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), deadLetterTimeout)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(redriveConfirmGrace, cancel) })
	defer stop()
	acked, err := dc.WaitContext(waitCtx)
	switch {
	case err != nil:
		return fmt.Errorf("published, but no confirm from the broker: %w: %w", ErrRedriveInDoubt, err)
	case !acked && ch.IsClosed():
		// The channel closed under the copy (a lost connection): the broker may have routed it.
		return fmt.Errorf("published, but the channel closed before the broker confirmed it: %w", ErrRedriveInDoubt)
	case !acked:
		return fmt.Errorf("the broker nacked it")
	}
	if r, ok := returnedNow(returns); ok {
		return fmt.Errorf("unroutable: %d %s", r.ReplyCode, r.ReplyText)
	}
	return nil
}

// redriveCopy is d as it was first delivered: the same body, properties and message id, and
// none of the headers its dead-lettering added, nor routing headers (CC), which would send it to
// other queues than its own.
func redriveCopy(d amqp.Delivery) amqp.Publishing {
	headers := make(amqp.Table, len(d.Headers))
	for k, v := range d.Headers {
		headers[k] = v
	}
	for _, k := range slices.Concat(deadLetterHeaders, routingHeaders) {
		delete(headers, k)
	}
	return amqp.Publishing{
		Headers:         headers,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    d.DeliveryMode,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		Expiration:      d.Expiration,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

// readDeadLetter reads what a dead-lettered delivery says about itself.
func readDeadLetter(d amqp.Delivery) DeadLetter {
	dl := DeadLetter{MessageID: d.MessageId, Type: d.Type, ContentType: d.ContentType, Headers: d.Headers, Body: d.Body}
	if reason, ok := d.Headers[HeaderDeadLetterReason].(string); ok {
		dl.Reason = reason
		if at, ok := d.Headers[HeaderDeadLetteredAt].(string); ok {
			dl.DeadLetteredAt, _ = time.Parse(time.RFC3339Nano, at)
		}
		return dl
	}
	// Dead-lettered by the broker: the most recent x-death entry comes first.
	if deaths, ok := d.Headers["x-death"].([]any); ok && len(deaths) > 0 {
		if death, ok := deaths[0].(amqp.Table); ok {
			reason, _ := death["reason"].(string)
			queue, _ := death["queue"].(string)
			dl.Reason = fmt.Sprintf("%s: dead-lettered by the broker from queue %s (x-death count %v)", reason, queue, death["count"])
			dl.DeadLetteredAt, _ = death["time"].(time.Time)
			return dl
		}
	}
	dl.Reason = "unknown: no reason header and no x-death"
	return dl
}
