package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// writeJSON writes v as indented JSON, HTML characters as they are.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

// pipeSafe writes to w with SIGPIPE caught: a write to a stdout whose reader went away
// (outboxctl … | head) then fails with EPIPE instead of killing the process, so that a command
// that changed something can still say so on stderr.
type pipeSafe struct{ w io.Writer }

func (p pipeSafe) Write(b []byte) (int, error) {
	pipe := make(chan os.Signal, 1) // Notify, not Ignore: Reset would not undo an Ignore
	signal.Notify(pipe, syscall.SIGPIPE)
	defer signal.Stop(pipe)
	return p.w.Write(b)
}

// writeRecord writes record, what an action already done printed, to the output, or if that
// fails to stderr, and returns the failure: a drop's record may be the last there is of the
// message.
func (c *cli) writeRecord(record []byte) error {
	_, err := pipeSafe{c.out}.Write(record)
	if err == nil {
		return nil
	}
	fmt.Fprintf(c.err, "the record of what was done could not be written to the output (%v); here it is:\n", err)
	_, _ = c.err.Write(record)
	return fmt.Errorf("write the record of what was done: %w", err)
}

// newTable starts a table; Flush prints it.
func newTable(w io.Writer) *tabwriter.Writer { return tabwriter.NewWriter(w, 0, 4, 2, ' ', 0) }

// utc returns t in UTC, nil for nil: what -o json shows.
func utc(t *time.Time) *time.Time {
	if t == nil {
		return nil
	}
	u := t.UTC()
	return &u
}

// when prints a time for a table, in UTC.
func when(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

// outboxRow is an outbox row in -o json.
type outboxRow struct {
	ID            uuid.UUID  `json:"id"`
	Type          string     `json:"type"`
	CorrelationID string     `json:"correlation_id"`
	OccurredAt    time.Time  `json:"occurred_at"`
	ProcessedAt   *time.Time `json:"processed_at"`
	Attempts      int        `json:"attempts"`
	LastError     *string    `json:"last_error"`
	NextAttemptAt *time.Time `json:"next_attempt_at"` // null while parked
	Exchange      *string    `json:"exchange"`        // null: the relay's
	RoutingKey    *string    `json:"routing_key"`     // null: the type
	ParkedAt      *time.Time `json:"parked_at"`
	ParkedReason  *string    `json:"parked_reason"`
	// Payload only where a command says so: outbox drop, and its dry run.
	Payload json.RawMessage `json:"payload,omitempty"`
}

func toOutboxRow(m messaging.OutboxMessage) outboxRow {
	r := outboxRow{
		ID: m.ID, Type: m.Type, CorrelationID: m.CorrelationID, OccurredAt: m.OccurredAt.UTC(), ProcessedAt: utc(m.ProcessedAt),
		Attempts: m.Attempts, LastError: m.LastError, Exchange: m.Exchange, RoutingKey: m.RoutingKey,
		ParkedAt: utc(m.ParkedAt), ParkedReason: m.ParkedReason, Payload: m.Payload,
	}
	if !m.NextAttemptAt.IsZero() {
		r.NextAttemptAt = utc(&m.NextAttemptAt)
	}
	return r
}

func toOutboxRows(ms []messaging.OutboxMessage) []outboxRow {
	rows := make([]outboxRow, len(ms))
	for i, m := range ms {
		rows[i] = toOutboxRow(m)
	}
	return rows
}

// outboxRowsResult is what retry prints in -o json; rowStream prints the same, its count after
// its rows.
type outboxRowsResult struct {
	DryRun      bool        `json:"dry_run"`
	Rows        []outboxRow `json:"rows"`
	Count       int         `json:"count"`
	Interrupted bool        `json:"interrupted,omitempty"` // retry, or its dry run, stopped between its batches
}

// rowStream prints the rows retry made due as each batch commits (or, in a dry run, as each
// batch is read), so that none is held once printed: a table, each batch's part aligned on
// its own, then a summary line; or, in -o json, an outboxRowsResult written a row at a time.
// It writes through pipeSafe, and after a failed write writes nothing more, returning that
// failure: retry stops between batches, and says on stderr what it did.
type rowStream struct {
	w      io.Writer
	json   bool
	dryRun bool
	n      int   // rows printed
	failed error // the output's first failure
}

func (s *rowStream) Write(p []byte) (int, error) {
	if s.failed != nil {
		return 0, s.failed
	}
	n, err := pipeSafe{s.w}.Write(p)
	s.failed = err
	return n, err
}

func (s *rowStream) add(rows []messaging.OutboxMessage) error {
	if len(rows) == 0 {
		return nil
	}
	var b bytes.Buffer // a batch goes out in one write
	if !s.json {
		tw := newTable(&b)
		if s.n == 0 {
			fmt.Fprintln(tw, outboxRowsHeader)
		}
		s.n += len(rows)
		writeOutboxRows(tw, rows)
		if err := tw.Flush(); err != nil {
			return err
		}
		_, err := s.Write(b.Bytes())
		return err
	}
	if s.n == 0 {
		b.WriteString(s.head())
	}
	enc := json.NewEncoder(&b)
	enc.SetIndent("    ", "  ")
	enc.SetEscapeHTML(false)
	for _, m := range rows {
		if s.n > 0 {
			b.WriteString(",")
		}
		b.WriteString("\n    ")
		if err := enc.Encode(toOutboxRow(m)); err != nil {
			return err
		}
		b.Truncate(b.Len() - 1) // Encode's newline
		s.n++
	}
	_, err := s.Write(b.Bytes())
	return err
}

func (s *rowStream) head() string {
	return fmt.Sprintf("{\n  \"dry_run\": %t,\n  \"rows\": [", s.dryRun)
}

// end prints, after the rows, the summary line of a table (if any), or the rest of the JSON
// result. It returns the output's first failure, even with nothing left to print: a dry run's
// heading that could not be written is a failure too.
func (s *rowStream) end(summary string, interrupted bool) error {
	if s.failed != nil {
		return s.failed
	}
	if !s.json {
		if summary == "" {
			return nil
		}
		_, err := fmt.Fprintln(s, summary)
		return err
	}
	tail := "\n  ],\n"
	if s.n == 0 {
		tail = s.head() + "],\n"
	}
	tail += fmt.Sprintf("  \"count\": %d", s.n)
	if interrupted {
		tail += ",\n  \"interrupted\": true"
	}
	_, err := io.WriteString(s, tail+"\n}\n")
	return err
}

// outboxRowResult is what the outbox commands print in -o json.
type outboxRowResult struct {
	DryRun bool      `json:"dry_run"`
	Row    outboxRow `json:"row"`
}

// printOutboxRows prints rows as a table of what an operator decides on: id, type, attempts,
// the next attempt (or since when the row is parked, and why), the last error.
func printOutboxRows(w io.Writer, rows []messaging.OutboxMessage) error {
	tw := newTable(w)
	fmt.Fprintln(tw, outboxRowsHeader)
	writeOutboxRows(tw, rows)
	return tw.Flush()
}

const outboxRowsHeader = "MESSAGE ID\tTYPE\tATTEMPTS\tNEXT ATTEMPT\tLAST ERROR"

func writeOutboxRows(tw *tabwriter.Writer, rows []messaging.OutboxMessage) {
	now := time.Now()
	for _, m := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", m.ID, printable(m.Type, 64), m.Attempts, nextAttempt(m, now), printable(deref(m.LastError), 200))
	}
}

