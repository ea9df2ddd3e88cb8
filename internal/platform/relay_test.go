package platform

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
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

// A binding with a wildcard word names no event type: the relay exports no counters for it,
// which no message would ever count in. A word that only contains # or * is a type's.
func TestRelayCountsNoTypeForAWildcardBinding(t *testing.T) {
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: "audit", Bindings: []messaging.Binding{
		{Exchange: "orders", RoutingKey: "#"},
		{Exchange: "orders", RoutingKey: "orders.*"},
		{Exchange: "orders", RoutingKey: "*.placed.#"},
		{Exchange: "orders", RoutingKey: "OrderPlaced"},
		{Exchange: "orders", RoutingKey: "C#.Order*"},
	}}}}
	if got, want := routedFrom(topology, "orders"), []string{"OrderPlaced", "C#.Order*"}; !slices.Equal(got, want) {
		t.Errorf("types routed from a topology with wildcard bindings = %q, want %q", got, want)
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

// A service whose relay does not listen (OUTBOX_NOTIFY=false) enqueues without the NOTIFY
// nobody would hear; one whose relay listens notifies at each enqueuing commit. The test's own
// NOTIFY after each commit marks which commit a notification came from: they arrive in commit
// order.
func TestAServiceNotifiesOnlyARelayThatListens(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1) // the LISTEN connection
	d := testenv.NewDatabase(t)
	d.MigrateLibrary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	testenv.Draw(t, 1)
	listener, err := pgx.Connect(ctx, d.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close(context.Background())
	if _, err := listener.Exec(ctx, "LISTEN outbox_messages"); err != nil {
		t.Fatal(err)
	}
	for _, notify := range []bool{false, true} {
		mark := fmt.Sprintf("after the commit with OUTBOX_NOTIFY=%t", notify)
		msg, err := messaging.NewMessage("Placed", map[string]string{"order_id": "o-1"})
		if err != nil {
			t.Fatal(err)
		}
		drv := ReadRelaySettings(EnvFrom(map[string]string{"OUTBOX_NOTIFY": strconv.FormatBool(notify)})).Enqueuing(d.Driver(t))
		if err := d.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(ctx, drv, tx, msg) }); err != nil {
			t.Fatal(err)
		}
		if err := d.DB.Exec("SELECT pg_notify('outbox_messages', ?)", mark).Error; err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	for len(got) == 0 || !strings.HasSuffix(got[len(got)-1], "=true") {
		n, err := listener.WaitForNotification(ctx)
		if err != nil {
			t.Fatalf("notifications so far %q, then: %v", got, err)
		}
		got = append(got, n.Payload)
	}
	if want := []string{"after the commit with OUTBOX_NOTIFY=false", "", "after the commit with OUTBOX_NOTIFY=true"}; !slices.Equal(got, want) {
		t.Errorf("notifications %q, want %q", got, want)
	}
}
