// Package systest runs the three real service binaries on the local PostgreSQL and RabbitMQ,
// each system on its own databases and RabbitMQ vhost: the harness of the end-to-end tests and
// the benchmarks.
package systest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// Build compiles every service (each package under services/) into dir, with the race
// detector if race is set.
func Build(dir string, race bool) error {
	list, err := exec.Command("go", "list", "github.com/outboxkit/outbox-inbox/services/...").Output()
	if err != nil {
		return fmt.Errorf("list the services: %w", err)
	}
	for _, pkg := range strings.Fields(string(list)) {
		args := []string{"build", "-o", filepath.Join(dir, path.Base(pkg))}
		if race {
			args = append(args, "-race")
		}
		if out, err := exec.Command("go", append(args, pkg)...).CombinedOutput(); err != nil {
			return fmt.Errorf("build %s: %w\n%s", pkg, err, out)
		}
	}
	return nil
}

// Service is one running binary.
type Service struct {
	Name string
	URL  string // http://host:port
	DB   *testenv.Database
	Logs *testenv.Logs
	bin  string
	env  []string
	// conns is the DB_MAX_CONNS its share of the test's connection budget allows.
	conns int
	cmd   *exec.Cmd
	done  chan struct{}
	err   error
	// consumer says the service consumes a queue of events.Topology, and so exports
	// alreadyDoneMetric; the order service consumes none.
	consumer bool
	// alreadyDone carries consumer_already_done_total over the process's restarts.
	alreadyDone float64
	discardLogs bool
	// ended says the test ended the process's run (Kill, Terminate): an exit it did not ask
	// for is a failure, even with status 0.
	ended bool
}

// alreadyDoneMetric counts a consumer's messages whose work another message had done already.
const alreadyDoneMetric = "consumer_already_done_total"

// AlreadyDone is how many of the service's messages found their work done already by another
// message, over all its runs, as the consumer counts it (Tally reads its marked log lines too).
// A consumer that does not export the count fails t: read as 0, a renamed metric would blind
// the check. A service that consumes nothing has done no message's work: 0.
func (s *Service) AlreadyDone(t *testing.T) float64 {
	t.Helper()
	select {
	case <-s.done:
		return s.alreadyDone
	default:
	}
	if !s.consumer {
		return 0
	}
	return s.alreadyDone + s.Metric(t, s.alreadyDoneSample())
}

func (s *Service) alreadyDoneSample() string {
	return fmt.Sprintf("%s{consumer=%q}", alreadyDoneMetric, s.Name)
}

// keepAlreadyDone adds the running process's count of work found done already to what
// survives it, before the test ends the process. It waits 5 s at most and fails t without
// stopping it: the signal that follows must be sent whatever the read does.
func (s *Service) keepAlreadyDone(t *testing.T) {
	t.Helper()
	if !s.consumer {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	n, err := s.metric(ctx, s.alreadyDoneSample())
	if err != nil {
		t.Errorf("%s's count of work found done already dies with the process, unread: %v", s.Name, err)
		return
	}
	s.alreadyDone += n
}

// System is the three services, each kind with its own database, on a private RabbitMQ vhost
// that they reach through a proxy (stop it and the broker is gone for them), with a mail
// server. orders, invoicers and notifiers are the replicas of each kind; order, invoicing and
// notification name the first of each.
type System struct {
	Order, Invoicing, Notification *Service
	Orders, Invoicers, Notifiers   []*Service
	Broker                         *toxiproxy.Proxy
	Mail                           *testenv.SMTPServer
	VHost                          string
	AMQPURL                        string // direct, not through the proxy: for the test's own checks; a list for a cluster
	// RepeatedMails is how many e-mails may arrive again with their Message-ID: what a sender
	// killed between the SMTP send and the mark does, by design (the receiver's idempotency
	// key), to at most its NOTIFY_CONCURRENCY e-mails a kill. 0 allows none.
	RepeatedMails int
	// PoisonSent: the test published messages the consumers must dead-letter, and counts them
	// itself. Otherwise WaitExactlyOnce fails on any dead letter: a good message's delivery
	// sent there, its work done by another, still tallies exactly once.
	PoisonSent bool
	ch         *amqp.Channel
	amqpURLs   []string                                  // each broker node's URL
	ctl        func(t testing.TB, args ...string) string // rabbitmqctl for the system's broker
}

// Options shape a System: how many replicas of each service, extra environment per service.
type Options struct {
	BinDir                       string // where Build put the binaries
	DirectBroker                 bool   // no proxy in front of RabbitMQ (benchmarks: it costs CPU)
	Orders, Invoicers, Notifiers int
	Env                          map[string][]string // a service's DB_MAX_CONNS here is every connection it opens
	// Cluster, if set, is the broker instead of the local one: every node's URL in AMQP_URL,
	// no proxy.
	Cluster *testenv.Cluster
	// Held names the kinds of service ("notification", say) that Start prepares but does not
	// start: the test starts them later, with Service.Start.
	Held []string
	// DiscardLogs drops the services' log lines instead of keeping them for the test
	// (benchmarks: under load they would fill memory), and leaves LOG_LEVEL at its default,
	// so that a benchmark measures what users run; otherwise the services log at debug level.
	DiscardLogs bool
}

// checkPool is the pool of each of the test's own handles on the services' databases.
const checkPool = 2

// dbConns is how many database connections a service started with env opens (its pool and
// its readiness check's): its last DB_MAX_CONNS, or the services' default.
func dbConns(t *testing.T, env []string) int {
	t.Helper()
	n := platform.DefaultDBMaxConns
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "DB_MAX_CONNS="); ok {
			var err error
			if n, err = strconv.Atoi(v); err != nil {
				t.Fatalf("DB_MAX_CONNS=%q: %v", v, err)
			}
		}
	}
	return n
}

