package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// placed is the event of the redrive test.
type placed struct {
	OrderID uuid.UUID `json:"order_id"`
}

// background runs fn until the test ends, and checks it then stops within 10 s.
func background(t *testing.T, fn func(ctx context.Context) error) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	var once atomic.Bool
	stop = func() {
		if once.Swap(true) {
			return
		}
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run returned %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("did not stop within 10 s")
		}
	}
	t.Cleanup(stop)
	return stop
}

// brokerNames returns a fresh exchange and queue, deleted with their dead-letter queue when
// the test ends.
func brokerNames(t *testing.T) (exchange, queue string) {
	t.Helper()
	exchange, queue = testenv.UniqueName("orders"), testenv.UniqueName("ctl")
	testenv.CleanupBroker(t, []string{queue, messaging.DeadLetterQueue(queue)}, []string{exchange})
	return exchange, queue
}

func publishTo(t *testing.T, ch *amqp.Channel, exchange, key string, p amqp.Publishing) {
	t.Helper()
	if err := ch.PublishWithContext(context.Background(), exchange, key, true, false, p); err != nil {
		t.Fatal(err)
	}
}

// listed returns the message ids of a dlq list, in the order printed.
func listed(t *testing.T, out string) []string {
	t.Helper()
	var ids []string
	rows := false
	for line := range strings.SplitSeq(out, "\n") {
		switch {
		case strings.HasPrefix(line, "MESSAGE ID"):
			rows = true
		case rows && line == "": // the table ends; a note may follow
			return ids
		case rows:
			ids = append(ids, strings.Fields(line)[0])
		}
	}
	return ids
}

func deliveryIDs(deliveries []amqp.Delivery) []string {
	ids := make([]string, len(deliveries))
	for i, d := range deliveries {
		ids[i] = d.MessageId
	}
	return ids
}

// deadLettered fills queue's dead-letter queue with six messages and returns their ids in
// queue order: five a consumer dead-lettered with its reason, then one the broker dead-lettered
// itself, over the queue's delivery limit.
func deadLettered(t *testing.T) (queue string, ch *amqp.Channel, ids []string) {
	t.Helper()
	exchange, queue := brokerNames(t)
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{
		{Queue: queue, Bindings: []messaging.Binding{{Exchange: exchange, RoutingKey: "OrderPlaced"}}, DeliveryLimit: 2}}}
	if err := topology.Declare(testenv.Connection(t), nil); err != nil {
		t.Fatal(err)
	}
	ch = testenv.Channel(t)
	db := testenv.NewDatabase(t)
	db.MigrateLibrary(t)
	log, _ := testenv.NewLogger(t)
	// One message at a time, so that they are dead-lettered in the order they came.
	c, err := messaging.NewSubscription(db.Driver(t), messaging.SubscriptionConfig{Name: queue, URL: testenv.AMQPURL(), Topology: topology, Logger: log, Concurrency: 1})
	if err != nil {
		t.Fatal(err)
	}
	refuse := func(_ context.Context, _ *gorm.DB, _ json.RawMessage, msg messaging.Message) error {
		return messaging.Permanent(fmt.Errorf("cannot invoice order of message %s", msg.ID))
	}
	if err := messaging.Handle(c, messaging.Event[json.RawMessage]{Exchange: exchange, Type: "OrderPlaced"}, refuse); err != nil {
		t.Fatal(err)
	}
	stop := background(t, c.Run)
	dlq := messaging.DeadLetterQueue(queue)
	for range 5 {
		id := uuid.NewString()
		ids = append(ids, id)
		publishTo(t, ch, exchange, "OrderPlaced", amqp.Publishing{MessageId: id, Type: "OrderPlaced", ContentType: "application/json", Body: []byte(`{}`)})
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == 5 }, "the consumer did not dead-letter 5 messages")
	stop()

	last := uuid.NewString()
	ids = append(ids, last)
	publishTo(t, ch, exchange, "OrderPlaced", amqp.Publishing{MessageId: last, Type: "OrderPlaced", ContentType: "application/json", Body: []byte(`{}`)})
	// Handed back more often than the limit of 2 allows, the broker dead-letters it itself.
	testenv.Eventually(t, 10*time.Second, func() bool {
		if d, ok, err := ch.Get(queue, false); err == nil && ok {
			_ = d.Reject(true) // RabbitMQ 4.3 counts rejects towards the limit, not nacks
		}
		return testenv.QueueDepth(t, ch, dlq) == 6
	}, "the broker did not dead-letter the message over the delivery limit")
	return queue, ch, ids
}

// deadMessage is a message as a consumer dead-letters it: of type msgType, with its reason.
func deadMessage(msgType, reason string) amqp.Publishing {
	id := uuid.NewString()
	return amqp.Publishing{MessageId: id, Type: msgType, ContentType: "application/json", Body: []byte(`{"id":"` + id + `"}`),
		Headers: amqp.Table{messaging.HeaderDeadLetterReason: reason, messaging.HeaderDeadLetteredAt: time.Now().UTC().Format(time.RFC3339Nano)}}
}

// fillDLQ declares a fresh consumer queue and its dead-letter queue, puts msgs in the
// dead-letter queue, in order, and returns the queue's name and the messages' ids.
func fillDLQ(t *testing.T, msgs ...amqp.Publishing) (queue string, ids []string) {
	t.Helper()
	_, queue = brokerNames(t)
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: queue}}}
	if err := topology.Declare(testenv.Connection(t), nil); err != nil {
		t.Fatal(err)
	}
	ch := testenv.Channel(t)
	dlq := messaging.DeadLetterQueue(queue)
	for _, m := range msgs {
		publishTo(t, ch, "", dlq, m)
		ids = append(ids, m.MessageId)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == len(msgs) }, "the dead-letter queue did not fill")
	return queue, ids
}

// fillDLQOf fills a fresh dead-letter queue, as fillDLQ, with n messages of type OrderPlaced
// dead-lettered for "no price".
func fillDLQOf(t *testing.T, n int) (queue string, ids []string) {
	t.Helper()
	msgs := make([]amqp.Publishing, n)
	for i := range msgs {
		msgs[i] = deadMessage("OrderPlaced", "no price")
	}
	return fillDLQ(t, msgs...)
}

// lowerMostWithoutLimit sets mostWithoutLimit to most until t ends. A test that calls it
// cannot run in parallel.
func lowerMostWithoutLimit(t *testing.T, most int) {
	before := mostWithoutLimit
	mostWithoutLimit = most
	t.Cleanup(func() { mostWithoutLimit = before })
}

// wantRefusal runs outboxctl with args on the broker at amqpURL and wants it to exit 2 with
// want in its stderr, and nothing on stdout.
func wantRefusal(t *testing.T, args []string, amqpURL string, want ...string) {
	t.Helper()
	if stdout := wantExit(t, exitUsage, append(args, "--amqp", amqpURL), want...); stdout != "" {
		t.Errorf("outboxctl %s: stdout %q; want nothing", strings.Join(args, " "), stdout)
	}
}

// wantNeverTaken gets the messages of ids from dlq, in that order, and wants each of them never
// delivered before, then hands them back.
func wantNeverTaken(t *testing.T, dlq string, ids []string) {
	t.Helper()
	ch := testenv.Channel(t)
	for _, want := range ids {
		d, ok, err := ch.Get(dlq, false)
		if err != nil || !ok || d.MessageId != want || d.Redelivered {
			t.Fatalf("get from %s: %v, %v, message %q redelivered %v; want %s, never taken", dlq, ok, err, d.MessageId, d.Redelivered, want)
		}
	}
	if err := ch.Close(); err != nil { // the broker takes them back
		t.Fatal(err)
	}
}

// inDLQ lists the whole dead-letter queue of queue through outboxctl: the ids, in order.
func inDLQ(t *testing.T, queue string) []string {
	t.Helper()
	return ids2(okJSON[dlqResult](t, "dlq", "list", queue, "--limit", "0", "--amqp", testenv.AMQPURL()).Messages)
}

// Listing takes nothing away and changes no order: twice, with the flags before and after the
// queue name (the second through a list of two brokers, one down), then the queue is drained and
// holds the same messages in the same order.
func TestDlqListLosesAndReordersNothing(t *testing.T) {
	t.Parallel()
	queue, ch, ids := deadLettered(t)
	first := ok(t, "dlq", "list", queue, "--amqp", testenv.AMQPURL())
	// --amqp takes one URL per cluster node, as AMQP_URL does; a node that is down is passed over.
	down := testenv.Proxy(t, testenv.AMQPHost(t))
	down.Stop()
	second := ok(t, "dlq", "list", "--amqp", testenv.AMQPURLVia(t, down.Listen)+","+testenv.AMQPURL(), queue)
	if first != second {
		t.Fatalf("two listings differ:\n%s\n%s", first, second)
	}
	if got := listed(t, first); !slices.Equal(got, ids) {
		t.Fatalf("listed %q, want %q in that order:\n%s", got, ids, first)
	}
	for _, want := range []string{
		"6 messages in " + messaging.DeadLetterQueue(queue),
		ids[0] + "  OrderPlaced", "cannot invoice order of message " + ids[0],
		"delivery_limit: dead-lettered by the broker from queue " + queue,
	} {
		if !strings.Contains(first, want) {
			t.Errorf("listing lacks %q:\n%s", want, first)
		}
	}
	res := okJSON[dlqResult](t, "dlq", "list", queue, "--amqp", testenv.AMQPURL())
	if res.DryRun != nil || res.Queue != queue || res.DeadLetterQueue != messaging.DeadLetterQueue(queue) || res.Waiting != 6 || res.Examined != 6 ||
		res.Count != 6 || res.Messages[5].MessageID != ids[5] || !strings.HasPrefix(res.Messages[5].Reason, "delivery_limit") ||
		res.Messages[0].DeadLetteredAt == nil || res.Messages[0].Headers != nil || res.Messages[0].Body != nil {
		t.Errorf("dlq list -o json: %+v", res)
	}
	drained := testenv.Drain(t, ch, messaging.DeadLetterQueue(queue), 200*time.Millisecond)
	if got := deliveryIDs(drained); !slices.Equal(got, ids) {
		t.Fatalf("after listing, the dead-letter queue holds %q, want %q", got, ids)
	}
	if out := ok(t, "dlq", "list", queue, "--amqp", testenv.AMQPURL()); !strings.Contains(out, "no message ready in "+messaging.DeadLetterQueue(queue)) {
		t.Errorf("listing an empty dead-letter queue: %q", out)
	}
	wantExit(t, exitFailure, []string{"dlq", "list", "no_such_queue", "--amqp", testenv.AMQPURL()}, `"no_such_queue.dlq"`)
	// After --, a name that looks like a flag is the queue's.
	wantExit(t, exitFailure, []string{"dlq", "list", "--amqp", testenv.AMQPURL(), "--", "-odd-name"}, `"-odd-name.dlq"`)
}

