package platform

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// With every place taken, a request is answered 503 at once, with a problem and a Retry-After
// of 1 to 3 s, and counted; a place that frees up within the wait admits the next request; and
// the sheds are logged as one line per interval, not one per request.
func TestAdmissionShedsTheExcessAtOnce(t *testing.T) {
	t.Parallel()
	log, logs := testenv.NewLogger(t)
	a, err := NewAdmission(log, prometheus.NewRegistry(), 2, 0)
	if err != nil {
		t.Fatal(err)
	}
	a.interval = 200 * time.Millisecond
	release := make(chan struct{})
	releaseAll := sync.OnceFunc(func() { close(release) })
	entered := make(chan struct{}, 10)
	srv := httptest.NewServer(a.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-release
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	// Before Close, which waits for the held requests: a failure must not turn into a hang.
	defer releaseAll()
	held := make(chan int, 2)
	for range 2 {
		go func() {
			resp, err := http.Post(srv.URL, "application/json", strings.NewReader("{}"))
			if err != nil {
				held <- 0
				return
			}
			resp.Body.Close()
			held <- resp.StatusCode
		}()
		<-entered
	}

	// A client that gives up: a request that waited for the held requests would otherwise hang
	// the test rather than fail it.
	client := &http.Client{Timeout: 5 * time.Second}
	var took []time.Duration
	for i := range 5 {
		start := time.Now()
		resp, err := client.Post(srv.URL, "application/json", strings.NewReader("{}"))
		if err != nil {
			t.Fatalf("request %d with every place taken: %v: it waited for a place", i, err)
		}
		took = append(took, time.Since(start))
		var p Problem
		_ = json.NewDecoder(resp.Body).Decode(&p)
		resp.Body.Close()
		retry, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Content-Type") != "application/problem+json" || p.Status != 503 {
			t.Fatalf("request %d with every place taken: %d %s %+v, want a 503 problem", i, resp.StatusCode, resp.Header.Get("Content-Type"), p)
		}
		if retry < 1 || retry > 3 {
			t.Fatalf("Retry-After %q, want 1 to 3 s", resp.Header.Get("Retry-After"))
		}
	}
	// At once: within the admission's wait and the round trip, not after the held requests.
	// The median, with a margin, because -race on two cores busy with other packages' tests
	// has put one round trip past 300 ms; the 50 ms target is the benchmark's shed p99
	// (scripts/bench.sh), measured without -race.
	if median := pct(took, 50); median > AdmissionWait+240*time.Millisecond {
		t.Fatalf("sheds took %v, median %s: want within %s", took, median, AdmissionWait+240*time.Millisecond)
	}
	if n := testutil.ToFloat64(a.count); n != 5 {
		t.Fatalf("http_requests_shed_total = %v, want 5", n)
	}
	// Started after the sheds, so that all five fall in its first interval however slowly
	// busy cores answered them.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = a.Run(ctx) }()
	testenv.Eventually(t, 5*time.Second, func() bool { return len(logs.Lines("at capacity: requests shed", "shed=5")) == 1 },
		"the sheds were not logged as one line")
	time.Sleep(3 * a.interval) // intervals without a shed: they must log nothing
	if n := len(logs.Lines("at capacity")); n != 1 {
		t.Fatalf("%d lines about shedding, want 1: intervals without a shed log nothing", n)
	}

	// A place freed during the wait admits the request waiting for it.
	done := make(chan int, 1)
	go func() {
		resp, err := http.Post(srv.URL, "application/json", strings.NewReader("{}"))
		if err != nil {
			done <- 0
			return
		}
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	release <- struct{}{} // one held request finishes, its place frees
	if code := <-held; code != http.StatusCreated {
		t.Fatalf("held request: %d", code)
	}
	<-entered
	releaseAll()
	if code := <-done; code != http.StatusCreated {
		t.Fatalf("the request that waited for a place: %d, want 201", code)
	}
}

// A place given back goes to the request waiting for it, not to the end of its wait; a request
// that only asks whether it would get one (a client waiting for 100 Continue) is told so, and
// gives the place back. Only a try in which the place came back sooner than AdmissionWait after
// the request began waiting judges: a machine that stalled the test longer may rightly have shed
// it.
func TestAFreedPlaceGoesToTheRequestWaiting(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		enter func(*Admission, context.Context) bool
		keeps int // the places in use after the request's answer
	}{
		{"enter", (*Admission).enter, 1},
		{"placeWithinWait", (*Admission).placeWithinWait, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			freedPlaceGoesToTheRequestWaiting(t, c.enter, c.keeps)
		})
	}
}

// freedPlaceGoesToTheRequestWaiting is TestAFreedPlaceGoesToTheRequestWaiting with a request
// that asks for a place by enter, and holds keeps places once given one.
func freedPlaceGoesToTheRequestWaiting(t *testing.T, enter func(*Admission, context.Context) bool, keeps int) {
	const tries = 5
	for range tries {
		a := newAdmission(t, 1, 0)
		if !a.enter(context.Background()) {
			t.Fatal("the one place of an idle admission was not given")
		}
		admitted := make(chan bool, 1)
		began := time.Now()
		go func() { admitted <- enter(a, context.Background()) }()
		if !waitsWithin(t, a, admitted, 5*time.Second) {
			t.Logf("the request was shed before the test saw it wait: tried again")
			continue
		}
		a.leave(time.Now())
		inTime := time.Since(began) < AdmissionWait
		if <-admitted {
			a.mu.Lock()
			inUse, waiting := a.inUse, len(a.waiting)
			a.mu.Unlock()
			if inUse != keeps || waiting != 0 {
				t.Fatalf("after the place was given: %d places in use, %d requests waiting; want %d and 0", inUse, waiting, keeps)
			}
			return
		}
		if inTime {
			t.Fatalf("the place came back within %s of the request's wait, and it was shed: want it admitted", AdmissionWait)
		}
		t.Logf("the place came back %s after the request began waiting, past its %s wait: tried again", time.Since(began), AdmissionWait)
	}
	t.Fatalf("the place came back past the %s wait in each of %d tries: the machine is too busy to show anything", AdmissionWait, tries)
}

// waitsWithin polls, as fast as it can (a wait lasts AdmissionWait), until a request waits for a
// place of a; false if admitted had its answer first. It fails the test after deadline.
func waitsWithin(t *testing.T, a *Admission, admitted <-chan bool, deadline time.Duration) bool {
	t.Helper()
	for end := time.Now().Add(deadline); time.Now().Before(end); runtime.Gosched() {
		a.mu.Lock()
		n := len(a.waiting)
		a.mu.Unlock()
		if n == 1 {
			return true
		}
		select {
		case <-admitted:
			return false
		default:
		}
	}
	t.Fatalf("no request waited for a place within %s", deadline)
	return false
}

