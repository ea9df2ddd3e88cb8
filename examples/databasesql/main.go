// Command databasesql is the library on database/sql (with pgx's stdlib driver here; lib/pq
// works the same): an order and its OrderPlaced event saved in one *sql.Tx, relayed, and handled
// once by a subscription whose handler writes with its own *sql.Tx. DATABASE_URL and AMQP_URL
// say where.
package main

import (
	"context"
	"database/sql"
	"log"
	"os"
	"os/signal"
	"sync"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/sqldriver"
)

type OrderPlaced struct {
	OrderID    uuid.UUID `json:"order_id"`
	TotalCents int64     `json:"total_cents"`
}

var orderPlaced = messaging.Event[OrderPlaced]{Exchange: "shop", Type: "OrderPlaced"}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	check(err)
	defer db.Close()
	// database/sql cannot receive notifications; pgx's connection under it can: the relay then
	// wakes at each commit instead of polling.
	driver := sqldriver.New(db).WithNotifications(func(ctx context.Context, c *sql.Conn) error {
		return c.Raw(func(dc any) error { _, err := dc.(*stdlib.Conn).Conn().WaitForNotification(ctx); return err })
	})
	check(messaging.MigrateOutbox(ctx, driver.DB()))
	check(messaging.MigrateInbox(ctx, driver.DB()))
	_, err = db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS orders (id uuid PRIMARY KEY, total_cents bigint NOT NULL);
		CREATE TABLE IF NOT EXISTS invoices (order_id uuid PRIMARY KEY, amount_cents bigint NOT NULL)`)
	check(err)

	// The order and its event, in one transaction.
	order := OrderPlaced{OrderID: uuid.New(), TotalCents: 2500}
	tx, err := db.BeginTx(ctx, nil)
	check(err)
	_, err = tx.ExecContext(ctx, `INSERT INTO orders (id, total_cents) VALUES ($1, $2)`, order.OrderID, order.TotalCents)
	check(err)
	msg, err := orderPlaced.Message(order)
	check(err)
	check(messaging.Enqueue(ctx, driver, tx, msg))
	check(tx.Commit())

	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: "billing", Bindings: []messaging.Binding{orderPlaced.Binding()}}}}
	pub := messaging.NewPublisher(messaging.PublisherConfig{URL: os.Getenv("AMQP_URL"), Topology: topology})
	defer pub.Close()
	relay, err := messaging.NewRelay(messaging.RelayConfig{DB: driver.DB(), Sender: pub, Exchange: orderPlaced.Exchange})
	check(err)
	sub, err := messaging.NewSubscription(driver, messaging.SubscriptionConfig{Name: "billing", URL: os.Getenv("AMQP_URL"), Topology: topology})
	check(err)
	// Once: an order left in the outbox or the queue by an earlier, interrupted run is
	// invoiced too, and a second close would panic.
	invoiced, once := make(chan struct{}), new(sync.Once)
	check(messaging.Handle(sub, orderPlaced, func(ctx context.Context, tx *sql.Tx, o OrderPlaced, m messaging.Message) error {
		// Written with the transaction that records the message in the inbox: once, or not at all.
		if _, err := tx.ExecContext(ctx, `INSERT INTO invoices (order_id, amount_cents) VALUES ($1, $2)`, o.OrderID, o.TotalCents); err != nil {
			return err
		}
		return messaging.AfterCommit(ctx, func() {
			log.Printf("invoiced order %s: %d cents", o.OrderID, o.TotalCents)
			once.Do(func() { close(invoiced) })
		})
	}))
	var wg sync.WaitGroup
	wg.Go(func() { check(relay.Run(ctx)) })
	wg.Go(func() { check(sub.Run(ctx)) })
	select {
	case <-invoiced:
	case <-ctx.Done():
	}
	stop()
	wg.Wait()
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
