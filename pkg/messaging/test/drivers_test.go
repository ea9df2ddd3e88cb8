package test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq" // database/sql's driver "postgres"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/messagingtest"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/pgxdriver"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/sqldriver"
)

// driverPool is the size of the pool a conformance test opens for its driver: the relay's two
// lanes and its LISTEN, the subscription's two workers, and the test's own transaction.
const driverPool = 6

// driverCase is one driver under the conformance test, with what the test does in the
// driver's own transactions: what a service does with them.
type driverCase[Tx any] struct {
	drv messaging.Driver[Tx]
	// begin, commit and rollback are the service's own transaction, around Enqueue.
	begin    func(ctx context.Context) (Tx, error)
	commit   func(ctx context.Context, tx Tx) error
	rollback func(ctx context.Context, tx Tx) error
	// notATransaction is a Tx that is not in a transaction: Enqueue must refuse it.
	notATransaction Tx
	// work writes message id's row of driver_work in tx, the handler's transaction.
	work func(ctx context.Context, tx Tx, id uuid.UUID) error
	// notifies says whether a relay on the driver wakes on NOTIFY; if not, it must say that it
	// polls.
	notifies bool
}

// The conformance of each driver: the library's migrations; Enqueue in the caller's
// transaction, and only there; a relay on the driver's pool that publishes to a real queue, and
// wakes on NOTIFY if the driver can receive them; a subscription whose handler writes with the
// driver's own transaction type, skips a redelivered duplicate and runs AfterCommit hooks only
// once committed; the operator's functions and the cleanups; and every connection back in the
// pool at the end.

func TestPgxDriver(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+driverPool)
	d := testenv.NewDatabase(t)
	testenv.Draw(t, driverPool)
	pool := newPgxPool(t, d.URL, driverPool)
	testDriver(t, d, func() { pool.Close() }, pgxCase(pool))
}

// The database/sql adapter over pgx's stdlib ("pgx") and over lib/pq ("postgres"), database/sql's
// other common PostgreSQL driver.
func TestSQLDriver(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			testenv.Connections(t, testenv.DefaultConnections+driverPool)
			d := testenv.NewDatabase(t)
			db := openSQLWith(t, driver, d.URL)
			testDriver(t, d, func() { _ = db.Close() }, sqlCase(sqldriver.New(db), db, false))
		})
	}
}

// The database/sql adapter receives notifications when given the driver's way to wait for
// them: pgx's, here.
func TestSQLDriverWithNotifications(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+driverPool)
	d := testenv.NewDatabase(t)
	db := openSQL(t, d.URL)
	wait := func(ctx context.Context, c *sql.Conn) error {
		return c.Raw(func(driverConn any) error {
			_, err := driverConn.(*stdlib.Conn).Conn().WaitForNotification(ctx)
			return err
		})
	}
	testDriver(t, d, func() { _ = db.Close() }, sqlCase(sqldriver.New(db).WithNotifications(wait), db, true))
}