// A request waits for a place only while the requests waiting before it can be given theirs
// within the wait: it stops at twice the places expected to free up in it, and at one. After a
// cut, the departures that bring those at work down to the places free none.
func TestWaitsInVain(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	for _, c := range []struct {
		ahead, inUse, places int
		mean                 time.Duration
		want                 bool
		situation            string
	}{
		{0, 1, 1, 100 * ms, false, "the first to wait always waits"},
		{1, 1, 1, 100 * ms, true, "one place, free every 100 ms: the second waits in vain"},
		{15, 16, 16, 20 * ms, false, "16 places of 20 ms free 8 in the wait: fewer than 16 ahead wait"},
		{16, 16, 16, 20 * ms, true, "twice the places that free in the wait"},
		{1000, 16, 16, 0, false, "before any request is done nothing is known: all wait"},
		{1, 32, 16, 20 * ms, true, "cut from 32 places to 16: the 16 departures in the wait free none"},
		{0, 32, 16, 20 * ms, false, "the first to wait always waits, after a cut too"},
		{5, 24, 16, 20 * ms, false, "cut to 16 with 24 at work: 8 leave in 6.7 ms, then 16 places free 2.7 in the rest"},
		{6, 24, 16, 20 * ms, true, "twice the 2.7 places that free"},
		{143, 32, 16, 2 * ms, false, "cut to 16 with 32 at work, fast: 16 leave in 1 ms, then 72 places free"},
		{144, 32, 16, 2 * ms, true, "twice the 72 places that free"},
	} {
		if got := waitsInVain(c.ahead, c.inUse, c.places, c.mean); got != c.want {
			t.Errorf("%s: waitsInVain(%d ahead, %d in use, %d places, mean %s) = %v, want %v", c.situation, c.ahead, c.inUse, c.places, c.mean, got, c.want)
		}
	}
}

// The mean follows the latencies a twentieth at a time, and one request held to its deadline
// moves it no more than one four times the mean.
func TestRunningMean(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	for _, c := range []struct {
		mean, took, want time.Duration
		situation        string
	}{
		{0, 30 * ms, 30 * ms, "the first latency stands for all"},
		{100 * ms, 0, 95 * ms, "a fast request: a twentieth of the way down"},
		{100 * ms, 200 * ms, 105 * ms, "a slow request: a twentieth of the way up"},
		{10 * ms, 5 * time.Second, 11500 * time.Microsecond, "a request held 5 s counts as 40 ms"},
	} {
		if got := runningMean(c.mean, c.took); got != c.want {
			t.Errorf("%s: runningMean(%s, %s) = %s, want %s", c.situation, c.mean, c.took, got, c.want)
		}
	}
}

// Behind a request that already waits for the one place, which frees every 100 ms, a request is
// shed without waiting; with nobody before it, it waits for the place.
func TestAdmissionShedsBehindAQueueWithoutWaiting(t *testing.T) {
	t.Parallel()
	a := newAdmission(t, 1, 0)
	ctx := context.Background()
	for range 2 {
		if !a.enter(ctx) {
			t.Fatal("the free place was not given")
		}
		a.leave(time.Now().Add(-100 * time.Millisecond))
	}
	if !a.enter(ctx) {
		t.Fatal("the free place was not given")
	}
	a.mu.Lock()
	a.waiting = append(a.waiting, make(chan struct{})) // a request waiting for it already
	a.mu.Unlock()
	start := time.Now()
	for range 100 {
		if a.enter(ctx) {
			t.Fatal("admitted with the one place taken")
		}
	}
	// Waiting, they would take 100 × AdmissionWait; without, microseconds each.
	if took := time.Since(start); took > 50*AdmissionWait {
		t.Fatalf("100 requests behind the queue took %s to shed: they waited", took)
	}
	a.mu.Lock()
	a.waiting = a.waiting[:0]
	a.mu.Unlock()
	start = time.Now()
	if a.enter(ctx) {
		t.Fatal("admitted with the one place taken")
	}
	if took := time.Since(start); took < AdmissionWait {
		t.Fatalf("the first to wait was shed after %s, want after the wait (%s)", took, AdmissionWait)
	}
}

// The places in use are scaled by target/p99 after a slow window, at most halved and never below
// one place; after a window within the target the limit grows by one, up to the most.
func TestNextLimit(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	for _, c := range []struct {
		limit     float64
		peak      int
		p99       time.Duration
		want      float64
		situation string
	}{
		{16, 16, 100 * ms, 8, "twice the target: halved"},
		{16, 16, 80 * ms, 10, "over the target: scaled by target/p99"},
		{16, 16, 400 * ms, 8, "far over the target: halved, no more"},
		{16, 6, 80 * ms, 3.75, "over the target with fewer in use: those in use are scaled"},
		{1.5, 3, 400 * ms, 1, "never below one place"},
		{16, 2, 400 * ms, 16, "over the target with two at work, who did not crowd each other: no cut"},
		{1, 1, 400 * ms, 2, "over the target at a limit of one, which kept every window that few: one more"},
		{8, 8, 50 * ms, 9, "at the target: one more"},
		{8, 2, 3 * ms, 9, "far under the target: one more, no more"},
		{16, 16, 10 * ms, 16, "never above the most"},
	} {
		if got := nextLimit(c.limit, c.peak, 16, 50*ms, c.p99); got != c.want {
			t.Errorf("%s: nextLimit(%v, peak %d, p99 %s) = %v, want %v", c.situation, c.limit, c.peak, c.p99, got, c.want)
		}
	}
}

// A limit cut to two learns the floor there (it may never see one request at a time): with
// requests of 35 ms against a 25 ms target, it grows back instead of swinging between two and
// three places.
func TestTheFloorIsLearntWithTwoAtWork(t *testing.T) {
	t.Parallel()
	a := newAdmission(t, 14, 25*time.Millisecond)
	a.limit = 2
	for i, peak := range []int{2, 3, 4} {
		if n, want := runWindow(a, peak, 35*time.Millisecond), 3+i; n != want {
			t.Fatalf("after window %d (%d at work, every request 35 ms): %d places, want %d", i+1, peak, n, want)
		}
	}
}

// newAdmission is an admission control of at most most places and a latency target, its
// metrics in a registry of its own.
func newAdmission(t *testing.T, most int, target time.Duration) *Admission {
	t.Helper()
	log, _ := testenv.NewLogger(t)
	a, err := NewAdmission(log, prometheus.NewRegistry(), most, target)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// runWindow has a window of a run its time with peak requests at work at most, each of its
// requests taking took, and returns the places after it.
func runWindow(a *Admission, peak int, took time.Duration) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.windowStart = time.Now().Add(-admissionWindow)
	a.peak = peak
	for range minWindowSamples {
		a.observe(time.Now(), took)
	}
	return a.places()
}

