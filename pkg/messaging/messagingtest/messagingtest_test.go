package messagingtest_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/messagingtest"
)

// A message a consumer would dead-letter before its payload is decoded (the nil UUID as its
// id, which the inbox would take for every other such message; a payload over
// MaxMessageBytes, or not JSON) is refused by Deliver as permanent too, its handler not run: a
// handler test passed where production dead-letters. Reaching the database, it fails as an
// outage (see noDatabase).
func TestDeliverChecksAMessageAsAConsumerDoes(t *testing.T) {
	t.Parallel()
	ev := messaging.Event[map[string]int]{Exchange: "orders", Type: "Placed"}
	sub, err := messaging.NewSubscription[struct{}](noDatabase{}, messaging.SubscriptionConfig{
		Name: "checks", URL: "amqp://127.0.0.1:1/", MaxMessageBytes: 16,
	})
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	if err := messaging.Handle(sub, ev, func(context.Context, struct{}, map[string]int, messaging.Message) error {
		ran++
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, because string
		change        func(*messaging.Message)
	}{
		{"the nil UUID", "nil UUID", func(m *messaging.Message) { m.ID = uuid.Nil }},
		{"over MaxMessageBytes", "exceeds the limit of 16", func(m *messaging.Message) { m.Payload = []byte(`{"n": 1234567890123}`) }},
		{"not JSON", "not valid JSON", func(m *messaging.Message) { m.Payload = []byte(`{"n":`) }},
	} {
		msg := messagingtest.Message(t, ev, map[string]int{"n": 1})
		tc.change(&msg)
		_, err := messagingtest.Deliver(context.Background(), sub, msg)
		if !messaging.IsPermanent(err) || !strings.Contains(err.Error(), tc.because) {
			t.Errorf("%s: Deliver = %v, want a permanent error saying %q", tc.name, err, tc.because)
		}
	}
	if ran != 0 {
		t.Errorf("the handler ran %d times, want none", ran)
	}
}

// errNoDatabase is every answer of noDatabase.
var errNoDatabase = errors.New("no database in this test")

// noDatabase is a driver without a database: a delivery that gets as far as its transaction
// fails, as an outage (the database does not answer either).
type noDatabase struct{}

func (noDatabase) DB() messaging.DB { return noDB{} }
func (noDatabase) Executor(struct{}) (messaging.Executor, error) {
	return nil, errNoDatabase
}

func (noDatabase) Begin(context.Context) (struct{}, messaging.TxExecutor, error) {
	return struct{}{}, nil, errNoDatabase
}

type noDB struct{}

func (noDB) Exec(context.Context, string, ...any) (int64, error) { return 0, errNoDatabase }
func (noDB) Query(context.Context, string, ...any) (messaging.Rows, error) {
	return nil, errNoDatabase
}
func (noDB) Begin(context.Context) (messaging.TxExecutor, error) { return nil, errNoDatabase }
func (noDB) Conn(context.Context) (messaging.Conn, error)        { return nil, errNoDatabase }
