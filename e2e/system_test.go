// Package e2e runs the three real service binaries against the local PostgreSQL and RabbitMQ
// and checks what a user of the system sees: orders in, exactly one invoice and one delivered
// confirmation out, whatever the broker does meanwhile.
package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

var binDir string

func TestMain(m *testing.M) {
	code := func() int {
		dir, err := os.MkdirTemp("", "e2e-bin-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		for _, s := range []string{"order", "invoicing", "notification"} {
			cmd := exec.Command("go", "build", "-race", "-o", filepath.Join(dir, s), "../services/"+s)
			if out, err := cmd.CombinedOutput(); err != nil {
				fmt.Fprintf(os.Stderr, "build %s: %v\n%s", s, err, out)
				return 1
			}
		}
		binDir = dir
		return m.Run()
	}()
	os.Exit(code)
}

// service is one running binary.
type service struct {
	name string
	url  string
	env  []string
	db   *testenv.Database
	logs *testenv.Logs
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// system is the three services, each kind with its own database, on a private RabbitMQ vhost
// that they reach through a proxy (stop it and the broker is gone for them), with a mail
// server. orders, invoicers and notifiers are the replicas of each kind; order, invoicing and
// notification name the first of each.
type system struct {
	order, invoicing, notification *service
	orders, invoicers, notifiers   []*service
	broker                         *toxiproxy.Proxy
	mail                           *testenv.SMTPServer
	vhost                          string
	amqpURL                        string // direct, not through the proxy: for the test's own checks
}

// options shape a system: how many replicas of each service, extra environment per service.
type options struct {
	orders, invoicers, notifiers int
	env                          map[string][]string
}

func startSystem(t *testing.T, opts options) *system {
	t.Helper()
	opts.orders, opts.invoicers, opts.notifiers = max(opts.orders, 1), max(opts.invoicers, 1), max(opts.notifiers, 1)
	s := &system{vhost: testenv.UniqueName("e2e")}
	testenv.RabbitMQCtl(t, "add_vhost", s.vhost)
	t.Cleanup(func() { _ = exec.Command("rabbitmqctl", "delete_vhost", s.vhost).Run() })
	testenv.RabbitMQCtl(t, "set_permissions", "-p", s.vhost, "guest", ".*", ".*", ".*")
	s.amqpURL = testenv.AMQPURL() + s.vhost
	s.broker = testenv.Proxy(t, testenv.AMQPHost(t))
	viaProxy := testenv.AMQPURLVia(t, s.broker.Listen) + s.vhost
	s.mail = testenv.NewSMTPServer(t)
	s.mail.Start()

	env := func(name string, extra ...string) []string {
		return append(append([]string{"AMQP_URL=" + viaProxy, "LOG_LEVEL=debug"}, opts.env[name]...), extra...)
	}
	// Consumers first: their queues must exist before the first order is relayed.
	invoicingDB, notificationDB, orderDB := testenv.NewDatabase(t), testenv.NewDatabase(t), testenv.NewDatabase(t)
	for range opts.invoicers {
		s.invoicers = append(s.invoicers, startService(t, "invoicing", invoicingDB, env("invoicing")))
	}
	for range opts.notifiers {
		s.notifiers = append(s.notifiers, startService(t, "notification", notificationDB, env("notification", "SMTP_ADDR="+s.mail.Addr)))
	}
	for range opts.orders {
		s.orders = append(s.orders, startService(t, "order", orderDB, env("order")))
	}
	s.order, s.invoicing, s.notification = s.orders[0], s.invoicers[0], s.notifiers[0]
	return s
}

func startService(t *testing.T, name string, db *testenv.Database, env []string) *service {
	t.Helper()
	s := &service{name: name, db: db, done: make(chan struct{}), env: env}
	s.url = "http://" + freeAddr(t)
	_, s.logs = testenv.NewLogger(t)
	s.start(t)
	t.Cleanup(func() { s.stop(t) })
	return s
}

// start runs the binary (again, after a stop) and waits until it is ready.
func (s *service) start(t *testing.T) {
	t.Helper()
	s.done = make(chan struct{})
	s.cmd = exec.Command(filepath.Join(binDir, s.name))
	s.cmd.Env = append(os.Environ(), append([]string{"DATABASE_URL=" + s.db.URL, "HTTP_ADDR=" + strings.TrimPrefix(s.url, "http://")}, s.env...)...)
	s.cmd.Stdout, s.cmd.Stderr = s.logs, s.logs
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", s.name, err)
	}
	go func() { s.err = s.cmd.Wait(); close(s.done) }()
	testenv.Eventually(t, 30*time.Second, func() bool { return s.status(t, "/readyz") == 200 }, "%s not ready", s.name)
}

