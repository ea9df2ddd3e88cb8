package messaging

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"golang.org/x/sync/semaphore"
)

// The broker's verdicts on one message. Each is that message's own fault: the relay records it
// against the row and backs the row off.
var (
	// ErrUnroutable: the broker confirmed the message but no queue was bound to take it (a
	// basic.return). It was not delivered anywhere, so it does not count as sent.
	ErrUnroutable = errors.New("message unroutable")
	// ErrNacked: the broker refused the message on a channel that stayed open.
	ErrNacked = errors.New("message nacked by the broker")
	// ErrTooLarge: the message is over PublisherConfig.MaxMessageBytes, or the broker closed
	// the channel for a body over its own max_message_size; it was not sent. From [Enqueue]:
	// its payload is over 16 MiB; it was not stored.
	ErrTooLarge = errors.New("message too large")
	// ErrNoExchange: the message names an exchange that does not exist; it was not sent.
	ErrNoExchange = errors.New("no such exchange")
	// ErrAccessRefused: the broker refused the publisher's user the message's exchange: no
	// write permission on it (or, by a topic permission, with the message's routing key), or,
	// for an exchange outside the Topology, none to check that it exists (from RabbitMQ 4.3.1
	// any one permission; on 4.2.6 and 4.3.0 configure, so there a user that may only write
	// must have the exchange in its Topology), or the exchange is internal; it was not sent.
	ErrAccessRefused = errors.New("access refused")
	// ErrInvalidEnvelope: the message cannot travel over AMQP (a type, routing key, exchange,
	// correlation id or header name over 255 bytes, headers that leave less than 3 KiB of a
	// frame free for what the broker adds at delivery, or a header
	// CC or BCC, which RabbitMQ takes as an array of routing keys only); it was not sent. [Enqueue] refuses such messages; this verdict catches rows written otherwise.
	ErrInvalidEnvelope = errors.New("message envelope not valid for AMQP")
)

// ErrBrokerUnavailable means the broker gave no verdict on the message: there is no
// connection, the channel closed, the broker blocked the connection (a resource alarm), no
// confirm came within the timeout, the client gave no confirm to wait for (a channel not in
// confirm mode), or the publisher cannot connect at all (its configuration
// names no broker, or none whose URL parses, or an app id AMQP cannot carry: [Publisher.Connect]
// reports those as they are, not as this error). It says nothing about the message itself, which may still
// have been delivered (at-least-once); the relay does not count it against the row.
var ErrBrokerUnavailable = errors.New("broker unavailable")

// errNotAnOutage marks a message given no verdict although the broker answers: another
// message of its window made the broker close the channel (a refused exchange or routing key,
// a body over the broker's limit), or a publish of the same message is in flight already. A
// relay sends it again at its next batch instead of pausing for an outage.
var errNotAnOutage = errors.New("the broker answers")

// errUnconfirmed marks a message given no verdict on a connection that is still up: no confirm
// came within the window's ConfirmTimeout, or the broker closed the channel for a reason not
// known to be a message's fault (a quorum queue without a majority, say, confirms nothing). A
// new connection, which is what [Publisher.Connect] checks, says nothing of its end: a relay
// waits for a batch the broker gives verdicts on instead.
var errUnconfirmed = errors.New("the connection is up, the broker said nothing")

// errWindowTimedOut is the cause of a window's end at its ConfirmTimeout, told apart from its
// caller's context ending: only the timeout says something of the broker.
var errWindowTimedOut = errors.New("confirm timeout")

// windowOverrun is how long a window may take past its ConfirmTimeout: up to closeWait to read
// why the broker closed a channel, a second to close a connection that timed out, and a second
// of slack.
const windowOverrun = closeWait + 2*time.Second

// DefaultMaxMessageBytes is the largest message body a publisher sends and a consumer accepts
// unless configured otherwise.
const DefaultMaxMessageBytes = 1 << 20

// PublisherConfig configures a [Publisher]. URL is required.
type PublisherConfig struct {
	URL            string // RabbitMQ URL, vhost included; for a cluster, a comma-separated list of the nodes' URLs, all with the same vhost, tried in a random order (one that does not parse is passed over, with a warning when the Publisher is made; if none parses, Connect fails)
	ConnectionName string // shown by the broker; helps find the connection in rabbitmqctl
	AppID          string // the AMQP app_id of every message
	// Topology is declared on every new connection, before the first publish on it (see
	// [Topology.Declare]): at least the exchanges of the messages, and, so that no message is
	// published before a queue that should take it exists, every consumer's queue. An exchange
	// of it that the connection declared, deleted, comes back with the next (or the next fails
	// to start, the broker's fault); one taken on trust, missing, is charged to its messages.
	Topology Topology
	// ConfirmTimeout bounds each window of up to MaxInFlight messages of a call (the wait for
	// room, the writes and the confirms): a broker that stops reading or a half-open connection
	// must not hold the caller forever. What the broker confirmed within it counts; a single
	// message the link cannot carry within it never does. The wait behind another call's
	// connection attempt counts too: a broker that accepts a connection and then stalls holds
	// no relay lane's claimed rows much longer than this. Default 15 s.
	ConfirmTimeout time.Duration
	Heartbeat      time.Duration // default 10 s; at least 1 s, as AMQP carries whole seconds
	// MaxInFlight is the most messages awaiting their confirms at once, over all concurrent
	// calls. Default 1000.
	MaxInFlight int
	// MaxMessageBytes: a larger body is refused with [ErrTooLarge] before publishing; one
	// that is JSON, up to half again as large (what PostgreSQL's jsonb adds in spaces), is
	// measured, and sent, without its insignificant white space first. Default
	// [DefaultMaxMessageBytes], what a [Subscription] accepts by default.
	MaxMessageBytes int
	// Reconnect paces the dial attempts after failures. Default 100 ms doubling up to 2 s,
	// jittered: a broker that comes back is found within about 2 s.
	Reconnect Backoff
	Logger    *slog.Logger
}

