package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
)

// enqueue commits n messages to the outbox, one after the other, and returns their ids.
func enqueue(t *testing.T, db *gorm.DB, n int) []uuid.UUID {
	t.Helper()
	return enqueueType(t, db, "OrderPlaced", n)
}

// enqueueType is enqueue with messages of type msgType.
func enqueueType(t *testing.T, db *gorm.DB, msgType string, n int) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, n)
	drv, err := gormdriver.New(db)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Transaction(func(tx *gorm.DB) error {
		for i := range ids {
			m, err := messaging.NewMessage(msgType, map[string]int{"n": i})
			if err != nil {
				return err
			}
			ids[i] = m.ID
			if err := messaging.Enqueue(context.Background(), drv, tx, m); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// execSQL runs a statement on db, or fails the test.
func execSQL(t *testing.T, db *gorm.DB, query string, args ...any) {
	t.Helper()
	if err := db.Exec(query, args...).Error; err != nil {
		t.Fatal(err)
	}
}

// fail makes row id look as the relay leaves a row the broker refused, due in an hour.
func fail(t *testing.T, db *gorm.DB, id uuid.UUID, attempts int, lastError string) {
	t.Helper()
	execSQL(t, db, `UPDATE outbox_messages SET attempts = ?, last_error = ?, next_attempt_at = now() + interval '1 hour' WHERE id = ?`,
		attempts, lastError, id)
}

// enqueueFailed enqueues n rows and makes each look refused attempts times by the broker.
func enqueueFailed(t *testing.T, d *testenv.Database, n, attempts int) []uuid.UUID {
	t.Helper()
	ids := enqueue(t, d.DB, n)
	for _, id := range ids {
		fail(t, d.DB, id, attempts, "message nacked by the broker")
	}
	return ids
}

// due reports whether row id is due now, and its attempts and last error.
func due(t *testing.T, db *gorm.DB, id uuid.UUID) (isDue bool, attempts int, lastError string) {
	t.Helper()
	var row struct {
		Due       bool
		Attempts  int
		LastError *string
	}
	if err := db.Raw(`SELECT next_attempt_at <= now() AS due, attempts, last_error FROM outbox_messages WHERE id = ?`, id).Scan(&row).Error; err != nil {
		t.Fatal(err)
	}
	return row.Due, row.Attempts, deref(row.LastError)
}

// outboxState is every row of the outbox as text, all its columns: what a dry run, or a
// refusal, must leave as it was.
func outboxState(t *testing.T, d *testenv.Database) string {
	t.Helper()
	var rows []string
	if err := d.DB.Raw(`SELECT (o.*)::text FROM outbox_messages o ORDER BY id`).Scan(&rows).Error; err != nil {
		t.Fatal(err)
	}
	return strings.Join(rows, "\n")
}

// parked reads whether row id is parked, its reason, and whether it is never due.
func parked(t *testing.T, db *gorm.DB, id uuid.UUID) (isParked bool, reason string, neverDue bool) {
	t.Helper()
	var row struct {
		Parked   bool
		Reason   *string
		NeverDue bool
	}
	if err := db.Raw(`SELECT parked_at IS NOT NULL AS parked, parked_reason AS reason, next_attempt_at = 'infinity' AS never_due
		FROM outbox_messages WHERE id = ?`, id).Scan(&row).Error; err != nil {
		t.Fatal(err)
	}
	return row.Parked, deref(row.Reason), row.NeverDue
}

func rowIDs(rows []outboxRow) []uuid.UUID {
	ids := make([]uuid.UUID, len(rows))
	for i, r := range rows {
		ids[i] = r.ID
	}
	return ids
}

func TestStatusShowsTheBacklogItsAgeAttemptsErrorsAndParkedRows(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	out := ok(t, "status", "--db", d.URL)
	for _, want := range []string{"unsent rows:            0", "oldest unsent row:      none", "highest attempt count:  0",
		"parked rows:            0", "no unsent row has failed"} {
		if !strings.Contains(out, want) {
			t.Errorf("empty outbox: status lacks %q:\n%s", want, out)
		}
	}

	ids := enqueue(t, d.DB, 5)
	execSQL(t, d.DB, `UPDATE outbox_messages SET occurred_at = now() - interval '10 minutes' WHERE id = ?`, ids[0])
	execSQL(t, d.DB, `UPDATE outbox_messages SET processed_at = now() WHERE id = ?`, ids[3])
	fail(t, d.DB, ids[1], 7, "message unroutable: exchange \"orders\" routing key \"OrderPlaced\": 312 NO_ROUTE")
	fail(t, d.DB, ids[2], 2, "message nacked by the broker\n(second line)")
	// Parked, older and with more attempts than any other: it counts apart.
	execSQL(t, d.DB, `UPDATE outbox_messages SET occurred_at = now() - interval '1 day' WHERE id = ?`, ids[4])
	fail(t, d.DB, ids[4], 40, "message too large")
	ok(t, "outbox", "park", "--id", ids[4].String(), "--reason", "over the broker's max message size", "--db", d.URL)

	out = ok(t, "status", "--db", d.URL)
	for _, want := range []string{
		"unsent rows:            3", "oldest unsent row:      10m", "highest attempt count:  7", "parked rows:            1",
		"latest errors (the latest 2 of the unsent rows that failed",
		ids[1].String(), `message unroutable: exchange "orders" routing key "OrderPlaced": 312 NO_ROUTE`,
		ids[2].String(), "message nacked by the broker (second line)",
		"parked rows (1 of 1", ids[4].String(), "over the broker's max message size", "message too large",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status lacks %q:\n%s", want, out)
		}
	}
	if !regexp.MustCompile(ids[1].String() + `\s+OrderPlaced\s+7\s+\S+ \(in (59m\d+s|1h0m0s)\)`).MatchString(out) {
		t.Errorf("status does not show the row's type, attempts and next attempt:\n%s", out)
	}
	if !regexp.MustCompile(ids[4].String() + `\s+OrderPlaced\s+40\s+parked since \S+: over the broker's max message size\s+message too large`).MatchString(out) {
		t.Errorf("status does not show the parked row with its reason:\n%s", out)
	}
	if strings.Contains(out, ids[0].String()) || strings.Contains(out, ids[3].String()) {
		t.Errorf("status lists a row that has not failed:\n%s", out)
	}

	s := okJSON[statusResult](t, "status", "--db", d.URL)
	if s.Unsent != 3 || s.Parked != 1 || s.MaxAttempts != 7 || s.OldestUnsentSeconds < 590 || s.OldestUnsentSeconds > 900 {
		t.Errorf("status -o json: %+v; want 3 unsent, 1 parked, 7 attempts, 10 minutes", s)
	}
	if got := rowIDs(s.LatestErrors); len(got) != 2 || !slices.Contains(got, ids[1]) || !slices.Contains(got, ids[2]) {
		t.Errorf("status -o json: latest errors %v, want rows 1 and 2", got)
	}
	if len(s.LatestParked) != 1 || s.LatestParked[0].ID != ids[4] || deref(s.LatestParked[0].ParkedReason) != "over the broker's max message size" ||
		s.LatestParked[0].NextAttemptAt != nil || s.LatestParked[0].ParkedAt == nil || s.LatestParked[0].Attempts != 40 {
		t.Errorf("status -o json: parked %+v, want row 4 with its reason, no next attempt", s.LatestParked)
	}
}

// retry makes every failed row due now, keeps each row's attempts and last error, and wakes
// the relays at once. Without a terminal, as in a script, it acts on every row without --yes: a
// retry loses nothing.
func TestRetryMakesEveryFailedRowDueAndWakesTheRelay(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	ids := enqueue(t, d.DB, 3)
	fail(t, d.DB, ids[0], 3, "message nacked by the broker")
	fail(t, d.DB, ids[1], 9, "message unroutable")

	woken := listenAsARelay(t, d)
	code, out, stderr := ctl(t, "retry", "--db", d.URL)
	if code != 0 || !strings.Contains(out, "2 failed outbox rows were waiting") || !strings.Contains(stderr, "make these 2 outbox rows due now: no terminal to ask on; going on") {
		t.Errorf("retry without a terminal: exit %d, stdout %q, stderr %q; want 2 rows retried, saying it did not ask", code, out, stderr)
	}
	woken("retry")
	for i, want := range []struct {
		attempts  int
		lastError string
	}{{3, "message nacked by the broker"}, {9, "message unroutable"}, {0, ""}} {
		if isDue, attempts, lastError := due(t, d.DB, ids[i]); !isDue || attempts != want.attempts || lastError != want.lastError {
			t.Errorf("row %d: due=%v attempts=%d last_error=%q; want due, %d, %q", i, isDue, attempts, lastError, want.attempts, want.lastError)
		}
	}
	if out := ok(t, "retry", "--db", d.URL); !strings.Contains(out, "0 failed outbox rows") {
		t.Errorf("a second retry said %q, want 0 rows", out)
	}
}

// --dry-run lists the rows retry would make due, --type and --limit pick the oldest of a type,
// and what was listed is what is retried; a parked row is never among them.
func TestRetryDryRunTypeAndLimit(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	placed := enqueueType(t, d.DB, "OrderPlaced", 3)
	issued := enqueueType(t, d.DB, "InvoiceIssued", 1)
	for _, id := range append(slices.Clone(placed), issued...) {
		fail(t, d.DB, id, 2, "message nacked by the broker")
	}
	ok(t, "outbox", "park", "--id", placed[0].String(), "--db", d.URL)
	before := outboxState(t, d)

	for _, batch := range []string{"10000", "1"} { // one read, and a read per row
		dry := okJSON[outboxRowsResult](t, "retry", "--dry-run", "--batch", batch, "--db", d.URL)
		if !dry.DryRun || dry.Count != 3 || !slices.Equal(rowIDs(dry.Rows), []uuid.UUID{placed[1], placed[2], issued[0]}) {
			t.Errorf("retry --dry-run --batch %s -o json: %+v; want rows 1, 2 and the InvoiceIssued, oldest first, the parked one aside", batch, dry)
		}
	}
	out := ok(t, "retry", "--dry-run", "--db", d.URL, "--type", "OrderPlaced", "--limit", "1")
	if !strings.Contains(out, "would make 1 failed outbox rows due now (dry run") || !strings.Contains(out, placed[1].String()) ||
		strings.Contains(out, placed[2].String()) {
		t.Errorf("retry --dry-run --type --limit 1 said %q; want row 1 only", out)
	}
	if after := outboxState(t, d); after != before {
		t.Fatalf("a dry run changed the outbox:\n%s\n%s", before, after)
	}

	got := okJSON[outboxRowsResult](t, "retry", "--type", "OrderPlaced", "--limit", "1", "--db", d.URL)
	if got.DryRun || got.Count != 1 || got.Rows[0].ID != placed[1] || got.Rows[0].NextAttemptAt == nil || got.Rows[0].NextAttemptAt.After(time.Now()) {
		t.Errorf("retry --type --limit 1 -o json: %+v; want row 1, due now", got)
	}
	for id, want := range map[uuid.UUID]bool{placed[0]: false, placed[1]: true, placed[2]: false, issued[0]: false} {
		if isDue, _, _ := due(t, d.DB, id); isDue != want {
			t.Errorf("row %s due=%v, want %v", id, isDue, want)
		}
	}
	if isParked, _, neverDue := parked(t, d.DB, placed[0]); !isParked || !neverDue {
		t.Error("retry touched the parked row")
	}
	wantExit(t, exitNoMatch, []string{"retry", "--type", "NoSuchType", "--db", d.URL, "--yes"}, `no unsent row of type "NoSuchType"`)
}

// A --limit of 0, as a script's --limit "$N" with N computed as 0 gives it, is a usage error
// that changes nothing: left out, a retry makes every row due, and 0 must not do the same.
func TestRetryRefusesALimitOfZero(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	enqueueFailed(t, d, 3, 1)
	before := outboxState(t, d)
	// No terminal: without the check, the retry would go on without asking.
	code, stdout, stderr := ctl(t, "retry", "--limit", "0", "--db", d.URL)
	if code != exitUsage || stdout != "" || !strings.Contains(stderr, "--limit 0: want 1 or more, or leave it out for all") {
		t.Errorf("retry --limit 0: exit %d, stdout %q, stderr %q; want 2 naming --limit", code, stdout, stderr)
	}
	if after := outboxState(t, d); after != before {
		t.Fatalf("retry --limit 0 changed the outbox:\n%s\n%s", before, after)
	}
}

// At a terminal, retry asks before it acts on more than one row, and does nothing unless the
// answer is yes; declined, -o json prints a result of no rows, as a declined redrive does.
func TestRetryAsksAtATerminal(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	ids := enqueue(t, d.DB, 2)
	fail(t, d.DB, ids[0], 1, "message nacked by the broker")
	fail(t, d.DB, ids[1], 1, "message nacked by the broker")
	before := outboxState(t, d)
	for _, answer := range []string{"n\n", "\n", ""} {
		code, stdout, stderr := ctlAt(t, &terminal{answer}, "retry", "--db", d.URL)
		if code != exitNotConfirmed || !strings.Contains(stderr, "make these 2 outbox rows due now? [y/N]") ||
			!strings.Contains(stderr, ids[0].String()) || stdout != "" {
			t.Errorf("retry answered %q: exit %d, stdout %q, stderr %q; want 4 after listing the rows and asking", answer, code, stdout, stderr)
		}
	}
	if code, stdout, _ := ctlAt(t, &terminal{"n\n"}, "retry", "--db", d.URL, "-o", "json"); code != exitNotConfirmed ||
		!strings.Contains(stdout, `"rows": []`) || decode[outboxRowsResult](t, stdout).Count != 0 {
		t.Errorf("retry declined, -o json: exit %d, stdout %q; want 4 and a result of no rows", code, stdout)
	}
	if after := outboxState(t, d); after != before {
		t.Fatalf("a declined retry changed the outbox:\n%s\n%s", before, after)
	}
	// Past 20 rows, the oldest 20 and a count.
	more := enqueue(t, d.DB, 23)
	for _, id := range more {
		fail(t, d.DB, id, 1, "message nacked by the broker")
	}
	_, _, stderr := ctlAt(t, &terminal{"n\n"}, "retry", "--db", d.URL)
	if listed := strings.Count(stderr, "message nacked by the broker"); listed != 20 || !strings.Contains(stderr, "... and 5 more (--dry-run lists them all)") ||
		!strings.Contains(stderr, "make these 25 outbox rows due now? [y/N]") {
		t.Errorf("retry of 25 rows at a terminal listed %d of them; want 20, a count of the 5 more, and the question of 25:\n%s", listed, stderr)
	}
	if dry := okJSON[outboxRowsResult](t, "retry", "--dry-run", "--db", d.URL); dry.Count != 25 || len(dry.Rows) != 25 {
		t.Errorf("retry --dry-run -o json: %d rows of %d, want all 25", len(dry.Rows), dry.Count)
	}
	code, stdout, stderr := ctlAt(t, &terminal{"yes\n"}, "retry", "--db", d.URL)
	if code != 0 || !strings.Contains(stdout, "25 failed outbox rows were waiting") {
		t.Fatalf("retry answered yes: exit %d, %q %q", code, stdout, stderr)
	}
	for _, id := range append(ids, more...) {
		if isDue, _, _ := due(t, d.DB, id); !isDue {
			t.Errorf("row %s is not due after a confirmed retry", id)
		}
	}
}

// What is confirmed is what is done: a listed row parked, or sent, while the question waits is
// left as it is, and stderr says how many were; the others are made due.
func TestRetryLeavesRowsChangedWhileItAsked(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	ids := enqueueFailed(t, d, 4, 2)
	in := &answerAfter{answer: strings.NewReader("y\n"), before: func() {
		if err := d.DB.Exec("UPDATE outbox_messages SET parked_at = now(), next_attempt_at = 'infinity' WHERE id = ?", ids[1]).Error; err != nil {
			t.Error(err)
		}
		if err := d.DB.Exec("UPDATE outbox_messages SET processed_at = now() WHERE id = ?", ids[2]).Error; err != nil {
			t.Error(err)
		}
	}}
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"retry", "--db", d.URL}, streams{in: in, out: &stdout, err: &stderr, interactive: true})
	if code != exitOK || !strings.Contains(stderr.String(), "2 of the 4 rows listed were sent, parked or made due meanwhile, and left as they were") ||
		!strings.Contains(stdout.String(), "2 failed outbox rows were waiting for their next attempt; they are due now") {
		t.Fatalf("retry with rows changed while it asked: exit %d, stdout %q, stderr %q; want 0, two made due and two left", code, stdout.String(), stderr.String())
	}
	for i, id := range ids {
		isDue, attempts, _ := due(t, d.DB, id)
		if want := i == 0 || i == 3; isDue != want || attempts != 2 {
			t.Errorf("row %d after the retry: due %v, attempts %d; want due %v, attempts 2", i, isDue, attempts, want)
		}
	}
	if parked := testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE id = ? AND parked_at IS NOT NULL AND next_attempt_at = 'infinity'", ids[1]); parked != 1 {
		t.Errorf("the row parked while retry asked was made due")
	}
}