func Start(t *testing.T, opts Options) *System {
	t.Helper()
	opts.Orders, opts.Invoicers, opts.Notifiers = max(opts.Orders, 1), max(opts.Invoicers, 1), max(opts.Notifiers, 1)
	s := &System{VHost: testenv.UniqueName("e2e"), ctl: testenv.RabbitMQCtl}
	brokers := []string{testenv.AMQPURL()}
	if opts.Cluster != nil {
		s.ctl, brokers, opts.DirectBroker = opts.Cluster.CtlAny, opts.Cluster.URLs, true
	} else {
		t.Cleanup(func() { testenv.RabbitMQCtlQuietly("delete_vhost", s.VHost) })
	}
	s.ctl(t, "add_vhost", s.VHost)
	s.ctl(t, "set_permissions", "-p", s.VHost, "guest", ".*", ".*", ".*")
	for _, b := range brokers {
		s.amqpURLs = append(s.amqpURLs, b+s.VHost)
	}
	s.AMQPURL = strings.Join(s.amqpURLs, ",")
	viaProxy := s.AMQPURL
	if !opts.DirectBroker {
		s.Broker = testenv.Proxy(t, testenv.AMQPHost(t))
		viaProxy = testenv.AMQPURLVia(t, s.Broker.Listen) + s.VHost
	}
	s.Mail = testenv.NewSMTPServer(t)
	s.Mail.Start()

	common := []string{"AMQP_URL=" + viaProxy}
	if !opts.DiscardLogs {
		common = append(common, "LOG_LEVEL=debug")
	}
	env := func(name string, extra ...string) []string {
		return append(append(slices.Clone(common), opts.Env[name]...), extra...)
	}
	envs := map[string][]string{"invoicing": env("invoicing"), "notification": env("notification", "SMTP_ADDR="+s.Mail.Addr), "order": env("order")}
	// Every connection the system can open, reserved at once: the services' pools and the
	// test's own handles on their three databases.
	testenv.Connections(t, 3*(checkPool+1)+
		opts.Invoicers*dbConns(t, envs["invoicing"])+opts.Notifiers*dbConns(t, envs["notification"])+opts.Orders*dbConns(t, envs["order"]))
	dbs := map[string]*testenv.Database{
		"invoicing": testenv.NewDatabaseWithPool(t, checkPool), "notification": testenv.NewDatabaseWithPool(t, checkPool),
		"order": testenv.NewDatabaseWithPool(t, checkPool),
	}
	replicas := map[string]int{"order": opts.Orders, "invoicing": opts.Invoicers, "notification": opts.Notifiers}
	lists := map[string]*[]*Service{"order": &s.Orders, "invoicing": &s.Invoicers, "notification": &s.Notifiers}
	// The publisher first, the consumers after it: no service may rely on another having
	// started before it (each declares the whole topology), and this order is the one that
	// would lose events if one did.
	for _, name := range []string{"order", "invoicing", "notification"} {
		for range replicas[name] {
			svc := newService(t, opts.BinDir, name, dbs[name], envs[name])
			svc.discardLogs = opts.DiscardLogs
			if !slices.Contains(opts.Held, name) {
				svc.Start(t)
			}
			*lists[name] = append(*lists[name], svc)
		}
	}
	s.Order, s.Invoicing, s.Notification = s.Orders[0], s.Invoicers[0], s.Notifiers[0]
	return s
}

// newService prepares a service, stopped until Start; it is stopped when the test ends, and
// fails the test if any of its runs reported a data race.
func newService(t *testing.T, binDir, name string, db *testenv.Database, env []string) *Service {
	t.Helper()
	s := &Service{Name: name, DB: db, bin: filepath.Join(binDir, name), done: make(chan struct{}), env: env, conns: dbConns(t, env),
		consumer: slices.ContainsFunc(events.Topology.Queues, func(q messaging.ConsumerTopology) bool { return q.Queue == name })}
	close(s.done) // not running
	s.URL = "http://" + FreeAddr(t)
	_, s.Logs = testenv.NewLogger(t)
	t.Cleanup(func() {
		s.Stop(t)
		// The race detector's exit status (66) dies with a process the test SIGKILLed; its
		// report, written when it found the race, is in the logs.
		if strings.Contains(s.Logs.String(), "WARNING: DATA RACE") {
			t.Errorf("%s: the race detector reported a data race (see its logs)", s.Name)
		}
	})
	return s
}

// Kill SIGKILLs the service, as a crash or an OOM kill would: no grace, nothing finished.
// Start runs it again.
func (s *Service) Kill(t *testing.T) {
	t.Helper()
	// Its count of work found done already dies with it: keep what it had so far.
	s.keepAlreadyDone(t)
	s.ended = true
	if err := s.cmd.Process.Kill(); err != nil {
		t.Fatalf("kill %s: %v", s.Name, err)
	}
	<-s.done
}

// SetEnv adds variables to the service's environment from its next Start on (a later value of
// a variable wins).
func (s *Service) SetEnv(vars ...string) { s.env = append(s.env, vars...) }

// Start runs the binary (again, after a Stop) and waits until it is ready.
func (s *Service) Start(t *testing.T) {
	t.Helper()
	if n := dbConns(t, s.env); n > s.conns {
		t.Fatalf("%s would start with DB_MAX_CONNS=%d, more than the %d reserved for it", s.Name, n, s.conns)
	}
	s.done, s.ended = make(chan struct{}), false
	s.cmd = exec.Command(s.bin)
	s.cmd.Env = append(os.Environ(), append([]string{"DATABASE_URL=" + s.DB.URL, "HTTP_ADDR=" + strings.TrimPrefix(s.URL, "http://")}, s.env...)...)
	s.cmd.Stdout, s.cmd.Stderr = s.Logs, s.Logs
	if s.discardLogs {
		s.cmd.Stdout, s.cmd.Stderr = io.Discard, io.Discard
	}
	// Tied to the test binary: no service outlives one killed or timed out.
	exited, err := StartProcess(s.cmd)
	if err != nil {
		s.ended = true // nothing runs: the cleanup's Stop has nothing to signal
		close(s.done)
		t.Fatalf("%s: %v", s.Name, err)
	}
	go func() {
		s.err = <-exited
		close(s.done)
	}()
	testenv.Eventually(t, 30*time.Second, func() bool {
		select {
		case <-s.done:
			t.Fatalf("%s exited while starting: %v", s.Name, s.err)
		default:
		}
		return s.Status(t, "/readyz") == 200
	}, "%s not ready", s.Name)
}

// Stop sends SIGTERM and requires a graceful exit within 10 s, what every service promises
// (platform.HardStop). It returns how long the exit took.
func (s *Service) Stop(t *testing.T) time.Duration {
	t.Helper()
	return s.Terminate(t)()
}

