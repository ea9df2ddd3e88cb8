package test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/messagingtest"
)

// A batch that fails is tried again one message at a time, so its own attempt must count no
// handler outcome and log no "message handled": each message is counted, and logged, as it
// would be one at a time. Neither the good message of a refused batch handler's batch (counted
// "permanent" for its neighbour's fault), nor a plain handler's message that ran before its
// neighbour failed (counted "ok" twice, logged handled twice).
func TestAFailedBatchCountsEachMessageAsOneAtATime(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, nil)
	bad := uuid.New()
	must(t, messaging.HandleBatch(s, b.placed, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[placed]) error {
		for _, d := range batch {
			if d.Payload.OrderID == bad {
				return messaging.Permanent(errors.New("refused"))
			}
			if err := record(tx, d.Msg); err != nil {
				return err
			}
		}
		return nil
	}))
	must(t, messaging.Handle(s, b.cancels, func(ctx context.Context, tx *gorm.DB, c cancelled, msg messaging.Message) error {
		if c.OrderID == bad {
			return errors.New("refused")
		}
		return record(tx, msg)
	}))
	goodP, badP := messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()}), messagingtest.Message(t, b.placed, placed{OrderID: bad})
	goodC, badC := messagingtest.Message(t, b.cancels, cancelled{OrderID: uuid.New()}), messagingtest.Message(t, b.cancels, cancelled{OrderID: bad})
	ctx := context.Background()
	// As a consumer does: the batch, then, once it failed, each of its messages on its own.
	for _, batch := range [][]messaging.Message{{goodP, badP}, {goodC, badC}} {
		if _, err := messagingtest.DeliverBatch(ctx, s, batch...); err == nil {
			t.Fatal("DeliverBatch = nil, want the batch's error")
		}
		for _, msg := range batch {
			_, _ = messagingtest.Deliver(ctx, s, msg)
		}
	}
	for _, c := range []struct {
		typ, outcome string
		want         float64
	}{{"Placed", "ok", 1}, {"Placed", "permanent", 1}, {"Cancelled", "ok", 1}, {"Cancelled", "error", 1}} {
		got := metricValue(t, b.registry, "consumer_handler_seconds", map[string]string{"consumer": b.name, "type": c.typ, "outcome": c.outcome})
		if got != c.want {
			t.Errorf("consumer_handler_seconds{type=%q,outcome=%q} counts %v, want %v: one per message, as one at a time", c.typ, c.outcome, got, c.want)
		}
	}
	for _, msg := range []messaging.Message{goodP, goodC} {
		if n := len(b.logs.Lines("message handled", "message_id="+msg.ID.String())); n != 1 {
			t.Errorf("%d \"message handled\" lines for %s message %s, want 1", n, msg.Type, msg.ID)
		}
	}
	if n := b.handled(t, "SELECT count(*) FROM handled"); n != 2 {
		t.Fatalf("%d messages handled, want the 2 good ones", n)
	}
}

// A batch handler that panics fails its batch, as a plain handler's panic fails its message:
// nothing of the batch commits, the panic is logged, and the process, with the batch's other
// messages, lives on to handle them one at a time.
func TestABatchHandlerPanicFailsOnlyItsBatch(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, nil)
	bad := uuid.New()
	must(t, messaging.HandleBatch(s, b.placed, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[placed]) error {
		for _, d := range batch {
			if err := record(tx, d.Msg); err != nil {
				return err
			}
			if d.Payload.OrderID == bad {
				panic("bad order")
			}
		}
		return nil
	}))
	good, poison := messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()}), messagingtest.Message(t, b.placed, placed{OrderID: bad})
	ctx := context.Background()
	if _, err := messagingtest.DeliverBatch(ctx, s, good, poison); err == nil || !strings.Contains(err.Error(), "panicked") {
		t.Fatalf("DeliverBatch = %v, want the batch handler's panic as its error", err)
	}
	if n := b.handled(t, "SELECT count(*) FROM handled"); n != 0 {
		t.Fatalf("%d messages of the panicked batch committed, want none", n)
	}
	if dup, err := messagingtest.Deliver(ctx, s, good); err != nil || dup {
		t.Fatalf("the good message alone: Deliver = %v, %v; want it handled", dup, err)
	}
	if _, err := messagingtest.Deliver(ctx, s, poison); err == nil {
		t.Fatal("the poison alone: Deliver = nil, want its panic as its error")
	}
	if n := len(b.logs.Lines("level=ERROR", "batch handler panicked", "stack=")); n != 2 {
		t.Errorf("%d 'batch handler panicked' lines with the stack, want 2: the batch's and the poison's own", n)
	}
	if n := len(b.logs.Lines("level=ERROR", "batch handler panicked", "size=1", "message_id="+poison.ID.String())); n != 1 {
		t.Errorf("%d 'batch handler panicked' lines naming the poison tried alone, want 1", n)
	}
	if n := b.handled(t, "SELECT count(*) FROM handled"); n != 1 {
		t.Fatalf("%d messages handled, want the good one", n)
	}
}

