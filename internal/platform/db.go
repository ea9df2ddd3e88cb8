package platform

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"time"

	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"
)

// OpenDB opens the service's database, waiting up to a minute for it to answer (containers
// start in any order). The connection carries application_name=service, so its sessions can
// be told apart in pg_stat_activity.
func OpenDB(ctx context.Context, log *slog.Logger, service, rawURL string, maxConns int) (*gorm.DB, error) {
	dsn, err := withApplicationName(rawURL, service)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	db, err := gorm.Open(postgres.Open(dsn), &gorm.Config{
		Logger: logger.Discard,
		// The loop below waits for the database instead of failing on the first try.
		DisableAutomaticPing: true,
	})
	if err != nil {
		return nil, fmt.Errorf("open database: %w", err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		return nil, fmt.Errorf("open database: %w", err)
	}
	// One pool for HTTP handlers, the relay's transactions (held open while publishing) and
	// its LISTEN connection: sized so the relay cannot starve the handlers.
	sqlDB.SetMaxOpenConns(maxConns)
	sqlDB.SetMaxIdleConns(maxConns)
	sqlDB.SetConnMaxLifetime(30 * time.Minute)
	sqlDB.SetConnMaxIdleTime(5 * time.Minute)

	deadline := time.Now().Add(time.Minute)
	for {
		pingCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
		err = sqlDB.PingContext(pingCtx)
		cancel()
		if err == nil {
			return db, nil
		}
		if ctx.Err() != nil {
			_ = sqlDB.Close()
			return nil, fmt.Errorf("waiting for the database: %w", ctx.Err())
		}
		if time.Now().After(deadline) {
			_ = sqlDB.Close()
			return nil, fmt.Errorf("database does not answer: %w", err)
		}
		log.Warn("waiting for the database", "error", err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func withApplicationName(rawURL, name string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", err
	}
	q := u.Query()
	if q.Get("application_name") == "" {
		q.Set("application_name", name)
	}
	u.RawQuery = q.Encode()
	return u.String(), nil
}

// Ping checks the database within 2 s, for readiness.
func Ping(ctx context.Context, db *gorm.DB) error {
	sqlDB, err := db.DB()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return sqlDB.PingContext(ctx)
}

// CloseDB closes the pool behind db.
func CloseDB(db *gorm.DB) {
	if sqlDB, err := db.DB(); err == nil {
		_ = sqlDB.Close()
	}
}