// --limit N lists the first N messages and takes no others: only those come back redelivered,
// and none is lost.
func TestDlqListTakesNoMoreThanTheLimit(t *testing.T) {
	t.Parallel()
	var msgs []amqp.Publishing
	for range 6 {
		msgs = append(msgs, deadMessage("OrderPlaced", "cannot invoice"))
	}
	queue, ids := fillDLQ(t, msgs...)
	dlq := messaging.DeadLetterQueue(queue)
	out := ok(t, "dlq", "list", queue, "--limit", "2", "--amqp", testenv.AMQPURL())
	if got := listed(t, out); !slices.Equal(got, ids[:2]) || !strings.Contains(out, "the first 2 of the 6 messages in "+dlq+" (--limit)") {
		t.Errorf("dlq list --limit 2 listed %q:\n%s", got, out)
	}
	// The messages handed back may have moved behind the others (RabbitMQ 3.x): the next
	// listing takes the first 2 of the queue as it is now.
	res := okJSON[dlqResult](t, "dlq", "list", "--limit=2", queue, "--amqp", testenv.AMQPURL())
	if res.Waiting != 6 || res.Examined != 2 || res.Count != 2 {
		t.Errorf("dlq list --limit 2 -o json: %+v", res)
	}
	taken := []string{ids[0], ids[1], res.Messages[0].MessageID, res.Messages[1].MessageID}
	drained := testenv.Drain(t, testenv.Channel(t), dlq, 200*time.Millisecond)
	if got := deliveryIDs(drained); !sameSet(got, ids) {
		t.Fatalf("the dead-letter queue holds %q, want %q", got, ids)
	}
	for _, d := range drained {
		if d.Redelivered != slices.Contains(taken, d.MessageId) {
			t.Errorf("message %s: redelivered=%v; only those listed (%q) were to be taken", d.MessageId, d.Redelivered, taken)
		}
	}
}

// sameSet reports whether a and b hold the same ids, in any order.
func sameSet(a, b []string) bool {
	return slices.Equal(slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b)))
}

// --type and --reason pick what is shown; --show-headers and --show-body show the rest of each
// message, safe for a terminal in a table and whole in -o json.
func TestDlqListFiltersAndShowsBodiesAndHeaders(t *testing.T) {
	t.Parallel()
	a1, b, a2 := deadMessage("OrderPlaced", "the Price List is missing"), deadMessage("OrderCancelled", "no such order"), deadMessage("OrderPlaced", "no such customer")
	a2.Body = []byte("line one\nline two \x1b[31mred\x1b[0m")
	binary := deadMessage("OrderPlaced", "undecodable")
	binary.Body, binary.ContentType = []byte{0xff, 0xfe, 0x00, 0x01}, "application/octet-stream"
	queue, ids := fillDLQ(t, a1, b, a2, binary)
	amqpURL := testenv.AMQPURL()

	if got := listed(t, ok(t, "dlq", "list", queue, "--type", "OrderPlaced", "--amqp", amqpURL)); !slices.Equal(got, []string{ids[0], ids[2], ids[3]}) {
		t.Errorf("--type OrderPlaced listed %q", got)
	}
	out := ok(t, "dlq", "list", queue, "--type", "OrderPlaced", "--reason", "PRICE LIST", "--amqp", amqpURL)
	if got := listed(t, out); !slices.Equal(got, ids[:1]) || !strings.Contains(out, `1 of the 4 messages in `+messaging.DeadLetterQueue(queue)+` match --type "OrderPlaced" --reason "PRICE LIST", in queue order:`) {
		t.Errorf("--type and --reason listed %q:\n%s", got, out)
	}
	if out := ok(t, "dlq", "list", queue, "--type", "Nothing", "--amqp", amqpURL); !strings.Contains(out, "0 of the 4 messages") || len(listed(t, out)) != 0 {
		t.Errorf("a filter that matches nothing: %q", out)
	}

	out = ok(t, "dlq", "list", queue, "--show-body", "--show-headers", "--amqp", amqpURL)
	for _, want := range []string{
		"message " + ids[0], `{"id":"` + ids[0] + `"}`, messaging.HeaderDeadLetterReason + ": the Price List is missing",
		// Escape sequences would act on the terminal: such a body is shown exactly, in base64.
		"body (application/json, 30 bytes):\n    base64: bGluZSBvbmUKbGluZSB0d28gG1szMW1yZWQbWzBt",
		"body (application/octet-stream, 4 bytes):\n    base64: //4AAQ==",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("--show-body --show-headers lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "\x1b") {
		t.Errorf("a body's escape sequence reached the terminal:\n%q", out)
	}
	res := okJSON[dlqResult](t, "dlq", "list", queue, "--show-body", "--show-headers", "--amqp", amqpURL)
	if len(res.Messages) != 4 || deref(res.Messages[2].Body) != string(a2.Body) || deref(res.Messages[3].BodyBase64) != "//4AAQ==" ||
		res.Messages[3].Body != nil || headersOf(res.Messages[0])[messaging.HeaderDeadLetterReason] != "the Price List is missing" ||
		res.Messages[3].ContentType != "application/octet-stream" {
		t.Errorf("dlq list --show-body --show-headers -o json: %+v", res)
	}
	if got := inDLQ(t, queue); !slices.Equal(got, ids) {
		t.Errorf("after the listings the dead-letter queue holds %q, want %q", got, ids)
	}
}

// A redriven message is the message as first published: the same id, type and body, without
// the headers of its dead-lettering (x-death, the reason, the delivery count).
func TestDlqRedriveRestoresTheMessage(t *testing.T) {
	t.Parallel()
	queue, ch, ids := deadLettered(t)
	out := ok(t, "dlq", "redrive", queue, "--id", ids[5], "--amqp", testenv.AMQPURL())
	if !strings.Contains(out, "redriven "+ids[5]+" OrderPlaced") || !strings.Contains(out, "moved 1 messages") {
		t.Errorf("redrive said %q", out)
	}
	out = ok(t, "dlq", "redrive", "--id", strings.ToUpper(ids[0]), queue, "--amqp", testenv.AMQPURL())
	if !strings.Contains(out, "redriven "+ids[0]) {
		t.Errorf("redrive of an id in capitals said %q", out)
	}
	back := testenv.Drain(t, ch, queue, 200*time.Millisecond)
	if got := deliveryIDs(back); !slices.Equal(got, []string{ids[5], ids[0]}) {
		t.Fatalf("the queue holds %q, want the two redriven", got)
	}
	for _, d := range back {
		if d.Type != "OrderPlaced" || string(d.Body) != "{}" || d.ContentType != "application/json" {
			t.Errorf("redriven %s: type %q, body %q, content type %q changed", d.MessageId, d.Type, d.Body, d.ContentType)
		}
		for _, h := range []string{"x-death", messaging.HeaderDeadLetterReason, messaging.HeaderDeadLetteredAt, messaging.HeaderOriginalExchange} {
			if _, ok := d.Headers[h]; ok {
				t.Errorf("redriven %s still carries %s", d.MessageId, h)
			}
		}
	}
	rest := testenv.Drain(t, ch, messaging.DeadLetterQueue(queue), 200*time.Millisecond)
	if got := deliveryIDs(rest); !slices.Equal(got, ids[1:5]) {
		t.Fatalf("the dead-letter queue holds %q, want the others in their order %q", got, ids[1:5])
	}
}

// --dry-run lists what would move and moves nothing; --type, --reason and --limit pick what
// moves; at a terminal, a no moves nothing and a yes moves them (without a terminal they move:
// TestDlqRedriveIntoASubscription).
func TestDlqRedriveDryRunFiltersLimitAndConfirmation(t *testing.T) {
	t.Parallel()
	msgs := []amqp.Publishing{
		deadMessage("OrderPlaced", "the price list is missing"), deadMessage("OrderCancelled", "no such order"),
		deadMessage("OrderPlaced", "the price list is missing"), deadMessage("OrderPlaced", "no such customer"),
		deadMessage("OrderPlaced", "the price list is missing"), deadMessage("OrderCancelled", "the price list is missing"),
	}
	queue, ids := fillDLQ(t, msgs...)
	amqpURL, dlq := testenv.AMQPURL(), messaging.DeadLetterQueue(queue)
	ch := testenv.Channel(t)
	reasons := map[string]string{}
	types := map[string]string{}
	for _, m := range msgs {
		reasons[m.MessageId], types[m.MessageId] = m.Headers[messaging.HeaderDeadLetterReason].(string), m.Type
	}
	// pick returns those of ids whose reason has "price", and of type msgType unless it is "".
	pick := func(ids []string, msgType string) []string {
		return slices.DeleteFunc(slices.Clone(ids), func(id string) bool {
			return !strings.Contains(reasons[id], "price") || (msgType != "" && types[id] != msgType)
		})
	}
	noneMoved := func(what string, want []string) {
		t.Helper()
		if got := inDLQ(t, queue); !slices.Equal(got, want) {
			t.Fatalf("after %s the dead-letter queue holds %q, want %q", what, got, want)
		}
		if n := testenv.QueueDepth(t, ch, queue); n != 0 {
			t.Fatalf("after %s %d messages are in %s", what, n, queue)
		}
	}

	out := ok(t, "dlq", "redrive", queue, "--dry-run", "--amqp", amqpURL)
	if got := listed(t, out); !slices.Equal(got, ids) || !strings.Contains(out, "would move 6 of the 6 messages in "+dlq+" to "+queue+" (dry run") {
		t.Errorf("redrive --dry-run listed %q:\n%s", got, out)
	}
	noneMoved("a dry run", ids)
	dry := okJSON[dlqResult](t, "dlq", "redrive", queue, "--reason", "PRICE", "--type", "OrderPlaced", "--limit", "3", "--dry-run", "--amqp", amqpURL)
	if want := pick(ids[:3], "OrderPlaced"); dry.DryRun == nil || !*dry.DryRun || dry.Waiting != 6 || dry.Examined != 3 || dry.Count != len(want) ||
		!slices.Equal(ids2(dry.Messages), want) {
		t.Errorf("redrive --dry-run -o json: %+v; want %q of the first 3", dry, want)
	}
	// Handed back, the 3 taken may have moved behind the others: the order is the queue's now.
	order := inDLQ(t, queue)
	if !sameSet(order, ids) {
		t.Fatalf("after a dry run of --limit 3 the dead-letter queue holds %q, want %q in any order", order, ids)
	}
	noneMoved("a dry run", order)

	wantExit(t, exitNoMatch, []string{"dlq", "redrive", queue, "--type", "Nothing", "--yes", "--amqp", amqpURL}, `no message of type "Nothing" in `+dlq)
	wantExit(t, exitNoMatch, []string{"dlq", "redrive", queue, "--reason", "no such order", "--limit", "1", "--yes", "--amqp", amqpURL},
		"in "+dlq+" (of the first 1 messages, --limit)")
	noneMoved("no match", inDLQ(t, queue))
	order = inDLQ(t, queue)
	if code, stdout, stderr := ctlAt(t, &terminal{"no\n"}, "dlq", "redrive", queue, "--reason", "price", "--amqp", amqpURL); code != exitNotConfirmed ||
		!strings.Contains(stderr, ids[4]) || !strings.Contains(stderr, "? [y/N]") || stdout != "" {
		t.Errorf("redrive declined at a terminal: exit %d, stdout %q, stderr %q; want 4, asked, nothing on stdout", code, stdout, stderr)
	}
	if code, stdout, _ := ctlAt(t, &terminal{"no\n"}, "dlq", "redrive", queue, "--reason", "price", "--amqp", amqpURL, "-o", "json"); code != exitNotConfirmed ||
		!strings.Contains(stdout, `"messages": []`) || decode[dlqResult](t, stdout).Count != 0 {
		t.Errorf("redrive declined at a terminal, -o json: exit %d, stdout %q; want 4 and no message moved, as an empty list", code, stdout)
	}
	noneMoved("a refusal", order)

	// Of the first 3 looked at, those whose reason matches move; then, asked and confirmed,
	// the other such.
	first := pick(order[:3], "")
	res := okJSON[dlqResult](t, "dlq", "redrive", queue, "--reason", "price", "--limit", "3", "--yes", "--amqp", amqpURL)
	if res.DryRun == nil || *res.DryRun || !slices.Equal(ids2(res.Messages), first) || res.Count != len(first) {
		t.Errorf("redrive --reason --limit 3 -o json: %+v; want %q", res, first)
	}
	rest := pick(inDLQ(t, queue), "")
	code, stdout, stderr := ctlAt(t, &terminal{"y\n"}, "dlq", "redrive", queue, "--reason", "price", "--amqp", amqpURL)
	if code != 0 || !strings.Contains(stdout, fmt.Sprintf("moved %d messages from %s to %s", len(rest), dlq, queue)) {
		t.Errorf("redrive confirmed at a terminal: exit %d, %q %q", code, stdout, stderr)
	}
	if got, want := drainIDs(t, queue), append(slices.Clone(first), rest...); !slices.Equal(got, want) {
		t.Errorf("the queue got %q, want %q", got, want)
	}
	if got := inDLQ(t, queue); !sameSet(got, []string{ids[1], ids[3]}) {
		t.Errorf("the dead-letter queue holds %q, want the two others", got)
	}
}

// A --limit of 0, as a script's --limit "$N" with N computed as 0 gives it, is a usage error
// that moves nothing: left out, a redrive moves every message, and 0 must not do the same.
func TestDlqRedriveRefusesALimitOfZero(t *testing.T) {
	t.Parallel()
	queue, ids := fillDLQ(t, deadMessage("OrderPlaced", "no price"), deadMessage("OrderPlaced", "no price"), deadMessage("OrderPlaced", "no price"))
	for _, limit := range []string{"0", "-1"} {
		// No terminal: without the check, the redrive would go on without asking.
		code, stdout, stderr := ctl(t, "dlq", "redrive", queue, "--limit", limit, "--amqp", testenv.AMQPURL())
		if code != exitUsage || stdout != "" || !strings.Contains(stderr, "--limit "+limit+": want 1 or more, or leave it out for all") {
			t.Errorf("redrive --limit %s: exit %d, stdout %q, stderr %q; want 2 naming --limit", limit, code, stdout, stderr)
		}
	}
	if got := inDLQ(t, queue); !slices.Equal(got, ids) {
		t.Errorf("after redrive --limit 0 the dead-letter queue holds %q, want all 3: %q", got, ids)
	}
	if n := testenv.QueueDepth(t, testenv.Channel(t), queue); n != 0 {
		t.Errorf("after redrive --limit 0, %d messages are in %s, want none", n, queue)
	}
}

// Without --limit, dlq redrive and dlq drop take at most mostWithoutLimit messages: with more
// waiting they refuse before taking any (each taken is held in memory until the command ends),
// exit 2 naming the --limit that takes them all (a filtered redrive or an --id with a smaller
// one would look at the first N only, each run again the same), and change nothing, dry run or
// not. With --limit, or with no more than that many waiting, they go on. Not parallel: it
// lowers mostWithoutLimit to 3, so that 4 messages stand for the tens of thousands.
func TestDlqRedriveAndDropWithoutALimitRefuseAQueueTooLongToHold(t *testing.T) {
	lowerMostWithoutLimit(t, 3)
	queue, ids := fillDLQOf(t, 4)
	amqpURL, dlq := testenv.AMQPURL(), messaging.DeadLetterQueue(queue)
	for _, args := range [][]string{
		{"dlq", "redrive", queue, "--yes"},
		{"dlq", "redrive", queue, "--dry-run", "-o", "json"},
		{"dlq", "redrive", queue, "--id", ids[3], "--yes"},
		{"dlq", "redrive", queue, "--type", "OrderPlaced", "--yes"},
		{"dlq", "drop", queue, "--id", ids[0], "--yes"},
		{"dlq", "drop", queue, "--id", ids[0], "--dry-run"},
	} {
		wantRefusal(t, args, amqpURL,
			"4 messages wait in "+dlq+", more than the 3 it takes without --limit", "--limit 4 takes them all, as before; a smaller one looks at the first N only",
			"nothing was changed", "Usage:")
	}
	if n := testenv.QueueDepth(t, testenv.Channel(t), queue); n != 0 {
		t.Errorf("after the refusals, %d messages are in %s, want none", n, queue)
	}
	// With --limit it goes on, and takes no more: the others were never taken (none comes
	// redelivered), by the refusals either.
	moved := okJSON[dlqResult](t, "dlq", "redrive", queue, "--limit", "1", "--yes", "--amqp", amqpURL)
	if moved.Count != 1 || moved.Messages[0].MessageID != ids[0] || moved.Waiting != 4 || moved.Examined != 1 {
		t.Fatalf("redrive --limit 1: %+v; want the first message moved", moved)
	}
	wantNeverTaken(t, dlq, ids[1:])
	// No more than mostWithoutLimit waiting: a drop without --limit goes on.
	inspect := testenv.Channel(t)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, inspect, dlq) == 3 }, "the messages did not come back")
	if got := decode[dlqDropResult](t, ok(t, "dlq", "drop", queue, "--id", ids[3], "--yes", "-o", "json", "--amqp", amqpURL)); got.Message.MessageID != ids[3] {
		t.Errorf("drop of 3 messages without --limit: %+v; want %s dropped", got, ids[3])
	}
	if got := inDLQ(t, queue); !sameElements(got, ids[1:3]) {
		t.Errorf("the dead-letter queue holds %q, want %q", got, ids[1:3])
	}
}

