package main

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// outage logs a failure that repeats while the database or the mail server is away (every
// poll, every scrape, every probe) once at each end: its first failure at level, the rest at
// Debug, and, at the first success after, the recovery with how long the outage lasted and how
// many failures it saw. A line a poll would be one a second per replica, all saying the same. (The library's relay does this
// for the broker, unexported; platform.FailureLog repeats a line every 10 s, with no recovery.)
type outage struct {
	failed, recovered string     // the messages of the failures and of the recovery
	level             slog.Level // the first failure's

	mu       sync.Mutex
	since    time.Time // zero while what it watches works
	ended    time.Time // when the last outage ended (see failFrom)
	failures int
}

// fail records a failure, logging it at o's level if it starts an outage, at Debug otherwise.
func (o *outage) fail(log *slog.Logger, err error) { o.failFrom(log, err, time.Now()) }

// failFrom records the failure of something begun at began, as fail does, unless an outage
// ended after began: what began before the last recovery says nothing of what o watches now.
func (o *outage) failFrom(log *slog.Logger, err error, began time.Time) {
	o.mu.Lock()
	if began.Before(o.ended) {
		o.mu.Unlock()
		return
	}
	first := o.since.IsZero()
	if first {
		o.since = time.Now()
	}
	o.failures++
	o.mu.Unlock()
	level := slog.LevelDebug
	if first {
		level = o.level
	}
	log.Log(context.Background(), level, o.failed, "error", err)
}

// ok ends the outage, if one is on, with one line.
func (o *outage) ok(log *slog.Logger) {
	o.mu.Lock()
	since, failures := o.since, o.failures
	o.since, o.failures = time.Time{}, 0
	if !since.IsZero() {
		o.ended = time.Now()
	}
	o.mu.Unlock()
	if !since.IsZero() {
		log.Info(o.recovered, "outage", time.Since(since).Round(time.Millisecond), "failures", failures)
	}
}

// on says whether an outage is on: a failure since the last success.
func (o *outage) on() bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return !o.since.IsZero()
}
