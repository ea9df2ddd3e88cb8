// Command order is the order service: it takes orders over HTTP, saves each with its
// OrderPlaced event in one transaction (the outbox), and relays the events to RabbitMQ.
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

func main() { platform.Main("order", run) }

func run(ctx context.Context, env *platform.Env) error {
	common := platform.ReadCommon(env, ":8080")
	batchSize := env.Int("OUTBOX_BATCH_SIZE", 500, 1, 1000)
	lanes := env.Int("OUTBOX_LANES", 2, 1, 16)
	// Each lane holds a connection for its batch's transaction, the relay one for LISTEN, and
	// requests still need some.
	env.Check(common.DBMaxConns >= lanes+3, "OUTBOX_LANES", "needs DB_MAX_CONNS of at least OUTBOX_LANES + 3")
	pollInterval := env.Duration("OUTBOX_POLL_INTERVAL", time.Second, 10*time.Millisecond, time.Hour)
	maxBackoff := env.Duration("OUTBOX_MAX_BACKOFF", 5*time.Minute, 2*time.Second, 24*time.Hour)
	notify := env.Bool("OUTBOX_NOTIFY", true)
	retention := env.Duration("OUTBOX_RETENTION", 7*24*time.Hour, time.Minute, 365*24*time.Hour)
	if err := env.Err(); err != nil {
		return err
	}
	log := platform.NewLogger(os.Stderr, "order", common.LogFormat, common.LogLevel)
	log.Info("starting", append(common.LogAttrs(), "outbox_batch_size", batchSize, "outbox_lanes", lanes, "outbox_poll_interval", pollInterval,
		"outbox_max_backoff", maxBackoff, "outbox_notify", notify, "outbox_retention", retention)...)

	base, err := platform.Start(ctx, log, "order", common,
		messaging.MigrateOutbox, platform.Migrations(migrations, "migrations", "order_schema"))
	if err != nil {
		return err
	}
	defer base.Close()
	db := base.DB
	messaging.RegisterOutboxStats(base.Registry, db)

	publisher := messaging.NewPublisher(messaging.PublisherConfig{
		URL: common.AMQPURL, ConnectionName: "order-relay", AppID: "order",
		Setup:  func(ch *amqp.Channel) error { return messaging.DeclareExchange(ch, events.Exchange) },
		Logger: log,
	})
	defer publisher.Close()
	relay, err := messaging.NewRelay(messaging.RelayConfig{
		DB: db, Sender: publisher, Exchange: events.Exchange,
		BatchSize: batchSize, Lanes: lanes, PollInterval: pollInterval, DisableNotify: !notify,
		Backoff: messaging.Backoff{Base: 2 * time.Second, Max: maxBackoff},
		Logger:  log, Metrics: base.Metrics,
	})
	if err != nil {
		return err
	}

	// Ready while the database works, whatever the broker does: taking orders while the
	// broker is down is what the outbox is for.
	router := platform.NewRouter(log, base.Registry, func(ctx context.Context) error { return platform.Ping(ctx, db) })
	(&api{store: &Store{db: db}, log: log}).routes(router)

	// Connect now, so bad credentials show at start and the exchange exists before the first
	// order; if the broker is down, the relay keeps trying.
	if err := publisher.Connect(ctx); err != nil {
		log.Warn("RabbitMQ not reachable at start; orders are taken and relayed once it is", "error", err)
	}
	if err := platform.Serve(ctx, log, platform.NewServer(common.HTTPAddr, router),
		relay.Run, base.OutboxCleanup(log, retention)); err != nil {
		return fmt.Errorf("run: %w", err)
	}
	return nil
}
