package messaging

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
)

// uuidV7Bound(t) is above every UUIDv7 made up to t, and below those made a millisecond later.
func TestUUIDv7Bound(t *testing.T) {
	t.Parallel()
	for range 1000 {
		before := time.Now()
		id, err := uuid.NewV7()
		if err != nil {
			t.Fatal(err)
		}
		after := time.Now()
		if bound := uuidV7Bound(after); bytes.Compare(id[:], bound[:]) >= 0 {
			t.Fatalf("UUIDv7 %s made before %s is not below its bound %s", id, after, bound)
		}
		if earlier := uuidV7Bound(before.Add(-time.Millisecond)); bytes.Compare(id[:], earlier[:]) < 0 {
			t.Fatalf("UUIDv7 %s made after %s is below the bound %s of the millisecond before", id, before, earlier)
		}
	}
}

// A failed lock query may have taken the lock all the same (cancelled between the server's
// answer and the scan): the session must not go back to the pool, where it would keep every
// later run out.
func TestASessionWhoseLockQueryFailedIsDiscarded(t *testing.T) {
	t.Parallel()
	conn := &lockConn{}
	ran, err := withSessionLock(context.Background(), lockDB{conn: conn}, 1, func(Conn) error { return nil })
	if ran || err == nil {
		t.Fatalf("withSessionLock = %v, %v; want an error and nothing run", ran, err)
	}
	if !conn.discarded || conn.closed {
		t.Fatalf("discarded %v, returned to the pool %v; want discarded only", conn.discarded, conn.closed)
	}
}

// The migrations' lock taken over a failed statement is treated as the cleanup's: the session
// is closed for good, not put back in the pool holding the lock every later migration waits
// for.
func TestAMigrationSessionWhoseLockFailedIsDiscarded(t *testing.T) {
	t.Parallel()
	conn := &lockConn{}
	if err := migrateSchema(context.Background(), lockDB{conn: conn}, "schema/outbox", "messaging_outbox_schema"); err == nil {
		t.Fatal("migrateSchema over a failing lock statement: no error")
	}
	if !conn.discarded || conn.closed {
		t.Fatalf("discarded %v, returned to the pool %v; want discarded only", conn.discarded, conn.closed)
	}
}

// Behind a pooler in transaction mode (PgBouncer's) the lock may be taken on one server
// connection and released on another, where pg_advisory_unlock answers false: the lock stays
// held where it was taken, and every later run skips, or waits, for up to the server
// connection's lifetime. Each says so with ErrLockNotReleased, naming the likely cause, and
// what it did all the same (the migrations applied, the rows deleted), rather than hand back a
// session whose lock was never released. An unlock that answers true returns the session to
// the pool.
func TestAnUnlockThatReleasesNothingIsAnError(t *testing.T) {
	t.Parallel()
	const deleted = 5
	for _, c := range []struct {
		name    string
		run     func(DB) error
		wording string // of the error, when the unlock released nothing
	}{
		{"cleanup", func(db DB) error {
			res, err := DeleteInboxMessages(context.Background(), db, time.Hour, CleanupOptions{})
			if res.Deleted != deleted {
				t.Errorf("cleanup: Deleted = %d, want the %d rows its batch deleted, whatever the unlock said", res.Deleted, deleted)
			}
			return err
		}, "clean up inbox_messages: "},
		{"migration", func(db DB) error {
			return migrateSchema(context.Background(), db, "schema/outbox", "messaging_outbox_schema")
		}, "migrations messaging_outbox_schema applied; their lock was not released: "},
	} {
		for _, released := range []bool{false, true} {
			conn := &unlockConn{released: released, deleted: deleted}
			err := c.run(unlockDB{conn: conn})
			if !conn.unlocked {
				t.Errorf("%s: the lock was never released", c.name)
			}
			if released {
				if err != nil || conn.discarded || !conn.closed {
					t.Errorf("%s whose unlock released the lock: %v, discarded %v, returned to the pool %v; want no error, returned only", c.name, err, conn.discarded, conn.closed)
				}
				continue
			}
			if !errors.Is(err, ErrLockNotReleased) || !strings.Contains(err.Error(), c.wording) || !strings.Contains(err.Error(), "transaction mode") {
				t.Errorf("%s whose unlock released nothing: %v, want ErrLockNotReleased, %q, naming a transaction-mode pooler", c.name, err, c.wording)
			}
			if !conn.discarded || conn.closed {
				t.Errorf("%s: discarded %v, returned to the pool %v; want discarded only", c.name, conn.discarded, conn.closed)
			}
		}
	}
}

