package messaging

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/singleflight"
	"gorm.io/gorm"
)

// Metrics holds the package's Prometheus collectors. Give one to the relay, consumers and
// inboxes of a process; a nil *Metrics records nothing.
type Metrics struct {
	published       *prometheus.CounterVec
	publishFailures *prometheus.CounterVec
	settled         *prometheus.CounterVec
	duplicates      *prometheus.CounterVec
	brokerUp        *prometheus.GaugeVec
	handled         *prometheus.HistogramVec
	cleanupDeleted  *prometheus.CounterVec
	eventAge        *prometheus.HistogramVec
}

// NewMetrics creates the collectors and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_messages_published_total",
			Help: "Outbox messages the broker confirmed and routed.",
		}, []string{"type"}),
		publishFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_publish_failures_total",
			Help: "Outbox messages the broker refused (nacked, returned, too large); each is retried with backoff.",
		}, []string{"type"}),
		settled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "consumer_messages_total",
			Help: "Deliveries settled by consumers, by outcome: acked, dead_lettered, requeued.",
		}, []string{"queue", "outcome"}),
		duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_duplicates_total",
			Help: "Messages an inbox recognised as already handled and skipped.",
		}, []string{"consumer"}),
		brokerUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_relay_broker_up",
			Help: "The relay's view of the broker: 1 while it takes messages, 0 during an outage (rows wait, unpenalised).",
		}, []string{"exchange"}),
		handled: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "consumer_handler_seconds",
			Help:    "Time handlers took per message, by consumer, type and outcome (ok, error, permanent).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 4, 9), // 0.5 ms to about 33 s
		}, []string{"consumer", "type", "outcome"}),
		cleanupDeleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_cleanup_deleted_total",
			Help: "Rows the cleanup jobs deleted, by table: outbox_messages (sent rows), inbox_messages (old records).",
		}, []string{"table"}),
		eventAge: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "consumer_event_age_seconds",
			Help: "Seconds from a message's occurred_at (its AMQP timestamp, in whole seconds) to the commit of its work, " +
				"per handled message; duplicates are not counted.",
			Buckets: prometheus.ExponentialBuckets(0.25, 2, 16), // 0.25 s to about 2.3 h
		}, []string{"consumer"}),
	}
	reg.MustRegister(m.published, m.publishFailures, m.settled, m.duplicates, m.brokerUp, m.handled, m.cleanupDeleted, m.eventAge)
	return m
}

func (m *Metrics) recordPublished(msgType string) {
	if m != nil {
		m.published.WithLabelValues(msgType).Inc()
	}
}

func (m *Metrics) recordPublishFailure(msgType string) {
	if m != nil {
		m.publishFailures.WithLabelValues(msgType).Inc()
	}
}

func (m *Metrics) setBrokerUp(exchange string, up bool) {
	if m != nil {
		v := 0.0
		if up {
			v = 1
		}
		m.brokerUp.WithLabelValues(exchange).Set(v)
	}
}

func (m *Metrics) recordHandled(consumer, msgType, outcome string, took time.Duration) {
	if m != nil {
		m.handled.WithLabelValues(consumer, msgType, outcome).Observe(took.Seconds())
	}
}

// recordEventAge observes how long after it occurred msg's work committed. A message without
// a timestamp says nothing; a producer's clock ahead of ours counts as no delay.
func (m *Metrics) recordEventAge(consumer string, msg Message, committed time.Time) {
	if m != nil && !msg.OccurredAt.IsZero() {
		m.eventAge.WithLabelValues(consumer).Observe(max(committed.Sub(msg.OccurredAt), 0).Seconds())
	}
}

func (m *Metrics) recordSettled(queue, outcome string) {
	if m != nil {
		m.settled.WithLabelValues(queue, outcome).Inc()
	}
}

func (m *Metrics) recordDuplicate(consumer string) {
	if m != nil {
		m.duplicates.WithLabelValues(consumer).Inc()
	}
}

