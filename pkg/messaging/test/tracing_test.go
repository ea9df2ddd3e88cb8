package test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// tracing is a test's own tracer provider, keeping every ended span in memory.
type tracing struct {
	tp    *sdktrace.TracerProvider
	spans *tracetest.InMemoryExporter
}

func newTracing(t *testing.T) *tracing {
	t.Helper()
	spans := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans), sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.AlwaysSample())))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return &tracing{tp: tp, spans: spans}
}

// span waits for the span named name in trace tid to end, and returns it, failing t unless
// there is exactly one. (A consumer's span ends after its commit, a moment after the work is
// visible.)
func (tr *tracing) span(t *testing.T, tid trace.TraceID, name string) tracetest.SpanStub {
	t.Helper()
	var found []tracetest.SpanStub
	testenv.Eventually(t, 5*time.Second, func() bool {
		found = found[:0]
		for _, s := range tr.spans.GetSpans() {
			if s.SpanContext.TraceID() == tid && s.Name == name {
				found = append(found, s)
			}
		}
		return len(found) > 0
	}, "no span %q in trace %s", name, tid)
	if len(found) != 1 {
		t.Fatalf("%d spans %q in trace %s, want 1 (all: %s)", len(found), name, tid, tr.names())
	}
	return found[0]
}

// wantAttributes fails t unless span has each of want's attributes, with its value.
func wantAttributes(t *testing.T, span tracetest.SpanStub, want map[string]string) {
	t.Helper()
	got := map[string]string{}
	for _, a := range span.Attributes {
		got[string(a.Key)] = a.Value.String()
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("span %q: attribute %s = %q, want %q (all: %v)", span.Name, k, got[k], v, got)
		}
	}
}

func (tr *tracing) names() string {
	var names []string
	for _, s := range tr.spans.GetSpans() {
		names = append(names, fmt.Sprintf("%s[%s parent %s]", s.Name, s.SpanContext.SpanID(), s.Parent.SpanID()))
	}
	return strings.Join(names, ", ")
}

// traceIDs adds the trace id of a line's context to the line, as the services' logger does:
// the library's part is to log with the right context.
type traceIDs struct{ slog.Handler }

