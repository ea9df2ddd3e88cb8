package messaging

import (
	"context"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/testhook"
)

// deliverer is a subscription of any driver, seen by its unexported deliver.
type deliverer interface {
	deliver(ctx context.Context, msgs []Message) (duplicates []bool, err error)
}

func init() {
	testhook.Deliver = func(ctx context.Context, sub, msgs any) ([]bool, error) {
		return sub.(deliverer).deliver(ctx, msgs.([]Message))
	}
}
