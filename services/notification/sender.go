package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
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
	// Lease the oldest due notifications, at most ?: push each one's next attempt past the time
	// a delivery may take, so no other sender takes it meanwhile, and no transaction stays open
	// during SMTP. Each row gets a lease of its own (clock_timestamp() is read per row), which
	// fences its outcome. If this sender dies, the lease runs out and the notification is
	// delivered again, with the same Message-ID. MATERIALIZED runs the locking SELECT once.
	leasePendingSQL = `WITH due AS MATERIALIZED (
    SELECT id FROM notifications
    WHERE status = '` + StatusPending + `' AND next_attempt_at <= now()
    ORDER BY created_at, id
    LIMIT ?
    FOR UPDATE SKIP LOCKED)
UPDATE notifications n
SET next_attempt_at = clock_timestamp() + ? * interval '1 millisecond'
FROM due
WHERE n.id = due.id
RETURNING n.id, n.order_id, n.recipient, n.subject, n.body, n.attempts, n.next_attempt_at AS leased_until, n.trace_parent, n.trace_state`

	// Record what became of leased notifications (a JSON array of outcomeRow): sent;
	// undeliverable, its recipient refused for good, with the attempt counted and the refusal
	// kept; or not sent, due again after retry_ms, with an attempt and its error counted if it
	// failed (one released unstarted at shutdown has none). Each update is fenced by the
	// notification's lease: a sender whose lease ran out (it was too slow, and another took the
	// notification over) changes nothing. The ids of the rows that hold their outcome come back.
	// The rows are found by primary key, from the array of the outcomes' ids: a condition on the
	// key itself, which a join alone is not (a plan that hashes the outcomes would read the whole
	// key). "status NOT IN ('sent', 'undeliverable')" is "status = 'pending'" (the only other
	// status) written so that the planner cannot use the partial index of pending rows, which it
	// would scan whole when it underestimates them (a backlog not yet analyzed). An outcome its
	// row holds already counts as recorded: an earlier attempt committed it, and its answer was
	// lost (a commit that timed out on the client after the server had done it). A sent or an
	// undeliverable one is its row in that status under the same lease (neither moves the
	// lease); a failure, its row no longer at this lease, with this attempt counted and its
	// error kept (so also a failure just like it recorded by a sender that took over after this
	// lease ran out, or leased it when it was due again: the row holds that outcome either way).
	recordOutcomesSQL = `WITH outcome AS (
    SELECT * FROM jsonb_to_recordset(?::jsonb) AS o(id uuid, leased_until timestamptz, attempts int, sent boolean, undeliverable boolean,
        failure text, retry_ms bigint)),
sent AS (
    UPDATE notifications n SET status = '` + StatusSent + `', sent_at = clock_timestamp()
    FROM outcome o
    WHERE n.id = ANY (ARRAY(SELECT id FROM outcome)) AND o.sent AND n.id = o.id AND n.status NOT IN ('` + StatusSent + `', '` + StatusUndeliverable + `')
      AND n.next_attempt_at = o.leased_until
    RETURNING n.id),
undeliverable AS (
    UPDATE notifications n SET status = '` + StatusUndeliverable + `', attempts = n.attempts + 1, last_error = o.failure
    FROM outcome o
    WHERE n.id = ANY (ARRAY(SELECT id FROM outcome)) AND o.undeliverable AND n.id = o.id AND n.status NOT IN ('` + StatusSent + `', '` + StatusUndeliverable + `')
      AND n.next_attempt_at = o.leased_until
    RETURNING n.id),
returned AS (
    UPDATE notifications n
    SET attempts = n.attempts + (o.failure IS NOT NULL)::int,
        last_error = coalesce(o.failure, n.last_error),
        next_attempt_at = clock_timestamp() + o.retry_ms * interval '1 millisecond'
    FROM outcome o
    WHERE n.id = ANY (ARRAY(SELECT id FROM outcome)) AND NOT o.sent AND NOT o.undeliverable AND n.id = o.id
      AND n.status NOT IN ('` + StatusSent + `', '` + StatusUndeliverable + `') AND n.next_attempt_at = o.leased_until
    RETURNING n.id),
recorded AS (
    SELECT n.id FROM notifications n JOIN outcome o ON n.id = o.id
    WHERE n.id = ANY (ARRAY(SELECT id FROM outcome))
      AND (o.sent AND n.status = '` + StatusSent + `' AND n.next_attempt_at = o.leased_until
        OR o.undeliverable AND n.status = '` + StatusUndeliverable + `' AND n.next_attempt_at = o.leased_until
        OR o.failure IS NOT NULL AND NOT o.undeliverable AND n.status NOT IN ('` + StatusSent + `', '` + StatusUndeliverable + `')
          AND n.next_attempt_at <> o.leased_until AND n.attempts = o.attempts + 1 AND n.last_error = o.failure))
SELECT id FROM sent UNION ALL SELECT id FROM undeliverable UNION ALL SELECT id FROM returned UNION ALL SELECT id FROM recorded`
)

