package main

import (
	"context"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/messagingtest"
)

// The service reads and writes trace contexts with the propagators platform installs at start,
// W3C trace context among them; its tests run no start, so the package installs them here.
func init() {
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
}

// Each InvoiceIssued of a batch belongs to the trace of the OrderPlaced that issued it, and
// carries its correlation id, as it would one message at a time: not the batch's, nor another
// message's.
func TestABatchAnnouncesEachInvoiceInItsOrdersTrace(t *testing.T) {
	t.Parallel()
	b := setup(t)
	orders := []uuid.UUID{uuid.New(), uuid.New(), uuid.New()}
	msgs := make([]messaging.Message, len(orders))
	traces := make([]string, len(orders))
	for i, id := range orders {
		msgs[i] = orderPlaced(t, id, 100)
		msgs[i].CorrelationID = "corr-" + id.String()
		span := uuid.New()
		traces[i] = hex.EncodeToString(id[:])
		msgs[i].TraceParent = fmt.Sprintf("00-%s-%s-01", traces[i], hex.EncodeToString(span[:8]))
	}
	if dups, err := messagingtest.DeliverBatch(context.Background(), b.sub, msgs...); err != nil || slices.Contains(dups, true) {
		t.Fatalf("DeliverBatch = %v, %v; want every message handled", dups, err)
	}
	for i, id := range orders {
		var row struct{ TraceParent, CorrelationID string }
		if err := b.db.Raw("SELECT trace_parent, correlation_id FROM outbox_messages WHERE type = ? AND payload->>'order_id' = ?",
			events.InvoiceIssuedType, id.String()).Scan(&row).Error; err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(row.TraceParent, "00-"+traces[i]+"-") || row.CorrelationID != msgs[i].CorrelationID {
			t.Errorf("order %d: InvoiceIssued with trace_parent %q, correlation id %q; want trace %s and %q, its OrderPlaced's",
				i, row.TraceParent, row.CorrelationID, traces[i], msgs[i].CorrelationID)
		}
	}
}