// dlq redrive into a pipe its reader closes after the first line (outboxctl dlq redrive Q --yes |
// head -1) moves them all, then says on stderr what it moved and exits 1. A write to a closed
// stdout raises SIGPIPE: unguarded, it would kill the process once they moved, with nothing
// said. Their lines (about 100 bytes a message, with a long type) are far more than a pipe
// holds (64 KiB), so a write after the close fails.
func TestDlqRedriveIntoAPipeClosedPartwaySaysWhatItMoved(t *testing.T) {
	t.Parallel()
	const n = 1000
	msgs := make([]amqp.Publishing, n)
	for i := range msgs {
		msgs[i] = deadMessage(strings.Repeat("OrderPlaced", 5), "no price")
	}
	queue, _ := fillDLQ(t, msgs...)
	code, stderr := runIntoPipe(t, true, "dlq", "redrive", queue, "--yes", "--amqp", testenv.AMQPURL())
	dlq := messaging.DeadLetterQueue(queue)
	said := fmt.Sprintf("moved %d messages from %s to %s (the output failed: write /dev/stdout: broken pipe)", n, dlq, queue)
	if code != exitFailure || !strings.Contains(stderr, said) {
		t.Fatalf("redrive into a pipe closed partway: exit %d, stderr %.2000q; want 1, and %q", code, stderr, said)
	}
	ch := testenv.Channel(t)
	if moved, left := testenv.QueueDepth(t, ch, queue), testenv.QueueDepth(t, ch, dlq); moved != n || left != 0 {
		t.Errorf("%d messages in %s, %d in %s; want all %d moved", moved, queue, left, dlq, n)
	}
}

// A dead-letter queue whose messages another client holds unacknowledged has none ready: dlq
// list and dlq redrive say no message is ready, not that the queue is empty, which it is not.
func TestDlqWhoseMessagesAreHeldElsewhereIsNotCalledEmpty(t *testing.T) {
	t.Parallel()
	queue, ids := fillDLQ(t, deadMessage("OrderPlaced", "no price"), deadMessage("OrderPlaced", "no price"))
	amqpURL, dlq := testenv.AMQPURL(), messaging.DeadLetterQueue(queue)
	holder, inspect := testenv.Channel(t), testenv.Channel(t)
	for range ids {
		if _, ok, err := holder.Get(dlq, false); err != nil || !ok {
			t.Fatalf("get from %s: %v, %v", dlq, ok, err)
		}
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, inspect, dlq) == 0 }, "the held messages are still counted ready")
	none := "no message ready in " + dlq + " (messages another client holds unacknowledged are not counted)"
	if out := ok(t, "dlq", "list", queue, "--amqp", amqpURL); out != none+"\n" {
		t.Errorf("dlq list of a queue whose messages are held elsewhere: %q; want %q", out, none)
	}
	if out := ok(t, "dlq", "redrive", queue, "--yes", "--amqp", amqpURL); out != none+": nothing to move\n" {
		t.Errorf("dlq redrive of a queue whose messages are held elsewhere: %q; want %q", out, none+": nothing to move")
	}
	if res := okJSON[dlqResult](t, "dlq", "list", queue, "--amqp", amqpURL); res.Waiting != 0 || res.Count != 0 {
		t.Errorf("dlq list -o json of a queue whose messages are held elsewhere: %+v; want waiting 0", res)
	}
	if err := holder.Close(); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, inspect, dlq) == 2 }, "the held messages did not come back")
}

