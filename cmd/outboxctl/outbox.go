package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/pgxdriver"
)

// latestShown is how many failing rows, and how many parked rows, status shows.
const latestShown = 10

// dbTimeout bounds each command's work in the database, each of retry's batches on its own: an
// operator waiting on a database that does not answer learns it, instead of waiting forever. A
// confirmation prompt is outside it, and so is a commit, which ends only with its answer (or a
// second signal): cut short, it might have happened or not.
const dbTimeout = 30 * time.Second

// isNoMatch reports whether err says that nothing matched: exit status 3.
func isNoMatch(err error) bool {
	for _, target := range []error{errNoMatch, messaging.ErrNoOutboxMessage, messaging.ErrNoUnsentMessage,
		messaging.ErrOutboxMessageParked, messaging.ErrOutboxMessageNotParked, messaging.ErrDeadLetterNotFound} {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

// statusResult is what status prints in -o json.
type statusResult struct {
	Database            string      `json:"database"` // its password masked
	Unsent              int64       `json:"unsent"`   // parked rows aside
	OldestUnsentSeconds float64     `json:"oldest_unsent_age_seconds"`
	MaxAttempts         int64       `json:"max_attempts"`
	Parked              int64       `json:"parked"`
	LatestErrors        []outboxRow `json:"latest_errors"`
	LatestParked        []outboxRow `json:"latest_parked"`
}

func (c *cli) statusCommand() *cobra.Command {
	var dbFlag string
	cmd := &cobra.Command{
		Use:   "status",
		Short: "the outbox: unsent and parked rows, the oldest one's age, the most attempts, the latest errors",
		Long: `status shows what the outbox alerts are about: how many rows are unsent, the age of the oldest,
the highest attempt count (parked rows aside: an operator set them apart), how many rows are
parked, then the latest errors (up to 10 unsent rows the broker refused, latest next attempt
first: the table keeps no time of failure, and each next attempt is a backoff after one) and
the latest parked rows (up to 10). It changes nothing.`,
		Example: `  outboxctl status
  outboxctl status --db 'postgres://postgres@127.0.0.1:5432/order_db' -o json`,
		Args: cobra.NoArgs,
		RunE: action(func(ctx context.Context, _ []string) error {
			return c.status(ctx, dbFlag)
		}),
	}
	dbFlags(cmd, &dbFlag)
	return cmd
}

func (c *cli) status(ctx context.Context, dbFlag string) error {
	dbURL, db, done, err := openDB(ctx, dbFlag)
	if err != nil {
		return err
	}
	defer done()
	ctx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	stats, err := messaging.ReadOutboxStats(ctx, db)
	if err != nil {
		return err
	}
	failing, err := messaging.FailingOutboxMessages(ctx, db, latestShown)
	if err != nil {
		return err
	}
	parked, err := messaging.ParkedOutboxMessages(ctx, db, latestShown)
	if err != nil {
		return err
	}
	if c.json() {
		return writeJSON(c.out, statusResult{
			Database: platform.Redact(dbURL), Unsent: stats.Pending, OldestUnsentSeconds: stats.OldestPending.Seconds(),
			MaxAttempts: stats.MaxAttempts, Parked: stats.Parked, LatestErrors: toOutboxRows(failing), LatestParked: toOutboxRows(parked),
		})
	}

	fmt.Fprintf(c.out, "outbox in %s\n", platform.Redact(dbURL))
	tw := newTable(c.out)
	oldest := "none"
	if stats.Pending > 0 {
		oldest = stats.OldestPending.Round(time.Second).String()
	}
	fmt.Fprintf(tw, "unsent rows:\t%d\n", stats.Pending)
	fmt.Fprintf(tw, "oldest unsent row:\t%s\n", oldest)
	fmt.Fprintf(tw, "highest attempt count:\t%d\n", stats.MaxAttempts)
	fmt.Fprintf(tw, "parked rows:\t%d\n", stats.Parked)
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(failing) == 0 {
		fmt.Fprintln(c.out, "no unsent row has failed")
	} else {
		// At most latestShown: the count is of those shown, not of all that failed.
		fmt.Fprintf(c.out, "\nlatest errors (the latest %d of the unsent rows that failed, latest next attempt first):\n", len(failing))
		if err := printOutboxRows(c.out, failing); err != nil {
			return err
		}
	}
	if len(parked) > 0 {
		fmt.Fprintf(c.out, "\nparked rows (%d of %d, latest parked first; outboxctl outbox unpark or drop):\n", len(parked), stats.Parked)
		return printOutboxRows(c.out, parked)
	}
	return nil
}

func (c *cli) retryCommand() *cobra.Command {
	var dbFlag, idFlag, typeFlag string
	var limit, batch int
	var dryRun, yes bool
	cmd := &cobra.Command{
		Use:   "retry",
		Short: "make failed outbox rows that wait out a backoff due now",
		Long: `retry makes the unsent rows that wait out a backoff (the broker refused them) due now: all of
them, those of --type, or the one row --id names, and wakes the relays, which send them at once.
Each row keeps its attempts and last error: they are its history, a row that fails again backs
off from where it was, and outbox_max_attempts counts it until it is sent. Parked rows are left
alone (outboxctl outbox unpark sends one).

It lists the rows first, and retries exactly those, --batch at a time (10,000 by default),
each batch in its own transaction, printing each batch's rows as it commits and saying on
stderr how far it got. With --dry-run it only lists them (--batch at a time too). When more
than one row would be retried it asks on a terminal; without one (a script) it goes on: a
retry loses nothing. An interrupt (Ctrl-C) stops it once the batch under
way has committed: the rows of the batches done are due, the others unchanged, and it exits 1
saying how many; run it again for the rest.

Exit status 3: --id names no unsent row, or a parked one; or --type matches no waiting row.`,
		Example: `  outboxctl retry --dry-run
  outboxctl retry --type InvoiceIssued --limit 100 --yes
  outboxctl retry --id 01a22da8-7b60-74ff-a842-0e78a2a15d84`,
		Args: cobra.NoArgs,
		RunE: action(func(ctx context.Context, _ []string) error {
			if idFlag != "" {
				id, err := parseID(idFlag)
				if err != nil {
					return err
				}
				return c.retryOne(ctx, dbFlag, id, dryRun)
			}
			if batch < 1 || batch > math.MaxInt32 {
				return usageError{fmt.Sprintf("--batch %d: want 1 to %d", batch, math.MaxInt32)}
			}
			return c.retryListed(ctx, dbFlag, messaging.OutboxFilter{Type: typeFlag, Limit: limit}, batch, dryRun, yes)
		}),
	}
	dbFlags(cmd, &dbFlag)
	cmd.Flags().StringVar(&idFlag, "id", "", "retry this row only (an unsent row, not parked)")
	cmd.Flags().StringVar(&typeFlag, "type", "", "retry rows of this message type only")
	cmd.Flags().IntVar(&limit, "limit", 0, "retry at most this many rows, the oldest first (default: all)")
	cmd.Flags().IntVar(&batch, "batch", defaultRetryBatch, "make the rows due this many at a time, each batch in its own transaction")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "list the rows it would retry, and change nothing")
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "do not ask before retrying more than one row")
	cmd.MarkFlagsMutuallyExclusive("id", "type")
	cmd.MarkFlagsMutuallyExclusive("id", "limit")
	cmd.MarkFlagsMutuallyExclusive("id", "batch")
	return cmd
}

