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

// A handler that succeeded in a transaction whose commit failed (a deferred constraint, a
// connection lost at the commit) did not handle its message: it counts as the commit's failure,
// and is not logged handled. One message's was counted "ok" and logged at once, before the
// commit, at every delivery until the message was dead-lettered.
func TestAHandlerWhoseCommitFailsIsNotCountedHandled(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	if err := b.db.DB.Exec(`CREATE TABLE parent (id int PRIMARY KEY);
		CREATE TABLE child (parent_id int REFERENCES parent DEFERRABLE INITIALLY DEFERRED)`).Error; err != nil {
		t.Fatal(err)
	}
	s := b.subscription(t, nil)
	must(t, messaging.Handle(s, b.placed, func(ctx context.Context, tx *gorm.DB, p placed, msg messaging.Message) error {
		return tx.Exec("INSERT INTO child VALUES (42)").Error // no parent 42: refused at the commit
	}))
	must(t, messaging.HandleBatch(s, b.cancels, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[cancelled]) error {
		return tx.Exec("INSERT INTO child VALUES (42)").Error
	}))
	ctx := context.Background()
	for _, msg := range []messaging.Message{messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()}), messagingtest.Message(t, b.cancels, cancelled{OrderID: uuid.New()})} {
		if _, err := messagingtest.Deliver(ctx, s, msg); err == nil || !strings.Contains(err.Error(), "commit inbox transaction") {
			t.Fatalf("Deliver of a %s = %v, want the commit's failure", msg.Type, err)
		}
		for outcome, want := range map[string]float64{"ok": 0, "error": 1} {
			if got := metricValue(t, b.registry, "consumer_handler_seconds", map[string]string{"consumer": b.name, "type": msg.Type, "outcome": outcome}); got != want {
				t.Errorf("consumer_handler_seconds{type=%q,outcome=%q} counts %v, want %v", msg.Type, outcome, got, want)
			}
		}
		if n := len(b.logs.Lines("message handled", "message_id="+msg.ID.String())); n != 0 {
			t.Errorf("%d \"message handled\" lines for the %s whose commit failed, want 0", n, msg.Type)
		}
	}
}

