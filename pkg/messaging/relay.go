package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"gorm.io/gorm"
)

// The statements that carry the relay's guarantees, in one place.
const (
	// The claim must walk the partial index in order and stop after the batch. A planner
	// without statistics (a new table, a burst before autovacuum's first ANALYZE) guesses that
	// few rows are unsent and prefers to fetch them all and sort them: at every claim, the
	// whole backlog. Forbidding the sort for the claim's transaction leaves it the index.
	claimPlanSQL = `SET LOCAL enable_sort = off`

	// Claim the oldest due rows. FOR UPDATE SKIP LOCKED (inside the batch's transaction) makes
	// concurrent relays, and the lanes of one relay, take disjoint rows instead of publishing
	// the same ones.
	claimSQL = `SELECT id, type, payload, correlation_id, occurred_at, attempts, trace_parent, trace_state, exchange, routing_key
FROM outbox_messages
WHERE processed_at IS NULL AND next_attempt_at <= now()
ORDER BY occurred_at, id
LIMIT ?
FOR UPDATE SKIP LOCKED`

	// Only rows the broker confirmed and routed. clock_timestamp(), not now(): now() is when the
	// transaction began, before the publishing it waited for. The ids travel as one array (see
	// uuidArray): 500 separate parameters cost the relay more CPU than the rest of the statement.
	markSentSQL = `UPDATE outbox_messages SET processed_at = clock_timestamp() WHERE id = ANY(?::uuid[])`

	// Never give up on a row: record why it failed and when to try again, counted from now,
	// not from the start of the transaction. Only the broker's verdict on this one message gets
	// here; a broker outage is the relay's to wait out, and costs the row nothing.
	recordFailureSQL = `UPDATE outbox_messages
SET attempts = attempts + 1,
    last_error = ?,
    next_attempt_at = clock_timestamp() + ? * interval '1 millisecond'
WHERE id = ?
RETURNING next_attempt_at`
)

// Sender publishes a batch, each message to its exchange, and reports one verdict per message
// (see [Publisher.Publish]). An error wrapping [ErrBrokerUnavailable] is no verdict: the row
// stays due and its attempts untouched. Any other error is the message's own fault, and backs
// the row off.
type Sender interface {
	Publish(ctx context.Context, msgs []Message) []error
}

// brokerProbe is what a [Sender] may also offer (a [Publisher] does): a cheap check that the
// broker takes messages again, so a relay waiting out an outage claims no rows to find out.
type brokerProbe interface {
	Connect(ctx context.Context) error
}

// RelayConfig configures a [Relay]. DB, Sender and Exchange are required.
type RelayConfig struct {
	DB     *gorm.DB // the service's database, holding outbox_messages
	Sender Sender
	// Exchange is where the rows that name no exchange of their own go: those enqueued before
	// rows recorded it, and messages enqueued without one. Each other row goes to its own.
	Exchange string
	// BatchSize is the most rows one transaction claims and publishes. Default 500.
	BatchSize int
	// Lanes is how many batches may be in progress at once, each in its own transaction:
	// while one waits for its confirms, the next is claimed and published. Default 2.
	Lanes int
	// PollInterval is how often the relay looks for due rows when nothing wakes it. Default
	// 1 s, jittered.
	PollInterval time.Duration
	// Backoff schedules retries of a row the broker refused (nacked, returned, too large):
	// 2 s, 4 s, 8 s … up to 5 min by default, jittered.
	Backoff Backoff
	// BrokerRetry paces the relay's checks for the broker during an outage. Default 100 ms
	// doubling up to 2 s, jittered: the relay resumes within about 2 s of the broker's return.
	BrokerRetry Backoff
	// DisableNotify turns off the LISTEN/NOTIFY wake-up, leaving only polling.
	DisableNotify bool
	// ShutdownGrace is how long a batch in progress may go on after Run's context ends, so it
	// can record what the broker confirmed. Default 5 s.
	ShutdownGrace time.Duration
	Logger        *slog.Logger
	Metrics       *Metrics // optional
	// TracerProvider makes the spans of the publishes, one per message that carries a trace
	// context, each a child of the span that enqueued it. Default: the global provider (a
	// no-op unless the process installed one; the trace context is passed on either way).
	TracerProvider trace.TracerProvider
}

