package messaging

import (
	"testing"
	"time"
)

// A copy's confirm is given up on only deadLetterTimeout after the connection was last
// unblocked, or never blocked: an alarm that clears just before a timeout of the wait leaves
// the broker time to read the copy, which publishing it again would double.
func TestConfirmWaitOutlastsTheBlock(t *testing.T) {
	now := time.Now()
	for _, c := range []struct {
		name        string
		blocked     bool
		unblockedAt time.Time
		want        time.Duration
	}{
		{"never blocked", false, time.Time{}, 0},
		{"blocked", true, now.Add(-time.Hour), deadLetterTimeout},
		{"unblocked just now", false, now.Add(-500 * time.Millisecond), deadLetterTimeout - 500*time.Millisecond},
		{"unblocked long ago", false, now.Add(-deadLetterTimeout - time.Second), 0},
	} {
		got := confirmWait(c.blocked, c.unblockedAt, now)
		if (c.want <= 0 && got > 0) || (c.want > 0 && got != c.want) {
			t.Errorf("%s: wait %s more, want %s", c.name, got, c.want)
		}
	}
}