// retryOne makes row id due now.
func (c *cli) retryOne(ctx context.Context, dbFlag string, id uuid.UUID, dryRun bool) error {
	_, db, done, err := openDB(ctx, dbFlag)
	if err != nil {
		return err
	}
	defer done()
	ctx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	row, err := unsentRow(ctx, db, id)
	if err != nil {
		return err
	}
	if row.Parked() {
		return fmt.Errorf("%w: %s: unpark it to send it (outboxctl outbox unpark --id %s)", messaging.ErrOutboxMessageParked, id, id)
	}
	if !dryRun {
		// The row as the change left it: once committed, the row is due, and no read after the
		// commit (an interrupt there cancels ctx) may turn that into a failure.
		if row, err = messaging.RetryOutboxMessage(ctx, db, id); err != nil {
			return err
		}
	}
	row.Payload = nil // shown by drop alone, and its dry run
	var record bytes.Buffer
	switch {
	case c.json():
		if err := writeJSON(&record, outboxRowsResult{DryRun: dryRun, Count: 1, Rows: []outboxRow{toOutboxRow(row)}}); err != nil {
			return err
		}
	case dryRun:
		fmt.Fprintf(&record, "would make %s due now (dry run: nothing changed)\n", describeRow(row))
	default:
		fmt.Fprintf(&record, "outbox row %s is due now; the relay sends it next\n", id)
	}
	if dryRun {
		_, err := c.out.Write(record.Bytes())
		return err
	}
	// Committed: an output that fails (a closed pipe) must not hide that the row is due.
	return c.writeRecord(record.Bytes())
}

