package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/smtp"
	"strings"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// The sender's statements: the same claim-deliver-mark shape as the outbox relay, for the one
// piece of work that leaves the database.
const (
	// Lease the oldest due notification: push its next attempt past the time a delivery may
	// take, so no other sender takes it meanwhile, and no transaction stays open during SMTP.
	// If this sender dies, the lease runs out and the notification is delivered again, with the
	// same Message-ID.
	claimPendingSQL = `UPDATE notifications
SET next_attempt_at = clock_timestamp() + ? * interval '1 millisecond'
WHERE id = (
    SELECT id FROM notifications
    WHERE status = 'pending' AND next_attempt_at <= now()
    ORDER BY created_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED)
RETURNING id, order_id, recipient, subject, body, attempts, next_attempt_at AS leased_until, trace_parent, trace_state`

	// Both updates are fenced by the lease: a sender whose lease ran out (it was too slow, and
	// another took the notification over) changes nothing.
	markSentSQL = `UPDATE notifications SET status = 'sent', sent_at = clock_timestamp()
WHERE id = ? AND status = 'pending' AND next_attempt_at = ?`

	recordDeliveryFailureSQL = `UPDATE notifications
SET attempts = attempts + 1,
    last_error = ?,
    next_attempt_at = clock_timestamp() + ? * interval '1 millisecond'
WHERE id = ? AND status = 'pending' AND next_attempt_at = ?`
)

// Deliverer hands a notification to the outside world. The notification id goes with it as
// the idempotency key: a crash between delivering and marking it sent delivers it again, and
// the receiver can recognise the repeat. Deliver must return when ctx ends: the lease that
// keeps other senders away lasts only so long.
type Deliverer interface {
	Deliver(ctx context.Context, n Notification) error
}

// sender delivers pending notifications after their transaction committed, retrying failures
// with backoff until they succeed. Each notification is leased, delivered and marked on its
// own: a crash between delivering and marking repeats one e-mail at most, never a batch, and a
// database that is briefly away when the mark is due is waited for rather than causing a
// repeat.
type sender struct {
	db        *gorm.DB
	deliverer Deliverer
	backoff   messaging.Backoff
	poll      time.Duration
	deliver   time.Duration // one delivery at most
	mark      time.Duration // recording its outcome at most, retries included
	grace     time.Duration // how long a delivery in progress may go on after shutdown
	log       *slog.Logger
	wake      chan struct{}
	tracer    trace.Tracer
}

// The budgets keep a clean shutdown within 10 s: a delivery in progress gets the grace, then
// recording its outcome gets its own budget.
func newSender(db *gorm.DB, d Deliverer, maxBackoff time.Duration, log *slog.Logger) *sender {
	return &sender{
		db: db, deliverer: d, poll: time.Second, deliver: 30 * time.Second, mark: 4 * time.Second, grace: 4 * time.Second,
		backoff: messaging.Backoff{Base: 2 * time.Second, Max: maxBackoff},
		log:     log.With("component", "sender"), wake: make(chan struct{}, 1),
		tracer: otel.Tracer("github.com/outboxkit/outbox-inbox/services/notification"),
	}
}

// Wake makes the sender look for pending notifications now (after a handler committed one).
func (s *sender) Wake() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Run delivers until ctx ends. A delivery in progress at that moment may finish, and be
// marked sent, within the grace period: a clean shutdown never repeats an e-mail.
func (s *sender) Run(ctx context.Context) error {
	for {
		delivered, err := s.deliverOne(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			s.log.Error("notification delivery round failed", "error", err)
		}
		if !delivered && !messaging.Sleep(ctx, s.wake, messaging.Jitter(s.poll)) {
			return nil
		}
	}
}

type pendingRow struct {
	ID          uuid.UUID
	OrderID     uuid.UUID
	Recipient   string
	Subject     string
	Body        string
	Attempts    int
	LeasedUntil time.Time
	TraceParent string
	TraceState  string
}

