package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// mostWithoutLimit is how many waiting messages a dlq command takes without --limit (dlq list
// with --limit 0 too); with more waiting it refuses. Each message taken is held in memory until
// the command ends: 200,000 of 64 KiB would be over 12 GiB. A variable, for the tests.
var mostWithoutLimit = 10000

// beforeTakeHook, unless nil, runs once a dead-letter queue was counted and before its
// messages are taken: for the tests, which take some meanwhile, as another client would.
var beforeTakeHook func(dlq string)

// noLimitBrake is the BeforeTake of a dlq command: with limit 0 (all: without --limit, or dlq
// list's --limit 0), it refuses a queue of more than mostWithoutLimit messages with a usage
// error, before any is taken.
func noLimitBrake(dlq string, limit int) func(waiting int) error {
	return func(waiting int) error {
		if limit > 0 || waiting <= mostWithoutLimit {
			if beforeTakeHook != nil {
				beforeTakeHook(dlq)
			}
			return nil
		}
		// The count, not "run it again for the rest": a filter or an --id looks at the first
		// N only, each run the same N, so only a --limit of them all reaches every message.
		return usageError{fmt.Sprintf("%d messages wait in %s, more than the %d it takes without --limit (it holds each in memory until it is done): --limit %d takes them all, as before; a smaller one looks at the first N only (and may reorder those it looked at); nothing was changed",
			waiting, dlq, mostWithoutLimit, waiting)}
	}
}

// dlqTake is what a dlq command learns of the messages it takes: how many were ready when the
// dead-letter queue was counted, and how many it took, of those, at most limit. Its output
// counts what it took: another client may take some between the count and the take.
type dlqTake struct {
	dlq     string
	limit   int // 0: all
	waiting int // ready when counted
	taken   int
}

// selection takes the messages for t: no more than t.limit, with noLimitBrake, and t's counts
// kept.
func (t *dlqTake) selection() messaging.DeadLetterSelection {
	brake := noLimitBrake(t.dlq, t.limit)
	return messaging.DeadLetterSelection{
		Limit: t.limit,
		BeforeTake: func(waiting int) error {
			t.waiting = waiting
			return brake(waiting)
		},
		Taken: func(n int) { t.taken = n },
	}
}

// cut says whether --limit may have left messages behind: it took limit of more that were
// counted. Another client may have taken those beyond since they were counted: what it says of
// them is that they may wait, not that they do.
func (t *dlqTake) cut() bool { return t.limit > 0 && t.taken >= t.limit && t.waiting > t.taken }

// scope says which messages of the dead-letter queue it looked at: all that were ready, the
// first --limit, or those still there when it took them.
func (t *dlqTake) scope() string {
	switch {
	case t.cut():
		return fmt.Sprintf("the first %d of the %d messages in %s (--limit)", t.taken, t.waiting, t.dlq)
	case t.taken < t.waiting:
		return fmt.Sprintf("the %d messages ready in %s (%d were counted at the start: the others were gone when it took them)", t.taken, t.dlq, t.waiting)
	}
	return fmt.Sprintf("the %d messages in %s", t.taken, t.dlq)
}

// What a command that looked at part of the queue says of the next run (see dlqTake.note).
const (
	noteList = iota
	noteRedrive
	noteOne // a run for one message: dlq drop, dlq redrive --id
)

// note is what a listing or a dry run says when --limit left messages behind (and nothing when
// it looked at them all): those it looked at were handed back and may now stand behind the
// others, so the next run may see different ones first. --id names one message a run: the
// next run acts on that one, or finds it no more among the first --limit.
func (t *dlqTake) note(kind int) string {
	if !t.cut() {
		return ""
	}
	s := fmt.Sprintf("it looked at the first %d of the %d messages only (--limit) and handed them back, and a quorum queue may put those behind the others: ", t.taken, t.waiting)
	switch kind {
	case noteList:
		return s + fmt.Sprintf("the next listing may show different messages first. To act on one listed here, name it with --id (one message a run; dlq redrive, dlq drop) and --limit %d, which looks at them all: a smaller --limit may no longer reach it", t.waiting)
	case noteRedrive:
		return s + fmt.Sprintf("the same command without --dry-run may see different messages first, and move those. To move one listed here, name it with --id (one message a run) and --limit %d, which looks at them all: a smaller --limit may no longer reach it", t.waiting)
	}
	return s + fmt.Sprintf("the same command without --dry-run may not find this message among the first %d (exit 3): --limit %d looks at them all", t.taken, t.waiting)
}

