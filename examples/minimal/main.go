// Command minimal is a whole service on the library in one file: it saves an event in its own
// transaction, relays it to RabbitMQ, handles it once through the inbox, and shuts down.
// DATABASE_URL and AMQP_URL say where.
package main

import (
	"context"
	"log"
	"os"
	"os/signal"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/pgxdriver"
)

func main() {
	type Greeted struct{ Name string }
	greeted := messaging.Event[Greeted]{Exchange: "greetings", Type: "Greeted"}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()
	db, amqpURL := pgxdriver.New(pool), os.Getenv("AMQP_URL")
	check(messaging.MigrateOutbox(ctx, db.DB()))
	check(messaging.MigrateInbox(ctx, db.DB()))
	msg, err := greeted.Message(Greeted{Name: "world"}) // enqueued in the transaction of the data it describes
	check(err)
	check(pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return messaging.Enqueue(ctx, db, tx, msg) }))
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: "greeter", Bindings: []messaging.Binding{greeted.Binding()}}}}
	pub := messaging.NewPublisher(messaging.PublisherConfig{URL: amqpURL, Topology: topology})
	defer pub.Close()
	relay, err := messaging.NewRelay(messaging.RelayConfig{DB: db.DB(), Sender: pub, Exchange: greeted.Exchange})
	check(err)
	sub, err := messaging.NewSubscription(db, messaging.SubscriptionConfig{Name: "greeter", URL: amqpURL, Topology: topology})
	check(err)
	handled, once := make(chan struct{}), new(sync.Once) // once: a message left from an earlier run is handled too
	check(messaging.Handle(sub, greeted, func(ctx context.Context, tx pgx.Tx, g Greeted, m messaging.Message) error {
		return messaging.AfterCommit(ctx, func() { log.Printf("hello, %s (message %s)", g.Name, m.ID); once.Do(func() { close(handled) }) })
	}))
	var wg sync.WaitGroup
	wg.Go(func() { check(relay.Run(ctx)) })
	wg.Go(func() { check(sub.Run(ctx)) })
	select { // handled once, or interrupted
	case <-handled:
	case <-ctx.Done():
	}
	stop() // shuts the relay and the subscription down
	wg.Wait()
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