// Terminate sends SIGTERM and returns at once; wait requires a graceful exit within 10 s of
// the signal, and returns how long the exit took. Graceful is status 0 and, where the test
// keeps the service's logs, none of the notGraceful lines logged since the signal.
func (s *Service) Terminate(t *testing.T) (wait func() time.Duration) {
	t.Helper()
	select {
	case <-s.done:
		// Never started (held), or ended by the test already; otherwise it exited by itself.
		if s.cmd != nil && !s.ended {
			t.Errorf("%s had already exited by itself: %v", s.Name, s.err)
		}
		return func() time.Duration { return 0 }
	default:
	}
	s.ended = true
	// The count dies with the process: keep it. (Work during the shutdown itself still shows
	// in the log lines, marked already_done=true, that Tally also reads.)
	s.keepAlreadyDone(t)
	// The logs hold every run's lines: only this stop's count.
	logged := len(s.Logs.String())
	start := time.Now()
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	return func() time.Duration { return s.waitExit(t, start, logged) }
}

// waitExit waits for the exit that a SIGTERM sent at start asked for; logged is how much of
// the logs was written before the signal.
func (s *Service) waitExit(t *testing.T, start time.Time, logged int) time.Duration {
	t.Helper()
	select {
	case <-s.done:
		if s.err != nil {
			t.Errorf("%s exited with %v after SIGTERM", s.Name, s.err)
		}
		if !s.discardLogs {
			checkGraceful(t, s.Name, s.Logs.String()[logged:])
		}
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
		t.Errorf("%s did not exit within 10 s of SIGTERM", s.Name)
	}
	return time.Since(start)
}

// notGraceful are the lines a service logs when its stop abandoned work: the hard stop's, whose
// exit status is 0 all the same, and the HTTP shutdown deadline's, which cut requests off.
var notGraceful = []string{
	"still stopping after the signal; abandoning what is in flight",
	"HTTP requests still running at the shutdown deadline were cut off",
}

// logTail is how many of a service's last log lines a failed stop shows.
const logTail = 30

// checkGraceful fails t if logs, a service's lines since its SIGTERM, hold a notGraceful line,
// and shows their last lines: what was still running when the service gave up on it.
func checkGraceful(t testing.TB, name, logs string) {
	t.Helper()
	lines := strings.Split(strings.TrimRight(logs, "\n"), "\n")
	for _, line := range lines {
		for _, bad := range notGraceful {
			if strings.Contains(line, bad) {
				t.Errorf("%s did not stop gracefully after SIGTERM: it logged\n%s\nits last log lines:\n%s",
					name, line, strings.Join(lines[max(0, len(lines)-logTail):], "\n"))
				return
			}
		}
	}
}

// FreeAddr returns a loopback address nothing listens on at the moment.
func FreeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// StartProcess starts cmd, as cmd.Start does, tied to the test binary: the kernel SIGKILLs it
// if the binary dies first, killed or timed out before its cleanups could stop it. exited gets
// cmd.Wait's result once the process has exited.
//
// Pdeathsig fires when the thread that started the process ends, not the process
// (go.dev/issue/27505), and Go ends a thread when a goroutine locked to it exits: the goroutine
// that starts cmd keeps its thread locked to itself until the process has exited, so that no
// other goroutine can take that thread down with it.
func StartProcess(cmd *exec.Cmd) (exited <-chan error, err error) {
	dieWithTest(cmd)
	started, done := make(chan error, 1), make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		done <- cmd.Wait()
	}()
	if err := <-started; err != nil {
		return nil, fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	return done, nil
}

// CombinedOutput is cmd.CombinedOutput for a process tied to the test binary (StartProcess).
func CombinedOutput(cmd *exec.Cmd) ([]byte, error) {
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out // one writer: exec copies to it from one goroutine at a time
	exited, err := StartProcess(cmd)
	if err != nil {
		return nil, err
	}
	err = <-exited
	return out.Bytes(), err
}

// httpClient is the test's HTTP client of the services. Its timeout bounds each request, so that
// a service that accepts a request and never answers cannot hold Eventually past its deadline.
var httpClient = &http.Client{Timeout: 10 * time.Second}

