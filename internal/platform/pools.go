package platform

import (
	"context"
	"fmt"
	"log/slog"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
)

// MinRequestConns is the fewest connections requests may be left with.
const MinRequestConns = 2

// Pools shares a service's DB_MAX_CONNS connections out between its parts, each with a pool of
// its own, so that none can take another's: requests that saturate theirs leave the relay its
// lanes and the consumers their workers, and the readiness check its connection
// (ReadinessConns). Requests get the rest.
type Pools struct {
	// Background is the relay's (a connection per lane, and its LISTEN), the backlog gauges'
	// (the outbox's, the sender's) and the cleanups'; see RelayConns and CleanupConns.
	Background int
	// Work is the consumers' (a connection per worker, and the check that the database
	// answers; see ConsumerConns).
	Work int
	// Sender is the notification sender's, whose sessions plan by index (see IndexPlansURL).
	Sender int
	// explain says, per part, what its connections are for, for the error that DB_MAX_CONNS is
	// too small.
	explain []string
}

// PoolsOf shares out the connections of a service that runs a relay (relay not nil), consumes
// (consumer not nil) and delivers with senders connections (and reads their backlog at each
// scrape over one more): what each part holds at most.
func PoolsOf(relay *RelaySettings, consumer *ConsumerSettings, senders int) Pools {
	var p Pools
	if relay != nil {
		p = p.AddBackground(RelayConns(*relay), "the relay (OUTBOX_LANES + 2)")
	}
	if n := CleanupConns(relay != nil, consumer != nil); n > 0 {
		p = p.AddBackground(n, "the cleanups")
	}
	if consumer != nil {
		p = p.AddWork(ConsumerConns(*consumer), "the consumer (CONSUMER_CONCURRENCY + 1)")
	}
	if senders > 0 {
		p.Sender = senders
		p.explain = append(p.explain, fmt.Sprintf("the sender %d", senders))
		p = p.AddBackground(1, "the sender's backlog gauges")
	}
	return p
}

// RelayConns is what a relay holds at most: a connection per lane, its LISTEN, and one for
// the backlog gauges read at each scrape.
func RelayConns(s RelaySettings) int { return s.Lanes + 2 }

// CleanupConns is what the hourly cleanups hold: one for the outbox's, one for the inbox's.
func CleanupConns(outbox, inbox bool) int {
	n := 0
	if outbox {
		n++
	}
	if inbox {
		n++
	}
	return n
}

// ConsumerConns is what a subscription holds at most: a connection per worker, and one to ask
// whether the database answers after a failure.
func ConsumerConns(s ConsumerSettings) int { return s.Concurrency + 1 }

// AddBackground adds n background connections, what for said by why (for the error message).
func (p Pools) AddBackground(n int, why string) Pools {
	p.Background += n
	p.explain = append(p.explain, fmt.Sprintf("%s %d", why, n))
	return p
}

// AddWork adds n work connections, what for said by why.
func (p Pools) AddWork(n int, why string) Pools {
	p.Work += n
	p.explain = append(p.explain, fmt.Sprintf("%s %d", why, n))
	return p
}

// Requests is what the pools leave requests of c's DB_MAX_CONNS.
func (p Pools) Requests(c Common) int {
	return c.DBMaxConns - ReadinessConns - p.Background - p.Work - p.Sender
}

// Check records in env a DB_MAX_CONNS that leaves requests fewer than MinRequestConns.
func (p Pools) Check(env *Env, c Common) {
	need := ReadinessConns + p.Background + p.Work + p.Sender + MinRequestConns
	env.Check(c.DBMaxConns >= need, "DB_MAX_CONNS", fmt.Sprintf("%d is too few: the readiness check %d, %s and requests at least %d need %d",
		c.DBMaxConns, ReadinessConns, strings.Join(p.explain, ", "), MinRequestConns, need))
}

// OpenBackground opens the background pool of size conns, with the pgx driver: the relay's
// LISTEN needs it, and its statements need no ORM. Its sessions plan by index
// (IndexPlansURL; the relay is told so) and carry application_name=service-background. Its
// errors name DATABASE_URL and never hold a password (see openError). It waits for its first
// connection as OpenDB does: pgxpool would connect only at the first statement, which would
// fail the start at once on a refusal that passes (57P03 while the server starts after a
// failover, 53300 while its connections are taken, a dial refused during a restart), where the
// other pools wait, live and not ready.
func OpenBackground(ctx context.Context, log *slog.Logger, service, rawURL string, conns int) (*pgxpool.Pool, error) {
	dsn, err := IndexPlansURL(rawURL)
	if err != nil {
		return nil, err
	}
	if dsn, err = WithApplicationName(dsn, service+"-background"); err != nil {
		return nil, errNotAURL
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, openError("open background pool", err, rawURL, dsn)
	}
	cfg.MaxConns = int32(conns)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, openError("open background pool", err, rawURL, dsn)
	}
	if err := waitForDatabase(ctx, log, service+"-background", rawURL, dsn, pool.Ping); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}
