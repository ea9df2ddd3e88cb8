package platform

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

var outboxGauge = regexp.MustCompile(`(?m)^(# TYPE )?(outbox_pending_messages|outbox_oldest_pending_age_seconds|outbox_max_attempts)\b`)

var statsErrors = regexp.MustCompile(`(?m)^outbox_stats_errors_total (\S+)$`)

// statsErrorCount reads outbox_stats_errors_total from a scrape.
func statsErrorCount(t *testing.T, body string) float64 {
	t.Helper()
	m := statsErrors.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("the scrape has no outbox_stats_errors_total:\n%s", body)
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// A backlog query stuck behind a lock costs the scrape its outbox gauges, and nothing else:
// the scrape is served at once, with the error counted, the query is cancelled by the server
// rather than left waiting, overlapping scrapes share one query, and the gauges come back
// with the table.
func TestMetricsOutliveAStuckBacklogQuery(t *testing.T) {
	const conns = 7                 // the readiness check, the relay's lane, LISTEN and gauges, the cleanup, requests 2
	testenv.Connections(t, 3+conns) // the database's creation, the test's handle (2), the service
	d := testenv.NewDatabaseWithPool(t, 2)
	relaying := RelaySettings{BatchSize: 10, Lanes: 1, PollInterval: time.Second, MaxBackoff: time.Minute, Retention: time.Hour}
	b, logs := startBase(t, d, conns, PoolsOf(&relaying, nil, 0), Library(messaging.MigrateOutbox))
	outbox, err := b.Outbox(b.log, testenv.AMQPURL(), "unused", "svc", messaging.Topology{}, relaying)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(outbox.Publisher.Close)
	srv := httptest.NewServer(NewRouter(b.log, b.Registry, b.DatabaseReady))
	t.Cleanup(srv.Close)

	r := get(t, srv.URL+"/metrics")
	if r.status != http.StatusOK || !outboxGauge.MatchString(r.body) || statsErrorCount(t, r.body) != 0 {
		t.Fatalf("scrape = %d, want 200 with the outbox gauges and no error counted:\n%s", r.status, r.body)
	}

	locker := d.DB.Begin()
	t.Cleanup(func() { locker.Rollback() })
	if err := locker.Exec("LOCK TABLE outbox_messages IN ACCESS EXCLUSIVE MODE").Error; err != nil {
		t.Fatal(err)
	}
	waiting := func() int64 {
		return testenv.Count(t, d.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND wait_event_type = 'Lock'", d.Name)
	}

	const scrapes = 4
	results, errs := make([]response, scrapes), make([]error, scrapes)
	var wg sync.WaitGroup
	for i := range scrapes {
		wg.Go(func() { results[i], errs[i] = fetch(srv.URL + "/metrics") })
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	var most int64
	for sampling := true; sampling; {
		select {
		case <-done:
			sampling = false
		case <-time.After(10 * time.Millisecond):
			most = max(most, waiting())
		}
	}
	counted := 0.0
	for i, r := range results {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if r.status != http.StatusOK || r.took > 3*time.Second {
			t.Fatalf("scrape with the table locked = %d after %s, want 200 well within Prometheus's 10 s", r.status, r.took)
		}
		if outboxGauge.MatchString(r.body) || !regexp.MustCompile(`(?m)^go_goroutines `).MatchString(r.body) ||
			!regexp.MustCompile(`(?m)^http_requests_total\{`).MatchString(r.body) {
			t.Fatalf("scrape with the table locked, want the other metrics and no outbox gauge:\n%s", r.body)
		}
		counted = max(counted, statsErrorCount(t, r.body))
	}
	if counted < 1 || counted > scrapes {
		t.Fatalf("outbox_stats_errors_total = %v after %d failed scrapes, want 1 to %d", counted, scrapes, scrapes)
	}
	if most > 1 {
		t.Fatalf("%d backlog queries waited on the lock at once, want overlapping scrapes to share one", most)
	}
	if n := waiting(); n != 0 {
		t.Fatalf("%d backlog queries still wait on the lock after the scrapes ended, want them cancelled by the server", n)
	}
	if len(logs.Lines("outbox backlog query failed", "statement timeout")) == 0 {
		t.Fatalf("no log line gives the failure's cause:\n%s", logs.String())
	}

	locker.Rollback()
	r = get(t, srv.URL+"/metrics")
	if r.status != http.StatusOK || len(outboxGauge.FindAllString(r.body, -1)) != 6 || statsErrorCount(t, r.body) != counted {
		t.Fatalf("scrape after the lock = %d, want the three outbox gauges back and no new error (%v):\n%s", r.status, counted, r.body)
	}
}
