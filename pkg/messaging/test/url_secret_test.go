package test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A broker URL that does not parse fails the dial, and neither the error nor the log quotes
// it: net/url's error would, password included, and the error reaches operators' logs.
func TestAnUnparseableBrokerURLStaysOutOfTheError(t *testing.T) {
	t.Parallel()
	const password = "s3cret"
	for _, c := range []struct {
		url  string
		none bool // no URL of the list parses: the configuration's fault, refused before any dial
	}{
		{"amqp://user:" + password + "@host:5672/%zz", true}, // a bad escape in the vhost
		{"amqp://user:" + password + "@[::1", true},          // an unclosed IPv6 literal
		{"amqp://user:" + password + "@host:5672/%zz," + testenv.AMQPURLVia(t, "127.0.0.1:1"), false},
	} {
		url := c.url
		log, logs := testenv.NewLogger(t)
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		p := messaging.NewPublisher(messaging.PublisherConfig{URL: url, ConnectionName: t.Name(), Logger: log})
		err := p.Connect(ctx)
		p.Close()
		_, _, listErr := messaging.ListDeadLetters(ctx, messaging.DeadLetterConfig{URL: url, Queue: "invoicing", ConnectionName: t.Name()}, 1)
		cancel()
		for api, err := range map[string]error{"Publisher.Connect": err, "ListDeadLetters": listErr} {
			if err == nil || !strings.Contains(err.Error(), "does not parse") || strings.Contains(err.Error(), password) {
				t.Errorf("%s with an unparseable URL: %v, want it said without the password", api, err)
			}
		}
		switch lines := logs.Lines("rabbitmq connection failed"); {
		case c.none && (errors.Is(err, messaging.ErrBrokerUnavailable) || !strings.Contains(err.Error(), "PublisherConfig.URL")):
			t.Errorf("Publisher.Connect with no URL that parses: %v, want the configuration's error naming PublisherConfig.URL, not an outage", err)
		case !c.none && len(lines) == 0:
			t.Errorf("the publisher logged no failed connection; logs:\n%s", logs)
		}
		if strings.Contains(logs.String(), password) {
			t.Errorf("the log shows the password:\n%s", logs)
		}
	}
}