// A batch's messages are handled in its order, as one at a time, whatever their handlers: a
// batch handler gets each run of consecutive messages of its event, in order, so that no
// message is handled before one that came ahead of it (see transact).
func TestABatchHandlesItsMessagesInTheirOrder(t *testing.T) {
	t.Parallel()
	batch, got, runs := handleMixedBatch(t, nil)
	if !slices.Equal(got, ids(batch)) {
		t.Fatalf("handled in the order %v, want the batch's, %v", got, ids(batch))
	}
	if !slices.Equal(runs, []int{2, 3}) {
		t.Fatalf("the batch handler got runs of %v messages, want [2 3]: each run of its event's consecutive messages", runs)
	}
}

// With BatchByType, a batch handler gets every message of its event in the transaction at
// once, in their order, after the plain handlers' messages, in theirs.
func TestBatchByTypeGivesABatchHandlerAllItsEventsMessagesAtOnce(t *testing.T) {
	t.Parallel()
	batch, got, runs := handleMixedBatch(t, func(cfg *messaging.SubscriptionConfig) { cfg.BatchByType = true })
	var plain, batched []messaging.Message
	for _, msg := range batch {
		if msg.Type == batch[0].Type {
			plain = append(plain, msg)
		} else {
			batched = append(batched, msg)
		}
	}
	if want := ids(append(plain, batched...)); !slices.Equal(got, want) {
		t.Fatalf("handled in the order %v, want %v: the plain handler's messages in order, then the batch handler's", got, want)
	}
	if !slices.Equal(runs, []int{5}) {
		t.Fatalf("the batch handler got runs of %v messages, want [5]: all of its event's at once", runs)
	}
}

// handleMixedBatch delivers, as one batch, cancellations (a plain handler) and placements (a
// batch handler) in the order c p p c p p p c, to a subscription tweak sets up. It returns the
// batch, the ids in the order they were handled, and the sizes of the batch handler's runs.
func handleMixedBatch(t *testing.T, tweak func(*messaging.SubscriptionConfig)) (batch []messaging.Message, got []uuid.UUID, runs []int) {
	t.Helper()
	b := setupSubscription(t)
	if err := b.db.DB.Exec("CREATE TABLE seen (n serial PRIMARY KEY, message_id uuid NOT NULL)").Error; err != nil {
		t.Fatal(err)
	}
	see := func(tx *gorm.DB, msg messaging.Message) error {
		return tx.Exec("INSERT INTO seen (message_id) VALUES (?)", msg.ID).Error
	}
	s := b.subscription(t, tweak)
	must(t, messaging.Handle(s, b.cancels, func(ctx context.Context, tx *gorm.DB, _ cancelled, msg messaging.Message) error {
		return see(tx, msg)
	}))
	must(t, messaging.HandleBatch(s, b.placed, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[placed]) error {
		runs = append(runs, len(batch))
		for _, d := range batch {
			if err := see(tx, d.Msg); err != nil {
				return err
			}
		}
		return nil
	}))
	batch = b.mixedBatch(t, "cppcpppc")
	if dups, err := messagingtest.DeliverBatch(context.Background(), s, batch...); err != nil || slices.Contains(dups, true) {
		t.Fatalf("DeliverBatch = %v, %v; want every message handled", dups, err)
	}
	if err := b.db.DB.Raw("SELECT message_id FROM seen ORDER BY n").Scan(&got).Error; err != nil {
		t.Fatal(err)
	}
	return batch, got, runs
}