func (s *Service) Status(t *testing.T, path string) int {
	t.Helper()
	resp, err := httpClient.Get(s.URL + path)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

func (s *Service) GetJSON(t *testing.T, path string, v any) {
	t.Helper()
	resp, err := httpClient.Get(s.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s%s = %d %s", s.Name, path, resp.StatusCode, body)
	}
	if err := json.Unmarshal(body, v); err != nil {
		t.Fatalf("GET %s%s: %v: %s", s.Name, path, err, body)
	}
}

// Metric returns one sample of the service's /metrics, named as the exposition format writes
// it, labels included (outbox_relay_broker_up{exchange="orders"}); a missing sample fails t.
func (s *Service) Metric(t *testing.T, name string) float64 {
	t.Helper()
	v, err := s.metric(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// MetricSoon is Metric for a sample that a scrape may leave out now and then, such as the
// outbox backlog gauges, dropped from a scrape whose query overran its second: it asks again
// for up to within before it fails t.
func (s *Service) MetricSoon(t *testing.T, name string, within time.Duration) float64 {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		v, err := s.metric(context.Background(), name)
		if err == nil {
			return v
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %v", within, err)
		}
		time.Sleep(100 * time.Millisecond) // the gauges' query, given time to finish
	}
}

// Counter is Metric for a counter with labels that the service may not export (yet): a label
// value it has not counted reads as 0.
func (s *Service) Counter(t *testing.T, name string) float64 {
	t.Helper()
	v, _, err := s.sample(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// metric is Metric's read, with an error for the sample missing.
func (s *Service) metric(ctx context.Context, name string) (float64, error) {
	v, ok, err := s.sample(ctx, name)
	if err == nil && !ok {
		err = fmt.Errorf("%s's /metrics has no sample %s", s.Name, name)
	}
	return v, err
}

func (s *Service) sample(ctx context.Context, name string) (v float64, ok bool, err error) {
	body, err := s.scrape(ctx)
	if err != nil {
		return 0, false, err
	}
	if v, ok, err = sampleIn(body, name); err != nil {
		return 0, false, fmt.Errorf("%s's /metrics: %w", s.Name, err)
	}
	return v, ok, nil
}

// scrape returns the service's /metrics; an answer other than 200, or one cut short, is an
// error.
func (s *Service) scrape(ctx context.Context) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/metrics", http.NoBody)
	if err != nil {
		return "", fmt.Errorf("GET %s/metrics: %w", s.Name, err)
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("GET %s/metrics: %w", s.Name, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", fmt.Errorf("GET %s/metrics: %w", s.Name, err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s/metrics = %d %s", s.Name, resp.StatusCode, body)
	}
	return string(body), nil
}

// sampleIn finds the sample name, labels included, in a scrape in the exposition format; ok is
// false if it has none.
func sampleIn(scrape, name string) (v float64, ok bool, err error) {
	for line := range strings.SplitSeq(scrape, "\n") {
		if value, ok := strings.CutPrefix(line, name+" "); ok {
			v, err := strconv.ParseFloat(value, 64)
			if err != nil {
				return 0, false, fmt.Errorf("%s: %w", line, err)
			}
			return v, true, nil
		}
	}
	return 0, false, nil
}

// PlaceOrder posts an order to the first order replica; see Service.PlaceOrder.
func (s *System) PlaceOrder(t *testing.T, customer string) uuid.UUID {
	t.Helper()
	return s.Order.PlaceOrder(t, customer)
}

// PlaceOrder posts an order and returns its id; it fails the test unless the answer is 201.
func (s *Service) PlaceOrder(t *testing.T, customer string) uuid.UUID {
	t.Helper()
	return s.PlaceOrderWith(t, customer, nil)
}

// PlaceOrderWith is PlaceOrder with extra request headers (a traceparent, say).
func (s *Service) PlaceOrderWith(t *testing.T, customer string, header http.Header) uuid.UUID {
	t.Helper()
	body := fmt.Sprintf(`{"customer_id": %q, "lines": [{"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250}]}`, customer)
	req, err := http.NewRequest(http.MethodPost, s.URL+"/orders", strings.NewReader(body))
	if err != nil {
		t.Error(err) // not Fatal: Load calls this from goroutines of its own
		return uuid.Nil
	}
	for k, v := range header {
		req.Header[http.CanonicalHeaderKey(k)] = v
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Error(err)
		return uuid.Nil
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusCreated {
		t.Errorf("POST /orders = %d %s", resp.StatusCode, out)
		return uuid.Nil
	}
	var o struct {
		ID uuid.UUID `json:"id"`
	}
	if err := json.Unmarshal(out, &o); err != nil {
		t.Error(err)
	}
	return o.ID
}

// CancelOrder cancels an order through the first order replica; see Service.CancelOrder.
func (s *System) CancelOrder(t *testing.T, id uuid.UUID, reason string) bool {
	t.Helper()
	return s.Order.CancelOrder(t, id, reason)
}

// CancelOrder posts the order's cancellation and reports whether it was answered 200 with the
// order cancelled (as a repeated cancellation is too); any other answer fails the test.
func (s *Service) CancelOrder(t *testing.T, id uuid.UUID, reason string) bool {
	t.Helper()
	code, body, err := postCancel(httpClient, s.URL, id, reason)
	switch {
	case err != nil:
		t.Error(err)
		return false
	case code != http.StatusOK || !isCancelled(body):
		t.Errorf("POST /orders/%s/cancel = %d %s", id, code, body)
		return false
	}
	return true
}

// InFlightOrder starts POST /orders for customer on a connection of its own and sends all of
// the request but the end of its body: the service is handling it, reading the body, until
// finish sends the rest and reads the answer.
func (s *Service) InFlightOrder(t *testing.T, customer string) (finish func() (status int, id uuid.UUID)) {
	t.Helper()
	body := fmt.Sprintf(`{"customer_id":%q,"lines":[{"sku":"S","quantity":1,"unit_price_cents":100}]}`, customer)
	conn, err := net.Dial("tcp", strings.TrimPrefix(s.URL, "http://"))
	if err != nil {
		t.Fatalf("connect to %s: %v", s.Name, err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	head := fmt.Sprintf("POST /orders HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n",
		strings.TrimPrefix(s.URL, "http://"), len(body))
	half := len(body) / 2
	if _, err := io.WriteString(conn, head+body[:half]); err != nil {
		t.Fatalf("start POST /orders: %v", err)
	}
	// Dialled is not accepted: a connection still in the listener's backlog when the service
	// is stopped is reset, not drained. The service accepts connections in the order they
	// came, so an answer on a new connection, dialled after this one, shows it accepted.
	probe := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := probe.Get(s.URL + "/readyz")
	if err != nil {
		t.Fatalf("%s did not answer a request after the one in flight: %v", s.Name, err)
	}
	_ = resp.Body.Close()
	return func() (int, uuid.UUID) {
		t.Helper()
		if _, err := io.WriteString(conn, body[half:]); err != nil {
			t.Fatalf("finish POST /orders: %v", err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("read the answer to POST /orders: %v", err)
		}
		defer resp.Body.Close()
		var o struct{ ID uuid.UUID }
		_ = json.NewDecoder(resp.Body).Decode(&o)
		return resp.StatusCode, o.ID
	}
}

// Refuses reports whether the service takes no new connections: its listener is closed.
func (s *Service) Refuses() bool {
	conn, err := net.DialTimeout("tcp", strings.TrimPrefix(s.URL, "http://"), time.Second)
	if err != nil {
		return true
	}
	_ = conn.Close()
	return false
}

// postCancel posts the cancellation of order id to an order replica and returns the answer.
func postCancel(client *http.Client, orderURL string, id uuid.UUID, reason string) (code int, body []byte, err error) {
	payload, err := json.Marshal(map[string]string{"reason": reason})
	if err != nil {
		return 0, nil, err
	}
	resp, err := client.Post(orderURL+"/orders/"+id.String()+"/cancel", "application/json", bytes.NewReader(payload))
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err = io.ReadAll(resp.Body)
	return resp.StatusCode, body, err
}

// isCancelled reports whether body is an order whose status is cancelled.
func isCancelled(body []byte) bool {
	var o struct{ Status string }
	return json.Unmarshal(body, &o) == nil && o.Status == "cancelled"
}

// Tally is what the system holds, to compare with what it should, over the whole chain:
// order → OrderPlaced (and OrderCancelled) → invoice and InvoiceIssued → notifications. Each
// order should have one invoice row, void once the order is cancelled, and one notification
// per kind it earned: an order_confirmation always, an invoice notification unless its
// cancellation reached the invoicing service first, an order_cancelled once it is cancelled.
// RedundantWork counts the messages whose work another message had done already: the unique
// columns would hide a message worked twice, the consumers' consumer_already_done_total does
// not. Their log lines are read too, for what a process did while it shut down, after its
// count was read: each such line carries already_done=true, whatever its wording.
type Tally struct {
	Orders, Unsent               int64
	Cancelled                    int // orders cancelled
	Invoices                     int
	MissingInvoice, ExtraInvoice int
	WrongInvoiceStatus           int // invoices not void though their order was cancelled, or void though it was not
	Notifications, Expected      int // notifications held, and earned
	WrongNotices                 int // (order, kind) pairs held more or fewer times than earned
	Sent, Mails                  int
	DuplicateMails               int // e-mails sent again, the same Message-ID
	StrayMails                   int // e-mails that are no notification's: wrong or missing Message-ID
	RedundantWork                int
}

// countByOrder runs query, which yields (order_id, n) rows, into a map.
func countByOrder(t *testing.T, db *testenv.Database, query string) map[uuid.UUID]int {
	t.Helper()
	var rows []struct {
		OrderID uuid.UUID
		N       int
	}
	if err := db.DB.Raw(query).Scan(&rows).Error; err != nil {
		t.Fatal(err)
	}
	counts := make(map[uuid.UUID]int, len(rows))
	for _, r := range rows {
		counts[r.OrderID] = r.N
	}
	return counts
}

// compare counts, per order, how far got is from want: missing and extra units, and the
// (order) keys that differ at all. Orders absent from want should have nothing.
func compare(want, got map[uuid.UUID]int) (missing, extra, wrong int) {
	for id, w := range want {
		g := got[id]
		missing += max(0, w-g)
		extra += max(0, g-w)
		if g != w {
			wrong++
		}
	}
	for id, g := range got {
		if _, ok := want[id]; !ok {
			extra += g
			wrong++
		}
	}
	return missing, extra, wrong
}

func (s *System) Tally(t *testing.T) Tally {
	t.Helper()
	var r Tally
	r.Orders = testenv.Count(t, s.Order.DB.DB, "SELECT count(*) FROM orders")
	r.Unsent = testenv.Count(t, s.Order.DB.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL") +
		testenv.Count(t, s.Invoicing.DB.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL")

	one := countByOrder(t, s.Order.DB, "SELECT id AS order_id, 1 AS n FROM orders")
	cancelled := countByOrder(t, s.Order.DB, "SELECT id AS order_id, 1 AS n FROM orders WHERE status = 'cancelled'")
	r.Cancelled = len(cancelled)
	// Every invoice was issued, and announced by one InvoiceIssued, but the void row that a
	// cancellation wrote before its order arrived: voided as it was created (services/invoicing).
	// An invoice voided later was issued first. Read from the rows, not from the events the
	// invoicing service wrote: an InvoiceIssued it failed to write shows as a notice missing.
	issued := countByOrder(t, s.Invoicing.DB, `SELECT order_id, count(*) AS n FROM invoices
		WHERE status = 'issued' OR voided_at <> created_at GROUP BY order_id`)
	invoices := countByOrder(t, s.Invoicing.DB, "SELECT order_id, count(*) AS n FROM invoices GROUP BY order_id")
	r.MissingInvoice, r.ExtraInvoice, _ = compare(one, invoices)
	for _, n := range invoices {
		r.Invoices += n
	}
	void := countByOrder(t, s.Invoicing.DB, "SELECT order_id, count(*) AS n FROM invoices WHERE status = 'void' GROUP BY order_id")
	for id, n := range invoices {
		if cancelled[id] > 0 {
			r.WrongInvoiceStatus += n - void[id]
		} else {
			r.WrongInvoiceStatus += void[id]
		}
	}
	for kind, want := range map[string]map[uuid.UUID]int{"order_confirmation": one, "invoice": issued, "order_cancelled": cancelled} {
		got := countByOrder(t, s.Notification.DB, "SELECT order_id, count(*) AS n FROM notifications WHERE kind = '"+kind+"' GROUP BY order_id")
		_, _, wrong := compare(want, got)
		r.WrongNotices += wrong
		for _, n := range want {
			r.Expected += n
		}
	}
	r.Notifications = int(testenv.Count(t, s.Notification.DB.DB, "SELECT count(*) FROM notifications"))
	r.Sent = int(testenv.Count(t, s.Notification.DB.DB, "SELECT count(*) FROM notifications WHERE status = 'sent'"))
	counted, logged := 0, 0
	for _, c := range append(append([]*Service{}, s.Invoicers...), s.Notifiers...) {
		counted += int(c.AlreadyDone(t))
		logged += alreadyDoneLogged(c.Logs.String())
	}
	r.RedundantWork = max(counted, logged)
	r.Mails, r.DuplicateMails, r.StrayMails = s.mailsPerNotification(t)
	return r
}

// mailsPerNotification matches each e-mail to its notification by Message-ID
// (<notification-id@…>): how many arrived, how many repeated one, how many matched none.
// Together with the notifications' own check per order and kind, every order's e-mails are
// checked one by one, not only as a total.
func (s *System) mailsPerNotification(t *testing.T) (mails, repeats, strays int) {
	t.Helper()
	var ids []string
	if err := s.Notification.DB.DB.Raw("SELECT id::text FROM notifications").Scan(&ids).Error; err != nil {
		t.Fatal(err)
	}
	known := make(map[string]bool, len(ids))
	for _, id := range ids {
		known[id] = true
	}
	seen := map[string]bool{}
	for _, m := range s.Mail.Mail() {
		mails++
		id, _, _ := strings.Cut(strings.Trim(m.MessageID, "<>"), "@")
		switch {
		case !known[id]:
			strays++
		case seen[id]:
			repeats++
		}
		seen[id] = true
	}
	return mails, repeats, strays
}

// quietPeriod is how long the tally must stay exact, unchanged, before it counts: a redelivery
// still in flight when it first holds would change it. It covers the broker's statistics
// interval (5 s by default), so the queue counts read at its end are not older than it.
const quietPeriod = 5 * time.Second

// exact reports whether the tally is exactly once for want orders, with at most maxRepeats
// e-mails repeated (the same Message-ID).
func (r Tally) exact(want int64, maxRepeats int) bool {
	return r.Orders == want && r.Unsent == 0 &&
		r.Invoices == int(want) && r.MissingInvoice+r.ExtraInvoice+r.WrongInvoiceStatus == 0 &&
		r.WrongNotices == 0 && r.Notifications == r.Expected &&
		r.Sent == r.Expected && r.Mails-r.DuplicateMails == r.Expected && r.DuplicateMails <= maxRepeats &&
		r.StrayMails == 0 && r.RedundantWork == 0
}

// tallyEvery is how often WaitExactlyOnce reads the tally: a dozen queries, a metric scrape
// per consumer and a copy of every log, which read every 20 ms took much of a 2-core
// machine from the system it waited for.
const tallyEvery = 250 * time.Millisecond

// WaitExactlyOnce waits until every order has exactly one invoice and every notification it
// earned, each delivered once, nothing is left to send, and nothing exists that should not;
// and then until that has held, unchanged, for a quiet period that ends with no message
// ready or unacknowledged in the consumers' queues, and none dead-lettered (unless PoisonSent).
func (s *System) WaitExactlyOnce(t *testing.T, want int64, timeout time.Duration) Tally {
	t.Helper()
	var last Tally
	var since time.Time
	testenv.EventuallyEvery(t, tallyEvery, timeout, func() bool {
		cur := s.Tally(t)
		// An e-mail once received stays so: past the bound, no wait can make the tally exact.
		if cur.DuplicateMails > s.RepeatedMails {
			t.Fatalf("%d e-mails arrived again with their Message-ID, want at most %d: %+v", cur.DuplicateMails, s.RepeatedMails, &cur)
		}
		if !cur.exact(want, s.RepeatedMails) || cur != last {
			last, since = cur, time.Time{}
			return false
		}
		if since.IsZero() {
			since = time.Now()
		}
		if time.Since(since) < quietPeriod {
			return false
		}
		// Queues still busy start another quiet period: rabbitmqctl, an Erlang VM each time,
		// costs half a second of CPU, too much to ask again at every read of the tally.
		if !s.queuesIdle(t) {
			since = time.Now()
			return false
		}
		return true
	}, "system did not settle on exactly-once for %d orders: %+v", want, &last)
	if dl := s.CheckQueuesEmpty(t); dl != 0 && !s.PoisonSent {
		t.Fatalf("%d messages dead-lettered, want none: no test message was poison", dl)
	}
	return last
}

// queuesIdle reports whether the consumers' queues hold no message, ready or unacknowledged:
// a declare (QueueDepth) counts only the ready ones, so a redelivery in flight would pass.
// Both queues must be listed: output it cannot read (renamed queues, another format) is not idle.
func (s *System) queuesIdle(t *testing.T) bool {
	t.Helper()
	counts := s.queueCounts(t)
	for _, q := range []string{"invoicing", "notification"} {
		c, ok := counts[q]
		if !ok || c.ready != 0 || c.unacked != 0 {
			return false
		}
	}
	return true
}

// queueCount is a queue's messages as the broker counts them: ready, and delivered but not yet
// acknowledged.
type queueCount struct{ ready, unacked int }

// queueCounts lists the queues of the system's vhost with their counts. A line it cannot read
// lists no queue.
func (s *System) queueCounts(t *testing.T) map[string]queueCount {
	t.Helper()
	out := s.ctl(t, "list_queues", "-q", "-p", s.VHost, "--no-table-headers", "name", "messages_ready", "messages_unacknowledged")
	counts := map[string]queueCount{}
	for line := range strings.SplitSeq(out, "\n") {
		f := strings.Fields(line)
		if len(f) != 3 {
			continue
		}
		ready, errReady := strconv.Atoi(f[1])
		unacked, errUnacked := strconv.Atoi(f[2])
		if errReady == nil && errUnacked == nil {
			counts[f[0]] = queueCount{ready, unacked}
		}
	}
	return counts
}

// Unacknowledged is how many messages of queue the broker has delivered and not had
// acknowledged: work in the consumers' hands. listed is false when the broker's list does not
// show the queue (or a line of it could not be read): ask again.
func (s *System) Unacknowledged(t *testing.T, queue string) (n int, listed bool) {
	t.Helper()
	c, listed := s.queueCounts(t)[queue]
	return c.unacked, listed
}

// Unhandled returns what each consumer still has to do with the order service's events about
// the orders ids, of which cancelled were cancelled: invoicing, invoices missing and cancelled
// orders' invoices not yet void; notification, order confirmations and cancellation notices
// missing.
func (s *System) Unhandled(t *testing.T, ids, cancelled []uuid.UUID) (invoices, notifications int64) {
	t.Helper()
	n, c := int64(len(ids)), int64(len(cancelled))
	invoices = n - testenv.Count(t, s.Invoicing.DB.DB, "SELECT count(*) FROM invoices WHERE order_id IN ?", ids) +
		c - testenv.Count(t, s.Invoicing.DB.DB, "SELECT count(*) FROM invoices WHERE status = 'void' AND order_id IN ?", cancelled)
	notifications = n - testenv.Count(t, s.Notification.DB.DB, "SELECT count(*) FROM notifications WHERE kind = 'order_confirmation' AND order_id IN ?", ids) +
		c - testenv.Count(t, s.Notification.DB.DB, "SELECT count(*) FROM notifications WHERE kind = 'order_cancelled' AND order_id IN ?", cancelled)
	return invoices, notifications
}

// CheckAccepted requires every order answered 201 to exist, and returns how many orders exist
// without one (a response lost while a service restarted: committed, never confirmed).
func (s *System) CheckAccepted(t *testing.T, accepted []uuid.UUID) (unconfirmed int64) {
	t.Helper()
	var orders []struct {
		ID         string
		CustomerID string
		CreatedAt  time.Time
	}
	if err := s.Order.DB.DB.Raw("SELECT id::text AS id, customer_id, created_at FROM orders").Scan(&orders).Error; err != nil {
		t.Fatal(err)
	}
	exists := make(map[string]bool, len(orders))
	for _, o := range orders {
		exists[o.ID] = true
	}
	answered := make(map[string]bool, len(accepted))
	for _, id := range accepted {
		if !exists[id.String()] {
			t.Fatalf("order %s was answered 201 but does not exist", id)
		}
		answered[id.String()] = true
	}
	// Which request an unanswered order came from, for the client's errors (see StartTraffic).
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, o := range orders {
			if !answered[o.ID] {
				t.Logf("order %s (customer_id %s, created_at %s) was committed without its 201 reaching the client", o.ID, o.CustomerID, o.CreatedAt.UTC().Format(time.RFC3339Nano))
			}
		}
	})
	return int64(len(orders) - len(accepted))
}

// DumpOnFailure logs the tally when the test fails.
func (s *System) DumpOnFailure(t *testing.T) {
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("tally: %+v", s.Tally(t))
		}
	})
}

// CheckQueuesEmpty requires the consumers' queues to be empty (dead-letter queues aside, whose
// depth it returns).
func (s *System) CheckQueuesEmpty(t *testing.T) (deadLettered int) {
	t.Helper()
	ch := s.Channel(t)
	for _, q := range []string{"invoicing", "notification"} {
		if n := testenv.QueueDepth(t, ch, q); n != 0 {
			t.Fatalf("queue %s still holds %d messages", q, n)
		}
		deadLettered += testenv.QueueDepth(t, ch, q+".dlq")
	}
	return deadLettered
}

// Channel returns the test's own channel on the system's vhost, directly to the broker (not
// through the proxy), opened on first use and closed when the test ends. One goroutine only.
func (s *System) Channel(t *testing.T) *amqp.Channel {
	t.Helper()
	if s.ch != nil && !s.ch.IsClosed() {
		return s.ch
	}
	var conn *amqp.Connection
	var err error
	for _, u := range s.amqpURLs { // the first node that answers
		if conn, err = amqp.Dial(u); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	if s.ch, err = conn.Channel(); err != nil {
		t.Fatal(err)
	}
	return s.ch
}

// DuplicatesSuppressed sums inbox_duplicates_total over all the system's consumer replicas
// (Invoicers and Notifiers; each counts from its last start), which must all be up: it scrapes
// each, and one whose /metrics fails (a replica stopped, say), or lacks its sample, fails t:
// read as 0, a metric renamed or unlabelled would pass for a run that suppressed no duplicate
// (see AlreadyDone).
func (s *System) DuplicatesSuppressed(t *testing.T) int {
	t.Helper()
	total := 0.0
	for _, c := range append(append([]*Service{}, s.Invoicers...), s.Notifiers...) {
		n, err := c.duplicates(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		total += n
	}
	return int(total)
}

// duplicatesMetric counts the messages a consumer's inbox recognised as handled already.
const duplicatesMetric = "inbox_duplicates_total"

// duplicates reads the service's count of duplicates suppressed from its /metrics.
func (s *Service) duplicates(ctx context.Context) (float64, error) {
	body, err := s.scrape(ctx)
	if err != nil {
		return 0, err
	}
	n, err := duplicatesIn(s.Name, body)
	if err != nil {
		return 0, fmt.Errorf("%s's /metrics: %w", s.Name, err)
	}
	return n, nil
}

// duplicatesIn reads consumer's inbox_duplicates_total{consumer="…"} from a scrape of its
// /metrics (the library exports it at 0 from the subscription's start): a scrape without that
// sample is an error.
func duplicatesIn(consumer, scrape string) (float64, error) {
	name := fmt.Sprintf("%s{consumer=%q}", duplicatesMetric, consumer)
	n, ok, err := sampleIn(scrape, name)
	if err == nil && !ok {
		err = fmt.Errorf("no sample %s", name)
	}
	return n, err
}

// Load places n orders from workers concurrent clients, spread over the order replicas, and
// cancels every 4th right after it is accepted, through the next replica: OrderCancelled then
// races its OrderPlaced through the relays and the consumers. It returns the ids of the orders
// answered 201 and how many cancellations were answered 200; any other answer fails the test.
func (s *System) Load(t *testing.T, n, workers int) (ids []uuid.UUID, cancelled int) {
	t.Helper()
	accepted := make(chan uuid.UUID, n)
	next := make(chan int, n)
	for i := range n {
		next <- i
	}
	close(next)
	var cancels atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range next {
				id := s.Orders[i%len(s.Orders)].PlaceOrder(t, fmt.Sprintf("load-%d", i))
				if id == uuid.Nil {
					continue
				}
				accepted <- id
				if i%4 == 3 && s.Orders[(i+1)%len(s.Orders)].CancelOrder(t, id, "load") {
					cancels.Add(1)
				}
			}
		})
	}
	wg.Wait()
	close(accepted)
	for id := range accepted {
		ids = append(ids, id)
	}
	return ids, int(cancels.Load())
}

// CPUTime is the CPU time the process has used so far, user and system: /proc's clock ticks,
// which Linux counts at 100 a second.
func (s *Service) CPUTime(t *testing.T) time.Duration {
	t.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", s.cmd.Process.Pid))
	if err != nil {
		t.Fatalf("read %s's stat: %v", s.Name, err)
	}
	// The fields after the command name, which is in parentheses and may hold spaces:
	// utime and stime are the 12th and 13th of them.
	f := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+1:]))
	var ticks int64
	for _, v := range f[11:13] {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			t.Fatalf("%s's stat: %v", s.Name, err)
		}
		ticks += n
	}
	return time.Duration(ticks) * 10 * time.Millisecond
}