// Deliverer hands a notification to the outside world. The notification id goes with it as
// the idempotency key: a crash between delivering and marking it sent delivers it again, and
// the receiver can recognise the repeat. Deliver must return when ctx ends: the lease that
// keeps other senders away lasts only so long. Deliver is called concurrently. An error that
// wraps errNotStarted says nothing was tried: the notification is released, not charged. So
// does one that wraps errUnreachable, from a mailServerProber: its server is away, and the
// sender leases nothing until a probe finds it back. One that wraps errRecipientRefused says
// the recipient is refused for good: the notification is undeliverable, never tried again.
type Deliverer interface {
	Deliver(ctx context.Context, n Notification) error
}

// mailServerProber is a Deliverer that can look for its server without a message.
type mailServerProber interface {
	Probe(ctx context.Context) error
}

// DefaultConcurrency is how many deliveries a sender runs at once unless NOTIFY_CONCURRENCY
// says: enough to keep DefaultSMTPConns connections busy while the deliveries that used them
// wait for their outcomes to be recorded (a transaction takes about three times as long as an
// e-mail to a nearby server), and for each transaction to record and lease many notifications
// at once. In the sender benchmark, 64 left each connection idle about 0.45 ms between
// e-mails, waiting for a delivery; 128 cut that to 0.06 ms.
const DefaultConcurrency = 128

// sender delivers pending notifications after their transaction committed, retrying failures
// with backoff until they succeed, or the mail server refuses their recipient for good (then
// they are undeliverable). Up to concurrency deliveries run at once, each under a lease
// of its own, and each is marked as soon as it is done: a crash between delivering and marking
// repeats the e-mails in flight (concurrency of them at most), never one marked already, and a
// database that is away when the mark is due is waited for, while the lease lasts, rather than
// causing a repeat. As many more notifications wait leased, so that a free delivery starts at
// once.
//
// Deliveries hold no database connection. The sender uses one, for all of them: each
// transaction on it records every outcome that waits and takes the leases the deliveries need
// (see line), so one commit serves many notifications.
type sender struct {
	// db's sessions must plan by index (platform.IndexPlansURL): the statements find their rows
	// through the pending index in order and the primary key, which a generic plan cached while
	// the table was nearly empty does not: right after a deployment, at 200 orders a second,
	// the recording of outcomes took 20 ms a statement and most of a core.
	db          *gorm.DB
	deliverer   Deliverer
	backoff     messaging.Backoff
	concurrency int
	poll        time.Duration
	deliver     time.Duration // one delivery at most, counted from its lease
	mark        time.Duration // one attempt to record and lease at most; the least a recording waits
	grace       time.Duration // how long a delivery in progress may go on after shutdown
	// stopBy is when recording must give up once Run was told to stop (nil while it runs): a
	// clean shutdown stays within the grace and one recording budget even while the database
	// is away or hangs.
	stopBy atomic.Pointer[time.Time]
	log    *slog.Logger
	wake   chan struct{}
	tracer trace.Tracer
	line   line
	// leasing logs Run's failed leases once an outage: it polls every second while the
	// database is away.
	leasing outage
	// mailServer is on from a delivery that found the mail server unreachable until a probe
	// finds it back (awaitMailServer), paced by probing: meanwhile Run leases nothing, and no
	// notification is charged an attempt, or put off by a backoff, for the server's absence.
	mailServer outage
	probing    messaging.Backoff
	// outcomes counts the deliveries tried, by outcome (see registerMetrics); nil counts none.
	outcomes *prometheus.CounterVec
}

// Delivery outcomes, as notification_deliveries_total labels them.
const (
	deliverySent          = "sent"
	deliveryFailed        = "failed"
	deliveryUndeliverable = "undeliverable"
)

