package main

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/mail"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/propagation"
	"golang.org/x/net/idna"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

//go:embed migrations/*.sql
var migrations embed.FS

// Delivery states of a notification: pending until sent, or undeliverable, its recipient
// refused for good by the mail server (errRecipientRefused), which ends its retries. The
// sender's and the backlog's statements are written with these, so that they match the rows.
const (
	StatusPending       = "pending"
	StatusSent          = "sent"
	StatusUndeliverable = "undeliverable"
)

// The kinds of notification: at most one of each per order (the migrations' UNIQUE (order_id,
// kind)), whatever order and how often their events arrive.
const (
	KindOrderConfirmation = "order_confirmation" // from OrderPlaced
	KindInvoice           = "invoice"            // from InvoiceIssued
	KindOrderCancelled    = "order_cancelled"    // from OrderCancelled
)

// Notification is a message to a customer and where its delivery stands.
type Notification struct {
	ID            uuid.UUID  `json:"id" gorm:"type:uuid;primaryKey"`
	OrderID       uuid.UUID  `json:"order_id" gorm:"type:uuid"`
	CustomerID    string     `json:"customer_id"`
	Kind          string     `json:"kind"`
	Recipient     string     `json:"recipient"`
	Subject       string     `json:"subject"`
	Body          string     `json:"body"`
	Status        string     `json:"status"`
	Attempts      int        `json:"attempts"`
	LastError     *string    `json:"last_error,omitempty"`
	NextAttemptAt time.Time  `json:"-"`
	MessageID     uuid.UUID  `json:"message_id" gorm:"type:uuid"`
	CreatedAt     time.Time  `json:"created_at"`
	SentAt        *time.Time `json:"sent_at,omitempty"`
	// TraceParent and TraceState are the W3C trace context of the handling that recorded it,
	// which its delivery continues.
	TraceParent string `json:"-"`
	TraceState  string `json:"-"`
}

// TableName pins the table the migrations create.
func (Notification) TableName() string { return "notifications" }

// confirmation is the order confirmation for an OrderPlaced event.
func confirmation(ev events.OrderPlaced) Notification {
	var b strings.Builder
	fmt.Fprintf(&b, "Thank you for your order %s.\r\n\r\n", ev.OrderID)
	// The SKUs as sent, on their lines: the event's checks refused any with a control
	// character, and the line and paragraph separators show as spaces, so that no SKU forges a
	// line (a total) of its own.
	for _, l := range ev.Lines {
		fmt.Fprintf(&b, "  %d × %s at %s\r\n", l.Quantity, events.OnOneLine(l.SKU), money(l.UnitPriceCents))
	}
	fmt.Fprintf(&b, "\r\nTotal: %s\r\n", money(ev.TotalCents))
	return Notification{OrderID: ev.OrderID, CustomerID: ev.CustomerID, Kind: KindOrderConfirmation,
		Subject: "Your order " + ev.OrderID.String(), Body: b.String()}
}

// invoiceNotice tells the customer about an InvoiceIssued event's invoice.
func invoiceNotice(ev events.InvoiceIssued) Notification {
	body := fmt.Sprintf("Your invoice %s for order %s.\r\n\r\nAmount: %s\r\n", ev.InvoiceID, ev.OrderID, money(ev.AmountCents))
	return Notification{OrderID: ev.OrderID, CustomerID: ev.CustomerID, Kind: KindInvoice,
		Subject: "Your invoice " + ev.InvoiceID.String(), Body: body}
}

// cancellation tells the customer about an OrderCancelled event.
func cancellation(ev events.OrderCancelled) Notification {
	body := fmt.Sprintf("Your order %s was cancelled.\r\n", ev.OrderID)
	// One line, whatever the publisher sent: a bare line break would break the e-mail's CRLF lines.
	if reason := strings.Join(strings.Fields(ev.Reason), " "); reason != "" {
		body += "\r\nReason: " + reason + "\r\n"
	}
	return Notification{OrderID: ev.OrderID, CustomerID: ev.CustomerID, Kind: KindOrderCancelled,
		Subject: "Your order " + ev.OrderID.String() + " was cancelled", Body: body}
}

// w3c writes and reads a notification's trace context, the W3C Trace Context of the messages.
var w3c propagation.TraceContext

func money(cents int64) string { return fmt.Sprintf("%d.%02d", cents/100, cents%100) }

