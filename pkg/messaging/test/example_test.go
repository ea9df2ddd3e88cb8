package test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/url"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/messagingtest"
)

// OrderPlaced and InvoiceIssued are the examples' events.
type OrderPlaced struct {
	OrderID    uuid.UUID `json:"order_id"`
	TotalCents int64     `json:"total_cents"`
}

type InvoiceIssued struct {
	OrderID     uuid.UUID `json:"order_id"`
	AmountCents int64     `json:"amount_cents"`
}

type OrderCancelled struct {
	OrderID uuid.UUID `json:"order_id"`
}

var (
	orderPlaced    = messaging.Event[OrderPlaced]{Exchange: "orders", Type: "OrderPlaced"}
	orderCancelled = messaging.Event[OrderCancelled]{Exchange: "orders", Type: "OrderCancelled"}
	invoiceIssued  = messaging.Event[InvoiceIssued]{Exchange: "invoicing", Type: "InvoiceIssued"}
)

// The order and its event are saved in one transaction: both exist, or neither.
func Example_enqueue() {
	db, drv, done := exampleDatabase("CREATE TABLE orders (id uuid PRIMARY KEY, total_cents bigint NOT NULL)")
	defer done()

	order := OrderPlaced{OrderID: uuid.New(), TotalCents: 2500}
	err := db.Transaction(func(tx *gorm.DB) error {
		if err := tx.Exec("INSERT INTO orders (id, total_cents) VALUES (?, ?)", order.OrderID, order.TotalCents).Error; err != nil {
			return err
		}
		msg, err := orderPlaced.Message(order)
		if err != nil {
			return err
		}
		return messaging.Enqueue(context.Background(), drv, tx, msg) // refuses a plain *gorm.DB: it must be the same transaction
	})
	if err != nil {
		panic(err) // panic, not log.Fatal: the deferred cleanup still runs
	}
	var unsent int64
	db.Raw("SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL").Scan(&unsent)
	fmt.Println("unsent events:", unsent)
	// Output: unsent events: 1
}

// The relay publishes due rows with confirms and marks the confirmed ones sent. Relay.Run does
// this in a loop, woken by each commit; ProcessBatch is one round.
func Example_relay() {
	db, drv, done := exampleDatabase()
	defer done()
	exchange, queued, cleanup := exampleQueue("OrderPlaced")
	defer cleanup()

	err := db.Transaction(func(tx *gorm.DB) error {
		msg, err := orderPlaced.Message(OrderPlaced{OrderID: uuid.New(), TotalCents: 2500})
		if err != nil {
			return err
		}
		msg.Exchange = exchange // this example's own exchange, not the event's
		return messaging.Enqueue(context.Background(), drv, tx, msg)
	})
	if err != nil {
		panic(err)
	}
	pub := messaging.NewPublisher(messaging.PublisherConfig{URL: testenv.AMQPURL(), AppID: "order",
		Topology: messaging.Topology{Exchanges: []string{exchange}}})
	defer pub.Close()
	relay, err := messaging.NewRelay(messaging.RelayConfig{DB: drv.DB(), Sender: pub, Exchange: exchange})
	if err != nil {
		panic(err)
	}
	res, err := relay.ProcessBatch(context.Background())
	if err != nil {
		panic(err)
	}
	fmt.Printf("claimed %d, sent %d, queued %d\n", res.Claimed, res.Sent, queued())
	// Output: claimed 1, sent 1, queued 1
}

// One subscription, one queue, two event types: each goes to its typed handler, inside the
// inbox transaction that records it, so a redelivery does nothing. messagingtest.Deliver hands
// a message to the subscription as the queue would; Run consumes the queue.
func Example_handle() {
	_, drv, done := exampleDatabase()
	defer done()
	sub, err := messaging.NewSubscription(drv, messaging.SubscriptionConfig{Name: "invoicing", URL: testenv.AMQPURL(), Logger: quiet})
	if err != nil {
		panic(err)
	}
	err = errors.Join(
		messaging.Handle(sub, orderPlaced, func(ctx context.Context, tx *gorm.DB, ev OrderPlaced, msg messaging.Message) error {
			fmt.Println("invoice", ev.TotalCents)
			return nil
		}),
		messaging.Handle(sub, orderCancelled, func(ctx context.Context, tx *gorm.DB, ev OrderCancelled, msg messaging.Message) error {
			fmt.Println("void")
			return nil
		}))
	if err != nil {
		panic(err)
	}
	id := uuid.New()
	placed, _ := orderPlaced.Message(OrderPlaced{OrderID: id, TotalCents: 2500})
	cancelled, _ := orderCancelled.Message(OrderCancelled{OrderID: id})
	for _, msg := range []messaging.Message{placed, cancelled, placed} {
		duplicate, err := messagingtest.Deliver(context.Background(), sub, msg)
		if err != nil {
			panic(err)
		}
		if duplicate {
			fmt.Println("duplicate skipped")
		}
	}
	// Output:
	// invoice 2500
	// void
	// duplicate skipped
}