// describeRow says in one line what an operator needs to know of one row.
func describeRow(m messaging.OutboxMessage) string {
	s := fmt.Sprintf("outbox row %s (%s, occurred %s, %d attempts", m.ID, printable(m.Type, 64), when(m.OccurredAt), m.Attempts)
	if m.LastError != nil {
		s += ", last error: " + printable(*m.LastError, 200)
	}
	return s + ")"
}

// nextAttempt says when a row is tried next, in UTC and from now; for a parked row, since when
// it is parked, and why.
func nextAttempt(m messaging.OutboxMessage, now time.Time) string {
	if m.Parked() {
		s := "parked since " + when(*m.ParkedAt)
		if m.ParkedReason != nil {
			s += ": " + printable(*m.ParkedReason, 100)
		}
		return s
	}
	at := m.NextAttemptAt.UTC().Format(time.RFC3339)
	if wait := m.NextAttemptAt.Sub(now); wait > 0 {
		return fmt.Sprintf("%s (in %s)", at, wait.Round(time.Second))
	}
	return at + " (due)"
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// deadLetter is a dead-lettered message in -o json.
type deadLetter struct {
	MessageID      string          `json:"message_id"`
	Type           string          `json:"type"`
	Reason         string          `json:"reason"`
	DeadLetteredAt *time.Time      `json:"dead_lettered_at"` // null when unknown
	ContentType    string          `json:"content_type"`
	Headers        *map[string]any `json:"headers,omitempty"`     // with --show-headers, and for dlq drop: {} when none
	Body           *string         `json:"body,omitempty"`        // the body when it is UTF-8 text (--show-body, dlq drop)
	BodyBase64     *string         `json:"body_base64,omitempty"` // or else the body in base64
}

// jsonTable is t as JSON can write it, never nil: a number it cannot write (NaN or an infinity,
// which another language's producer may send) becomes its text. dlq drop prints its record
// after the message is gone: it must not fail on what the message holds.
func jsonTable(t amqp.Table) map[string]any {
	out := make(map[string]any, len(t))
	for k, v := range t {
		out[k] = jsonValue(v)
	}
	return out
}

// jsonValue is v as JSON can write it (see jsonTable).
func jsonValue(v any) any {
	switch v := v.(type) {
	case float64:
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return strconv.FormatFloat(v, 'g', -1, 64)
		}
	case float32:
		if f := float64(v); math.IsNaN(f) || math.IsInf(f, 0) {
			return strconv.FormatFloat(f, 'g', -1, 64)
		}
	case amqp.Table:
		return jsonTable(v)
	case []any:
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = jsonValue(x)
		}
		return out
	}
	return v
}

