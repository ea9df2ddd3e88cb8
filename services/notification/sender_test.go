package main

import (
	"context"
	"errors"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// senderEnv is one test's database with the notifications table, a running loopback SMTP
// server, and senders that each have a connection pool of their own (tagged with an
// application_name, so a test can kill exactly one sender's sessions).
type senderEnv struct {
	db   *testenv.Database
	smtp *testenv.SMTPServer
	log  *slog.Logger
	logs *testenv.Logs
}

// senderPool is the pool of each sender a test builds.
const senderPool = 4

func newSenderEnv(t *testing.T) *senderEnv {
	t.Helper()
	// The database, two senders and an admin connection.
	testenv.Connections(t, testenv.DefaultConnections+2*senderPool+1)
	d := testenv.NewDatabase(t)
	d.Migrate(t, platform.Migrations(migrations, "migrations", "notification_schema"))
	log, logs := testenv.NewLogger(t)
	e := &senderEnv{db: d, smtp: testenv.NewSMTPServer(t), log: log, logs: logs}
	e.smtp.Start()
	return e
}

// mailer is the real deliverer, to the test's mail server.
func (e *senderEnv) mailer() Deliverer {
	return smtpDeliverer{addr: e.smtp.Addr, from: "orders@shop.example"}
}

// sender builds a sender on a pool of its own, with budgets short enough for a test: its
// lease is deliver+mark+grace = 2 s.
func (e *senderEnv) sender(t *testing.T, name string, d Deliverer) *sender {
	t.Helper()
	u, err := url.Parse(e.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("application_name", name)
	u.RawQuery = q.Encode()
	db := testenv.OpenPool(t, u.String(), senderPool)
	s := newSender(db, d, time.Second, e.log.With("sender", name))
	s.deliver, s.mark, s.grace, s.poll = 500*time.Millisecond, time.Second, 500*time.Millisecond, 50*time.Millisecond
	s.backoff.Base = 100 * time.Millisecond
	return s
}

// pending inserts one notification, due now, and returns its id.
func (e *senderEnv) pending(t *testing.T) uuid.UUID {
	t.Helper()
	id := uuid.Must(uuid.NewV7())
	if err := e.db.DB.Exec(`INSERT INTO notifications (id, order_id, customer_id, kind, recipient, subject, body, message_id)
VALUES (?, ?, 'c-1', ?, 'c-1@customers.example', 'Your order', 'Thank you.', ?)`, id, uuid.New(), KindOrderConfirmation, uuid.New()).Error; err != nil {
		t.Fatal(err)
	}
	return id
}

func (e *senderEnv) row(t *testing.T, id uuid.UUID) Notification {
	t.Helper()
	var n Notification
	if err := e.db.DB.Take(&n, "id = ?", id).Error; err != nil {
		t.Fatal(err)
	}
	return n
}

// mails counts the e-mails received with id's Message-ID, the receiver's idempotency key, and
// fails if any other e-mail arrived.
func (e *senderEnv) mails(t *testing.T, id uuid.UUID) int {
	t.Helper()
	want := "<" + id.String() + "@" + MessageIDDomain + ">"
	n := 0
	for _, m := range e.smtp.Mail() {
		if m.MessageID != want {
			t.Fatalf("e-mail with Message-ID %q, want only %q", m.MessageID, want)
		}
		n++
	}
	return n
}

// admin is a connection to the server's maintenance database, for killing sessions.
func admin(t *testing.T) *gorm.DB {
	t.Helper()
	return testenv.OpenPool(t, testenv.DatabaseURL(), 1)
}

// sameRow fails unless got is want: status, attempts, last error, lease and sent_at.
func sameRow(t *testing.T, what string, got, want Notification) {
	t.Helper()
	eqTime := func(a, b *time.Time) bool { return (a == nil) == (b == nil) && (a == nil || a.Equal(*b)) }
	eqStr := func(a, b *string) bool { return (a == nil) == (b == nil) && (a == nil || *a == *b) }
	if got.Status != want.Status || got.Attempts != want.Attempts || !eqStr(got.LastError, want.LastError) ||
		!got.NextAttemptAt.Equal(want.NextAttemptAt) || !eqTime(got.SentAt, want.SentAt) {
		t.Fatalf("%s: row = %+v, want it unchanged: %+v", what, got, want)
	}
}

// stalled stands for a sender that stops at the worst moment (a GC pause, a frozen VM, a send
// stuck in the kernel): it ignores ctx until the test releases it, which a well-behaved
// Deliverer never does, and is how a lease runs out under a live sender.
type stalled struct {
	inner     Deliverer
	sendFirst bool  // send, then stall before returning; otherwise stall, then send
	fail      error // after the stall, fail with this instead of sending
	entered   chan struct{}
	release   chan struct{}
	once      sync.Once
}

func newStalled(inner Deliverer, sendFirst bool, fail error) *stalled {
	return &stalled{inner: inner, sendFirst: sendFirst, fail: fail, entered: make(chan struct{}), release: make(chan struct{})}
}

func (d *stalled) Deliver(ctx context.Context, n Notification) error {
	if d.sendFirst && d.fail == nil {
		if err := d.inner.Deliver(ctx, n); err != nil {
			return err
		}
	}
	d.once.Do(func() { close(d.entered) })
	<-d.release
	if d.fail != nil {
		return d.fail
	}
	if !d.sendFirst {
		// The stuck send completes after all; its own deadline ran out long ago.
		sendCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		return d.inner.Deliver(sendCtx, n)
	}
	return nil
}

type outcome struct {
	delivered bool
	err       error
}

func (o outcome) String() string {
	if o.err != nil {
		return "error: " + o.err.Error()
	}
	if o.delivered {
		return "delivered"
	}
	return "nothing delivered"
}

// start runs one deliverOne of s in the background.
func start(s *sender) <-chan outcome {
	done := make(chan outcome, 1)
	go func() {
		delivered, err := s.deliverOne(context.Background())
		done <- outcome{delivered, err}
	}()
	return done
}

// await waits for a background deliverOne, with a deadline.
func await(t *testing.T, done <-chan outcome) outcome {
	t.Helper()
	select {
	case o := <-done:
		return o
	case <-time.After(15 * time.Second):
		t.Fatal("deliverOne did not return")
		return outcome{}
	}
}

// wait waits for ch to close, with a deadline.
func wait(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(15 * time.Second):
		t.Fatalf("%s did not happen", what)
	}
}

// takeOver waits, polling, for the lease on id to run out, then starts s's deliverOne, which
// takes the notification over.
func takeOver(t *testing.T, s *sender, id uuid.UUID) <-chan outcome {
	t.Helper()
	var done <-chan outcome
	testenv.Eventually(t, 15*time.Second, func() bool {
		// Claim only once the old lease is over: a second sender that stalls in delivery
		// cannot be polled with deliverOne itself.
		var due bool
		if err := s.db.Raw("SELECT next_attempt_at <= now() FROM notifications WHERE id = ?", id).Scan(&due).Error; err != nil {
			t.Fatal(err)
		}
		if !due {
			return false
		}
		done = start(s)
		return true
	}, "the lease on %s never ran out", id)
	return done
}

// The lease fence: a sender whose lease ran out changes nothing when it finally records its
// outcome; the notification belongs to the sender that leased it next.
func TestExpiredLeaseChangesNothing(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		bFirst bool  // the second sender finishes (delivers and marks) before the first returns
		fail   error // the first sender's delivery fails instead of succeeding
	}{
		// Here status = 'pending' alone would keep the first sender out.
		"mark after the second sender marked": {bFirst: true},
		// Here only the lease fence does: the row is still pending, under the second lease.
		"mark while the second sender holds the lease":    {},
		"failure while the second sender holds the lease": {fail: errors.New("smtp: 451 try again")},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newSenderEnv(t)
			id := e.pending(t)
			first := newStalled(e.mailer(), true, tc.fail)
			a := e.sender(t, "sender-a", first)
			second := newStalled(e.mailer(), true, nil)
			b := e.sender(t, "sender-b", second)
			if tc.bFirst {
				close(second.release) // the second sender does not stall
			}

			aDone := start(a)
			wait(t, first.entered, "the first delivery")
			aLease := e.row(t, id).NextAttemptAt
			bDone := takeOver(t, b, id)
			wait(t, second.entered, "the second delivery")
			if tc.bFirst {
				if o := await(t, bDone); !o.delivered || o.err != nil {
					t.Fatalf("second sender: %v, want delivered", o)
				}
			}
			before := e.row(t, id)
			if !before.NextAttemptAt.After(aLease) {
				t.Fatalf("lease %v not renewed by the second sender (first lease %v)", before.NextAttemptAt, aLease)
			}

			close(first.release)
			if o := await(t, aDone); o.err != nil || o.delivered != (tc.fail == nil) {
				t.Fatalf("first sender: %v", o)
			}
			sameRow(t, "after the first sender, whose lease ran out, recorded its outcome", e.row(t, id), before)
			if n := len(e.logs.Lines("sender=sender-a", "lease on the notification ran out", id.String())); n != 1 {
				t.Fatalf("%d 'lease ran out' lines from the first sender, want 1", n)
			}

			if !tc.bFirst {
				aDoneAt := time.Now()
				close(second.release)
				if o := await(t, bDone); !o.delivered || o.err != nil {
					t.Fatalf("second sender: %v, want delivered", o)
				}
				got := e.row(t, id)
				if got.SentAt == nil || got.SentAt.Before(aDoneAt) {
					t.Fatalf("sent_at = %v, want the second sender's mark, after %v", got.SentAt, aDoneAt)
				}
			}
			got := e.row(t, id)
			if got.Status != StatusSent || got.Attempts != 0 || got.LastError != nil {
				t.Fatalf("row = %+v, want sent by the second sender, no attempts or error recorded", got)
			}
			if n := len(e.logs.Lines("sender=sender-b", "lease on the notification ran out")); n != 0 {
				t.Fatal("the second sender lost its lease")
			}
			wantMails := 2
			if tc.fail != nil {
				wantMails = 1
			}
			if n := e.mails(t, id); n != wantMails {
				t.Fatalf("%d e-mails, want %d", n, wantMails)
			}
		})
	}
}

