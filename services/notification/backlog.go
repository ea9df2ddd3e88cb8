package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// backlogSQL reads the notifications not sent yet, on the partial index of pending rows.
const backlogSQL = `SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at))::float8, 0)
FROM notifications WHERE status = 'pending'`

// backlogTimeout bounds the backlog query, the wait for its connection included, well inside
// Prometheus's scrape timeout (10 s by default).
const backlogTimeout = 2 * time.Second

// backlogCollector exports, at each scrape, how many notifications wait to be sent and the age
// of the oldest: a sender that stopped sending without failing (stuck, or not running) shows
// there, where notification_deliveries_total only stops rising. A scrape whose query fails
// leaves both out and logs why; the service's readiness says the database is away. It reads
// over a connection of the background pool (PoolsOf counts it), which no delivery or message
// can take.
type backlogCollector struct {
	db              messaging.DB
	log             *slog.Logger
	pending, oldest *prometheus.Desc
}

func newBacklogCollector(db messaging.DB, log *slog.Logger) *backlogCollector {
	return &backlogCollector{
		db: db, log: log,
		pending: prometheus.NewDesc("notification_pending", "Notifications not sent yet, due or waiting for a retry.", nil, nil),
		oldest:  prometheus.NewDesc("notification_oldest_pending_age_seconds", "Age of the oldest notification not sent yet; 0 when none waits.", nil, nil),
	}
}

func (c *backlogCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.pending
	ch <- c.oldest
}

func (c *backlogCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), backlogTimeout)
	defer cancel()
	pending, age, err := readBacklog(ctx, c.db)
	if err != nil {
		c.log.Warn("could not read the notification backlog; its gauges are left out of this scrape", "error", err)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(pending))
	ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, age)
}

// registerBacklog exports the backlog gauges on reg.
func registerBacklog(reg prometheus.Registerer, db messaging.DB, log *slog.Logger) error {
	if err := reg.Register(newBacklogCollector(db, log)); err != nil {
		return fmt.Errorf("register the notification backlog gauges: %w", err)
	}
	return nil
}

// readBacklog returns how many notifications wait and the age of the oldest, in seconds.
func readBacklog(ctx context.Context, db messaging.DB) (pending int64, age float64, err error) {
	rows, err := db.Query(ctx, backlogSQL)
	if err != nil {
		return 0, 0, err
	}
	defer rows.Close()
	if !rows.Next() {
		return 0, 0, fmt.Errorf("the backlog query returned no row: %w", rows.Err())
	}
	if err := rows.Scan(&pending, &age); err != nil {
		return 0, 0, err
	}
	return pending, age, rows.Err()
}
