package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"testing"
	"time"
)

// A second Run while one runs returns ErrRunning at once: the two would share one consumer,
// their sessions and reconnection loops racing over its state. Once the first has returned,
// Run may be called again.
func TestASecondConcurrentRunIsRefused(t *testing.T) {
	t.Parallel()
	s, err := NewSubscription[struct{}](noDriver{}, SubscriptionConfig{Name: "twice", URL: refusingURL(t), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	if err := Handle(s, Event[struct{}]{Exchange: "x", Type: "T"}, func(context.Context, struct{}, struct{}, Message) error { return nil }); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	first := make(chan error, 1)
	go func() { first <- s.Run(ctx) }()
	for deadline := time.Now().Add(5 * time.Second); !s.running.Load(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first Run did not start")
		}
	}
	second, stop := context.WithTimeout(context.Background(), 5*time.Second)
	defer stop()
	started := time.Now()
	if err := s.Run(second); !errors.Is(err, ErrRunning) || time.Since(started) > time.Second {
		t.Fatalf("a second Run = %v after %s, want ErrRunning at once", err, time.Since(started))
	}
	cancel()
	if err := <-first; err != nil {
		t.Fatalf("the first Run = %v", err)
	}
	if err := s.Run(ctx); err != nil { // ctx has ended: it returns at once
		t.Fatalf("a Run after the first returned = %v, want nil", err)
	}
}

// refusingURL is an AMQP URL whose port refuses connections: a consumer of it keeps
// reconnecting.
func refusingURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("amqp://guest:guest@%s/", addr)
}

// noDriver is a driver without a database: a delivery that gets as far as its transaction fails.
type noDriver struct{}

func (noDriver) DB() DB                              { return failingDB{} }
func (noDriver) Executor(struct{}) (Executor, error) { return nil, errors.New("noDriver") }
func (noDriver) Begin(context.Context) (struct{}, TxExecutor, error) {
	return struct{}{}, nil, errors.New("noDriver")
}