// registerMetrics exports notification_deliveries_total on reg, each outcome at zero from the
// start so that increase() sees the first: the mail server's refusals show there, where the
// consumer's metrics, which count the notifications recorded, look healthy. An unreachable
// server tries nothing, so notification_mail_server_unreachable shows it instead; read from
// mailServer at each scrape, it cannot disagree with the pause, which deliveries start and
// Run ends from different goroutines.
func (s *sender) registerMetrics(reg prometheus.Registerer) error {
	v := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "notification_deliveries_total",
		Help: "E-mails the sender tried to deliver, by outcome: sent, failed (to be tried again after a backoff), or undeliverable (the recipient refused for good; not tried again).",
	}, []string{"outcome"})
	for _, o := range []string{deliverySent, deliveryFailed, deliveryUndeliverable} {
		v.WithLabelValues(o)
	}
	if err := reg.Register(v); err != nil {
		return fmt.Errorf("register notification_deliveries_total: %w", err)
	}
	unreachable := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "notification_mail_server_unreachable",
		Help: "1 while the sender is paused because the mail server is unreachable, probing it; 0 otherwise.",
	}, func() float64 {
		if s.mailServer.on() {
			return 1
		}
		return 0
	})
	if err := reg.Register(unreachable); err != nil {
		return fmt.Errorf("register notification_mail_server_unreachable: %w", err)
	}
	s.outcomes = v
	return nil
}

// count counts one delivery tried, by its outcome.
func (s *sender) count(o *deliveryOutcome) {
	if s.outcomes == nil {
		return
	}
	outcome := deliveryFailed
	switch {
	case o.sent:
		outcome = deliverySent
	case o.undeliverable:
		outcome = deliveryUndeliverable
	}
	s.outcomes.WithLabelValues(outcome).Inc()
}

// The budgets keep a clean shutdown within 10 s: a delivery in progress gets the grace, then
// recording its outcome gets its own budget (mark), even while the database is away. The lease
// outlasts a sent e-mail's recording by the grace (leaseFor).
func newSender(db *gorm.DB, d Deliverer, concurrency int, maxBackoff time.Duration, log *slog.Logger) *sender {
	s := &sender{
		db: db, deliverer: d, concurrency: concurrency,
		poll: time.Second, deliver: 30 * time.Second, mark: 4 * time.Second, grace: 4 * time.Second,
		backoff: messaging.Backoff{Base: 2 * time.Second, Max: maxBackoff},
		log:     log.With("component", "sender"), wake: make(chan struct{}, 1),
		tracer:  otel.Tracer("github.com/outboxkit/outbox-inbox/services/notification"),
		leasing: outage{failed: "leasing notifications failed", recovered: "leasing notifications works again", level: slog.LevelError},
		mailServer: outage{failed: "mail server unreachable; sending paused", recovered: "mail server reachable again; sending resumed",
			level: slog.LevelError},
		// Quick at first, for a server that restarts; never so slow that e-mails wait long
		// after it is back.
		probing: messaging.Backoff{Base: 500 * time.Millisecond, Max: 10 * time.Second},
	}
	s.line.flush = s.flush
	return s
}

// Wake makes the sender look for pending notifications now (after a handler committed one).
func (s *sender) Wake() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// Run delivers until ctx ends, with s.concurrency deliveries at once, and keeps as many
// notifications leased in waiting: whenever some of those start, it leases as many more. When
// ctx ends, deliveries in progress may finish, and be marked sent, within the grace period;
// those leased but not started are released, due again at once; and Run returns once all that
// is recorded. A clean shutdown repeats only an e-mail whose conversation, begun before the
// signal, outlasts the grace: it is cut off, counted as failed, and sent again later with the
// same Message-ID. While the mail server is away, Run leases nothing and probes it
// (awaitMailServer).
func (s *sender) Run(ctx context.Context) error {
	s.stopBy.Store(nil)
	stopping := context.AfterFunc(ctx, func() {
		by := time.Now().Add(s.grace + s.mark)
		s.stopBy.Store(&by)
	})
	defer stopping()
	waiting := make(chan pendingRow, s.concurrency)
	room := make(chan struct{}, s.concurrency) // a token per leased notification waiting
	var workers sync.WaitGroup
	for range s.concurrency {
		workers.Go(func() { s.work(ctx, waiting, room) })
	}
	defer workers.Wait()
	defer close(waiting)
	for {
		select {
		case room <- struct{}{}:
		case <-ctx.Done():
			return nil
		}
		free := 1 + takeFree(room)
		if s.mailServer.on() {
			// Leased now, they would only be released again: the places go back, and Run
			// waits for the server.
			for range free {
				<-room
			}
			if !s.awaitMailServer(ctx) {
				return nil
			}
			continue
		}
		rows, err := s.lease(free)
		for range free - len(rows) {
			<-room
		}
		for _, row := range rows {
			waiting <- row
		}
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			s.leasing.fail(s.log, err)
		} else {
			s.leasing.ok(s.log)
		}
		if len(rows) < free && !s.idle(ctx) {
			return nil
		}
	}
}