// BatchResult tells what one [Relay.ProcessBatch] did.
type BatchResult struct {
	Claimed int // rows claimed
	Sent    int // confirmed by the broker and marked processed
	Failed  int // refused by the broker: attempts recorded with a backoff
	Unsent  int // no verdict, the broker being unavailable: still due, attempts untouched
}

// Relay moves outbox rows to the broker: it claims due rows, publishes them, marks those the
// broker confirmed as processed and backs off those it refused, all in one transaction per
// batch. A crash before that commit leaves every row of the batch unprocessed, so they are
// published again later: delivery is at-least-once, and consumers deduplicate by message id.
type Relay struct {
	cfg    RelayConfig
	log    *slog.Logger
	outage outage
	tracer trace.Tracer
	// spanOptions are the same for every publish span: made once.
	spanOptions []trace.SpanStartOption
}

// NewRelay checks cfg and fills in its defaults.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	if cfg.DB == nil || cfg.Sender == nil || cfg.Exchange == "" {
		return nil, errors.New("relay: DB, Sender and Exchange are required")
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 500
	}
	if cfg.Lanes <= 0 {
		cfg.Lanes = 2
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = time.Second
	}
	cfg.Backoff = cfg.Backoff.withDefaults(2*time.Second, 5*time.Minute)
	cfg.BrokerRetry = cfg.BrokerRetry.withDefaults(100*time.Millisecond, 2*time.Second)
	if cfg.ShutdownGrace <= 0 {
		cfg.ShutdownGrace = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Relay{
		cfg: cfg, log: cfg.Logger.With("component", "relay", "exchange", cfg.Exchange),
		tracer: newTracer(cfg.TracerProvider),
		spanOptions: []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
			semconv.MessagingSystemRabbitMQ, semconv.MessagingOperationTypeSend, semconv.MessagingOperationName("publish"))},
	}, nil
}

// Run relays until ctx ends, then returns nil once the batches in progress are settled. Each
// lane drains without pause while its batches come back full, and otherwise waits for a
// NOTIFY from a committed [Enqueue] or the next poll. While the broker is unavailable the
// lanes claim nothing; they look for the broker again and resume as soon as it is back.
func (r *Relay) Run(ctx context.Context) error {
	if probe, ok := r.cfg.Sender.(brokerProbe); ok {
		if err := probe.Connect(ctx); err != nil {
			r.brokerDown(err)
		} else {
			r.brokerUp(ctx)
		}
	}
	wake := newWakeup()
	var wg sync.WaitGroup
	if !r.cfg.DisableNotify {
		wg.Go(func() { r.listen(ctx, wake) })
	}
	for range r.cfg.Lanes {
		wg.Go(func() { r.lane(ctx, wake) })
	}
	wg.Wait()
	return nil
}

// lane runs batches one after another until ctx ends.
func (r *Relay) lane(ctx context.Context, wake wakeup) {
	for ctx.Err() == nil {
		res, err := r.ProcessBatch(ctx)
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, ErrBrokerUnavailable):
			r.brokerDown(err)
			r.awaitBroker(ctx)
		case err != nil:
			r.log.Error("relay batch failed", "error", err)
			Sleep(ctx, nil, Jitter(r.cfg.PollInterval))
		default:
			if res.Claimed > 0 { // an empty claim never reached the broker
				r.brokerUp(ctx)
			}
			if res.Claimed == r.cfg.BatchSize {
				wake.signal() // more is waiting: another lane may join
			} else {
				Sleep(ctx, wake, Jitter(r.cfg.PollInterval))
			}
		}
	}
}

