package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"gorm.io/gorm"
)

// The statements that carry the relay's guarantees, in one place.
const (
	// Claim the oldest due rows. FOR UPDATE SKIP LOCKED (inside the batch's transaction) makes
	// concurrent relays take disjoint rows instead of publishing the same ones.
	claimSQL = `SELECT id, type, payload, correlation_id, occurred_at, attempts
FROM outbox_messages
WHERE processed_at IS NULL AND next_attempt_at <= now()
ORDER BY occurred_at, id
LIMIT ?
FOR UPDATE SKIP LOCKED`

	// Only rows the broker confirmed and routed. clock_timestamp(), not now(): now() is when the
	// transaction began, before the publishing it waited for.
	markSentSQL = `UPDATE outbox_messages SET processed_at = clock_timestamp() WHERE id IN ?`

	// Never give up on a row: record why it failed and when to try again, counted from now,
	// not from the start of the transaction (a confirm timeout can take seconds).
	recordFailureSQL = `UPDATE outbox_messages
SET attempts = attempts + 1,
    last_error = ?,
    next_attempt_at = clock_timestamp() + ? * interval '1 millisecond'
WHERE id = ?
RETURNING next_attempt_at`
)

// Sender publishes a batch and reports one verdict per message (see [Publisher.Publish]).
type Sender interface {
	Publish(ctx context.Context, exchange string, msgs []Message) []error
}

// RelayConfig configures a [Relay]. DB, Sender and Exchange are required.
type RelayConfig struct {
	DB       *gorm.DB // the service's database, holding outbox_messages
	Sender   Sender
	Exchange string
	// BatchSize is the most rows one transaction claims and publishes. Default 500: on the
	// reference machine 500 drained about 1.6× faster than 100 (BenchmarkRelayDrain).
	BatchSize int
	// PollInterval is how often the relay looks for due rows when nothing wakes it. Default 1 s.
	PollInterval time.Duration
	// Backoff schedules retries of a row that failed: 2 s, 4 s, 8 s … up to 5 min by default.
	Backoff Backoff
	// DisableNotify turns off the LISTEN/NOTIFY wake-up, leaving only polling.
	DisableNotify bool
	// ShutdownGrace is how long a batch in progress may go on after Run's context ends, so it
	// can record what the broker confirmed. Default 5 s.
	ShutdownGrace time.Duration
	Logger        *slog.Logger
	Metrics       *Metrics // optional
}

// BatchResult tells what one [Relay.ProcessBatch] did.
type BatchResult struct {
	Claimed int // rows claimed
	Sent    int // confirmed by the broker and marked processed
	Failed  int // attempts recorded with a backoff
}

// Relay moves outbox rows to the broker: it claims due rows, publishes them, marks those the
// broker confirmed as processed and backs off those that failed, all in one transaction per
// batch. A crash before that commit leaves every row of the batch unprocessed, so they are
// published again later: delivery is at-least-once, and consumers deduplicate by message id.
type Relay struct {
	cfg RelayConfig
	log *slog.Logger
}

// NewRelay checks cfg and fills in its defaults.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	if cfg.DB == nil || cfg.Sender == nil || cfg.Exchange == "" {
		return nil, errors.New("relay: DB, Sender and Exchange are required")
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 500
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = time.Second
	}
	cfg.Backoff = cfg.Backoff.withDefaults(2*time.Second, 5*time.Minute)
	if cfg.ShutdownGrace <= 0 {
		cfg.ShutdownGrace = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Relay{cfg: cfg, log: cfg.Logger.With("component", "relay")}, nil
}

// Run relays until ctx ends, then returns nil. It drains without pause while batches come back
// full, and otherwise waits for a NOTIFY from a committed [Enqueue] or the next poll. After a
// failed batch it waits a full poll interval, so an outage is not hammered on every insert.
func (r *Relay) Run(ctx context.Context) error {
	wake := make(chan struct{}, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	if !r.cfg.DisableNotify {
		wg.Go(func() { r.listen(ctx, wake) })
	}
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		res, err := r.ProcessBatch(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			r.log.Error("relay batch failed", "error", err)
		}
		healthy := err == nil && res.Failed == 0
		if healthy && res.Claimed == r.cfg.BatchSize {
			continue
		}
		timer.Reset(r.cfg.PollInterval)
		if healthy {
			select {
			case <-ctx.Done():
				return nil
			case <-wake:
			case <-timer.C:
			}
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
		}
	}
}

type failure struct {
	msg           Message
	attempts      int
	delay         time.Duration
	nextAttemptAt time.Time
	err           error
}