// deliverOne leases the oldest due notification, delivers it and marks it sent, or records
// the failure with a backoff. delivered reports whether one was sent. Leasing, delivering and
// recording each have a budget of their own, and the lease covers all three. Delivering and
// recording happen in a span of the trace that recorded the notification.
func (s *sender) deliverOne(parent context.Context) (delivered bool, err error) {
	if parent.Err() != nil {
		return false, nil // shutting down: take nothing new
	}
	var rows []pendingRow
	lease := s.deliver + s.mark + s.grace
	claimCtx, cancelClaim := context.WithTimeout(parent, s.mark)
	err = s.db.WithContext(claimCtx).Raw(claimPendingSQL, lease.Milliseconds()).Scan(&rows).Error
	cancelClaim()
	if err != nil {
		return false, fmt.Errorf("lease a pending notification: %w", err)
	}
	if len(rows) == 0 {
		return false, nil
	}
	row := rows[0]
	ctx, span := s.startSpan(parent, row)
	defer func() {
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()

	// A delivery in progress at shutdown may finish within the grace, so that a clean shutdown
	// never repeats an e-mail.
	deliverCtx, cancelDeliver := context.WithTimeout(context.WithoutCancel(ctx), s.deliver)
	stop := context.AfterFunc(parent, func() {
		t := time.AfterFunc(s.grace, cancelDeliver)
		<-deliverCtx.Done()
		t.Stop()
	})
	failure := s.deliverer.Deliver(deliverCtx, Notification{ID: row.ID, OrderID: row.OrderID, Recipient: row.Recipient, Subject: row.Subject, Body: row.Body})
	stop()
	cancelDeliver()

	markCtx, cancelMark := context.WithTimeout(context.WithoutCancel(ctx), s.mark)
	defer cancelMark()
	if failure != nil {
		span.SetStatus(codes.Error, failure.Error())
		attempts := row.Attempts + 1
		delay := s.backoff.Delay(attempts)
		if err := s.persist(markCtx, row, recordDeliveryFailureSQL, failure.Error(), delay.Milliseconds(), row.ID, row.LeasedUntil); err != nil {
			return false, fmt.Errorf("record delivery failure of %s: %w", row.ID, err)
		}
		s.log.WarnContext(ctx, "notification delivery failed", "notification_id", row.ID, "attempts", attempts, "retry_in", delay, "error", failure)
		return false, nil
	}
	if err := s.persist(markCtx, row, markSentSQL, row.ID, row.LeasedUntil); err != nil {
		return false, fmt.Errorf("mark notification %s sent (it will be delivered again when its lease ends): %w", row.ID, err)
	}
	s.log.InfoContext(ctx, "notification delivered", "notification_id", row.ID, "order_id", row.OrderID)
	return true, nil
}

// startSpan starts the delivery's span, a child of the span that recorded the notification
// (a new trace for a notification recorded outside any).
func (s *sender) startSpan(ctx context.Context, row pendingRow) (context.Context, trace.Span) {
	ctx = w3c.Extract(ctx, propagation.MapCarrier{"traceparent": row.TraceParent, "tracestate": row.TraceState})
	ctx, span := s.tracer.Start(ctx, "deliver notification", trace.WithSpanKind(trace.SpanKindClient))
	if span.IsRecording() {
		span.SetAttributes(attribute.String("notification.id", row.ID.String()), attribute.Int("notification.attempts", row.Attempts))
	}
	return ctx, span
}

// persist runs a lease-fenced update, retrying while the database is away, until ctx ends:
// once an e-mail went out, recording that is worth waiting for. If the lease was lost meanwhile
// the update changes nothing, which is right: the notification belongs to another sender now.
func (s *sender) persist(ctx context.Context, row pendingRow, sql string, args ...any) error {
	retry := messaging.Backoff{Base: 100 * time.Millisecond, Max: time.Second}
	for attempt := 1; ; attempt++ {
		res := s.db.WithContext(ctx).Exec(sql, args...)
		if res.Error == nil {
			if res.RowsAffected == 0 {
				s.log.WarnContext(ctx, "lease on the notification ran out before its outcome was recorded; another sender has it", "notification_id", row.ID)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return res.Error
		case <-time.After(retry.Delay(attempt)):
		}
	}
}

// logDeliverer "delivers" to the log, when no mail server is configured.
type logDeliverer struct{ log *slog.Logger }

func (d logDeliverer) Deliver(ctx context.Context, n Notification) error {
	d.log.InfoContext(ctx, "notification delivered to the log (no SMTP_ADDR set)", "notification_id", n.ID, "order_id", n.OrderID,
		"recipient", n.Recipient, "subject", n.Subject)
	return nil
}

// smtpDeliverer sends e-mail through a plain SMTP relay (Mailpit in docker compose).
type smtpDeliverer struct {
	addr string
	from string
}

// Deliver sends one e-mail whose Message-ID is derived from the notification id, so the
// receiving side can drop a repeat.
func (d smtpDeliverer) Deliver(ctx context.Context, n Notification) error {
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", d.addr)
	if err != nil {
		return fmt.Errorf("smtp dial %s: %w", d.addr, err)
	}
	defer conn.Close()
	if deadline, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(deadline)
	}
	// Cancellation (shutdown past its grace) must interrupt a stalled server too.
	defer context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })()
	host, _, _ := net.SplitHostPort(d.addr)
	c, err := smtp.NewClient(conn, host)
	if err != nil {
		return fmt.Errorf("smtp greeting: %w", err)
	}
	defer c.Close()
	if err := c.Hello("notification"); err != nil {
		return fmt.Errorf("smtp hello: %w", err)
	}
	if err := c.Mail(d.from); err != nil {
		return fmt.Errorf("smtp mail from: %w", err)
	}
	if err := c.Rcpt(n.Recipient); err != nil {
		return fmt.Errorf("smtp rcpt to: %w", err)
	}
	w, err := c.Data()
	if err != nil {
		return fmt.Errorf("smtp data: %w", err)
	}
	if _, err := w.Write(composeEmail(d.from, n)); err != nil {
		return fmt.Errorf("smtp write: %w", err)
	}
	if err := w.Close(); err != nil {
		return fmt.Errorf("smtp end of data: %w", err)
	}
	// The server accepted the message: it is delivered, whatever QUIT says.
	_ = c.Quit()
	return nil
}

// MessageIDDomain qualifies e-mail Message-IDs: <notification-id@MessageIDDomain>.
const MessageIDDomain = "notification.outbox-inbox"

func composeEmail(from string, n Notification) []byte {
	var b strings.Builder
	fmt.Fprintf(&b, "From: %s\r\n", from)
	fmt.Fprintf(&b, "To: %s\r\n", n.Recipient)
	fmt.Fprintf(&b, "Subject: %s\r\n", n.Subject)
	fmt.Fprintf(&b, "Message-ID: <%s@%s>\r\n", n.ID, MessageIDDomain)
	fmt.Fprintf(&b, "X-Notification-ID: %s\r\n", n.ID)
	fmt.Fprintf(&b, "X-Order-ID: %s\r\n", n.OrderID)
	fmt.Fprintf(&b, "Date: %s\r\n", time.Now().UTC().Format(time.RFC1123Z))
	b.WriteString("MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n\r\n")
	b.WriteString(n.Body)
	return []byte(b.String())
}