// ProcessBatch claims, publishes and settles one batch of due rows in one transaction. When
// the broker gave no verdict on some rows (see [ErrBrokerUnavailable]), the rest is still
// settled and committed, those rows stay due, and the error says why.
func (r *Relay) ProcessBatch(parent context.Context) (BatchResult, error) {
	ctx, cancel := withGrace(parent, r.cfg.ShutdownGrace)
	defer cancel()

	var s settlement
	err := r.cfg.DB.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		rows, err := r.claim(tx)
		if err != nil || len(rows) == 0 {
			s = settlement{}
			return err
		}
		msgs := make([]Message, len(rows))
		for i, row := range rows {
			msgs[i] = row.Message()
			if row.Exchange == nil { // a row from before rows named their exchange
				msgs[i].Exchange = r.cfg.Exchange
			}
		}
		spans := r.startPublishSpans(ctx, msgs)
		verdicts := r.cfg.Sender.Publish(ctx, msgs)
		endPublishSpans(spans, verdicts)
		s, err = r.settle(tx, rows, msgs, verdicts)
		return err
	})
	if err != nil {
		return BatchResult{Claimed: s.res.Claimed}, err
	}
	r.report(ctx, s)
	return s.res, s.brokerErr
}

// claim locks the oldest due rows, up to a batch. It scans them by hand: GORM's reflection
// cost the relay more CPU per row than the claim's own work.
func (r *Relay) claim(tx *gorm.DB) ([]OutboxMessage, error) {
	if err := tx.Exec(claimPlanSQL).Error; err != nil {
		return nil, fmt.Errorf("claim outbox batch: %w", err)
	}
	cursor, err := tx.Raw(claimSQL, r.cfg.BatchSize).Rows()
	if err != nil {
		return nil, fmt.Errorf("claim outbox batch: %w", err)
	}
	defer cursor.Close()
	rows := make([]OutboxMessage, 0, r.cfg.BatchSize)
	for cursor.Next() {
		var m OutboxMessage
		if err := cursor.Scan(&m.ID, &m.Type, &m.Payload, &m.CorrelationID, &m.OccurredAt, &m.Attempts, &m.TraceParent, &m.TraceState, &m.Exchange, &m.RoutingKey); err != nil {
			return nil, fmt.Errorf("claim outbox batch: %w", err)
		}
		rows = append(rows, m)
	}
	if err := cursor.Err(); err != nil {
		return nil, fmt.Errorf("claim outbox batch: %w", err)
	}
	return rows, nil
}

// startPublishSpans starts a producer span for each message that carries a trace context, as
// a child of the span that enqueued it, and makes that span the message's trace context: the
// consumers' spans become its children. A message enqueued outside any trace is sent without
// one, and costs nothing here. The spans are returned by message index, nil where none was
// started, or nil altogether.
func (r *Relay) startPublishSpans(ctx context.Context, msgs []Message) []trace.Span {
	var spans []trace.Span
	for i := range msgs {
		m := &msgs[i]
		if m.TraceParent == "" {
			continue
		}
		parent := m.traced(ctx)
		psc := trace.SpanContextFromContext(parent)
		if !psc.IsValid() {
			continue // not a W3C traceparent: sent as it is, for the consumer to ignore
		}
		if spans == nil {
			spans = make([]trace.Span, len(msgs))
		}
		spanCtx, span := r.tracer.Start(parent, "publish "+m.Exchange, r.spanOptions...)
		messageAttributes(span, *m)
		if span.IsRecording() {
			span.SetAttributes(semconv.MessagingDestinationName(m.Exchange))
		}
		spans[i] = span
		// Without a tracer provider the span is the parent itself: the stored context goes on
		// as it is, with no formatting.
		if span.SpanContext().SpanID() != psc.SpanID() {
			m.TraceParent, m.TraceState = traceOf(spanCtx)
		}
	}
	return spans
}

// endPublishSpans ends the spans with the broker's verdicts.
func endPublishSpans(spans []trace.Span, verdicts []error) {
	for i, span := range spans {
		if span != nil {
			endSpan(span, verdicts[i])
		}
	}
}

