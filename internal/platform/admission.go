package platform

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/http/httpguts"
)

// AdmissionWait is the longest a request waits for a free place before it is shed: long enough
// to ride out a burst, short enough that a shed request learns at once to come back later.
const AdmissionWait = 10 * time.Millisecond

// latencyWeight is the weight of each request's latency in the running mean that tells how
// fast places free up: about the last twenty requests count.
const latencyWeight = 0.05

// latencyCap bounds one request's latency in the running mean, as a multiple of the mean: one
// request held to its deadline would otherwise make places look scarce for the next sixty.
const latencyCap = 4

// shedLogInterval is how often shedding is logged, as one line with the count: under overload
// a line per request would add to the load.
const shedLogInterval = 10 * time.Second

// admissionWindow is how often the limit is reconsidered, from the requests that finished in
// it: long enough to hold a hundred requests at the rates where a limit matters, so that its
// p99 is not one request's, short enough to follow a change of load within seconds.
const admissionWindow = 500 * time.Millisecond

// windowSamples bounds the latencies a window keeps; past it, the first ones stand for all.
const windowSamples = 1024

// minWindowSamples is the fewest requests a window judges the limit by: the p99 of fewer would
// be the slowest one's. At lower rates a window lasts until that many have finished.
const minWindowSamples = 20

// fewAtWork is the most requests at work at once in a window whose p99, however slow, cuts
// nothing: so few do not crowd each other.
const fewAtWork = 2

// quietPeriod is how long after the last sign of pressure a cut limit gives every place back:
// SetRetryAfter's longest Retry-After, so that the clients the cut turned away have come back
// (and, crowding, shown the pressure again) before it does.
const quietPeriod = 3 * time.Second

// DefaultLatencyTarget is the admitted requests' p99 that the limit is lowered to hold, unless
// HTTP_LATENCY_TARGET says: about six times an order's p99 on an idle machine (8 ms), so that
// the limit moves only once requests queue for the cores or the database.
const DefaultLatencyTarget = 50 * time.Millisecond