// Publisher publishes messages with mandatory routing and publisher confirms, over a
// connection that it opens on first use and opens again, by itself, after it breaks.
// It is safe for concurrent use: calls write their messages one call at a time on one channel,
// and wait for their confirms side by side. A call whose context ends while it waits for its
// confirms leaves the others' windows alone: its messages' places among the MaxInFlight are
// given back when their confirms come, or, if they have not all come by the window's
// ConfirmTimeout, the connection is closed then, as for a window that timed out. One whose
// context ends while its messages are still being written, a window whose ConfirmTimeout runs
// out with a confirm still to come, or one whose channel the broker closed, closes the connection (a write the broker does
// not read would hold every call), and every other window still waiting on it gets
// [ErrBrokerUnavailable] for its unconfirmed messages.
//
// It is the relay's [Sender]. An event that a transaction's work causes goes through [Enqueue]
// in that transaction, never straight to Publish after the commit: a crash or a broker outage
// between the two would lose it, the dual write the outbox exists to avoid.
type Publisher struct {
	cfg      PublisherConfig
	log      *slog.Logger
	inFlight *semaphore.Weighted // messages awaiting a verdict, over all calls

	// lock guards the fields below and serialises writes to the channel. A caller's wait for
	// it ends with the caller's context: the holder may be dialling a broker that stalls.
	lock      *semaphore.Weighted
	sess      *pubSession
	failures  int
	nextDial  time.Time
	lastError error
}

// NewPublisher returns a Publisher; it does not connect until the first Publish.
func NewPublisher(cfg PublisherConfig) *Publisher {
	if cfg.ConfirmTimeout <= 0 {
		cfg.ConfirmTimeout = 15 * time.Second
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = 1000
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = DefaultMaxMessageBytes
	}
	cfg.Reconnect = cfg.Reconnect.withDefaults(100*time.Millisecond, 2*time.Second)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	p := &Publisher{cfg: cfg, log: cfg.Logger.With("component", "publisher"), inFlight: semaphore.NewWeighted(int64(cfg.MaxInFlight)), lock: semaphore.NewWeighted(1)}
	warnUnparseableURLs(p.log, "PublisherConfig.URL", cfg.URL)
	return p
}

// Connect opens the connection and declares the topology now, instead of at the first Publish,
// so a misconfiguration shows at start. It also tells whether the broker takes messages: it
// fails while the broker blocks the connection. A failure is not final, Publish keeps trying,
// but for a configuration no broker can mend (no broker URL, or none that parses, an AppID over
// 255 bytes), which Connect returns as it is.
func (p *Publisher) Connect(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := p.cfg.check(); err != nil {
		return err // the configuration's fault, which no broker can mend: not ErrBrokerUnavailable
	}
	if err := p.lock.Acquire(ctx, 1); err != nil {
		return unavailable("wait for another call's connection attempt or writes: %w", err)
	}
	defer p.lock.Release(1)
	s, err := p.sessionLocked(ctx)
	if err != nil {
		return err
	}
	return s.watch.blockedErr()
}

// Publish sends each message to its exchange with its routing key (see [Message.Exchange]),
// and waits for the broker's verdict on all of them. It returns one error per message, in
// order: nil means the broker confirmed it and routed it to at least one queue;
// [ErrUnroutable], [ErrNoExchange], [ErrAccessRefused], [ErrNacked], [ErrTooLarge] and
// [ErrInvalidEnvelope] are verdicts on that message; [ErrBrokerUnavailable] means there was none
// (also given to a message whose earlier publish on the connection is not settled yet: a
// return names its message by id alone). Anything but nil means the message must be treated as
// not sent (and may still have been delivered: at-least-once).
func (p *Publisher) Publish(ctx context.Context, msgs []Message) []error {
	errs := make([]error, len(msgs))
	for start := 0; start < len(msgs); start += p.cfg.MaxInFlight {
		end := min(start+p.cfg.MaxInFlight, len(msgs))
		p.publishWindow(ctx, msgs[start:end], errs[start:end])
	}
	return errs
}

// PublishTimeout is the longest a Publish of n messages takes: ConfirmTimeout for each window
// of up to MaxInFlight messages, and a few seconds more for each, to read why the broker closed
// a channel and to close a connection that timed out. A [Relay] has the database end a batch's
// transaction left idle longer than that, and some margin (see [Sender]).
func (p *Publisher) PublishTimeout(n int) time.Duration {
	windows := max(1, (n+p.cfg.MaxInFlight-1)/p.cfg.MaxInFlight)
	return time.Duration(windows) * (p.cfg.ConfirmTimeout + windowOverrun)
}

