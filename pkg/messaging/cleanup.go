package messaging

import (
	"context"
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// DefaultCleanupBatchSize is how many rows one DELETE of a cleanup removes unless
// [CleanupOptions] says otherwise: tens of milliseconds of work on two cores, so each batch's
// transaction, its locks and its WAL stay small.
const DefaultCleanupBatchSize = 10_000

// CleanupOptions tune [DeleteSentOutboxMessages] and [DeleteInboxMessages]. The zero value is
// the default.
type CleanupOptions struct {
	// BatchSize is the most rows one DELETE removes; each DELETE is its own transaction.
	// Default DefaultCleanupBatchSize.
	BatchSize int
	// Metrics counts the deleted rows in outbox_cleanup_deleted_total; nil counts nothing.
	Metrics *Metrics
}

// CleanupResult is what one cleanup run did.
type CleanupResult struct {
	Deleted int64 // rows deleted
	Batches int   // DELETE statements run
	// Skipped is set when another runner (another replica) held the table's cleanup lock: this
	// run did nothing and leaves the work to that one.
	Skipped bool
}

// Classes of the session-level advisory locks that let one runner at a time clean a table, in
// whichever replica: a lock's key is its class in the high 32 bits, the hash of the tables'
// schema (current_schema(), where the migrations create them) in the low ones (see
// cleanupLockKey). One per table and schema, so the outbox's and the inbox's cleanups don't
// keep each other out, nor those of services that each have their schema in one database
// (advisory locks are the database's). Arbitrary values ("outb", "inbo" in ASCII), unlike
// goose's lock key; every copy of this package must use the same ones.
const (
	outboxCleanupLockClass int32 = 0x6f757462
	inboxCleanupLockClass  int32 = 0x696e626f
)

// cleanupLockKey is the SQL of a cleanup lock's key, from its class, $1. No schema (a
// search_path naming none that exists) hashes as an empty name: that cleanup fails at its
// DELETE, which finds no table, saying so. Two schemas whose hashes collide share a lock:
// each skips a turn while the other runs.
const cleanupLockKey = `(CAST($1 AS bigint) << 32) | (CAST(hashtext(coalesce(current_schema(), '')) AS bigint) & 4294967295)`

// DeleteSentOutboxMessages deletes the rows sent more than olderThan ago, in batches of
// [CleanupOptions.BatchSize] rows, each its own transaction, until none is left, and says how
// many. Unsent rows are never deleted, however old. Only one runner at a time cleans a
// schema's outbox: a call that finds another one running returns at once, Skipped.
//
// A cancelled ctx stops it between batches, or interrupts the current batch's DELETE, which
// then deletes nothing. A batch whose DELETE is done commits all the same, given up to 2 s
// past ctx's end, so that a batch done is not reported failed; past them its commit is
// abandoned, and the error says the commit failed although its rows may have been deleted (the
// next run deletes any left). Against a database that stops answering, the rollback and the
// release of the cleanup's lock then take up to 2 s and 5 s more. The result counts the
// batches committed before; with an error wrapping [ErrLockNotReleased], all of the run's.
//
// It finds the rows through the primary key, by the time in their UUIDv7 ids ([Enqueue]
// refuses any other version): those made before the cutoff, then those made more than
// [farAhead] after the database's clock (a business time made into an id, a clock that was
// years out), which would otherwise wait for that time. A row whose id came from a clock a
// little ahead of the database's is found at a later run.
func DeleteSentOutboxMessages(ctx context.Context, db DB, olderThan time.Duration, opts CleanupOptions) (CleanupResult, error) {
	var past, ahead uuid.UUID // where each walk is: from the nil UUID, and from farAhead
	upToCutoff := func(ctx context.Context, tx Executor, cutoff time.Time, limit int) (int64, int64, error) {
		return deleteSentBatch(ctx, tx, &past, uuidV7Bound(cutoff), cutoff, limit)
	}
	farAheadOfNow := func(ctx context.Context, tx Executor, cutoff time.Time, limit int) (int64, int64, error) {
		if ahead == (uuid.UUID{}) {
			ahead = uuidV7Bound(cutoff.Add(olderThan + farAhead)) // the cutoff is now - olderThan
		}
		return deleteSentBatch(ctx, tx, &ahead, uuid.Max, cutoff, limit)
	}
	return cleanUp(ctx, db, "outbox_messages", outboxCleanupLockClass, olderThan, opts, upToCutoff, farAheadOfNow)
}

// farAhead is how far past the database's clock the time in an outbox id must be for the
// cleanup to take its row by processed_at alone: beyond any clocks that merely disagree.
const farAhead = time.Hour

// deleteSentBatch deletes, in tx, the next batch of rows sent before cutoff whose ids are
// between *after and below, and moves *after to the last id it took.
func deleteSentBatch(ctx context.Context, tx Executor, after *uuid.UUID, below uuid.UUID, cutoff time.Time, limit int) (picked, deleted int64, err error) {
	var last uuid.NullUUID
	err = queryRow(ctx, tx, []any{&picked, &deleted, &last}, statements.DeleteSentOutboxBatch, *after, below, cutoff, limit)
	if last.Valid {
		*after = last.UUID
	}
	return picked, deleted, err
}

// DeleteInboxMessages deletes the inbox records older than olderThan, in batches, and says how
// many; one runner at a time, and stopped by a cancelled ctx, as [DeleteSentOutboxMessages]
// is (a batch's commit given up to 2 s past ctx's end, then abandoned). Keep records longer
// than any duplicate can arrive (the relay's longest possible retry, the broker's redelivery
// window): a message whose record is gone would be handled again. An olderThan under a
// millisecond, the cutoff's resolution, is an error: it would delete every record.
func DeleteInboxMessages(ctx context.Context, db DB, olderThan time.Duration, opts CleanupOptions) (CleanupResult, error) {
	if olderThan < time.Millisecond {
		// An unset setting (or one in the wrong unit) would delete every record, even that of a
		// batch whose ack is yet to reach the broker: its redelivery would be handled again.
		return CleanupResult{}, fmt.Errorf("clean up inbox_messages: olderThan is %s, want a retention longer than any duplicate can arrive", olderThan)
	}
	var after time.Time // year 1, before every record
	next := func(ctx context.Context, tx Executor, cutoff time.Time, limit int) (picked, deleted int64, err error) {
		var last sql.NullTime
		err = queryRow(ctx, tx, []any{&picked, &deleted, &last}, statements.DeleteInboxBatch, after, cutoff, limit)
		if last.Valid {
			after = last.Time
		}
		return picked, deleted, err
	}
	return cleanUp(ctx, db, "inbox_messages", inboxCleanupLockClass, olderThan, opts, next)
}

// cleanupBatch deletes, in tx, the next batch of rows older than cutoff, at most limit, and
// says how many rows it picked and how many of them it deleted.
type cleanupBatch func(ctx context.Context, tx Executor, cutoff time.Time, limit int) (picked, deleted int64, err error)

// cleanUp runs the batches of one table's cleanup under the lock of lockClass: each walk's in
// turn, until it finds no more.
func cleanUp(ctx context.Context, db DB, table string, lockClass int32, olderThan time.Duration, opts CleanupOptions, walks ...cleanupBatch) (CleanupResult, error) {
	var res CleanupResult
	locked, err := withSessionLock(ctx, db, lockClass, func(conn Conn) error {
		for _, next := range walks {
			if err := deleteInBatches(ctx, conn, table, olderThan, opts, next, &res); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return res, fmt.Errorf("clean up %s: %w", table, err)
	}
	res.Skipped = !locked
	return res, nil
}

// deleteInBatches runs batches until one comes back short (nothing older is left) or deletes
// nothing (its rows were changed meanwhile; the next run sees them), adding to res as it goes.
// The cutoff is the database's clock, the one processed_at was stamped with, read once so
// the run has an end however fast rows age into it.
func deleteInBatches(ctx context.Context, conn Conn, table string, olderThan time.Duration, opts CleanupOptions, next cleanupBatch, res *CleanupResult) error {
	limit := opts.BatchSize
	if limit <= 0 {
		limit = DefaultCleanupBatchSize
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("stopped after %d batches: %w", res.Batches, err)
	}
	var cutoff time.Time
	if err := queryRow(ctx, conn, []any{&cutoff}, `SELECT now() - $1 * interval '1 millisecond'`, olderThan.Milliseconds()); err != nil {
		return fmt.Errorf("read cutoff: %w", err)
	}
	for {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("stopped after %d batches: %w", res.Batches, err)
		}
		picked, deleted, err := runBatch(ctx, conn, cutoff, limit, next)
		if err != nil {
			return fmt.Errorf("batch %d: %w", res.Batches+1, err)
		}
		res.Batches++
		res.Deleted += deleted
		opts.Metrics.recordCleanupDeleted(table, deleted)
		if picked < int64(limit) || deleted == 0 {
			return nil
		}
	}
}

// runBatch runs one batch in a transaction of its own and returns its counts once committed.
// A cancelled ctx interrupts the batch's statement, which then deletes nothing; its commit is
// given settleWait more: interrupted at once, a commit may have happened or not, and the rows
// counted would not be the rows deleted; never interrupted, one the database does not answer
// would hold the caller's shutdown until TCP gives the connection up.
func runBatch(ctx context.Context, conn Conn, cutoff time.Time, limit int, next cleanupBatch) (picked, deleted int64, err error) {
	txCtx, cancel := withGrace(ctx, settleWait)
	defer cancel()
	tx, err := conn.Begin(txCtx) // database/sql commits under the transaction's context
	if err != nil {
		return 0, 0, fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			rollback(ctx, tx)
		}
	}()
	if _, err := tx.Exec(ctx, statements.CleanupPlan); err != nil {
		return 0, 0, fmt.Errorf("plan setting: %w", err)
	}
	if picked, deleted, err = next(ctx, tx, cutoff, limit); err != nil {
		return 0, 0, err
	}
	if err := tx.Commit(txCtx); err != nil {
		return 0, 0, fmt.Errorf("commit: %w", err)
	}
	return picked, deleted, nil
}

// withSessionLock runs fn on a connection of its own holding the advisory lock of class in
// the session's schema (cleanupLockKey), and says whether it got the lock; when another
// session holds it, fn does not run. The lock belongs to the session, so it is taken, used and
// released on that one connection, never through the pool, where each statement may run on
// another connection. A transaction-level lock would last one batch only, and let two runners
// take turns.
func withSessionLock(ctx context.Context, db DB, class int32, fn func(conn Conn) error) (locked bool, err error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return false, fmt.Errorf("take a connection: %w", err)
	}
	// The key taken is the key released, whatever the session's schema by then.
	var key int64
	if err := queryRow(ctx, conn, []any{&locked, &key}, `SELECT pg_try_advisory_lock(k), k FROM (SELECT `+cleanupLockKey+`) AS cleanup_lock(k)`, class); err != nil {
		// The lock may have been taken all the same (a cancellation between the server's
		// answer and the scan): back in the pool, the session would keep every run out.
		conn.Discard()
		return false, fmt.Errorf("take the lock: %w", err)
	}
	if !locked {
		conn.Close()
		return false, nil
	}
	defer func() { err = errors.Join(err, unlock(ctx, conn, key)) }()
	return true, fn(conn)
}

