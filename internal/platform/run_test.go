package platform

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// The hard stop fires once, the given time after the context ends, and not before.
func TestHardStopFiresAfterTheSignal(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	fired := make(chan time.Time, 2)
	hardStop(ctx, time.Second, func() { fired <- time.Now() })
	select {
	case <-fired:
		t.Fatal("fired before the signal")
	case <-time.After(200 * time.Millisecond): // a wait for something that must not happen
	}
	signalled := time.Now()
	cancel()
	select {
	case at := <-fired:
		// Not much later either: the hard stop is what keeps a service's exit within 10 s. (The
		// margin is a busy machine's timer latency under -race.)
		if d := at.Sub(signalled); d < time.Second || d >= 1800*time.Millisecond {
			t.Fatalf("fired %s after the signal, want 1s (less than 1.8s)", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("did not fire within 5 s of the signal")
	}
}

// The hard stop's line is a log line like the others: key=value, or JSON with LOG_FORMAT=json.
func TestHardStopLineIsALogLine(t *testing.T) {
	var text, js bytes.Buffer
	logHardStop(&text, "order", "text")
	logHardStop(&js, "order", "json")
	if !strings.Contains(text.String(), `level=ERROR msg="still stopping after the signal; abandoning what is in flight (it was not acknowledged)" service=order after=9s`) {
		t.Errorf("text line %q", text.String())
	}
	var line map[string]any
	if err := json.Unmarshal(js.Bytes(), &line); err != nil || line["service"] != "order" || line["after"] != "9s" {
		t.Errorf("JSON line %q (%v)", js.String(), err)
	}
}
