package platform

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// ConsumerSettings are the knobs of a consumer service.
type ConsumerSettings struct {
	Concurrency    int           // CONSUMER_CONCURRENCY: parallel handlers, default 8
	BatchSize      int           // CONSUMER_BATCH_SIZE: messages per transaction at most, default 50 (1: none)
	Prefetch       int           // CONSUMER_PREFETCH: unacked deliveries per handler, default 2 × batch size
	InboxRetention time.Duration // INBOX_RETENTION: how long inbox records are kept, default 30 days
	BatchByType    bool          // set by the service, not the environment: see messaging.SubscriptionConfig
}

// ReadConsumerSettings reads ConsumerSettings. Every parallel handler holds a database
// connection for its transaction, so DB_MAX_CONNS must have room for them, for requests and
// for the readiness check's own connection.
func ReadConsumerSettings(env *Env) ConsumerSettings {
	var s ConsumerSettings
	// 8 handlers drained a backlog about 1.5× faster than 4 on two cores (scripts/bench.sh),
	// and leave room in the default pool of 20 and in PostgreSQL's default 100 connections.
	s.Concurrency = env.Int("CONSUMER_CONCURRENCY", messaging.DefaultConcurrency, 1, 256)
	problems := len(env.errs)
	s.BatchSize = env.Int("CONSUMER_BATCH_SIZE", messaging.DefaultBatchSize, 1, 1000)
	batchParsed := len(env.errs) == problems
	s.Prefetch = env.Int("CONSUMER_PREFETCH", 2*s.BatchSize, 1, 65535)
	// Against a batch size given, not the default that stands in for one that does not parse.
	env.Check(!batchParsed || s.Prefetch >= s.BatchSize, "CONSUMER_PREFETCH", "must be at least CONSUMER_BATCH_SIZE, or no batch fills")
	// Records must outlive any duplicate: the relay's retries and the broker's redeliveries
	// arrive within minutes or hours, so a day is the floor.
	s.InboxRetention = env.Duration("INBOX_RETENTION", 30*24*time.Hour, 24*time.Hour, 10*365*24*time.Hour)
	return s
}

// LogAttrs lists the settings for the start-up log line.
func (s ConsumerSettings) LogAttrs() []any {
	return []any{"consumer_concurrency", s.Concurrency, "consumer_batch_size", s.BatchSize, "consumer_prefetch", s.Prefetch, "inbox_retention", s.InboxRetention}
}

// InboxCleanup is the hourly job deleting inbox records older than the retention.
func (b *Base) InboxCleanup(log *slog.Logger, retention time.Duration) Worker {
	return b.cleanup(log, "inbox records", retention, messaging.DeleteInboxMessages)
}

// Subscription is a subscription of the services: on GORM, its handlers get a *gorm.DB.
type Subscription = messaging.Subscription[*gorm.DB]

// Subscription returns the subscription of the consumer name (also its queue's), on the
// base's database, configured by s, declaring topology, the whole system's. Register its
// handlers, then run it.
func (b *Base) Subscription(log *slog.Logger, name, amqpURL string, topology messaging.Topology, s ConsumerSettings) (*Subscription, error) {
	return messaging.NewSubscription(b.WorkDriver, messaging.SubscriptionConfig{
		Name: name, URL: amqpURL, Topology: topology,
		Concurrency: s.Concurrency, BatchSize: s.BatchSize, BatchByType: s.BatchByType, Prefetch: s.Prefetch,
		Logger: log, Metrics: b.Metrics,
	})
}

// ConsumerReady is the readiness of a consumer service: its database and its broker
// connection both work.
func (b *Base) ConsumerReady(sub *Subscription) ReadyFunc {
	return func(ctx context.Context) error {
		if err := b.DatabaseReady(ctx); err != nil {
			return err
		}
		if !sub.Ready() {
			return &NotReadyError{Reason: "not consuming from RabbitMQ"}
		}
		return nil
	}
}

// ServeConsumer runs a consumer service once its handlers are registered on sub: sub itself
// (the intake, beside the HTTP server), the inbox cleanup and workers, and an HTTP server on
// addr that is ready while the database and the broker both work and serves GET path, the
// records of type T by order (see ListByOrder). workers.Relay, if set, sends what sub's
// handlers commit to the outbox, until sub has settled its last messages.
func ServeConsumer[T any](ctx context.Context, b *Base, log *slog.Logger, addr, path string, sub *Subscription, s ConsumerSettings, workers Workers) error {
	if err := sub.Start(); err != nil {
		return err
	}
	router := NewRouter(log, b.Registry, b.ConsumerReady(sub))
	b.API(router).Get(path, ListByOrder(log, func(ctx context.Context, orderID *uuid.UUID, limit int) ([]T, error) {
		return ListRecent[T](ctx, b.DB, orderID, limit)
	}))
	workers.Intake = append(workers.Intake, sub.Run)
	workers.Others = append(workers.Others, b.InboxCleanup(log, s.InboxRetention), b.Profiler(), b.Admission.Run)
	if err := Serve(ctx, log, NewServer(addr, router), workers); err != nil {
		return fmt.Errorf("run: %w", err)
	}
	return nil
}
