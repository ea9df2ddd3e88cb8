package messaging

import "time"

// Backoff is an exponential schedule: Base after the first failure, doubling after each
// further one, never more than Max.
type Backoff struct {
	Base time.Duration
	Max  time.Duration
}

// Delay returns the wait after the given number of failures (1 for the first).
func (b Backoff) Delay(failures int) time.Duration {
	if failures < 1 {
		failures = 1
	}
	d := b.Base
	for i := 1; i < failures; i++ {
		if d >= b.Max/2 {
			return b.Max
		}
		d *= 2
	}
	return min(d, b.Max)
}

// withDefaults fills in whichever of Base and Max is unset.
func (b Backoff) withDefaults(base, maxDelay time.Duration) Backoff {
	if b.Base <= 0 {
		b.Base = base
	}
	if b.Max <= 0 {
		b.Max = max(maxDelay, b.Base)
	}
	return b
}
