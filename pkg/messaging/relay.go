package messaging

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// The defaults of a [RelayConfig].
const (
	DefaultRelayBatchSize = 500
	DefaultLanes          = 2
	DefaultPollInterval   = time.Second
	DefaultMaxBackoff     = 5 * time.Minute
	DefaultMaxBatchBytes  = 16 << 20 // 16 MiB: the largest payload Enqueue takes
)

// Sender publishes a batch, each message to its exchange, and reports one verdict per message,
// in their order (see [Publisher.Publish]); any other number of verdicts fails the batch, its
// rows left due, and the relay logs it and tries again at [RelayConfig.BrokerRetry]'s pace
// (100 ms doubling to 2 s by default), for ever. An error wrapping [ErrBrokerUnavailable] is no
// verdict: the row stays due and its attempts untouched. Any other error is the message's own
// fault, and backs the row off ([RelayConfig.Backoff]). A Sender may also have a
// method Connect(ctx) error, as a [Publisher] has (a wrapper that embeds a Sender loses it:
// give the wrapper one): the relay then asks it, not a row, whether the broker is back, and
// after every empty claim whether it still has it, so it must cost no round trip while
// connected; an error of it at [Relay.Run]'s start that does not wrap ErrBrokerUnavailable is
// taken for the configuration's, and Run returns it. A Sender may also have a method
// PublishTimeout(n int) time.Duration, the longest its Publish of n messages takes, as a
// [Publisher] has (a wrapper must forward it too): the relay then has the database end a
// batch's transaction left idle longer than that and 5 s (a timeout of 0 or less sets no bound;
// one longer than PostgreSQL takes, about 24.8 days, is cut to that). A relay host lost
// mid-batch (a partition, a frozen machine) holds its rows locked, skipped by every other
// relay, that long at most; without it, until the database's TCP keepalives find the
// connection dead (two hours at Linux's defaults). The bound is the server's alone: the
// relay gives its statements no deadline of its own (see [Relay.Run]).
type Sender interface {
	Publish(ctx context.Context, msgs []Message) []error
}

// publishBound is what a [Sender] may also offer (a [Publisher] does): how long its Publish of
// n messages may take.
type publishBound interface {
	PublishTimeout(n int) time.Duration
}

// idleMargin is how long a batch's transaction may sit idle beyond its Sender's PublishTimeout:
// the relay's own work between the statements takes microseconds; the margin is for a machine
// that stalls.
const idleMargin = 5 * time.Second

// maxIdleBound is the longest idle_in_transaction_session_timeout PostgreSQL takes: an int of
// milliseconds.
const maxIdleBound = math.MaxInt32 * time.Millisecond

// idleBoundOf is how long the database may let a batch of n rows for sender sit idle in its
// transaction: the Sender's PublishTimeout of n messages and idleMargin, at most maxIdleBound;
// 0, no bound, for a Sender without the method or with a timeout of 0 or less.
func idleBoundOf(sender Sender, n int) time.Duration {
	b, ok := sender.(publishBound)
	if !ok {
		return 0
	}
	timeout := b.PublishTimeout(n)
	switch {
	case timeout <= 0:
		return 0
	case timeout > maxIdleBound-idleMargin: // and no overflow of the sum
		return maxIdleBound
	}
	return timeout + idleMargin
}

// trialBatch is the most rows a lane claims to find out whether an outage the probe cannot see
// is over: the oldest due row, likely the one the broker left unconfirmed, whose every try
// would reach again whichever of its queues are healthy.
const trialBatch = 1

// brokerProbe is what a [Sender] may also offer (a [Publisher] does): a cheap check that the
// broker takes messages again, so a relay waiting out an outage claims no rows to find out. An
// error that does not wrap [ErrBrokerUnavailable] says that no broker will do (the
// configuration's fault): [Relay.Run] returns it.
type brokerProbe interface {
	Connect(ctx context.Context) error
}

// RelayConfig configures a [Relay]. DB, Sender and Exchange are required.
type RelayConfig struct {
	DB     DB // the service's database, holding outbox_messages (a driver's DB())
	Sender Sender
	// Exchange is where the rows that name no exchange of their own go: those enqueued before
	// rows recorded it, and messages enqueued without one. Each other row goes to its own.
	Exchange string
	// BatchSize is the most rows one transaction claims and publishes. Default
	// [DefaultRelayBatchSize].
	BatchSize int
	// MaxBatchBytes bounds the payload bytes one batch holds: the claim keeps its rows, oldest
	// first, while their payloads add up to no more, and always keeps the first, however large.
	// The rows it locked past the bound are left as they were, due again at the batch's commit,
	// and the lane claims them at once, as after a full batch; the next batches, the lanes' and
	// ProcessBatch's, claim fewer rows (twice what fitted, back up to BatchSize as batches come
	// back full, BatchSize again once one finds fewer than it asked for): the server sends every
	// row a claim locks. A relay holds about Lanes × MaxBatchBytes of payloads (and one row more per lane,
	// read to find the bound passed): size a memory limit for it. Without the bound, two lanes of
	// 500 rows of 1 MB took a gigabyte, and a relay killed for its memory claimed the same rows at
	// each restart. Default [DefaultMaxBatchBytes], the largest payload [Enqueue] takes; negative
	// is refused.
	MaxBatchBytes int
	// Lanes is how many batches may be in progress at once, each in its own transaction:
	// while one waits for its confirms, the next is claimed and published. Default
	// [DefaultLanes]. Give a [Publisher] a MaxInFlight of at least Lanes × BatchSize: a lane
	// whose batch finds no room waits, its rows locked, for the other lanes' confirms, and a
	// wait past the publisher's ConfirmTimeout is taken for an outage.
	Lanes int
	// PollInterval is how often the relay looks for due rows when nothing wakes it (a NOTIFY
	// from a committed Enqueue, if the driver can receive them). Default
	// [DefaultPollInterval], jittered. It bounds only the idle wait: a lane that saw the broker
	// refuse a row looks again when that row's Backoff runs out, if sooner, and one whose batch
	// failed tries again at BrokerRetry's pace, however long the poll.
	PollInterval time.Duration
	// Backoff schedules retries of a row the broker refused (nacked, returned, too large):
	// 2 s, 4 s, 8 s … up to [DefaultMaxBackoff] by default, jittered. The lane that recorded the
	// refusal claims again once the row is due (or sooner, woken by a NOTIFY or the poll); a
	// relay started since, or another replica, finds it at its next NOTIFY or poll.
	Backoff Backoff
	// BrokerRetry paces the relay's checks for the broker during an outage (its tries of one
	// row, in an outage no check can see: see [Relay.Run]), the batches after failed ones (a
	// database away, a Sender's wrong count of verdicts: each lane tries again after its next
	// step, whatever PollInterval), and, at its first step, the batch after one
	// whose rows the broker answered for but took nowhere. Its Max, or 500 ms if less, also
	// caps the wait between attempts to LISTEN again, which start at 500 ms. Default 100 ms
	// doubling up to 2 s, jittered: the relay resumes within about 2 s of the broker's or the
	// database's return.
	BrokerRetry Backoff
	// DisableNotify turns off the LISTEN/NOTIFY wake-up, leaving only polling. The relay does
	// not listen; Enqueue still sends its NOTIFY at commit unless given a driver of
	// [WithoutNotify], which spares every enqueuing commit a lock the whole server shares (see
	// there): pair the two.
	DisableNotify bool
	// SessionsPlanByIndex says every session of DB starts with enable_sort and enable_seqscan
	// off (runtime parameters of its connection string, say, on a pool of the relay's own,
	// with jit off too: a statement left with no index to use would carry a prohibitive cost
	// estimate, which has PostgreSQL compile it): each batch's transaction then does without
	// the statement that sets them for it, a round trip per batch. Leave it false unless every
	// connection of DB has them (a connection pooler may drop them): without them, the claim on
	// a table without statistics fetches and sorts the whole backlog, and a generic plan of
	// the marking scans the whole table.
	SessionsPlanByIndex bool
	// ShutdownGrace is how long a batch in progress may wait for the broker's confirms after
	// Run's context ends; what the broker confirmed by then is still recorded, within 2 s
	// more. Default [DefaultShutdownGrace].
	ShutdownGrace time.Duration
	Logger        *slog.Logger
	Metrics       *Metrics // optional
	// Types are the event types the relay is expected to publish, if known: their
	// outbox_messages_published_total and outbox_publish_failures_total are exported at zero
	// from NewRelay on, so that rate() and increase() count their first message. Another type
	// appears at its first.
	Types []string
	// TracerProvider makes the spans of the publishes, one per message: a child of the span
	// that enqueued it, or, for a message enqueued outside any trace, the root of a trace of
	// its own. Default: the global provider (a no-op unless the process installed one; the
	// trace context is passed on either way).
	TracerProvider trace.TracerProvider
	// Propagator reads a row's trace context, and writes the publish span's in its place.
	// Default: the global one.
	Propagator propagation.TextMapPropagator
}