// What retry shows before it asks is the rows it listed, as they are now: a row that began to
// wait out a backoff after the listing is not retried, so it is not shown either. The oldest
// row, due when retry lists the rows, is made to wait before it reads the rows it shows.
func TestRetryShowsTheRowsItListedBeforeItAsks(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	ids := enqueue(t, d.DB, 3)
	fail(t, d.DB, ids[1], 2, "message nacked by the broker")
	fail(t, d.DB, ids[2], 2, "message nacked by the broker")
	// last_error: in what reads rows to show them, not in the listing of the ids.
	dbURL := beforeFirstQueryWith(t, d, "last_error", func() {
		if err := d.DB.Exec(`UPDATE outbox_messages SET attempts = 1, last_error = 'refused after the listing', next_attempt_at = now() + interval '1 hour' WHERE id = ?`, ids[0]).Error; err != nil {
			t.Error(err)
		}
	})
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"retry", "--db", dbURL}, streams{in: strings.NewReader("y\n"), out: &stdout, err: &stderr, interactive: true})
	if code != exitOK || strings.Contains(stderr.String(), ids[0].String()) ||
		!strings.Contains(stderr.String(), ids[1].String()) || !strings.Contains(stderr.String(), ids[2].String()) {
		t.Fatalf("retry with a row made to wait after the listing: exit %d, stderr %q; want 0, the two rows listed shown, not the other", code, stderr.String())
	}
	if isDue, attempts, lastError := due(t, d.DB, ids[0]); isDue || attempts != 1 || lastError != "refused after the listing" {
		t.Errorf("the row made to wait after the listing: due %v, attempts %d, last error %q; want it waiting as the test left it", isDue, attempts, lastError)
	}
	for _, id := range ids[1:] {
		if isDue, _, _ := due(t, d.DB, id); !isDue {
			t.Errorf("row %s, listed and confirmed, is not due", id)
		}
	}
}

