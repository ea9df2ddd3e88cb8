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

// failureLogInterval is how often a FailureLog writes a line at most.
const failureLogInterval = 10 * time.Second

// FailureLog logs the failures of a kind of request (the database's, say) once per interval at
// most, each line with how many failed since the last: during an outage every request fails
// alike, and a line each would be thousands a second saying the same. The zero value is ready.
type FailureLog struct {
	mu   sync.Mutex
	next time.Time
	held int
}

// Error logs msg and err at ERROR, with attrs and the failures held back since the last line,
// unless a line was written less than the interval ago: then it only counts this one.
func (f *FailureLog) Error(ctx context.Context, log *slog.Logger, msg string, err error, attrs ...any) {
	f.mu.Lock()
	now := time.Now()
	if now.Before(f.next) {
		f.held++
		f.mu.Unlock()
		return
	}
	held := f.held
	f.next, f.held = now.Add(failureLogInterval), 0
	f.mu.Unlock()
	log.ErrorContext(ctx, msg, append(attrs, "error", err, "failed_since_last_line", held)...)
}

// SetRetryAfter sets a 503's Retry-After to one to three seconds, drawn at random, so that the
// clients it turns away come back spread out rather than all in the same second.
func SetRetryAfter(w http.ResponseWriter) {
	w.Header().Set("Retry-After", strconv.Itoa(1+rand.IntN(3)))
}
