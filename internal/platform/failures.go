package platform

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// failureLogInterval is how often a FailureLog writes a line of one message at most.
const failureLogInterval = 10 * time.Second

// FailureLog logs failures once per interval at most for each message (each operation's
// "place order failed", say), each line with how many of that message were held back in the
// interval after the line before: during an outage every request fails alike, and a line each
// would be thousands a second saying the same. The zero value is ready.
type FailureLog struct {
	mu    sync.Mutex
	kinds map[string]*failureKind
}

// failureKind is one message's state: when its next line may be written, and how many were
// held back since its last.
type failureKind struct {
	next time.Time
	held int
}

// Log logs msg and err at level, with attrs and the count held back since msg's last line,
// unless that line was written less than the interval ago: then it only counts this one.
func (f *FailureLog) Log(ctx context.Context, log *slog.Logger, level slog.Level, msg string, err error, attrs ...any) {
	f.mu.Lock()
	if f.kinds == nil {
		f.kinds = map[string]*failureKind{}
	}
	k := f.kinds[msg]
	if k == nil {
		k = &failureKind{}
		f.kinds[msg] = k
	}
	now := time.Now()
	if now.Before(k.next) {
		k.held++
		f.mu.Unlock()
		return
	}
	held := k.held
	k.next, k.held = now.Add(failureLogInterval), 0
	f.mu.Unlock()
	log.Log(ctx, level, msg, append(attrs, "error", err, "held_back_after_last_line", held)...)
}

// Unavailable answers a request whose database work failed with err: a 503 with detail and a
// spread Retry-After, the failure logged as "<op> failed"; or, if the request's client went
// away, no answer (AbandonResponse), logged at WARN as "<op> abandoned: its client went away",
// so that a stalled database whose clients give up first still shows.
func (f *FailureLog) Unavailable(w http.ResponseWriter, r *http.Request, log *slog.Logger, op, detail string, err error, attrs ...any) {
	if r.Context().Err() != nil {
		f.Log(r.Context(), log, slog.LevelWarn, op+" abandoned: its client went away", err, attrs...)
		AbandonResponse()
	}
	f.Log(r.Context(), log, slog.LevelError, op+" failed", err, attrs...)
	SetRetryAfter(w)
	WriteProblem(w, http.StatusServiceUnavailable, detail)
}

// SetRetryAfter sets a 503's Retry-After to one to three seconds, drawn at random, so that the
// clients it turns away come back spread out rather than all in the same second.
func SetRetryAfter(w http.ResponseWriter) {
	w.Header().Set("Retry-After", strconv.Itoa(1+rand.IntN(3)))
}

// AbandonResponse ends a request whose client went away (its context ended) without an answer:
// it aborts the response, and net/http closes the connection. A handler that returned having
// written nothing would have net/http send a 200, which a client that only half-closed its
// connection can still read, as success. The request is counted with status 499.
func AbandonResponse() { panic(http.ErrAbortHandler) }
