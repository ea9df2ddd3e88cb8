package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"mime/quotedprintable"
	"net"
	"net/mail"
	"net/textproto"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	gosmtp "github.com/emersion/go-smtp"
	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/events"
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

// silentMailServer is the address of a server that accepts connections, holds them open and
// never says anything, not even its greeting; accepted counts the connections.
func silentMailServer(t *testing.T) (addr string, accepted *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	accepted = new(atomic.Int64)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			t.Cleanup(func() { _ = conn.Close() })
		}
	}()
	return ln.Addr().String(), accepted
}

// stalledDeliverer is a deliverer of one connection, to a silent server, and a delivery that
// holds that connection, stalled in its greeting until the test ends.
func stalledDeliverer(t *testing.T) *smtpDeliverer {
	t.Helper()
	addr, accepted := silentMailServer(t)
	d := newSMTPDeliverer(addr, "orders@shop.example", 1)
	ctx, cancel := context.WithCancel(context.Background())
	stalled := make(chan error, 1)
	go func() { stalled <- d.Deliver(ctx, mailTo("c-1@customers.example")) }()
	t.Cleanup(func() {
		cancel()
		// Taken by the pump, not withdrawn: cut short in its greeting by its own end, not the
		// server's, so not started either.
		if err := <-stalled; err == nil || !strings.Contains(err.Error(), "smtp greeting") {
			t.Errorf("the stalled delivery: err = %v, want it cut short in its greeting", err)
		}
		d.Close()
	})
	testenv.Eventually(t, 5*time.Second, func() bool { return accepted.Load() == 1 }, "the first delivery did not connect")
	return d
}

// waitingDeliveries is how many deliveries wait for a connection.
func waitingDeliveries(d *smtpDeliverer) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.waiting)
}

// burst delivers n e-mails through d from n goroutines at once.
func burst(t *testing.T, d *smtpDeliverer, n int) {
	t.Helper()
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
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
	burst(t, d, 30)
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

// Deliveries one after another keep to one connection, however many the deliverer may open: a
// connection is opened only when no open one is free.
func TestDeliveriesOneAfterAnotherKeepToOneConnection(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 3)
	for range 5 {
		if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
			t.Fatal(err)
		}
	}
	if n, mails := srv.Sessions(), len(srv.Mail()); n != 1 || mails != 5 {
		t.Fatalf("%d SMTP sessions and %d e-mails, want 1 and 5", n, mails)
	}
}

// After a burst, deliveries one after another go to the connection used last: the others are
// left unused and close at their idle timeout, instead of each being kept open by every third
// delivery.
func TestDeliveriesAfterABurstKeepToTheConnectionUsedLast(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 3)
	d.idleTimeout = 300 * time.Millisecond
	burst(t, d, 30)
	sessions := srv.Sessions()
	testenv.Eventually(t, 10*time.Second, func() bool {
		if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
			t.Fatal(err)
		}
		return srv.OpenSessions() == 1
	}, "deliveries one after another kept %d connections open", srv.OpenSessions())
	if n := srv.Sessions(); n != sessions {
		t.Fatalf("%d SMTP sessions after the burst's %d: deliveries one after another opened new ones", n, sessions)
	}
}

// A delivery after Close is not started: nothing was tried, so the sender releases the
// notification rather than counting a failed attempt.
func TestDeliveryAfterCloseIsNotStarted(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 1)
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	d.Close()
	if err := deliverNow(d, mailTo("c-1@customers.example")); !errors.Is(err, errNotStarted) {
		t.Fatalf("delivery after Close: err = %v, want errNotStarted", err)
	}
	// One a pump took from the queue, or was handed, just as Close came.
	taken := &smtpJob{ctx: context.Background(), n: mailTo("c-1@customers.example"), done: make(chan error, 1)}
	if _, err := d.deliver(nil, taken); !errors.Is(err, errNotStarted) {
		t.Fatalf("delivery taken by a pump as Close came: err = %v, want errNotStarted", err)
	}
	if n := len(srv.Mail()); n != 1 {
		t.Fatalf("%d e-mails, want only the one before Close", n)
	}
}

// A delivery waiting for a connection when Close comes is not started, and learns so at once,
// while the delivery that holds the only connection is still stalled.
func TestDeliveryWaitingAtCloseIsNotStarted(t *testing.T) {
	t.Parallel()
	d := stalledDeliverer(t)
	waiting := make(chan error, 1)
	go func() { waiting <- deliverNow(d, mailTo("c-2@customers.example")) }()
	testenv.Eventually(t, 5*time.Second, func() bool { return waitingDeliveries(d) == 1 },
		"the second delivery is not waiting for the connection")
	closing := time.Now()
	go d.Close()
	select {
	case err := <-waiting:
		if !errors.Is(err, errNotStarted) || !errors.Is(err, errClosed) {
			t.Fatalf("the waiting delivery: err = %v, want errNotStarted, closed", err)
		}
		if took := time.Since(closing); took > 500*time.Millisecond {
			t.Fatalf("the waiting delivery was answered %v after Close began, want at once", took)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the waiting delivery was not answered at Close")
	}
}

// A delivery whose budget runs out while it waits for a connection is not started, and leaves
// the queue.
func TestDeliveryOutOfTimeWhileWaitingIsNotStarted(t *testing.T) {
	t.Parallel()
	d := stalledDeliverer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	answer := make(chan error, 1)
	go func() { answer <- d.Deliver(ctx, mailTo("c-2@customers.example")) }()
	select {
	case err := <-answer:
		if !errors.Is(err, errNotStarted) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("delivery out of time while waiting: err = %v, want errNotStarted, deadline exceeded", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the delivery out of time while waiting was never answered")
	}
	if n := waitingDeliveries(d); n != 0 {
		t.Fatalf("%d deliveries still waiting, want none", n)
	}
}

// A delivery begins a conversation only with time left for it: one cut off by its deadline
// after the server took the message would be charged as failed and the e-mail sent again. On a
// relay that answers each message 300 ms late, five deliveries with a second each queue for
// one connection: those that start finish; the rest are not started. None is reported failed
// while the server has its message.
func TestDeliveryShortOfTimeIsNotStartedOnASlowServer(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 1)
	srv.AnswerLate(300 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	notes := make([]Notification, 5)
	errs := make([]error, len(notes))
	var wg sync.WaitGroup
	for i := range notes {
		notes[i] = mailTo(fmt.Sprintf("c-%d@customers.example", i))
		wg.Go(func() { errs[i] = d.Deliver(ctx, notes[i]) })
	}
	wg.Wait()
	accepted := map[string]bool{}
	for _, m := range srv.Mail() {
		accepted[m.To] = true
	}
	sent := 0
	for i, err := range errs {
		switch {
		case err == nil:
			sent++
		case accepted[notes[i].Recipient]:
			t.Errorf("delivery %d: the server took the message, but the delivery says %v: it would be sent again", i, err)
		case !errors.Is(err, errNotStarted):
			t.Errorf("delivery %d: %v, want sent or not started", i, err)
		}
	}
	if sent == 0 || sent != len(accepted) {
		t.Fatalf("%d deliveries sent, the server took %d messages; want the same, at least one", sent, len(accepted))
	}
}

// Against a server slower than half a delivery's budget, a delivery asked for with its whole
// budget still begins: the margin never asks for more than half the budget, or every delivery
// would be released and leased again at once, in a loop. A conversation cut off by its
// deadline counts among the recent ones, for at least as long as it ran.
func TestDeliveryWithItsWholeBudgetBeginsOnASlowServer(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 1)
	srv.AnswerLate(2 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := d.Deliver(ctx, mailTo("c-1@customers.example")); err == nil || errors.Is(err, errNotStarted) {
		t.Fatalf("delivery with 300 ms to a server that answers in 2 s: %v, want it cut off", err)
	}
	d.mu.Lock()
	longest := d.longest.at()
	d.mu.Unlock()
	if longest < 250*time.Millisecond {
		t.Fatalf("longest recent conversation %s after one cut off at 300 ms, want about 300 ms", longest)
	}
	srv.AnswerLate(600 * time.Millisecond)
	for i := range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := d.Deliver(ctx, mailTo("c-1@customers.example"))
		cancel()
		if err != nil {
			t.Fatalf("delivery %d, with a budget of 1 s on a server that answers in 600 ms: %v, want it sent", i, err)
		}
	}
}

// A delivery asked for with only part of its budget left (a leased notification that waited in
// line for a worker) is measured against its whole budget: with less left than a conversation
// may take, it does not begin, though half of what it has left would have let it. Begun, it
// would be cut off after the server took the message, and the e-mail would go again.
func TestDeliveryWithLittleOfItsBudgetLeftIsNotStarted(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 1)
	srv.AnswerLate(300 * time.Millisecond)
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(withBudget(context.Background(), 10*time.Second), 250*time.Millisecond)
	defer cancel()
	late := mailTo("c-2@customers.example")
	if err := d.Deliver(ctx, late); !errors.Is(err, errNotStarted) {
		t.Fatalf("delivery with 250 ms of 10 s left, on a server that takes 300 ms: %v, want not started", err)
	}
	for _, m := range srv.Mail() {
		if m.To == late.Recipient {
			t.Fatal("the server has the message of a delivery that was not started")
		}
	}
}

