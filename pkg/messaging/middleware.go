package messaging

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"gorm.io/gorm"
)

// Recover turns a panic in the handler into that message's error: its transaction rolls back,
// the message is retried like any failure (and dead-lettered at its delivery limit), and the
// process, with the other messages in flight, lives on. The stack is logged once, here.
func Recover(log *slog.Logger) Middleware {
	return func(next HandlerFunc) HandlerFunc {
		return func(ctx context.Context, tx *gorm.DB, msg Message) (err error) {
			defer func() {
				if r := recover(); r != nil {
					err = fmt.Errorf("handler panicked: %v", r)
					log.ErrorContext(ctx, "handler panicked", "message_id", msg.ID, "type", msg.Type, "panic", r, "stack", string(debug.Stack()))
				}
			}()
			return next(ctx, tx, msg)
		}
	}
}

// Timeout bounds one message's handling. The transaction's statements run under the same
// deadline, so a handler stuck in the database is cut off too.
func Timeout(d time.Duration) Middleware {
	return func(next HandlerFunc) HandlerFunc {
		return func(ctx context.Context, tx *gorm.DB, msg Message) error {
			ctx, cancel := context.WithTimeout(ctx, d)
			defer cancel()
			return next(ctx, tx.WithContext(ctx), msg)
		}
	}
}

// Observe logs each message's outcome (at debug level when it succeeds) and counts it, with
// its handling time, by consumer, type and outcome.
func Observe(consumer string, log *slog.Logger, m *Metrics) Middleware {
	return func(next HandlerFunc) HandlerFunc {
		return func(ctx context.Context, tx *gorm.DB, msg Message) error {
			start := time.Now()
			err := next(ctx, tx, msg)
			took := time.Since(start)
			outcome := "ok"
			switch {
			case err == nil:
				log.DebugContext(ctx, "message handled", "consumer", consumer, "message_id", msg.ID, "type", msg.Type, "took", took)
			case IsPermanent(err):
				outcome = "permanent"
			default:
				outcome = "error"
			}
			m.recordHandled(consumer, msg.Type, outcome, took)
			return err
		}
	}
}