// Admission bounds the requests at work at once: a request that finds every place taken waits
// up to AdmissionWait for one, and is otherwise answered 503 at once, with a Retry-After of one
// to three seconds, drawn at random so that clients come back spread out. Sheds are counted in
// http_requests_shed_total and logged once per interval while they last.
//
// The places number at most max, and fewer while the admitted requests are slow: every
// admissionWindow, when the p99 of the requests admitted since the limit was last cut that
// finished in it exceeds the target, the most places in use in it are scaled by target/p99 (halved at
// most, never below one place); otherwise the limit grows by one. A request's latency runs from
// its admission to its response, so the wait for a place, which a lower limit lengthens, does
// not count; nor does the wait for the request's body, which is the client's pace: the body is
// read before the request asks for a place (see readBody). A request that finds none at work
// after quietPeriod without pressure (no request found every place taken, no more than
// fewAtWork were at work, none took longer than the target itself, not the target in force
// below) gives every place back: windows judge only finished requests, and a service gone idle
// after a spike kept one place, shedding most of the next burst. None at work, not a few: a
// request stuck in a stalled database shows no latency until it ends.
//
// Fewer places only help latency that comes from the requests crowding each other. So a window
// with at most fewAtWork requests at work at once cuts nothing and counts as within the target
// (a slow one there, a reconnection or a pause, used to leave a quiet service one place for
// the next burst, and a limit of one or two, which keeps every window that few, stayed there
// for good behind any latency tail). The p10 of such a window is the floor: what a request
// takes when nothing queues (its fastest tenth, since two at once may already slow each other;
// a window of one at a time alone would do, but a limit cut to two may never see one). A later
// window whose p10 is below the floor lowers it (the database became faster). The target in
// force is never below twice the floor, nor above four times the target (the floor counts up
// to twice the target: a floor learnt in a stall must not turn the limit off). With a database
// farther away than the target allows, the limit falls to a few places once, learns the floor
// there, and comes back; it used to stay at one place, shedding what a fixed limit would have
// served.
//
// A request does not wait at all when the requests already waiting are at least twice the
// places expected to free up in AdmissionWait (the places over the admitted requests' mean
// latency, less the departures that only bring the requests at work down to a limit just
// cut): those places go to the requests ahead of it first, so it would be shed at the end
// of the wait about as often as served, and a place it got would be one a request ahead of it
// no longer needed. As many are admitted either way; the shed ones learn it 10 ms sooner.
//
// A client that sends "Expect: 100-continue" is asked for its body (net/http sends 100 Continue
// on the body's first read) only if a place is free or one is given it within the wait, which
// it hands on at once to the requests waiting: its upload holds no place, and once the body is
// in it asks for a place as any request does, so it may still be shed if the places filled
// during the upload. Otherwise it is shed with not a byte of its body read: net/http then sends
// no 100 Continue, marks the 503 "Connection: close", and closes the connection, at once for a
// declared body over 256 KiB, and otherwise once the client closes it or sends the body, which
// net/http reads and discards, or at the server's ReadTimeout.
//
// A fixed limit cannot hold a latency: where the requests share the cores with the relay, the
// broker and the consumers of the orders already accepted, only a limit small enough keeps them
// fast, and on a bigger machine that limit would waste it. Latency grows with the requests at
// work at once (Little's law), so scaling by the ratio lands near the limit that holds the
// target in one step; growing by one finds the room again when the load eases.
type Admission struct {
	max    int
	target time.Duration // 0: the limit stays max

	mu          sync.Mutex
	limit       float64
	inUse       int
	waiting     []chan struct{} // first come, first given a place
	lastCut     time.Time       // when limit was last cut
	window      []time.Duration
	windowStart time.Time
	peak        int           // the most places in use since windowStart
	pressed     time.Time     // the last sign of pressure (see enter), the zero time until one
	floor       time.Duration // what a request takes when nothing queues, 0 until seen
	mean        time.Duration // a running mean of the latencies, 0 until one request is done

	bodyBudget int64        // the most bytes of bodies read ahead of admission held at once
	bodiesHeld atomic.Int64 // and how many are

	// shed counts the requests shed since the last shed line, and bodyShed those of them whose
	// bodies found the budget full: counted together, and read together, so that a line never
	// counts a body shed without its shed.
	shedMu   sync.Mutex
	shed     int64
	bodyShed int64
	count    prometheus.Counter
	log      *slog.Logger
	interval time.Duration // of the shed lines
}

// NewAdmission returns an admission control of at most most places, lowered to hold the
// admitted requests' p99 to target (0: never lowered), whose sheds and limit are reported in
// reg.
func NewAdmission(log *slog.Logger, reg prometheus.Registerer, most int, target time.Duration) (*Admission, error) {
	a := &Admission{max: most, target: target, limit: float64(most), windowStart: time.Now(), bodyBudget: DefaultBodyBudget,
		window: make([]time.Duration, 0, windowSamples), log: log, interval: shedLogInterval,
		count: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "http_requests_shed_total",
			Help: "Requests answered 503 at once because every place of admission control was taken, or the bodies read ahead of admission filled their budget.",
		})}
	limit := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "http_admission_limit",
		Help: "API requests admitted at once now: HTTP_MAX_IN_FLIGHT, lowered while the admitted requests' p99 exceeds HTTP_LATENCY_TARGET, all back after 3 s quiet with none at work.",
	}, func() float64 { return float64(a.Places()) })
	for _, c := range []prometheus.Collector{a.count, limit} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return a, nil
}

// MaxBufferedBody is the largest request body any of the services' APIs accepts (the order
// API's 1 MiB): admission answers a request that declares a larger one 413 at once, and reads a
// smaller one before the request asks for a place.
const MaxBufferedBody = 1 << 20

// DefaultBodyBudget bounds the bytes of the bodies read ahead of admission that are held at
// once: without it, many slow uploads of a megabyte each would be a way to exhaust memory.
const DefaultBodyBudget = 16 << 20