func (h traceIDs) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r.AddAttrs(slog.String("trace_id", sc.TraceID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

func (h traceIDs) WithAttrs(attrs []slog.Attr) slog.Handler {
	return traceIDs{h.Handler.WithAttrs(attrs)}
}
func (h traceIDs) WithGroup(name string) slog.Handler { return traceIDs{h.Handler.WithGroup(name)} }

// traceParent formats a span context as a W3C traceparent, independently of the code under test.
func traceParent(sc trace.SpanContext) string {
	return fmt.Sprintf("00-%s-%s-%s", sc.TraceID(), sc.SpanID(), sc.TraceFlags())
}

// storedTrace returns the trace_parent column of outbox row id.
func storedTrace(t *testing.T, db *gorm.DB, id uuid.UUID) string {
	t.Helper()
	var tp string
	if err := db.Raw("SELECT trace_parent FROM outbox_messages WHERE id = ?", id).Scan(&tp).Error; err != nil {
		t.Fatal(err)
	}
	return tp
}

// spy declares a queue that takes a copy of exchange's messages with routingKey, to read their
// headers while the subscription consumes its own copies.
func spy(t *testing.T, exchange, routingKey string) string {
	t.Helper()
	q := testenv.UniqueName("spy")
	testenv.CleanupBroker(t, []string{q, messaging.DeadLetterQueue(q)}, nil)
	declare(t, queueTopology(exchange, q, routingKey))
	return q
}

// handledContexts records the span context each message's handler saw, by message id.
type handledContexts struct {
	mu   sync.Mutex
	seen map[uuid.UUID]trace.SpanContext
}

func (h *handledContexts) record(ctx context.Context, msg messaging.Message) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.seen == nil {
		h.seen = map[uuid.UUID]trace.SpanContext{}
	}
	h.seen[msg.ID] = trace.SpanContextFromContext(ctx)
}

func (h *handledContexts) get(id uuid.UUID) (trace.SpanContext, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	sc, ok := h.seen[id]
	return sc, ok
}

// One trace follows a message: the span that enqueued it, the relay's publish span (its child,
// and the message's traceparent header), the consumer's span (the publish span's child, in the
// handler's context), and what the handler enqueues (stored with the consumer span). A
// redelivery is logged in the same trace.
func TestTraceFollowsAMessageFromEnqueueToTheConsumersOwnOutbox(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	tr := newTracing(t)
	log := slog.New(traceIDs{b.log.Handler()})
	followUps := map[uuid.UUID]uuid.UUID{} // handled message → the message its handler enqueued
	var mu sync.Mutex
	var seen handledContexts
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) { c.TracerProvider, c.Logger = tr.tp, log })
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		seen.record(ctx, msg)
		next, err := messaging.NewMessage("FollowUp", p)
		if err != nil {
			return err
		}
		mu.Lock()
		followUps[msg.ID] = next.ID
		mu.Unlock()
		return messaging.Enqueue(ctx, b.drv, tx, next)
	}))
	ch := testenv.Channel(t)
	declareSubscription(t, s)
	headers := spy(t, b.exchange, b.placed.Type)

	ctx, request := tr.tp.Tracer("test").Start(context.Background(), "request")
	msg, err := b.placed.Message(placed{OrderID: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(ctx, b.drv, tx, msg) }); err != nil {
		t.Fatal(err)
	}
	request.End()
	tid := request.SpanContext().TraceID()
	if got, want := storedTrace(t, b.db.DB, msg.ID), traceParent(request.SpanContext()); got != want {
		t.Fatalf("outbox row trace_parent = %q, want the enqueuing span's %q", got, want)
	}

	relay := b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) { c.TracerProvider, c.Logger = tr.tp, log })
	if res, err := relay.ProcessBatch(context.Background()); err != nil || res.Sent != 1 {
		t.Fatalf("relay batch = %+v, %v; want 1 sent", res, err)
	}
	publish := tr.span(t, tid, "publish "+b.exchange)
	if publish.Parent.SpanID() != request.SpanContext().SpanID() || publish.SpanKind != trace.SpanKindProducer {
		t.Fatalf("publish span: parent %s kind %s, want a producer span child of the request %s", publish.Parent.SpanID(), publish.SpanKind, request.SpanContext().SpanID())
	}
	// The attributes an operator searches a trace backend by: the message id across the
	// services, the exchange and routing key it went to.
	wantAttributes(t, publish, map[string]string{
		"messaging.system": "rabbitmq", "messaging.operation.type": "send", "messaging.message.id": msg.ID.String(),
		"messaging.destination.name": b.exchange, "messaging.rabbitmq.destination.routing_key": b.placed.Type,
	})
	delivered := testenv.Drain(t, ch, headers, 200*time.Millisecond)
	if len(delivered) != 1 || delivered[0].Headers["traceparent"] != traceParent(publish.SpanContext) {
		t.Fatalf("deliveries %+v, want one with traceparent %s (the publish span)", delivered, traceParent(publish.SpanContext))
	}

	run(t, s.Run)
	testenv.Eventually(t, 10*time.Second, func() bool { _, ok := seen.get(msg.ID); return ok }, "message not handled")
	process := tr.span(t, tid, "process "+b.name)
	if process.Parent.SpanID() != publish.SpanContext.SpanID() || !process.Parent.IsRemote() || process.SpanKind != trace.SpanKindConsumer {
		t.Fatalf("process span: parent %s kind %s, want a consumer span child of the publish span %s", process.Parent.SpanID(), process.SpanKind, publish.SpanContext.SpanID())
	}
	wantAttributes(t, process, map[string]string{
		"messaging.system": "rabbitmq", "messaging.operation.type": "process", "messaging.message.id": msg.ID.String(),
		"messaging.consumer.group.name": b.name, "messaging.rabbitmq.destination.routing_key": b.placed.Type,
	})
	if handlerSC, _ := seen.get(msg.ID); handlerSC.SpanID() != process.SpanContext.SpanID() || handlerSC.TraceID() != tid {
		t.Fatalf("the handler's context holds span %s of trace %s, want the process span %s of %s", handlerSC.SpanID(), handlerSC.TraceID(), process.SpanContext.SpanID(), tid)
	}
	mu.Lock()
	followUp := followUps[msg.ID]
	mu.Unlock()
	if got, want := storedTrace(t, b.db.DB, followUp), traceParent(process.SpanContext); got != want {
		t.Fatalf("the handler's own outbox row has trace_parent %q, want the process span's %q", got, want)
	}
	if lines := b.logs.Lines(`msg="message handled"`, "message_id="+msg.ID.String(), "trace_id="+tid.String()); len(lines) != 1 {
		t.Fatalf("%d 'message handled' lines in trace %s, want 1", len(lines), tid)
	}

	// A redelivery: the same message published again. The inbox skips it, in the same trace.
	if err := b.db.DB.Exec("UPDATE outbox_messages SET processed_at = NULL WHERE id = ?", msg.ID).Error; err != nil {
		t.Fatal(err)
	}
	if res, err := relay.ProcessBatch(context.Background()); err != nil || res.Sent != 1 {
		t.Fatalf("second relay batch = %+v, %v; want 1 sent", res, err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines(`msg="duplicate message skipped"`, "message_id="+msg.ID.String(), "trace_id="+tid.String())) == 1
	}, "no 'duplicate message skipped' line in trace %s", tid)
}

