package messaging

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"mime"
	"net"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
)

const (
	contentTypeJSON     = "application/json"
	correlationIDHeader = "correlation_id"
	defaultHeartbeat    = 10 * time.Second
	dialTimeout         = 10 * time.Second
)

// splitURLs splits a comma-separated list of broker URLs, one per node of a cluster, all with
// the same vhost. A single URL is a list of one.
func splitURLs(list string) []string {
	var urls []string
	for u := range strings.SplitSeq(list, ",") {
		if u = strings.TrimSpace(u); u != "" {
			urls = append(urls, u)
		}
	}
	return urls
}

// dial connects to the first broker of urls (see splitURLs) that answers, trying them in a
// new random order each time: with no preferred node, clients spread over the cluster, and a
// node that fails is simply passed over, as RabbitMQ's client guidance advises. It gives up
// when ctx ends.
func dial(ctx context.Context, urls, name string, heartbeat time.Duration) (*amqp.Connection, error) {
	conn, _, err := dialSocket(ctx, urls, name, heartbeat)
	return conn, err
}

// dialSocket is dial, and also returns the connection's socket: closing it is the one way to
// end a write the broker does not read once the client has given the connection up (see
// Publisher.write).
func dialSocket(ctx context.Context, urls, name string, heartbeat time.Duration) (*amqp.Connection, net.Conn, error) {
	list := splitURLs(urls)
	if len(list) == 0 {
		return nil, nil, errors.New("dial rabbitmq: no broker URL")
	}
	errs := make([]error, 0, len(list))
	for _, i := range rand.Perm(len(list)) {
		conn, sock, err := dialOne(ctx, list[i], name, heartbeat)
		if err == nil {
			return conn, sock, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, nil, fmt.Errorf("dial rabbitmq: %w", errors.Join(errs...))
}

// unparseableHelp says what is wrong with a broker URL that does not parse, without it.
const unparseableHelp = "(its text is left out, as it may hold a password; its scheme must be amqp or amqps, " +
	"and a reserved character such as / ? # @ : in its user name or password must be percent-encoded)"

// errUnparseableURL stands for a broker URL that does not parse. net/url's error quotes the
// URL, password included, and a dial error ends up in logs, so nothing of the URL is kept.
var errUnparseableURL = errors.New("a broker URL does not parse " + unparseableHelp)

// unparseableURLs counts the URLs of list (see splitURLs) that do not parse, and all of them.
func unparseableURLs(list string) (bad, all int) {
	urls := splitURLs(list)
	for _, u := range urls {
		if _, err := amqp.ParseURI(u); err != nil {
			bad++
		}
	}
	return bad, len(urls)
}

// checkURLs refuses a broker URL list that names no broker a dial could reach: none at all, or
// none that parses, a configuration's fault that no broker can mend (a dial would fail for
// ever). Its error goes after the setting's name, and leaves the URLs' text out, as
// errUnparseableURL does. A list of which some URL parses passes: a dial passes the others
// over (see warnUnparseableURLs).
func checkURLs(list string) error {
	switch bad, all := unparseableURLs(list); {
	case all == 0:
		return errors.New("names no broker")
	case bad == 1 && all == 1:
		return errors.New("does not parse " + unparseableHelp)
	case bad == all:
		return fmt.Errorf("does not parse: none of its %d broker URLs does %s", all, unparseableHelp)
	}
	return nil
}

// CheckBrokerURL refuses a broker URL, or a cluster's comma-separated list of them, as
// [PublisherConfig] and [SubscriptionConfig] take it, that names no broker or has a URL that
// does not parse, without quoting it (it may hold a password). The library passes over a node
// whose URL does not parse while another's does: a start that must not leave a typo to be
// found later checks its setting with this first, before anything is written.
func CheckBrokerURL(list string) error {
	bad, all := unparseableURLs(list)
	switch {
	case all == 0:
		return errors.New("names no broker")
	case bad > 0:
		return fmt.Errorf("does not parse: %d of its %d broker URLs do not %s", bad, all, unparseableHelp)
	}
	return nil
}

// warnUnparseableURLs logs, once for the setting named setting, the URLs of list that do not
// parse when others do: every dial passes them over, which would otherwise go unsaid while a
// node that parses answers.
func warnUnparseableURLs(log *slog.Logger, setting, list string) {
	if bad, all := unparseableURLs(list); bad > 0 && bad < all {
		log.Warn("broker URLs that do not parse are passed over; the others are used", "setting", setting,
			"unparseable", bad, "urls", all, "reason", unparseableHelp)
	}
}

// checkHeartbeat refuses a heartbeat AMQP cannot carry: the client sends whole seconds, so
// less than one would be 0, and the broker's interval (60 s by default) would be used. 0 takes
// the default.
func checkHeartbeat(hb time.Duration) error {
	if hb > 0 && hb < time.Second {
		return fmt.Errorf("%s is under AMQP's 1 s; give at least 1 s, or 0 for the default %s", hb, defaultHeartbeat)
	}
	return nil
}

// dialOne opens a connection with heartbeats (so a half-open TCP connection is noticed in
// bounded time) and a connection name that shows up in the broker's management tools. The TCP
// connection and the AMQP handshake each get dialTimeout, and end with ctx: a broker that
// accepts and never answers holds a shutdown up no longer than that.
func dialOne(ctx context.Context, url, name string, heartbeat time.Duration) (*amqp.Connection, net.Conn, error) {
	// Parsed here first, since amqp.DialConfig's own parse error would quote the URL.
	if _, err := amqp.ParseURI(url); err != nil {
		return nil, nil, errUnparseableURL
	}
	if heartbeat <= 0 {
		heartbeat = defaultHeartbeat
	}
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName(name)
	handshakeOver := func() bool { return true }
	var sock net.Conn
	conn, err := amqp.DialConfig(url, amqp.Config{
		Heartbeat:  heartbeat,
		Locale:     "en_US",
		Properties: props,
		// As amqp.DefaultDial, with ctx: DialConfig calls it and then shakes hands on the
		// connection, within its deadline, before it returns.
		Dial: func(network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{Timeout: dialTimeout}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			if err := c.SetDeadline(time.Now().Add(dialTimeout)); err != nil {
				_ = c.Close()
				return nil, err
			}
			handshakeOver = context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
			sock = c
			return c, nil
		},
	})
	if !handshakeOver() {
		// ctx ended during the handshake, or just after it, cutting into the connection.
		if err == nil {
			_ = conn.CloseDeadline(time.Now())
		}
		return nil, nil, fmt.Errorf("dial: %w", ctx.Err())
	}
	if err != nil {
		return nil, nil, err
	}
	awaitFirstFrame(conn, sock)
	return conn, sock, nil
}

// awaitFirstFrame gives the connection the read deadline its heartbeats would: the client
// clears its deadlines at the end of the handshake, after its heartbeater may already have set
// one, and sets the next only when a frame arrives. A broker that stalls right after the
// handshake sent none, and every call on the connection (the setup's first channel) waited for
// ever, heartbeats or not. The heartbeater moves the deadline on at each frame that arrives, as
// it would have: three of its half-heartbeat intervals.
func awaitFirstFrame(conn *amqp.Connection, sock net.Conn) {
	if hb := conn.Config.Heartbeat; hb > 0 && sock != nil {
		_ = sock.SetReadDeadline(time.Now().Add(3 * hb / 2))
	}
}

// toPublishing puts the envelope into AMQP properties, so consumers (and people reading a
// queue in the management UI) see id, type and time without parsing the body. The trace
// context goes in the traceparent and tracestate headers, as W3C Trace Context names them.
func toPublishing(m Message, appID string) amqp.Publishing {
	p := amqp.Publishing{
		ContentType:  contentTypeJSON,
		DeliveryMode: amqp.Persistent,
		MessageId:    m.ID.String(),
		Type:         m.Type,
		Timestamp:    m.OccurredAt,
		AppId:        appID,
		Body:         m.Payload,
	}
	if m.CorrelationID != "" || m.TraceParent != "" || len(m.Headers) > 0 {
		p.Headers = make(amqp.Table, 3+len(m.Headers))
	}
	for k, v := range m.Headers {
		p.Headers[k] = v
	}
	if m.CorrelationID != "" {
		p.CorrelationId = m.CorrelationID
		p.Headers[correlationIDHeader] = m.CorrelationID
	}
	if m.TraceParent != "" {
		p.Headers[traceParentHeader] = m.TraceParent
		if m.TraceState != "" {
			p.Headers[traceStateHeader] = m.TraceState
		}
	}
	return p
}

// maxShortString is AMQP's limit on a short string: the type, the correlation id, the
// exchange, the routing key, the app id and every header name travel as one.
const maxShortString = 255

// routingHeaders are RabbitMQ's extra routing keys of a message (sender-selected distribution):
// a copy the library publishes again, to a dead-letter queue or back to its queue, leaves them
// out, or it would go to every queue they name once more.
var routingHeaders = []string{"CC", "BCC"}

// brokerHeadroom is the part of a frame a message's properties leave free for the headers
// RabbitMQ adds when it delivers the message. It takes a message whose properties fill the
// frame, adds its headers at delivery without checking the frame size again, and the client
// refuses the larger frame (501, "frame size exceeds negotiated frame_max"), closing the
// connection: at every delivery of the message from a quorum queue (RabbitMQ 3.10 counts the
// first one too) to its consumer, and at every basic.get of it from a dead-letter queue
// (listing or redriving it), taking what is behind it along.
//
// What it adds, on RabbitMQ 3.10 to 4.3: a quorum queue's x-delivery-count and, from 4.3 on,
// x-acquired-count (26 bytes each); and to a message it dead-letters itself (at the delivery
// limit), x-death (121 bytes besides the queue's, exchange's and routing key's names),
// x-first-death-exchange, -queue and -reason (93 bytes, and the exchange's and queue's names),
// and from 3.13 on their x-last-death-* (90, and the same names). With names of 255 bytes,
// AMQP's longest, that is 2,141 bytes; an operator's message interceptors add timestamp_in_ms
// (25) and x-routed-by (at most 272). 3 KiB keeps some 600 bytes over that, of RabbitMQ's
// default frame of 128 KiB.
const brokerHeadroom = 3 << 10

// checkEnvelope returns an error wrapping [ErrInvalidEnvelope] when p, published to exchange
// with key, cannot travel over AMQP: a short string over 255 bytes, properties (headers
// included) that do not fit in one frame of frameSize bytes less brokerHeadroom, or a header
// named CC or BCC. The client would fail mid-frame, or the broker close the connection (the
// channel, for CC or BCC), either way taking every other message in flight with it; or, for
// properties that fill a frame, the client close the consumer's connection at each delivery.
func checkEnvelope(exchange, key string, p amqp.Publishing, frameSize int) error {
	type field struct{ name, value string }
	properties := []field{{"type", p.Type}, {"correlation id", p.CorrelationId}, {"app id", p.AppId},
		{"message id", p.MessageId}, {"content type", p.ContentType}}
	// The content header frame: its own header and end (8 bytes); class, weight, body size and
	// property flags (14); delivery mode and timestamp (9); each short string property with its
	// length byte; the headers' table, each a name, a type byte and a long string.
	size := 8 + 14 + 9 + 4
	for _, f := range properties {
		size += 1 + len(f.value)
	}
	shortStrings := append([]field{{"exchange", exchange}, {"routing key", key}}, properties...)
	for k, v := range p.Headers {
		if slices.Contains(routingHeaders, k) {
			// RabbitMQ reads these as more routing keys (sender-selected distribution), an array:
			// a string makes it close the channel, and with it every confirm in flight.
			return fmt.Errorf("%w: the header %q is RabbitMQ's list of extra routing keys, which a string cannot be", ErrInvalidEnvelope, k)
		}
		shortStrings = append(shortStrings, field{"header name", k})
		s, _ := v.(string) // toPublishing writes strings only
		size += 1 + len(k) + 1 + 4 + len(s)
	}
	for _, f := range shortStrings {
		if len(f.value) > maxShortString {
			return fmt.Errorf("%w: the %s %q is %d bytes, AMQP allows %d", ErrInvalidEnvelope, f.name, truncate(f.value), len(f.value), maxShortString)
		}
	}
	if frameSize > 0 && size > frameSize-brokerHeadroom { // 0: no limit was negotiated
		return fmt.Errorf("%w: its properties and headers take %d bytes, more than the %d the connection's frame size of %d leaves beside the %d the broker may add at delivery",
			ErrInvalidEnvelope, size, frameSize-brokerHeadroom, frameSize, brokerHeadroom)
	}
	return nil
}

// fromDelivery reads the envelope back. Its errors are Permanent: a delivery without a valid
// message id (the nil UUID is none) or a JSON body will never become handleable, however often
// it is retried.
func fromDelivery(d amqp.Delivery, maxBody int) (Message, error) {
	id, err := uuid.Parse(d.MessageId)
	if err != nil {
		return Message{}, Permanent(fmt.Errorf("invalid message_id %q: %w", truncate(d.MessageId), err))
	}
	if err := checkReceived(id, d.ContentType, d.Body, maxBody); err != nil {
		return Message{}, err
	}
	m := Message{ID: id, Type: d.Type, Payload: d.Body, OccurredAt: d.Timestamp, CorrelationID: travelling(d.CorrelationId),
		Exchange: d.Exchange, RoutingKey: d.RoutingKey}
	for k, v := range d.Headers {
		s, ok := v.(string)
		switch {
		case !ok:
		case k == traceParentHeader:
			m.TraceParent = s
		case k == traceStateHeader:
			m.TraceState = s
		case k == correlationIDHeader:
			if m.CorrelationID == "" {
				m.CorrelationID = travelling(s)
			}
		default:
			if m.Headers == nil {
				m.Headers = make(map[string]string, len(d.Headers))
			}
			m.Headers[k] = s
		}
	}
	return m, nil
}

// checkReceived is what a consumer checks of a message before its payload is decoded, given
// its id, content type ("" for none) and body, and what messagingtest's deliveries check too:
// an error, [Permanent], dead-letters a delivery.
func checkReceived(id uuid.UUID, contentType string, body []byte, maxBody int) error {
	if id == uuid.Nil {
		// The inbox knows a message by its id: every message of the nil id after the first would
		// be taken for a duplicate of it, and acknowledged without its work.
		return Permanent(errors.New("message_id is the nil UUID"))
	}
	if contentType != "" {
		mt, _, err := mime.ParseMediaType(contentType)
		if err != nil || mt != contentTypeJSON {
			return Permanent(fmt.Errorf("content type %q is not %s", truncate(contentType), contentTypeJSON))
		}
	}
	if maxBody > 0 && len(body) > maxBody {
		return Permanent(fmt.Errorf("body of %d bytes exceeds the limit of %d", len(body), maxBody))
	}
	if !json.Valid(body) {
		return Permanent(errors.New("body is not valid JSON"))
	}
	return nil
}

// travelling is a delivery's correlation id if a message can carry it on, or "". A handler
// copies it to the messages its work enqueues, and Enqueue refuses one over AMQP's 255 bytes
// (a header may be longer) or holding a NUL (a property may): its work would fail on every
// delivery, for an id only there to be passed on. Invalid UTF-8 would be stored as U+FFFD:
// altered, and maybe over 255 bytes.
func travelling(id string) string {
	if len(id) > maxShortString || strings.IndexByte(id, 0) >= 0 || !utf8.ValidString(id) {
		return ""
	}
	return id
}

// deliveryMessage is what can be read of a delivery that never became a Message, for the
// lines about it: its id, type and trace context as they came.
func deliveryMessage(d amqp.Delivery) Message {
	m := Message{Type: d.Type}
	m.TraceParent, _ = d.Headers[traceParentHeader].(string)
	m.TraceState, _ = d.Headers[traceStateHeader].(string)
	return m
}

// maxEchoed is how much of a field from a bad message an error or a log line repeats.
const maxEchoed = 64

// truncate shortens a field from an untrusted message for errors and logs.
func truncate(s string) string {
	if len(s) <= maxEchoed {
		return s
	}
	return cutUTF8(s, maxEchoed) + "…"
}

// cutUTF8 is s cut to at most n bytes, before the character that n falls in: a cut through a
// multi-byte character would end a header or a log value in invalid UTF-8. It steps back no
// further than one character's bytes, so s invalid already is cut near n all the same.
func cutUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for i := n; i >= 0 && i > n-utf8.UTFMax; i-- {
		if utf8.RuneStart(s[i]) {
			return s[:i]
		}
	}
	return s[:n]
}

// connWatch drains a connection's notifications (an undrained Notify channel stalls the
// client), logs why the connection closed or was blocked, and keeps the blocked state: a
// blocked connection takes no messages until the broker's resource alarm clears.
type connWatch struct {
	mu          sync.Mutex
	reason      string        // why the broker blocked the connection; "" while it does not
	blocked     chan struct{} // closed while the connection is blocked
	unblocked   chan struct{} // closed while it is not
	closed      chan struct{} // closed once the connection is
	blockedAt   time.Time     // when the broker last blocked it
	unblockedAt time.Time     // when the broker last unblocked it
}

// watchConnection starts watching conn, logging its close at level closed.
func watchConnection(conn *amqp.Connection, log *slog.Logger, closed slog.Level) *connWatch {
	w := newConnWatch()
	closes := conn.NotifyClose(make(chan *amqp.Error, 1))
	blocked := conn.NotifyBlocked(make(chan amqp.Blocking, 1))
	go func() {
		for b := range blocked {
			w.set(b)
			if b.Active {
				log.Warn("rabbitmq blocked the connection", "reason", b.Reason)
			} else {
				log.Info("rabbitmq unblocked the connection")
			}
		}
	}()
	go func() {
		defer close(w.closed)
		if err, ok := <-closes; ok && err != nil {
			log.Log(context.Background(), closed, "rabbitmq connection closed", "error", err)
		}
	}()
	return w
}

// newConnWatch is the watch of a connection not blocked, not closed.
func newConnWatch() *connWatch {
	w := &connWatch{blocked: make(chan struct{}), unblocked: make(chan struct{}), closed: make(chan struct{})}
	close(w.unblocked)
	return w
}

func (w *connWatch) set(b amqp.Blocking) {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case b.Active && w.reason == "":
		w.reason = b.Reason
		if w.reason == "" {
			w.reason = "unknown"
		}
		w.blockedAt = time.Now()
		close(w.blocked)
		w.unblocked = make(chan struct{})
	case !b.Active && w.reason != "":
		w.reason = ""
		w.blocked = make(chan struct{})
		close(w.unblocked)
		w.unblockedAt = time.Now()
	}
}