// A body that ends before its declared length, or mid-chunk, is read ahead as far as it came,
// and the handler then sees the error, as it would have from the connection: a truncated body
// must not pass for a whole one.
func TestABodyCutShortIsAnErrorForTheHandler(t *testing.T) {
	t.Parallel()
	a := newAdmission(t, 4, DefaultLatencyTarget)
	for _, declared := range []int64{100, -1} {
		r := httptest.NewRequest(http.MethodPost, "/", io.MultiReader(strings.NewReader(`{"a":1}`), failedReader{io.ErrUnexpectedEOF}))
		r.ContentLength = declared
		release, read := a.readBody(r)
		got, err := io.ReadAll(r.Body)
		release()
		if !read {
			t.Errorf("declared %d: a body within the budget was not read", declared)
		}
		if string(got) != `{"a":1}` || !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Errorf("declared %d: the handler read %q, %v; want the 7 bytes that came, then io.ErrUnexpectedEOF", declared, got, err)
		}
	}
	if n := a.bodiesHeld.Load(); n != 0 {
		t.Errorf("%d bytes still counted as held, want 0", n)
	}
}

// A quiet service, one request at a time, keeps its places when two of a window's requests are
// slow (a reconnection, a pause): fewer places would not have made them faster, and the next
// burst would be shed.
func TestASlowRequestAmongFewAtWorkCutsNothing(t *testing.T) {
	t.Parallel()
	a := newAdmission(t, 14, 50*time.Millisecond)
	a.windowStart = time.Now().Add(-admissionWindow) // the window has run its time
	for i := range minWindowSamples {
		took := 5 * time.Millisecond
		if i%10 == 0 {
			took = 400 * time.Millisecond
		}
		a.mu.Lock()
		a.take()
		a.inUse--
		a.observe(time.Now(), took)
		a.mu.Unlock()
	}
	if n := a.Places(); n != 14 {
		t.Fatalf("after a window of one request at a time, two of them slow: %d places, want the 14 kept", n)
	}
}

// A floor learnt in a stall (a quiet window whose requests waited on a stalled database) raises
// the target in force to twice the target at most: the limit still cuts for a crowd after it.
func TestAFloorLearntInAStallDoesNotTurnTheLimitOff(t *testing.T) {
	t.Parallel()
	const target = 50 * time.Millisecond
	a := newAdmission(t, 32, target)
	if n := runWindow(a, 1, time.Second); n != 32 { // the stall, one request at a time
		t.Fatalf("after a quiet window of 1 s requests: %d places, want the 32 kept", n)
	}
	if n := runWindow(a, 32, 300*time.Millisecond); n != 21 { // a crowd: 32 × 200 ms / 300 ms
		t.Fatalf("after a crowded window at p99 300 ms, the floor learnt at 1 s: %d places, want 21 (the target in force capped at 4 × %s)", n, target)
	}
}

// Requests that take longer than the target with nothing queued (a database farther away than
// the target allows) are not shed for it for long: the limit falls to a few places once, learns
// that floor there, aims at twice it, and comes back to every place, where a limit that aimed at
// the target stayed at one place and shed what it could have served.
// A floor 1.4 times the target cuts the places from three to two, not to one: the floor must be
// learnt with two at work.
//
// The windows are given their latencies, not timed: on busy cores a request stalls past the
// floor, and the window it falls in rightly cuts the limit.
func TestALatencyFloorAboveTheTargetKeepsThePlaces(t *testing.T) {
	t.Parallel()
	const most, target = 14, 25 * time.Millisecond
	for _, floor := range []time.Duration{40 * time.Millisecond, 35 * time.Millisecond} {
		t.Run(floor.String(), func(t *testing.T) {
			a := newAdmission(t, most, target)
			// As many clients as places, each request taking floor however many are at work:
			// every place is in use in each window.
			places, lowest := most, most
			for window := 1; lowest >= most/2 || places < most; window++ {
				if window > 30 {
					t.Fatalf("%d places after %d windows, the lowest %d; want the limit to fall below %d and come back to %d",
						places, window-1, lowest, most/2, most)
				}
				places = runWindow(a, places, floor)
				lowest = min(lowest, places)
			}
			for range 3 {
				if n := runWindow(a, most, floor); n != most {
					t.Fatalf("every place back: %d places after a window at work on all of them, want the %d kept", n, most)
				}
			}
		})
	}
}

// A limit is judged by enough requests admitted under it: a window of a few slow ones changes
// nothing, and the slow ones still finishing from before a cut do not cut it again.
func TestLimitIsJudgedByTheRequestsAdmittedUnderIt(t *testing.T) {
	t.Parallel()
	a := newAdmission(t, 32, 25*time.Millisecond)
	a.peak = 32
	finish := func(admitted time.Time) int {
		a.windowStart = time.Now().Add(-admissionWindow) // the window has run its time
		for range minWindowSamples {
			a.observe(admitted, 200*time.Millisecond)
		}
		a.peak = 32
		return a.places()
	}
	a.windowStart = time.Now().Add(-admissionWindow)
	for range minWindowSamples - 1 {
		a.observe(time.Now(), time.Second)
	}
	if n := a.places(); n != 32 {
		t.Fatalf("after a window of %d slow requests: %d places, want 32: too few to judge by", minWindowSamples-1, n)
	}
	a.window = a.window[:0]
	before := time.Now()
	if n := finish(before); n != 16 {
		t.Fatalf("after a window at p99 200 ms: %d places, want 16 (halved)", n)
	}
	if n := finish(before); n != 16 {
		t.Fatalf("a request admitted before the cut: %d places, want 16 still", n)
	}
	if n := finish(time.Now()); n != 8 {
		t.Fatalf("a request admitted after the cut, as slow: %d places, want 8", n)
	}
}

// The sheds since the last line are logged when Run ends too: a burst in the last interval before
// a shutdown is not lost to the logs.
func TestSheddingJustBeforeAShutdownIsLogged(t *testing.T) {
	t.Parallel()
	log, logs := testenv.NewLogger(t)
	a, err := NewAdmission(log, prometheus.NewRegistry(), 2, 0)
	if err != nil {
		t.Fatal(err)
	}
	a.interval = time.Hour
	a.shed = 5
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := a.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if n := len(logs.Lines("at capacity: requests shed", "shed=5")); n != 1 {
		t.Fatalf("%d lines of the 5 sheds before the shutdown, want 1", n)
	}
}

// A request slower than a window, admitted after the last cut, counts when it is done though the
// places grew by one meanwhile: if each growth forgot the requests admitted before it, the places
// would climb past any tail longer than a window, up to the most, and swing from there.
func TestASlowTailCountsWhileThePlacesGrow(t *testing.T) {
	t.Parallel()
	a := newAdmission(t, 16, time.Second)
	a.limit = 10
	admitted := time.Now()
	if n := runWindow(a, 10, 5*time.Millisecond); n != 11 {
		t.Fatalf("after a window of fast requests: %d places, want 11", n)
	}
	a.windowStart, a.peak = time.Now().Add(-admissionWindow), 11
	for range 4 {
		a.observe(admitted, 1600*time.Millisecond) // admitted before the growth, done after it
	}
	for range minWindowSamples - 4 {
		a.observe(time.Now(), 5*time.Millisecond)
	}
	if n := a.places(); n >= 11 {
		t.Fatalf("after a window at p99 1.6 s against a target of 1 s: %d places, want fewer than 11", n)
	}
}

