package messaging

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/testhook"
)

// ErrNotInTransaction is returned by [Enqueue] when it is not given a transaction.
var ErrNotInTransaction = errors.New("outbox: enqueue needs the caller's transaction")

// Enqueue adds msgs to the outbox in tx, the caller's open transaction of driver d, and
// notifies the relays, which publish them once tx commits (unless d is of [WithoutNotify]: the
// relays then find them at their next poll).
//
// tx must be the same transaction that writes the business data the messages describe. That
// is the whole pattern: the data and its events are saved together or not at all, so a crash
// or a broker outage can never leave one without the other. Outside a transaction Enqueue
// would commit the messages on their own and bring back the dual write, so a driver whose
// transaction type can also be a plain handle (GORM's *gorm.DB) refuses it with
// [ErrNotInTransaction].
//
// A message without a trace context of its own gets ctx's, written by the process's global
// OpenTelemetry propagator (otel.SetTextMapPropagator): the relay and the consumers continue
// that trace. A message without an exchange goes to its relay's ([RelayConfig.Exchange]).
//
// It writes nothing, and returns an error, if a message lacks an id, a type or a JSON payload,
// if its id is not a UUIDv7 (the cleanup finds sent rows by the time in their ids), if AMQP
// cannot carry its envelope ([ErrInvalidEnvelope]): such a row would never be sent, or
// if PostgreSQL cannot store it: a NUL character in any field, or in the payload invalid UTF-8,
// an unpaired surrogate escape or a number beyond numeric's range, all of which
// encoding/json's Valid lets through; an OccurredAt outside the years 1 to 9999; or if it
// would be stored changed: invalid UTF-8 in its type, correlation id, trace context,
// exchange, routing key, or a header's name or value; or if two of msgs share an id; or if
// its payload is over 16 MiB as given, white space included, or as jsonb gives it back and the
// relay sends it, each number written out in full, 1e1000 as 1,001 digits ([ErrTooLarge]):
// RabbitMQ 4 takes no larger message by default, and PostgreSQL's jsonb fails on some not much
// larger, aborting tx. Checked before any statement, so that tx stays usable. An id stored
// already (a message enqueued again) is found by the insert, whose failure aborts tx.
//
// Past 8 MiB of rows it inserts them in several statements, in tx (they travel as one jsonb
// value, which holds at most 256 MiB), behind a savepoint: an error from any of them, an id
// stored already included, rolls tx back to it, and tx goes on, none of msgs written; unless
// that rollback fails too (a connection lost, a transaction its driver ended with ctx: the
// error says the transaction is unusable). On an error, roll tx back unless its data is to be
// saved without the messages.
//
// The payload is stored as jsonb: consumers get the same JSON value, not the same bytes (jsonb
// orders the keys, drops the whitespace and keeps the last of duplicate keys).
func Enqueue[Tx any](ctx context.Context, d Driver[Tx], tx Tx, msgs ...Message) error {
	ex, err := d.Executor(tx)
	if err != nil {
		return err
	}
	if len(msgs) == 0 {
		return nil
	}
	batches, err := outboxRows(ctx, msgs, time.Now().UTC(), enqueueBound(ctx))
	if err != nil {
		return err
	}
	insert := statements.InsertOutbox
	if _, quiet := d.(quietDriver[Tx]); quiet {
		insert = statements.InsertOutboxQuiet
	}
	if len(batches) == 1 {
		if _, err := ex.Exec(ctx, insert, batches[0].rows); err != nil {
			return fmt.Errorf("outbox: insert %d messages: %w", len(msgs), err)
		}
		return nil
	}
	return insertBatches(ctx, ex, insert, batches, len(msgs))
}

