package platform

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"gorm.io/gorm"
)

// Problem is an RFC 9457 problem detail, the body of every error response.
type Problem struct {
	Type   string       `json:"type"`
	Title  string       `json:"title"`
	Status int          `json:"status"`
	Detail string       `json:"detail,omitempty"`
	Errors []FieldError `json:"errors,omitempty"`
}

// FieldError names one invalid field of a request.
type FieldError struct {
	Field   string `json:"field"`
	Message string `json:"message"`
}

// WriteProblem writes an application/problem+json response.
func WriteProblem(w http.ResponseWriter, status int, detail string, fields ...FieldError) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(Problem{
		Type: "about:blank", Title: http.StatusText(status), Status: status, Detail: detail, Errors: fields,
	})
}

// WriteJSON writes v as a JSON response.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// ReadyFunc reports whether the service can do its job now: nil, or why not, best as a
// *NotReadyError.
type ReadyFunc func(ctx context.Context) error

// NotReadyError is why a service is not ready: Reason, fixed words that /readyz answers, and
// Err, the cause, which only the log shows (its text is the driver's, and internal).
type NotReadyError struct {
	Reason string
	Err    error
}

func (e *NotReadyError) Error() string {
	if e.Err == nil {
		return e.Reason
	}
	return e.Reason + ": " + e.Err.Error()
}

func (e *NotReadyError) Unwrap() error { return e.Err }

// readiness answers /readyz and logs each change of the answer once, with its cause: probes
// come every few seconds, and a line per probe would bury the one that matters.
type readiness struct {
	ready ReadyFunc
	log   *slog.Logger
	mu    sync.Mutex
	// reason is why the service was not ready at the last probe, "" if it was.
	reason string
}

func (r *readiness) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	err := r.ready(req.Context())
	reason, cause := "", err
	if err != nil {
		reason = "not ready"
		var nr *NotReadyError
		if errors.As(err, &nr) {
			reason, cause = nr.Reason, nr.Err
		}
	}
	r.mu.Lock()
	if reason != r.reason {
		r.reason = reason
		switch {
		case err == nil:
			r.log.InfoContext(req.Context(), "ready again")
		case cause == nil:
			r.log.WarnContext(req.Context(), "not ready", "reason", reason)
		default:
			r.log.WarnContext(req.Context(), "not ready", "reason", reason, "error", cause)
		}
	}
	r.mu.Unlock()
	if err != nil {
		WriteProblem(w, http.StatusServiceUnavailable, reason)
		return
	}
	WriteJSON(w, http.StatusOK, map[string]string{"status": "ready"})
}

// readyTimeout bounds the readiness check a scrape runs, well inside Prometheus's scrape
// timeout (10 s by default).
const readyTimeout = 2 * time.Second

// maxScrapesInFlight bounds the scrapes of /metrics at work at once, each of which pings the
// database over the connection /readyz uses: enough for a pair of Prometheus servers and a
// person or two; promhttp answers the others 503 at once (in text/plain, its own).
const maxScrapesInFlight = 4

// scrapeTimeout bounds a scrape's answer, past the collectors' own bounds (readyTimeout, the
// backlog query's) and within Prometheus's scrape timeout (10 s by default). A gather that
// outlasts it holds its place in maxScrapesInFlight until done.
const scrapeTimeout = 5 * time.Second

// readyGauge is service_ready, what /readyz would answer at each scrape: 1 ready, 0 not. A
// service that is up but not ready still answers its scrape, so up alone never shows it.
func readyGauge(ready ReadyFunc) prometheus.GaugeFunc {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "service_ready", Help: "1 while the service is ready (what /readyz answers), 0 while it is not.",
	}, func() float64 {
		ctx, cancel := context.WithTimeout(context.Background(), readyTimeout)
		defer cancel()
		if ready(ctx) != nil {
			return 0
		}
		return 1
	})
}