// publishWindow publishes up to MaxInFlight messages and fills in their verdicts.
func (p *Publisher) publishWindow(ctx context.Context, msgs []Message, errs []error) {
	// ConfirmTimeout bounds the whole window, the wait for a place among the in-flight
	// messages and the writes included.
	expires := time.Now().Add(p.cfg.ConfirmTimeout)
	ctx, cancel := context.WithDeadlineCause(ctx, expires, errWindowTimedOut)
	defer cancel()
	msgs = compactOversized(msgs, p.cfg.MaxMessageBytes)
	if err := p.inFlight.Acquire(ctx, int64(len(msgs))); err != nil {
		fill(errs, unavailable("wait for room among the messages in flight: %w", err))
		return
	}
	s, confirms := p.write(ctx, msgs, errs)
	if s == nil {
		p.inFlight.Release(int64(len(msgs)))
		return
	}
	p.settle(ctx, expires, s, msgs, confirms, errs)
}

// settle fills in the verdicts of a window written on s, whose context ctx ends at expires (its
// ConfirmTimeout) at the latest, and gives its places among the MaxInFlight back: at once, or
// once the confirms still awaited come, or once s is retired.
func (p *Publisher) settle(ctx context.Context, expires time.Time, s *pubSession, msgs []Message, confirms []*amqp.DeferredConfirmation, errs []error) {
	blocked, awaited := s.verdicts(ctx, msgs, confirms, errs, p.cfg.ConfirmTimeout)
	if blocked {
		// Blocked by the broker: return now, so no caller holds anything open through a
		// resource alarm, and let the confirms come in later on a connection kept open. Not
		// for ever: once unblocked, the broker has ConfirmTimeout to confirm them, as any
		// window (see unblockedFor), or the connection is retired. A broker that withholds
		// them on a connection it keeps up would hold the window's places and ids for good.
		go func() {
			expired, done := make(chan time.Time), make(chan struct{})
			go s.watch.unblockedFor(p.cfg.ConfirmTimeout, expired, done)
			s.settleLate(confirms, msgs, expired)
			close(done)
			p.inFlight.Release(int64(len(msgs)))
		}()
		return
	}
	switch {
	case s.ch.IsClosed() || awaited && errors.Is(context.Cause(ctx), errWindowTimedOut):
		// A confirm still awaited at the window's timeout: the connection is retired, and the
		// other windows on it get no verdict for what they still await. Not when every confirm
		// came, the last just as the time ran out: a healthy connection closed would cost the
		// other windows their confirms, their messages published again.
		//
		// Retired before its places are given back: its messages' returns may still come, and
		// a window given those places must not publish where they would fill the returns'
		// buffer (MaxInFlight), or the client would drop one of its returns after 5 s and its
		// message count as routed. Closed, not taken out under the lock, which a Connect to a
		// stalled broker may hold: the next call finds it closed and dials again. Closed before
		// its ids are released too: a window written on it in between could publish one of
		// them again and take the late return of the earlier publish as its own.
		s.close()
		s.release(msgs, confirms)
		p.inFlight.Release(int64(len(msgs)))
	case awaited:
		// The caller stopped waiting, which says nothing of the broker: the connection, and the
		// other calls' windows on it, go on. The places are given back once the confirms come,
		// the returns with them, for the same reason; or once the connection closes, by the
		// window's own ConfirmTimeout at the latest.
		go func() {
			expiry := time.NewTimer(time.Until(expires))
			defer expiry.Stop()
			s.settleLate(confirms, msgs, expiry.C)
			p.inFlight.Release(int64(len(msgs)))
		}()
	default:
		s.release(msgs, confirms)
		p.inFlight.Release(int64(len(msgs)))
	}
}