// beforeFirstQueryWith returns d's URL through a proxy that runs change once, before it passes
// on the first bytes from a client that hold marker (part of a query's text): a change made
// between two of a command's queries, whatever the timing. The proxy sees the queries as long
// as the connection is not encrypted.
func beforeFirstQueryWith(t *testing.T, d *testenv.Database, marker string, change func()) string {
	t.Helper()
	upstream := testenv.DatabaseHost(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	var once sync.Once
	go func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return // closed: the test ended
			}
			server, err := net.Dial("tcp", upstream)
			if err != nil {
				_ = client.Close() // the command fails to connect, and says so
				continue
			}
			go func() {
				_, _ = io.Copy(client, server)
				_ = client.Close()
			}()
			go func() {
				defer server.Close()
				buf, tail := make([]byte, 64<<10), []byte(nil)
				for {
					n, err := client.Read(buf)
					if n > 0 {
						// With the end of the last read: a marker split between two reads is seen.
						seen := slices.Concat(tail, buf[:n])
						if bytes.Contains(seen, []byte(marker)) {
							once.Do(change)
						}
						tail = seen[max(0, len(seen)-len(marker)+1):]
						if _, err := server.Write(buf[:n]); err != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	u, err := url.Parse(testenv.URLVia(t, d.URL, ln.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("sslmode", "disable")
	u.RawQuery = q.Encode()
	return u.String()
}

// listenAsARelay listens on the relays' channel, as a relay does, from now on; woken waits for
// the next NOTIFY there, and fails t, saying after what, if none comes within 10 s.
func listenAsARelay(t *testing.T, d *testenv.Database) (woken func(after string)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	listener, err := pgx.Connect(ctx, d.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = listener.Close(context.Background()) })
	if _, err := listener.Exec(ctx, "LISTEN outbox_messages"); err != nil { // the library's channel
		t.Fatal(err)
	}
	return func(after string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := listener.WaitForNotification(ctx); err != nil {
			t.Fatalf("after %s, no NOTIFY reached the relays' channel: %v", after, err)
		}
	}
}

// retry --id makes that row due, waking the relays, and leaves the others; an id that names no
// unsent row, or a parked one, is an error that names it.
func TestRetryOneRowByID(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	ids := enqueue(t, d.DB, 4)
	fail(t, d.DB, ids[0], 4, "message nacked by the broker")
	fail(t, d.DB, ids[1], 4, "message nacked by the broker")
	execSQL(t, d.DB, `UPDATE outbox_messages SET processed_at = now() WHERE id = ?`, ids[2])
	ok(t, "outbox", "park", "--id", ids[3].String(), "--db", d.URL)

	before := outboxState(t, d)
	dry := okJSON[outboxRowsResult](t, "retry", "--id", ids[0].String(), "--dry-run", "--db", d.URL)
	if !dry.DryRun || dry.Count != 1 || dry.Rows[0].ID != ids[0] || dry.Rows[0].Attempts != 4 || dry.Rows[0].Payload != nil {
		t.Errorf("retry --id --dry-run -o json: %+v; want the row without its payload", dry)
	}
	if after := outboxState(t, d); after != before {
		t.Fatalf("a dry run changed the outbox:\n%s\n%s", before, after)
	}

	woken := listenAsARelay(t, d)
	if out := ok(t, "retry", "--id", ids[0].String(), "--db", d.URL); !strings.Contains(out, ids[0].String()+" is due now") {
		t.Errorf("retry --id said %q", out)
	}
	woken("retry --id")
	if isDue, attempts, _ := due(t, d.DB, ids[0]); !isDue || attempts != 4 {
		t.Errorf("the row named: due=%v attempts=%d, want due with its 4 attempts", isDue, attempts)
	}
	if isDue, _, _ := due(t, d.DB, ids[1]); isDue {
		t.Error("retry --id made another row due too")
	}
	for _, id := range []string{uuid.NewString(), ids[2].String()} { // unknown, and sent already
		for _, dryRun := range []string{"--dry-run=false", "--dry-run"} {
			wantExit(t, exitNoMatch, []string{"retry", "--db", d.URL, "--id", id, dryRun}, "no unsent outbox row has this id: "+id)
		}
	}
	wantExit(t, exitNoMatch, []string{"retry", "--db", d.URL, "--id", ids[3].String()}, "parked", "outbox unpark --id "+ids[3].String())
	if isParked, _, neverDue := parked(t, d.DB, ids[3]); !isParked || !neverDue {
		t.Error("retry --id unparked a parked row")
	}
}

// park keeps a row from the relay: it stays unsent while the relay sends the rows around it,
// then unpark sends it, waking the relay; --dry-run changes nothing; a parked row can be parked
// no more, nor a sent one at all. The relay's poll is an hour: only a NOTIFY (Enqueue's, or
// unpark's) has it claim again within the test.
func TestParkKeepsARowFromTheRelayUntilUnparked(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	exchange, queue := brokerNames(t)
	topology := messaging.Topology{Exchanges: []string{exchange}, Queues: []messaging.ConsumerTopology{
		{Queue: queue, Bindings: []messaging.Binding{{Exchange: exchange, RoutingKey: "OrderPlaced"}}}}}
	if err := topology.Declare(testenv.Connection(t), nil); err != nil {
		t.Fatal(err)
	}
	first := enqueue(t, d.DB, 2) // the oldest rows: the head of every claim
	fail(t, d.DB, first[0], 12, "message too large")
	id := first[0].String()

	before := outboxState(t, d)
	dry := okJSON[outboxRowResult](t, "outbox", "park", "--id", id, "--reason", "too large", "--dry-run", "--db", d.URL)
	if !dry.DryRun || dry.Row.ID != first[0] || dry.Row.ParkedAt != nil || dry.Row.Payload != nil {
		t.Errorf("park --dry-run -o json: %+v; want the row as it is", dry)
	}
	if out := ok(t, "outbox", "park", "--id", id, "--dry-run", "--db", d.URL); !strings.Contains(out, "would park outbox row "+id) {
		t.Errorf("park --dry-run said %q", out)
	}
	if after := outboxState(t, d); after != before {
		t.Fatalf("a dry run changed the outbox:\n%s\n%s", before, after)
	}

	got := okJSON[outboxRowResult](t, "outbox", "park", "--id", id, "--reason", "too large", "--db", d.URL)
	if got.DryRun || got.Row.ParkedAt == nil || deref(got.Row.ParkedReason) != "too large" || got.Row.NextAttemptAt != nil || got.Row.Attempts != 12 {
		t.Errorf("park -o json: %+v; want the row parked, with its reason and attempts", got)
	}
	if isParked, reason, neverDue := parked(t, d.DB, first[0]); !isParked || reason != "too large" || !neverDue {
		t.Fatalf("after park: parked=%v reason=%q never due=%v", isParked, reason, neverDue)
	}
	wantExit(t, exitNoMatch, []string{"outbox", "park", "--id", id, "--db", d.URL}, "the outbox row is parked: "+id)

	pub := messaging.NewPublisher(messaging.PublisherConfig{URL: testenv.AMQPURL(), Topology: messaging.Topology{Exchanges: []string{exchange}}})
	t.Cleanup(pub.Close)
	log, _ := testenv.NewLogger(t)
	relay, err := messaging.NewRelay(messaging.RelayConfig{DB: d.Driver(t).DB(), Sender: pub, Exchange: exchange, Logger: log, PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	background(t, relay.Run)
	sent := func(id uuid.UUID) bool {
		return testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE id = ? AND processed_at IS NOT NULL", id) == 1
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return sent(first[1]) }, "the row after the parked one was not sent")
	later := enqueue(t, d.DB, 1) // another claim, after the first
	testenv.Eventually(t, 10*time.Second, func() bool { return sent(later[0]) }, "a later row was not sent")
	if sent(first[0]) {
		t.Fatal("the relay sent the parked row")
	}
	wantExit(t, exitNoMatch, []string{"outbox", "park", "--id", first[1].String(), "--db", d.URL}, "no unsent outbox row has this id: "+first[1].String(), "it was sent at")

	wantExit(t, exitNoMatch, []string{"outbox", "unpark", "--id", later[0].String(), "--db", d.URL}, "no unsent outbox row")
	out := ok(t, "outbox", "unpark", "--id", id, "--db", d.URL)
	if !strings.Contains(out, "unparked outbox row "+id) || !strings.Contains(out, "12 attempts") {
		t.Errorf("unpark said %q", out)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return sent(first[0]) }, "the unparked row was not sent")
	if isParked, _, neverDue := parked(t, d.DB, first[0]); isParked || neverDue {
		t.Errorf("after unpark: parked=%v never due=%v", isParked, neverDue)
	}
	if got := drainIDs(t, queue); !slices.Equal(got, []string{first[1].String(), later[0].String(), id}) {
		t.Errorf("the queue got %q, want the parked row last", got)
	}
}

// unpark --dry-run changes nothing, and unpark of a row that is not parked is refused.
func TestUnparkDryRunAndRefusal(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	ids := enqueue(t, d.DB, 2)
	ok(t, "outbox", "park", "--id", ids[0].String(), "--db", d.URL)
	before := outboxState(t, d)
	dry := okJSON[outboxRowResult](t, "outbox", "unpark", "--id", ids[0].String(), "--dry-run", "--db", d.URL)
	if !dry.DryRun || dry.Row.ParkedAt == nil {
		t.Errorf("unpark --dry-run -o json: %+v; want the row as it is, parked", dry)
	}
	wantExit(t, exitNoMatch, []string{"outbox", "unpark", "--id", ids[1].String(), "--db", d.URL}, "the outbox row is not parked: "+ids[1].String())
	wantExit(t, exitNoMatch, []string{"outbox", "unpark", "--id", ids[1].String(), "--dry-run", "--db", d.URL}, "the outbox row is not parked: "+ids[1].String())
	if after := outboxState(t, d); after != before {
		t.Fatalf("a dry run or a refusal changed the outbox:\n%s\n%s", before, after)
	}
	got := okJSON[outboxRowResult](t, "outbox", "unpark", "--id", ids[0].String(), "--db", d.URL)
	if got.Row.ParkedAt != nil || got.Row.NextAttemptAt == nil || got.Row.NextAttemptAt.After(time.Now()) {
		t.Errorf("unpark -o json: %+v; want the row due now", got)
	}
}

// drop deletes one unsent row, parked or not, and shows its payload; it asks first, and
// without a terminal refuses unless given --yes; --dry-run changes nothing.
func TestDropDeletesOneUnsentRow(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	ids := enqueue(t, d.DB, 3)
	execSQL(t, d.DB, `UPDATE outbox_messages SET processed_at = now() WHERE id = ?`, ids[2])
	ok(t, "outbox", "park", "--id", ids[1].String(), "--db", d.URL)
	id := ids[0].String()

	before := outboxState(t, d)
	out := ok(t, "outbox", "drop", "--id", id, "--dry-run", "--db", d.URL)
	if !strings.Contains(out, "would drop outbox row "+id) || !strings.Contains(out, `payload: {"n": 0}`) {
		t.Errorf("drop --dry-run said %q", out)
	}
	dry := okJSON[outboxRowResult](t, "outbox", "drop", "--id", id, "--dry-run", "--db", d.URL)
	if !dry.DryRun || dry.Row.ID != ids[0] || compact(t, dry.Row.Payload) != `{"n":0}` {
		t.Errorf("drop --dry-run -o json: %+v", dry)
	}
	wantExit(t, exitNotConfirmed, []string{"outbox", "drop", "--id", id, "--db", d.URL}, "drop outbox row "+id+" for good", "--yes")
	if code, _, stderr := ctlAt(t, &terminal{"n\n"}, "outbox", "drop", "--id", id, "--db", d.URL); code != exitNotConfirmed ||
		!strings.Contains(stderr, `payload: {"n": 0}`) || !strings.Contains(stderr, "for good? [y/N]") {
		t.Errorf("drop declined at a terminal: exit %d, %q; want 4 after showing the payload", code, stderr)
	}
	if after := outboxState(t, d); after != before {
		t.Fatalf("a dry run or a refused drop changed the outbox:\n%s\n%s", before, after)
	}

	got := okJSON[outboxRowResult](t, "outbox", "drop", "--id", id, "--yes", "--db", d.URL)
	if got.DryRun || got.Row.ID != ids[0] || compact(t, got.Row.Payload) != `{"n":0}` {
		t.Errorf("drop -o json: %+v; want the row with its payload", got)
	}
	if code, stdout, stderr := ctlAt(t, &terminal{"y\n"}, "outbox", "drop", "--id", ids[1].String(), "--db", d.URL); code != 0 ||
		!strings.Contains(stdout, "dropped outbox row "+ids[1].String()) || !strings.Contains(stdout, `payload: {"n": 1}`) {
		t.Errorf("drop of the parked row, confirmed: exit %d, %q %q", code, stdout, stderr)
	}
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages"); n != 1 {
		t.Errorf("%d rows left, want the sent one", n)
	}
	for _, gone := range []string{id, ids[2].String()} { // dropped already, and sent
		wantExit(t, exitNoMatch, []string{"outbox", "drop", "--id", gone, "--yes", "--db", d.URL}, "no unsent outbox row has this id: "+gone)
	}
}

// An interrupt that comes while a drop commits lets the commit finish and prints the record of
// the row dropped: interrupted, the commit may have happened or not, and a drop that removed
// the row but printed nothing would have lost the only copy of its payload. The commit waits
// for a lock the test holds (holdCommits).
func TestDropInterruptedWhileItCommitsFinishesAndKeepsTheRecord(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	id := enqueue(t, d.DB, 1)[0]
	waiting, release := holdCommits(t, d)
	ctx, interrupt := context.WithCancel(context.Background())
	defer interrupt()
	var stdout, stderr bytes.Buffer
	codes := make(chan int, 1)
	go func() {
		codes <- run(ctx, []string{"outbox", "drop", "--id", id.String(), "--yes", "-o", "json", "--db", d.URL},
			streams{in: strings.NewReader(""), out: &stdout, err: &stderr})
	}()
	testenv.Eventually(t, 10*time.Second, waiting, "the drop never reached its commit")
	interrupt()
	select {
	case code := <-codes:
		t.Fatalf("drop interrupted while it committed returned %d before its commit ended: stdout %q, stderr %q", code, stdout.String(), stderr.String())
	case <-time.After(200 * time.Millisecond): // time for a wrong return to come; the right one cannot
	}
	release()
	code := exitWithin(t, codes, "drop did not end")
	left := testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages")
	if code != exitOK || left != 0 {
		t.Fatalf("drop interrupted while it committed: exit %d, %d rows left, stdout %q, stderr %q; want it committed and reported",
			code, left, stdout.String(), stderr.String())
	}
	if got := decode[outboxRowResult](t, stdout.String()); got.Row.ID != id || compact(t, got.Row.Payload) != `{"n":0}` {
		t.Errorf("drop interrupted while it committed printed %+v; want the row with its payload", got)
	}
}

// retry --id interrupted while its change commits reports the row due, once the commit is in:
// a read of the row after the commit, on the interrupted context, would fail, exit 1 with
// nothing on stdout, though the row is due. The commit waits for a lock the test holds.
func TestRetryOneInterruptedWhileItCommitsReportsTheRowDue(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	id := enqueueFailed(t, d, 1, 3)[0]
	waiting, release := holdCommits(t, d, "UPDATE")
	ctx, interrupt := context.WithCancel(context.Background())
	defer interrupt()
	var stdout, stderr bytes.Buffer
	codes := make(chan int, 1)
	go func() {
		codes <- run(ctx, []string{"retry", "--id", id.String(), "-o", "json", "--db", d.URL},
			streams{in: strings.NewReader(""), out: &stdout, err: &stderr})
	}()
	testenv.Eventually(t, 10*time.Second, waiting, "the retry never reached its commit")
	interrupt()
	release()
	code := exitWithin(t, codes, "retry did not end")
	isDue, attempts, _ := due(t, d.DB, id)
	if code != exitOK || !isDue {
		t.Fatalf("retry --id interrupted while it committed: exit %d, due %v, stdout %q, stderr %q; want it committed and reported",
			code, isDue, stdout.String(), stderr.String())
	}
	got := decode[outboxRowsResult](t, stdout.String())
	if got.DryRun || got.Count != 1 || got.Rows[0].ID != id || got.Rows[0].Attempts != attempts || got.Rows[0].NextAttemptAt == nil ||
		got.Rows[0].NextAttemptAt.After(time.Now()) || got.Rows[0].Payload != nil {
		t.Errorf("retry --id interrupted while it committed printed %+v; want the row due, without its payload", got)
	}
}

// A drop whose record cannot be written to the output (a full disk, a closed pipe) puts it on
// stderr and exits 1: the record may be the only copy of the payload, and exit 0 would say all
// went well. A closed pipe is tried with the binary, where SIGPIPE would end the process first.
func TestDropWhoseOutputFailsKeepsTheRecordOnStderr(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	ids := enqueue(t, d.DB, 3)
	for i, format := range []string{"table", "json"} {
		id := ids[i]
		var stderr bytes.Buffer
		code := run(context.Background(), []string{"outbox", "drop", "--id", id.String(), "--yes", "-o", format, "--db", d.URL},
			streams{in: strings.NewReader(""), out: failingWriter{}, err: &stderr})
		if left := testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE id = ?", id); left != 0 {
			t.Fatalf("-o %s: the row is still there; want it dropped", format)
		}
		if code != exitFailure || !strings.Contains(stderr.String(), id.String()) ||
			!strings.Contains(stderr.String(), "the record of what was done could not be written to the output (no space left on device)") || !strings.Contains(stderr.String(), `"n"`) {
			t.Errorf("-o %s: drop with a failing output: exit %d, stderr %q; want 1, with the row's record", format, code, stderr.String())
		}
	}
	code, stderr := runIntoPipe(t, false, "outbox", "drop", "--id", ids[2].String(), "--yes", "--db", d.URL)
	if code != exitFailure || !strings.Contains(stderr, "dropped outbox row "+ids[2].String()) || !strings.Contains(stderr, "broken pipe") {
		t.Errorf("drop into a closed pipe: exit %d, stderr %q; want 1, with the row's record", code, stderr)
	}
}

// retry into a pipe its reader closes partway (outboxctl retry | head -5) stops between
// batches, says on stderr how far it got, and exits 1, as a batch that fails does. A write to
// a closed stdout raises SIGPIPE: unguarded, it would kill the process partway (exit 141 in a
// shell), with later batches never tried and nothing said of those done. The rows' table
// (about 120 bytes a row) is far more than a pipe holds, so a write after the close fails.
func TestRetryIntoAPipeClosedPartwayStopsAndSaysHowFarItGot(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	const rows = 3000
	waitingRows(t, d, rows)
	code, stderr := runIntoPipe(t, true, "retry", "--yes", "--batch", "10", "--db", d.URL)
	said := regexp.MustCompile(`(\d+) of the 3000 failed outbox rows listed are due now; the last (\d+) listed were not tried \(the output failed: .*broken pipe\)`).
		FindStringSubmatch(stderr)
	if code != exitFailure || said == nil || !strings.Contains(stderr, "(its rows are due): write /dev/stdout: broken pipe") {
		t.Fatalf("retry into a pipe closed partway: exit %d, stderr %.2000q; want 1, saying how many rows are due", code, stderr)
	}
	madeDue := testenv.Count(t, d.DB, `SELECT count(*) FROM outbox_messages WHERE next_attempt_at <= now()`)
	notTried := rows - madeDue
	if said[1] != strconv.FormatInt(madeDue, 10) || said[2] != strconv.FormatInt(notTried, 10) || notTried == 0 {
		t.Errorf("retry said %s rows are due and %s not tried; the outbox has %d due, %d waiting", said[1], said[2], madeDue, notTried)
	}
}

// failingWriter is an output that takes nothing.
type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, syscall.ENOSPC }

// holdCommits makes the commit of a transaction that deletes an outbox row (or does event:
// UPDATE) wait, at a deferred trigger, for an advisory lock the test holds, until release;
// waiting says whether one waits.
func holdCommits(t *testing.T, d *testenv.Database, event ...string) (waiting func() bool, release func()) {
	t.Helper()
	const key = 4242
	on := "DELETE"
	if len(event) > 0 {
		on = event[0]
	}
	execSQL(t, d.DB, `CREATE FUNCTION held_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END $$`)
	execSQL(t, d.DB, `CREATE CONSTRAINT TRIGGER held_commit AFTER `+on+` ON outbox_messages DEFERRABLE INITIALLY DEFERRED
		FOR EACH ROW EXECUTE FUNCTION held_commit()`)
	sqlDB, err := d.DB.DB()
	if err != nil {
		t.Fatal(err)
	}
	holder, err := sqlDB.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.ExecContext(context.Background(), `SELECT pg_advisory_lock($1)`, key); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			_, _ = holder.ExecContext(context.Background(), `SELECT pg_advisory_unlock($1)`, key)
			_ = holder.Close()
		})
	}
	t.Cleanup(release)
	waiting = func() bool {
		return testenv.Count(t, d.DB, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event = 'advisory'`) == 1
	}
	return waiting, release
}

// drainIDs takes what waits in queue and returns the message ids in order.
func drainIDs(t *testing.T, queue string) []string {
	t.Helper()
	return deliveryIDs(testenv.Drain(t, testenv.Channel(t), queue, 200*time.Millisecond))
}

// compact is raw without its spaces.
func compact(t *testing.T, raw json.RawMessage) string {
	t.Helper()
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		t.Fatalf("%q: %v", raw, err)
	}
	return b.String()
}

// waitingRows adds n rows the broker refused, due in an hour, ids and occurred_at in the
// same order: a backlog after an outage, made in one statement.
func waitingRows(t *testing.T, d *testenv.Database, n int) {
	t.Helper()
	execSQL(t, d.DB, `INSERT INTO outbox_messages (id, type, payload, occurred_at, attempts, last_error, next_attempt_at)
		SELECT `+testenv.UUIDv7SQL("ts", "g")+`, 'OrderPlaced', '{}', ts, 3, 'message nacked by the broker', now() + interval '1 hour'
		FROM (SELECT g, now() - interval '1 hour' + g * interval '1 ms' AS ts FROM generate_series(1, ?::int) g) s`, n)
}

// A backlog whose retry takes longer than one transaction may (dbTimeout) is retried all the
// same, a batch per transaction. A trigger makes each UPDATE statement take 1.3 ms per row, as
// a loaded database might: 25,000 rows in one transaction would take 32.5 s.
func TestRetryInBatchesGoesBeyondOneTransactionsBudget(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	const rows = 25000
	waitingRows(t, d, rows)
	execSQL(t, d.DB, `CREATE FUNCTION slow_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_sleep((SELECT count(*) FROM changed) * 0.0013);
	RETURN NULL;
END $$`)
	execSQL(t, d.DB, `CREATE TRIGGER slow_update AFTER UPDATE ON outbox_messages REFERENCING NEW TABLE AS changed
		FOR EACH STATEMENT EXECUTE FUNCTION slow_update()`)

	start := time.Now()
	code, stdout, stderr := ctl(t, "retry", "--yes", "--db", d.URL)
	took := time.Since(start)
	if code != 0 || !strings.Contains(stdout, "25000 failed outbox rows were waiting for their next attempt; they are due now") ||
		!strings.Contains(stderr, "batch 3 of 3: 25000 of 25000 rows tried, 25000 made due") {
		t.Fatalf("retry of %d rows: exit %d after %s, stdout %.200q, stderr %q; want all made due in 3 batches", rows, code, took, stdout, stderr)
	}
	if took <= dbTimeout {
		t.Errorf("the retry took %s, within one transaction's %s: the test shows nothing", took, dbTimeout)
	}
	if n := testenv.Count(t, d.DB, `SELECT count(*) FROM outbox_messages WHERE next_attempt_at > now()`); n != 0 {
		t.Errorf("%d rows still wait out their backoff", n)
	}
}

// An interrupt while a batch is under way lets that batch commit, then stops: the rows of the
// batches done are due, every other row is as it was, and the output says how far it got.
func TestRetryInterruptedStopsBetweenBatches(t *testing.T) {
	t.Parallel()
	for _, format := range []string{"table", "json"} {
		t.Run(format, func(t *testing.T) {
			t.Parallel()
			retryInterrupted(t, format)
		})
	}
}

// retryInterrupted is TestRetryInterruptedStopsBetweenBatches with output in format.
func retryInterrupted(t *testing.T, format string) {
	d := outboxDB(t)
	waitingRows(t, d, 5000)
	var first []uuid.UUID // the oldest 1000: the first batch
	if err := d.DB.Raw(`SELECT id FROM outbox_messages ORDER BY occurred_at, id LIMIT 1000`).Scan(&first).Error; err != nil {
		t.Fatal(err)
	}
	others := func() string {
		t.Helper()
		var rows []string
		if err := d.DB.Raw(`SELECT (o.*)::text FROM outbox_messages o WHERE id NOT IN ? ORDER BY id`, first).Scan(&rows).Error; err != nil {
			t.Fatal(err)
		}
		return strings.Join(rows, "\n")
	}
	before := others()
	// The first batch's UPDATE waits at the gate until it is released.
	release := testenv.HoldAt(t, d.DB, "BEFORE UPDATE ON outbox_messages")

	ctx, interrupt := context.WithCancel(context.Background())
	defer interrupt()
	var stdout, stderr bytes.Buffer
	codes := make(chan int, 1)
	go func() {
		codes <- run(ctx, []string{"retry", "--yes", "--batch", "1000", "-o", format, "--db", d.URL}, streams{in: strings.NewReader(""), out: &stdout, err: &stderr})
	}()
	testenv.Eventually(t, 20*time.Second, func() bool {
		return testenv.Count(t, d.DB, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = ? AND application_name = 'outboxctl' AND wait_event_type = 'Lock' AND query LIKE 'UPDATE outbox_messages%'`, d.Name) == 1
	}, "the first batch never reached the gate")
	interrupt()
	release()
	code := exitWithin(t, codes, "retry did not stop after the interrupt")

	said := strings.Contains(stdout.String(), "1000 of the 5000 failed outbox rows listed are due now; the last 4000 listed were not tried")
	if format == "json" {
		var got struct {
			Count       int  `json:"count"`
			Interrupted bool `json:"interrupted"`
		}
		said = json.Unmarshal(stdout.Bytes(), &got) == nil && got.Count == 1000 && got.Interrupted
	}
	if code != exitFailure || !strings.Contains(stderr.String(), "interrupted after batch 1 of 5: 1000 of the 5000 rows listed were tried, the other 4000 are unchanged") || !said {
		t.Errorf("interrupted retry: exit %d, stdout %.300q, stderr %q; want 1, saying 1000 of 5000 are due", code, stdout.String(), stderr.String())
	}
	for _, id := range first {
		if isDue, _, _ := due(t, d.DB, id); !isDue {
			t.Fatalf("row %s of the batch under way at the interrupt is not due: half a batch", id)
		}
	}
	if after := others(); after != before {
		t.Error("the rows of the batches after the interrupt changed")
	}
}

