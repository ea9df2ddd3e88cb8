package e2e

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// An example started without DATABASE_URL or AMQP_URL, or with one blank, or with an AMQP_URL
// of which a URL does not parse, exits 1 naming it, having written nothing: pgx takes an empty
// DATABASE_URL for a local default, and an example needs the broker only after it has saved
// its event.
func TestExamplesRefuseAMissingURLBeforeWritingAnything(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"minimal", "databasesql", "gorm"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testenv.Connections(t, 1+1) // the test's database; an example refuses before it connects
			db := testenv.NewDatabaseWithPool(t, 1)
			bin := buildExample(t, name)
			// The local default pgx would reach without DATABASE_URL is a closed port here, so
			// that an example which went on to it writes to no real database.
			host, port, err := net.SplitHostPort(systest.FreeAddr(t))
			if err != nil {
				t.Fatal(err)
			}
			noDatabase := []string{"PGHOST=" + host, "PGPORT=" + port}
			noBroker := "AMQP_URL=amqp://guest:guest@" + systest.FreeAddr(t) + "/"
			for _, c := range []struct {
				variable string
				env      []string
			}{
				{"AMQP_URL", []string{"DATABASE_URL=" + db.URL}},
				{"AMQP_URL", []string{"DATABASE_URL=" + db.URL, "AMQP_URL= "}},
				{"AMQP_URL", []string{"DATABASE_URL=" + db.URL, "AMQP_URL=http://guest:guest@" + systest.FreeAddr(t) + "/"}},
				{"AMQP_URL", []string{"DATABASE_URL=" + db.URL, "AMQP_URL=" + strings.TrimPrefix(noBroker, "AMQP_URL=") + ",amqp://guest:p%zz@broker/"}},
				{"DATABASE_URL", append([]string{noBroker}, noDatabase...)},
				{"DATABASE_URL", append([]string{noBroker, "DATABASE_URL= "}, noDatabase...)},
			} {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				cmd := exec.CommandContext(ctx, bin)
				cmd.Env = append([]string{"PATH=/usr/bin:/bin"}, c.env...)
				var stderr bytes.Buffer
				cmd.Stderr = &stderr
				exited, err := systest.StartProcess(cmd) // dies with the test binary
				if err == nil {
					err = <-exited
				}
				cancel()
				var exit *exec.ExitError
				if !errors.As(err, &exit) || exit.ExitCode() != 1 {
					t.Errorf("examples/%s with %q: %v, want exit status 1", name, c.env, err)
				}
				if !strings.Contains(stderr.String(), c.variable) {
					t.Errorf("examples/%s with %q printed %q on stderr, want an error naming %s", name, c.env, stderr.String(), c.variable)
				}
			}
			const tables = "SELECT count(*) FROM information_schema.tables WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
			if n := testenv.Count(t, db.DB, tables); n != 0 {
				t.Fatalf("examples/%s created %d tables before it failed, want none", name, n)
			}
		})
	}
}