// recipient is the customer id when it is a mailbox as SMTP carries it (mailbox) at another
// domain than domain, otherwise a mailbox derived from it at domain. Only lower-case letters
// (servers take a local part's case as the same mailbox), digits, '.', '-' and '_' survive:
// nothing from a message can inject an SMTP header. The dots are those a mailbox may have (none
// first, last or twice in a row): a server refuses "a..b@domain" as syntax, every time, and
// the notification would be retried for ever. An id that had to change, or be cut, could
// become another's ("acme/1" and "Acme:1" both "acme_1"), whose customer would read its
// e-mails: it ends in 48 bits of a digest of itself after an '=', which no id kept whole has
// (and an address kept whole is at another domain).
func recipient(customerID, domain string) string {
	if mailbox(customerID) && !atDomain(customerID, domain) {
		return customerID
	}
	local := strings.Map(func(r rune) rune {
		switch {
		case r >= 'A' && r <= 'Z':
			return r - 'A' + 'a'
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '.', r == '-', r == '_':
			return r
		}
		return '_'
	}, customerID)
	local = strings.Join(slices.DeleteFunc(strings.Split(local, "."), func(s string) bool { return s == "" }), ".")
	if room := min(maxLocalPart, maxAddress-1-len(domain)); local != customerID || local == "" || len(local) > room {
		sum := sha256.Sum256([]byte(customerID))
		tag := "=" + hex.EncodeToString(sum[:])[:digestChars]
		local = strings.TrimRight(local[:max(0, min(len(local), room-len(tag)))], ".") + tag
	}
	return local + "@" + domain
}

// atDomain says whether mailbox is at domain, as a name: its A-label, in any case.
func atDomain(mailbox, domain string) bool {
	at, _ := asciiDomain(mailbox[strings.LastIndexByte(mailbox, '@')+1:])
	return strings.EqualFold(at, domain)
}

// digestChars is how much of a changed customer id's SHA-256, in hex, its mailbox carries: 48
// bits, against a collision among ids that change alike.
const digestChars = 12

// maxLocalPart is the most octets of a mailbox's local part (RFC 5321 4.5.3.1.1), and
// maxAddress of the whole address: a path is 256 octets at most, its '<' and '>' included
// (4.5.3.1.3). maxRecipientDomain leaves room at NOTIFY_RECIPIENT_DOMAIN for a derived local
// part of its '=' and digest alone.
const (
	maxLocalPart       = 64
	maxAddress         = 254
	maxRecipientDomain = maxAddress - 1 - 1 - digestChars
)

// mailbox says whether address is one mailbox that SMTP carries as it is: mail.ParseAddress
// reads it whole, with no '<' or '>' (which would end the envelope's address early), and within
// what RFC 5321 carries, which is less than what RFC 5322 lets it read: a local part of
// maxLocalPart octets at most, at a domain name (domainName), maxAddress in all. Not at a domain literal
// ("a@[192.0.2.1]"): no customer's address is one, relays commonly refuse them, and one that
// is refused is refused every time.
func mailbox(address string) bool {
	a, err := mail.ParseAddress(address)
	if err != nil || a.Address != address || strings.ContainsAny(address, "\r\n<>") {
		return false
	}
	at := strings.LastIndexByte(address, '@') // a quoted local part may hold '@'; a domain may not
	return len(address) <= maxAddress && at <= maxLocalPart && domainName(address[at+1:])
}

// domainName says whether domain is a name RFC 5321 carries: labels of letters, digits and
// '-' (none first or last), of 1 to 63 octets, 253 in all (a name's text form: its 255
// octets on the wire count a length before each label and a root's 0 after). A label of other letters (a U-label:
// a customer's address may be UTF-8, which the mailer sends with SMTPUTF8) counts as the
// A-label it stands for, and must be a valid one.
func domainName(domain string) bool {
	_, ok := asciiDomain(domain)
	return ok
}

// asciiDomain is domain with each U-label written as its A-label, and whether it is a name
// domainName takes.
func asciiDomain(domain string) (string, bool) {
	labels := strings.Split(domain, ".")
	for i, label := range labels {
		if !ldhLabel(label) {
			a, err := idna.Registration.ToASCII(label)
			if err != nil || !ldhLabel(a) {
				return "", false
			}
			labels[i] = a
		}
	}
	ascii := strings.Join(labels, ".")
	return ascii, len(ascii) <= 253
}

// errUTF8LocalPart refuses a mailbox whose local part is not ASCII where it must be: a domain's
// U-labels have an ASCII form, their A-labels, but a local part has none, and only a server
// that offers SMTPUTF8 takes it as it is.
var errUTF8LocalPart = errors.New("its local part is not ASCII, which only a server that offers SMTPUTF8 takes")