// shownBeforeAsking is how many of the rows retry lists at a terminal before it asks.
const shownBeforeAsking = 20

// retryListed lists the rows of f that wait out a backoff, has them confirmed, and retries
// those, batch at a time. Only their ids are held (16 bytes a row), and each batch's rows are
// printed as it commits: a backlog of millions fits in memory and in the listing's budget.
func (c *cli) retryListed(ctx context.Context, dbFlag string, f messaging.OutboxFilter, batch int, dryRun, yes bool) error {
	_, db, done, err := openDB(ctx, dbFlag)
	if err != nil {
		return err
	}
	defer done()
	listCtx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	ids, err := messaging.WaitingOutboxMessageIDs(listCtx, db, f)
	if err != nil {
		return err
	}
	if len(ids) == 0 && f.Type != "" {
		return fmt.Errorf("%w: no unsent row of type %q waits out a backoff", errNoMatch, printable(f.Type, 64))
	}
	if dryRun {
		return c.retryDryRun(ctx, db, ids, batch)
	}
	if len(ids) > 1 {
		if !yes && c.interactive {
			if err := c.showOldest(ctx, db, ids); err != nil {
				return err
			}
		}
		if err := c.confirmBulk(ctx, yes, fmt.Sprintf("make these %d outbox rows due now", len(ids))); err != nil {
			if c.json() { // not confirmed: a result, as a redrive's, that says none was made due
				if werr := (&rowStream{w: c.out, json: true}).end("", false); werr != nil {
					return werr
				}
			}
			return err
		}
	}
	out := &rowStream{w: c.out, json: c.json()}
	retried, tried, err := c.retryInBatches(ctx, db, ids, batch, out.add)
	if skipped := tried - retried; skipped > 0 {
		fmt.Fprintf(c.err, "%d of the %d rows listed were sent, parked or made due meanwhile, and left as they were\n", skipped, tried)
	}
	// What was made due before a failure or an interruption is due: say so either way.
	if retried == 0 && err != nil && !c.json() {
		return err
	}
	summary := fmt.Sprintf("%d failed outbox rows were waiting for their next attempt; they are due now", retried)
	if err != nil {
		summary = fmt.Sprintf("%d of the %d failed outbox rows listed are due now; the last %d listed were not tried", retried, len(ids), len(ids)-tried)
	}
	if werr := out.end(summary, err != nil && ctx.Err() != nil); werr != nil {
		// The output failed (a closed pipe: retry | head): what was done is said on stderr.
		fmt.Fprintf(c.err, "%s (the output failed: %v)\n", summary, werr)
		if err == nil {
			err = werr
		}
	}
	return err
}

// retryDryRun prints the rows ids as they are now, a batch at a time, and changes nothing. An
// interrupt stops it between two batches.
func (c *cli) retryDryRun(ctx context.Context, db messaging.DB, ids []uuid.UUID, batch int) error {
	out := &rowStream{w: c.out, json: c.json(), dryRun: true}
	if !c.json() {
		fmt.Fprintf(out, "would make %d failed outbox rows due now (dry run: nothing changed)\n", len(ids))
	}
	var err error
	for chunk := range slices.Chunk(ids, batch) {
		batchCtx, cancel := context.WithTimeout(ctx, dbTimeout)
		rows, rerr := messaging.ListedOutboxMessages(batchCtx, db, chunk)
		cancel()
		if err = rerr; err == nil {
			err = out.add(rows)
		}
		if err != nil {
			break
		}
	}
	// An interrupt stops it between two reads: the result says the rows shown are not all.
	interrupted := err != nil && ctx.Err() != nil
	if interrupted {
		err = fmt.Errorf("interrupted: %d of the %d rows listed were shown: %w", out.n, len(ids), err)
	}
	if eerr := out.end("", interrupted); eerr != nil && err == nil {
		err = eerr
	}
	return err
}

// showOldest shows, before retry asks, the oldest of the rows listed, ids, then a count: a
// backlog of a type the broker refused for an hour is hundreds of thousands of rows, which no
// one reads before answering. It reads those rows, not the rows waiting now: a row that began
// to wait since the listing is not retried, so it must not be shown as if it were.
func (c *cli) showOldest(ctx context.Context, db messaging.DB, ids []uuid.UUID) error {
	ctx, cancel := context.WithTimeout(ctx, dbTimeout) // not what is left of the listing's
	defer cancel()
	shown := ids[:min(len(ids), shownBeforeAsking)]
	oldest, err := messaging.ListedOutboxMessages(ctx, db, shown)
	if err != nil {
		return err
	}
	if err := printOutboxRows(c.err, oldest); err != nil {
		return err
	}
	if more := len(ids) - len(shown); more > 0 {
		fmt.Fprintf(c.err, "... and %d more (--dry-run lists them all)\n", more)
	}
	return nil
}