// A redrive that fails before it picked a message prints no result, in either format, as dlq
// list and drop print none: a document of zero counts would pass for "nothing to move". Here
// no broker answers, or the dead-letter queue is missing.
func TestDlqRedriveThatFailsBeforePickingPrintsNothing(t *testing.T) {
	t.Parallel()
	_, missing := brokerNames(t) // never declared
	for _, args := range [][]string{
		{"dlq", "redrive", "q", "--amqp", "amqp://g@127.0.0.1:1/", "-o", "json"},
		{"dlq", "redrive", "q", "--amqp", "amqp://g@127.0.0.1:1/", "-o", "json", "--dry-run"},
		{"dlq", "redrive", "q", "--amqp", "amqp://g@127.0.0.1:1/", "--yes"},
		{"dlq", "redrive", missing, "--amqp", testenv.AMQPURL(), "-o", "json"},
		{"dlq", "redrive", missing, "--amqp", testenv.AMQPURL()},
	} {
		if code, stdout, stderr := ctl(t, args...); code != exitFailure || stdout != "" || stderr == "" {
			t.Errorf("outboxctl %s: exit %d, stdout %q, stderr %q; want 1, the error on stderr and nothing on stdout",
				strings.Join(args, " "), code, stdout, stderr)
		}
	}
}

// A copy the broker nacks (its queue is full and rejects publishes) is no move: the redrive
// fails, and the message stays in the dead-letter queue, acknowledged there only after a
// confirm.
func TestDlqRedriveOfACopyTheBrokerNacksKeepsTheMessage(t *testing.T) {
	t.Parallel()
	_, queue := brokerNames(t)
	dlq, ch := messaging.DeadLetterQueue(queue), testenv.Channel(t)
	// The redrive publishes its copy through the default exchange straight into queue, which
	// holds one message already and refuses another with a nack.
	if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"}); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(dlq, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	first := uuid.NewString()
	publishTo(t, ch, "", queue, amqp.Publishing{MessageId: first, Type: "OrderPlaced", ContentType: "application/json", Body: []byte(`{}`)})
	dead := deadMessage("OrderPlaced", "no price")
	publishTo(t, ch, "", dlq, dead)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.QueueDepth(t, ch, queue) == 1 && testenv.QueueDepth(t, ch, dlq) == 1
	}, "the queues did not fill")

	code, stdout, stderr := ctl(t, "dlq", "redrive", queue, "--amqp", testenv.AMQPURL())
	if code != exitFailure || !strings.Contains(stderr, "redrive message "+dead.MessageId+": the broker nacked it") ||
		!strings.Contains(stdout, "stopped by a failure: moved 0 of the 1 messages picked") {
		t.Errorf("redrive into a full queue: exit %d, stdout %q, stderr %q; want 1, the nack named, nothing moved", code, stdout, stderr)
	}
	if got := inDLQ(t, queue); !slices.Equal(got, []string{dead.MessageId}) {
		t.Errorf("after a nacked redrive the dead-letter queue holds %q, want the message %s", got, dead.MessageId)
	}
	if got := drainIDs(t, queue); !slices.Equal(got, []string{first}) {
		t.Errorf("%s holds %q, want only the message it held before", queue, got)
	}
}

// ids2 returns the message ids of ds.
func ids2(ds []deadLetter) []string {
	ids := make([]string, len(ds))
	for i, d := range ds {
		ids[i] = d.MessageID
	}
	return ids
}

// Without a terminal and without --yes, drop is refused before it connects: taking the queue
// and handing it back could reorder it. Port 1 refuses connections, so a dial would show.
func TestDlqDropWithoutATerminalRefusesBeforeConnecting(t *testing.T) {
	t.Parallel()
	id := uuid.NewString()
	code, _, stderr := ctl(t, "dlq", "drop", "invoicing", "--id", id, "--amqp", "amqp://guest:guest@127.0.0.1:1/")
	if code != exitNotConfirmed || !strings.Contains(stderr, "drop the message with id "+id+" from invoicing.dlq for good") ||
		!strings.Contains(stderr, "--yes") || strings.Contains(stderr, "dial") {
		t.Errorf("drop without a terminal or --yes: exit %d, %q; want 4 asking for --yes, before any dial", code, stderr)
	}
}

// drop removes exactly the message named, and hands the others back in order; it asks first,
// refuses without a terminal unless given --yes, and shows the message whole.
func TestDlqDropRemovesExactlyOne(t *testing.T) {
	t.Parallel()
	msgs := []amqp.Publishing{deadMessage("OrderPlaced", "a producer's bug"), deadMessage("OrderPlaced", "a producer's bug"),
		deadMessage("OrderCancelled", "a producer's bug"), deadMessage("OrderPlaced", "a producer's bug")}
	queue, ids := fillDLQ(t, msgs...)
	amqpURL, dlq := testenv.AMQPURL(), messaging.DeadLetterQueue(queue)

	out := ok(t, "dlq", "drop", queue, "--id", ids[2], "--dry-run", "--amqp", amqpURL)
	if !strings.Contains(out, "would drop from "+dlq) || !strings.Contains(out, `{"id":"`+ids[2]+`"}`) || !strings.Contains(out, messaging.HeaderDeadLetterReason) {
		t.Errorf("drop --dry-run said %q", out)
	}
	dry := decode[dlqDropResult](t, ok(t, "dlq", "drop", "-o", "json", queue, "--id", ids[2], "--dry-run", "--amqp", amqpURL))
	if !dry.DryRun || dry.Message.MessageID != ids[2] || dry.Message.Type != "OrderCancelled" || deref(dry.Message.Body) != `{"id":"`+ids[2]+`"}` ||
		headersOf(dry.Message)[messaging.HeaderDeadLetterReason] != "a producer's bug" {
		t.Errorf("drop --dry-run -o json: %+v", dry)
	}
	wantExit(t, exitNotConfirmed, []string{"dlq", "drop", queue, "--id", ids[2], "--amqp", amqpURL}, "drop the message with id "+ids[2]+" from "+dlq+" for good", "--yes")
	if code, _, stderr := ctlAt(t, &terminal{"\n"}, "dlq", "drop", queue, "--id", ids[2], "--amqp", amqpURL); code != exitNotConfirmed || !strings.Contains(stderr, `{"id":"`+ids[2]+`"}`) {
		t.Errorf("drop declined at a terminal: exit %d, %q; want 4 after showing the message", code, stderr)
	}
	unknown := uuid.NewString()
	wantExit(t, exitNoMatch, []string{"dlq", "drop", queue, "--id", unknown, "--yes", "--amqp", amqpURL}, "no message with id "+unknown+" in "+dlq)
	wantExit(t, exitNoMatch, []string{"dlq", "drop", queue, "--id", unknown, "--dry-run", "--amqp", amqpURL}, "no message with id "+unknown+" in "+dlq)
	if got := inDLQ(t, queue); !slices.Equal(got, ids) {
		t.Fatalf("after dry runs and refusals the dead-letter queue holds %q, want %q", got, ids)
	}

	got := decode[dlqDropResult](t, ok(t, "dlq", "drop", queue, "--id", strings.ToUpper(ids[2]), "--yes", "-o", "json", "--amqp", amqpURL))
	if got.DryRun || got.Message.MessageID != ids[2] || deref(got.Message.Body) != `{"id":"`+ids[2]+`"}` {
		t.Errorf("drop -o json: %+v", got)
	}
	code, stdout, stderr := ctlAt(t, &terminal{"y\n"}, "dlq", "drop", queue, "--id", ids[0], "--amqp", amqpURL)
	if code != 0 || !strings.Contains(stdout, "dropped from "+dlq+", for good:\nmessage "+ids[0]) {
		t.Errorf("drop confirmed at a terminal: exit %d, %q %q", code, stdout, stderr)
	}
	drained := testenv.Drain(t, testenv.Channel(t), dlq, 200*time.Millisecond)
	if got := deliveryIDs(drained); !slices.Equal(got, []string{ids[1], ids[3]}) {
		t.Fatalf("the dead-letter queue holds %q, want the two others in order", got)
	}
}

// drop --limit, a brake for a queue too long to hold, looks at the first messages only: one
// beyond them is not found, and nothing changes, but for the order of those it looked at.
func TestDlqDropLooksAtTheFirstLimitOnly(t *testing.T) {
	t.Parallel()
	queue, ids := fillDLQ(t, deadMessage("OrderPlaced", "a producer's bug"), deadMessage("OrderPlaced", "a producer's bug"),
		deadMessage("OrderPlaced", "a producer's bug"))
	amqpURL, dlq := testenv.AMQPURL(), messaging.DeadLetterQueue(queue)
	wantExit(t, exitNoMatch, []string{"dlq", "drop", queue, "--id", ids[2], "--limit", "2", "--yes", "--amqp", amqpURL},
		"no message with id "+ids[2]+" in "+dlq+" (of the first 2 messages, --limit)")
	if got := inDLQ(t, queue); !sameElements(got, ids) {
		t.Fatalf("after a drop that found nothing the dead-letter queue holds %q, want %q", got, ids)
	}
	first := inDLQ(t, queue)[0]
	if got := decode[dlqDropResult](t, ok(t, "dlq", "drop", "-o", "json", queue, "--id", first, "--limit", "1", "--yes", "--amqp", amqpURL)); got.Message.MessageID != first {
		t.Errorf("drop --limit 1 of the first message: %+v", got)
	}
	if got, want := inDLQ(t, queue), slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return id == first }); !sameElements(got, want) {
		t.Fatalf("after the drop the dead-letter queue holds %q, want %q", got, want)
	}
}

// sameElements reports whether a and b hold the same strings, in any order.
func sameElements(a, b []string) bool {
	return len(a) == len(b) && !slices.ContainsFunc(a, func(s string) bool { return !slices.Contains(b, s) })
}

