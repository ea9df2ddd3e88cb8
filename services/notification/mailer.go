package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"mime"
	"mime/quotedprintable"
	"net"
	"net/netip"
	"net/smtp"
	"net/textproto"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"
)

// logDeliverer "delivers" to the log, when no mail server is configured.
type logDeliverer struct{ log *slog.Logger }

func (d logDeliverer) Deliver(ctx context.Context, n Notification) error {
	// Not the recipient, an e-mail address (personal data): the notification id leads to it.
	d.log.InfoContext(ctx, "notification delivered to the log (no SMTP_ADDR set)", "notification_id", n.ID, "order_id", n.OrderID,
		"subject", n.Subject)
	return nil
}

// DefaultSMTPConns is how many connections a sender opens to the SMTP server at most, unless
// SMTP_MAX_CONNS says.
const DefaultSMTPConns = 8

// smtpIdleTimeout is how long an SMTP connection may wait unused before it is closed: well
// below the 5 minutes RFC 5321 asks servers to wait for a command, and not so long that a
// quiet sender holds the server's connections for nothing.
const smtpIdleTimeout = 30 * time.Second

// smtpDeliverer sends e-mail through a plain SMTP relay (Mailpit in docker compose), over at
// most maxConns connections kept open between deliveries. Each connection has a goroutine of
// its own (a pump) that takes the next waiting delivery the moment it has finished the last:
// the connection does not idle while deliveries wait. (Handed from one delivery's goroutine to
// the next, it idled between e-mails for about 40 % of the time an e-mail took.) A delivery
// that finds no delivery waiting ahead of it goes to the pump freed most recently, whose
// connection is the likeliest to be open; the others stay unused, and close once idle for
// idleTimeout. A pump is started only when none is free, so no more connections are open than
// deliveries needed at once. A connection that failed in any way is closed, never used again;
// a pump whose connection was closed dials anew for its next delivery. A pump the server
// refuses a session while another is open holds off (see holdOff): the deliveries flow to the
// pumps that have one.
type smtpDeliverer struct {
	addr, from  string
	helo        string // what EHLO says (SMTP_HELO_NAME); "" for the connection's address literal
	idleTimeout time.Duration
	dialTimeout time.Duration // how long opening a session may take at most (see dial)
	maxConns    int
	closing     chan struct{} // closed by Close

	mu      sync.Mutex
	longest longestRecent // of the recent conversations
	free    []*smtpPump   // the most recently freed last
	waiting []*smtpJob    // for a pump, the oldest first
	pumps   int
	closed  bool
	stopped sync.WaitGroup // the pumps
	// sessions: the connections past their greeting and EHLO, open now; dialing: those being
	// opened. sessionEnded is closed, and replaced, as a session closes, and dialed as an
	// opening ends, either way.
	sessions, dialing    int
	sessionEnded, dialed chan struct{}
}

// smtpPump is one connection's goroutine; a delivery is handed to it in next.
type smtpPump struct {
	next chan *smtpJob // one at most: a pump is handed a delivery only while free
}

// smtpJob is one delivery on its way to a pump, and where its outcome goes.
type smtpJob struct {
	ctx    context.Context
	n      Notification
	done   chan error
	budget time.Duration // the delivery's whole budget (see withBudget); 0 if ctx has no deadline
}

// budgetKey carries a delivery's whole budget, of which its context's deadline may leave only
// a part: a leased notification that waited in line for a worker.
type budgetKey struct{}

// withBudget says that ctx's deadline ends a budget of d: a delivery with less of it left than
// a conversation may take is not begun (see timeToConverse). Without it, the budget is what
// ctx has left when the delivery is asked for.
func withBudget(ctx context.Context, d time.Duration) context.Context {
	return context.WithValue(ctx, budgetKey{}, d)
}

// smtpConn is one connection to the server, past its greeting and EHLO.
type smtpConn struct {
	conn   net.Conn
	client *smtp.Client
	// pipelining: the server takes a message's commands in one write (RFC 2920, PIPELINING),
	// so a message costs two round trips instead of five. eightBit: it takes 8-bit bodies
	// (8BITMIME), so a body may go as it is (see composeEmail). utf8: it
	// takes UTF-8 addresses (SMTPUTF8, RFC 6531), which a customer's may be; without it, the
	// addresses go as asciiAddress writes them (see send).
	pipelining, eightBit, utf8 bool
	// used: a message went over it already, so the next begins with RSET. broken: a
	// conversation on it failed or was cut short, so it is closed, never reused.
	used, broken bool
	idleSince    time.Time
	// d is the deliverer whose session count this connection is in, until it closes.
	d *smtpDeliverer
}

