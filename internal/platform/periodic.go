package platform

import (
	"context"
	"log/slog"
	"time"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// cleanupFunc deletes what of a table is older than a retention (messaging's
// DeleteSentOutboxMessages, DeleteInboxMessages).
type cleanupFunc func(ctx context.Context, db messaging.DB, olderThan time.Duration, opts messaging.CleanupOptions) (messaging.CleanupResult, error)

// cleanup is the hourly job that deletes what of the base's database is older than retention,
// counted in the base's metrics, and says how many, as what. Every replica runs it; the one
// that finds another replica's run in progress skips its turn.
func (b *Base) cleanup(log *slog.Logger, what string, retention time.Duration, del cleanupFunc) Worker {
	return Periodic(log, what+" cleanup", time.Hour, func(ctx context.Context) error {
		start := time.Now()
		res, err := del(ctx, b.Background, retention, messaging.CleanupOptions{Metrics: b.Metrics})
		switch {
		case res.Skipped:
			log.Debug(what+" cleanup skipped: another replica is running it", "older_than", retention)
		case res.Deleted > 0:
			log.Info("deleted "+what, "count", res.Deleted, "batches", res.Batches, "took", time.Since(start), "older_than", retention)
		}
		return err
	})
}

// Periodic returns a Worker that runs fn at start and then every interval (cleanup jobs).
// A failure is logged and tried again at the next tick; it does not stop the service.
func Periodic(log *slog.Logger, name string, interval time.Duration, fn func(ctx context.Context) error) Worker {
	return func(ctx context.Context) error {
		ticker := time.NewTicker(interval)
		defer ticker.Stop()
		for {
			if err := fn(ctx); err != nil && ctx.Err() == nil {
				log.Warn(name+" failed", "error", err)
			}
			select {
			case <-ctx.Done():
				return nil
			case <-ticker.C:
			}
		}
	}
}
