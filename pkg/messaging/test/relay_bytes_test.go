package test

import (
	"context"
	"database/sql"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/pgxdriver"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/sqldriver"
)

// bigPayload is a JSON string of about 1,000,000 bytes: under the publisher's default
// MaxMessageBytes (1 MiB), and printed back by jsonb as given.
const bigPayload = 1_000_000

// enqueueBig commits n messages of bigPayload bytes, oldest first, and returns their ids.
func (b *testBundle) enqueueBig(t *testing.T, n int) []uuid.UUID {
	t.Helper()
	var ids []uuid.UUID
	for i := range n {
		m := newMessage(t, i)
		m.Payload = json.RawMessage(`"` + strings.Repeat("a", bigPayload-2) + `"`)
		if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, m) }); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, m.ID)
	}
	return ids
}

// relayDBs are the relay's database on each driver: the bundle's GORM pool, pgx's, and
// database/sql's over pgx's stdlib and over lib/pq.
func relayDBs(t *testing.T, b *testBundle) map[string]messaging.DB {
	t.Helper()
	open := func(driver string) *sql.DB {
		db, err := sql.Open(driver, b.db.URL)
		if err != nil {
			t.Fatal(err)
		}
		db.SetMaxOpenConns(2)
		t.Cleanup(func() { _ = db.Close() })
		return db
	}
	testenv.Draw(t, 6)
	pool := newPgxPool(t, b.db.URL, 2)
	t.Cleanup(pool.Close)
	return map[string]messaging.DB{
		"gorm":     b.drv.DB(),
		"pgx":      pgxdriver.New(pool).DB(),
		"sql(pgx)": sqldriver.New(open("pgx")).DB(),
		"sql(pq)":  sqldriver.New(open("postgres")).DB(),
	}
}

// A batch keeps the oldest rows while their payloads add up to MaxBatchBytes: of three rows
// of 1 MB, a bound of 2.5 MB keeps two, on every driver. The third, claimed and left, is
// neither marked nor charged, and the transaction, its cursor closed early, commits the
// marks of the two. The next batch sends it.
func TestRelayBatchKeepsRowsUpToMaxBatchBytes(t *testing.T) {
	t.Parallel()
	b := setupWith(t, 6)
	for name, db := range relayDBs(t, b) {
		ids := b.enqueueBig(t, 3)
		r := b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) {
			c.DB, c.MaxBatchBytes = db, bigPayload*5/2
		})
		res, err := r.ProcessBatch(context.Background())
		if err != nil || res != (messaging.BatchResult{Claimed: 2, Sent: 2}) {
			t.Fatalf("%s: batch = %+v, %v; want the 2 oldest rows claimed and sent", name, res, err)
		}
		var row outboxRow
		if err := b.db.DB.First(&row, "id = ?", ids[2]).Error; err != nil {
			t.Fatal(err)
		}
		if row.ProcessedAt != nil || row.Attempts != 0 || row.LastError != nil {
			t.Fatalf("%s: the row past the bound is %+v; want it unsent and uncharged", name, row)
		}
		if n := b.unprocessed(t); n != 1 {
			t.Fatalf("%s: %d rows unsent, want the 1 past the bound", name, n)
		}
		res, err = r.ProcessBatch(context.Background())
		if err != nil || res != (messaging.BatchResult{Claimed: 1, Sent: 1}) {
			t.Fatalf("%s: next batch = %+v, %v; want the row left behind sent", name, res, err)
		}
		assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
	}
}

// A row over the bound goes alone: the claim always keeps its first row.
func TestRelaySendsARowOverMaxBatchBytesAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.enqueueBig(t, 2)
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) { c.MaxBatchBytes = bigPayload / 2 })
	for i := range 2 {
		res, err := r.ProcessBatch(context.Background())
		if err != nil || res != (messaging.BatchResult{Claimed: 1, Sent: 1}) {
			t.Fatalf("batch %d = %+v, %v; want one row over the bound claimed and sent", i, res, err)
		}
	}
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
}

// A relay whose batches the bound cuts drains the backlog without waiting for the poll, an
// hour away (and no NOTIFY): a batch cut by bytes is taken for a full one.
func TestRelayDrainsBatchesCutByMaxBatchBytesWithoutThePoll(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.enqueueBig(t, 7)
	sender := &batchSizes{Sender: b.publisher(t, testenv.AMQPURL())}
	r := b.relay(t, sender, func(c *messaging.RelayConfig) {
		c.MaxBatchBytes, c.PollInterval, c.DisableNotify = bigPayload*5/2, time.Hour, true
	})
	run(t, r.Run)
	b.waitAllSent(t, 15*time.Second)
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
	sender.mu.Lock()
	defer sender.mu.Unlock()
	for i, n := range sender.sizes {
		if n > 2 {
			t.Errorf("batch %d of %v published %d rows of 1 MB, over the bound of 2.5 MB", i, sender.sizes, n)
		}
	}
}

// batchSizes records the size of each batch it publishes.
type batchSizes struct {
	messaging.Sender
	mu    sync.Mutex
	sizes []int
}

func (s *batchSizes) Publish(ctx context.Context, msgs []messaging.Message) []error {
	s.mu.Lock()
	s.sizes = append(s.sizes, len(msgs))
	s.mu.Unlock()
	return s.Sender.Publish(ctx, msgs)
}