// notFound is the error of a search for f that found nothing: where it looked, and, if --limit
// left messages behind, how to look at them all. A message a dry run found among the first
// --limit may be beyond them by the next run, handed back behind the others.
func (t *dlqTake) notFound(f dlqFilter) error {
	where := t.dlq
	if t.cut() {
		where = fmt.Sprintf("%s (of the first %d messages, --limit): of the %d waiting it looked no further, and a message an earlier run looked at and handed back may have moved behind the others; --limit %d looks at them all",
			t.dlq, t.taken, t.waiting, t.waiting)
	}
	return fmt.Errorf("%w: no message %s in %s", errNoMatch, f, where)
}

// printNote prints a note, if there is one, after a table or a record.
func printNote(w io.Writer, note string) {
	if note != "" {
		fmt.Fprintf(w, "\nnote: %s\n", note)
	}
}

func (c *cli) dlqCommand() *cobra.Command {
	return group("dlq", "list, redrive or drop the messages of a consumer's dead-letter queue",
		c.dlqListCommand(), c.dlqRedriveCommand(), c.dlqDropCommand())
}

// dlqFilter picks messages of a dead-letter queue; its zero value picks them all.
type dlqFilter struct {
	// id is a message id: a UUID in its canonical form matches the same UUID in either case;
	// anything else matches that text exactly, since a message is dead-lettered for lacking a
	// valid id too.
	id        string
	withoutID bool // the messages that have no message id at all
	typ       string
	reason    string // a part of the reason, in any case
}

func (f dlqFilter) any() bool { return f.id != "" || f.withoutID || f.typ != "" || f.reason != "" }

func (f dlqFilter) match(d messaging.DeadLetter) bool {
	if (f.id != "" && !sameID(f.id, d.MessageID)) || (f.withoutID && d.MessageID != "") {
		return false
	}
	return (f.typ == "" || d.Type == f.typ) && (f.reason == "" || strings.Contains(strings.ToLower(d.Reason), strings.ToLower(f.reason)))
}

// sameID says whether a message's id is the one an operator gave: the same UUID in either case,
// each in its canonical text (x<id>y, which uuid.Parse takes for <id>, is not it), or else the
// same text.
func sameID(given, id string) bool {
	want, werr := platform.ParseUUID(given)
	got, gerr := platform.ParseUUID(id)
	if werr == nil && gerr == nil {
		return want == got
	}
	return given == id
}

// String says what f picks, for messages.
func (f dlqFilter) String() string {
	var parts []string
	if f.id != "" {
		parts = append(parts, "with id "+printable(f.id, 64))
	}
	if f.withoutID {
		parts = append(parts, "without a message id")
	}
	if f.typ != "" {
		parts = append(parts, fmt.Sprintf("of type %q", printable(f.typ, 64)))
	}
	if f.reason != "" {
		parts = append(parts, fmt.Sprintf("whose reason has %q", printable(f.reason, 64)))
	}
	return strings.Join(parts, " and ")
}

// flags says what f picks as the flags that asked for it.
func (f dlqFilter) flags() string {
	var parts []string
	if f.typ != "" {
		parts = append(parts, fmt.Sprintf("--type %q", printable(f.typ, 64)))
	}
	if f.reason != "" {
		parts = append(parts, fmt.Sprintf("--reason %q", printable(f.reason, 64)))
	}
	return strings.Join(parts, " ")
}

// dlqResult is what dlq list and dlq redrive print in -o json.
type dlqResult struct {
	DryRun          *bool        `json:"dry_run,omitempty"` // dlq redrive only
	Queue           string       `json:"queue"`
	DeadLetterQueue string       `json:"dead_letter_queue"`
	Waiting         int          `json:"waiting"`  // messages ready in the dead-letter queue at the start, not those held unacknowledged
	Examined        int          `json:"examined"` // the first ones, up to --limit, that it looked at
	Count           int          `json:"count"`    // messages listed, or redriven
	Messages        []deadLetter `json:"messages"`
	// dlq redrive stopped early: interrupted, and the id of the message that may be in both
	// queues.
	Interrupted bool    `json:"interrupted,omitempty"`
	InDoubt     *string `json:"in_doubt,omitempty"`
	// A listing or a dry run that looked at the first --limit of more messages: those it
	// handed back may have moved behind the others, and what that means for the next run.
	Note string `json:"note,omitempty"`
}

