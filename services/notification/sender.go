package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/smtp"
	"strings"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// The sender's statements: the same claim-deliver-mark shape as the outbox relay, for the one
// piece of work that leaves the database.
const (
	claimPendingSQL = `SELECT id, order_id, recipient, subject, body, attempts
FROM notifications
WHERE status = 'pending' AND next_attempt_at <= now()
ORDER BY created_at, id
LIMIT ?
FOR UPDATE SKIP LOCKED`

	markSentSQL = `UPDATE notifications SET status = 'sent', sent_at = now() WHERE id = ?`

	recordDeliveryFailureSQL = `UPDATE notifications
SET attempts = attempts + 1,
    last_error = ?,
    next_attempt_at = now() + ? * interval '1 millisecond'
WHERE id = ?`
)

// Deliverer hands a notification to the outside world. The notification id goes with it as
// the idempotency key: a crash between delivering and marking it sent delivers it again, and
// the receiver can recognise the repeat.
type Deliverer interface {
	Deliver(ctx context.Context, n Notification) error
}

// sender delivers pending notifications after their transaction committed, retrying failures
// with backoff until they succeed.
type sender struct {
	db        *gorm.DB
	deliverer Deliverer
	backoff   messaging.Backoff
	poll      time.Duration
	batch     int
	log       *slog.Logger
	wake      chan struct{}
}

func newSender(db *gorm.DB, d Deliverer, maxBackoff time.Duration, log *slog.Logger) *sender {
	return &sender{
		db: db, deliverer: d, batch: 10, poll: time.Second,
		backoff: messaging.Backoff{Base: 2 * time.Second, Max: maxBackoff},
		log:     log.With("component", "sender"), wake: make(chan struct{}, 1),
	}
}

// Wake makes the sender look for pending notifications now (after a handler committed one).
func (s *sender) Wake() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Run delivers until ctx ends.
func (s *sender) Run(ctx context.Context) error {
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		n, err := s.deliverBatch(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			s.log.Error("notification batch failed", "error", err)
		}
		if err == nil && n == s.batch {
			continue
		}
		timer.Reset(s.poll)
		select {
		case <-ctx.Done():
			return nil
		case <-s.wake:
		case <-timer.C:
		}
	}
}

type pendingRow struct {
	ID        uuid.UUID
	OrderID   uuid.UUID
	Recipient string
	Subject   string
	Body      string
	Attempts  int
}

// deliverBatch claims due notifications and delivers them one by one, marking each sent. At
// the first failure it records a backoff and stops: the usual cause, the mail server being
// down, would fail the rest too. It returns how many it claimed.
func (s *sender) deliverBatch(ctx context.Context) (int, error) {
	var claimed int
	type outcome struct {
		id       uuid.UUID
		attempts int
		delay    time.Duration
		err      error
	}
	var failed *outcome
	var sent []uuid.UUID
	err := s.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		failed, sent = nil, nil
		var rows []pendingRow
		if err := tx.Raw(claimPendingSQL, s.batch).Scan(&rows).Error; err != nil {
			return fmt.Errorf("claim pending notifications: %w", err)
		}
		claimed = len(rows)
		for _, r := range rows {
			n := Notification{ID: r.ID, OrderID: r.OrderID, Recipient: r.Recipient, Subject: r.Subject, Body: r.Body}
			if err := s.deliverer.Deliver(ctx, n); err != nil {
				o := outcome{id: r.ID, attempts: r.Attempts + 1, err: err}
				o.delay = s.backoff.Delay(o.attempts)
				if err := tx.Exec(recordDeliveryFailureSQL, err.Error(), o.delay.Milliseconds(), r.ID).Error; err != nil {
					return fmt.Errorf("record delivery failure of %s: %w", r.ID, err)
				}
				failed = &o
				break
			}
			if err := tx.Exec(markSentSQL, r.ID).Error; err != nil {
				return fmt.Errorf("mark notification %s sent: %w", r.ID, err)
			}
			sent = append(sent, r.ID)
		}
		return nil
	})
	if err != nil {
		return claimed, err
	}
	for _, id := range sent {
		s.log.Info("notification delivered", "notification_id", id)
	}
	if failed != nil {
		s.log.Warn("notification delivery failed", "notification_id", failed.id, "attempts", failed.attempts,
			"retry_in", failed.delay, "error", failed.err)
		return claimed, errors.New("delivery failed")
	}
	return claimed, nil
}

// logDeliverer "delivers" to the log, when no mail server is configured.
type logDeliverer struct{ log *slog.Logger }

func (d logDeliverer) Deliver(_ context.Context, n Notification) error {
	d.log.Info("notification delivered to the log (no SMTP_ADDR set)", "notification_id", n.ID, "order_id", n.OrderID,
		"recipient", n.Recipient, "subject", n.Subject)
	return nil
}

// smtpDeliverer sends e-mail through a plain SMTP relay (Mailpit in docker compose).
type smtpDeliverer struct {
	addr    string
	from    string
	timeout time.Duration
}

// Deliver sends one e-mail whose Message-ID is derived from the notification id, so the
// receiving side can drop a repeat.
func (d smtpDeliverer) Deliver(ctx context.Context, n Notification) error {
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", d.addr)
	if err != nil {
		return fmt.Errorf("smtp dial %s: %w", d.addr, err)
	}
	defer conn.Close()
	if deadline, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(deadline)
	}
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
	return c.Quit()
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
