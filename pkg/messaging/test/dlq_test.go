package test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A redrive that fails on a message (here its queue is deleted once the messages are held:
// the copy comes back unroutable) leaves that message, and every one it had not come to yet,
// in the dead-letter queue, in their order: the operator can run it again.
func TestAFailedRedriveLeavesTheDeadLetterQueueInOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	ids := fillDeadLetterQueue(t, b.ch, dlq, 40)
	moved, err := messaging.RedriveDeadLetters(context.Background(), messaging.DeadLetterConfig{URL: testenv.AMQPURL(), Queue: b.queue},
		messaging.DeadLetterSelection{
			Match: func(d messaging.DeadLetter) bool { return d.MessageID != ids[0] }, // all but the first
			Confirm: func([]messaging.DeadLetter, int) error {
				_, err := b.ch.QueueDelete(b.queue, false, false, false)
				return err
			},
		})
	if err == nil || len(moved) != 0 {
		t.Fatalf("redrive into a deleted queue moved %d messages, error %v: want none moved and an error", len(moved), err)
	}
	if held, first := drainInOrder(t, b.ch, dlq, ids); first >= 0 {
		t.Fatalf("after the failed redrive %s holds %d of the %d messages, the first out of order at %d", dlq, held, len(ids), first)
	}
}

// A listing's limit is an upper bound, not a size: a limit far above what waits (an operator's
// --limit 1000000000) lists what waits, and holds no room for the rest.
func TestAListingLimitAboveTheQueueListsWhatWaits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	ids := []string{uuid.NewString(), uuid.NewString()}
	for _, id := range ids {
		must(t, b.ch.PublishWithContext(context.Background(), "", dlq, true, false,
			amqp.Publishing{MessageId: id, Type: eventType, ContentType: "application/json", Body: []byte(`{}`)}))
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == len(ids) }, "the messages did not reach %s", dlq)
	listed, waiting, err := messaging.ListDeadLetters(context.Background(), messaging.DeadLetterConfig{URL: testenv.AMQPURL(), Queue: b.queue}, 1<<40)
	if err != nil || waiting != len(ids) || len(listed) != len(ids) {
		t.Fatalf("listed %d of %d waiting, error %v: want the %d that wait", len(listed), waiting, err, len(ids))
	}
}

// A drop removes one message, the first that matches, and shows its confirmation only that
// one, even when the dead-letter queue holds two copies of it (a message dead-lettered again
// after a crash before its acknowledgement): the second copy stays, in its place.
func TestADropShowsAndRemovesTheFirstMatchOnly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	twice, other := uuid.NewString(), uuid.NewString()
	ids := []string{other, twice, twice}
	for _, id := range ids {
		must(t, b.ch.PublishWithContext(context.Background(), "", dlq, true, false,
			amqp.Publishing{MessageId: id, Type: eventType, ContentType: "application/json", Body: []byte(`{}`)}))
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == len(ids) }, "the messages did not reach %s", dlq)
	var shown int
	_, err := messaging.DropDeadLetter(context.Background(), messaging.DeadLetterConfig{URL: testenv.AMQPURL(), Queue: b.queue},
		messaging.DeadLetterSelection{
			Match:   func(d messaging.DeadLetter) bool { return d.MessageID == twice },
			Confirm: func(picked []messaging.DeadLetter, _ int) error { shown = len(picked); return nil },
		})
	if err != nil || shown != 1 {
		t.Fatalf("drop showed %d messages to confirm, error %v: want the one it drops", shown, err)
	}
	got := make([]string, 0, len(ids))
	for _, d := range testenv.Drain(t, b.ch, dlq, 200*time.Millisecond) {
		got = append(got, d.MessageId)
	}
	if !slices.Equal(got, []string{other, twice}) {
		t.Fatalf("after the drop %s holds %q, want the other message and the second copy", dlq, got)
	}
}