// The consumer dead-letters a message whose id is not a UUID, or that has none: drop takes
// those too, by the id as written or with --without-id. What it prints is the last record of
// the message, its body whole.
func TestDlqDropTakesAnIdThatIsNoUUIDOrNone(t *testing.T) {
	t.Parallel()
	textID, noID, big := deadMessage("OrderPlaced", "no valid message id"), deadMessage("OrderPlaced", "no valid message id"), deadMessage("OrderPlaced", "too big")
	textID.MessageId, noID.MessageId = "order-42", ""
	big.Body = []byte(`{"note":"` + strings.Repeat("x  y\t", 1200) + `END"}`)
	queue, ids := fillDLQ(t, textID, noID, big)
	amqpURL, dlq := testenv.AMQPURL(), messaging.DeadLetterQueue(queue)

	out := ok(t, "dlq", "drop", queue, "--id", "order-42", "--yes", "--amqp", amqpURL)
	if !strings.Contains(out, "dropped from "+dlq+", for good:\nmessage order-42") {
		t.Errorf("drop --id order-42 said %q", out)
	}
	wantExit(t, exitNoMatch, []string{"dlq", "drop", queue, "--id", "ORDER-42", "--yes", "--amqp", amqpURL}, "no message with id ORDER-42 in "+dlq)
	out = ok(t, "dlq", "drop", queue, "--without-id", "--yes", "--amqp", amqpURL)
	if !strings.Contains(out, "dropped from "+dlq+", for good:\nmessage -") {
		t.Errorf("drop --without-id said %q", out)
	}
	wantExit(t, exitNoMatch, []string{"dlq", "drop", queue, "--without-id", "--yes", "--amqp", amqpURL}, "no message without a message id in "+dlq)
	if got := inDLQ(t, queue); !slices.Equal(got, ids[2:]) {
		t.Fatalf("the dead-letter queue holds %q, want only the big one", got)
	}
	out = ok(t, "dlq", "drop", queue, "--id", ids[2], "--yes", "--amqp", amqpURL)
	if !strings.Contains(out, "    "+string(big.Body)+"\n") || strings.Contains(out, "more bytes") {
		t.Errorf("the record of a dropped message lacks its whole body, as it was:\n%s", out)
	}
}

// Redrive end to end, into a running subscription: a message whose inbox record exists is
// skipped as a duplicate, the others are handled once; --id moves one and leaves the rest in
// order; an id not there is an error that names it and moves nothing. inbox show tells which
// were handled, and when.
func TestDlqRedriveIntoASubscription(t *testing.T) {
	t.Parallel()
	exchange, queue := brokerNames(t)
	db := testenv.NewDatabase(t)
	db.Migrate(t, platform.Library(messaging.MigrateInbox))
	if err := db.DB.Exec("CREATE TABLE handled (message_id uuid NOT NULL)").Error; err != nil {
		t.Fatal(err)
	}
	var refusing atomic.Bool // until the price list is fixed, every order is refused
	event := messaging.Event[placed]{Exchange: exchange, Type: "Placed", Validate: func(placed) error {
		if refusing.Load() {
			return errors.New("the price list is missing")
		}
		return nil
	}}
	log, logs := testenv.NewLogger(t)
	sub, err := messaging.NewSubscription(db.Driver(t), messaging.SubscriptionConfig{Name: queue, URL: testenv.AMQPURL(), Concurrency: 2, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	err = messaging.Handle(sub, event, func(ctx context.Context, tx *gorm.DB, _ placed, msg messaging.Message) error {
		return tx.Exec("INSERT INTO handled (message_id) VALUES (?)", msg.ID).Error
	})
	if err != nil {
		t.Fatal(err)
	}
	topology, err := sub.Topology()
	if err != nil {
		t.Fatal(err)
	}
	if err := topology.Declare(testenv.Connection(t), nil); err != nil {
		t.Fatal(err)
	}
	ch := testenv.Channel(t)
	background(t, sub.Run)
	handled := func(id uuid.UUID) int64 {
		return testenv.Count(t, db.DB, "SELECT count(*) FROM handled WHERE message_id = ?", id)
	}
	message := func() (messaging.Message, amqp.Publishing) {
		m, err := event.Message(placed{OrderID: uuid.New()})
		if err != nil {
			t.Fatal(err)
		}
		return m, amqp.Publishing{MessageId: m.ID.String(), Type: m.Type, ContentType: "application/json", Body: m.Payload}
	}
	dlq := messaging.DeadLetterQueue(queue)
	inDLQ := func() []string { return listed(t, ok(t, "dlq", "list", queue, "--amqp", testenv.AMQPURL())) }

	// A is handled. B and C are refused and dead-lettered. A copy of A lands in the
	// dead-letter queue too, as a crash between its dead-letter confirm and its ack would leave
	// one while the broker redelivered A to be handled.
	a, aPub := message()
	publishTo(t, ch, exchange, "Placed", aPub)
	testenv.Eventually(t, 10*time.Second, func() bool { return handled(a.ID) == 1 }, "A not handled")
	refusing.Store(true)
	b, bPub := message()
	c, cPub := message()
	publishTo(t, ch, exchange, "Placed", bPub)
	publishTo(t, ch, exchange, "Placed", cPub)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == 2 }, "B and C not dead-lettered")
	aPub.Headers = amqp.Table{messaging.HeaderDeadLetterReason: "the price list is missing"}
	publishTo(t, ch, "", dlq, aPub)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == 3 }, "A's copy not in the dead-letter queue")
	if got := inDLQ(); len(got) != 3 || !slices.Contains(got, b.ID.String()) || !slices.Contains(got, c.ID.String()) || got[2] != a.ID.String() {
		t.Fatalf("dead-letter queue holds %q, want B and C, then A", got)
	}
	order := inDLQ()

	// The inbox: A was handled by this consumer, B was not.
	if out := ok(t, "inbox", "show", "--id", a.ID.String(), "--consumer", queue, "--db", db.URL); !strings.Contains(out, "message "+a.ID.String()+" was handled by "+queue+" at ") {
		t.Errorf("inbox show of A said %q", out)
	}
	code, stdout, _ := ctl(t, "inbox", "show", "--id", b.ID.String(), "--consumer", queue, "--db", db.URL)
	if code != exitNoMatch || !strings.Contains(stdout, "no record of message "+b.ID.String()+" by consumer "+queue) {
		t.Errorf("inbox show of B before its redrive: exit %d, %q; want 3, not handled", code, stdout)
	}

	refusing.Store(false) // the price list is fixed
	out := ok(t, "dlq", "redrive", queue, "--id", b.ID.String(), "--amqp", testenv.AMQPURL())
	if !strings.Contains(out, "redriven "+b.ID.String()+" Placed") {
		t.Errorf("redrive --id said %q", out)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return handled(b.ID) == 1 }, "B not handled after its redrive")
	if got, want := inDLQ(), slices.DeleteFunc(slices.Clone(order), func(id string) bool { return id == b.ID.String() }); !slices.Equal(got, want) {
		t.Fatalf("after redriving B the dead-letter queue holds %q, want %q", got, want)
	}
	shown := okJSON[inboxResult](t, "inbox", "show", "--id", b.ID.String(), "--db", db.URL)
	if !shown.Handled || len(shown.Records) != 1 || shown.Records[0].Consumer != queue || time.Since(shown.Records[0].ProcessedAt) > time.Minute {
		t.Errorf("inbox show -o json of B after its redrive: %+v", shown)
	}

	unknown := uuid.NewString()
	wantExit(t, exitNoMatch, []string{"dlq", "redrive", queue, "--id", unknown, "--amqp", testenv.AMQPURL()}, "no message with id "+unknown+" in "+dlq)
	if got := len(inDLQ()); got != 2 {
		t.Fatalf("a failed redrive left %d messages, want 2", got)
	}

	// Without a terminal, as in a script, the plain command moves them all: a redrive loses
	// nothing, and the inbox skips what was handled already.
	code, out, stderr := ctl(t, "dlq", "redrive", "--amqp", testenv.AMQPURL(), queue)
	if code != 0 || !strings.Contains(out, "moved 2 messages from "+dlq+" to "+queue) || !strings.Contains(stderr, "no terminal to ask on; going on") {
		t.Errorf("redrive without a terminal: exit %d, stdout %q, stderr %q; want both moved, saying it did not ask", code, out, stderr)
	}
	testenv.Eventually(t, 10*time.Second, func() bool {
		return handled(c.ID) == 1 && len(logs.Lines("duplicate message skipped", "message_id="+a.ID.String())) == 1
	}, "want C handled and A's copy skipped as a duplicate")
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, ch, queue) == 0 }, "the queue is not drained")
	for name, id := range map[string]uuid.UUID{"A": a.ID, "B": b.ID, "C": c.ID} {
		if n := handled(id); n != 1 {
			t.Errorf("%s handled %d times, want once", name, n)
		}
	}
	if n := testenv.QueueDepth(t, ch, dlq); n != 0 {
		t.Errorf("the dead-letter queue still holds %d", n)
	}
}

// A quorum queue puts a large return back in an order of its own (beyond 32 messages, on
// every broker tested): the tools hand back what they hold in returns it keeps in order, and an
// interrupt lets them do so before the connection closes. 200 messages: listed twice, one
// redriven, and a redrive interrupted at its question, the queue keeps its order each time.
func TestDlqToolsKeepTheOrderOfALongQueue(t *testing.T) {
	t.Parallel()
	_, queue := brokerNames(t)
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: queue}}}
	if err := topology.Declare(testenv.Connection(t), nil); err != nil {
		t.Fatal(err)
	}
	ch := testenv.Channel(t)
	dlq := messaging.DeadLetterQueue(queue)
	ids := make([]string, 200)
	for i := range ids {
		ids[i] = uuid.NewString()
		publishTo(t, ch, "", dlq, amqp.Publishing{MessageId: ids[i], Type: "OrderPlaced", ContentType: "application/json", Body: []byte(`{}`)})
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == len(ids) }, "the messages did not reach %s", dlq)

	for i := range 2 {
		if got := listed(t, ok(t, "dlq", "list", queue, "--limit", "0", "--amqp", testenv.AMQPURL())); !slices.Equal(got, ids) {
			t.Fatalf("listing %d: %d messages, first out of order at %d", i+1, len(got), firstDifference(got, ids))
		}
	}
	moved := ids[100]
	ok(t, "dlq", "redrive", queue, "--id", moved, "--amqp", testenv.AMQPURL())
	ids = slices.Delete(ids, 100, 101)

	// Interrupted at its question, as by Ctrl-C: the context ends while all are held.
	ctx, interrupt := context.WithCancel(context.Background())
	_, err := messaging.RedriveDeadLetters(ctx, messaging.DeadLetterConfig{URL: testenv.AMQPURL(), Queue: queue},
		messaging.DeadLetterSelection{Confirm: func([]messaging.DeadLetter, int) error { interrupt(); return ctx.Err() }})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("interrupted redrive: %v, want context.Canceled", err)
	}
	if got := deliveryIDs(testenv.Drain(t, ch, dlq, 200*time.Millisecond)); !slices.Equal(got, ids) {
		t.Fatalf("after the tools, %s holds %d messages, first out of order at %d", dlq, len(got), firstDifference(got, ids))
	}
	if got := deliveryIDs(testenv.Drain(t, ch, queue, 200*time.Millisecond)); !slices.Equal(got, []string{moved}) {
		t.Fatalf("%s holds %q, want the one redriven", queue, got)
	}
}

