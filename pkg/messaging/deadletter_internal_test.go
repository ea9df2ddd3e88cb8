package messaging

import (
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
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

// A dead-letter copy leaves the queue's delivery counts behind: the dead-letter queue keeps its
// own, and a redriven message that carried them would start its new life counted.
func TestDeadLetterCopyLeavesTheDeliveryCountsOut(t *testing.T) {
	d := amqp.Delivery{Headers: amqp.Table{"x-delivery-count": int64(19), "x-acquired-count": int64(20), "tenant": "a"}}
	headers := deadLetterCopy(d, errors.New("poison"), time.Now()).Headers
	for _, h := range []string{"x-delivery-count", "x-acquired-count"} {
		if _, ok := headers[h]; ok {
			t.Errorf("the copy carries %s", h)
		}
	}
	if headers["tenant"] != "a" || headers[HeaderDeadLetterReason] != "poison" {
		t.Errorf("the copy's headers are %v", headers)
	}
}