// takeFree takes every token of room free now and says how many.
func takeFree(room chan struct{}) int {
	n := 0
	for {
		select {
		case room <- struct{}{}:
			n++
		default:
			return n
		}
	}
}

// work delivers leased notifications one after another until waiting closes; those it takes
// once ctx ended, or while the mail server is away, it releases instead.
func (s *sender) work(ctx context.Context, waiting <-chan pendingRow, room <-chan struct{}) {
	for row := range waiting {
		<-room
		if ctx.Err() != nil || s.mailServer.on() {
			s.release(inTrace(ctx, row), row)
			continue
		}
		if _, err := s.deliverLeased(ctx, row); err != nil {
			s.log.ErrorContext(inTrace(ctx, row), "recording a notification's delivery failed", "notification_id", row.ID, "error", err)
		}
	}
}

// idle waits for a wake-up or the next poll, jittered, and reports whether ctx is still live.
func (s *sender) idle(ctx context.Context) bool {
	t := time.NewTimer(messaging.Backoff{Base: s.poll, Max: s.poll}.Delay(1))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-s.wake:
	case <-t.C:
	}
	return true
}

// awaitMailServer probes the mail server, ever less often, until it answers (true) or ctx
// ends (false). Each delay counts from the start of the probe before, and a probe has
// probing.Max at most (a delivery's budget, if shorter), so probes begin probing.Max apart at
// most even to a server that accepts connections and says nothing, each probe out of time.
func (s *sender) awaitMailServer(ctx context.Context) bool {
	probe, ok := s.deliverer.(mailServerProber)
	last := time.Now()
	for failures := 1; ok; failures++ {
		t := time.NewTimer(time.Until(last.Add(s.probing.Delay(failures))))
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-t.C:
		}
		last = time.Now()
		probeCtx, cancel := context.WithTimeout(ctx, min(s.deliver, s.probing.Max))
		err := probe.Probe(probeCtx)
		cancel()
		if ctx.Err() != nil {
			return false
		}
		if err == nil {
			break
		}
		s.mailServer.fail(s.log, err)
	}
	s.mailServer.ok(s.log)
	return true
}

// pendingRow is a leased notification.
type pendingRow struct {
	ID          uuid.UUID
	OrderID     uuid.UUID
	Recipient   string
	Subject     string
	Body        string
	Attempts    int
	LeasedUntil time.Time // the database's clock: the lease's fence
	TraceParent string
	TraceState  string
	// leasedAt is this process's clock when the lease was asked for, no later than the database
	// took it: the delivery's budget and a sent mark's (recordBy) count from there, so they end
	// a grace before the lease however long the notification waited, and however long the
	// lease's transaction took to answer. Read after the commit, it could come a transaction's
	// budget after the lease, and a mark could then wait until the lease's very end.
	leasedAt time.Time
}

// leaseFor is how long a notification is kept from other senders: its delivery and recording
// its outcome (a delivery never outlasts its own budget, even in a shutdown), both counted from
// leasedAt, before the lease; and the grace, the margin by which the lease outlasts them, so that
// a mark answered at its deadline (or by a clock a little ahead) still finds the lease its own.
func (s *sender) leaseFor() time.Duration { return s.deliver + s.mark + s.grace }

// lease leases up to limit due notifications, oldest first, in the next transaction free to
// (one lease a transaction; Run asks for one at a time). It is not cut short by shutdown, only
// by its own budget: a lease taken and never reported would keep its notification waiting for
// nothing.
func (s *sender) lease(limit int) ([]pendingRow, error) {
	// Read before the request, so never after the database took the lease (see leasedAt).
	asked := time.Now()
	r := &leaseRequest{limit: limit, deadline: asked.Add(s.mark), done: make(chan leaseResult, 1)}
	s.line.add(nil, r)
	res := <-r.done
	if res.err != nil {
		return nil, fmt.Errorf("lease pending notifications: %w", res.err)
	}
	for i := range res.rows {
		res.rows[i].leasedAt = asked
	}
	return res.rows, nil
}