// BatchResult tells what one [Relay.ProcessBatch] did.
type BatchResult struct {
	Claimed int // rows claimed
	Sent    int // confirmed by the broker and marked processed
	Failed  int // refused by the broker: attempts recorded with a backoff
	Unsent  int // no verdict (the broker unavailable, or the channel closed for another row): still due, attempts untouched
}

// Relay moves outbox rows to the broker: it claims due rows, publishes them, marks those the
// broker confirmed as processed and backs off those it refused, all in one transaction per
// batch. A crash before that commit leaves every row of the batch unprocessed, so they are
// published again later: delivery is at-least-once, and consumers deduplicate by message id.
type Relay struct {
	cfg    RelayConfig
	log    *slog.Logger
	outage outage
	tracer trace.Tracer
	// probe is the Sender, if it can be asked for the broker without a message; nil if not.
	probe brokerProbe
	// idleBound is how long the database lets a batch's transaction sit idle (idleBoundOf); 0
	// for no bound.
	idleBound time.Duration
	// spanOptions are the same for every publish span, rootSpanOptions for one that starts a
	// trace: made once.
	spanOptions, rootSpanOptions []trace.SpanStartOption
	// claimSize is how many rows the next whole batch claims, a lane's or ProcessBatch's: 0 for
	// BatchSize, fewer after batches cut by MaxBatchBytes (see nextSize).
	claimSize atomic.Int64
}

// NewRelay checks cfg and fills in its defaults.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	if cfg.DB == nil || cfg.Sender == nil || cfg.Exchange == "" {
		return nil, errors.New("relay: DB, Sender and Exchange are required")
	}
	if len(cfg.Exchange) > maxShortString {
		return nil, fmt.Errorf("relay: Exchange is %d bytes; AMQP allows %d", len(cfg.Exchange), maxShortString)
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = DefaultRelayBatchSize
	}
	switch {
	case cfg.MaxBatchBytes < 0:
		return nil, fmt.Errorf("relay: MaxBatchBytes is %d; it must be 0 (the default, %d) or more", cfg.MaxBatchBytes, DefaultMaxBatchBytes)
	case cfg.MaxBatchBytes == 0:
		cfg.MaxBatchBytes = DefaultMaxBatchBytes
	}
	if cfg.Lanes <= 0 {
		cfg.Lanes = DefaultLanes
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	cfg.Backoff = cfg.Backoff.withDefaults(2*time.Second, DefaultMaxBackoff)
	cfg.BrokerRetry = cfg.BrokerRetry.withDefaults(100*time.Millisecond, 2*time.Second)
	if cfg.ShutdownGrace <= 0 {
		cfg.ShutdownGrace = DefaultShutdownGrace
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.Propagator = propagatorOr(cfg.Propagator)
	cfg.Metrics.initRelay(cfg.Types)
	spanOptions := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
		semconv.MessagingSystemRabbitMQ, semconv.MessagingOperationTypeSend, semconv.MessagingOperationName("publish"))}
	probe, _ := cfg.Sender.(brokerProbe)
	return &Relay{
		cfg: cfg, probe: probe, idleBound: idleBoundOf(cfg.Sender, cfg.BatchSize), log: cfg.Logger.With("component", "relay", "exchange", cfg.Exchange),
		tracer:          newTracer(cfg.TracerProvider),
		spanOptions:     spanOptions,
		rootSpanOptions: append(slices.Clip(spanOptions), trace.WithNewRoot()),
	}, nil
}