func newSMTPDeliverer(addr, from string, maxConns int) *smtpDeliverer {
	return &smtpDeliverer{addr: addr, from: from, idleTimeout: smtpIdleTimeout, dialTimeout: smtpDialTimeout,
		maxConns: max(maxConns, 1), closing: make(chan struct{}), sessionEnded: make(chan struct{}), dialed: make(chan struct{})}
}

// errNotStarted marks a delivery for which no SMTP conversation began: out of time while it
// waited for a connection, or the deliverer closed. Not the notification's failure, and nothing
// was sent.
var errNotStarted = errors.New("no SMTP conversation began")

// errClosed is why a delivery after Close, or waiting for a connection when it came, was not
// started.
var errClosed = errors.New("the deliverer is closed")

// Deliver sends one e-mail whose Message-ID is derived from the notification id, so the
// receiving side can drop a repeat.
func (d *smtpDeliverer) Deliver(ctx context.Context, n Notification) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("smtp: %w: %w", errNotStarted, err)
	}
	job := &smtpJob{ctx: ctx, n: n, done: make(chan error, 1)}
	if deadline, ok := ctx.Deadline(); ok {
		job.budget = time.Until(deadline)
		if whole, ok := ctx.Value(budgetKey{}).(time.Duration); ok {
			job.budget = whole
		}
	}
	if err := d.hand(job); err != nil {
		return err
	}
	select {
	case err := <-job.done:
		return err
	case <-ctx.Done():
		if d.withdraw(job) {
			return fmt.Errorf("smtp: waiting for a connection: %w: %w", errNotStarted, ctx.Err())
		}
		// A pump has it, or Close answered it: a conversation ends with ctx, and the pump
		// answers then.
		return <-job.done
	}
}

// hand gives job to the pump freed most recently, or to a new one while fewer than maxConns
// run, or else queues it for the first pump to finish.
func (d *smtpDeliverer) hand(job *smtpJob) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.closed:
		return fmt.Errorf("smtp: %w: %w", errNotStarted, errClosed)
	case len(d.free) > 0:
		p := d.free[len(d.free)-1]
		d.free = d.free[:len(d.free)-1]
		p.next <- job
	case d.pumps < d.maxConns:
		d.pumps++
		p := &smtpPump{next: make(chan *smtpJob, 1)}
		p.next <- job
		d.stopped.Add(1)
		go d.pump(p)
	default:
		d.waiting = append(d.waiting, job)
	}
	return nil
}

// withdraw takes job out of the queue, if no pump has taken it yet, and says whether it did.
func (d *smtpDeliverer) withdraw(job *smtpJob) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for i, j := range d.waiting {
		if j == job {
			d.waiting = slices.Delete(d.waiting, i, i+1)
			return true
		}
	}
	return false
}

// pump is one connection's life: it delivers what it is handed, then each delivery waiting,
// oldest first; it closes its connection after idleTimeout without a delivery, and says QUIT
// at Close.
func (d *smtpDeliverer) pump(p *smtpPump) {
	defer d.stopped.Done()
	var c *smtpConn
	var wait time.Duration // how long the pump holds off after a session refused, 0 when none was
	idle := time.NewTimer(d.idleTimeout)
	defer idle.Stop()
	for {
		select {
		case job := <-p.next:
			for job != nil {
				var err error
				c, err = d.deliver(c, job)
				if c != nil {
					wait = 0
				}
				if errors.Is(err, errNoMoreSessions) {
					// Not started, released; and this pump takes no other delivery until it has
					// held off, leaving them to the pumps that have a session.
					job.done <- err
					wait = min(max(2*wait, smtpHoldOff), smtpMaxHoldOff)
					d.holdOff(wait)
					job = d.nextFor(p)
					continue
				}
				next := d.nextFor(p)
				// Answered once the pump is free or busy with the next: a caller that delivers
				// again at once finds this pump rather than starting another.
				job.done <- err
				job = next
			}
			idle.Reset(d.idleTimeout)
		case <-idle.C:
			// QUIT before the next delivery can dial: never more than maxConns open. A
			// delivery handed over meanwhile waits a second at most.
			if c != nil {
				c.quit()
				c = nil
			}
		case <-d.closing:
			// A delivery handed over as Close came, and not taken yet, is not started (one
			// taken meanwhile is refused by deliver).
			select {
			case job := <-p.next:
				job.done <- fmt.Errorf("smtp: %w: %w", errNotStarted, errClosed)
			default:
			}
			if c != nil {
				c.quit()
			}
			return
		}
	}
}

