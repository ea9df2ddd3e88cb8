package bench

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/systest"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// Load and backlog of the cleanup figure: the steady rate of the latency figure, far below the
// POST ceiling (about 1,200 req/s here) so that the service keeps up on a noisy machine (at
// 500/s, with the machine's load average near 20, it did not: p99 5 s, with or without the
// cleanup), and a backlog that keeps the cleanup busy for seconds.
const (
	cleanupPostRate = 200
	cleanupBacklog  = 2_000_000
)

// postLatencyDuringCleanup: POST /orders at a steady rate against the order service alone (its
// relay included), p99 while the cleanup deletes a backlog of sent rows, next to p99 of the
// same load for 10 s just before, after 2 s of it unmeasured. The cleanup runs in this process
// on the order database, as the replica that holds the cleanup lock would; the service's own ran
// at its start, before the backlog was there.
func postLatencyDuringCleanup(t *testing.T, r *report, binDir string) {
	t.Helper()
	sys := systest.Start(t, systest.Options{BinDir: binDir, DirectBroker: true, DiscardLogs: true})
	sys.Invoicing.Stop(t)
	sys.Notification.Stop(t)
	db := sys.Order.DB.DB
	// Sent 10 to 8 days ago, with ids of their time and the payload of a real order.
	backlog := fmt.Sprintf(`INSERT INTO outbox_messages (id, type, payload, occurred_at, processed_at)
		SELECT %s, 'OrderPlaced', ?, ts, ts + interval '50 ms'
		FROM generate_series(1, %d) g, LATERAL (SELECT now() - interval '10 days' + g * interval '%f ms' AS ts) t`,
		testenv.UUIDv7SQL("ts", "g"), cleanupBacklog, float64(2*24*time.Hour/time.Millisecond)/cleanupBacklog)
	if err := db.Exec(backlog, string(orderPlaced(t).Payload)).Error; err != nil {
		t.Fatal(err)
	}
	// Settled, as autovacuum would leave it, so that neither window pays for the insert.
	for _, q := range []string{"VACUUM ANALYZE outbox_messages", "CHECKPOINT"} {
		if err := db.Exec(q).Error; err != nil {
			t.Fatal(err)
		}
	}
	// The same load for 2 s first, unmeasured: a new service's first requests take up to 240 ms
	// and admission sheds some (16 to 36 here), which made the 10 s "before" measure the
	// service's start, not the steady load the cleanup is compared against.
	warm := make(chan struct{})
	time.AfterFunc(2*time.Second, func() { close(warm) })
	warmUp := postSteadily(sys.Order.URL, cleanupPostRate, warm)
	stop := make(chan struct{})
	time.AfterFunc(10*time.Second, func() { close(stop) })
	before := postSteadily(sys.Order.URL, cleanupPostRate, stop)

	type outcome struct {
		res  messaging.CleanupResult
		err  error
		took time.Duration
	}
	done := make(chan outcome, 1)
	cleaned := make(chan struct{})
	orderDB := sys.Order.DB.Driver(t).DB()
	go func() {
		defer close(cleaned)
		start := time.Now()
		res, err := messaging.DeleteSentOutboxMessages(context.Background(), orderDB, 7*24*time.Hour, messaging.CleanupOptions{})
		done <- outcome{res, err, time.Since(start)}
	}()
	got := postSteadily(sys.Order.URL, cleanupPostRate, cleaned)
	c := <-done
	if c.err != nil || c.res.Skipped || c.res.Deleted != cleanupBacklog {
		t.Fatalf("cleanup: %+v, %v; want all %d rows deleted", c.res, c.err, cleanupBacklog)
	}
	during, errs := got.split(http.StatusCreated)
	baseline, baseErrs := before.split(http.StatusCreated)
	p99, base := percentile(during, .99), percentile(baseline, .99)
	ratio := float64(p99) / float64(base)
	r.add(fmt.Sprintf("POST /orders p99 at %d/s while a cleanup deletes %d sent rows (%d batches, %.1f s; errors in the 2 s warm-up %s, before %s, during %s)",
		cleanupPostRate, cleanupBacklog, c.res.Batches, c.took.Seconds(), warmUp.errors(), before.errors(), got.errors()),
		p99.Round(100*time.Microsecond).String(), fmt.Sprintf("%s the 10 s before, no cleanup", base.Round(100*time.Microsecond)),
		fmt.Sprintf("%.2f", ratio), "≤ 2.00, 0 err after the warm-up, a second's requests each",
		// Too few samples would make either p99 meaningless (none at all, a ratio of 0).
		ratio <= 2 && baseErrs+errs == 0 && len(during) >= cleanupPostRate && len(baseline) >= cleanupPostRate)
}

// postSteadily posts orders to orderURL at perSecond, open loop (a request starts on time
// whatever the earlier ones are doing), until stop closes, and returns what they got.
func postSteadily(orderURL string, perSecond int, stop <-chan struct{}) *outcomes {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: 10 * time.Second}
	var got outcomes
	var wg sync.WaitGroup
	stopped := func() bool {
		select {
		case <-stop:
			return true
		default:
			return false
		}
	}
	paced(perSecond, stopped, func(due time.Time) { wg.Go(func() { postDue(client, orderURL, &got, due) }) })
	wg.Wait()
	return &got
}