// insertBatches runs insert on each of batches, of total messages, in ex, all or none: an
// insert that fails before it reaches the server (its ctx ended) leaves the transaction usable,
// and a caller that logged the error and committed would commit the batches before it. So the
// batches go behind a savepoint, and an error rolls the transaction back to it: usable, none
// of the messages written.
func insertBatches(ctx context.Context, ex Executor, insert string, batches []outboxBatch, total int) error {
	if _, err := ex.Exec(ctx, `SAVEPOINT messaging_enqueue`); err != nil {
		return fmt.Errorf("outbox: insert %d messages: set a savepoint: %w", total, err)
	}
	var err error
	for _, b := range batches {
		if _, err = ex.Exec(ctx, insert, b.rows); err != nil {
			err = fmt.Errorf("outbox: insert messages %d to %d of %d: %w", b.first, b.first+b.n-1, total, err)
			break
		}
	}
	if err == nil {
		if _, err = ex.Exec(ctx, `RELEASE SAVEPOINT messaging_enqueue`); err == nil {
			return nil
		}
		// Its ctx ended before it reached the server, say: the rows are in, and are undone.
		err = fmt.Errorf("outbox: insert %d messages: release the savepoint: %w", total, err)
	}
	// Under a context of its own: ctx's end may be the error, and the savepoint still to undo.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleWait)
	defer cancel()
	for _, undo := range []string{`ROLLBACK TO SAVEPOINT messaging_enqueue`, `RELEASE SAVEPOINT messaging_enqueue`} {
		if _, rerr := ex.Exec(ctx, undo); rerr != nil {
			return errors.Join(err, fmt.Errorf("outbox: the transaction is unusable, roll it back: undo the %d messages (%s): %w", total, undo, rerr))
		}
	}
	return err
}

// WithoutNotify returns d, through which [Enqueue] inserts its messages without notifying the
// relays: for relays that poll ([RelayConfig.DisableNotify]), which nothing would wake. A
// commit that notifies takes a lock PostgreSQL shares across the whole server (on "database
// 0", in PreCommit_Notify) and holds it until the commit is flushed: the notifying commits of
// every database on the server go one at a time, each waiting for the others' flushes. Give
// Enqueue the returned driver itself: one wrapped again, in a driver of one's own, notifies.
func WithoutNotify[Tx any](d Driver[Tx]) Driver[Tx] { return quietDriver[Tx]{d} }

// quietDriver is a driver whose enqueues do not notify; it is its driver in all else.
type quietDriver[Tx any] struct{ Driver[Tx] }

// enqueueFrameSize is what [Enqueue] checks a message's envelope against: RabbitMQ's default
// frame size, less room for the app id the relay adds. The publisher checks again against its
// connection's own.
const enqueueFrameSize = 128<<10 - maxShortString

// enqueuePayloadBytes is the largest payload [Enqueue] takes, measured as given, and as jsonb
// gives it back (jsonbRefusal): RabbitMQ 4's default max_message_size, 16 MiB. A larger
// message would never be delivered there, and one message goes whole into an insert: past
// some 32 MiB (an array of 2^24 small numbers) jsonb's parser asks for 1 GiB at once, more
// than PostgreSQL allocates, and the insert fails and aborts the caller's transaction. At 16
// MiB it takes the backend under 1 GB.
const enqueuePayloadBytes = 16 << 20

// enqueueBatchBytes bounds the JSON array of one insert of [Enqueue]: its rows travel as one
// jsonb value, which PostgreSQL caps at 256 MiB (less a byte), and jsonb can take up to six
// times the bytes of its text (an array of one-digit numbers: a 4-byte entry and an 8-byte
// numeric for every 2 bytes). Refused by the server, the insert would abort the caller's
// transaction; past the bound the messages go in several inserts, in that transaction. Not
// higher: the backend's memory grows with the value (an array of digits of 32 MiB took one to
// 1.85 GB), and a smaller insert costs nothing measurable.
const enqueueBatchBytes = 8 << 20

// batchBytesKey is the key of a bound on the JSON of one insert lower than enqueueBatchBytes,
// in the ctx of a test's Enqueue (testhook.WithEnqueueBatchBytes): a few small messages are
// then split as megabytes would be.
type batchBytesKey struct{}

func init() {
	testhook.WithEnqueueBatchBytes = func(ctx context.Context, n int) context.Context {
		return context.WithValue(ctx, batchBytesKey{}, n)
	}
}

// enqueueBound is the bound on the JSON of one insert of an Enqueue under ctx.
func enqueueBound(ctx context.Context) int {
	if n, ok := ctx.Value(batchBytesKey{}).(int); ok {
		return n
	}
	return enqueueBatchBytes
}

// outboxBatch is the JSON array of the rows of one insert: the messages first to first+n-1.
type outboxBatch struct {
	rows     string
	first, n int
}

