package test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
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
	// The batch's error names the messages it failed on, as the consumer's log line gives it:
	// the batch handler's run, by its size and first message; the plain handler's message.
	for _, c := range []struct {
		batch []messaging.Message
		names string
	}{
		{[]messaging.Message{goodP, badP}, "2 Placed messages, " + goodP.ID.String() + " first: "},
		{[]messaging.Message{goodC, badC}, "message " + badC.ID.String() + ": "},
	} {
		if _, err := messagingtest.DeliverBatch(ctx, s, c.batch...); err == nil || !strings.Contains(err.Error(), c.names) {
			t.Fatalf("DeliverBatch = %v, want the batch's error, naming %q", err, c.names)
		}
		for _, msg := range c.batch {
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

// A batch handler's error in a batch of several names the messages it was given: the run's
// size and first message, or the message alone in its run; with BatchByType, all its event's.
func TestABatchHandlersErrorNamesItsMessages(t *testing.T) {
	t.Parallel()
	for _, byType := range []bool{false, true} {
		t.Run(fmt.Sprintf("BatchByType=%v", byType), func(t *testing.T) {
			t.Parallel()
			b := setupSubscription(t)
			s := b.subscription(t, func(cfg *messaging.SubscriptionConfig) { cfg.BatchByType = byType })
			must(t, messaging.HandleBatch(s, b.placed, func(context.Context, *gorm.DB, []messaging.Delivered[placed]) error {
				return errors.New("refused")
			}))
			must(t, messaging.Handle(s, b.cancels, func(ctx context.Context, tx *gorm.DB, _ cancelled, msg messaging.Message) error {
				return record(tx, msg)
			}))
			p := func() messaging.Message { return messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()}) }
			c := messagingtest.Message(t, b.cancels, cancelled{OrderID: uuid.New()})
			p1, p2 := p(), p()
			want := "message " + p1.ID.String() + ": refused" // the run [p1] of [p1 c p2]
			if byType {
				want = "2 Placed messages, " + p1.ID.String() + " first: refused"
			}
			if _, err := messagingtest.DeliverBatch(context.Background(), s, p1, c, p2); err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("DeliverBatch = %v, want an error naming %q", err, want)
			}
		})
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

// Two batches that take the same rows in opposite orders deadlock, and PostgreSQL aborts one
// (SQLSTATE 40P01): its messages are then handled one by one, as the services' batch inserts
// count on (insertNewSQL in invoicing and in notification), each worked once and none
// dead-lettered. Two consumers of one database, a queue each, stand in for two workers of one
// queue, whose messages the broker, not the test, would share out. Each gets a batch of a
// Placed and a Cancelled, one in that order and one in the other, and each event's batch
// handler updates its kind's row of tally: a barrier keeps either from taking its second row
// before both hold their first. Only the batches wait there, not their messages tried one by
// one after, which would deadlock again.
//
// A gate, a message whose handler waits, keeps each consumer busy until its batch's two
// messages have been sent to it, so that it takes them together. But the client hands
// deliveries over one at a time, and the second may not be handed over yet when the consumer
// looks (see collect): a batch that comes apart says so at the barrier, lets the other through,
// and the test tries again with new messages.
func TestABatchAbortedInADeadlockIsRetriedOneByOne(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	must(t, b.db.DB.Exec("CREATE TABLE tally (kind text PRIMARY KEY, n int NOT NULL); INSERT INTO tally VALUES ('Placed', 0), ('Cancelled', 0)").Error)
	names := [2]string{b.name, testenv.UniqueName("sub")}
	testenv.CleanupBroker(t, []string{names[1], messaging.DeadLetterQueue(names[1])}, nil)
	// A round: for each consumer a gate, and a batch that takes its kinds in the consumer's order.
	type round struct {
		gates    [2]messaging.Message
		batches  [2][]messaging.Message
		gated    [2]chan struct{} // closed once the consumer's gate is in its handler
		gateOnce [2]sync.Once
		held     [2]chan struct{} // closed once the consumer's batch holds its first row
		apart    [2]chan struct{} // closed if the batch's first message came without the second
		crossing [2]atomic.Bool   // the batch has come to the barrier
		release  chan struct{}    // opens the gates
	}
	newRound := func() *round {
		r := &round{release: make(chan struct{})}
		p := func() messaging.Message { return messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()}) }
		c := func() messaging.Message { return messagingtest.Message(t, b.cancels, cancelled{OrderID: uuid.New()}) }
		// Each gate is of the kind its batch takes first: one of the other kind would wait, at
		// its UPDATE, for the other batch, held at the barrier until this one's comes.
		r.gates[0], r.batches[0] = p(), []messaging.Message{p(), c()}
		r.gates[1], r.batches[1] = c(), []messaging.Message{c(), p()}
		for i := range 2 {
			r.gated[i], r.held[i], r.apart[i] = make(chan struct{}), make(chan struct{}), make(chan struct{})
		}
		return r
	}
	var current atomic.Pointer[round]
	// await waits up to 10 s for ch to close, or or (nil: never).
	await := func(ctx context.Context, what string, ch, or <-chan struct{}) error {
		select {
		case <-ch:
		case <-or:
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Second):
			return fmt.Errorf("after 10 s: %s", what)
		}
		return nil
	}
	work := func(ctx context.Context, i int, tx *gorm.DB, msgs []messaging.Message) error {
		r := current.Load()
		gate := msgs[0].ID == r.gates[i].ID
		if gate {
			r.gateOnce[i].Do(func() { close(r.gated[i]) })
			if err := await(ctx, "the gate was not opened", r.release, nil); err != nil {
				return err
			}
		}
		if err := tx.Exec("UPDATE tally SET n = n + ? WHERE kind = ?", len(msgs), msgs[0].Type).Error; err != nil {
			return err
		}
		for _, msg := range msgs {
			if err := record(tx, msg); err != nil {
				return err
			}
		}
		if msgs[0].ID != r.batches[i][0].ID || !r.crossing[i].CompareAndSwap(false, true) {
			return nil
		}
		// The batch's first message: its transaction holds the second too if it claimed it.
		var claimed int64
		if err := tx.Raw("SELECT count(*) FROM inbox_messages WHERE message_id = ? AND consumer = ?", r.batches[i][1].ID, names[i]).Scan(&claimed).Error; err != nil {
			return err
		}
		if claimed == 0 {
			close(r.apart[i])
			return nil
		}
		close(r.held[i])
		return await(ctx, "the other batch neither took its first row nor came apart", r.held[1-i], r.apart[1-i])
	}
	// Each consumer's queue gets its own messages, straight through the default exchange. Each
	// is confirmed, so in its queue already when the test looks there: a quorum queue counts a
	// message only once it is in, and the count would say none wait before they had come.
	confirms := testenv.Channel(t)
	must(t, confirms.Confirm(false))
	send := func(queue string, msg messaging.Message) {
		dc, err := confirms.PublishWithDeferredConfirmWithContext(context.Background(), "", queue, true, false, publishing(msg))
		must(t, err)
		if !dc.Wait() {
			t.Fatalf("the broker refused message %s", msg.ID)
		}
	}
	var stops [2]func() error
	for i, name := range names {
		s := b.subscription(t, func(c *messaging.SubscriptionConfig) {
			c.Name, c.Concurrency = name, 1
			c.RetryBackoff = messaging.Backoff{Base: 20 * time.Millisecond, Max: 200 * time.Millisecond}
		})
		must(t, messaging.HandleBatch(s, b.placed, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[placed]) error {
			return work(ctx, i, tx, envelopes(batch))
		}))
		must(t, messaging.HandleBatch(s, b.cancels, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[cancelled]) error {
			return work(ctx, i, tx, envelopes(batch))
		}))
		stops[i] = start(t, s.Run)
		testenv.Eventually(t, 10*time.Second, s.Ready, "consumer %s not ready", name)
	}
	settled := func(queue, outcome string) float64 {
		return metricValue(t, b.registry, "consumer_messages_total", map[string]string{"queue": queue, "outcome": outcome})
	}

	const rounds = 10
	var all []messaging.Message
	var r *round
	for n := 1; ; n++ {
		r = newRound()
		current.Store(r)
		for i, name := range names {
			send(name, r.gates[i])
			all = append(all, r.gates[i])
		}
		for i, name := range names {
			must(t, await(context.Background(), "consumer "+name+" did not take its gate", r.gated[i], nil))
		}
		for i, name := range names {
			for _, msg := range r.batches[i] {
				send(name, msg)
			}
			all = append(all, r.batches[i]...)
		}
		testenv.Eventually(t, 10*time.Second, func() bool {
			return testenv.QueueDepth(t, b.ch, names[0]) == 0 && testenv.QueueDepth(t, b.ch, names[1]) == 0
		}, "the batches' messages did not reach their consumers")
		close(r.release)
		testenv.Eventually(t, 20*time.Second, func() bool {
			for _, name := range names {
				if settled(name, "acked")+settled(name, "dead_lettered") < float64(3*n) {
					return false
				}
			}
			return true
		}, "not every message of round %d was settled", n)
		if len(b.logs.Lines("batch failed")) > 0 {
			break
		}
		apart := 0
		for i := range 2 {
			select {
			case <-r.apart[i]:
				apart++
			default:
			}
		}
		if apart == 0 {
			break // both batches came whole, and neither failed: the assertions below say so
		}
		if n == rounds {
			t.Fatalf("in each of %d rounds a batch came apart: no two batches to cross", rounds)
		}
		t.Logf("round %d: %d of the 2 batches came apart; trying again", n, apart)
	}
	for i, stop := range stops {
		if err := stop(); err != nil {
			t.Fatalf("Run of %s = %v, want nil", names[i], err)
		}
	}

	failed := b.logs.Lines("batch failed; processing its messages one by one")
	if len(failed) != 1 || !strings.Contains(failed[0], "SQLSTATE 40P01") || !strings.Contains(failed[0], "size=2") {
		t.Fatalf("want one batch of 2 failed, on a deadlock (SQLSTATE 40P01), got %q", failed)
	}
	for _, msg := range all {
		if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM handled WHERE message_id = ?", msg.ID); n != 1 {
			t.Errorf("%s message %s worked %d times, want once", msg.Type, msg.ID, n)
		}
	}
	if n := b.handled(t, "SELECT count(*) FROM tally t WHERE n <> (SELECT count(*) FROM handled h WHERE h.type = t.kind)"); n != 0 {
		t.Errorf("%d kinds' tally differs from their messages handled: the aborted batch's work was kept, or a message's done twice", n)
	}
	for i, name := range names {
		// The batch PostgreSQL let through committed whole; the aborted one's messages, one by one.
		want := int64(1)
		if strings.Contains(failed[0], "queue="+name+" ") {
			want = 2
		}
		if got := testenv.Count(t, b.db.DB, "SELECT count(DISTINCT txid) FROM handled WHERE message_id IN (?, ?)", r.batches[i][0].ID, r.batches[i][1].ID); got != want {
			t.Errorf("the batch of %s committed in %d transactions, want %d", name, got, want)
		}
		if got, want := settled(name, "acked"), float64(len(all)/2); got != want {
			t.Errorf("%v of the %v messages of %s acked, want all", got, want, name)
		}
		if dead := deadLetters(t, b.ch, name); len(dead) != 0 {
			t.Errorf("%d messages of %s dead-lettered, want none: %v", len(dead), name, reasonsByID(dead))
		}
		wantNothingRequeued(t, b.testBundle, name)
		// Acknowledged: with the consumer gone, nothing comes back.
		if back := testenv.Drain(t, b.ch, name, 200*time.Millisecond); len(back) != 0 {
			t.Errorf("%d messages back in %s after the consumer stopped, want none", len(back), name)
		}
	}
	if lines := b.logs.Lines("retrying message"); len(lines) != 0 {
		t.Errorf("a message tried one by one failed again: %q", lines)
	}
}

// envelopes lists the messages of a batch handler's batch.
func envelopes[T any](batch []messaging.Delivered[T]) []messaging.Message {
	msgs := make([]messaging.Message, len(batch))
	for i, d := range batch {
		msgs[i] = d.Msg
	}
	return msgs
}