// A client that sends its body late (a slow uplink, Expect: 100-continue) does so before its
// request asks for a place: that wait is the client's pace, not the server's latency. While the
// body is pending the request holds no place, and a window may change the limit; once the body
// is in, the request is admitted under the limit then, and adds one latency, from its admission.
func TestAdmissionIsNotCutBySlowUploads(t *testing.T) {
	t.Parallel()
	a := newAdmission(t, 20, DefaultLatencyTarget)
	var inUse, places int // as the handler found them
	h := a.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.mu.Lock()
		inUse, places = a.inUse, a.places()
		a.mu.Unlock()
		readsItsBody(w, r)
	}))
	body, upload := io.Pipe()
	defer upload.Close() // a test that fails with the body pending must not leave its request reading
	rec := httptest.NewRecorder()
	answered := make(chan struct{})
	go func() {
		defer close(answered)
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/", body))
	}()
	// A pipe's write returns once it is read: the request is reading its body.
	if _, err := upload.Write([]byte("{")); err != nil {
		t.Fatal(err)
	}
	a.mu.Lock()
	pending := a.inUse
	a.mu.Unlock()
	if pending != 0 {
		t.Fatalf("%d places in use while the request's body is pending, want 0: the upload holds a place", pending)
	}
	if n := runWindow(a, 20, 2*DefaultLatencyTarget); n != 10 { // a crowded window at twice the target
		t.Fatalf("after a window of 20 at work at twice the target: %d places, want 10", n)
	}
	bodyDone := time.Now()
	if _, err := upload.Write([]byte(`"a":1}`)); err != nil {
		t.Fatal(err)
	}
	upload.Close()
	select {
	case <-answered:
	case <-time.After(5 * time.Second):
		t.Fatal("the request was not answered within 5 s of its body")
	}
	sinceBody := time.Since(bodyDone)
	if rec.Code != http.StatusCreated || rec.Body.String() != "7" || inUse != 1 || places != 10 {
		t.Fatalf("once its body was in: %d %q, handled with %d places in use of %d; want 201 with its 7 bytes read, admitted to 1 of the 10 places",
			rec.Code, rec.Body.String(), inUse, places)
	}
	a.mu.Lock()
	window, left := slices.Clone(a.window), a.inUse
	a.mu.Unlock()
	// Admitted after its body came, it counts under the new limit, and its latency leaves the
	// upload out.
	if len(window) != 1 || window[0] > sinceBody || left != 0 {
		t.Fatalf("latencies added to the window: %v, %d places in use after the answer; want one, at most the %s since the body came, and the place given back",
			window, left, sinceBody)
	}
}

// readsItsBody reads the request's body and answers 201 with how many bytes it read, or 400
// with the read's error.
func readsItsBody(w http.ResponseWriter, r *http.Request) {
	n, err := io.Copy(io.Discard, r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write([]byte(strconv.FormatInt(n, 10)))
}

// Clients that send their bodies slowly hold no place while they do: with every one of the
// places' worth of them trickling, a request whose body came at once is served, and the
// trickled requests are served with their whole bodies when they arrive. A body declared over
// MaxBufferedBody is refused at once.
func TestSlowUploadsHoldNoPlace(t *testing.T) {
	t.Parallel()
	const places = 4
	a := newAdmission(t, places, DefaultLatencyTarget)
	srv := httptest.NewUnstartedServer(a.Middleware(http.HandlerFunc(readsItsBody)))
	active := countRequests(srv)
	srv.Start()
	defer srv.Close()

	trickled, releaseAll := trickle(srv.URL, places, 7)
	defer releaseAll() // before the server closes, which waits for their requests
	// Every trickling request has reached the server, and waits for its body: each has taken
	// the budget of the one byte it sent, which it does past admission too, had admission come
	// before the body. A fixed wait here was too short on busy cores for that order to show.
	testenv.Eventually(t, 5*time.Second, func() bool { return active.Load() >= places && a.bodiesHeld.Load() == places },
		"the trickling requests never reached the server and began reading their bodies")
	for range 3 {
		if code, _ := postTo(t, http.DefaultClient, srv.URL); code != http.StatusCreated {
			t.Fatalf("a request with its body at once, beside %d trickling ones: %d, want 201: they hold the places", places, code)
		}
	}
	releaseAll()
	for range places {
		if got := <-trickled; got != "201 7" {
			t.Errorf("a trickled request: %q, want 201 and its 7 bytes read", got)
		}
	}

	if n := a.bodiesHeld.Load(); n != 0 {
		t.Errorf("%d bytes of bodies still counted as held after every request ended, want 0", n)
	}

	// A body declared larger than any API takes is answered 413 at once, unread.
	resp, err := http.Post(srv.URL, "text/plain", strings.NewReader(strings.Repeat("x", MaxBufferedBody+10)))
	if err != nil {
		t.Fatal(err)
	}
	var p struct{ Status int }
	if err := json.NewDecoder(resp.Body).Decode(&p); err != nil || resp.StatusCode != http.StatusRequestEntityTooLarge || p.Status != http.StatusRequestEntityTooLarge ||
		resp.Header.Get("Content-Type") != "application/problem+json" {
		t.Errorf("a body over MaxBufferedBody: %d %+v (%v), want a 413 problem", resp.StatusCode, p, err)
	}
	resp.Body.Close()
}

// The bodies read ahead of admission hold at most the budget's bytes at once: a request whose
// body finds no room is shed at once, holding no place, and gives back what it took; a body
// that arrives whole in its first read needs none, so small requests still go through.
// Admitted to read its body after admission instead, slow uploads that filled the budget had
// every later request take a place with its body unread, and held them all.
func TestABodyPastTheBudgetIsShed(t *testing.T) {
	t.Parallel()
	a := newAdmission(t, 4, DefaultLatencyTarget)
	a.bodyBudget = 6001
	srv := httptest.NewUnstartedServer(a.Middleware(http.HandlerFunc(readsItsBody)))
	active := countRequests(srv)
	srv.Start()
	defer srv.Close()
	// A slow upload that holds the budget, all but a byte or two: 5,999 of the 6,000 bytes it
	// declares (its buffer grows to the declared length and one more at most).
	filling, releaseFilling := trickleBytes(srv.URL, 1, 6000, 5999)
	defer releaseFilling()
	testenv.Eventually(t, 5*time.Second, func() bool { return a.bodiesHeld.Load() >= 5999 },
		"the slow upload never took its bytes of the budget")
	held := a.bodiesHeld.Load()
	// The next slow uploads find no room for their bytes: shed, not admitted to wait for them.
	past, releasePast := trickleBytes(srv.URL, 4, MaxBufferedBody, 7000)
	defer releasePast()
	inUse := func() int {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.inUse
	}
	for range 4 {
		select {
		case got := <-past:
			if !strings.HasPrefix(got, "503 ") {
				t.Errorf("a slow upload past the budget: %q, want 503", got)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("a slow upload past the budget still unanswered after 5 s, %d places in use", inUse())
		}
	}
	if n := inUse(); n != 0 || a.bodiesHeld.Load() != held {
		t.Errorf("%d places in use, %d bytes held; want none in use and the first upload's %d only", n, a.bodiesHeld.Load(), held)
	}
	// A request whose small body came at once is served all the same.
	if code, _ := postTo(t, http.DefaultClient, srv.URL); code != http.StatusCreated {
		t.Errorf("a small request while slow uploads hold the budget: %d, want 201", code)
	}
	releaseFilling()
	<-filling
	testenv.Eventually(t, 5*time.Second, func() bool { return active.Load() >= 6 && a.bodiesHeld.Load() == 0 },
		"the budget was not given back")
}

// countRequests counts, from when srv starts, the connections that have begun a request.
func countRequests(srv *httptest.Server) *atomic.Int64 {
	var active atomic.Int64
	srv.Config.ConnState = func(_ net.Conn, state http.ConnState) {
		if state == http.StateActive {
			active.Add(1)
		}
	}
	return &active
}

// trickle starts n clients that post a body of declared bytes to url, sending its first byte at
// once and the rest only once release is called (a body of 7 bytes, {"a":1}; any other length
// ends there, short); each one's status and response body, or error, come on results.
func trickle(url string, n int, declared int64) (results <-chan string, release func()) {
	return trickleBytes(url, n, declared, 1)
}

// trickleBytes is trickle with first bytes sent at once.
func trickleBytes(url string, n int, declared int64, first int) (results <-chan string, release func()) {
	released := make(chan struct{})
	var once sync.Once
	out := make(chan string, n)
	for range n {
		pr, pw := io.Pipe()
		go func() {
			_, _ = pw.Write(append([]byte("{"), bytes.Repeat([]byte(" "), first-1)...)) // then nothing until released
			<-released
			if declared == 7 {
				_, _ = pw.Write([]byte(`"a":1}`))
			}
			_ = pw.Close()
		}()
		go func() {
			req, _ := http.NewRequest(http.MethodPost, url, pr)
			req.ContentLength = declared
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				out <- err.Error()
				return
			}
			defer resp.Body.Close()
			got, _ := io.ReadAll(resp.Body)
			out <- fmt.Sprintf("%d %s", resp.StatusCode, got)
		}()
	}
	return out, func() { once.Do(func() { close(released) }) }
}

// Budget is taken by the bytes that arrive, not by the lengths declared: sixteen clients that
// declare a megabyte each and send one byte take a byte each, and the next slow uploads still
// hold no place. The budget is two reads' worth: taken ahead of the bytes, 4 KiB for each of
// the first two clients' reads filled it, and the small trickles were admitted to read their
// bodies after admission, holding every place.
func TestDeclaredLengthsTakeNoBudget(t *testing.T) {
	t.Parallel()
	const places = 4
	a := newAdmission(t, places, DefaultLatencyTarget)
	a.bodyBudget = 2 * bodyReadSize
	srv := httptest.NewUnstartedServer(a.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusCreated)
	})))
	active := countRequests(srv)
	srv.Start()
	defer srv.Close()
	_, releaseBig := trickle(srv.URL, 16, MaxBufferedBody)
	defer releaseBig()
	_, releaseSmall := trickle(srv.URL, places, 7)
	defer releaseSmall()
	testenv.Eventually(t, 5*time.Second, func() bool { return active.Load() >= 16+places && a.bodiesHeld.Load() >= 16+places },
		"the trickling clients never reached the server, or their bytes were not counted")
	if held := a.bodiesHeld.Load(); held != 16+places {
		t.Errorf("%d bytes of budget taken by %d clients that sent one byte each, want one each", held, 16+places)
	}
	for range 3 {
		if code, _ := postTo(t, http.DefaultClient, srv.URL); code != http.StatusCreated {
			t.Fatalf("a request with its body at once, beside 20 trickling ones: %d, want 201: they hold the places", code)
		}
	}
}