// dlqDropResult is what dlq drop prints in -o json.
type dlqDropResult struct {
	DryRun          bool       `json:"dry_run"`
	InDoubt         bool       `json:"in_doubt,omitempty"` // acknowledged, but the broker's answer after it never came
	Queue           string     `json:"queue"`
	DeadLetterQueue string     `json:"dead_letter_queue"`
	Message         deadLetter `json:"message"`        // with its headers and body
	Note            string     `json:"note,omitempty"` // a dry run that looked at the first --limit of more messages: see dlqResult
}

func (c *cli) dlqListCommand() *cobra.Command {
	var amqpFlag, typeFlag, reason string
	var limit int
	var showBody, showHeaders bool
	cmd := &cobra.Command{
		Use:         "list QUEUE",
		Short:       "what waits in QUEUE.dlq: message id, type, when and why",
		Annotations: map[string]string{limitZeroIsAll: "it moves and deletes nothing"},
		Long: `list shows what waits in QUEUE's dead-letter queue, QUEUE.dlq, in queue order: every message, or
the first --limit only, if given. For each, its message id, type, when and why it was
dead-lettered (the consumer's reason header, or, for a message the broker dead-lettered at the
delivery limit, delivery_limit from x-death), and with --show-headers and --show-body its
headers and body. --type and --reason show only those that match (of the first --limit).

AMQP cannot peek: it takes those messages unacknowledged (all that wait, or the first --limit)
and hands them all back, in order: nothing is lost, and the dead-letter queue has no delivery
limit to spend (but one an earlier version declared, on RabbitMQ 4.0 to 4.2: see
docs/outboxctl.md). When it took the whole queue, its order is unchanged; when a --limit left
more messages beyond, those shown may move back in the queue (a quorum queue may put messages
handed back behind the others: seen on RabbitMQ 3.10 and 4.x alike), so the next listing may
start further on; a note after the table says so, and how to reach a message listed. Messages
another client holds at that moment are not shown.

Each message taken is held in memory until it is done: without --limit (or with --limit 0,
the same), when more than ` + fmt.Sprint(mostWithoutLimit) + ` wait, it refuses (exit status 2), takes none, and names the
--limit that takes them all.`,
		Example: `  outboxctl dlq list invoicing
  outboxctl dlq list invoicing --type OrderPlaced --reason "price list" --show-body
  outboxctl dlq list invoicing --limit 1000 -o json`,
		Args: exactArgs("QUEUE"),
		RunE: action(func(ctx context.Context, args []string) error {
			return c.dlqList(ctx, amqpFlag, args[0], limit, dlqFilter{typ: typeFlag, reason: reason}, showHeaders, showBody)
		}),
	}
	amqpFlags(cmd, &amqpFlag)
	limitFlag(cmd, &limit)
	cmd.Flags().StringVar(&typeFlag, "type", "", "show the messages of this type only")
	cmd.Flags().StringVar(&reason, "reason", "", "show the messages whose reason has this text only, in any case")
	cmd.Flags().BoolVar(&showBody, "show-body", false, "show each message's body")
	cmd.Flags().BoolVar(&showHeaders, "show-headers", false, "show each message's headers")
	return cmd
}

