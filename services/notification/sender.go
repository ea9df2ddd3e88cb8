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

	markSentSQL = `UPDATE notifications SET status = 'sent', sent_at = clock_timestamp() WHERE id = ?`

	recordDeliveryFailureSQL = `UPDATE notifications
SET attempts = attempts + 1,
    last_error = ?,
    next_attempt_at = clock_timestamp() + ? * interval '1 millisecond'
WHERE id = ?`
)

// Deliverer hands a notification to the outside world. The notification id goes with it as
// the idempotency key: a crash between delivering and marking it sent delivers it again, and
// the receiver can recognise the repeat.
type Deliverer interface {
	Deliver(ctx context.Context, n Notification) error
}

// sender delivers pending notifications after their transaction committed, retrying failures
// with backoff until they succeed. Each notification is claimed, delivered and marked in a
// transaction of its own: a crash between delivering and marking repeats one e-mail at most,
// never a batch.
type sender struct {
	db        *gorm.DB
	deliverer Deliverer
	backoff   messaging.Backoff
	poll      time.Duration
	timeout   time.Duration // one delivery, marking included
	grace     time.Duration // how long a delivery in progress may go on after shutdown
	log       *slog.Logger
	wake      chan struct{}
}

func newSender(db *gorm.DB, d Deliverer, maxBackoff time.Duration, log *slog.Logger) *sender {
	return &sender{
		db: db, deliverer: d, poll: time.Second, timeout: 30 * time.Second, grace: 5 * time.Second,
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

// Run delivers until ctx ends. A delivery in progress at that moment may finish, and be
// marked sent, within the grace period: a clean shutdown never repeats an e-mail.
func (s *sender) Run(ctx context.Context) error {
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		delivered, err := s.deliverOne(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			s.log.Error("notification delivery round failed", "error", err)
		}
		if delivered {
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

// deliverOne claims the oldest due notification, delivers it and marks it sent, or records
// the failure with a backoff. delivered reports whether one was sent.
func (s *sender) deliverOne(parent context.Context) (delivered bool, err error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(parent), s.timeout)
	defer cancel()
	stop := context.AfterFunc(parent, func() {
		t := time.AfterFunc(s.grace, cancel)
		<-ctx.Done()
		t.Stop()
	})
	defer stop()

	var row pendingRow
	var failure error
	var attempts int
	var delay time.Duration
	err = s.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		failure, delivered = nil, false
		res := tx.Raw(claimPendingSQL, 1).Scan(&row)
		if res.Error != nil {
			return fmt.Errorf("claim pending notification: %w", res.Error)
		}
		if res.RowsAffected == 0 {
			return nil
		}
		n := Notification{ID: row.ID, OrderID: row.OrderID, Recipient: row.Recipient, Subject: row.Subject, Body: row.Body}
		if failure = s.deliverer.Deliver(ctx, n); failure != nil {
			attempts = row.Attempts + 1
			delay = s.backoff.Delay(attempts)
			if err := tx.Exec(recordDeliveryFailureSQL, failure.Error(), delay.Milliseconds(), row.ID).Error; err != nil {
				return fmt.Errorf("record delivery failure of %s: %w", row.ID, err)
			}
			return nil
		}
		if err := tx.Exec(markSentSQL, row.ID).Error; err != nil {
			return fmt.Errorf("mark notification %s sent: %w", row.ID, err)
		}
		delivered = true
		return nil
	})
	if err != nil {
		return false, err
	}
	if failure != nil {
		s.log.Warn("notification delivery failed", "notification_id", row.ID, "attempts", attempts, "retry_in", delay, "error", failure)
	} else if delivered {
		s.log.Info("notification delivered", "notification_id", row.ID, "order_id", row.OrderID)
	}
	return delivered, nil
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