// retry prints each batch's rows once the batch has committed, before it makes the next batch
// due: a backlog of millions is never held in memory to be printed at the end. The output
// notes, at its first write, how many rows are due then: only the first batch's.
func TestRetryPrintsEachBatchAsItCommits(t *testing.T) {
	t.Parallel()
	for _, format := range []string{"table", "json"} {
		t.Run(format, func(t *testing.T) {
			t.Parallel()
			d := outboxDB(t)
			waitingRows(t, d, 3000)
			out := &dueAtFirstWrite{db: d.DB}
			var stderr bytes.Buffer
			code := run(context.Background(), []string{"retry", "--yes", "--batch", "1000", "-o", format, "--db", d.URL},
				streams{in: strings.NewReader(""), out: out, err: &stderr})
			said := strings.Contains(out.String(), "3000 failed outbox rows were waiting for their next attempt; they are due now")
			if format == "json" {
				got := decode[outboxRowsResult](t, out.String())
				said = got.Count == 3000 && len(got.Rows) == 3000
			}
			if code != 0 || !said {
				t.Fatalf("retry: exit %d, stdout %.300q, stderr %q; want 3000 rows made due", code, out.String(), stderr.String())
			}
			if out.due != 1000 {
				t.Errorf("at retry's first output, %d rows were due; want the first batch's 1000, printed before the next batch", out.due)
			}
		})
	}
}