// Run relays until ctx ends, then returns nil once the batches in progress are settled. Each lane
// drains without pause while its batches come back full (as many rows as they asked for, or cut
// by MaxBatchBytes) and sent, and otherwise waits for a NOTIFY from a committed [Enqueue] or the next poll, but no
// longer than until the next row it saw the broker refuse is due again (each row's
// [RelayConfig.Backoff]). A batch with rows left unsent is followed after BrokerRetry's first
// step, and a failed batch (the database away) after BrokerRetry's next step, whatever the poll;
// neither wait hears a NOTIFY. While the broker is unavailable the lanes claim nothing; they look
// for the broker again and resume as soon as it is back. An outage that such a look cannot see end
// (no confirm in time, or a channel the broker closed for a reason of no message, on a connection
// that stays up: see [ErrBrokerUnavailable]) ends only with a batch the broker gives verdicts on,
// or when no row is due: meanwhile one lane at a time claims and publishes one row, at
// BrokerRetry's pace (the oldest due row: if that row is what the broker cannot confirm, nothing
// moves until it can, or the row is parked; the relay logs the row once an outage). A Sender that
// cannot connect for a reason no broker can mend (a [Publisher] whose configuration names no
// broker) makes Run return that error at once.
//
// A batch's statements get no deadline of the relay's until Run stops (then the shutdown's, see
// [Relay.ProcessBatch]): a driver that honours a context's end by closing its socket (pgx)
// sends no cancel request, and the server's session runs on, unaware, holding its locks (a
// commit waiting for a synchronous standby, a claim waiting for a migration's lock), while the
// lane would claim the next batch on another session. A lane whose database connection goes
// silent learns of it from its driver's TCP connection (with pgx, Go's keepalive: 15 s idle,
// then 9 probes 15 s apart); the database frees a lost host's rows at the Sender's bound (see
// [Sender]) either way.
func (r *Relay) Run(ctx context.Context) error {
	if r.probe != nil {
		tried := time.Now()
		if err := r.probe.Connect(ctx); err != nil {
			if ctx.Err() != nil {
				return nil // stopped while it connected: no outage to report, nor a gauge to drop
			}
			if !errors.Is(err, ErrBrokerUnavailable) {
				return fmt.Errorf("relay: %w", err)
			}
			r.brokerDown(err)
		} else {
			r.brokerUp(ctx, tried, false)
		}
	}
	wake := newWakeup()
	var wg sync.WaitGroup
	if !r.cfg.DisableNotify {
		wg.Go(func() { r.listen(ctx, wake) })
	}
	for range r.cfg.Lanes {
		wg.Go(func() { r.lane(ctx, wake) })
	}
	wg.Wait()
	return nil
}

// lane runs batches one after another until ctx ends.
func (r *Relay) lane(ctx context.Context, wake wakeup) {
	failed := 0 // batches failed in a row
	// due holds, in order, when the rows this lane saw the broker refuse are due again, while
	// that is ahead. Nothing NOTIFYs when a backoff runs out, and a claim at one row's time finds
	// only the rows due by then: each time is kept (see addDue), and the lane waits no longer
	// than the earliest.
	var due []time.Time
	for ctx.Err() == nil {
		limit, trial := r.wholeBatch(), false
		switch down, silent := r.outageState(); {
		case silent:
			// No probe sees this outage end, only a batch the broker answers for (or a claim
			// that finds no row due): one lane at a time tries one row, at BrokerRetry's pace.
			wait, ok := r.startTrial()
			if !ok {
				sleep(ctx, nil, wait)
				continue
			}
			limit, trial = trialBatch, true
		case down && r.probe != nil:
			// Run's first look, or another lane, found the broker gone: claim nothing, which
			// would hold the rows locked while the publish dials, until the probe finds it.
			r.awaitBroker(ctx, 1)
			continue
		}
		started := time.Now()
		r.batchStarts(trial)
		// Due by now: this batch claims those rows, or it is full and the lane drains on (the
		// claim takes the oldest rows first); a batch that fails is followed by more.
		due = slices.Delete(due, 0, sort.Search(len(due), func(i int) bool { return due[i].After(started) }))
		s, err := r.processBatch(ctx, limit, trial)
		res := s.res
		if len(s.failures) > 0 {
			// Counted from now, after the commit, on this process's clock: each row, dated by
			// the database's at its refusal (next_attempt_at, of another clock), is due by then.
			now := time.Now()
			for _, f := range s.failures {
				due = addDue(due, now.Add(f.delay), f.delay)
			}
		}
		// First what the batch says of the broker, then the trial's end, then the wait: a
		// trial ended before its outcome is recorded would let another lane start one, at the
		// outage's end or before its next retry is due.
		var wait func()
		switch {
		case ctx.Err() != nil:
			r.batchEnds(trial)
			return
		case errors.Is(err, ErrBrokerUnavailable):
			failures := r.brokerDown(err)
			if trial && s.unconfirmed != nil {
				r.trialFailed(ctx, *s.unconfirmed, err)
			}
			wait = func() { r.awaitBroker(ctx, failures) }
		case err != nil:
			// Paced as a broker's checks (100 ms doubling to 2 s by default), not as the poll:
			// a wait of a whole long poll, deaf to wakes, would leave the rows of a database
			// back after a blip for an hour where NOTIFY carries the traffic; one of a short
			// poll (10 ms at least) would have every lane retry, and log, a database away about
			// a hundred times a second.
			failed++
			r.log.Error("relay batch failed", "error", err)
			wait = func() { sleep(ctx, nil, r.cfg.BrokerRetry.Delay(failed)) }
		case res.Claimed == 0 && r.isBrokerLost() && r.probe != nil:
			// Another lane found the broker gone while this one claimed nothing: an empty
			// claim never reached the broker, so look for it, that its return is known (and
			// outbox_relay_broker_up says so) before the next row. A Sender that cannot be
			// probed learns it from the next row's publish.
			wait = func() { r.awaitBroker(ctx, 1) }
		case res.Claimed == 0 && r.lostWhileIdle(ctx):
			// Nor does it see the broker go: the outage begins now, not at the next row.
			wait = func() { r.awaitBroker(ctx, 1) }
		case trial && res.Claimed == 0:
			// No row is claimable: none is due (the one the broker confirmed nothing of was
			// parked, say), or one is held locked elsewhere (s.dueHeld). With none due, none is
			// left to confirm: waiting for a verdict, the outage would last until the next row
			// is enqueued, the gauge at 0 and the alert firing meanwhile.
			failed = 0
			wait = func() {} // the next trial, paced by startTrial
			if r.trialFoundNothing(ctx, started, s.dueHeld) {
				wait = r.afterBatch(ctx, wake, res, false, due)
			}
		default:
			failed = 0
			// Only rows given to the Sender heard from the broker: not an empty claim, nor one
			// of rows that could not be read, which a Sender without a probe would take for
			// the broker's return.
			if s.published {
				r.brokerUp(ctx, started, s.answered)
			}
			// A batch the bytes bound cut (s.cut) left due rows behind its last, as a full one.
			wait = r.afterBatch(ctx, wake, res, res.Claimed == limit || s.cut, due)
		}
		r.batchEnds(trial)
		wait()
	}
}

// afterBatch is how a lane waits after a batch that did not fail: the broker answered for its
// rows, or it claimed none. full says the claim may have left due rows: it took as many as it
// asked for, or the bytes bound cut it.
func (r *Relay) afterBatch(ctx context.Context, wake wakeup, res BatchResult, full bool, due []time.Time) func() {
	switch {
	case res.Unsent > 0:
		// The broker answered but took some rows nowhere (a channel it closed for another row,
		// a row whose earlier publish is still in flight): paced as a retry, not claimed again
		// at once, which spins while those rows wait.
		return func() { sleep(ctx, nil, r.cfg.BrokerRetry.Delay(1)) }
	case full:
		return wake.signal // more is waiting: another lane may join
	}
	return func() {
		wait := jittered(r.cfg.PollInterval)
		if len(due) > 0 {
			wait = min(wait, time.Until(due[0]))
		}
		sleep(ctx, wake, wait)
	}
}