// uuidArray writes ids as a PostgreSQL array literal, {a,b,…}.
func uuidArray(ids []uuid.UUID) string {
	var b strings.Builder
	b.Grow(len(ids)*37 + 2)
	b.WriteByte('{')
	for i, id := range ids {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(id.String())
	}
	b.WriteByte('}')
	return b.String()
}

// settlement is what a batch did, kept to be logged and counted after its commit, so neither
// reports a state the database does not hold.
type settlement struct {
	res       BatchResult
	sentTypes []string
	failures  []failure
	brokerErr error
}

type failure struct {
	msg           Message
	attempts      int
	delay         time.Duration
	nextAttemptAt time.Time
	err           error
}

// settle records the verdicts in tx: marks what was sent, backs off what the broker refused,
// and leaves alone what it gave no verdict on.
func (r *Relay) settle(tx *gorm.DB, rows []OutboxMessage, msgs []Message, verdicts []error) (settlement, error) {
	s := settlement{res: BatchResult{Claimed: len(rows)}}
	sent := make([]uuid.UUID, 0, len(rows))
	for i, err := range verdicts {
		switch {
		case err == nil:
			sent = append(sent, rows[i].ID)
			s.sentTypes = append(s.sentTypes, rows[i].Type)
		case errors.Is(err, ErrBrokerUnavailable):
			s.res.Unsent++
			if s.brokerErr == nil {
				s.brokerErr = err
			}
		default:
			f := failure{msg: msgs[i], attempts: rows[i].Attempts + 1, err: err}
			f.delay = r.cfg.Backoff.Delay(f.attempts)
			if err := tx.Raw(recordFailureSQL, err.Error(), f.delay.Milliseconds(), f.msg.ID).Scan(&f.nextAttemptAt).Error; err != nil {
				return s, fmt.Errorf("record publish failure of %s: %w", f.msg.ID, err)
			}
			s.failures = append(s.failures, f)
		}
	}
	if len(sent) > 0 {
		if err := tx.Exec(markSentSQL, uuidArray(sent)).Error; err != nil {
			return s, fmt.Errorf("mark %d outbox rows sent: %w", len(sent), err)
		}
	}
	s.res.Sent, s.res.Failed = len(sent), len(s.failures)
	return s, nil
}

// report logs and counts what a committed batch did. A line about one message carries that
// message's trace context.
func (r *Relay) report(ctx context.Context, s settlement) {
	for _, t := range s.sentTypes {
		r.cfg.Metrics.recordPublished(t)
	}
	for _, f := range s.failures {
		r.cfg.Metrics.recordPublishFailure(f.msg.Type)
		r.log.WarnContext(f.msg.traced(ctx), "outbox publish failed",
			"message_id", f.msg.ID, "type", f.msg.Type, "attempts", f.attempts,
			"retry_in", f.delay, "next_attempt_at", f.nextAttemptAt.UTC().Format(time.RFC3339Nano), "error", f.err)
	}
	if s.res.Sent > 0 {
		r.log.Debug("outbox batch sent", "sent", s.res.Sent, "claimed", s.res.Claimed)
	}
}

// outage is the relay's view of the broker, shared by its lanes.
type outage struct {
	mu    sync.Mutex
	since time.Time // zero while the broker is up
}

// brokerDown starts an outage, unless one is on: logged once, however many lanes and batches
// run into it.
func (r *Relay) brokerDown(err error) {
	r.outage.mu.Lock()
	defer r.outage.mu.Unlock()
	r.cfg.Metrics.setBrokerUp(r.cfg.Exchange, false)
	if !r.outage.since.IsZero() {
		return
	}
	r.outage.since = time.Now()
	r.log.Warn("broker unavailable; relay paused, rows wait in the outbox", "error", err)
}

