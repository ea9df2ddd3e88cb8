package messaging

import (
	"bytes"
	"context"
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
func (c *lockConn) Close()   { c.closed = true }
func (c *lockConn) Discard() { c.discarded = true }
