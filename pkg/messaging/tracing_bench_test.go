package messaging

import (
	"context"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// BenchmarkPublishSpans is what tracing adds to the relay per message: the publish span, the
// header's context and the AMQP headers, for a batch of 500 rows enqueued in a trace, with an
// SDK provider (as the services run) and without one, next to rows enqueued outside any trace.
//
//	go test -run '^$' -bench PublishSpans ./pkg/messaging/
func BenchmarkPublishSpans(b *testing.B) {
	const traced = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	sdk := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.AlwaysSample())))
	b.Cleanup(func() { _ = sdk.Shutdown(context.Background()) })
	for _, c := range []struct {
		name        string
		provider    trace.TracerProvider
		traceParent string
	}{{"sdk", sdk, traced}, {"no provider", nil, traced}, {"untraced rows", sdk, ""}} {
		b.Run(c.name, func(b *testing.B) {
			relay := &Relay{tracer: newTracer(c.provider)}
			rows := make([]Message, 500)
			for i := range rows {
				m, err := NewMessage("OrderPlaced", map[string]int{"n": i})
				if err != nil {
					b.Fatal(err)
				}
				m.CorrelationID, m.TraceParent, m.Exchange = m.ID.String(), c.traceParent, "orders"
				rows[i] = m
			}
			msgs := make([]Message, len(rows))
			verdicts := make([]error, len(rows))
			b.ReportAllocs()
			for b.Loop() {
				copy(msgs, rows)
				endPublishSpans(relay.startPublishSpans(context.Background(), msgs), verdicts)
				for _, m := range msgs {
					_ = toPublishing(m, "order")
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(rows)), "ns/msg")
		})
	}
}