// A sender stuck in delivery loses its lease; another takes the notification over and
// delivers it. When the stuck send completes the customer has the e-mail twice, both with the
// notification id as Message-ID, and the notification is sent once.
func TestStuckDeliveryIsTakenOverAndRepeatsTheMessageID(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	stuck := newStalled(e.mailer(), false, nil)
	a := e.sender(t, "sender-a", stuck)
	b := e.sender(t, "sender-b", e.mailer())

	aDone := start(a)
	wait(t, stuck.entered, "the first delivery")
	if o := await(t, takeOver(t, b, id)); !o.delivered || o.err != nil {
		t.Fatalf("second sender: %v, want delivered", o)
	}
	if n := e.mails(t, id); n != 1 {
		t.Fatalf("%d e-mails after the takeover, want 1", n)
	}
	sent := e.row(t, id)
	if sent.Status != StatusSent || sent.SentAt == nil {
		t.Fatalf("row = %+v, want sent by the second sender", sent)
	}

	close(stuck.release)
	if o := await(t, aDone); o.err != nil {
		t.Fatalf("first sender: %v", o.err)
	}
	if n := e.mails(t, id); n != 2 {
		t.Fatalf("%d e-mails with Message-ID %s, want 2: the stuck one and the takeover", n, id)
	}
	sameRow(t, "after the stuck sender finished", e.row(t, id), sent)
	if n := testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE status = 'sent'"); n != 1 {
		t.Fatalf("%d sent notifications, want 1", n)
	}
}