// defaultRetryBatch is how many rows retry makes due in one transaction unless --batch says
// otherwise: 10,000 took under a second on a test machine, far inside dbTimeout, where 500,000
// in one took 25 s.
const defaultRetryBatch = 10000

// retryInBatches makes the rows ids due, batch at a time, each batch in its own transaction
// within dbTimeout, hands each batch's rows made due to done once it has committed, and says
// on stderr how far it got after each when there are several. An interrupt stops it between
// batches: the batch under way commits first, so that every row is either due or untouched and
// the count is exact. It returns how many rows it made due, how many of ids it tried (those of
// the batches that committed), and why it stopped early.
func (c *cli) retryInBatches(ctx context.Context, db messaging.DB, ids []uuid.UUID, batch int, done func([]messaging.OutboxMessage) error) (retried, tried int, err error) {
	batches := (len(ids) + batch - 1) / batch
	for n := 1; tried < len(ids); n++ {
		if ctx.Err() != nil {
			return retried, tried, fmt.Errorf("interrupted after batch %d of %d: %d of the %d rows listed were tried, the other %d are unchanged (outboxctl retry --dry-run lists those still waiting)",
				n-1, batches, tried, len(ids), len(ids)-tried)
		}
		chunk := ids[tried:min(tried+batch, len(ids))]
		// Not cancelled by an interrupt: the batch commits or fails whole, in its own time.
		batchCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), dbTimeout)
		rows, err := messaging.RetryListedOutboxMessages(batchCtx, db, chunk)
		cancel()
		if err != nil {
			return retried, tried, fmt.Errorf("batch %d of %d: %d of the %d rows listed were tried before it, the other %d are unchanged: %w",
				n, batches, tried, len(ids), len(ids)-tried, err)
		}
		retried, tried = retried+len(rows), tried+len(chunk)
		if batches > 1 {
			fmt.Fprintf(c.err, "batch %d of %d: %d of %d rows tried, %d made due\n", n, batches, tried, len(ids), retried)
		}
		if err := done(rows); err != nil {
			return retried, tried, fmt.Errorf("print batch %d of %d (its rows are due): %w", n, batches, err)
		}
	}
	return retried, tried, nil
}

func (c *cli) outboxCommand() *cobra.Command {
	return group("outbox", "set aside, send again or drop one outbox row the broker will never accept",
		c.parkCommand(), c.unparkCommand(), c.dropRowCommand())
}

func (c *cli) parkCommand() *cobra.Command {
	var dbFlag, idFlag, reason string
	var dryRun bool
	cmd := &cobra.Command{
		Use:   "park --id UUID",
		Short: "keep one unsent outbox row from being sent, until it is unparked",
		Long: `park sets aside an unsent outbox row the broker will never accept (a message over its size
limit, an exchange that is gone for good), which would otherwise be retried every backoff
forever. No relay sends it until outboxctl outbox unpark; it keeps its place, attempts and last
error. It no longer counts in outbox_pending_messages, outbox_oldest_pending_age_seconds and
outbox_max_attempts, but in outbox_parked_messages, and status lists it. A row a relay is
publishing at that moment is parked once the broker's verdict is in, or found sent.

Exit status 3: no unsent row has the id, or it is parked already.`,
		Example: `  outboxctl outbox park --id 01a22da8-7b60-74ff-a842-0e78a2a15d84 --reason "over the broker's max message size"`,
		Args:    cobra.NoArgs,
		RunE: action(func(ctx context.Context, _ []string) error {
			return c.changeRow(ctx, dbFlag, idFlag, dryRun, false, rowAction{
				verb: "park",
				check: func(m messaging.OutboxMessage) error {
					if m.Parked() {
						return messaging.ErrOutboxMessageParked
					}
					return nil
				},
				do: func(ctx context.Context, db messaging.DB, id uuid.UUID) (messaging.OutboxMessage, error) {
					return messaging.ParkOutboxMessage(ctx, db, id, reason)
				},
				done: func(row messaging.OutboxMessage) string {
					return fmt.Sprintf("parked %s: no relay sends it until outboxctl outbox unpark --id %s", describeRow(row), row.ID)
				},
			})
		}),
	}
	dbFlags(cmd, &dbFlag)
	idFlagFor(cmd, &idFlag, "the row to park")
	cmd.Flags().StringVar(&reason, "reason", "", "why, kept with the row and shown by status")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "show the row it would park, and change nothing")
	return cmd
}