// Middleware admits or sheds each request once its body has arrived; a request whose client
// waits for 100 Continue is shed before that if no place is near, and one whose body finds no
// room in the body budget as it arrives. A body declared larger than MaxBufferedBody is
// answered 413 at once, unread.
func (a *Admission) Middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > MaxBufferedBody {
			w.Header().Set("Connection", "close") // the body is left unread
			WriteProblem(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("body exceeds %d bytes", MaxBufferedBody))
			return
		}
		// Before the body's first read, on which net/http sends 100 Continue: a client that
		// waits for it learns it is shed without uploading.
		if expectsContinue(r) && !a.placeWithinWait(r.Context()) {
			a.refuse(w, r, false)
			return
		}
		release, read := a.readBody(r)
		defer release()
		if !read {
			w.Header().Set("Connection", "close") // the rest of the body is left unread
			a.refuse(w, r, true)
			return
		}
		if !a.enter(r.Context()) {
			a.refuse(w, r, false)
			return
		}
		admitted := time.Now()
		defer func() { a.leave(admitted) }()
		next.ServeHTTP(w, r)
	})
}

// refuse answers a request that got no place 503, with a Retry-After of one to three seconds,
// and counts it as shed, as one whose body found the budget full if bodyFull; unless its client
// went away while it waited: nobody to answer, nothing shed.
func (a *Admission) refuse(w http.ResponseWriter, r *http.Request, bodyFull bool) {
	if r.Context().Err() != nil {
		AbandonResponse()
	}
	a.shedMu.Lock()
	a.shed++
	if bodyFull {
		a.bodyShed++
	}
	a.shedMu.Unlock()
	a.count.Inc()
	SetRetryAfter(w)
	WriteProblem(w, http.StatusServiceUnavailable, "the service is at capacity; try again after the Retry-After delay")
}

// expectsContinue reports whether r's client waits for "100 Continue" before it sends its body,
// as net/http tells it.
func expectsContinue(r *http.Request) bool {
	return r.ProtoAtLeast(1, 1) && r.Body != nil && r.Body != http.NoBody &&
		httpguts.HeaderValuesContainsToken(r.Header["Expect"], "100-continue")
}

// readBody reads r's body before the request asks for a place, so that a client that sends it
// slowly (a slow uplink, or on purpose) waits without holding one: fourteen clients trickling
// their bodies held every place of the order service for the server's ReadTimeout (10 s) when
// bodies were read after admission. The bytes are counted against the body budget as they
// arrive, with the room the buffer that holds them grows by (at most twice the bytes), until
// release: a client must send them to take budget, not declare them, and one that sends
// nothing takes none (the 4 KiB each read lands in first is outside the budget, and so is a
// body that arrives whole in it). A body the
// budget has no room for is not read on: read reports false, and the request is shed, holding
// no place (admitted to read its body after admission, such requests took every place while
// slow uploads held the budget). Past MaxBufferedBody is the handler's to read, and refuse.
// The handler reads what was read, then the rest and any read error, as it would have from the
// connection.
func (a *Admission) readBody(r *http.Request) (release func(), read bool) {
	var held int64
	release = func() { a.bodiesHeld.Add(-held) }
	if r.Body == nil || r.Body == http.NoBody {
		return release, true
	}
	most := int64(MaxBufferedBody + 1) // one byte past the most, to tell a larger body
	if r.ContentLength >= 0 {
		most = min(most, r.ContentLength+1) // one more, to see the end
	}
	var body []byte
	rest := io.Reader(r.Body)
	// Each read lands here first: net/http's connection reads through a buffer of this size
	// already, and the bytes are taken into body only once counted.
	arrived := make([]byte, min(most, bodyReadSize))
	for int64(len(body)) < most {
		n, err := r.Body.Read(arrived[:min(int64(len(arrived)), most-int64(len(body)))])
		if n > 0 && len(body) == 0 && errors.Is(err, io.EOF) {
			// The whole body in its first read (net/http gives the end with the last bytes):
			// it stays in the buffer every request has, outside the budget, so small requests
			// still go through while slow uploads hold all of it.
			body = arrived[:n]
		} else if n > 0 {
			grow := a.room(body, n, most)
			if grow < 0 {
				return release, false
			}
			if grow > 0 {
				held += grow
				body = append(make([]byte, 0, int64(cap(body))+grow), body...)
			}
			body = append(body, arrived[:n]...)
		}
		if errors.Is(err, io.EOF) {
			rest = http.NoBody
			break
		}
		if err != nil { // a body cut short (io.ErrUnexpectedEOF) too: the handler must see it
			rest = failedReader{err}
			break
		}
	}
	r.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(body), rest), r.Body}
	return release, true
}