func (c *cli) dlqList(ctx context.Context, amqpFlag, queue string, limit int, f dlqFilter, showHeaders, showBody bool) error {
	cfg, err := deadLetterConfig(amqpFlag, queue)
	if err != nil {
		return err
	}
	dlq := messaging.DeadLetterQueue(cfg.Queue)
	tk := &dlqTake{dlq: dlq, limit: limit}
	sel := tk.selection()
	if f.any() {
		sel.Match = f.match
	}
	shown, waiting, err := messaging.ListDeadLettersWith(ctx, cfg, sel)
	if err != nil {
		return err
	}
	note := tk.note(noteList)
	if c.json() {
		return writeJSON(c.out, dlqResult{Queue: queue, DeadLetterQueue: dlq, Waiting: waiting, Examined: tk.taken,
			Count: len(shown), Messages: toDeadLetters(shown, showHeaders, showBody), Note: note})
	}
	if waiting == 0 {
		fmt.Fprintln(c.out, noneReady(dlq))
		return nil
	}
	fmt.Fprintln(c.out, listSummary(tk, len(shown), f))
	switch {
	case len(shown) == 0:
	case !showHeaders && !showBody:
		if err := printDeadLetters(c.out, shown); err != nil {
			return err
		}
	default:
		body := noBody
		if showBody {
			body = maxBodyShown
		}
		for _, d := range shown {
			printDeadLetter(c.out, d, showHeaders, body)
		}
	}
	printNote(c.out, note)
	return nil
}

// noneReady says that no message was ready in dlq: not that it is empty, since the broker's
// count leaves out the messages another client holds unacknowledged.
func noneReady(dlq string) string {
	return fmt.Sprintf("no message ready in %s (messages another client holds unacknowledged are not counted)", dlq)
}

// listSummary heads dlq list's table: which messages it shows, of those it took.
func listSummary(t *dlqTake, shown int, f dlqFilter) string {
	switch {
	case f.any():
		return fmt.Sprintf("%d of %s match %s, in queue order:", shown, t.scope(), f.flags())
	case t.taken < t.waiting:
		return t.scope() + ", in queue order:"
	}
	return fmt.Sprintf("%d messages in %s, in queue order:", t.taken, t.dlq)
}

func (c *cli) dlqRedriveCommand() *cobra.Command {
	var amqpFlag, idFlag, typeFlag, reason string
	var limit int
	var dryRun, yes bool
	cmd := &cobra.Command{
		Use:   "redrive QUEUE",
		Short: "move messages from QUEUE.dlq back to QUEUE, their ids unchanged",
		Long: `redrive moves messages from QUEUE's dead-letter queue back to QUEUE: all of them, or those that
match --id, or --type and --reason; of the first --limit only, if given. They keep their
properties and message ids, so the inbox still recognises any already handled; the headers of
the dead-lettering (x-death, the reason, the delivery count) are dropped, so each is handled
like a new delivery. Each is acknowledged in the dead-letter queue only after the broker
confirmed its copy; the others are handed back in their order.

It takes the messages it looks at unacknowledged (all that wait, or the first --limit), picks
those it would move, and moves exactly those. With --dry-run it only lists them and moves
nothing; but with a --limit that leaves messages behind, those it looked at may change place in
the queue, and the same command without --dry-run may then see different ones first: a note
after the list says so, and how to move one listed (--id, one message a run). When more
than one would move it asks on a terminal first, holding them meanwhile; without one (a
script) it goes on: a message handled already is skipped by the inbox. A --limit that leaves
messages behind may move those it looked at and kept back in the queue (see dlq list --help).
Each message taken is held in memory until it is done: without --limit, when more than ` + fmt.Sprint(mostWithoutLimit) + `
wait, it refuses (exit status 2), changes nothing, and names the --limit that takes them all.

An interrupt (Ctrl-C) stops it before the next message; it prints what moved, says it was
interrupted, and exits 1. A message published but not confirmed at that moment (or whose
acknowledgement failed) may be in both queues: the error names it, and how to check.

Exit status 3: --id, --type or --reason match no message (of the first --limit). Messages
another client holds unacknowledged at that moment are not seen.`,
		Example: `  outboxctl dlq redrive invoicing --dry-run
  outboxctl dlq redrive invoicing --reason "price list" --yes
  outboxctl dlq redrive notification --id 01a22da8-7b60-74ff-a842-0e78a2a15d84`,
		Args: exactArgs("QUEUE"),
		RunE: action(func(ctx context.Context, args []string) error {
			f := dlqFilter{id: idFlag, typ: typeFlag, reason: reason}
			return c.dlqRedrive(ctx, amqpFlag, args[0], limit, f, dryRun, yes)
		}),
	}
	amqpFlags(cmd, &amqpFlag)
	cmd.Flags().StringVar(&idFlag, "id", "", "move the message with this id only")
	cmd.Flags().StringVar(&typeFlag, "type", "", "move the messages of this type only")
	cmd.Flags().StringVar(&reason, "reason", "", "move the messages whose reason has this text only, in any case")
	limitFlag(cmd, &limit)
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "list the messages it would move, and move nothing (those it looked at may change place in the queue)")
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "do not ask before moving more than one message")
	cmd.MarkFlagsMutuallyExclusive("id", "type")
	cmd.MarkFlagsMutuallyExclusive("id", "reason")
	return cmd
}

