package platform

import (
	"context"
	"log/slog"
	"time"

	"gorm.io/gorm"
)

// cleanup is the hourly job that deletes what of the base's database is older than retention,
// and says how many, as what.
func (b *Base) cleanup(log *slog.Logger, what string, retention time.Duration, del func(context.Context, *gorm.DB, time.Duration) (int64, error)) Worker {
	return Periodic(log, what+" cleanup", time.Hour, func(ctx context.Context) error {
		n, err := del(ctx, b.DB, retention)
		if err == nil && n > 0 {
			log.Info("deleted "+what, "count", n, "older_than", retention)
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
