// Command databasesql is the library on database/sql (with pgx's stdlib driver here; lib/pq
// works the same): an order and its OrderPlaced event saved in one *sql.Tx, relayed, and handled
// once by a subscription whose handler writes with its own *sql.Tx. It stops once that is
// done, or at once on SIGTERM or Ctrl-C. DATABASE_URL and AMQP_URL say where.
package main

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/stdlib"
	"golang.org/x/sync/errgroup"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/sqldriver"
)

type OrderPlaced struct {
	OrderID    uuid.UUID `json:"order_id"`
	TotalCents int64     `json:"total_cents"`
}

var orderPlaced = messaging.Event[OrderPlaced]{Exchange: "shop", Type: "OrderPlaced"}

func main() {
	// SIGTERM is how Docker and Kubernetes ask a container to stop.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		slog.Error("databasesql failed", "error", err)
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
	db, err := sql.Open("pgx", databaseURL)
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	defer db.Close()
	// database/sql cannot receive notifications; pgx's connection under it can: the relay then
	// wakes at each commit instead of polling. Another driver (lib/pq) has no *stdlib.Conn
	// there: ErrNoNotifications makes the relay poll instead. Such a driver should also enqueue
	// through messaging.WithoutNotify(driver), with RelayConfig.DisableNotify set: a notify no
	// relay hears still takes PostgreSQL's server-wide notify lock at every enqueuing commit.
	driver := sqldriver.New(db).WithNotifications(func(ctx context.Context, c *sql.Conn) error {
		return c.Raw(func(dc any) error {
			conn, ok := dc.(*stdlib.Conn)
			if !ok {
				return messaging.ErrNoNotifications
			}
			_, err := conn.Conn().WaitForNotification(ctx)
			return err
		})
	})
	// A deadline: a migration stuck behind another replica's, or behind a long transaction on
	// the tables, fails the start with its reason rather than hanging it.
	mctx, cancelMigrations := context.WithTimeout(ctx, 2*time.Minute)
	defer cancelMigrations()
	if err := messaging.MigrateOutbox(mctx, driver.DB()); err != nil {
		return fmt.Errorf("migrate the outbox: %w", err)
	}
	if err := messaging.MigrateInbox(mctx, driver.DB()); err != nil {
		return fmt.Errorf("migrate the inbox: %w", err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS orders (id uuid PRIMARY KEY, total_cents bigint NOT NULL);
		CREATE TABLE IF NOT EXISTS invoices (order_id uuid PRIMARY KEY, amount_cents bigint NOT NULL)`); err != nil {
		return fmt.Errorf("create the tables: %w", err)
	}
	if err := placeOrder(ctx, db, driver, OrderPlaced{OrderID: uuid.New(), TotalCents: 2500}); err != nil {
		return err
	}

	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: "billing", Bindings: []messaging.Binding{orderPlaced.Binding()}}}}
	pub := messaging.NewPublisher(messaging.PublisherConfig{URL: amqpURL, Topology: topology})
	defer pub.Close()
	relay, err := messaging.NewRelay(messaging.RelayConfig{DB: driver.DB(), Sender: pub, Exchange: orderPlaced.Exchange})
	if err != nil {
		return err
	}
	sub, err := messaging.NewSubscription(driver, messaging.SubscriptionConfig{Name: "billing", URL: amqpURL, Topology: topology})
	if err != nil {
		return err
	}
	// Once: an order left in the outbox or the queue by an earlier, interrupted run is
	// invoiced too, and a second close would panic.
	invoiced, once := make(chan struct{}), new(sync.Once)
	if err := messaging.Handle(sub, orderPlaced, func(ctx context.Context, tx *sql.Tx, o OrderPlaced, m messaging.Message) error {
		// Written with the transaction that records the message in the inbox: once, or not at all.
		if _, err := tx.ExecContext(ctx, `INSERT INTO invoices (order_id, amount_cents) VALUES ($1, $2)`, o.OrderID, o.TotalCents); err != nil {
			return fmt.Errorf("insert the invoice: %w", err)
		}
		return messaging.AfterCommit(ctx, func() {
			slog.Info("invoiced", "order_id", o.OrderID, "amount_cents", o.TotalCents, "message_id", m.ID)
			once.Do(func() { close(invoiced) })
		})
	}); err != nil {
		return err
	}
	return runUntil(ctx, invoiced, relay.Run, sub.Run)
}

// placeOrder saves the order and its event in one transaction.
func placeOrder(ctx context.Context, db *sql.DB, driver *sqldriver.Driver, order OrderPlaced) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }() // nothing once committed; else frees the connection
	if _, err := tx.ExecContext(ctx, `INSERT INTO orders (id, total_cents) VALUES ($1, $2)`, order.OrderID, order.TotalCents); err != nil {
		return fmt.Errorf("insert the order: %w", err)
	}
	msg, err := orderPlaced.Message(order)
	if err != nil {
		return err
	}
	if err := messaging.Enqueue(ctx, driver, tx, msg); err != nil {
		return fmt.Errorf("enqueue: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit the order: %w", err)
	}
	return nil
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
