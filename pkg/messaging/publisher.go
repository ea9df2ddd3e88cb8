package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

var (
	// ErrUnroutable: the broker confirmed the message but no queue was bound to take it (a
	// basic.return). It was not delivered anywhere, so it does not count as sent.
	ErrUnroutable = errors.New("message unroutable")
	// ErrNacked: the broker refused the message, or the channel closed before confirming it.
	ErrNacked = errors.New("message not confirmed by the broker")
	// ErrNotPublished: the message was never handed to the broker, because an earlier message
	// of the same call failed to publish (a broken connection). Its attempt does not count.
	ErrNotPublished = errors.New("message not published")
)

// PublisherConfig configures a [Publisher]. URL is required.
type PublisherConfig struct {
	URL            string
	ConnectionName string // shown by the broker; helps find the connection in rabbitmqctl
	AppID          string // the AMQP app_id of every message
	// Setup declares what the publisher needs (at least its exchange). It runs on every new
	// channel, so a deleted exchange comes back after the next reconnect.
	Setup func(ch *amqp.Channel) error
	// ConfirmTimeout bounds the wait for one call's confirms: a blocked broker (memory alarm)
	// or a half-open connection must not hold the caller forever. Default 15 s.
	ConfirmTimeout time.Duration
	Heartbeat      time.Duration // default 10 s
	// MaxInFlight is the most messages one call publishes before waiting for their confirms.
	// Default 1000.
	MaxInFlight int
	// Reconnect paces the dial attempts after failures. Default 100 ms doubling up to 5 s.
	Reconnect Backoff
	Logger    *slog.Logger
}

// Publisher publishes messages with mandatory routing and publisher confirms, over a
// connection that it opens on first use and opens again, by itself, after it breaks.
// It is safe for concurrent use; calls are serialised on one channel.
type Publisher struct {
	cfg PublisherConfig
	log *slog.Logger

	mu        sync.Mutex
	conn      *amqp.Connection
	ch        *amqp.Channel
	returns   chan amqp.Return
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
	cfg.Reconnect = cfg.Reconnect.withDefaults(100*time.Millisecond, 5*time.Second)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Publisher{cfg: cfg, log: cfg.Logger.With("component", "publisher")}
}

// Connect opens the connection and declares the topology now, instead of at the first Publish,
// so a misconfiguration shows at start. A failure is not final: Publish keeps trying.
func (p *Publisher) Connect(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	return p.connectLocked()
}

// Publish sends msgs to exchange, each with its Type as the routing key, and waits for the
// broker's verdict on all of them. It returns one error per message, in order: nil means the
// broker confirmed it and routed it to at least one queue. Anything else means the message
// must be treated as not sent (and may still have been delivered: at-least-once).
func (p *Publisher) Publish(ctx context.Context, exchange string, msgs []Message) []error {
	errs := make([]error, len(msgs))
	for start := 0; start < len(msgs); start += p.cfg.MaxInFlight {
		end := min(start+p.cfg.MaxInFlight, len(msgs))
		p.publishWindow(ctx, exchange, msgs[start:end], errs[start:end])
	}
	return errs
}

