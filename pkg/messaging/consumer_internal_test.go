package messaging

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	amqp "github.com/rabbitmq/amqp091-go"
)

// A message of a type this replica has no handler for goes back to the queue at once, on every
// broker's way of counting its deliveries, and is dead-lettered at its last allowed delivery;
// only a queue that does not count (a redelivery without either header) dead-letters it early,
// which would otherwise give it back for ever. The headers are those each broker sets, as read
// off RabbitMQ 3.10.8 and 4.3.6: 4.3 leaves x-delivery-count out at first, and after nacks
// until the first reject or lost channel.
func TestATypeWithoutAHandlerGoesBackUntilItsLastDelivery(t *testing.T) {
	c := &consumer{cfg: consumerConfig{DeliveryLimit: 20}}
	noHandler := fmt.Errorf("%w %q", errNoHandler, "Refunded")
	wantSettled(t, func(d amqp.Delivery) outcome { return c.undecodable(d, noHandler) }, []settleCase{
		{"first delivery", amqp.Delivery{}, settleElsewhere, ""},
		{"3.10, redelivered", amqp.Delivery{Redelivered: true, Headers: amqp.Table{"x-delivery-count": int64(3)}}, settleElsewhere, ""},
		{"4.3, redelivered after a nack", amqp.Delivery{Redelivered: true, Headers: amqp.Table{"x-acquired-count": int64(1)}}, settleElsewhere, ""},
		{"last delivery", amqp.Delivery{Redelivered: true, Headers: amqp.Table{"x-delivery-count": int64(19), "x-acquired-count": int64(19)}}, settleDeadLetter, "on each of 20 deliveries"},
		{"a queue that does not count", amqp.Delivery{Redelivered: true}, settleDeadLetter, "does not count deliveries"},
	})
	if o := c.undecodable(amqp.Delivery{}, Permanent(fmt.Errorf("invalid"))); o.settle != settleDeadLetter {
		t.Errorf("an invalid payload settled as %d, want dead-lettered at once", o.settle)
	}
}

// A message whose handler fails on every try is dead-lettered at its last delivery, and on a
// queue that does not count deliveries (a classic queue a deployment declared) at its first
// redelivery, as one of a type without a handler is: rejected there, it came back for ever.
func TestAFailingMessageIsDeadLetteredWhereItsQueueGivesItNoMoreDeliveries(t *testing.T) {
	c := &consumer{cfg: consumerConfig{DeliveryLimit: 20, Retries: 1, HandlerTimeout: time.Second}, log: slog.New(slog.DiscardHandler),
		work: work{process: func(context.Context, []job, func()) error { return errors.New("no such customer") }}}
	wantSettled(t, func(d amqp.Delivery) outcome {
		return c.process(context.Background(), context.Background(), job{d: d}, false)
	}, []settleCase{
		{"first delivery", amqp.Delivery{}, settleReject, ""},
		{"counted, not the last", amqp.Delivery{Redelivered: true, Headers: amqp.Table{"x-delivery-count": int64(3)}}, settleReject, ""},
		{"the last", amqp.Delivery{Redelivered: true, Headers: amqp.Table{"x-delivery-count": int64(19)}}, settleDeadLetter, "on each of 20 deliveries"},
		{"a queue that does not count", amqp.Delivery{Redelivered: true}, settleDeadLetter, "does not count deliveries"},
	})
}

// The delivery count is read whatever integer type carries it: a shovel or a plugin that sets
// x-delivery-count again may send any, which the client decodes each to its own Go type. Only
// int64, int32 and int were read, and every other count as 0: such a message never reached its
// last-delivery check. A negative count is 0; one past int saturates, not wrapping below the
// limit.
func TestTheDeliveryCountIsReadFromEveryIntegerType(t *testing.T) {
	c := &consumer{cfg: consumerConfig{DeliveryLimit: 20}}
	for _, tc := range []struct {
		count any
		want  int
	}{
		{int(19), 19}, {int8(19), 19}, {int16(19), 19}, {int32(19), 19}, {int64(19), 19},
		{uint(19), 19}, {uint8(19), 19}, {uint16(19), 19}, {uint32(19), 19}, {uint64(19), 19},
		{int8(-1), 0}, {int64(math.MinInt64), 0}, {int(-19), 0},
		{uint64(math.MaxUint64), math.MaxInt}, {uint32(math.MaxUint32), int(min(math.MaxUint32, uint64(math.MaxInt)))},
		{nil, 0}, {"19", 0}, {float64(19), 0},
	} {
		d := amqp.Delivery{Redelivered: true, Headers: amqp.Table{deliveryCountHeader: tc.count}}
		if got := deliveryCount(d); got != tc.want {
			t.Errorf("x-delivery-count %v (%T) read as %d, want %d", tc.count, tc.count, got, tc.want)
		}
		if last, _ := c.lastDelivery(d); last != (tc.want >= 19) {
			t.Errorf("x-delivery-count %v (%T): last delivery of 20 %v, want %v", tc.count, tc.count, last, tc.want >= 19)
		}
	}
}

