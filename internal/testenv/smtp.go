package testenv

import (
	"io"
	"net"
	"net/mail"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/emersion/go-smtp"
)

// Mail is one message an SMTPServer received.
type Mail struct {
	From, To  string
	MessageID string
	Header    mail.Header
	Body      string
}

// SMTPServer is a real SMTP server on loopback that keeps what it receives.
type SMTPServer struct {
	Addr string
	t    testing.TB
	srv  *smtp.Server
	mu   sync.Mutex
	mail []Mail
	// refused are the recipients whose RCPT TO the server refuses.
	refused map[string]bool
	// perSession is the most messages a session takes (0: no limit, below 0: none); MAIL past
	// it gets 421.
	perSession int
	// acceptDelay is how long the server takes to answer a message it has accepted.
	acceptDelay time.Duration
	// hold, while set, keeps the answer to each message accepted until it is closed (see
	// HoldAnswers).
	hold chan struct{}
	// sessions counts the SMTP sessions (client connections) ever opened, open those not
	// closed yet.
	sessions, open atomic.Int64
}

// NewSMTPServer reserves a loopback address; Start begins serving on it, Stop ends it (so
// tests can take the mail server down and bring it back on the same address).
func NewSMTPServer(t testing.TB) *SMTPServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &SMTPServer{Addr: ln.Addr().String(), t: t}
	_ = ln.Close()
	t.Cleanup(s.Stop)
	return s
}

// Start serves SMTP on s.Addr.
func (s *SMTPServer) Start() {
	s.t.Helper()
	ln, err := net.Listen("tcp", s.Addr)
	if err != nil {
		s.t.Fatalf("listen on %s: %v", s.Addr, err)
	}
	srv := smtp.NewServer(smtp.BackendFunc(func(*smtp.Conn) (smtp.Session, error) {
		s.sessions.Add(1)
		s.open.Add(1)
		return &smtpSession{server: s}, nil
	}))
	srv.Domain = "localhost"
	srv.AllowInsecureAuth = true
	s.mu.Lock()
	s.srv = srv
	s.mu.Unlock()
	go func() { _ = srv.Serve(ln) }()
}

// Stop closes the server and every connection to it.
func (s *SMTPServer) Stop() {
	s.mu.Lock()
	srv := s.srv
	s.srv = nil
	s.mu.Unlock()
	if srv != nil {
		_ = srv.Close()
	}
}

// Mail returns what the server received so far.
func (s *SMTPServer) Mail() []Mail {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Mail(nil), s.mail...)
}

// Refuse makes the server refuse recipient at RCPT TO, permanently (550).
func (s *SMTPServer) Refuse(recipient string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.refused == nil {
		s.refused = map[string]bool{}
	}
	s.refused[recipient] = true
}

// AnswerLate makes the server keep each message it accepts, then take delay to say so (its 250
// after the final dot): a slow relay, whose accepted messages a client that gives up before the
// answer does not know it sent.
func (s *SMTPServer) AnswerLate(delay time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.acceptDelay = delay
}

// HoldAnswers makes the server keep each message it accepts and say nothing of it until
// release is called: a relay stalled after the final dot for as long as the test needs, not
// for a fixed time a loaded machine may outlast. Messages accepted after release are answered
// as before. release is also called at cleanup.
func (s *SMTPServer) HoldAnswers() (release func()) {
	hold := make(chan struct{})
	s.mu.Lock()
	s.hold = hold
	s.mu.Unlock()
	var once sync.Once
	release = func() {
		once.Do(func() {
			s.mu.Lock()
			if s.hold == hold {
				s.hold = nil
			}
			s.mu.Unlock()
			close(hold)
		})
	}
	s.t.Cleanup(release)
	return release
}

// LimitPerSession makes the server take at most n messages in a session (none if n < 0), as
// Exim's smtp_accept_max_per_connection does: MAIL after them gets 421.
func (s *SMTPServer) LimitPerSession(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.perSession = n
}

// Sessions is how many SMTP sessions (client connections) the server has had.
func (s *SMTPServer) Sessions() int { return int(s.sessions.Load()) }

// OpenSessions is how many SMTP sessions are open now: those not yet closed by either side.
func (s *SMTPServer) OpenSessions() int { return int(s.open.Load()) }

type smtpSession struct {
	server   *SMTPServer
	from, to string
	messages int // taken in this session
}

// Reset is RSET, or the end of a message: the next one starts from nothing.
func (x *smtpSession) Reset() { x.from, x.to = "", "" }

// Logout is the end of the session, whoever closed it.
func (x *smtpSession) Logout() error {
	x.server.open.Add(-1)
	return nil
}

func (x *smtpSession) Mail(from string, _ *smtp.MailOptions) error {
	x.server.mu.Lock()
	limit := x.server.perSession
	x.server.mu.Unlock()
	if limit != 0 && x.messages >= limit {
		return &smtp.SMTPError{Code: 421, EnhancedCode: smtp.EnhancedCode{4, 7, 0}, Message: "too many messages in this session"}
	}
	x.from = from
	return nil
}

func (x *smtpSession) Rcpt(to string, _ *smtp.RcptOptions) error {
	x.server.mu.Lock()
	refused := x.server.refused[to]
	x.server.mu.Unlock()
	if refused {
		// Quoting the address, as Postfix does.
		return &smtp.SMTPError{Code: 550, EnhancedCode: smtp.EnhancedCode{5, 1, 1}, Message: "<" + to + ">: Recipient address rejected: mailbox unavailable"}
	}
	x.to = to
	return nil
}
func (x *smtpSession) Data(r io.Reader) error {
	m, err := mail.ReadMessage(r)
	if err != nil {
		return err
	}
	body, err := io.ReadAll(m.Body)
	if err != nil {
		return err
	}
	x.server.mu.Lock()
	x.messages++
	x.server.mail = append(x.server.mail, Mail{From: x.from, To: x.to, MessageID: m.Header.Get("Message-Id"), Header: m.Header, Body: string(body)})
	delay, hold := x.server.acceptDelay, x.server.hold
	x.server.mu.Unlock()
	time.Sleep(delay) // the slow relay's own pace, not a wait for anything
	if hold != nil {
		<-hold
	}
	return nil
}