// In a batch, one transaction handles messages of different traces: each handler runs in its
// own message's trace.
func TestEachMessageOfABatchKeepsItsOwnTrace(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	tr := newTracing(t)
	var seen handledContexts
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) { c.TracerProvider = tr.tp })
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, _ placed, msg messaging.Message) error {
		seen.record(ctx, msg)
		return record(tx, msg)
	}))
	declareSubscription(t, s)
	// They wait before the subscription starts, so batches form.
	const n = 100
	sent := map[uuid.UUID]trace.SpanContext{}
	for range n {
		msg, err := b.placed.Message(placed{OrderID: uuid.New()})
		if err != nil {
			t.Fatal(err)
		}
		_, parent := tr.tp.Tracer("test").Start(context.Background(), "request")
		parent.End()
		sent[msg.ID] = parent.SpanContext()
		p := publishing(msg)
		p.Headers = amqp.Table{"traceparent": traceParent(parent.SpanContext())}
		if err := b.ch.PublishWithContext(context.Background(), b.exchange, msg.Type, true, false, p); err != nil {
			t.Fatal(err)
		}
	}
	run(t, s.Run)
	testenv.Eventually(t, 10*time.Second, func() bool { return b.handled(t, "SELECT count(*) FROM handled") == n }, "messages not handled")
	if most := b.handled(t, "SELECT max(n) FROM (SELECT count(*) AS n FROM handled GROUP BY txid) AS batches"); most < 2 {
		t.Fatalf("no transaction handled more than %d message: no batch to check", most)
	}
	for id, parent := range sent {
		process := tr.span(t, parent.TraceID(), "process "+b.name)
		handlerSC, _ := seen.get(id)
		if process.Parent.SpanID() != parent.SpanID() || handlerSC.SpanID() != process.SpanContext.SpanID() {
			t.Errorf("message %s: process span %s with parent %s, handler in span %s; want the process span a child of %s, and the handler in it",
				id, process.SpanContext.SpanID(), process.Parent.SpanID(), handlerSC.SpanID(), parent.SpanID())
		}
	}
}

// A message that comes without a trace context starts a trace of its own, rooted in the
// consumer's receive span, which the handler's outbox rows continue. One that never decodes
// gets one too: the line that dead-letters it carries its trace id.
func TestMessageWithoutTraceContextStartsATrace(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	tr := newTracing(t)
	var seen handledContexts
	var followUp uuid.UUID
	log := slog.New(traceIDs{b.log.Handler()})
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) { c.TracerProvider, c.Logger = tr.tp, log })
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		next, err := messaging.NewMessage("FollowUp", p)
		if err != nil {
			return err
		}
		followUp = next.ID
		seen.record(ctx, msg) // last: the test reads followUp once it sees this
		return messaging.Enqueue(ctx, b.drv, tx, next)
	}))
	declareSubscription(t, s)
	msg, err := b.placed.Message(placed{OrderID: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	b.publish(t, b.exchange, msg)
	// Run under a span of the service's own (as long as the process): not the message's parent.
	_, service := tr.tp.Tracer("test").Start(context.Background(), "service")
	defer service.End()
	run(t, func(ctx context.Context) error { return s.Run(trace.ContextWithSpan(ctx, service)) })
	testenv.Eventually(t, 10*time.Second, func() bool {
		_, ok := seen.get(msg.ID)
		return ok && b.handled(t, "SELECT count(*) FROM outbox_messages") == 1
	}, "message not handled")
	sc, _ := seen.get(msg.ID)
	if !sc.IsValid() || !sc.IsSampled() || sc.TraceID() == service.SpanContext().TraceID() {
		t.Fatalf("the handler's context has span context %+v, want a new sampled trace, not Run's %s", sc, service.SpanContext().TraceID())
	}
	receive := tr.span(t, sc.TraceID(), "receive "+b.name)
	if receive.Parent.IsValid() {
		t.Fatalf("the receive span of an untraced message has parent %s, want none", receive.Parent.SpanID())
	}
	if process := tr.span(t, sc.TraceID(), "process "+b.name); process.Parent.SpanID() != receive.SpanContext.SpanID() {
		t.Fatalf("the process span's parent is %s, want the receive span %s", process.Parent.SpanID(), receive.SpanContext.SpanID())
	}
	if got := storedTrace(t, b.db.DB, followUp); got != traceParent(sc) {
		t.Fatalf("the handler's outbox row has trace_parent %q, want %q", got, traceParent(sc))
	}

	poison := uuid.NewString()
	// Straight into the queue: not JSON, no type, no trace context.
	if err := b.ch.PublishWithContext(context.Background(), "", b.name, true, false, amqp.Publishing{MessageId: poison, Body: []byte("<xml/>")}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return len(b.logs.Lines("message dead-lettered", "message_id="+poison)) == 1 },
		"the undecodable message was not dead-lettered")
	lines := b.logs.Lines("message dead-lettered", "message_id="+poison, "trace_id=")
	if len(lines) != 1 {
		t.Fatalf("the dead-letter line of an untraced message carries no trace id: %q", b.logs.Lines("message dead-lettered", "message_id="+poison))
	}
	// Its trace shows the failure: no handler's span starts for it.
	tid, _ := trace.TraceIDFromHex(regexp.MustCompile(`trace_id=([0-9a-f]{32})`).FindStringSubmatch(lines[0])[1])
	if process := tr.span(t, tid, "process "+b.name); process.Status.Code != codes.Error {
		t.Fatalf("the undecodable message's process span has status %+v, want an error", process.Status)
	}
}