// unlockDB hands out conn.
type unlockDB struct {
	DB
	conn *unlockConn
}

func (d unlockDB) Conn(context.Context) (Conn, error) { return d.conn, nil }

// unlockConn takes every advisory lock, answers released to pg_advisory_unlock (false, as a
// server connection that does not hold the lock does), and finds little to do: the cleanup's
// one batch deletes deleted rows, the migrations are all applied.
type unlockConn struct {
	Conn
	released                    bool
	deleted                     int64
	unlocked, closed, discarded bool
}

func (c *unlockConn) Query(_ context.Context, query string, _ ...any) (Rows, error) {
	switch {
	case strings.Contains(query, "pg_advisory_unlock"):
		c.unlocked = true
		return &scanRows{values: []any{c.released}}, nil
	case strings.Contains(query, "pg_try_advisory_lock"), strings.Contains(query, "to_regclass"):
		return &scanRows{values: []any{true}}, nil
	case strings.Contains(query, "now() -"):
		return &scanRows{values: []any{time.Now()}}, nil
	case strings.Contains(query, "version_id"):
		var applied []any
		for v := range int64(100) {
			applied = append(applied, v, true)
		}
		return &scanRows{values: applied, width: 2}, nil
	}
	return nil, errors.New("unlockConn: unexpected query " + query)
}
func (c *unlockConn) Exec(_ context.Context, query string, _ ...any) (int64, error) {
	if !strings.Contains(query, "pg_advisory_unlock") {
		return 0, errors.New("unlockConn: unexpected statement " + query)
	}
	c.unlocked = true // its answer unread
	return 1, nil
}
func (c *unlockConn) Begin(context.Context) (TxExecutor, error) { return unlockTx{c}, nil }
func (c *unlockConn) Close()                                    { c.closed = true }
func (c *unlockConn) Discard()                                  { c.discarded = true }

// unlockTx is a transaction of unlockConn's: its statements succeed, its batch picks and
// deletes the conn's deleted rows, fewer than a batch's limit.
type unlockTx struct{ *unlockConn }

func (unlockTx) Exec(context.Context, string, ...any) (int64, error) { return 0, nil }
func (t unlockTx) Query(context.Context, string, ...any) (Rows, error) {
	return &scanRows{values: []any{t.deleted, t.deleted, sql.NullTime{}}, width: 3}, nil
}
func (unlockTx) Commit(context.Context) error   { return nil }
func (unlockTx) Rollback(context.Context) error { return nil }

// scanRows returns values as rows of width columns (one unless set), each scanned into a
// destination of its value's type.
type scanRows struct {
	values []any
	width  int
	at     int // the next row's first value
	row    []any
}

func (r *scanRows) Next() bool {
	w := max(r.width, 1)
	if r.at+w > len(r.values) {
		return false
	}
	r.row, r.at = r.values[r.at:r.at+w], r.at+w
	return true
}
func (r *scanRows) Scan(dest ...any) error {
	for i, v := range r.row {
		reflect.ValueOf(dest[i]).Elem().Set(reflect.ValueOf(v))
	}
	return nil
}
func (r *scanRows) Err() error { return nil }
func (r *scanRows) Close()     {}

// lockDB hands out conn, whose every statement fails.
type lockDB struct {
	DB
	conn *lockConn
}

func (d lockDB) Conn(context.Context) (Conn, error) { return d.conn, nil }

type lockConn struct {
	Conn
	closed, discarded bool
}

