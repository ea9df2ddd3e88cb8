package messaging

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
)

const mib = 1 << 20

// A batch keeps the oldest rows while their payloads add up to no more than MaxBatchBytes: of
// three rows of 1 MiB, a bound of 2.5 MiB keeps two. The third, which the claim locked and
// read, is left as it was, unsent and uncharged, and free once the batch commits: the next
// batch takes it. Without the bound, a relay held BatchSize rows in each lane, whatever their
// size, and one under a memory limit was killed, claimed the same rows at its restart, and
// was killed again.
func TestABatchKeepsRowsUpToMaxBatchBytes(t *testing.T) {
	t.Parallel()
	db := newTableDB(mib, mib, mib)
	sender := &recordingSender{}
	r := newBytesRelay(t, db, sender, func(c *RelayConfig) { c.MaxBatchBytes = 5 * mib / 2 })

	res, err := r.ProcessBatch(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res != (BatchResult{Claimed: 2, Sent: 2}) {
		t.Fatalf("batch = %+v, want the 2 oldest rows claimed and sent", res)
	}
	if got, want := sender.batches(), [][]uuid.UUID{db.ids(0, 1)}; !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("published %v, want %v", got, want)
	}
	third := db.row(2)
	if third.sent || third.attempts != 0 || third.lockedBy != 0 {
		t.Fatalf("the row past the bound is sent %t, attempts %d, locked by %d; want it untouched, unsent and free",
			third.sent, third.attempts, third.lockedBy)
	}
	if n := db.cursorsOpen(); n != 0 {
		t.Fatalf("%d cursors left open", n)
	}

	res, err = r.ProcessBatch(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res != (BatchResult{Claimed: 1, Sent: 1}) {
		t.Fatalf("next batch = %+v, want the row left behind claimed and sent", res)
	}
	if got := sender.batches(); len(got) != 2 || !slices.Equal(got[1], db.ids(2)) {
		t.Fatalf("published %v, want the third row in a batch of its own", got)
	}
	if n := db.closedTwice(); n != 0 {
		t.Fatalf("%d cursors closed twice", n)
	}
}

// A row larger than the bound is kept all the same when it is the first: it goes alone, the
// rows behind it left for the next batch. One that would pass the bound behind a smaller row
// waits for the next batch, which it heads.
func TestARowLargerThanMaxBatchBytesGoesAlone(t *testing.T) {
	t.Parallel()
	db := newTableDB(2*mib, 2*mib, 100, 100, 3*mib, 100)
	sender := &recordingSender{}
	r := newBytesRelay(t, db, sender, func(c *RelayConfig) { c.MaxBatchBytes = mib })
	for range 5 {
		if _, err := r.ProcessBatch(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	want := [][]uuid.UUID{db.ids(0), db.ids(1), db.ids(2, 3), db.ids(4), db.ids(5)}
	if got := sender.batches(); !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("published %v, want %v: each row over the bound alone, in order", got, want)
	}
	if res, err := r.ProcessBatch(context.Background()); err != nil || res != (BatchResult{}) {
		t.Fatalf("batch = %+v, %v; want the outbox drained", res, err)
	}
}

// A lane whose batch the bytes bound cut claims the next at once, as after a full batch: it
// left due rows. Taken for a drained outbox (fewer rows than BatchSize), the rest of a backlog
// of large rows waited for the next poll, or NOTIFY, one batch of them a poll.
func TestALaneDrainsBatchesCutByBytesWithoutWaitingForThePoll(t *testing.T) {
	t.Parallel()
	db := newTableDB(mib, mib, mib, mib, mib, mib, mib)
	sender := &recordingSender{}
	r := newBytesRelay(t, db, sender, func(c *RelayConfig) {
		c.MaxBatchBytes, c.Lanes, c.PollInterval, c.DisableNotify = 5*mib/2, 1, time.Hour, true
	})
	stop := runRelay(t, r)
	defer stop()
	deadline := time.Now().Add(10 * time.Second) // the poll is an hour away
	for db.unsent() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d of 7 rows still unsent after 10 s, in batches %v: the lane waited for the poll after a batch cut by bytes",
				db.unsent(), sender.batches())
		}
		time.Sleep(10 * time.Millisecond)
	}
	for i, b := range sender.batches() {
		if len(b) > 2 {
			t.Errorf("batch %d published %d rows of 1 MiB, over the bound of 2.5 MiB", i, len(b))
		}
	}
}