// PeakRSS is the process's peak resident set size so far (VmHWM), in bytes.
func (s *Service) PeakRSS(t *testing.T) int64 {
	t.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.cmd.Process.Pid))
	if err != nil {
		t.Fatalf("read %s's status: %v", s.Name, err)
	}
	for line := range strings.SplitSeq(string(raw), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kib, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				t.Fatalf("%s: %q: %v", s.Name, line, err)
			}
			return kib << 10
		}
	}
	t.Fatalf("%s: no VmHWM in /proc status", s.Name)
	return 0
}

// Traffic is orders placed without pause by background clients that keep going through
// restarts and outages, every 4th accepted order cancelled right after, counting what was
// accepted, what was cancelled, what got a 5xx, and any other answer (a failure).
type Traffic struct {
	accepted                        sync.Map
	placed, cancelled, serverErrors atomic.Int64
	mu                              sync.Mutex
	unexpected                      []string
	clientErrors                    []string // the last maxClientErrors, logged if the test fails
	stop                            chan struct{}
	stopOnce                        sync.Once
	wg                              sync.WaitGroup
}

// StartTraffic starts workers clients posting to the first order replica, until Stop or the
// end of t: a test that fails before its Stop must not leave clients posting to a port that
// another test's order service may take next.
func (s *System) StartTraffic(t *testing.T, workers int) *Traffic {
	t.Helper()
	tr := &Traffic{stop: make(chan struct{})}
	t.Cleanup(tr.halt)
	t.Cleanup(func() {
		if t.Failed() {
			tr.mu.Lock()
			defer tr.mu.Unlock()
			t.Logf("traffic's last client errors:\n%s", strings.Join(tr.clientErrors, "\n"))
		}
	})
	for w := range workers {
		tr.wg.Go(func() {
			client := &http.Client{Timeout: 15 * time.Second}
			accepted := 0
			for i := 0; ; i++ {
				select {
				case <-tr.stop:
					return
				default:
				}
				customer := fmt.Sprintf("w%d-%d", w, i)
				body := fmt.Sprintf(`{"customer_id":%q,"lines":[{"sku":"S","quantity":1,"unit_price_cents":100}]}`, customer)
				resp, conn, err := postTraced(client, s.Order.URL+"/orders", body)
				if err != nil {
					// Refused or reset: the service is restarting. Try again soon. Whether an
					// error hid an answer to an order that was committed, CheckAccepted tells.
					tr.clientError(customer, conn, err)
					time.Sleep(20 * time.Millisecond)
					continue
				}
				out, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				var o struct{ ID uuid.UUID }
				switch {
				case resp.StatusCode == http.StatusCreated && json.Unmarshal(out, &o) == nil:
					tr.accepted.Store(o.ID, true)
					tr.placed.Add(1)
					if accepted++; accepted%4 == 0 {
						tr.cancel(client, s.Order.URL, o.ID)
					}
				case resp.StatusCode >= 500:
					tr.serverErrors.Add(1)
				default:
					tr.fail("POST /orders = %d %s", resp.StatusCode, out)
				}
			}
		})
	}
	return tr
}

