package messaging

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// OutboxStats is what to alert on: a backlog whose oldest row keeps ageing means the relay is
// stuck or the broker is down; a row with many attempts is a message that cannot be published.
// Parked rows are counted apart: an operator set them aside, and they must neither hide a
// stuck relay nor page anyone, but never drop out of view either.
type OutboxStats struct {
	Pending       int64         // rows not yet sent, parked ones aside
	OldestPending time.Duration // age of the oldest of them, 0 when none
	MaxAttempts   int64         // most failed attempts of any of them
	Parked        int64         // rows parked by an operator ([ParkOutboxMessage])
}

// ReadOutboxStats reads OutboxStats, exactly: it reads every unsent row (0.3-0.4 s for 3
// million). [RegisterOutboxStats]'s gauges read the oldest rows only.
func ReadOutboxStats(ctx context.Context, db Executor) (OutboxStats, error) {
	return readOutboxStats(ctx, db, statements.OutboxStats)
}

func readOutboxStats(ctx context.Context, db Executor, query string, args ...any) (OutboxStats, error) {
	var s OutboxStats
	var oldestSeconds float64
	err := queryRow(ctx, db, []any{&s.Pending, &oldestSeconds, &s.MaxAttempts, &s.Parked}, query, args...)
	if err != nil {
		return OutboxStats{}, fmt.Errorf("read outbox stats: %w", err)
	}
	s.OldestPending = time.Duration(max(oldestSeconds, 0) * float64(time.Second))
	return s, nil
}

// FailingOutboxMessages returns up to limit unsent rows the broker refused at least once,
// parked ones aside, with their attempts and last error (not their payloads), the latest next
// attempt first. The table keeps no time of failure; as each next attempt is a backoff after
// its failure, and the backoff of a row failing for long is the cap, this is close to the
// latest failures first.
func FailingOutboxMessages(ctx context.Context, db Executor, limit int) ([]OutboxMessage, error) {
	out, err := queryOutbox(ctx, db, false, statements.FailingOutbox, limit)
	if err != nil {
		return nil, fmt.Errorf("read failing outbox messages: %w", err)
	}
	return out, nil
}

// ParkedOutboxMessages returns up to limit parked rows, without their payloads, the latest
// parked first.
func ParkedOutboxMessages(ctx context.Context, db Executor, limit int) ([]OutboxMessage, error) {
	out, err := queryOutbox(ctx, db, false, statements.ParkedOutbox, limit)
	if err != nil {
		return nil, fmt.Errorf("read parked outbox messages: %w", err)
	}
	return out, nil
}

// OutboxFilter narrows the rows an operator's bulk action considers. Its zero value takes
// them all.
type OutboxFilter struct {
	Type  string // only rows of this type, unless ""
	Limit int    // at most this many, the oldest first, unless 0
}

// WaitingOutboxMessages returns, without their payloads and oldest first, the rows of f that
// wait out a backoff: unsent, not parked, not due yet. They are the rows
// [RetryOutboxMessages] would make due, and what an operator confirms before
// [RetryListedOutboxMessages] does it to them.
func WaitingOutboxMessages(ctx context.Context, db Executor, f OutboxFilter) ([]OutboxMessage, error) {
	if f.Limit < 0 {
		return nil, fmt.Errorf("read waiting outbox messages: limit %d is negative", f.Limit)
	}
	out, err := queryOutbox(ctx, db, false, statements.WaitingOutbox, f.Type, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("read waiting outbox messages: %w", err)
	}
	return out, nil
}

// WaitingOutboxMessageIDs returns the ids of the rows [WaitingOutboxMessages] returns, in its
// order: a tool that retries a backlog of millions lists them in a few bytes each, and
// retries them, a batch at a time, with [RetryListedOutboxMessages].
func WaitingOutboxMessageIDs(ctx context.Context, db Executor, f OutboxFilter) ([]uuid.UUID, error) {
	if f.Limit < 0 {
		return nil, fmt.Errorf("read waiting outbox message ids: limit %d is negative", f.Limit)
	}
	rows, err := db.Query(ctx, statements.WaitingOutboxIDs, f.Type, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("read waiting outbox message ids: %w", err)
	}
	defer rows.Close()
	var ids []uuid.UUID
	for rows.Next() {
		var id uuid.UUID
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("read waiting outbox message ids: %w", err)
		}
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read waiting outbox message ids: %w", err)
	}
	return ids, nil
}

