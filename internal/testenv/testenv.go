// Package testenv gives each test its own PostgreSQL database, its own RabbitMQ names and its
// own network faults, on the shared local servers, so tests run in parallel and leave nothing
// behind.
package testenv

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/Shopify/toxiproxy/v2/collectors"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/rs/zerolog"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
)

// DatabaseURL is the administrative PostgreSQL URL tests create their databases with.
func DatabaseURL() string {
	return envOr("TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
}

// AMQPURL is the RabbitMQ URL tests use.
func AMQPURL() string { return envOr("TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/") }

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// HostInQuery is rawURL, a PostgreSQL URL, with its host and port moved into the host= and
// port= parameters, as a Unix socket's directory is given (postgres:///db?host=/run/postgresql).
func HostInQuery(t testing.TB, rawURL string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("host", u.Hostname())
	if u.Port() != "" {
		q.Set("port", u.Port())
	}
	u.Host, u.RawQuery = "", q.Encode()
	return u.String()
}

// UniqueName returns prefix plus a short random suffix, valid as a database, queue or exchange name.
func UniqueName(prefix string) string {
	return prefix + "_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
}

// Database is a fresh, empty PostgreSQL database that is dropped when the test ends.
type Database struct {
	Name string
	URL  string
	DB   *gorm.DB
}

// NewDatabase creates a database for t, with a handle on a pool of 10 connections.
func NewDatabase(t testing.TB) *Database {
	t.Helper()
	return NewDatabaseWithPool(t, poolSize)
}

// NewDatabaseWithPool creates a database for t, with a handle on a pool of pool connections.
// It draws them, and one for creating and dropping the database, from t's reservation.
func NewDatabaseWithPool(t testing.TB, pool int) *Database {
	t.Helper()
	Draw(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := UniqueName("test")
	admin, err := pgx.Connect(ctx, DatabaseURL())
	if err != nil {
		t.Fatalf("connect to PostgreSQL at TEST_DATABASE_URL: %v", err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("create database %s: %v", name, err)
	}
	u, err := url.Parse(DatabaseURL())
	if err != nil {
		t.Fatalf("parse TEST_DATABASE_URL: %v", err)
	}
	u.Path = "/" + name
	d := &Database{Name: name, URL: u.String()}
	// Dropped after the pool below is closed: cleanups run last-registered first.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin, err := pgx.Connect(ctx, DatabaseURL())
		if err != nil {
			t.Errorf("drop database %s: %v", name, err)
			return
		}
		defer admin.Close(ctx)
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	d.DB = OpenPool(t, d.URL, pool)
	return d
}

// Migrate applies migrations to the database, in order: a service's (platform.Migrations),
// or the library's (platform.Library(messaging.MigrateOutbox)).
func (d *Database) Migrate(t testing.TB, migrations ...func(context.Context, *slog.Logger, *gorm.DB) error) {
	t.Helper()
	log, _ := NewLogger(t)
	for _, m := range migrations {
		if err := m(context.Background(), log, d.DB); err != nil {
			t.Fatalf("migrate %s: %v", d.Name, err)
		}
	}
}

// MigrateLibrary applies the messaging library's migrations: outbox_messages and
// inbox_messages.
func (d *Database) MigrateLibrary(t testing.TB) {
	t.Helper()
	for _, m := range []func(context.Context, messaging.DB) error{messaging.MigrateOutbox, messaging.MigrateInbox} {
		if err := m(context.Background(), d.Driver(t).DB()); err != nil {
			t.Fatalf("migrate %s: %v", d.Name, err)
		}
	}
}

// Driver is the messaging library's adapter of the database's GORM handle.
func (d *Database) Driver(t testing.TB) *gormdriver.Driver {
	t.Helper()
	drv, err := gormdriver.New(d.DB)
	if err != nil {
		t.Fatal(err)
	}
	return drv
}

// OpenPool opens a quiet GORM handle on url with at most size connections, drawn from t's
// reservation, and closes it when t ends.
func OpenPool(t testing.TB, url string, size int) *gorm.DB {
	t.Helper()
	Draw(t, size)
	db, err := OpenGORM(url, size)
	if err != nil {
		t.Fatalf("open pool: %v", err)
	}
	t.Cleanup(func() {
		if sqlDB, err := db.DB(); err == nil {
			_ = sqlDB.Close()
		}
	})
	return db
}

// OpenGORM opens a quiet GORM handle on url with at most size connections, for code that has
// no test to draw them from: a test's child process (its parent draws them), an example
// (after Reserve).
func OpenGORM(url string, size int) (*gorm.DB, error) {
	// QueryFields as the services' handle has it (platform.OpenDB), so that their code is tested
	// reading as it reads there.
	db, err := gorm.Open(postgres.Open(url), &gorm.Config{Logger: logger.Discard, QueryFields: true})
	if err != nil {
		return nil, err
	}
	sqlDB, err := db.DB()
	if err != nil {
		return nil, err
	}
	sqlDB.SetMaxOpenConns(size)
	return db, nil
}

// Count returns the result of a SELECT count(*) … query.
func Count(t testing.TB, db *gorm.DB, query string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := db.Raw(query, args...).Scan(&n).Error; err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// UUIDv7SQL is a SQL expression for a UUIDv7 whose timestamp is the timestamptz expression ts
// and whose other bits are the bigint expression n (distinct per row): rows made by one
// INSERT … SELECT … generate_series get ids ordered by time, as a producer's would be.
func UUIDv7SQL(ts, n string) string {
	return fmt.Sprintf(`(lpad(to_hex(floor(extract(epoch FROM %s) * 1000)::bigint), 12, '0') || '70008' || lpad(to_hex(%s), 15, '0'))::uuid`, ts, n)
}

// Eventually polls cond every 20 ms until it holds, failing t after timeout.
func Eventually(t testing.TB, timeout time.Duration, cond func() bool, format string, args ...any) {
	t.Helper()
	EventuallyEvery(t, 20*time.Millisecond, timeout, cond, format, args...)
}

// EventuallyEvery is Eventually polling every interval: for a cond whose cost would take
// from what the test is waiting for.
func EventuallyEvery(t testing.TB, interval, timeout time.Duration, cond func() bool, format string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %s: "+format, append([]any{timeout}, args...)...)
		}
		time.Sleep(interval)
	}
}

// Logs captures a test's slog output so tests can assert log lines; it is printed when the
// test fails.
type Logs struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// NewLogger returns a text logger at debug level writing into the returned Logs.
func NewLogger(t testing.TB) (*slog.Logger, *Logs) {
	l := &Logs{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("logs:\n%s", l.String())
		}
	})
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug})), l
}