// A failing message's tries on one delivery wait their backoff between them, and each wait is
// logged with retry_in: tried again at once, a failure that lasts a moment (a lock, a row not
// there yet) spent every try of the delivery in that moment.
func TestInPlaceRetriesWaitTheirBackoff(t *testing.T) {
	var logs bytes.Buffer
	var tries []time.Time
	backoff := Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond, Jitter: 0.01}
	c := &consumer{cfg: consumerConfig{DeliveryLimit: 20, Retries: 3, RetryBackoff: backoff, HandlerTimeout: time.Second, Propagator: propagatorOr(nil)},
		log: slog.New(slog.NewTextHandler(&logs, nil)),
		work: work{
			decode: func(Message) (any, error) { return nil, nil },
			process: func(context.Context, []job, func()) error {
				tries = append(tries, time.Now())
				return errors.New("no such customer yet")
			}}}
	o := c.process(context.Background(), context.Background(), job{msg: Message{ID: uuid.New(), Type: "Placed"}}, false)
	if o.settle != settleReject || len(tries) != 3 {
		t.Fatalf("settled as %d after %d tries, want rejected after 3", o.settle, len(tries))
	}
	for i, gap := range []time.Duration{tries[1].Sub(tries[0]), tries[2].Sub(tries[1])} {
		least := time.Duration(float64(backoff.ceiling(i+1)) * (1 - backoff.Jitter))
		if gap < least {
			t.Errorf("try %d came %s after the one before, want at least the backoff's %s", i+2, gap, least)
		}
	}
	if n := strings.Count(logs.String(), "handler failed; retrying message"); n != 2 || strings.Count(logs.String(), "retry_in=") != 2 {
		t.Errorf("want 2 lines of a retry, each with retry_in: %s", logs.String())
	}
}

// settleCase is a delivery, and how it must be settled: want, for a reason holding because.
type settleCase struct {
	name    string
	d       amqp.Delivery
	want    settleKind
	because string
}

func wantSettled(t *testing.T, decide func(amqp.Delivery) outcome, cases []settleCase) {
	t.Helper()
	for _, tc := range cases {
		o := decide(tc.d)
		if o.settle != tc.want || (tc.because != "" && !strings.Contains(o.reason.Error(), tc.because)) {
			t.Errorf("%s: settled as %d (%v), want %d (%q)", tc.name, o.settle, o.reason, tc.want, tc.because)
		}
	}
}

// settlements records how each delivery was settled, in order: the consumer's own decision,
// without a broker in between.
type settlements []settled

// settled is one basic.ack, basic.nack or basic.reject: of the delivery tag, and with
// multiple, of every unsettled delivery before it on the channel too.
type settled struct {
	op       string
	tag      uint64
	multiple bool
}

func (s *settlements) Ack(tag uint64, multiple bool) error {
	*s = append(*s, settled{"ack", tag, multiple})
	return nil
}

func (s *settlements) Nack(tag uint64, multiple, _ bool) error {
	*s = append(*s, settled{"nack", tag, multiple})
	return nil
}

func (s *settlements) Reject(tag uint64, _ bool) error {
	*s = append(*s, settled{"reject", tag, false})
	return nil
}

// deliveriesOf are deliveries of messages of types, tagged from 1 on, settled into acks.
func deliveriesOf(acks *settlements, types ...string) []amqp.Delivery {
	ds := make([]amqp.Delivery, len(types))
	for i, typ := range types {
		ds[i] = amqp.Delivery{Acknowledger: acks, DeliveryTag: uint64(i + 1), MessageId: uuid.NewString(), Type: typ, Body: []byte(`{}`)}
	}
	return ds
}

