package messaging

import (
	"testing"
	"time"
)

// A Base set above the default Max, with Max left to its default, is waited in full: the cap
// defaults to at least the base, so the first retry never comes sooner than configured.
func TestABaseAboveTheDefaultMaxIsKept(t *testing.T) {
	t.Parallel()
	b := Backoff{Base: 10 * time.Second}.withDefaults(100*time.Millisecond, 5*time.Second)
	if b.Max < b.Base {
		t.Fatalf("Max defaulted to %s, below the Base of %s", b.Max, b.Base)
	}
	if c := b.ceiling(1); c != 10*time.Second {
		t.Fatalf("the first delay's ceiling is %s, want the Base of 10s", c)
	}
}
