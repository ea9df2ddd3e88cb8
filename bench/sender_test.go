package bench

import (
	"fmt"
	"net/smtp"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// senderConns is the notification sender's default NOTIFY_CONCURRENCY: the deliveries it runs
// at once, each on an SMTP connection of its own. The ceiling uses as many connections.
const senderConns = 8

// senderBacklog is how many pending notifications the sender drains, and how many e-mails
// each ceiling sends.
const senderBacklog = 20_000

// notificationMessageID is the Message-ID domain of the notification service's e-mails; the
// ceiling's e-mails have another.
const notificationMessageID = "@notification.outbox-inbox>"

// senderThroughput: the notification binary, with its defaults, drains a backlog of pending
// notifications into the test SMTP server, next to that server's ceiling measured in the same
// run: a plain client sending as many e-mails over as many reused connections, right before and
// right after the drain, as fast as it can. Only the notification service runs.
func senderThroughput(t *testing.T, r *report, binDir string) {
	t.Helper()
	// BENCH_PPROF_ADDR serves the notification binary's profiler there, to profile the drain.
	sys := systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, DiscardLogs: true,
		Env: map[string][]string{"notification": {"PPROF_ADDR=" + os.Getenv("BENCH_PPROF_ADDR")}}})
	// The notification service ran once to create its schema; the others would compete for the
	// two cores.
	sys.Order.Stop(t)
	sys.Invoicing.Stop(t)
	sys.Notification.Stop(t)
	fillNotifications(t, sys.Notification.DB, senderBacklog)

	inProcess := smtpCeiling(t, sys.Mail.Addr, senderBacklog, senderConns)
	before := smtpCeilingProcess(t, sys.Mail.Addr, senderBacklog, senderConns)
	sessions := sys.Mail.Sessions()
	start := time.Now()
	sys.Notification.Start(t)
	// Polled with the cheapest question, which stops at the first pending row: counting the
	// table every 20 ms would take the database's time from the sender.
	testenv.Eventually(t, 5*time.Minute, func() bool {
		return testenv.Count(t, sys.Notification.DB.DB, "SELECT count(*) FROM (SELECT 1 FROM notifications WHERE status = 'pending' LIMIT 1) p") == 0
	}, "not all %d notifications were sent", senderBacklog)
	if n := testenv.Count(t, sys.Notification.DB.DB, "SELECT count(*) FROM notifications WHERE status = 'sent'"); n != senderBacklog {
		t.Fatalf("%d notifications sent, want %d", n, senderBacklog)
	}
	var span struct{ First, Last time.Time }
	if err := sys.Notification.DB.DB.Raw("SELECT min(sent_at) AS first, max(sent_at) AS last FROM notifications").Scan(&span).Error; err != nil {
		t.Fatal(err)
	}
	sys.Notification.Stop(t)
	conns := sys.Mail.Sessions() - sessions
	after := smtpCeilingProcess(t, sys.Mail.Addr, senderBacklog, senderConns)

	mails, repeats := notificationMails(sys.Mail)
	ceiling := (before + after) / 2
	// The e-mails after the first over the time from its mark to the last's: the sender's
	// start, dials and greetings are outside this window, unlike the ceiling's (dial to QUIT,
	// see sendCeiling). docs/benchmarks.md says so beside the phase.
	perSec := rate(senderBacklog-1, span.Last.Sub(span.First))
	r.add(fmt.Sprintf("SMTP ceiling: test SMTP server, a plain client in a process of its own, %d e-mails over %d reused connections (RSET, MAIL, RCPT, DATA pipelined), no DB",
		senderBacklog, senderConns), fmt.Sprintf("%.0f mail/s", ceiling), fmt.Sprintf("before %.0f, after the drain %.0f", before, after), "1.00", "", true)
	r.add("   the same client in the server's own process, before the drain", fmt.Sprintf("%.0f mail/s", inProcess), "ceiling", fmt.Sprintf("%.2f", inProcess/ceiling), "", true)
	r.add(fmt.Sprintf("sender: notification binary, defaults, drains %d pending notifications (%d e-mails, %d repeated, over %d connections; first sent %.2f s after start)",
		senderBacklog, mails, repeats, conns, span.First.Sub(start).Seconds()),
		fmt.Sprintf("%.0f mail/s", perSec), "ceiling", fmt.Sprintf("%.2f", perSec/ceiling), "≥ 0.50",
		perSec/ceiling >= 0.50 && mails == senderBacklog && repeats == 0 && conns <= senderConns)
}

// notificationBody is an order confirmation's body as the service writes it.
func notificationBody(orderID uuid.UUID) string {
	return fmt.Sprintf("Thank you for your order %s.\r\n\r\n  2 × SKU-1 at 12.50\r\n\r\nTotal: 25.00\r\n", orderID)
}

// fillNotifications commits n pending order confirmations, due now, as the notification
// service's handlers record them.
func fillNotifications(t *testing.T, db *testenv.Database, n int) {
	t.Helper()
	orderID := uuid.New() // one body for all: its size is what counts
	if err := db.DB.Exec(`INSERT INTO notifications (id, order_id, customer_id, kind, recipient, subject, body, message_id, created_at, next_attempt_at)
SELECT `+testenv.UUIDv7SQL("now()", "i")+`, gen_random_uuid(), 'c-42', 'order_confirmation', 'c-42@customers.example',
    'Your order ' || gen_random_uuid(), ?, gen_random_uuid(), now() + i * interval '1 microsecond', now()
FROM generate_series(1, ?) AS i`, notificationBody(orderID), n).Error; err != nil {
		t.Fatal(err)
	}
}