// batchConsumer is a consumer of w, without a broker: it settles what it is handed.
func batchConsumer(w work, retries int) *consumer {
	return &consumer{cfg: consumerConfig{Queue: "q", BatchSize: 10, Retries: retries, DeliveryLimit: 20, HandlerTimeout: time.Second,
		RetryBackoff: Backoff{Base: time.Millisecond, Max: time.Millisecond}, Propagator: propagatorOr(nil)},
		log: slog.New(slog.DiscardHandler), work: w}
}

// decodeAllBut decodes every message but those of type missing, which has no handler here.
func decodeAllBut(missing string) func(Message) (any, error) {
	return func(msg Message) (any, error) {
		if msg.Type == missing {
			return nil, fmt.Errorf("%w %q", errNoHandler, msg.Type)
		}
		return struct{}{}, nil
	}
}

// A delivery of a batch that did not decode is settled before the batch's ack: that ack covers
// every delivery up to the batch's last on the channel (multiple), and would take the one
// settled after it for handled, acknowledging, and losing, a message no handler ran for.
func TestAnUndecodableDeliveryIsSettledBeforeItsBatchIsAcked(t *testing.T) {
	t.Parallel()
	var got settlements
	c := batchConsumer(work{decode: decodeAllBut("Refunded"), process: func(context.Context, []job, func()) error { return nil }}, 1)
	ctx := context.Background()
	c.handle(ctx, ctx, deliveriesOf(&got, "Placed", "Refunded", "Placed"))
	want := settlements{{"reject", 2, false}, {"ack", 3, true}}
	if !slices.Equal(got, want) {
		t.Fatalf("settled %+v, want %+v: the message without a handler back to the queue, then the batch acked", got, want)
	}
}

// A batch that fails costs its messages no tries: each is then tried alone with all its
// Retries, and acked alone (not multiple: the others may still be in hand). Counted against
// them, a bad batch would reject good messages at their first failure alone, spending a
// delivery, or dead-lettering them at their last.
func TestAFailedBatchCostsItsMessagesNoTries(t *testing.T) {
	t.Parallel()
	var got settlements
	triedAlone := map[uuid.UUID]bool{}
	c := batchConsumer(work{decode: decodeAllBut(""), process: func(_ context.Context, jobs []job, _ func()) error {
		if len(jobs) > 1 {
			return errors.New("batch handler failed")
		}
		if !triedAlone[jobs[0].msg.ID] { // a moment's failure, which a second try gets past
			triedAlone[jobs[0].msg.ID] = true
			return errors.New("row locked")
		}
		return nil
	}}, 2)
	ctx := context.Background()
	c.handle(ctx, ctx, deliveriesOf(&got, "Placed", "Placed", "Placed"))
	want := settlements{{"ack", 1, false}, {"ack", 2, false}, {"ack", 3, false}}
	if !slices.Equal(got, want) {
		t.Fatalf("settled %+v, want %+v: each acked alone on its second try alone", got, want)
	}
}

// A consumer's tag fits in AMQP's short string whatever its queue's name: the client refused a
// longer one, closing the connection, and the subscription reconnected for ever, never ready.
// The name is cut at a character, for the tag to stay valid UTF-8, and the UUID keeps each tag
// its own.
func TestAConsumerTagFitsAMQP(t *testing.T) {
	t.Parallel()
	queue := "q" + strings.Repeat("é", maxQueueName/2) // the longest name, of 2-byte characters at odd offsets
	if len(queue) != maxQueueName {
		t.Fatalf("the queue's name is %d bytes, want %d", len(queue), maxQueueName)
	}
	tag, other := consumerTag(queue), consumerTag(queue)
	if len(tag) > maxShortString || !utf8.ValidString(tag) || tag == other {
		t.Fatalf("consumer tag of %d bytes (valid UTF-8: %v; the same as the next one: %v), want at most %d, valid, unique",
			len(tag), utf8.ValidString(tag), tag == other, maxShortString)
	}
}