// NewRouter returns a chi router with tracing, recovery, request metrics, problem+json for
// unknown routes, and the operational endpoints: /healthz (the process runs), /readyz (ready
// returns nil; otherwise a 503 that gives the reason, not the cause, see NotReadyError) and
// /metrics (reg, in Prometheus text format, with service_ready registered on it). Every request runs in a server
// span that continues the W3C trace context the request came with (its traceparent header,
// without baggage: see edgeTraceContext), or starts a trace: the handler's context carries it.
func NewRouter(log *slog.Logger, reg *prometheus.Registry, ready ReadyFunc) chi.Router {
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "http_requests_total", Help: "HTTP requests by route, method and status code.",
	}, []string{"route", "method", "code"})
	duration := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "http_request_duration_seconds", Help: "HTTP request latency by route.",
		Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
	}, []string{"route"})
	reg.MustRegister(requests, duration, readyGauge(ready))

	tracer := otel.Tracer(tracerName)
	r := chi.NewRouter()
	r.Use(func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			start := time.Now()
			// Named once routed (describeServerSpan): the method alone is the client's to choose.
			ctx, span := tracer.Start(edgeTraceContext(req), "HTTP", serverSpan)
			defer span.End()
			req = req.WithContext(ctx)
			ww := middleware.NewWrapResponseWriter(w, req.ProtoMajor)
			// Deferred before the recovery, so they run after it, also when it panics again.
			defer func() { describeServerSpan(span, req, sentStatus(ww, req)) }()
			defer func() {
				route := routeLabel(req)
				requests.WithLabelValues(route, methodLabel(req.Method), strconv.Itoa(sentStatus(ww, req))).Inc()
				duration.WithLabelValues(route).Observe(time.Since(start).Seconds())
			}()
			defer func() {
				if p := recover(); p != nil {
					if err, ok := p.(error); ok && errors.Is(err, http.ErrAbortHandler) {
						panic(p)
					}
					log.ErrorContext(ctx, "handler panicked", "panic", p, "method", req.Method, "path", req.URL.Path)
					if ww.Status() != 0 {
						// Too late for a problem response: abort, so the client sees a broken
						// response rather than a truncated 200.
						panic(http.ErrAbortHandler)
					}
					WriteProblem(ww, http.StatusInternalServerError, "internal error")
				}
			}()
			next.ServeHTTP(ww, req)
		})
	})
	// HEAD is GET without its body (RFC 9110 requires it of a general-purpose server): uptime
	// checkers probe with it.
	r.Use(middleware.GetHead)
	r.NotFound(func(w http.ResponseWriter, _ *http.Request) { WriteProblem(w, http.StatusNotFound, "no such resource") })
	r.MethodNotAllowed(func(w http.ResponseWriter, req *http.Request) {
		// RFC 9110 wants the methods in Allow; chi does not pass them to a handler of one's own.
		w.Header().Set("Allow", strings.Join(allowedMethods(r, req), ", "))
		WriteProblem(w, http.StatusMethodNotAllowed, "method not allowed here")
	})
	r.Get("/healthz", healthz)
	r.Method(http.MethodGet, "/readyz", &readiness{ready: ready, log: log})
	r.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{MaxRequestsInFlight: maxScrapesInFlight, Timeout: scrapeTimeout}))
	return r
}