func (c *lockConn) Query(context.Context, string, ...any) (Rows, error) {
	return nil, context.Canceled
}
func (c *lockConn) Exec(context.Context, string, ...any) (int64, error) {
	return 0, context.Canceled
}
func (c *lockConn) Begin(context.Context) (TxExecutor, error) { return lockTx{}, nil }
func (c *lockConn) Close()                                    { c.closed = true }
func (c *lockConn) Discard()                                  { c.discarded = true }

// lockTx is a transaction of lockConn's, whose every statement fails too.
type lockTx struct{ TxExecutor }

func (lockTx) Exec(context.Context, string, ...any) (int64, error) { return 0, context.Canceled }
func (lockTx) Rollback(context.Context) error                      { return nil }

// Every rollback is bounded, not only the relay's and the subscription's: a cleanup batch, an
// operator's action or a migration whose statement failed as the database stopped answering
// would otherwise wait on its rollback as long as the connection lives (pgx sets no read
// deadline, and database/sql's adapter bounds it only through a deadline), holding the
// cleanup's lock or the operator with it.
func TestEveryRollbackIsBounded(t *testing.T) {
	t.Parallel()
	boom := errors.New("the statement failed")
	for _, c := range []struct {
		name string
		run  func(context.Context, *rollbackConn) error
		// failAt lists the statements to fail, one run each (the first is 1): every one of
		// them must be followed by a bounded rollback.
		failAt []int
	}{
		{"cleanup batch", func(ctx context.Context, c *rollbackConn) error {
			_, _, err := runBatch(ctx, c, time.Now(), 10, func(context.Context, Executor, time.Time, int) (int64, int64, error) { return 0, 0, boom })
			return err
		}, []int{2}},
		{"operator action", func(ctx context.Context, c *rollbackConn) error {
			return inTx(ctx, rollbackDB{c}, func(TxExecutor) (bool, error) { return false, boom })
		}, []int{2}},
		{"migration lock", func(ctx context.Context, c *rollbackConn) error {
			return lockMigrations(ctx, c)
		}, []int{1, 2, 3}},
		{"migration", func(ctx context.Context, c *rollbackConn) error {
			return migration{version: 1, up: "SELECT 1"}.applyOnce(ctx, c, "versions")
		}, []int{1, 2, 3, 4}},
	} {
		for _, at := range c.failAt {
			conn := &rollbackConn{fail: boom, failAt: at}
			if err := c.run(context.Background(), conn); !errors.Is(err, boom) {
				t.Fatalf("%s, statement %d failing: %v, want the statement's failure", c.name, at, err)
			}
			if !conn.rolledBack || !conn.bounded {
				t.Errorf("%s, statement %d failing: rolled back %v, within a deadline %v; want a bounded rollback", c.name, at, conn.rolledBack, conn.bounded)
			}
		}
	}
}

// rollbackDB hands out its conn.
type rollbackDB struct{ conn *rollbackConn }

func (d rollbackDB) Conn(context.Context) (Conn, error) { return d.conn, nil }
func (d rollbackDB) Begin(context.Context) (TxExecutor, error) {
	return nil, errors.New("rollbackDB: Begin")
}
func (d rollbackDB) Exec(context.Context, string, ...any) (int64, error) {
	return 0, errors.New("rollbackDB: Exec")
}
func (d rollbackDB) Query(context.Context, string, ...any) (Rows, error) {
	return nil, errors.New("rollbackDB: Query")
}

// rollbackConn is its own transaction: its first statement succeeds and every later one fails
// with fail; Rollback records whether its context had a deadline.
type rollbackConn struct {
	Conn
	fail                error
	failAt, statements  int // the statement that fails (the first is 1), and how many ran
	rolledBack, bounded bool
}