// A delivery with little of its budget left does not begin on a deliverer that has had no
// conversation yet, nor on one whose last conversation ended long ago: nothing known of the
// server, or nothing newer, is no sign that a conversation would be quick. Begun, on a relay that
// answers each message 600 ms late, it would be cut off after the server took the message, and
// the e-mail would go again.
func TestDeliveryShortOfTimeIsNotStartedOnAnIdleDeliverer(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		budget time.Duration
		idle   time.Duration // since the last conversation, of 300 ms; 0 for none
	}{
		{"no conversation yet, budget 10 s", 10 * time.Second, 0},
		{"no conversation yet, budget 30 s", 30 * time.Second, 0},
		{"last conversation 25 s ago, budget 10 s", 10 * time.Second, 25 * time.Second},
		{"last conversation 25 s ago, budget 30 s", 30 * time.Second, 25 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv, d := mailServer(t, 1)
			srv.AnswerLate(600 * time.Millisecond)
			if tc.idle > 0 {
				d.mu.Lock()
				d.longest.add(time.Now().Add(-tc.idle), 300*time.Millisecond)
				d.mu.Unlock()
			}
			ctx, cancel := context.WithTimeout(withBudget(context.Background(), tc.budget), 150*time.Millisecond)
			defer cancel()
			if err := d.Deliver(ctx, mailTo("c-1@customers.example")); !errors.Is(err, errNotStarted) {
				t.Errorf("delivery with 150 ms of %s left: %v, want not started", tc.budget, err)
			}
			if mail := srv.Mail(); len(mail) != 0 {
				t.Errorf("the server took %d messages, want none: the delivery was not started", len(mail))
			}
		})
	}
}

// The longest recent conversation is forgotten by halves, as time is spent on conversations
// since: a server that was slow once holds back deliveries short of time for a while, never for
// good; and idle time, which says nothing of the server, forgets nothing.
func TestLongestRecentConversationFadesOnlyWhileConversing(t *testing.T) {
	t.Parallel()
	var l longestRecent
	now := time.Now()
	want := func(what string, d time.Duration) {
		t.Helper()
		if got := l.at(); got.Round(time.Millisecond) != d.Round(time.Millisecond) {
			t.Errorf("%s: longest %s, want %s", what, got, d)
		}
	}
	l.add(now, 20*time.Second)
	l.add(now, time.Second) // shorter: the longest stays
	want("a 20 s conversation, then a 1 s one", 20*time.Second)
	now = now.Add(time.Hour)
	l.add(now, time.Second)
	want("an hour idle, then a 1 s conversation", time.Duration(float64(20*time.Second)*math.Exp2(-0.1)))
	for range 9 {
		now = now.Add(time.Second)
		l.add(now, time.Second)
	}
	want("ten 1 s conversations one after another", 10*time.Second)
	// Eight connections at once: what counts is the time between the conversations' ends.
	for range 80 {
		now = now.Add(longestHalfLife / 80)
		l.add(now, time.Second)
	}
	want("a half-life more of conversations side by side", 5*time.Second)
	l.add(now.Add(-time.Millisecond), 2*time.Second) // recorded late: ended before the newest
	want("a 2 s conversation recorded out of order", 5*time.Second)
	l.add(now, 6*time.Second) // longer than the 5 s left of the first
	want("a 6 s conversation after the 20 s one faded to 5 s", 6*time.Second)
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

// A server that takes so many messages a session answers 421 to the next MAIL: nothing of the
// message was entrusted to it, so the delivery goes on over a new connection instead of
// counting as failed. On a new connection a 421 is the message's failure: no endless redial.
func TestSessionLimitOfTheServerIsNotADeliveryFailure(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 1)
	srv.LimitPerSession(2)
	for i := range 5 {
		if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
			t.Fatalf("delivery %d, to a server that takes 2 messages a session: %v, want it sent", i, err)
		}
	}
	if n, want := srv.Sessions(), 3; n != want || len(srv.Mail()) != 5 {
		t.Fatalf("%d SMTP sessions, %d e-mails; want %d sessions for 5 e-mails", n, len(srv.Mail()), want)
	}
	srv.LimitPerSession(-1) // MAIL always refused, on a new connection too
	err := deliverNow(d, mailTo("c-1@customers.example"))
	if err == nil || errors.Is(err, errStale) || !strings.Contains(err.Error(), "421") {
		t.Fatalf("delivery to a server that takes no message: %v, want the 421 as its failure", err)
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
// idle connection it would have taken stays healthy for the next delivery. Out of time when it
// asks, and when the connection's goroutine takes it (handed over as its budget ran out).
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
	job := &smtpJob{ctx: ctx, n: mailTo("c-1@customers.example"), done: make(chan error, 1)}
	if err := d.hand(job); err != nil {
		t.Fatal(err)
	}
	if err := <-job.done; !errors.Is(err, errNotStarted) {
		t.Fatalf("delivery handed over with its budget spent: err = %v, want errNotStarted", err)
	}
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	if n, mails := srv.Sessions(), len(srv.Mail()); n != 1 || mails != 2 {
		t.Fatalf("%d SMTP sessions and %d e-mails, want 1 and 2: the idle connection reused", n, mails)
	}
}