// A handler whose session the server ends (pg_terminate_backend: an operator, a failover, a
// pooler's restart) while the database still answers has met an outage (SQLSTATE 57P01), not a
// fault of its message. (lib/pq reports it as a network error without the SQLSTATE, and the
// message is charged a delivery: library.md says so.)
func TestASessionTheServerEndsIsAnOutage(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+driverPool)
	d := testenv.NewDatabase(t)
	db := openSQL(t, d.URL)
	drv := sqldriver.New(db)
	must(t, messaging.MigrateInbox(context.Background(), drv.DB()))
	ev := messaging.Event[payload]{Exchange: testenv.UniqueName("orders"), Type: eventType}
	queue := testenv.UniqueName("ended")
	sub, err := messaging.NewSubscription(drv, messaging.SubscriptionConfig{Name: queue, URL: testenv.AMQPURL(),
		Topology: messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: queue, Bindings: []messaging.Binding{ev.Binding()}}}}})
	if err != nil {
		t.Fatal(err)
	}
	must(t, messaging.Handle(sub, ev, func(ctx context.Context, tx *sql.Tx, _ payload, _ messaging.Message) error {
		var pid int
		if err := tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			return err
		}
		if err := d.DB.Exec("SELECT pg_terminate_backend(?)", pid).Error; err != nil {
			return fmt.Errorf("test: %w", err)
		}
		// pg_terminate_backend only signals the session: wait until it is gone.
		testenv.Eventually(t, 10*time.Second, func() bool {
			return testenv.Count(t, d.DB, fmt.Sprintf("SELECT count(*) FROM pg_stat_activity WHERE pid = %d", pid)) == 0
		}, "session %d still there", pid)
		_, err := tx.ExecContext(ctx, "SELECT 1")
		return err
	}))
	m, err := ev.Message(payload{OrderID: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := messagingtest.Deliver(context.Background(), sub, m); !messaging.IsUnavailable(err) {
		t.Errorf("the handler's session ended by the server: %v, want the database unavailable", err)
	}
}

// A handler that fails as the database stops answering (a partition, a proxy that holds the
// data) leaves a rollback that the database never answers either: pgx waits as long as its
// connection lives, and the worker, and so the subscription's shutdown, waited with it. The
// rollback is bounded on each driver, database/sql's (whose Rollback takes no context) and
// GORM's among them, and the message's failure reported as the database's.
func TestARollbackTheDatabaseNeverAnswersIsBounded(t *testing.T) {
	t.Parallel()
	t.Run("pgx", func(t *testing.T) {
		t.Parallel()
		testenv.Connections(t, testenv.DefaultConnections+2)
		d := testenv.NewDatabase(t)
		proxy := testenv.Proxy(t, testenv.DatabaseHost(t))
		pool := newPgxPool(t, testenv.URLVia(t, d.URL, proxy.Listen), 2)
		t.Cleanup(pool.Reset) // its connections, held by the proxy, are not waited for
		testSilentRollback(t, proxy, pgxdriver.New(pool), func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SELECT 1")
			return err
		})
	})
	t.Run("sql", func(t *testing.T) {
		t.Parallel()
		testenv.Connections(t, testenv.DefaultConnections+driverPool)
		d := testenv.NewDatabase(t)
		proxy := testenv.Proxy(t, testenv.DatabaseHost(t))
		db := openSQL(t, testenv.URLVia(t, d.URL, proxy.Listen))
		testSilentRollback(t, proxy, sqldriver.New(db), func(ctx context.Context, tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, "SELECT 1")
			return err
		})
	})
	t.Run("gorm", func(t *testing.T) {
		t.Parallel()
		testenv.Connections(t, testenv.DefaultConnections+2)
		d := testenv.NewDatabase(t)
		proxy := testenv.Proxy(t, testenv.DatabaseHost(t))
		drv, err := gormdriver.New(testenv.OpenPool(t, testenv.URLVia(t, d.URL, proxy.Listen), 2))
		if err != nil {
			t.Fatal(err)
		}
		testSilentRollback(t, proxy, drv, func(ctx context.Context, tx *gorm.DB) error {
			return tx.WithContext(ctx).Exec("SELECT 1").Error
		})
	})
}

