package systest

import (
	"fmt"
	"strings"
	"testing"
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