// write publishes the window on the current session (connecting first if needed), under the
// lock: concurrent calls interleave whole windows, not single messages. A nil session means
// nothing was published; errs says why.
func (p *Publisher) write(ctx context.Context, msgs []Message, errs []error) (*pubSession, []*amqp.DeferredConfirmation) {
	if err := p.lock.Acquire(ctx, 1); err != nil {
		fill(errs, unavailable("wait for another call's connection attempt or writes: %w", err))
		return nil, nil
	}
	defer p.lock.Release(1)
	s, err := p.sessionLocked(ctx)
	if err == nil {
		err = s.watch.blockedErr()
	}
	if err == nil && ctx.Err() != nil {
		// The wait for the lock outlasted the window: publish nothing, close nothing.
		err = unavailable("no time left to publish: %w", ctx.Err())
	}
	if err != nil {
		fill(errs, err)
		return nil, nil
	}
	// A broker that stops reading (a memory alarm, a half-open connection) blocks the socket
	// write itself, and the context is only checked before writing. Closing the connection
	// would not end it once the client's reader has given the connection up for a missed
	// heartbeat (it is closed already, and waits for the channel the write holds): the
	// context's end, while the window is still being written, closes the socket itself.
	writing := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		select {
		case <-writing:
		default:
			_ = s.sock.Close()
		}
	})
	defer stop()
	defer close(writing) // before stop: an end that comes after the writes closes nothing
	confirms := make([]*amqp.DeferredConfirmation, len(msgs))
	for i, m := range msgs {
		if len(m.Payload) > p.cfg.MaxMessageBytes {
			errs[i] = fmt.Errorf("%w: %d bytes, the limit is %d", ErrTooLarge, len(m.Payload), p.cfg.MaxMessageBytes)
			continue
		}
		pub := toPublishing(m, p.cfg.AppID)
		if err := checkEnvelope(m.Exchange, m.routingKey(), pub, s.conn.Config.FrameSize); err != nil {
			errs[i] = err
			continue
		}
		if !s.reserve(m.ID) {
			errs[i] = unavailable("message %s: an earlier publish of it on this connection is not confirmed yet: %w", m.ID, errNotAnOutage)
			continue
		}
		if err := s.checkExchange(m.Exchange); err != nil {
			s.unreserve(m.ID)
			if !errors.Is(err, ErrNoExchange) && !errors.Is(err, ErrAccessRefused) {
				fill(errs[i:], err)
				break
			}
			errs[i] = err
			continue
		}
		dc, err := s.ch.PublishWithDeferredConfirmWithContext(ctx, m.Exchange, m.routingKey(), true, false, pub)
		if err != nil {
			s.unreserve(m.ID)
			err = unavailable("publish: %w", err)
			if s.closedForMessage(s.closeReason()) {
				err = fmt.Errorf("%w: the channel closed for an earlier message's refusal: %w", err, errNotAnOutage)
			}
			fill(errs[i:], err)
			break
		}
		if dc == nil {
			// No confirm, and no error: the client's answer on a channel not in confirm mode
			// (setup puts it in). Nothing this channel takes would ever be confirmed: the message
			// is not sent, nor is the rest of the window, and the connection is retired, so that
			// the next call dials one that confirms.
			s.unreserve(m.ID)
			fill(errs[i:], unavailable("publish: the channel is not in confirm mode, no confirm will come"))
			s.close()
			break
		}
		confirms[i] = dc
	}
	return s, confirms
}

// sessionLocked returns an open session, dialling if needed (until ctx ends), but not more
// often than the reconnect backoff allows.
func (p *Publisher) sessionLocked(ctx context.Context) (*pubSession, error) {
	if s := p.sess; s != nil && !s.ch.IsClosed() && !s.conn.IsClosed() {
		return s, nil
	}
	p.discardLocked()
	if wait := time.Until(p.nextDial); wait > 0 {
		return nil, unavailable("next connection attempt in %s: %w", wait.Round(time.Millisecond), p.lastError)
	}
	s, err := p.open(ctx)
	if err != nil && ctx.Err() != nil {
		// The caller gave up, which says nothing of the broker: no backoff for the next caller.
		return nil, unavailable("%w", err)
	}
	if err != nil {
		p.failures++
		p.nextDial = time.Now().Add(p.cfg.Reconnect.Delay(p.failures))
		p.lastError = err
		// Debug: the caller gets the error, and a relay logs the outage once at each end, not
		// each of its attempts.
		p.log.Debug("rabbitmq connection failed", "error", err, "failures", p.failures)
		return nil, unavailable("%w", err)
	}
	if p.failures > 0 {
		p.log.Debug("rabbitmq connection restored", "after_failures", p.failures)
	}
	p.failures, p.sess = 0, s
	return s, nil
}

// check finds what no broker can mend: Connect returns it as it is.
func (c PublisherConfig) check() error {
	if err := checkURLs(c.URL); err != nil {
		return fmt.Errorf("PublisherConfig.URL %w", err)
	}
	if len(c.AppID) > maxShortString {
		return fmt.Errorf("PublisherConfig.AppID is %d bytes; AMQP allows %d", len(c.AppID), maxShortString)
	}
	if err := checkHeartbeat(c.Heartbeat); err != nil {
		return fmt.Errorf("PublisherConfig.Heartbeat %w", err)
	}
	if err := c.Topology.check(); err != nil {
		return fmt.Errorf("PublisherConfig.Topology: %w", err)
	}
	return nil
}

