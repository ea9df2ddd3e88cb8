package messaging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
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

// What AMQP cannot carry is refused when the subscription is made, naming its field: a Name
// whose dead-letter queue's name is over 255 bytes (its queue was declared, then its consumer
// refused, and it reconnected for ever, never ready), and a Heartbeat under a second (the
// client sends whole seconds: 0, the broker's 60 s). 0 is the default, not under a second.
func TestAConfigurationAMQPCannotCarryIsRefused(t *testing.T) {
	t.Parallel()
	longest := strings.Repeat("n", maxQueueName)
	for _, tc := range []struct {
		name  string
		cfg   SubscriptionConfig
		field string // "" when taken
	}{
		{"the longest name", SubscriptionConfig{Name: longest}, ""},
		{"a name a byte longer", SubscriptionConfig{Name: longest + "n"}, "Name"},
		{"a name of 230 bytes, with its consumer tag's 37", SubscriptionConfig{Name: strings.Repeat("n", 230)}, ""},
		{"the default heartbeat", SubscriptionConfig{Name: "n", Heartbeat: 0}, ""},
		{"a heartbeat of a second", SubscriptionConfig{Name: "n", Heartbeat: time.Second}, ""},
		{"a heartbeat under a second", SubscriptionConfig{Name: "n", Heartbeat: 999 * time.Millisecond}, "Heartbeat"},
	} {
		tc.cfg.URL = "amqp://127.0.0.1/"
		_, err := NewSubscription[struct{}](noDriver{}, tc.cfg)
		if tc.field == "" && err != nil || tc.field != "" && (err == nil || !strings.Contains(err.Error(), tc.field)) {
			t.Errorf("%s: NewSubscription = %v, want %s", tc.name, err, map[bool]string{true: "taken", false: "an error naming " + tc.field}[tc.field == ""])
		}
	}
}

// An attempt the shutdown calls off gives no verdict: its message goes back uncounted, to be
// handled again. It counts no handler outcome either: consumer_handler_seconds counted it an
// error, and the message's handling after the restart once more. An attempt abandoned at the
// shutdown (its handler ignoring its ctx) counts none when it returns at last.
func TestAnAttemptCalledOffCountsNoHandlerOutcome(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		abandoned bool
	}{{"called off", false}, {"abandoned at the shutdown, returning later", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			metrics, err := NewMetrics(prometheus.NewRegistry(), "")
			if err != nil {
				t.Fatal(err)
			}
			s, err := NewSubscription[struct{}](claimingDriver{}, SubscriptionConfig{Name: "called-off", URL: "amqp://127.0.0.1/",
				Metrics: metrics, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			workCtx, shutdown := context.WithCancel(context.Background())
			release := make(chan struct{})
			err = Handle(s, Event[struct{}]{Exchange: "x", Type: "T"}, func(ctx context.Context, _ struct{}, _ struct{}, _ Message) error {
				shutdown() // while the handler runs
				if tc.abandoned {
					<-release // its ctx ignored
					return nil
				}
				<-ctx.Done()
				return fmt.Errorf("look the customer up: %w", ctx.Err())
			})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Start(); err != nil {
				t.Fatal(err)
			}
			msg, err := NewMessage("T", struct{}{})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.consumer.Load().attempt(workCtx, []job{{msg: msg, payload: struct{}{}}}); err == nil {
				t.Fatal("an attempt called off succeeded")
			}
			if tc.abandoned {
				close(release)
				for deadline := time.Now().Add(5 * time.Second); abandonedNow(t, metrics, "called-off") != 0; time.Sleep(10 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatal("the abandoned attempt did not return")
					}
				}
			}
			for _, outcome := range []string{handlerOK, handlerError, handlerPermanent} {
				if n := handledCount(t, metrics, "called-off", "T", outcome); n != 0 {
					t.Errorf("consumer_handler_seconds{outcome=%q} counted %d, want none for an attempt called off", outcome, n)
				}
			}
		})
	}
}

// handledCount is how many outcomes consumer_handler_seconds counted for consumer's msgType.
func handledCount(t *testing.T, m *Metrics, consumer, msgType, outcome string) uint64 {
	t.Helper()
	var v dto.Metric
	if err := m.handled.WithLabelValues(consumer, msgType, outcome).(prometheus.Metric).Write(&v); err != nil {
		t.Fatal(err)
	}
	return v.GetHistogram().GetSampleCount()
}

// claimingDriver's transactions claim every message they are given, and commit unless their
// context has ended: a transaction, begun under it, ends with it.
type claimingDriver struct{}

func (claimingDriver) DB() DB                              { return failingDB{} }
func (claimingDriver) Executor(struct{}) (Executor, error) { return nil, errors.New("claimingDriver") }
func (claimingDriver) Begin(context.Context) (struct{}, TxExecutor, error) {
	return struct{}{}, claimingTx{}, nil
}

type claimingTx struct{}

func (claimingTx) Exec(context.Context, string, ...any) (int64, error) {
	return 0, errors.New("claimingTx: Exec")
}

// Query claims each id of the inbox claim's array.
func (claimingTx) Query(_ context.Context, sql string, args ...any) (Rows, error) {
	if sql != statements.ClaimInbox {
		return nil, errors.New("claimingTx: Query")
	}
	rows := &valueRows{}
	for id := range strings.SplitSeq(strings.Trim(args[0].(string), "{}"), ",") {
		rows.rows = append(rows.rows, []any{uuid.MustParse(id)})
	}
	return rows, nil
}
func (claimingTx) Commit(ctx context.Context) error { return ctx.Err() }
func (claimingTx) Rollback(context.Context) error   { return nil }