// nextFor returns the oldest waiting delivery for p, or, if none waits, puts p back among the
// free pumps and returns nil.
func (d *smtpDeliverer) nextFor(p *smtpPump) *smtpJob {
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.waiting) > 0 {
		job := d.waiting[0]
		d.waiting[0] = nil
		d.waiting = d.waiting[1:]
		return job
	}
	if !d.closed {
		d.free = append(d.free, p)
	}
	return nil
}

// deliver sends job's e-mail on c, or on a new connection if c is nil, idled too long or turns
// out stale, and returns the connection to keep (nil once it failed) and the outcome.
func (d *smtpDeliverer) deliver(c *smtpConn, job *smtpJob) (*smtpConn, error) {
	if c != nil && time.Since(c.idleSince) >= d.idleTimeout {
		c.close() // at once, without QUIT: the delivery is not kept waiting for it
		c = nil
	}
	start := time.Now()
	for {
		if err := d.mayBegin(job); err != nil {
			return c, err
		}
		if c == nil {
			var err error
			if c, err = d.dial(job.ctx, job.budget); err != nil {
				return nil, err
			}
			// The dial took its time: the shutdown may have begun, or the budget run low.
			if err := d.mayBegin(job); err != nil {
				return c, err
			}
		}
		// The server accepted the message if send says so, even if the connection broke just
		// after.
		err := c.send(job.ctx, d.from, job.n)
		// A conversation cut short took at least this long: it counts too, or a server that
		// turned slow past the budgets would never be waited for.
		d.conversed(start)
		if !c.broken {
			c.idleSince = time.Now()
			return c, err
		}
		c.close()
		c = nil
		// A reused connection opens with RSET, and one the server (or the network) dropped
		// while it idled fails there, before any message was entrusted to it: it is replaced
		// rather than failing the delivery, if the delivery may still begin on another.
		if !errors.Is(err, errStale) {
			return nil, err
		}
	}
}

// mayBegin says whether job may begin a conversation now, wrapping errNotStarted if not: its
// delivery may have been handed over as its deadline passed (an RSET then would fail and close
// a healthy idle connection for nothing), or just as Close came (a conversation begun now
// would run into a shutdown's grace), or it has too little time left (timeToConverse). A
// delivery whose stale connection was just replaced is asked again: nothing of it was tried.
func (d *smtpDeliverer) mayBegin(job *smtpJob) error {
	if err := job.ctx.Err(); err != nil {
		return fmt.Errorf("smtp: %w: %w", errNotStarted, err)
	}
	select {
	case <-d.closing:
		return fmt.Errorf("smtp: %w: %w", errNotStarted, errClosed)
	default:
	}
	return d.timeToConverse(job)
}

// conversed records a conversation begun at start and over now.
func (d *smtpDeliverer) conversed(start time.Time) {
	now := time.Now()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.longest.add(now, now.Sub(start))
}

// conversationMargin is how many times the longest recent conversation a delivery must have
// left of its budget to begin one.
const conversationMargin = 2

// timeToConverse says whether job has time left to begin a conversation: a message cut off by
// the deadline after its final dot may have been accepted, and would be sent again. It needs
// conversationMargin times the longest recent conversation, but never more than half its whole
// budget: a delivery asked for with its whole budget always begins (else, against a server
// slower than that, every delivery would be released and leased again at once, in a loop).
// Before the deliverer's first conversation nothing is known of the server, and it needs that
// half: no conversation says one would be quick. One with less, as a notification that waited
// in line, is not started then, and is released to be tried again with a budget of its own:
// half of what it has left would let it begin a conversation it has no time to finish, and the
// e-mail, taken by the server, would go again.
func (d *smtpDeliverer) timeToConverse(job *smtpJob) error {
	deadline, ok := job.ctx.Deadline()
	if !ok {
		return nil
	}
	need := job.budget / 2
	d.mu.Lock()
	if d.longest.known() {
		need = min(conversationMargin*d.longest.at(), need)
	}
	d.mu.Unlock()
	if left := time.Until(deadline); left < need {
		return fmt.Errorf("smtp: %w: %s of its budget left, a conversation may take %s", errNotStarted,
			left.Round(time.Millisecond), need.Round(time.Millisecond))
	}
	return nil
}

// longestHalfLife is how fast a long conversation is forgotten, in time spent conversing since:
// a server slow for a while holds back deliveries short of time until about as long has been
// spent on quicker conversations, not for good (its deliveries with their whole budget begin).
const longestHalfLife = 10 * time.Second

