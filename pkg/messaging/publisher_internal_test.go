package messaging

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
)

// checkEnvelope leaves the broker room for what it adds at delivery: the largest headers it
// lets through, published to an exchange by a routing key of 255 bytes each, to a quorum queue
// of a name almost as long, are delivered again (basic.get, handed back, got again with
// x-delivery-count, to a consumer) and, dead-lettered there by the broker at its delivery
// limit, read back from the dead-letter queue, x-death and x-first-death-* added. One byte more
// is refused before anything is written. (Headers filling the frame were taken, and the client
// closed the connection at their second delivery, "frame size exceeds negotiated frame_max".)
func TestEnvelopeAtItsLimitIsDeliveredAgain(t *testing.T) {
	t.Parallel()
	s := testSession(t)
	frame := s.conn.Config.FrameSize
	name := func(prefix string, n int) string { return prefix + strings.Repeat("x", n-len(prefix)) }
	id := uuid.NewString()
	// A quorum queue's name, with its virtual host's, names an Erlang atom: at most 255 bytes.
	exchange, key := name("limit-"+id, maxShortString), name("limit-key", maxShortString)
	dlq := quorumQueue(t, "limit-dlq-"+id, nil)
	queue := quorumQueue(t, name("limit-queue-"+id, maxShortString-len("%2F_")), amqp.Table{
		"x-delivery-limit": 2, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq,
	})
	ch, err := testConnection(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeDirect, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(queue, key, exchange, false, nil); err != nil {
		t.Fatal(err)
	}

	m := Message{ID: uuid.New(), Type: "Test", Payload: []byte(`{}`), OccurredAt: time.Now(), CorrelationID: "corr",
		Exchange: exchange, RoutingKey: key}
	pad := func(n int) amqp.Publishing {
		m.Headers = map[string]string{"pad": strings.Repeat("x", n)}
		return toPublishing(m, "app")
	}
	n := frame
	for checkEnvelope(m.Exchange, m.routingKey(), pad(n), frame) != nil {
		n--
	}
	if err := checkEnvelope(m.Exchange, m.routingKey(), pad(n+1), frame); !errors.Is(err, ErrInvalidEnvelope) {
		t.Fatalf("one byte over the limit: %v, want ErrInvalidEnvelope", err)
	}
	if size := contentHeaderSize(pad(n)); size > frame-brokerHeadroom || size < frame-brokerHeadroom-8 {
		t.Fatalf("the largest headers let through take %d bytes, want at most the %d the headroom leaves, and close to it",
			size, frame-brokerHeadroom)
	}
	dc, err := s.ch.PublishWithDeferredConfirmWithContext(context.Background(), m.Exchange, m.routingKey(), true, false, pad(n))
	if err != nil {
		t.Fatal(err)
	}
	if !dc.Wait() || s.ch.IsClosed() {
		t.Fatalf("the broker refused headers of %d bytes in a frame of %d", n, frame)
	}

	d := deliveredAgain(t, testConnection(t), queue)
	if err := d.Reject(true); err != nil { // past the delivery limit: dead-lettered
		t.Fatal(err)
	}
	d = deliveredAgain(t, testConnection(t), dlq)
	if _, ok := d.Headers["x-death"]; !ok || d.MessageId != m.ID.String() {
		t.Errorf("the message read back from the dead-letter queue, id %s, has no x-death: %.300v", d.MessageId, d.Headers)
	}
	if err := d.Ack(false); err != nil {
		t.Fatal(err)
	}
}

// testSession is a publisher's session on the broker at TEST_AMQP_URL.
func testSession(t *testing.T) *pubSession {
	t.Helper()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	conn := testConnection(t)
	s := &pubSession{conn: conn, watch: watchConnection(conn, log, slog.LevelWarn)}
	if err := s.setup(PublisherConfig{MaxInFlight: 10}, log); err != nil {
		t.Fatal(err)
	}
	return s
}

// A message the broker confirmed and returned (no queue took it) is not sent, even when the
// broker blocks the connection before the rest of its window is confirmed and the wait stops
// early. The confirm and the block race in await's select, so the window is tried many times.
func TestUnroutableIsNotSentWhenBlockedMidWindow(t *testing.T) {
	t.Parallel()
	s := testSession(t)
	ctx := context.Background()
	for range 30 {
		// The default exchange routes by queue name: no queue has this one.
		unroutable := Message{ID: uuid.New(), Type: "Test", Payload: []byte(`{}`), RoutingKey: "no-such-queue-" + uuid.NewString()}
		dc, err := s.ch.PublishWithDeferredConfirmWithContext(ctx, "", unroutable.routingKey(), true, false, toPublishing(unroutable, ""))
		if err != nil {
			t.Fatal(err)
		}
		if !dc.Wait() {
			t.Fatal("the broker nacked the message")
		}
		s.watch.set(amqp.Blocking{Active: true, Reason: "test"})
		// The second message's confirm never comes.
		msgs := []Message{unroutable, {ID: uuid.New()}}
		errs := make([]error, len(msgs))
		if blocked, _ := s.verdicts(ctx, msgs, []*amqp.DeferredConfirmation{dc, {}}, errs, time.Second); !blocked {
			t.Fatal("verdicts did not stop at the block")
		}
		if errs[0] == nil {
			t.Fatal("the confirmed but returned message counts as sent")
		}
		if !errors.Is(errs[0], ErrUnroutable) && !errors.Is(errs[0], ErrBrokerUnavailable) {
			t.Fatalf("the returned message's verdict = %v, want unroutable or no verdict", errs[0])
		}
		if !errors.Is(errs[1], ErrBrokerUnavailable) {
			t.Fatalf("the unconfirmed message's verdict = %v, want no verdict", errs[1])
		}
		s.watch.set(amqp.Blocking{Active: false})
	}
}

// A window that did not publish a message, because another window has the same id in flight,
// does not take that message's return: the window that published it, unroutable, would count
// it as sent.
func TestAWindowTakesOnlyTheReturnsOfItsOwnPublishes(t *testing.T) {
	t.Parallel()
	s := testSession(t)
	ctx := context.Background()
	// The default exchange routes by queue name: no queue has this one.
	x := Message{ID: uuid.New(), Type: "Test", Payload: []byte(`{}`), RoutingKey: "no-such-queue-" + uuid.NewString()}
	if !s.reserve(x.ID) {
		t.Fatal("a fresh id is in flight")
	}
	dc, err := s.ch.PublishWithDeferredConfirmWithContext(ctx, "", x.routingKey(), true, false, toPublishing(x, ""))
	if err != nil {
		t.Fatal(err)
	}
	<-dc.Done() // its return came before its confirm
	if s.reserve(x.ID) {
		t.Fatal("an id in flight was reserved again")
	}
	other := []error{unavailable("test: an earlier publish of it is not confirmed yet")}
	s.verdicts(ctx, []Message{x}, []*amqp.DeferredConfirmation{nil}, other, time.Second)
	own := make([]error, 1)
	s.verdicts(ctx, []Message{x}, []*amqp.DeferredConfirmation{dc}, own, time.Second)
	if !errors.Is(own[0], ErrUnroutable) {
		t.Fatalf("the verdict on the unroutable message = %v, want ErrUnroutable", own[0])
	}
	if !errors.Is(other[0], ErrBrokerUnavailable) {
		t.Fatalf("the verdict on the copy never published = %v, want no verdict", other[0])
	}
}

// A confirm that came counts even when the wait for the window stops early, at its timeout or
// at a block: the select that stops it picks at random among what is ready, and took the
// confirm in hand for no verdict about half the time, so a window cut off by a slow link went
// out a few messages at a time.
func TestAConfirmInHandCountsWhenTheWaitStopsEarly(t *testing.T) {
	t.Parallel()
	s := testSession(t)
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	for _, stop := range []struct {
		name  string
		ctx   context.Context
		block bool
	}{{"at the timeout", ended, false}, {"at a block", context.Background(), true}} {
		for range 20 {
			// The default exchange takes a routing key no queue has, not mandatory: an ack.
			m := Message{ID: uuid.New(), Type: "Test", Payload: []byte(`{}`), RoutingKey: "no-such-queue-" + uuid.NewString()}
			dc, err := s.ch.PublishWithDeferredConfirmWithContext(context.Background(), "", m.routingKey(), false, false, toPublishing(m, ""))
			if err != nil {
				t.Fatal(err)
			}
			<-dc.Done()
			if stop.block {
				s.watch.set(amqp.Blocking{Active: true, Reason: "test"})
			}
			// The second message's confirm never comes.
			errs := make([]error, 2)
			s.await(stop.ctx, []Message{m, {ID: uuid.New()}}, []*amqp.DeferredConfirmation{dc, {}}, errs, time.Second)
			s.watch.set(amqp.Blocking{Active: false})
			if errs[0] != nil {
				t.Fatalf("%s: the confirmed message's verdict = %v, want sent", stop.name, errs[0])
			}
			if !errors.Is(errs[1], ErrBrokerUnavailable) {
				t.Fatalf("%s: the unconfirmed message's verdict = %v, want no verdict", stop.name, errs[1])
			}
		}
	}
}

// A block stops the wait for a window's confirms with no verdict on the messages still
// awaited, even when the broker unblocks the connection at once (an alarm flapping at its
// watermark): the state read after the wake-up said "not blocked", and every message still
// awaited counted as sent. Nor does it touch the verdicts of messages never published (too
// large), which it overwrote. The alarm flaps throughout, so that the wake-up and the unblock
// race in many of the windows tried.
func TestABlockThatEndsAtOnceLeavesTheAwaitedUnsent(t *testing.T) {
	t.Parallel()
	s := testSession(t)
	stop := make(chan struct{})
	flapped := make(chan struct{})
	go func() {
		defer close(flapped)
		for {
			select {
			case <-stop:
				s.watch.set(amqp.Blocking{Active: false})
				return
			default:
				s.watch.set(amqp.Blocking{Active: true, Reason: "test"})
				s.watch.set(amqp.Blocking{Active: false})
				runtime.Gosched() // a flap, not a core taken from the tests beside it
			}
		}
	}()
	defer func() { close(stop); <-flapped }()
	for range 300 {
		tooLarge := fmt.Errorf("%w: test", ErrTooLarge)
		// The first message's confirm never comes; the second was never published.
		msgs := []Message{{ID: uuid.New()}, {ID: uuid.New()}}
		errs := []error{nil, tooLarge}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		s.await(ctx, msgs, []*amqp.DeferredConfirmation{{}, nil}, errs, 20*time.Millisecond)
		cancel()
		if !errors.Is(errs[0], ErrBrokerUnavailable) {
			t.Fatalf("the unconfirmed message's verdict = %v, want no verdict", errs[0])
		}
		if !errors.Is(errs[1], ErrTooLarge) {
			t.Fatalf("the unpublished message's verdict = %v, want its own, %v", errs[1], tooLarge)
		}
	}
}

// A return names its message by id alone. So a message is not published again on a connection
// while an earlier publish of it is unsettled there, as when its window was abandoned to a
// block: the abandoned window's late settling would take the new publish's return, and the
// message, which no queue took, would count as sent.
func TestAMessageIsNotPublishedTwiceAtOnceOnAConnection(t *testing.T) {
	t.Parallel()
	p := testPublisher(t)
	ctx := context.Background()
	// The default exchange routes by queue name: no queue has this one.
	x := Message{ID: uuid.New(), Type: "Test", Payload: []byte(`{}`), RoutingKey: "no-such-queue-" + uuid.NewString()}
	publish := func() (*pubSession, []*amqp.DeferredConfirmation, error) {
		errs := make([]error, 1)
		s, confirms := p.write(ctx, []Message{x}, errs)
		if s == nil {
			t.Fatalf("nothing published: %v", errs[0])
		}
		return s, confirms, errs[0]
	}

	// The first publish, in a window left to settle late.
	s, abandoned, err := publish()
	if err != nil || abandoned[0] == nil {
		t.Fatalf("first publish: %v", err)
	}
	if _, confirms, err := publish(); !errors.Is(err, ErrBrokerUnavailable) || confirms[0] != nil {
		t.Fatalf("published again while the first is unsettled: verdict %v", err)
	}
	abandoned[0].Wait()
	s.settleLate(abandoned, []Message{x}, nil)

	// Settled: it goes again, and its own return is its verdict.
	_, confirms, err := publish()
	if err != nil || confirms[0] == nil {
		t.Fatalf("publish after the first settled: %v", err)
	}
	errs := make([]error, 1)
	if blocked, _ := s.verdicts(ctx, []Message{x}, confirms, errs, time.Second); blocked {
		t.Fatal("blocked")
	}
	s.release([]Message{x}, confirms)
	if !errors.Is(errs[0], ErrUnroutable) {
		t.Fatalf("verdict %v, want ErrUnroutable", errs[0])
	}
}

// The broker's reasons for closing a channel at a refused publish cover exactly the messages
// they name: by exchange, or by exchange and routing key for a topic permission, quotes in the
// names too; a reason cut at 255 bytes covers those it begins as.
func TestARefusalCoversTheMessagesItNames(t *testing.T) {
	long := "orders." + strings.Repeat("k", 200)
	cutLong := ("ACCESS_REFUSED - access to topic '" + long + "' in exchange 'orders' in vhost '/' refused for user 'relay'")[:252] + "..."
	mid := "orders." + strings.Repeat("k", 163) // cut after the exchange's name
	cutMid := ("ACCESS_REFUSED - access to topic '" + mid + "' in exchange 'orders' in vhost '/' refused for user 'relay'")[:252] + "..."
	for _, c := range []struct {
		reason string
		m      Message
		want   bool
	}{
		{"ACCESS_REFUSED - access to exchange 'orders' in vhost '/' refused for user 'u'", Message{Exchange: "orders", Type: "A"}, true},
		{"ACCESS_REFUSED - access to exchange 'orders' in vhost '/' refused for user 'u'", Message{Exchange: "billing", Type: "A"}, false},
		{"ACCESS_REFUSED - access to exchange 'amq.default' in vhost '/' refused for user 'u'", Message{RoutingKey: "q", Type: "A"}, true},
		{"ACCESS_REFUSED - access to topic 'it's' in exchange 'orders' in vhost '/' refused for user 'u'", Message{Exchange: "orders", RoutingKey: "it's"}, true},
		{"ACCESS_REFUSED - access to topic 'it's' in exchange 'orders' in vhost '/' refused for user 'u'", Message{Exchange: "orders", RoutingKey: "it"}, false},
		{"ACCESS_REFUSED - write access to topic 'A' in exchange 'orders' in vhost '/' refused for user 'u'", Message{Exchange: "orders", Type: "A"}, true},
		{"ACCESS_REFUSED - write access to topic 'A' in exchange 'orders' in vhost '/' refused for user 'u'", Message{Exchange: "orders", Type: "B"}, false},
		{cutLong, Message{Exchange: "orders", RoutingKey: long}, true},
		{cutLong, Message{Exchange: "orders", RoutingKey: "orders.k"}, false},
		{cutMid, Message{Exchange: "orders", RoutingKey: mid}, true},
		{cutMid, Message{Exchange: "billing", RoutingKey: mid}, false},
		{cutMid, Message{Exchange: "orders", RoutingKey: mid + "x"}, false},
		{"NOT_FOUND - no exchange 'orders' in vhost '/'", Message{Exchange: "orders", Type: "A"}, false},
	} {
		code := amqp.AccessRefused
		if strings.HasPrefix(c.reason, "NOT_FOUND") {
			code = amqp.NotFound
		}
		if got := refuses(&amqp.Error{Code: code, Reason: c.reason}, c.m); got != c.want {
			t.Errorf("%q covers exchange %q key %q: %v, want %v", c.reason, c.m.Exchange, c.m.routingKey(), got, c.want)
		}
	}
}

// Only a JSON payload over the limit, and within what jsonb's spaces can add to one that fits,
// is compacted, in a copy of the messages; the others are left as they are, and a window with
// none of them is not copied.
func TestCompactOversized(t *testing.T) {
	const most = 20
	spaced := json.RawMessage(`[1, 2, 3, 4, 5, 6, 7, 8]`)             // 24 bytes, 17 compact
	tooLong := json.RawMessage(`[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]`) // 35 bytes: past 1.5 × 20 + 1
	notJSON := json.RawMessage(`{not json at all, though long}`)
	fits := json.RawMessage(`[1, 2]`)
	msgs := []Message{{Payload: fits}, {Payload: spaced}, {Payload: tooLong}, {Payload: notJSON}}
	got := compactOversized(msgs, most)
	want := []string{string(fits), `[1,2,3,4,5,6,7,8]`, string(tooLong), string(notJSON)}
	for i := range got {
		if string(got[i].Payload) != want[i] {
			t.Errorf("message %d: %s, want %s", i, got[i].Payload, want[i])
		}
	}
	if string(msgs[1].Payload) != string(spaced) {
		t.Errorf("the caller's message changed: %s", msgs[1].Payload)
	}
	if untouched := []Message{{Payload: fits}}; &compactOversized(untouched, most)[0] != &untouched[0] {
		t.Error("a window with nothing to compact was copied")
	}
}

// A channel closed for a publish to a missing exchange charges that exchange's message unless
// the next connection declares it (the Topology's, declared or seen by this one); its others
// are then left for the next batch, not taken for an outage. A reason cut short counts by its
// prefix. A close for a reason of no message, the connection still up, is an outage that a new
// connection does not show the end of (errUnconfirmed). A verdict read from the close is the
// broker's answer to the publish (brokerAnswered), unlike the same verdict of a check before it.
func TestAMissingExchangeIsChargedUnlessTheNextConnectionDeclaresIt(t *testing.T) {
	long := strings.Repeat("x", 240)
	closed := func(exchange string) *pubSession {
		reason := "NOT_FOUND - no exchange '" + exchange + "' in vhost '/'"
		if len(reason) > 255 {
			reason = reason[:252] + cutReason
		}
		return &pubSession{
			conn:     &amqp.Connection{}, // open
			declares: map[string]bool{"orders": true, "trusted": false},
			closeErr: &amqp.Error{Code: amqp.NotFound, Reason: reason},
		}
	}
	for _, c := range []struct {
		closedFor, exchange      string
		want                     error
		notAnOutage, unconfirmed bool
	}{
		{"gone", "gone", ErrNoExchange, false, false},
		{"gone", "orders", ErrBrokerUnavailable, true, false},
		{"trusted", "trusted", ErrNoExchange, false, false},
		{"orders", "orders", ErrBrokerUnavailable, false, true},
		{"orders", "billing", ErrBrokerUnavailable, false, true},
		{long, long, ErrNoExchange, false, false},
		{long, "orders", ErrBrokerUnavailable, true, false},
	} {
		err := closed(c.closedFor).closedVerdict(Message{Exchange: c.exchange})
		if !errors.Is(err, c.want) || errors.Is(err, errNotAnOutage) != c.notAnOutage || errors.Is(err, errUnconfirmed) != c.unconfirmed {
			t.Errorf("closed for %.20q, message to %.20q: %v; want %v, not an outage %v, unconfirmed %v",
				c.closedFor, c.exchange, err, c.want, c.notAnOutage, c.unconfirmed)
		}
		if answered := !errors.Is(c.want, ErrBrokerUnavailable); brokerAnswered(err) != answered {
			t.Errorf("closed for %.20q, message to %.20q: %v is the broker's answer %t, want %t", c.closedFor, c.exchange, err, !answered, answered)
		}
	}
}

// The client marks a channel closed before it hands over the broker's reason. A publish or a
// confirm that fails in between is judged by that reason all the same: without it, a message
// the broker refused would be taken for an outage, and the relay would pause and redial.
func TestAClosedChannelsReasonIsAwaited(t *testing.T) {
	t.Parallel()
	s := testSession(t)
	late := make(chan *amqp.Error, 1)
	s.closes = late // the reason comes on this one, late; the client's own it closes at once
	if err := s.ch.Close(); err != nil {
		t.Fatal(err)
	}
	// The hand-over the client makes after marking the channel closed, made late.
	time.AfterFunc(100*time.Millisecond, func() {
		late <- &amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no exchange 'gone' in vhost '/'"}
	})
	if err := s.closedVerdict(Message{Exchange: "gone"}); !errors.Is(err, ErrNoExchange) {
		t.Fatalf("verdict on a message to the exchange the channel closed for = %v, want ErrNoExchange", err)
	}

	// A reason later than closeWait is not waited for, but found when asked again.
	s = testSession(t)
	later := make(chan *amqp.Error, 1)
	s.closes = later
	if err := s.ch.Close(); err != nil {
		t.Fatal(err)
	}
	if reason := s.closeReason(); reason != nil {
		t.Fatalf("reason before the client handed one over = %v, want none yet", reason)
	}
	later <- &amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no exchange 'gone' in vhost '/'"}
	if err := s.closedVerdict(Message{Exchange: "gone"}); !errors.Is(err, ErrNoExchange) {
		t.Fatalf("verdict once the late reason came = %v, want ErrNoExchange", err)
	}

	// A channel the client closed, which has no reason, answers at once.
	s = testSession(t)
	if err := s.ch.Close(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if reason := s.closeReason(); reason != nil {
		t.Fatalf("reason of a channel the client closed = %v, want none", reason)
	}
	if took := time.Since(start); took >= closeWait {
		t.Errorf("the reason of a channel the client closed took %s, want it at once", took)
	}
}

// A heartbeat under a second is a configuration's fault, as a too long AppID: the client would
// send 0 and take the broker's 60 s. Refused by the check, before any broker is reached.
func TestAPublisherHeartbeatUnderASecondIsRefused(t *testing.T) {
	for hb, want := range map[time.Duration]bool{0: false, time.Second: false, 999 * time.Millisecond: true, time.Nanosecond: true} {
		err := PublisherConfig{URL: "amqp://127.0.0.1:1/", Heartbeat: hb}.check()
		if refused := err != nil && strings.Contains(err.Error(), "PublisherConfig.Heartbeat"); refused != want {
			t.Errorf("check with Heartbeat %v = %v; want refused: %v", hb, err, want)
		}
	}
}

// A window whose ConfirmTimeout ran out on a connection still up is an outage a new connection
// does not show the end of (errUnconfirmed); one whose caller stopped waiting says nothing of
// the broker.
func TestOnlyAWindowsOwnTimeoutIsUnconfirmed(t *testing.T) {
	t.Parallel()
	s := &pubSession{conn: &amqp.Connection{}} // open
	timedOut, cancel := context.WithTimeoutCause(context.Background(), time.Nanosecond, errWindowTimedOut)
	defer cancel()
	<-timedOut.Done()
	if err := s.unconfirmed(timedOut, time.Second); !errors.Is(err, ErrBrokerUnavailable) || !errors.Is(err, errUnconfirmed) {
		t.Errorf("the window's timeout: %v, want ErrBrokerUnavailable and errUnconfirmed", err)
	}
	ended, end := context.WithCancel(context.Background())
	end()
	callerEnded, cancel := context.WithTimeoutCause(ended, time.Minute, errWindowTimedOut)
	defer cancel()
	if err := s.unconfirmed(callerEnded, time.Minute); !errors.Is(err, ErrBrokerUnavailable) || errors.Is(err, errUnconfirmed) {
		t.Errorf("the caller's end: %v, want ErrBrokerUnavailable, not errUnconfirmed", err)
	}
}

// Every verdict read from the reason the broker closed the channel for a message's publish is
// the broker's answer to it (brokerAnswered): it ends an outage a probe cannot see, as a confirm
// does.
func TestAVerdictReadFromAClosedChannelIsTheBrokersAnswer(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		reason *amqp.Error
		want   error
	}{
		{&amqp.Error{Code: amqp.AccessRefused, Reason: "ACCESS_REFUSED - write access to exchange 'x' in vhost '/' refused for user 'u'"}, ErrAccessRefused},
		{&amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - message size 20 is larger than configured max size 10"}, ErrTooLarge},
		{&amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no exchange 'x' in vhost '/'"}, ErrNoExchange},
	} {
		s := &pubSession{conn: &amqp.Connection{}, closeErr: c.reason} // the connection open
		err := s.closedVerdict(Message{Exchange: "x", Payload: make([]byte, 20)})
		if !errors.Is(err, c.want) || !brokerAnswered(err) {
			t.Errorf("closed for %q: %v, the broker's answer %t; want %v, the broker's answer", c.reason.Reason, err, brokerAnswered(err), c.want)
		}
	}
}

// testPublisher is a publisher of the broker at TEST_AMQP_URL, closed when t ends.
func testPublisher(t *testing.T) *Publisher {
	t.Helper()
	url := os.Getenv("TEST_AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	p := NewPublisher(PublisherConfig{URL: url, ConnectionName: t.Name(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	t.Cleanup(p.Close)
	return p
}

// routedMessages are n messages to a queue of their own, which takes them: each is confirmed,
// and none comes back.
func routedMessages(t *testing.T, n int) []Message {
	t.Helper()
	ch, err := testConnection(t).Channel()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclare("", false, true, true, false, nil) // exclusive to the test's connection
	if err != nil {
		t.Fatal(err)
	}
	msgs := make([]Message, n)
	for i := range msgs {
		msgs[i] = Message{ID: uuid.New(), Type: "Test", Payload: []byte(`{}`), RoutingKey: q.Name}
	}
	return msgs
}

// A window whose confirms are all in when its ConfirmTimeout runs out (the last one came just
// then, and the wait took it in hand) keeps its connection: the windows of the other calls
// (relay lanes) on it still await theirs, and retiring it would lose them, their rows committed
// unsent to go out again, and an outage logged. Only a published message still without its
// confirm at the window's end retires the connection.
func TestAWindowConfirmedAtItsTimeoutKeepsTheConnection(t *testing.T) {
	t.Parallel()
	for _, awaited := range []bool{false, true} {
		p := testPublisher(t)
		ctx := context.Background()
		msgs := routedMessages(t, 3)
		own, other := msgs[:2], msgs[2:]
		ownErrs, otherErrs := make([]error, len(own)), make([]error, len(other))
		if err := p.inFlight.Acquire(ctx, int64(len(own))); err != nil {
			t.Fatal(err)
		}
		s, confirms := p.write(ctx, own, ownErrs)
		if s == nil {
			t.Fatalf("nothing published: %v", ownErrs)
		}
		for _, dc := range confirms {
			<-dc.Done()
		}
		if awaited {
			confirms[1] = &amqp.DeferredConfirmation{} // its confirm never comes
		}
		// Another call's window, written on the connection, its confirm not yet taken in.
		if err := p.inFlight.Acquire(ctx, int64(len(other))); err != nil {
			t.Fatal(err)
		}
		otherSession, otherConfirms := p.write(ctx, other, otherErrs)
		if otherSession != s {
			t.Fatalf("the other window went to another connection: %v", otherErrs)
		}
		timedOut, cancel := context.WithDeadlineCause(ctx, time.Now(), errWindowTimedOut)
		<-timedOut.Done()
		p.settle(timedOut, time.Now(), s, own, confirms, ownErrs)
		cancel()
		if retired := s.conn.IsClosed(); retired != awaited {
			t.Errorf("a confirm still awaited %t: the connection retired %t, want %t", awaited, retired, awaited)
		}
		if !awaited && (ownErrs[0] != nil || ownErrs[1] != nil) {
			t.Errorf("the window's confirmed messages: %v, want sent", ownErrs)
		}
		if awaited && (ownErrs[0] != nil || !errors.Is(ownErrs[1], ErrBrokerUnavailable)) {
			t.Errorf("a window with a confirm still awaited: %v, want the confirmed one sent, the other no verdict", ownErrs)
		}
		p.settle(ctx, time.Now().Add(time.Minute), s, other, otherConfirms, otherErrs)
		if !awaited && otherErrs[0] != nil {
			t.Errorf("the other window's message, on a connection kept: %v, want sent", otherErrs[0])
		}
	}
}

// A publish the client hands back no confirm for (a nil DeferredConfirmation and no error: what
// it does on a channel not in confirm mode) is not sent: nothing would ever confirm it. Nor is
// any message after it in its window, written on a channel that confirms nothing.
func TestAPublishWithoutAConfirmIsNotSent(t *testing.T) {
	t.Parallel()
	p := testPublisher(t)
	ctx := context.Background()
	if err := p.Connect(ctx); err != nil {
		t.Fatal(err)
	}
	// The session's channel swapped for one not in confirm mode.
	s := p.sess
	ch, err := s.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	s.ch, s.closes, s.returns = ch, ch.NotifyClose(make(chan *amqp.Error, 1)), ch.NotifyReturn(make(chan amqp.Return, 10))
	for i, err := range p.Publish(ctx, routedMessages(t, 2)) {
		if !errors.Is(err, ErrBrokerUnavailable) {
			t.Errorf("message %d, published with no confirm to come: %v, want no verdict (ErrBrokerUnavailable)", i, err)
		}
	}
	// The connection retired, the next call dials one whose channel confirms.
	for i, err := range p.Publish(ctx, routedMessages(t, 2)) {
		if err != nil {
			t.Errorf("message %d, published after: %v, want sent", i, err)
		}
	}
}

// A broker URL list of which no URL parses names no broker: Connect returns that as the
// configuration's fault, naming PublisherConfig.URL, not as ErrBrokerUnavailable (a relay would
// pause for good, waiting for a broker), and without the URL's text, which may hold a password.
// One of which some URL parses is not refused: the others are passed over.
func TestABrokerURLListOfWhichNoneParsesIsTheConfigurationsFault(t *testing.T) {
	t.Parallel()
	const password = "hunter"
	for url, refused := range map[string]bool{
		"http://x":                                  true,
		"amqp://u:" + password + "%zz@h/":           true,
		"amqp://u:" + password + "@[::1/":           true,
		"http://x, amqp://u:" + password + "%zz@h/": true,
		"http://x, amqp://127.0.0.1:1/":             false,
		"amqp://127.0.0.1:1/":                       false,
	} {
		err := PublisherConfig{URL: url}.check()
		if (err != nil) != refused {
			t.Errorf("check with URL %q: %v, want refused %t", url, err, refused)
		}
		if !refused {
			continue
		}
		p := NewPublisher(PublisherConfig{URL: url, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		err = p.Connect(context.Background())
		p.Close()
		if err == nil || errors.Is(err, ErrBrokerUnavailable) || !strings.Contains(err.Error(), "PublisherConfig.URL") || strings.Contains(err.Error(), password) {
			t.Errorf("Connect with URL %q: %v; want an error naming PublisherConfig.URL, not ErrBrokerUnavailable, without the password", url, err)
		}
	}
}