// smtpCeiling sends n e-mails like the sender's to addr over conns connections from this
// process, each kept open for all its e-mails with RSET between them, as the sender does, and
// returns the rate.
func smtpCeiling(t *testing.T, addr string, n, conns int) float64 {
	t.Helper()
	perSec, err := sendCeiling(addr, n, conns)
	if err != nil {
		t.Fatalf("ceiling: %v", err)
	}
	return perSec
}

// smtpCeilingProcess is smtpCeiling from a process of its own, as the sender is: this test
// binary started again as a client (see TestMain). A client in the server's own process is
// spared the wake-ups of another process on every reply, which the sender cannot be.
func smtpCeilingProcess(t *testing.T, addr string, n, conns int) float64 {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s,%d,%d", smtpClientVariable, addr, n, conns))
	cmd.Stderr = os.Stderr // why it failed, if it does
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("ceiling client: %v\n%s", err, out)
	}
	perSec, err := strconv.ParseFloat(strings.TrimSpace(string(out)), 64)
	if err != nil {
		t.Fatalf("ceiling client printed %q, not a rate", out)
	}
	return perSec
}

// smtpClientVariable makes the test binary the ceiling's client: ADDR,N,CONNS.
const smtpClientVariable = "BENCH_SMTP_CEILING_CLIENT"

// TestMain runs the tests, or the ceiling's client when smtpClientVariable says so: it prints
// the rate, or fails.
func TestMain(m *testing.M) {
	if v := os.Getenv(smtpClientVariable); v != "" {
		var addr string
		var n, conns int
		if _, err := fmt.Sscanf(strings.ReplaceAll(v, ",", " "), "%s %d %d", &addr, &n, &conns); err != nil {
			fmt.Fprintf(os.Stderr, "%s=%q: %v\n", smtpClientVariable, v, err)
			os.Exit(2)
		}
		perSec, err := sendCeiling(addr, n, conns)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		fmt.Println(perSec)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// sendCeiling sends n e-mails to addr over conns connections and returns the rate. The e-mails
// are built before the clock starts, so it measures the server.
func sendCeiling(addr string, n, conns int) (float64, error) {
	msgs := make([][]byte, n)
	for i := range msgs {
		msgs[i] = ceilingEmail()
	}
	var next atomic.Int64
	errs := make(chan error, conns)
	var wg sync.WaitGroup
	start := time.Now()
	for range conns {
		wg.Go(func() {
			c, err := smtp.Dial(addr)
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			if err := c.Hello("bench"); err != nil {
				errs <- err
				return
			}
			for i := next.Add(1) - 1; i < int64(n); i = next.Add(1) - 1 {
				if err := sendOne(c, msgs[i]); err != nil {
					errs <- err
					return
				}
			}
			errs <- c.Quit()
		})
	}
	wg.Wait()
	took := time.Since(start)
	close(errs)
	for err := range errs {
		if err != nil {
			return 0, err
		}
	}
	return rate(n, took), nil
}

// sendOne sends one e-mail in a session as the sender does to a server that offers PIPELINING
// and 8BITMIME, as the test server does (RFC 2920): RSET, MAIL, RCPT and DATA in one write,
// then the message. The sender leaves out the RSET on a connection's first e-mail; this sends
// it every time: one more per connection.
func sendOne(c *smtp.Client, msg []byte) error {
	t := c.Text
	if _, err := t.W.WriteString("RSET\r\nMAIL FROM:<orders@shop.example> BODY=8BITMIME\r\nRCPT TO:<c-42@customers.example>\r\nDATA\r\n"); err != nil {
		return err
	}
	if err := t.W.Flush(); err != nil {
		return err
	}
	for _, code := range []int{250, 250, 25, 354} {
		if _, _, err := t.ReadResponse(code); err != nil {
			return err
		}
	}
	w := t.DotWriter()
	if _, err := w.Write(msg); err != nil {
		return err
	}
	if err := w.Close(); err != nil {
		return err
	}
	_, _, err := t.ReadResponse(250)
	return err
}

// ceilingEmail is an e-mail with the headers and body of the sender's, and a Message-ID of the
// ceiling's own.
func ceilingEmail() []byte {
	id, orderID := uuid.New(), uuid.New()
	var b strings.Builder
	b.WriteString("From: orders@shop.example\r\nTo: c-42@customers.example\r\n")
	fmt.Fprintf(&b, "Subject: Your order %s\r\n", orderID)
	fmt.Fprintf(&b, "Message-ID: <%s@ceiling.bench>\r\n", id)
	fmt.Fprintf(&b, "X-Notification-ID: %s\r\nX-Order-ID: %s\r\n", id, orderID)
	fmt.Fprintf(&b, "Date: %s\r\n", time.Now().UTC().Format(time.RFC1123Z))
	b.WriteString("MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n\r\n")
	b.WriteString(notificationBody(orderID))
	return []byte(b.String())
}

// notificationMails counts the e-mails the notification service sent to srv, and how many of
// them repeated a Message-ID.
func notificationMails(srv *testenv.SMTPServer) (mails, repeats int) {
	seen := map[string]bool{}
	for _, m := range srv.Mail() {
		if !strings.HasSuffix(m.MessageID, notificationMessageID) {
			continue
		}
		mails++
		if seen[m.MessageID] {
			repeats++
		}
		seen[m.MessageID] = true
	}
	return mails, repeats
}