// dueAtFirstWrite is an output that counts, at its first write, the rows due in db.
type dueAtFirstWrite struct {
	bytes.Buffer
	db  *gorm.DB
	due int64
}

func (w *dueAtFirstWrite) Write(p []byte) (int, error) {
	if w.Len() == 0 {
		if err := w.db.Raw(`SELECT count(*) FROM outbox_messages WHERE next_attempt_at <= now()`).Scan(&w.due).Error; err != nil {
			return 0, err
		}
	}
	return w.Buffer.Write(p)
}

// An interrupt stops a dry run between its reads, and its -o json result says so: the rows
// shown are not all those listed. Here the interrupt comes as the first row is printed, with a
// read per row.
func TestRetryDryRunInterruptedSaysSo(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	waitingRows(t, d, 3)
	ctx, interrupt := context.WithCancel(context.Background())
	defer interrupt()
	out := &interruptAtFirstWrite{interrupt: interrupt}
	var stderr bytes.Buffer
	code := run(ctx, []string{"retry", "--dry-run", "--batch", "1", "-o", "json", "--db", d.URL},
		streams{in: strings.NewReader(""), out: out, err: &stderr})
	got := decode[outboxRowsResult](t, out.String())
	if code != exitFailure || !got.DryRun || got.Count != 1 || len(got.Rows) != 1 || !got.Interrupted ||
		!strings.Contains(stderr.String(), "interrupted: 1 of the 3 rows listed were shown") {
		t.Errorf("dry run interrupted at its first row: exit %d, %+v, stderr %q; want 1, and the one row shown, interrupted", code, got, stderr.String())
	}
}

