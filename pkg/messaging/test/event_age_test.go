package test

import (
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A handled message's age, from its occurred_at to the commit of its work, is observed once;
// a duplicate's is not: its age says how late the copy came, not how long the work took.
func TestInboxObservesTheAgeOfEachHandledEvent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	in := b.inbox(t, b.drv, b.queue, workFunc)
	hourAgo := func(i int) messaging.Message {
		m := newMessage(t, i)
		m.OccurredAt = time.Now().Add(-time.Hour)
		return m
	}
	single, first, second := hourAgo(1), hourAgo(2), hourAgo(3)
	// single twice (the second time, a duplicate), then two more and single a third time.
	for _, m := range []messaging.Message{single, single, first, second, single} {
		if _, err := deliver(in, m); err != nil {
			t.Fatal(err)
		}
	}
	count, sum := eventAge(t, b, b.queue)
	if count != 3 || sum < 3*3600 || sum > 3*3660 {
		t.Fatalf("event age: %d observations summing to %.0f s, want 3 of about an hour each", count, sum)
	}
}

// End to end: the age comes from the AMQP timestamp the relay sets from occurred_at.
func TestConsumerObservesTheEventAgeFromTheTimestamp(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.createWorkTable(t)
	b.consumer(t, testenv.AMQPURL(), b.drv, workFunc, nil)
	const n = 4
	for i := range n {
		p := publishing(newMessage(t, i))
		p.Timestamp = time.Now().Add(-30 * time.Second)
		b.publishRaw(t, p)
		if i == 0 {
			b.publishRaw(t, p) // a duplicate
		}
	}
	acked := `consumer_messages_total{outcome="acked",queue="` + b.queue + `"} 5`
	testenv.Eventually(t, 10*time.Second, func() bool { return hasMetric(t, b.registry, acked) }, "not every delivery was acknowledged")
	count, sum := eventAge(t, b, b.queue)
	// The timestamp has whole seconds: each age is 30 s and up to one more, plus the handling.
	if count != n || sum < n*30 || sum > n*40 {
		t.Fatalf("event age: %d observations summing to %.1f s, want %d of 30 to 40 s", count, sum, n)
	}
}

// eventAge reads consumer_event_age_seconds of consumer from the bundle's registry.
func eventAge(t *testing.T, b *testBundle, consumer string) (count uint64, sum float64) {
	t.Helper()
	h := eventAgeHistogram(t, b, consumer)
	return h.GetSampleCount(), h.GetSampleSum()
}

// eventAgeHistogram is consumer's consumer_event_age_seconds as b's registry has it now (nil,
// whose counts read 0, if it has none).
func eventAgeHistogram(t *testing.T, b *testBundle, consumer string) *dto.Histogram {
	t.Helper()
	families, err := b.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "consumer_event_age_seconds" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "consumer" && l.GetValue() == consumer {
					return m.GetHistogram()
				}
			}
		}
	}
	return nil
}

// The alert ConsumerEventAgeHigh fires when the 95th percentile of consumer_event_age_seconds
// is over 60 s, and histogram_quantile interpolates within a bucket: 60 s must be a bucket's
// bound. Between 32 and 64, events all 33 s old would read 62 s and fire it, and 6 % of them
// 61 s old would read about 37 s and not.
func TestEventAgeHasABucketAtTheAlertsMinute(t *testing.T) {
	t.Parallel()
	b := handledOneOccurredAt(t, time.Now().Add(-33*time.Second))
	counts := map[float64]uint64{}
	for _, bucket := range eventAgeHistogram(t, b, b.queue).GetBucket() {
		counts[bucket.GetUpperBound()] = bucket.GetCumulativeCount()
	}
	if n, ok := counts[60]; !ok || n != 1 || counts[32] != 0 {
		t.Fatalf("buckets %v: want one at 60 s holding the 33 s old event, none of it at 32 s", counts)
	}
}

// A producer whose clock runs ahead of ours dates its events in our future: such an event's age
// counts as no delay, not as a negative one that would pull the histogram's sum, and the
// averages read off it, below the truth.
func TestAnEventFromTheFutureIsObservedAsNoDelay(t *testing.T) {
	t.Parallel()
	b := handledOneOccurredAt(t, time.Now().Add(time.Hour))
	if count, sum := eventAge(t, b, b.queue); count != 1 || sum != 0 {
		t.Fatalf("event age: %d observations summing to %.0f s, want 1 of 0 s", count, sum)
	}
}

// handledOneOccurredAt is a test bundle whose inbox has handled one message that occurred at.
func handledOneOccurredAt(t *testing.T, at time.Time) *testBundle {
	t.Helper()
	b := setup(t)
	b.createWorkTable(t)
	in := b.inbox(t, b.drv, b.queue, workFunc)
	m := newMessage(t, 1)
	m.OccurredAt = at
	if _, err := deliver(in, m); err != nil {
		t.Fatal(err)
	}
	return b
}