// diesAfterSend closes the sender's pool right after the e-mail went out: the sender "dies" between
// the SMTP send and the mark.
type diesAfterSend struct {
	inner Deliverer
	db    *gorm.DB
}

func (d diesAfterSend) Deliver(ctx context.Context, n Notification) error {
	if err := d.inner.Deliver(ctx, n); err != nil {
		return err
	}
	sqlDB, err := d.db.DB()
	if err != nil {
		return err
	}
	return sqlDB.Close()
}

// A crash between the SMTP send and the mark: the notification stays pending under its lease,
// and a new sender, once the lease ran out, sends it again with the same Message-ID.
func TestCrashBetweenSendAndMarkSendsAgainWithTheSameMessageID(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	a := e.sender(t, "sender-a", nil)
	a.deliverer = diesAfterSend{inner: e.mailer(), db: a.db}
	a.mark = 300 * time.Millisecond // the dead sender gives up on marking sooner

	if delivered, err := a.deliverOne(context.Background()); delivered || err == nil || !strings.Contains(err.Error(), "delivered again") {
		t.Fatalf("deliverOne of the dying sender = %v, %v; want the mark to fail", delivered, err)
	}
	if got := e.row(t, id); got.Status != StatusPending || got.Attempts != 0 || got.SentAt != nil || !got.NextAttemptAt.After(time.Now()) {
		t.Fatalf("row = %+v, want pending under the dead sender's lease", got)
	}
	if n := e.mails(t, id); n != 1 {
		t.Fatalf("%d e-mails before the restart, want 1", n)
	}

	b := e.sender(t, "sender-b", e.mailer())
	if o := await(t, takeOver(t, b, id)); !o.delivered || o.err != nil {
		t.Fatalf("new sender: %v, want delivered", o)
	}
	if n := e.mails(t, id); n != 2 {
		t.Fatalf("%d e-mails with Message-ID %s, want 2: before and after the crash", n, id)
	}
	if got := e.row(t, id); got.Status != StatusSent || got.SentAt == nil || got.Attempts != 0 {
		t.Fatalf("row = %+v, want sent", got)
	}
}

