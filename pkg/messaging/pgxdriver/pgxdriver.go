// Package pgxdriver adapts a pgx v5 pool to the messaging library: handlers get the pgx.Tx of
// their message, messaging.Enqueue writes into the caller's pgx.Tx, and a relay on the pool
// wakes at each commit of an Enqueue (LISTEN/NOTIFY) instead of waiting for its next poll.
package pgxdriver

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// readCommitted is the isolation of every transaction the library opens, whatever the
// server's or role's default_transaction_isolation says: the inbox's claim relies on it.
var readCommitted = pgx.TxOptions{IsoLevel: pgx.ReadCommitted}

// Driver is the pgx adapter.
type Driver struct{ pool *pgxpool.Pool }

// New returns the adapter of pool.
func New(pool *pgxpool.Pool) *Driver { return &Driver{pool: pool} }

// DB returns the pool.
func (d *Driver) DB() messaging.DB { return db{d.pool} }

// Executor runs statements in tx.
func (d *Driver) Executor(tx pgx.Tx) (messaging.Executor, error) {
	if tx == nil {
		return nil, messaging.ErrNotInTransaction
	}
	return executor{tx}, nil
}

// Begin opens a READ COMMITTED transaction, which ends when ctx does, as database/sql's do:
// see handlerTx.
func (d *Driver) Begin(ctx context.Context) (pgx.Tx, messaging.TxExecutor, error) {
	c, err := d.pool.Acquire(ctx)
	if err != nil {
		return nil, nil, err
	}
	tx, err := c.BeginTx(ctx, readCommitted)
	if err != nil {
		c.Release()
		return nil, nil, err
	}
	h := &handlerTx{txExecutor: txExecutor{executor{tx}, tx}, c: c, socket: c.Conn().PgConn().Conn()}
	h.stop = context.AfterFunc(ctx, h.abandon)
	return tx, h, nil
}

// handlerTx is a handler's transaction, on a connection of its own. pgx does not end a
// transaction whose context ends: a handler that ignores its context, which the subscription
// gives up, would keep it open, its locks held (its messages' inbox claims among them: their
// redeliveries would wait on them) and its connection out of the pool, for as long as it
// blocks. So once ctx ends, the connection leaves the pool and its socket is closed, which
// ends the transaction on the server; the handler's goroutine, the one that uses the
// connection, finds it closed. Commit and Rollback disarm that first; the connection goes back
// to the pool only after them (not a pgxpool.Tx: a handler's own Commit would put it back,
// for another's transaction to be closed).
type handlerTx struct {
	txExecutor
	c      *pgxpool.Conn
	socket net.Conn
	stop   func() bool

	mu        sync.Mutex
	abandoned bool // the connection left the pool, its socket closed
	released  bool // the connection is back in the pool, or closed
}

func (h *handlerTx) abandon() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.released {
		return
	}
	h.abandoned = true
	h.c.Hijack()
	_ = h.socket.Close()
}

func (h *handlerTx) Commit(ctx context.Context) error {
	h.stop()
	defer h.release(ctx)
	return h.txExecutor.Commit(ctx)
}

func (h *handlerTx) Rollback(ctx context.Context) error {
	h.stop()
	defer h.release(ctx)
	return h.tx.Rollback(ctx)
}

// release returns the connection to the pool, or closes it if it left the pool.
func (h *handlerTx) release(ctx context.Context) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case h.released:
	case h.abandoned:
		_ = h.tx.Conn().Close(ctx)
	default:
		h.c.Release()
	}
	h.released = true
}

// querier is what runs pgx statements: a pool, a connection, a transaction.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

type executor struct{ q querier }

func (e executor) Exec(ctx context.Context, sql string, args ...any) (int64, error) {
	tag, err := e.q.Exec(ctx, sql, args...)
	return tag.RowsAffected(), withEndedContext(ctx, err)
}

func (e executor) Query(ctx context.Context, sql string, args ...any) (messaging.Rows, error) {
	r, err := e.q.Query(ctx, sql, args...)
	if err != nil {
		return nil, withEndedContext(ctx, err)
	}
	return rows{r, ctx}, nil
}

// withEndedContext names ctx's end in err, a statement's or a commit's failure, when ctx's end
// caused it: with pgconn.CancelRequestContextWatcherHandler pgx reports a statement the server
// cancelled for ctx by the server's query_canceled, and a statement on a handler's connection
// whose socket handlerTx closed as a closed connection, so errors.Is(err, context.Canceled)
// would not see the caller's own cancellation.
func withEndedContext(ctx context.Context, err error) error {
	return messaging.ContextEnded(ctx, err, net.ErrClosed, pgconn.ErrConnClosed)
}

// rows are a query's results. pgx reads them, and learns that the statement failed, after
// Query has returned: Err names the end of the query's context as Query would.
type rows struct {
	pgx.Rows
	ctx context.Context
}

func (r rows) Err() error { return withEndedContext(r.ctx, r.Rows.Err()) }

type txExecutor struct {
	executor
	tx pgx.Tx
}

func (t txExecutor) Commit(ctx context.Context) error {
	return withEndedContext(ctx, t.tx.Commit(ctx))
}

func (t txExecutor) Rollback(ctx context.Context) error { return t.tx.Rollback(ctx) }

type db struct{ pool *pgxpool.Pool }

func (d db) Exec(ctx context.Context, sql string, args ...any) (int64, error) {
	return executor{d.pool}.Exec(ctx, sql, args...)
}

func (d db) Query(ctx context.Context, sql string, args ...any) (messaging.Rows, error) {
	return executor{d.pool}.Query(ctx, sql, args...)
}

func (d db) Begin(ctx context.Context) (messaging.TxExecutor, error) {
	tx, err := d.pool.BeginTx(ctx, readCommitted)
	if err != nil {
		return nil, err
	}
	return txExecutor{executor{tx}, tx}, nil
}

func (d db) Conn(ctx context.Context) (messaging.Conn, error) {
	c, err := d.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return &conn{executor{c}, c}, nil
}

type conn struct {
	executor
	c *pgxpool.Conn
}

func (c *conn) Begin(ctx context.Context) (messaging.TxExecutor, error) {
	tx, err := c.c.BeginTx(ctx, readCommitted)
	if err != nil {
		return nil, err
	}
	return txExecutor{executor{tx}, tx}, nil
}

func (c *conn) WaitForNotification(ctx context.Context) error {
	_, err := c.c.Conn().WaitForNotification(ctx)
	return err
}

func (c *conn) Close() { c.c.Release() }

// closeTimeout bounds the goodbye to a connection that is discarded.
const closeTimeout = time.Second

// Discard takes the connection out of the pool and closes it.
func (c *conn) Discard() {
	pc := c.c.Hijack()
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	_ = pc.Close(ctx)
}