// deliverLeased delivers a leased notification and marks it sent, or records the failure with
// a backoff. delivered reports whether it was sent. Delivering and recording each have a
// budget of their own, and the lease covers both. They happen in a span of the trace that
// recorded the notification.
func (s *sender) deliverLeased(parent context.Context, row pendingRow) (delivered bool, err error) {
	ctx, span := s.startSpan(parent, row)
	defer func() {
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()

	// A delivery in progress at shutdown may finish within the grace, so that a clean shutdown
	// repeats no e-mail whose server answers in time.
	deliverCtx, cancelDeliver := context.WithDeadline(withBudget(context.WithoutCancel(ctx), s.deliver), row.leasedAt.Add(s.deliver))
	stop := context.AfterFunc(parent, func() {
		t := time.AfterFunc(s.grace, cancelDeliver)
		<-deliverCtx.Done()
		t.Stop()
	})
	began := time.Now()
	failure := s.deliverer.Deliver(deliverCtx, Notification{ID: row.ID, OrderID: row.OrderID, Recipient: row.Recipient, Subject: row.Subject, Body: row.Body})
	stop()
	cancelDeliver()

	if errors.Is(failure, errNotStarted) {
		// It waited out its budget for a mail server connection: nothing was tried, so no
		// attempt is counted and no backoff taken.
		s.log.DebugContext(ctx, "notification not started within its budget; released", "notification_id", row.ID, "error", failure)
		s.release(ctx, row)
		return false, nil
	}
	if _, probed := s.deliverer.(mailServerProber); probed && errors.Is(failure, errUnreachable) {
		// The server is away: nothing of the e-mail was tried, so no attempt is counted and no
		// backoff taken. Run waits for the server before it leases again. A conversation cut
		// off by the shutdown is no outage, nor is one begun before the sender resumed (a dial
		// that timed out late): it would pause the sender again for nothing.
		span.SetStatus(codes.Error, failure.Error())
		if parent.Err() == nil {
			s.mailServer.failFrom(s.log, failure, began)
		}
		s.release(ctx, row)
		return false, nil
	}
	// Counted as tried whether or not the outcome can be recorded: an e-mail that went out and
	// will go again, its mark lost, is two e-mails sent.
	o := &deliveryOutcome{row: row, sent: failure == nil, undeliverable: errors.Is(failure, errRecipientRefused)}
	s.count(o)
	shown := ""
	if failure != nil {
		// A mail server's refusal often quotes the address ("550 5.1.1 <ann@example.org>:
		// Recipient address rejected"). The row, which holds the address anyway, keeps the
		// reply whole; the log and the trace, read by more people, get it without the address.
		shown = withoutAddress(failure.Error(), row.Recipient)
		span.SetStatus(codes.Error, shown)
		o.failure = storable(failure.Error())
		if !o.undeliverable {
			o.retryIn = s.backoff.Delay(row.Attempts + 1)
		}
	}
	changed, err := s.record(o)
	switch {
	case err != nil && failure != nil:
		// An undeliverable one that is not recorded is tried again once its lease ends, and
		// refused again.
		return false, fmt.Errorf("record delivery failure of %s: %w", row.ID, err)
	case err != nil:
		return false, fmt.Errorf("mark notification %s sent (it will be delivered again when its lease ends): %w", row.ID, err)
	case !changed:
		s.log.WarnContext(ctx, "lease on the notification ran out before its outcome was recorded; another sender has it", "notification_id", row.ID)
	case o.undeliverable:
		// A dead letter: an operator fixes the address and sends it again (docs/operations.md).
		s.log.ErrorContext(ctx, "notification undeliverable: the mail server refuses its recipient for good; it is not tried again",
			"notification_id", row.ID, "order_id", row.OrderID, "attempts", row.Attempts+1, "error", shown)
	case failure != nil:
		s.log.WarnContext(ctx, "notification delivery failed", "notification_id", row.ID, "attempts", row.Attempts+1, "retry_in", o.retryIn, "error", shown)
	default:
		s.log.InfoContext(ctx, "notification delivered", "notification_id", row.ID, "order_id", row.OrderID)
	}
	return failure == nil, nil
}

// withoutAddress is text with each occurrence of address, in any case (servers echo it as
// they like), replaced by a stand-in: as it is, with its domain as its A-label (what went to a
// server without SMTPUTF8, which may quote it so), and its local part alone in angle brackets
// ("<ann>: unknown user", as some servers answer). A bare local part is left: it may be a word
// of the reply.
func withoutAddress(text, address string) string {
	if address == "" {
		return text
	}
	forms := regexp.QuoteMeta(address)
	at := strings.LastIndexByte(address, '@')
	if domain, ok := asciiDomain(address[at+1:]); ok && at > 0 {
		forms += "|" + regexp.QuoteMeta(address[:at]+"@"+domain)
	}
	text = regexp.MustCompile(`(?i)`+forms).ReplaceAllLiteralString(text, "[recipient]")
	if at <= 0 {
		return text
	}
	return regexp.MustCompile(`(?i)<`+regexp.QuoteMeta(address[:at])+`>`).ReplaceAllLiteralString(text, "<[recipient]>")
}

// storable is an error text as a jsonb string can hold it: a mail server's reply may carry a
// NUL byte or invalid UTF-8, which PostgreSQL refuses, failing the transaction of every outcome
// recorded with it.
func storable(text string) string {
	return strings.ToValidUTF8(strings.ReplaceAll(text, "\x00", ""), "\uFFFD")
}

// release gives back a leased notification that was never started (at shutdown, or out of time
// before a mail server connection was free): due again at once, for any sender, without an
// attempt counted. ctx carries the notification's trace, for the line a failure logs.
func (s *sender) release(ctx context.Context, row pendingRow) {
	if _, err := s.record(&deliveryOutcome{row: row}); err != nil {
		s.log.WarnContext(ctx, "releasing a notification failed; it is due again when its lease ends", "notification_id", row.ID, "error", err)
	}
}

// startSpan starts the delivery's span, a child of the span that recorded the notification
// (a new trace for a notification recorded outside any).
func (s *sender) startSpan(ctx context.Context, row pendingRow) (context.Context, trace.Span) {
	ctx, span := s.tracer.Start(inTrace(ctx, row), "deliver notification", trace.WithSpanKind(trace.SpanKindClient))
	if span.IsRecording() {
		span.SetAttributes(attribute.String("notification.id", row.ID.String()), attribute.Int("notification.attempts", row.Attempts))
	}
	return ctx, span
}

// inTrace is ctx within the trace that recorded row, if it was recorded within one: its
// delivery's span is a child there, and a line about it outside that span (a release, a
// failed recording) carries that trace_id.
func inTrace(ctx context.Context, row pendingRow) context.Context {
	return w3c.Extract(ctx, propagation.MapCarrier{"traceparent": row.TraceParent, "tracestate": row.TraceState})
}

// record records o in the next transaction and reports whether its row holds it (for a sent
// e-mail, also when an earlier attempt whose answer was lost recorded it): false if the lease
// had run out, which is right, the notification belonging to another sender now. A
// database that is away is waited for, within one recording budget (mark); for an e-mail that
// went out, as long as the lease keeps other senders away (recordBy): giving up on that
// sends it again, where giving up on a failure or a release only delays the next attempt.
func (s *sender) record(o *deliveryOutcome) (changed bool, err error) {
	o.deadline, o.done = s.recordBy(o, time.Now()), make(chan recordResult, 1)
	s.line.add(o, nil)
	r := <-o.done
	return r.changed, r.err
}

// recordBy is when recording o, asked for at now, gives up: one recording budget from now, or,
// for an e-mail that went out, from the end of its delivery's budget if that is later: a grace
// before its lease ends (leasedAt).
func (s *sender) recordBy(o *deliveryOutcome, now time.Time) time.Time {
	deadline := now.Add(s.mark)
	if lease := o.row.leasedAt.Add(s.deliver + s.mark); o.sent && lease.After(deadline) {
		return lease
	}
	return deadline
}

// deliveryOutcome is what became of a leased notification, waiting to be recorded.
type deliveryOutcome struct {
	row           pendingRow
	sent          bool
	undeliverable bool          // its recipient refused for good (errRecipientRefused); failure says how
	failure       string        // why the delivery failed; "" if it was sent, or released unstarted
	retryIn       time.Duration // when it is due again, if neither sent nor undeliverable
	deadline      time.Time     // when recording gives up, unless shutdown comes first (see until)
	done          chan recordResult
}

type recordResult struct {
	changed bool
	err     error
}

// outcomeRow is a deliveryOutcome as recordOutcomesSQL reads it.
type outcomeRow struct {
	ID            uuid.UUID `json:"id"`
	LeasedUntil   time.Time `json:"leased_until"`
	Attempts      int       `json:"attempts"` // as leased
	Sent          bool      `json:"sent"`
	Undeliverable bool      `json:"undeliverable"`
	Failure       *string   `json:"failure"`
	RetryMS       int64     `json:"retry_ms"`
}

// leaseRequest asks the next transaction for up to limit leases.
type leaseRequest struct {
	limit    int
	deadline time.Time
	done     chan leaseResult
}

type leaseResult struct {
	rows []pendingRow
	err  error
}

// line is the sender's one database connection, shared as a database shares a commit: what
// waits when a transaction starts (every outcome to record, and the first lease request) goes
// into it, so nothing waits for more than the transaction in progress, and one commit serves
// many notifications. Run asks for one lease at a time; a request made beside it waits its turn
// rather than replacing Run's. A flush runs the transactions while anything waits.
type line struct {
	flush    func() // the sender's
	mu       sync.Mutex
	outcomes []*deliveryOutcome
	leases   []*leaseRequest
	running  bool
}

// add queues an outcome or a lease request for the next transaction, starting a flush if none
// runs.
func (l *line) add(o *deliveryOutcome, r *leaseRequest) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if o != nil {
		l.outcomes = append(l.outcomes, o)
	}
	if r != nil {
		l.leases = append(l.leases, r)
	}
	if !l.running {
		l.running = true
		go l.flush()
	}
}

