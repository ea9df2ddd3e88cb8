package test

import (
	"context"
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/pgxdriver"
)

// The migrations look for their tables in the schema they create them in, current_schema(),
// not along the whole search_path: a service whose own schema comes first on its path gets
// tables of its own there, not those another service migrated into public, later on the path.
func TestMigrationsCreateTheTablesInTheCurrentSchemaNotOneLaterOnThePath(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1) // the second service's pool
	d := testenv.NewDatabase(t)
	d.MigrateLibrary(t) // the first service's, in public
	must(t, d.DB.Exec("CREATE SCHEMA billing").Error)
	pool := billingPool(t, d.URL)

	ctx := context.Background()
	must(t, messaging.MigrateOutbox(ctx, pgxdriver.New(pool).DB()))
	must(t, messaging.MigrateInbox(ctx, pgxdriver.New(pool).DB()))
	for _, table := range []string{"messaging_outbox_schema", "outbox_messages", "messaging_inbox_schema", "inbox_messages"} {
		if n := testenv.Count(t, d.DB, "SELECT count(*) FROM pg_tables WHERE schemaname = 'billing' AND tablename = ?", table); n != 1 {
			t.Errorf("no billing.%s: the migrations took public's for the second service's", table)
		}
	}
}

// billingPool is a pool of one connection to the database at dbURL whose sessions have schema
// billing first on their search_path, public after it: a second service's, beside one in
// public. It draws its connection from the test's budget, and closes with t.
func billingPool(t *testing.T, dbURL string) *pgxpool.Pool {
	t.Helper()
	u, err := url.Parse(dbURL)
	must(t, err)
	q := u.Query()
	q.Set("search_path", "billing,public")
	u.RawQuery = q.Encode()
	testenv.Draw(t, 1)
	pool := newPgxPool(t, u.String(), 1)
	t.Cleanup(pool.Close)
	return pool
}