// A service that does one request at a time, 5 ms each, has a latency of 5 ms per request
// admitted before it: with 16 places, 80 ms. Under more clients than places, admission lowers
// its places until the admitted requests' p99 is near the target, sheds the rest at once, and
// gives the places back when the load is gone. The same service behind a fixed limit, under the
// same load at the same time, is the baseline: on busy cores both slow down.
//
// Not parallel: its 96 clients would slow the other tests' round trips past their bounds.
func TestAdmissionHoldsTheLatencyTarget(t *testing.T) {
	const most, target = 16, 25 * time.Millisecond
	log, _ := testenv.NewLogger(t)
	reg := prometheus.NewRegistry()
	a, err := NewAdmission(log, reg, most, target)
	if err != nil {
		t.Fatal(err)
	}
	fixed, err := NewAdmission(log, prometheus.NewRegistry(), most, 0)
	if err != nil {
		t.Fatal(err)
	}
	var adaptive, baseline loadResult
	var wg sync.WaitGroup
	wg.Go(func() { adaptive = overloadOne(t, a) })
	wg.Go(func() { baseline = overloadOne(t, fixed) })
	wg.Wait()
	t.Logf("admitted in the last 2 s: %d, p50 %s, p99 %s (target %s), against %d, p50 %s, p99 %s with a fixed limit; shed %d, p50 %s, p90 %s; %d places of %d at the end",
		len(adaptive.admitted), pct(adaptive.admitted, 50), pct(adaptive.admitted, 99), target, len(baseline.admitted), pct(baseline.admitted, 50), pct(baseline.admitted, 99),
		len(adaptive.shed), pct(adaptive.shed, 50), pct(adaptive.shed, 90), a.Places(), most)
	// Kept busy: about as many admitted as with the fixed limit (0.71-0.99 measured, alone and
	// beside the whole suite), which busy cores slow down as much.
	if len(adaptive.admitted) < len(baseline.admitted)/2 {
		t.Fatalf("%d requests admitted in 2 s, want at least half the fixed limit's %d: the service kept busy", len(adaptive.admitted), len(baseline.admitted))
	}
	// Near the target: the median, alone or beside the other packages' tests, 0.27-0.53 of
	// the fixed limit's (the p99 0.31-0.83, the highest with other tests loading the cores);
	// without adaptation both are about one. The median judges, being steady on busy cores; the
	// p99 only has to be lower.
	if pct(adaptive.admitted, 50) > pct(baseline.admitted, 50)*2/3 || pct(adaptive.admitted, 99) >= pct(baseline.admitted, 99) {
		t.Fatalf("admitted p50 %s, p99 %s: want at most two thirds of the fixed limit's p50 %s, and below its p99 %s: near the %s target",
			pct(adaptive.admitted, 50), pct(adaptive.admitted, 99), pct(baseline.admitted, 50), pct(baseline.admitted, 99), target)
	}
	// At once, not after a wait in line: the median shed 0.15-0.33 of the fixed limit's admitted
	// median, which waited in line. Judged against it because 96 clients under -race on two
	// busy cores slow every round trip (a shed p90 of 350 ms once); the bound of the wait itself
	// is TestAdmissionShedsTheExcessAtOnce's.
	if len(adaptive.shed) == 0 || pct(adaptive.shed, 50) > pct(baseline.admitted, 50)*2/3 {
		t.Fatalf("%d shed, p50 %s: want the excess shed in at most two thirds of the fixed limit's admitted p50 %s",
			len(adaptive.shed), pct(adaptive.shed, 50), pct(baseline.admitted, 50))
	}
	if n := gauge(t, reg, "http_admission_limit"); n >= most || n != float64(a.Places()) {
		t.Fatalf("http_admission_limit %v at the end of the load, want the places now (%d), fewer than %d", n, a.Places(), most)
	}
	for _, ad := range []*Admission{a, fixed} {
		ad.mu.Lock()
		inUse, waiting := ad.inUse, len(ad.waiting)
		ad.mu.Unlock()
		if inUse != 0 || waiting != 0 {
			t.Fatalf("after the load: %d places in use, %d requests waiting; want every place given back", inUse, waiting)
		}
	}

	// One request at a time, each well within the target: the places come back. The target is
	// raised for this part: what it judges is the coming back, and a lone 5 ms request under
	// -race, on cores busy with other packages' tests, took over 25 ms at times in CI (one such
	// window cuts the places to one again, since only one was at work).
	a.mu.Lock()
	a.target = 10 * target
	a.mu.Unlock()
	srv, client := oneAtATime(a)
	defer srv.Close()
	testenv.Eventually(t, 30*time.Second, func() bool {
		for range minWindowSamples {
			if code, _ := postTo(t, client, srv.URL); code != http.StatusCreated {
				t.Fatalf("a lone request: %d, want 201", code)
			}
		}
		return a.Places() == most
	}, "the places did not come back once the load was gone")
}