func (p *Publisher) open(ctx context.Context) (*pubSession, error) {
	// Checked here too, where an error is the broker being unavailable to this publisher: as a
	// verdict on each message, it would charge every row for the configuration's fault.
	if err := p.cfg.check(); err != nil {
		return nil, err
	}
	conn, sock, err := dialSocket(ctx, p.cfg.URL, p.cfg.ConnectionName, p.cfg.Heartbeat)
	if err != nil {
		return nil, err
	}
	// Debug, as its failed reconnections: a relay logs the outage once at each end.
	s := &pubSession{conn: conn, sock: sock, watch: watchConnection(conn, p.log, slog.LevelDebug)}
	// As the dial, the setup ends with ctx: closing the connection ends every call waiting on it.
	setupOver := context.AfterFunc(ctx, func() { _ = conn.CloseDeadline(time.Now()) })
	err = s.setup(p.cfg, p.log)
	if !setupOver() {
		err = fmt.Errorf("set up the publisher: %w", ctx.Err())
	}
	if err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

func (p *Publisher) discardLocked() {
	if p.sess != nil {
		p.sess.close()
		p.sess = nil
	}
}

// Close closes the connection. Publish after Close opens a new one.
func (p *Publisher) Close() {
	p.lockAlways()
	defer p.lock.Release(1)
	p.discardLocked()
}

// lockAlways takes the lock however long its holder keeps it: a window, for its ConfirmTimeout
// at most, or a Connect, for as long as its dial and setup (their timeouts and heartbeats).
func (p *Publisher) lockAlways() {
	_ = p.lock.Acquire(context.Background(), 1) // fails only with its context, which never ends
}

// pubSession is one connection with its confirm-mode channel.
type pubSession struct {
	conn  *amqp.Connection
	sock  net.Conn // conn's socket
	ch    *amqp.Channel
	watch *connWatch

	// The broker sends a message's basic.return before its ack, and the client queues it in
	// returns before it resolves the confirm. So once a call's confirms are in, all its returns
	// are in returns or, moved there by another call, in returned.
	returnsMu sync.Mutex
	returns   chan amqp.Return
	returned  map[string]amqp.Return
	// unsettled holds the ids of the messages published and not yet settled. A return names
	// its message by id alone, so two publishes of one id in flight at once could not tell
	// whose it is: a window abandoned to a block could take the return of the same row
	// published again after it, which would then count as sent.
	unsettled map[uuid.UUID]bool
	// closes says why the broker closed ch; closeErr keeps it once read, and closeAwaited
	// says closeReason waited for it. closeMu guards them, held over that wait, whose outcome
	// every caller needs.
	closeMu      sync.Mutex
	closes       chan *amqp.Error
	closeErr     *amqp.Error
	closeAwaited bool

	// exchanges holds the exchanges known to exist on this connection, checked before the first
	// publish to each: a publish to a missing one would close the channel, and with it every
	// other message's confirm.
	exchanges map[string]bool
	// declares maps each of the Topology's exchanges to whether this connection declared it or
	// saw it exist, as the next will: deleted, such a one is the broker's state to mend, not a
	// message's fault. Those taken on trust (refused, their existence hidden) map to false.
	declares map[string]bool
}

func (s *pubSession) setup(cfg PublisherConfig, log *slog.Logger) error {
	trusted, err := cfg.Topology.declare(s.conn, log)
	if err != nil && !errors.Is(err, ErrLegacyDeadLetterQueue) {
		return fmt.Errorf("declare topology: %w", err)
	}
	s.exchanges = map[string]bool{"": true} // the default exchange always exists
	s.declares = make(map[string]bool)
	for _, x := range cfg.Topology.AllExchanges() {
		s.exchanges[x], s.declares[x] = true, !trusted[x]
	}
	ch, err := s.conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	s.ch = ch
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("enable publisher confirms: %w", err)
	}
	// Every message in flight may come back once: the semaphore keeps them within the buffer.
	s.returns = ch.NotifyReturn(make(chan amqp.Return, cfg.MaxInFlight))
	s.returned = make(map[string]amqp.Return)
	s.unsettled = make(map[uuid.UUID]bool)
	s.closes = ch.NotifyClose(make(chan *amqp.Error, 1))
	return nil
}

// reserve marks id as in flight, unless it is already.
func (s *pubSession) reserve(id uuid.UUID) bool {
	s.returnsMu.Lock()
	defer s.returnsMu.Unlock()
	if s.unsettled[id] {
		return false
	}
	s.unsettled[id] = true
	return true
}

func (s *pubSession) unreserve(id uuid.UUID) {
	s.returnsMu.Lock()
	defer s.returnsMu.Unlock()
	delete(s.unsettled, id)
}

// release ends the flight of a window's published messages, once their verdicts are in.
func (s *pubSession) release(msgs []Message, confirms []*amqp.DeferredConfirmation) {
	s.returnsMu.Lock()
	defer s.returnsMu.Unlock()
	for i, dc := range confirms {
		if dc != nil {
			delete(s.unsettled, msgs[i].ID)
		}
	}
}

// checkExchange returns nil if exchange exists, ErrNoExchange if it does not, and
// ErrBrokerUnavailable if the broker did not say. It asks on a channel of its own, which the
// broker closes when the exchange is missing.
func (s *pubSession) checkExchange(exchange string) error {
	if s.exchanges[exchange] {
		return nil
	}
	ch, err := s.conn.Channel()
	if err != nil {
		return unavailable("open channel: %w", err)
	}
	err = ch.ExchangeDeclarePassive(exchange, amqp.ExchangeTopic, true, false, false, false, nil)
	var amqpErr *amqp.Error
	switch {
	case err == nil:
		_ = ch.Close()
		s.exchanges[exchange] = true
		return nil
	case errors.As(err, &amqpErr) && amqpErr.Code == amqp.NotFound:
		return fmt.Errorf("%w: %q", ErrNoExchange, exchange)
	case errors.As(err, &amqpErr) && amqpErr.Code == amqp.AccessRefused:
		return fmt.Errorf("%w: exchange %q: %s", ErrAccessRefused, exchange, amqpErr.Reason)
	default:
		return unavailable("check exchange %q: %w", exchange, err)
	}
}

// verdicts fills in errs from the confirms and the returns. It reports whether it stopped
// early because the broker blocked the connection; even then, a message confirmed before the
// block that came back unroutable is not counted as sent: its return came before its confirm.
// It reports too whether some published message was left without its confirm (see await).
func (s *pubSession) verdicts(ctx context.Context, msgs []Message, confirms []*amqp.DeferredConfirmation, errs []error, timeout time.Duration) (blocked, awaited bool) {
	blocked, awaited = s.await(ctx, msgs, confirms, errs, timeout)
	s.matchReturns(msgs, confirms, errs)
	return blocked, awaited
}