// A message of a type this replica has no handler for is rejected while the session runs (a
// counted delivery: it goes on towards its dead-lettering), but once the session has ended it
// is handed back with a nack, as every message in hand is: RabbitMQ 4.3 does not count that
// one against it, since it did not fail.
func TestATypeWithoutAHandlerIsHandedBackUncountedAtShutdown(t *testing.T) {
	c := &consumer{cfg: consumerConfig{DeliveryLimit: 20}, log: slog.New(slog.DiscardHandler)}
	noHandler := c.undecodable(amqp.Delivery{}, fmt.Errorf("%w %q", errNoHandler, "Refunded"))

	running, ended := context.Background(), canceled()
	for _, tc := range []struct {
		name    string
		session context.Context
		want    string
	}{
		{"while the session runs", running, "reject"},
		{"after the session ended", ended, "nack"},
	} {
		var got settlements
		c.settle(tc.session, context.Background(), job{d: amqp.Delivery{Acknowledger: &got}}, noHandler)
		if len(got) != 1 || got[0].op != tc.want {
			t.Errorf("%s: settled with %v, want one %s", tc.name, got, tc.want)
		}
	}
}

func canceled() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

// A goroutine of a session whose channel closed, late (after the next session started
// consuming), leaves the consumer ready: it marked it not ready, and Ready said false while the
// next session consumed, until that one ended.
func TestALateEndOfAnOldSessionLeavesTheNextOneReady(t *testing.T) {
	old := testSession(t) // a real channel, which the old session's end cancels its consumer on
	c := &consumer{log: slog.New(slog.DiscardHandler)}
	next := new(amqp.Connection) // the next session's: only which one it is counts
	c.live.Store(next)
	closed := make(chan *amqp.Error)
	close(closed) // the old channel's close, come late
	session, endSession := context.WithCancel(context.Background())
	c.endWithChannels(session, endSession, old.conn, []consumerLink{{ch: old.ch, tag: "old", closed: closed}})
	<-session.Done() // the old session's goroutine ran to its end
	if c.live.Load() != next {
		t.Fatal("the end of an old session marked the next one's consumer not ready")
	}
}

// An attempt cut off by the handler timeout is a failure to retry, whatever the handler called
// it: a Permanent mark goes, its text stays. An Unavailable the subscription found (the
// database silent past the deadline) stays, and a Permanent of an attempt that was not cut off
// stays too.
func TestAnAttemptCutOffByTheTimeoutLosesOnlyItsPermanentMark(t *testing.T) {
	for _, tc := range []struct {
		name                   string
		timeout                time.Duration
		process                func(ctx context.Context) error
		permanent, unavailable bool
	}{
		{"cut off, called permanent", 20 * time.Millisecond, func(ctx context.Context) error {
			<-ctx.Done()
			return Permanent(fmt.Errorf("look the customer up: %w", ctx.Err()))
		}, false, false},
		{"cut off, the database silent", 20 * time.Millisecond, func(ctx context.Context) error {
			<-ctx.Done()
			return Unavailable(Permanent(fmt.Errorf("look the customer up: %w", ctx.Err())))
		}, true, true},
		{"permanent in time", time.Minute, func(context.Context) error { return Permanent(errors.New("no such customer")) }, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &consumer{cfg: consumerConfig{HandlerTimeout: tc.timeout},
				work: work{process: func(ctx context.Context, _ []job, _ func()) error { return tc.process(ctx) }}}
			err := c.attempt(context.Background(), nil)
			if IsPermanent(err) != tc.permanent || IsUnavailable(err) != tc.unavailable {
				t.Fatalf("attempt = %v: permanent %v, unavailable %v; want %v, %v", err, IsPermanent(err), IsUnavailable(err), tc.permanent, tc.unavailable)
			}
			if !strings.Contains(err.Error(), "look the customer up") && !strings.Contains(err.Error(), "no such customer") {
				t.Fatalf("attempt = %v: the handler's text is gone", err)
			}
		})
	}
}