// toDeadLetter is d for -o json, with its headers and body if asked for.
func toDeadLetter(d messaging.DeadLetter, headers, body bool) deadLetter {
	out := deadLetter{MessageID: d.MessageID, Type: d.Type, Reason: d.Reason, ContentType: d.ContentType}
	if !d.DeadLetteredAt.IsZero() {
		out.DeadLetteredAt = utc(&d.DeadLetteredAt)
	}
	if headers {
		h := jsonTable(d.Headers)
		out.Headers = &h
	}
	if body {
		if utf8.Valid(d.Body) {
			s := string(d.Body)
			out.Body = &s
		} else {
			s := base64.StdEncoding.EncodeToString(d.Body)
			out.BodyBase64 = &s
		}
	}
	return out
}

func toDeadLetters(ds []messaging.DeadLetter, headers, body bool) []deadLetter {
	out := make([]deadLetter, len(ds))
	for i, d := range ds {
		out[i] = toDeadLetter(d, headers, body)
	}
	return out
}

// printDeadLetters prints a table of messages: id, type, when and why dead-lettered.
func printDeadLetters(w io.Writer, ds []messaging.DeadLetter) error {
	tw := newTable(w)
	fmt.Fprintln(tw, "MESSAGE ID\tTYPE\tDEAD-LETTERED AT\tREASON")
	for _, d := range ds {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", printable(d.MessageID, 64), printable(d.Type, 64), when(d.DeadLetteredAt), printable(d.Reason, 300))
	}
	return tw.Flush()
}

// How much of a body printDeadLetter shows: none, the first maxBodyShown bytes (a listing; -o
// json shows it whole), or all of it (the last record of a message dropped).
const (
	noBody       = 0
	maxBodyShown = 4096
	wholeBody    = -1
)

// printDeadLetter prints one message in full, as a block: what the table shows, then its
// headers if asked for, and as much of its body as bodyShown says.
func printDeadLetter(w io.Writer, d messaging.DeadLetter, headers bool, bodyShown int) {
	fmt.Fprintf(w, "message %s\n", printable(d.MessageID, 64))
	fmt.Fprintf(w, "  type:              %s\n", printable(d.Type, 64))
	fmt.Fprintf(w, "  dead-lettered at:  %s\n", when(d.DeadLetteredAt))
	fmt.Fprintf(w, "  reason:            %s\n", printable(d.Reason, 2000))
	if headers {
		fmt.Fprintln(w, "  headers:")
		valueLimit := 2000
		if bodyShown == wholeBody {
			valueLimit = math.MaxInt
		}
		for _, k := range slices.Sorted(maps.Keys(d.Headers)) {
			fmt.Fprintf(w, "    %s: %s\n", printable(k, 100), printable(fmt.Sprint(d.Headers[k]), valueLimit))
		}
	}
	if bodyShown != noBody {
		fmt.Fprintf(w, "  body (%s, %d bytes):\n", printable(d.ContentType, 100), len(d.Body))
		fmt.Fprintln(w, indent(showBody(d.Body, bodyShown), "    "))
	}
}

// showBody is a body as it is, if it is UTF-8 text with no control characters but line breaks
// and tabs (which a terminal would act on), or else in base64: either way exact. A limit above
// 0 cuts it there.
func showBody(b []byte, limit int) string {
	s, prefix := string(b), ""
	if !utf8.Valid(b) || strings.ContainsFunc(s, func(r rune) bool { return r != '\n' && r != '\t' && unicode.IsControl(r) }) {
		s, prefix = base64.StdEncoding.EncodeToString(b), "base64: "
	}
	if limit > 0 && len(s) > limit {
		shown := strings.ToValidUTF8(s[:limit], "")
		return prefix + shown + fmt.Sprintf("\n… %d more bytes (-o json shows them all)", len(s)-len(shown))
	}
	return prefix + s
}

// indent puts prefix before every line of s.
func indent(s, prefix string) string {
	return prefix + strings.ReplaceAll(s, "\n", "\n"+prefix)
}