// ProcessBatch claims, publishes and settles one batch of due rows in one transaction.
func (r *Relay) ProcessBatch(parent context.Context) (BatchResult, error) {
	ctx, cancel := withGrace(parent, r.cfg.ShutdownGrace)
	defer cancel()

	var res BatchResult
	var failures []failure
	var sentTypes []string
	err := r.cfg.DB.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		res, failures, sentTypes = BatchResult{}, nil, nil
		var rows []OutboxMessage
		if err := tx.Raw(claimSQL, r.cfg.BatchSize).Scan(&rows).Error; err != nil {
			return fmt.Errorf("claim outbox batch: %w", err)
		}
		res.Claimed = len(rows)
		if len(rows) == 0 {
			return nil
		}
		msgs := make([]Message, len(rows))
		for i, row := range rows {
			msgs[i] = row.Message()
		}
		verdicts := r.cfg.Sender.Publish(ctx, r.cfg.Exchange, msgs)

		sent := make([]uuid.UUID, 0, len(rows))
		for i, err := range verdicts {
			switch {
			case err == nil:
				sent = append(sent, rows[i].ID)
				sentTypes = append(sentTypes, rows[i].Type)
			case errors.Is(err, ErrNotPublished) && len(failures) > 0:
				// Never reached the broker because of the failure already recorded: it
				// stays due and goes out with the next batch.
			default:
				f := failure{msg: msgs[i], attempts: rows[i].Attempts + 1, err: err}
				f.delay = r.cfg.Backoff.Delay(f.attempts)
				if err := tx.Raw(recordFailureSQL, err.Error(), f.delay.Milliseconds(), f.msg.ID).Scan(&f.nextAttemptAt).Error; err != nil {
					return fmt.Errorf("record publish failure of %s: %w", f.msg.ID, err)
				}
				failures = append(failures, f)
			}
		}
		if len(sent) > 0 {
			if err := tx.Exec(markSentSQL, sent).Error; err != nil {
				return fmt.Errorf("mark %d outbox rows sent: %w", len(sent), err)
			}
		}
		res.Sent, res.Failed = len(sent), len(failures)
		return nil
	})
	if err != nil {
		return BatchResult{Claimed: res.Claimed}, err
	}
	// Logged and counted after the commit, so neither reports a state the database does not hold.
	for _, t := range sentTypes {
		r.cfg.Metrics.recordPublished(t)
	}
	for _, f := range failures {
		r.cfg.Metrics.recordPublishFailure(f.msg.Type)
		r.log.Warn("outbox publish failed",
			"message_id", f.msg.ID, "type", f.msg.Type, "attempts", f.attempts,
			"retry_in", f.delay, "next_attempt_at", f.nextAttemptAt.UTC().Format(time.RFC3339Nano), "error", f.err)
	}
	if res.Sent > 0 {
		r.log.Debug("outbox batch sent", "sent", res.Sent, "claimed", res.Claimed)
	}
	return res, nil
}

// listen wakes the relay on every NOTIFY, on a connection of its own taken from the pool for
// as long as the relay runs (size the pool for it). While it cannot listen, polling still
// moves everything, only later.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) {
	retry := Backoff{Base: 500 * time.Millisecond, Max: 30 * time.Second}
	failures := 0
	for {
		listened, err := r.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		if listened {
			failures = 0
		}
		failures++
		delay := retry.Delay(failures)
		r.log.Warn("relay lost its LISTEN connection; polling meanwhile", "error", err, "retry_in", delay)
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
	}
}

// listenOnce listens until its connection fails; listened reports whether LISTEN succeeded.
func (r *Relay) listenOnce(ctx context.Context, wake chan<- struct{}) (listened bool, err error) {
	sqlDB, err := r.cfg.DB.DB()
	if err != nil {
		return false, fmt.Errorf("listen: %w", err)
	}
	conn, err := sqlDB.Conn(ctx)
	if err != nil {
		return false, fmt.Errorf("listen: take a connection: %w", err)
	}
	defer conn.Close()
	err = conn.Raw(func(driverConn any) error {
		sc, ok := driverConn.(*stdlib.Conn)
		if !ok {
			return fmt.Errorf("listen: need the pgx driver, got %T", driverConn)
		}
		pc := sc.Conn()
		if _, err := pc.Exec(ctx, "LISTEN "+pgx.Identifier{NotifyChannel}.Sanitize()); err != nil {
			return fmt.Errorf("listen: %w", err)
		}
		defer func() {
			if !pc.IsClosed() {
				unlistenCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
				defer cancel()
				_, _ = pc.Exec(unlistenCtx, "UNLISTEN *")
			}
		}()
		listened = true
		signal(wake) // rows committed while nobody listened
		for {
			if _, err := pc.WaitForNotification(ctx); err != nil {
				return fmt.Errorf("wait for notification: %w", err)
			}
			signal(wake)
		}
	})
	return listened, err
}

func signal(c chan<- struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// withGrace returns a context that ends grace after parent does (or when cancel is called):
// work in progress at shutdown gets a bounded chance to finish and record its outcome.
func withGrace(parent context.Context, grace time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.WithoutCancel(parent))
	stop := context.AfterFunc(parent, func() {
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-ctx.Done():
		}
	})
	return ctx, func() { stop(); cancel() }
}