// A server that pipelines (RFC 2920) gets a reused connection's RSET, MAIL, RCPT and DATA in one
// write; one that does not gets each command after the reply to the one before. Both receive
// every e-mail. A proxy between the two records what the deliverer writes, and can hide the
// server's PIPELINING.
func TestCommandsArePipelinedOnlyWhereTheServerSaysSo(t *testing.T) {
	t.Parallel()
	for _, pipelining := range []bool{true, false} {
		t.Run(fmt.Sprintf("pipelining=%v", pipelining), func(t *testing.T) {
			t.Parallel()
			srv, proxy, d := proxiedMailServer(t, pipelining)
			for range 3 {
				if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
					t.Fatal(err)
				}
			}
			if n := len(srv.Mail()); n != 3 {
				t.Fatalf("%d e-mails, want 3", n)
			}
			together := 0
			for _, w := range proxy.writes() {
				if strings.Contains(w, "MAIL FROM") && strings.Contains(w, "RCPT TO") {
					together++
				}
				if pipelining && strings.HasPrefix(w, "RSET") && !strings.HasSuffix(w, "RSET\r\nMAIL FROM:<orders@shop.example> BODY=8BITMIME\r\nRCPT TO:<c-1@customers.example>\r\nDATA\r\n") {
					t.Errorf("a reused connection's commands went as %q, want RSET, MAIL, RCPT and DATA in one write", w)
				}
			}
			switch {
			case pipelining && together != 3:
				t.Fatalf("%d of 3 e-mails had MAIL and RCPT in one write, want 3: %q", together, proxy.writes())
			case !pipelining && together != 0:
				t.Fatalf("%d e-mails had MAIL and RCPT in one write to a server that does not pipeline, want 0", together)
			}
		})
	}
}

// An idle connection the server reset, rather than closed, fails at the write of its RSET,
// before any message goes on it, and is replaced too, whether the server pipelines or not.
func TestIdleConnectionTheServerResetIsReplaced(t *testing.T) {
	t.Parallel()
	for _, pipelining := range []bool{true, false} {
		t.Run(fmt.Sprintf("pipelining=%v", pipelining), func(t *testing.T) {
			t.Parallel()
			srv, proxy, d := proxiedMailServer(t, pipelining)
			if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
				t.Fatal(err)
			}
			proxy.reset(t)
			if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
				t.Fatalf("delivery after the server reset the idle connection: %v, want it on a new one", err)
			}
			if n := len(srv.Mail()); n != 2 {
				t.Fatalf("%d e-mails, want 2", n)
			}
		})
	}
}

// A reused connection whose RSET goes unanswered until the delivery's deadline is not a failed
// delivery: nothing of the message was entrusted to it, so the notification is released
// uncharged rather than counted as a failed attempt and put off by a backoff.
func TestRSETUnansweredUntilTheDeadlineIsNotStarted(t *testing.T) {
	t.Parallel()
	srv, proxy, d := proxiedMailServer(t, true)
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	proxy.muted.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	err := d.Deliver(ctx, mailTo("c-1@customers.example"))
	if !errors.Is(err, errNotStarted) {
		t.Fatalf("err = %v, want it not started", err)
	}
	if !slices.ContainsFunc(proxy.writes(), func(w string) bool { return strings.HasPrefix(w, "RSET") }) {
		t.Fatalf("no RSET was sent (the delivery was refused before it, and the test shows nothing): %q", proxy.writes())
	}
	if n := len(srv.Mail()); n != 1 {
		t.Fatalf("%d e-mails, want 1", n)
	}
}

// proxiedMailServer is a running test mail server behind a recording proxy that offers
// PIPELINING or hides it, and a deliverer of one connection to the proxy.
func proxiedMailServer(t *testing.T, pipelining bool) (*testenv.SMTPServer, *smtpRecorder, *smtpDeliverer) {
	t.Helper()
	if pipelining {
		return hidingMailServer(t)
	}
	return hidingMailServer(t, "PIPELINING")
}

// hidingMailServer is a running test mail server behind a recording proxy that hides the
// extensions named, and a deliverer of one connection to the proxy.
func hidingMailServer(t *testing.T, hide ...string) (*testenv.SMTPServer, *smtpRecorder, *smtpDeliverer) {
	t.Helper()
	srv := testenv.NewSMTPServer(t)
	srv.Start()
	proxy := newSMTPRecorder(t, srv.Addr, hide...)
	d := newSMTPDeliverer(proxy.addr, "orders@shop.example", 1)
	t.Cleanup(d.Close)
	return srv, proxy, d
}

// smtpRecorder forwards SMTP connections to a server, keeping each read of the client's side
// as one write; the extensions named in hide are renamed in the server's replies.
type smtpRecorder struct {
	addr    string
	muted   atomic.Bool // the server's replies are dropped, unseen by the client
	mu      sync.Mutex
	seen    []string
	clients []*net.TCPConn
}

// reset drops every client connection with a TCP reset, as a server or a firewall may drop an
// idle one.
func (r *smtpRecorder) reset(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.clients {
		if err := c.SetLinger(0); err != nil {
			t.Fatal(err)
		}
		_ = c.Close()
	}
	r.clients = nil
}

func newSMTPRecorder(t *testing.T, server string, hide ...string) *smtpRecorder {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	r := &smtpRecorder{addr: ln.Addr().String()}
	go func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			r.mu.Lock()
			r.clients = append(r.clients, client.(*net.TCPConn))
			r.mu.Unlock()
			upstream, err := net.Dial("tcp", server)
			if err != nil {
				_ = client.Close()
				return
			}
			go func() {
				defer func() { _ = client.Close() }()
				buf := make([]byte, 64<<10)
				for {
					n, err := upstream.Read(buf)
					if err != nil {
						return
					}
					out := buf[:n]
					for _, ext := range hide {
						out = bytes.ReplaceAll(out, []byte(ext), []byte("X-HIDDEN-"+ext))
					}
					if r.muted.Load() {
						continue
					}
					if _, err := client.Write(out); err != nil {
						return
					}
				}
			}()
			go func() {
				defer func() { _ = upstream.Close() }()
				buf := make([]byte, 64<<10)
				for {
					n, err := client.Read(buf)
					if err != nil {
						return
					}
					r.mu.Lock()
					r.seen = append(r.seen, string(buf[:n]))
					r.mu.Unlock()
					if _, err := upstream.Write(buf[:n]); err != nil {
						return
					}
				}
			}()
		}
	}()
	return r
}

// writes is what the client wrote so far, a read at a time.
func (r *smtpRecorder) writes() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.seen...)
}

// A server that offers 8BITMIME gets the body as it is, declared 8bit; one that does not gets
// it quoted-printable, every byte of the conversation 7-bit: a strict relay refuses an 8-bit
// body it was not told of, and an order confirmation has a "×" in every line.
func TestBodyIsQuotedPrintableWhereTheServerTakesNo8BitMIME(t *testing.T) {
	t.Parallel()
	n := mailTo("c-1@customers.example")
	n.Body = "Thank you for your order.\r\n\r\n  2 × SKU-1 at 9.99\r\n" + strings.Repeat("a", 100) + "=\r\n"
	for _, eightBit := range []bool{true, false} {
		t.Run(fmt.Sprintf("8bitmime=%v", eightBit), func(t *testing.T) {
			t.Parallel()
			srv, proxy, d := hidingMailServer(t)
			if !eightBit {
				srv, proxy, d = hidingMailServer(t, "8BITMIME")
			}
			if err := deliverNow(d, n); err != nil {
				t.Fatal(err)
			}
			mail := srv.Mail()
			if len(mail) != 1 {
				t.Fatalf("%d e-mails, want 1", len(mail))
			}
			encoding, body := mail[0].Header.Get("Content-Transfer-Encoding"), mail[0].Body
			if !eightBit {
				decoded, err := io.ReadAll(quotedprintable.NewReader(strings.NewReader(body)))
				if err != nil {
					t.Fatalf("body %q: %v", body, err)
				}
				body = string(decoded)
			}
			if want := map[bool]string{true: "8bit", false: "quoted-printable"}[eightBit]; encoding != want || body != n.Body {
				t.Fatalf("encoding %q, body %q; want %q and %q", encoding, body, want, n.Body)
			}
			for _, w := range proxy.writes() {
				if strings.Contains(w, "MAIL FROM") && strings.Contains(w, "BODY=8BITMIME") != eightBit {
					t.Errorf("MAIL FROM went as %q to a server whose 8BITMIME is %v", w, eightBit)
				}
				if i := strings.IndexFunc(w, func(r rune) bool { return r > 127 }); !eightBit && i >= 0 {
					t.Errorf("the client wrote an 8-bit byte to a server without 8BITMIME: %q", w)
				}
			}
		})
	}
}

