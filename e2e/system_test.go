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
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/google/uuid"

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
	db   *testenv.Database
	logs *testenv.Logs
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// system is the three services, each with its own database, on a private RabbitMQ vhost that
// they reach through a proxy (stop it and the broker is gone for them), with a mail server.
type system struct {
	order, invoicing, notification *service
	broker                         *toxiproxy.Proxy
	mail                           *testenv.SMTPServer
	vhost                          string
}

func startSystem(t *testing.T, extraEnv map[string][]string) *system {
	t.Helper()
	s := &system{vhost: testenv.UniqueName("e2e")}
	testenv.RabbitMQCtl(t, "add_vhost", s.vhost)
	t.Cleanup(func() { _ = exec.Command("rabbitmqctl", "delete_vhost", s.vhost).Run() })
	testenv.RabbitMQCtl(t, "set_permissions", "-p", s.vhost, "guest", ".*", ".*", ".*")
	s.broker = testenv.Proxy(t, testenv.AMQPHost(t))
	amqpURL := testenv.AMQPURLVia(t, s.broker.Listen) + s.vhost
	s.mail = testenv.NewSMTPServer(t)
	s.mail.Start()

	env := func(name string, extra ...string) []string {
		return append(append([]string{"AMQP_URL=" + amqpURL, "LOG_LEVEL=debug"}, extraEnv[name]...), extra...)
	}
	// Consumers first: their queues must exist before the first order is relayed.
	s.invoicing = startService(t, "invoicing", env("invoicing"))
	s.notification = startService(t, "notification", env("notification", "SMTP_ADDR="+s.mail.Addr))
	s.order = startService(t, "order", env("order"))
	return s
}

func startService(t *testing.T, name string, env []string) *service {
	t.Helper()
	s := &service{name: name, db: testenv.NewDatabase(t), done: make(chan struct{})}
	addr := freeAddr(t)
	s.url = "http://" + addr
	_, s.logs = testenv.NewLogger(t)
	s.cmd = exec.Command(filepath.Join(binDir, name))
	s.cmd.Env = append(os.Environ(), append([]string{"DATABASE_URL=" + s.db.URL, "HTTP_ADDR=" + addr}, env...)...)
	s.cmd.Stdout, s.cmd.Stderr = s.logs, s.logs
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() { s.err = s.cmd.Wait(); close(s.done) }()
	t.Cleanup(func() { s.stop(t) })
	testenv.Eventually(t, 30*time.Second, func() bool { return s.status(t, "/readyz") == 200 }, "%s not ready", name)
	return s
}

// stop sends SIGTERM and requires a clean exit within 10 s (CONTRACT.md).
func (s *service) stop(t *testing.T) {
	t.Helper()
	select {
	case <-s.done:
		return
	default:
	}
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

// placeOrder posts an order and returns its id; it fails the test unless the answer is 201.
func (s *system) placeOrder(t *testing.T, customer string) uuid.UUID {
	t.Helper()
	body := fmt.Sprintf(`{"customer_id": %q, "lines": [{"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250}]}`, customer)
	resp, err := http.Post(s.order.url+"/orders", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST /orders = %d %s", resp.StatusCode, out)
	}
	var o struct {
		ID uuid.UUID `json:"id"`
	}
	if err := json.Unmarshal(out, &o); err != nil {
		t.Fatal(err)
	}
	return o.ID
}

// tally is what the system holds, to compare with what it should.
type tally struct {
	orders, unsent                       int64
	invoices, notifications, sent, mails int
	missingInvoice, extraInvoice         int
	missingNotice, extraNotice           int
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
	r.mails = len(s.mail.Mail())
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
			last.sent == int(want) && last.mails == int(want)
	}, "system did not settle on exactly-once for %d orders", want)
	return last
}

func (s *system) dumpOnFailure(t *testing.T) {
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("tally: %+v", s.tally(t))
		}
	})
}