// ListedOutboxMessages returns the rows ids, as they are now and without their payloads, the
// oldest first: a tool shows a backlog listed by [WaitingOutboxMessageIDs] a batch at a time.
func ListedOutboxMessages(ctx context.Context, db Executor, ids []uuid.UUID) ([]OutboxMessage, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	out, err := queryOutbox(ctx, db, false, statements.ListedOutbox, uuidArray(ids))
	if err != nil {
		return nil, fmt.Errorf("read outbox rows: %w", err)
	}
	return out, nil
}

// Errors of the functions that act on one outbox row; each is wrapped with the row's id.
var (
	// ErrNoOutboxMessage: no row has the id.
	ErrNoOutboxMessage = errors.New("no outbox row has this id")
	// ErrNoUnsentMessage: no unsent row has the id (none at all, or it was sent).
	ErrNoUnsentMessage = errors.New("no unsent outbox row has this id")
	// ErrOutboxMessageParked: the row is parked, and the action is not for parked rows.
	ErrOutboxMessageParked = errors.New("the outbox row is parked")
	// ErrOutboxMessageNotParked: the row is not parked, and the action is for parked rows.
	ErrOutboxMessageNotParked = errors.New("the outbox row is not parked")
)

// OutboxMessageByID returns row id, with its payload, or [ErrNoOutboxMessage].
func OutboxMessageByID(ctx context.Context, db Executor, id uuid.UUID) (OutboxMessage, error) {
	out, err := queryOutbox(ctx, db, true, statements.OutboxRow, id)
	switch {
	case err != nil:
		return OutboxMessage{}, fmt.Errorf("read outbox row %s: %w", id, err)
	case len(out) == 0:
		return OutboxMessage{}, fmt.Errorf("%w: %s", ErrNoOutboxMessage, id)
	}
	return out[0], nil
}

// RetryOutboxMessages makes every unsent row that waits out a backoff due now, and wakes the
// relays; it returns how many. Parked rows stay parked. Each row keeps its attempts and last
// error: they are its history, and a row that fails again backs off from where it was (and
// still counts in outbox_max_attempts until it is sent).
func RetryOutboxMessages(ctx context.Context, db DB) (int64, error) {
	var n int64
	err := inTx(ctx, db, func(tx TxExecutor) (notify bool, err error) {
		n, err = tx.Exec(ctx, statements.RetryAll)
		return n > 0, err
	})
	if err != nil {
		return 0, fmt.Errorf("make outbox rows due: %w", err)
	}
	return n, nil
}

// RetryListedOutboxMessages makes due now, as [RetryOutboxMessages] does, those of the rows
// ids that still wait out a backoff, and returns them as they are now: an operator's tool
// lists the rows ([WaitingOutboxMessages]), has them confirmed, and retries exactly those.
func RetryListedOutboxMessages(ctx context.Context, db DB, ids []uuid.UUID) ([]OutboxMessage, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	var retried []OutboxMessage
	err := inTx(ctx, db, func(tx TxExecutor) (notify bool, err error) {
		retried, err = queryOutbox(ctx, tx, false, statements.RetryListed, uuidArray(ids))
		return len(retried) > 0, err
	})
	if err != nil {
		return nil, fmt.Errorf("make outbox rows due: %w", err)
	}
	return retried, nil
}