func (p *Publisher) publishWindow(ctx context.Context, exchange string, msgs []Message, errs []error) {
	p.mu.Lock()
	defer p.mu.Unlock()

	if err := p.connectLocked(); err != nil {
		errs[0] = err
		for i := 1; i < len(errs); i++ {
			errs[i] = ErrNotPublished
		}
		return
	}

	// ConfirmTimeout bounds the whole call, writes included: a broker that stops reading (a
	// memory alarm, a stalled link) blocks the socket write itself, and the context is only
	// checked before writing. Closing the connection at the deadline unblocks it.
	waitCtx, cancel := context.WithTimeout(ctx, p.cfg.ConfirmTimeout)
	defer cancel()
	conn := p.conn
	stop := context.AfterFunc(waitCtx, func() { _ = conn.CloseDeadline(time.Now()) })
	defer stop()

	// Publish the whole window, then collect the confirms: many in flight, one round trip.
	broken := false
	confirms := make([]*amqp.DeferredConfirmation, len(msgs))
	for i, m := range msgs {
		dc, err := p.ch.PublishWithDeferredConfirmWithContext(waitCtx, exchange, m.Type, true, false, toPublishing(m, p.cfg.AppID))
		if err != nil {
			errs[i] = fmt.Errorf("publish: %w", err)
			for j := i + 1; j < len(msgs); j++ {
				errs[j] = ErrNotPublished
			}
			broken = true
			break
		}
		confirms[i] = dc
	}

	for i, dc := range confirms {
		if dc == nil {
			continue
		}
		ack, err := dc.WaitContext(waitCtx)
		switch {
		case err != nil || (!ack && waitCtx.Err() != nil):
			// Timed out (the deadline also closed the connection, which nacks the rest). The
			// channel's state is unknown now: start afresh.
			errs[i] = fmt.Errorf("wait for confirm: %w", waitCtx.Err())
			broken = true
		case !ack && p.ch.IsClosed():
			errs[i] = fmt.Errorf("%w: channel closed", ErrNacked)
		case !ack:
			errs[i] = ErrNacked
		}
	}

	// The broker sends a basic.return before the ack of the same message, and the client hands
	// it to p.returns before it resolves the confirm. So every return of this window is already
	// buffered here (the buffer holds MaxInFlight, so none was dropped).
	returned := p.drainReturnsLocked()
	for i, m := range msgs {
		if r, ok := returned[m.ID.String()]; ok && errs[i] == nil {
			errs[i] = fmt.Errorf("%w: exchange %q routing key %q: %d %s", ErrUnroutable, r.Exchange, r.RoutingKey, r.ReplyCode, r.ReplyText)
		}
	}

	if broken || p.ch.IsClosed() {
		p.resetLocked()
	}
}

func (p *Publisher) drainReturnsLocked() map[string]amqp.Return {
	var returned map[string]amqp.Return
	for {
		select {
		case r, ok := <-p.returns:
			if !ok {
				return returned
			}
			if returned == nil {
				returned = make(map[string]amqp.Return)
			}
			returned[r.MessageId] = r
		default:
			return returned
		}
	}
}

// connectLocked makes sure there is an open confirm-mode channel, dialling if needed, but not
// more often than the reconnect backoff allows.
func (p *Publisher) connectLocked() error {
	if p.ch != nil && !p.ch.IsClosed() && !p.conn.IsClosed() {
		return nil
	}
	p.resetLocked()
	if wait := time.Until(p.nextDial); wait > 0 {
		return fmt.Errorf("rabbitmq unavailable, next connection attempt in %s: %w", wait.Round(time.Millisecond), p.lastError)
	}
	if err := p.openLocked(); err != nil {
		p.failures++
		p.nextDial = time.Now().Add(p.cfg.Reconnect.Delay(p.failures))
		p.lastError = err
		p.resetLocked()
		p.log.Warn("rabbitmq connection failed", "error", err, "failures", p.failures)
		return err
	}
	if p.failures > 0 {
		p.log.Info("rabbitmq connection restored", "after_failures", p.failures)
	}
	p.failures = 0
	return nil
}

func (p *Publisher) openLocked() error {
	conn, err := dial(p.cfg.URL, p.cfg.ConnectionName, p.cfg.Heartbeat)
	if err != nil {
		return err
	}
	p.conn = conn
	watchConnection(conn, p.log)
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	p.ch = ch
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("enable publisher confirms: %w", err)
	}
	p.returns = ch.NotifyReturn(make(chan amqp.Return, p.cfg.MaxInFlight))
	if p.cfg.Setup != nil {
		if err := p.cfg.Setup(ch); err != nil {
			return fmt.Errorf("declare topology: %w", err)
		}
	}
	return nil
}

func (p *Publisher) resetLocked() {
	if p.conn != nil {
		// Closing the connection closes its channel too. The deadline matters: a half-open
		// connection never answers the close handshake (nor would a channel's).
		_ = p.conn.CloseDeadline(time.Now().Add(time.Second))
	}
	p.ch, p.conn, p.returns = nil, nil, nil
}

// Close closes the connection. Publish after Close opens a new one.
func (p *Publisher) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.resetLocked()
}

// watchConnection drains the connection's notifications (an undrained Notify channel stalls
// the client) and logs why the connection closed or was blocked.
func watchConnection(conn *amqp.Connection, log *slog.Logger) {
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	blocked := conn.NotifyBlocked(make(chan amqp.Blocking, 1))
	go func() {
		for b := range blocked {
			if b.Active {
				log.Warn("rabbitmq blocked the connection", "reason", b.Reason)
			} else {
				log.Info("rabbitmq unblocked the connection")
			}
		}
	}()
	go func() {
		if err, ok := <-closed; ok && err != nil {
			log.Warn("rabbitmq connection closed", "error", err)
		}
	}()
}