// await collects the confirms into errs. It returns blocked as soon as the broker blocks the
// connection, and stops when ctx ends, either way with the confirms not come yet as
// ErrBrokerUnavailable; awaited says whether there were any such (a wait stopped early with
// every confirm in hand leaves none).
func (s *pubSession) await(ctx context.Context, msgs []Message, confirms []*amqp.DeferredConfirmation, errs []error, timeout time.Duration) (blocked, awaited bool) {
	for i, dc := range confirms {
		if dc == nil {
			continue
		}
		select {
		case <-dc.Done():
		case <-ctx.Done():
			return false, s.settledOrNot(msgs[i:], confirms[i:], errs[i:], s.unconfirmed(ctx, timeout))
		case <-s.watch.blockedC():
			// Not blockedErr: the broker may have unblocked the connection since, and its nil
			// would count every message still awaited as sent.
			return true, s.settledOrNot(msgs[i:], confirms[i:], errs[i:], unavailable("the broker blocked the connection before the confirms came"))
		}
		errs[i] = s.confirmed(msgs[i], dc)
	}
	return false, false
}

// unconfirmed is the error of a message whose confirm had not come when ctx ended: the
// window's timeout, on a connection still up, is errUnconfirmed.
func (s *pubSession) unconfirmed(ctx context.Context, timeout time.Duration) error {
	switch {
	case !errors.Is(context.Cause(ctx), errWindowTimedOut):
		return unavailable("the caller stopped waiting for the confirm: %w", ctx.Err())
	case s.conn.IsClosed():
		return unavailable("no confirm within %s: %w", timeout, ctx.Err())
	default:
		return unavailable("no confirm within %s: %w: %w", timeout, ctx.Err(), errUnconfirmed)
	}
}

// settledOrNot gives each message still awaited when the wait stopped early the verdict its
// confirm has if it came (the select that stopped the wait picks at random among what is
// ready, and a confirm in hand must count), and err, no verdict, if not. It reports whether any
// got err.
func (s *pubSession) settledOrNot(msgs []Message, confirms []*amqp.DeferredConfirmation, errs []error, err error) (awaited bool) {
	for i, dc := range confirms {
		if dc == nil {
			continue
		}
		select {
		case <-dc.Done():
			errs[i] = s.confirmed(msgs[i], dc)
		default:
			errs[i], awaited = err, true
		}
	}
	return awaited
}

// confirmed is the verdict of m's confirm dc, which came.
func (s *pubSession) confirmed(m Message, dc *amqp.DeferredConfirmation) error {
	switch {
	case dc.Acked():
		return nil
	case s.ch.IsClosed():
		// The channel closed (the exchange is gone, or the connection): every pending confirm
		// resolves as a nack, which says nothing about the message, unless the broker closed it
		// for a publish to the message's exchange.
		return s.closedVerdict(m)
	default:
		return ErrNacked
	}
}

// writeRefused is the reason RabbitMQ gives when it closes a channel for a publish to an
// exchange the user may not write to, or with a routing key its topic permissions refuse (3.x
// says "access to", 4.x "write access to"). On a channel that only publishes, nothing else is
// refused an exchange.
var writeRefused = regexp.MustCompile(`^ACCESS_REFUSED - (?:write )?access to (?:topic '(.*)' in )?exchange '(.*)' in vhost '.*' refused for user '.*'$`)

// internalRefused is the reason RabbitMQ gives when it closes a channel for a publish to an
// internal exchange (one only other exchanges may route to), which a passive declare does not
// tell apart.
var internalRefused = regexp.MustCompile(`^ACCESS_REFUSED - cannot publish to internal exchange '(.*)' in vhost '.*'$`)

// tooLargeForBroker is the reason RabbitMQ gives when it closes a channel for a body over its
// max_message_size (16 MiB by default on 4.x; without "configured" at its hard cap, 512 MiB):
// PublisherConfig.MaxMessageBytes may be larger.
var tooLargeForBroker = regexp.MustCompile(`^PRECONDITION_FAILED - message size \d+ is larger than (?:configured )?max size (\d+)$`)

// missingPrefix begins the reason RabbitMQ gives when it closes a channel for a publish to an
// exchange that does not exist: "NOT_FOUND - no exchange 'X' in vhost 'V'".
const missingPrefix = "NOT_FOUND - no exchange '"

// closedForMissing reports whether the broker closed a channel for reason, a publish to
// exchange, missing. A reason the broker cut short covers exchange if it begins as its would.
func closedForMissing(reason *amqp.Error, exchange string) bool {
	if reason == nil || reason.Code != amqp.NotFound {
		return false
	}
	head := missingPrefix + exchange + "' in vhost '"
	if cut, ok := strings.CutSuffix(reason.Reason, cutReason); ok {
		return strings.HasPrefix(head, cut) || strings.HasPrefix(cut, head)
	}
	return strings.HasPrefix(reason.Reason, head)
}