// take returns what waits, and ends the flush if nothing does.
func (l *line) take() ([]*deliveryOutcome, *leaseRequest) {
	l.mu.Lock()
	defer l.mu.Unlock()
	outcomes := l.outcomes
	l.outcomes = nil
	var r *leaseRequest
	if len(l.leases) > 0 {
		r = l.leases[0]
		l.leases = l.leases[1:]
	}
	if len(outcomes) == 0 && r == nil {
		l.running = false
	}
	return outcomes, r
}

// putBack returns outcomes a transaction failed to record to the front of the queue.
func (l *line) putBack(outcomes []*deliveryOutcome) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.outcomes = append(outcomes, l.outcomes...)
}

// flush runs transactions until nothing waits. After a failed one, the outcomes whose budget
// is not spent are tried again, with backoff, with those that came meanwhile, and the others
// get the error; a lease request gets the error at once (the sender asks again at its next
// poll).
func (s *sender) flush() {
	retry := messaging.Backoff{Base: 100 * time.Millisecond, Max: time.Second}
	var lastErr error
	for attempt := 0; ; {
		outcomes, r := s.line.take()
		if len(outcomes) == 0 && r == nil {
			return
		}
		if lastErr != nil || s.stopBy.Load() != nil {
			if outcomes = s.expire(outcomes, lastErr); len(outcomes) == 0 && r == nil {
				continue
			}
		}
		changed, rows, err := s.transact(outcomes, r)
		if r != nil {
			r.done <- leaseResult{rows: rows, err: err}
		}
		if err == nil {
			for _, o := range outcomes {
				o.done <- recordResult{changed: changed[o.row.ID]}
			}
			attempt, lastErr = 0, nil
			continue
		}
		attempt++
		lastErr = err
		if len(outcomes) > 0 {
			s.log.Warn("recording notification outcomes failed; retrying", "outcomes", len(outcomes), "attempt", attempt, "error", err)
		}
		s.line.putBack(outcomes)
		// Not past the first budget to end: its outcome is answered when it ends, not later.
		pause := retry.Delay(attempt)
		for _, o := range outcomes {
			pause = min(pause, time.Until(s.until(o)))
		}
		time.Sleep(pause)
	}
}