func (m *Metrics) recordCleanupDeleted(table string, n int64) {
	if m != nil {
		m.cleanupDeleted.WithLabelValues(table).Add(float64(n))
	}
}

// RegisterOutboxStats registers gauges read from outbox_messages at every scrape (see
// [ReadOutboxStats]): the backlog, its oldest row's age, and the most attempts of any unsent
// row. Alert when the age keeps growing or the attempts pass a threshold.
//
// The query is bounded (statsStatementTimeout, by the server) and shared by scrapes that
// overlap it. When it fails or times out, that scrape has no outbox gauges, the rest of it is
// served, outbox_stats_errors_total counts the failure and log (nil: slog.Default()) says why.
func RegisterOutboxStats(reg prometheus.Registerer, db *gorm.DB, log *slog.Logger) {
	if log == nil {
		log = slog.Default()
	}
	reg.MustRegister(&outboxStatsCollector{db: db, log: log, errors: prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_stats_errors_total",
		Help: "Backlog queries that failed or timed out; the scrapes they served have no outbox_pending_messages, " +
			"outbox_oldest_pending_age_seconds or outbox_max_attempts.",
	})})
}

// statsStatementTimeout bounds the backlog query, well inside Prometheus's scrape timeout
// (10 s by default); statsTimeout also covers waiting for a pool connection.
const (
	statsStatementTimeout = time.Second
	statsTimeout          = 2 * time.Second
)

var (
	pendingDesc = prometheus.NewDesc("outbox_pending_messages", "Outbox messages not yet sent.", nil, nil)
	oldestDesc  = prometheus.NewDesc("outbox_oldest_pending_age_seconds", "Age of the oldest unsent outbox message.", nil, nil)
	attemptDesc = prometheus.NewDesc("outbox_max_attempts", "Most failed publish attempts of any unsent outbox message.", nil, nil)
)

type outboxStatsCollector struct {
	db     *gorm.DB
	log    *slog.Logger
	errors prometheus.Counter
	// reading lets overlapping scrapes share one query, so a slow database never has more
	// than one of them waiting.
	reading singleflight.Group
}

func (c *outboxStatsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- pendingDesc
	ch <- oldestDesc
	ch <- attemptDesc
	c.errors.Describe(ch)
}

// Collect sends the gauges if the query works, and the error counter after it, so a scrape
// counts its own failure.
func (c *outboxStatsCollector) Collect(ch chan<- prometheus.Metric) {
	v, err, _ := c.reading.Do("stats", func() (any, error) { return c.read() })
	if err == nil {
		s := v.(OutboxStats)
		ch <- prometheus.MustNewConstMetric(pendingDesc, prometheus.GaugeValue, float64(s.Pending))
		ch <- prometheus.MustNewConstMetric(oldestDesc, prometheus.GaugeValue, s.OldestPending.Seconds())
		ch <- prometheus.MustNewConstMetric(attemptDesc, prometheus.GaugeValue, float64(s.MaxAttempts))
	}
	c.errors.Collect(ch)
}

// read runs the query under a statement timeout shorter than its context: the server ends the
// query itself and the connection stays usable. At a context's deadline the driver drops the
// connection instead, and only a cancel request, sent best effort, stops the server's side,
// which may go on waiting (for a lock, say) and holding a connection slot.
func (c *outboxStatsCollector) read() (OutboxStats, error) {
	ctx, cancel := context.WithTimeout(context.Background(), statsTimeout)
	defer cancel()
	var s OutboxStats
	err := c.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		if err := tx.Exec(fmt.Sprintf("SET LOCAL statement_timeout = %d", statsStatementTimeout.Milliseconds())).Error; err != nil {
			return fmt.Errorf("set statement_timeout: %w", err)
		}
		var err error
		s, err = ReadOutboxStats(ctx, tx)
		return err
	}, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		c.errors.Inc()
		c.log.Warn("outbox backlog query failed; the scrape goes without the outbox gauges", "error", err)
		return OutboxStats{}, err
	}
	return s, nil
}
