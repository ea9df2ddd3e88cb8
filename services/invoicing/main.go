// Command invoicing is the invoicing service: it consumes OrderPlaced and OrderCancelled through
// its inbox, keeps exactly one invoice per order, and announces each invoice it issues with
// InvoiceIssued, relayed from its own outbox.
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

// Consumer is this service's consumer name and queue name.
const Consumer = "invoicing"

func main() { platform.Main("invoicing", run) }

func run(ctx context.Context, env *platform.Env) error {
	common := platform.ReadCommon(env, ":8081")
	settings := platform.ReadConsumerSettings(env, common)
	relaying := platform.ReadRelaySettings(env, common)
	if err := env.Err(); err != nil {
		return err
	}
	log := platform.NewLogger(os.Stderr, "invoicing", common.LogFormat, common.LogLevel)
	log.Info("starting", append(append(common.LogAttrs(), settings.LogAttrs()...), relaying.LogAttrs()...)...)

	base, err := platform.Start(ctx, log, "invoicing", common,
		messaging.MigrateInbox, messaging.MigrateOutbox, platform.Migrations(migrations, "migrations", "invoicing_schema"))
	if err != nil {
		return err
	}
	defer base.Close()
	outbox, err := base.Outbox(log, common.AMQPURL, events.InvoicingExchange, "invoicing", relaying)
	if err != nil {
		return err
	}
	defer outbox.Publisher.Close()

	sub, err := base.Subscription(log, Consumer, common.AMQPURL, settings)
	if err != nil {
		return err
	}
	invoicer{log: log}.subscribe(sub)
	if err := sub.Start(); err != nil {
		return err
	}

	router := platform.NewRouter(log, base.Registry, base.ConsumerReady(sub))
	router.Get("/invoices", platform.ListByOrder(log, func(ctx context.Context, orderID uuid.UUID, limit int) ([]Invoice, error) {
		return platform.ListRecent[Invoice](ctx, base.DB, orderID, limit)
	}))
	if err := platform.Serve(ctx, log, platform.NewServer(common.HTTPAddr, router),
		sub.Run, outbox.Relay.Run, outbox.Cleanup, base.InboxCleanup(log, settings.InboxRetention)); err != nil {
		return fmt.Errorf("run: %w", err)
	}
	return nil
}
