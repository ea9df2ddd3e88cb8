// Package messagingtest helps test a service's handlers against its real database, without a
// broker: deliver a message to a subscription as its queue would, once or twice, and see what
// the handlers and the inbox did.
package messagingtest

import (
	"context"
	"fmt"
	"testing"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/testhook"
)

// Deliver hands msg to sub as a delivery from its queue would be: decoded and checked, then
// claimed in the inbox and handled in one transaction, behind the subscription's middleware,
// with its after-commit hooks run. duplicate reports that sub had handled msg already, and
// did nothing. Errors are the handler's, or a [messaging.Permanent] one for a message that fails
// a consumer's checks (the nil UUID as its id, a payload over the subscription's
// MaxMessageBytes or not JSON) or does not decode (a queue would dead-letter it), or whose type
// has no handler (a queue would give it back for another replica, and dead-letter it at its
// last delivery).
func Deliver[Tx any](ctx context.Context, sub *messaging.Subscription[Tx], msg messaging.Message) (duplicate bool, err error) {
	duplicates, err := testhook.Deliver(ctx, sub, []messaging.Message{msg})
	if err != nil {
		return false, err
	}
	return duplicates[0], nil
}

// DeliverBatch hands msgs to sub as deliveries waiting in its queue together would be: claimed
// in the inbox and handled in one transaction in their order, each run of a batch handler's
// messages given to it together (see [messaging.HandleBatch]), the after-commit hooks run once
// it commits. duplicates reports, for each message, that sub had handled it already. An error
// is the batch's: nothing of it was committed (a consumer would then retry its messages one by
// one, which Deliver does).
func DeliverBatch[Tx any](ctx context.Context, sub *messaging.Subscription[Tx], msgs ...messaging.Message) (duplicates []bool, err error) {
	if len(msgs) == 0 {
		return nil, nil
	}
	return testhook.Deliver(ctx, sub, msgs)
}

// DeliverTwice delivers msg to sub twice, as a broker's redelivery would, and fails t unless
// the first delivery did the work and the second was recognised as a duplicate.
func DeliverTwice[Tx any](t testing.TB, sub *messaging.Subscription[Tx], msg messaging.Message) {
	t.Helper()
	ctx := context.Background()
	for i, want := range []bool{false, true} {
		dup, err := Deliver(ctx, sub, msg)
		if err != nil || dup != want {
			t.Fatalf("delivery %d of message %s: duplicate=%v, err=%v; want duplicate=%v", i+1, msg.ID, dup, err, want)
		}
	}
}

// Message builds a message of ev with payload, failing t if it cannot.
func Message[T any](t testing.TB, ev messaging.Event[T], payload T) messaging.Message {
	t.Helper()
	msg, err := ev.Message(payload)
	if err != nil {
		t.Fatal(fmt.Errorf("message of %s: %w", ev.Type, err))
	}
	return msg
}