// room takes from the budget what body must grow by to take n more bytes, and returns it: 0
// when it has room, -1 when the budget has none. It grows to twice its size, or to what the n
// bytes need, never past most.
func (a *Admission) room(body []byte, n int, most int64) int64 {
	if len(body)+n <= cap(body) {
		return 0
	}
	grow := min(max(int64(len(body)+n), 2*int64(cap(body))), most) - int64(cap(body))
	if a.bodiesHeld.Add(grow) > a.bodyBudget {
		a.bodiesHeld.Add(-grow)
		return -1
	}
	return grow
}

// bodyReadSize is the most readBody reads at once.
const bodyReadSize = 4 << 10

// failedReader fails every read with err: the error reading a body met before the handler.
type failedReader struct{ err error }

func (f failedReader) Read([]byte) (int, error) { return 0, f.err }

// Places is how many requests are admitted at once now: with every place back if the service
// has been quiet (see giveBackIfQuiet), so that the gauge of an idle replica does not show the
// cut of its last spike for hours.
func (a *Admission) Places() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.giveBackIfQuiet(time.Now())
	return a.places()
}

func (a *Admission) places() int { return max(1, int(a.limit)) }

// enter takes a place, waiting up to AdmissionWait for one behind those already waiting, unless
// so many wait already that the wait would be in vain.
func (a *Admission) enter(ctx context.Context) bool {
	a.mu.Lock()
	now := time.Now()
	a.giveBackIfQuiet(now)
	if len(a.waiting) == 0 && a.inUse < a.places() {
		a.take()
		a.mu.Unlock()
		return true
	}
	a.pressed = now
	if waitsInVain(len(a.waiting), a.inUse, a.places(), a.mean) {
		a.mu.Unlock()
		return false
	}
	given := make(chan struct{})
	a.waiting = append(a.waiting, given)
	a.mu.Unlock()
	t := time.NewTimer(AdmissionWait)
	defer t.Stop()
	select {
	case <-given:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if i := slices.Index(a.waiting, given); i >= 0 {
		a.waiting = slices.Delete(a.waiting, i, i+1)
		return false
	}
	return true // given a place as its wait ended: it is this request's now
}

// placeWithinWait reports whether a request would get a place now or within AdmissionWait, as
// enter decides, without keeping it: a place given during the wait goes back to the requests
// waiting at once. A request asks before its client, waiting for "100 Continue", uploads its
// body, and then asks for its place once the body is in: the upload holds no place.
func (a *Admission) placeWithinWait(ctx context.Context) bool {
	a.mu.Lock()
	free := len(a.waiting) == 0 && a.inUse < a.places()
	a.mu.Unlock()
	if free { // not taken: a place taken and given back would count as at work in the window
		return true
	}
	if !a.enter(ctx) {
		return false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.inUse--
	a.handOn()
	return true
}

// giveBackIfQuiet gives every place back when none is in use and no pressure was seen for
// quietPeriod: no request found every place taken (enter), more than fewAtWork at work (take)
// or a latency over the target (observe). The load that cut the places is gone; a fresh window
// judges the requests under all of them. The caller holds a.mu.
func (a *Admission) giveBackIfQuiet(now time.Time) {
	if a.limit < float64(a.max) && a.inUse == 0 && now.Sub(a.pressed) >= quietPeriod {
		a.limit = float64(a.max)
		a.window, a.windowStart, a.peak = a.window[:0], now, 0
	}
}

// take counts a place taken. The caller holds a.mu.
func (a *Admission) take() {
	a.inUse++
	a.peak = max(a.peak, a.inUse)
	if a.inUse > fewAtWork {
		a.pressed = time.Now()
	}
}

// leave gives back the place of a request admitted when given, learns from its latency, and
// gives the places free now to the requests waiting longest.
func (a *Admission) leave(admitted time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.inUse--
	took := time.Since(admitted)
	a.mean = runningMean(a.mean, took)
	if a.target > 0 {
		a.observe(admitted, took)
	}
	a.handOn()
}

// handOn gives the places free now to the requests waiting longest. The caller holds a.mu.
func (a *Admission) handOn() {
	for len(a.waiting) > 0 && a.inUse < a.places() {
		close(a.waiting[0])
		a.waiting = a.waiting[1:]
		a.take()
	}
}

// observe adds a latency to the window and, once the window has run its time and holds enough
// requests, sets the limit from its p99 and starts the next. Only requests admitted since the
// last cut count: the ones admitted under a larger limit before it would cut it again for a
// queue it has already cut, down to a single place. A growth by one keeps the requests admitted
// before it: a slow one that outlasts a window must still count, or the limit would climb past
// any tail longer than the window.
func (a *Admission) observe(admitted time.Time, took time.Duration) {
	now := time.Now()
	if took > a.target {
		a.pressed = now
	}
	if admitted.Before(a.lastCut) {
		return
	}
	if len(a.window) < windowSamples {
		a.window = append(a.window, took)
	}
	if now.Sub(a.windowStart) < admissionWindow || len(a.window) < minWindowSamples {
		return
	}
	slices.Sort(a.window)
	if a.peak <= fewAtWork {
		a.floor = a.window[(len(a.window)-1)/10]
	} else if a.floor > 0 {
		a.floor = min(a.floor, a.window[(len(a.window)-1)/10])
	}
	target := max(a.target, 2*min(a.floor, 2*a.target))
	next := nextLimit(a.limit, a.peak, a.max, target, a.window[(len(a.window)-1)*99/100])
	if next < a.limit {
		a.lastCut = now
	}
	a.limit = next
	a.window = a.window[:0]
	a.windowStart = now
	a.peak = a.inUse
}

// nextLimit is the limit after a window whose admitted requests had p99 latency with at most
// peak of them at work at once: the places in use scaled down by target/p99 when that is over
// target and more than fewAtWork were at work (a limit above them held nobody back; fewer did
// not crowd each other), at most halved and never below one; otherwise one more, up to most.
func nextLimit(limit float64, peak, most int, target, p99 time.Duration) float64 {
	if p99 > target && peak > fewAtWork {
		return max(1, min(limit, float64(peak))*max(0.5, float64(target)/float64(p99)))
	}
	return min(float64(most), limit+1)
}

// waitsInVain reports whether a request with ahead requests waiting before it should not wait,
// with inUse requests at work, each done after mean, under places places: ahead is at least
// twice the places expected to free in AdmissionWait. After a cut more are at work than the
// places: the first departures, inUse of them each mean, only bring them down to the places
// and free nothing; then places free each mean. The first to wait always waits; a mean of 0,
// before any request is done, knows nothing: all wait.
func waitsInVain(ahead, inUse, places int, mean time.Duration) bool {
	if mean <= 0 || ahead == 0 {
		return false
	}
	excess := float64(max(0, inUse-places)) / float64(max(1, inUse))
	frees := float64(places) * (float64(AdmissionWait)/float64(mean) - excess)
	return float64(ahead) >= 2*frees
}

// runningMean adds a latency, at most latencyCap times the mean, to the mean; the first one
// stands for all.
func runningMean(mean, took time.Duration) time.Duration {
	if mean == 0 {
		return took
	}
	return mean + time.Duration(latencyWeight*float64(min(took, latencyCap*mean)-mean))
}

// Run logs, once per interval, how many requests were shed in it, until ctx ends, and then
// those shed since the last line: a burst just before a shutdown is logged too. Those shed
// later, while the server drains, Base.Close logs.
func (a *Admission) Run(ctx context.Context) error {
	tick := time.NewTicker(a.interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			a.logShed()
			return nil
		case <-tick.C:
			a.logShed()
		}
	}
}

// logShed logs how many requests were shed since it last did, if any, over the interval.
func (a *Admission) logShed() { a.logShedOver("interval", a.interval) }

// logShedOver logs how many requests were shed since it last did, if any, with key and value
// saying over what time.
func (a *Admission) logShedOver(key string, value any) {
	a.shedMu.Lock()
	n, bodyFull := a.shed, a.bodyShed
	a.shed, a.bodyShed = 0, 0
	a.shedMu.Unlock()
	if n > 0 {
		a.log.Warn("at capacity: requests shed", "shed", n, key, value, "places", a.Places(), "max_in_flight", a.max,
			"body_budget_full", bodyFull)
	}
}