// loadResult is what overloadOne measured.
type loadResult struct {
	admitted, shed []time.Duration // admitted: in the last 2 s only
}

// overloadOne puts a service that does one request at a time, 5 ms each, behind a, and has 48
// clients post to it in a closed loop for 4 s; the last 2 s are measured, once the limit has
// had a few windows to settle.
func overloadOne(t *testing.T, a *Admission) loadResult {
	srv, client := oneAtATime(a)
	defer srv.Close()
	var mu sync.Mutex
	var got loadResult
	start := time.Now()
	var wg sync.WaitGroup
	for range 48 {
		wg.Go(func() {
			for time.Since(start) < 4*time.Second {
				code, took := postTo(t, client, srv.URL)
				settled := time.Since(start) > 2*time.Second
				mu.Lock()
				switch {
				case code == http.StatusCreated && settled:
					got.admitted = append(got.admitted, took)
				case code == http.StatusServiceUnavailable:
					got.shed = append(got.shed, took)
				}
				mu.Unlock()
				if code != http.StatusCreated {
					time.Sleep(10 * time.Millisecond) // a shed client comes back a little later
				}
			}
		})
	}
	wg.Wait()
	return got
}

// oneAtATime serves, behind a, a service that does one request at a time, 5 ms each.
func oneAtATime(a *Admission) (*httptest.Server, *http.Client) {
	var one sync.Mutex
	srv := httptest.NewServer(a.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		one.Lock()
		time.Sleep(5 * time.Millisecond) // the work
		one.Unlock()
		w.WriteHeader(http.StatusCreated)
	})))
	return srv, &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
}

// postTo posts to url and says what came back, and how long it took.
func postTo(t *testing.T, client *http.Client, url string) (int, time.Duration) {
	start := time.Now()
	resp, err := client.Post(url, "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Error(err)
		return 0, 0
	}
	resp.Body.Close()
	return resp.StatusCode, time.Since(start)
}

// pct is the p-th percentile of ds (0 when there are none).
func pct(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[(len(s)-1)*p/100]
}

// gauge is the value of the gauge name in reg.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no gauge %s", name)
	return 0
}

// A request whose client went away while it waited for a place gets no answer and is not
// counted as shed: nobody was turned away.
func TestAClientGoneWhileItWaitsIsNotShed(t *testing.T) {
	t.Parallel()
	a := newAdmission(t, 1, 0)
	if !a.enter(context.Background()) {
		t.Fatal("the first request was not admitted")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	req := httptest.NewRequestWithContext(ctx, http.MethodGet, "/", nil)
	rec := httptest.NewRecorder()
	if p := serveRecovering(a.Middleware(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { t.Error("a request with no place was handled") })), rec, req); !isAbort(p) || rec.Code != http.StatusOK || rec.Body.Len() != 0 {
		t.Fatalf("panic %v, response %d with %d bytes; want the response abandoned (http.ErrAbortHandler), nothing written", p, rec.Code, rec.Body.Len())
	}
	a.shedMu.Lock()
	shed := a.shed
	a.shedMu.Unlock()
	if n := testutil.ToFloat64(a.count); n != 0 || shed != 0 {
		t.Fatalf("http_requests_shed_total %v, %d in the log's count; want 0: the client went away", n, shed)
	}
}

// A request whose body found the budget full, and whose client went away meanwhile, is not
// counted as shed, nor as shed for its body: the shed line's body_budget_full counts only the
// sheds it counts. (Counted before the client's going was seen, such a request made a later
// shed for want of a place read as one for the budget.)
func TestAClientGoneWhoseBodyFoundTheBudgetFullIsNotCounted(t *testing.T) {
	t.Parallel()
	log, logs := testenv.NewLogger(t)
	a, err := NewAdmission(log, prometheus.NewRegistry(), 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	a.bodyBudget = 10
	handler := a.Middleware(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { t.Error("a request with no place was handled") }))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	gone := httptest.NewRequestWithContext(ctx, http.MethodPost, "/", bytes.NewReader(make([]byte, 2*bodyReadSize)))
	if p := serveRecovering(handler, httptest.NewRecorder(), gone); !isAbort(p) {
		t.Fatalf("panic %v, want the response abandoned: the client went away", p)
	}
	// Then a request shed for want of a place, with no body.
	if !a.enter(context.Background()) {
		t.Fatal("the first request was not admitted")
	}
	rec := httptest.NewRecorder()
	handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	if rec.Code != http.StatusServiceUnavailable {
		t.Fatalf("a request with every place taken: %d, want 503", rec.Code)
	}
	a.logShed()
	if lines := logs.Lines("at capacity: requests shed"); len(lines) != 1 || !strings.Contains(lines[0], " shed=1 ") || !strings.Contains(lines[0], " body_budget_full=0") {
		t.Fatalf("lines about shedding %q, want one of a shed, none for the budget", lines)
	}
}