func (c *cli) unparkCommand() *cobra.Command {
	var dbFlag, idFlag string
	var dryRun bool
	cmd := &cobra.Command{
		Use:   "unpark --id UUID",
		Short: "make one parked outbox row due now",
		Long: `unpark makes a parked outbox row due now, and wakes the relays, which send it at once. It keeps
its attempts and last error.

Exit status 3: no unsent row has the id, or it is not parked.`,
		Example: `  outboxctl outbox unpark --id 01a22da8-7b60-74ff-a842-0e78a2a15d84`,
		Args:    cobra.NoArgs,
		RunE: action(func(ctx context.Context, _ []string) error {
			return c.changeRow(ctx, dbFlag, idFlag, dryRun, false, rowAction{
				verb: "unpark",
				check: func(m messaging.OutboxMessage) error {
					if !m.Parked() {
						return messaging.ErrOutboxMessageNotParked
					}
					return nil
				},
				do: messaging.UnparkOutboxMessage,
				done: func(row messaging.OutboxMessage) string {
					return fmt.Sprintf("unparked %s: it is due now, and the relay sends it next", describeRow(row))
				},
			})
		}),
	}
	dbFlags(cmd, &dbFlag)
	idFlagFor(cmd, &idFlag, "the row to unpark")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "show the row it would unpark, and change nothing")
	return cmd
}

func (c *cli) dropRowCommand() *cobra.Command {
	var dbFlag, idFlag string
	var dryRun, yes bool
	cmd := &cobra.Command{
		Use:   "drop --id UUID",
		Short: "delete one unsent outbox row: no relay publishes its event",
		Long: `drop deletes an unsent outbox row, parked or not: no relay publishes its event, and no consumer
learns of it (unless an earlier attempt had published it already: one that ended without the
broker's confirm, none in time or the connection lost first, or whose relay died after the
confirm, before it marked the row sent; unsent says only that no relay recorded it sent). Only for a message no one must receive (a producer's bug); the output shows
the row with its payload, as the last record of it. It asks on a terminal first, and without
one refuses unless given --yes. A row a relay is publishing at that moment is dropped once the
broker's verdict is in, or found sent.

Exit status 3: no unsent row has the id.`,
		Example: `  outboxctl outbox drop --id 01a22da8-7b60-74ff-a842-0e78a2a15d84 --dry-run
  outboxctl outbox drop --id 01a22da8-7b60-74ff-a842-0e78a2a15d84 --yes -o json > dropped.json`,
		Args: cobra.NoArgs,
		RunE: action(func(ctx context.Context, _ []string) error {
			return c.changeRow(ctx, dbFlag, idFlag, dryRun, true, rowAction{
				verb:    "drop",
				confirm: yes,
				do:      messaging.DropOutboxMessage,
				done: func(row messaging.OutboxMessage) string {
					return fmt.Sprintf("dropped %s: no relay will publish its event", describeRow(row))
				},
			})
		}),
	}
	dbFlags(cmd, &dbFlag)
	idFlagFor(cmd, &idFlag, "the row to drop")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "show the row it would drop, and change nothing")
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "do not ask before dropping")
	return cmd
}

// rowAction is what outbox park, unpark and drop do to their row.
type rowAction struct {
	verb    string
	check   func(messaging.OutboxMessage) error // refuses a row the action is not for, beyond being unsent
	do      func(ctx context.Context, db messaging.DB, id uuid.UUID) (messaging.OutboxMessage, error)
	done    func(messaging.OutboxMessage) string // says what was done to the row
	confirm bool                                 // --yes
}