// errNoALabel refuses an address whose domain is not ASCII and has no A-label form.
var errNoALabel = errors.New("its domain has no ASCII form (A-label)")

// asciiAddress is address as a server without SMTPUTF8 takes it. An ASCII address goes as it
// is, whatever its domain (a domain literal, a name with '_': a relay's business, as before).
// Otherwise each label of its domain that is not ASCII goes as its A-label, case-mapped as
// IDNA looks names up ("Shöp" as "shöp"), and its local part as it is if ASCII
// (errUTF8LocalPart otherwise). The error names no part of address: it reaches the log.
func asciiAddress(address string) (string, error) {
	if isASCII(address) {
		return address, nil
	}
	at := strings.LastIndexByte(address, '@') // a quoted local part may hold '@'; a domain may not
	if at < 0 || !isASCII(address[:at]) {
		return "", errUTF8LocalPart
	}
	labels := strings.Split(address[at+1:], ".")
	for i, label := range labels {
		if isASCII(label) {
			continue
		}
		a, err := idna.Lookup.ToASCII(label)
		if err != nil || !ldhLabel(a) {
			return "", errNoALabel
		}
		labels[i] = a
	}
	return address[:at] + "@" + strings.Join(labels, "."), nil
}

// isASCII says whether s is ASCII.
func isASCII(s string) bool {
	for i := range len(s) {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

// ldhLabel says whether label is 1 to 63 letters, digits and '-', with no '-' first or last.
func ldhLabel(label string) bool {
	if len(label) == 0 || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
		return false
	}
	for _, r := range label {
		if (r < 'a' || r > 'z') && (r < 'A' || r > 'Z') && (r < '0' || r > '9') && r != '-' {
			return false
		}
	}
	return true
}

// notifier turns events into pending notifications. Its handlers run inside the inbox's
// transaction and only record; sending is the sender's job, after the commit.
type notifier struct {
	log    *slog.Logger
	domain string
	wake   func() // called after a new notification committed: wakes the sender
	// alreadyDone, if set, counts a message whose notification another message recorded already.
	alreadyDone func()
}

// batchByType is the notifier's subscription's messaging.SubscriptionConfig.BatchByType: each
// of its handlers inserts notifications of its own kind and reads none, so a batch's messages
// may be gathered by event type, one INSERT per type rather than per run. A backlog fed by two
// relays interleaves OrderPlaced and InvoiceIssued almost one by one, and drained at half the
// speed in runs. The price: an order's notifications of one batch are queued by kind.
const batchByType = true

// subscribe registers a batch handler per event the notifier turns into a notification; the
// subscription's queue is bound to each. Each event's messages in a batch are recorded with
// one INSERT (see batchByType).
func (h notifier) subscribe(sub *platform.Subscription) error {
	return errors.Join(
		messaging.HandleBatch(sub, events.OrderPlacedEvent, recordAll(h, confirmation)),
		messaging.HandleBatch(sub, events.InvoiceIssuedEvent, recordAll(h, invoiceNotice)),
		messaging.HandleBatch(sub, events.OrderCancelledEvent, recordAll(h, cancellation)))
}

// recordAll records, for each message of a batch, the notification build makes of its event.
func recordAll[T any](h notifier, build func(T) Notification) messaging.BatchHandler[*gorm.DB, T] {
	return func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[T]) error {
		ns := make([]Notification, len(batch))
		for i, d := range batch {
			var err error
			if ns[i], err = h.prepare(d.Ctx, d.Msg, build(d.Payload)); err != nil {
				return err
			}
		}
		inserted, err := insertNew(tx, ns)
		if err != nil {
			return err
		}
		for i, d := range batch {
			if err := h.recorded(d.Ctx, ns[i], d.Msg, inserted[ns[i].ID]); err != nil {
				return err
			}
		}
		return nil
	}
}

// prepare completes n as a pending notification about msg, which keeps ctx's trace context for
// its delivery.
func (h notifier) prepare(ctx context.Context, msg messaging.Message, n Notification) (Notification, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return n, fmt.Errorf("notification id: %w", err)
	}
	n.ID, n.MessageID, n.Recipient, n.Status = id, msg.ID, recipient(n.CustomerID, h.domain), StatusPending
	carrier := propagation.MapCarrier{}
	w3c.Inject(ctx, carrier)
	n.TraceParent, n.TraceState = carrier.Get("traceparent"), carrier.Get("tracestate")
	return n, nil
}

