package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/singleflight"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
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
	abandoned       *prometheus.GaugeVec
}

// NewMetrics creates the collectors and registers them with reg, each name prefixed with
// namespace and an underscore unless namespace is "". It fails, registering nothing, when reg
// has any of them already (a second NewMetrics on one registry, say).
func NewMetrics(reg prometheus.Registerer, namespace string) (*Metrics, error) {
	m := &Metrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace,
			Name:      "outbox_messages_published_total",
			Help:      "Outbox messages the broker confirmed and routed.",
		}, []string{"type"}),
		publishFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace,
			Name:      "outbox_publish_failures_total",
			Help:      "Publishes of outbox messages refused for the message itself (the broker nacked, returned or refused it; too large, or its envelope or headers unusable); each refused row is retried with backoff and counts at each attempt.",
		}, []string{"type"}),
		settled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace,
			Name:      "consumer_messages_total",
			Help:      "Deliveries settled by consumers, by outcome: acked, dead_lettered, requeued.",
		}, []string{"queue", "outcome"}),
		duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace,
			Name:      "inbox_duplicates_total",
			Help:      "Messages an inbox recognised as already handled and skipped.",
		}, []string{"consumer"}),
		brokerUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace,
			Name:      "outbox_relay_broker_up",
			Help:      "The relay's view of the broker: 1 while it takes messages, 0 during an outage (rows wait, unpenalised).",
		}, []string{"exchange"}),
		handled: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace,
			Name:      "consumer_handler_seconds",
			Help:      "Time handlers took per message (a batch handler's, shared among its messages), by consumer, type and outcome (ok, error, permanent), as their transaction ended.",
			Buckets:   prometheus.ExponentialBuckets(0.0005, 4, 9), // 0.5 ms to about 33 s
		}, []string{"consumer", "type", "outcome"}),
		cleanupDeleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace,
			Name:      "outbox_cleanup_deleted_total",
			Help:      "Rows the cleanup jobs deleted, by table: outbox_messages (sent rows), inbox_messages (old records).",
		}, []string{"table"}),
		eventAge: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace,
			Name:      "consumer_event_age_seconds",
			Help: "Seconds from a message's occurred_at (its AMQP timestamp, in whole seconds) to the commit of its work, " +
				"per handled message; duplicates are not counted.",
			// 0.25 s to about 2.3 h, doubling, and 60 s: the alert ConsumerEventAgeHigh's
			// threshold, which a quantile interpolated between 32 and 64 would miss both ways.
			Buckets: slices.Sorted(slices.Values(append(prometheus.ExponentialBuckets(0.25, 2, 16), 60))),
		}, []string{"consumer"}),
		abandoned: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace,
			Name:      "consumer_attempts_abandoned",
			Help: "Attempts a consumer gave up on (a handler or after-commit hook that ignored its context) whose " +
				"goroutine has not returned yet: each holds what it holds (a connection, memory) until it does.",
		}, []string{"consumer"}),
	}
	return m, registerAll(reg, m.published, m.publishFailures, m.settled, m.duplicates, m.brokerUp, m.handled, m.cleanupDeleted, m.eventAge, m.abandoned)
}

// registerAll registers cs with reg, all or none.
func registerAll(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			for _, done := range cs[:i] {
				reg.Unregister(done)
			}
			var dup prometheus.AlreadyRegisteredError
			if errors.As(err, &dup) {
				return fmt.Errorf("messaging metrics: registered already: %w", err)
			}
			return fmt.Errorf("messaging metrics: %w", err)
		}
	}
	return nil
}

// The outcomes that label consumer_messages_total, as a consumer settles a delivery.
const (
	settledAcked        = "acked"
	settledRequeued     = "requeued"
	settledDeadLettered = "dead_lettered"
)

// The outcomes that label consumer_handler_seconds (see outcomeOf).
const (
	handlerOK        = "ok"
	handlerError     = "error"
	handlerPermanent = "permanent"
)

// initSubscription exports at zero every series a subscription named name (its queue and its
// consumer) will count, its handled types' included, before its first event. A labelled series
// that appeared only at its first increment would start at 1, and rate() and increase() see no
// increase in a series' first sample: an alert on them would miss each process's first
// dead-letter. The zero series help only with a dead-letter after the first scrape. One before it
// (a message waiting at Start is dead-lettered within milliseconds, the first scrape comes 0-15 s
// later) still lands in the first sample; ConsumerDeadLettering counts what the counter holds for
// a process started within its window (docs/operations.md).
func (m *Metrics) initSubscription(name string, types []string) {
	if m == nil {
		return
	}
	for _, outcome := range []string{settledAcked, settledRequeued, settledDeadLettered} {
		m.settled.WithLabelValues(name, outcome)
	}
	m.duplicates.WithLabelValues(name)
	m.eventAge.WithLabelValues(name)
	m.abandoned.WithLabelValues(name)
	for _, t := range types {
		for _, outcome := range []string{handlerOK, handlerError, handlerPermanent} {
			m.handled.WithLabelValues(name, t, outcome)
		}
	}
}