// mixedBatch makes a message per letter of kinds, in order: a cancellation for each 'c', a
// placement for any other.
func (b *subscriptionBundle) mixedBatch(t *testing.T, kinds string) []messaging.Message {
	t.Helper()
	var batch []messaging.Message
	for i, kind := range kinds {
		if kind == 'c' {
			batch = append(batch, messagingtest.Message(t, b.cancels, cancelled{OrderID: uuid.New()}))
		} else {
			batch = append(batch, messagingtest.Message(t, b.placed, placed{OrderID: uuid.New(), N: i}))
		}
	}
	return batch
}

// ids lists msgs' ids.
func ids(msgs []messaging.Message) []uuid.UUID {
	out := make([]uuid.UUID, len(msgs))
	for i, msg := range msgs {
		out[i] = msg.ID
	}
	return out
}

// Each run of a batch handler's messages is logged and counted, once its transaction commits,
// as its own: every message handled is logged once, with its own message_id, and counted once,
// however many runs of its event the transaction holds (a run's items must not be reused for
// the next run while the first's outcomes wait for the commit; see transact).
func TestABatchLogsAndCountsEachRunsMessagesAsTheirOwn(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, nil)
	must(t, messaging.Handle(s, b.cancels, func(ctx context.Context, tx *gorm.DB, _ cancelled, msg messaging.Message) error {
		return record(tx, msg)
	}))
	must(t, messaging.HandleBatch(s, b.placed, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[placed]) error {
		for _, d := range batch {
			if err := record(tx, d.Msg); err != nil {
				return err
			}
		}
		return nil
	}))
	batch := b.mixedBatch(t, "ppcpp")
	if dups, err := messagingtest.DeliverBatch(context.Background(), s, batch...); err != nil || slices.Contains(dups, true) {
		t.Fatalf("DeliverBatch = %v, %v; want every message handled", dups, err)
	}
	for _, msg := range batch {
		if n := len(b.logs.Lines("message handled", "message_id="+msg.ID.String(), "type="+msg.Type)); n != 1 {
			t.Errorf("%d \"message handled\" lines for %s message %s, want 1", n, msg.Type, msg.ID)
		}
	}
	for typ, want := range map[string]float64{"Placed": 4, "Cancelled": 1} {
		got := metricValue(t, b.registry, "consumer_handler_seconds", map[string]string{"consumer": b.name, "type": typ, "outcome": "ok"})
		if got != want {
			t.Errorf("consumer_handler_seconds{type=%q,outcome=\"ok\"} counts %v, want %v: one per message", typ, got, want)
		}
	}
}

// A transaction's handler outcomes are its own to count: a message handled with a context
// that a batch's handler gave on (here, from its after-commit hook, once the batch's outcomes
// are counted) is counted at once, not held for the batch.
func TestAMessageHandledFromABatchsHookIsCounted(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, nil)
	otherName := b.name + "_other"
	other := b.subscription(t, func(cfg *messaging.SubscriptionConfig) { cfg.Name = otherName })
	must(t, messaging.Handle(other, b.cancels, func(ctx context.Context, tx *gorm.DB, _ cancelled, msg messaging.Message) error {
		return record(tx, msg)
	}))
	follow := messagingtest.Message(t, b.cancels, cancelled{OrderID: uuid.New()})
	var followErr error
	must(t, messaging.HandleBatch(s, b.placed, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[placed]) error {
		return messaging.AfterCommit(batch[0].Ctx, func() { _, followErr = messagingtest.Deliver(batch[0].Ctx, other, follow) })
	}))
	batch := []messaging.Message{
		messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()}), messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()}),
	}
	if _, err := messagingtest.DeliverBatch(context.Background(), s, batch...); err != nil || followErr != nil {
		t.Fatalf("DeliverBatch = %v, the message its hook delivers: %v; want both handled", err, followErr)
	}
	labels := map[string]string{"consumer": otherName, "type": "Cancelled", "outcome": "ok"}
	if got := metricValue(t, b.registry, "consumer_handler_seconds", labels); got != 1 {
		t.Errorf("consumer_handler_seconds{consumer=%q,type=\"Cancelled\",outcome=\"ok\"} counts %v, want 1: the message its hook delivered", otherName, got)
	}
	if n := len(b.logs.Lines("message handled", "message_id="+follow.ID.String())); n != 1 {
		t.Errorf("%d \"message handled\" lines for %s, want 1", n, follow.ID)
	}
}