// Write implements io.Writer for the slog handler.
func (l *Logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// String returns everything logged so far.
func (l *Logs) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// Lines returns the log lines that contain every one of parts.
func (l *Logs) Lines(parts ...string) []string {
	var out []string
	for line := range strings.SplitSeq(l.String(), "\n") {
		if line == "" {
			continue
		}
		match := true
		for _, p := range parts {
			if !strings.Contains(line, p) {
				match = false
				break
			}
		}
		if match {
			out = append(out, line)
		}
	}
	return out
}

// Proxy starts an in-process toxiproxy between the code under test and upstream
// ("host:port"). Stop it to cut every connection; add toxics for latency or resets.
func Proxy(t testing.TB, upstream string) *toxiproxy.Proxy {
	t.Helper()
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	srv.Metrics.ProxyMetrics = collectors.NewProxyMetricCollectors()
	p := toxiproxy.NewProxy(srv, UniqueName("proxy"), "127.0.0.1:0", upstream)
	if err := p.Start(); err != nil {
		t.Fatalf("start proxy to %s: %v", upstream, err)
	}
	t.Cleanup(p.Stop)
	return p
}

// AMQPURLVia returns AMQPURL with its host and port replaced by addr.
func AMQPURLVia(t testing.TB, addr string) string {
	t.Helper()
	return URLVia(t, AMQPURL(), addr)
}

// AMQPHost returns the host:port of AMQPURL.
func AMQPHost(t testing.TB) string {
	t.Helper()
	return parseURL(t, AMQPURL()).Host
}

// DatabaseHost returns the host:port of DatabaseURL, the port 5432 unless it names one; it
// fails a test whose database is not reached over TCP.
func DatabaseHost(t testing.TB) string {
	t.Helper()
	u := parseURL(t, DatabaseURL())
	if u.Hostname() == "" || u.Query().Has("host") {
		t.Fatalf("TEST_DATABASE_URL %s names no TCP host to proxy", u.Redacted())
	}
	if u.Port() == "" {
		return net.JoinHostPort(u.Hostname(), "5432")
	}
	return u.Host
}

// URLVia returns rawURL with its host and port replaced by addr.
func URLVia(t testing.TB, rawURL, addr string) string {
	t.Helper()
	u := parseURL(t, rawURL)
	u.Host = addr
	return u.String()
}

func parseURL(t testing.TB, rawURL string) *url.URL {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatalf("parse a test server's URL: %v", err)
	}
	return u
}