// outboxRows writes msgs as the JSON arrays statements.InsertOutbox reads, each of at most
// bound bytes unless it holds a single larger message: one, in all but the largest enqueues.
// It writes them by hand, without reflection, the payload as it is. Messages without an
// OccurredAt get now, those without a trace context ctx's.
func outboxRows(ctx context.Context, msgs []Message, now time.Time, bound int) ([]outboxBatch, error) {
	var trace traceCarrier
	injectTrace(ctx, globalPropagator(), &trace)
	var ids map[uuid.UUID]int // of the messages before, when there are several
	if len(msgs) > 1 {
		ids = make(map[uuid.UUID]int, len(msgs))
	}
	var batches []outboxBatch
	from := 0 // the current batch's first message
	b := make([]byte, 0, min(256*len(msgs), bound))
	b = append(b, '[')
	for i, m := range msgs {
		if m.ID == uuid.Nil || m.Type == "" || !json.Valid(m.Payload) {
			return nil, fmt.Errorf("outbox: enqueue message %d: needs an id, a type and a JSON payload (use NewMessage)", i)
		}
		// The cleanup finds sent rows through the primary key, up to the UUIDv7 of its cutoff:
		// an id of another version sorts anywhere, and its row might never be deleted.
		if m.ID.Version() != 7 {
			return nil, fmt.Errorf("outbox: enqueue message %d (%s): its id is a UUID version %d, not a UUIDv7 (use NewMessage, or uuid.NewV7)", i, m.ID, m.ID.Version())
		}
		if len(m.Payload) > enqueuePayloadBytes {
			return nil, fmt.Errorf("outbox: enqueue message %d (%s): %w: its payload is %d bytes, more than the %d a default RabbitMQ 4 takes", i, m.ID, ErrTooLarge, len(m.Payload), enqueuePayloadBytes)
		}
		if first, ok := ids[m.ID]; ok {
			return nil, fmt.Errorf("outbox: enqueue message %d (%s): message %d has its id already", i, m.ID, first)
		} else if ids != nil {
			ids[m.ID] = i
		}
		if m.OccurredAt.IsZero() {
			m.OccurredAt = now
		}
		if m.TraceParent == "" {
			m = m.withTrace(trace)
		}
		if err := checkEnvelope(m.Exchange, m.routingKey(), toPublishing(m, ""), enqueueFrameSize); err != nil {
			return nil, fmt.Errorf("outbox: enqueue message %d (%s): %w", i, m.ID, err)
		}
		if why := unstorable(m); why != "" {
			return nil, fmt.Errorf("outbox: enqueue message %d (%s): %s", i, m.ID, why)
		}
		// The relay sends the payload as jsonb gives it back, each number written out in full: 8
		// bytes of 1e131071 read back as 131,072, and a payload of a few KiB as hundreds of MiB,
		// never sent, and as large in the relay's memory and the server's at every attempt.
		if why, printed := jsonbRefusal(m.Payload); why != "" {
			return nil, fmt.Errorf("outbox: enqueue message %d (%s): its payload holds %s, which PostgreSQL's jsonb cannot store", i, m.ID, why)
		} else if printed > enqueuePayloadBytes {
			return nil, fmt.Errorf("outbox: enqueue message %d (%s): %w: its payload is %d bytes as PostgreSQL's jsonb gives it back, its numbers written out in full, more than the %d a default RabbitMQ 4 takes", i, m.ID, ErrTooLarge, printed, enqueuePayloadBytes)
		}
		start := len(b)
		if i > from {
			b = append(b, ',')
		}
		b = append(b, `{"id":"`...)
		b = append(b, m.ID.String()...)
		b = append(b, `","type":`...)
		b = appendJSONString(b, m.Type)
		b = append(b, `,"payload":`...)
		b = append(b, m.Payload...)
		b = append(b, `,"correlation_id":`...)
		b = appendJSONString(b, m.CorrelationID)
		b = append(b, `,"occurred_at":"`...)
		b = m.OccurredAt.UTC().AppendFormat(b, time.RFC3339Nano)
		b = append(b, `","trace_parent":`...)
		b = appendJSONString(b, m.TraceParent)
		b = append(b, `,"trace_state":`...)
		b = appendJSONString(b, m.TraceState)
		b = append(b, `,"exchange":`...)
		b = appendJSONStringOrNull(b, m.Exchange)
		b = append(b, `,"routing_key":`...)
		b = appendJSONStringOrNull(b, m.RoutingKey)
		b = append(b, `,"headers":`...)
		b = appendJSONObject(b, m.Headers)
		b = append(b, '}')
		if len(b)+1 > bound && i > from {
			// Past the bound with this row: the rows before are a batch, and it begins the next,
			// in b's room. The batch's end overwrites the row's comma only.
			row := b[start+1:]
			batches = append(batches, outboxBatch{rows: string(append(b[:start], ']')), first: from, n: i - from})
			b = append(b[:1], row...)
			from = i
		}
	}
	return append(batches, outboxBatch{rows: string(append(b, ']')), first: from, n: len(msgs) - from}), nil
}

