// Command invoicing is the invoicing service: it consumes OrderPlaced through its inbox and
// creates exactly one invoice per order.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// Consumer is this service's consumer name and queue name (CONTRACT.md).
const Consumer = "invoicing"

func main() { platform.Main("invoicing", run) }

func run(ctx context.Context, env *platform.Env) error {
	common := platform.ReadCommon(env, ":8081")
	settings := platform.ReadConsumerSettings(env, common)
	if err := env.Err(); err != nil {
		return err
	}
	log := platform.NewLogger(os.Stderr, "invoicing", common.LogFormat, common.LogLevel)
	log.Info("starting", append(common.LogAttrs(), settings.LogAttrs()...)...)

	base, err := platform.Start(ctx, log, "invoicing", common,
		messaging.MigrateInbox, platform.Migrations(migrations, "migrations", "invoicing_schema"))
	if err != nil {
		return err
	}
	defer base.Close()

	consumer, err := base.NewInboxConsumer(log, platform.InboxConsumer{
		Name: Consumer, Exchange: events.Exchange, RoutingKeys: []string{events.OrderPlacedType},
		AMQPURL: common.AMQPURL, Settings: settings, Work: invoicer{log: log}.handle,
	})
	if err != nil {
		return err
	}

	router := platform.NewRouter(log, base.Registry, base.ConsumerReady(consumer))
	router.Get("/invoices", platform.ListByOrder(log, func(ctx context.Context, orderID uuid.UUID, limit int) ([]Invoice, error) {
		return platform.ListRecent[Invoice](ctx, base.DB, orderID, limit)
	}))
	if err := platform.Serve(ctx, log, platform.NewServer(common.HTTPAddr, router),
		consumer.Run, base.InboxCleanup(log, settings.InboxRetention)); err != nil {
		return fmt.Errorf("run: %w", err)
	}
	return nil
}
