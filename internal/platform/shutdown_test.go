package platform

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A request in flight at the signal commits its event during the drain: Serve sends it before
// it returns, and it reaches its queue. The relay polls once an hour and does not listen, so
// it is the stop that sends the row, not a poll that happens to come first.
func TestServeSendsWhatRequestsCommitDuringTheDrain(t *testing.T) {
	s := startDrainService(t, testenv.AMQPURL())
	seed := s.insertRow(t)
	stop := s.serve(t)
	testenv.Eventually(t, 10*time.Second, func() bool { return s.unsent(t) == 0 },
		"the relay did not send the row committed before it started")

	took, status, id := s.stopDuringARequest(t, stop)
	if status != http.StatusCreated {
		t.Fatalf("the request in flight at the signal got %d, want 201", status)
	}
	if n := s.unsent(t); n != 0 {
		t.Fatalf("%d outbox rows left unsent after Serve returned: the relay stopped before the request committed during the drain", n)
	}
	ch := testenv.Channel(t)
	testenv.Eventually(t, 5*time.Second, func() bool { return testenv.QueueDepth(t, ch, s.queue) == 2 },
		"the queue does not hold both messages")
	var got []string
	for _, d := range testenv.Drain(t, ch, s.queue, 0) {
		got = append(got, d.MessageId)
	}
	if !slices.Contains(got, seed.String()) || !slices.Contains(got, id.String()) {
		t.Fatalf("the queue holds %v, want %s and %s", got, seed, id)
	}
	if len(s.logs.Lines("sent the outbox's last rows before stopping", "sent=1")) != 1 {
		t.Error("the last pass was not logged")
	}
	t.Logf("stopped %s after the signal", took.Round(time.Millisecond))
}

// With a broker it cannot reach, the relay's last pass gives up at its first batch: the row
// committed during the drain waits for the next start, and Serve returns at once.
func TestServeDoesNotWaitForABrokerItCannotReach(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedPort := ln.Addr().String()
	_ = ln.Close()
	s := startDrainService(t, "amqp://guest:guest@"+closedPort+"/")
	stop := s.serve(t)

	took, status, _ := s.stopDuringARequest(t, stop)
	if status != http.StatusCreated {
		t.Fatalf("the request in flight at the signal got %d, want 201", status)
	}
	if took > 3*time.Second {
		t.Fatalf("Serve returned %s after the signal with the broker unreachable, want within 3 s", took)
	}
	if n := s.unsent(t); n != 1 {
		t.Fatalf("%d outbox rows unsent, want the 1 committed during the drain", n)
	}
	if len(s.logs.Lines("level=WARN", "could not send the outbox's last rows before stopping", "broker unavailable")) != 1 {
		t.Error("the rows left unsent were not logged")
	}
}

// drainService is a service whose one endpoint, POST /orders, enqueues an event in a
// transaction, and whose relay polls once an hour without listening.
type drainService struct {
	d      *testenv.Database
	b      *Base
	logs   *testenv.Logs
	outbox *Outbox
	queue  string
	url    string
}

func startDrainService(t *testing.T, amqpURL string) *drainService {
	t.Helper()
	relaying := RelaySettings{BatchSize: 10, Lanes: 1, PollInterval: time.Hour, MaxBackoff: time.Minute, Retention: time.Hour}
	pools := PoolsOf(&relaying, nil, 0)
	conns := ReadinessConns + pools.Background + pools.Work + MinRequestConns
	testenv.Connections(t, 3+conns) // the database's creation, the test's handle (2), the service
	d := testenv.NewDatabaseWithPool(t, 2)
	b, logs := startBase(t, d, conns, pools, Library(messaging.MigrateOutbox))
	exchange, queue := testenv.UniqueName("orders"), testenv.UniqueName("invoicing")
	testenv.CleanupBroker(t, []string{queue, messaging.DeadLetterQueue(queue)}, []string{exchange})
	topology := messaging.Topology{Queues: []messaging.ConsumerTopology{{Queue: queue, Bindings: []messaging.Binding{{Exchange: exchange, RoutingKey: "Placed"}}}}}
	outbox, err := b.Outbox(b.log, amqpURL, exchange, "svc", topology, relaying)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(outbox.Publisher.Close)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return &drainService{d: d, b: b, logs: logs, outbox: outbox, queue: queue, url: "http://" + addr}
}

// serve runs Serve, with intake as its intake workers, until the returned signal; wait then
// requires Serve to return nil within 10 s of it, and says how long it took.
func (s *drainService) serve(t *testing.T, intake ...Worker) (stop stopper) {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		id := uuid.Must(uuid.NewV7())
		err := s.b.DB.WithContext(r.Context()).Transaction(func(tx *gorm.DB) error {
			return messaging.Enqueue(r.Context(), s.b.Driver, tx, messaging.Message{ID: id, Type: "Placed", Payload: json.RawMessage(`{}`)})
		})
		if err != nil {
			WriteProblem(w, http.StatusInternalServerError, err.Error())
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprint(w, id)
	})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	go func() {
		done <- Serve(ctx, s.b.log, NewServer(strings.TrimPrefix(s.url, "http://"), mux), Workers{Intake: intake, Relay: s.outbox.Relay})
	}()
	testenv.Eventually(t, 10*time.Second, func() bool { return len(s.logs.Lines("listening")) == 1 }, "Serve does not listen")
	var signalled time.Time
	return stopper{
		signal: func() {
			signalled = time.Now()
			cancel()
		},
		wait: func() time.Duration {
			t.Helper()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("Serve: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("Serve did not return within 10 s of the signal")
			}
			return time.Since(signalled)
		},
	}
}

