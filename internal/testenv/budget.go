package testenv

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// The PostgreSQL connection budget. Every test process of the suite (go test runs one per
// package, several at once) takes its connections from one budget per server, so the suite
// cannot exhaust max_connections however many packages and tests run together:
//
//   - A test reserves all the connections it may open at once, before its first one
//     (DefaultConnections, or Connections(t, n) for more), and keeps them until it ends. A
//     reservation is all or nothing, so no test holds part of the budget while waiting for
//     the rest, and waiting can never deadlock.
//   - Waiting is not fair: no queue spans the processes, and a waiter tries again every 20 to
//     70 ms, all at once or nothing. A large reservation (an end-to-end system's 45, say, of
//     the 87 of a server at the default max_connections) waits until that many are free at
//     the same moment, while smaller ones take the slots freed meanwhile: it may wait long,
//     up to Reserve's 10 minutes. Making it fair would take a gate that holds the small ones
//     back while a large one waits, and that would deadlock a test that holds slots while a
//     subtest of its own waits at the gate: the tests' -timeouts allow for the waits instead.
//   - Each unit of the budget is a slot file locked with flock, which the kernel releases
//     when the process dies: a crashed test process frees its slots.
//   - A test that opens more than it reserved fails at once, saying so: the budget holds by
//     construction, not by luck.
//
// The budget is TEST_PG_CONNECTIONS, or the server's max_connections less its superuser
// reserve and a margin for everything outside the suite.

// DefaultConnections is what a test reserves unless it asks for more: one database's pool and
// the administrative connection that creates and drops it. The library opens no connection
// outside the pool it is given (a relay's LISTEN takes one from it), so pools are all there is
// to count, with Draw for a test's own extra connections.
const DefaultConnections = poolSize + 1

// poolSize is the pool of a test's database handle (NewDatabase).
const poolSize = 10

// budgetMargin is kept free for psql sessions, monitoring and the admin tools of other suites.
const budgetMargin = 10

type reservation struct {
	total, drawn int
}

var (
	reservationsMu sync.Mutex
	reservations   = map[testing.TB]*reservation{}

	budgetOnce sync.Once
	budgetSize int
	budgetErr  error
)

// Connections reserves n PostgreSQL connections for t, waiting until the budget has them.
// Call it first, before anything in t connects, when t opens more than DefaultConnections:
// several databases or pools, or services with pools of their own.
func Connections(t testing.TB, n int) {
	t.Helper()
	reservationsMu.Lock()
	_, held := reservations[t]
	reservationsMu.Unlock()
	if held {
		t.Fatalf("testenv.Connections(%d) after %s already reserved its connections: call it first", n, t.Name())
		return
	}
	reserve(t, n)
}

// Draw takes n of t's reserved connections for a pool or connection t is about to open,
// reserving DefaultConnections first if t has reserved nothing yet.
func Draw(t testing.TB, n int) {
	t.Helper()
	reservationsMu.Lock()
	r := reservations[t]
	reservationsMu.Unlock()
	if r == nil {
		r = reserve(t, DefaultConnections)
	}
	reservationsMu.Lock()
	defer reservationsMu.Unlock()
	if r.drawn+n > r.total {
		t.Fatalf("%s opens %d more PostgreSQL connections than the %d it reserved (%d drawn): reserve enough with testenv.Connections first",
			t.Name(), r.drawn+n-r.total, r.total, r.drawn)
		return
	}
	r.drawn += n
}

// Reserve takes n connections from the budget for code outside a test, such as an example;
// release gives them back.
func Reserve(n int) (release func(), err error) {
	size, err := budget()
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL connection budget: %w", err)
	}
	if n > size {
		return nil, fmt.Errorf("%d PostgreSQL connections wanted, more than the suite's whole budget of %d (TEST_PG_CONNECTIONS)", n, size)
	}
	slots, err := acquireSlots(budgetDir(), size, n, 10*time.Minute)
	if err != nil {
		return nil, fmt.Errorf("reserve %d PostgreSQL connections: %w", n, err)
	}
	return slots.release, nil
}

