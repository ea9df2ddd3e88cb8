package messaging

import (
	"context"
	"fmt"
	"time"

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
