package messaging

import (
	"encoding/json"
	"errors"
	"testing"

	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// planNode is the part of EXPLAIN (FORMAT JSON) the claim's checks read.
type planNode struct {
	NodeType  string     `json:"Node Type"`
	IndexName string     `json:"Index Name"`
	HitBlocks int        `json:"Shared Hit Blocks"`
	ReadBlock int        `json:"Shared Read Blocks"`
	Plans     []planNode `json:"Plans"`
}

func (n planNode) buffers() int { return n.HitBlocks + n.ReadBlock }

func (n planNode) find(nodeType string) *planNode {
	if n.NodeType == nodeType {
		return &n
	}
	for _, c := range n.Plans {
		if f := c.find(nodeType); f != nil {
			return f
		}
	}
	return nil
}

var errRollback = errors.New("rollback")

// explainClaim runs the relay's claim under EXPLAIN (ANALYZE, BUFFERS) in a transaction that
// is rolled back. Guarded, the relay's own claim of one row runs first in that transaction, with
// whatever settings it makes for its claims.
func explainClaim(t *testing.T, db *gorm.DB, guarded bool) planNode {
	t.Helper()
	return explainRolledBack(t, db, func(tx *gorm.DB) (string, error) {
		if guarded {
			if _, err := (&Relay{cfg: RelayConfig{BatchSize: 1}}).claim(tx); err != nil {
				return "", err
			}
		}
		var out string
		err := tx.Raw("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+claimSQL, 500).Row().Scan(&out)
		return out, err
	})
}

// explainRolledBack runs explain, which returns an EXPLAIN (FORMAT JSON) result, in a
// transaction that is rolled back, and returns the plan's root.
func explainRolledBack(t *testing.T, db *gorm.DB, explain func(tx *gorm.DB) (string, error)) planNode {
	t.Helper()
	var out string
	err := db.Transaction(func(tx *gorm.DB) error {
		var err error
		if out, err = explain(tx); err != nil {
			return err
		}
		return errRollback
	})
	if !errors.Is(err, errRollback) {
		t.Fatal(err)
	}
	var plans []struct{ Plan planNode }
	if err := json.Unmarshal([]byte(out), &plans); err != nil || len(plans) != 1 {
		t.Fatalf("parse plan %s: %v", out, err)
	}
	return plans[0].Plan
}

// A table the planner has no statistics for (a new deployment whose first minutes bring a
// burst) must not make the claim fetch and sort the whole backlog: it walks the partial index in
// order and reads the batch, whatever autovacuum did or did not do.
func TestClaimReadsTheBatchNotTheBacklogWithoutStatistics(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	db.Migrate(t, MigrateOutbox)
	for _, q := range []string{
		`ALTER TABLE outbox_messages SET (autovacuum_enabled = off)`,
		`INSERT INTO outbox_messages (id, type, payload, occurred_at)
		 SELECT gen_random_uuid(), 'OrderPlaced',
		        jsonb_build_object('order_id', gen_random_uuid(), 'customer_id', 'c-42', 'total_cents', g),
		        now() - (100000 - g) * interval '1 millisecond'
		 FROM generate_series(1, 100000) g`,
	} {
		if err := db.DB.Exec(q).Error; err != nil {
			t.Fatal(err)
		}
	}
	if n := testenv.Count(t, db.DB, "SELECT count(*) FROM pg_stats WHERE tablename = 'outbox_messages'"); n != 0 {
		t.Fatalf("the table has statistics (%d columns): the test needs a table never analyzed", n)
	}
	tableBlocks := testenv.Count(t, db.DB, "SELECT pg_relation_size('outbox_messages') / current_setting('block_size')::int")

	unguarded := explainClaim(t, db.DB, false)
	t.Logf("claim without the plan setting: sort=%v, %d buffers (the table has %d blocks)",
		unguarded.find("Sort") != nil, unguarded.buffers(), tableBlocks)

	// The scan is what reads; locking then touches each claimed row once more (twice on a page
	// that vacuum marked all-visible: the lock clears the mark).
	plan := explainClaim(t, db.DB, true)
	scan := plan.find("Index Scan")
	if plan.find("Sort") != nil || scan == nil || scan.IndexName != "outbox_messages_unprocessed_idx" {
		t.Fatalf("claim plan sorts or does not walk the partial index: %+v", plan)
	}
	// 500 rows of about 200 bytes fill some 15 heap blocks; a few index blocks lead to them.
	const batchBlocks = 60
	if b := scan.buffers(); b > batchBlocks {
		t.Fatalf("the claim's scan read %d buffers for a batch of 500 out of %d blocks: more than the batch", b, tableBlocks)
	}
	t.Logf("claim with the plan setting: index scan of %d buffers, %d with the row locks", scan.buffers(), plan.buffers())

	// A long drain between vacuums: the sent rows leave dead entries at the head of the
	// partial index, which every claim steps over until vacuum removes them.
	if err := db.DB.Exec(`UPDATE outbox_messages SET processed_at = now()
		WHERE id IN (SELECT id FROM outbox_messages ORDER BY occurred_at, id LIMIT 50000)`).Error; err != nil {
		t.Fatal(err)
	}
	first, second := explainClaim(t, db.DB, true), explainClaim(t, db.DB, true)
	if first.find("Sort") != nil || second.find("Sort") != nil {
		t.Fatal("the claim sorts after the drain")
	}
	t.Logf("after 50,000 rows sent without a vacuum: the first claim's scan reads %d buffers, the next %d (the first marks the dead entries)",
		first.find("Index Scan").buffers(), second.find("Index Scan").buffers())
	if err := db.DB.Exec("VACUUM outbox_messages").Error; err != nil {
		t.Fatal(err)
	}
	vacuumed := explainClaim(t, db.DB, true).find("Index Scan")
	if vacuumed == nil || vacuumed.buffers() > batchBlocks {
		t.Fatalf("after vacuum the claim's scan is %+v", vacuumed)
	}
	t.Logf("after VACUUM: the scan reads %d buffers", vacuumed.buffers())
}
