package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/singleflight"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// backlogCountCap bounds what the backlog query counts, and so its cost, however large the
// backlog: the gauge reads the cap beyond it. The oldest row comes off the partial index of
// pending rows (created_at, id) at once.
const backlogCountCap = 100_000

// backlogSQL reads the pending notifications (not sent, not undeliverable), up to a cap, and the
// age of the oldest.
const backlogSQL = `SELECT
    (SELECT count(*) FROM (SELECT 1 FROM notifications WHERE status = '` + StatusPending + `' LIMIT $1) AS capped),
    coalesce((SELECT extract(epoch FROM now() - min(created_at))::float8 FROM notifications WHERE status = '` + StatusPending + `'), 0)`

// backlogTimeout bounds the backlog query, the wait for its connection included, well inside
// Prometheus's scrape timeout (10 s by default).
const backlogTimeout = 2 * time.Second

// backlogCollector exports, at each scrape, how many notifications wait to be sent and the age
// of the oldest: a sender that stopped sending without failing (stuck, or not running) shows
// there, where notification_deliveries_total only stops rising. A scrape whose query fails
// leaves both out and counts the failure in notification_backlog_errors_total, as the library's
// outbox_stats_errors_total does, so that an alert sees the gauges go blind; the log says why,
// once an outage (every scrape would repeat it). It reads over the background pool (PoolsOf
// counts a connection for it), which no delivery or message can take; overlapping scrapes
// share one query.
type backlogCollector struct {
	db              messaging.DB
	log             *slog.Logger
	pending, oldest *prometheus.Desc
	errors          prometheus.Counter
	failing         outage
	reading         singleflight.Group
}

func newBacklogCollector(db messaging.DB, log *slog.Logger) *backlogCollector {
	return &backlogCollector{
		db: db, log: log,
		pending: prometheus.NewDesc("notification_pending",
			fmt.Sprintf("Notifications pending (not sent, not undeliverable), due or waiting for a retry (counted up to %d).", backlogCountCap), nil, nil),
		oldest: prometheus.NewDesc("notification_oldest_pending_age_seconds", "Age of the oldest pending notification (not sent, not undeliverable); 0 when none waits.", nil, nil),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "notification_backlog_errors_total",
			Help: "Backlog queries that failed or timed out; the scrapes they served have no notification_pending or notification_oldest_pending_age_seconds.",
		}),
		failing: outage{
			failed:    "notification backlog query failed; the scrapes go without the notification gauges",
			recovered: "notification backlog query works again",
			level:     slog.LevelWarn,
		},
	}
}

func (c *backlogCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.pending
	ch <- c.oldest
	c.errors.Describe(ch)
}

// Collect sends the gauges if the query works, and the error counter after it, so a scrape
// counts its own failure.
func (c *backlogCollector) Collect(ch chan<- prometheus.Metric) {
	v, err, _ := c.reading.Do("backlog", func() (any, error) { return c.read() })
	if err == nil {
		b := v.(backlog)
		ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(b.pending))
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, b.age)
	}
	c.errors.Collect(ch)
}

// read runs the backlog query once for the scrapes that share it, counting and logging its
// failure there, once for all of them.
func (c *backlogCollector) read() (backlog, error) {
	ctx, cancel := context.WithTimeout(context.Background(), backlogTimeout)
	defer cancel()
	b, err := readBacklog(ctx, c.db, backlogCountCap)
	if err != nil {
		c.errors.Inc()
		c.failing.fail(c.log, err)
		return b, err
	}
	c.failing.ok(c.log)
	return b, nil
}

// registerBacklog exports the backlog gauges on reg.
func registerBacklog(reg prometheus.Registerer, db messaging.DB, log *slog.Logger) error {
	if err := reg.Register(newBacklogCollector(db, log)); err != nil {
		return fmt.Errorf("register the notification backlog gauges: %w", err)
	}
	return nil
}

// backlog is how many notifications wait (up to the count's cap) and the age of the oldest, in
// seconds.
type backlog struct {
	pending int64
	age     float64
}

// readBacklog counts the pending notifications up to countCap: the collector's is
// backlogCountCap; a test's can be small.
func readBacklog(ctx context.Context, db messaging.DB, countCap int64) (backlog, error) {
	var b backlog
	rows, err := db.Query(ctx, backlogSQL, countCap)
	if err != nil {
		return b, fmt.Errorf("read the notification backlog: %w", err)
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return b, fmt.Errorf("read the notification backlog: %w", err)
		}
		return b, errors.New("read the notification backlog: no row")
	}
	if err := rows.Scan(&b.pending, &b.age); err != nil {
		return b, fmt.Errorf("read the notification backlog: %w", err)
	}
	if err := rows.Err(); err != nil {
		return b, fmt.Errorf("read the notification backlog: %w", err)
	}
	return b, nil
}