// A process that installed no tracer provider (the global no-op one) makes no spans, but passes
// the trace context on: from a span in the enqueuing context to the row and the AMQP header,
// and from a delivery's header to the handler's context, its consumer's log lines and its own
// outbox rows, unchanged.
func TestTraceContextPassesThroughWithoutATracerProvider(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	log := slog.New(traceIDs{b.log.Handler()})
	incoming := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID(uuid.New()), SpanID: trace.SpanID([8]byte{1, 2, 3, 4, 5, 6, 7, 8}), TraceFlags: trace.FlagsSampled, Remote: true,
	})
	var seen handledContexts
	var attempts int
	var followUp uuid.UUID
	s := b.subscription(t, func(c *messaging.SubscriptionConfig) { c.Logger = log })
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		if attempts++; attempts == 1 {
			return errors.New("first attempt fails")
		}
		next, err := messaging.NewMessage("FollowUp", p)
		if err != nil {
			return err
		}
		followUp = next.ID
		seen.record(ctx, msg)
		return messaging.Enqueue(ctx, b.drv, tx, next)
	}))
	ch := testenv.Channel(t)
	declareSubscription(t, s)
	headers := spy(t, b.exchange, b.placed.Type)

	msg, err := b.placed.Message(placed{OrderID: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	enqueueCtx := trace.ContextWithRemoteSpanContext(context.Background(), incoming)
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(enqueueCtx, b.drv, tx, msg) }); err != nil {
		t.Fatal(err)
	}
	if res, err := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil).ProcessBatch(context.Background()); err != nil || res.Sent != 1 {
		t.Fatalf("relay batch = %+v, %v; want 1 sent", res, err)
	}
	if delivered := testenv.Drain(t, ch, headers, 200*time.Millisecond); len(delivered) != 1 || delivered[0].Headers["traceparent"] != traceParent(incoming) {
		t.Fatalf("deliveries %+v, want one with traceparent %s", delivered, traceParent(incoming))
	}

	run(t, s.Run)
	testenv.Eventually(t, 10*time.Second, func() bool { _, ok := seen.get(msg.ID); return ok }, "message not handled")
	if sc, _ := seen.get(msg.ID); !sc.Equal(incoming) {
		t.Fatalf("the handler's context has %s, want the incoming %s", traceParent(sc), traceParent(incoming))
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return storedTrace(t, b.db.DB, followUp) == traceParent(incoming) },
		"the handler's outbox row does not carry the incoming trace context %s", traceParent(incoming))
	if lines := b.logs.Lines(`msg="handler failed; retrying message"`, "trace_id="+incoming.TraceID().String()); len(lines) != 1 {
		t.Fatalf("%d retry lines in trace %s, want 1", len(lines), incoming.TraceID())
	}
}

