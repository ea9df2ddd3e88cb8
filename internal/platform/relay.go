package platform

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"time"

	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
)

// RelaySettings are the knobs of a service's outbox relay (OUTBOX_*).
type RelaySettings struct {
	BatchSize    int           // OUTBOX_BATCH_SIZE: rows per batch, default 500
	Lanes        int           // OUTBOX_LANES: batches in progress at once, default 2
	PollInterval time.Duration // OUTBOX_POLL_INTERVAL: default 1 s
	MaxBackoff   time.Duration // OUTBOX_MAX_BACKOFF: cap of a refused row's backoff, default 5 min
	Notify       bool          // OUTBOX_NOTIFY: wake on LISTEN/NOTIFY, default true
	Retention    time.Duration // OUTBOX_RETENTION: how long sent rows are kept, default 7 days
}

// ReadRelaySettings reads RelaySettings.
func ReadRelaySettings(env *Env) RelaySettings {
	var s RelaySettings
	s.BatchSize = env.Int("OUTBOX_BATCH_SIZE", messaging.DefaultRelayBatchSize, 1, 1000)
	s.Lanes = env.Int("OUTBOX_LANES", messaging.DefaultLanes, 1, 16)
	s.PollInterval = env.Duration("OUTBOX_POLL_INTERVAL", messaging.DefaultPollInterval, 10*time.Millisecond, time.Hour)
	s.MaxBackoff = env.Duration("OUTBOX_MAX_BACKOFF", messaging.DefaultMaxBackoff, 2*time.Second, 24*time.Hour)
	s.Notify = env.Bool("OUTBOX_NOTIFY", true)
	s.Retention = env.Duration("OUTBOX_RETENTION", 7*24*time.Hour, time.Minute, 365*24*time.Hour)
	return s
}

// Enqueuing is the driver messaging.Enqueue takes for the outbox, on d's pool: d, or, when the
// relay does not listen (OUTBOX_NOTIFY=false), d without the NOTIFY nobody would hear, which
// spares each enqueuing commit a lock the whole database server shares.
func (s RelaySettings) Enqueuing(d *gormdriver.Driver) messaging.Driver[*gorm.DB] {
	if s.Notify {
		return d
	}
	return messaging.WithoutNotify[*gorm.DB](d)
}

// LogAttrs lists the settings for the start-up log line.
func (s RelaySettings) LogAttrs() []any {
	return []any{"outbox_batch_size", s.BatchSize, "outbox_lanes", s.Lanes, "outbox_poll_interval", s.PollInterval,
		"outbox_max_backoff", s.MaxBackoff, "outbox_notify", s.Notify, "outbox_retention", s.Retention}
}

// inFlight is the relay's publisher's MaxInFlight: room for every lane's whole batch (and no
// less than the publisher's default), so no lane waits, its rows locked, for another's confirms.
func (s RelaySettings) inFlight() int { return max(1000, s.Lanes*s.BatchSize) }

// Outbox is a service's way out: the relay of its outbox to its own exchange, and the hourly
// cleanup of sent rows. Run both; Close the publisher when done.
type Outbox struct {
	Publisher *messaging.Publisher
	Relay     *messaging.Relay
	Cleanup   Worker
}

// Outbox wires the relay of the base's outbox, publishing as appID; exchange takes the rows
// that name none of their own. Its publisher declares topology, the whole system's, before its
// first publish. The outbox's gauges join the base's metrics.
func (b *Base) Outbox(log *slog.Logger, amqpURL, exchange, appID string, topology messaging.Topology, s RelaySettings) (*Outbox, error) {
	if err := messaging.RegisterOutboxStats(b.Registry, "", b.Background, log); err != nil {
		return nil, err
	}
	pub := messaging.NewPublisher(messaging.PublisherConfig{
		URL: amqpURL, ConnectionName: appID + "-relay", AppID: appID, Topology: topology, Logger: log,
		MaxInFlight: s.inFlight(),
	})
	relay, err := messaging.NewRelay(messaging.RelayConfig{
		DB: b.Background, Sender: cutSender{pub}, Exchange: exchange,
		BatchSize: s.BatchSize, Lanes: s.Lanes, PollInterval: s.PollInterval, DisableNotify: !s.Notify,
		SessionsPlanByIndex: true, // OpenBackground's sessions do
		Backoff:             messaging.Backoff{Base: 2 * time.Second, Max: s.MaxBackoff},
		Logger:              log, Metrics: b.Metrics, Types: routedFrom(topology, exchange),
	})
	if err != nil {
		pub.Close()
		return nil, err
	}
	return &Outbox{Publisher: pub, Relay: relay, Cleanup: b.outboxCleanup(log, s.Retention)}, nil
}

// cutSender is the relay's Sender: its Publisher, whose publishes also end when the cut their
// context carries does (see relayCut), ShutdownTimeout after the signal, when Serve stops
// waiting for the relay. A Relay's batch outlives its context by ShutdownGrace for its
// confirms; a broker that accepts the connection and never answers would hold its dial that
// long, and with it the publisher's lock and the batch's database connection, for which the
// service's Close of the publisher and of the pools wait, past the hard stop. Cut off, the
// publish gives the rows still unconfirmed no verdict, and the batch records the rest and
// commits at once. Connect and PublishTimeout are the Publisher's (see messaging.Sender).
type cutSender struct{ *messaging.Publisher }

func (s cutSender) Publish(ctx context.Context, msgs []messaging.Message) []error {
	if cut := relayCut(ctx); cut != nil {
		var cancel context.CancelFunc
		ctx, cancel = context.WithCancel(ctx)
		defer cancel()
		if cut.Err() != nil {
			// AfterFunc would cancel on a goroutine of its own, after the publish began.
			cancel()
		}
		stop := context.AfterFunc(cut, cancel)
		defer stop()
	}
	return s.Publisher.Publish(ctx, msgs)
}

// outboxCleanup is the hourly job deleting sent outbox rows older than the retention.
func (b *Base) outboxCleanup(log *slog.Logger, retention time.Duration) Worker {
	return b.cleanup(log, "sent outbox messages", retention, messaging.DeleteSentOutboxMessages)
}

// routedFrom lists the routing keys topology binds from exchange, once each: the event types
// a relay to that exchange can deliver, whose counters it exports from the start. A key with a
// wildcard word (# or *: the exchanges are topic exchanges) names a pattern, not a type, and
// would export a series no message ever counts in.
func routedFrom(topology messaging.Topology, exchange string) []string {
	var types []string
	for _, q := range topology.Queues {
		for _, b := range q.Bindings {
			if b.Exchange == exchange && !isPattern(b.RoutingKey) && !slices.Contains(types, b.RoutingKey) {
				types = append(types, b.RoutingKey)
			}
		}
	}
	return types
}

// isPattern reports whether a topic binding key matches more than one routing key: whether a
// word of it is a wildcard.
func isPattern(key string) bool {
	return slices.ContainsFunc(strings.Split(key, "."), func(word string) bool { return word == "#" || word == "*" })
}