// errStopped answers an outcome whose recording budget ended with the shutdown's.
var errStopped = errors.New("recording budget spent at shutdown")

// expire answers the outcomes whose recording budget is spent with err (errStopped if none),
// and returns the rest.
func (s *sender) expire(outcomes []*deliveryOutcome, err error) []*deliveryOutcome {
	if err == nil {
		err = errStopped
	}
	now := time.Now()
	live := outcomes[:0]
	for _, o := range outcomes {
		if now.After(s.until(o)) {
			o.done <- recordResult{err: err}
			continue
		}
		live = append(live, o)
	}
	return live
}

// until is when recording o gives up: its deadline, or the shutdown's (stopBy) if that comes
// first.
func (s *sender) until(o *deliveryOutcome) time.Time {
	if by := s.stopBy.Load(); by != nil && by.Before(o.deadline) {
		return *by
	}
	return o.deadline
}

// scanIDs reads the ids recordOutcomesSQL returns. It and scanLeased read rows by hand: they
// run for every batch of outcomes and leases, where GORM's reflective scan cost the sender more
// CPU than the rest of reading the rows.
func scanIDs(rows *sql.Rows, err error) ([]uuid.UUID, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var ids []uuid.UUID
	for rows.Next() {
		var id uuid.UUID
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}

// scanLeased reads the notifications leasePendingSQL leased.
func scanLeased(rows *sql.Rows, err error) ([]pendingRow, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var leased []pendingRow
	for rows.Next() {
		var p pendingRow
		if err := rows.Scan(&p.ID, &p.OrderID, &p.Recipient, &p.Subject, &p.Body, &p.Attempts, &p.LeasedUntil, &p.TraceParent, &p.TraceState); err != nil {
			return nil, err
		}
		leased = append(leased, p)
	}
	return leased, rows.Err()
}

// readCommitted is the isolation of the sender's transactions, whatever the database's default:
// under a snapshot taken before another sender leased a row, the lease's FOR UPDATE fails to
// serialize (SKIP LOCKED skips only rows locked now), rolling back the outcomes recorded with it.
var readCommitted = &sql.TxOptions{Isolation: sql.LevelReadCommitted}

// transact records outcomes and takes the leases r asks for, in one transaction that ends by
// the earlier of their latest deadline and one recording budget from now. It returns the ids of
// the rows the outcomes changed, and the rows leased.
func (s *sender) transact(outcomes []*deliveryOutcome, r *leaseRequest) (map[uuid.UUID]bool, []pendingRow, error) {
	var deadline time.Time
	if r != nil {
		deadline = r.deadline
	}
	rows := make([]outcomeRow, len(outcomes))
	for i, o := range outcomes {
		rows[i] = outcomeRow{ID: o.row.ID, LeasedUntil: o.row.LeasedUntil, Attempts: o.row.Attempts, Sent: o.sent, Undeliverable: o.undeliverable,
			RetryMS: o.retryIn.Milliseconds()}
		if o.failure != "" {
			rows[i].Failure = &o.failure
		}
		if until := s.until(o); until.After(deadline) {
			deadline = until
		}
	}
	// One attempt gets one recording budget at most: a database that hangs is tried again,
	// with backoff, while the outcomes' own deadlines last. Nothing runs past the shutdown's.
	if attempt := time.Now().Add(s.mark); attempt.Before(deadline) {
		deadline = attempt
	}
	if by := s.stopBy.Load(); by != nil && by.Before(deadline) {
		deadline = *by
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	var changedIDs []uuid.UUID
	var leased []pendingRow
	run := func(tx *gorm.DB) error {
		if len(rows) > 0 {
			doc, err := json.Marshal(rows)
			if err != nil {
				return err
			}
			if changedIDs, err = scanIDs(tx.Raw(recordOutcomesSQL, string(doc)).Rows()); err != nil {
				return fmt.Errorf("record %d outcomes: %w", len(rows), err)
			}
		}
		if r != nil {
			var err error
			if leased, err = scanLeased(tx.Raw(leasePendingSQL, r.limit, s.leaseFor().Milliseconds()).Rows()); err != nil {
				return fmt.Errorf("lease %d: %w", r.limit, err)
			}
		}
		return nil
	}
	// A transaction even for one statement: one that the deadline cut off while it waited
	// for a lock is rolled back, where alone it would commit later, unseen.
	if err := s.db.WithContext(ctx).Transaction(run, readCommitted); err != nil {
		return nil, nil, err
	}
	changed := make(map[uuid.UUID]bool, len(changedIDs))
	for _, id := range changedIDs {
		changed[id] = true
	}
	return changed, leased, nil
}