// testSilentRollback delivers a message whose handler runs statement, silences proxy (the
// database's only way to drv), and fails: its delivery must end within 15 s.
func testSilentRollback[Tx any](t *testing.T, proxy *toxiproxy.Proxy, drv messaging.Driver[Tx], statement func(context.Context, Tx) error) {
	t.Helper()
	must(t, messaging.MigrateInbox(context.Background(), drv.DB()))
	ev := messaging.Event[payload]{Exchange: testenv.UniqueName("orders"), Type: eventType}
	queue := testenv.UniqueName("silent")
	sub, err := messaging.NewSubscription(drv, messaging.SubscriptionConfig{Name: queue, URL: testenv.AMQPURL(),
		Topology: messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: queue, Bindings: []messaging.Binding{ev.Binding()}}}}})
	if err != nil {
		t.Fatal(err)
	}
	must(t, messaging.Handle(sub, ev, func(ctx context.Context, tx Tx, _ payload, _ messaging.Message) error {
		if err := statement(ctx, tx); err != nil {
			return err
		}
		if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"silence","type":"timeout","attributes":{"timeout":0}}`)); err != nil {
			return fmt.Errorf("test: %w", err)
		}
		return errors.New("a call outside the database failed")
	}))
	m, err := ev.Message(payload{OrderID: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	delivered := make(chan error, 1)
	go func() {
		_, err := messagingtest.Deliver(context.Background(), sub, m)
		delivered <- err
	}()
	select {
	case err := <-delivered:
		if !messaging.IsUnavailable(err) {
			t.Errorf("the handler's failure with the database silent: %v, want the database unavailable", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the delivery still waits for its rollback after 15 s")
	}
}

func TestGormDriver(t *testing.T) {
	t.Parallel()
	d := testenv.NewDatabase(t)
	drv := d.Driver(t)
	testDriver(t, d, nil, gormCase(drv, d.DB))
}

// openSQL opens a database/sql pool on url through pgx's stdlib driver.
func openSQL(t *testing.T, url string) *sql.DB { t.Helper(); return openSQLWith(t, "pgx", url) }

// openSQLWith opens a database/sql pool of driverPool connections through the named driver.
func openSQLWith(t *testing.T, driver, url string) *sql.DB {
	t.Helper()
	testenv.Draw(t, driverPool)
	db, err := sql.Open(driver, url)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(driverPool)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// pgxCase is the pgx adapter over pool, as a case of the driver tests.
func pgxCase(pool *pgxpool.Pool) driverCase[pgx.Tx] {
	return driverCase[pgx.Tx]{
		drv:      pgxdriver.New(pool),
		begin:    func(ctx context.Context) (pgx.Tx, error) { return pool.Begin(ctx) },
		commit:   func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) },
		rollback: func(ctx context.Context, tx pgx.Tx) error { return tx.Rollback(ctx) },
		work: func(ctx context.Context, tx pgx.Tx, id uuid.UUID) error {
			_, err := tx.Exec(ctx, "INSERT INTO driver_work (message_id) VALUES ($1)", id)
			return err
		},
		notifies: true,
	}
}

// gormCase is the GORM adapter drv over db, as a case of the driver tests.
func gormCase(drv *gormdriver.Driver, db *gorm.DB) driverCase[*gorm.DB] {
	return driverCase[*gorm.DB]{
		drv: drv,
		begin: func(ctx context.Context) (*gorm.DB, error) {
			tx := db.WithContext(ctx).Begin()
			return tx, tx.Error
		},
		commit:          func(_ context.Context, tx *gorm.DB) error { return tx.Commit().Error },
		rollback:        func(_ context.Context, tx *gorm.DB) error { return tx.Rollback().Error },
		notATransaction: db, // a plain handle: Enqueue on it would commit the messages on their own
		work: func(_ context.Context, tx *gorm.DB, id uuid.UUID) error {
			return tx.Exec("INSERT INTO driver_work (message_id) VALUES (?)", id).Error
		},
		notifies: true,
	}
}

// sqlCase is the database/sql adapter drv over db, as a case of the driver tests.
func sqlCase(drv *sqldriver.Driver, db *sql.DB, notifies bool) driverCase[*sql.Tx] {
	return driverCase[*sql.Tx]{
		drv:      drv,
		begin:    func(ctx context.Context) (*sql.Tx, error) { return db.BeginTx(ctx, nil) },
		commit:   func(_ context.Context, tx *sql.Tx) error { return tx.Commit() },
		rollback: func(_ context.Context, tx *sql.Tx) error { return tx.Rollback() },
		work: func(ctx context.Context, tx *sql.Tx, id uuid.UUID) error {
			_, err := tx.ExecContext(ctx, "INSERT INTO driver_work (message_id) VALUES ($1)", id)
			return err
		},
		notifies: notifies,
	}
}

// hookRun is what an AfterCommit hook saw.
type hookRun struct {
	id      uuid.UUID
	attempt int  // of the handler, from 1
	visible bool // the attempt's row, read from outside its transaction
}

// testDriver runs the conformance test of c on database d; closePool, if not nil, closes the
// driver's pool, which must not wait for a connection the library kept.
func testDriver[Tx any](t *testing.T, d *testenv.Database, closePool func(), c driverCase[Tx]) {
	ctx := context.Background()
	log, logs := testenv.NewLogger(t)
	for range 2 { // the second time, nothing to do
		must(t, messaging.MigrateOutbox(ctx, c.drv.DB()))
		must(t, messaging.MigrateInbox(ctx, c.drv.DB()))
	}
	for _, table := range []string{"outbox_messages", "inbox_messages"} {
		if n := testenv.Count(t, d.DB, "SELECT count(*) FROM pg_tables WHERE tablename = ?", table); n != 1 {
			t.Fatalf("no table %s after the migrations", table)
		}
	}
	must(t, d.DB.Exec("CREATE TABLE driver_work (message_id uuid PRIMARY KEY)").Error)

	exchange, queue := testenv.UniqueName("orders"), testenv.UniqueName("invoicing")
	testenv.CleanupBroker(t, []string{queue, messaging.DeadLetterQueue(queue)}, []string{exchange})
	event := messaging.Event[payload]{Exchange: exchange, Type: eventType}
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: queue, Bindings: []messaging.Binding{event.Binding()}}}}
	message := func(n int) messaging.Message {
		m, err := event.Message(payload{OrderID: uuid.New(), N: n})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	rows := func(id uuid.UUID) int64 {
		return testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE id = ?", id)
	}

	// Enqueue writes in the caller's transaction: gone with its rollback, there with its commit.
	enqueue := func(m messaging.Message, commit bool) {
		t.Helper()
		tx, err := c.begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		must(t, messaging.Enqueue(ctx, c.drv, tx, m))
		if n := rows(m.ID); n != 0 {
			t.Fatalf("the enqueued row is visible outside its transaction before the commit")
		}
		if commit {
			must(t, c.commit(ctx, tx))
		} else {
			must(t, c.rollback(ctx, tx))
		}
	}
	rolledBack, first := message(0), message(1)
	enqueue(rolledBack, false)
	if n := rows(rolledBack.ID); n != 0 {
		t.Fatal("a rolled-back transaction left its outbox row")
	}
	if err := messaging.Enqueue(ctx, c.drv, c.notATransaction, message(-1)); !errors.Is(err, messaging.ErrNotInTransaction) {
		t.Fatalf("Enqueue outside a transaction = %v, want ErrNotInTransaction", err)
	}
	enqueue(first, true)
	if n := rows(first.ID); n != 1 {
		t.Fatal("a committed transaction has no outbox row")
	}

	// The relay on the driver's pool publishes to a real queue. With notifications it waits for
	// them (the poll is an hour away); without, it says it polls, and does.
	pub := messaging.NewPublisher(messaging.PublisherConfig{URL: testenv.AMQPURL(), Topology: topology, Logger: log})
	t.Cleanup(pub.Close)
	poll := time.Hour
	if !c.notifies {
		poll = 200 * time.Millisecond
	}
	relay, err := messaging.NewRelay(messaging.RelayConfig{DB: c.drv.DB(), Sender: pub, Exchange: exchange, PollInterval: poll, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	stopRelay := start(t, relay.Run)
	sent := func(id uuid.UUID) bool {
		return testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE id = ? AND processed_at IS NOT NULL", id) == 1
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return sent(first.ID) }, "the relay did not send the first row")
	if c.notifies {
		testenv.Eventually(t, 5*time.Second, func() bool {
			return testenv.Count(t, d.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND query LIKE 'LISTEN%'", d.Name) == 1
		}, "the relay is not listening")
	} else {
		testenv.Eventually(t, 5*time.Second, func() bool {
			return len(logs.Lines("level=INFO", "cannot receive notifications; the relay polls")) == 1
		}, "the relay did not say that it polls")
	}
	second := message(2)
	enqueue(second, true)
	woken := time.Now()
	testenv.Eventually(t, 5*time.Second, func() bool { return sent(second.ID) }, "the relay did not send a row committed while it waited")
	t.Logf("a row committed while the relay waited was sent %s later (notifications: %v)", time.Since(woken).Round(time.Millisecond), c.notifies)

	// The subscription's handler writes with the driver's own transaction; its hooks run once
	// that committed, and never for an attempt that failed.
	sub, err := messaging.NewSubscription(c.drv, messaging.SubscriptionConfig{
		Name: queue, URL: testenv.AMQPURL(), Topology: topology, Concurrency: 2, Logger: log,
		RetryBackoff: messaging.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	attempts := map[uuid.UUID]int{}
	hooks := make(chan hookRun, 10)
	must(t, messaging.Handle(sub, event, func(ctx context.Context, tx Tx, p payload, msg messaging.Message) error {
		mu.Lock()
		attempts[msg.ID]++
		attempt := attempts[msg.ID]
		mu.Unlock()
		if err := c.work(ctx, tx, msg.ID); err != nil {
			return err
		}
		if err := messaging.AfterCommit(ctx, func() {
			var n int64
			err := d.DB.Raw("SELECT count(*) FROM driver_work WHERE message_id = ?", msg.ID).Scan(&n).Error
			hooks <- hookRun{id: msg.ID, attempt: attempt, visible: err == nil && n == 1}
		}); err != nil {
			return err
		}
		if msg.ID == first.ID && attempt == 1 {
			return fmt.Errorf("the first attempt at message %d fails", p.N)
		}
		return nil
	}))
	stopSub := start(t, sub.Run)
	worked := func() int64 { return testenv.Count(t, d.DB, "SELECT count(*) FROM driver_work") }
	testenv.Eventually(t, 10*time.Second, func() bool { return worked() == 2 }, "the subscription did not handle both messages")

	// A redelivery of the second message is recognised, and skipped.
	if errs := pub.Publish(ctx, []messaging.Message{second}); errs[0] != nil {
		t.Fatal(errs[0])
	}
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(logs.Lines("duplicate message skipped", "consumer="+queue, "message_id="+second.ID.String())) == 1
	}, "the redelivered message was not skipped as a duplicate")
	if n := worked(); n != 2 {
		t.Fatalf("%d rows of work for 2 messages, one of them delivered twice", n)
	}
	if n := len(logs.Lines("duplicate message skipped")); n != 1 {
		t.Fatalf("%d duplicate lines, want 1", n)
	}

	// The operator's functions read and write through the driver's pool: a row the broker
	// refused is listed with its reason, counted in the backlog and made due again.
	refused := message(3)
	refused.RoutingKey = "NobodyListens"
	enqueue(refused, true)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE id = ? AND attempts > 0", refused.ID) == 1
	}, "the relay did not record the broker's refusal")
	failing, err := messaging.FailingOutboxMessages(ctx, c.drv.DB(), 10)
	if err != nil || len(failing) != 1 || failing[0].ID != refused.ID || failing[0].LastError == nil ||
		!strings.Contains(*failing[0].LastError, "unroutable") || failing[0].RoutingKey == nil || *failing[0].RoutingKey != "NobodyListens" {
		t.Fatalf("failing rows = %+v, %v; want the refused one, unroutable", failing, err)
	}
	if stats, err := messaging.ReadOutboxStats(ctx, c.drv.DB()); err != nil || stats.Pending != 1 || stats.MaxAttempts < 1 {
		t.Fatalf("outbox stats = %+v, %v; want the refused row pending", stats, err)
	}
	_, err = messaging.RetryOutboxMessage(ctx, c.drv.DB(), refused.ID)
	must(t, err)
	if _, err := messaging.RetryOutboxMessage(ctx, c.drv.DB(), uuid.New()); !errors.Is(err, messaging.ErrNoUnsentMessage) {
		t.Fatalf("retry of an unknown row = %v, want ErrNoUnsentMessage", err)
	}
	must(t, stopSub())
	must(t, stopRelay())
	// The cleanups take their lock on a connection of the pool: the two rows sent, and the two
	// inbox records, go; the refused row stays. A millisecond's retention, the least the inbox's
	// takes: all but what committed within it.
	for name, cleanup := range map[string]func(context.Context, messaging.DB, time.Duration, messaging.CleanupOptions) (messaging.CleanupResult, error){
		"outbox": messaging.DeleteSentOutboxMessages, "inbox": messaging.DeleteInboxMessages,
	} {
		if res, err := cleanup(ctx, c.drv.DB(), time.Millisecond, messaging.CleanupOptions{}); err != nil || res.Deleted != 2 {
			t.Errorf("%s cleanup = %+v, %v; want 2 rows deleted", name, res, err)
		}
	}
	close(hooks)
	ran := map[uuid.UUID][]hookRun{}
	for h := range hooks {
		ran[h.id] = append(ran[h.id], h)
	}
	for m, wantAttempt := range map[uuid.UUID]int{first.ID: 2, second.ID: 1} {
		if hs := ran[m]; len(hs) != 1 || hs[0].attempt != wantAttempt || !hs[0].visible {
			t.Errorf("message %s: hooks ran %+v; want once, after attempt %d committed, its row visible", m, hs, wantAttempt)
		}
	}

	if closePool != nil {
		closed := make(chan struct{})
		go func() { closePool(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Fatal("closing the driver's pool waits for a connection the library has not given back")
		}
	}
}

// Every transaction a driver opens for the library (a handler's, the pool's, a connection's)
// is READ COMMITTED whatever the database's default: at REPEATABLE READ or SERIALIZABLE the
// inbox's claim fails with a serialization error on a duplicate that a concurrent transaction
// claimed, and a relay's claim on a row another lane marked.
func TestEveryDriverOpensReadCommittedTransactions(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+4*driverPool)
	d := testenv.NewDatabase(t)
	must(t, d.DB.Exec("ALTER DATABASE "+d.Name+" SET default_transaction_isolation = 'serializable'").Error)
	// The setting applies to sessions that start after it: the pools below.
	testenv.Draw(t, driverPool)
	pool := newPgxPool(t, d.URL, driverPool)
	t.Cleanup(pool.Close)
	checkReadCommitted(t, "pgxdriver", pgxdriver.New(pool))
	for _, driver := range []string{"pgx", "postgres"} {
		checkReadCommitted(t, "sqldriver over "+driver, sqldriver.New(openSQLWith(t, driver, d.URL)))
	}
	checkReadCommitted(t, "gormdriver", driverOf(t, testenv.OpenPool(t, d.URL, driverPool)))
}

// checkReadCommitted fails t unless each way drv opens a transaction opens it READ COMMITTED,
// where the pool's sessions default to SERIALIZABLE (without which it shows nothing).
func checkReadCommitted[Tx any](t *testing.T, name string, drv messaging.Driver[Tx]) {
	t.Helper()
	ctx := context.Background()
	isolation := func(ex messaging.Executor) string {
		t.Helper()
		rows, err := ex.Query(ctx, "SHOW transaction_isolation")
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		defer rows.Close()
		var level string
		if !rows.Next() {
			t.Fatalf("%s: SHOW transaction_isolation returned no row: %v", name, rows.Err())
		}
		if err := rows.Scan(&level); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		return level
	}
	if got := isolation(drv.DB()); got != "serializable" {
		t.Fatalf("%s: a session of the pool runs at %q, want the database's default, serializable: the test shows nothing", name, got)
	}
	_, handlerTx, err := drv.Begin(ctx)
	must(t, err)
	poolTx, err := drv.DB().Begin(ctx)
	must(t, err)
	conn, err := drv.DB().Conn(ctx)
	must(t, err)
	defer conn.Close()
	connTx, err := conn.Begin(ctx)
	must(t, err)
	for what, tx := range map[string]messaging.TxExecutor{"Driver.Begin": handlerTx, "DB.Begin": poolTx, "Conn.Begin": connTx} {
		if got := isolation(tx); got != "read committed" {
			t.Errorf("%s: %s opens a transaction at %q, want read committed", name, what, got)
		}
		must(t, tx.Rollback(ctx))
	}
}

// A handler's transaction ends when its context does, whatever the driver: the subscription
// abandons a handler that ignores its context, and a transaction left open held its locks (its
// messages' inbox claims, which their redeliveries wait on) and its connection for as long as
// the handler blocked, to commit its work once it returned. database/sql rolls back by itself
// (and GORM on it); pgx does not, and pgxdriver closes the connection. The pool has the
// connection back, or room for another, before the library's rollback; the commit that comes
// after fails, and nothing is committed.
func TestEveryDriverEndsAHandlersTransactionWhenItsContextEnds(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+4*driverPool)
	d := testenv.NewDatabase(t)
	must(t, d.DB.Exec("CREATE TABLE driver_work (message_id uuid PRIMARY KEY)").Error)
	testenv.Draw(t, driverPool)
	pool := newPgxPool(t, d.URL, driverPool)
	t.Cleanup(pool.Close)
	gormPool := testenv.OpenPool(t, d.URL, driverPool)
	gormSQL, err := gormPool.DB()
	if err != nil {
		t.Fatal(err)
	}
	type driverUnderTest struct {
		begin func(context.Context) (messaging.TxExecutor, error)
		inUse func() int
	}
	drivers := map[string]driverUnderTest{
		"pgxdriver": {func(ctx context.Context) (messaging.TxExecutor, error) {
			_, tx, err := pgxdriver.New(pool).Begin(ctx)
			return tx, err
		}, func() int { return int(pool.Stat().AcquiredConns()) }},
		"gormdriver": {func(ctx context.Context) (messaging.TxExecutor, error) {
			_, tx, err := driverOf(t, gormPool).Begin(ctx)
			return tx, err
		}, func() int { return gormSQL.Stats().InUse }},
	}
	for _, driver := range []string{"pgx", "postgres"} {
		db := openSQLWith(t, driver, d.URL)
		drivers["sqldriver over "+driver] = driverUnderTest{func(ctx context.Context) (messaging.TxExecutor, error) {
			_, tx, err := sqldriver.New(db).Begin(ctx)
			return tx, err
		}, func() int { return db.Stats().InUse }}
	}
	for name, drv := range drivers {
		ctx, cancel := context.WithCancel(context.Background())
		tx, err := drv.begin(ctx)
		must(t, err)
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) }) // before its pool closes, if t fails
		id := uuid.New()
		_, err = tx.Exec(ctx, "INSERT INTO driver_work (message_id) VALUES ($1)", id)
		must(t, err)
		rows, err := tx.Query(ctx, "SELECT pg_backend_pid()")
		must(t, err)
		var pid int
		if !rows.Next() {
			t.Fatalf("%s: no backend pid: %v", name, rows.Err())
		}
		must(t, rows.Scan(&pid))
		rows.Close()
		cancel()
		testenv.Eventually(t, 5*time.Second, func() bool {
			return drv.inUse() == 0 &&
				testenv.Count(t, d.DB, "SELECT count(*) FROM pg_stat_activity WHERE pid = ? AND xact_start IS NOT NULL", pid) == 0
		}, "%s: the transaction stayed open, or its connection out of the pool, after its context ended", name)
		if err := tx.Commit(ctx); err == nil {
			t.Errorf("%s: the commit of a transaction whose context ended succeeded", name)
		}
		if n := testenv.Count(t, d.DB, "SELECT count(*) FROM driver_work WHERE message_id = ?", id); n != 0 {
			t.Errorf("%s: the transaction's row was committed after its context ended", name)
		}
	}
}

// endsAfterOneLook is a context that ends as soon as it has been looked at once: what a
// cancellation between database/sql's look at the context and the driver's looks like.
type endsAfterOneLook struct {
	context.Context
	looked bool
	cancel context.CancelFunc
}

func lookedAtOnce() *endsAfterOneLook {
	ctx, cancel := context.WithCancel(context.Background())
	return &endsAfterOneLook{Context: ctx, cancel: cancel}
}

func (c *endsAfterOneLook) Done() <-chan struct{} {
	done := c.Context.Done()
	if c.looked {
		c.cancel()
	}
	c.looked = true
	return done
}

// A statement of a transaction or of a connection whose context ends just before the driver
// sends it, or while it runs, reports the context's end: pgx's stdlib turns "not sent, the
// context had ended" into driver.ErrBadConn, which database/sql hands back as it is inside a
// transaction, and a caller asking errors.Is(err, context.Canceled) (a cleanup cancelled
// between two batches, a shutdown) would take the cancellation for a broken connection.
func TestSQLDriverReportsAContextThatEndsJustBeforeAStatement(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+3*driverPool)
	d := testenv.NewDatabase(t)
	pool := sqldriver.New(openSQL(t, d.URL)).DB()
	ctx := context.Background()
	// Each statement on a transaction or connection of its own: a statement the context
	// stops while it runs leaves its connection closed. A transaction's statement has its
	// context looked at by database/sql first, a connection's by the driver alone: the context
	// ends right after database/sql's look, or before the call.
	ended := func() context.Context {
		c, cancel := context.WithCancel(ctx)
		cancel()
		return c
	}
	for _, c := range []struct {
		name string
		open func() messaging.Executor
		ctx  func() context.Context
	}{
		{"transaction", func() messaging.Executor {
			tx, err := pool.Begin(ctx)
			must(t, err)
			t.Cleanup(func() { _ = tx.Rollback(ctx) })
			return tx
		}, func() context.Context { return lookedAtOnce() }},
		{"connection", func() messaging.Executor {
			conn, err := pool.Conn(ctx)
			must(t, err)
			t.Cleanup(conn.Close)
			return conn
		}, ended},
	} {
		if _, err := c.open().Exec(c.ctx(), "SELECT 1"); !errors.Is(err, context.Canceled) {
			t.Errorf("Exec on a %s whose context ended just before it: %v, want context.Canceled", c.name, err)
		}
		if rows, err := c.open().Query(c.ctx(), "SELECT 1"); !errors.Is(err, context.Canceled) {
			if err == nil {
				rows.Close()
			}
			t.Errorf("Query on a %s whose context ended just before it: %v, want context.Canceled", c.name, err)
		}
	}
	// lib/pq reports a statement its context stopped while it ran by the server's error alone.
	for _, driver := range []string{"pgx", "postgres"} {
		tx, err := sqldriver.New(openSQLWith(t, driver, d.URL)).DB().Begin(ctx)
		must(t, err)
		stop, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		_, err = tx.Exec(stop, "SELECT pg_sleep(5)")
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("over %s, a statement whose context ended while it ran: %v, want context.DeadlineExceeded", driver, err)
		}
		_ = tx.Rollback(ctx)
	}
}

// database/sql rolls back by itself a transaction whose context ended; the commit that comes
// after says so as the context's end, over pgx and lib/pq alike, and through GORM, not as a
// transaction done already (a log line that reads as a bug of the caller's).
func TestSQLDriverCommitAfterTheContextEndedReportsIt(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+2*driverPool)
	d := testenv.NewDatabase(t)
	gormDriver := driverOf(t, d.DB)
	begins := map[string]func(context.Context) (messaging.TxExecutor, error){
		"pgx":      sqldriver.New(openSQLWith(t, "pgx", d.URL)).DB().Begin,
		"postgres": sqldriver.New(openSQLWith(t, "postgres", d.URL)).DB().Begin,
		"gorm": func(ctx context.Context) (messaging.TxExecutor, error) {
			_, tx, err := gormDriver.Begin(ctx)
			return tx, err
		},
	}
	for driver, begin := range begins {
		ctx, cancel := context.WithCancel(context.Background())
		tx, err := begin(ctx)
		must(t, err)
		cancel()
		testenv.Eventually(t, 5*time.Second, func() bool {
			_, err := tx.Exec(context.Background(), "SELECT 1")
			return errors.Is(err, sql.ErrTxDone)
		}, "over %s, the transaction was not rolled back when its context ended", driver)
		if err := tx.Commit(ctx); !errors.Is(err, context.Canceled) {
			t.Errorf("over %s, the commit of a transaction whose context ended: %v, want context.Canceled", driver, err)
		}
	}
}

// With pgconn.CancelRequestContextWatcherHandler, pgx has the server cancel a statement whose
// context ends, and reports the server's query_canceled (57014) as it is; and a handler's
// transaction whose context ends has its socket closed under whatever runs on it. pgxdriver
// names the context's end whatever pgx said, as sqldriver does for lib/pq, on a statement of the
// pool, a query's rows, and a transaction's statement and commit (slowed by a deferred trigger),
// the server's error still in the chain.
func TestPgxDriverReportsAStatementItsContextCancelledAsTheContextsEnd(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+driverPool)
	d := testenv.NewDatabase(t)
	must(t, d.DB.Exec(`CREATE TABLE slow_commit (id int);
CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow_commit DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION slow_commit()`).Error)
	testenv.Draw(t, 3)
	pool := newPgxPoolWith(t, d.URL, 3, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: c, DeadlineDelay: 5 * time.Second}
		}
	})
	t.Cleanup(pool.Close)
	drv := pgxdriver.New(pool)
	// cancelledWhile returns a context cancelled once the server runs query (its text as
	// pg_stat_activity shows it) begun after this call, or after 10 s: not after a fixed delay,
	// which a slow first connection or the statements before query could outlast under load;
	// nor on an earlier case's statement of the same text that a backend still shows active.
	cancelledWhile := func(query string) context.Context {
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		var since time.Time
		must(t, d.DB.Raw(`SELECT clock_timestamp()`).Scan(&since).Error)
		go func() {
			defer cancel()
			for deadline := time.Now().Add(10 * time.Second); ctx.Err() == nil && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				var running int64
				err := d.DB.Raw(`SELECT count(*) FROM pg_stat_activity
					WHERE datname = current_database() AND state = 'active' AND query = ?
					AND query_start >= ?`, query, since).Scan(&running).Error
				if err == nil && running > 0 {
					return
				}
			}
		}()
		return ctx
	}
	const sleep = "SELECT pg_sleep(3)"
	check := func(what string, err error, serverCancelled bool) {
		t.Helper()
		if !errors.Is(err, context.Canceled) {
			t.Errorf("%s, cancelled: %v, want context.Canceled", what, err)
		}
		var pgErr *pgconn.PgError
		if serverCancelled && (!errors.As(err, &pgErr) || pgErr.Code != "57014") {
			t.Errorf("%s, cancelled: %v, want the server's query_canceled in the chain", what, err)
		}
	}
	_, err := drv.DB().Exec(cancelledWhile(sleep), sleep)
	check("a statement on the pool", err, true)
	rows, err := drv.DB().Query(cancelledWhile(sleep), sleep)
	must(t, err)
	for rows.Next() {
	}
	// Not the server's cancel: the rows' read may begin only after the context ended (a loaded
	// machine), which pgx then reports without asking the server.
	check("a query's rows on the pool", rows.Err(), false)
	rows.Close()
	for _, c := range []struct {
		name  string
		begin func(context.Context) (messaging.TxExecutor, error)
		// abandoned says the transaction's socket is closed when its context ends, not its
		// statement cancelled by the server.
		abandoned bool
	}{
		{"DB.Begin", drv.DB().Begin, false},
		{"Driver.Begin", func(ctx context.Context) (messaging.TxExecutor, error) {
			_, tx, err := drv.Begin(ctx)
			return tx, err
		}, true},
	} {
		ctx := cancelledWhile(sleep)
		tx, err := c.begin(ctx)
		must(t, err)
		_, err = tx.Exec(ctx, sleep)
		check(c.name+": a transaction's statement", err, !c.abandoned)
		_ = tx.Rollback(context.Background())
		ctx = cancelledWhile("commit") // pgx's text for Commit
		tx, err = c.begin(ctx)
		must(t, err)
		_, err = tx.Exec(ctx, "INSERT INTO slow_commit VALUES (1)")
		must(t, err)
		check(c.name+": a transaction's commit", tx.Commit(ctx), !c.abandoned)
		_ = tx.Rollback(context.Background())
	}
}

// newPgxPool opens a pgx pool of size connections on url.
func newPgxPool(t *testing.T, url string, size int32) *pgxpool.Pool {
	t.Helper()
	return newPgxPoolWith(t, url, size, func(*pgxpool.Config) {})
}

// newPgxPoolWith opens a pgx pool of size connections on url, its configuration changed by
// configure.
func newPgxPoolWith(t *testing.T, url string, size int32, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = size
	configure(cfg)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return pool
}
