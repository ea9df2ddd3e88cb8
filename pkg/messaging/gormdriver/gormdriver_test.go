package gormdriver_test

import (
	"context"
	"errors"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/testhook"
)

// With PrepareStmt, GORM's transaction is a *gorm.PreparedStmtTX, which prepares each statement
// before it runs it, on the transaction's connection: Enqueue runs in it as in a plain
// transaction. One message commits with the caller's row; so do messages of several inserts,
// behind the savepoint; and an id stored already, in the second insert, rolls the transaction
// back to the savepoint (its ROLLBACK TO prepared in a transaction the insert aborted) and the
// caller's row still commits, without the messages. A plain handle is refused still.
func TestEnqueueWithPreparedStatements(t *testing.T) {
	t.Parallel()
	db := newDatabase(t)
	drv, err := gormdriver.New(db)
	must(t, err)
	ctx := context.Background()
	must(t, messaging.MigrateOutbox(ctx, drv.DB()))
	must(t, db.Exec("CREATE TABLE orders (id uuid PRIMARY KEY)").Error)

	// enqueue writes msgs, and an order of the first one's id, in one transaction.
	enqueue := func(ctx context.Context, msgs ...messaging.Message) (enqueued error) {
		t.Helper()
		err := db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
			if _, ok := tx.Statement.ConnPool.(*gorm.PreparedStmtTX); !ok {
				t.Fatalf("GORM's transaction is a %T, want a *gorm.PreparedStmtTX", tx.Statement.ConnPool)
			}
			enqueued = messaging.Enqueue(ctx, drv, tx, msgs...)
			return tx.Exec("INSERT INTO orders (id) VALUES (?)", msgs[0].ID).Error
		})
		if err != nil {
			t.Fatalf("the transaction after an Enqueue that returned %v: %v", enqueued, err)
		}
		return enqueued
	}
	count := func(query string, args ...any) int64 {
		t.Helper()
		var n int64
		must(t, db.Raw(query, args...).Scan(&n).Error)
		return n
	}
	stored := func(msgs []messaging.Message) int64 {
		t.Helper()
		ids := make([]uuid.UUID, len(msgs))
		for i, m := range msgs {
			ids[i] = m.ID
		}
		return count("SELECT count(*) FROM outbox_messages WHERE id IN ?", ids)
	}

	one := messages(t, 1, 0)
	must(t, enqueue(ctx, one...))
	if n := stored(one); n != 1 {
		t.Fatalf("one message enqueued: %d stored, want 1", n)
	}

	// Under a bound of 8 KiB, 30 messages of 1 KiB go in 5 inserts or so.
	split := testhook.WithEnqueueBatchBytes(ctx, 8<<10)
	first := messages(t, 30, 1<<10)
	must(t, enqueue(split, first...))
	if n := stored(first); n != int64(len(first)) {
		t.Fatalf("%d messages enqueued in several inserts: %d stored", len(first), n)
	}
	again := messages(t, 30, 1<<10)
	again[20] = first[20] // past the first insert
	err = enqueue(split, again...)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" || !strings.Contains(err.Error(), "insert messages ") || strings.Contains(err.Error(), "messages 0 to") {
		t.Fatalf("Enqueue of an id stored already, past the first insert = %v, want the unique violation of an insert after the first", err)
	}
	if n := stored(again); n != 1 {
		t.Errorf("%d messages of the failed Enqueue stored, want none (and the one stored before)", n-1)
	}
	for _, m := range []messaging.Message{one[0], first[0], again[0]} {
		if n := count("SELECT count(*) FROM orders WHERE id = ?", m.ID); n != 1 {
			t.Errorf("the order of the transaction of message %s committed %d times, want once", m.ID, n)
		}
	}

	if err := messaging.Enqueue(ctx, drv, db, messages(t, 1, 0)...); !errors.Is(err, messaging.ErrNotInTransaction) {
		t.Errorf("Enqueue on a plain handle = %v, want ErrNotInTransaction", err)
	}
}

// messages returns n new messages, each with a payload of at least filler bytes.
func messages(t *testing.T, n, filler int) []messaging.Message {
	t.Helper()
	msgs := make([]messaging.Message, n)
	for i := range msgs {
		m, err := messaging.NewMessage("OrderPlaced", map[string]any{"n": i, "filler": strings.Repeat("x", filler)})
		must(t, err)
		msgs[i] = m
	}
	return msgs
}

// newDatabase creates a database on the server of TEST_DATABASE_URL for t, dropped when t ends,
// and opens it through GORM with prepared statements, on a pool of two connections.
func newDatabase(t *testing.T) *gorm.DB {
	t.Helper()
	admin := os.Getenv("TEST_DATABASE_URL")
	if admin == "" {
		admin = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	name := "test_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	adminExec(t, admin, "CREATE DATABASE "+name)
	t.Cleanup(func() { adminExec(t, admin, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)") })
	u, err := url.Parse(admin)
	must(t, err)
	u.Path = "/" + name
	db, err := gorm.Open(postgres.Open(u.String()), &gorm.Config{PrepareStmt: true, Logger: logger.Discard})
	must(t, err)
	sqlDB, err := db.DB()
	must(t, err)
	sqlDB.SetMaxOpenConns(2)
	t.Cleanup(func() { _ = sqlDB.Close() })
	return db
}

// adminExec runs statement on the server of the administrative URL admin.
func adminExec(t *testing.T, admin, statement string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, admin)
	if err != nil {
		t.Fatalf("connect to PostgreSQL at TEST_DATABASE_URL: %v", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, statement); err != nil {
		t.Fatalf("%s: %v", statement, err)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
