// Command gorm is the library on GORM: an order and its OrderPlaced event saved in one
// db.Transaction, relayed, and handled once by a subscription whose handler gets its
// transaction as a *gorm.DB. DATABASE_URL and AMQP_URL say where.
package main

import (
	"context"
	"log"
	"os"
	"os/signal"
	"sync"

	"github.com/google/uuid"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
)

type Order struct {
	ID         uuid.UUID `gorm:"type:uuid;primaryKey"`
	TotalCents int64
}

type Invoice struct {
	OrderID     uuid.UUID `gorm:"type:uuid;primaryKey"`
	AmountCents int64
}

type OrderPlaced struct {
	OrderID    uuid.UUID `json:"order_id"`
	TotalCents int64     `json:"total_cents"`
}

var orderPlaced = messaging.Event[OrderPlaced]{Exchange: "shop", Type: "OrderPlaced"}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	db, err := gorm.Open(postgres.Open(os.Getenv("DATABASE_URL")), &gorm.Config{})
	check(err)
	driver, err := gormdriver.New(db)
	check(err)
	check(messaging.MigrateOutbox(ctx, driver.DB()))
	check(messaging.MigrateInbox(ctx, driver.DB()))
	check(db.AutoMigrate(&Order{}, &Invoice{}))

	// The order and its event, in one transaction: Enqueue refuses a *gorm.DB outside one.
	order := Order{ID: uuid.New(), TotalCents: 2500}
	check(db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		if err := tx.Create(&order).Error; err != nil {
			return err
		}
		msg, err := orderPlaced.Message(OrderPlaced{OrderID: order.ID, TotalCents: order.TotalCents})
		if err != nil {
			return err
		}
		return messaging.Enqueue(ctx, driver, tx, msg)
	}))

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
	check(messaging.Handle(sub, orderPlaced, func(ctx context.Context, tx *gorm.DB, o OrderPlaced, m messaging.Message) error {
		// Written with the transaction that records the message in the inbox: once, or not at all.
		if err := tx.Create(&Invoice{OrderID: o.OrderID, AmountCents: o.TotalCents}).Error; err != nil {
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