// longestRecent is the longest recent conversation, halved every longestHalfLife of
// conversation since: the time from one conversation's end to the next one's counts for no more
// than the next one lasted. Time without a conversation forgets nothing: a server unheard from
// is no quicker for it, and a delivery that waited while the connections idled (a notification
// in line behind a worker whose mark waited out a database failover) would begin with too little
// time left, to be cut off after the server took its message.
type longestRecent struct {
	took  time.Duration
	since time.Duration // conversation time since it ended
	last  time.Time     // when the newest conversation ended; the zero time before any
}

func (l *longestRecent) at() time.Duration {
	return time.Duration(float64(l.took) * math.Exp2(-float64(l.since)/float64(longestHalfLife)))
}

// known says whether any conversation was recorded.
func (l *longestRecent) known() bool { return !l.last.IsZero() }

// add records a conversation that took took and ended at now. Conversations on several
// connections end out of order: one recorded after a later one adds no time.
func (l *longestRecent) add(now time.Time, took time.Duration) {
	if l.known() {
		l.since += max(min(now.Sub(l.last), took), 0)
	}
	if now.After(l.last) {
		l.last = now
	}
	if took >= l.at() {
		l.took, l.since = took, 0
	}
}

// closeOnShutdown closes d when ctx ends, so that no conversation begins during a shutdown's
// grace: one begun then is cut off at the grace's end, maybe after the server took the
// message, and sent again after the restart. The deliveries waiting for a connection are
// released at once; those under way finish within the grace.
func (d *smtpDeliverer) closeOnShutdown(ctx context.Context) {
	context.AfterFunc(ctx, d.Close)
}

// Close says QUIT to the idle connections, and to those in use once their delivery is done;
// deliveries waiting for a connection are not started. It waits two seconds at most: an idle
// connection's QUIT takes one at most, and a delivery in progress has its own deadline.
func (d *smtpDeliverer) Close() {
	d.mu.Lock()
	if !d.closed {
		d.closed = true
		close(d.closing)
		for _, job := range d.waiting {
			job.done <- fmt.Errorf("smtp: waiting for a connection: %w: %w", errNotStarted, errClosed)
		}
		d.waiting = nil
	}
	d.mu.Unlock()
	// Every call waits, not only the first: the process's last Close, after the one at the
	// start of its shutdown, must not return before the QUITs are said.
	stopped := make(chan struct{})
	go func() {
		d.stopped.Wait()
		close(stopped)
	}()
	t := time.NewTimer(2 * time.Second)
	defer t.Stop()
	select {
	case <-stopped:
	case <-t.C:
	}
}

// errUnreachable marks a delivery that opened no session with the server while no other
// session of the deliverer was open: the dial failed, or the greeting or the answer to EHLO
// was a refusal (421 or 5xx) or did not come within the dial's bound. Nothing of the message
// was tried; the server is away, or refuses this client, not the message.
var errUnreachable = errors.New("mail server unreachable")

// errNoMoreSessions marks a delivery that opened no session while another of the deliverer's
// sessions was open: the server is there, but takes no more sessions from this client (a
// limit of connections per client answers 421). It wraps errNotStarted too; its pump holds
// off (holdOff), so that the deliveries go to the sessions open.
var errNoMoreSessions = errors.New("the mail server opened no more sessions")

// smtpDialTimeout bounds the opening of a session, connection, greeting and EHLO: a server
// that has not answered by then is away. A delivery gives it half its budget at most.
const smtpDialTimeout = 10 * time.Second

// smtpHoldOff is how long a pump refused a session holds off first, doubling at each refusal
// up to smtpMaxHoldOff: a server full up is not dialled in a loop.
const smtpHoldOff, smtpMaxHoldOff = time.Second, 30 * time.Second

// holdOff waits wait, or until one of the deliverer's sessions closes (the server may take
// another then), or Close.
func (d *smtpDeliverer) holdOff(wait time.Duration) {
	d.mu.Lock()
	ended := d.sessionEnded
	d.mu.Unlock()
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ended:
	case <-d.closing:
	}
}

