package platform

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// AdmissionWait is the longest a request waits for a free place before it is shed: long enough
// to ride out a burst, short enough that a shed request learns at once to come back later.
const AdmissionWait = 10 * time.Millisecond

// shedLogInterval is how often shedding is logged, as one line with the count: under overload
// a line per request would add to the load.
const shedLogInterval = 10 * time.Second

// Admission bounds the requests at work at once: a request that finds all limit places taken
// waits up to AdmissionWait for one, and is otherwise answered 503 at once, with a
// Retry-After of one to three seconds, drawn at random so that clients come back spread out.
// The admitted ones keep their latency, because the database never has more of them than it
// has connections for; without it, every request queues for a connection and all of them
// slow down together, until they fail at their deadline. Sheds are counted in
// http_requests_shed_total and logged once per interval while they last.
type Admission struct {
	places   chan struct{}
	limit    int
	shed     atomic.Int64
	count    prometheus.Counter
	log      *slog.Logger
	interval time.Duration // of the shed lines
}

// NewAdmission returns an admission control of limit places, whose sheds are counted in reg.
func NewAdmission(log *slog.Logger, reg prometheus.Registerer, limit int) (*Admission, error) {
	a := &Admission{places: make(chan struct{}, limit), limit: limit, log: log, interval: shedLogInterval,
		count: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "http_requests_shed_total",
			Help: "Requests answered 503 at once because as many as HTTP_MAX_IN_FLIGHT were at work already.",
		})}
	if err := reg.Register(a.count); err != nil {
		return nil, err
	}
	return a, nil
}

// Middleware admits or sheds each request.
func (a *Admission) Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !a.enter(r.Context()) {
			if r.Context().Err() != nil {
				return // the client went away while it waited: nobody to answer, nothing shed
			}
			a.shed.Add(1)
			a.count.Inc()
			w.Header().Set("Retry-After", strconv.Itoa(1+rand.IntN(3)))
			WriteProblem(w, http.StatusServiceUnavailable, "the service is at capacity; try again after the Retry-After delay")
			return
		}
		defer func() { <-a.places }()
		next.ServeHTTP(w, r)
	})
}

// enter takes a place, waiting up to AdmissionWait for one.
func (a *Admission) enter(ctx context.Context) bool {
	select {
	case a.places <- struct{}{}:
		return true
	default:
	}
	t := time.NewTimer(AdmissionWait)
	defer t.Stop()
	select {
	case a.places <- struct{}{}:
		return true
	case <-t.C:
		return false
	case <-ctx.Done():
		return false
	}
}

// Run logs, once per interval, how many requests were shed in it, until ctx ends.
func (a *Admission) Run(ctx context.Context) error {
	tick := time.NewTicker(a.interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			if n := a.shed.Swap(0); n > 0 {
				a.log.Warn("at capacity: requests shed", "shed", n, "interval", a.interval, "max_in_flight", a.limit)
			}
		}
	}
}