// changeRow reads the row idFlag names, checks that act applies to it, and, unless dryRun,
// asks if ask says so and acts. A deletion shows the row's payload.
func (c *cli) changeRow(ctx context.Context, dbFlag, idFlag string, dryRun, ask bool, act rowAction) error {
	id, err := parseID(idFlag)
	if err != nil {
		return err
	}
	_, db, done, err := openDB(ctx, dbFlag)
	if err != nil {
		return err
	}
	defer done()
	readCtx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	row, err := unsentRow(readCtx, db, id)
	if err != nil {
		return err
	}
	if act.check != nil {
		if err := act.check(row); err != nil {
			return fmt.Errorf("%w: %s", err, id)
		}
	}
	if !ask {
		row.Payload = nil
	}
	if dryRun {
		return c.printRowResult(row, true, fmt.Sprintf("would %s %s (dry run: nothing changed)", act.verb, describeRow(row)))
	}
	if ask {
		if !act.confirm && c.interactive {
			fmt.Fprintf(c.err, "%s\npayload: %s\n", describeRow(row), printable(string(row.Payload), 2000))
		}
		if err := c.confirm(ctx, act.confirm, fmt.Sprintf("%s outbox row %s for good", act.verb, id)); err != nil {
			return err
		}
	}
	actCtx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	changed, err := act.do(actCtx, db, id)
	if err != nil {
		return err
	}
	if !ask {
		changed.Payload = nil
	}
	return c.printRowResult(changed, false, act.done(changed))
}

// printRowResult prints one row's result: in -o json the row, or else the sentence and, if the
// row has one, the payload.
func (c *cli) printRowResult(row messaging.OutboxMessage, dryRun bool, sentence string) error {
	var record bytes.Buffer
	if c.json() {
		if err := writeJSON(&record, outboxRowResult{DryRun: dryRun, Row: toOutboxRow(row)}); err != nil {
			return err
		}
	} else {
		fmt.Fprintln(&record, sentence)
		if row.Payload != nil {
			fmt.Fprintf(&record, "payload: %s\n", showBody(row.Payload, wholeBody))
		}
	}
	if dryRun {
		_, err := c.out.Write(record.Bytes())
		return err
	}
	return c.writeRecord(record.Bytes())
}

// unsentRow reads row id, or says that no unsent row has it.
func unsentRow(ctx context.Context, db messaging.Executor, id uuid.UUID) (messaging.OutboxMessage, error) {
	row, err := messaging.OutboxMessageByID(ctx, db, id)
	switch {
	case errors.Is(err, messaging.ErrNoOutboxMessage):
		return row, fmt.Errorf("%w: %s", messaging.ErrNoUnsentMessage, id)
	case err != nil:
		return row, err
	case row.Sent():
		return row, fmt.Errorf("%w: %s (it was sent at %s)", messaging.ErrNoUnsentMessage, id, when(*row.ProcessedAt))
	}
	return row, nil
}

// parseID reads --id.
func parseID(value string) (uuid.UUID, error) {
	id, err := platform.ParseUUID(value) // not x<id>y, which uuid.Parse takes for <id>
	if err != nil {
		return uuid.Nil, usageError{fmt.Sprintf("--id %q is not a UUID", printable(value, 64))}
	}
	return id, nil
}

// dbFlags adds --db to cmd.
func dbFlags(cmd *cobra.Command, dbFlag *string) {
	cmd.Flags().StringVar(dbFlag, "db", "", "PostgreSQL URL of the service's database (default $DATABASE_URL)")
}

// idFlagFor adds the required --id to cmd.
func idFlagFor(cmd *cobra.Command, idFlag *string, usage string) {
	cmd.Flags().StringVar(idFlag, "id", "", usage+" (required)")
	_ = cmd.MarkFlagRequired("id") // the flag was just added
}

// openDB connects to the database --db or DATABASE_URL names, and returns its URL, the
// library's handle on it, and what closes it.
func openDB(ctx context.Context, flagValue string) (string, messaging.DB, func(), error) {
	rawURL, err := urlFrom("db", flagValue, "DATABASE_URL", parsePostgresURL, "postgres", "postgresql")
	if err != nil {
		return "", nil, nil, err
	}
	// How its sessions show in pg_stat_activity. The rest of the query stays as written, as the
	// services keep it: rebuilt through url.Values, options=-c%20search_path%3Dapp would reach
	// the server as -c+search_path=app.
	dsn, err := platform.WithApplicationName(rawURL, "outboxctl")
	if err != nil {
		return "", nil, nil, err
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		// pgx quotes the URL rebuilt here, application_name added, which the arguments do not
		// hold for hideSecrets to find.
		return "", nil, nil, fmt.Errorf("open database: %s", platform.MaskPasswords(platform.WithoutQuotedURL(err.Error()), rawURL, dsn))
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return "", nil, nil, fmt.Errorf("open database: %w", err)
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return "", nil, nil, fmt.Errorf("connect to the database: %w", err)
	}
	return rawURL, pgxdriver.New(pool).DB(), pool.Close, nil
}
