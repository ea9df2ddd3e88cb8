package messaging

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// A message's W3C trace context travels in the outbox row's trace_parent and trace_state
// columns, then in the AMQP headers of the same names as HTTP's; whatever else the propagator
// writes (baggage, B3) travels in the row's headers, then as AMQP headers of its own.
const (
	traceParentHeader = "traceparent"
	traceStateHeader  = "tracestate"
)

// tracerName is the instrumentation scope of the package's spans.
const tracerName = "github.com/outboxkit/outbox-inbox/pkg/messaging"

// newTracer returns the package's tracer from tp, or from the global provider when tp is nil.
// The global one is a no-op until the process installs an SDK, and still passes trace
// contexts on: a service without tracing keeps the traces of those it talks to whole.
func newTracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(tracerName)
}

// globalPropagator is the process's propagator (otel.SetTextMapPropagator); a no-op until one
// is installed.
func globalPropagator() propagation.TextMapPropagator { return otel.GetTextMapPropagator() }

// propagatorOr returns p, or the global propagator when p is nil.
func propagatorOr(p propagation.TextMapPropagator) propagation.TextMapPropagator {
	if p == nil {
		return globalPropagator()
	}
	return p
}

// traceCarrier holds one message's trace context for a propagator, without a map for the
// usual two fields.
type traceCarrier struct {
	parent, state string
	other         map[string]string
}

func (c *traceCarrier) Get(key string) string {
	switch key {
	case traceParentHeader:
		return c.parent
	case traceStateHeader:
		return c.state
	}
	return c.other[key]
}

func (c *traceCarrier) Set(key, value string) {
	switch key {
	case traceParentHeader:
		c.parent = value
	case traceStateHeader:
		c.state = value
	default:
		if c.other == nil {
			c.other = map[string]string{}
		}
		c.other[key] = value
	}
}

func (c *traceCarrier) Keys() []string {
	keys := make([]string, 0, 2+len(c.other))
	if c.parent != "" {
		keys = append(keys, traceParentHeader)
	}
	if c.state != "" {
		keys = append(keys, traceStateHeader)
	}
	for k := range c.other {
		keys = append(keys, k)
	}
	return keys
}

// injectTrace writes ctx's trace context into c with p.
func injectTrace(ctx context.Context, p propagation.TextMapPropagator, c *traceCarrier) {
	p.Inject(ctx, c)
}

// traced returns ctx carrying the message's trace context, read with p, as the remote parent:
// the handler's log lines, and whatever it enqueues, then belong to the message's trace.
func (m Message) traced(ctx context.Context, p propagation.TextMapPropagator) context.Context {
	if m.TraceParent == "" && len(m.Headers) == 0 {
		return ctx
	}
	return p.Extract(ctx, &traceCarrier{parent: m.TraceParent, state: m.TraceState, other: m.Headers})
}

// WithTrace returns m carrying ctx's trace context, written by the process's global
// propagator: for messages that one [Enqueue] saves for several causes (a [BatchHandler]'s),
// each with the context of the message that caused it. [Enqueue] gives a message without a
// trace context its own ctx's.
func (m Message) WithTrace(ctx context.Context) Message {
	m.withTraceOf(ctx, globalPropagator())
	return m
}

// withTrace returns m with the trace context c, its other keys added to m's own headers.
func (m Message) withTrace(c traceCarrier) Message {
	m.TraceParent, m.TraceState = c.parent, c.state
	if len(c.other) > 0 {
		headers := make(map[string]string, len(m.Headers)+len(c.other))
		for k, v := range m.Headers {
			headers[k] = v
		}
		for k, v := range c.other {
			headers[k] = v
		}
		m.Headers = headers
	}
	return m
}

// withTraceOf sets m's trace context to ctx's, written with p: a relay's publish span becomes
// the parent of the consumers' spans.
func (m *Message) withTraceOf(ctx context.Context, p propagation.TextMapPropagator) {
	c := traceCarrier{other: make(map[string]string, len(m.Headers))}
	for k, v := range m.Headers {
		c.other[k] = v
	}
	injectTrace(ctx, p, &c)
	m.TraceParent, m.TraceState, m.Headers = c.parent, c.state, c.other
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