// wholeBatch is how many rows the next batch that is not a trial claims.
func (r *Relay) wholeBatch() int {
	if n := r.claimSize.Load(); n > 0 {
		return int(n)
	}
	return r.cfg.BatchSize
}

// nextSize is how many rows the next whole batch claims, a lane's or ProcessBatch's (a loop
// of them, as the services' last pass at a stop), after one that claimed up to limit and kept
// claimed, cut by the bytes bound if cut. The server sends every row a claim
// locks, and a cut claim reads those past the bound off the connection for nothing: at the
// default BatchSize, 500 rows of 1 MB for the 16 a batch keeps, and the rest of a backlog of
// large rows again at each batch. After a cut the lane claims twice what the batch kept, and
// twice as many at each batch that comes back full, up to BatchSize; after one that found
// fewer rows due than it asked for, BatchSize again.
func (r *Relay) nextSize(limit, claimed int, cut bool) int {
	double := func(n int) int {
		if n >= r.cfg.BatchSize/2 {
			return r.cfg.BatchSize
		}
		return max(2*n, 1)
	}
	switch {
	case cut:
		return double(claimed)
	case claimed == limit:
		return double(limit)
	}
	return r.cfg.BatchSize
}

// settleWait is how long a transaction outlives the context of the work it records, to record
// it and commit: a relay batch's, the wait for its confirms, ended by the shutdown grace (ended
// with the wait, the transaction, which database/sql rolls back when its context ends, took the
// confirmed rows with it, to be sent again at the next start); a cleanup batch's, its caller's
// (see runBatch). Bounded: a database that stops answering would hold the shutdown until TCP
// gives the connection up.
const settleWait = 2 * time.Second

// ProcessBatch claims, publishes and settles one batch of due rows in one transaction. When
// the broker gave no verdict on some rows (see [ErrBrokerUnavailable]), the rest is still
// settled and committed, those rows stay due, and the error says why; but not when the broker
// is there, and closed the channel for another row's refusal: those rows, counted in Unsent,
// go at the next batch. A batch holds payloads of at most [RelayConfig.MaxBatchBytes] (its
// first row aside): one that claims fewer than BatchSize rows does not say the outbox is
// drained, one that claims none does.
//
// It outlives ctx: a batch under way when ctx ends waits up to [RelayConfig.ShutdownGrace] more
// for the broker's confirms, then up to 2 s more to record them and commit, and, if that
// fails, up to 2 s more for the rollback. Cut off with ctx, a batch would leave rows the
// broker took unmarked, sent again at the next start.
func (r *Relay) ProcessBatch(parent context.Context) (BatchResult, error) {
	s, err := r.processBatch(parent, r.wholeBatch(), false)
	return s.res, err
}

// processBatch is ProcessBatch of up to limit rows, a silent outage's trial if trial, returning
// the whole settlement: a lane also asks whether the batch reached the Sender, and, of a trial
// that claimed nothing, whether a row is due all the same.
func (r *Relay) processBatch(parent context.Context, limit int, trial bool) (settlement, error) {
	ctx, cancel := withGrace(parent, r.cfg.ShutdownGrace)
	defer cancel()
	txCtx, cancelTx := withGrace(ctx, settleWait)
	defer cancelTx()

	s, err := r.batch(txCtx, ctx, limit, trial)
	if err != nil {
		return settlement{res: BatchResult{Claimed: s.res.Claimed}}, err
	}
	if !trial {
		// Lanes share it: a cut in one says the rows at the head of the outbox are large.
		r.claimSize.Store(int64(r.nextSize(limit, s.res.Claimed, s.cut)))
	}
	r.report(ctx, s)
	return s, s.brokerErr
}

// batch is ProcessBatch's transaction: claim up to limit rows, publish, settle, commit. The
// transaction's statements run under ctx; the publish, and so the wait for its confirms, under
// publishCtx, which ends first. A trial that claims nothing says whether a row is due all the
// same (s.dueHeld, see dueHeld).
func (r *Relay) batch(ctx, publishCtx context.Context, limit int, trial bool) (s settlement, err error) {
	tx, err := r.cfg.DB.Begin(ctx)
	if err != nil {
		return s, fmt.Errorf("begin outbox batch: %w", err)
	}
	var pub publication
	committed := false
	defer func() {
		if !committed { // an error, or nothing to claim
			rollback(ctx, tx)
		}
		// Once the transaction is over: a span processor that exports each span as it ends
		// (with a slow exporter) must not keep the transaction idle, past its bound.
		pub.endSpans()
	}()
	msgs, attempts, unreadable, cut, err := r.claim(ctx, tx, limit)
	if err != nil {
		return settlement{}, err
	}
	if len(msgs) == 0 {
		if trial {
			if s.dueHeld, err = r.dueHeld(ctx, tx); err != nil {
				return settlement{}, err
			}
		}
		return s, nil
	}
	pub, err = r.publish(publishCtx, msgs, unreadable)
	if err != nil {
		return settlement{res: BatchResult{Claimed: len(msgs)}}, err
	}
	if s, err = r.settle(ctx, tx, msgs, attempts, pub.verdicts); err != nil {
		return s, err
	}
	s.published, s.answered, s.cut = pub.published, pub.answered, cut
	if err := tx.Commit(ctx); err != nil {
		return s, fmt.Errorf("commit outbox batch: %w", err)
	}
	committed = true
	return s, nil
}

// publication is what a batch's publish did.
type publication struct {
	verdicts  []error // one per claimed row
	published bool    // some row went to the Sender
	answered  bool    // the broker answered the publish of some row (see brokerAnswered)
	// spans are the publish spans, by message sent, and outcomes what each ends with.
	spans    []trace.Span
	outcomes []error
}

// endSpans ends the publish spans with their outcomes.
func (p publication) endSpans() {
	for i, span := range p.spans {
		if span != nil {
			endSpan(span, p.outcomes[i])
		}
	}
}