// errDryRun makes a library action that holds what it would act on hand it all back.
var errDryRun = errors.New("dry run")

func (c *cli) dlqRedrive(ctx context.Context, amqpFlag, queue string, limit int, f dlqFilter, dryRun, yes bool) error {
	cfg, err := deadLetterConfig(amqpFlag, queue)
	if err != nil {
		return err
	}
	dlq := messaging.DeadLetterQueue(cfg.Queue)
	result := dlqResult{DryRun: &dryRun, Queue: queue, DeadLetterQueue: dlq}
	var picked []messaging.DeadLetter
	tk := &dlqTake{dlq: dlq, limit: limit}
	sel := tk.selection()
	sel.Confirm = func(p []messaging.DeadLetter, _ int) error {
		picked = p
		if dryRun {
			return errDryRun
		}
		if len(p) < 2 {
			return nil
		}
		if !yes && c.interactive {
			// The first, then a count, as retry does: a dead-letter queue after an outage is
			// thousands of messages, which no one reads before answering.
			fmt.Fprintf(c.err, "%d of %s, in queue order:\n", len(p), tk.scope())
			if err := printDeadLetters(c.err, p[:min(len(p), shownBeforeAsking)]); err != nil {
				return err
			}
			if more := len(p) - shownBeforeAsking; more > 0 {
				fmt.Fprintf(c.err, "... and %d more (--dry-run lists them all)\n", more)
			}
		}
		return c.confirmBulk(ctx, yes, fmt.Sprintf("move these %d messages from %s back to %s", len(p), dlq, queue))
	}
	if f.any() {
		sel.Match = f.match
	}
	// The messages are held while the question waits for its answer: what is confirmed is
	// what moves.
	moved, err := messaging.RedriveDeadLetters(ctx, cfg, sel)
	// What it took, not what the broker counted before: another client may take some between.
	result.Waiting, result.Examined = tk.waiting, tk.taken
	switch {
	case errors.Is(err, errDryRun):
		kind := noteRedrive
		if f.id != "" { // it moves that message or none: exit 3
			kind = noteOne
		}
		result.Count, result.Messages, result.Note = len(picked), toDeadLetters(picked, false, false), tk.note(kind)
		if c.json() {
			return writeJSON(c.out, result)
		}
		fmt.Fprintf(c.out, "would move %d of %s to %s (dry run: nothing moved), in queue order:\n", len(picked), tk.scope(), queue)
		if err := printDeadLetters(c.out, picked); err != nil {
			return err
		}
		printNote(c.out, result.Note)
		return nil
	case errors.Is(err, messaging.ErrDeadLetterNotFound):
		return tk.notFound(f)
	}
	if errors.Is(err, errNotConfirmed) { // declined, or interrupted at the question: nothing moved
		result.Messages = []deadLetter{} // a list, as every other answer's, for a script to read
		if c.json() {
			if werr := writeJSON(c.out, result); werr != nil {
				return werr
			}
		}
		return err
	}
	// What moved before a failure or an interrupt moved: say so either way, and which message,
	// if any, may be in both queues.
	interrupted := err != nil && ctx.Err() != nil
	var inDoubt *messaging.DeadLetter
	if errors.Is(err, messaging.ErrRedriveInDoubt) && len(moved) < len(picked) {
		inDoubt = &picked[len(moved)]
		err = fmt.Errorf("%w; %s", err, inDoubtAdvice(queue, dlq, inDoubt.MessageID, tk.waiting))
	}
	if interrupted {
		err = fmt.Errorf("interrupted: %w", err)
	}
	if err != nil && len(picked) == 0 {
		// Stopped before it picked a message (no broker, no dead-letter queue, no permission):
		// nothing moved, and stdout shows no result that could pass for one, as for dlq list.
		return err
	}
	result.Count, result.Messages, result.Interrupted = len(moved), toDeadLetters(moved, false, false), interrupted
	if inDoubt != nil {
		result.InDoubt = &inDoubt.MessageID
	}
	var summary string
	switch {
	case len(picked) == 0: // and no error: one returned above
		summary = noneReady(dlq) + ": nothing to move"
	case err != nil:
		stopped := "stopped by a failure"
		if interrupted {
			stopped = "interrupted"
		}
		summary = fmt.Sprintf("%s: moved %d of the %d messages picked from %s to %s; the others are still in %s",
			stopped, len(moved), len(picked), dlq, queue, dlq)
	default:
		summary = fmt.Sprintf("moved %d messages from %s to %s", len(moved), dlq, queue)
	}
	var out bytes.Buffer
	var werr error
	if c.json() {
		werr = writeJSON(&out, result)
	} else {
		for _, d := range moved {
			fmt.Fprintf(&out, "redriven %s %s\n", printable(d.MessageID, 64), printable(d.Type, 64))
		}
		fmt.Fprintln(&out, summary)
		if tk.cut() && err == nil {
			fmt.Fprintf(&out, "up to %d more may wait beyond the %d it looked at (%d were counted when it started; --limit)\n", tk.waiting-tk.taken, tk.taken, tk.waiting)
		}
	}
	if werr == nil {
		// Through the guard: a closed pipe (dlq redrive | head) would otherwise kill the process
		// once the messages moved, with nothing said of them.
		_, werr = pipeSafe{c.out}.Write(out.Bytes())
	}
	if werr != nil {
		fmt.Fprintf(c.err, "%s (the output failed: %v)\n", summary, werr)
		if err == nil {
			err = fmt.Errorf("print the messages moved: %w", werr)
		}
	}
	return err
}

