package test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// Crash tests re-run this test binary as a child process that SIGKILLs itself at a precise
// point: a real process death, not a cancelled context. The parent then checks what the
// survivors make of it.
const (
	crashPointEnv = "MESSAGING_CRASH_POINT"
	crashDBEnv    = "MESSAGING_CRASH_DB"
	crashExEnv    = "MESSAGING_CRASH_EXCHANGE"
	crashQueueEnv = "MESSAGING_CRASH_QUEUE"
	// childPool is the child's pool, drawn from the parent test's connections.
	childPool = 2
)

func die() {
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // never returns
}

// runChild runs test name in a child process at crash point, and requires that it died of
// SIGKILL.
func (b *testBundle) runChild(t *testing.T, name, point string) {
	t.Helper()
	testenv.Draw(t, childPool)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+name+"$", "-test.v")
	cmd.Env = append(os.Environ(), crashPointEnv+"="+point, crashDBEnv+"="+b.db.URL, crashExEnv+"="+b.exchange, crashQueueEnv+"="+b.queue)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("child %s: %v\n%s", point, err, out)
	}
	if ws, ok := exit.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child %s did not die of SIGKILL: %v\n%s", point, err, out)
	}
}

// childEnv is what a crashing child needs, read from the parent's environment.
func childEnv(t *testing.T) (db *gorm.DB, exchange, queue string) {
	t.Helper()
	db, err := testenv.OpenGORM(os.Getenv(crashDBEnv), childPool)
	if err != nil {
		t.Fatal(err)
	}
	return db, os.Getenv(crashExEnv), os.Getenv(crashQueueEnv)
}

// killAfterConfirms publishes for real, then kills the process: the broker has the
// messages, the relay's transaction never commits its marks.
type killAfterConfirms struct{ messaging.Sender }

func (k killAfterConfirms) Publish(ctx context.Context, msgs []messaging.Message) []error {
	errs := k.Sender.Publish(ctx, msgs)
	for _, err := range errs {
		if err != nil {
			fmt.Println("publish failed before the crash point:", err)
			os.Exit(3)
		}
	}
	die()
	return errs
}

func TestRelayProcessKilledBetweenPublishAndCommit(t *testing.T) {
	if os.Getenv(crashPointEnv) == "relay-after-publish" {
		db, exchange, _ := childEnv(t)
		pub := messaging.NewPublisher(messaging.PublisherConfig{URL: testenv.AMQPURL(),
			Topology: messaging.Topology{Exchanges: []string{exchange}}})
		r, err := messaging.NewRelay(messaging.RelayConfig{DB: driverOf(t, db).DB(), Sender: killAfterConfirms{pub}, Exchange: exchange})
		if err != nil {
			t.Fatal(err)
		}
		_, _ = r.ProcessBatch(context.Background())
		t.Fatal("the relay survived its crash point")
	}
	t.Parallel()
	b := setupWith(t, childPool)
	b.createWorkTable(t)
	ids := b.enqueue(t, 20)
	b.runChild(t, "TestRelayProcessKilledBetweenPublishAndCommit", "relay-after-publish")

	if n := b.unprocessed(t); n != 20 {
		t.Fatalf("%d rows unprocessed after the crash, want all 20", n)
	}
	if n := testenv.QueueDepth(t, b.ch, b.queue); n != 20 {
		t.Fatalf("queue holds %d, want the 20 published before the crash", n)
	}
	// The relay starts again and publishes all 20 a second time; the inbox absorbs them.
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	run(t, b.relay(t, b.publisher(t, testenv.AMQPURL()), nil).Run)
	b.waitAllSent(t, 20*time.Second)
	testenv.Eventually(t, 20*time.Second, func() bool { return len(b.logs.Lines("duplicate message skipped")) == 20 },
		"the 20 republished messages were not all recognised as duplicates")
	if w := b.workDone(t); w != 20 {
		t.Fatalf("work done %d times for 20 messages, want 20", w)
	}
	for _, id := range ids {
		if n := len(b.duplicateLines(id)); n != 1 {
			t.Fatalf("message %s: %d duplicate lines, want 1", id, n)
		}
	}
}

// The consumer dies after its transaction committed but before the ack reached the broker
// ("after-commit"), or in the middle of its transaction ("before-commit"). Either way the
// broker redelivers, and the work is done exactly once.
func TestConsumerProcessKilled(t *testing.T) {
	point := os.Getenv(crashPointEnv)
	if point == "consumer-after-commit" || point == "consumer-before-commit" {
		db, exchange, queue := childEnv(t)
		c, err := messaging.NewSubscription(driverOf(t, db), messaging.SubscriptionConfig{
			Name: queue, URL: testenv.AMQPURL(), Topology: queueTopology(exchange, queue, eventType),
		})
		if err != nil {
			t.Fatal(err)
		}
		must(t, messaging.Handle(c, messaging.Event[payload]{Exchange: exchange, Type: eventType},
			func(ctx context.Context, tx *gorm.DB, p payload, msg messaging.Message) error {
				if err := doWork(tx, p, msg); err != nil {
					return err
				}
				if point == "consumer-before-commit" {
					die()
				}
				return messaging.AfterCommit(ctx, die) // committed, not acknowledged
			}))
		_ = c.Run(context.Background())
		t.Fatal("the consumer survived its crash point")
	}
	for _, point := range []string{"consumer-after-commit", "consumer-before-commit"} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			b := setupWith(t, childPool)
			b.createWorkTable(t)
			msg := newMessage(t, 1)
			b.publishRaw(t, publishing(msg))
			b.runChild(t, "TestConsumerProcessKilled", point)

			wantWork := map[string]int64{"consumer-after-commit": 1, "consumer-before-commit": 0}[point]
			if w := b.workDone(t); w != wantWork {
				t.Fatalf("work rows after the crash = %d, want %d", w, wantWork)
			}
			// Unacknowledged, so the broker has it again for the next consumer.
			b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
			acked := `consumer_messages_total{outcome="acked",queue="` + b.queue + `"} 1`
			testenv.Eventually(t, 20*time.Second, func() bool { return hasMetric(t, b.registry, acked) },
				"the redelivered message was not acknowledged")
			if w, c := b.workDone(t), testenv.Count(t, b.db.DB, "SELECT count(*) FROM inbox_messages"); w != 1 || c != 1 {
				t.Fatalf("after redelivery: %d work rows, %d inbox rows; want 1 and 1", w, c)
			}
			wantDup := map[string]int{"consumer-after-commit": 1, "consumer-before-commit": 0}[point]
			if n := len(b.duplicateLines(msg.ID)); n != wantDup {
				t.Fatalf("%d duplicate lines, want %d", n, wantDup)
			}
		})
	}
}
