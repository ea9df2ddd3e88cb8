package messaging

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"maps"
	"net"
	neturl "net/url"
	"os"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
)

// A copy's confirm is given up on only deadLetterTimeout after the connection was last
// unblocked, or never blocked: an alarm that clears just before a timeout of the wait leaves
// the broker time to read the copy, which publishing it again would double.
func TestConfirmWaitOutlastsTheBlock(t *testing.T) {
	now := time.Now()
	for _, c := range []struct {
		name        string
		blocked     bool
		unblockedAt time.Time
		want        time.Duration
	}{
		{"never blocked", false, time.Time{}, 0},
		{"blocked", true, now.Add(-time.Hour), deadLetterTimeout},
		{"unblocked just now", false, now.Add(-500 * time.Millisecond), deadLetterTimeout - 500*time.Millisecond},
		{"unblocked long ago", false, now.Add(-deadLetterTimeout - time.Second), 0},
	} {
		got := confirmWait(c.blocked, c.unblockedAt, now)
		if (c.want <= 0 && got > 0) || (c.want > 0 && got != c.want) {
			t.Errorf("%s: wait %s more, want %s", c.name, got, c.want)
		}
	}
}

// copyOf is the dead-letter copy of d, on a connection with no frame limit.
func copyOf(d amqp.Delivery, reason error) amqp.Publishing {
	copied, _ := deadLetterCopy(d, reason, time.Now(), 0)
	return copied
}

// A dead-letter copy leaves the queue's delivery counts behind: the dead-letter queue keeps its
// own, and a redriven message that carried them would start its new life counted.
func TestDeadLetterCopyLeavesTheDeliveryCountsOut(t *testing.T) {
	d := amqp.Delivery{Headers: amqp.Table{"x-delivery-count": int64(19), "x-acquired-count": int64(20), "tenant": "a"}}
	headers := copyOf(d, errors.New("poison")).Headers
	for _, h := range []string{"x-delivery-count", "x-acquired-count"} {
		if _, ok := headers[h]; ok {
			t.Errorf("the copy carries %s", h)
		}
	}
	if headers["tenant"] != "a" || headers[HeaderDeadLetterReason] != "poison" {
		t.Errorf("the copy's headers are %v", headers)
	}
}

// Neither copy the library publishes again keeps RabbitMQ's routing headers: published through
// the default exchange, a CC naming another queue would put the copy there too.
func TestCopiesLeaveTheRoutingHeadersOut(t *testing.T) {
	d := amqp.Delivery{Headers: amqp.Table{"CC": []any{"other"}, "BCC": []any{"hidden"}, "tenant": "a"}}
	for name, headers := range map[string]amqp.Table{
		"dead-letter copy": copyOf(d, errors.New("poison")).Headers,
		"redrive copy":     redriveCopy(d).Headers,
	} {
		_, cc := headers["CC"]
		_, bcc := headers["BCC"]
		if cc || bcc || headers["tenant"] != "a" {
			t.Errorf("the %s's headers are %v; want tenant and no CC or BCC", name, headers)
		}
	}
}

// A confirmed copy whose channel closed right after (a node restarting) was taken for an
// unroutable one: the client closes the returns channel with the channel, and a read of it
// gives a return of zero values. A redrive so reported no doubt about a message in both queues,
// and a dead-letter copy was published a second time.
func TestAClosedReturnsChannelIsNoReturn(t *testing.T) {
	t.Parallel()
	s := testSession(t)
	q, err := s.ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan amqp.Return)
	close(closed)
	if err := redrive(context.Background(), s.ch, closed, q.Name, amqp.Delivery{MessageId: "m", Body: []byte(`{}`)}); err != nil {
		t.Errorf("redrive of a confirmed copy, its returns closed: %v, want moved", err)
	}
	p := &deadLetterPublisher{queue: q.Name, watch: s.watch, ch: s.ch, returns: closed}
	if err := p.confirm(context.Background(), amqp.Publishing{Body: []byte(`{}`)}); err != nil {
		t.Errorf("a dead-letter copy confirmed, its returns closed: %v, want confirmed", err)
	}
}