// inDoubtAdvice names the message a redrive may have left in both queue and dlq, and how to
// check, with a command that answers for that message (waiting: how many were counted in dlq
// at the start). --id takes the id as it is: with one the output shortens or cleans, --id
// would find nothing (exit 3) and seem to say it is gone, so a listing of them all is named
// instead; one without an id has dlq drop --without-id. The check shows that one message,
// however long the queue. The inbox holds only an id its consumer reads as a UUID: the
// consumer dead-letters any other again.
func inDoubtAdvice(queue, dlq, id string, waiting int) string {
	q := shellWord(queue)
	u, uerr := uuid.Parse(id) // as the consumer reads it
	once := ""
	if uerr == nil {
		once = " (its consumer handles it once)"
	}
	var s string
	switch {
	case id == "":
		return fmt.Sprintf("a message without a message id may be in both %s and %s: outboxctl dlq drop %s --without-id --dry-run shows whether one without an id is still in %s (exit 3 if none is; it shows the first, which may be another without one; with more than %d waiting it names the --limit that looks at them all)",
			queue, dlq, q, dlq, mostWithoutLimit)
	case printable(id, 64) == id:
		s = fmt.Sprintf("message %s may be in both %s and %s%s: outboxctl dlq redrive %s --id %s --dry-run shows whether it is still in %s (exit 3 if not; with more than %d waiting it names the --limit that looks at them all)",
			id, queue, dlq, once, q, shellWord(id), dlq, mostWithoutLimit)
	default:
		n := max(waiting, 1)
		s = fmt.Sprintf("message %s (its id shortened or cleaned here; in_doubt in -o json has it whole, but for bytes that are not UTF-8) may be in both %s and %s%s: outboxctl dlq list %s --limit %d -o json lists the first %d messages in %s, as many as waited when this run began, with their ids whole (but for bytes that are not UTF-8): look for its message_id there",
			printable(id, 64), queue, dlq, once, q, n, n, dlq)
	}
	if uerr == nil {
		s += fmt.Sprintf(", and outboxctl inbox show --id %s --consumer %s, against the consumer's database, whether it was handled", u, q)
	}
	return s
}

