package messaging

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// The database seam. The library runs each of its statements through these few interfaces,
// so it works in the transactions of whatever PostgreSQL driver a service already uses. There
// are adapters for database/sql (package sqldriver, in this module), pgx v5 (module pgxdriver)
// and GORM (module gormdriver); another driver needs an adapter of its own, and these
// interfaces are what it implements. Statements use PostgreSQL's $1, $2 … placeholders.
//
// What the library expects of an adapter's errors and calls:
//   - A server's error keeps its SQLSTATE reachable by errors.As as a value with a
//     SQLState() string method (pgconn.PgError and pq.Error have one): the library tells by it
//     a database that cannot take writes now (a lost connection, a failover, a lock timeout)
//     from a value the database refuses.
//   - An error of a statement or a commit that a caller's context caused satisfies
//     errors.Is(err, ctx.Err()), whatever the driver said (a statement not sent, one the
//     server cancelled, a transaction rolled back).
//   - Rollback after a failed Commit, or after a rollback, is harmless; the library calls it
//     on every path out of a transaction.
//   - DB is used by many goroutines at once (relay lanes, consumer workers).

// Driver adapts one PostgreSQL driver. Tx is its transaction type: what [Enqueue] writes into
// and what handlers receive (pgx.Tx, *sql.Tx, *gorm.DB).
type Driver[Tx any] interface {
	// DB is the pool the relay, the subscriptions and the maintenance jobs take their
	// connections and transactions from.
	DB() DB
	// Executor runs statements in tx, the caller's open transaction. It fails with
	// [ErrNotInTransaction] when tx is not one.
	Executor(tx Tx) (Executor, error)
	// Begin opens a READ COMMITTED transaction on the pool for ctx, and returns it as the
	// driver's own type, for a handler, and as the library's, to commit or roll back. The
	// transaction ends, rolled back, once ctx ends (as database/sql's do), even while nothing
	// runs on it: a handler the subscription abandoned must neither hold its locks nor commit
	// when it returns.
	Begin(ctx context.Context) (Tx, TxExecutor, error)
}

// Executor runs statements: on a pool, a connection or a transaction.
type Executor interface {
	// Exec runs a statement and returns how many rows it affected. It must also take a
	// statement that returns rows, and discard them: the outbox's insert ends in a SELECT of
	// pg_notify.
	Exec(ctx context.Context, sql string, args ...any) (rowsAffected int64, err error)
	// Query runs a statement that returns rows.
	Query(ctx context.Context, sql string, args ...any) (Rows, error)
}

// Rows are a query's results, read with Next and Scan, then closed. Once Next has returned
// false, Err reports the query's failure, one the server sent after rows included.
type Rows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
	Close()
}

// TxExecutor is an Executor in a transaction.
type TxExecutor interface {
	Executor
	Commit(ctx context.Context) error
	Rollback(ctx context.Context) error
}

// DB is a pool of connections.
type DB interface {
	Executor
	// Begin opens a READ COMMITTED transaction.
	Begin(ctx context.Context) (TxExecutor, error)
	// Conn takes one connection out of the pool for a session of its own (an advisory lock,
	// LISTEN), until Close or Discard.
	Conn(ctx context.Context) (Conn, error)
}

// Conn is one connection taken out of a pool.
type Conn interface {
	Executor
	// Begin opens a READ COMMITTED transaction on this connection.
	Begin(ctx context.Context) (TxExecutor, error)
	// WaitForNotification waits for a notification on a channel this connection listens to,
	// until ctx ends; one that came before the call counts (it returns at once). It returns an
	// error wrapping [ErrNoNotifications] if the driver cannot receive them.
	WaitForNotification(ctx context.Context) error
	// Close returns the connection to its pool.
	Close()
	// Discard closes the connection for good: a session whose state is unknown (a lock that
	// could not be released) must not go back to the pool.
	Discard()
}

// ErrNoNotifications is returned by [Conn.WaitForNotification] of a driver that cannot receive
// PostgreSQL notifications; a relay on it polls instead.
var ErrNoNotifications = errors.New("the database driver cannot receive notifications")

// rollbackWait bounds a rollback, which runs whether or not its caller's context has ended (the
// work failed, timed out, or was cut off at shutdown): a database that stops answering would
// otherwise hold it, and its worker, for as long as the connection lives (pgx sets no read
// deadline of its own); past it, pgx gives the connection up. database/sql's Rollback takes no
// context: its adapter ends the context the transaction began under instead, which pgx's
// stdlib rolls back under (lib/pq's rollback is not bounded).
const rollbackWait = 2 * time.Second

// rollback rolls tx back, within rollbackWait even after ctx has ended.
func rollback(ctx context.Context, tx TxExecutor) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackWait)
	defer cancel()
	_ = tx.Rollback(ctx)
}

// queryCanceled is the SQLSTATE of a statement the server cancelled: how a driver that cancels
// a running statement when its context ends (lib/pq, pgx with
// pgconn.CancelRequestContextWatcherHandler) reports it.
const queryCanceled = "57014"

// ContextEnded keeps an adapter to the contract above on a context's end: it names ctx's end
// in err, a statement's or a commit's failure, when ctx has ended and err is the server's
// query_canceled or one of causes, the driver's own ways of reporting that end (a closed
// connection, say); err stays in the chain, for errors.Is and errors.As. Other errors (a
// constraint's) are left as they are, even after ctx ended. Exported for the adapters of other
// modules, pgxdriver's and any of one's own.
func ContextEnded(ctx context.Context, err error, causes ...error) error {
	cause := ctx.Err()
	if err == nil || cause == nil || errors.Is(err, cause) {
		return err
	}
	var coded interface{ SQLState() string }
	if (errors.As(err, &coded) && coded.SQLState() == queryCanceled) ||
		slices.ContainsFunc(causes, func(c error) bool { return errors.Is(err, c) }) {
		return fmt.Errorf("%w: %w", cause, err)
	}
	return err
}