// After a batch cut by bytes, a lane claims twice the rows that fit, not BatchSize: the server
// sends every row a claim locks, and the claim reads those past the bound off the connection
// for nothing (at the defaults, 500 rows of 1 MB for the 16 kept, again at each batch of a
// backlog of large rows: a relay drained 600 such rows 2.3 times slower than without the
// bound). Batches that come back full double it, up to BatchSize.
func TestALaneClaimsFewerRowsWhileBatchesAreCutByBytes(t *testing.T) {
	t.Parallel()
	sizes := []int{mib, mib, mib, mib, mib}
	for range 30 {
		sizes = append(sizes, 10)
	}
	db := newTableDB(sizes...)
	sender := &recordingSender{}
	r := newBytesRelay(t, db, sender, func(c *RelayConfig) {
		c.BatchSize, c.MaxBatchBytes, c.Lanes, c.PollInterval, c.DisableNotify = 8, 5*mib/2, 1, time.Hour, true
	})
	stop := runRelay(t, r)
	eventually(t, func() bool { return db.unsent() == 0 }, "%d rows unsent", db.unsent())
	stop()
	// 8: keeps 2 of 1 MiB, cut; 4: keeps 2, cut; 4: keeps 1 and 3 small rows, full; 8, 8, 8:
	// full; 8: finds the last 3.
	want := []int{8, 4, 4, 8, 8, 8, 8}
	if got := db.claimLimits(); !slices.Equal(got[:min(len(got), len(want))], want) {
		t.Fatalf("the claims asked for %v rows, want %v first; published %d batches", got, want, len(sender.batches()))
	}
}

// ProcessBatch in a loop (the services' last pass at a stop) claims fewer rows after a cut, as
// the lanes do, and BatchSize again once a claim finds fewer rows than it asked for: at the
// defaults, each call would otherwise read 500 rows of 1 MB off the connection for the 16 it
// keeps.
func TestProcessBatchClaimsFewerRowsAfterACut(t *testing.T) {
	t.Parallel()
	db := newTableDB(mib, mib, mib, mib, mib)
	r := newBytesRelay(t, db, &recordingSender{}, func(c *RelayConfig) { c.BatchSize, c.MaxBatchBytes = 8, 5*mib/2 })
	for range 10 {
		res, err := r.ProcessBatch(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if res.Claimed == 0 {
			break
		}
	}
	// 8: keeps 2, cut; 4: keeps 2, cut; 4: finds the last 1; 8: finds none.
	if got, want := db.claimLimits(), []int{8, 4, 4, 8}; !slices.Equal(got, want) {
		t.Fatalf("the claims asked for %v rows, want %v", got, want)
	}
}

// A lane's next claim: twice what a cut batch kept, twice a full one, BatchSize after one
// that drained; never more than BatchSize, nor less than a row, however large BatchSize.
func TestALanesNextClaimSize(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		batchSize, limit, claimed int
		cut                       bool
		want                      int
	}{
		{500, 500, 16, true, 32},
		{500, 32, 1, true, 2},
		{500, 32, 32, false, 64},
		{500, 256, 256, false, 500},
		{500, 300, 300, false, 500},
		{500, 500, 3, false, 500},
		{500, 4, 0, false, 500},
		{500, 400, 300, true, 500},
		{1, 1, 1, true, 1},
		{1, 1, 1, false, 1},
		{math.MaxInt, math.MaxInt/2 + 1, math.MaxInt/2 + 1, false, math.MaxInt},
		{math.MaxInt, math.MaxInt, math.MaxInt/2 + 1, true, math.MaxInt},
	} {
		r := &Relay{cfg: RelayConfig{BatchSize: tc.batchSize}}
		if got := r.nextSize(tc.limit, tc.claimed, tc.cut); got != tc.want {
			t.Errorf("BatchSize %d, a batch of up to %d that kept %d (cut %t): next claims %d, want %d",
				tc.batchSize, tc.limit, tc.claimed, tc.cut, got, tc.want)
		}
	}
}