// brokerUp ends the outage, if one is on, with one line: how long it lasted and how many rows
// waited (they go out now).
func (r *Relay) brokerUp(ctx context.Context) {
	r.outage.mu.Lock()
	defer r.outage.mu.Unlock()
	r.cfg.Metrics.setBrokerUp(r.cfg.Exchange, true)
	if r.outage.since.IsZero() {
		return
	}
	lasted := time.Since(r.outage.since)
	r.outage.since = time.Time{}
	stats, err := ReadOutboxStats(ctx, r.cfg.DB)
	if err != nil {
		stats.Pending = -1 // unknown; the outage is over all the same
	}
	r.log.Info("broker available again; relay resumed", "outage", lasted.Round(time.Millisecond), "rows_waiting", stats.Pending)
}

func (r *Relay) isBrokerDown() bool {
	r.outage.mu.Lock()
	defer r.outage.mu.Unlock()
	return !r.outage.since.IsZero()
}

// awaitBroker returns once the broker looks available again, or ctx ends. Without a probe on
// the Sender, it returns after one retry delay, and the next batch finds out.
func (r *Relay) awaitBroker(ctx context.Context) {
	probe, canProbe := r.cfg.Sender.(brokerProbe)
	for failures := 1; ; failures++ {
		if !Sleep(ctx, nil, r.cfg.BrokerRetry.Delay(failures)) || !canProbe || !r.isBrokerDown() {
			return
		}
		if probe.Connect(ctx) == nil {
			r.brokerUp(ctx)
			return
		}
	}
}

// listen wakes the relay on every NOTIFY, on a connection of its own taken from the pool for
// as long as the relay runs (size the pool for it). While it cannot listen, polling still
// moves everything, only later.
func (r *Relay) listen(ctx context.Context, wake wakeup) {
	reconnect(ctx, Backoff{Base: 500 * time.Millisecond, Max: 30 * time.Second}, r.log,
		"relay lost its LISTEN connection; polling meanwhile",
		func(ctx context.Context) (bool, error) { return r.listenOnce(ctx, wake) })
}

// listenOnce listens until its connection fails; listened reports whether LISTEN succeeded.
func (r *Relay) listenOnce(ctx context.Context, wake wakeup) (listened bool, err error) {
	sqlDB, err := r.cfg.DB.DB()
	if err != nil {
		return false, fmt.Errorf("listen: %w", err)
	}
	conn, err := sqlDB.Conn(ctx)
	if err != nil {
		return false, fmt.Errorf("listen: take a connection: %w", err)
	}
	defer conn.Close()
	err = conn.Raw(func(driverConn any) error {
		sc, ok := driverConn.(*stdlib.Conn)
		if !ok {
			return fmt.Errorf("listen: need the pgx driver, got %T", driverConn)
		}
		pc := sc.Conn()
		if _, err := pc.Exec(ctx, "LISTEN "+pgx.Identifier{NotifyChannel}.Sanitize()); err != nil {
			return fmt.Errorf("listen: %w", err)
		}
		defer func() {
			if !pc.IsClosed() {
				unlistenCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
				defer cancel()
				_, _ = pc.Exec(unlistenCtx, "UNLISTEN *")
			}
		}()
		listened = true
		wake.signal() // rows committed while nobody listened
		for {
			if _, err := pc.WaitForNotification(ctx); err != nil {
				return fmt.Errorf("wait for notification: %w", err)
			}
			wake.signal()
		}
	})
	return listened, err
}

// wakeup is a token for one idle lane: each NOTIFY starts one batch, not one per lane, and a
// lane whose batch came back full passes the token on, so that another joins the drain.
type wakeup chan struct{}

func newWakeup() wakeup { return make(wakeup, 1) }

func (w wakeup) signal() {
	select {
	case w <- struct{}{}:
	default:
	}
}

// withGrace returns a context that ends grace after parent does (or when cancel is called):
// work in progress at shutdown gets a bounded chance to finish and record its outcome.
func withGrace(parent context.Context, grace time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.WithoutCancel(parent))
	stop := context.AfterFunc(parent, func() {
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-ctx.Done():
		}
	})
	return ctx, func() { stop(); cancel() }
}
