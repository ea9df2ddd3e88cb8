package messaging

import (
	"math/rand/v2"
	"time"
)

// DefaultJitter is the share of every delay that is drawn at random unless a [Backoff] sets
// its own: replicas that failed together then retry apart, not in lockstep.
const DefaultJitter = 0.2

// Backoff is an exponential schedule: Base after the first failure, doubling after each
// further one, never more than Max. Each delay d is jittered into [d×(1−Jitter), d], so the
// cap is never exceeded.
type Backoff struct {
	Base time.Duration
	Max  time.Duration
	// Jitter is the random share of each delay, from 0 to 1. Zero means [DefaultJitter].
	Jitter float64
}

// Delay returns the wait after the given number of failures (1 for the first).
func (b Backoff) Delay(failures int) time.Duration {
	return jitter(b.ceiling(failures), b.Jitter)
}

// ceiling is the schedule without jitter: the longest the wait after failures can be.
func (b Backoff) ceiling(failures int) time.Duration {
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

// jittered returns a random duration in [d×(1−DefaultJitter), d]: a poll interval that
// replicas started together do not share.
func jittered(d time.Duration) time.Duration { return jitter(d, DefaultJitter) }

// jitter returns a random duration in [d×(1−share), d]; a share of zero means DefaultJitter.
func jitter(d time.Duration, share float64) time.Duration {
	if share <= 0 {
		share = DefaultJitter
	}
	share = min(share, 1)
	if d <= 0 {
		return d
	}
	return d - time.Duration(rand.Float64()*share*float64(d))
}