// An attempt that does not return when its context ends (a handler blocked on a channel, a
// call without a timeout) is abandoned abandonMargin later, logged once with its message: a
// failure, counted as any the timeout cut off. Waited for, it held its worker, and at the next
// lost channel its session, for good. Stuck after its commit, in an after-commit hook, it is a
// success: its work is done, and its message is to be acknowledged. consumer_attempts_abandoned
// counts it until it returns.
func TestAnAttemptThatDoesNotReturnIsAbandoned(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, line string
		committed  bool
		silentDB   bool // the database does not answer either
	}{
		{"a handler", "handler did not return within its timeout; abandoning it", false, false},
		{"an after-commit hook", "after-commit hook did not return within the handler timeout", true, false},
		{"a handler while the database is silent", "handler did not return within its timeout; abandoning it", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			stuck := make(chan struct{})
			t.Cleanup(func() { close(stuck) })
			var logs bytes.Buffer
			metrics, err := NewMetrics(prometheus.NewRegistry(), "")
			if err != nil {
				t.Fatal(err)
			}
			c := &consumer{cfg: consumerConfig{Queue: "q", HandlerTimeout: 50 * time.Millisecond, Propagator: propagatorOr(nil), Metrics: metrics},
				log: slog.New(slog.NewTextHandler(&logs, nil)),
				work: work{process: func(_ context.Context, _ []job, committed func()) error {
					if tc.committed {
						committed()
					}
					<-stuck // its context ignored
					return nil
				}, answers: func(context.Context) bool { return !tc.silentDB }}}
			msg := Message{ID: uuid.New(), Type: "Placed"}
			attempted := make(chan error, 1)
			go func() { attempted <- c.attempt(context.Background(), []job{{msg: msg}}) }()
			select {
			case err = <-attempted:
			case <-time.After(abandonMargin + 5*time.Second):
				t.Fatal("the attempt was not abandoned")
			}
			if tc.committed != (err == nil) || IsPermanent(err) || IsUnavailable(err) != tc.silentDB {
				t.Fatalf("attempt = %v; want %s", err, map[bool]string{true: "nil: its work committed", false: "a failure to count, or an outage if the database is silent"}[tc.committed])
			}
			if n := strings.Count(logs.String(), tc.line); n != 1 || !strings.Contains(logs.String(), "message_id="+msg.ID.String()) {
				t.Fatalf("want one line %q naming the message, got: %s", tc.line, logs.String())
			}
			if n := abandonedNow(t, metrics, "q"); n != 1 {
				t.Fatalf("consumer_attempts_abandoned = %v while the attempt runs on; want 1", n)
			}
			stuck <- struct{}{} // it returns at last
			deadline := time.Now().Add(5 * time.Second)
			for abandonedNow(t, metrics, "q") != 0 {
				if time.Now().After(deadline) {
					t.Fatal("consumer_attempts_abandoned still counts the attempt after it returned")
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
}

// abandonedNow reads consumer_attempts_abandoned of consumer.
func abandonedNow(t *testing.T, m *Metrics, consumer string) float64 {
	t.Helper()
	var v dto.Metric
	if err := m.abandoned.WithLabelValues(consumer).Write(&v); err != nil {
		t.Fatal(err)
	}
	return v.GetGauge().GetValue()
}

// An attempt the shutdown calls off is given up stopMargin after, not abandonMargin: a service's
// hard stop (9 s after the signal, its grace 5 s) leaves no room for the longer wait.
func TestAnAttemptCalledOffByTheShutdownIsAbandonedSooner(t *testing.T) {
	t.Parallel()
	stuck := make(chan struct{})
	t.Cleanup(func() { close(stuck) })
	var logs bytes.Buffer
	c := &consumer{cfg: consumerConfig{HandlerTimeout: time.Minute, Propagator: propagatorOr(nil)},
		log: slog.New(slog.NewTextHandler(&logs, nil)),
		work: work{process: func(context.Context, []job, func()) error {
			<-stuck // its context ignored
			return nil
		}}}
	workCtx, stop := context.WithCancel(context.Background())
	attempted := make(chan error, 1)
	go func() { attempted <- c.attempt(workCtx, []job{{msg: Message{ID: uuid.New(), Type: "Placed"}}}) }()
	stop()
	stopped := time.Now()
	select {
	case err := <-attempted:
		if took := time.Since(stopped); err == nil || took > stopMargin+time.Second {
			t.Fatalf("attempt = %v after %s; want a failure within %s", err, took.Round(time.Millisecond), stopMargin)
		}
	case <-time.After(abandonMargin + 5*time.Second):
		t.Fatal("the attempt was not abandoned")
	}
	if !strings.Contains(logs.String(), "handler did not return at the shutdown; abandoning it") {
		t.Fatalf("no line about the attempt abandoned at the shutdown: %s", logs.String())
	}
}

// An attempt the shutdown called off is handed back at once, also when the handler says its
// dependency is unavailable (its lookup's ctx.Err(), wrapped): not logged as an outage with a
// retry that never comes, nor held for that retry's backoff, which, with the grace over before
// the session ended (the broker slow to confirm the cancels), took the hand-back past the
// connection's close.
func TestAnUnavailableAttemptTheShutdownCalledOffIsHandedBackAtOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name         string
		sessionEnded bool
	}{{"the session ended too", true}, {"the grace ended before the session", false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var logs bytes.Buffer
			session, endSession := context.WithCancel(context.Background())
			defer endSession()
			workCtx, endGrace := context.WithCancel(context.Background())
			c := &consumer{cfg: consumerConfig{DeliveryLimit: 20, Retries: 3, HandlerTimeout: time.Minute, Propagator: propagatorOr(nil),
				RetryBackoff: Backoff{Base: 5 * time.Second, Max: 5 * time.Second}},
				log: slog.New(slog.NewTextHandler(&logs, nil)),
				work: work{decode: func(Message) (any, error) { return nil, nil }, process: func(ctx context.Context, _ []job, _ func()) error {
					if tc.sessionEnded {
						endSession()
					}
					endGrace() // the shutdown's grace is over
					<-ctx.Done()
					return Unavailable(fmt.Errorf("payments: %w", ctx.Err()))
				}}}
			begin := time.Now()
			o := c.process(session, workCtx, job{msg: Message{ID: uuid.New(), Type: "Placed"}}, false)
			if o.settle != settleNack {
				t.Fatalf("settled as %d, want handed back (%d)", o.settle, settleNack)
			}
			if took := time.Since(begin); took > time.Second {
				t.Errorf("handed back %s after the attempt began, want at once: it waited for a retry", took.Round(time.Millisecond))
			}
			if strings.Contains(logs.String(), "retrying message") {
				t.Errorf("logged a retry that never comes: %s", logs.String())
			}
		})
	}
}

