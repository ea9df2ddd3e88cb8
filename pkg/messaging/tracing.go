package messaging

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// A message's trace context travels as W3C Trace Context: in the outbox row's trace_parent and
// trace_state columns, then in the AMQP headers of the same names as HTTP's.
const (
	traceParentHeader = "traceparent"
	traceStateHeader  = "tracestate"
)

// tracerName is the instrumentation scope of the package's spans.
const tracerName = "github.com/outboxkit/outbox-inbox/pkg/messaging"

// w3c reads and writes trace contexts whatever propagator the process installed globally
// (none, by default): the wire format is part of the messages' contract, not a setting.
var w3c propagation.TraceContext

// newTracer returns the package's tracer from tp, or from the global provider when tp is nil.
// The global one is a no-op until the process installs an SDK, and still passes trace
// contexts on: a service without tracing keeps the traces of those it talks to whole.
func newTracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(tracerName)
}

// traceCarrier holds one message's trace context for the propagator, without a map per
// message.
type traceCarrier struct{ parent, state string }

func (c *traceCarrier) Get(key string) string {
	switch key {
	case traceParentHeader:
		return c.parent
	case traceStateHeader:
		return c.state
	}
	return ""
}

func (c *traceCarrier) Set(key, value string) {
	switch key {
	case traceParentHeader:
		c.parent = value
	case traceStateHeader:
		c.state = value
	}
}

func (c *traceCarrier) Keys() []string { return []string{traceParentHeader, traceStateHeader} }

// traceOf returns the W3C trace context of the span in ctx, or "" when there is none.
func traceOf(ctx context.Context) (parent, state string) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return "", ""
	}
	var c traceCarrier
	w3c.Inject(ctx, &c)
	return c.parent, c.state
}

// withTrace returns ctx with the trace context parent and state as its remote parent span;
// ctx itself when parent is empty or invalid.
func withTrace(ctx context.Context, parent, state string) context.Context {
	if parent == "" {
		return ctx
	}
	return w3c.Extract(ctx, &traceCarrier{parent: parent, state: state})
}

// traced returns ctx carrying the message's trace context, if it has one, as the remote
// parent: the handler's log lines, and whatever it enqueues, then belong to the message's
// trace.
func (m Message) traced(ctx context.Context) context.Context {
	return withTrace(ctx, m.TraceParent, m.TraceState)
}

// endSpan ends span, marking it failed when err is not nil.
func endSpan(span trace.Span, err error) {
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// messageAttributes are the attributes of one message on its span. They are only built for a
// span that records: the id's string costs an allocation.
func messageAttributes(span trace.Span, m Message) {
	if span.IsRecording() {
		span.SetAttributes(semconv.MessagingMessageID(m.ID.String()), semconv.MessagingRabbitMQDestinationRoutingKey(m.routingKey()))
	}
}
