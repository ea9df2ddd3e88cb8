package test

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A publisher that failed to connect dials again only after its reconnect delay: meanwhile
// every call gets ErrBrokerUnavailable at once, and a broker that refuses connections (here a
// listener that closes each one) is not dialled by every call of every lane.
func TestPublisherDialsAgainOnlyAfterItsReconnectDelay(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	var dials atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			dials.Add(1)
			_ = c.Close()
		}
	}()
	p := messaging.NewPublisher(messaging.PublisherConfig{
		URL: "amqp://guest:guest@" + ln.Addr().String() + "/", Logger: quiet,
		Reconnect: messaging.Backoff{Base: time.Minute, Max: time.Minute},
	})
	t.Cleanup(p.Close)
	msg := newMessage(t, 1)
	for i := range 5 {
		if errs := p.Publish(context.Background(), []messaging.Message{msg}); !errors.Is(errs[0], messaging.ErrBrokerUnavailable) {
			t.Fatalf("publish %d: %v, want ErrBrokerUnavailable", i+1, errs[0])
		}
	}
	if n := dials.Load(); n != 1 {
		t.Fatalf("%d connections for 5 publishes within the reconnect delay, want 1", n)
	}
}
