// Package messaging implements the transactional outbox and inbox patterns over PostgreSQL and
// RabbitMQ, so that services agree on what happened: no event is lost when a process dies or
// the broker is down, and none is acted on twice when it arrives again.
//
// A database and a broker cannot share a transaction. So the write side saves each event in
// the same transaction as the data it describes ([Enqueue], the outbox), and a [Relay] moves
// the saved events to RabbitMQ: it claims rows with FOR UPDATE SKIP LOCKED (two replicas never
// claim a row at once; one whose confirm never came is sent again, and may arrive twice), waits
// for the broker's publisher confirms before it counts a row as sent,
// and backs off, without ever giving up, a row the broker refuses. That is at-least-once
// delivery, so the read side claims every message in an inbox table in the transaction of its
// work and acknowledges it only after that commits ([Subscription], the inbox): a message that
// arrives again is recognised and skipped.
//
// # Drivers
//
// The library runs its statements through a small seam, [Driver], so that it writes in the
// transactions of the PostgreSQL driver a service already uses: pgx v5 (module pgxdriver),
// database/sql (package sqldriver) or GORM (module gormdriver). Handlers get the driver's own
// transaction type.
//
// # A service in brief
//
// The event is saved with the data, in the caller's transaction; the relay publishes it; the
// subscription hands it, once, to its typed handler, in a transaction of its own that also
// records it in the inbox (pgx here; see the examples folder for database/sql and GORM):
//
//	type OrderPlaced struct {
//		OrderID uuid.UUID `json:"order_id"`
//	}
//
//	var orderPlaced = messaging.Event[OrderPlaced]{Exchange: "orders", Type: "OrderPlaced"}
//
//	func run(ctx context.Context, pool *pgxpool.Pool, amqpURL string) error {
//		db := pgxdriver.New(pool)
//		if err := messaging.MigrateOutbox(ctx, db.DB()); err != nil {
//			return err
//		}
//		if err := messaging.MigrateInbox(ctx, db.DB()); err != nil {
//			return err
//		}
//		// Write side: the order and its event commit together, or not at all.
//		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//			id := uuid.New()
//			if _, err := tx.Exec(ctx, `INSERT INTO orders (id) VALUES ($1)`, id); err != nil {
//				return err
//			}
//			msg, err := orderPlaced.Message(OrderPlaced{OrderID: id})
//			if err != nil {
//				return err
//			}
//			return messaging.Enqueue(ctx, db, tx, msg)
//		})
//		if err != nil {
//			return err
//		}
//		// Every process declares the whole topology before it publishes or consumes, so a
//		// consumer that starts last misses nothing.
//		topology := messaging.Topology{Queues: []messaging.ConsumerTopology{
//			{Queue: "invoicing", Bindings: []messaging.Binding{orderPlaced.Binding()}},
//		}}
//		pub := messaging.NewPublisher(messaging.PublisherConfig{URL: amqpURL, Topology: topology})
//		defer pub.Close()
//		relay, err := messaging.NewRelay(messaging.RelayConfig{DB: db.DB(), Sender: pub, Exchange: "orders"})
//		if err != nil {
//			return err
//		}
//		// Read side: the invoice and the inbox record commit together; a redelivery is skipped.
//		sub, err := messaging.NewSubscription(db, messaging.SubscriptionConfig{Name: "invoicing", URL: amqpURL, Topology: topology})
//		if err != nil {
//			return err
//		}
//		err = messaging.Handle(sub, orderPlaced, func(ctx context.Context, tx pgx.Tx, p OrderPlaced, msg messaging.Message) error {
//			_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, p.OrderID)
//			return err
//		})
//		if err != nil {
//			return err
//		}
//		g, ctx := errgroup.WithContext(ctx)
//		g.Go(func() error { return relay.Run(ctx) })
//		g.Go(func() error { return sub.Run(ctx) })
//		return g.Wait()
//	}
//
// # Failures
//
// A handler's error is retried in place, then the message goes back to its queue, counted as
// a failed delivery; at its last allowed delivery ([DefaultDeliveryLimit]) it is dead-lettered,
// with its reason, to the queue's dead-letter queue. The deliveries follow each other at once:
// with the defaults a message whose handler fails at once on every try is dead-lettered within
// about 6 s. Mark an error no retry can fix with [Permanent] (dead-lettered at once, unless it carries a database outage's SQLSTATE or the
// handler timeout cut the attempt off; a statement the database refuses for the value alone,
// too long or not valid in its type, is taken as one) and a dependency's outage with [Unavailable]
// (retried for as long as it lasts, without counting against the message). A message that
// cannot be decoded is dead-lettered at once; one whose type has no handler goes back to the
// queue at once, for a replica that has one, until its last allowed delivery.
// [ListDeadLetters], [RedriveDeadLetters] and [DropDeadLetter] are the operator's view of a
// dead-letter queue. On the publishing side, [ParkOutboxMessage] sets aside an outbox row the
// broker will never accept, which would otherwise be retried forever.
//
// # Observability
//
// Each message carries the trace context of the span that enqueued it, from the outbox row to
// the AMQP headers to its handler's context, written and read with the process's
// OpenTelemetry propagator; spans are recorded when the process installs a tracer provider.
// [NewMetrics] and [RegisterOutboxStats] export Prometheus metrics: the backlog, its age, the
// failures, the duplicates, the dead letters.
//
// # Housekeeping
//
// [DeleteSentOutboxMessages] and [DeleteInboxMessages] delete old rows in small batches, one
// runner at a time; keep inbox records longer than any duplicate can arrive.
package messaging