// awayAfterSend sends, then takes the database away from the sender: its sessions are
// terminated and the database refuses connections for a while.
type awayAfterSend struct {
	t      *testing.T
	inner  Deliverer
	admin  *gorm.DB
	dbName string
	away   time.Duration
	killed atomic.Int64
	back   chan backAt
}

// backAt is the database server's clock when the database took connections again.
type backAt struct {
	at  time.Time
	err error
}

func (d *awayAfterSend) Deliver(ctx context.Context, n Notification) error {
	if err := d.inner.Deliver(ctx, n); err != nil {
		return err
	}
	if err := d.admin.Exec("ALTER DATABASE " + d.dbName + " ALLOW_CONNECTIONS false").Error; err != nil {
		d.t.Error(err)
	}
	d.killed.Store(testenv.Count(d.t, d.admin, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = ? AND application_name = 'sender-a'`, d.dbName))
	// Not d.t here: this may outlive a test that failed early.
	time.AfterFunc(d.away, func() {
		var b backAt
		b.err = d.admin.Raw("SELECT clock_timestamp()").Scan(&b.at).Error
		if err := d.admin.Exec("ALTER DATABASE " + d.dbName + " ALLOW_CONNECTIONS true").Error; b.err == nil {
			b.err = err
		}
		d.back <- b
	})
	return nil
}

// The database is away when the mark is due: the sender retries the mark within its budget
// and the notification ends sent, with one e-mail.
func TestMarkIsRetriedWhileTheDatabaseIsAway(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	away := &awayAfterSend{t: t, inner: e.mailer(), admin: admin(t), dbName: e.db.Name, away: 700 * time.Millisecond, back: make(chan backAt, 1)}
	t.Cleanup(func() { _ = away.admin.Exec("ALTER DATABASE " + e.db.Name + " ALLOW_CONNECTIONS true").Error })
	a := e.sender(t, "sender-a", away)
	a.mark = 4 * time.Second
	var failedMarks atomic.Int32
	if err := a.db.Callback().Raw().After("gorm:raw").Register("test:failed_marks", func(tx *gorm.DB) {
		if tx.Error != nil && strings.HasPrefix(tx.Statement.SQL.String(), "UPDATE notifications SET status = 'sent'") {
			failedMarks.Add(1)
		}
	}); err != nil {
		t.Fatal(err)
	}

	if delivered, err := a.deliverOne(context.Background()); !delivered || err != nil {
		t.Fatalf("deliverOne = %v, %v; want delivered and marked once the database is back", delivered, err)
	}
	if n := away.killed.Load(); n < 1 {
		t.Fatalf("killed %d of the sender's sessions, want its pool's", n)
	}
	if n := failedMarks.Load(); n < 1 {
		t.Fatalf("%d failed marks, want the mark to have failed while the database was away", n)
	}
	back := <-away.back
	if back.err != nil {
		t.Fatal(back.err)
	}
	got := e.row(t, id)
	if got.Status != StatusSent || got.SentAt == nil || got.SentAt.Before(back.at) || got.Attempts != 0 {
		t.Fatalf("row = %+v, want sent after the database came back at %v", got, back.at)
	}
	if n := e.mails(t, id); n != 1 {
		t.Fatalf("%d e-mails, want 1", n)
	}
}

// heldOpen is a delivery that goes on until the test releases it, then sends for real; it
// respects ctx, as a Deliverer must.
type heldOpen struct {
	inner   Deliverer
	entered chan struct{}
	release chan struct{}
}

func (d heldOpen) Deliver(ctx context.Context, n Notification) error {
	close(d.entered)
	select {
	case <-d.release:
	case <-ctx.Done():
		return ctx.Err()
	}
	return d.inner.Deliver(ctx, n)
}

// Shutdown while a delivery is in progress: it finishes within the grace, is marked sent,
// and Run returns nil — a clean shutdown never repeats an e-mail.
func TestDeliveryFinishingDuringShutdownIsMarkedSent(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	held := heldOpen{inner: e.mailer(), entered: make(chan struct{}), release: make(chan struct{})}
	s := e.sender(t, "sender-a", held)
	s.deliver, s.grace = 10*time.Second, time.Second

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- s.Run(ctx) }()
	wait(t, held.entered, "the delivery")
	cancel()
	// Released half-way through the grace: late enough that a delivery cancelled at shutdown,
	// not at the end of the grace, would already have failed.
	time.AfterFunc(s.grace/2, func() { close(held.release) })

	select {
	case err := <-ran:
		if err != nil {
			t.Fatalf("Run = %v, want nil", err)
		}
	case <-time.After(s.grace + s.mark + 5*time.Second):
		t.Fatal("Run did not return after shutdown")
	}
	// Run returned only after the mark: no polling needed.
	if got := e.row(t, id); got.Status != StatusSent || got.SentAt == nil || got.Attempts != 0 {
		t.Fatalf("row = %+v, want sent before Run returned", got)
	}
	if n := e.mails(t, id); n != 1 {
		t.Fatalf("%d e-mails, want 1", n)
	}
	if n := len(e.logs.Lines("notification delivered", id.String())); n != 1 {
		t.Fatalf("%d 'notification delivered' lines, want 1", n)
	}
}

// slow stands for a slow mail server: each delivery takes delay, well within the lease.
type slow struct {
	inner     Deliverer
	delay     time.Duration
	delivered atomic.Int32
}

func (d *slow) Deliver(ctx context.Context, n Notification) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d.delay):
	}
	if err := d.inner.Deliver(ctx, n); err != nil {
		return err
	}
	d.delivered.Add(1)
	return nil
}

// Two senders compete for the same notifications on one slow mail server: while a lease holds,
// nobody else takes the notification, so each is e-mailed once.
func TestTwoSendersOnASlowMailServerDeliverEachNotificationOnce(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	const notifications = 10
	ids := make([]uuid.UUID, notifications)
	for i := range ids {
		ids[i] = e.pending(t)
	}
	a, b := &slow{inner: e.mailer(), delay: 200 * time.Millisecond}, &slow{inner: e.mailer(), delay: 200 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for name, d := range map[string]*slow{"sender-a": a, "sender-b": b} {
		s := e.sender(t, name, d)
		wg.Go(func() { _ = s.Run(ctx) })
	}
	testenv.Eventually(t, 30*time.Second, func() bool {
		return testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE status = 'sent'") == notifications
	}, "not all %d notifications were sent", notifications)
	cancel()
	wg.Wait()

	if a.delivered.Load() == 0 || b.delivered.Load() == 0 {
		t.Fatalf("deliveries: sender-a %d, sender-b %d; both must have taken part", a.delivered.Load(), b.delivered.Load())
	}
	byMessageID := map[string]int{}
	for _, m := range e.smtp.Mail() {
		byMessageID[m.MessageID]++
	}
	for _, id := range ids {
		if n := byMessageID["<"+id.String()+"@"+MessageIDDomain+">"]; n != 1 {
			t.Errorf("notification %s e-mailed %d times while leases held, want once", id, n)
		}
	}
	if len(byMessageID) != notifications {
		t.Errorf("%d distinct Message-IDs e-mailed, want %d", len(byMessageID), notifications)
	}
}