// onTheWire is msg as send writes it after DATA: through the dot-writer, ended by a lone dot.
func onTheWire(t *testing.T, msg []byte) string {
	t.Helper()
	var b bytes.Buffer
	w := textproto.NewWriter(bufio.NewWriter(&b)).DotWriter()
	if _, err := w.Write(msg); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// lineEnd is what a server may take for the end of a line: CRLF, or, a lenient one, a bare CR
// or LF.
var lineEnd = regexp.MustCompile("\r\n|\r|\n")

// A body goes as it is, declared 8bit, only if SMTP carries it so: no line over 998 octets, no
// CR but in a CRLF. Otherwise it goes quoted-printable, its text kept: a cancellation's reason
// of 500 "あ" is one line of 1,508 octets, and an SKU with a bare CR would go out as it is, the
// "." after it not dot-stuffed (to a server that ends lines at a bare CR, the end of the data).
func TestBodyGoes8BitOnlyAsSMTPCarriesIt(t *testing.T) {
	t.Parallel()
	reason := cancellation(events.OrderCancelled{OrderID: uuid.New(), CustomerID: "c-1", Reason: strings.Repeat("あ", 500)}).Body
	sku := confirmation(events.OrderPlaced{OrderID: uuid.New(), CustomerID: "c-1", TotalCents: 100,
		Lines: []events.Line{{SKU: "a\r.\r\nX", Quantity: 1, UnitPriceCents: 100}}}).Body
	for name, tc := range map[string]struct {
		body, encoding string
		text           string // as the recipient reads it
	}{
		"a line of 998 octets":  {strings.Repeat("a", 998) + "\r\n", "8bit", strings.Repeat("a", 998) + "\r\n"},
		"a line of 999 octets":  {strings.Repeat("a", 999) + "\r\n", "quoted-printable", strings.Repeat("a", 999) + "\r\n"},
		"a reason of 500 あ":     {reason, "quoted-printable", reason},
		"an SKU with a bare CR": {sku, "quoted-printable", strings.Replace(sku, "a\r.", "a\r\n.", 1)},
		"a NUL":                 {"a\x00b\r\n", "quoted-printable", "a\x00b\r\n"}, // 8bit data has none (RFC 6152)
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			n := mailTo("c-1@customers.example")
			n.Body = tc.body
			msg, err := composeEmail("orders@shop.example", n, true)
			if err != nil {
				t.Fatal(err)
			}
			wire := onTheWire(t, msg)
			for line := range strings.SplitSeq(wire, "\r\n") {
				if len(line) > maxLine {
					t.Errorf("a line of %d octets on the wire, want %d at most", len(line), maxLine)
				}
			}
			if i := regexp.MustCompile("\r([^\n]|$)").FindStringIndex(wire); i != nil {
				t.Errorf("a bare CR on the wire at %d: %q", i[0], wire[max(i[0]-10, 0):min(i[1]+10, len(wire))])
			}
			lines := lineEnd.Split(wire, -1)
			if i := slices.Index(lines, "."); i != len(lines)-2 {
				t.Errorf("a lone dot on the wire at line %d of %d, before the end of the data", i+1, len(lines)-1)
			}
			m, err := mail.ReadMessage(bytes.NewReader(msg))
			if err != nil {
				t.Fatal(err)
			}
			body := m.Body
			if tc.encoding == "quoted-printable" {
				body = quotedprintable.NewReader(body)
			}
			text, err := io.ReadAll(body)
			if err != nil {
				t.Fatal(err)
			}
			if encoding := m.Header.Get("Content-Transfer-Encoding"); encoding != tc.encoding || string(text) != tc.text {
				t.Errorf("encoding %q, text %q; want %q and %q", encoding, text, tc.encoding, tc.text)
			}
		})
	}
}

// No header value puts a line of its own on the wire: a recipient with a line break in it (it
// would reach RCPT TO and the To header) is refused before any command, and a subject with one
// is encoded (RFC 2047), its text kept.
func TestHeaderValuesPutNoLineOfTheirOwnOnTheWire(t *testing.T) {
	t.Parallel()
	const injected = "Bcc: y@example.org"
	noInjectedLine := func(t *testing.T, proxy *smtpRecorder) {
		t.Helper()
		for _, line := range lineEnd.Split(strings.Join(proxy.writes(), ""), -1) {
			if strings.HasPrefix(strings.ToLower(line), "bcc:") {
				t.Errorf("the client wrote the line %q", line)
			}
		}
	}
	t.Run("recipient", func(t *testing.T) {
		t.Parallel()
		srv, proxy, d := hidingMailServer(t)
		if err := deliverNow(d, mailTo("c-1@customers.example\r\n"+injected)); !errors.Is(err, errNotAMailbox) {
			t.Errorf("err = %v, want %v", err, errNotAMailbox)
		}
		if n := len(srv.Mail()); n != 0 {
			t.Errorf("%d e-mails, want none", n)
		}
		noInjectedLine(t, proxy)
	})
	t.Run("subject", func(t *testing.T) {
		t.Parallel()
		srv, proxy, d := hidingMailServer(t)
		n := mailTo("c-1@customers.example")
		n.Subject = "x\r\n" + injected
		if err := deliverNow(d, n); err != nil {
			t.Fatal(err)
		}
		got := srv.Mail()
		if len(got) != 1 {
			t.Fatalf("%d e-mails, want 1", len(got))
		}
		subject, err := new(mime.WordDecoder).DecodeHeader(got[0].Header.Get("Subject"))
		if bcc := got[0].Header.Get("Bcc"); bcc != "" || err != nil || subject != n.Subject {
			t.Errorf("Bcc %q, subject %q (%v); want no Bcc and the subject %q", bcc, subject, err, n.Subject)
		}
		noInjectedLine(t, proxy)
	})
}

// Without SMTP_ADDR the log stands in for the mail server. Its line says which notification was
// "sent", not to whom: the address is personal data, and the notification id leads to it.
func TestDeliveryToTheLogNamesNoRecipient(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	recipient := e.row(t, id).Recipient
	s := e.sender(t, "log", logDeliverer{log: e.log})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if delivered, err := s.deliverOne(ctx); err != nil || !delivered {
		t.Fatalf("deliver to the log: %v, %v; want it delivered", delivered, err)
	}
	if n := e.row(t, id); n.Status != StatusSent {
		t.Fatalf("notification %s is %q after its delivery to the log, want sent", id, n.Status)
	}
	if lines := e.logs.Lines("notification delivered to the log", "notification_id="+id.String(), `subject="Your order"`); len(lines) != 1 {
		t.Errorf("%d lines about the delivery to the log, want 1; logs:\n%s", len(lines), e.logs)
	}
	if recipient == "" || strings.Contains(e.logs.String(), recipient) {
		t.Errorf("the log names the recipient %q:\n%s", recipient, e.logs)
	}
}

