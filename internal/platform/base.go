package platform

import (
	"context"
	"database/sql"
	"io/fs"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/migrate"
)

// Migration brings one part of a service's schema up to date.
type Migration func(ctx context.Context, db *sql.DB) error

// Migrations applies the goose files in dir of fsys, recording them in versionTable.
func Migrations(fsys fs.FS, dir, versionTable string) Migration {
	return func(ctx context.Context, db *sql.DB) error {
		sub, err := fs.Sub(fsys, dir)
		if err != nil {
			return err
		}
		return migrate.Up(ctx, db, sub, versionTable)
	}
}

// Base is what every service starts with: its tracer provider, its database, migrated, the
// readiness check of that database, and a metrics registry with the process collectors and the
// messaging metrics.
type Base struct {
	// DB is the pool of DB_MAX_CONNS less ReadinessConns connections.
	DB       *gorm.DB
	Registry *prometheus.Registry
	Metrics  *messaging.Metrics
	// DatabaseReady pings the database over a connection of its own (OpenReadinessDB).
	DatabaseReady ReadyFunc
	readinessDB   *sql.DB
	// alreadyDone counts messages whose work their business key shows was done already, by
	// another message: what the inbox cannot see, and no message should cause.
	alreadyDone *prometheus.CounterVec
	tracing     *sdktrace.TracerProvider
	log         *slog.Logger
}

// AlreadyDone returns the counter of the consumer's messages that found their work done
// already by another message (consumer_already_done_total).
func (b *Base) AlreadyDone(consumer string) func() {
	return b.alreadyDone.WithLabelValues(consumer).Inc
}

// Start installs the service's tracer provider (see startTracing), opens the service's
// database (a pool and the readiness check's connection, DB_MAX_CONNS in all), applies
// migrations in order (before anything serves, so no pooled statement sees a changing
// schema) and prepares the metrics.
func Start(ctx context.Context, log *slog.Logger, service string, c Common, migrations ...Migration) (*Base, error) {
	tp, err := startTracing(ctx, log, service, c.OTLPEndpoint != "")
	if err != nil {
		return nil, err
	}
	db, err := OpenDB(ctx, log, service, c.DatabaseURL, c.DBMaxConns-ReadinessConns)
	if err != nil {
		stopTracing(log, tp)
		return nil, err
	}
	sqlDB, err := db.DB()
	if err != nil {
		stopTracing(log, tp)
		return nil, err
	}
	for _, m := range migrations {
		if err := m(ctx, sqlDB); err != nil {
			_ = sqlDB.Close()
			stopTracing(log, tp)
			return nil, err
		}
	}
	readinessDB, err := OpenReadinessDB(service, c.DatabaseURL)
	if err != nil {
		_ = sqlDB.Close()
		stopTracing(log, tp)
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	alreadyDone := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "consumer_already_done_total",
		Help: "Messages whose work was already done by another message (same business key): a sign of duplicate messages upstream.",
	}, []string{"consumer"})
	reg.MustRegister(alreadyDone)
	return &Base{
		DB: db, Registry: reg, Metrics: messaging.NewMetrics(reg),
		DatabaseReady: DatabaseReady(readinessDB), readinessDB: readinessDB,
		alreadyDone: alreadyDone, tracing: tp, log: log,
	}, nil
}

// Close exports the spans still waiting and closes the database pool and the readiness
// check's connection.
func (b *Base) Close() {
	stopTracing(b.log, b.tracing)
	CloseDB(b.DB)
	_ = b.readinessDB.Close()
}