// closedForMessage reports whether the broker closed the channel for reason, one message's
// fault: closedForRefusal, or a publish to a missing exchange that the next connection does not
// declare again. An exchange of the Topology this connection declared or saw exist is declared
// or checked by the next: deleted, it is the broker's state, not a message's fault.
func (s *pubSession) closedForMessage(reason *amqp.Error) bool {
	if closedForRefusal(reason) {
		return true
	}
	if reason == nil || reason.Code != amqp.NotFound || !strings.HasPrefix(reason.Reason, missingPrefix) {
		return false
	}
	for x, declared := range s.declares {
		if declared && closedForMissing(reason, x) {
			return false
		}
	}
	return true
}

// closedVerdict is the verdict on m, unconfirmed when ch closed: ErrAccessRefused if the broker
// closed ch for a publish to m's exchange (with m's routing key, for a topic permission; or an
// internal exchange), ErrNoExchange if for a publish to m's exchange, missing and not one the
// next connection declares, ErrTooLarge if for a body larger than the broker takes and m's is,
// else none (errUnconfirmed if the connection is still up). Every such message would close it
// again, batch after batch, and with it the confirms of all the others.
func (s *pubSession) closedVerdict(m Message) error {
	reason := s.closeReason()
	if refuses(reason, m) {
		return closedFor{fmt.Errorf("%w: exchange %q: %s", ErrAccessRefused, m.Exchange, reason.Reason)}
	}
	if closedForMissing(reason, m.Exchange) && !s.declares[m.Exchange] {
		return closedFor{fmt.Errorf("%w: %q: %s", ErrNoExchange, m.Exchange, reason.Reason)}
	}
	if most, ok := brokerMaxSize(reason); ok && len(m.Payload) > most {
		return closedFor{fmt.Errorf("%w: %d bytes, the broker's limit is %d: %s", ErrTooLarge, len(m.Payload), most, reason.Reason)}
	}
	if s.closedForMessage(reason) {
		return unavailable("channel closed before the confirm, for another message's refusal: %w", errNotAnOutage)
	}
	if s.conn.IsClosed() {
		return unavailable("channel closed before the confirm")
	}
	// The broker closed the channel and kept the connection, for a reason not known here: a new
	// channel does not say that it confirms again.
	why := "no reason given"
	if reason != nil {
		why = reason.Error()
	}
	return unavailable("the broker closed the channel before the confirm (%s): %w", why, errUnconfirmed)
}

// closedFor is a verdict read from the reason the broker closed the channel for the message's
// publish: unlike the same verdict from a check before the publish, it is the broker's answer to
// the publish (see brokerAnswered).
type closedFor struct{ error }

func (c closedFor) Unwrap() error { return c.error }

// closeWait bounds closeReason's wait for the reason of a closed channel. The client hands it
// over, or closes closes without one, once it has sent the broker its close-ok and taken the
// channel's locks: at once, unless its socket or the machine is stalled.
const closeWait = time.Second

// closeReason is why the broker closed the channel; nil if it did not (the client closed it),
// or the channel is open. The client marks a channel closed before it hands over the broker's
// reason: a publish or a confirm failing in between would find none and be taken for an
// outage, so the reason of a closed channel is waited for, closeWait at most the first time
// (the caller, holding the publisher, waits with it), and looked for without waiting after.
func (s *pubSession) closeReason() *amqp.Error {
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if s.closeErr != nil || !s.ch.IsClosed() {
		return s.closeErr
	}
	if s.closeAwaited {
		select {
		case s.closeErr = <-s.closes:
		default:
		}
		return s.closeErr
	}
	t := time.NewTimer(closeWait)
	defer t.Stop()
	select {
	case s.closeErr = <-s.closes:
	case <-t.C:
	}
	s.closeAwaited = true
	return s.closeErr
}

// closedForRefusal reports whether the broker closed a channel for reason, one message's fault: on a
// channel that only publishes, a refused exchange or routing key, or a body over its limit.
func closedForRefusal(reason *amqp.Error) bool {
	_, tooLarge := brokerMaxSize(reason)
	return tooLarge || reason != nil && reason.Code == amqp.AccessRefused
}

// refuses reports whether the broker closed a channel for reason, a publish of m's. A reason
// the broker cut short covers m if it begins as m's would.
func refuses(reason *amqp.Error, m Message) bool {
	if r, ok := readRefusal(reason); ok {
		return r.covers(m)
	}
	if reason == nil || reason.Code != amqp.AccessRefused {
		return false
	}
	cut, ok := strings.CutSuffix(reason.Reason, cutReason)
	if !ok {
		return false
	}
	x := m.Exchange
	if x == "" {
		x = "amq.default"
	}
	for _, refused := range []string{"ACCESS_REFUSED - access to ", "ACCESS_REFUSED - write access to ", "ACCESS_REFUSED - cannot publish to internal "} {
		for _, what := range []string{"exchange '" + x + "'", "topic '" + m.routingKey() + "' in exchange '" + x + "'"} {
			if head := refused + what + " in vhost '"; strings.HasPrefix(head, cut) || strings.HasPrefix(cut, head) {
				return true
			}
		}
	}
	return false
}

// cutReason ends a reason RabbitMQ cut short: one longer than an AMQP short string (a topic
// permission's quotes the routing key, up to 255 bytes itself) is cut at 252 bytes and ends so.
// Cut in the routing key, it covers every key that begins as the refused one did.
const cutReason = "..."