// A message the broker refuses is logged in its trace, and its publish span fails. One
// enqueued outside any trace is logged in a trace its publish span starts, not in the span of
// the relay's caller, and so when a row of its batch could not be read as a message.
func TestRefusedPublishIsLoggedInItsTrace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tr := newTracing(t)
	log := slog.New(traceIDs{b.log.Handler()})
	ctx, request := tr.tp.Tracer("test").Start(context.Background(), "request")
	msg, err := messaging.NewMessage("NobodyListens", map[string]int{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	untraced, err := messaging.NewMessage("NobodyListens", map[string]int{"n": 2})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(ctx, b.drv, tx, msg) }); err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, untraced) }); err != nil {
		t.Fatal(err)
	}
	unreadable, err := messaging.NewMessage("NobodyListens", map[string]int{"n": 3})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, unreadable) }); err != nil {
		t.Fatal(err)
	}
	if err := b.db.DB.Exec(`UPDATE outbox_messages SET headers = '[1]' WHERE id = ?`, unreadable.ID).Error; err != nil {
		t.Fatal(err)
	}
	request.End()
	relay := b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) { c.TracerProvider, c.Logger = tr.tp, log })
	// Under a span of the service's own (as long as the process): not the untraced row's parent.
	_, service := tr.tp.Tracer("test").Start(context.Background(), "service")
	defer service.End()
	if res, err := relay.ProcessBatch(trace.ContextWithSpan(context.Background(), service)); err != nil || res.Failed != 3 {
		t.Fatalf("relay batch = %+v, %v; want 3 refused", res, err)
	}
	lines := b.logs.Lines(`msg="outbox publish failed"`, "message_id="+untraced.ID.String())
	m := regexp.MustCompile(`trace_id=([0-9a-f]{32})`).FindStringSubmatch(strings.Join(lines, "\n"))
	if len(lines) != 1 || m == nil {
		t.Fatalf("the untraced message's failure lines carry no trace id: %q", lines)
	}
	if root, _ := trace.TraceIDFromHex(m[1]); root == service.SpanContext().TraceID() || tr.span(t, root, "publish "+b.exchange).Parent.IsValid() {
		t.Fatal("the publish span of an untraced message has a parent, want a trace of its own")
	}
	tid := request.SpanContext().TraceID()
	if lines := b.logs.Lines(`msg="outbox publish failed"`, "message_id="+msg.ID.String(), "trace_id="+tid.String()); len(lines) != 1 {
		t.Fatalf("%d 'outbox publish failed' lines in trace %s, want 1", len(lines), tid)
	}
	if publish := tr.span(t, tid, "publish "+b.exchange); publish.Status.Code != codes.Error || !strings.Contains(publish.Status.Description, "unroutable") {
		t.Fatalf("publish span status %+v, want an error naming the unroutable message", publish.Status)
	}
}

// Whatever else the propagator writes travels with the message as well: baggage in the context
// of the enqueue reaches the handler's, through the outbox row and an AMQP header of its own.
func TestBaggageTravelsWithTheMessage(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	member, err := baggage.NewMember("tenant", "acme")
	if err != nil {
		t.Fatal(err)
	}
	bag, err := baggage.New(member)
	if err != nil {
		t.Fatal(err)
	}
	seen := make(chan string, 1)
	s := b.subscription(t, nil)
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, _ placed, msg messaging.Message) error {
		seen <- baggage.FromContext(ctx).Member("tenant").Value()
		return nil
	}))
	ch := testenv.Channel(t)
	declareSubscription(t, s)
	headers := spy(t, b.exchange, b.placed.Type)

	msg, err := b.placed.Message(placed{OrderID: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	ctx := baggage.ContextWithBaggage(context.Background(), bag)
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(ctx, b.drv, tx, msg) }); err != nil {
		t.Fatal(err)
	}
	var stored string
	if err := b.db.DB.Raw("SELECT coalesce(headers->>'baggage', '') FROM outbox_messages WHERE id = ?", msg.ID).Scan(&stored).Error; err != nil {
		t.Fatal(err)
	}
	if stored != "tenant=acme" {
		t.Fatalf("the outbox row's baggage header is %q, want tenant=acme", stored)
	}
	if res, err := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil).ProcessBatch(context.Background()); err != nil || res.Sent != 1 {
		t.Fatalf("relay batch = %+v, %v; want 1 sent", res, err)
	}
	if delivered := testenv.Drain(t, ch, headers, 200*time.Millisecond); len(delivered) != 1 || delivered[0].Headers["baggage"] != "tenant=acme" {
		t.Fatalf("deliveries %+v, want one with the header baggage: tenant=acme", delivered)
	}
	run(t, s.Run)
	select {
	case got := <-seen:
		if got != "acme" {
			t.Fatalf("the handler's context has tenant %q in its baggage, want acme", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("message not handled")
	}
}