// shellWord is s as a POSIX shell reads it as one word: as it is if it holds only characters
// no shell treats specially, otherwise in single quotes. A message id is any text. A leading
// = is quoted too: zsh, by default, reads =name as the path of the command name.
func shellWord(s string) string {
	if s != "" && !strings.HasPrefix(s, "=") && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/@%+=,") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func (c *cli) dlqDropCommand() *cobra.Command {
	var amqpFlag, idFlag string
	var limit int
	var withoutID, dryRun, yes bool
	cmd := &cobra.Command{
		Use:   "drop QUEUE (--id ID | --without-id)",
		Short: "remove one message from QUEUE.dlq for good",
		Long: `drop removes the message with --id from QUEUE's dead-letter queue, for good, and leaves the
others there in their order: for a message no consumer must ever handle (a producer's bug),
where rabbitmqctl purge_queue would drop them all. A UUID matches in either case; an
id that is not one (a message dead-lettered for that) matches as written, exactly as dlq list
-o json shows it (the table shortens and cleans it), and --without-id picks a message that
has none. The output shows the message with its headers and whole body,
as the last record of it. If two copies share the id, the first goes. It takes the whole queue
unacknowledged meanwhile, as a listing of it all does, so that the others keep their order; or
the first --limit only, for a queue too long to hold, which may move those it looked at back
in the queue (see dlq list --help): a dry run with such a --limit drops nothing, but says in a
note that the same command without --dry-run may then not find the message. Without --limit, when more than ` + fmt.Sprint(mostWithoutLimit) + ` wait, it refuses (exit
status 2), changes nothing, and names the --limit that takes them all. It asks on a terminal
first, and without one refuses unless given --yes.

Exit status 3: no message in QUEUE.dlq has the id (of the first --limit; messages another
client holds unacknowledged at that moment are not seen).`,
		Example: `  outboxctl dlq drop invoicing --id 01a22da8-7b60-74ff-a842-0e78a2a15d84 --dry-run
  outboxctl dlq drop invoicing --id 01a22da8-7b60-74ff-a842-0e78a2a15d84 --yes -o json > dropped.json
  outboxctl dlq drop invoicing --without-id --dry-run`,
		Args: exactArgs("QUEUE"),
		RunE: action(func(ctx context.Context, args []string) error {
			// Given, --without-id=false passes the flags' check and would leave a filter of
			// nothing, which picks the first message of all.
			if idFlag == "" && !withoutID {
				return usageError{"--without-id=false names no message: give --id, or --without-id"}
			}
			return c.dlqDrop(ctx, amqpFlag, args[0], limit, dlqFilter{id: idFlag, withoutID: withoutID}, dryRun, yes)
		}),
	}
	amqpFlags(cmd, &amqpFlag)
	cmd.Flags().StringVar(&idFlag, "id", "", "the message to drop")
	cmd.Flags().BoolVar(&withoutID, "without-id", false, "drop the first message that has no message id")
	limitFlag(cmd, &limit)
	cmd.MarkFlagsOneRequired("id", "without-id")
	cmd.MarkFlagsMutuallyExclusive("id", "without-id")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "show the message it would drop, and drop nothing (those it looked at may change place in the queue)")
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "do not ask before dropping")
	return cmd
}

func (c *cli) dlqDrop(ctx context.Context, amqpFlag, queue string, limit int, f dlqFilter, dryRun, yes bool) error {
	cfg, err := deadLetterConfig(amqpFlag, queue)
	if err != nil {
		return err
	}
	dlq := messaging.DeadLetterQueue(cfg.Queue)
	question := fmt.Sprintf("drop the message %s from %s for good", f, dlq)
	if !dryRun && !yes && !c.interactive {
		// Refused before connecting: taking the queue and handing it back is not nothing (a
		// quorum queue may put those it hands back behind the rest).
		return c.confirm(ctx, yes, question)
	}
	var found messaging.DeadLetter
	// The whole queue (or the first limit) is held, so that the others keep their order, and
	// while the question waits for its answer: what is confirmed is what goes.
	tk := &dlqTake{dlq: dlq, limit: limit}
	sel := tk.selection()
	sel.Match = f.match
	sel.Confirm = func(p []messaging.DeadLetter, _ int) error {
		found = p[0]
		if dryRun {
			return errDryRun
		}
		if !yes && c.interactive {
			printDeadLetter(c.err, found, true, wholeBody)
		}
		return c.confirm(ctx, yes, question)
	}
	dropped, err := messaging.DropDeadLetter(ctx, cfg, sel)
	switch {
	case errors.Is(err, errDryRun):
		return c.printDroppedWithNote(queue, dlq, found, dropDryRun, tk.note(noteOne))
	case errors.Is(err, messaging.ErrDeadLetterNotFound):
		return tk.notFound(f)
	case errors.Is(err, messaging.ErrDropInDoubt):
		// It may be gone: its record is printed all the same, the last there may be.
		return errors.Join(err, c.printDropped(queue, dlq, dropped, dropInDoubt))
	case err != nil:
		return err
	}
	return c.printDropped(queue, dlq, dropped, dropDone)
}