// stop sends SIGTERM and requires a clean exit within 10 s (CONTRACT.md). It returns how
// long the exit took.
func (s *service) stop(t *testing.T) time.Duration {
	t.Helper()
	select {
	case <-s.done:
		return 0
	default:
	}
	start := time.Now()
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
		if s.err != nil {
			t.Errorf("%s exited with %v after SIGTERM", s.name, s.err)
		}
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
		t.Errorf("%s did not exit within 10 s of SIGTERM", s.name)
	}
	return time.Since(start)
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func (s *service) status(t *testing.T, path string) int {
	t.Helper()
	resp, err := http.Get(s.url + path)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

func (s *service) getJSON(t *testing.T, path string, v any) {
	t.Helper()
	resp, err := http.Get(s.url + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("GET %s%s = %d %s", s.name, path, resp.StatusCode, body)
	}
	if err := json.Unmarshal(body, v); err != nil {
		t.Fatalf("GET %s%s: %v: %s", s.name, path, err, body)
	}
}

// placeOrder posts an order to the first order replica; see placeOrderAt.
func (s *system) placeOrder(t *testing.T, customer string) uuid.UUID {
	t.Helper()
	return s.order.placeOrderAt(t, customer)
}

// placeOrderAt posts an order and returns its id; it fails the test unless the answer is 201.
func (s *service) placeOrderAt(t *testing.T, customer string) uuid.UUID {
	t.Helper()
	body := fmt.Sprintf(`{"customer_id": %q, "lines": [{"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250}]}`, customer)
	resp, err := http.Post(s.url+"/orders", "application/json", strings.NewReader(body))
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

// tally is what the system holds, to compare with what it should.
type tally struct {
	orders, unsent                       int64
	invoices, notifications, sent, mails int
	missingInvoice, extraInvoice         int
	missingNotice, extraNotice           int
	duplicateMails                       int
}

func (s *system) tally(t *testing.T) tally {
	t.Helper()
	var r tally
	r.orders = testenv.Count(t, s.order.db.DB, "SELECT count(*) FROM orders")
	r.unsent = testenv.Count(t, s.order.db.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL")
	var orderIDs []uuid.UUID
	if err := s.order.db.DB.Raw("SELECT id FROM orders").Scan(&orderIDs).Error; err != nil {
		t.Fatal(err)
	}
	perOrder := func(db *testenv.Database, table, where string) (total int, missing, extra int) {
		counts := map[uuid.UUID]int{}
		var rows []struct {
			OrderID uuid.UUID
			N       int
		}
		if err := db.DB.Raw("SELECT order_id, count(*) AS n FROM " + table + where + " GROUP BY order_id").Scan(&rows).Error; err != nil {
			t.Fatal(err)
		}
		for _, row := range rows {
			counts[row.OrderID] = row.N
			total += row.N
		}
		known := map[uuid.UUID]bool{}
		for _, id := range orderIDs {
			known[id] = true
			switch n := counts[id]; {
			case n == 0:
				missing++
			case n > 1:
				extra += n - 1
			}
		}
		for id, n := range counts {
			if !known[id] {
				extra += n // work for an order that does not exist
			}
		}
		return total, missing, extra
	}
	r.invoices, r.missingInvoice, r.extraInvoice = perOrder(s.invoicing.db, "invoices", "")
	r.notifications, r.missingNotice, r.extraNotice = perOrder(s.notification.db, "notifications", "")
	r.sent, _, _ = perOrder(s.notification.db, "notifications", " WHERE status = 'sent'")
	mails := s.mail.Mail()
	r.mails = len(mails)
	seen := map[string]bool{}
	for _, m := range mails {
		if seen[m.MessageID] {
			r.duplicateMails++
		}
		seen[m.MessageID] = true
	}
	return r
}

// waitExactlyOnce waits until every order has exactly one invoice and one delivered
// confirmation, nothing is left to send, and nothing exists that should not.
func (s *system) waitExactlyOnce(t *testing.T, want int64, timeout time.Duration) tally {
	t.Helper()
	var last tally
	testenv.Eventually(t, timeout, func() bool {
		last = s.tally(t)
		return last.orders == want && last.unsent == 0 &&
			last.invoices == int(want) && last.missingInvoice+last.extraInvoice == 0 &&
			last.notifications == int(want) && last.missingNotice+last.extraNotice == 0 &&
			last.sent == int(want) && last.mails == int(want) && last.duplicateMails == 0
	}, "system did not settle on exactly-once for %d orders", want)
	s.checkQueuesEmpty(t)
	return last
}

func (s *system) dumpOnFailure(t *testing.T) {
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("tally: %+v", s.tally(t))
		}
	})
}

// checkQueuesEmpty requires the consumers' queues to be empty (dead-letter queues aside, whose
// depth it returns).
func (s *system) checkQueuesEmpty(t *testing.T) (deadLettered int) {
	t.Helper()
	conn, err := amqp.Dial(s.amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for _, q := range []string{"invoicing", "notification"} {
		for _, name := range []string{q, q + ".dlq"} {
			ch, err := conn.Channel()
			if err != nil {
				t.Fatal(err)
			}
			info, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
			if err != nil {
				t.Fatalf("inspect %s: %v", name, err)
			}
			_ = ch.Close()
			if name == q && info.Messages != 0 {
				t.Fatalf("queue %s still holds %d messages", q, info.Messages)
			}
			if name != q {
				deadLettered += info.Messages
			}
		}
	}
	return deadLettered
}

// duplicatesSuppressed sums inbox_duplicates_total over the running consumer replicas.
func (s *system) duplicatesSuppressed(t *testing.T) int {
	t.Helper()
	total := 0
	for _, c := range append(append([]*service{}, s.invoicers...), s.notifiers...) {
		resp, err := http.Get(c.url + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for line := range strings.SplitSeq(string(body), "\n") {
			if strings.HasPrefix(line, "inbox_duplicates_total{") {
				var n float64
				fmt.Sscan(line[strings.LastIndex(line, " ")+1:], &n)
				total += int(n)
			}
		}
	}
	return total
}

// load places n orders from workers concurrent clients, spread over the order replicas, and
// returns the ids of those answered 201; any other answer fails the test.
func (s *system) load(t *testing.T, n, workers int) []uuid.UUID {
	t.Helper()
	ids := make(chan uuid.UUID, n)
	next := make(chan int, n)
	for i := range n {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range next {
				ids <- s.orders[i%len(s.orders)].placeOrderAt(t, fmt.Sprintf("load-%d", i))
			}
		})
	}
	wg.Wait()
	close(ids)
	var out []uuid.UUID
	for id := range ids {
		out = append(out, id)
	}
	return out
}

func decodeJSON(resp *http.Response, v any) error { return json.NewDecoder(resp.Body).Decode(v) }
