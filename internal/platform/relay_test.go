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

// The relay's publisher has room for every lane's whole batch, at the largest settings too:
// a lane left waiting for another's confirms holds its claimed rows, and a wait past the
// confirm timeout would be logged as an outage.
func TestRelayPublisherHoldsEveryLanesBatch(t *testing.T) {
	for _, vars := range []map[string]string{
		{},
		{"OUTBOX_LANES": "16", "OUTBOX_BATCH_SIZE": "1000"},
		{"OUTBOX_LANES": "3", "OUTBOX_BATCH_SIZE": "400"},
	} {
		env := EnvFrom(vars)
		s := ReadRelaySettings(env)
		if err := env.Err(); err != nil {
			t.Fatal(err)
		}
		if got := s.inFlight(); got < s.Lanes*s.BatchSize || got < 1000 {
			t.Errorf("%v: MaxInFlight %d; want at least %d lanes × %d rows, and the default 1,000", vars, got, s.Lanes, s.BatchSize)
		}
	}
}
