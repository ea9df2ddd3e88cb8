package messaging

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"
)

// OutboxStats is what to alert on: a backlog whose oldest row keeps ageing means the relay is
// stuck or the broker is down; a row with many attempts is a message that cannot be published.
type OutboxStats struct {
	Pending       int64         // rows not yet sent
	OldestPending time.Duration // age of the oldest unsent row, 0 when none
	MaxAttempts   int64         // most failed attempts of any unsent row
}

// ReadOutboxStats reads OutboxStats. It only touches unsent rows, through the partial index.
func ReadOutboxStats(ctx context.Context, db *gorm.DB) (OutboxStats, error) {
	var row struct {
		Pending       int64
		OldestSeconds float64
		MaxAttempts   int64
	}
	err := db.WithContext(ctx).Raw(`SELECT count(*) AS pending,
       coalesce(extract(epoch FROM now() - min(occurred_at)), 0) AS oldest_seconds,
       coalesce(max(attempts), 0) AS max_attempts
FROM outbox_messages WHERE processed_at IS NULL`).Scan(&row).Error
	if err != nil {
		return OutboxStats{}, fmt.Errorf("read outbox stats: %w", err)
	}
	return OutboxStats{
		Pending:       row.Pending,
		OldestPending: time.Duration(max(row.OldestSeconds, 0) * float64(time.Second)),
		MaxAttempts:   row.MaxAttempts,
	}, nil
}

// FailingOutboxMessages returns up to limit unsent rows the broker refused at least once, with
// their attempts and last error (not their payloads), the latest next attempt first. The table
// keeps no time of failure; as each next attempt is a backoff after its failure, and the
// backoff of a row failing for long is the cap, this is close to the latest failures first.
func FailingOutboxMessages(ctx context.Context, db *gorm.DB, limit int) ([]OutboxMessage, error) {
	var rows []OutboxMessage
	err := db.WithContext(ctx).
		Select("id, type, correlation_id, occurred_at, attempts, last_error, next_attempt_at").
		Where("processed_at IS NULL AND attempts > 0").
		Order("next_attempt_at DESC, id").Limit(limit).Find(&rows).Error
	if err != nil {
		return nil, fmt.Errorf("read failing outbox messages: %w", err)
	}
	return rows, nil
}

// ErrNoUnsentMessage is returned by [RetryOutboxMessage] for an id that names no unsent row.
var ErrNoUnsentMessage = errors.New("no unsent outbox row has this id")

// RetryOutboxMessages makes every unsent row that waits out a backoff due now, and wakes the
// relays; it returns how many. Each row keeps its attempts and last error: they are its
// history, and a row that fails again backs off from where it was (and still counts in
// outbox_max_attempts until it is sent).
func RetryOutboxMessages(ctx context.Context, db *gorm.DB) (int64, error) {
	return retryOutbox(ctx, db, `UPDATE outbox_messages SET next_attempt_at = now()
WHERE processed_at IS NULL AND next_attempt_at > now()`)
}

// RetryOutboxMessage makes the unsent row id due now, as [RetryOutboxMessages] does for all.
func RetryOutboxMessage(ctx context.Context, db *gorm.DB, id uuid.UUID) error {
	n, err := retryOutbox(ctx, db, `UPDATE outbox_messages SET next_attempt_at = now()
WHERE id = ? AND processed_at IS NULL`, id)
	if err == nil && n == 0 {
		err = fmt.Errorf("%w: %s", ErrNoUnsentMessage, id)
	}
	return err
}

// retryOutbox runs the update and, if it changed rows, notifies the relays in the same
// transaction, as [Enqueue] does: they claim the rows on commit instead of at their next poll.
func retryOutbox(ctx context.Context, db *gorm.DB, update string, args ...any) (int64, error) {
	var n int64
	err := db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		res := tx.Exec(update, args...)
		if res.Error != nil {
			return fmt.Errorf("make outbox rows due: %w", res.Error)
		}
		if n = res.RowsAffected; n == 0 {
			return nil
		}
		if err := tx.Exec("SELECT pg_notify(?, '')", NotifyChannel).Error; err != nil {
			return fmt.Errorf("notify relay: %w", err)
		}
		return nil
	})
	return n, err
}
