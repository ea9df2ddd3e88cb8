package systest

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/platform"
)

// errorRecorder is a testing.TB that records Errorf instead of failing the test.
type errorRecorder struct {
	testing.TB
	errors []string
}

func (r *errorRecorder) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

// A stop that exits 0 after the hard stop, or after the shutdown deadline cut requests off, is
// not graceful: each line fails the stop, once, with the log's last lines; a clean stop passes.
func TestCheckGracefulFailsAnAbandonedStop(t *testing.T) {
	clean := "level=INFO msg=\"shutting down\" service=order\nlevel=INFO msg=stopped service=order\n"
	r := &errorRecorder{TB: t}
	checkGraceful(r, "order", clean)
	if len(r.errors) != 0 {
		t.Fatalf("a clean stop failed: %q", r.errors)
	}
	for _, bad := range []string{
		`level=ERROR msg="still stopping after the signal; abandoning what is in flight (it was not acknowledged)" service=order after=9s`,
		`level=WARN msg="HTTP requests still running at the shutdown deadline were cut off" service=order error="context deadline exceeded"`,
	} {
		var logs strings.Builder
		for i := range 2 * logTail {
			fmt.Fprintf(&logs, "level=DEBUG msg=\"line %d\"\n", i)
		}
		logs.WriteString(bad + "\n")
		logs.WriteString("level=INFO msg=\"last line\"\n")
		r := &errorRecorder{TB: t}
		checkGraceful(r, "order", logs.String())
		if len(r.errors) != 1 {
			t.Fatalf("%d failures for a log with %q, want 1: %q", len(r.errors), bad, r.errors)
		}
		got := r.errors[0]
		for _, want := range []string{"order did not stop gracefully", bad, fmt.Sprintf("line %d", 2*logTail-1), "last line"} {
			if !strings.Contains(got, want) {
				t.Errorf("the failure lacks %q:\n%s", want, got)
			}
		}
		if strings.Contains(got, "\"line 0\"") {
			t.Errorf("the failure shows more than the log's last %d lines:\n%s", logTail, got)
		}
	}
}

// The duplicates a consumer suppressed are read from its own labelled sample; a scrape that
// lacks it (the metric gone, renamed, or exported without its consumer label) is an error, not
// 0: read as 0, it would pass the check that a run without faults suppressed none.
func TestDuplicatesInRequiresTheConsumersSample(t *testing.T) {
	const other = "# HELP consumer_messages_total Deliveries settled.\n# TYPE consumer_messages_total counter\n" +
		`consumer_messages_total{outcome="acked",queue="invoicing"} 12` + "\n"
	for _, c := range []struct {
		name, scrape string
		want         float64
	}{
		{"zero", other + "# TYPE inbox_duplicates_total counter\n" + `inbox_duplicates_total{consumer="invoicing"} 0` + "\n", 0},
		{"some", other + `inbox_duplicates_total{consumer="invoicing"} 3` + "\n", 3},
	} {
		got, err := duplicatesIn("invoicing", c.scrape)
		if err != nil || got != c.want {
			t.Errorf("%s: duplicatesIn = %v, %v; want %v", c.name, got, err, c.want)
		}
	}
	for _, c := range []struct{ name, scrape string }{
		{"absent", other},
		{"empty", ""},
		{"renamed", other + `messaging_inbox_duplicates_total{consumer="invoicing"} 0` + "\n"},
		{"unlabelled", other + "inbox_duplicates_total 0\n"},
		{"another consumer's", other + `inbox_duplicates_total{consumer="notification"} 0` + "\n"},
		{"unparsable", other + `inbox_duplicates_total{consumer="invoicing"} many` + "\n"},
	} {
		if got, err := duplicatesIn("invoicing", c.scrape); err == nil {
			t.Errorf("%s: duplicatesIn = %v without an error, for a scrape without the sample:\n%s", c.name, got, c.scrape)
		}
	}
}

// A /metrics that answers anything but 200 fails the read of the duplicates, whatever its body.
func TestDuplicatesFailsOnAFailedScrape(t *testing.T) {
	for _, status := range []int{http.StatusInternalServerError, http.StatusNotFound} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(status)
			fmt.Fprintln(w, `inbox_duplicates_total{consumer="invoicing"} 0`)
		}))
		s := &Service{Name: "invoicing", URL: srv.URL}
		n, err := s.duplicates(context.Background())
		srv.Close()
		if err == nil {
			t.Errorf("status %d: duplicates = %v without an error", status, n)
		}
	}
}

// Every line a consumer logs for a message whose work another message had done already counts,
// whatever its wording, in the text format and in JSON: the consumers mark each such line
// (already_done=true), as they count it in consumer_already_done_total. What a process did
// while it shut down survives only in these lines (its count is read before the signal), so a
// wording left uncounted would hide the redundant work that the exactly-once check exists to
// catch. Lines of work done for the first time, unmarked, do not count.
func TestAlreadyDoneLoggedCountsEveryMarkedLine(t *testing.T) {
	already := []struct {
		level slog.Level
		msg   string
	}{
		// services/invoicing
		{slog.LevelWarn, "order already invoiced by another message; nothing to do"},
		{slog.LevelError, "order already invoiced by another message, with another amount and another customer; nothing done"},
		{slog.LevelWarn, "order already cancelled, its invoice void; nothing to do"},
		{slog.LevelError, "order already cancelled, its invoice void, with another amount; nothing done"},
		{slog.LevelWarn, "order already cancelled by another message; nothing to do"},
		{slog.LevelError, "order already cancelled by another message, for another customer; nothing to do"},
		// services/notification
		{slog.LevelWarn, "order already has a order_confirmation notification from another message; nothing to do"},
	}
	firstTime := []string{
		"order was cancelled before it arrived; its invoice stays void",
		"invoice voided, for another customer",
		"cancellation remembered before its order",
		"notification recorded",
	}
	for _, format := range []string{"text", "json"} {
		var buf bytes.Buffer
		log := platform.NewLogger(&buf, "invoicing", format, "info")
		for i, l := range already {
			log.Log(context.Background(), l.level, firstTime[i%len(firstTime)]) // between them, unmarked
			log.Log(context.Background(), l.level, l.msg, "order_id", uuid.New(), "message_id", uuid.New(), "already_done", true)
		}
		if got := alreadyDoneLogged(buf.String()); got != len(already) {
			t.Errorf("%s: %d lines counted as work found done already, want %d:\n%s", format, got, len(already), buf.String())
		}
	}
}