// Connection opens a plain AMQP connection for the test's own declarations, closed when the
// test ends.
func Connection(t testing.TB) *amqp.Connection {
	t.Helper()
	conn, err := amqp.Dial(AMQPURL())
	if err != nil {
		t.Fatalf("connect to RabbitMQ at TEST_AMQP_URL: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// Channel opens a plain AMQP channel for the test's own declarations and inspections.
func Channel(t testing.TB) *amqp.Channel {
	t.Helper()
	ch, err := Connection(t).Channel()
	if err != nil {
		t.Fatalf("open channel: %v", err)
	}
	return ch
}

// CleanupBroker deletes the given queues and exchanges when the test ends.
func CleanupBroker(t testing.TB, queues, exchanges []string) {
	t.Cleanup(func() {
		conn, err := amqp.Dial(AMQPURL())
		if err != nil {
			t.Errorf("cleanup broker: %v", err)
			return
		}
		defer conn.Close()
		for _, q := range queues {
			if ch, err := conn.Channel(); err == nil {
				_, _ = ch.QueueDelete(q, false, false, false)
				_ = ch.Close()
			}
		}
		for _, x := range exchanges {
			if ch, err := conn.Channel(); err == nil {
				_ = ch.ExchangeDelete(x, false, false)
				_ = ch.Close()
			}
		}
	})
}

// Drain consumes every message now on queue, or arriving within idle of the last one, and
// returns them. Use it to count what reached a queue.
func Drain(t testing.TB, ch *amqp.Channel, queue string, idle time.Duration) []amqp.Delivery {
	t.Helper()
	var out []amqp.Delivery
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			t.Fatalf("get from %s: %v", queue, err)
		}
		if ok {
			out = append(out, d)
			continue
		}
		// Empty right now; wait a little for stragglers.
		deadline := time.Now().Add(idle)
		for !ok && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
			d, ok, err = ch.Get(queue, true)
			if err != nil {
				t.Fatalf("get from %s: %v", queue, err)
			}
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

// QueueDepth returns how many ready messages queue holds.
func QueueDepth(t testing.TB, ch *amqp.Channel, queue string) int {
	t.Helper()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		t.Fatalf("inspect queue %s: %v", queue, err)
	}
	return q.Messages
}

// CloseConnectionsNamed closes, from the broker's side, every connection whose client-given
// name is name.
func CloseConnectionsNamed(t testing.TB, name string) int {
	t.Helper()
	out := RabbitMQCtl(t, "list_connections", "--silent", "pid", "client_properties")
	n := 0
	for line := range strings.SplitSeq(out, "\n") {
		if !strings.Contains(line, fmt.Sprintf(`{"connection_name","%s"}`, name)) {
			continue
		}
		pid := strings.Fields(line)[0]
		RabbitMQCtl(t, "close_connection", pid, "closed by test")
		n++
	}
	return n
}

// HoldAt makes every later row event of db that when names ("BEFORE INSERT ON outbox_messages")
// wait, inside its statement and its transaction, until the returned release is called (it is
// also called at cleanup): a test's way to hold a transaction at one point while another runs
// against it. The gate is an advisory lock, held on a connection of its own, that a trigger
// waits for. Its key is random, so that two gates of one database do not meet (an advisory
// lock belongs to its database: other tests' databases cannot meet it).
func HoldAt(t *testing.T, db *gorm.DB, when string) (release func()) {
	t.Helper()
	ctx := context.Background()
	sqlDB, err := db.DB()
	if err != nil {
		t.Fatal(err)
	}
	gate, err := sqlDB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	key := rand.Int64N(1 << 62)
	if _, err := gate.ExecContext(ctx, "SELECT pg_advisory_lock($1)", key); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			if _, err := gate.ExecContext(ctx, "SELECT pg_advisory_unlock($1)", key); err != nil {
				t.Error(err)
			}
			_ = gate.Close()
		})
	}
	t.Cleanup(release)
	name := fmt.Sprintf("wait_at_gate_%d", key)
	for _, stmt := range []string{
		fmt.Sprintf(`CREATE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_advisory_lock_shared(%d);
	PERFORM pg_advisory_unlock_shared(%d);
	RETURN NEW;
END $$`, name, key, key),
		fmt.Sprintf("CREATE TRIGGER %s %s FOR EACH ROW EXECUTE FUNCTION %s()", name, when, name),
	} {
		if err := db.Exec(stmt).Error; err != nil {
			t.Fatal(err)
		}
	}
	return release
}