// Deliveries waiting for a connection get it oldest first: the one that has waited longest,
// and has the least of its budget left, goes next. The server holds its answer to the first
// message until all three wait, however long queueing them takes.
func TestDeliveriesWaitingForAConnectionGoOldestFirst(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 1)
	release := srv.HoldAnswers()
	var wg sync.WaitGroup
	deliver := func(recipient string) {
		wg.Go(func() {
			if err := deliverNow(d, mailTo(recipient)); err != nil {
				t.Error(err)
			}
		})
	}
	deliver("first@customers.example")
	testenv.Eventually(t, 5*time.Second, func() bool { return len(srv.Mail()) == 1 }, "the first delivery did not reach the server")
	want := []string{"first@customers.example"}
	for i := range 3 {
		recipient := fmt.Sprintf("waiting-%d@customers.example", i)
		want = append(want, recipient)
		deliver(recipient)
		testenv.Eventually(t, 5*time.Second, func() bool { return waitingDeliveries(d) == i+1 }, "%s is not waiting for the connection", recipient)
	}
	release()
	wg.Wait()
	var got []string
	for _, m := range srv.Mail() {
		got = append(got, m.To)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("e-mails in the order %q, want %q", got, want)
	}
}

// A conversation stalled on the server (a relay that never answers the final dot) ends when its
// delivery is cancelled, as at the end of a shutdown's grace, not only at its deadline: the
// delivery fails as soon as it is cancelled, long before its deadline, and is not taken for one
// never started.
func TestStalledConversationEndsWhenItsDeliveryIsCancelled(t *testing.T) {
	t.Parallel()
	srv, d := mailServer(t, 1)
	srv.HoldAnswers()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	answer := make(chan error, 1)
	go func() { answer <- d.Deliver(ctx, mailTo("c-1@customers.example")) }()
	testenv.Eventually(t, 5*time.Second, func() bool { return len(srv.Mail()) == 1 }, "the message did not reach the server")
	cancel()
	select {
	case err := <-answer:
		if err == nil || errors.Is(err, errNotStarted) {
			t.Fatalf("delivery cancelled while the server held its message: err = %v, want its failure", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the delivery went on after it was cancelled, waiting for the server")
	}
}

// Close says QUIT on each idle connection before closing it: the session ends politely, not
// by a dropped connection (or by the connection's collection, long after).
func TestCloseSaysQuit(t *testing.T) {
	t.Parallel()
	srv, proxy, d := proxiedMailServer(t, true)
	if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
		t.Fatal(err)
	}
	d.Close()
	testenv.Eventually(t, 5*time.Second, func() bool { return srv.OpenSessions() == 0 }, "sessions still open after Close")
	if writes := proxy.writes(); !slices.Contains(writes, "QUIT\r\n") {
		t.Fatalf("the deliverer wrote %q, want a QUIT at Close", writes)
	}
}

// A server that does not offer SMTPUTF8 gets every address as ASCII, before DATA and in the
// headers: a domain as its A-label, and a recipient whose local part has no ASCII form not at
// all, refused before any command of its own, the connection kept for the next. One that
// offers SMTPUTF8 gets the addresses as they are.
func TestAddressesAreASCIIWhereTheServerTakesNoSMTPUTF8(t *testing.T) {
	t.Parallel()
	t.Run("no SMTPUTF8", func(t *testing.T) {
		t.Parallel()
		srv := testenv.NewSMTPServer(t)
		srv.Start()
		proxy := newSMTPRecorder(t, srv.Addr)
		d := newSMTPDeliverer(proxy.addr, "orders@shöp.example", 1)
		t.Cleanup(d.Close)
		if err := deliverNow(d, mailTo("ann@bücher.example")); err != nil {
			t.Fatal(err)
		}
		err := deliverNow(d, mailTo("jöhn@example.com"))
		if !errors.Is(err, errUTF8LocalPart) || strings.Contains(err.Error(), "jöhn") {
			t.Errorf("err = %v, want %v, without the address", err, errUTF8LocalPart)
		}
		if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
			t.Fatal(err)
		}
		got := srv.Mail()
		if len(got) != 2 {
			t.Fatalf("%d e-mails, want 2", len(got))
		}
		const from, to = "orders@xn--shp-tna.example", "ann@xn--bcher-kva.example"
		if got[0].From != from || got[0].To != to || got[0].Header.Get("From") != from || got[0].Header.Get("To") != to {
			t.Errorf("envelope %s to %s, headers %q to %q; want %s to %s in both", got[0].From, got[0].To,
				got[0].Header.Get("From"), got[0].Header.Get("To"), from, to)
		}
		// The bodies and subjects are ASCII too: the whole conversation must be.
		wire := strings.Join(proxy.writes(), "")
		if i := strings.IndexFunc(wire, func(r rune) bool { return r >= 0x80 }); i >= 0 {
			t.Errorf("an 8-bit byte on the wire to a server without SMTPUTF8: %q", wire[max(i-20, 0):min(i+20, len(wire))])
		}
		if n := strings.Count(wire, "MAIL FROM"); n != 2 {
			t.Errorf("%d MAIL FROM, want 2 (none for the refused recipient)", n)
		}
	})
	t.Run("SMTPUTF8", func(t *testing.T) {
		t.Parallel()
		srv := utf8MailServer(t)
		proxy := newSMTPRecorder(t, srv.addr)
		d := newSMTPDeliverer(proxy.addr, "orders@shöp.example", 1)
		t.Cleanup(d.Close)
		if err := deliverNow(d, mailTo("jöhn@bücher.example")); err != nil {
			t.Fatal(err)
		}
		wire := strings.Join(proxy.writes(), "")
		for _, want := range []string{"MAIL FROM:<orders@shöp.example> BODY=8BITMIME SMTPUTF8\r\n", "RCPT TO:<jöhn@bücher.example>\r\n",
			"From: orders@shöp.example\r\n", "To: jöhn@bücher.example\r\n"} {
			if !strings.Contains(wire, want) {
				t.Errorf("%q not on the wire: %q", want, wire)
			}
		}
		if got := srv.received(); len(got) != 1 || got[0] != "orders@shöp.example to jöhn@bücher.example" {
			t.Errorf("received %q, want one e-mail from orders@shöp.example to jöhn@bücher.example", got)
		}
	})
}

// recordingMailServer is a test mail server for what testenv's does not do: offer SMTPUTF8,
// refuse a greeting, or refuse MAIL or RCPT with any reply. It records each e-mail's envelope
// and each name it was greeted by.
type recordingMailServer struct {
	addr  string
	mu    sync.Mutex
	mail  []string // "from to to", an e-mail's envelope
	helos []string
	// refuse, if set, answers MAIL ("mail", the sender) and RCPT ("rcpt", the recipient):
	// an error is the server's reply, nil takes the address.
	refuse func(cmd, address string) error
	// refused counts the commands refuse refused.
	refused int
}

// refuseWith makes s answer MAIL and RCPT with what refuse says.
func (s *recordingMailServer) refuseWith(refuse func(cmd, address string) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.refuse = refuse
}

// refusals is how many commands the server refused.
func (s *recordingMailServer) refusals() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.refused
}

// answer is the server's reply to cmd for address: what refuse says, counted if a refusal.
func (s *recordingMailServer) answer(cmd, address string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.refuse == nil {
		return nil
	}
	err := s.refuse(cmd, address)
	if err != nil {
		s.refused++
	}
	return err
}

// refusing is a running recordingMailServer that answers cmd ("mail" or "rcpt") with reply.
func refusing(t *testing.T, cmd string, reply *gosmtp.SMTPError) *recordingMailServer {
	t.Helper()
	s := runMailServer(t, "127.0.0.1:0", false, nil)
	s.refuseWith(func(c, _ string) error {
		if c == cmd {
			return reply
		}
		return nil
	})
	return s
}

func (s *recordingMailServer) received() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.mail...)
}

func (s *recordingMailServer) greetedBy() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.helos...)
}