// A consumer refused after others started (its queue deleted meanwhile, say) ends the setup,
// and those started before it hand back at once what the broker sent them: left to the closing
// connection, each was a failed delivery (RabbitMQ 4.3), at every such setup, up to the
// delivery limit.
func TestConsumersStartedBeforeOneRefusedHandBackWhatTheyWereSent(t *testing.T) {
	t.Parallel()
	conn := testConnection(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	queue := "start-" + uuid.NewString()
	if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = ch.QueueDelete(queue, false, false, false) })
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	const sent = 3
	for range sent {
		dc, err := ch.PublishWithDeferredConfirm("", queue, true, false, amqp.Publishing{Body: []byte(`{}`)})
		if err != nil || !dc.Wait() {
			t.Fatalf("publish: %v", err)
		}
	}
	first, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Qos(sent, 0, false); err != nil {
		t.Fatal(err)
	}
	refused, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := refused.Close(); err != nil { // its Consume fails
		t.Fatal(err)
	}
	links := []consumerLink{{ch: first}, {ch: refused}}
	c := &consumer{cfg: consumerConfig{Queue: queue}}
	if _, err := c.startConsumers(context.Background(), links); err == nil {
		t.Fatal("the consumers started on a closed channel")
	}
	// Every message reached the first consumer, which was not to settle it...
	for range sent {
		select {
		case _, ok := <-links[0].deliveries:
			if !ok {
				t.Fatal("the first consumer's deliveries ended before the queue's messages came")
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the broker did not send the first consumer the queue's messages")
		}
	}
	// ...but to hand it back, ready for another consumer.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
		if err != nil {
			t.Fatal(err)
		}
		if q.Messages == sent {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of the %d messages back in the queue, the others held by a consumer of a setup that failed", q.Messages, sent)
		}
	}
}

// testConnection is a connection to the broker at TEST_AMQP_URL, closed when t ends.
func testConnection(t *testing.T) *amqp.Connection {
	t.Helper()
	url := os.Getenv("TEST_AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	conn, err := dial(context.Background(), url, t.Name(), 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}