// ErrLockNotReleased is wrapped by the error of [MigrateOutbox], [MigrateInbox],
// [DeleteSentOutboxMessages] and [DeleteInboxMessages] when pg_advisory_unlock answered that
// their session did not hold their advisory lock: a pooler in transaction mode (PgBouncer's)
// likely ran the lock and the unlock on different server connections. The work is done all
// the same (the migrations applied, unless the error names one that failed; a cleanup's
// [CleanupResult] counts its rows deleted), but the lock stays held on the server connection
// that took it until that closes (PgBouncer's server_lifetime), the cleanups skipping and the
// migrations waiting meanwhile. Give the migrations and the cleanups a direct connection or
// session pooling; to free the lock at once, end the backend that pg_locks shows holding it
// (locktype advisory) with pg_terminate_backend.
var ErrLockNotReleased = errors.New("the session did not hold its advisory lock at its release: " +
	"a pooler in transaction mode (PgBouncer's) likely ran the lock and the unlock on different server connections, " +
	"and the one that took the lock holds it still, keeping later runs out (cleanups skip, migrations wait) until it closes; " +
	"give migrations and cleanups a direct connection or session pooling")

// unlock releases the session's advisory lock and returns the connection to its pool, or,
// when it cannot release the lock, closes the connection: back in the pool, a session still
// holding the lock would keep every later run out. A lock the session did not hold is an
// error: it was released nowhere, and is held where no one can reach it.
func unlock(ctx context.Context, conn Conn, key int64) error {
	// The run's ctx may be cancelled already; the lock must be released all the same.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	var released bool
	switch err := queryRow(ctx, conn, []any{&released}, `SELECT pg_advisory_unlock($1)`, key); {
	case err != nil:
		conn.Discard() // the lock goes with the session
	case !released:
		// Bound to who knows which server connection: not a session to hand out again.
		conn.Discard()
		return ErrLockNotReleased
	default:
		conn.Close()
	}
	return nil
}

// uuidV7Bound returns the UUID that every UUIDv7 made up to t's millisecond is below, and every
// one made later above: the next millisecond's timestamp, all other bits zero.
func uuidV7Bound(t time.Time) uuid.UUID {
	var id uuid.UUID
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(t.UnixMilli()+1))
	copy(id[:6], ms[2:]) // the 48-bit big-endian millisecond timestamp
	return id
}