// healthz answers /healthz: the process runs.
func healthz(w http.ResponseWriter, _ *http.Request) {
	WriteJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// routedMethods are the methods a route may have, in the order Allow lists them.
var routedMethods = []string{
	http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
	http.MethodDelete, http.MethodOptions, http.MethodConnect, http.MethodTrace,
}

// allowedMethods are the methods routes has a route for at req's path, and HEAD where GET is
// (middleware.GetHead). routes is the
// top-level router, which finds routes in its subrouters as well, given the whole path.
func allowedMethods(routes chi.Routes, req *http.Request) []string {
	path := req.URL.RawPath
	if path == "" {
		path = req.URL.Path
	}
	var allowed []string
	for _, m := range routedMethods {
		if routes.Match(chi.NewRouteContext(), m, path) || m == http.MethodHead && slices.Contains(allowed, http.MethodGet) {
			allowed = append(allowed, m)
		}
	}
	return allowed
}

// maxEdgeTraceState is the longest tracestate a client's request may bring in: the W3C Trace
// Context asks a tracer to pass on at least 512 characters, and past them a client's own
// entries would ride in every message its request leads to.
const maxEdgeTraceState = 512

// edgeTraceContext is req's context with the trace context its client sent, read at the public
// edge: its traceparent, and its tracestate unless longer than maxEdgeTraceState. Never its
// baggage, which the global propagator would read and the outbox store with every message:
// the client's data, not ours, carried downstream as if it were. Between the services, trace
// context and baggage travel with the messages, as pkg/messaging propagates them.
func edgeTraceContext(req *http.Request) context.Context {
	ctx := propagation.TraceContext{}.Extract(req.Context(), propagation.HeaderCarrier(req.Header))
	sc := trace.SpanContextFromContext(ctx)
	if len(sc.TraceState().String()) > maxEdgeTraceState {
		ctx = trace.ContextWithRemoteSpanContext(ctx, sc.WithTraceState(trace.TraceState{}))
	}
	return ctx
}

// tracerName is the instrumentation scope of the platform's spans.
const tracerName = "github.com/outboxkit/outbox-inbox/internal/platform"

var serverSpan = trace.WithSpanKind(trace.SpanKindServer)

// routeLabel is the request's route pattern (/orders/{id}), known once chi has routed it, or
// "unmatched".
func routeLabel(req *http.Request) string {
	if route := chi.RouteContext(req.Context()).RoutePattern(); route != "" {
		return route
	}
	return "unmatched"
}

// describeServerSpan names a request's span after its route, as the HTTP semantic conventions
// do ("POST /orders"), and records its outcome: a 5xx is an error of the server's.
func describeServerSpan(span trace.Span, req *http.Request, status int) {
	name := methodLabel(req.Method)
	attrs := []attribute.KeyValue{semconv.HTTPRequestMethodKey.String(name), semconv.HTTPResponseStatusCode(status), semconv.URLPath(req.URL.Path)}
	if name == "other" {
		name, attrs[0] = "HTTP", semconv.HTTPRequestMethodOther
	}
	if route := chi.RouteContext(req.Context()).RoutePattern(); route != "" {
		name += " " + route
		attrs = append(attrs, semconv.HTTPRoute(route))
	}
	span.SetName(name)
	span.SetAttributes(attrs...)
	if status >= 500 {
		span.SetStatus(codes.Error, http.StatusText(status))
	}
}

// clientGone is the status counted for a request whose client went away before it was
// answered, and to which nothing was written (AbandonResponse): nginx's 499, "client closed
// request".
const clientGone = 499

// sentStatus is the status of w's response to req: the one written; with nothing written, the
// 200 net/http answers, or clientGone if req's client went away (nobody was answered).
func sentStatus(w middleware.WrapResponseWriter, req *http.Request) int {
	switch {
	case w.Status() != 0:
		return w.Status()
	case req.Context().Err() != nil:
		return clientGone
	}
	return http.StatusOK
}

// ReadHeaderTimeout is how long a client may take to send its request headers.
const ReadHeaderTimeout = 5 * time.Second

// NewServer returns an HTTP server with every timeout set: slow or stalled clients (slowloris)
// cannot hold connections open.
func NewServer(addr string, h http.Handler) *http.Server {
	return &http.Server{
		Addr:              addr,
		Handler:           h,
		ReadHeaderTimeout: ReadHeaderTimeout,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      15 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
}

// ParseUUID parses a UUID in its canonical text only, 8-4-4-4-12 hex digits in either case
// (RFC 9562, section 4): uuid.Parse also takes 32 bare digits, urn:uuid: and, at 38
// characters, any two around the 36 (it never checks they are braces), so x<id>y would name
// the order <id>.
func ParseUUID(s string) (uuid.UUID, error) {
	if len(s) != 36 {
		return uuid.Nil, fmt.Errorf("parse UUID: %d characters, not 36", len(s))
	}
	id, err := uuid.Parse(s)
	if err != nil {
		return uuid.Nil, fmt.Errorf("parse UUID: %w", err)
	}
	return id, nil
}

// ListByOrder serves a list endpoint such as GET /invoices: ?order_id= (a UUID) selects one
// order's items, otherwise the most recent come first; ?limit= caps them (default 100, at most
// 1000). A parameter given empty is a 400, not a missing one: a script whose variable is unset
// must not get every order's items for one order's. So is one given twice, a query that does
// not parse, of which url.Values would keep only the pairs it could read, and any other
// parameter: a misspelt filter (?orderId=) would otherwise list every order's items.
func ListByOrder[T any](log *slog.Logger, list func(ctx context.Context, orderID *uuid.UUID, limit int) ([]T, error)) http.HandlerFunc {
	var failures FailureLog
	return func(w http.ResponseWriter, r *http.Request) {
		q, err := url.ParseQuery(r.URL.RawQuery)
		if err != nil {
			WriteProblem(w, http.StatusBadRequest, "the query string does not parse: separate parameters with & and percent-encode reserved characters")
			return
		}
		// Sorted, so that a query with several unknown names always gets the same answer.
		for _, name := range slices.Sorted(maps.Keys(q)) {
			if name != "order_id" && name != "limit" {
				WriteProblem(w, http.StatusBadRequest, fmt.Sprintf("unknown query parameter %q: only order_id and limit are accepted", name))
				return
			}
		}
		for _, name := range []string{"order_id", "limit"} {
			if len(q[name]) > 1 {
				WriteProblem(w, http.StatusBadRequest, name+" is given more than once")
				return
			}
		}
		var orderID *uuid.UUID
		if q.Has("order_id") {
			id, err := ParseUUID(q.Get("order_id"))
			if err != nil {
				WriteProblem(w, http.StatusBadRequest, "order_id must be a UUID (8-4-4-4-12 hex digits)")
				return
			}
			orderID = &id
		}
		limit := 100
		if q.Has("limit") {
			n, err := strconv.Atoi(q.Get("limit"))
			if err != nil || n < 1 || n > 1000 {
				WriteProblem(w, http.StatusBadRequest, "limit must be an integer from 1 to 1000")
				return
			}
			limit = n
		}
		ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
		defer cancel()
		items, err := list(ctx, orderID, limit)
		if err != nil {
			failures.Unavailable(w, r, log, "list", "the database is unavailable; try again", err, "path", r.URL.Path)
			return
		}
		WriteJSON(w, http.StatusOK, items)
	}
}

// ListRecent loads rows of T (a table with order_id, created_at and id columns), newest
// first: those of one order, or all when orderID is nil.
func ListRecent[T any](ctx context.Context, db *gorm.DB, orderID *uuid.UUID, limit int) ([]T, error) {
	q := db.WithContext(ctx).Order("created_at DESC, id DESC").Limit(limit)
	if orderID != nil {
		q = q.Where("order_id = ?", *orderID)
	}
	rows := []T{}
	if err := q.Find(&rows).Error; err != nil {
		return nil, fmt.Errorf("list: %w", err)
	}
	return rows, nil
}

// methodLabel keeps the metric's label set bounded whatever methods clients invent.
func methodLabel(m string) string {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete, http.MethodOptions:
		return m
	}
	return "other"
}
