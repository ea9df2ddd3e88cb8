// Package sqldriver adapts a database/sql pool of a PostgreSQL driver (pgx's stdlib, lib/pq)
// to the messaging library: handlers get the *sql.Tx of their message, and
// messaging.Enqueue writes into the caller's *sql.Tx.
//
// database/sql gives no access to PostgreSQL notifications, so a relay on this driver finds new
// rows by polling (messaging.RelayConfig.PollInterval), unless the adapter is given the
// driver's own way to wait for one (Driver.WithNotifications: pgx's stdlib has it): the relay
// then wakes at each commit of an Enqueue.
package sqldriver

import (
	"context"
	"database/sql"
	"database/sql/driver"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// readCommitted is the isolation of every transaction the library opens, whatever the
// server's or role's default_transaction_isolation says: the inbox's claim relies on it.
var readCommitted = &sql.TxOptions{Isolation: sql.LevelReadCommitted}

// Driver is the database/sql adapter.
type Driver struct {
	db   *sql.DB
	wait WaitFunc
}

// WaitFunc waits on c, which listens to a channel, for a notification, until ctx ends:
// what a PostgreSQL driver offers beyond database/sql (pgx: through c.Raw, the *stdlib.Conn's
// Conn().WaitForNotification).
type WaitFunc func(ctx context.Context, c *sql.Conn) error

// New returns the adapter of db.
func New(db *sql.DB) *Driver { return &Driver{db: db} }

// WithNotifications returns the adapter with a way to receive notifications: a relay on it then
// wakes at each commit of an Enqueue instead of polling.
func (d *Driver) WithNotifications(wait WaitFunc) *Driver { return &Driver{db: d.db, wait: wait} }

// DB returns the pool.
func (d *Driver) DB() messaging.DB { return pool{d.db, d.wait} }

// Executor runs statements in tx.
func (d *Driver) Executor(tx *sql.Tx) (messaging.Executor, error) {
	if tx == nil {
		return nil, messaging.ErrNotInTransaction
	}
	return Executor(tx), nil
}

// Begin opens a READ COMMITTED transaction.
func (d *Driver) Begin(ctx context.Context) (*sql.Tx, messaging.TxExecutor, error) {
	return begin(ctx, d.db.BeginTx)
}

// begin opens a READ COMMITTED transaction under a context of its own, which the library's
// Rollback ends when its own context ends first (see TxWithEnd).
func begin(ctx context.Context, beginTx func(context.Context, *sql.TxOptions) (*sql.Tx, error)) (*sql.Tx, messaging.TxExecutor, error) {
	ctx, end := context.WithCancel(ctx)
	tx, err := beginTx(ctx, readCommitted)
	if err != nil {
		end()
		return nil, nil, err
	}
	return tx, TxWithEnd(tx, end), nil
}

// Queryer is what runs database/sql statements: an *sql.DB, *sql.Conn or *sql.Tx, or a
// wrapper of one (GORM's connection pool).
type Queryer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// Executor adapts q.
func Executor(q Queryer) messaging.Executor { return executor{q} }

type executor struct{ q Queryer }

func (e executor) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	res, err := e.q.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, withEndedContext(ctx, err)
	}
	return res.RowsAffected()
}

func (e executor) Query(ctx context.Context, query string, args ...any) (messaging.Rows, error) {
	r, err := e.q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, withEndedContext(ctx, err)
	}
	return rows{r}, nil
}

// withEndedContext names ctx's end in err, a statement's or a commit's failure, when ctx's end
// caused it: pgx's stdlib reports a statement it did not send because ctx had ended as
// driver.ErrBadConn, lib/pq one it cancelled by the server's query_canceled, and database/sql
// the commit of a transaction it rolled back itself when the context it began under ended as
// sql.ErrTxDone, so errors.Is(err, context.Canceled) would not see the caller's own
// cancellation.
func withEndedContext(ctx context.Context, err error) error {
	return messaging.ContextEnded(ctx, err, driver.ErrBadConn, sql.ErrTxDone)
}

type rows struct{ *sql.Rows }

func (r rows) Close() { _ = r.Rows.Close() }

// Transaction is a transaction of database/sql, or anything that commits and rolls back like
// one (GORM's).
type Transaction interface {
	Queryer
	Commit() error
	Rollback() error
}

// Tx adapts tx. Its Rollback is not bounded by the context it is given: see TxWithEnd.
func Tx(tx Transaction) messaging.TxExecutor { return TxWithEnd(tx, func() {}) }

// TxWithEnd adapts tx, where end cancels the context tx began under. database/sql's Rollback
// takes no context, but pgx's stdlib rolls back under the one its transaction began with: so
// Rollback ends that context if its own ends first, and a rollback the database never answers
// gives up with its connection (lib/pq's rollback waits regardless). Commit and Rollback call
// end once done, which frees the context.
func TxWithEnd(tx Transaction, end context.CancelFunc) messaging.TxExecutor {
	return txExecutor{executor{tx}, tx.Commit, tx.Rollback, end}
}

type txExecutor struct {
	executor
	commit, rollback func() error
	end              context.CancelFunc
}

func (t txExecutor) Commit(ctx context.Context) error {
	defer t.end()
	return withEndedContext(ctx, t.commit())
}

func (t txExecutor) Rollback(ctx context.Context) error {
	defer t.end()
	stop := context.AfterFunc(ctx, t.end)
	defer stop()
	return t.rollback()
}

type pool struct {
	db   *sql.DB
	wait WaitFunc
}

func (p pool) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	return executor{p.db}.Exec(ctx, query, args...)
}

func (p pool) Query(ctx context.Context, query string, args ...any) (messaging.Rows, error) {
	return executor{p.db}.Query(ctx, query, args...)
}

func (p pool) Begin(ctx context.Context) (messaging.TxExecutor, error) {
	_, tx, err := begin(ctx, p.db.BeginTx)
	return tx, err
}

func (p pool) Conn(ctx context.Context) (messaging.Conn, error) {
	c, err := p.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	return conn{executor{c}, c, p.wait}, nil
}

type conn struct {
	executor
	c    *sql.Conn
	wait WaitFunc
}

func (c conn) Begin(ctx context.Context) (messaging.TxExecutor, error) {
	_, tx, err := begin(ctx, c.c.BeginTx)
	return tx, err
}

func (c conn) WaitForNotification(ctx context.Context) error {
	if c.wait == nil {
		return messaging.ErrNoNotifications
	}
	return c.wait(ctx, c.c)
}

func (c conn) Close() { _ = c.c.Close() }

// Discard makes database/sql close the connection instead of pooling it.
func (c conn) Discard() {
	_ = c.c.Raw(func(any) error { return driver.ErrBadConn })
	_ = c.c.Close()
}