// A drop whose acknowledgement went out but whose answer from the broker never came (the
// connection lost just then) may have removed the message: it returns the message all the
// same, the last record of it, with an error that says so. It used to return nothing.
func TestADropWhoseAnswerNeverComesReturnsItsMessage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	id := uuid.NewString()
	must(t, b.ch.PublishWithContext(context.Background(), "", dlq, true, false,
		amqp.Publishing{MessageId: id, Type: eventType, ContentType: "application/json", Body: []byte(`{"n":1}`)}))
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == 1 }, "the message did not reach %s", dlq)
	proxy := testenv.Proxy(t, testenv.AMQPHost(t))
	dropped, err := messaging.DropDeadLetter(context.Background(), messaging.DeadLetterConfig{URL: testenv.AMQPURLVia(t, proxy.Listen), Queue: b.queue},
		messaging.DeadLetterSelection{
			Match: func(d messaging.DeadLetter) bool { return d.MessageID == id },
			Confirm: func([]messaging.DeadLetter, int) error {
				// The broker's answers are held from here on, and the connection is lost a second later.
				if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"silence","type":"timeout","stream":"downstream","attributes":{"timeout":0}}`)); err != nil {
					return err
				}
				time.AfterFunc(time.Second, proxy.Stop)
				return nil
			},
		})
	if !errors.Is(err, messaging.ErrDropInDoubt) || dropped.MessageID != id || string(dropped.Body) != `{"n":1}` {
		t.Fatalf("a drop whose answer never came: %+v, %v; want the message and ErrDropInDoubt", dropped, err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, b.ch, dlq) == 0 }, "the acknowledged message is still in %s", dlq)
}

// A redrive interrupted while the broker does not confirm the copy under way (here the
// consumer queue's process is suspended once the messages are held: it takes the copy and
// confirms nothing) gives that confirm up a while after the interrupt, in doubt, and still
// hands back every message it holds in their order, that one among them, before its
// connection is closed. The consumer queue is a classic queue: the dead-letter queue's channel
// goes on answering while the queue's process is suspended.
func TestARedriveInterruptedWithoutAConfirmHandsBackInOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	queue := testenv.UniqueName("classic")
	dlq := messaging.DeadLetterQueue(queue)
	testenv.CleanupBroker(t, []string{queue, dlq}, nil)
	if _, err := b.ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ch.QueueDeclare(dlq, true, false, false, false, messaging.ConsumerTopology{Queue: queue}.DeadLetterArguments()); err != nil {
		t.Fatal(err)
	}
	ids := fillDeadLetterQueue(t, b.ch, dlq, 100) // beyond the 32 a quorum queue takes back in order at a close
	uri, err := amqp.ParseURI(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	// The process that suspends the queue's resumes it when it ends: at a message, or after 30 s.
	suspender := "outbox_test_" + strings.ReplaceAll(queue, "-", "_")
	t.Cleanup(func() { testenv.RabbitMQCtlQuietly("eval", fmt.Sprintf(`catch %s ! resume, ok.`, suspender)) })
	suspend := fmt.Sprintf(`{ok, Q} = rabbit_amqqueue:lookup(rabbit_misc:r(<<%q>>, queue, <<%q>>)), P = amqqueue:get_pid(Q),
		Self = self(), S = spawn(fun() -> erlang:suspend_process(P), Self ! suspended, receive _ -> ok after 30000 -> ok end end),
		register(%s, S), receive suspended -> ok after 5000 -> timeout end.`, uri.Vhost, queue, suspender)

	ctx, interrupt := context.WithCancel(context.Background())
	defer interrupt()
	var confirmed time.Time
	moved, err := messaging.RedriveDeadLetters(ctx, messaging.DeadLetterConfig{URL: testenv.AMQPURL(), Queue: queue},
		messaging.DeadLetterSelection{Confirm: func([]messaging.DeadLetter, int) error {
			if out := strings.TrimSpace(testenv.RabbitMQCtl(t, "eval", suspend)); out != "ok" {
				return fmt.Errorf("suspend %s: %s", queue, out)
			}
			// The first copy is published as this returns, and waits for its confirm.
			confirmed = time.Now()
			time.AfterFunc(2*time.Second, interrupt)
			return nil
		}})
	took := time.Since(confirmed) - 2*time.Second
	if !errors.Is(err, messaging.ErrRedriveInDoubt) || len(moved) != 0 {
		t.Fatalf("redrive interrupted without a confirm: moved %d, error %v; want none moved and the first in doubt", len(moved), err)
	}
	if held, first := drainInOrder(t, b.ch, dlq, ids); first >= 0 {
		t.Errorf("%v, %s after the interrupt: %s holds %d of the %d messages, the first out of order at %d; want them all in order",
			err, took.Round(time.Millisecond), dlq, held, len(ids), first)
	}
}

// fillDeadLetterQueue publishes n messages of new ids to dlq and waits until it holds them; it
// returns their ids in order.
func fillDeadLetterQueue(t *testing.T, ch *amqp.Channel, dlq string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	for i := range ids {
		ids[i] = uuid.NewString()
		must(t, ch.PublishWithContext(context.Background(), "", dlq, true, false,
			amqp.Publishing{MessageId: ids[i], Type: eventType, ContentType: "application/json", Body: []byte(`{}`)}))
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == n }, "the messages did not reach %s", dlq)
	return ids
}

// drainInOrder drains queue and compares its message ids with want: it returns how many it
// held, and where the first difference is (-1 when it held want, in order).
func drainInOrder(t *testing.T, ch *amqp.Channel, queue string, want []string) (held, first int) {
	t.Helper()
	got := make([]string, 0, len(want))
	for _, d := range testenv.Drain(t, ch, queue, 200*time.Millisecond) {
		got = append(got, d.MessageId)
	}
	if slices.Equal(got, want) {
		return len(got), -1
	}
	for first < min(len(got), len(want)) && got[first] == want[first] {
		first++
	}
	return len(got), first
}

// ListDeadLettersWith brakes as a redrive does: an error from BeforeTake, told how many wait,
// takes none (none comes back redelivered). Given no error, it calls Taken with how many it
// took, which is fewer than were counted when another client took some in between (here,
// BeforeTake itself), and returns those Match picks, of the first Limit.
func TestAListingWithASelectionBrakesAndCountsWhatItTook(t *testing.T) {
	t.Parallel()
	b := setup(t)
	dlq := messaging.DeadLetterQueue(b.queue)
	ids := fillDeadLetterQueue(t, b.ch, dlq, 6)
	cfg := messaging.DeadLetterConfig{URL: testenv.AMQPURL(), Queue: b.queue}
	brake := errors.New("too many")
	var told int
	_, _, err := messaging.ListDeadLettersWith(context.Background(), cfg, messaging.DeadLetterSelection{
		BeforeTake: func(waiting int) error { told = waiting; return brake },
		Taken:      func(int) { t.Error("Taken called after BeforeTake refused") },
	})
	if !errors.Is(err, brake) || told != 6 {
		t.Fatalf("a listing braked: %v, told %d waiting; want the brake's error, told 6", err, told)
	}
	for _, want := range ids {
		d, ok, err := b.ch.Get(dlq, false)
		if err != nil || !ok || d.MessageId != want || d.Redelivered {
			t.Fatalf("get from %s: %v, %v, message %q redelivered %v; want %s, never taken", dlq, ok, err, d.MessageId, d.Redelivered, want)
		}
	}
	other := testenv.Channel(t)
	must(t, b.ch.Close()) // the broker takes them back, in an order of its own
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, other, dlq) == 6 }, "the messages did not come back")

	taken := -1
	var elsewhere []string
	listed, waiting, err := messaging.ListDeadLettersWith(context.Background(), cfg, messaging.DeadLetterSelection{
		Limit: 5,
		BeforeTake: func(int) error {
			for range 2 { // another client takes 2 between the count and the take
				d, ok, err := other.Get(dlq, false)
				if err != nil || !ok {
					return fmt.Errorf("get from %s: %v, %w", dlq, ok, err)
				}
				elsewhere = append(elsewhere, d.MessageId)
			}
			return nil
		},
		Taken: func(n int) { taken = n },
		Match: func(d messaging.DeadLetter) bool { return d.MessageID != ids[5] },
	})
	if err != nil || waiting != 6 || taken != 4 {
		t.Fatalf("a listing of 5 with 2 of 6 taken meanwhile: %v, %d waiting, Taken(%d); want 6 waiting and Taken(4)", err, waiting, taken)
	}
	var want []string
	for _, id := range ids {
		if !slices.Contains(elsewhere, id) && id != ids[5] {
			want = append(want, id)
		}
	}
	got := make([]string, len(listed))
	for i, d := range listed {
		got[i] = d.MessageID
	}
	if !slices.Equal(slices.Sorted(slices.Values(got)), slices.Sorted(slices.Values(want))) {
		t.Errorf("listed %q, want those of the 4 taken that match, %q", got, want)
	}
}
