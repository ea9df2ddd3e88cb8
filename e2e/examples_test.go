package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// exampleConns is what an example opens at most: the relay's lanes and LISTEN, the
// subscription's workers and its database check, and main's own, with the defaults.
const exampleConns = 2 + 1 + 8 + 1 + 1

// buildExample builds examples/name, the program an adopter copies first, once for the tests
// that run it.
func buildExample(t *testing.T, name string) string {
	t.Helper()
	examplesBuilt.Lock()
	defer examplesBuilt.Unlock()
	bin := filepath.Join(binDir, "example-"+name)
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/outboxkit/outbox-inbox/examples/"+name).CombinedOutput(); err != nil {
		t.Fatalf("build examples/%s: %v\n%s", name, err, out)
	}
	return bin
}

// examplesBuilt serializes buildExample.
var examplesBuilt sync.Mutex

// exampleVhost is the test broker's URL for a vhost of t's own: the examples' exchanges and
// queues have fixed names.
func exampleVhost(t *testing.T) string {
	t.Helper()
	vhost := testenv.UniqueName("example")
	t.Cleanup(func() { testenv.RabbitMQCtlQuietly("delete_vhost", vhost) })
	testenv.RabbitMQCtl(t, "add_vhost", vhost)
	testenv.RabbitMQCtl(t, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
	return testenv.AMQPURL() + vhost
}

// Each example, as built from examples/, saves its event in its transaction, relays it, handles
// it once through the inbox (its work and the inbox row committed together) and exits 0.
func TestExamplesHandleTheirEventOnceAndExit(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, line, work string }{
		{"minimal", ` INFO hello name=world `, ""},
		{"databasesql", ` INFO invoiced order_id=`, "SELECT count(*) FROM invoices WHERE amount_cents = 2500"},
		{"gorm", ` INFO invoiced order_id=`, "SELECT count(*) FROM invoices WHERE amount_cents = 2500"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			testenv.Connections(t, 1+1+exampleConns)
			db := testenv.NewDatabaseWithPool(t, 1)
			bin := buildExample(t, c.name)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin)
			cmd.Env = append(cmd.Environ(), "DATABASE_URL="+db.URL, "AMQP_URL="+exampleVhost(t))
			out, err := systest.CombinedOutput(cmd)
			if err != nil {
				t.Fatalf("examples/%s: %v\n%s", c.name, err, out)
			}
			if n := strings.Count(string(out), c.line); n != 1 {
				t.Fatalf("examples/%s printed %q %d times, want once:\n%s", c.name, c.line, n, out)
			}
			if n := testenv.Count(t, db.DB, "SELECT count(*) FROM inbox_messages"); n != 1 {
				t.Fatalf("%d inbox rows, want 1", n)
			}
			if n := testenv.Count(t, db.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NOT NULL"); n != 1 {
				t.Fatalf("%d outbox rows sent, want 1", n)
			}
			if c.work != "" {
				if n := testenv.Count(t, db.DB, c.work); n != 1 {
					t.Fatalf("%q = %d, want 1", c.work, n)
				}
			}
		})
	}
}

// SIGTERM, what Docker and Kubernetes send, stops an example in order, as Ctrl-C does: it exits
// 0, not killed by the signal, while its relay and subscription wait for a broker that is away.
func TestExamplesStopInOrderOnSIGTERM(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"minimal", "databasesql", "gorm"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testenv.Connections(t, 1+1+exampleConns)
			db := testenv.NewDatabaseWithPool(t, 1)
			cmd := exec.Command(buildExample(t, name))
			cmd.Env = append(cmd.Environ(), "DATABASE_URL="+db.URL, "AMQP_URL=amqp://guest:guest@"+systest.FreeAddr(t)+"/")
			// Its event enqueued: it is past its start, relaying to nowhere.
			sigtermExitsZero(t, cmd, 30*time.Second, 15*time.Second, "its event enqueued", func(string) bool {
				var n int64
				return db.DB.Raw("SELECT count(*) FROM outbox_messages").Scan(&n).Error == nil && n == 1
			})
		})
	}
}