// publish sends the messages and returns their verdicts, whether it gave the Sender any, and
// whether the broker answered for any. A row that could not be read as a message is not sent,
// and the reason is its verdict: backed off like any refused row, it cannot head every claim
// and hold up the rows behind it. A Sender that answers for a different number of messages
// than it was given is an error: no verdict can be matched to its row, so the batch is rolled
// back and every row stays due, its attempts untouched. The publish spans are left to end.
func (r *Relay) publish(ctx context.Context, msgs []Message, unreadable []error) (p publication, err error) {
	send, at := msgs, []int(nil)
	if unreadable != nil {
		send = make([]Message, 0, len(msgs))
		for i, err := range unreadable {
			if err == nil {
				send, at = append(send, msgs[i]), append(at, i)
			}
		}
	}
	p.published = len(send) > 0
	if !p.published {
		p.verdicts = unreadable
		return p, nil
	}
	p.spans = r.startPublishSpans(ctx, send)
	verdicts := r.cfg.Sender.Publish(ctx, send)
	if len(verdicts) != len(send) {
		err := fmt.Errorf("relay: the Sender gave %d verdicts for %d messages", len(verdicts), len(send))
		p.outcomes = slices.Repeat([]error{err}, len(send))
		return p, err
	}
	p.outcomes, p.answered = verdicts, slices.ContainsFunc(verdicts, brokerAnswered)
	if unreadable == nil {
		p.verdicts = verdicts
		return p, nil
	}
	for j, i := range at {
		unreadable[i] = verdicts[j]
		msgs[i] = send[j] // with the publish span's trace context, which its lines are logged in
	}
	p.verdicts = unreadable
	return p, nil
}

// brokerAnswered says whether verdict is the broker's answer to a message's publish: its
// confirm (nil, ErrNacked; ErrUnroutable, returned before it), or the reason it closed the
// channel for the message. Only that says the broker confirms again; not a check before the
// publish (ErrTooLarge by MaxMessageBytes, ErrInvalidEnvelope, an exchange's passive declare).
func brokerAnswered(verdict error) bool {
	var closed closedFor
	return verdict == nil || errors.Is(verdict, ErrNacked) || errors.Is(verdict, ErrUnroutable) || errors.As(verdict, &closed)
}

