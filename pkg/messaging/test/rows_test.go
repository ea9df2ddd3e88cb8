package test

import (
	"context"
	"strings"
	"testing"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/pgxdriver"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/sqldriver"
)

// Every adapter's Rows report, once Next has returned false, an error the server sent after a
// row (the contract of Rows that the library's one-row queries rely on): here a division by
// zero in the second row.
func TestRowsReportAnErrorTheServerSentAfterARow(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1+2*driverPool)
	d := testenv.NewDatabase(t)
	testenv.Draw(t, 1)
	pool := newPgxPool(t, d.URL, 1)
	defer pool.Close()
	for _, c := range []struct {
		name string
		db   messaging.DB
	}{
		{"pgxdriver", pgxdriver.New(pool).DB()},
		{"sqldriver over pgx's stdlib", sqldriver.New(openSQLWith(t, "pgx", d.URL)).DB()},
		{"sqldriver over lib/pq", sqldriver.New(openSQLWith(t, "postgres", d.URL)).DB()},
		{"gormdriver", d.Driver(t).DB()},
	} {
		rows, err := c.db.Query(context.Background(), `SELECT 1 / x FROM (VALUES (1), (0)) AS v(x)`)
		must(t, err)
		var first int
		if !rows.Next() || rows.Scan(&first) != nil || first != 1 {
			t.Errorf("%s: no first row of 1 (%v)", c.name, rows.Err())
		}
		if rows.Next() {
			t.Errorf("%s: a second row", c.name)
		}
		if err := rows.Err(); err == nil || !strings.Contains(err.Error(), "division by zero") {
			t.Errorf("%s: Err after the rows = %v, want the division by zero", c.name, err)
		}
		rows.Close()
	}
}
