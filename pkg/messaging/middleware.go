package messaging

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"
)

// recoverPanics turns a panic in a handler into that message's error: its transaction rolls
// back, the message is retried like any failure (and dead-lettered at its delivery limit), and
// the process, with the other messages in flight, lives on. The stack is logged once, here.
func recoverPanics[Tx any](log *slog.Logger) Middleware[Tx] {
	return func(next Handler[Tx, any]) Handler[Tx, any] {
		return func(ctx context.Context, tx Tx, payload any, msg Message) (err error) {
			defer func() {
				if r := recover(); r != nil {
					err = fmt.Errorf("handler panicked: %v", r)
					log.ErrorContext(ctx, "handler panicked", "message_id", msg.ID, "type", msg.Type, "panic", r, "stack", string(debug.Stack()))
				}
			}()
			return next(ctx, tx, payload, msg)
		}
	}
}

// observe logs each message's outcome (at debug level when it succeeds) and counts it, with
// its handling time, by consumer, type and outcome, once its transaction has ended: a handler
// that succeeded counts as the commit did.
func observe[Tx any](consumer string, log *slog.Logger, m *Metrics) Middleware[Tx] {
	return func(next Handler[Tx, any]) Handler[Tx, any] {
		return func(ctx context.Context, tx Tx, payload any, msg Message) error {
			start := time.Now()
			err := next(ctx, tx, payload, msg)
			took := time.Since(start)
			whenObserved(ctx, func(txErr error) {
				outcome := finalOutcome(err, txErr)
				if outcome == handlerOK {
					log.DebugContext(ctx, "message handled", "consumer", consumer, "message_id", msg.ID, "type", msg.Type, "took", took)
				}
				m.recordHandled(consumer, msg.Type, outcome, took)
			})
			return err
		}
	}
}

// outcomeOf is a handler's outcome as the metrics label it: ok, permanent (marked so, or a
// statement the database refused for the value alone: dead-lettered at once, unless the
// consumer finds an outage or a timeout behind it) or error.
func outcomeOf(err error) string {
	switch {
	case err == nil:
		return handlerOK
	case IsPermanent(err), dataException(err):
		return handlerPermanent
	default:
		return handlerError
	}
}