// RetryOutboxMessage makes the unsent row id due now, as [RetryOutboxMessages] does for all,
// and returns it as it is now, with its payload, from the change itself: no read after the
// commit can fail once the row is due. It fails with [ErrNoUnsentMessage], or
// [ErrOutboxMessageParked] for a parked row, which [UnparkOutboxMessage] makes due.
func RetryOutboxMessage(ctx context.Context, db DB, id uuid.UUID) (OutboxMessage, error) {
	return changeOutboxRow(ctx, db, id, "make outbox row due", func(m OutboxMessage) error {
		if m.Parked() {
			return ErrOutboxMessageParked
		}
		return nil
	}, true, statements.RetryOne, id)
}

// ParkOutboxMessage parks the unsent row id, for reason: no relay sends it until
// [UnparkOutboxMessage], and it is counted apart ([OutboxStats].Parked). It is for a row the
// broker will never accept, which would otherwise be retried forever; its attempts and last
// error stay. It returns the row as parked; [ErrNoUnsentMessage], or [ErrOutboxMessageParked]
// if it is parked already. A row a relay is publishing at that moment is parked once the
// relay's verdict is in, or found sent.
func ParkOutboxMessage(ctx context.Context, db DB, id uuid.UUID, reason string) (OutboxMessage, error) {
	return changeOutboxRow(ctx, db, id, "park outbox row", func(m OutboxMessage) error {
		if m.Parked() {
			return ErrOutboxMessageParked
		}
		return nil
	}, false, statements.ParkOne, id, reason)
}

// UnparkOutboxMessage makes the parked row id due now, and wakes the relays. It returns the
// row as it is now; [ErrNoUnsentMessage], or [ErrOutboxMessageNotParked] if it is not parked.
func UnparkOutboxMessage(ctx context.Context, db DB, id uuid.UUID) (OutboxMessage, error) {
	return changeOutboxRow(ctx, db, id, "unpark outbox row", func(m OutboxMessage) error {
		if !m.Parked() {
			return ErrOutboxMessageNotParked
		}
		return nil
	}, true, statements.UnparkOne, id)
}

// DropOutboxMessage deletes the unsent row id, parked or not: no relay publishes its event
// again. Unsent says only that no relay recorded it sent: an earlier attempt that ended without
// the broker's confirm (none within the timeout, the connection lost first) may have been
// delivered all the same, as may one whose relay stopped before it marked the row sent.
// It returns the row as it was, with its payload, so that the caller can keep a record of what
// it dropped; [ErrNoUnsentMessage] if there is no such row or it was sent.
func DropOutboxMessage(ctx context.Context, db DB, id uuid.UUID) (OutboxMessage, error) {
	return changeOutboxRow(ctx, db, id, "drop outbox row", nil, false, statements.DropOne, id)
}

// changeOutboxRow locks row id and refuses it with ErrNoUnsentMessage if it is missing or sent,
// or with what check says; otherwise it runs change, which returns the row (statements.
// OutboxColumns and the payload), and notifies the relays if notify says so. All in one
// transaction. It returns the row change returned.
func changeOutboxRow(ctx context.Context, db DB, id uuid.UUID, what string, check func(OutboxMessage) error,
	notify bool, change string, args ...any) (OutboxMessage, error) {
	var row OutboxMessage
	err := inTx(ctx, db, func(tx TxExecutor) (bool, error) {
		locked, err := queryOutbox(ctx, tx, true, statements.LockOutboxRow, id)
		if err != nil {
			return false, err
		}
		if len(locked) == 0 || locked[0].Sent() {
			return false, refusal{ErrNoUnsentMessage}
		}
		if check != nil {
			if err := check(locked[0]); err != nil {
				return false, refusal{err}
			}
		}
		changed, err := queryOutbox(ctx, tx, true, change, args...)
		if err != nil {
			return false, err
		}
		if len(changed) != 1 { // the lock makes this impossible; a guard all the same
			return false, fmt.Errorf("%d rows changed, want 1", len(changed))
		}
		row = changed[0]
		return notify, nil
	})
	var r refusal
	switch {
	case errors.As(err, &r):
		return OutboxMessage{}, fmt.Errorf("%w: %s", r.err, id)
	case err != nil:
		return OutboxMessage{}, fmt.Errorf("%s %s: %w", what, id, err)
	}
	return row, nil
}

