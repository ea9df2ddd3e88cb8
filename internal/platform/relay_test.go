package platform

import (
	"slices"
	"testing"

	"github.com/outboxkit/outbox-inbox/internal/events"
)

// A service's relay exports the publish counters of exactly the types the topology routes from
// its exchange.
func TestRelayCountsTheTypesItsExchangeRoutes(t *testing.T) {
	for exchange, want := range map[string][]string{
		events.Exchange:          {events.OrderPlacedType, events.OrderCancelledType},
		events.InvoicingExchange: {events.InvoiceIssuedType},
		"elsewhere":              nil,
	} {
		if got := routedFrom(events.Topology, exchange); !slices.Equal(got, want) {
			t.Errorf("types routed from %q = %v, want %v", exchange, got, want)
		}
	}
}
