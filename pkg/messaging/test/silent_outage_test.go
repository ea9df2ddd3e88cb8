package test

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/binary"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// Two replicas in an outage their probes cannot see (the broker takes the messages, keeps the
// connection up and confirms nothing, as a quorum queue without its majority does), over the
// only due row, stay in it: a trial that finds the row the other replica's trial holds (SKIP
// LOCKED skips it) asks whether a row is due all the same, and goes on. The outage ended there,
// the replica's next whole batch claimed the row once let go and began a new one, while the
// other's trial found the row locked in turn: the outages ended and began by turns (a dozen in
// 5 s), none lasting long enough for BrokerUnavailable to fire. Once the row is parked, none is
// due, and the next trials end both outages.
func TestTwoRelaysStayInTheOutageOfTheOnlyDueRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	url := confirmlessBroker(t)
	id := b.enqueue(t, 1)[0]
	for range 2 {
		pub := b.publisher(t, url, func(c *messaging.PublisherConfig) { c.ConfirmTimeout = 500 * time.Millisecond })
		run(t, b.relay(t, pub, func(c *messaging.RelayConfig) {
			c.PollInterval = 50 * time.Millisecond
			c.BrokerRetry = messaging.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond}
		}).Run)
	}
	const paused, resumed = "broker unavailable; relay paused", "broker available again"
	testenv.Eventually(t, 15*time.Second, func() bool { return len(b.logs.Lines(paused)) >= 2 },
		"the row's whole batch failed on fewer than two relays: their outages did not both begin")
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if n, ended := len(b.logs.Lines(paused)), b.logs.Lines(resumed); n != 2 || len(ended) != 0 {
			t.Fatalf("%d outages began and %d ended over the one row the broker confirms nothing of, want 2 and none: %q",
				n, len(ended), ended)
		}
	}

	_, err := messaging.ParkOutboxMessage(context.Background(), b.drv.DB(), id, "its queue lost its majority")
	must(t, err)
	gauge := `outbox_relay_broker_up{exchange="` + b.exchange + `"}`
	testenv.Eventually(t, 10*time.Second, func() bool {
		return len(b.logs.Lines(resumed)) == 2 && hasMetric(t, b.registry, gauge+" 1")
	}, "the outages did not both end once the row was parked, no row due")
}

// The question a trial that claimed nothing asks, whether a row is due all the same, counts
// no row parked or backed off, and walks the claim's partial index under the claim's plan
// settings, stopping at the first due row, past the parked and backed-off rows at the head of
// the backlog, on a table without statistics as on one analyzed: a read of a few blocks, not of
// the backlog.
func TestAnyDueCountsOnlyDueRowsAndWalksTheClaimsIndex(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	db.MigrateLibrary(t)
	must(t, db.DB.Exec(`ALTER TABLE outbox_messages SET (autovacuum_enabled = off)`).Error)
	must(t, db.DB.Exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at, attempts, parked_at, next_attempt_at)
		SELECT gen_random_uuid(), 'OrderPlaced', '{}', now() - (200000 - g) * interval '1 millisecond', 1,
		       CASE WHEN g <= 1000 THEN now() END,
		       CASE WHEN g <= 1000 THEN 'infinity'::timestamptz ELSE now() + interval '1 hour' END
		FROM generate_series(1, 2000) g`).Error)
	anyDue := func() bool {
		t.Helper()
		var due bool
		must(t, db.DB.Raw(statements.AnyDue).Scan(&due).Error)
		return due
	}
	if anyDue() {
		t.Fatal("AnyDue counts a parked or backed-off row as due")
	}
	must(t, db.DB.Exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at)
		SELECT gen_random_uuid(), 'OrderPlaced', jsonb_build_object('n', g), now() - (100000 - g) * interval '1 millisecond'
		FROM generate_series(1, 100000) g`).Error)
	if !anyDue() {
		t.Fatal("AnyDue finds no row due among 100,000")
	}
	tableBlocks := testenv.Count(t, db.DB, "SELECT pg_relation_size('outbox_messages') / current_setting('block_size')::int")
	for _, analyzed := range []bool{false, true} {
		if analyzed {
			must(t, db.DB.Exec("ANALYZE outbox_messages").Error)
		}
		plan := explainRolledBack(t, db.DB, func(ctx context.Context, tx *sql.Tx) (string, error) {
			if _, err := tx.ExecContext(ctx, statements.ClaimPlan); err != nil {
				return "", err
			}
			var out string
			err := tx.QueryRowContext(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+statements.AnyDue).Scan(&out)
			return out, err
		})
		scan := plan.find("Index Scan")
		if scan == nil || scan.IndexName != "outbox_messages_unprocessed_idx" || plan.find("Sort") != nil {
			t.Fatalf("analyzed %t: AnyDue's plan is %s; want the claim's partial index walked", analyzed, strings.Join(plan.nodes(), ", "))
		}
		// The 2,000 rows at the head fill some 30 heap blocks; a few index blocks lead to them.
		if n := plan.buffers(); n > 100 {
			t.Fatalf("analyzed %t: AnyDue read %d buffers of a table of %d blocks: more than the rows at its head", analyzed, n, tableBlocks)
		}
		t.Logf("analyzed %t: %s, %d buffers (the table has %d blocks)", analyzed, strings.Join(plan.nodes(), ", "), plan.buffers(), tableBlocks)
	}
}

// confirmlessBroker is a proxy to the test's broker that passes everything on, both ways, but
// the broker's confirms (basic.ack, basic.nack), on every connection: a broker that takes the
// messages, keeps the connection up (its heartbeats pass) and confirms nothing, a new
// connection's messages neither, as a quorum queue without its majority. It returns the URL to
// dial.
func confirmlessBroker(t *testing.T) string {
	t.Helper()
	ln := forward(t, testenv.AMQPHost(t), func(client, server net.Conn) {
		go copyThenClose(server, client) // until the client closes
		go func() {
			withoutConfirms(client, server)
			_ = client.Close()
		}()
	})
	return testenv.AMQPURLVia(t, ln.Addr().String())
}

// withoutConfirms copies the frames server sends to client, but for the methods basic.ack and
// basic.nack, until either ends.
func withoutConfirms(client io.Writer, server io.Reader) {
	const (
		methodFrame         = 1
		basic               = 60
		basicAck, basicNack = 80, 120
		methodLen           = 4 // a method's class and method ids
	)
	r := bufio.NewReader(server)
	for {
		frame, err := readFrame(r)
		if err != nil {
			return
		}
		if frame[0] == methodFrame && len(frame) > frameHeaderLen+methodLen {
			class, method := binary.BigEndian.Uint16(frame[7:9]), binary.BigEndian.Uint16(frame[9:11])
			if class == basic && (method == basicAck || method == basicNack) {
				continue
			}
		}
		if _, err := client.Write(frame); err != nil {
			return
		}
	}
}
