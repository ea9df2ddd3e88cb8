package messaging

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"gorm.io/gorm"
)

// claimInboxSQL records that a consumer handles a message. The primary key (message_id,
// consumer) decides between two deliveries of one message, even concurrent ones: under READ
// COMMITTED the second insert waits for the first transaction and then affects 0 rows. There
// is no check-then-insert race, and no unique-violation error that would abort the
// transaction.
const claimInboxSQL = `INSERT INTO inbox_messages (message_id, consumer, processed_at)
VALUES (?, ?, now())
ON CONFLICT (message_id, consumer) DO NOTHING`

// inboxTxOptions sets READ COMMITTED on the inbox's transactions rather than trusting
// PostgreSQL's default, which default_transaction_isolation (per server, database or role) can
// change: under REPEATABLE READ or SERIALIZABLE the waiting claim fails with a serialization
// error instead of finding the duplicate. A DB that is itself inside a transaction keeps that
// transaction's isolation.
var inboxTxOptions = &sql.TxOptions{Isolation: sql.LevelReadCommitted}

// Inbox makes a consumer's work idempotent: it runs the work for a message at most once per
// consumer name, in the same transaction as the record that it did.
type Inbox struct {
	cfg    InboxConfig
	log    *slog.Logger
	tracer trace.Tracer
	// spanName and spanOptions are the same for every message's span: made once.
	spanName    string
	spanOptions []trace.SpanStartOption
}

// InboxConfig configures an [Inbox]. DB and Consumer are required.
type InboxConfig struct {
	// DB holds inbox_messages and the consumer's own tables.
	DB *gorm.DB
	// Consumer names the consumer (e.g. "invoicing"). Consumers sharing a database keep
	// separate records through their names.
	Consumer string
	Logger   *slog.Logger
	// Metrics, optional, counts duplicates and observes each handled message's age, from its
	// occurred_at to the commit of its work (consumer_event_age_seconds). A duplicate's age is
	// left out: it says how late a copy came, not how long the work took to happen.
	Metrics *Metrics
	// TracerProvider makes each message's consumer span, a child of the span that published
	// the message. Default: the global provider (a no-op unless the process installed one; the
	// message's trace context reaches the work either way).
	TracerProvider trace.TracerProvider
}

// NewInbox returns the inbox of one consumer.
func NewInbox(cfg InboxConfig) (*Inbox, error) {
	if cfg.DB == nil || cfg.Consumer == "" {
		return nil, errors.New("inbox: DB and Consumer are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Inbox{
		cfg: cfg, log: cfg.Logger.With("component", "inbox"),
		tracer: newTracer(cfg.TracerProvider), spanName: "process " + cfg.Consumer,
		spanOptions: []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(
			semconv.MessagingSystemRabbitMQ, semconv.MessagingOperationTypeProcess, semconv.MessagingOperationName("process"),
			semconv.MessagingConsumerGroupName(cfg.Consumer))},
	}, nil
}

// startSpan starts msg's consumer span, a child of the trace context msg came with, or of
// ctx's span when it came without one (a new trace when neither has one). Work done in the
// returned context, its log lines and what it enqueues, belongs to that trace.
func (in *Inbox) startSpan(ctx context.Context, msg Message) (context.Context, trace.Span) {
	ctx, span := in.tracer.Start(msg.traced(ctx), in.spanName, in.spanOptions...)
	messageAttributes(span, msg)
	return ctx, span
}

// Handle claims msg and runs work with the same transaction, then commits both. If this
// consumer already handled msg it runs nothing, logs one "duplicate" line and reports
// duplicate=true. If work fails, the claim rolls back with it, so a redelivery runs it again.
//
// Errors: those of work are returned as they are (mark undecodable input with [Permanent]);
// any other failure while the database does not answer is wrapped with [Unavailable].
//
// It all happens in msg's span (see [InboxConfig.TracerProvider]): tx's context carries it.
func (in *Inbox) Handle(ctx context.Context, msg Message, work func(tx *gorm.DB) error) (duplicate bool, err error) {
	ctx, span := in.startSpan(ctx, msg)
	defer func() { endSpan(span, err) }()
	hooks := &afterCommitHooks{}
	ctx = context.WithValue(ctx, afterCommitKey{}, hooks)
	err = in.cfg.DB.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		res := tx.Exec(claimInboxSQL, msg.ID, in.cfg.Consumer)
		if res.Error != nil {
			return fmt.Errorf("claim inbox message %s: %w", msg.ID, res.Error)
		}
		if duplicate = res.RowsAffected == 0; duplicate {
			return nil
		}
		return work(tx)
	}, inboxTxOptions)
	if err != nil {
		// Ask the database directly, on a context of its own: a database that swallows traffic
		// shows up as the handler's deadline passing, and that must not count as the message's
		// fault.
		if !IsPermanent(err) && !in.databaseAnswers(context.WithoutCancel(ctx)) {
			err = Unavailable(err)
		}
		return false, err
	}
	if duplicate {
		in.skipped(ctx, span, msg)
	} else {
		in.cfg.Metrics.recordEventAge(in.cfg.Consumer, msg, time.Now())
	}
	for _, fn := range hooks.fns {
		fn()
	}
	return duplicate, nil
}