// Probe says whether a delivery could begin a conversation now: yes if a session of the
// deliverer is open (no connection beyond it is dialled, which a server at its limit of
// connections per client would refuse); else it opens one and ends it, within ctx and
// dialTimeout. Any failure is errUnreachable, as is finding maxConns being opened already; but
// a refusal because a delivery opened a session meanwhile is the server there.
func (d *smtpDeliverer) Probe(ctx context.Context) error {
	d.mu.Lock()
	sessions, dialing := d.sessions, d.dialing
	d.mu.Unlock()
	if sessions > 0 {
		return nil
	}
	if dialing >= d.maxConns {
		return fmt.Errorf("%w: all %d connections are being opened", errUnreachable, d.maxConns)
	}
	// The bound a delivery's dial has, within ctx: a server slow to greet, which deliveries
	// wait for, must not fail every probe. A probe that ran out of ctx found no server either.
	c, err := d.dial(ctx, 0)
	switch {
	case errors.Is(err, errNoMoreSessions):
		return nil // a delivery opened a session meanwhile: the server is there
	case err != nil && !errors.Is(err, errUnreachable):
		return fmt.Errorf("%w: %w", errUnreachable, err)
	case err != nil:
		return err
	}
	c.quit()
	return nil
}

// dial opens a session: a connection, its greeting and EHLO (HELO, to a server that refuses
// it), within dialTimeout and half of budget, a delivery's whole budget (0 for none). It fails
// with errNotStarted if ctx ended first, the delivery's time, not the server's: one that
// waited in line may have had too little left. Otherwise with errNoMoreSessions while
// another session of d is open, once the others being opened have ended, and else with
// errUnreachable.
func (d *smtpDeliverer) dial(ctx context.Context, budget time.Duration) (*smtpConn, error) {
	bound := d.dialTimeout
	if budget > 0 {
		bound = min(bound, budget/2)
	}
	dialCtx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	d.mu.Lock()
	d.dialing++
	d.mu.Unlock()
	c, err := d.open(dialCtx)
	d.mu.Lock()
	d.dialing--
	close(d.dialed)
	d.dialed = make(chan struct{})
	if err == nil {
		d.sessions++
		c.d = d
	}
	for err != nil && d.sessions == 0 && d.dialing > 0 && ctx.Err() == nil {
		dialed := d.dialed
		d.mu.Unlock()
		select {
		case <-dialed:
		case <-ctx.Done():
		}
		d.mu.Lock()
	}
	others := d.sessions
	d.mu.Unlock()
	// The deadline may cut the connection before ctx reports it ended.
	deadline, hasDeadline := ctx.Deadline()
	switch {
	case err == nil:
		return c, nil
	case ctx.Err() != nil || hasDeadline && !time.Now().Before(deadline):
		return nil, fmt.Errorf("smtp: %w: opening a session: %w", errNotStarted, err)
	case others > 0:
		return nil, fmt.Errorf("smtp: %w: %w: %w", errNotStarted, errNoMoreSessions, err)
	default:
		return nil, fmt.Errorf("%w: %w", errUnreachable, err)
	}
}

// open connects and says EHLO (HELO, to a server that refuses it), within ctx.
func (d *smtpDeliverer) open(ctx context.Context) (*smtpConn, error) {
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", d.addr)
	if err != nil {
		return nil, fmt.Errorf("smtp dial %s: %w", d.addr, err)
	}
	c := &smtpConn{conn: conn}
	name := d.helo
	if name == "" {
		if name, err = heloName(conn.LocalAddr()); err != nil {
			_ = conn.Close()
			return nil, err
		}
	}
	host, _, _ := net.SplitHostPort(d.addr)
	err = c.during(ctx, func() error {
		client, err := smtp.NewClient(conn, host)
		if err != nil {
			return fmt.Errorf("smtp greeting: %w", err)
		}
		c.client = client
		if err := client.Hello(name); err != nil {
			return fmt.Errorf("smtp hello: %w", err)
		}
		// Hello said EHLO; its reply listed the extensions.
		c.pipelining, _ = client.Extension("PIPELINING")
		c.eightBit, _ = client.Extension("8BITMIME")
		c.utf8, _ = client.Extension("SMTPUTF8")
		return nil
	})
	if c.broken {
		c.close()
		return nil, errors.Join(err, ctx.Err())
	}
	// Idle from now: a delivery that may not begin after the dial leaves it to its pump.
	c.idleSince = time.Now()
	return c, nil
}

// heloName is what EHLO says unless SMTP_HELO_NAME says otherwise: the address literal of
// local, the connection's own end (RFC 5321 4.1.3), "[192.0.2.7]" or "[IPv6:2001:db8::1]". A
// bare name such as the service's is neither a domain nor a literal (4.1.1.1), which relays
// refuse (Postfix's reject_non_fqdn_helo_hostname); the address needs no configuration, and is
// the one the server sees unless a NAT stands between them.
func heloName(local net.Addr) (string, error) {
	ap, err := netip.ParseAddrPort(local.String())
	if err != nil {
		return "", fmt.Errorf("smtp: local address %q: %w", local, err)
	}
	// A zone means nothing to the server. (An IPv4 peer of a dual-stack socket is IPv4
	// already: net.IP prints such an address dotted.)
	ip := ap.Addr().WithZone("")
	if ip.Is4() {
		return "[" + ip.String() + "]", nil
	}
	return "[IPv6:" + ip.String() + "]", nil
}