// stopper stops what serve started: signal is the signal, wait waits for Serve to return.
type stopper struct {
	signal func()
	wait   func() time.Duration
}

// stopDuringARequest sends POST /orders and holds it inside its transaction, before its
// insert, then gives the signal, and lets the request commit once Serve is shutting down. It
// returns how long Serve took to return after the signal, the request's status and the id of
// the event it enqueued.
func (s *drainService) stopDuringARequest(t *testing.T, stop stopper) (took time.Duration, status int, id uuid.UUID) {
	t.Helper()
	release := testenv.HoldAt(t, s.d.DB, "BEFORE INSERT ON outbox_messages")
	type answer struct {
		r   response
		err error
	}
	answered := make(chan answer, 1)
	go func() {
		r, err := post(s.url + "/orders")
		answered <- answer{r, err}
	}()
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, s.d.DB, "SELECT count(*) FROM pg_stat_activity WHERE datname = ? AND wait_event_type = 'Lock'", s.d.Name) == 1
	}, "the request is not held at its insert")
	stop.signal()
	testenv.Eventually(t, 5*time.Second, func() bool { return len(s.logs.Lines("shutting down")) == 1 }, "Serve is not shutting down")
	release()
	took = stop.wait()
	select {
	case a := <-answered:
		if a.err != nil {
			t.Fatalf("POST /orders: %v", a.err)
		}
		if a.r.status == http.StatusCreated {
			id = uuid.MustParse(a.r.body)
		}
		return took, a.r.status, id
	case <-time.After(10 * time.Second):
		t.Fatal("no answer to the request in flight within 10 s")
		return 0, 0, uuid.Nil
	}
}

// insertRow commits an event as another client of the database would.
func (s *drainService) insertRow(t *testing.T) uuid.UUID {
	t.Helper()
	id, err := s.tryInsertRow()
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// tryInsertRow is insertRow for a goroutine other than the test's, which must not call t.Fatal.
func (s *drainService) tryInsertRow() (uuid.UUID, error) {
	id := uuid.New()
	return id, s.d.DB.Exec(`INSERT INTO outbox_messages (id, type, payload, occurred_at) VALUES (?, 'Placed', '{}', now())`, id).Error
}

// unsent counts the outbox rows not marked sent.
func (s *drainService) unsent(t *testing.T) int64 {
	t.Helper()
	return testenv.Count(t, s.d.DB, "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL")
}

// post is an empty POST, for other goroutines than the test's.
func post(url string) (response, error) {
	resp, err := http.Post(url, "application/json", nil)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, err
	}
	return response{status: resp.StatusCode, body: string(body)}, nil
}

// An intake worker settles its messages after the signal: what it commits then, here more rows
// than one batch holds, is sent by the relay's last pass before Serve returns, whole. The
// relay stops only once the intake has, and its last pass goes on until it finds no row.
func TestServeSendsWhatTheIntakeCommitsAfterTheSignal(t *testing.T) {
	s := startDrainService(t, testenv.AMQPURL())
	const rows = 25 // the relay's batches hold 10
	intake := Worker(func(ctx context.Context) error {
		<-ctx.Done()
		time.Sleep(300 * time.Millisecond) // settling what it has in progress
		for range rows {
			// Not insertRow: its t.Fatal belongs to the test's goroutine; Serve returns this.
			if _, err := s.tryInsertRow(); err != nil {
				return err
			}
		}
		return nil
	})
	stop := s.serve(t, intake)
	stop.signal()
	stop.wait()
	if n := s.unsent(t); n != 0 {
		t.Fatalf("%d of the %d outbox rows the intake committed after the signal left unsent after Serve returned", n, rows)
	}
}

// A broker that accepts the connection and never answers (no handshake comes) holds the stop
// no later than ShutdownTimeout after the signal: the relay's last pass, dialling it for the
// row committed before, is cut off then, and its batch, which its dial held, records at once
// that the broker gave no verdict. What the service does after Serve, the publisher's Close and
// the pools' (which wait for that batch), is over well before the hard stop would cut it off
// with its error line. The row waits for the next start.
func TestServeDoesNotWaitForABrokerThatNeverAnswers(t *testing.T) {
	t.Parallel()
	silent := testenv.ServeEach(t, func(net.Conn) {}) // each connection held open, unread, until the test's end
	s := startDrainService(t, "amqp://guest:guest@"+silent+"/")
	s.insertRow(t)
	stop := s.serve(t)
	stop.signal()
	signalled := time.Now()
	took := stop.wait()
	s.outbox.Publisher.Close()
	s.b.Close()
	closed := time.Since(signalled)
	t.Logf("Serve returned %s after the signal, the publisher and the pools closed %s after it", took.Round(time.Millisecond), closed.Round(time.Millisecond))
	if closed > HardStop-500*time.Millisecond {
		t.Fatalf("the publisher and the pools closed %s after the signal, want well within the hard stop, %s", closed.Round(time.Millisecond), HardStop)
	}
	if n := s.unsent(t); n != 1 {
		t.Fatalf("%d outbox rows unsent, want the 1 the broker gave no verdict on", n)
	}
	if len(s.logs.Lines("level=WARN", "the outbox's last batch was still running at the shutdown deadline")) != 1 {
		t.Error("the last batch left at the deadline was not logged")
	}
}