// interruptAtFirstWrite is an output that interrupts the command at its first write.
type interruptAtFirstWrite struct {
	bytes.Buffer
	interrupt func()
}

func (w *interruptAtFirstWrite) Write(p []byte) (int, error) {
	w.interrupt()
	return w.Buffer.Write(p)
}

// A dry run with no row waiting writes only its heading: a failed write of that (a full disk)
// exits 1, as a failed write of rows does, not 0 with nothing printed.
func TestRetryDryRunOfNothingIntoAFailingOutputFails(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	for _, format := range []string{"table", "json"} {
		var stderr bytes.Buffer
		code := run(context.Background(), []string{"retry", "--dry-run", "-o", format, "--db", d.URL},
			streams{in: strings.NewReader(""), out: failingWriter{}, err: &stderr})
		if code != exitFailure || !strings.Contains(stderr.String(), "no space left on device") {
			t.Errorf("-o %s: dry run of an empty outbox into a failing output: exit %d, stderr %q; want 1, with the failure", format, code, stderr.String())
		}
	}
}

// retry --id whose output fails once the row is due (a closed pipe, a full disk) says on
// stderr that the row is due, and exits 1: not killed by SIGPIPE after its commit, with nothing
// said. The closed pipe is tried with the binary, where SIGPIPE would end the process first.
func TestRetryOneWhoseOutputFailsSaysTheRowIsDueOnStderr(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	ids := enqueue(t, d.DB, 2)
	fail(t, d.DB, ids[0], 2, "message nacked by the broker")
	fail(t, d.DB, ids[1], 2, "message nacked by the broker")
	var stderr bytes.Buffer
	code := run(context.Background(), []string{"retry", "--id", ids[0].String(), "--db", d.URL},
		streams{in: strings.NewReader(""), out: failingWriter{}, err: &stderr})
	if isDue, _, _ := due(t, d.DB, ids[0]); !isDue || code != exitFailure ||
		!strings.Contains(stderr.String(), "outbox row "+ids[0].String()+" is due now") || !strings.Contains(stderr.String(), "no space left on device") {
		t.Errorf("retry --id with a failing output: due %v, exit %d, stderr %q; want the row due, 1, and stderr saying so", isDue, code, stderr.String())
	}
	code, said := runIntoPipe(t, false, "retry", "--id", ids[1].String(), "-o", "json", "--db", d.URL)
	if isDue, _, _ := due(t, d.DB, ids[1]); !isDue || code != exitFailure ||
		!strings.Contains(said, `"id": "`+ids[1].String()+`"`) || !strings.Contains(said, "broken pipe") {
		t.Errorf("retry --id -o json into a closed pipe: due %v, exit %d, stderr %q; want the row due, 1, and its record on stderr", isDue, code, said)
	}
}