// runMailServer is a recordingMailServer listening at listen ("127.0.0.1:0", "[::1]:0"),
// offering SMTPUTF8 if utf8, refusing an EHLO or HELO whose name greet refuses (nil: none).
func runMailServer(t *testing.T, listen string, utf8 bool, greet func(name string) error) *recordingMailServer {
	t.Helper()
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		t.Fatal(err)
	}
	s := &recordingMailServer{addr: ln.Addr().String()}
	// go-smtp opens the session at EHLO or HELO: an error here is the answer to it.
	srv := gosmtp.NewServer(gosmtp.BackendFunc(func(c *gosmtp.Conn) (gosmtp.Session, error) {
		s.mu.Lock()
		s.helos = append(s.helos, c.Hostname())
		s.mu.Unlock()
		if greet != nil {
			if err := greet(c.Hostname()); err != nil {
				return nil, err
			}
		}
		return &recordingSession{server: s}, nil
	}))
	srv.Domain = "localhost"
	srv.EnableSMTPUTF8 = utf8
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return s
}

// utf8MailServer is a running recordingMailServer that offers SMTPUTF8.
func utf8MailServer(t *testing.T) *recordingMailServer {
	t.Helper()
	return runMailServer(t, "127.0.0.1:0", true, nil)
}

type recordingSession struct {
	server   *recordingMailServer
	from, to string
}

func (x *recordingSession) Reset()        { x.from, x.to = "", "" }
func (x *recordingSession) Logout() error { return nil }

func (x *recordingSession) Mail(from string, _ *gosmtp.MailOptions) error {
	if err := x.server.answer("mail", from); err != nil {
		return err
	}
	x.from = from
	return nil
}

func (x *recordingSession) Rcpt(to string, _ *gosmtp.RcptOptions) error {
	if err := x.server.answer("rcpt", to); err != nil {
		return err
	}
	x.to = to
	return nil
}

func (x *recordingSession) Data(r io.Reader) error {
	if _, err := io.Copy(io.Discard, r); err != nil {
		return err
	}
	x.server.mu.Lock()
	defer x.server.mu.Unlock()
	x.server.mail = append(x.server.mail, x.from+" to "+x.to)
	return nil
}

// refuseNonFQDN refuses, as Postfix's reject_non_fqdn_helo_hostname does, a name that is
// neither a domain with a dot nor an address literal.
func refuseNonFQDN(name string) error {
	if strings.Contains(name, ".") || strings.HasPrefix(name, "[") && strings.HasSuffix(name, "]") {
		return nil
	}
	return &gosmtp.SMTPError{Code: 504, EnhancedCode: gosmtp.EnhancedCode{5, 5, 2},
		Message: "<" + name + ">: Helo command rejected: need fully-qualified hostname"}
}

// EHLO names the client by the address literal of its end of the connection, which a relay
// that takes only a fully qualified name or a literal accepts, over IPv4 and IPv6 alike; or by
// SMTP_HELO_NAME, when given.
func TestEHLONamesTheClientByItsAddressLiteral(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ listen, helo, want string }{
		{"127.0.0.1:0", "", "[127.0.0.1]"},
		{"[::1]:0", "", "[IPv6:::1]"},
		{"127.0.0.1:0", "mail.shop.example", "mail.shop.example"}, // SMTP_HELO_NAME, for a client behind a NAT
	} {
		listen, want := tc.listen, tc.want
		t.Run(listen+" "+tc.helo, func(t *testing.T) {
			t.Parallel()
			if ln, err := net.Listen("tcp", listen); err != nil {
				t.Skipf("no loopback at %s: %v", listen, err)
			} else {
				_ = ln.Close()
			}
			srv := runMailServer(t, listen, false, refuseNonFQDN)
			d := newSMTPDeliverer(srv.addr, "orders@shop.example", 1)
			d.helo = tc.helo
			t.Cleanup(d.Close)
			if err := deliverNow(d, mailTo("c-1@customers.example")); err != nil {
				t.Fatalf("delivery to a relay that wants a fully qualified EHLO: %v", err)
			}
			if got := srv.received(); len(got) != 1 {
				t.Errorf("the server took %q, want one e-mail", got)
			}
			if got := srv.greetedBy(); len(got) != 1 || got[0] != want {
				t.Errorf("greeted by %q, want one EHLO %s", got, want)
			}
		})
	}
}

// The address literal has no zone, which means nothing to the server, and an IPv4 address
// mapped into IPv6 is the IPv4 address it is.
func TestHeloName(t *testing.T) {
	t.Parallel()
	for local, want := range map[string]string{
		"192.0.2.7:40000":          "[192.0.2.7]",
		"[2001:db8::1]:40000":      "[IPv6:2001:db8::1]",
		"[fe80::1%eth0]:40000":     "[IPv6:fe80::1]",
		"[::ffff:192.0.2.7]:40000": "[192.0.2.7]",
	} {
		addr, err := net.ResolveTCPAddr("tcp", local)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := heloName(addr); err != nil || got != want {
			t.Errorf("heloName(%s) = %q, %v; want %q", local, got, err, want)
		}
	}
}

// A server that opens no session, while no other is open, is away or refuses this client, not
// the message (errUnreachable, which the sender waits out uncharged): nothing listening, a 421
// or a 554 greeting, or no greeting in time. A refusal within a session is the message's
// failure.
func TestAServerThatOpensNoSessionIsUnreachable(t *testing.T) {
	t.Parallel()
	greeting := func(t *testing.T, reply string) string {
		return testenv.ServeEach(t, func(conn net.Conn) {
			_, _ = io.WriteString(conn, reply)
			_ = conn.Close()
		})
	}
	closed := testenv.NewSMTPServer(t) // never started: nothing listens
	silent, _ := silentMailServer(t)
	for name, addr := range map[string]string{
		"nothing listening": closed.Addr,
		"421 greeting":      greeting(t, "421 4.3.2 shutting down\r\n"),
		// A policy refusal of this client (its IP blocklisted): no session either, for ever.
		"554 greeting": greeting(t, "554 5.7.1 no SMTP service for you\r\n"),
		"no greeting":  silent,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			d := newSMTPDeliverer(addr, "orders@shop.example", 1)
			t.Cleanup(d.Close)
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			if err := d.Deliver(ctx, mailTo("c-1@customers.example")); !errors.Is(err, errUnreachable) {
				t.Errorf("delivery: err = %v, want %v", err, errUnreachable)
			}
			ctx, cancel = context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			if err := d.Probe(ctx); !errors.Is(err, errUnreachable) {
				t.Errorf("probe: err = %v, want %v", err, errUnreachable)
			}
		})
	}
	t.Run("refusal in a session", func(t *testing.T) {
		t.Parallel()
		srv, d := mailServer(t, 1)
		srv.LimitPerSession(-1) // MAIL refused with 421
		if err := deliverNow(d, mailTo("c-1@customers.example")); err == nil || errors.Is(err, errUnreachable) {
			t.Errorf("delivery: err = %v, want the refusal, not %v", err, errUnreachable)
		}
		if err := d.Probe(context.Background()); err != nil {
			t.Errorf("probe: %v, want the session opened", err)
		}
	})
}