// A claim cut by the bound closes its cursor before the publish, and a failure to read the
// rest of the rows (pgx reads them off the connection at Close, and reports a connection lost
// meanwhile in Err) fails the batch before any row goes to the broker: with the transaction
// lost, the rows could not be marked sent, and would all go again.
func TestACutClaimThatCannotReadItsRestPublishesNothing(t *testing.T) {
	t.Parallel()
	db := newTableDB(mib, mib, mib)
	db.closeErr = errors.New("conn closed")
	sender := &recordingSender{}
	r := newBytesRelay(t, db, sender, func(c *RelayConfig) { c.MaxBatchBytes = mib })
	if _, err := r.ProcessBatch(context.Background()); err == nil || !strings.Contains(err.Error(), "conn closed") {
		t.Fatalf("batch error %v, want the cursor's failure to read its rest", err)
	}
	if got := sender.batches(); len(got) != 0 {
		t.Fatalf("published %v after the claim failed", got)
	}
	if n := db.unsent(); n != 3 {
		t.Fatalf("%d rows unsent, want all 3", n)
	}
}

// MaxBatchBytes defaults to DefaultMaxBatchBytes, and a negative one is refused, by name.
func TestRelayConfigMaxBatchBytes(t *testing.T) {
	t.Parallel()
	cfg := RelayConfig{DB: failingDB{}, Sender: nopSender{}, Exchange: "x", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	for _, tc := range []struct{ set, want int }{{0, DefaultMaxBatchBytes}, {1, 1}, {64 * mib, 64 * mib}} {
		c := cfg
		c.MaxBatchBytes = tc.set
		r, err := NewRelay(c)
		if err != nil {
			t.Fatalf("MaxBatchBytes %d: %v", tc.set, err)
		}
		if r.cfg.MaxBatchBytes != tc.want {
			t.Errorf("MaxBatchBytes %d became %d, want %d", tc.set, r.cfg.MaxBatchBytes, tc.want)
		}
	}
	if DefaultMaxBatchBytes != enqueuePayloadBytes {
		t.Errorf("DefaultMaxBatchBytes is %d, want the largest payload Enqueue takes, %d", DefaultMaxBatchBytes, enqueuePayloadBytes)
	}
	c := cfg
	c.MaxBatchBytes = -1
	if _, err := NewRelay(c); err == nil || !strings.Contains(err.Error(), "MaxBatchBytes") {
		t.Fatalf("MaxBatchBytes -1: error %v, want one naming MaxBatchBytes", err)
	}
}

func newBytesRelay(t *testing.T, db DB, sender Sender, tweak func(*RelayConfig)) *Relay {
	t.Helper()
	cfg := RelayConfig{DB: db, Sender: sender, Exchange: "x", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	tweak(&cfg)
	r, err := NewRelay(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// recordingSender confirms every message, and records the ids of each batch.
type recordingSender struct {
	mu   sync.Mutex
	sent [][]uuid.UUID
}

func (s *recordingSender) Publish(_ context.Context, msgs []Message) []error {
	ids := make([]uuid.UUID, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sent = append(s.sent, ids)
	return make([]error, len(msgs))
}

func (s *recordingSender) batches() [][]uuid.UUID {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.sent)
}

// tableDB is an outbox in memory, with the claim's row locks: each Begin is a transaction,
// whose claim locks the due rows no other holds, oldest first, up to its limit (FOR UPDATE SKIP
// LOCKED), and returns them all, as the server sends them; its marks and backoffs apply at its
// commit, and its locks go at its end. Its cursors count what is read of them and how they are
// closed; closeErr, if set, is what a cursor closed before its end reports (a connection lost
// while the rest was read off it).
type tableDB struct {
	DB
	mu       sync.Mutex
	rows     []*tableRow
	txs      int
	closeErr error
	// open counts the cursors not closed, twice those closed twice.
	open, twice int
	limits      []int // each claim's

}

type tableRow struct {
	id       uuid.UUID
	payload  []byte
	attempts int
	sent     bool
	lockedBy int // the transaction holding it; 0: none
}

func newTableDB(sizes ...int) *tableDB {
	d := &tableDB{}
	for _, n := range sizes {
		d.rows = append(d.rows, &tableRow{id: uuid.New(), payload: bytes.Repeat([]byte("1"), n)})
	}
	return d
}

func (d *tableDB) Begin(context.Context) (TxExecutor, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.txs++
	return &tableTx{db: d, n: d.txs}, nil
}

func (d *tableDB) ids(at ...int) []uuid.UUID {
	d.mu.Lock()
	defer d.mu.Unlock()
	ids := make([]uuid.UUID, len(at))
	for i, a := range at {
		ids[i] = d.rows[a].id
	}
	return ids
}

func (d *tableDB) row(i int) tableRow {
	d.mu.Lock()
	defer d.mu.Unlock()
	return *d.rows[i]
}

func (d *tableDB) unsent() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, r := range d.rows {
		if !r.sent {
			n++
		}
	}
	return n
}

func (d *tableDB) claimLimits() []int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.limits)
}

func (d *tableDB) cursorsOpen() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.open
}

