package main

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// enqueue commits n messages to the outbox and returns their ids.
func enqueue(t *testing.T, db *gorm.DB, n int) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, n)
	err := db.Transaction(func(tx *gorm.DB) error {
		for i := range ids {
			m, err := messaging.NewMessage("OrderPlaced", map[string]int{"n": i})
			if err != nil {
				return err
			}
			ids[i] = m.ID
			if err := messaging.Enqueue(tx, m); err != nil {
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

// fail makes row id look as the relay leaves a row the broker refused, due in an hour.
func fail(t *testing.T, db *gorm.DB, id uuid.UUID, attempts int, lastError string) {
	t.Helper()
	if err := db.Exec(`UPDATE outbox_messages SET attempts = ?, last_error = ?, next_attempt_at = now() + interval '1 hour' WHERE id = ?`,
		attempts, lastError, id).Error; err != nil {
		t.Fatal(err)
	}
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
	if row.LastError != nil {
		lastError = *row.LastError
	}
	return row.Due, row.Attempts, lastError
}

func TestStatusShowsTheBacklogItsAgeAttemptsAndErrors(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	out := ok(t, "status", "--db", d.URL)
	for _, want := range []string{"unsent rows:            0", "oldest unsent row:      none", "highest attempt count:  0", "no unsent row has failed"} {
		if !strings.Contains(out, want) {
			t.Errorf("empty outbox: status lacks %q:\n%s", want, out)
		}
	}

	ids := enqueue(t, d.DB, 4)
	if err := d.DB.Exec(`UPDATE outbox_messages SET occurred_at = now() - interval '10 minutes' WHERE id = ?`, ids[0]).Error; err != nil {
		t.Fatal(err)
	}
	if err := d.DB.Exec(`UPDATE outbox_messages SET processed_at = now() WHERE id = ?`, ids[3]).Error; err != nil {
		t.Fatal(err)
	}
	fail(t, d.DB, ids[1], 7, "message unroutable: exchange \"orders\" routing key \"OrderPlaced\": 312 NO_ROUTE")
	fail(t, d.DB, ids[2], 2, "message nacked by the broker\n(second line)")
	out = ok(t, "status", "--db", d.URL)
	for _, want := range []string{
		"unsent rows:            3", "oldest unsent row:      10m", "highest attempt count:  7",
		"latest errors (2 unsent rows that failed",
		ids[1].String(), `message unroutable: exchange "orders" routing key "OrderPlaced": 312 NO_ROUTE`,
		ids[2].String(), "message nacked by the broker (second line)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status lacks %q:\n%s", want, out)
		}
	}
	if !regexp.MustCompile(ids[1].String() + `\s+OrderPlaced\s+7\s+\S+ \(in (59m\d+s|1h0m0s)\)`).MatchString(out) {
		t.Errorf("status does not show the row's type, attempts and next attempt:\n%s", out)
	}
	if strings.Contains(out, ids[0].String()) || strings.Contains(out, ids[3].String()) {
		t.Errorf("status lists a row that has not failed:\n%s", out)
	}
}

// retry makes every failed row due now, keeps each row's attempts and last error, and wakes
// the relays at once.
func TestRetryMakesEveryFailedRowDueAndWakesTheRelay(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	ids := enqueue(t, d.DB, 3)
	fail(t, d.DB, ids[0], 3, "message nacked by the broker")
	fail(t, d.DB, ids[1], 9, "message unroutable")

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	listener, err := pgx.Connect(ctx, d.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close(context.Background())
	if _, err := listener.Exec(ctx, "LISTEN "+messaging.NotifyChannel); err != nil {
		t.Fatal(err)
	}

	if out := ok(t, "retry", "--db", d.URL); !strings.Contains(out, "2 failed outbox rows were waiting") {
		t.Errorf("retry said %q, want 2 rows", out)
	}
	if _, err := listener.WaitForNotification(ctx); err != nil {
		t.Fatalf("no NOTIFY reached the relay's channel: %v", err)
	}
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

// retry --id makes that row due and leaves the others; an id that names no unsent row is an
// error that names it.
func TestRetryOneRowByID(t *testing.T) {
	t.Parallel()
	d := outboxDB(t)
	ids := enqueue(t, d.DB, 3)
	fail(t, d.DB, ids[0], 4, "message nacked by the broker")
	fail(t, d.DB, ids[1], 4, "message nacked by the broker")
	if err := d.DB.Exec(`UPDATE outbox_messages SET processed_at = now() WHERE id = ?`, ids[2]).Error; err != nil {
		t.Fatal(err)
	}

	if out := ok(t, "retry", "--id", ids[0].String(), "--db", d.URL); !strings.Contains(out, ids[0].String()+" is due now") {
		t.Errorf("retry --id said %q", out)
	}
	if isDue, attempts, _ := due(t, d.DB, ids[0]); !isDue || attempts != 4 {
		t.Errorf("the row named: due=%v attempts=%d, want due with its 4 attempts", isDue, attempts)
	}
	if isDue, _, _ := due(t, d.DB, ids[1]); isDue {
		t.Error("retry --id made another row due too")
	}
	for _, id := range []string{uuid.NewString(), ids[2].String()} { // unknown, and sent already
		code, _, stderr := ctl(t, "retry", "--db", d.URL, "--id", id)
		if code != 1 || !strings.Contains(stderr, "no unsent outbox row has this id: "+id) {
			t.Errorf("retry --id %s: exit %d, stderr %q; want 1 naming the id", id, code, stderr)
		}
	}
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL AND next_attempt_at <= now()"); n != 1 {
		t.Errorf("%d unsent rows are due, want the one named", n)
	}
}
