package platform

import (
	"context"
	"io"
	"log/slog"

	"go.opentelemetry.io/otel/trace"
)

// NewLogger returns a text or JSON slog logger at level, tagged with the service name. A line
// logged with a context that holds a span (log.InfoContext(ctx, …) while handling a request or
// a message) carries that span's trace_id and span_id.
func NewLogger(w io.Writer, service, format, level string) *slog.Logger {
	var lvl slog.Level
	_ = lvl.UnmarshalText([]byte(level))
	opts := &slog.HandlerOptions{Level: lvl}
	var h slog.Handler = slog.NewTextHandler(w, opts)
	if format == "json" {
		opts.ReplaceAttr = readableDuration
		h = slog.NewJSONHandler(w, opts)
	}
	return slog.New(traceIDs{h}).With("service", service)
}

// readableDuration writes a duration as the text handler does ("1.5s"), not as JSON's count of
// nanoseconds (1500000000), which nobody reading the logs can take in at a glance.
func readableDuration(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		return slog.String(a.Key, a.Value.Duration().String())
	}
	return a
}

// traceIDs adds the trace and span ids of the record's context to the record: the key from a
// service's log lines to its trace, and to the other services' lines about the same request.
type traceIDs struct{ slog.Handler }

func (h traceIDs) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r.AddAttrs(slog.String("trace_id", sc.TraceID().String()), slog.String("span_id", sc.SpanID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

func (h traceIDs) WithAttrs(attrs []slog.Attr) slog.Handler {
	return traceIDs{h.Handler.WithAttrs(attrs)}
}

func (h traceIDs) WithGroup(name string) slog.Handler { return traceIDs{h.Handler.WithGroup(name)} }
