package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/gormdriver"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/messagingtest"
)

// The notification keeps the trace of the message that recorded it; its delivery, later and
// from the row, is a span of that trace, and so are the delivery's log lines.
func TestDeliveryContinuesTheTraceThatRecordedTheNotification(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.smtp.Start()
	spans := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	logs := &testenv.Logs{}
	log := platform.NewLogger(logs, "notification", "text", "debug")
	drv, err := gormdriver.New(b.db)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := messaging.NewSubscription(drv, messaging.SubscriptionConfig{Name: Consumer, URL: "amqp://unused", Logger: log, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	send := newSender(b.db, b.send.deliverer, DefaultConcurrency, 10*time.Second, log)
	send.tracer = tp.Tracer("test")
	if err := (notifier{log: log, domain: "customers.example"}).subscribe(sub); err != nil {
		t.Fatal(err)
	}

	ctx, upstream := tp.Tracer("test").Start(context.Background(), "publish invoicing")
	orderID := uuid.New()
	if _, err := messagingtest.Deliver(ctx, sub, invoiceIssued(t, orderID, "c-7")); err != nil {
		t.Fatal(err)
	}
	upstream.End()
	if delivered, err := send.deliverOne(context.Background()); err != nil || !delivered {
		t.Fatalf("deliverOne = %v, %v; want the notice delivered", delivered, err)
	}

	tid := upstream.SpanContext().TraceID()
	byName := map[string]tracetest.SpanStub{}
	for _, s := range spans.GetSpans() {
		if s.SpanContext.TraceID() == tid {
			byName[s.Name] = s
		}
	}
	process, deliver := byName["process "+Consumer], byName["deliver notification"]
	if process.Parent.SpanID() != upstream.SpanContext().SpanID() || deliver.Parent.SpanID() != process.SpanContext.SpanID() ||
		deliver.SpanKind != trace.SpanKindClient {
		t.Fatalf("spans of trace %s: %+v; want process a child of the upstream span, and deliver a client span child of process", tid, byName)
	}
	n := b.kinds(t, orderID)[KindInvoice]
	if want := fmt.Sprintf("00-%s-%s-01", tid, process.SpanContext.SpanID()); n.TraceParent != want {
		t.Fatalf("the notification row keeps trace_parent %q, want the process span's %q", n.TraceParent, want)
	}
	for _, line := range []struct{ msg, span string }{
		{`msg="notification recorded"`, process.SpanContext.SpanID().String()},
		{`msg="notification delivered"`, deliver.SpanContext.SpanID().String()},
	} {
		if got := logs.Lines(line.msg, "notification_id="+n.ID.String(), "trace_id="+tid.String(), "span_id="+line.span); len(got) != 1 {
			t.Errorf("%d %s lines with trace_id=%s span_id=%s, want 1:\n%s", len(got), line.msg, tid, line.span, logs.String())
		}
	}
}