func reserve(t testing.TB, n int) *reservation {
	t.Helper()
	release, err := Reserve(n)
	if err != nil {
		t.Fatalf("%s: %v", t.Name(), err)
	}
	r := &reservation{total: n}
	reservationsMu.Lock()
	reservations[t] = r
	reservationsMu.Unlock()
	// Registered before anything that connects, so it runs after their cleanups.
	t.Cleanup(func() {
		reservationsMu.Lock()
		delete(reservations, t)
		reservationsMu.Unlock()
		release()
	})
	return r
}

// budget returns the number of slots, reading the server's limits once per process.
func budget() (int, error) {
	budgetOnce.Do(func() {
		if v := os.Getenv("TEST_PG_CONNECTIONS"); v != "" {
			budgetSize, budgetErr = strconv.Atoi(v)
			if budgetErr == nil && budgetSize < 1 {
				budgetErr = fmt.Errorf("TEST_PG_CONNECTIONS: must be a positive integer, got %q", v)
			}
			return
		}
		budgetSize, budgetErr = serverBudget()
	})
	return budgetSize, budgetErr
}

func serverBudget() (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, DatabaseURL())
	if err != nil {
		return 0, fmt.Errorf("connect to PostgreSQL at TEST_DATABASE_URL: %w", err)
	}
	defer conn.Close(ctx)
	var limit int
	err = conn.QueryRow(ctx, `SELECT current_setting('max_connections')::int
	 - current_setting('superuser_reserved_connections')::int`).Scan(&limit)
	if err != nil {
		return 0, fmt.Errorf("read max_connections: %w", err)
	}
	if limit-budgetMargin < DefaultConnections {
		return 0, fmt.Errorf("max_connections leaves %d for the suite, fewer than one test's %d", limit-budgetMargin, DefaultConnections)
	}
	return limit - budgetMargin, nil
}

// budgetDir holds the slot files of the server at TEST_DATABASE_URL, shared by every test
// process on this machine.
func budgetDir() string {
	host := "server"
	if i := strings.Index(DatabaseURL(), "@"); i >= 0 {
		host = DatabaseURL()[i+1:]
	}
	host = strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' {
			return r
		}
		return '_'
	}, strings.SplitN(host, "/", 2)[0])
	return filepath.Join(os.TempDir(), "outbox-inbox-pg-budget-"+host)
}

// acquireSlots locks n of the size slot files, all or none, trying again until timeout.
func acquireSlots(dir string, size, n int, timeout time.Duration) (heldSlots, error) {
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return nil, fmt.Errorf("slot directory: %w", err)
	}
	deadline := time.Now().Add(timeout)
	for {
		held, err := tryLockSlots(dir, size, n)
		if err != nil || len(held) == n {
			return held, err
		}
		held.release()
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("the budget of %d had no %d free for %s (slot files in %s)", size, n, timeout, dir)
		}
		time.Sleep(time.Duration(20+rand.IntN(50)) * time.Millisecond)
	}
}

// tryLockSlots locks free slots, from a random start so waiting processes spread out, until
// it holds n or has tried them all.
func tryLockSlots(dir string, size, n int) (heldSlots, error) {
	var held heldSlots
	start := rand.IntN(size)
	for i := 0; i < size && len(held) < n; i++ {
		f, ok, err := lockSlot(filepath.Join(dir, fmt.Sprintf("slot-%04d", (start+i)%size)))
		if err != nil {
			held.release()
			return nil, err
		}
		if ok {
			held = append(held, f)
		}
	}
	return held, nil
}

type heldSlots []*os.File

// release unlocks the slots by closing them.
func (h heldSlots) release() {
	for _, f := range h {
		_ = f.Close()
	}
}