func (d *tableDB) closedTwice() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.twice
}

type tableTx struct {
	db      *tableDB
	n       int
	marked  []uuid.UUID
	refused []uuid.UUID
}

func (tx *tableTx) Exec(_ context.Context, sql string, args ...any) (int64, error) {
	switch sql {
	case statements.ClaimPlan:
		return 0, nil
	case statements.MarkSent:
		ids := parseUUIDArray(args[0].(string))
		tx.marked = append(tx.marked, ids...)
		return int64(len(ids)), nil
	}
	return 0, fmt.Errorf("tableDB: Exec %.30q", sql)
}

func (tx *tableTx) Query(_ context.Context, sql string, args ...any) (Rows, error) {
	d := tx.db
	switch sql {
	case statements.Claim, statements.ClaimBounded:
		d.mu.Lock()
		defer d.mu.Unlock()
		c := &tableCursor{db: d}
		d.limits = append(d.limits, args[0].(int))
		for _, r := range d.rows {
			if len(c.rows) == args[0].(int) {
				break
			}
			if !r.sent && r.lockedBy == 0 {
				r.lockedBy = tx.n
				c.rows = append(c.rows, []any{r.id, "T", slices.Clone(r.payload), "", time.Now(), r.attempts, "", "",
					(*string)(nil), (*string)(nil), (*string)(nil)})
			}
		}
		d.open++
		return c, nil
	case statements.RecordFailures:
		refused, err := refusals(args)
		if err != nil {
			return nil, err
		}
		rows := &valueRows{}
		for id := range refused {
			tx.refused = append(tx.refused, id)
			rows.rows = append(rows.rows, []any{id, time.Now()})
		}
		return rows, nil
	}
	return nil, fmt.Errorf("tableDB: Query %.30q", sql)
}

func (tx *tableTx) Commit(context.Context) error {
	d := tx.db
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, r := range d.rows {
		if slices.Contains(tx.marked, r.id) {
			r.sent = true
		}
		if slices.Contains(tx.refused, r.id) {
			r.attempts++
		}
	}
	tx.end()
	return nil
}

func (tx *tableTx) Rollback(context.Context) error {
	tx.db.mu.Lock()
	defer tx.db.mu.Unlock()
	tx.end()
	return nil
}

// end frees the transaction's rows; the caller holds db.mu.
func (tx *tableTx) end() {
	for _, r := range tx.db.rows {
		if r.lockedBy == tx.n {
			r.lockedBy = 0
		}
	}
}

// tableCursor is a claim's rows, as valueRows. Closed before its end, it reports db.closeErr.
type tableCursor struct {
	valueRows
	db           *tableDB
	done, closed bool
	err          error
}

func (c *tableCursor) Err() error { return c.err }

func (c *tableCursor) Close() {
	c.db.mu.Lock()
	defer c.db.mu.Unlock()
	if c.closed {
		c.db.twice++
		return
	}
	c.closed = true
	c.db.open--
	if !c.done { // the rest is read off the connection, and dropped
		c.err = c.db.closeErr
	}
}

func (c *tableCursor) Next() bool {
	if c.closed || c.done {
		return false
	}
	c.done = !c.valueRows.Next()
	return !c.done
}

func parseUUIDArray(s string) []uuid.UUID {
	var ids []uuid.UUID
	for _, id := range strings.Split(strings.Trim(s, "{}"), ",") {
		if id != "" {
			ids = append(ids, uuid.MustParse(id))
		}
	}
	return ids
}
