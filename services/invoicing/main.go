// Command invoicing is the invoicing service: it consumes OrderPlaced and OrderCancelled through
// its inbox, keeps exactly one invoice per order, and announces each invoice it issues with
// InvoiceIssued, relayed from its own outbox.
package main

import (
	"context"
	"os"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// Consumer is this service's consumer name and queue name.
const Consumer = events.InvoicingQueue

func main() { platform.Main("invoicing", run) }

func run(ctx context.Context, env *platform.Env) error {
	common := platform.ReadCommon(env, ":8081")
	settings := platform.ReadConsumerSettings(env)
	relaying := platform.ReadRelaySettings(env)
	pools := platform.PoolsOf(&relaying, &settings, 0)
	pools.Check(env, common)
	if err := env.Err(); err != nil {
		return err
	}
	log := platform.NewLogger(os.Stderr, "invoicing", common.LogFormat, common.LogLevel)
	log.Info("starting", append(append(common.LogAttrs(), settings.LogAttrs()...), relaying.LogAttrs()...)...)

	base, err := platform.Start(ctx, log, "invoicing", common, pools,
		platform.Library(messaging.MigrateInbox), platform.Library(messaging.MigrateOutbox), platform.Migrations(migrations, "migrations", "invoicing_schema"))
	if err != nil {
		return err
	}
	defer base.Close()
	outbox, err := base.Outbox(log, common.AMQPURL, events.InvoicingExchange, "invoicing", events.Topology, relaying)
	if err != nil {
		return err
	}
	defer outbox.Publisher.Close()

	sub, err := base.Subscription(log, Consumer, common.AMQPURL, events.Topology, settings)
	if err != nil {
		return err
	}
	if err := (invoicer{log: log, driver: relaying.Enqueuing(base.WorkDriver), alreadyDone: base.AlreadyDone(Consumer)}).subscribe(sub); err != nil {
		return err
	}
	return platform.ServeConsumer[Invoice](ctx, base, log, common.HTTPAddr, "/invoices", sub, settings,
		platform.Workers{Relay: outbox.Relay, Others: []platform.Worker{outbox.Cleanup}})
}