// insertNewSQL inserts the notifications of a JSON array, in (order_id, kind) order, skipping
// those whose order has one of their kind already, and returns the ids of those it inserted.
// A concurrent insert of the same order and kind waits for the other transaction, then skips;
// the order keeps two batches holding the same ones from waiting for each other in a circle
// within a kind. A batch inserts its kinds one statement each (see batchByType), in the order
// its events first came: two whose kinds came in other orders can still cross, and PostgreSQL
// then aborts one, whose messages the consumer retries one by one.
// Among the array's own rows of one order and kind, ord (the batch's order, which a sort need
// not keep) lets the earlier message's stand, as it would one delivery at a time.
// A notification is created, and due, at the database's now(): the clock that says when it is
// due and how old the backlog is, not a consumer replica's, which may run fast or slow.
const insertNewSQL = `INSERT INTO notifications (id, order_id, customer_id, kind, recipient, subject, body, status,
    next_attempt_at, message_id, created_at, trace_parent, trace_state)
SELECT id, order_id, customer_id, kind, recipient, subject, body, status, now(), message_id, now(), trace_parent, trace_state
FROM jsonb_to_recordset(?::jsonb) AS r(id uuid, order_id uuid, customer_id text, kind text, recipient text, subject text,
    body text, status text, message_id uuid, trace_parent text, trace_state text, ord int)
ORDER BY order_id, kind, ord
ON CONFLICT (order_id, kind) DO NOTHING
RETURNING id`

// notificationRow is a notification as insertNewSQL reads it: every column it writes but the
// two times, which are the database's, and its place in the batch.
type notificationRow struct {
	ID          uuid.UUID `json:"id"`
	OrderID     uuid.UUID `json:"order_id"`
	CustomerID  string    `json:"customer_id"`
	Kind        string    `json:"kind"`
	Recipient   string    `json:"recipient"`
	Subject     string    `json:"subject"`
	Body        string    `json:"body"`
	Status      string    `json:"status"`
	MessageID   uuid.UUID `json:"message_id"`
	TraceParent string    `json:"trace_parent"`
	TraceState  string    `json:"trace_state"`
	Ord         int       `json:"ord"`
}

// insertNew inserts the notifications whose order has none of their kind, in one statement,
// and reports which. A redelivery never gets here (the inbox skips it), so one skipped is
// another message about the same order and kind, and the customer must not hear about it twice.
func insertNew(tx *gorm.DB, ns []Notification) (map[uuid.UUID]bool, error) {
	rows := make([]notificationRow, len(ns))
	for i, n := range ns {
		rows[i] = notificationRow{ID: n.ID, OrderID: n.OrderID, CustomerID: n.CustomerID, Kind: n.Kind, Recipient: n.Recipient,
			Subject: n.Subject, Body: n.Body, Status: n.Status, MessageID: n.MessageID,
			TraceParent: n.TraceParent, TraceState: n.TraceState, Ord: i}
	}
	doc, err := json.Marshal(rows)
	if err != nil {
		return nil, fmt.Errorf("insert %d notifications: %w", len(ns), err)
	}
	var ids []uuid.UUID
	if err := tx.Raw(insertNewSQL, string(doc)).Scan(&ids).Error; err != nil {
		return nil, fmt.Errorf("insert %d notifications: %w", len(ns), err)
	}
	inserted := make(map[uuid.UUID]bool, len(ids))
	for _, id := range ids {
		inserted[id] = true
	}
	return inserted, nil
}

// recorded says, once the transaction commits, what became of msg's notification n: recorded
// (and the sender woken), or not, its order having one of its kind already.
func (h notifier) recorded(ctx context.Context, n Notification, msg messaging.Message, inserted bool) error {
	if !inserted {
		return messaging.AfterCommit(ctx, func() {
			if h.alreadyDone != nil {
				h.alreadyDone()
			}
			h.log.WarnContext(ctx, "order already has a "+n.Kind+" notification from another message; nothing to do",
				"order_id", n.OrderID, "kind", n.Kind, "message_id", msg.ID, "already_done", true)
		})
	}
	return messaging.AfterCommit(ctx, func() {
		// Not the recipient: a customer's e-mail address is personal data, which logs keep out of
		// reach of its erasure; the notification id leads to it.
		h.log.InfoContext(ctx, "notification recorded", "notification_id", n.ID, "order_id", n.OrderID, "kind", n.Kind, "message_id", msg.ID)
		if h.wake != nil {
			h.wake()
		}
	})
}