// refusal is a row's state that forbids an action, one of the errors above.
type refusal struct{ err error }

func (r refusal) Error() string { return r.err.Error() }

// inTx runs fn in a transaction and commits it, with a notification to the relays if fn asks
// for one: as with [Enqueue], they claim the rows at the commit instead of at their next poll.
// A cancelled ctx interrupts the wait for a connection and fn's statements, which then change
// nothing; but not the commit: interrupted, a commit may have happened or not, and an operator
// who dropped a row would not know whether its payload, returned only on success, was the
// last copy. A commit that never answers holds the caller (outboxctl: until a second signal).
func inTx(ctx context.Context, db DB, fn func(tx TxExecutor) (notify bool, err error)) (err error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	uncancelled := context.WithoutCancel(ctx)
	tx, err := conn.Begin(uncancelled) // database/sql rolls back a transaction whose ctx ends
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			rollback(ctx, tx)
		}
	}()
	notify, err := fn(tx)
	if err != nil {
		return err
	}
	if notify {
		if _, err = tx.Exec(ctx, statements.Notify); err != nil {
			return fmt.Errorf("notify relay: %w", err)
		}
	}
	return tx.Commit(uncancelled)
}

// queryOutbox runs a query that returns statements.OutboxColumns, and the payload after them
// if withPayload, and returns its rows.
func queryOutbox(ctx context.Context, db Executor, withPayload bool, query string, args ...any) ([]OutboxMessage, error) {
	rows, err := db.Query(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []OutboxMessage
	for rows.Next() {
		var m OutboxMessage
		var next *time.Time
		dest := []any{&m.ID, &m.Type, &m.CorrelationID, &m.OccurredAt, &m.ProcessedAt, &m.Attempts, &m.LastError,
			&next, &m.Exchange, &m.RoutingKey, &m.ParkedAt, &m.ParkedReason}
		var payload []byte
		if withPayload {
			dest = append(dest, &payload)
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		if next != nil {
			m.NextAttemptAt = *next
		}
		if payload != nil {
			m.Payload = json.RawMessage(payload)
		}
		out = append(out, m)
	}
	return out, rows.Err()
}

// InboxRecord says that a consumer handled a message, and when.
type InboxRecord struct {
	MessageID uuid.UUID
	Consumer  string
	// ProcessedAt is when the transaction of its work began (the claim is its first
	// statement, stamped with the transaction's now()): it committed a handler's time later.
	ProcessedAt time.Time
}

// FindInboxRecords returns the inbox's records of message id: those of consumer, or of every
// consumer if consumer is "", by consumer name. None means not handled, or handled so long ago
// that [DeleteInboxMessages] deleted the record.
func FindInboxRecords(ctx context.Context, db Executor, id uuid.UUID, consumer string) ([]InboxRecord, error) {
	rows, err := db.Query(ctx, statements.InboxRecords, id, consumer)
	if err != nil {
		return nil, fmt.Errorf("read inbox records of %s: %w", id, err)
	}
	defer rows.Close()
	var out []InboxRecord
	for rows.Next() {
		var r InboxRecord
		if err := rows.Scan(&r.MessageID, &r.Consumer, &r.ProcessedAt); err != nil {
			return nil, fmt.Errorf("read inbox records of %s: %w", id, err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read inbox records of %s: %w", id, err)
	}
	return out, nil
}

// queryRow runs a query that returns one row and scans it into dest. It reads the results to
// their end: an error the server sends after the row (the statement cancelled, or timed out,
// as it completed) shows in Err only then. Unreported, it would leave a transaction aborted
// behind a success, whose commit then says only that it rolled back.
func queryRow(ctx context.Context, db Executor, dest []any, query string, args ...any) error {
	rows, err := db.Query(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return errors.New("no row")
	}
	if err := rows.Scan(dest...); err != nil {
		return err
	}
	if rows.Next() {
		return errors.New("more than one row")
	}
	return rows.Err()
}