// A reason past maxReasonBytes is cut before the character the limit falls in: cut through it,
// the header ended in invalid UTF-8.
func TestADeadLetterReasonIsCutAtACharacter(t *testing.T) {
	t.Parallel()
	reason := strings.Repeat("a", maxReasonBytes-1) + "é" // the limit falls inside é
	got, _ := copyOf(amqp.Delivery{}, errors.New(reason)).Headers[HeaderDeadLetterReason].(string)
	if want := strings.Repeat("a", maxReasonBytes-1) + "…"; got != want {
		t.Fatalf("reason header of %d bytes (valid UTF-8: %v), want the %d ASCII bytes and an ellipsis", len(got), utf8.ValidString(got), maxReasonBytes-1)
	}
}

// A dead-letter queue declared again on a connection whose broker stopped answering is given up
// as a copy's confirm is, deadLetterTimeout on (no alarm blocking it), and the connection
// closed: the client's calls have no deadline of their own, and the declaration, which holds
// mu, held every worker's dead letter behind it for good.
func TestADeclarationOnASilentDeadLetterConnectionIsGivenUp(t *testing.T) {
	t.Parallel()
	var silent atomic.Bool
	url := silenceableBroker(t, &silent)
	queue := "silent-" + uuid.NewString()
	p := &deadLetterPublisher{
		dial: func(ctx context.Context) (*amqp.Connection, error) {
			return dial(ctx, url, t.Name(), 30*time.Second) // its heartbeat gives up later
		},
		log:   slog.New(slog.DiscardHandler),
		queue: DeadLetterQueue(queue),
		own:   ConsumerTopology{Queue: queue},
	}
	t.Cleanup(p.close)
	conn, err := p.connection(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	silent.Store(true)
	began := time.Now()
	done := make(chan error, 1)
	go func() { done <- p.declareAgain(context.Background(), errUnroutable) }()
	select {
	case err := <-done:
		if err == nil || strings.Contains(err.Error(), "declared it again") || !conn.IsClosed() {
			t.Fatalf("declaring on a silent connection = %v after %s (connection closed: %v), want a failure and the connection closed",
				err, time.Since(began).Round(time.Millisecond), conn.IsClosed())
		}
	case <-time.After(deadLetterTimeout + 5*time.Second):
		t.Fatalf("declaring on a silent connection had not returned after %s, want within %s", time.Since(began).Round(time.Second), deadLetterTimeout)
	}
}

// silenceableBroker forwards connections to the broker at TEST_AMQP_URL, and returns that URL
// through it. Once silent is set, nothing more goes either way, and the connections stay open:
// a broker that stopped answering, and reads nothing the client sends.
func silenceableBroker(t *testing.T, silent *atomic.Bool) string {
	t.Helper()
	copyUntilSilent := func(to, from net.Conn) {
		buf := make([]byte, 32<<10)
		for {
			n, err := from.Read(buf)
			if err != nil {
				return
			}
			if !silent.Load() {
				if _, err := to.Write(buf[:n]); err != nil {
					return
				}
			}
		}
	}
	return forwardToBroker(t, copyUntilSilent, copyUntilSilent)
}

// forwardToBroker forwards connections to the broker at TEST_AMQP_URL, and returns that URL
// through it: up copies what a client sends to the broker, down what the broker sends back.
func forwardToBroker(t *testing.T, up, down func(to, from net.Conn)) string {
	t.Helper()
	u, err := neturl.Parse(testAMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	upstream := u.Host
	if u.Port() == "" {
		upstream = net.JoinHostPort(u.Hostname(), "5672")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	conns := []io.Closer{l}
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	go func() {
		for {
			client, err := l.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", upstream)
			if err != nil {
				_ = client.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, client, server)
			mu.Unlock()
			go up(server, client)
			go down(client, server)
		}
	}()
	u.Host = l.Addr().String()
	return u.String()
}

// testAMQPURL is the broker's URL for tests: TEST_AMQP_URL, or a local broker's.
func testAMQPURL() string {
	if url := os.Getenv("TEST_AMQP_URL"); url != "" {
		return url
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

// The copy leaves out the properties that would lose it: the original's expiration would
// expire it in the dead-letter queue without a trace, and a user_id naming another broker user
// than the consumer's has the broker refuse it (406) at every try. The rest are kept.
func TestDeadLetterCopyLeavesExpirationAndUserIDOut(t *testing.T) {
	t.Parallel()
	d := amqp.Delivery{
		ContentType: "application/json", ContentEncoding: "identity", DeliveryMode: amqp.Persistent, Priority: 3,
		CorrelationId: "corr-1", ReplyTo: "replies", Expiration: "60000", MessageId: uuid.NewString(),
		Timestamp: time.Now().Truncate(time.Second), Type: "OrderPlaced", UserId: "order-service", AppId: "order",
		Body: []byte(`{"n":1}`),
	}
	got := copyOf(d, errors.New("poison"))
	if got.Expiration != "" || got.UserId != "" {
		t.Errorf("the copy has expiration %q and user_id %q, want neither", got.Expiration, got.UserId)
	}
	want := amqp.Publishing{
		Headers: got.Headers, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding, DeliveryMode: d.DeliveryMode,
		Priority: d.Priority, CorrelationId: d.CorrelationId, ReplyTo: d.ReplyTo, MessageId: d.MessageId,
		Timestamp: d.Timestamp, Type: d.Type, AppId: d.AppId, Body: d.Body,
	}
	rest := got
	rest.Expiration, rest.UserId = "", ""
	if !reflect.DeepEqual(rest, want) {
		t.Errorf("the copy is %+v, want the original's other properties and body %+v", got, want)
	}
}

// poisonFillingAFrame is a delivery whose own headers, a pad of n bytes among others, fill
// most of a frame, as another publisher, not held to brokerHeadroom, may send.
func poisonFillingAFrame(n int) amqp.Delivery {
	return amqp.Delivery{
		Headers: amqp.Table{
			"pad": strings.Repeat("x", n), "tenant": "acme", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
			"x-death": []any{amqp.Table{"count": int64(1), "queue": "orders", "reason": "rejected", "time": time.Now().Truncate(time.Second)}},
			"attempt": int32(2), "replayed": true, "score": 0.5,
		},
		Exchange: "orders", RoutingKey: "OrderPlaced", ContentType: "application/json", ContentEncoding: "identity",
		DeliveryMode: amqp.Persistent, Priority: 1, CorrelationId: "corr-1", ReplyTo: "replies", MessageId: uuid.NewString(),
		Timestamp: time.Now().Add(-time.Hour).Truncate(time.Second), Type: "OrderPlaced", AppId: "order", Body: []byte(`{"n":1}`),
	}
}

// largestFittingPad is the largest pad of poisonFillingAFrame whose whole copy, with reason,
// dead-lettered at, takes at most limit bytes: each byte of the pad is one of the copy.
func largestFittingPad(limit int, reason error, at time.Time) int {
	empty, _ := deadLetterCopy(poisonFillingAFrame(0), reason, at, 0)
	return limit - contentHeaderSize(empty)
}

// deadLetteredAt is when the tests' copies are dead-lettered.
var deadLetteredAt = time.Date(2025, 6, 1, 12, 0, 0, 123456789, time.UTC)

// A message whose own headers fill most of a frame could never be dead-lettered: the reason
// and the rest added took its copy past the frame size, the broker closed the dead-letter
// connection at every try, and the worker retried it for ever, holding what its channel had
// been sent. Past the frame, less the dead-letter queue's headroom, its copy leaves the
// message's headers out, says so, and keeps why it is there, what tells it apart (id, type,
// time, where it was published) and its body.
func TestADeadLetterCopyPastTheFrameLeavesTheHeadersOut(t *testing.T) {
	t.Parallel()
	const frame = 128 << 10
	reason := errors.New(strings.Repeat("r", 2*maxReasonBytes))
	at := deadLetteredAt
	n := largestFittingPad(frame-deadLetterQueueHeadroom, reason, at)
	whole, dropped := deadLetterCopy(poisonFillingAFrame(n), reason, at, frame)
	if dropped || whole.Headers["pad"] == nil || whole.Headers["tenant"] != "acme" || contentHeaderSize(whole) != frame-deadLetterQueueHeadroom {
		t.Fatalf("a copy of %d bytes in a frame of %d: headers dropped %v, want the whole copy", contentHeaderSize(whole), frame, dropped)
	}

	d := poisonFillingAFrame(n + 1)
	got, dropped := deadLetterCopy(d, reason, at, frame)
	if !dropped {
		t.Fatalf("a copy of %d bytes in a frame of %d kept the message's headers", contentHeaderSize(got), frame)
	}
	want := amqp.Table{
		HeaderDeadLetterReason:       strings.Repeat("r", maxReasonBytes) + "…",
		HeaderDeadLetteredAt:         "2025-06-01T12:00:00.123456789Z",
		HeaderOriginalExchange:       d.Exchange,
		HeaderOriginalRoutingKey:     d.RoutingKey,
		HeaderOriginalHeadersDropped: true,
	}
	if !reflect.DeepEqual(got.Headers, want) {
		t.Errorf("the copy's headers are %.300v, want %v alone", got.Headers, want)
	}
	if got.MessageId != d.MessageId || got.Type != d.Type || !got.Timestamp.Equal(d.Timestamp) || string(got.Body) != string(d.Body) ||
		got.CorrelationId != d.CorrelationId || got.DeliveryMode != d.DeliveryMode {
		t.Errorf("the copy %+v lost the original's properties or body", got)
	}

	// What is left, with the delivery counts a dead-letter queue adds (26 bytes each), fits in
	// AMQP's smallest frame, whatever the original's properties and reason: each property and
	// the exchange and routing key are at most 255 bytes.
	long := strings.Repeat("p", maxShortString)
	worst := amqp.Delivery{Headers: d.Headers, Exchange: long, RoutingKey: long, ContentType: long, ContentEncoding: long,
		DeliveryMode: amqp.Persistent, Priority: 9, CorrelationId: long, ReplyTo: long, MessageId: long,
		Timestamp: time.Now(), Type: long, AppId: long, Body: d.Body}
	const smallestFrame = 4096
	if got, dropped := deadLetterCopy(worst, reason, at, smallestFrame); !dropped || contentHeaderSize(got)+2*26 > smallestFrame {
		t.Errorf("the copy without the headers takes %d bytes (headers dropped: %v), with the delivery counts more than AMQP's smallest frame of %d",
			contentHeaderSize(got), dropped, smallestFrame)
	}
}

// A message as large as the publisher lets it be keeps its headers (its traceparent, say) in its
// copy, whatever is added to them: the longest reason, exchange and routing key, and the headers
// an operator's message interceptors added when it was published. (Held to brokerHeadroom, as
// the publisher is, its copy left them all out.)
func TestACopyOfAMessageAtThePublishLimitKeepsItsHeaders(t *testing.T) {
	t.Parallel()
	const frame = 128 << 10
	long := strings.Repeat("e", maxShortString)
	m := Message{ID: uuid.New(), Type: "OrderPlaced", Payload: []byte(`{}`), OccurredAt: time.Now(), CorrelationID: "corr",
		TraceParent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", Exchange: long, RoutingKey: long}
	pad := func(n int) amqp.Publishing {
		m.Headers = map[string]string{"pad": strings.Repeat("x", n)}
		return toPublishing(m, "app")
	}
	n := frame - brokerHeadroom
	for checkEnvelope(m.Exchange, m.routingKey(), pad(n), frame) != nil {
		n--
	}
	p := pad(n)
	headers := maps.Clone(p.Headers)
	maps.Copy(headers, amqp.Table{
		"x-delivery-count": int64(19), "x-acquired-count": int64(20), // the consumer's queue's, left out
		"timestamp_in_ms": int64(1), "x-routed-by": strings.Repeat("n", maxShortString), // the interceptors'
	})
	d := amqp.Delivery{Headers: headers, Exchange: m.Exchange, RoutingKey: m.routingKey(), ContentType: p.ContentType,
		DeliveryMode: p.DeliveryMode, CorrelationId: p.CorrelationId, MessageId: p.MessageId, Timestamp: p.Timestamp,
		Type: p.Type, AppId: p.AppId, Body: p.Body}
	got, dropped := deadLetterCopy(d, errors.New(strings.Repeat("r", 2*maxReasonBytes)), deadLetteredAt, frame)
	if dropped || got.Headers[traceParentHeader] != m.TraceParent || got.Headers["pad"] != p.Headers["pad"] {
		t.Errorf("the copy of a message at the publish limit, %d bytes, takes %d (headers dropped: %v), want its headers kept",
			contentHeaderSize(p), contentHeaderSize(got), dropped)
	}
}

// A copy's size does not depend on the time it is dead-lettered at: RFC3339Nano drops the
// trailing zeros of the nanoseconds, and a copy near its limit kept or dropped the message's
// headers from one try of the same delivery to the next, as the clock went. The time still
// reads back as RFC 3339, as ListDeadLetters reads it.
func TestADeadLetterCopysSizeDoesNotDependOnTheClock(t *testing.T) {
	t.Parallel()
	d := poisonFillingAFrame(100)
	want, _ := deadLetterCopy(d, errors.New("poison"), deadLetteredAt, 0)
	for _, at := range []time.Time{
		time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC),
		time.Date(2025, 6, 1, 12, 0, 0, 100_000_000, time.UTC),
		time.Date(2025, 6, 1, 12, 0, 0, 120_000_000, time.FixedZone("CEST", 2*60*60)),
		time.Date(2025, 6, 1, 12, 0, 0, 999_999_999, time.UTC),
	} {
		got, _ := deadLetterCopy(d, errors.New("poison"), at, 0)
		if contentHeaderSize(got) != contentHeaderSize(want) {
			t.Errorf("a copy dead-lettered at %v takes %d bytes, one at %v %d", at, contentHeaderSize(got), deadLetteredAt, contentHeaderSize(want))
		}
		written, _ := got.Headers[HeaderDeadLetteredAt].(string)
		if read, err := time.Parse(time.RFC3339, written); err != nil || !read.Equal(at) || read.Location() != time.UTC {
			t.Errorf("dead-lettered at %v, written %q, read back as %v (%v): want the same instant, in UTC", at, written, read, err)
		}
		if dl := readDeadLetter(amqp.Delivery{Headers: got.Headers}); !dl.DeadLetteredAt.Equal(at) {
			t.Errorf("dead-lettered at %v, listed as dead-lettered at %v", at, dl.DeadLetteredAt)
		}
	}
}

// A dead-letter copy as large as deadLetterCopy lets it be is read back from a quorum queue, as
// a listing or redrive reads it (basic.get, the message handed back and got again), and by a
// consumer: the broker adds x-delivery-count when it delivers it again. (A copy filling the
// frame was taken, and the client closed the connection at its second basic.get, "frame size
// exceeds negotiated frame_max": every listing and redrive died on it.)
func TestADeadLetterCopyAtItsLimitIsDeliveredAgain(t *testing.T) {
	t.Parallel()
	s := testSession(t)
	frame := s.conn.Config.FrameSize
	queue := quorumQueue(t, "copy-limit-"+uuid.NewString(), nil)
	reason := errors.New("poison")
	n := largestFittingPad(frame-deadLetterQueueHeadroom, reason, deadLetteredAt)
	if over, dropped := deadLetterCopy(poisonFillingAFrame(n+1), reason, deadLetteredAt, frame); !dropped {
		t.Fatalf("a copy of %d bytes in a frame of %d kept the message's headers", contentHeaderSize(over), frame)
	}
	fitting, dropped := deadLetterCopy(poisonFillingAFrame(n), reason, deadLetteredAt, frame)
	if dropped || contentHeaderSize(fitting) != frame-deadLetterQueueHeadroom {
		t.Fatalf("the largest copy kept takes %d bytes (headers dropped: %v), want %d", contentHeaderSize(fitting), dropped, frame-deadLetterQueueHeadroom)
	}
	dc, err := s.ch.PublishWithDeferredConfirmWithContext(context.Background(), "", queue, true, false, fitting)
	if err != nil || !dc.Wait() {
		t.Fatalf("the broker refused a copy of %d bytes in a frame of %d: %v", contentHeaderSize(fitting), frame, err)
	}
	d := deliveredAgain(t, testConnection(t), queue)
	if d.Headers["pad"] != fitting.Headers["pad"] {
		t.Errorf("the copy came back without its headers: %.200v", d.Headers)
	}
	if err := d.Ack(false); err != nil {
		t.Fatal(err)
	}
}

// quorumQueue declares a quorum queue named name with args besides its type, deleted when the
// test ends, and returns its name.
func quorumQueue(t *testing.T, name string, args amqp.Table) string {
	t.Helper()
	conn := testConnection(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	declared := amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum}
	maps.Copy(declared, args)
	if _, err := ch.QueueDeclare(name, true, false, false, false, declared); err != nil {
		t.Fatalf("declare quorum queue %.40s…: %v", name, err)
	}
	t.Cleanup(func() {
		if ch, err := testConnection(t).Channel(); err == nil {
			_, _ = ch.QueueDelete(name, false, false, false)
		}
	})
	return name
}

// deliveredAgain reads the message waiting alone in queue, on conn: by basic.get, handed back,
// by basic.get again, which a quorum queue counts in x-delivery-count, handed back, and by a
// consumer, whose delivery it returns unsettled. It fails t if the client closed conn on the
// way, which it does for a content header past the frame size.
func deliveredAgain(t *testing.T, conn *amqp.Connection, queue string) amqp.Delivery {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	for get := 1; get <= 2; get++ {
		// A quorum queue applies a return after it answered it: the message is waited for.
		deadline := time.Now().Add(10 * time.Second)
		d, ok, err := ch.Get(queue, false)
		for err == nil && !ok && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
			d, ok, err = ch.Get(queue, false)
		}
		if err != nil || !ok {
			t.Fatalf("basic.get %d of the message: got one %v, %v (connection closed: %v)", get, ok, err, conn.IsClosed())
		}
		if count, counted := d.Headers["x-delivery-count"]; get == 2 && !counted {
			t.Fatalf("the message got again has no x-delivery-count (%v): not the delivery that adds it", count)
		}
		// A reject, which every version counts in x-delivery-count (4.x counts a nack's
		// hand-back in x-acquired-count only).
		if err := d.Reject(true); err != nil {
			t.Fatal(err)
		}
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case d, ok := <-deliveries:
		if !ok {
			t.Fatalf("the consumer's deliveries ended: %v", <-closed)
		}
		return d
	case <-time.After(10 * time.Second):
		t.Fatalf("no delivery to the consumer in 10 s (connection closed: %v)", conn.IsClosed())
	}
	return amqp.Delivery{}
}

// contentHeaderSize is exactly the frame the client writes, for every property and every type
// of header value it writes, in arrays and tables too: read off the wire by frameTap. An
// estimate too low (the frame's 8 bytes forgotten, say) would let a copy past the limit
// through; RabbitMQ takes 8 bytes past the frame size, so publishing it would not tell.
func TestContentHeaderSizeIsTheClientsFrame(t *testing.T) {
	t.Parallel()
	url, frames := frameTap(t)
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := dial(context.Background(), url, t.Name(), 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	values := amqp.Table{
		"nil": nil, "bool": true, "byte": byte(200), "int8": int8(-8), "int16": int16(-16), "uint16": uint16(16),
		"int": 64, "int32": int32(-32), "uint32": uint32(32), "int64": int64(-64), "float32": float32(0.5),
		"float64": 0.25, "decimal": amqp.Decimal{Scale: 2, Value: 12345}, "string": "héllo", "bytes": []byte{0, 1, 2},
		"time": time.Now(), "empty string": "", "empty bytes": []byte{}, "empty array": []any{}, "empty table": amqp.Table{},
	}
	every := maps.Clone(values)
	every["array"] = []any{nil, true, byte(1), int8(1), int16(1), uint16(1), 1, int32(1), uint32(1), int64(1), float32(1), 1.0,
		amqp.Decimal{}, "s", []byte("b"), time.Now(), []any{"nested"}, amqp.Table{"k": "v"}}
	every["table"] = maps.Clone(values)
	all := amqp.Publishing{
		Headers: every, ContentType: "application/json", ContentEncoding: "gzip", DeliveryMode: amqp.Persistent, Priority: 9,
		CorrelationId: "corr", ReplyTo: "replies", Expiration: "60000", MessageId: uuid.NewString(), Timestamp: time.Now(),
		Type: "OrderPlaced", UserId: u.User.Username(), AppId: "order", Body: []byte(`{"n":1}`),
	}
	noHeaders := all
	noHeaders.Headers = nil
	for name, pub := range map[string]amqp.Publishing{
		"no property":                {},
		"every property":             all,
		"every property but headers": noHeaders,
		"headers alone":              {Headers: amqp.Table{"k": "v"}},
		"an empty header table":      {Headers: amqp.Table{}, Body: []byte("x")},
	} {
		if err := ch.PublishWithContext(context.Background(), "", "no-such-queue-"+uuid.NewString(), false, false, pub); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		select {
		case got := <-frames:
			if want := contentHeaderSize(pub); want != got {
				t.Errorf("%s: contentHeaderSize says %d bytes, the client wrote %d", name, want, got)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: no content header frame on the wire in 10 s", name)
		}
	}
}

// A copy the worker tries again, the same delivery, is said once to leave the headers out, even
// with another delivery's tries between (two workers); the next delivery's copy is said again.
func TestADroppedHeadersCopyIsSaidOnce(t *testing.T) {
	t.Parallel()
	var logs strings.Builder
	var mu sync.Mutex
	queue := "dropped-once-" + uuid.NewString()
	p := &deadLetterPublisher{
		dial:  func(context.Context) (*amqp.Connection, error) { return testConnection(t), nil },
		log:   slog.New(slog.NewTextHandler(lockedWriter{&mu, &logs}, nil)),
		queue: quorumQueue(t, DeadLetterQueue(queue), nil),
		own:   ConsumerTopology{Queue: queue},
	}
	t.Cleanup(p.close)
	d := poisonFillingAFrame(128 << 10)
	d.DeliveryTag = 7
	next := d
	next.DeliveryTag = 8
	var saidD, saidNext bool // each worker's, for its delivery
	for _, try := range []struct {
		d    amqp.Delivery
		said *bool
	}{{d, &saidD}, {next, &saidNext}, {d, &saidD}, {next, &saidNext}, {d, &saidD}} {
		if err := p.publish(context.Background(), try.d, errors.New("poison"), try.said); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if n := strings.Count(logs.String(), "leaves the message's headers out"); n != 2 {
		t.Errorf("%d lines say a copy leaves the headers out, want 2: one for each delivery\n%s", n, logs.String())
	}
}

// lockedWriter writes to w under mu.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// frameTap forwards connections to the broker at TEST_AMQP_URL, returns that URL through it,
// and sends on frames the length of each content header frame a client writes, as written:
// its header and end included.
func frameTap(t *testing.T) (string, <-chan int) {
	t.Helper()
	frames := make(chan int, 100)
	url := forwardToBroker(t, func(to, from net.Conn) {
		protocol := make([]byte, 8) // "AMQP" and the version
		if _, err := io.ReadFull(from, protocol); err != nil {
			return
		}
		if _, err := to.Write(protocol); err != nil {
			return
		}
		for {
			header := make([]byte, 7) // type, channel, payload size
			if _, err := io.ReadFull(from, header); err != nil {
				return
			}
			frame := make([]byte, len(header)+int(binary.BigEndian.Uint32(header[3:7]))+1) // and its end
			copy(frame, header)
			if _, err := io.ReadFull(from, frame[len(header):]); err != nil {
				return
			}
			if frame[0] == amqpHeaderFrame {
				frames <- len(frame)
			}
			if _, err := to.Write(frame); err != nil {
				return
			}
		}
	}, func(to, from net.Conn) { _, _ = io.Copy(to, from) })
	return url, frames
}

// amqpHeaderFrame is the type of a content header frame.
const amqpHeaderFrame = 2

// logHook is a logger's handler that calls do at each record of msg, and drops every record.
type logHook struct {
	msg string
	do  func()
}

func (h logHook) Enabled(context.Context, slog.Level) bool { return true }
func (h logHook) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h logHook) WithGroup(string) slog.Handler            { return h }

func (h logHook) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		h.do()
	}
	return nil
}

// A session that ends while the worker waits to try a dead-letter copy again (its channel
// lost, which cuts the wait short) hands the message back without publishing the copy again:
// published then, it could be confirmed, logged as dead-lettered, and its ack fail on the
// channel gone, and the redelivery would be dead-lettered a second time.
func TestNoDeadLetterCopyIsPublishedAfterTheSessionEnded(t *testing.T) {
	t.Parallel()
	session, endSession := context.WithCancel(context.Background())
	defer endSession()
	var dials atomic.Int32
	c := &consumer{cfg: consumerConfig{Queue: "q", RetryBackoff: Backoff{Base: time.Minute, Max: time.Minute}}}
	c.deadLetters = &deadLetterPublisher{
		dial: func(context.Context) (*amqp.Connection, error) {
			dials.Add(1)
			return nil, errors.New("connection refused")
		},
		log:   slog.New(slog.DiscardHandler),
		queue: DeadLetterQueue("q"),
	}
	// The session ends during the wait after the first failure, which is a minute long.
	log := slog.New(logHook{msg: "could not dead-letter message; retrying", do: func() { time.AfterFunc(20*time.Millisecond, endSession) }})
	var got settlements
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.deadLetter(context.Background(), session, context.Background(), log, amqp.Delivery{Acknowledger: &got, DeliveryTag: 1}, errors.New("poison"))
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the worker still dead-letters the message 10 s after its session ended")
	}
	if n := dials.Load(); n != 1 {
		t.Errorf("the copy was tried %d times, want once: none after the session ended", n)
	}
	if len(got) != 1 || got[0].op != "nack" {
		t.Errorf("the message was settled with %v, want handed back with a nack", got)
	}
}