// A client that sends Expect: 100-continue while every place is taken, and none frees within
// the wait, gets its 503 without uploading its body: the server answers before it asks for the
// body, and closes the connection (the client must not send the body on it, nor reuse it).
// With a place free, the client is asked for its body, sends it, and is served on a connection
// it may reuse.
func TestExpectContinueIsShedBeforeItsUpload(t *testing.T) {
	t.Parallel()
	a := newAdmission(t, 1, 0)
	release := make(chan struct{})
	releaseAll := sync.OnceFunc(func() { close(release) })
	entered := make(chan struct{}, 1)
	srv := httptest.NewServer(a.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			entered <- struct{}{}
			<-release
		}
		readsItsBody(w, r)
	})))
	defer srv.Close()
	defer releaseAll() // before Close, which waits for the held request
	held := make(chan int, 1)
	go func() {
		resp, err := http.Post(srv.URL+"/hold", "application/json", strings.NewReader("{}"))
		if err != nil {
			held <- 0
			return
		}
		resp.Body.Close()
		held <- resp.StatusCode
	}()
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the request to hold the one place was not admitted within 5 s")
	}

	// Every place taken: headers declaring a megabyte, and not one byte of it.
	conn, br := dialRaw(t, srv)
	defer conn.Close() // before the server closes, which waits for a handler reading from it
	fmt.Fprintf(conn, "POST / HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n",
		srv.Listener.Addr(), MaxBufferedBody)
	resp := readRaw(t, br)
	if resp.StatusCode == http.StatusContinue {
		t.Fatal("100 Continue with every place taken: the client uploads its body only to be shed")
	}
	var p Problem
	_ = json.NewDecoder(resp.Body).Decode(&p)
	resp.Body.Close()
	retry, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Content-Type") != "application/problem+json" || p.Status != 503 || retry < 1 || retry > 3 {
		t.Fatalf("with every place taken: %d %s %+v, Retry-After %q; want a 503 problem with a Retry-After of 1 to 3 s",
			resp.StatusCode, resp.Header.Get("Content-Type"), p, resp.Header.Get("Retry-After"))
	}
	if !resp.Close {
		t.Error("the 503 keeps the connection: the client would have to send the body it declared on it")
	}
	// net/http closes at once a connection whose unread body is past what it would read to
	// reuse it (256 KiB).
	if _, err := br.ReadByte(); !errors.Is(err, io.EOF) {
		t.Errorf("after the 503: %v, want the connection closed by the server", err)
	}
	if n := testutil.ToFloat64(a.count); n != 1 {
		t.Errorf("http_requests_shed_total = %v, want 1", n)
	}

	releaseAll()
	if code := <-held; code != http.StatusCreated {
		t.Fatalf("the held request: %d, want 201", code)
	}
	// A place free: asked for its body, and served.
	conn2, br := dialRaw(t, srv)
	defer conn2.Close()
	fmt.Fprintf(conn2, "POST / HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: 7\r\nExpect: 100-continue\r\n\r\n", srv.Listener.Addr())
	if resp := readRaw(t, br); resp.StatusCode != http.StatusContinue {
		t.Fatalf("with a place free: %d before the body, want 100 Continue", resp.StatusCode)
	}
	fmt.Fprint(conn2, `{"a":1}`)
	resp = readRaw(t, br)
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || string(got) != "7" || resp.Close {
		t.Fatalf("with a place free, after its body: %d %q (close %v), want 201 and its 7 bytes read, the connection kept", resp.StatusCode, got, resp.Close)
	}
}

// dialRaw opens a TCP connection to srv whose reads give up after 5 s: a server that waits for
// a body the test never sends fails the test instead of hanging it.
func dialRaw(t *testing.T, srv *httptest.Server) (net.Conn, *bufio.Reader) {
	t.Helper()
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if err := conn.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		conn.Close()
		t.Fatal(err)
	}
	return conn, bufio.NewReader(conn)
}

// readRaw reads the next response off br, an interim 100 Continue too.
func readRaw(t *testing.T, br *bufio.Reader) *http.Response {
	t.Helper()
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("reading a response (reads give up after 5 s): %v", err)
	}
	return resp
}

// A request shed while the server drains, after Run's last line at the signal, is logged when
// the service closes its Base, once Serve has returned: the count is not lost.
func TestSheddingDuringTheDrainIsLogged(t *testing.T) {
	t.Parallel()
	log, logs := testenv.NewLogger(t)
	a, err := NewAdmission(log, prometheus.NewRegistry(), 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	hold, entered := make(chan struct{}), make(chan struct{}, 1)
	srv := NewServer("", a.Middleware(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		entered <- struct{}{}
		<-hold
		w.WriteHeader(http.StatusCreated)
	})))
	active := make(chan struct{}, 4)
	srv.ConnState = func(_ net.Conn, state http.ConnState) {
		if state == http.StateActive {
			active <- struct{}{}
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ranOut := make(chan struct{})
	run := Worker(func(ctx context.Context) error {
		defer close(ranOut)
		return a.Run(ctx)
	})
	signal, served := serveOn(t, log, srv, ln, Workers{Others: []Worker{run}})

	held := make(chan int, 1)
	go func() {
		resp, err := http.Post("http://"+ln.Addr().String(), "application/json", strings.NewReader("{}"))
		if err != nil {
			held <- 0
			return
		}
		resp.Body.Close()
		held <- resp.StatusCode
	}()
	within(t, entered, 5*time.Second, "the first request does not hold the one place")
	within(t, active, 5*time.Second, "the first request is not read")
	// A request whose body has not all arrived at the signal: it asks for its place after it.
	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(conn)
	if _, err := io.WriteString(conn, "POST / HTTP/1.1\r\nHost: order\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{"); err != nil {
		t.Fatal(err)
	}
	within(t, active, 5*time.Second, "the second request is not read")
	signal()
	within(t, ranOut, 5*time.Second, "Run did not stop at the signal")
	if _, err := io.WriteString(conn, "}"); err != nil {
		t.Fatal(err)
	}
	if resp := readRaw(t, br); resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("the request whose body arrived after the signal got %d, want 503: shed", resp.StatusCode)
	}
	close(hold)
	if status := within(t, held, 5*time.Second, "the first request was not answered"); status != http.StatusCreated {
		t.Fatalf("the first request got %d, want 201", status)
	}
	if err := within(t, served, 10*time.Second, "Serve did not return"); err != nil {
		t.Fatal(err)
	}
	(&Base{Admission: a, log: log, tracing: sdktrace.NewTracerProvider()}).Close()
	if lines := logs.Lines("at capacity: requests shed"); len(lines) != 1 || !strings.Contains(lines[0], "shed=1 during=shutdown ") {
		t.Fatalf("lines about shedding %q, want one of the request shed during the drain", lines)
	}
}

