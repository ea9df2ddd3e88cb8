package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
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

// mailer is the real deliverer, to the test's mail server, with a pool of its own.
func (e *senderEnv) mailer(t *testing.T) *smtpDeliverer {
	t.Helper()
	m := newSMTPDeliverer(e.smtp.Addr, "orders@shop.example", DefaultSMTPConns)
	t.Cleanup(m.Close)
	return m
}

// sender builds a sender on a pool of its own, with budgets short enough for a test: its
// lease is deliver+mark+grace = 2 s. Its concurrency is the default.
func (e *senderEnv) sender(t *testing.T, name string, d Deliverer) *sender {
	t.Helper()
	return e.senderOn(t, name, d, senderPool, nil)
}

// senderOn is sender on a pool of size connections, each with the run-time parameters params.
func (e *senderEnv) senderOn(t *testing.T, name string, d Deliverer, size int, params map[string]string) *sender {
	t.Helper()
	// The pool notification's main gives it (platform.Start's Sender).
	dsn, err := platform.IndexPlansURL(e.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("application_name", name)
	for k, v := range params {
		q.Set(k, v)
	}
	// A space as %20: a connection URI's query, as libpq reads it, takes "+" for itself.
	u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
	db := testenv.OpenPool(t, u.String(), size)
	s := newSender(db, d, DefaultConcurrency, time.Second, e.log.With("sender", name))
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

// pendingMany inserts n pending notifications, due now, and returns their ids.
func (e *senderEnv) pendingMany(t *testing.T, n int) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = e.pending(t)
	}
	return ids
}