// cancel cancels order id, asking again while the service cannot be reached (a repeated
// cancellation writes nothing), until the traffic stops.
func (tr *Traffic) cancel(client *http.Client, orderURL string, id uuid.UUID) {
	for {
		code, body, err := postCancel(client, orderURL, id, "traffic")
		if err == nil {
			switch {
			case code == http.StatusOK && isCancelled(body):
				tr.cancelled.Add(1)
			case code >= 500:
				tr.serverErrors.Add(1)
			default:
				tr.fail("POST /orders/%s/cancel = %d %s", id, code, body)
			}
			return
		}
		select {
		case <-tr.stop:
			return
		case <-time.After(20 * time.Millisecond): // the service is restarting: try again soon
		}
	}
}

// maxClientErrors is how many of the traffic's client errors it keeps, the last.
const maxClientErrors = 100

// clientError records a request's error, with its customer_id and what its connection was.
func (tr *Traffic) clientError(customer string, conn httptrace.GotConnInfo, err error) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	local := ""
	if conn.Conn != nil {
		local = conn.Conn.LocalAddr().String()
	}
	line := fmt.Sprintf("%s customer_id=%s reused=%t was_idle=%t idle=%s local=%s error=%q",
		time.Now().UTC().Format(time.RFC3339Nano), customer, conn.Reused, conn.WasIdle, conn.IdleTime, local, err)
	if len(tr.clientErrors) == maxClientErrors {
		tr.clientErrors = tr.clientErrors[1:]
	}
	tr.clientErrors = append(tr.clientErrors, line)
}

