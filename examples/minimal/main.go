// Command minimal is a whole service on the library in one file: it saves an event in its own
// transaction, relays it to RabbitMQ, handles it once through the inbox, and shuts down, at
// once on SIGTERM or Ctrl-C. DATABASE_URL and AMQP_URL say where.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/pgxdriver"
)

type Greeted struct{ Name string }

var greeted = messaging.Event[Greeted]{Exchange: "greetings", Type: "Greeted"}

func main() {
	// SIGTERM is how Docker and Kubernetes ask a container to stop.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		slog.Error("minimal failed", "error", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	// Both, before anything is written: pgx takes an empty DATABASE_URL for a local default,
	// and without AMQP_URL, or with one that does not parse, the start would fail only after
	// the event was saved.
	databaseURL, err := required("DATABASE_URL")
	if err != nil {
		return err
	}
	amqpURL, err := required("AMQP_URL")
	if err != nil {
		return err
	}
	if err := messaging.CheckBrokerURL(amqpURL); err != nil {
		return fmt.Errorf("AMQP_URL %w", err)
	}
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	// What the relay (a connection per lane, one for its LISTEN) and the subscription (one per
	// worker, one to ask whether the database answers after a failure) hold at most, and one
	// for the rest: fewer, and workers wait for a connection within their handler timeout.
	cfg.MaxConns = max(cfg.MaxConns, messaging.DefaultLanes+1+messaging.DefaultConcurrency+1+1)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("open the database: %w", err)
	}
	defer pool.Close()
	db := pgxdriver.New(pool)
	// A deadline: a migration stuck behind another replica's, or behind a long transaction on
	// the tables, fails the start with its reason rather than hanging it.
	mctx, cancelMigrations := context.WithTimeout(ctx, 2*time.Minute)
	defer cancelMigrations()
	if err := messaging.MigrateOutbox(mctx, db.DB()); err != nil {
		return fmt.Errorf("migrate the outbox: %w", err)
	}
	if err := messaging.MigrateInbox(mctx, db.DB()); err != nil {
		return fmt.Errorf("migrate the inbox: %w", err)
	}
	msg, err := greeted.Message(Greeted{Name: "world"})
	if err != nil {
		return err
	}
	// Enqueued in the transaction of the data it describes (here, none).
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return messaging.Enqueue(ctx, db, tx, msg) }); err != nil {
		return fmt.Errorf("enqueue: %w", err)
	}

	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: "greeter", Bindings: []messaging.Binding{greeted.Binding()}}}}
	pub := messaging.NewPublisher(messaging.PublisherConfig{URL: amqpURL, Topology: topology})
	defer pub.Close()
	relay, err := messaging.NewRelay(messaging.RelayConfig{DB: db.DB(), Sender: pub, Exchange: greeted.Exchange})
	if err != nil {
		return err
	}
	sub, err := messaging.NewSubscription(db, messaging.SubscriptionConfig{Name: "greeter", URL: amqpURL, Topology: topology})
	if err != nil {
		return err
	}
	handled, once := make(chan struct{}), new(sync.Once) // once: a message left from an earlier run is handled too
	if err := messaging.Handle(sub, greeted, func(ctx context.Context, tx pgx.Tx, g Greeted, m messaging.Message) error {
		return messaging.AfterCommit(ctx, func() {
			slog.Info("hello", "name", g.Name, "message_id", m.ID)
			once.Do(func() { close(handled) })
		})
	}); err != nil {
		return err
	}
	return runUntil(ctx, handled, relay.Run, sub.Run)
}

// runUntil runs each part until done closes or ctx ends, then stops them all and waits; the
// first part to fail stops the others, and its error is returned.
func runUntil(ctx context.Context, done <-chan struct{}, parts ...func(context.Context) error) error {
	g, ctx := errgroup.WithContext(ctx)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for _, part := range parts {
		g.Go(func() error { return part(ctx) })
	}
	g.Go(func() error {
		select {
		case <-done:
			cancel()
		case <-ctx.Done():
		}
		return nil
	})
	return g.Wait()
}

// required is the value of the environment variable name, or an error naming it if it is unset
// or blank.
func required(name string) (string, error) {
	v := os.Getenv(name)
	if strings.TrimSpace(v) == "" {
		return "", fmt.Errorf("%s is required", name)
	}
	return v, nil
}