// firstDifference is the first index where a and b differ, or -1.
func firstDifference(a, b []string) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

// answerAfter is a terminal's input that runs before once, when it is first read (when the
// question is asked), then gives answer.
type answerAfter struct {
	before func()
	once   sync.Once
	answer io.Reader
}

func (a *answerAfter) Read(p []byte) (int, error) {
	a.once.Do(a.before)
	return a.answer.Read(p)
}

// An interrupt while a copy waits for the broker's confirm stops the redrive once that confirm
// has come: the message is moved, in neither queue twice, and the output says how many moved
// and that the others are still dead-lettered. The broker's answers come 3 s late from the
// question on, so the second message's copy is in the queue, unconfirmed, when the interrupt
// comes.
func TestDlqRedriveInterruptedWaitsForTheConfirmInFlight(t *testing.T) {
	t.Parallel()
	ctx, interrupt := context.WithCancel(context.Background())
	defer interrupt()
	r := redriveUntilTheSecondConfirm(ctx, t)
	queue, ids, dlq, ch, codes, stdout, stderr := r.queue, r.ids, r.dlq, r.ch, r.codes, &r.stdout, &r.stderr
	interrupt()
	code := exitWithin(t, codes, "redrive did not stop after the interrupt")

	if want := fmt.Sprintf("redriven %s OrderPlaced\nredriven %s OrderPlaced\ninterrupted: moved 2 of the 3 messages picked from %s to %s; the others are still in %s",
		ids[0], ids[1], dlq, queue, dlq); code != exitFailure || !strings.Contains(stdout.String(), want) {
		t.Errorf("interrupted redrive: exit %d, stdout %q; want 1, and %q", code, stdout.String(), want)
	}
	if !strings.Contains(stderr.String(), "outboxctl dlq redrive: interrupted: ") || strings.Contains(stderr.String(), "may be in both") {
		t.Errorf("interrupted redrive: stderr %q; want it interrupted, no message in doubt", stderr.String())
	}
	// As said: the first two moved, the third where it was.
	testenv.Eventually(t, 20*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == 1 }, "the message held was not handed back to %s", dlq)
	if got := inDLQ(t, queue); !slices.Equal(got, ids[2:]) {
		t.Errorf("%s holds %q, want %q", dlq, got, ids[2:])
	}
	if got := drainIDs(t, queue); !slices.Equal(got, ids[:2]) {
		t.Errorf("%s holds %q, want %q", queue, got, ids[:2])
	}
}

// At a terminal, redrive lists the first 20 messages it would move, and counts the rest,
// before it asks.
func TestDlqRedriveAsksAfterTheFirst20(t *testing.T) {
	t.Parallel()
	msgs := make([]amqp.Publishing, 23)
	for i := range msgs {
		msgs[i] = deadMessage("OrderPlaced", "no price")
	}
	queue, ids := fillDLQ(t, msgs...)
	code, stdout, stderr := ctlAt(t, &terminal{"n\n"}, "dlq", "redrive", queue, "--amqp", testenv.AMQPURL())
	if listed := strings.Count(stderr, "no price"); code != exitNotConfirmed || stdout != "" || listed != 20 ||
		!strings.Contains(stderr, "... and 3 more (--dry-run lists them all)") || !strings.Contains(stderr, "move these 23 messages") {
		t.Errorf("redrive of 23 messages declined at a terminal: exit %d, %d listed, stdout %q, stderr %q; want 4 after 20 listed and a count of 3 more",
			code, listed, stdout, stderr)
	}
	if got := inDLQ(t, queue); !slices.Equal(got, ids) {
		t.Errorf("after a refusal the dead-letter queue holds %q, want %q", got, ids)
	}
}

// A connection lost while a copy waits for the broker's confirm leaves that message in doubt,
// as an interrupt does: the broker may have routed the copy, and the original goes back to the
// dead-letter queue when the channel closes. The output names it.
func TestDlqRedriveCutOffWhileAConfirmWaitsSaysWhatMayBeInBoth(t *testing.T) {
	t.Parallel()
	r := redriveUntilTheSecondConfirm(context.Background(), t)
	queue, ids, dlq, ch, codes, stdout, stderr := r.queue, r.ids, r.dlq, r.ch, r.codes, &r.stdout, &r.stderr
	r.proxy.Stop() // the connection goes
	code := exitWithin(t, codes, "redrive did not stop when its connection was cut")

	if want := fmt.Sprintf("stopped by a failure: moved 1 of the 3 messages picked from %s to %s", dlq, queue); code != exitFailure ||
		!strings.Contains(stdout.String(), want) {
		t.Errorf("cut-off redrive: exit %d, stdout %q; want 1, and %q", code, stdout.String(), want)
	}
	// How to check works on a queue of any length: one message shown, not the whole queue.
	for _, want := range []string{"message " + ids[1] + " may be in both " + queue + " and " + dlq,
		"outboxctl dlq redrive " + queue + " --id " + ids[1] + " --dry-run shows whether it is still in " + dlq} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("cut-off redrive: stderr %q lacks %q", stderr.String(), want)
		}
	}
	if strings.Contains(stderr.String(), "--limit 0") {
		t.Errorf("cut-off redrive: stderr %q sends the operator to a listing of the whole queue", stderr.String())
	}
	// As it says: the second is in both.
	testenv.Eventually(t, 20*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == 2 }, "the messages held were not handed back to %s", dlq)
	if got := drainIDs(t, queue); !slices.Equal(got, ids[:2]) {
		t.Errorf("%s holds %q, want %q", queue, got, ids[:2])
	}
}

