package platform

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"
	"log/slog"
	"sync"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/migrate"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/pgxdriver"
)

// Migration brings one part of a service's schema up to date.
type Migration func(ctx context.Context, log *slog.Logger, db *gorm.DB) error

// Migrations applies the goose files in dir of fsys, recording them in versionTable.
func Migrations(fsys fs.FS, dir, versionTable string) Migration {
	return func(ctx context.Context, log *slog.Logger, db *gorm.DB) error {
		sub, err := fs.Sub(fsys, dir)
		if err != nil {
			return err
		}
		sqlDB, err := db.DB()
		if err != nil {
			return err
		}
		return migrate.Up(ctx, log, sqlDB, sub, versionTable)
	}
}

// Library is one of the messaging library's migrations (messaging.MigrateOutbox,
// messaging.MigrateInbox). They wait for the migration lock, as a service's do, without a
// word: if they have not finished within libraryWaitLog, the log says the start waits for
// them, and again every libraryWaitRelog (see logWhileRunning).
func Library(m func(ctx context.Context, db messaging.DB) error) Migration {
	return func(ctx context.Context, log *slog.Logger, db *gorm.DB) error {
		d, err := gormdriver.New(db)
		if err != nil {
			return err
		}
		stop := logWhileRunning(ctx, log)
		defer stop()
		return m(ctx, d.DB())
	}
}

// libraryWaitLog is how long the library's migrations run before the log says the start
// waits for them, and libraryWaitRelog how often it says so again, as a service's migrations
// say they wait for the lock.
const (
	libraryWaitLog   = time.Second
	libraryWaitRelog = time.Minute
)

// logWhileRunning logs, libraryWaitLog from now and every libraryWaitRelog after, until stop
// is called or ctx ends, that the library's migrations have not finished. Why is not known
// from here: most often another replica's migrations, which hold the lock; or a transaction
// holding a lock a migration needs; or a migration's own work.
func logWhileRunning(ctx context.Context, log *slog.Logger) (stop func()) {
	start := time.Now()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTimer(libraryWaitLog)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			log.WarnContext(ctx, "the messaging library's migrations have not finished; the start waits for them "+
				"(for another replica's migrations, or a lock a transaction holds, most likely)",
				"waited", time.Since(start).Round(time.Second))
			t.Reset(libraryWaitRelog)
		}
	})
	return func() {
		close(done)
		wg.Wait()
	}
}

// Base is what every service starts with: its tracer provider, its database, migrated, the
// readiness check of that database, and a metrics registry with the process collectors and the
// messaging metrics.
type Base struct {
	// DB is the requests' pool (what Pools leaves them), and Driver the same pool for the
	// messaging library: what requests enqueue, they enqueue in its transactions.
	DB     *gorm.DB
	Driver *gormdriver.Driver
	// Work is the consumers' pool (Pools.Work), WorkDriver the same for the library; nil in a
	// service that consumes nothing.
	Work       *gorm.DB
	WorkDriver *gormdriver.Driver
	// Sender is the notification sender's pool (Pools.Sender), whose sessions plan by index
	// (IndexPlansURL); nil in a service that sends nothing.
	Sender *gorm.DB
	// Background is the relay's, the cleanups' and the backlog gauges' pool
	// (Pools.Background), on pgx, whose sessions plan by index (IndexPlansURL).
	Background messaging.DB
	background *pgxpool.Pool
	// Admission bounds the API requests at work at once (HTTP_MAX_IN_FLIGHT, lowered to hold
	// HTTP_LATENCY_TARGET); run it.
	Admission *Admission
	Registry  *prometheus.Registry
	Metrics   *messaging.Metrics
	// DatabaseReady pings the database over a connection of its own (OpenReadinessDB).
	DatabaseReady ReadyFunc
	readinessDB   *sql.DB
	// alreadyDone counts messages whose work their business key shows was done already, by
	// another message: what the inbox cannot see, and no message should cause.
	alreadyDone *prometheus.CounterVec
	tracing     *sdktrace.TracerProvider
	log         *slog.Logger
	pprofAddr   string
	// starting holds the server that answers the probes while the service starts, until Serve
	// takes it (see startingServer); nil outside Main.
	starting *startingSlot
}

// Profiler serves Go's profiler where PPROF_ADDR says, if it does (see Profiler).
func (b *Base) Profiler() Worker { return Profiler(b.log, b.pprofAddr) }

// AlreadyDone returns the counter of the consumer's messages that found their work done
// already by another message (consumer_already_done_total), exported at zero from now on so
// that rate() and increase() count the first one.
func (b *Base) AlreadyDone(consumer string) func() {
	return b.alreadyDone.WithLabelValues(consumer).Inc
}