func (c *rollbackConn) Begin(context.Context) (TxExecutor, error) { return c, nil }
func (c *rollbackConn) Exec(context.Context, string, ...any) (int64, error) {
	c.statements++
	if c.statements == c.failAt {
		return 0, c.fail
	}
	return 0, nil
}
func (c *rollbackConn) Commit(context.Context) error { return errors.New("rollbackConn: Commit") }
func (c *rollbackConn) Rollback(ctx context.Context) error {
	_, c.bounded = ctx.Deadline()
	c.rolledBack = true
	return nil
}
func (c *rollbackConn) Close() {}

// A cleanup batch whose commit is under way when the caller's context ends commits all the
// same, for settleWait: interrupted at once, it might have deleted rows it reports not
// deleted. But no longer: a database that stops answering would hold the caller's shutdown
// until TCP gives the connection up.
func TestACleanupCommitOutlivesItsContextBoundedly(t *testing.T) {
	t.Parallel()
	conn := &stuckCommitConn{committing: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, _, err := runBatch(ctx, conn, time.Now(), 10, func(context.Context, Executor, time.Time, int) (int64, int64, error) { return 1, 1, nil })
		done <- err
	}()
	<-conn.committing
	cancelled := time.Now()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("runBatch = %v, want its commit ended by its context, not held by a database that does not answer", err)
	}
	if waited := conn.endedAt.Sub(cancelled); waited < settleWait {
		t.Errorf("the commit was ended %s after the caller's context, want %s", waited, settleWait)
	}
	if !conn.beginEnded {
		t.Error("the transaction's context, under which database/sql commits, outlived the commit's")
	}
}

// stuckCommitConn is its own transaction, whose statements succeed and whose commit never
// answers: it returns once its context ends, or, when none would end it, well after
// settleWait.
type stuckCommitConn struct {
	Conn
	beginCtx   context.Context
	committing chan struct{}
	endedAt    time.Time
	beginEnded bool // Begin's context had ended when the commit's did
}

func (c *stuckCommitConn) Begin(ctx context.Context) (TxExecutor, error) {
	c.beginCtx = ctx
	return c, nil
}
func (c *stuckCommitConn) Exec(context.Context, string, ...any) (int64, error) { return 0, nil }
func (c *stuckCommitConn) Rollback(context.Context) error                      { return nil }
func (c *stuckCommitConn) Commit(ctx context.Context) error {
	close(c.committing)
	select {
	case <-ctx.Done():
		c.endedAt, c.beginEnded = time.Now(), c.beginCtx.Err() != nil
		return ctx.Err()
	case <-time.After(settleWait + 10*time.Second):
		return errors.New("stuckCommitConn: the commit's context never ended")
	}
}

// An inbox retention under a millisecond is refused before the database is touched: the
// cutoff is read in whole milliseconds, so 999 µs was a cutoff of now, which deleted the records
// of batches whose ack had yet to reach the broker, and their redeliveries were handled again.
func TestAnInboxRetentionUnderAMillisecondIsRefused(t *testing.T) {
	t.Parallel()
	for _, olderThan := range []time.Duration{time.Millisecond - time.Microsecond, time.Nanosecond, 0, -time.Hour} {
		_, err := DeleteInboxMessages(context.Background(), untouchedDB{t}, olderThan, CleanupOptions{})
		if err == nil || !strings.Contains(err.Error(), "olderThan") {
			t.Errorf("DeleteInboxMessages(%s) = %v, want an error naming olderThan", olderThan, err)
		}
	}
}

// untouchedDB fails the test at any use.
type untouchedDB struct{ t *testing.T }

func (d untouchedDB) Exec(context.Context, string, ...any) (int64, error) {
	d.t.Error("the database was used")
	return 0, errors.New("untouchedDB: Exec")
}
func (d untouchedDB) Query(context.Context, string, ...any) (Rows, error) {
	d.t.Error("the database was used")
	return nil, errors.New("untouchedDB: Query")
}
func (d untouchedDB) Begin(context.Context) (TxExecutor, error) {
	d.t.Error("the database was used")
	return nil, errors.New("untouchedDB: Begin")
}
func (d untouchedDB) Conn(context.Context) (Conn, error) {
	d.t.Error("the database was used")
	return nil, errors.New("untouchedDB: Conn")
}