// dropOutcome is what became of the message dlq drop prints.
type dropOutcome int

const (
	dropDone    dropOutcome = iota
	dropDryRun              // it would be dropped
	dropInDoubt             // acknowledged, and the broker's answer after it never came
)

// printDropped prints the message dlq drop dropped, would drop, or may have dropped, in full.
func (c *cli) printDropped(queue, dlq string, d messaging.DeadLetter, outcome dropOutcome) error {
	return c.printDroppedWithNote(queue, dlq, d, outcome, "")
}

// printDroppedWithNote is printDropped with a note after the record, if not "" (see
// dlqTake.note).
func (c *cli) printDroppedWithNote(queue, dlq string, d messaging.DeadLetter, outcome dropOutcome, note string) error {
	var record bytes.Buffer
	if c.json() {
		if err := writeJSON(&record, dlqDropResult{DryRun: outcome == dropDryRun, InDoubt: outcome == dropInDoubt, Queue: queue, DeadLetterQueue: dlq,
			Message: toDeadLetter(d, true, true), Note: note}); err != nil {
			return err
		}
	} else {
		switch outcome {
		case dropDryRun:
			// Nothing dropped: with a --limit that left messages behind, those it looked at
			// may have changed place.
			fmt.Fprintf(&record, "would drop from %s (dry run: nothing dropped):\n", dlq)
		case dropInDoubt:
			fmt.Fprintf(&record, "may have dropped from %s (the broker did not answer after the acknowledgement):\n", dlq)
		default:
			fmt.Fprintf(&record, "dropped from %s, for good:\n", dlq)
		}
		printDeadLetter(&record, d, true, wholeBody)
		printNote(&record, note)
	}
	if outcome == dropDryRun {
		_, err := c.out.Write(record.Bytes())
		return err
	}
	return c.writeRecord(record.Bytes())
}

// exactArgs wants one argument per name, and says which are missing or too many.
func exactArgs(names ...string) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) != len(names) {
			return usageError{fmt.Sprintf("want %s, got %d arguments", strings.Join(names, " "), len(args))}
		}
		return nil
	}
}

// amqpFlags adds --amqp to cmd.
func amqpFlags(cmd *cobra.Command, amqpFlag *string) {
	cmd.Flags().StringVar(amqpFlag, "amqp", "", "RabbitMQ URL, or a comma-separated list of one per node, all naming the same vhost (default $AMQP_URL)")
}

// limitFlag adds --limit to a dlq command: left out, it takes every message that waits, up to
// mostWithoutLimit (see noLimitBrake).
func limitFlag(cmd *cobra.Command, limit *int) {
	cmd.Flags().IntVar(limit, "limit", 0, fmt.Sprintf("look at the first N messages, no more (default: all of them, if no more than %d wait)", mostWithoutLimit))
}

// deadLetterConfig is the dead-letter queue of queue on the broker --amqp or AMQP_URL names.
func deadLetterConfig(flagValue, queue string) (messaging.DeadLetterConfig, error) {
	if strings.TrimSpace(queue) == "" {
		return messaging.DeadLetterConfig{}, usageError{fmt.Sprintf("QUEUE %q names no queue: give the consumer's queue, invoicing say", queue)}
	}
	amqpURL, err := urlListFrom("amqp", flagValue, "AMQP_URL", parseAMQPURL, "amqp", "amqps")
	if err != nil {
		return messaging.DeadLetterConfig{}, err
	}
	return messaging.DeadLetterConfig{URL: amqpURL, Queue: queue, ConnectionName: "outboxctl"}, nil
}
