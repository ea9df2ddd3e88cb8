package messaging

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	neturl "net/url"
	"os"
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

// A dead-letter copy leaves the queue's delivery counts behind: the dead-letter queue keeps its
// own, and a redriven message that carried them would start its new life counted.
func TestDeadLetterCopyLeavesTheDeliveryCountsOut(t *testing.T) {
	d := amqp.Delivery{Headers: amqp.Table{"x-delivery-count": int64(19), "x-acquired-count": int64(20), "tenant": "a"}}
	headers := deadLetterCopy(d, errors.New("poison"), time.Now()).Headers
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
		"dead-letter copy": deadLetterCopy(d, errors.New("poison"), time.Now()).Headers,
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
	got, _ := deadLetterCopy(amqp.Delivery{}, errors.New(reason), time.Now()).Headers[HeaderDeadLetterReason].(string)
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
	target := os.Getenv("TEST_AMQP_URL")
	if target == "" {
		target = "amqp://guest:guest@127.0.0.1:5672/"
	}
	u, err := neturl.Parse(target)
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
			go copyUntilSilent(server, client)
			go copyUntilSilent(client, server)
		}
	}()
	u.Host = l.Addr().String()
	return u.String()
}