// clock reads the database's clock, the one leases and backoffs are written with.
func (e *senderEnv) clock(t *testing.T) time.Time {
	t.Helper()
	var now time.Time
	if err := e.db.DB.Raw("SELECT clock_timestamp()").Scan(&now).Error; err != nil {
		t.Fatal(err)
	}
	return now
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

// deliverOne leases the oldest due notification and delivers it as Run does, reporting whether
// it was sent: one delivery, under the test's control.
func (s *sender) deliverOne(ctx context.Context) (delivered bool, err error) {
	if ctx.Err() != nil {
		return false, nil // shutting down: take nothing new
	}
	rows, err := s.lease(1)
	if err != nil || len(rows) == 0 {
		return false, err
	}
	return s.deliverLeased(ctx, rows[0])
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

// wait waits for a value from ch, or its close, with a deadline.
func wait[T any](t *testing.T, ch <-chan T, what string) {
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
		"undeliverable while the second sender holds the lease": {
			fail: fmt.Errorf("smtp rcpt to: %w: 550 5.1.1 User unknown", errRecipientRefused)},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newSenderEnv(t)
			id := e.pending(t)
			first := newStalled(e.mailer(t), true, tc.fail)
			a := e.sender(t, "sender-a", first)
			reg := prometheus.NewRegistry()
			if err := a.registerMetrics(reg); err != nil {
				t.Fatal(err)
			}
			second := newStalled(e.mailer(t), true, nil)
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
			// Its e-mail went out, or was refused, all the same: the metric counts what was tried.
			outcome := deliverySent
			switch {
			case errors.Is(tc.fail, errRecipientRefused):
				outcome = deliveryUndeliverable
			case tc.fail != nil:
				outcome = deliveryFailed
			}
			if n := testutil.ToFloat64(a.outcomes.WithLabelValues(outcome)); n != 1 {
				t.Errorf("the first sender counted %v %s deliveries, want 1: its outcome was not recorded, but it was tried", n, outcome)
			}
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
	stuck := newStalled(e.mailer(t), false, nil)
	a := e.sender(t, "sender-a", stuck)
	b := e.sender(t, "sender-b", e.mailer(t))

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
	a.deliverer = diesAfterSend{inner: e.mailer(t), db: a.db}
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

	b := e.sender(t, "sender-b", e.mailer(t))
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

// The database is away when the mark is due: the sender retries the mark, and the
// notification ends sent, with one e-mail. Away for less than one recording budget, or for
// several, a restart's worth: it keeps trying while its lease keeps other senders away, rather
// than giving up and sending the e-mail again once the lease ran out.
func TestMarkIsRetriedWhileTheDatabaseIsAway(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct{ away, deliver, mark time.Duration }{
		"within one budget":                  {away: 700 * time.Millisecond, deliver: 500 * time.Millisecond, mark: 4 * time.Second},
		"for five budgets, within the lease": {away: 1500 * time.Millisecond, deliver: 5 * time.Second, mark: 300 * time.Millisecond},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newSenderEnv(t)
			id := e.pending(t)
			away := &awayAfterSend{t: t, inner: e.mailer(t), admin: admin(t), dbName: e.db.Name, away: tc.away, back: make(chan backAt, 1)}
			t.Cleanup(func() { _ = away.admin.Exec("ALTER DATABASE " + e.db.Name + " ALLOW_CONNECTIONS true").Error })
			a := e.sender(t, "sender-a", away)
			a.deliver, a.mark = tc.deliver, tc.mark

			if delivered, err := a.deliverOne(context.Background()); !delivered || err != nil {
				t.Fatalf("deliverOne = %v, %v; want delivered and marked once the database is back", delivered, err)
			}
			if n := away.killed.Load(); n < 1 {
				t.Fatalf("killed %d of the sender's sessions, want its pool's", n)
			}
			if n := len(e.logs.Lines("recording notification outcomes failed; retrying")); n < 1 {
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
		})
	}
}

// While the database is away, Run's lease fails at every poll (once a second in production):
// the failure is logged as an error once, at the outage's start, the polls after it at Debug,
// and the outage's end once, with how long it lasted.
func TestLeaseFailuresAreLoggedOnceAnOutage(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	adm := admin(t)
	allow := func(on bool) {
		t.Helper()
		if err := adm.Exec(fmt.Sprintf("ALTER DATABASE %s ALLOW_CONNECTIONS %v", e.db.Name, on)).Error; err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { _ = adm.Exec("ALTER DATABASE " + e.db.Name + " ALLOW_CONNECTIONS true").Error })
	s := e.sender(t, "sender-a", e.mailer(t))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	returned := runSender(ctx, t, s)
	sessions := `SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND application_name = 'sender-a'`
	testenv.Eventually(t, 10*time.Second, func() bool { return testenv.Count(t, adm, sessions, e.db.Name) > 0 },
		"the sender never connected")
	allow(false)
	testenv.Count(t, adm, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = ? AND application_name = 'sender-a'`, e.db.Name)
	failed := func(level string) int { return len(e.logs.Lines(level, `msg="leasing notifications failed"`)) }
	const polls = 6
	testenv.Eventually(t, 10*time.Second, func() bool { return failed("") >= polls },
		"fewer than %d polls failed while the database was away", polls)
	if n, all := failed("level=ERROR"), failed(""); n != 1 {
		t.Errorf("%d ERROR lines for the %d failed leases of one outage, want 1 (the rest at DEBUG)", n, all)
	}
	allow(true)
	recovered := func() []string { return e.logs.Lines(`msg="leasing notifications works again"`) }
	testenv.Eventually(t, 10*time.Second, func() bool { return len(recovered()) > 0 }, "the recovery was not logged")
	cancel()
	returned()
	if n, all := failed("level=DEBUG"), failed(""); n != all-1 {
		t.Errorf("%d DEBUG lines for the %d failed leases of one outage, want all but the first", n, all)
	}
	if r := recovered(); len(r) != 1 || !strings.Contains(r[0], "level=INFO") || !strings.Contains(r[0], "outage=") ||
		!strings.Contains(r[0], fmt.Sprintf("failures=%d", failed(""))) {
		t.Errorf("recovery lines %q, want one at INFO with the outage's length and its %d failures", r, failed(""))
	}
}

// Shutdown while the database is away, or hangs (the row stays locked): recording gives up
// within the grace and one recording budget, however long the lease would let it wait, so the
// process stops in time. The notification stays pending under its lease.
func TestShutdownDoesNotWaitForAnAbsentDatabase(t *testing.T) {
	t.Parallel()
	for _, hangs := range []bool{false, true} {
		t.Run(fmt.Sprintf("hangs=%v", hangs), func(t *testing.T) {
			t.Parallel()
			e := newSenderEnv(t)
			id := e.pending(t)
			var d Deliverer
			var sent func() bool
			var restore func() error
			if hangs {
				l := &locksAfterSend{inner: e.mailer(t), db: e.db.DB}
				d, sent, restore = l, func() bool { return l.locked.Load() }, l.release
				t.Cleanup(func() { _ = l.release() })
			} else {
				away := &awayAfterSend{t: t, inner: e.mailer(t), admin: admin(t), dbName: e.db.Name, away: 3 * time.Second, back: make(chan backAt, 1)}
				t.Cleanup(func() { _ = away.admin.Exec("ALTER DATABASE " + e.db.Name + " ALLOW_CONNECTIONS true").Error })
				d, sent, restore = away, func() bool { return away.killed.Load() > 0 }, func() error { return (<-away.back).err }
			}
			s := e.sender(t, "sender-a", d)
			// A budget long enough that an attempt begun before the shutdown's cap, and not cut
			// by it, would show.
			s.deliver, s.mark, s.grace = 20*time.Second, time.Second, 300*time.Millisecond

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			returned := runSender(ctx, t, s)
			testenv.Eventually(t, 10*time.Second, sent, "the e-mail was never sent")
			cancel()
			stopped := time.Now()
			returned()
			if took := time.Since(stopped); took > s.grace+s.mark+500*time.Millisecond {
				t.Fatalf("Run returned %v after shutdown, want within the grace and one recording budget (%v)", took, s.grace+s.mark)
			}
			if err := restore(); err != nil {
				t.Fatal(err)
			}
			if got := e.row(t, id); got.Status != StatusPending || !got.NextAttemptAt.After(time.Now()) {
				t.Fatalf("row = %+v, want pending under its lease", got)
			}
		})
	}
}

// locksAfterSend sends, then locks the notification's row in a transaction of its own until
// release, so that recording its outcome hangs: a database that answers nothing.
type locksAfterSend struct {
	inner  Deliverer
	db     *gorm.DB
	mu     sync.Mutex
	tx     *gorm.DB
	locked atomic.Bool
}

func (d *locksAfterSend) Deliver(ctx context.Context, n Notification) error {
	if err := d.inner.Deliver(ctx, n); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.tx = d.db.Begin()
	if err := d.tx.Exec("SELECT 1 FROM notifications WHERE id = ? FOR UPDATE", n.ID).Error; err != nil {
		return err
	}
	d.locked.Store(true)
	return nil
}

// release ends the lock's transaction.
func (d *locksAfterSend) release() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.tx == nil {
		return nil
	}
	err := d.tx.Rollback().Error
	d.tx = nil
	return err
}

// Shutdown while a delivery is in progress: it finishes within the grace, is marked sent,
// and Run returns nil — a clean shutdown never repeats an e-mail.
func TestDeliveryFinishingDuringShutdownIsMarkedSent(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	d := held{inner: e.mailer(t), entered: make(chan uuid.UUID, 1), release: make(chan struct{})}
	s := e.sender(t, "sender-a", d)
	s.deliver, s.grace = 10*time.Second, time.Second

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	returned := runSender(ctx, t, s)
	wait(t, d.entered, "the delivery")
	cancel()
	// Released half-way through the grace: late enough that a delivery cancelled at shutdown,
	// not at the end of the grace, would already have failed.
	time.AfterFunc(s.grace/2, func() { close(d.release) })
	returned()
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

// Two senders compete for the same notifications on one slow mail server, each with deliveries
// in parallel: while a lease holds, nobody else takes the notification, so each is e-mailed
// once.
func TestTwoSendersOnASlowMailServerDeliverEachNotificationOnce(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	const notifications = 20
	ids := e.pendingMany(t, notifications)
	a, b := &slow{inner: e.mailer(t), delay: 200 * time.Millisecond}, &slow{inner: e.mailer(t), delay: 200 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for name, d := range map[string]*slow{"sender-a": a, "sender-b": b} {
		s := e.sender(t, name, d)
		// Few enough that neither sender leases every notification at once (the deliveries
		// and as many leased in waiting).
		s.concurrency = 3
		// A budget the wrapper's delay leaves room in: before its first conversation a
		// deliverer begins one only with half its budget left, and 500 ms less 200 ms left a
		// sender a few milliseconds late on a busy machine nothing to begin, for good.
		s.deliver = time.Second
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

// A notification leased ahead waits in line for a worker, and its budget, counted from the
// lease, runs meanwhile. On a relay that answers each message 600 ms late, with one delivery
// at a time and a budget of 1 s, the second notification reaches the mail server with about
// 400 ms left, less than a conversation: it must not begin one it cannot finish (the server
// would take the e-mail, the delivery be cut off and charged, and the e-mail sent again), but
// be released and sent once with a budget of its own.
func TestNotificationThatWaitedInLineIsEmailedOnce(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	ids := e.pendingMany(t, 2)
	e.smtp.AnswerLate(600 * time.Millisecond)
	s := e.sender(t, "sender-a", e.mailer(t))
	s.concurrency, s.deliver = 1, time.Second
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = s.Run(ctx); close(done) }()
	testenv.Eventually(t, 20*time.Second, func() bool {
		return testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE status = 'sent'") == int64(len(ids))
	}, "not both notifications were sent")
	cancel()
	<-done
	byMessageID := map[string]int{}
	for _, m := range e.smtp.Mail() {
		byMessageID[m.MessageID]++
	}
	for _, id := range ids {
		if n := byMessageID["<"+id.String()+"@"+MessageIDDomain+">"]; n != 1 {
			t.Errorf("notification %s e-mailed %d times without a crash, want once (row: %+v)", id, n, e.row(t, id))
		}
	}
}

// busyFirst keeps its worker busy with the first notification it is given, as a "sent" mark
// that waits out a database failover would, until only short is left of that notification's
// budget (nothing is e-mailed for it); every later notification goes to inner.
type busyFirst struct {
	inner Deliverer
	short time.Duration
	taken atomic.Bool
}

func (d *busyFirst) Deliver(ctx context.Context, n Notification) error {
	if d.taken.Swap(true) {
		return d.inner.Deliver(ctx, n)
	}
	deadline, _ := ctx.Deadline()
	t := time.NewTimer(time.Until(deadline.Add(-d.short)))
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// The notification leased behind one that kept the only worker busy reaches the mailer with
// about 450 ms of its budget left, on a relay that answers each message 600 ms late. The
// mailer has had no conversation yet, or its last was 25 s ago (its connections idled while
// the worker was busy): either way the delivery must not begin (it would be cut off after the
// server took the e-mail, and the e-mail sent again), but be released and e-mailed once with a
// budget of its own.
func TestNotificationThatWaitedInLineIsEmailedOnceByAnIdleMailer(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		idle time.Duration // since the mailer's last conversation, of 600 ms; 0 for none
	}{{"no conversation yet", 0}, {"last conversation 25 s ago", 25 * time.Second}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newSenderEnv(t)
			ids := e.pendingMany(t, 2)
			e.smtp.AnswerLate(600 * time.Millisecond)
			m := e.mailer(t)
			if tc.idle > 0 {
				m.mu.Lock()
				m.longest.add(time.Now().Add(-tc.idle), 600*time.Millisecond)
				m.mu.Unlock()
			}
			s := e.sender(t, "sender-a", &busyFirst{inner: m, short: 450 * time.Millisecond})
			s.concurrency, s.deliver = 1, 2*time.Second
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			returned := runSender(ctx, t, s)
			testenv.Eventually(t, 20*time.Second, func() bool {
				return testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE status = 'sent'") == int64(len(ids))
			}, "not both notifications were sent")
			cancel()
			returned()
			if n, r := e.mails(t, ids[1]), e.row(t, ids[1]); n != 1 || r.Attempts != 0 {
				t.Errorf("the notification that waited in line: e-mailed %d times without a crash, %d attempts counted; want once, none (row: %+v)",
					n, r.Attempts, r)
			}
		})
	}
}

// overlapping counts how many deliveries are in progress at once, at most, each taking delay
// before handing over to inner.
type overlapping struct {
	inner      Deliverer
	delay      time.Duration
	mu         sync.Mutex
	now, most  int
	deliveries int
}

func (d *overlapping) Deliver(ctx context.Context, n Notification) error {
	d.mu.Lock()
	d.now++
	d.most = max(d.most, d.now)
	d.deliveries++
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		d.now--
		d.mu.Unlock()
	}()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d.delay):
	}
	return d.inner.Deliver(ctx, n)
}

// statementsAtOnce registers callbacks on db that count its statements in progress, and
// returns the most there were at once.
func statementsAtOnce(t *testing.T, db *gorm.DB) func() int {
	t.Helper()
	var mu sync.Mutex
	now, most := 0, 0
	begin := func(*gorm.DB) {
		mu.Lock()
		defer mu.Unlock()
		now++
		most = max(most, now)
	}
	end := func(*gorm.DB) {
		mu.Lock()
		defer mu.Unlock()
		now--
	}
	for _, err := range []error{
		db.Callback().Row().Before("gorm:row").Register("test:begin_row", begin),
		db.Callback().Row().After("gorm:row").Register("test:end_row", end),
		db.Callback().Raw().Before("gorm:raw").Register("test:begin_raw", begin),
		db.Callback().Raw().After("gorm:raw").Register("test:end_raw", end),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	return func() int {
		mu.Lock()
		defer mu.Unlock()
		return most
	}
}

// Deliveries run concurrently, up to the sender's concurrency, and each notification is still
// e-mailed once; while they run, the sender's statements (leases and records, for all of them)
// run one at a time, on one database connection.
func TestConcurrentDeliveriesShareOneDatabaseConnection(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	const notifications = 40
	ids := e.pendingMany(t, notifications)
	d := &overlapping{inner: e.mailer(t), delay: 50 * time.Millisecond}
	s := e.sender(t, "sender-a", d)
	s.concurrency = 8
	// Each delivery must begin its conversation in its budget, or it is released and tried
	// again, a second delivery of the same notification: 500 ms was too little on a loaded
	// machine (7 of 40 released in one CI run, each e-mailed once all the same).
	s.deliver = 5 * time.Second
	most := statementsAtOnce(t, s.db)
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- s.Run(ctx) }()
	testenv.Eventually(t, 30*time.Second, func() bool {
		return testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE status = 'sent'") == notifications
	}, "not all %d notifications were sent", notifications)
	cancel()
	if err := <-ran; err != nil {
		t.Fatal(err)
	}

	if d.most != s.concurrency {
		t.Errorf("at most %d deliveries at once, want the concurrency, %d", d.most, s.concurrency)
	}
	if n := most(); n != 1 {
		t.Errorf("at most %d of the sender's statements at once, want 1", n)
	}
	byMessageID := map[string]int{}
	for _, m := range e.smtp.Mail() {
		byMessageID[m.MessageID]++
	}
	for _, id := range ids {
		if n := byMessageID["<"+id.String()+"@"+MessageIDDomain+">"]; n != 1 {
			t.Errorf("notification %s e-mailed %d times, want once", id, n)
		}
	}
	if d.deliveries != notifications {
		t.Errorf("%d deliveries, want %d", d.deliveries, notifications)
	}
}

// held is a delivery that goes on until the test releases it, then sends for real; it respects
// ctx, as a Deliverer must. entered receives one value per delivery that began.
type held struct {
	inner   Deliverer
	entered chan uuid.UUID
	release chan struct{}
}

func (d held) Deliver(ctx context.Context, n Notification) error {
	d.entered <- n.ID
	select {
	case <-d.release:
	case <-ctx.Done():
		return ctx.Err()
	}
	return d.inner.Deliver(ctx, n)
}

// Shutdown with deliveries in progress and more notifications leased in waiting: those in
// progress finish within the grace and are marked sent, those waiting are given back unsent,
// due again at once with no attempt counted, and the rest were never leased. One e-mail per
// delivery that began, none repeated.
func TestShutdownFinishesDeliveriesInProgressAndReleasesTheLeasedRest(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	const notifications = 6
	e.pendingMany(t, notifications)
	d := held{inner: e.mailer(t), entered: make(chan uuid.UUID, notifications), release: make(chan struct{})}
	s := e.sender(t, "sender-a", d)
	s.concurrency = 2
	s.deliver, s.grace = 10*time.Second, 2*time.Second

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	returned := runSender(ctx, t, s)
	inProgress := map[uuid.UUID]bool{}
	for range s.concurrency {
		select {
		case id := <-d.entered:
			inProgress[id] = true
		case <-time.After(15 * time.Second):
			t.Fatal("the deliveries did not begin")
		}
	}
	// The two deliveries are under way; two more notifications are leased, waiting for them.
	testenv.Eventually(t, 15*time.Second, func() bool {
		return testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE next_attempt_at > now()") == 4
	}, "not four notifications leased")
	cancel()
	time.AfterFunc(s.grace/2, func() { close(d.release) })
	returned()

	var rows []Notification
	if err := e.db.DB.Find(&rows).Error; err != nil {
		t.Fatal(err)
	}
	sent := 0
	for _, n := range rows {
		switch {
		case inProgress[n.ID]:
			if n.Status != StatusSent || n.Attempts != 0 {
				t.Errorf("notification in progress at shutdown: %+v, want sent", n)
			}
			sent++
		case n.Status != StatusPending || n.Attempts != 0 || n.LastError != nil || n.NextAttemptAt.After(time.Now()):
			t.Errorf("notification not begun at shutdown: %+v, want pending, due now, no attempt", n)
		}
	}
	if sent != s.concurrency {
		t.Errorf("%d of the notifications in progress sent, want %d", sent, s.concurrency)
	}
	if n := len(d.entered); n != 0 {
		t.Errorf("%d deliveries began after the shutdown", n)
	}
	if n := len(e.smtp.Mail()); n != s.concurrency {
		t.Errorf("%d e-mails, want %d", n, s.concurrency)
	}
}

// Shutdown while deliveries wait in the mailer for its one connection, on a relay that
// answers each message late: the one under way finishes within the grace and is marked sent;
// none of those waiting begins (begun in the grace, it would be cut off at its end after the
// relay took the message, and sent again). They are released, due at once, no attempt counted.
func TestShutdownBeginsNoConversationInTheGrace(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	const notifications = 4
	e.pendingMany(t, notifications)
	e.smtp.AnswerLate(time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m := newSMTPDeliverer(e.smtp.Addr, "orders@shop.example", 1)
	t.Cleanup(m.Close)
	s := e.sender(t, "sender-a", m)
	s.concurrency = notifications
	s.deliver, s.grace = 10*time.Second, 1500*time.Millisecond
	// The worker main runs, which closes the mailer at the shutdown.
	returned := runWorker(ctx, t, s, sending(s, m))
	// The relay took the first message and is slow to say so; the others wait for the connection.
	testenv.Eventually(t, 15*time.Second, func() bool { return len(e.smtp.Mail()) == 1 }, "no delivery began")
	cancel()
	returned()
	taken := map[string]bool{}
	for _, mail := range e.smtp.Mail() {
		taken[mail.MessageID] = true
	}
	var rows []Notification
	if err := e.db.DB.Find(&rows).Error; err != nil {
		t.Fatal(err)
	}
	for _, n := range rows {
		switch {
		case taken[fmt.Sprintf("<%s@%s>", n.ID, MessageIDDomain)]:
			if n.Status != StatusSent {
				t.Errorf("notification %s: the relay took its e-mail, but it is %s with %d attempts: it would be sent again", n.ID, n.Status, n.Attempts)
			}
		case n.Status != StatusPending || n.Attempts != 0 || n.NextAttemptAt.After(time.Now()):
			t.Errorf("notification not begun at shutdown: %+v, want pending, due now, no attempt", n)
		}
	}
	if len(taken) != 1 {
		t.Errorf("the relay took %d e-mails, want the one under way at shutdown", len(taken))
	}
}

// runSender runs s until ctx ends. The returned function, called once ctx has ended, waits for
// Run to return nil: within the grace and one recording budget, with 5 s to spare.
func runSender(ctx context.Context, t *testing.T, s *sender) (returned func()) {
	return runWorker(ctx, t, s, s.Run)
}

// runWorker is runSender running s by the worker run.
func runWorker(ctx context.Context, t *testing.T, s *sender, run platform.Worker) (returned func()) {
	ran := make(chan error, 1)
	go func() { ran <- run(ctx) }()
	return func() {
		t.Helper()
		select {
		case err := <-ran:
			if err != nil {
				t.Fatalf("Run = %v, want nil", err)
			}
		case <-time.After(s.grace + s.mark + 5*time.Second):
			t.Fatal("Run did not return within the grace and one recording budget of the shutdown")
		}
	}
}

// holdLeases makes every later update of the test database's notifications wait, inside its
// statement and holding the row, until the returned release is called (it is also called at
// cleanup).
func (e *senderEnv) holdLeases(t *testing.T) (release func()) {
	t.Helper()
	return testenv.HoldAt(t, e.db.DB, "BEFORE UPDATE ON notifications")
}

// lockWaits lists the statements of the sender name (its connections' application_name) that
// wait for a lock.
func (e *senderEnv) lockWaits(t *testing.T, name string) []string {
	t.Helper()
	var queries []string
	if err := e.db.DB.Raw("SELECT query FROM pg_stat_activity WHERE application_name = ? AND wait_event_type = 'Lock'", name).
		Scan(&queries).Error; err != nil {
		t.Fatal(err)
	}
	return queries
}

// A sender skips a notification that another sender is leasing, instead of waiting for it and
// leasing it again: the first is held inside its lease's update, holding the row, and the
// second, started then, must find nothing to do.
func TestSecondSenderSkipsANotificationBeingLeased(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	release := e.holdLeases(t)
	a := e.sender(t, "sender-a", e.mailer(t))
	b := e.sender(t, "sender-b", e.mailer(t))
	b.mark = 10 * time.Second // the budget of its claim: a claim that waits is seen waiting, not cut short
	aDone := start(a)
	testenv.Eventually(t, 10*time.Second, func() bool { return len(e.lockWaits(t, "sender-a")) == 1 },
		"the first sender did not reach its lease's update")
	bDone := start(b)
	var got *outcome
	var waits []string
	testenv.Eventually(t, 10*time.Second, func() bool {
		select {
		case o := <-bDone:
			got = &o
			return true
		default:
		}
		waits = e.lockWaits(t, "sender-b")
		return len(waits) > 0
	}, "the second sender neither returned nor waited")
	if got == nil {
		t.Errorf("the second sender waits at %q for the notification the first is leasing, instead of skipping it", waits)
	} else if got.delivered || got.err != nil {
		t.Errorf("second sender: %+v, want nothing delivered and no error", *got)
	}
	release()
	if o := await(t, aDone); !o.delivered || o.err != nil {
		t.Fatalf("first sender: %+v, want delivered", o)
	}
	if got == nil {
		await(t, bDone)
	}
	if n := e.mails(t, id); n != 1 {
		t.Fatalf("notification e-mailed %d times, want once", n)
	}
}

// A sent notification is never taken again, however long ago its last lease ran out.
func TestSentNotificationIsNeverTakenAgain(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	s := e.sender(t, "sender-a", e.mailer(t))
	if o := await(t, start(s)); !o.delivered || o.err != nil {
		t.Fatalf("first round: %+v, want delivered", o)
	}
	if err := e.db.DB.Exec("UPDATE notifications SET next_attempt_at = now() - interval '1 hour' WHERE id = ?", id).Error; err != nil {
		t.Fatal(err)
	}
	if o := await(t, start(s)); o.delivered || o.err != nil {
		t.Errorf("second round: %+v, want nothing taken: the notification was sent", o)
	}
	if n := e.mails(t, id); n != 1 {
		t.Fatalf("notification e-mailed %d times, want once", n)
	}
	if r := e.row(t, id); r.Status != StatusSent {
		t.Fatalf("status %q, want %q", r.Status, StatusSent)
	}
}

// notStarted never gets as far as a mail server, as a delivery out of time waiting for a
// connection.
type notStarted struct{}

func (notStarted) Deliver(context.Context, Notification) error {
	return fmt.Errorf("smtp: waiting for a connection: %w: %w", errNotStarted, context.DeadlineExceeded)
}

// A notification whose delivery never started is released, not charged: no attempt counted, no
// error recorded, due again at once.
func TestNotificationNotStartedIsReleasedUncharged(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	s := e.sender(t, "sender-a", notStarted{})
	if o := await(t, start(s)); o.delivered || o.err != nil {
		t.Fatalf("%+v, want nothing delivered and no error", o)
	}
	r := e.row(t, id)
	if r.Status != StatusPending || r.Attempts != 0 || r.LastError != nil {
		t.Fatalf("status %q, attempts %d, last error %v; want pending, 0, none", r.Status, r.Attempts, r.LastError)
	}
	if r.NextAttemptAt.After(time.Now().Add(time.Second)) {
		t.Fatalf("due at %s, want now: nothing was tried, so no backoff", r.NextAttemptAt)
	}
}

// refusesOddly fails every delivery with a reply jsonb cannot hold as it is: a NUL byte and
// invalid UTF-8.
type refusesOddly struct{}

func (refusesOddly) Deliver(context.Context, Notification) error {
	return errors.New("smtp rcpt to: 550 no such user\x00 \xff")
}

// A failure whose text the database cannot store as it is (a server's reply with a NUL byte)
// is still recorded, cleaned: one attempt, due again after its backoff, and the recording of
// other outcomes is not held up retrying it.
func TestFailureWithAnUnstorableReplyIsRecorded(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	s := e.sender(t, "sender-a", refusesOddly{})
	if o := await(t, start(s)); o.delivered || o.err != nil {
		t.Fatalf("%+v, want the failure recorded", o)
	}
	r := e.row(t, id)
	if r.Status != StatusPending || r.Attempts != 1 || r.LastError == nil || *r.LastError != "smtp rcpt to: 550 no such user \uFFFD" {
		t.Fatalf("status %q, attempts %d, last error %v; want pending, 1, the reply cleaned", r.Status, r.Attempts, r.LastError)
	}
}

// A mail server's refusal that quotes the address, as Postfix's does, is logged and traced
// without it: the customers' addresses stay out of the logs and the traces. The row keeps the
// reply whole (it holds the address anyway).
func TestARefusalIsLoggedAndTracedWithoutTheAddress(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	const address = "c-1@customers.example"
	e.smtp.Refuse(address)
	spans := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	s := e.sender(t, "sender-a", e.mailer(t))
	s.tracer = tp.Tracer("test")
	if o := await(t, start(s)); o.delivered || o.err != nil {
		t.Fatalf("%+v, want the refusal recorded", o)
	}
	if r := e.row(t, id); r.LastError == nil || !strings.Contains(*r.LastError, "<"+address+">: Recipient address rejected") {
		t.Fatalf("last error %v, want the server's reply whole", r.LastError)
	}
	if n := len(e.logs.Lines("notification undeliverable", id.String(), "550", "[recipient]")); n != 1 {
		t.Fatalf("%d undeliverable lines with the reply and a stand-in for the address, want 1:\n%s", n, e.logs.String())
	}
	if lines := e.logs.Lines(address); len(lines) != 0 {
		t.Fatalf("the customer's address is logged:\n%s", strings.Join(lines, "\n"))
	}
	for _, span := range spans.GetSpans() {
		if strings.Contains(span.Status.Description, address) || span.Name == "deliver notification" && !strings.Contains(span.Status.Description, "550") {
			t.Fatalf("span %q has status %q, want the reply without the address", span.Name, span.Status.Description)
		}
	}
}

// Servers echo the address in their own case, and in the forms they were sent or keep: its
// domain as the A-label (to a server without SMTPUTF8), or its local part alone.
func TestWithoutAddressIgnoresCase(t *testing.T) {
	for _, tc := range []struct{ text, address, want string }{
		{"550 5.1.1 <Ann@Example.ORG>: rejected; ann@example.org unknown", "ann@example.org",
			"550 5.1.1 <[recipient]>: rejected; [recipient] unknown"},
		{"550 <Ann@XN--BCHER-KVA.example>: rejected; ann@bücher.example unknown", "ann@bücher.example",
			"550 <[recipient]>: rejected; [recipient] unknown"},
		{"550 5.1.1 <ANN>: unknown user; annual quota", "ann@example.org", "550 5.1.1 <[recipient]>: unknown user; annual quota"},
		{"550 5.1.1 <jöhn>: unknown user", "jöhn@bücher.example", "550 5.1.1 <[recipient]>: unknown user"},
	} {
		if got := withoutAddress(tc.text, tc.address); got != tc.want {
			t.Errorf("%q without %s: got %q, want %q", tc.text, tc.address, got, tc.want)
		}
	}
}

// The sender's statements find their rows through their indexes, by key, however much the
// table grew since their plans were cached: on a connection that caches a generic plan at once (what a
// prepared statement gets after its first executions), a first round plans them on a nearly
// empty table; after 20,000 more notifications, and no ANALYZE, the next round must not scan
// the table.
func TestSenderFindsItsRowsByIndexWhateverPlanWasCached(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(e.db.DB.Exec("ALTER TABLE notifications SET (autovacuum_enabled = off)").Error)
	s := e.senderOn(t, "sender-a", e.mailer(t), 1, map[string]string{"plan_cache_mode": "force_generic_plan"})
	e.pending(t)
	if o := await(t, start(s)); !o.delivered || o.err != nil {
		t.Fatalf("first round: %+v, want delivered", o)
	}
	must(e.db.DB.Exec(`INSERT INTO notifications (id, order_id, customer_id, kind, recipient, subject, body, status, next_attempt_at, message_id, created_at, sent_at)
		SELECT gen_random_uuid(), gen_random_uuid(), 'c', 'order_confirmation', 'c@customers.example', 's', 'b', 'sent', now(), gen_random_uuid(), now(), now()
		FROM generate_series(1, 20000)`).Error)
	type tableStats struct{ SeqTupRead, IdxTupFetch, NTupUpd int64 }
	stats := func() (st tableStats) {
		t.Helper()
		must(e.db.DB.Raw("SELECT seq_tup_read, idx_tup_fetch, n_tup_upd FROM pg_stat_user_tables WHERE relname = 'notifications'").Scan(&st).Error)
		return st
	}
	before := stats()
	e.pending(t)
	if o := await(t, start(s)); !o.delivered || o.err != nil {
		t.Fatalf("second round: %+v, want delivered", o)
	}
	// The sender's session reports its counters when idle, within seconds; its two updates
	// (the lease, the mark) show when they are in.
	var after tableStats
	testenv.Eventually(t, 20*time.Second, func() bool { after = stats(); return after.NTupUpd >= before.NTupUpd+2 },
		"the sender's statistics were not reported")
	if read := after.SeqTupRead - before.SeqTupRead; read > 1000 {
		t.Fatalf("the second round read %d rows by sequential scan of a table of %d: a cached plan scans it whole", read, 20002)
	}
	if read := after.IdxTupFetch - before.IdxTupFetch; read > 1000 {
		t.Fatalf("the second round fetched %d rows through an index, of a table of %d: a cached plan walks a whole index", read, 20002)
	}
}

// A mark tried again after its commit's answer was lost (the server committed, the client's
// deadline passed first) finds the row sent under its own lease: recorded, not a lease that
// ran out, and nothing changes the second time.
func TestMarkTriedAgainAfterALostAnswerCountsAsRecorded(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	s, row := e.leasedOne(t)
	id := row.ID
	if changed, err := s.record(&deliveryOutcome{row: row, sent: true}); !changed || err != nil {
		t.Fatalf("first mark = %v, %v; want recorded", changed, err)
	}
	marked := e.row(t, id)
	if changed, err := s.record(&deliveryOutcome{row: row, sent: true}); !changed || err != nil {
		t.Fatalf("the mark again = %v, %v; want it recognised as recorded", changed, err)
	}
	sameRow(t, "after the mark was tried again", e.row(t, id), marked)
}

// So is a failure recorded again after its answer was lost: the row, already due again with
// the attempt counted, is left as it is, and the sender is told it holds the outcome, not that
// another sender took the notification over.
func TestAFailureTriedAgainAfterALostAnswerCountsAsRecorded(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	s, row := e.leasedOne(t)
	id := row.ID
	failed := func() *deliveryOutcome { // due again before the lease would have ended, as early failures are
		return &deliveryOutcome{row: row, failure: "451 4.3.0 try again later", retryIn: 100 * time.Millisecond}
	}
	if changed, err := s.record(failed()); !changed || err != nil {
		t.Fatalf("first record = %v, %v; want recorded", changed, err)
	}
	recorded := e.row(t, id)
	if changed, err := s.record(failed()); !changed || err != nil {
		t.Fatalf("the record again = %v, %v; want it recognised as recorded", changed, err)
	}
	sameRow(t, "after the failure was recorded again", e.row(t, id), recorded)
	other := failed()
	other.failure = "421 4.7.0 closing"
	if changed, err := s.record(other); changed || err != nil {
		t.Fatalf("a different failure under the lease that ran out = %v, %v; want it not recorded", changed, err)
	}
}

// So is an undeliverable outcome recorded again after its answer was lost: the row, already
// undeliverable under the same lease, is left as it is.
func TestAnUndeliverableTriedAgainAfterALostAnswerCountsAsRecorded(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	s, row := e.leasedOne(t)
	refused := func() *deliveryOutcome {
		return &deliveryOutcome{row: row, undeliverable: true, failure: "smtp rcpt to: 550 5.1.1 User unknown"}
	}
	if changed, err := s.record(refused()); !changed || err != nil {
		t.Fatalf("first record = %v, %v; want recorded", changed, err)
	}
	recorded := e.row(t, row.ID)
	if recorded.Status != StatusUndeliverable || recorded.Attempts != 1 || !recorded.NextAttemptAt.Equal(row.LeasedUntil) {
		t.Fatalf("row = %+v, want undeliverable, its attempt counted, at its lease", recorded)
	}
	if changed, err := s.record(refused()); !changed || err != nil {
		t.Fatalf("the record again = %v, %v; want it recognised as recorded", changed, err)
	}
	sameRow(t, "after the undeliverable outcome was recorded again", e.row(t, row.ID), recorded)
	for name, o := range map[string]*deliveryOutcome{
		"a failure":  {row: row, failure: "smtp rcpt to: 451 try again", retryIn: time.Second},
		"a release":  {row: row},
		"a sent one": {row: row, sent: true},
	} {
		if changed, err := s.record(o); changed || err != nil {
			t.Fatalf("%s under the same lease = %v, %v; want nothing recorded: the row is undeliverable", name, changed, err)
		}
		sameRow(t, "after "+name+" under the same lease", e.row(t, row.ID), recorded)
	}
}

// leasedOne is a sender of a pending notification, and that notification leased by it.
func (e *senderEnv) leasedOne(t *testing.T) (*sender, pendingRow) {
	t.Helper()
	id := e.pending(t)
	s := e.sender(t, "sender-a", e.mailer(t))
	rows, err := s.lease(1)
	if err != nil || len(rows) != 1 || rows[0].ID != id {
		t.Fatalf("lease = %+v, %v; want the notification %s", rows, err, id)
	}
	return s, rows[0]
}

// Lease requests made while a transaction runs each get their answer, in turn: one made beside
// Run's (a test's deliverOne, say) never replaces it, which would leave its caller waiting for
// ever.
func TestLeaseRequestsMadeTogetherAreEachAnswered(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	ids := map[uuid.UUID]bool{e.pending(t): true, e.pending(t): true}
	release := e.holdLeases(t)
	s := e.sender(t, "sender-a", e.mailer(t))
	s.mark = 10 * time.Second // the budget of each lease: the held one is seen waiting, not cut short
	type answer struct {
		rows []pendingRow
		err  error
	}
	answers := make(chan answer, 3)
	lease := func() {
		rows, err := s.lease(1)
		answers <- answer{rows, err}
	}
	go lease()
	testenv.Eventually(t, 10*time.Second, func() bool { return len(e.lockWaits(t, "sender-a")) == 1 },
		"the first lease did not reach its update")
	go lease()
	go lease()
	testenv.Eventually(t, 10*time.Second, func() bool {
		s.line.mu.Lock()
		defer s.line.mu.Unlock()
		return len(s.line.leases) == 2
	}, "the two later requests are not both waiting")
	release()
	leased := map[uuid.UUID]bool{}
	for range 3 {
		select {
		case a := <-answers:
			if a.err != nil {
				t.Fatalf("lease: %v", a.err)
			}
			for _, r := range a.rows {
				leased[r.ID] = true
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a lease request was never answered")
		}
	}
	if !maps.Equal(leased, ids) {
		t.Fatalf("leased %v, want both pending notifications %v", leased, ids)
	}
}

// failing fails every delivery, as a mail server that answers 451 to each message; begun, if
// set, is called as each delivery begins.
type failing struct{ begun func() }

func (f failing) Deliver(context.Context, Notification) error {
	if f.begun != nil {
		f.begun()
	}
	return errors.New("smtp rcpt to: 451 try again later")
}

// A failure's backoff grows with the attempts made before it, doubling from the base, and
// never exceeds the maximum, however many there were: with a base of 100 ms and a maximum of
// 1 s, the fourth failure waits 640 to 800 ms (800 ms less its jitter), the eleventh 1 s at
// most and no less than the jittered maximum.
func TestBackoffGrowsWithTheAttemptsUpToTheMaximum(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		before   int           // attempts recorded before this one
		from, to time.Duration // the wait recorded, allowing for the jitter
	}{
		{before: 3, from: 640 * time.Millisecond, to: 800 * time.Millisecond},
		{before: 10, from: 800 * time.Millisecond, to: time.Second},
	} {
		t.Run(fmt.Sprintf("after %d attempts", tc.before), func(t *testing.T) {
			t.Parallel()
			e := newSenderEnv(t)
			id := e.pending(t)
			if err := e.db.DB.Exec("UPDATE notifications SET attempts = ?, last_error = 'smtp: 451' WHERE id = ?", tc.before, id).Error; err != nil {
				t.Fatal(err)
			}
			// The failure is recorded between two readings of the database's clock, the first
			// as the delivery begins, so its wait lies between the due time less the second and
			// the due time less the first, however slow the machine.
			var before time.Time
			var beforeErr error
			s := e.sender(t, "sender-a", failing{begun: func() {
				beforeErr = e.db.DB.Raw("SELECT clock_timestamp()").Scan(&before).Error
			}})
			if o := await(t, start(s)); o.delivered || o.err != nil {
				t.Fatalf("%+v, want the failure recorded", o)
			}
			after := e.clock(t)
			if beforeErr != nil || before.IsZero() {
				t.Fatalf("the clock as the delivery began: %v, %v", before, beforeErr)
			}
			var due struct {
				Attempts      int
				NextAttemptAt time.Time
			}
			if err := e.db.DB.Raw("SELECT attempts, next_attempt_at FROM notifications WHERE id = ?", id).Scan(&due).Error; err != nil {
				t.Fatal(err)
			}
			longest, shortest := due.NextAttemptAt.Sub(before), due.NextAttemptAt.Sub(after)
			if due.Attempts != tc.before+1 || longest < tc.from || shortest > tc.to {
				t.Fatalf("attempts %d, due again in %v to %v after the failure; want %d, in %v to %v", due.Attempts, shortest, longest, tc.before+1, tc.from, tc.to)
			}
		})
	}
}

// Notifications are leased oldest first, whatever order their ids or rows are in: a backlog
// drains in the order it built up, and no notification waits behind younger ones.
func TestOldestNotificationsAreLeasedFirst(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	ids := e.pendingMany(t, 3)
	// The last inserted is the oldest, the first the youngest.
	for i, id := range ids {
		if err := e.db.DB.Exec("UPDATE notifications SET created_at = now() - ? * interval '1 minute' WHERE id = ?", i, id).Error; err != nil {
			t.Fatal(err)
		}
	}
	s := e.sender(t, "sender-a", e.mailer(t))
	var leased []uuid.UUID
	for range 2 {
		rows, err := s.lease(1)
		if err != nil || len(rows) != 1 {
			t.Fatalf("lease = %+v, %v; want one notification", rows, err)
		}
		leased = append(leased, rows[0].ID)
	}
	if want := []uuid.UUID{ids[2], ids[1]}; !slices.Equal(leased, want) {
		t.Fatalf("leased %v, want the oldest two in order, %v", leased, want)
	}
}

// A notification released unstarted after earlier failures keeps their count and the last
// error: a release says nothing about the mail server, and the error is what an operator reads
// of a notification that has not gone out yet.
func TestReleaseKeepsTheLastError(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	const earlier = "smtp rcpt to: 451 try again later"
	if err := e.db.DB.Exec("UPDATE notifications SET attempts = 2, last_error = ? WHERE id = ?", earlier, id).Error; err != nil {
		t.Fatal(err)
	}
	s := e.sender(t, "sender-a", notStarted{})
	if o := await(t, start(s)); o.delivered || o.err != nil {
		t.Fatalf("%+v, want nothing delivered and no error", o)
	}
	r := e.row(t, id)
	if r.Status != StatusPending || r.Attempts != 2 || r.LastError == nil || *r.LastError != earlier {
		t.Fatalf("status %q, attempts %d, last error %v; want pending, 2, %q", r.Status, r.Attempts, r.LastError, earlier)
	}
}

// Shutdown while a delivery goes on past the grace (a mail server that never answers): it is
// cut off at the grace's end, not at its own deadline, counted as failed and due again after a
// backoff. Run returns within the grace and one recording budget (runSender allows 5 s more,
// still far short of the delivery's own 20 s deadline).
func TestDeliveryOutlastingTheGraceIsCutOffAndCountedAsFailed(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	d := held{inner: e.mailer(t), entered: make(chan uuid.UUID, 1), release: make(chan struct{})}
	s := e.sender(t, "sender-a", d)
	s.deliver, s.grace = 20*time.Second, 300*time.Millisecond

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	returned := runSender(ctx, t, s)
	wait(t, d.entered, "the delivery")
	cancel()
	returned()
	r := e.row(t, id)
	if r.Status != StatusPending || r.Attempts != 1 || r.LastError == nil || !strings.Contains(*r.LastError, "context canceled") {
		t.Fatalf("row = %+v, want pending with the cut-off delivery counted as a failed attempt", r)
	}
	if n := len(e.logs.Lines("notification delivery failed", id.String())); n != 1 {
		t.Fatalf("%d 'notification delivery failed' lines, want 1", n)
	}
	if n := len(e.smtp.Mail()); n != 0 {
		t.Fatalf("%d e-mails, want none", n)
	}
}

// The sender never gives up on a notification: however many attempts failed before, it is
// leased once due and, the mail server taking it, sent.
func TestNotificationIsSentAfterAnyNumberOfFailedAttempts(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	if err := e.db.DB.Exec("UPDATE notifications SET attempts = 50, last_error = 'smtp: 451' WHERE id = ?", id).Error; err != nil {
		t.Fatal(err)
	}
	s := e.sender(t, "sender-a", e.mailer(t))
	if o := await(t, start(s)); !o.delivered || o.err != nil {
		t.Fatalf("%+v, want the notification leased and delivered after 50 failed attempts", o)
	}
	if r := e.row(t, id); r.Status != StatusSent || r.Attempts != 50 {
		t.Fatalf("status %q, attempts %d; want sent, the 50 earlier attempts kept", r.Status, r.Attempts)
	}
	if n := e.mails(t, id); n != 1 {
		t.Fatalf("%d e-mails, want 1", n)
	}
}

// A lease runs its whole length from when it is taken, however long the transaction that takes
// it ran before (recording outcomes that waited for a lock): the statement reads the clock as it
// leases each row (clock_timestamp()), where now(), the transaction's start, would end the lease
// that much sooner.
func TestLeaseRunsItsWholeLengthFromItsTaking(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	e.pendingMany(t, 3)
	s := e.sender(t, "sender-a", e.mailer(t))
	s.mark = 10 * time.Second // the budget of each transaction: the one held is seen through, not cut short
	earlier, err := s.lease(2)
	if err != nil || len(earlier) != 2 {
		t.Fatalf("lease = %+v, %v; want two notifications", earlier, err)
	}
	// Two transactions of the test's own lock the two rows leased, so that recording their
	// outcomes waits.
	locks := make([]*gorm.DB, 2)
	for i, row := range earlier {
		locks[i] = e.db.DB.Begin()
		t.Cleanup(func() { locks[i].Rollback() })
		if err := locks[i].Exec("SELECT 1 FROM notifications WHERE id = ? FOR UPDATE", row.ID).Error; err != nil {
			t.Fatal(err)
		}
	}
	released := make(chan error, 2)
	release := func(row pendingRow) {
		go func() {
			_, err := s.record(&deliveryOutcome{row: row})
			released <- err
		}()
	}
	// The first transaction records the first release and waits; the second release and a
	// lease request queue behind it, for the next transaction.
	release(earlier[0])
	testenv.Eventually(t, 10*time.Second, func() bool { return len(e.lockWaits(t, "sender-a")) == 1 },
		"the first release did not wait for its row")
	release(earlier[1])
	leased := make(chan []pendingRow, 1)
	go func() {
		rows, err := s.lease(1)
		if err != nil {
			t.Error(err)
		}
		leased <- rows
	}()
	testenv.Eventually(t, 10*time.Second, func() bool {
		s.line.mu.Lock()
		defer s.line.mu.Unlock()
		return len(s.line.outcomes) == 1 && len(s.line.leases) == 1
	}, "the second release and the lease request are not both waiting")
	locks[0].Rollback()
	wait(t, released, "the first release")
	// The next transaction records the second release, waiting for its row, then leases.
	testenv.Eventually(t, 10*time.Second, func() bool { return len(e.lockWaits(t, "sender-a")) == 1 },
		"the second release did not wait for its row")
	// The row lock goes after a while, the database's clock read as it goes: the lease is
	// taken after that, so a lease counted from its taking lasts until that moment and its
	// whole length at least.
	const held = 1500 * time.Millisecond
	freed := make(chan time.Time, 1)
	time.AfterFunc(held, func() {
		var at time.Time
		if err := locks[1].Raw("SELECT clock_timestamp()").Scan(&at).Error; err != nil {
			t.Error(err)
		}
		locks[1].Rollback()
		freed <- at
	})
	var rows []pendingRow
	select {
	case rows = <-leased:
	case <-time.After(15 * time.Second):
		t.Fatal("the lease request was never answered")
	}
	if len(rows) != 1 {
		t.Fatalf("leased %+v, want one notification", rows)
	}
	lockFreed := <-freed
	if until := rows[0].LeasedUntil; until.Before(lockFreed.Add(s.leaseFor())) {
		t.Fatalf("the lease runs until %v, %v after the row lock went; want its whole length, %v, at least: it counted from before the transaction waited %v",
			until, until.Sub(lockFreed), s.leaseFor(), held)
	}
}

// A sent e-mail's mark may wait until its delivery's budget and a recording's have passed since
// leasedAt: that ends a grace before the lease, however long the lease's transaction took to
// answer after the database took the lease (here held inside its update, past the lease's
// clock_timestamp(), until the test sees it wait). Ending at the lease's very end, a mark
// answered late, or by a clock a little ahead, finds the notification taken by another sender,
// which e-mails it again.
func TestSentMarkEndsAGraceBeforeItsLease(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	id := e.pending(t)
	release := e.holdLeases(t)
	s := e.sender(t, "sender-a", e.mailer(t))
	s.mark = 10 * time.Second // the lease's transaction is seen through, not cut short
	type answer struct {
		rows []pendingRow
		err  error
	}
	answered := make(chan answer, 1)
	go func() {
		rows, err := s.lease(1)
		answered <- answer{rows, err}
	}()
	testenv.Eventually(t, 10*time.Second, func() bool { return len(e.lockWaits(t, "sender-a")) == 1 },
		"the lease did not reach its update")
	release()
	var a answer
	select {
	case a = <-answered:
	case <-time.After(15 * time.Second):
		t.Fatal("the lease request was never answered")
	}
	if a.err != nil || len(a.rows) != 1 || a.rows[0].ID != id {
		t.Fatalf("lease = %+v, %v; want the notification %s", a.rows, a.err, id)
	}
	row := a.rows[0]
	delivered := row.leasedAt.Add(s.deliver) // the delivery used its whole budget
	by := s.recordBy(&deliveryOutcome{row: row, sent: true}, delivered)
	if margin := row.LeasedUntil.Sub(by); margin < s.grace {
		t.Fatalf("a sent mark may wait until %v before its lease ends (deliver %v, mark %v, grace %v); want the grace at least",
			margin, s.deliver, s.mark, s.grace)
	}
}

// The sender's transactions are READ COMMITTED whatever the database's default. Under
// repeatable read, a transaction whose snapshot came before another sender leased a row fails
// to serialize when its own lease locks that row, and rolls back the outcomes it recorded. Here
// sender B's transaction takes its snapshot recording a release that waits for a row the test
// locks; sender A leases the other notification meanwhile.
func TestSenderTransactionsReadCommittedWhateverTheDefault(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	ids := e.pendingMany(t, 2)
	a := e.sender(t, "sender-a", e.mailer(t))
	b := e.senderOn(t, "sender-b", e.mailer(t), 1, map[string]string{"default_transaction_isolation": "repeatable read"})
	b.mark = 10 * time.Second // the budget of its transaction: the one held is seen through, not cut short
	var isolation string
	if err := b.db.Raw("SHOW default_transaction_isolation").Scan(&isolation).Error; err != nil || isolation != "repeatable read" {
		t.Fatalf("sender B's default isolation: %q, %v; want repeatable read", isolation, err)
	}
	leased, err := b.lease(1)
	if err != nil || len(leased) != 1 || leased[0].ID != ids[0] {
		t.Fatalf("sender B's lease = %+v, %v; want the notification %s", leased, err, ids[0])
	}
	lock := e.db.DB.Begin()
	t.Cleanup(func() { lock.Rollback() })
	if err := lock.Exec("SELECT 1 FROM notifications WHERE id = ? FOR UPDATE", ids[0]).Error; err != nil {
		t.Fatal(err)
	}
	type result struct {
		changed map[uuid.UUID]bool
		leased  []pendingRow
		err     error
	}
	done := make(chan result, 1)
	go func() {
		deadline := time.Now().Add(b.mark)
		changed, rows, err := b.transact([]*deliveryOutcome{{row: leased[0], deadline: deadline}}, &leaseRequest{limit: 1, deadline: deadline})
		done <- result{changed, rows, err}
	}()
	testenv.Eventually(t, 10*time.Second, func() bool { return len(e.lockWaits(t, "sender-b")) == 1 },
		"sender B's release did not wait for its row")
	if rows, err := a.lease(1); err != nil || len(rows) != 1 || rows[0].ID != ids[1] {
		t.Fatalf("sender A's lease = %+v, %v; want the notification %s", rows, err, ids[1])
	}
	lock.Rollback()
	var r result
	select {
	case r = <-done:
	case <-time.After(15 * time.Second):
		t.Fatal("sender B's transaction did not end")
	}
	if r.err != nil || !r.changed[ids[0]] || len(r.leased) != 0 {
		t.Fatalf("sender B's transaction: changed %v, leased %+v, %v; want its release recorded and nothing leased", r.changed, r.leased, r.err)
	}
}

// leaseChecked stalls the first delivery until release (ignoring its context, as a sender
// frozen mid-delivery), and checks every later one's deadline against its notification's
// lease, as the database has it: a delivery must never be allowed to run past its lease.
type leaseChecked struct {
	inner   Deliverer
	db      *gorm.DB
	first   sync.Once
	entered chan struct{}
	release chan struct{}
	mu      sync.Mutex
	past    []string // deliveries whose deadline was past their lease
}

func (d *leaseChecked) Deliver(ctx context.Context, n Notification) error {
	stall := false
	d.first.Do(func() { stall = true })
	if stall {
		close(d.entered)
		<-d.release
		return errors.New("smtp: stalled")
	}
	var lease time.Time
	if err := d.db.Raw("SELECT next_attempt_at FROM notifications WHERE id = ?", n.ID).Scan(&lease).Error; err != nil {
		return err
	}
	if deadline, ok := ctx.Deadline(); !ok || deadline.After(lease) {
		d.mu.Lock()
		d.past = append(d.past, fmt.Sprintf("%s: deadline %v, lease until %v", n.ID, deadline, lease))
		d.mu.Unlock()
	}
	return d.inner.Deliver(ctx, n)
}

// A notification whose lease ran out while it waited in line (its worker stuck on the one
// before it) gets no budget past its lease: its delivery's deadline counts from the lease, so it
// is released, never delivered while another sender may have taken it.
func TestDeliveryNeverRunsPastItsLease(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	ids := e.pendingMany(t, 2)
	d := &leaseChecked{inner: e.mailer(t), db: e.db.DB, entered: make(chan struct{}), release: make(chan struct{})}
	s := e.sender(t, "sender-a", d)
	s.concurrency = 1
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	returned := runSender(ctx, t, s)
	wait(t, d.entered, "the first delivery")
	// The second notification is leased and waits for the worker, until its lease is over.
	leased := func() bool {
		return testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE id = ? AND next_attempt_at > now()", ids[1]) == 1
	}
	testenv.Eventually(t, 15*time.Second, leased, "the second notification was not leased")
	testenv.Eventually(t, 15*time.Second, func() bool { return !leased() }, "the second notification's lease did not run out")
	close(d.release)
	testenv.Eventually(t, 15*time.Second, func() bool {
		return testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE id = ? AND status = 'sent'", ids[1]) == 1
	}, "the second notification was not sent")
	cancel()
	returned()
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.past) != 0 {
		t.Fatalf("deliveries allowed to run past their lease:\n%s", strings.Join(d.past, "\n"))
	}
}

// errAway is a delivery's or a probe's failure to open a session with a mail server that is away.
var errAway = fmt.Errorf("%w: smtp dial 127.0.0.1:25: connection refused", errUnreachable)

// awayMailServer is a deliverer that can be probed, to a mail server that is away while away
// is set: every delivery fails with errAway after 200 ms (a dial that times out, long enough
// for Run to lease the next notifications into waiting), every probe at once or, with hang
// set, when its ctx ends (a server that accepts connections and says nothing). Otherwise each
// delivery is sent and each probe succeeds.
type awayMailServer struct {
	away, hang atomic.Bool
	tried      atomic.Int64 // deliveries begun
	mu         sync.Mutex
	sent       map[uuid.UUID]int
	probes     []time.Time     // when each probe began
	budgets    []time.Duration // and the time its ctx gave it
}

func newAwayMailServer() *awayMailServer {
	d := &awayMailServer{sent: map[uuid.UUID]int{}}
	d.away.Store(true)
	return d
}

func (d *awayMailServer) Deliver(ctx context.Context, n Notification) error {
	d.tried.Add(1)
	if d.away.Load() {
		select {
		case <-time.After(200 * time.Millisecond):
			return errAway
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sent[n.ID]++
	return nil
}

func (d *awayMailServer) Probe(ctx context.Context) error {
	deadline, _ := ctx.Deadline()
	d.mu.Lock()
	d.probes = append(d.probes, time.Now())
	d.budgets = append(d.budgets, time.Until(deadline))
	d.mu.Unlock()
	if !d.away.Load() {
		return nil
	}
	if d.hang.Load() {
		<-ctx.Done()
		return fmt.Errorf("%w: smtp greeting: %w", errUnreachable, ctx.Err())
	}
	return errAway
}

// probed is when each probe began, and the budget each had.
func (d *awayMailServer) probed() ([]time.Time, []time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.probes), slices.Clone(d.budgets)
}

// delivered is how many e-mails were sent, and how many notifications were sent more than once.
func (d *awayMailServer) delivered() (sent, repeated int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, n := range d.sent {
		sent += n
		if n > 1 {
			repeated++
		}
	}
	return sent, repeated
}

// unreachableGauge reads notification_mail_server_unreachable from reg.
func unreachableGauge(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "notification_mail_server_unreachable" {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no notification_mail_server_unreachable")
	return 0
}

// While the mail server is away, a sender with a backlog leases nothing: each worker tries the
// one notification it had begun, and releases the rest it holds unstarted, no attempt charged;
// the probes go on and nothing else is tried. Once a probe finds the server back, each
// notification is sent once.
func TestSenderPausedForTheMailServerLeasesNothingAndReleasesWhatItHeld(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	const notifications = 50
	e.pendingMany(t, notifications)
	d := newAwayMailServer()
	s := e.sender(t, "sender-a", d)
	s.concurrency = 8
	s.probing = messaging.Backoff{Base: 50 * time.Millisecond, Max: 200 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	returned := runSender(ctx, t, s)

	// Paused, everything released; then a second's probes, for anything tried meanwhile.
	testenv.Eventually(t, 10*time.Second, func() bool {
		return s.mailServer.on() && testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE next_attempt_at > now()") == 0
	}, "the sender did not pause and release its notifications")
	tried := d.tried.Load()
	time.Sleep(time.Second)
	if n := d.tried.Load(); n != tried || n > int64(s.concurrency) {
		t.Errorf("%d deliveries tried once paused, %d a second later; want one a worker at most (%d), none later", tried, n, s.concurrency)
	}
	if probes, _ := d.probed(); len(probes) < 4 {
		t.Errorf("%d probes in the pause, want 4 or more", len(probes))
	}
	if n := testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE status <> 'pending' OR attempts > 0 OR last_error IS NOT NULL OR next_attempt_at > now()"); n != 0 {
		t.Errorf("%d notifications sent, charged or leased while the sender was paused, want none", n)
	}

	d.away.Store(false)
	testenv.Eventually(t, 15*time.Second, func() bool {
		return testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE status = 'sent' AND attempts = 0") == notifications
	}, "not every notification sent, uncharged, once the mail server was back")
	if sent, repeated := d.delivered(); sent != notifications || repeated != 0 {
		t.Errorf("%d e-mails, %d notifications sent more than once; want %d, none", sent, repeated, notifications)
	}
	if n := len(e.logs.Lines("mail server reachable again; sending resumed")); n != 1 {
		t.Errorf("%d lines of the mail server's return, want 1", n)
	}
	cancel()
	returned()
}

// Shutdown while the sender is paused for the mail server, between probes or in one that
// waits for a server that says nothing: Run returns at once, with nothing leased or charged.
func TestShutdownWhilePausedForTheMailServerIsPrompt(t *testing.T) {
	t.Parallel()
	for name, hang := range map[string]bool{"between probes": false, "in a probe": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newSenderEnv(t)
			const notifications = 10
			e.pendingMany(t, notifications)
			d := newAwayMailServer()
			d.hang.Store(hang)
			s := e.sender(t, "sender-a", d)
			s.concurrency = 4
			// A probe, or a wait for one, of 10 s: Run must not sit it out.
			s.deliver = 10 * time.Second
			s.probing = messaging.Backoff{Base: 10 * time.Second, Max: 10 * time.Second}
			if hang {
				s.probing.Base = 10 * time.Millisecond
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ran := make(chan error, 1)
			go func() { ran <- s.Run(ctx) }()
			testenv.Eventually(t, 10*time.Second, func() bool {
				probes, _ := d.probed()
				return s.mailServer.on() && (len(probes) > 0) == hang &&
					testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE next_attempt_at > now()") == 0
			}, "the sender did not pause and release its notifications")
			cancel()
			stopped := time.Now()
			select {
			case err := <-ran:
				if err != nil {
					t.Fatalf("Run = %v, want nil", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("Run did not return")
			}
			if took := time.Since(stopped); took > time.Second {
				t.Errorf("Run returned %v after the shutdown, want within a second", took)
			}
			if n := testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE status <> 'pending' OR attempts > 0 OR last_error IS NOT NULL OR next_attempt_at > now()"); n != 0 {
				t.Errorf("%d notifications sent, charged or leased after the shutdown, want none", n)
			}
		})
	}
}

// A probe that waits for a server that says nothing gives up after probing.Max (a delivery's
// budget, if shorter), and the next begins probing.Max at most after its start: the server's
// return is found that soon, however long a delivery's budget.
func TestProbesBeginProbingMaxApartAtMost(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	e.pending(t)
	d := newAwayMailServer()
	d.hang.Store(true)
	s := e.sender(t, "sender-a", d)
	s.deliver = 10 * time.Second
	s.probing = messaging.Backoff{Base: 50 * time.Millisecond, Max: 500 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	returned := runSender(ctx, t, s)
	testenv.Eventually(t, 10*time.Second, func() bool { return s.mailServer.on() }, "the sender did not pause")
	time.Sleep(3 * time.Second)
	probes, budgets := d.probed()
	if len(probes) < 4 {
		t.Fatalf("%d probes in 3 s, want 4 or more (each %v apart at most)", len(probes), s.probing.Max)
	}
	const slack = 200 * time.Millisecond
	for i := 1; i < len(probes); i++ {
		if gap := probes[i].Sub(probes[i-1]); gap > s.probing.Max+slack {
			t.Errorf("probe %d began %v after the one before, want %v at most", i+1, gap, s.probing.Max)
		}
	}
	for i, b := range budgets {
		if b > s.probing.Max {
			t.Errorf("probe %d had %v, want %v at most", i+1, b, s.probing.Max)
		}
	}
	d.away.Store(false)
	back := time.Now()
	testenv.Eventually(t, 15*time.Second, func() bool {
		return testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE status = 'sent'") == 1
	}, "not sent once the mail server was back")
	if took := time.Since(back); took > s.probing.Max+time.Second {
		t.Errorf("sent %v after the mail server came back, want within %v and a second", took, s.probing.Max)
	}
	cancel()
	returned()
}

// lateUnreachable is a deliverer that can be probed, whose first delivery fails as unreachable
// only once the test closes back (as a dial that times out late, begun during the outage), and
// whose second fails so at once, once the first has begun, which starts the outage. The rest
// are sent, and every probe succeeds.
type lateUnreachable struct {
	calls         atomic.Int64
	entered, back chan struct{}
}

func (d *lateUnreachable) Deliver(ctx context.Context, n Notification) error {
	switch d.calls.Add(1) {
	case 1:
		close(d.entered)
		select {
		case <-d.back:
		case <-ctx.Done():
			return ctx.Err()
		}
		return errAway
	case 2:
		<-d.entered
		return errAway
	}
	return nil
}

func (d *lateUnreachable) Probe(context.Context) error { return nil }

// A delivery begun before a probe found the mail server back, which fails after as unreachable,
// starts no new outage: its notification is released, uncharged, and the sender goes on, one
// outage logged and the gauge at 0.
func TestAStaleUnreachableDeliveryDoesNotPauseTheSenderAgain(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	e.pendingMany(t, 2)
	d := &lateUnreachable{entered: make(chan struct{}), back: make(chan struct{})}
	s := e.sender(t, "sender-a", d)
	s.concurrency = 2
	s.deliver = 10 * time.Second
	s.probing = messaging.Backoff{Base: 50 * time.Millisecond, Max: 50 * time.Millisecond}
	reg := prometheus.NewRegistry()
	if err := s.registerMetrics(reg); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	returned := runSender(ctx, t, s)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(e.logs.Lines("mail server reachable again; sending resumed")) == 1
	}, "the outage did not end")
	close(d.back)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, e.db.DB, "SELECT count(*) FROM notifications WHERE status = 'sent' AND attempts = 0") == 2
	}, "not both notifications sent, uncharged")
	if n := len(e.logs.Lines("mail server unreachable; sending paused", "level=ERROR")); n != 1 {
		t.Errorf("%d outages logged, want 1", n)
	}
	if v := unreachableGauge(t, reg); v != 0 {
		t.Errorf("notification_mail_server_unreachable = %v, want 0", v)
	}
	if n := len(e.logs.Lines("mail server reachable again; sending resumed")); n != 1 {
		t.Errorf("%d returns of the mail server logged, want 1", n)
	}
	cancel()
	returned()
}

// A recipient the mail server refuses for good (550 5.1.1 to RCPT TO: no such mailbox) ends the
// notification's retries after one attempt, as a dead letter: undeliverable, the refusal kept
// whole, logged once at ERROR without the address, counted in notification_deliveries_total as
// tried, never leased again however due it looks, and out of the backlog gauges, whose oldest
// age it would otherwise hold for ever.
func TestARecipientRefusedForGoodMakesTheNotificationUndeliverable(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	const address = "c-1@customers.example"
	e.smtp.Refuse(address)
	id := e.pending(t)
	if err := e.db.DB.Exec("UPDATE notifications SET created_at = now() - interval '1 day' WHERE id = ?", id).Error; err != nil {
		t.Fatal(err)
	}
	s := e.sender(t, "sender-a", e.mailer(t))
	if err := s.registerMetrics(prometheus.NewRegistry()); err != nil {
		t.Fatal(err)
	}
	if o := await(t, start(s)); o.delivered || o.err != nil {
		t.Fatalf("%+v, want the refusal recorded", o)
	}
	r := e.row(t, id)
	if r.Status != StatusUndeliverable || r.Attempts != 1 || r.SentAt != nil || r.LastError == nil ||
		!strings.Contains(*r.LastError, "550") || !strings.Contains(*r.LastError, "5.1.1 <"+address+">: Recipient address rejected") {
		t.Fatalf("row = %+v (last error %s), want undeliverable after 1 attempt, the refusal kept whole", r, lastError(r))
	}
	if n := len(e.logs.Lines("level=ERROR", "notification undeliverable", "notification_id="+id.String(), "attempts=1",
		"550", "5.1.1 <[recipient]>")); n != 1 {
		t.Fatalf("%d ERROR lines of the notification undeliverable, want 1:\n%s", n, e.logs)
	}
	if n := len(e.logs.Lines(id.String())); n != 1 {
		t.Fatalf("%d lines about the notification, want the one:\n%s", n, e.logs)
	}
	if lines := e.logs.Lines(address); len(lines) != 0 {
		t.Fatalf("the customer's address is logged:\n%s", strings.Join(lines, "\n"))
	}
	for outcome, want := range map[string]float64{deliveryUndeliverable: 1, deliveryFailed: 0, deliverySent: 0} {
		if n := testutil.ToFloat64(s.outcomes.WithLabelValues(outcome)); n != want {
			t.Errorf("notification_deliveries_total{outcome=%q} = %v, want %v", outcome, n, want)
		}
	}

	if err := e.db.DB.Exec("UPDATE notifications SET next_attempt_at = now() - interval '1 hour' WHERE id = ?", id).Error; err != nil {
		t.Fatal(err)
	}
	if rows, err := s.lease(DefaultConcurrency); err != nil || len(rows) != 0 {
		t.Fatalf("lease = %+v, %v; want nothing: the notification is undeliverable", rows, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	drv := e.db.Driver(t).DB()
	if b, err := readBacklog(ctx, drv, backlogCountCap); err != nil || b.pending != 0 || b.age != 0 {
		t.Fatalf("backlog = %+v, %v; want none: the undeliverable notification waits for no one", b, err)
	}
	// A notification recorded now is the oldest pending, not the day-old undeliverable one.
	e.pending(t)
	if b, err := readBacklog(ctx, drv, backlogCountCap); err != nil || b.pending != 1 || b.age > 60 {
		t.Fatalf("backlog = %+v, %v; want the new notification alone, seconds old", b, err)
	}
	if n := e.smtp.Sessions(); n != 1 || len(e.smtp.Mail()) != 0 {
		t.Fatalf("%d SMTP sessions and %d e-mails, want the one refused conversation", n, len(e.smtp.Mail()))
	}
}

// A refusal that is not the recipient's bad address keeps the notification pending, retried
// with backoff as any failure: a relay refusing to relay or asking for authentication (a 5yz,
// but the relay's configuration, which refuses every recipient alike until it is fixed), or a
// mailbox busy for now (4yz).
func TestARefusalThatIsNotABadAddressIsRetried(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"relaying denied", "authentication required", "mailbox busy"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newSenderEnv(t)
			reply := otherRefusals[name]
			srv := refusing(t, "rcpt", reply)
			mailer := newSMTPDeliverer(srv.addr, "orders@shop.example", 1)
			t.Cleanup(mailer.Close)
			id := e.pending(t)
			s := e.sender(t, "sender-a", mailer)
			if err := s.registerMetrics(prometheus.NewRegistry()); err != nil {
				t.Fatal(err)
			}
			if o := await(t, start(s)); o.delivered || o.err != nil {
				t.Fatalf("%+v, want the refusal recorded", o)
			}
			code := fmt.Sprint(reply.Code)
			enhanced := fmt.Sprintf("%d.%d.%d ", reply.EnhancedCode[0], reply.EnhancedCode[1], reply.EnhancedCode[2])
			if r := e.row(t, id); r.Status != StatusPending || r.Attempts != 1 || r.LastError == nil ||
				!strings.Contains(*r.LastError, code) || !strings.Contains(*r.LastError, enhanced) {
				t.Fatalf("row = %+v (last error %s), want pending after 1 attempt, with the %s %s", r, lastError(r), code, enhanced)
			}
			if n := len(e.logs.Lines("level=WARN", "notification delivery failed", id.String(), code, enhanced)); n != 1 {
				t.Fatalf("%d failure lines, want 1:\n%s", n, e.logs)
			}
			if n := len(e.logs.Lines("c-1@customers.example")); n != 0 {
				t.Fatalf("%d lines with the customer's address, want none:\n%s", n, e.logs)
			}
			// Due again after its backoff (100 ms, 1 s at most), it is tried again.
			testenv.Eventually(t, 10*time.Second, func() bool {
				if _, err := s.deliverOne(context.Background()); err != nil {
					t.Fatal(err)
				}
				return e.row(t, id).Attempts == 2
			}, "the notification was not tried again")
			if r := e.row(t, id); r.Status != StatusPending || srv.refusals() != 2 {
				t.Fatalf("status %q after %d refusals, want pending after 2", r.Status, srv.refusals())
			}
			if n := testutil.ToFloat64(s.outcomes.WithLabelValues(deliveryFailed)); n != 2 {
				t.Fatalf("%v failed deliveries counted, want 2", n)
			}
			if n := len(e.logs.Lines("notification undeliverable")); n != 0 {
				t.Fatalf("%d undeliverable lines, want none", n)
			}
		})
	}
}

// The runbook's statements (docs/operations.md, NotificationsUndeliverable) send undeliverable
// notifications again: those of an order, each of its kinds, to the address it gives; those of
// a customer, all its orders', to the address it gives; and the rest as they are. Each is
// pending again, due at once, its last error cleared and its attempts kept, and leased and sent
// (or refused again) as any other.
func TestUndeliverableNotificationsAreSentAgainPerTheRunbook(t *testing.T) {
	t.Parallel()
	e := newSenderEnv(t)
	order := uuid.New()
	byOrder := []uuid.UUID{e.pendingFor(t, order, "c-1", KindOrderConfirmation), e.pendingFor(t, order, "c-1", KindInvoice)}
	byCustomer := []uuid.UUID{e.pendingFor(t, uuid.New(), "c-2", KindOrderConfirmation), e.pendingFor(t, uuid.New(), "c-2", KindOrderCancelled)}
	asIs := e.pendingFor(t, uuid.New(), "c-3", KindOrderConfirmation)
	all := append(append(slices.Clone(byOrder), byCustomer...), asIs)
	for _, c := range []string{"c-1", "c-2", "c-3"} {
		e.smtp.Refuse(c + "@customers.example")
	}
	s := e.sender(t, "sender-a", e.mailer(t))
	for range all {
		if o := await(t, start(s)); o.delivered || o.err != nil {
			t.Fatalf("%+v, want the refusal recorded", o)
		}
	}
	for _, id := range all {
		if r := e.row(t, id); r.Status != StatusUndeliverable || r.Attempts != 1 {
			t.Fatalf("row = %+v, want undeliverable after 1 attempt", r)
		}
	}
	stmts := runbookStatements(t)
	sendAgain := func(what, stmt string, ids []uuid.UUID, address string, sent bool) {
		t.Helper()
		if err := e.db.DB.Exec(stmt).Error; err != nil {
			t.Fatalf("the runbook's statement for %s: %v", what, err)
		}
		for _, id := range ids {
			if r := e.row(t, id); r.Status != StatusPending || r.LastError != nil || r.Attempts != 1 || r.NextAttemptAt.After(e.clock(t)) {
				t.Fatalf("%s: row = %+v (last error %s), want pending, due now, its last error cleared, its attempt kept", what, r, lastError(r))
			}
		}
		for range ids {
			if o := await(t, start(s)); o.delivered != sent || o.err != nil {
				t.Fatalf("%s: %+v, want sent %v", what, o, sent)
			}
		}
		for _, id := range ids {
			r := e.row(t, id)
			if sent && (r.Status != StatusSent || r.Recipient != address) || !sent && (r.Status != StatusUndeliverable || r.Attempts != 2) {
				t.Fatalf("%s: row = %+v, want sent (%v) to %s after its second attempt", what, r, sent, address)
			}
		}
	}
	sendAgain("an order", runbookValue("recipient", runbookValue("order_id", stmts[0], order.String()), "ann@example.org"), byOrder, "ann@example.org", true)
	sendAgain("a customer", runbookValue("recipient", runbookValue("customer_id", stmts[1], "c-2"), "bob@example.org"), byCustomer, "bob@example.org", true)
	sendAgain("the rest", stmts[2], []uuid.UUID{asIs}, "c-3@customers.example", false)
	var to []string
	for _, m := range e.smtp.Mail() {
		to = append(to, m.To)
	}
	slices.Sort(to)
	if want := []string{"ann@example.org", "ann@example.org", "bob@example.org", "bob@example.org"}; !slices.Equal(to, want) {
		t.Fatalf("e-mails to %q, want %q", to, want)
	}
	for _, id := range append(byOrder, byCustomer...) {
		if r := e.row(t, id); r.Status != StatusSent {
			t.Fatalf("status %q after the statement for the rest, want it left sent", r.Status)
		}
	}
}

// pendingFor inserts a pending notification of kind for customer's order, due now, to the
// address its customer id gives.
func (e *senderEnv) pendingFor(t *testing.T, order uuid.UUID, customer, kind string) uuid.UUID {
	t.Helper()
	id := uuid.Must(uuid.NewV7())
	if err := e.db.DB.Exec(`INSERT INTO notifications (id, order_id, customer_id, kind, recipient, subject, body, message_id)
VALUES (?, ?, ?, ?, ?, 'Your order', 'Thank you.', ?)`, id, order, customer, kind, customer+"@customers.example", uuid.New()).Error; err != nil {
		t.Fatal(err)
	}
	return id
}

// lastError is n's last error, for a message.
func lastError(n Notification) string {
	if n.LastError == nil {
		return "none"
	}
	return fmt.Sprintf("%q", *n.LastError)
}

// runbookStatements are the three UPDATEs of docs/operations.md that send undeliverable
// notifications again, as written there: an order's and a customer's, each with its example id
// and address, and the rest.
func runbookStatements(t *testing.T) []string {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, m := range regexp.MustCompile(`(?s)"(UPDATE notifications SET [^"]*status = 'undeliverable'[^"]*)"`).FindAllStringSubmatch(string(doc), -1) {
		found = append(found, strings.Join(strings.Fields(m[1]), " "))
	}
	if len(found) != 3 || !strings.Contains(found[0], "WHERE order_id = ") || !strings.Contains(found[1], "WHERE customer_id = ") ||
		strings.Contains(found[2], "_id = ") {
		t.Fatalf("docs/operations.md: UPDATEs of undeliverable notifications %q, want three: by order_id, by customer_id, then the rest", found)
	}
	return found
}

// runbookValue is stmt with the example value of its column name replaced by value.
func runbookValue(name, stmt, value string) string {
	return regexp.MustCompile(`\b`+name+` = '[^']*'`).ReplaceAllLiteralString(stmt, name+" = '"+value+"'")
}
