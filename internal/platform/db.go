package platform

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"net/url"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" driver of OpenReadinessDB
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
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
		// A read names its model's columns, never SELECT *: pgx caches each prepared statement,
		// and a cached SELECT * fails once a migration adds a column to its table, on every
		// replica still serving while a rolling upgrade migrates.
		QueryFields: true,
	})
	if err != nil {
		return nil, fmt.Errorf("open database: %w", err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		return nil, fmt.Errorf("open database: %w", err)
	}
	// A pool of maxConns for one part (requests, the consumers' work, or the sender's; see
	// Pools), which no other part's load can take.
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

// IndexPlansURL returns rawURL with the settings that make every statement of its sessions
// use an index where one serves: enable_sort and enable_seqscan off, from the connection's
// start. A pool whose statements must walk an index in order and find rows by key gets them
// so: the notification sender's, whose transactions then need no statement to set them, and
// the background pool's, where the relay's batches need none (the backlog gauges and the
// cleanups, which keep to their indexes too, still set theirs). Without them, a generic plan
// cached while the table was nearly empty scans it whole, and keeps doing so as it grows,
// until an ANALYZE; and a planner without statistics sorts the whole backlog. jit is off too:
// a sequential scan where no index serves still runs, but its prohibitive cost estimate would
// have PostgreSQL compile the statement, half a second (seen with sorts in the cleanups).
func IndexPlansURL(rawURL string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", fmt.Errorf("DATABASE_URL: %w", err)
	}
	q := u.Query()
	q.Set("enable_sort", "off")
	q.Set("enable_seqscan", "off")
	q.Set("jit", "off")
	u.RawQuery = q.Encode()
	return u.String(), nil
}

// indexPlansSQL reads the settings IndexPlansURL gives a session: "off,off,off".
const indexPlansSQL = `SELECT concat_ws(',', current_setting('enable_sort'), current_setting('enable_seqscan'), current_setting('jit'))`

// checkIndexPlans fails unless db's sessions have the settings IndexPlansURL asks for: a
// connection pooler between the service and PostgreSQL may drop a connection's startup
// parameters, and the pool's statements would then plan without them, unseen.
func checkIndexPlans(ctx context.Context, db messaging.DB, pool string) error {
	rows, err := db.Query(ctx, indexPlansSQL)
	if err != nil {
		return fmt.Errorf("read the plan settings of the %s: %w", pool, err)
	}
	defer rows.Close()
	var got string
	for rows.Next() {
		if err := rows.Scan(&got); err != nil {
			return fmt.Errorf("read the plan settings of the %s: %w", pool, err)
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read the plan settings of the %s: %w", pool, err)
	}
	if got != "off,off,off" {
		return fmt.Errorf("DATABASE_URL: the sessions of the %s have enable_sort, enable_seqscan and jit %q, where their connection string sets them off: does a connection pooler drop startup parameters?", pool, got)
	}
	return nil
}

// ReadinessConns is how many of DB_MAX_CONNS readiness checks keep for themselves (see
// OpenReadinessDB); the pool has the rest.
const ReadinessConns = 1

// OpenReadinessDB returns the handle readiness checks ping the database through: a
// connection of its own, apart from the pool that requests and workers share, so a saturated
// pool cannot make every replica unready at once. It connects at the first check, and again
// after its connection breaks. Its sessions carry application_name=service-readiness.
func OpenReadinessDB(service, rawURL string) (*sql.DB, error) {
	dsn, err := withApplicationName(rawURL, service+"-readiness")
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, fmt.Errorf("open readiness connection: %w", err)
	}
	db.SetMaxOpenConns(ReadinessConns)
	db.SetMaxIdleConns(ReadinessConns)
	db.SetConnMaxLifetime(30 * time.Minute)
	return db, nil
}

// DatabaseReady is the readiness check of the database behind db (see OpenReadinessDB): it
// must answer a ping within 2 s.
func DatabaseReady(db *sql.DB) ReadyFunc {
	return func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		if err := db.PingContext(ctx); err != nil {
			return &NotReadyError{Reason: "the database does not answer", Err: err}
		}
		return nil
	}
}

// CloseDB closes the pool behind db.
func CloseDB(db *gorm.DB) {
	if sqlDB, err := db.DB(); err == nil {
		_ = sqlDB.Close()
	}
}