// claim locks the oldest due rows, up to limit, and returns them as the messages to publish
// (the rows of earlier versions, which name no exchange, to the relay's) with the failed
// attempts of each so far. unreadable, nil if every row could be read, holds why a row cannot
// be sent as it is (headers written by hand that are not a JSON object of strings). With an
// idleBound, the claim also has the database end the transaction once it sits idle longer.
//
// It keeps the rows, in their order, while their payloads add up to no more than MaxBatchBytes,
// the first whatever its size, and says whether it cut the batch there: the rows it locked after
// are left as they are, neither marked nor charged, and are due again once the batch's transaction
// ends. They are the batch's newest, but stay locked until then: another lane, or relay, may send
// rows newer still before them, as it may the rows of any batch in progress (the relay promises no
// order across its lanes). The cursor is closed at the cut: pgx and database/sql (lib/pq's and
// pgx's stdlib, GORM's) read the rest of its rows off the connection one at a time, keeping none,
// and the transaction goes on.
func (r *Relay) claim(ctx context.Context, tx Executor, limit int) (msgs []Message, attempts []int, unreadable []error, cut bool, err error) {
	if !r.cfg.SessionsPlanByIndex {
		if _, err := tx.Exec(ctx, statements.ClaimPlan); err != nil {
			return nil, nil, nil, false, fmt.Errorf("claim outbox batch: %w", err)
		}
	}
	var cursor Rows
	if r.idleBound > 0 {
		cursor, err = tx.Query(ctx, statements.ClaimBounded, limit, strconv.FormatInt(r.idleBound.Milliseconds(), 10))
	} else {
		cursor, err = tx.Query(ctx, statements.Claim, limit)
	}
	if err != nil {
		return nil, nil, nil, false, fmt.Errorf("claim outbox batch: %w", err)
	}
	closed := false
	defer func() {
		if !closed {
			cursor.Close()
		}
	}()
	msgs, attempts = make([]Message, 0, limit), make([]int, 0, limit)
	held := 0 // bytes of the kept rows' payloads
	for cursor.Next() {
		var m Message
		var n int
		var payload []byte
		var exchange, routingKey, headers *string
		if err := cursor.Scan(&m.ID, &m.Type, &payload, &m.CorrelationID, &m.OccurredAt, &n, &m.TraceParent, &m.TraceState,
			&exchange, &routingKey, &headers); err != nil {
			return nil, nil, nil, false, fmt.Errorf("claim outbox batch: %w", err)
		}
		if len(msgs) > 0 && len(payload) > r.cfg.MaxBatchBytes-held {
			cut = true
			break
		}
		held += len(payload)
		m.Payload, m.Exchange, m.RoutingKey = payload, r.cfg.Exchange, deref(routingKey)
		if exchange != nil {
			m.Exchange = *exchange
		}
		var bad error
		if headers != nil {
			if m.Headers, err = parseHeaders(*headers); err != nil {
				bad = fmt.Errorf("the row's headers are not a JSON object of strings: %w", err)
			}
		}
		if bad != nil && unreadable == nil {
			unreadable = make([]error, len(msgs), limit)
		}
		if unreadable != nil {
			unreadable = append(unreadable, bad)
		}
		msgs, attempts = append(msgs, m), append(attempts, n)
	}
	if cut {
		// Before the publish: pgx reports here a failure to read the rest (the connection
		// lost), which would otherwise surface only after the rows had gone to the broker.
		cursor.Close()
		closed = true
	}
	if err := cursor.Err(); err != nil {
		return nil, nil, nil, false, fmt.Errorf("claim outbox batch: %w", err)
	}
	return msgs, attempts, unreadable, cut, nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// parseHeaders reads a row's headers, a JSON object of strings.
func parseHeaders(raw string) (map[string]string, error) {
	var h map[string]string
	err := json.Unmarshal([]byte(raw), &h)
	return h, err
}

// startPublishSpans starts a producer span for each message, as a child of the span that
// enqueued it, and makes that span the message's trace context: the consumers' spans become
// its children. A message enqueued outside any trace (a row written by hand, or by a program
// that traces nothing) starts a trace of its own here, so that the relay's lines about it, and
// its consumers', carry one. The spans are returned by message index; nil altogether without a
// tracer provider, when no message had a trace context to pass on.
func (r *Relay) startPublishSpans(ctx context.Context, msgs []Message) []trace.Span {
	// Without the span of the caller's context, if it has one (Run's, say): an untraced row
	// starts a trace of its own, not a child of a span as long as the process.
	ctx = trace.ContextWithSpanContext(ctx, trace.SpanContext{})
	var spans []trace.Span
	for i := range msgs {
		m := &msgs[i]
		parent := m.traced(ctx, r.cfg.Propagator)
		psc := trace.SpanContextFromContext(parent)
		options := r.spanOptions
		if !psc.IsValid() {
			options = r.rootSpanOptions
		}
		spanCtx, span := r.tracer.Start(parent, "publish "+m.Exchange, options...)
		if !span.SpanContext().IsValid() {
			continue // no tracer provider, and no trace context to pass on: sent as it is
		}
		if spans == nil {
			spans = make([]trace.Span, len(msgs))
		}
		messageAttributes(span, *m)
		if span.IsRecording() {
			span.SetAttributes(semconv.MessagingDestinationName(m.Exchange))
		}
		spans[i] = span
		// Without a tracer provider the span is the parent itself: the stored context goes on
		// as it is, with no formatting.
		if span.SpanContext().SpanID() != psc.SpanID() {
			m.withTraceOf(spanCtx, r.cfg.Propagator)
		}
	}
	return spans
}

// uuidArray writes ids as a PostgreSQL array literal, {a,b,…}.
func uuidArray(ids []uuid.UUID) string {
	var b strings.Builder
	b.Grow(len(ids)*37 + 2)
	b.WriteByte('{')
	for i, id := range ids {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(id.String())
	}
	b.WriteByte('}')
	return b.String()
}

// settlement is what a batch did, kept to be logged and counted after its commit, so neither
// reports a state the database does not hold.
type settlement struct {
	res       BatchResult
	sentTypes []string
	failures  []failure
	brokerErr error
	published bool // some row went to the Sender, whose verdicts say whether the broker answers
	answered  bool // the broker answered the publish of some row (see brokerAnswered)
	// unconfirmed is the first row given no verdict on a connection still up (errUnconfirmed):
	// the row of a failed trial, logged.
	unconfirmed *Message
	// dueHeld: the claim, a trial's, found no row, and a row is due all the same, locked by
	// another transaction (another lane's whole batch, another replica's trial or batch).
	dueHeld bool
	// cut: the claim left rows it had locked for the bytes bound (RelayConfig.MaxBatchBytes),
	// due again at the commit.
	cut bool
}

type failure struct {
	msg           Message
	attempts      int
	delay         time.Duration
	nextAttemptAt time.Time
	err           error
}

// dueGrain is the least by which addDue rounds a refused row's due time up.
const dueGrain = 50 * time.Millisecond

// addDue adds to due, kept in order, the time at which a row backed off by delay is due,
// rounded up to a grain of at most a twentieth of delay (the backoff's jitter is wider), at
// least dueGrain and a power of two times it, so that grains nest: rows refused at about the
// same time share one, and due stays short however many rows a storm of refusals backs off.
func addDue(due []time.Time, at time.Time, delay time.Duration) []time.Time {
	grain := dueGrain
	for grain*2 <= delay/20 {
		grain *= 2
	}
	// Up to the next grain, keeping the monotonic reading (Truncate drops it): a step of the
	// wall clock must not make a time due early, nor late.
	at = at.Add(grain - at.Sub(at.Truncate(grain)))
	i, found := slices.BinarySearchFunc(due, at, time.Time.Compare)
	if found {
		return due
	}
	return slices.Insert(due, i, at)
}

// settle records the verdicts in tx: marks what was sent, backs off what the broker refused,
// and leaves alone what it gave no verdict on.
func (r *Relay) settle(ctx context.Context, tx Executor, msgs []Message, attempts []int, verdicts []error) (settlement, error) {
	s := settlement{res: BatchResult{Claimed: len(msgs)}}
	sent := make([]uuid.UUID, 0, len(msgs))
	for i, err := range verdicts {
		switch {
		case err == nil:
			sent = append(sent, msgs[i].ID)
			s.sentTypes = append(s.sentTypes, msgs[i].Type)
		case errors.Is(err, ErrBrokerUnavailable):
			s.res.Unsent++
			// The first, or the first that a probe cannot see end (errUnconfirmed): that one
			// says how the relay waits.
			if !errors.Is(err, errNotAnOutage) &&
				(s.brokerErr == nil || errors.Is(err, errUnconfirmed) && !errors.Is(s.brokerErr, errUnconfirmed)) {
				s.brokerErr = err
			}
			if s.unconfirmed == nil && errors.Is(err, errUnconfirmed) {
				s.unconfirmed = &msgs[i]
			}
		default:
			f := failure{msg: msgs[i], attempts: attempts[i] + 1, err: err}
			f.delay = r.cfg.Backoff.Delay(f.attempts)
			s.failures = append(s.failures, f)
		}
	}
	if len(s.failures) > 0 {
		if err := recordFailures(ctx, tx, s.failures); err != nil {
			return s, err
		}
	}
	if len(sent) > 0 {
		if _, err := tx.Exec(ctx, statements.MarkSent, uuidArray(sent)); err != nil {
			return s, fmt.Errorf("mark %d outbox rows sent: %w", len(sent), err)
		}
	}
	s.res.Sent, s.res.Failed = len(sent), len(s.failures)
	return s, nil
}

// recordFailures backs the rows of fs off, in one statement, and reads when each is due again.
func recordFailures(ctx context.Context, tx Executor, fs []failure) error {
	type refusal struct {
		Error   string `json:"error"`
		DelayMS int64  `json:"delay_ms"`
	}
	ids := make([]uuid.UUID, len(fs))
	byID := make(map[string]refusal, len(fs))
	at := make(map[uuid.UUID]*failure, len(fs))
	for i := range fs {
		f := &fs[i]
		ids[i], at[f.msg.ID] = f.msg.ID, f
		byID[f.msg.ID.String()] = refusal{Error: storableText(f.err.Error()), DelayMS: f.delay.Milliseconds()}
	}
	refusals, err := json.Marshal(byID)
	if err != nil {
		return fmt.Errorf("record %d publish failures: %w", len(fs), err)
	}
	rows, err := tx.Query(ctx, statements.RecordFailures, uuidArray(ids), string(refusals))
	if err != nil {
		return fmt.Errorf("record %d publish failures: %w", len(fs), err)
	}
	defer rows.Close()
	recorded := 0
	for rows.Next() {
		var id uuid.UUID
		var next time.Time
		if err := rows.Scan(&id, &next); err != nil {
			return fmt.Errorf("record %d publish failures: %w", len(fs), err)
		}
		if f := at[id]; f != nil {
			f.nextAttemptAt = next
			recorded++
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("record %d publish failures: %w", len(fs), err)
	}
	if recorded != len(fs) {
		return fmt.Errorf("record %d publish failures: %d rows recorded", len(fs), recorded)
	}
	return nil
}

// storableText is text as a text column takes it: a Sender's error may quote a server's reply,
// and a broker's reason cut at its length limit may end inside a character. PostgreSQL refuses
// a NUL or invalid UTF-8, and a refused record of one row's failure would roll back its whole
// batch, the marks of the rows the broker confirmed included, at every attempt.
func storableText(s string) string {
	return strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", ""), "\uFFFD")
}

// report logs and counts what a committed batch did. A line about one message carries that
// message's trace context.
func (r *Relay) report(ctx context.Context, s settlement) {
	for _, t := range s.sentTypes {
		r.cfg.Metrics.recordPublished(t)
	}
	for _, f := range s.failures {
		r.cfg.Metrics.recordPublishFailure(f.msg.Type)
		r.log.WarnContext(f.msg.traced(ctx, r.cfg.Propagator), "outbox publish failed",
			"message_id", f.msg.ID, "type", f.msg.Type, "attempts", f.attempts,
			"retry_in", f.delay, "next_attempt_at", f.nextAttemptAt.UTC().Format(time.RFC3339Nano), "error", f.err)
	}
	if s.res.Sent > 0 {
		r.log.Debug("outbox batch sent", "sent", s.res.Sent, "claimed", s.res.Claimed)
	}
}

// outage is the relay's view of the broker, shared by its lanes.
type outage struct {
	mu       sync.Mutex
	since    time.Time // zero while the broker is up
	latest   time.Time // the outage's latest failure (since, at its first); zero while the broker is up
	failures int       // the batches and probes it failed so far, which pace the retries
	// silent: the outage began with, or met, a failure on a connection that stayed up
	// (errUnconfirmed: no confirm in time, a channel closed for no known message's fault). A
	// probe, which finds a connection, cannot see it end; a batch the broker answers for ends
	// it, or a trial that finds no row due. trying says a lane's trial batch is out; next is
	// when the next may start; rowLogged, that a failed trial's row was logged.
	silent    bool
	trying    bool
	next      time.Time
	rowLogged bool
	// batches counts the lanes' whole batches out (begun before the outage did, or as it did):
	// rows they hold locked, which a trial's claim skips.
	batches int
}

// brokerDown starts an outage, unless one is on: logged once, however many lanes and batches
// run into it; one on is dated by its latest failure too (see endOutage). It returns the
// failures so far.
func (r *Relay) brokerDown(err error) (failures int) {
	r.outage.mu.Lock()
	defer r.outage.mu.Unlock()
	r.cfg.Metrics.setBrokerUp(r.cfg.Exchange, false)
	r.outage.failures++
	r.outage.latest = time.Now()
	if errors.Is(err, errUnconfirmed) {
		r.outage.silent = true
	}
	if r.outage.silent {
		r.outage.next = time.Now().Add(r.cfg.BrokerRetry.Delay(r.outage.failures))
	}
	if !r.outage.since.IsZero() {
		return r.outage.failures
	}
	r.outage.since = r.outage.latest
	r.log.Warn("broker unavailable; relay paused, rows wait in the outbox", "error", err)
	return r.outage.failures
}

// brokerUp ends the outage, if one is on, with one line: how long it lasted and how many rows
// waited (they go out now); the broker answered something begun at since (after the outage's
// latest failure, or it ends nothing: see endOutage), with a verdict on a message if verdict
// (only that, or a trial that found no row due, ends a silent outage). The count reads every
// unsent row, so it runs after the lock is let go: the other lanes, which ask whether the
// broker is down at each turn, go on meanwhile.
func (r *Relay) brokerUp(ctx context.Context, since time.Time, verdict bool) {
	lasted, ended := r.endOutage(since, verdict)
	if !ended {
		return
	}
	waiting, err := r.countWaiting(ctx)
	if err != nil {
		waiting = -1 // unknown; the outage is over all the same
	}
	r.log.Info("broker available again; relay resumed", "outage", lasted.Round(time.Millisecond), "rows_waiting", waiting)
}

// countWaiting counts the unsent rows, every one: on sessions that plan by index, in a
// transaction that lets it scan the table instead (statements.ScanPlan).
func (r *Relay) countWaiting(ctx context.Context) (int64, error) {
	if !r.cfg.SessionsPlanByIndex {
		stats, err := ReadOutboxStats(ctx, r.cfg.DB)
		return stats.Pending, err
	}
	tx, err := r.cfg.DB.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer rollback(ctx, tx) // it only reads
	if _, err := tx.Exec(ctx, statements.ScanPlan); err != nil {
		return 0, err
	}
	stats, err := ReadOutboxStats(ctx, tx)
	return stats.Pending, err
}

// endOutage ends the outage, if one is on, and says how long it lasted; unless its latest
// failure came after since (its first, or a later one): a batch or probe begun before a lane's
// batch failed, whose answer came in after, says nothing about the broker after that failure,
// and ending the outage on it would let the lanes claim whole batches again, into a broker that
// just failed one (and, for the first, log the outage twice); a probe or batch begun after it
// ends it. Nor a silent one without a verdict: a new connection, which a probe or a batch of no
// verdict found, is what it had all along.
func (r *Relay) endOutage(since time.Time, verdict bool) (lasted time.Duration, ended bool) {
	r.outage.mu.Lock()
	defer r.outage.mu.Unlock()
	if r.outage.latest.After(since) || r.outage.silent && !verdict {
		return 0, false
	}
	r.cfg.Metrics.setBrokerUp(r.cfg.Exchange, true)
	if r.outage.since.IsZero() {
		return 0, false
	}
	lasted = time.Since(r.outage.since)
	r.outage.since, r.outage.latest, r.outage.failures, r.outage.silent, r.outage.rowLogged = time.Time{}, time.Time{}, 0, false, false
	return lasted, true
}

// outageState says whether an outage is on, and whether it is silent.
func (r *Relay) outageState() (down, silent bool) {
	r.outage.mu.Lock()
	defer r.outage.mu.Unlock()
	return !r.outage.since.IsZero(), r.outage.silent
}

// isBrokerLost says whether an outage that a probe can see end is on.
func (r *Relay) isBrokerLost() bool {
	down, silent := r.outageState()
	return down && !silent
}

// startTrial gives the lane the trial batch of a silent outage, unless the outage is over,
// another lane's trial is out, or the next is not due yet: then it says how long to wait
// before asking again.
func (r *Relay) startTrial() (wait time.Duration, ok bool) {
	r.outage.mu.Lock()
	defer r.outage.mu.Unlock()
	switch {
	case !r.outage.silent:
		return 0, false
	case r.outage.trying:
		return r.cfg.BrokerRetry.Delay(1), false
	case time.Now().Before(r.outage.next):
		return time.Until(r.outage.next), false
	}
	r.outage.trying = true
	return 0, true
}

// batchStarts counts a lane's whole batch out; a trial batch is counted by startTrial.
func (r *Relay) batchStarts(trial bool) {
	if trial {
		return
	}
	r.outage.mu.Lock()
	defer r.outage.mu.Unlock()
	r.outage.batches++
}

// batchEnds says the lane's batch, a trial or a whole one, is over, its outcome recorded.
func (r *Relay) batchEnds(trial bool) {
	r.outage.mu.Lock()
	defer r.outage.mu.Unlock()
	if trial {
		r.outage.trying = false
	} else {
		r.outage.batches--
	}
}

// dueHeld says, after a trial's claim, in tx, found no row, whether one is due all the same:
// locked, which the claim skipped (SKIP LOCKED). Another lane's whole batch still out holds its
// rows (no lane starts one during the outage, and trials are one at a time, so no other lane
// holds a row otherwise); without one, the database is asked, in tx, under the claim's plan
// settings, for a row another session holds: another replica's trial or batch, say.
func (r *Relay) dueHeld(ctx context.Context, tx TxExecutor) (bool, error) {
	r.outage.mu.Lock()
	lanes := r.outage.batches > 0
	r.outage.mu.Unlock()
	if lanes {
		return true, nil
	}
	var due bool
	if err := queryRow(ctx, tx, []any{&due}, statements.AnyDue); err != nil {
		return false, fmt.Errorf("ask whether an outbox row is due: %w", err)
	}
	return due, nil
}

// trialFoundNothing ends a silent outage whose trial, begun at since, claimed no row, and says
// whether it did: unless a row is due all the same (dueHeld), none waits for the broker (a row
// parked, or backed off until later, waits for no broker). A due row held locked waits for it
// as this relay's rows would: the outcome of the batch that holds it, or a later trial, at
// BrokerRetry's pace, tells.
func (r *Relay) trialFoundNothing(ctx context.Context, since time.Time, dueHeld bool) bool {
	if dueHeld {
		r.outage.mu.Lock()
		r.outage.next = time.Now().Add(r.cfg.BrokerRetry.Delay(r.outage.failures))
		r.outage.mu.Unlock()
		return false
	}
	r.brokerUp(ctx, since, true)
	return true
}

// trialFailed logs, once an outage, the row whose trial the broker gave no verdict on: the
// oldest due row, which every trial claims again while no other session holds it. If that row
// is what the broker cannot confirm (its quorum queue lost its majority), this relay's trials
// move no row, however healthy their queues, until the broker confirms it or an operator parks
// it. Another replica's trial, finding it locked, takes the next row, and the broker's confirm
// of that row ends the replica's outage, until its next whole batch takes the row again.
func (r *Relay) trialFailed(ctx context.Context, m Message, err error) {
	r.outage.mu.Lock()
	logged := r.outage.rowLogged
	r.outage.rowLogged = true
	r.outage.mu.Unlock()
	if logged {
		return
	}
	r.log.WarnContext(m.traced(ctx, r.cfg.Propagator),
		"the broker confirms nothing of the row the relay tries during the outage; it is tried again, the oldest due row, until confirmed or parked (outboxctl outbox park sets it aside)",
		"message_id", m.ID, "type", m.Type, "message_exchange", m.Exchange, "routing_key", m.routingKey(), "error", err)
}

// lostWhileIdle asks a Sender that can be probed whether it still has the broker, a check of
// its connection that costs no round trip while the connection is up, and starts the outage if
// not. A Sender that cannot be probed learns it from the next row's publish.
func (r *Relay) lostWhileIdle(ctx context.Context) bool {
	if r.probe == nil {
		return false
	}
	err := r.probe.Connect(ctx)
	if err == nil || !errors.Is(err, ErrBrokerUnavailable) || ctx.Err() != nil {
		return false
	}
	r.brokerDown(err)
	return true
}

// awaitBroker returns once the broker looks available again, or ctx ends; the outage has
// failed failures times so far. Without a probe on the Sender, or in a silent outage, it
// returns after one retry delay, the next for each batch the outage fails, and the next batch
// finds out.
func (r *Relay) awaitBroker(ctx context.Context, failures int) {
	for ; ; failures++ {
		if !sleep(ctx, nil, r.cfg.BrokerRetry.Delay(failures)) || r.probe == nil || !r.isBrokerLost() {
			return
		}
		if tried := time.Now(); r.probe.Connect(ctx) == nil {
			r.brokerUp(ctx, tried, false)
			return
		}
	}
}

// listen wakes the relay on every NOTIFY, on a connection of its own taken from the pool for
// as long as the relay runs (size the pool for it). While it cannot listen, polling still
// moves everything, only later.
func (r *Relay) listen(ctx context.Context, wake wakeup) {
	reconnect(ctx, r.listenRetry(), r.log,
		"relay lost its LISTEN connection; polling meanwhile",
		func(ctx context.Context) (bool, error) {
			listened, err := r.listenOnce(ctx, wake)
			if errors.Is(err, ErrNoNotifications) {
				r.log.Info("the database driver cannot receive notifications; the relay polls", "poll_interval", r.cfg.PollInterval)
				<-ctx.Done()
			}
			return listened, err
		})
}

// listenRetry paces the attempts to LISTEN again: from 500 ms, doubling up to the lanes' cap on
// their retries of a failed batch (BrokerRetry's Max, 2 s by default), or 500 ms if that is
// less, all jittered. After a database outage the lanes are back within that cap, and so must be
// the wakes: with a long poll, events enqueued meanwhile would otherwise wait for a longer
// backoff. The floor keeps a small Max (10 ms) from having the listener try, and log, a
// database away a hundred times a second.
func (r *Relay) listenRetry() Backoff {
	return Backoff{Base: 500 * time.Millisecond, Max: max(r.cfg.BrokerRetry.Max, 500*time.Millisecond),
		Jitter: r.cfg.BrokerRetry.Jitter}
}

// listenOnce listens until its connection fails; listened reports whether LISTEN succeeded.
// A driver that cannot receive notifications ends it for good: the relay polls.
func (r *Relay) listenOnce(ctx context.Context, wake wakeup) (listened bool, err error) {
	conn, err := r.cfg.DB.Conn(ctx)
	if err != nil {
		return false, fmt.Errorf("listen: take a connection: %w", err)
	}
	discard := false
	defer func() {
		if discard {
			conn.Discard()
		} else {
			conn.Close()
		}
	}()
	if _, err := conn.Exec(ctx, statements.Listen); err != nil {
		return false, fmt.Errorf("listen: %w", err)
	}
	// Back in the pool, the connection must not listen on: close it if UNLISTEN fails.
	defer func() {
		unlistenCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		if _, err := conn.Exec(unlistenCtx, "UNLISTEN *"); err != nil {
			discard = true
		}
	}()
	wake.signal() // rows committed while nobody listened
	for {
		if err := conn.WaitForNotification(ctx); err != nil {
			return true, fmt.Errorf("wait for notification: %w", err)
		}
		wake.signal()
	}
}

// wakeup is a token for one idle lane: each NOTIFY starts one batch, not one per lane, and a
// lane whose batch came back full passes the token on, so that another joins the drain.
type wakeup chan struct{}

func newWakeup() wakeup { return make(wakeup, 1) }

func (w wakeup) signal() {
	select {
	case w <- struct{}{}:
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
