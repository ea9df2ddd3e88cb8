package platform

import (
	"context"
	"log/slog"
	"time"
)

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
