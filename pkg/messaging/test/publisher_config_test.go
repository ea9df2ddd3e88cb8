package test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // database/sql's "pgx"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/sqldriver"
)

// unparseableURLs name no broker a dial could reach: each is a configuration's fault, which no
// broker can mend. Their password must stay out of every error and log line.
const unparseablePassword = "hunter"

var unparseableURLs = []string{
	"http://x",
	"amqp://relay:" + unparseablePassword + "%zz@broker/",           // a bad escape in the password
	"amqp://relay:" + unparseablePassword + "%zz@broker/, http://x", // a cluster of which none parses
}

// lazyDriver is a database/sql driver whose pool connects at first use, to a closed port: what
// is tested here fails before it.
func lazyDriver(t *testing.T) *sqldriver.Driver {
	t.Helper()
	db, err := sql.Open("pgx", "postgres://nobody@127.0.0.1:1/none?sslmode=disable&connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return sqldriver.New(db)
}

// A relay whose publisher's URL does not parse returns that from Run at once, naming
// PublisherConfig.URL: it is no outage (an outage paused the relay and waited for a broker for
// ever), and the URL is not quoted (its password would reach the log).
func TestARelayWhosePublisherURLDoesNotParseStopsAtOnce(t *testing.T) {
	t.Parallel()
	for _, url := range unparseableURLs {
		log, logs := testenv.NewLogger(t)
		p := messaging.NewPublisher(messaging.PublisherConfig{URL: url, ConnectionName: t.Name(), Logger: log})
		r, err := messaging.NewRelay(messaging.RelayConfig{DB: lazyDriver(t).DB(), Sender: p, Exchange: "orders", DisableNotify: true, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		start := time.Now()
		err = r.Run(ctx)
		cancel()
		p.Close()
		if err == nil || errors.Is(err, messaging.ErrBrokerUnavailable) || !strings.Contains(err.Error(), "PublisherConfig.URL") {
			t.Errorf("Relay.Run with PublisherConfig.URL %q: %v after %s; want at once an error naming PublisherConfig.URL, not ErrBrokerUnavailable",
				url, err, time.Since(start).Round(time.Millisecond))
		}
		if err != nil && strings.Contains(err.Error(), unparseablePassword) {
			t.Errorf("Relay.Run's error shows the password: %v", err)
		}
		if strings.Contains(logs.String(), unparseablePassword) {
			t.Errorf("the log shows the password:\n%s", logs)
		}
	}
}

// A subscription whose URL does not parse is refused by NewSubscription, naming the URL without
// quoting it: Run would otherwise log a reconnection for ever.
func TestASubscriptionWhoseURLDoesNotParseIsRefused(t *testing.T) {
	t.Parallel()
	for _, url := range append(unparseableURLs, " , ") {
		_, err := messaging.NewSubscription(lazyDriver(t), messaging.SubscriptionConfig{Name: "invoicing", URL: url, Logger: quiet})
		if err == nil || !strings.Contains(err.Error(), "URL") || strings.Contains(err.Error(), unparseablePassword) {
			t.Errorf("NewSubscription with URL %q: %v; want an error naming the URL, without its password", url, err)
		}
	}
}

// A cluster's URL list of which some nodes parse works with those, as before; the others are
// passed over, but not silently: the publisher and the subscription each say so once, when
// made, without quoting them.
func TestAClusterNodeWhoseURLDoesNotParseIsLoggedOnce(t *testing.T) {
	t.Parallel()
	url := "amqp://relay:" + unparseablePassword + "%zz@broker/," + testenv.AMQPURL()
	log, logs := testenv.NewLogger(t)
	p := messaging.NewPublisher(messaging.PublisherConfig{URL: url, ConnectionName: t.Name(), Logger: log})
	t.Cleanup(p.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for range 3 {
		if err := p.Connect(ctx); err != nil {
			t.Fatalf("Connect with one node of two that parses: %v", err)
		}
		p.Close()
	}
	if _, err := messaging.NewSubscription(lazyDriver(t), messaging.SubscriptionConfig{Name: "invoicing", URL: url, Logger: log}); err != nil {
		t.Fatalf("NewSubscription with one node of two that parses: %v", err)
	}
	if lines := logs.Lines("level=WARN", "setting=PublisherConfig.URL", "unparseable=1 urls=2"); len(lines) != 1 {
		t.Errorf("%d warnings of the publisher's unparseable node, want 1", len(lines))
	}
	if lines := logs.Lines("level=WARN", "setting=SubscriptionConfig.URL", "unparseable=1 urls=2"); len(lines) != 1 {
		t.Errorf("%d warnings of the subscription's unparseable node, want 1", len(lines))
	}
	if strings.Contains(logs.String(), unparseablePassword) {
		t.Errorf("the log shows the password:\n%s", logs)
	}
}