// postTraced posts body to url as JSON, and says what connection it went on.
func postTraced(client *http.Client, url, body string) (*http.Response, httptrace.GotConnInfo, error) {
	var got httptrace.GotConnInfo
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return nil, got, err
	}
	req.Header.Set("Content-Type", "application/json")
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) { got = info },
	}))
	resp, err := client.Do(req)
	return resp, got, err
}

func (tr *Traffic) fail(format string, args ...any) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.unexpected = append(tr.unexpected, fmt.Sprintf(format, args...))
}

// WaitFor waits until n more orders have been accepted: proof that orders flow.
func (tr *Traffic) WaitFor(t *testing.T, n int64) {
	t.Helper()
	target := tr.placed.Load() + n
	testenv.Eventually(t, 60*time.Second, func() bool { return tr.placed.Load() >= target }, "orders are not flowing")
}

// Placed is how many orders have been accepted so far.
func (tr *Traffic) Placed() int64 { return tr.placed.Load() }

// halt stops the clients and waits for them; again, it does nothing.
func (tr *Traffic) halt() {
	tr.stopOnce.Do(func() { close(tr.stop) })
	tr.wg.Wait()
}

// Stop ends the traffic and returns the ids of the accepted orders, how many cancellations
// were answered 200, and the count of 5xx answers. Any other answer fails t.
func (tr *Traffic) Stop(t *testing.T) (accepted []uuid.UUID, cancelled, serverErrors int64) {
	t.Helper()
	tr.halt()
	for _, u := range tr.unexpected {
		t.Errorf("traffic: %s", u)
	}
	tr.accepted.Range(func(k, _ any) bool { accepted = append(accepted, k.(uuid.UUID)); return true })
	return accepted, tr.cancelled.Load(), tr.serverErrors.Load()
}

// alreadyDoneMark is the attribute (already_done=true) that a consumer puts on the log line of
// each message it counts in alreadyDoneMetric, whatever the line's wording.
const alreadyDoneMark = "already_done"

// alreadyDoneLogged counts the lines of logs, in the text format or JSON, that carry
// alreadyDoneMark: messages that found their work done already by another message.
func alreadyDoneLogged(logs string) int {
	text, json := " "+alreadyDoneMark+"=true", `"`+alreadyDoneMark+`":true`
	n := 0
	for line := range strings.SplitSeq(logs, "\n") {
		if strings.Contains(line+" ", text+" ") || strings.Contains(line, json) {
			n++
		}
	}
	return n
}
