// Package pgxdriver adapts a pgx v5 pool to the messaging library: handlers get the pgx.Tx of
// their message, messaging.Enqueue writes into the caller's pgx.Tx, and a relay on the pool
// wakes at each commit of an Enqueue (LISTEN/NOTIFY) instead of waiting for its next poll.
package pgxdriver

import (
	"context"
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

// Begin opens a READ COMMITTED transaction.
func (d *Driver) Begin(ctx context.Context) (pgx.Tx, messaging.TxExecutor, error) {
	tx, err := d.pool.BeginTx(ctx, readCommitted)
	if err != nil {
		return nil, nil, err
	}
	return tx, txExecutor{executor{tx}, tx}, nil
}

// querier is what runs pgx statements: a pool, a connection, a transaction.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

type executor struct{ q querier }

func (e executor) Exec(ctx context.Context, sql string, args ...any) (int64, error) {
	tag, err := e.q.Exec(ctx, sql, args...)
	return tag.RowsAffected(), err
}

func (e executor) Query(ctx context.Context, sql string, args ...any) (messaging.Rows, error) {
	r, err := e.q.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return r, nil
}

type txExecutor struct {
	executor
	tx pgx.Tx
}

func (t txExecutor) Commit(ctx context.Context) error   { return t.tx.Commit(ctx) }
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