// unstorable says what in m, its payload aside (jsonbRefusal), PostgreSQL cannot store, or ""
// if it can all be stored. Its insert would fail and abort the caller's transaction, with
// every statement in it: Enqueue refuses the message first, and the transaction goes on.
func unstorable(m Message) string {
	// Text without a NUL can still be stored changed: JSON, in which the rows are written,
	// carries no invalid UTF-8, and each bad byte would become U+FFFD, three bytes, after the
	// envelope's size was checked. Published elsewhere than asked, taken for another type, or
	// past AMQP's 255 bytes and refused at every attempt.
	for _, f := range [...]struct{ name, value string }{
		{"type", m.Type}, {"correlation id", m.CorrelationID}, {"trace parent", m.TraceParent},
		{"trace state", m.TraceState}, {"exchange", m.Exchange}, {"routing key", m.RoutingKey},
	} {
		if strings.IndexByte(f.value, 0) >= 0 {
			return "its " + f.name + " holds a NUL character, which PostgreSQL's text cannot store"
		}
		if !utf8.ValidString(f.value) {
			return "its " + f.name + " is not valid UTF-8, and would be stored changed"
		}
	}
	for k, v := range m.Headers {
		if strings.IndexByte(k, 0) >= 0 || strings.IndexByte(v, 0) >= 0 {
			return "its header " + strconv.Quote(k) + " holds a NUL character, which PostgreSQL's text cannot store"
		}
		if !utf8.ValidString(k) {
			return "its header " + strconv.Quote(k) + " has a name that is not valid UTF-8, and would be stored changed"
		}
		if !utf8.ValidString(v) {
			return "its header " + strconv.Quote(k) + " has a value that is not valid UTF-8, and would be stored changed"
		}
	}
	if y := m.OccurredAt.UTC().Year(); y < 1 || y > 9999 {
		// PostgreSQL stores none before the year 1; RFC 3339, in which JSON carries times (and
		// encoding/json writes them), none after 9999.
		return "its occurred-at time is in the year " + strconv.Itoa(y) + ", outside the years 1 to 9999"
	}
	return ""
}

// appendJSONString appends s, valid UTF-8 (unstorable refuses any other), as a JSON string.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// appendJSONStringOrNull appends s, or null for "".
func appendJSONStringOrNull(b []byte, s string) []byte {
	if s == "" {
		return append(b, "null"...)
	}
	return appendJSONString(b, s)
}

// appendJSONObject appends m as a JSON object of strings, or null when it is empty.
func appendJSONObject(b []byte, m map[string]string) []byte {
	if len(m) == 0 {
		return append(b, "null"...)
	}
	b = append(b, '{')
	first := true
	for k, v := range m {
		if !first {
			b = append(b, ',')
		}
		first = false
		b = appendJSONString(b, k)
		b = append(b, ':')
		b = appendJSONString(b, v)
	}
	return append(b, '}')
}

// OutboxMessage is one row of outbox_messages, as the operator's functions read it
// ([FailingOutboxMessages], [OutboxMessageByID]). The library's migrations define the table;
// only [Enqueue] inserts.
type OutboxMessage struct {
	ID            uuid.UUID
	Type          string
	CorrelationID string
	OccurredAt    time.Time
	ProcessedAt   *time.Time // set once the broker confirmed the publish
	Attempts      int
	LastError     *string
	NextAttemptAt time.Time  // the database's clock decides when a row is due; zero while parked
	Exchange      *string    // nil: the relay's exchange
	RoutingKey    *string    // nil: the type
	ParkedAt      *time.Time // set while an operator keeps the row from being sent ([ParkOutboxMessage])
	ParkedReason  *string
	// Payload is read only by the functions that say so; nil elsewhere.
	Payload json.RawMessage
}

// Sent reports whether the broker confirmed the row's publish.
func (m OutboxMessage) Sent() bool { return m.ProcessedAt != nil }

// Parked reports whether the row is parked: unsent, and never sent until it is unparked.
func (m OutboxMessage) Parked() bool { return m.ParkedAt != nil }