// state says whether the connection is blocked now, and when it was last unblocked.
func (w *connWatch) state() (blocked bool, unblockedAt time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.reason != "", w.unblockedAt
}

// blockedC is closed once the connection is blocked.
func (w *connWatch) blockedC() <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.blocked
}

// unblockedFor closes expired once the connection has been unblocked for d on end, or once it
// closes; never while it is blocked: a resource alarm can last long, and confirms given up
// while it does would have every message awaited on the connection sent again. It gives up
// when done closes.
func (w *connWatch) unblockedFor(d time.Duration, expired chan<- time.Time, done <-chan struct{}) {
	for {
		select {
		case <-w.unblockedC():
		case <-w.closed:
			close(expired)
			return
		case <-done:
			return
		}
		timer := time.NewTimer(d)
		select {
		case <-timer.C:
			close(expired)
			return
		case <-w.blockedC():
			// Blocked again before the time ran out: the time starts over at the next unblock.
			timer.Stop()
		case <-w.closed:
			timer.Stop()
			close(expired)
			return
		case <-done:
			timer.Stop()
			return
		}
	}
}

// unblockedC is closed once the connection is not blocked.
func (w *connWatch) unblockedC() <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.unblocked
}

// blockedErr is ErrBrokerUnavailable while the connection is blocked, else nil.
func (w *connWatch) blockedErr() error {
	if reason, _ := w.block(); reason != "" {
		return unavailable("the broker blocked the connection: %s", reason)
	}
	return nil
}

// block is why the broker blocks the connection now, and since when; "" if it does not.
func (w *connWatch) block() (reason string, since time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.reason, w.blockedAt
}