// Start installs the service's tracer provider (see startTracing), opens the service's
// database (the pools of pools, the readiness check's connection, and the requests' pool,
// DB_MAX_CONNS in all), applies migrations in order (before any request is served, so no
// pooled statement sees a changing schema) and prepares the metrics. Under Main, it answers
// the probes on HTTP_ADDR from its beginning, live and not ready, until Serve takes the
// listener over (see startingServer).
func Start(ctx context.Context, log *slog.Logger, service string, c Common, pools Pools, migrations ...Migration) (_ *Base, err error) {
	tp, err := startTracing(ctx, log, service, c.OTLPEndpoint != "")
	if err != nil {
		return nil, err
	}
	b := &Base{tracing: tp, log: log, pprofAddr: c.PprofAddr}
	if pools.Requests(c) < MinRequestConns {
		stopTracing(log, tp)
		return nil, fmt.Errorf("DB_MAX_CONNS: %d leaves requests %d connections, fewer than %d", c.DBMaxConns, pools.Requests(c), MinRequestConns)
	}
	// b, not the result, which a failure's return has set to nil by now.
	defer func() {
		if err != nil {
			b.Close()
		}
	}()
	if slot := startingSlotOf(ctx); slot != nil {
		srv, err := serveWhileStarting(log, c.HTTPAddr)
		if err != nil {
			return nil, err
		}
		slot.put(srv)
		b.starting = slot
	}
	if b.DB, err = OpenDB(ctx, log, service, c.DatabaseURL, pools.Requests(c)); err != nil {
		return nil, err
	}
	if b.Driver, err = gormdriver.New(b.DB); err != nil {
		return nil, err
	}
	for _, m := range migrations {
		if err := m(ctx, log, b.DB); err != nil {
			return nil, err
		}
	}
	if pools.Work > 0 {
		if b.Work, err = OpenDB(ctx, log, service+"-work", c.DatabaseURL, pools.Work); err != nil {
			return nil, err
		}
		if b.WorkDriver, err = gormdriver.New(b.Work); err != nil {
			return nil, err
		}
	}
	if pools.Sender > 0 {
		dsn, err := IndexPlansURL(c.DatabaseURL)
		if err != nil {
			return nil, err
		}
		if b.Sender, err = OpenDB(ctx, log, service+"-sender", dsn, pools.Sender); err != nil {
			return nil, err
		}
		drv, err := gormdriver.New(b.Sender)
		if err != nil {
			return nil, err
		}
		if err := checkIndexPlans(ctx, drv.DB(), "sender's pool"); err != nil {
			return nil, err
		}
	}
	if pools.Background > 0 {
		if b.background, err = OpenBackground(ctx, log, service, c.DatabaseURL, pools.Background); err != nil {
			return nil, err
		}
		b.Background = pgxdriver.New(b.background).DB()
		if err := checkIndexPlans(ctx, b.Background, "background pool"); err != nil {
			return nil, err
		}
	}
	if b.readinessDB, err = OpenReadinessDB(service, c.DatabaseURL); err != nil {
		return nil, err
	}
	b.DatabaseReady = DatabaseReady(b.readinessDB)
	if err := b.metrics(); err != nil {
		return nil, err
	}
	inFlight := c.MaxInFlight
	if inFlight == 0 {
		inFlight = pools.Requests(c)
	}
	if b.Admission, err = NewAdmission(log, b.Registry, inFlight, c.LatencyTarget); err != nil {
		return nil, err
	}
	return b, nil
}

// API is where a service's own routes go: behind admission control, beside the operational
// endpoints that NewRouter serves.
func (b *Base) API(router chi.Router) chi.Router { return router.With(b.Admission.Middleware) }

// metrics prepares the registry: the process's collectors, the library's metrics, and the
// count of work found done already.
func (b *Base) metrics() error {
	b.Registry = prometheus.NewRegistry()
	b.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	b.alreadyDone = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "consumer_already_done_total",
		Help: "Messages whose work was already done by another message (same business key): a sign of duplicate messages upstream.",
	}, []string{"consumer"})
	b.Registry.MustRegister(b.alreadyDone)
	var err error
	b.Metrics, err = messaging.NewMetrics(b.Registry, "")
	return err
}

// Close logs the requests shed since Admission.Run's last line, exports the spans still
// waiting, and closes the database pools and the readiness check's connection: whatever of
// them Start opened, and the probes' server of the start if Serve never took it. A service
// closes its Base once Serve has returned.
func (b *Base) Close() {
	if s := b.starting.take(); s != nil {
		s.close()
	}
	if b.Admission != nil {
		// Run stopped at the signal; the server drained after it, and its sheds are logged here.
		b.Admission.logShedOver("during", "shutdown")
	}
	stopTracing(b.log, b.tracing)
	for _, db := range []*gorm.DB{b.DB, b.Work, b.Sender} {
		if db != nil {
			CloseDB(db)
		}
	}
	if b.background != nil {
		b.background.Close()
	}
	if b.readinessDB != nil {
		_ = b.readinessDB.Close()
	}
}
