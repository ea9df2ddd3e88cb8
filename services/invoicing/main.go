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
	outbox, err := base.Outbox(log, common.AMQPURL, events.InvoicingExchange, "invoicing", events.Topology, relaying)
	if err != nil {
		return err
	}
	defer outbox.Publisher.Close()

	sub, err := base.Subscription(log, Consumer, common.AMQPURL, events.Topology, settings)
	if err != nil {
		return err
	}
	invoicer{log: log, alreadyDone: base.AlreadyDone(Consumer)}.subscribe(sub)
	return platform.ServeConsumer[Invoice](ctx, base, log, common.HTTPAddr, "/invoices", sub, settings, outbox.Relay.Run, outbox.Cleanup)
}