// A batch handler's time is shared out among its messages: the histogram's sum is the time the
// handler took, not that time once for every message of the batch.
func TestABatchHandlersTimeIsSharedOutAmongItsMessages(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, nil)
	const took = 200 * time.Millisecond
	must(t, messaging.HandleBatch(s, b.placed, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[placed]) error {
		time.Sleep(took) // the handler's time is what is measured
		return nil
	}))
	msgs := make([]messaging.Message, 10)
	for i := range msgs {
		msgs[i] = messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()})
	}
	if _, err := messagingtest.DeliverBatch(context.Background(), s, msgs...); err != nil {
		t.Fatal(err)
	}
	labels := map[string]string{"consumer": b.name, "type": "Placed", "outcome": "ok"}
	if n := metricValue(t, b.registry, "consumer_handler_seconds", labels); n != 10 {
		t.Fatalf("consumer_handler_seconds counts %v, want one per message, 10", n)
	}
	if sum := histogramSum(t, b.registry, "consumer_handler_seconds", labels); sum < took.Seconds() || sum > 2*took.Seconds() {
		t.Errorf("consumer_handler_seconds_sum = %.3f s, want the handler's %.1f s (and a margin), shared among the 10", sum, took.Seconds())
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

// Two batches that take the same two rows in opposite orders deadlock, and PostgreSQL aborts
// one (SQLSTATE 40P01), as the services' batch inserts count on (insertNewSQL in invoicing and
// in notification). The abort is neither the messages' fault nor an outage, so the consumer
// retries the batch's messages one by one (that split is tested apart), and each then commits
// once. Each batch is a Placed and a Cancelled, in opposite orders, whose handlers update their
// kind's row of tally; on the first attempt, a barrier keeps each batch from its second row
// until both hold their first.
func TestABatchAbortedInADeadlockIsRetriedOneByOne(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	must(t, b.db.DB.Exec("CREATE TABLE tally (kind text PRIMARY KEY, n int NOT NULL); INSERT INTO tally VALUES ('Placed', 0), ('Cancelled', 0)").Error)
	p, c := messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()}), messagingtest.Message(t, b.cancels, cancelled{OrderID: uuid.New()})
	p2, c2 := messagingtest.Message(t, b.placed, placed{OrderID: uuid.New()}), messagingtest.Message(t, b.cancels, cancelled{OrderID: uuid.New()})
	batches := [2][]messaging.Message{{p, c}, {c2, p2}}
	// held[i] closes once batch i holds its first row; crossing is the batches' first attempt,
	// the only one to wait at the barrier.
	held := [2]chan struct{}{make(chan struct{}), make(chan struct{})}
	var crossing atomic.Bool
	crossing.Store(true)
	work := func(ctx context.Context, tx *gorm.DB, msg messaging.Message) error {
		if err := tx.Exec("UPDATE tally SET n = n + 1 WHERE kind = ?", msg.Type).Error; err != nil {
			return err
		}
		if err := record(tx, msg); err != nil {
			return err
		}
		for i, batch := range batches {
			if !crossing.Load() || msg.ID != batch[0].ID {
				continue
			}
			close(held[i])
			select {
			case <-held[1-i]:
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(10 * time.Second):
				return errors.New("after 10 s, the other batch holds no row")
			}
		}
		return nil
	}
	s := b.subscription(t, nil)
	must(t, messaging.HandleBatch(s, b.placed, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[placed]) error {
		for _, d := range batch {
			if err := work(ctx, tx, d.Msg); err != nil {
				return err
			}
		}
		return nil
	}))
	must(t, messaging.HandleBatch(s, b.cancels, func(ctx context.Context, tx *gorm.DB, batch []messaging.Delivered[cancelled]) error {
		for _, d := range batch {
			if err := work(ctx, tx, d.Msg); err != nil {
				return err
			}
		}
		return nil
	}))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var errs [2]error
	var wg sync.WaitGroup
	for i, batch := range batches {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = messagingtest.DeliverBatch(ctx, s, batch...)
		}()
	}
	wg.Wait()
	crossing.Store(false)
	if (errs[0] == nil) == (errs[1] == nil) {
		t.Fatalf("DeliverBatch = %v and %v, want exactly one batch aborted", errs[0], errs[1])
	}
	failed := 0
	if errs[1] != nil {
		failed = 1
	}
	err := errs[failed]
	var coded interface{ SQLState() string }
	if !errors.As(err, &coded) || coded.SQLState() != "40P01" {
		t.Fatalf("the aborted batch: %v, want a deadlock, SQLSTATE 40P01", err)
	}
	if messaging.IsPermanent(err) || messaging.IsUnavailable(err) {
		t.Fatalf("the deadlock: IsPermanent=%v, IsUnavailable=%v; want neither, for its messages to be retried one by one, not dead-lettered",
			messaging.IsPermanent(err), messaging.IsUnavailable(err))
	}
	for _, msg := range batches[failed] { // as the consumer does after a failed batch
		if dup, err := messagingtest.Deliver(ctx, s, msg); err != nil || dup {
			t.Fatalf("%s message %s alone: Deliver = %v, %v; want it handled", msg.Type, msg.ID, dup, err)
		}
	}
	for i, batch := range batches {
		want := int64(1) // the batch PostgreSQL let through committed whole; the other's messages one by one
		if i == failed {
			want = 2
		}
		if got := testenv.Count(t, b.db.DB, "SELECT count(DISTINCT txid) FROM handled WHERE message_id IN (?, ?)", batch[0].ID, batch[1].ID); got != want {
			t.Errorf("batch %d (failed: %v) committed in %d transactions, want %d", i, i == failed, got, want)
		}
		for _, msg := range batch {
			if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM handled WHERE message_id = ?", msg.ID); n != 1 {
				t.Errorf("%s message %s handled %d times, want once", msg.Type, msg.ID, n)
			}
		}
	}
	if n := b.handled(t, "SELECT count(*) FROM tally t WHERE n <> (SELECT count(*) FROM handled h WHERE h.type = t.kind)"); n != 0 {
		t.Errorf("%d kinds' tally differs from their messages handled: the aborted batch's work was kept", n)
	}
}