// An ASCII address goes as it is to a server without SMTPUTF8, whatever its domain: it did
// before, and a relay may take a domain literal or a name with '_'. Only a domain that is not
// ASCII is written anew, as IDNA looks it up, case-mapped.
func TestASCIIAddress(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		address, want string
		err           error
	}{
		{address: "orders@shop.example", want: "orders@shop.example"},
		{address: "orders@[192.0.2.1]", want: "orders@[192.0.2.1]"},
		{address: "noreply@mail_relay.internal", want: "noreply@mail_relay.internal"},
		{address: "Orders@Shop.Example", want: "Orders@Shop.Example"},
		{address: "orders@Shöp.example", want: "orders@xn--shp-tna.example"},
		{address: "ann@bücher.example", want: "ann@xn--bcher-kva.example"},
		{address: `"a@b"@shöp.example`, want: `"a@b"@xn--shp-tna.example`},
		{address: "jöhn@example.com", err: errUTF8LocalPart},
		{address: "orders@shöp_relay.example", err: errNoALabel},
	} {
		got, err := asciiAddress(tc.address)
		if got != tc.want || !errors.Is(err, tc.err) {
			t.Errorf("asciiAddress(%q) = %q, %v; want %q, %v", tc.address, got, err, tc.want, tc.err)
		}
	}
}

// limitedMailServer is a proxy to server that opens limit sessions at once at most, and
// greets any more with 421, as Exim past smtp_accept_max does; dials counts its connections.
func limitedMailServer(t *testing.T, server string, limit int64) (addr string, dials *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	dials = new(atomic.Int64)
	var open atomic.Int64
	go func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			dials.Add(1)
			if open.Load() >= limit {
				_, _ = io.WriteString(client, "421 4.3.2 Too many concurrent SMTP connections; please try again later\r\n")
				_ = client.Close()
				continue
			}
			upstream, err := net.Dial("tcp", server)
			if err != nil {
				_ = client.Close()
				continue
			}
			open.Add(1)
			go func() {
				_, _ = io.Copy(client, upstream)
				_ = client.Close()
			}()
			go func() {
				_, _ = io.Copy(upstream, client)
				_ = upstream.Close()
				open.Add(-1)
			}()
		}
	}()
	return ln.Addr().String(), dials
}

// A server that takes fewer sessions from this client than SMTP_MAX_CONNS (replicas × conns
// above its limit) is there, not away: a session it refuses while another is open is
// errNotStarted, not errUnreachable (which would pause the sender), and its pump holds off,
// so that the e-mails go over the sessions open, and the server is not dialled in a loop. A
// probe then finds the server at once, over the sessions open, without dialling past them.
func TestAServerThatTakesNoMoreSessionsIsNoOutage(t *testing.T) {
	t.Parallel()
	srv := testenv.NewSMTPServer(t)
	srv.Start()
	addr, dials := limitedMailServer(t, srv.Addr, 2)
	d := newSMTPDeliverer(addr, "orders@shop.example", 8)
	t.Cleanup(d.Close)
	start := time.Now()
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() {
			n := mailTo("c-1@customers.example")
			// As the sender does: a notification not started is released and leased again.
			for {
				err := deliverNow(d, n)
				if err == nil {
					return
				}
				if !errors.Is(err, errNotStarted) || errors.Is(err, errUnreachable) {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if n := len(srv.Mail()); n != 50 {
		t.Errorf("%d e-mails, want 50", n)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("50 e-mails took %s", took)
	}
	// 8 at first, and a few of the pumps refused again at 1 s, 2 s, ...
	if n := dials.Load(); n > 20 {
		t.Errorf("%d connections to the server, want 20 at most: refused pumps dial again in a loop", n)
	}
	before := dials.Load()
	if err := d.Probe(context.Background()); err != nil {
		t.Errorf("probe: %v, want the server found", err)
	}
	if n := dials.Load() - before; n != 0 {
		t.Errorf("the probe dialled %d connections, want none beside the sessions open", n)
	}
}

// lateGreetingServer is the address of a server that greets each connection after delay, and
// holds it open.
func lateGreetingServer(t *testing.T, delay time.Duration) string {
	t.Helper()
	return testenv.ServeEach(t, func(conn net.Conn) {
		time.AfterFunc(delay, func() { _, _ = io.WriteString(conn, "220 localhost ESMTP\r\n") })
	})
}

// Opening a session has a bound of its own, within the delivery's deadline: a delivery that
// waited in line, left too little of its budget for a slow greeting, is not started
// (released), not the server away (which would pause the sender); a server that does not
// greet within the bound, with time to spare, is away.
func TestADeliveryOutOfTimeIsNoOutage(t *testing.T) {
	t.Parallel()
	t.Run("out of its budget", func(t *testing.T) {
		t.Parallel()
		d := newSMTPDeliverer(lateGreetingServer(t, 200*time.Millisecond), "orders@shop.example", 1)
		t.Cleanup(d.Close)
		// A quick conversation before: 20 ms needed, so that the delivery dials and its own
		// deadline cuts the greeting off (a fresh deliverer would ask half the budget).
		d.longest.add(time.Now(), 10*time.Millisecond)
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		err := d.Deliver(withBudget(ctx, 10*time.Second), mailTo("c-1@customers.example"))
		if !errors.Is(err, errNotStarted) || errors.Is(err, errUnreachable) {
			t.Errorf("err = %v, want %v, not %v", err, errNotStarted, errUnreachable)
		}
	})
	t.Run("silent server", func(t *testing.T) {
		t.Parallel()
		addr, _ := silentMailServer(t)
		d := newSMTPDeliverer(addr, "orders@shop.example", 1)
		d.dialTimeout = 200 * time.Millisecond
		t.Cleanup(d.Close)
		start := time.Now()
		if err := deliverNow(d, mailTo("c-1@customers.example")); !errors.Is(err, errUnreachable) {
			t.Errorf("err = %v, want %v", err, errUnreachable)
		}
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("took %s, want the dial's bound, 200ms", took)
		}
	})
	// A probe has the bound a delivery's opening has, not half its own time: a server slow to
	// greet, which deliveries wait for, would otherwise fail every probe, the sender paused.
	t.Run("a probe waits for a slow greeting", func(t *testing.T) {
		t.Parallel()
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ln.Close() })
		go func() { // greets late, then answers EHLO and QUIT
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			defer func() { _ = conn.Close() }()
			time.Sleep(300 * time.Millisecond)
			_, _ = io.WriteString(conn, "220 localhost ESMTP\r\n")
			r := bufio.NewReader(conn)
			for _, reply := range []string{"250 localhost\r\n", "221 bye\r\n"} {
				if _, err := r.ReadString('\n'); err != nil {
					return
				}
				_, _ = io.WriteString(conn, reply)
			}
		}()
		d := newSMTPDeliverer(ln.Addr().String(), "orders@shop.example", 1)
		t.Cleanup(d.Close)
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		if err := d.Probe(ctx); err != nil {
			t.Errorf("probe of a server that greets in 300ms, given 500ms: %v, want it answered", err)
		}
	})
}

// slowGreetingProxy is the address of a proxy to server that holds back each connection's
// first delay of the server's words: a server slow to greet.
func slowGreetingProxy(t *testing.T, server string, delay time.Duration) string {
	t.Helper()
	return testenv.ServeEach(t, func(client net.Conn) {
		backend, err := net.Dial("tcp", server)
		if err != nil {
			_ = client.Close()
			return
		}
		t.Cleanup(func() { _ = backend.Close() })
		go func() { _, _ = io.Copy(backend, client) }()
		go func() {
			time.Sleep(delay)
			_, _ = io.Copy(client, backend)
		}()
	})
}

