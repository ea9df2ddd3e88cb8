package messaging

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"gorm.io/gorm"
)

// claimInboxSQL records that a consumer handles a message. The primary key (message_id,
// consumer) decides between two deliveries of one message, even concurrent ones: the second
// insert waits for the first transaction and then affects 0 rows. There is no check-then-insert
// race, and no unique-violation error that would abort the transaction.
const claimInboxSQL = `INSERT INTO inbox_messages (message_id, consumer, processed_at)
VALUES (?, ?, now())
ON CONFLICT (message_id, consumer) DO NOTHING`

// Inbox makes a consumer's work idempotent: it runs the work for a message at most once per
// consumer name, in the same transaction as the record that it did.
type Inbox struct {
	db       *gorm.DB
	consumer string
	log      *slog.Logger
}

// NewInbox returns the inbox of the named consumer (e.g. "invoicing") in db, which holds
// inbox_messages and the consumer's own tables. Consumers sharing a database keep separate
// records through their names.
func NewInbox(db *gorm.DB, consumer string, logger *slog.Logger) *Inbox {
	if logger == nil {
		logger = slog.Default()
	}
	return &Inbox{db: db, consumer: consumer, log: logger.With("component", "inbox")}
}

// Handle claims msg and runs work with the same transaction, then commits both. If this
// consumer already handled msg it runs nothing, logs one "duplicate" line and reports
// duplicate=true. If work fails, the claim rolls back with it, so a redelivery runs it again.
//
// Errors: those of work are returned as they are (mark undecodable input with [Permanent]);
// any other failure while the database does not answer is wrapped with [Unavailable].
func (in *Inbox) Handle(ctx context.Context, msg Message, work func(tx *gorm.DB) error) (duplicate bool, err error) {
	err = in.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		res := tx.Exec(claimInboxSQL, msg.ID, in.consumer)
		if res.Error != nil {
			return fmt.Errorf("claim inbox message %s: %w", msg.ID, res.Error)
		}
		if duplicate = res.RowsAffected == 0; duplicate {
			return nil
		}
		return work(tx)
	})
	if err != nil {
		if !IsPermanent(err) && ctx.Err() == nil && !in.databaseAnswers(ctx) {
			err = Unavailable(err)
		}
		return false, err
	}
	if duplicate {
		in.log.Info("duplicate message skipped", "consumer", in.consumer, "message_id", msg.ID, "type", msg.Type)
	}
	return duplicate, nil
}

// Handler adapts the inbox to a [Consumer]: every delivery runs through Handle.
func (in *Inbox) Handler(work func(ctx context.Context, tx *gorm.DB, msg Message) error) Handler {
	return func(ctx context.Context, msg Message) error {
		_, err := in.Handle(ctx, msg, func(tx *gorm.DB) error { return work(ctx, tx, msg) })
		return err
	}
}

func (in *Inbox) databaseAnswers(ctx context.Context) bool {
	sqlDB, err := in.db.DB()
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return sqlDB.PingContext(ctx) == nil
}
