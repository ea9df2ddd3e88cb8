package messaging

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"
)

// NotifyChannel is the PostgreSQL channel [Enqueue] notifies and the [Relay] listens on.
const NotifyChannel = "outbox_messages"

// insertOutboxSQL is followed by one insertOutboxRow per message.
const (
	insertOutboxSQL  = `INSERT INTO outbox_messages (id, type, payload, correlation_id, occurred_at, trace_parent, trace_state, exchange, routing_key) VALUES `
	insertOutboxRow  = "(?, ?, ?, ?, ?, ?, ?, ?, ?)"
	insertOutboxArgs = 9
)

// maxInsertRows is the most rows one INSERT may carry: PostgreSQL's wire protocol numbers a
// statement's parameters with 16 bits.
const maxInsertRows = 65535 / insertOutboxArgs

// ErrNotInTransaction is returned by [Enqueue] when it is given a *gorm.DB that is not inside
// a transaction.
var ErrNotInTransaction = errors.New("outbox: enqueue needs the caller's transaction")

// OutboxMessage is one row of outbox_messages: an event waiting to be, or already, published.
// It is for reading rows; the library's migrations define the table and its column defaults,
// and only [Enqueue] inserts.
type OutboxMessage struct {
	ID            uuid.UUID       `gorm:"type:uuid;primaryKey"`
	Type          string          `gorm:"not null"`
	Payload       json.RawMessage `gorm:"type:jsonb;not null"`
	CorrelationID string          `gorm:"not null"`
	OccurredAt    time.Time       `gorm:"not null"`
	ProcessedAt   *time.Time      // set once the broker confirmed the publish
	Attempts      int             `gorm:"not null"`
	LastError     *string
	NextAttemptAt time.Time `gorm:"not null"` // the database's clock decides when a row is due
	TraceParent   string    `gorm:"not null"` // W3C trace context of the enqueuing span; "" for none
	TraceState    string    `gorm:"not null"`
	Exchange      *string   // nil: the relay's exchange
	RoutingKey    *string   // nil: the type
}

// TableName pins the table name the migrations create.
func (OutboxMessage) TableName() string { return "outbox_messages" }

// Message returns the row's envelope.
func (m OutboxMessage) Message() Message {
	return Message{ID: m.ID, Type: m.Type, Payload: m.Payload, OccurredAt: m.OccurredAt, CorrelationID: m.CorrelationID,
		TraceParent: m.TraceParent, TraceState: m.TraceState, Exchange: deref(m.Exchange), RoutingKey: deref(m.RoutingKey)}
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// nullIfEmpty stores "" as NULL.
func nullIfEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// Enqueue adds msgs to the outbox inside tx, the caller's open transaction, and notifies the
// relay that will publish them once tx commits.
//
// tx must be the same transaction that writes the business data the messages describe
// (typically the tx of db.Transaction). That is the whole pattern: the data and its events are
// saved together or not at all, so a crash or a broker outage can never leave one without the
// other. Given a plain *gorm.DB, Enqueue would commit the messages on their own and bring back
// the dual-write problem, so it refuses with [ErrNotInTransaction] instead.
//
// Each message keeps the trace context of the span in tx's context (db.WithContext(ctx) before
// the transaction; a consumer's handler gets such a tx), unless it has one of its own: the
// relay and the consumers continue that trace.
func Enqueue(tx *gorm.DB, msgs ...Message) error {
	if _, ok := tx.Statement.ConnPool.(gorm.TxCommitter); !ok {
		return ErrNotInTransaction
	}
	if len(msgs) == 0 {
		return nil
	}
	for i, m := range msgs {
		if m.ID == uuid.Nil || m.Type == "" || !json.Valid(m.Payload) {
			return fmt.Errorf("outbox: enqueue message %d: needs an id, a type and a JSON payload (use NewMessage)", i)
		}
	}
	now := time.Now().UTC()
	traceParent, traceState := traceOf(tx.Statement.Context)
	for chunk := range slices.Chunk(msgs, maxInsertRows) {
		if err := insertOutbox(tx, chunk, now, traceParent, traceState); err != nil {
			return err
		}
	}
	// NOTIFY inside the transaction is delivered only if and when it commits: the relay wakes
	// exactly when the rows become visible to it.
	if err := tx.Exec("SELECT pg_notify(?, '')", NotifyChannel).Error; err != nil {
		return fmt.Errorf("outbox: notify relay: %w", err)
	}
	return nil
}

// insertOutbox inserts msgs, at most maxInsertRows of them, in one statement. Messages without
// an OccurredAt get now, those without a trace context the caller's (traceParent, traceState).
func insertOutbox(tx *gorm.DB, msgs []Message, now time.Time, traceParent, traceState string) error {
	values := make([]string, len(msgs))
	args := make([]any, 0, insertOutboxArgs*len(msgs))
	for i, m := range msgs {
		if m.OccurredAt.IsZero() {
			m.OccurredAt = now
		}
		if m.TraceParent == "" {
			m.TraceParent, m.TraceState = traceParent, traceState
		}
		values[i] = insertOutboxRow
		args = append(args, m.ID, m.Type, string(m.Payload), m.CorrelationID, m.OccurredAt, m.TraceParent, m.TraceState,
			nullIfEmpty(m.Exchange), nullIfEmpty(m.RoutingKey))
	}
	// next_attempt_at, processed_at and attempts take their defaults: due now, by the
	// database's clock.
	if err := tx.Exec(insertOutboxSQL+strings.Join(values, ", "), args...).Error; err != nil {
		return fmt.Errorf("outbox: insert %d messages: %w", len(msgs), err)
	}
	return nil
}
