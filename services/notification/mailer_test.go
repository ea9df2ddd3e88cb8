package main

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// mailTo is a notification to recipient, with an id of its own.
func mailTo(recipient string) Notification {
	return Notification{ID: uuid.New(), OrderID: uuid.New(), Recipient: recipient, Subject: "Your order", Body: "Thank you."}
}

// deliverNow delivers n through d with a deadline.
func deliverNow(d *smtpDeliverer, n Notification) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return d.Deliver(ctx, n)
}

// mailServer is a running test mail server and a deliverer to it of at most conns connections.
func mailServer(t *testing.T, conns int) (*testenv.SMTPServer, *smtpDeliverer) {
	t.Helper()
	srv := testenv.NewSMTPServer(t)
	srv.Start()
	d := newSMTPDeliverer(srv.Addr, "orders@shop.example", conns)
	t.Cleanup(d.Close)
	return srv, d
}

// Deliveries at once share at most the deliverer's connections, each kept open for the next:
// thirty e-mails from thirty goroutines open three sessions.
func TestDeliveriesShareABoundedPoolOfConnections(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 3)
	var wg sync.WaitGroup
	for range 30 {
		wg.Go(func() {
			if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if n := len(srv.Mail()); n != 30 {
		t.Fatalf("%d e-mails, want 30", n)
	}
	if n := srv.Sessions(); n < 1 || n > 3 {
		t.Fatalf("%d SMTP sessions, want 1 to 3: the pool's bound, every connection reused", n)
	}
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	if n, open := srv.Sessions(), srv.OpenSessions(); n > 3 || open != n {
		t.Fatalf("%d sessions, %d open, after one more e-mail; want no new one, all still open", n, open)
	}
}

// A connection on which a delivery failed is closed, never used again: the next delivery gets
// a new one, and the failed one's session ends.
func TestConnectionOfAFailedDeliveryIsNotReused(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 1)
	srv.Refuse("gone@customers.example")
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	err := deliverNow(d, mailTo("gone@customers.example"))
	if err == nil || !strings.Contains(err.Error(), "rcpt to") || !strings.Contains(err.Error(), "550") {
		t.Fatalf("delivery to a refused recipient: err = %v, want the 550 at RCPT TO", err)
	}
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	if n := srv.Sessions(); n != 2 {
		t.Fatalf("%d SMTP sessions, want 2: the failed one, then a new one", n)
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return srv.OpenSessions() == 1 }, "the failed delivery's session is still open")
	if n := len(srv.Mail()); n != 2 {
		t.Fatalf("%d e-mails, want the 2 to c-1", n)
	}
}

// An idle connection the server closed (a restart, its idle timeout) is found out by the RSET
// that starts its reuse, before any message goes on it, and replaced: the delivery succeeds.
func TestIdleConnectionTheServerClosedIsReplaced(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 1)
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	srv.Start()
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatalf("delivery after the server closed the idle connection: %v, want it on a new one", err)
	}
	if n := srv.Sessions(); n != 2 {
		t.Fatalf("%d SMTP sessions, want 2", n)
	}
}

// A connection idle for the idle timeout is closed, and the next delivery opens another.
func TestIdleConnectionIsClosedAfterTheIdleTimeout(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 2)
	d.idleTimeout = 200 * time.Millisecond
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	if n := srv.OpenSessions(); n != 1 {
		t.Fatalf("%d open SMTP sessions after a delivery, want 1 kept for the next", n)
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return srv.OpenSessions() == 0 }, "the idle connection was never closed")
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	if n := srv.Sessions(); n != 2 {
		t.Fatalf("%d SMTP sessions, want 2", n)
	}
}

// Close says QUIT to the idle connections: their sessions end.
func TestCloseEndsTheIdleSessions(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 2)
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	d.Close()
	testenv.Eventually(t, 5*time.Second, func() bool { return srv.OpenSessions() == 0 }, "sessions still open after Close")
}

// A delivery out of time before it has a connection is not started: its error says so, and the
// idle connection it would have taken stays healthy for the next delivery.
func TestDeliveryOutOfTimeBeforeAConnectionIsNotStarted(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 1)
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := d.Deliver(ctx, mailTo("c-1@customers.example")); !errors.Is(err, errNotStarted) {
		t.Fatalf("delivery with its budget spent: err = %v, want errNotStarted", err)
	}
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	if n, mails := srv.Sessions(), len(srv.Mail()); n != 1 || mails != 2 {
		t.Fatalf("%d SMTP sessions and %d e-mails, want 1 and 2: the idle connection reused", n, mails)
	}
}
