package test

import (
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A row committed while the relay's LISTEN connection is gone notifies no one: once the relay
// listens again, it looks for such rows at once instead of leaving them to its next poll (an
// hour away here).
func TestRelayLooksForRowsCommittedWhileItWasNotListening(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.runListeningRelay(t)
	const listening = "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND query LIKE 'LISTEN%'"
	var ids []uuid.UUID
	for attempt := 1; ids == nil; attempt++ {
		var pids []int64
		testenv.Eventually(t, 5*time.Second, func() bool {
			must(t, b.db.DB.Raw("SELECT pid FROM pg_stat_activity WHERE datname = ? AND query LIKE 'LISTEN%'", b.db.Name).Scan(&pids).Error)
			return len(pids) == 1
		}, "the relay is not listening, on one session")
		// pg_terminate_backend returns once the session is signalled, not ended: a row committed
		// before it is gone may still be heard. Its pid tells it gone, where a count of the
		// listening sessions may never see none: the relay listens again, on a new one, after its
		// reconnect delay, 0.4 s at least, time enough to commit a row that no one hears of.
		must(t, b.db.DB.Exec("SELECT pg_terminate_backend(?)", pids[0]).Error)
		testenv.Eventually(t, 5*time.Second, func() bool {
			return testenv.Count(t, b.db.DB, "SELECT count(*) FROM pg_stat_activity WHERE pid = ?", pids[0]) == 0
		}, "the relay's LISTEN session (pid %d) did not end", pids[0])
		enqueued := b.enqueue(t, 1)
		if testenv.Count(t, b.db.DB, listening, b.db.Name) == 0 {
			ids = enqueued // committed while no one listened
			continue
		}
		if attempt == 3 {
			t.Fatal("the relay listened again before each of 3 commits: no row was committed unheard")
		}
		b.waitAllSent(t, 5*time.Second) // heard: sent, and not the case under test
		testenv.Drain(t, b.ch, b.queue, 100*time.Millisecond)
	}
	b.waitAllSent(t, 5*time.Second)
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
}

// A full batch means more may wait: the lane claims the next one at once rather than at its
// next poll (an hour here). One commit of 50 rows notifies once; the relay takes them 10 at a
// time.
func TestRelayKeepsClaimingWhileItsBatchesComeBackFull(t *testing.T) {
	t.Parallel()
	b := setup(t)
	r := b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) {
		c.PollInterval, c.BatchSize, c.Lanes = time.Hour, 10, 1
	})
	run(t, r.Run)
	testenv.Eventually(t, 5*time.Second, func() bool {
		return testenv.Count(t, b.db.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND query LIKE 'LISTEN%'", b.db.Name) == 1
	}, "relay is not listening")
	ids := b.enqueue(t, 50)
	b.waitAllSent(t, 5*time.Second)
	assertExactlyOnce(t, testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond), ids)
}