type afterCommitKey struct{}

type afterCommitHooks struct{ fns []func() }

// ErrNotInInbox is returned by [AfterCommit] for a transaction that is not an inbox's.
var ErrNotInInbox = errors.New("after commit: not the transaction of an inbox")

// AfterCommit registers fn to run once the inbox transaction tx belongs to has committed: the
// place to log what the work did, or to start work outside the database, so that neither
// happens for a transaction that rolls back. It returns [ErrNotInInbox], and drops fn, when tx
// is not the transaction of [Inbox.Handle] or [Inbox.HandleBatch]: return that error, and the
// message is retried instead of losing its hook. A hook registered inside a nested
// tx.Transaction (a savepoint) runs if the outer transaction commits, even when the savepoint
// was rolled back: register hooks outside savepoints.
func AfterCommit(tx *gorm.DB, fn func()) error {
	hooks, ok := tx.Statement.Context.Value(afterCommitKey{}).(*afterCommitHooks)
	if !ok {
		return ErrNotInInbox
	}
	hooks.fns = append(hooks.fns, fn)
	return nil
}

// Handler adapts the inbox to a [Consumer]: every delivery runs through Handle. work gets the
// transaction's own context, which carries its [AfterCommit] hooks.
func (in *Inbox) Handler(work func(ctx context.Context, tx *gorm.DB, msg Message) error) Handler {
	return func(ctx context.Context, msg Message) error {
		_, err := in.Handle(ctx, msg, func(tx *gorm.DB) error { return work(tx.Statement.Context, tx, msg) })
		return err
	}
}

// HandleBatch handles msgs in one transaction, all or nothing: each is claimed and, unless it
// is a duplicate, worked, and one commit settles them all (one fsync instead of len(msgs)).
// If anything fails, nothing is committed and the error is returned; the caller then handles
// the messages one by one with Handle, so a single bad message cannot hold up the others.
// Messages are claimed in id order, so two batches holding the same messages lock them in the
// same order instead of deadlocking.
//
// Each message has its own span, and its work a tx whose context carries it: one transaction,
// as many traces as messages.
func (in *Inbox) HandleBatch(ctx context.Context, msgs []Message, work func(tx *gorm.DB, msg Message) error) (err error) {
	msgs = slices.Clone(msgs)
	slices.SortFunc(msgs, func(a, b Message) int { return bytes.Compare(a.ID[:], b.ID[:]) })
	hooks := &afterCommitHooks{}
	ctx = context.WithValue(ctx, afterCommitKey{}, hooks)
	traced := make([]tracedMessage, 0, len(msgs))
	defer func() {
		for _, m := range traced {
			endSpan(m.span, err)
		}
	}()
	err = in.cfg.DB.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		for _, msg := range msgs {
			msgCtx, span := in.startSpan(ctx, msg)
			res := tx.Exec(claimInboxSQL, msg.ID, in.cfg.Consumer)
			duplicate := res.Error == nil && res.RowsAffected == 0
			traced = append(traced, tracedMessage{ctx: msgCtx, span: span, msg: msg, duplicate: duplicate})
			if res.Error != nil {
				return fmt.Errorf("claim inbox message %s: %w", msg.ID, res.Error)
			}
			if duplicate {
				continue
			}
			if err := work(tx.WithContext(msgCtx), msg); err != nil {
				return fmt.Errorf("message %s: %w", msg.ID, err)
			}
		}
		return nil
	}, inboxTxOptions)
	if err != nil {
		return err
	}
	for _, m := range traced {
		if m.duplicate {
			in.skipped(m.ctx, m.span, m.msg)
		}
	}
	committed := time.Now()
	for _, m := range traced {
		if !m.duplicate {
			in.cfg.Metrics.recordEventAge(in.cfg.Consumer, m.msg, committed)
		}
	}
	for _, fn := range hooks.fns {
		fn()
	}
	return nil
}

// tracedMessage is one message of a batch with its span.
type tracedMessage struct {
	ctx       context.Context
	span      trace.Span
	msg       Message
	duplicate bool
}

// skipped counts and logs a duplicate, in its span.
func (in *Inbox) skipped(ctx context.Context, span trace.Span, msg Message) {
	in.cfg.Metrics.recordDuplicate(in.cfg.Consumer)
	span.AddEvent("duplicate message skipped")
	in.log.InfoContext(ctx, "duplicate message skipped", "consumer", in.cfg.Consumer, "message_id", msg.ID, "type", msg.Type)
}

// BatchHandler adapts HandleBatch to a [Consumer]'s batches.
func (in *Inbox) BatchHandler(work func(ctx context.Context, tx *gorm.DB, msg Message) error) BatchHandler {
	return func(ctx context.Context, msgs []Message) error {
		return in.HandleBatch(ctx, msgs, func(tx *gorm.DB, msg Message) error { return work(tx.Statement.Context, tx, msg) })
	}
}

func (in *Inbox) databaseAnswers(ctx context.Context) bool {
	sqlDB, err := in.cfg.DB.DB()
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return sqlDB.PingContext(ctx) == nil
}