// A consumer's own outbox: the handler enqueues the event its work produces in the inbox
// transaction, and the service's relay publishes it. Exactly once holds along the chain: a
// redelivered OrderPlaced is a duplicate, so no second InvoiceIssued is written.
func Example_consumerOutbox() {
	db, drv, done := exampleDatabase()
	defer done()
	sub, err := messaging.NewSubscription(drv, messaging.SubscriptionConfig{Name: "invoicing", URL: testenv.AMQPURL(), Logger: quiet})
	if err != nil {
		panic(err)
	}
	err = messaging.Handle(sub, orderPlaced, func(ctx context.Context, tx *gorm.DB, ev OrderPlaced, msg messaging.Message) error {
		issued, err := invoiceIssued.Message(InvoiceIssued{OrderID: ev.OrderID, AmountCents: ev.TotalCents})
		if err != nil {
			return err
		}
		return messaging.Enqueue(ctx, drv, tx, issued)
	})
	if err != nil {
		panic(err)
	}
	placed, _ := orderPlaced.Message(OrderPlaced{OrderID: uuid.New(), TotalCents: 2500})
	for range 2 {
		if _, err := messagingtest.Deliver(context.Background(), sub, placed); err != nil {
			panic(err)
		}
	}
	var issued int64
	db.Raw("SELECT count(*) FROM outbox_messages WHERE type = 'InvoiceIssued'").Scan(&issued)
	fmt.Println("InvoiceIssued in the outbox:", issued)
	// The service then runs a relay of db's outbox to the "invoicing" exchange (see Example_relay).

	// Output: InvoiceIssued in the outbox: 1
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// exampleDatabase makes a database of its own with both messaging tables, and more tables if
// given, and returns its GORM handle and the library's adapter of it; done drops it. (The
// tests' helpers need a *testing.T, which examples do not have.)
func exampleDatabase(tables ...string) (db *gorm.DB, drv *gormdriver.Driver, done func()) {
	// An admin connection and the pool.
	const pool = 4
	release, err := testenv.Reserve(1 + pool)
	if err != nil {
		log.Fatal(err)
	}
	admin, err := testenv.OpenGORM(testenv.DatabaseURL(), 1)
	if err != nil {
		log.Fatal(err)
	}
	name := testenv.UniqueName("example")
	if err := admin.Exec("CREATE DATABASE " + name).Error; err != nil {
		log.Fatal(err)
	}
	u, err := url.Parse(testenv.DatabaseURL())
	if err != nil {
		log.Fatal(err)
	}
	u.Path = "/" + name
	if db, err = testenv.OpenGORM(u.String(), pool); err != nil {
		log.Fatal(err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		log.Fatal(err)
	}
	if drv, err = gormdriver.New(db); err != nil {
		log.Fatal(err)
	}
	for _, migrate := range []func(context.Context, messaging.DB) error{messaging.MigrateOutbox, messaging.MigrateInbox} {
		if err := migrate(context.Background(), drv.DB()); err != nil {
			log.Fatal(err)
		}
	}
	for _, ddl := range tables {
		if err := db.Exec(ddl).Error; err != nil {
			log.Fatal(err)
		}
	}
	return db, drv, func() {
		_ = sqlDB.Close()
		_ = admin.Exec("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)").Error
		if a, err := admin.DB(); err == nil {
			_ = a.Close()
		}
		release()
	}
}

// exampleQueue declares an exchange and a queue bound to routingKey; depth counts its messages,
// and done deletes both.
func exampleQueue(routingKey string) (exchange string, depth func() int, done func()) {
	exchange, queue := testenv.UniqueName("orders"), testenv.UniqueName("invoicing")
	conn, err := amqp.Dial(testenv.AMQPURL())
	if err != nil {
		log.Fatal(err)
	}
	ch, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}
	if err := queueTopology(exchange, queue, routingKey).Declare(conn, nil); err != nil {
		log.Fatal(err)
	}
	depth = func() int {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			log.Fatal(err)
		}
		return q.Messages
	}
	return exchange, depth, func() {
		for _, q := range []string{queue, messaging.DeadLetterQueue(queue)} {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		_ = ch.ExchangeDelete(exchange, false, false)
		_ = conn.Close()
	}
}