// A delivery whose session opened too late for it to begin (the dial took what a conversation
// needs of its time) is not started, and leaves the session to its connection's next
// delivery, idle from its opening: not dropped and dialled again.
func TestASessionOpenedTooLateIsKeptForTheNext(t *testing.T) {
	t.Parallel()
	srv := testenv.NewSMTPServer(t)
	srv.Start()
	d := newSMTPDeliverer(slowGreetingProxy(t, srv.Addr, 900*time.Millisecond), "orders@shop.example", 1)
	t.Cleanup(d.Close)
	d.mu.Lock()
	d.longest.add(time.Now(), 400*time.Millisecond) // 800 ms needed
	d.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	if err := d.Deliver(withBudget(ctx, 10*time.Second), mailTo("c-1@customers.example")); !errors.Is(err, errNotStarted) {
		t.Fatalf("a delivery whose session opened with about 600 ms of its time left: %v, want %v", err, errNotStarted)
	}
	if err := deliverNow(d, mailTo("c-2@customers.example")); err != nil {
		t.Fatal(err)
	}
	if n := srv.Sessions(); n != 1 {
		t.Errorf("%d sessions, want 1: the one opened for the first delivery serves the next", n)
	}
	if mail := srv.Mail(); len(mail) != 1 || mail[0].To != "c-2@customers.example" {
		t.Errorf("the server took %+v, want the second e-mail alone", mail)
	}
}

// smtpReply is a server's reply as go-smtp writes it: code, enhanced code (none if nil) and text.
func smtpReply(code int, enhanced []int, text string) *gosmtp.SMTPError {
	e := &gosmtp.SMTPError{Code: code, EnhancedCode: gosmtp.NoEnhancedCode, Message: text}
	if enhanced != nil {
		e.EnhancedCode = gosmtp.EnhancedCode{enhanced[0], enhanced[1], enhanced[2]}
	}
	return e
}

// Refusals the recipient could never get past, whoever sends it: the server's 5yz to RCPT TO
// with an enhanced status code that says the recipient's address is bad.
var addressRefusals = map[string]*gosmtp.SMTPError{
	"bad mailbox": smtpReply(550, []int{5, 1, 1}, "<c-1@customers.example>: Recipient address rejected: User unknown"),
	"bad syntax":  smtpReply(553, []int{5, 1, 3}, "Bad recipient address syntax"),
	"moved":       smtpReply(551, []int{5, 1, 6}, "User has moved; no forwarding address"),
	"null MX":     smtpReply(556, []int{5, 1, 10}, "Recipient address has null MX"),
	"ambiguous":   smtpReply(550, []int{5, 1, 4}, "Ambiguous recipient"),
	// go-smtp writes the enhanced code on the last line only.
	"two lines": smtpReply(550, []int{5, 1, 1}, "No such user here\nCheck the address"),
}

// Refusals that may be the relay's or the sender's, which refuses every recipient alike until
// its configuration is fixed, or that pass: tried again, as any failure.
var otherRefusals = map[string]*gosmtp.SMTPError{
	"relaying denied":          smtpReply(550, []int{5, 7, 1}, "<c-1@customers.example>: Relay access denied"),
	"authentication required":  smtpReply(530, []int{5, 7, 0}, "Authentication required"),
	"mailbox busy":             smtpReply(450, []int{4, 2, 1}, "Mailbox busy, try again later"),
	"no such mailbox, for now": smtpReply(450, []int{4, 1, 1}, "Recipient address rejected: unverified address"),
	"sender's domain unknown":  smtpReply(550, []int{5, 1, 8}, "<orders@shop.example>: Sender address rejected: Domain not found"),
	"sender's syntax":          smtpReply(553, []int{5, 1, 7}, "<orders@shop.example>: Sender address rejected: bad syntax"),
	"sender unlisted":          smtpReply(550, []int{5, 1, 0}, "<orders@shop.example>: Sender address rejected: User unknown"),
	// Postfix's answer (unknown_address_reject_code 550) to a DNS lookup of the recipient's
	// domain that failed, NXDOMAIN or a malformed reply: a glitch at the relay, not the address.
	"no such system, or DNS":     smtpReply(550, []int{5, 1, 2}, "<c-1@customers.example>: Recipient address rejected: Domain not found"),
	"no enhanced code":           smtpReply(550, nil, "User unknown"),
	"class that is not the code": smtpReply(550, []int{4, 1, 1}, "User unknown"),
}

// A reply to RCPT TO that refuses the recipient's address for good fails the delivery with
// errRecipientRefused, the reply kept whole; any other refusal, a 5yz included, and the same
// address status in reply to MAIL FROM (the sender's), fails it as any failure does.
func TestOnlyARecipientsBadAddressIsRefusedForGood(t *testing.T) {
	t.Parallel()
	try := func(t *testing.T, cmd string, reply *gosmtp.SMTPError, permanent bool) {
		t.Helper()
		srv := refusing(t, cmd, reply)
		d := newSMTPDeliverer(srv.addr, "orders@shop.example", 1)
		t.Cleanup(d.Close)
		err := deliverNow(d, mailTo("c-1@customers.example"))
		at := map[string]string{"mail": "smtp mail from: ", "rcpt": "smtp rcpt to: "}[cmd]
		if err == nil || !strings.HasPrefix(err.Error(), at) || !strings.Contains(err.Error(), fmt.Sprint(reply.Code)) {
			t.Fatalf("err = %v, want the server's %d to %q", err, reply.Code, at)
		}
		if errors.Is(err, errRecipientRefused) != permanent || errors.Is(err, errNotStarted) || errors.Is(err, errUnreachable) {
			t.Fatalf("err = %v: refused for good %v, want %v (and started, the server reachable)", err, errors.Is(err, errRecipientRefused), permanent)
		}
		if srv.refusals() != 1 || len(srv.received()) != 0 {
			t.Fatalf("%d refusals and %d e-mails, want the one refusal and none", srv.refusals(), len(srv.received()))
		}
	}
	for name, reply := range addressRefusals {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			try(t, "rcpt", reply, true)
		})
	}
	for name, reply := range otherRefusals {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			try(t, "rcpt", reply, false)
		})
	}
	t.Run("bad mailbox to MAIL FROM", func(t *testing.T) {
		t.Parallel()
		try(t, "mail", addressRefusals["bad mailbox"], false)
	})
}

// The enhanced status code that decides is the first at the start of a line of the reply,
// 5.1.y with y an address status of the recipient's; none, or one that is not a code, decides
// nothing.
func TestRefusesRecipient(t *testing.T) {
	for _, tc := range []struct {
		code int
		msg  string
		want bool
	}{
		{550, "5.1.1 <ann@example.org>: Recipient address rejected: User unknown", true},
		{550, "5.1.1", true},
		{550, "5.1.10 Recipient address has null MX", true},
		{550, "5.1.1 No such user\n5.1.1 Check the address", true},
		{550, "No such user\n5.1.1 Check the address", true},
		{550, "5.7.1 Relay access denied\n5.1.1 User unknown", false},
		{550, "5.1.11 Not one RFC 3463 or 7505 gives", false},
		{550, "5.1.01 User unknown", false},
		{550, "5.1.1x User unknown", false},
		{550, "5.1.100 User unknown", false},
		{550, "User unknown 5.1.1", false},
		{550, "5.1.2 <ann@example.org>: Recipient address rejected: Domain not found", false},
		{550, "5.1.5 Destination address valid", false},
		{550, "5.1.9 Relayed to a non-compliant mailer", false},
		{450, "5.1.1 User unknown", false},
		{450, "4.1.1 User unknown", false},
		{550, "4.1.1 User unknown", false},
		{554, "5.7.1 <ann@example.org>: Relay access denied", false},
	} {
		if got := refusesRecipient(&textproto.Error{Code: tc.code, Msg: tc.msg}); got != tc.want {
			t.Errorf("%d %q: refused for good %v, want %v", tc.code, tc.msg, got, tc.want)
		}
	}
}
