// Command order is the order service: it takes orders over HTTP, saves each with its
// OrderPlaced event in one transaction (the outbox), and relays the events to RabbitMQ.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

func main() { platform.Main("order", run) }

func run(ctx context.Context, env *platform.Env) error {
	common := platform.ReadCommon(env, ":8080")
	relaying := platform.ReadRelaySettings(env)
	pools := platform.PoolsOf(&relaying, nil, 0)
	pools.Check(env, common)
	if err := env.Err(); err != nil {
		return err
	}
	log := platform.NewLogger(os.Stderr, "order", common.LogFormat, common.LogLevel)
	log.Info("starting", append(common.LogAttrs(), relaying.LogAttrs()...)...)

	base, err := platform.Start(ctx, log, "order", common, pools,
		platform.Library(messaging.MigrateOutbox), platform.Migrations(migrations, "migrations", "order_schema"))
	if err != nil {
		return err
	}
	defer base.Close()
	outbox, err := base.Outbox(log, common.AMQPURL, events.Exchange, "order", events.Topology, relaying)
	if err != nil {
		return err
	}
	defer outbox.Publisher.Close()

	workers := platform.Workers{Relay: outbox.Relay, Others: []platform.Worker{outbox.Cleanup, base.Profiler(), base.Admission.Run}}
	store := &Store{db: base.DB, driver: relaying.Enqueuing(base.Driver)}
	if err := platform.Serve(ctx, log, platform.NewServer(common.HTTPAddr, handler(log, base, store)), workers); err != nil {
		return fmt.Errorf("run: %w", err)
	}
	return nil
}

// handler is the service's HTTP handler: the operational endpoints, and the order API on store
// behind base's admission control.
func handler(log *slog.Logger, base *platform.Base, store *Store) http.Handler {
	// Ready while the database works, whatever the broker does: taking orders while the
	// broker is down is what the outbox is for.
	router := platform.NewRouter(log, base.Registry, base.DatabaseReady)
	(&api{store: store, log: log}).routes(base.API(router))
	return router
}