// initRelay exports at zero the publish counters of types, for the same reason as
// initSubscription. (outbox_relay_broker_up, a gauge, is set when the relay first asks for the
// broker.)
func (m *Metrics) initRelay(types []string) {
	if m == nil {
		return
	}
	for _, t := range types {
		m.published.WithLabelValues(t)
		m.publishFailures.WithLabelValues(t)
	}
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

// addAbandoned counts an abandoned attempt that is still running (+1), or that returned at last (-1).
func (m *Metrics) addAbandoned(consumer string, delta float64) {
	if m != nil {
		m.abandoned.WithLabelValues(consumer).Add(delta)
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
// [OutboxStats]): the backlog, its oldest row's age, and the most attempts of any unsent row,
// parked rows aside, and how many rows are parked. Alert when the age keeps growing or the
// attempts pass a threshold; a parked row is an operator's decision, shown apart so that it
// neither keeps those alerts firing nor drops out of view.
//
// Each scrape reads the oldest 100,000 unsent rows at most, parked ones included, so that it
// costs about the same at any backlog (40-55 ms), and every gauge is read from those rows: the
// pending count stops at 100,000, the attempts and the parked rows are those among them, and
// the oldest row's age is exact unless 100,000 older rows are parked. An exact count of
// millions of rows outlasts the query's timeout, and the gauges would drop out while the
// backlog is largest; [ReadOutboxStats] counts them all. A query that fails or takes more than
// a second drops only these gauges from that scrape, counts itself in
// outbox_stats_errors_total and logs why; the rest of the scrape is served. Names are prefixed with namespace as in [NewMetrics].
func RegisterOutboxStats(reg prometheus.Registerer, namespace string, db DB, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	name := func(n string) string { return prometheus.BuildFQName(namespace, "", n) }
	return registerAll(reg, &outboxStatsCollector{db: db, log: log,
		pending: prometheus.NewDesc(name("outbox_pending_messages"),
			fmt.Sprintf("Outbox messages not yet sent, parked ones aside (counted up to %d).", statsHead), nil, nil),
		oldest: prometheus.NewDesc(name("outbox_oldest_pending_age_seconds"), "Age of the oldest unsent outbox message, parked ones aside.", nil, nil),
		attempt: prometheus.NewDesc(name("outbox_max_attempts"),
			fmt.Sprintf("Most failed publish attempts of any unsent outbox message, parked ones aside (of the oldest %d).", statsHead), nil, nil),
		parked: prometheus.NewDesc(name("outbox_parked_messages"),
			fmt.Sprintf("Outbox messages an operator parked: unsent, and never sent until unparked (those among the oldest %d unsent).", statsHead), nil, nil),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace,
			Name:      "outbox_stats_errors_total",
			Help: "Backlog queries that failed or timed out; the scrapes they served have no outbox_pending_messages, " +
				"outbox_oldest_pending_age_seconds, outbox_max_attempts or outbox_parked_messages.",
		})})
}

// statsStatementTimeout bounds the backlog query, well inside Prometheus's scrape timeout
// (10 s by default); statsTimeout also covers waiting for a pool connection. statsHead is how
// many of the oldest unsent rows the gauges read.
const (
	statsStatementTimeout = time.Second
	statsTimeout          = 2 * time.Second
	statsHead             = 100_000
)

type outboxStatsCollector struct {
	db                       DB
	log                      *slog.Logger
	pending, oldest, attempt *prometheus.Desc
	parked                   *prometheus.Desc
	errors                   prometheus.Counter
	// reading lets overlapping scrapes share one query, so a slow database never has more
	// than one of them waiting.
	reading singleflight.Group
}

func (c *outboxStatsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.pending
	ch <- c.oldest
	ch <- c.attempt
	ch <- c.parked
	c.errors.Describe(ch)
}

// Collect sends the gauges if the query works, and the error counter after it, so a scrape
// counts its own failure.
func (c *outboxStatsCollector) Collect(ch chan<- prometheus.Metric) {
	v, err, _ := c.reading.Do("stats", func() (any, error) { return c.read() })
	if err == nil {
		s := v.(OutboxStats)
		ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(s.Pending))
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, s.OldestPending.Seconds())
		ch <- prometheus.MustNewConstMetric(c.attempt, prometheus.GaugeValue, float64(s.MaxAttempts))
		ch <- prometheus.MustNewConstMetric(c.parked, prometheus.GaugeValue, float64(s.Parked))
	}
	c.errors.Collect(ch)
}

// read runs the query under a statement timeout shorter than its context: the server ends the
// query itself and the connection stays usable. At a context's deadline the driver drops the
// connection instead, and only a cancel request, sent best effort, stops the server's side,
// which may go on waiting (for a lock, say) and holding a connection slot.
func (c *outboxStatsCollector) read() (s OutboxStats, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), statsTimeout)
	defer cancel()
	defer func() {
		if err != nil {
			c.errors.Inc()
			c.log.Warn("outbox backlog query failed; the scrape goes without the outbox gauges", "error", err)
		}
	}()
	tx, err := c.db.Begin(ctx)
	if err != nil {
		return s, fmt.Errorf("read outbox stats: %w", err)
	}
	defer rollback(ctx, tx) // read only: nothing to commit
	if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL statement_timeout = %d", statsStatementTimeout.Milliseconds())); err != nil {
		return s, fmt.Errorf("set statement_timeout: %w", err)
	}
	// The claim's plan settings: the oldest rows along the partial index, never a scan and
	// sort of the table, whatever its statistics say.
	if _, err := tx.Exec(ctx, statements.ClaimPlan); err != nil {
		return s, fmt.Errorf("read outbox stats: plan settings: %w", err)
	}
	return readOutboxStats(ctx, tx, statements.OutboxStatsHead, statsHead)
}