// After a spike cut the places to one, and no request came for longer than the longest
// Retry-After the shedder gives (the clients it turned away are back by then), a burst of ten
// at the idle service is served, none shed. Given back only by windows of finished requests,
// the places never came back to a service that went idle: the burst's first requests found
// the one place taken before any had finished, and seven or eight of the ten were shed.
func TestAnIdleServiceGetsItsPlacesBackForTheNextBurst(t *testing.T) {
	t.Parallel()
	const most = 14
	a := newAdmission(t, most, DefaultLatencyTarget)
	for range 4 { // the spike's windows, every place at work, 400 ms each: halved down to one
		runWindow(a, most, 400*time.Millisecond)
	}
	if n := a.Places(); n != 1 {
		t.Fatalf("after the spike's windows: %d places, want 1", n)
	}
	gate := make(chan struct{}) // the spike's admitted request holds its place until closed
	h := a.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-gate
		time.Sleep(5 * time.Millisecond) // the work
	}))
	var shed atomic.Int32
	burst := func() *sync.WaitGroup {
		shed.Store(0)
		var wg sync.WaitGroup
		for range 10 {
			wg.Go(func() {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
				if rec.Code == http.StatusServiceUnavailable {
					shed.Add(1)
				}
			})
		}
		return &wg
	}
	a.mu.Lock()
	a.pressed = time.Now() // the spike's windows just ended, however long the machine stalled since
	a.mu.Unlock()
	spike := burst()
	testenv.Eventually(t, 5*time.Second, func() bool { return shed.Load() == 9 }, "the spike: not 9 of 10 shed at one place")
	close(gate)
	spike.Wait()
	time.Sleep(quietPeriod + 250*time.Millisecond) // idle
	burst().Wait()
	if n := shed.Load(); n > 0 {
		t.Fatalf("a burst of 10 at the service idle since the spike: %d shed, want none (%d places of %d)", n, a.Places(), most)
	}
}

// Under pressure that goes on past quietPeriod the places stay cut: requests over the target
// one at a time (a database that slowed down), or every request finding the one place taken.
// Only the windows give places back then, one a window of requests within the target in force.
func TestPressureThatGoesOnKeepsTheLimitCut(t *testing.T) {
	t.Parallel()
	const most, target = 64, 10 * time.Millisecond
	for _, c := range []struct {
		situation string
		work      time.Duration // each request's
		holder    bool          // a request holds the one place throughout
	}{
		{"requests over the target, one at a time", 2 * target, false},
		{"every place taken", 0, true},
	} {
		t.Run(c.situation, func(t *testing.T) {
			t.Parallel()
			a := newAdmission(t, most, target)
			for range 6 { // halved down to one place
				runWindow(a, most, 40*target)
			}
			release := make(chan struct{})
			h := a.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/hold" {
					<-release
				}
				time.Sleep(c.work)
			}))
			serve := func(path string) int {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
				return rec.Code
			}
			held := make(chan int, 1)
			defer func() { // the holder, if any, returns before the test
				close(release)
				if c.holder {
					<-held
				}
			}()
			if c.holder {
				go func() { held <- serve("/hold") }()
				testenv.Eventually(t, 5*time.Second, func() bool {
					a.mu.Lock()
					defer a.mu.Unlock()
					return a.inUse == 1
				}, "the holder was not admitted")
			}
			for start := time.Now(); time.Since(start) < quietPeriod+500*time.Millisecond; {
				code := serve("/")
				if n := a.Places(); n == most || c.holder && code != http.StatusServiceUnavailable {
					t.Fatalf("%s after %s under pressure: %d, %d places of %d; want the cut kept",
						c.situation, time.Since(start).Round(time.Millisecond), code, n, most)
				}
				time.Sleep(target)
			}
		})
	}
}

// A request gives every place back only after quietPeriod without pressure, and with none at
// work: a shorter gap keeps the cut, and so do two at work (stuck in a stalled database, they
// show no latency until they end) or three. A single sign of pressure
// after a long quiet keeps it too: a latency over the configured target, though within the
// target in force raised by the floor; a request that found every place taken; a third at work.
func TestAQuietGapGivesThePlacesBackOnlyOnceLongEnough(t *testing.T) {
	t.Parallel()
	const most, target = 14, 25 * time.Millisecond
	for _, c := range []struct {
		situation string
		gap       time.Duration // since the last pressure
		atWork    int
		then      func(a *Admission) // a sign of pressure after the gap
		want      int
	}{
		{"a gap of quietPeriod", quietPeriod + 10*time.Millisecond, 0, nil, most},
		{"a gap shorter than quietPeriod", quietPeriod - time.Second, 0, nil, 5},
		{"two at work", time.Minute, 2, nil, 5},
		{"three at work", time.Minute, 3, nil, 5},
		{"a latency over the target, within the target in force", time.Minute, 0, func(a *Admission) {
			a.floor = 2 * target // the target in force is 4 × target
			a.observe(time.Now(), 3*target)
		}, 5},
		{"every place found taken", time.Minute, 0, func(a *Admission) {
			a.inUse = 5
			if a.enter(context.Background()) { // waits its 10 ms and is shed
				t.Fatal("admitted with every place taken")
			}
			a.inUse = 0
		}, 5},
		{"a third at work", time.Minute, 0, func(a *Admission) {
			a.inUse = 2
			a.take()
			a.inUse = 0
		}, 5},
	} {
		a := newAdmission(t, most, target)
		a.limit, a.pressed, a.inUse = 5, time.Now().Add(-c.gap), c.atWork
		if c.then != nil {
			c.then(a)
		}
		if !a.enter(context.Background()) {
			t.Fatalf("%s: a request with %d at work of 5 places shed", c.situation, c.atWork)
		}
		if n := a.Places(); n != c.want {
			t.Errorf("%s: %d places, want %d", c.situation, n, c.want)
		}
	}
}

// The gauge of the places (Places, read at each scrape) gives them back as a request would: a
// replica gone idle after a spike does not show its cut for hours. Not while one is at work.
func TestAnIdleReplicasGaugeShowsEveryPlace(t *testing.T) {
	t.Parallel()
	const most = 14
	a := newAdmission(t, most, 25*time.Millisecond)
	a.limit, a.pressed, a.inUse = 1, time.Now().Add(-quietPeriod-time.Second), 1
	if n := a.Places(); n != 1 {
		t.Fatalf("%d places with a request at work, want the cut's 1", n)
	}
	a.inUse = 0
	if n := a.Places(); n != most {
		t.Fatalf("%d places after %s idle, want %d", n, quietPeriod+time.Second, most)
	}
}

// quietPeriod outlasts every Retry-After the shedder gives: the clients a cut turned away come
// back to a service that has not yet given its places back, and count as pressure if they crowd.
func TestTheQuietPeriodOutlastsTheRetryAfter(t *testing.T) {
	t.Parallel()
	for range 100 {
		rec := httptest.NewRecorder()
		SetRetryAfter(rec)
		s, err := strconv.Atoi(rec.Header().Get("Retry-After"))
		if err != nil || time.Duration(s)*time.Second > quietPeriod {
			t.Fatalf("Retry-After %q, want at most the quiet period %s", rec.Header().Get("Retry-After"), quietPeriod)
		}
	}
}