// A connection lost once the last message's copy is confirmed, while the acknowledgement of its
// original is on its way, leaves that message in doubt: an acknowledgement has no answer, and one
// the broker never got leaves the original in the dead-letter queue. The requests take 3 s to
// reach the broker from the question on (the answers none), and the connection is cut as soon as
// the last copy is in the queue: its confirm is back by then, and the acknowledgement under way.
func TestDlqRedriveCutOffBeforeTheLastAcknowledgementArrivesSaysItMayBeInBoth(t *testing.T) {
	t.Parallel()
	proxy, ch := testenv.Proxy(t, testenv.AMQPHost(t)), testenv.Channel(t)
	queue, ids := fillDLQ(t, deadMessage("OrderPlaced", "no price"), deadMessage("OrderPlaced", "no price"))
	dlq := messaging.DeadLetterQueue(queue)
	in := &answerAfter{answer: strings.NewReader("y\n"), before: func() {
		if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"slow","type":"latency","stream":"upstream","attributes":{"latency":3000}}`)); err != nil {
			t.Error(err)
		}
	}}
	var stdout, stderr bytes.Buffer
	codes := make(chan int, 1)
	go func() {
		codes <- run(context.Background(), []string{"dlq", "redrive", queue, "--amqp", testenv.AMQPURLVia(t, proxy.Listen)},
			streams{in: in, out: &stdout, err: &stderr, interactive: true})
	}()
	testenv.Eventually(t, 20*time.Second, func() bool { return testenv.QueueDepth(t, ch, queue) == 2 }, "the last copy never reached %s", queue)
	proxy.Stop()
	code := exitWithin(t, codes, "redrive did not stop when its connection was cut")

	if want := "message " + ids[1] + " may be in both " + queue + " and " + dlq; code != exitFailure || !strings.Contains(stderr.String(), want) {
		t.Errorf("redrive cut off before its last acknowledgement arrived: exit %d, stdout %q, stderr %q; want 1, and %q",
			code, stdout.String(), stderr.String(), want)
	}
	// As it says: the last original is back in the dead-letter queue, and its copy in the queue.
	testenv.Eventually(t, 20*time.Second, func() bool { return testenv.QueueDepth(t, ch, dlq) == 1 }, "the last original did not come back to %s", dlq)
	if got := inDLQ(t, queue); !slices.Equal(got, ids[1:]) {
		t.Errorf("%s holds %q, want %q", dlq, got, ids[1:])
	}
	if got := drainIDs(t, queue); !slices.Equal(got, ids) {
		t.Errorf("%s holds %q, want %q", queue, got, ids)
	}
}

// redriveInFlight is a dlq redrive of three dead letters running through a proxy, stopped at
// the moment its second copy waits for the broker's confirm.
type redriveInFlight struct {
	queue, dlq     string
	ids            []string
	proxy          *toxiproxy.Proxy
	ch             *amqp.Channel
	codes          chan int
	stdout, stderr bytes.Buffer
}

// redriveUntilTheSecondConfirm starts a redrive under ctx and returns once the first message
// moved and the second's copy is in the queue, unconfirmed: the broker's answers come 3 s late
// from the question on.
func redriveUntilTheSecondConfirm(ctx context.Context, t *testing.T) *redriveInFlight {
	t.Helper()
	r := &redriveInFlight{proxy: testenv.Proxy(t, testenv.AMQPHost(t)), ch: testenv.Channel(t), codes: make(chan int, 1)}
	r.queue, r.ids = fillDLQ(t, deadMessage("OrderPlaced", "no price"), deadMessage("OrderPlaced", "no price"), deadMessage("OrderPlaced", "no price"))
	r.dlq = messaging.DeadLetterQueue(r.queue)
	in := &answerAfter{answer: strings.NewReader("y\n"), before: func() {
		if _, err := r.proxy.Toxics.AddToxicJson(strings.NewReader(`{"name":"slow","type":"latency","stream":"downstream","attributes":{"latency":3000}}`)); err != nil {
			t.Error(err)
		}
	}}
	go func() {
		r.codes <- run(ctx, []string{"dlq", "redrive", r.queue, "--amqp", testenv.AMQPURLVia(t, r.proxy.Listen)},
			streams{in: in, out: &r.stdout, err: &r.stderr, interactive: true})
	}()
	testenv.Eventually(t, 20*time.Second, func() bool { return testenv.QueueDepth(t, r.ch, r.queue) == 2 }, "the second copy never reached %s", r.queue)
	return r
}

// headersOf is d's headers, nil when it has none in its JSON.
func headersOf(d deadLetter) map[string]any {
	if d.Headers == nil {
		return nil
	}
	return *d.Headers
}

// A listing, or a dry run, of the first --limit messages of more that wait hands those it
// looked at back, where a quorum queue may put them behind the others: it says so, in the table
// and in -o json ("note"), and that the next run may see different messages first, and how to
// act on one of those it listed. One that looked at the whole queue says nothing of the kind.
func TestDlqPartOfTheQueueLookedAtSaysTheNextRunMaySeeOthers(t *testing.T) {
	t.Parallel()
	queue, _ := fillDLQOf(t, 6)
	amqpURL, dlq := testenv.AMQPURL(), messaging.DeadLetterQueue(queue)
	part := "note: it looked at the first 2 of the 6 messages only (--limit) and handed them back, and a quorum queue may put those behind the others"

	out := ok(t, "dlq", "list", queue, "--limit", "2", "--amqp", amqpURL)
	for _, want := range []string{part, "the next listing may show different messages first", "--id (one message a run", "--limit 6, which looks at them all"} {
		if !strings.Contains(out, want) {
			t.Errorf("dlq list --limit 2 of 6 lacks %q:\n%s", want, out)
		}
	}
	if got := listed(t, out); len(got) != 2 {
		t.Errorf("dlq list --limit 2 listed %q:\n%s", got, out)
	}
	if res := okJSON[dlqResult](t, "dlq", "list", queue, "--limit", "2", "--amqp", amqpURL); !strings.Contains("note: "+res.Note, part) {
		t.Errorf("dlq list --limit 2 -o json: note %q; want %q", res.Note, part)
	}
	for _, args := range [][]string{{"dlq", "list", queue}, {"dlq", "list", queue, "--limit", "6"}, {"dlq", "redrive", queue, "--dry-run"}} {
		args = append(args, "--amqp", amqpURL)
		if out := ok(t, args...); strings.Contains(out, "note:") {
			t.Errorf("outboxctl %s looked at the whole queue, and said:\n%s", strings.Join(args, " "), out)
		}
		if res := okJSON[dlqResult](t, args...); res.Note != "" {
			t.Errorf("outboxctl %s -o json looked at the whole queue, and has a note: %+v", strings.Join(args, " "), res)
		}
	}

	part = strings.ReplaceAll(part, "first 2", "first 3")
	out = ok(t, "dlq", "redrive", queue, "--limit", "3", "--dry-run", "--amqp", amqpURL)
	for _, want := range []string{"would move 3 of the first 3 of the 6 messages in " + dlq + " (--limit) to " + queue + " (dry run: nothing moved)",
		part, "the same command without --dry-run may see different messages first, and move those", "--id (one message a run)", "--limit 6, which looks at them all"} {
		if !strings.Contains(out, want) {
			t.Errorf("dlq redrive --limit 3 --dry-run of 6 lacks %q:\n%s", want, out)
		}
	}
	if res := okJSON[dlqResult](t, "dlq", "redrive", queue, "--limit", "3", "--dry-run", "--amqp", amqpURL); res.Examined != 3 || !strings.Contains("note: "+res.Note, part) {
		t.Errorf("dlq redrive --limit 3 --dry-run -o json: %+v; want a note %q", res, part)
	}

	first := inDLQ(t, queue)[0]
	out = ok(t, "dlq", "drop", queue, "--id", first, "--limit", "3", "--dry-run", "--amqp", amqpURL)
	for _, want := range []string{"would drop from " + dlq + " (dry run: nothing dropped):", part,
		"the same command without --dry-run may not find this message among the first 3 (exit 3): --limit 6 looks at them all"} {
		if !strings.Contains(out, want) {
			t.Errorf("dlq drop --limit 3 --dry-run of 6 lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "nothing changed") {
		t.Errorf("dlq drop --limit 3 --dry-run says nothing changed, which a quorum queue may make untrue:\n%s", out)
	}
	first = inDLQ(t, queue)[0]
	if res := decode[dlqDropResult](t, ok(t, "dlq", "drop", queue, "--id", first, "--limit", "3", "--dry-run", "-o", "json", "--amqp", amqpURL)); !strings.Contains("note: "+res.Note, part) {
		t.Errorf("dlq drop --limit 3 --dry-run -o json: %+v; want a note %q", res, part)
	}
	if res := decode[dlqDropResult](t, ok(t, "dlq", "drop", queue, "--id", first, "--dry-run", "-o", "json", "--amqp", amqpURL)); res.Note != "" {
		t.Errorf("dlq drop --dry-run -o json of the whole queue has a note: %+v", res)
	}
	// A redrive dry run of one --id: the real run moves that message or exits 3, as a drop does;
	// it cannot move others, and --id was given already.
	first = inDLQ(t, queue)[0]
	one := "the same command without --dry-run may not find this message among the first 3 (exit 3): --limit 6 looks at them all"
	out = ok(t, "dlq", "redrive", queue, "--id", first, "--limit", "3", "--dry-run", "--amqp", amqpURL)
	for _, want := range []string{"would move 1 of the first 3 of the 6 messages in " + dlq + " (--limit)", part, one} {
		if !strings.Contains(out, want) {
			t.Errorf("dlq redrive --id --limit 3 --dry-run of 6 lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "different messages") || strings.Contains(out, "name it with --id") {
		t.Errorf("dlq redrive --id --limit 3 --dry-run of 6 says other messages may move, or to give --id:\n%s", out)
	}
	first = inDLQ(t, queue)[0]
	if res := okJSON[dlqResult](t, "dlq", "redrive", queue, "--id", first, "--limit", "3", "--dry-run", "--amqp", amqpURL); !strings.Contains(res.Note, one) {
		t.Errorf("dlq redrive --id --limit 3 --dry-run -o json: note %q; want %q", res.Note, one)
	}
	if got := inDLQ(t, queue); len(got) != 6 {
		t.Errorf("after the listings and dry runs the dead-letter queue holds %q, want all 6", got)
	}
}

// An --id beyond the first --limit messages is not found (exit 3), and the error says how many
// wait and which --limit looks at them all: a dry run of the same command may have found it, and
// handed it back behind the others. The dry run then the real run, as an operator runs them:
// where the broker kept the order the message moves; where it did not, exit 3 says why.
func TestDlqIdBeyondTheLimitNamesTheLimitThatReachesIt(t *testing.T) {
	t.Parallel()
	queue, ids := fillDLQOf(t, 4)
	amqpURL, dlq := testenv.AMQPURL(), messaging.DeadLetterQueue(queue)
	hint := "--limit 4 looks at them all"
	for _, args := range [][]string{
		{"dlq", "redrive", queue, "--id", ids[3], "--limit", "2", "--yes"},
		{"dlq", "redrive", queue, "--id", ids[3], "--limit", "2", "--dry-run"},
		{"dlq", "drop", queue, "--id", ids[3], "--limit", "2", "--yes"},
	} {
		wantExit(t, exitNoMatch, append(args, "--amqp", amqpURL),
			"no message with id "+ids[3]+" in "+dlq+" (of the first 2 messages, --limit)", "of the 4 waiting", "may have moved behind the others", hint)
	}
	if n := testenv.QueueDepth(t, testenv.Channel(t), queue); n != 0 {
		t.Fatalf("%d messages moved to %s, want none", n, queue)
	}

	target := inDLQ(t, queue)[0]
	if got := ids2(okJSON[dlqResult](t, "dlq", "redrive", queue, "--id", target, "--limit", "2", "--dry-run", "--amqp", amqpURL).Messages); !slices.Equal(got, []string{target}) {
		t.Fatalf("dry run of --id %s --limit 2: %q", target, got)
	}
	code, stdout, stderr := ctl(t, "dlq", "redrive", queue, "--id", target, "--limit", "2", "--yes", "--amqp", amqpURL)
	switch code {
	case exitOK:
		t.Logf("the broker kept the order: the real run moved it")
		if !strings.Contains(stdout, "redriven "+target) {
			t.Errorf("redrive --id %s --limit 2: %q", target, stdout)
		}
	case exitNoMatch:
		t.Logf("the broker put the messages handed back behind the others: the real run did not reach it")
		if !strings.Contains(stderr, hint) {
			t.Errorf("redrive --id %s --limit 2 after its dry run: stderr %q lacks %q", target, stderr, hint)
		}
	default:
		t.Errorf("redrive --id %s --limit 2 after its dry run: exit %d, %q %q", target, code, stdout, stderr)
	}
}

// dlq list without --limit (or with --limit 0, the same) takes no more than mostWithoutLimit
// messages, as dlq redrive and dlq drop do: with more waiting it refuses before taking any,
// exit 2, naming the --limit that takes them all. Not parallel: it lowers mostWithoutLimit to 3.
func TestDlqListWithoutALimitRefusesAQueueTooLongToHold(t *testing.T) {
	lowerMostWithoutLimit(t, 3)
	queue, ids := fillDLQOf(t, 4)
	amqpURL, dlq := testenv.AMQPURL(), messaging.DeadLetterQueue(queue)
	for _, args := range [][]string{
		{"dlq", "list", queue},
		{"dlq", "list", queue, "-o", "json"},
		{"dlq", "list", queue, "--type", "OrderPlaced"},
		{"dlq", "list", queue, "--limit", "0"},
	} {
		wantRefusal(t, args, amqpURL,
			"4 messages wait in "+dlq+", more than the 3 it takes without --limit", "--limit 4 takes them all, as before; a smaller one looks at the first N only",
			"nothing was changed", "Usage:")
	}
	// Nothing was taken: none comes redelivered.
	wantNeverTaken(t, dlq, ids)
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, testenv.Channel(t), dlq) == 4 }, "the messages did not come back")
	if got := listed(t, ok(t, "dlq", "list", queue, "--limit", "4", "--amqp", amqpURL)); len(got) != 4 {
		t.Errorf("dlq list --limit 4: listed %q, want all 4", got)
	}
	// Below 0 the refusal says what 0 does.
	wantExit(t, exitUsage, []string{"dlq", "list", queue, "--limit", "-1", "--amqp", amqpURL}, "--limit -1: want 0 (all of them, if no more than 3 wait) or more")
}

// Without --limit, dlq list shows what waits: all 150 messages, in queue order, with no note of
// others beyond, and hands them back as they were: the queue keeps its order and its count.
func TestDlqListWithoutALimitListsTheWholeQueue(t *testing.T) {
	t.Parallel()
	queue, ids := fillDLQOf(t, 150)
	dlq := messaging.DeadLetterQueue(queue)
	out := ok(t, "dlq", "list", queue, "--amqp", testenv.AMQPURL())
	if got := listed(t, out); !slices.Equal(got, ids) {
		t.Fatalf("dlq list listed %d messages, first out of order at %d; want all 150 in queue order:\n%s", len(got), firstDifference(got, ids), out)
	}
	if !strings.HasPrefix(out, "150 messages in "+dlq+", in queue order:") || strings.Contains(out, "note:") {
		t.Errorf("dlq list of 150 messages:\n%s", out)
	}
	res := okJSON[dlqResult](t, "dlq", "list", queue, "--amqp", testenv.AMQPURL())
	if res.Waiting != 150 || res.Examined != 150 || res.Count != 150 || res.Note != "" || !slices.Equal(ids2(res.Messages), ids) {
		t.Errorf("dlq list -o json of 150 messages: waiting %d, examined %d, count %d, note %q", res.Waiting, res.Examined, res.Count, res.Note)
	}
	if got := deliveryIDs(testenv.Drain(t, testenv.Channel(t), dlq, 200*time.Millisecond)); !slices.Equal(got, ids) {
		t.Fatalf("after the listings, %s holds %d messages, first out of order at %d; want the 150 in their order", dlq, len(got), firstDifference(got, ids))
	}
}

// The counts a dlq command prints are those of the messages it took, not of those the broker
// counted before: another client may take some in between. Here, between the count and the
// take (beforeTakeHook), another client takes 2 of 6: with --limit 5 the command looks at the 4
// left, says so, and says no more wait beyond; with --limit 4, which it reaches, it cannot
// tell, and says that up to 2 may wait beyond. Not parallel: it sets beforeTakeHook.
func TestDlqCountsWhatItTookNotWhatWasCounted(t *testing.T) {
	var msgs []amqp.Publishing
	for range 6 {
		msgs = append(msgs, deadMessage("OrderPlaced", "no price"))
	}
	queue, _ := fillDLQ(t, msgs...)
	amqpURL, dlq := testenv.AMQPURL(), messaging.DeadLetterQueue(queue)
	inspect := testenv.Channel(t)
	// withTwoTaken runs outboxctl with args while another client takes 2 messages between the
	// count and the take, then gives them back.
	withTwoTaken := func(args ...string) (code int, stdout, stderr string) {
		t.Helper()
		holder, took := testenv.Channel(t), 0
		beforeTakeHook = func(q string) {
			if q != dlq {
				return
			}
			for range 2 {
				if _, ok, err := holder.Get(dlq, false); err != nil || !ok {
					t.Errorf("get from %s: %v, %v", dlq, ok, err)
				} else {
					took++
				}
			}
		}
		defer func() { beforeTakeHook = nil }()
		code, stdout, stderr = ctl(t, append(args, "--amqp", amqpURL)...)
		if took != 2 {
			t.Errorf("outboxctl %s: the other client took %d messages between the count and the take, want 2", strings.Join(args, " "), took)
		}
		want := testenv.QueueDepth(t, inspect, dlq) + took
		if err := holder.Close(); err != nil {
			t.Fatal(err)
		}
		testenv.Eventually(t, 10*time.Second, func() bool { return testenv.QueueDepth(t, inspect, dlq) == want }, "the 2 taken did not come back")
		return code, stdout, stderr
	}
	wantCounts := func(what string, res dlqResult, count int) {
		t.Helper()
		if res.Waiting != 6 || res.Examined != 4 || res.Count != count || res.Note != "" {
			t.Errorf("%s: %+v; want 6 waiting, 4 examined, %d counted, no note", what, res, count)
		}
	}
	taken := "the 4 messages ready in " + dlq + " (6 were counted at the start: the others were gone when it took them)"

	_, stdout, stderr := withTwoTaken("dlq", "list", queue, "--limit", "5", "-o", "json")
	wantCounts("dlq list --limit 5 -o json", decode[dlqResult](t, stdout), 4)
	_, stdout, _ = withTwoTaken("dlq", "list", queue, "--limit", "5")
	if !strings.Contains(stdout, taken+", in queue order:") || strings.Contains(stdout, "the first") || strings.Contains(stdout, "note:") {
		t.Errorf("dlq list --limit 5 with 2 taken meanwhile: %q, stderr %q; want %q", stdout, stderr, taken)
	}
	_, stdout, _ = withTwoTaken("dlq", "redrive", queue, "--limit", "5", "--dry-run", "-o", "json")
	wantCounts("dlq redrive --limit 5 --dry-run -o json", decode[dlqResult](t, stdout), 4)
	_, stdout, _ = withTwoTaken("dlq", "redrive", queue, "--limit", "5", "--dry-run")
	if !strings.Contains(stdout, "would move 4 of "+taken+" to "+queue) || strings.Contains(stdout, "the first") || strings.Contains(stdout, "note:") {
		t.Errorf("dlq redrive --limit 5 --dry-run with 2 taken meanwhile: %q; want %q", stdout, taken)
	}
	code, stdout, stderr := withTwoTaken("dlq", "redrive", queue, "--limit", "5", "--yes")
	if code != 0 || !strings.Contains(stdout, "moved 4 messages from "+dlq+" to "+queue) || strings.Contains(stdout, "beyond") {
		t.Errorf("dlq redrive --limit 5 with 2 taken meanwhile: exit %d, %q, %q; want 4 moved, and none said to wait beyond", code, stdout, stderr)
	}
	if n := testenv.QueueDepth(t, inspect, dlq); n != 2 {
		t.Errorf("%d messages left in %s, want the 2 the other client held", n, dlq)
	}

	// With --limit 4 the take reaches the limit, and may have left messages behind, or (here)
	// not: the other client took the 2 beyond. The output says how many may wait beyond, not
	// that they did.
	queue, _ = fillDLQ(t, msgs...)
	dlq = messaging.DeadLetterQueue(queue)
	code, stdout, stderr = withTwoTaken("dlq", "redrive", queue, "--limit", "4", "--yes")
	if code != 0 || !strings.Contains(stdout, "moved 4 messages from "+dlq+" to "+queue) || strings.Contains(stdout, "more messages waited beyond") ||
		!strings.Contains(stdout, "up to 2 more may wait beyond the 4 it looked at (6 were counted when it started; --limit)") {
		t.Errorf("dlq redrive --limit 4 with 2 taken meanwhile: exit %d, %q, %q; want 4 moved, and up to 2 said to wait beyond", code, stdout, stderr)
	}
}

// The message a redrive may have left in both queues is named with a command that answers for
// that message: --id with the id as it is, quoted for a shell where it needs it (a message id
// is any text); for one without an id, dlq drop --without-id; for an id the output shortens or
// cleans (which --id would not match: exit 3, "not in the dead-letter queue", untrue), a
// listing of them all. The inbox is named only for an id its consumer reads as a UUID.
func TestDlqInDoubtAdviceNamesACommandThatFindsTheMessage(t *testing.T) {
	t.Parallel()
	const queue, dlq, waiting = "invoicing", "invoicing.dlq", 7
	id := "01a22da8-7b60-74ff-a842-0e78a2a15d84"
	listing := "outboxctl dlq list invoicing --limit 7 -o json"
	for _, c := range []struct {
		name, id string
		want     []string // what the advice says
		args     []string // the words of its dlq command, as a shell reads them; nil: no --id command
		inbox    bool
	}{
		{name: "a UUID", id: id, args: []string{"dlq", "redrive", queue, "--id", id, "--dry-run"}, inbox: true,
			want: []string{"message " + id + " may be in both invoicing and invoicing.dlq", "outboxctl inbox show --id " + id + " --consumer invoicing"}},
		{name: "a UUID the consumer reads in another form", id: "urn:uuid:" + strings.ToUpper(id), args: []string{"dlq", "redrive", queue, "--id", "urn:uuid:" + strings.ToUpper(id), "--dry-run"},
			inbox: true, want: []string{"outboxctl inbox show --id " + id + " --consumer invoicing"}},
		{name: "an id a shell would read otherwise", id: `it's $HOME; "x" & y*`, args: []string{"dlq", "redrive", queue, "--id", `it's $HOME; "x" & y*`, "--dry-run"}},
		{name: "a dash", id: "-", args: []string{"dlq", "redrive", queue, "--id", "-", "--dry-run"}},
		{name: "a leading equals sign, which zsh expands", id: "=legacy-42", args: []string{"dlq", "redrive", queue, "--id", "=legacy-42", "--dry-run"},
			want: []string{"--id '=legacy-42' --dry-run"}},
		{name: "an id cut", id: strings.Repeat("a", 100), want: []string{listing, "whole"}},
		{name: "an id with a tab", id: "a\tb", want: []string{listing}},
		{name: "an id with two spaces", id: "a  b", want: []string{listing}},
		{name: "no id", id: "", want: []string{"a message without a message id may be in both invoicing and invoicing.dlq",
			"outboxctl dlq drop invoicing --without-id --dry-run shows whether one without an id is still in invoicing.dlq"}},
	} {
		advice := inDoubtAdvice(queue, dlq, c.id, waiting)
		for _, want := range c.want {
			if !strings.Contains(advice, want) {
				t.Errorf("%s: %q lacks %q", c.name, advice, want)
			}
		}
		if got := strings.Contains(advice, "outboxctl inbox show"); got != c.inbox {
			t.Errorf("%s: %q names inbox show: %v, want %v", c.name, advice, got, c.inbox)
		}
		if c.args == nil {
			if strings.Contains(advice, "--id") {
				t.Errorf("%s: %q names an --id", c.name, advice)
			}
			continue
		}
		// The command as a shell reads it, from "outboxctl dlq redrive" to " shows".
		_, cmd, ok := strings.Cut(advice, "outboxctl dlq redrive")
		cmd, _, ok2 := strings.Cut(cmd, " shows whether")
		if !ok || !ok2 {
			t.Errorf("%s: %q names no dlq redrive", c.name, advice)
			continue
		}
		out, err := exec.Command("sh", "-c", `set -f; set -- dlq redrive`+cmd+`; printf '%s\0' "$@"`).Output()
		if err != nil {
			t.Errorf("%s: %q: sh reads no command: %v", c.name, advice, err)
			continue
		}
		if got := strings.Split(strings.TrimSuffix(string(out), "\x00"), "\x00"); !slices.Equal(got, c.args) {
			t.Errorf("%s: %q: a shell reads outboxctl %q, want %q", c.name, advice, got, c.args)
		}
	}
}