// validHeloName says whether name can follow EHLO (RFC 5321 4.1.1.1, 4.1.3): "" (the address
// literal of the connection), a fully qualified domain name of letters, digits and hyphens
// whose last label is not all digits (an address without its brackets is none: RFC 3696 2),
// or an address literal, its "IPv6:" tag in any case (RFC 5234 2.3).
func validHeloName(name string) bool {
	if name == "" {
		return true
	}
	if literal, ok := strings.CutPrefix(name, "["); ok {
		literal, ok = strings.CutSuffix(literal, "]")
		const tag = "IPv6:"
		if len(literal) > len(tag) && strings.EqualFold(literal[:len(tag)], tag) {
			ip, err := netip.ParseAddr(literal[len(tag):])
			return ok && err == nil && ip.Is6() && ip.Zone() == ""
		}
		ip, err := netip.ParseAddr(literal)
		return ok && err == nil && ip.Is4()
	}
	labels := strings.Split(name, ".")
	last := labels[len(labels)-1]
	return len(name) <= 253 && len(labels) > 1 && !slices.ContainsFunc(labels, func(l string) bool { return !ldhLabel(l) }) &&
		strings.Trim(last, "0123456789") != ""
}

// during runs fn, a conversation on the connection, within ctx: its deadline, and its
// cancellation (shutdown past its grace), which must interrupt a stalled server too. A
// connection whose conversation ctx cut short is broken, whatever fn returned.
func (c *smtpConn) during(ctx context.Context, fn func() error) error {
	deadline, _ := ctx.Deadline() // the zero time, none, if ctx has none
	if err := c.conn.SetDeadline(deadline); err != nil {
		c.broken = true
		return fmt.Errorf("smtp: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { _ = c.conn.SetDeadline(time.Now()) })
	err := fn()
	if !stop() || err != nil {
		c.broken = true
	}
	return err
}

// errStale marks a reused connection that no longer takes messages, before any of the message
// was entrusted to it: its opening RSET failed (the server or the network dropped it while it
// idled), or the server answered 421 (it is closing the session).
var errStale = errors.New("reused SMTP connection no longer takes messages")

// send sends one message in the session: RSET if the connection was used before, MAIL, RCPT
// and DATA, then the message. Where the server pipelines, the commands up to DATA go in one
// write and their replies are read after it. A failure once the conversation began breaks the
// connection: a server that refused a command may be in any state.
func (c *smtpConn) send(ctx context.Context, from string, n Notification) error {
	// Before any command: a message refused here leaves the connection as it was.
	if !c.utf8 {
		// A server without SMTPUTF8 takes only ASCII, in the envelope and the headers alike: a
		// customer's address may be UTF-8 (SMTP_FROM was checked at start).
		var err error
		if from, err = asciiAddress(from); err != nil {
			return fmt.Errorf("smtp: sender: %w", err)
		}
		// Not the recipient itself: the error reaches the log, which keeps no customer's address.
		if n.Recipient, err = asciiAddress(n.Recipient); err != nil {
			return fmt.Errorf("smtp: recipient: %w", err)
		}
	}
	msg, err := composeEmail(from, n, c.eightBit)
	if err != nil {
		return err
	}
	params := ""
	if c.eightBit {
		params += " BODY=8BITMIME"
	}
	if c.utf8 {
		params += " SMTPUTF8"
	}
	cmds := make([]smtpCommand, 0, 4)
	reused := c.used
	if reused {
		cmds = append(cmds, smtpCommand{"RSET", 250, "rset"})
	}
	cmds = append(cmds,
		smtpCommand{"MAIL FROM:<" + from + ">" + params, 250, "mail from"},
		smtpCommand{"RCPT TO:<" + n.Recipient + ">", 25, "rcpt to"},
		smtpCommand{"DATA", 354, "data"})
	c.used = true
	return c.during(ctx, func() error {
		if err := c.converse(cmds, reused); err != nil {
			return err
		}
		w := c.client.Text.DotWriter()
		if _, err := w.Write(msg); err != nil {
			return fmt.Errorf("smtp write: %w", err)
		}
		if err := w.Close(); err != nil {
			return fmt.Errorf("smtp write: %w", err)
		}
		if _, _, err := c.client.Text.ReadResponse(250); err != nil {
			return fmt.Errorf("smtp end of data: %w", err)
		}
		return nil
	})
}

// errRecipientRefused marks a delivery whose recipient the mail server refuses for good: it
// answered RCPT TO with a 5yz whose enhanced status code says the recipient's address is bad
// (refusesRecipient). The same address would be refused at every retry: the sender makes the
// notification undeliverable. Any other refusal is retried, a 5yz included: a relay's
// configuration (relaying denied, authentication required, the sender's address refused)
// refuses every recipient alike, until it is fixed.
var errRecipientRefused = errors.New("the mail server refuses the recipient's address for good")

// recipientAddressStatus are the details y of the enhanced status codes 5.1.y (RFC 3463 3.2,
// RFC 7505 4) that say the recipient's address is bad: 1 no such mailbox, 3 bad syntax, 4
// ambiguous, 6 moved with no forwarding address, 10 a domain that takes no mail (null MX). Not
// the others of the class: 0 (other address status, which Postfix gives a sender's address it
// does not know), 5 and 9 (no failure), 7 and 8 (the sender's address, which Postfix refuses in
// its reply to RCPT TO): each may refuse every recipient alike; nor 2 (no such system), which
// Postfix with unknown_address_reject_code = 550 also gives when the lookup of the domain fails
// (NXDOMAIN, a malformed reply): a DNS glitch at the relay, retried.
var recipientAddressStatus = map[string]bool{"1": true, "3": true, "4": true, "6": true, "10": true}

// enhancedCode is an enhanced status code (RFC 3463 2) at the start of a reply's line: its
// class, subject and detail.
var enhancedCode = regexp.MustCompile(`^([245])\.([0-9]{1,3})\.([0-9]{1,3})(?: |$)`)

// refusesRecipient says whether reply, the server's to RCPT TO, refuses the recipient's address
// for good: a 5yz whose enhanced status code is 5.1.y, y one of recipientAddressStatus. The code
// is the first that begins a line of the reply (RFC 2034 puts it on each; some servers on the
// last alone). A reply without one says too little to give up on.
func refusesRecipient(reply *textproto.Error) bool {
	if reply.Code/100 != 5 {
		return false
	}
	for line := range strings.SplitSeq(reply.Msg, "\n") {
		if c := enhancedCode.FindStringSubmatch(line); c != nil {
			return c[1] == "5" && c[2] == "1" && recipientAddressStatus[c[3]]
		}
	}
	return false
}

// smtpCommand is one command of a message's conversation and the reply code it expects.
type smtpCommand struct {
	line   string
	expect int
	name   string // for errors
}

// converse sends cmds and reads their replies: all in one write where the server pipelines,
// else one after another. Every reply sent for is read, so the conversation stays in step; the
// first failure is returned. A group that opens with RSET and fails there, writing it (the
// server reset the idle connection) or at its reply (closed it), is errStale: nothing of the
// message counts before the server's 250 to RSET. So is a 421 on a reused connection (a server
// that takes so many messages a session, as Exim can): the server is closing that session, not
// refusing the message. A refusal of RCPT that refusesRecipient reads as the recipient's bad
// address is errRecipientRefused. A server that refused MAIL or RCPT yet answered DATA with
// 354 waits for a message; the connection is closed instead, which ends it unaccepted.
func (c *smtpConn) converse(cmds []smtpCommand, reused bool) error {
	t := c.client.Text
	for len(cmds) > 0 {
		group := cmds[:1]
		if c.pipelining {
			group = cmds
		}
		cmds = cmds[len(group):]
		failed := func(cmd smtpCommand, err error) error {
			var reply *textproto.Error
			isReply := errors.As(err, &reply)
			switch {
			case cmd.name == "rset" || reused && isReply && reply.Code == 421:
				return fmt.Errorf("smtp %s: %w: %w", cmd.name, errStale, err)
			case cmd.name == "rcpt to" && isReply && refusesRecipient(reply):
				return fmt.Errorf("smtp %s: %w: %w", cmd.name, errRecipientRefused, err)
			}
			return fmt.Errorf("smtp %s: %w", cmd.name, err)
		}
		for _, cmd := range group {
			if _, err := t.W.WriteString(cmd.line + "\r\n"); err != nil {
				return failed(group[0], err)
			}
		}
		if err := t.W.Flush(); err != nil {
			return failed(group[0], err)
		}
		var first error
		for _, cmd := range group {
			if _, _, err := t.ReadResponse(cmd.expect); err != nil && first == nil {
				first = failed(cmd, err)
			}
		}
		if first != nil {
			return first
		}
	}
	return nil
}

// quit ends a session politely, within a second: the server accepted every message sent on
// it already, whatever QUIT says.
func (c *smtpConn) quit() {
	_ = c.conn.SetDeadline(time.Now().Add(time.Second))
	_ = c.client.Quit()
	c.close()
}

// close drops the connection, and its session from its deliverer's count.
func (c *smtpConn) close() {
	_ = c.conn.Close()
	if c.d != nil {
		c.d.sessionClosed()
		c.d = nil
	}
}

// sessionClosed counts a session closed, and wakes the pumps held off.
func (d *smtpDeliverer) sessionClosed() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sessions--
	close(d.sessionEnded)
	d.sessionEnded = make(chan struct{})
}

// MessageIDDomain qualifies e-mail Message-IDs: <notification-id@MessageIDDomain>.
const MessageIDDomain = "notification.outbox-inbox"

// errNotAMailbox refuses an address that would reach a command or a header as more than a
// mailbox: a CR or LF would start a line of its own (another recipient, another header), and
// "<" or ">" would end the envelope's address early. Nothing of the e-mail is sent. It counts
// as a failed attempt like any other, and fails alike at each retry: the notification stays
// pending, retried at NOTIFY_MAX_BACKOFF for ever (docs/operations.md).
var errNotAMailbox = errors.New("not a plain mailbox (CR, LF, '<' or '>'); nothing was sent")

// composeEmail is n as an e-mail, or errNotAMailbox. Its body goes as it is (8bit) to a server
// that offers 8BITMIME, if it is 8-bit text as SMTP carries it (eightBitText); otherwise
// quoted-printable: an order confirmation's "×" is not 7-bit, and a strict relay refuses an
// 8-bit body it was not told of (554 5.6.1), every time. The subject is encoded (RFC 2047) if
// it has anything but printable ASCII: a line break in it then stays text, not a new header.
func composeEmail(from string, n Notification, eightBit bool) ([]byte, error) {
	if strings.ContainsAny(from, "\r\n<>") {
		return nil, fmt.Errorf("smtp: sender %q: %w", from, errNotAMailbox)
	}
	// Not the recipient itself: the error reaches the log, which keeps no customer's address.
	if strings.ContainsAny(n.Recipient, "\r\n<>") {
		return nil, fmt.Errorf("smtp: recipient: %w", errNotAMailbox)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "From: %s\r\n", from)
	fmt.Fprintf(&b, "To: %s\r\n", n.Recipient)
	fmt.Fprintf(&b, "Subject: %s\r\n", mime.QEncoding.Encode("utf-8", n.Subject))
	fmt.Fprintf(&b, "Message-ID: <%s@%s>\r\n", n.ID, MessageIDDomain)
	fmt.Fprintf(&b, "X-Notification-ID: %s\r\n", n.ID)
	fmt.Fprintf(&b, "X-Order-ID: %s\r\n", n.OrderID)
	fmt.Fprintf(&b, "Date: %s\r\n", time.Now().UTC().Format(time.RFC1123Z))
	b.WriteString("MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n")
	if eightBit && eightBitText(n.Body) {
		b.WriteString("Content-Transfer-Encoding: 8bit\r\n\r\n")
		b.WriteString(n.Body)
		return []byte(b.String()), nil
	}
	b.WriteString("Content-Transfer-Encoding: quoted-printable\r\n\r\n")
	w := quotedprintable.NewWriter(&b)
	// Writes to a strings.Builder do not fail.
	_, _ = w.Write([]byte(n.Body))
	_ = w.Close()
	return []byte(b.String()), nil
}

// maxLine is the most octets a line of a message may have before its CRLF (RFC 5322 2.1.1,
// RFC 5321 4.5.3.1.6).
const maxLine = 998

// eightBitText says whether body may go as it is: no line longer than maxLine, no NUL (which
// 8bit data never holds, RFC 6152), and no CR but
// in a CRLF (the dot-writer makes a bare LF CRLF, but passes a bare CR through, and does not
// dot-stuff a "." after it, which a server that ends lines at a bare CR would take for the end
// of the data). A body that is not goes quoted-printable, whose soft line breaks give back a
// long line whole; a bare CR, which text/plain carries in neither encoding, becomes the line
// break a reader would have seen.
func eightBitText(body string) bool {
	for line := range strings.SplitSeq(body, "\n") {
		line = strings.TrimSuffix(line, "\r")
		if len(line) > maxLine || strings.ContainsAny(line, "\r\x00") {
			return false
		}
	}
	return true
}
