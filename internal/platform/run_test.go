package platform

import (
	"context"
	"testing"
	"time"
)

// The hard stop fires once, the given time after the context ends, and not before.
func TestHardStopFiresAfterTheSignal(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	fired := make(chan time.Time, 2)
	hardStop(ctx, 100*time.Millisecond, func() { fired <- time.Now() })
	select {
	case <-fired:
		t.Fatal("fired before the signal")
	case <-time.After(200 * time.Millisecond): // a wait for something that must not happen
	}
	signalled := time.Now()
	cancel()
	select {
	case at := <-fired:
		if d := at.Sub(signalled); d < 100*time.Millisecond {
			t.Fatalf("fired %s after the signal, want at least 100ms", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("did not fire within 5 s of the signal")
	}
}
