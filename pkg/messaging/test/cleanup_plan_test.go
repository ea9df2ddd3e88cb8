package test

import (
	"context"
	"database/sql"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

// explainBatch runs one cleanup batch (query with args, literals in SQL syntax) under EXPLAIN
// (ANALYZE, BUFFERS) in a transaction that is rolled back: with the batch's plan setting, as a
// prepared statement (as the driver's statement cache runs it) with the plan cache mode given.
func explainBatch(t *testing.T, db *gorm.DB, planCacheMode, query string, args ...any) planNode {
	t.Helper()
	return explainRolledBack(t, db, func(ctx context.Context, tx *sql.Tx) (string, error) {
		for _, q := range []string{statements.CleanupPlan, "SET LOCAL plan_cache_mode = " + planCacheMode, "PREPARE cleanup_batch AS " + query} {
			if _, err := tx.ExecContext(ctx, q); err != nil {
				return "", err
			}
		}
		params := ""
		for i, a := range args {
			if i > 0 {
				params += ", "
			}
			params += fmt.Sprintf("'%v'", a)
		}
		var out string
		if err := tx.QueryRowContext(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE cleanup_batch("+params+")").Scan(&out); err != nil {
			return "", err
		}
		// A prepared statement outlives the transaction: the pooled connection must not keep it.
		_, err := tx.ExecContext(ctx, "DEALLOCATE cleanup_batch")
		return out, err
	})
}

// checkBatchPlan fails t unless the batch walks index to find its rows and deletes them by
// their address: no plan that reads the whole table, whatever the statistics, and no sort (with
// sorts disabled, one would make the statement look so costly that it gets JIT-compiled).
func checkBatchPlan(t *testing.T, plan planNode, index string) {
	t.Helper()
	scan := plan.find("Index Scan")
	if plan.find("Seq Scan") != nil || plan.find("Hash Join") != nil || plan.find("Sort") != nil ||
		plan.find("Tid Scan") == nil || scan == nil || scan.IndexName != index {
		t.Errorf("batch plan does not walk %s and delete by ctid, or sorts: %+v", index, plan)
	}
}

// Each cleanup batch reads its rows through an index and deletes them by ctid, with or without
// statistics (a new deployment, or before autovacuum's first ANALYZE), as a custom or a generic
// plan (the driver prepares its statements, and the server may switch to a generic plan after
// five runs).
func TestCleanupBatchPlans(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	db.MigrateLibrary(t)
	for _, q := range []string{
		`ALTER TABLE outbox_messages SET (autovacuum_enabled = off)`,
		`ALTER TABLE inbox_messages SET (autovacuum_enabled = off)`,
		`INSERT INTO outbox_messages (id, type, payload, occurred_at, processed_at)
		 SELECT ` + testenv.UUIDv7SQL("ts", "g") + `, 'OrderPlaced', '{}', ts, ts + interval '50 ms'
		 FROM generate_series(1, 100000) g, LATERAL (SELECT now() - interval '14 days' + g * interval '12 s' AS ts) t`,
		`INSERT INTO inbox_messages (message_id, consumer, processed_at)
		 SELECT ` + testenv.UUIDv7SQL("ts", "g") + `, 'invoicing', ts
		 FROM generate_series(1, 100000) g, LATERAL (SELECT now() - interval '60 days' + g * interval '51.84 s' AS ts) t`,
	} {
		if err := db.DB.Exec(q).Error; err != nil {
			t.Fatal(err)
		}
	}
	var outboxCutoff, inboxCutoff time.Time
	if err := db.DB.Raw("SELECT now() - interval '7 days', now() - interval '30 days'").Row().Scan(&outboxCutoff, &inboxCutoff); err != nil {
		t.Fatal(err)
	}
	check := func(stats string) {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			t.Run(stats+"/"+mode, func(t *testing.T) {
				checkBatchPlan(t, explainBatch(t, db.DB, mode, statements.DeleteSentOutboxBatch,
					uuid.Nil, v7Bound(outboxCutoff), outboxCutoff.Format(time.RFC3339Nano), 1000), "outbox_messages_pkey")
				checkBatchPlan(t, explainBatch(t, db.DB, mode, statements.DeleteInboxBatch,
					time.Time{}.Format(time.RFC3339Nano), inboxCutoff.Format(time.RFC3339Nano), 1000), "inbox_messages_processed_at_idx")
			})
		}
	}
	check("no statistics")
	if err := db.DB.Exec("ANALYZE outbox_messages, inbox_messages").Error; err != nil {
		t.Fatal(err)
	}
	check("analyzed")
}

// v7Bound is the first UUIDv7 of the millisecond after t's, the bound a cleanup of the rows
// sent before t passes to its batches.
func v7Bound(t time.Time) uuid.UUID {
	var id uuid.UUID
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(t.UnixMilli()+1))
	copy(id[:6], ms[2:])
	return id
}