// writeRefusal is what the broker closed a channel for: publishing to exchange, or, if byKey (a
// topic permission), publishing there with the routing key key.
type writeRefusal struct {
	exchange, key string
	byKey         bool
}

func (r writeRefusal) covers(m Message) bool {
	return r.exchange == m.Exchange && (!r.byKey || r.key == m.routingKey())
}

// readRefusal reads the refusal a channel was closed for from the broker's reason.
func readRefusal(reason *amqp.Error) (writeRefusal, bool) {
	if reason == nil || reason.Code != amqp.AccessRefused {
		return writeRefusal{}, false
	}
	text := reason.Reason
	var r writeRefusal
	if x := writeRefused.FindStringSubmatchIndex(text); x != nil {
		r.exchange = text[x[4]:x[5]]
		if x[2] >= 0 {
			r.key, r.byKey = text[x[2]:x[3]], true
		}
	} else if x := internalRefused.FindStringSubmatch(text); x != nil {
		r.exchange = x[1]
	} else {
		return writeRefusal{}, false
	}
	if r.exchange == "amq.default" {
		r.exchange = "" // the default exchange's name in permissions and reasons
	}
	return r, true
}

// brokerMaxSize reads the broker's max_message_size from the reason it closed a channel for a
// body over it.
func brokerMaxSize(reason *amqp.Error) (int, bool) {
	if reason == nil || reason.Code != amqp.PreconditionFailed {
		return 0, false
	}
	x := tooLargeForBroker.FindStringSubmatch(reason.Reason)
	if x == nil {
		return 0, false
	}
	most, err := strconv.Atoi(x[1])
	return most, err == nil
}

// matchReturns turns the confirmed messages that came back with a basic.return into
// ErrUnroutable. Only the window's own publishes take a return: a copy it did not publish (its
// id in flight in another window) would take the return of the other's, which would then count
// its unroutable message as sent.
func (s *pubSession) matchReturns(msgs []Message, confirms []*amqp.DeferredConfirmation, errs []error) {
	s.returnsMu.Lock()
	defer s.returnsMu.Unlock()
	s.collectReturnsLocked()
	for i, m := range msgs {
		if confirms[i] == nil {
			continue
		}
		r, ok := s.returned[m.ID.String()]
		if !ok {
			continue
		}
		delete(s.returned, m.ID.String())
		if errs[i] == nil {
			errs[i] = fmt.Errorf("%w: exchange %q routing key %q: %d %s", ErrUnroutable, r.Exchange, r.RoutingKey, r.ReplyCode, r.ReplyText)
		}
	}
}

func (s *pubSession) collectReturnsLocked() {
	for {
		select {
		case r, ok := <-s.returns:
			if !ok {
				return
			}
			s.returned[r.MessageId] = r
		default:
			return
		}
	}
}

// settleLate waits out the confirms of a window nobody waits for any more, and drops its
// returns; if expired fires first, it closes the connection (no return comes any more). That
// is ConfirmTimeout after the broker unblocks the connection, for a window abandoned to a
// block; the window's own ConfirmTimeout, for one whose caller stopped waiting. A broker that
// withholds the confirms on a connection it keeps would otherwise hold the window's places
// among the MaxInFlight for good, and the later windows, finding no room, would close nothing:
// the publisher would be wedged.
func (s *pubSession) settleLate(confirms []*amqp.DeferredConfirmation, msgs []Message, expired <-chan time.Time) {
	for _, dc := range confirms {
		if dc == nil {
			continue
		}
		select {
		case <-dc.Done():
		case <-expired:
			s.close() // no return comes any more
			s.release(msgs, confirms)
			return
		}
	}
	s.matchReturns(msgs, confirms, make([]error, len(msgs)))
	s.release(msgs, confirms)
}

func (s *pubSession) close() {
	// Closing the connection closes its channel too. The deadline matters: a half-open
	// connection never answers the close handshake (nor would a channel's).
	_ = s.conn.CloseDeadline(time.Now().Add(time.Second))
}

func unavailable(format string, args ...any) error {
	return fmt.Errorf("%w: %w", ErrBrokerUnavailable, fmt.Errorf(format, args...))
}

// compactOversized returns msgs with each payload over most that is JSON without its
// insignificant white space (a copy of msgs, if any changed; before the lock, which a large
// payload's compaction would hold). PostgreSQL gives a jsonb column back with a space after
// every ':' and ',', half as long again at most (an array of small numbers): a payload within
// the limit when it was enqueued is measured, and sent, as it was. One longer than that cannot
// fit, and is not compacted at each retry in vain.
func compactOversized(msgs []Message, most int) []Message {
	out, copied := msgs, false
	for i, m := range msgs {
		if len(m.Payload) <= most || len(m.Payload) > most+most/2+1 {
			continue
		}
		var b bytes.Buffer
		if json.Compact(&b, m.Payload) != nil {
			continue // not JSON: measured as it is
		}
		if !copied {
			out, copied = slices.Clone(msgs), true
		}
		out[i].Payload = b.Bytes()
	}
	return out
}

func fill(errs []error, err error) {
	for i := range errs {
		errs[i] = err
	}
}
