package test

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// Right after a subscription starts and a relay is made, every series they will count is
// exported at zero: a series born at its first increment starts at 1, and rate() and increase()
// see no increase in a series' first sample, so an alert on the first dead-letter after a start
// would never fire.
func TestMetricsExportEverySeriesAtZeroFromTheStart(t *testing.T) {
	t.Parallel()
	b := setupSubscription(t)
	s := b.subscription(t, nil)
	must(t, messaging.Handle(s, b.placed, func(context.Context, *gorm.DB, placed, messaging.Message) error { return nil }))
	must(t, messaging.Handle(s, b.cancels, func(context.Context, *gorm.DB, cancelled, messaging.Message) error { return nil }))
	queue := `queue="` + b.name + `"`
	consumer := `consumer="` + b.name + `"`
	if hasMetric(t, b.registry, "consumer_messages_total{") {
		t.Fatal("consumer_messages_total is exported before the subscription started")
	}
	must(t, s.Start())
	b.relay(t, b.publisher(t, testenv.AMQPURL()), func(c *messaging.RelayConfig) { c.Types = []string{"Placed", "Cancelled"} })

	want := []string{
		`consumer_messages_total{outcome="acked",` + queue + `}`,
		`consumer_messages_total{outcome="requeued",` + queue + `}`,
		`consumer_messages_total{outcome="dead_lettered",` + queue + `}`,
		`inbox_duplicates_total{` + consumer + `}`,
		`consumer_event_age_seconds_count{` + consumer + `}`,
		`outbox_messages_published_total{type="Placed"}`,
		`outbox_messages_published_total{type="Cancelled"}`,
		`outbox_publish_failures_total{type="Placed"}`,
		`outbox_publish_failures_total{type="Cancelled"}`,
	}
	for _, typ := range []string{"Placed", "Cancelled"} {
		for _, outcome := range []string{"ok", "error", "permanent"} {
			want = append(want, `consumer_handler_seconds_count{`+consumer+`,outcome="`+outcome+`",type="`+typ+`"}`)
		}
	}
	for _, series := range want {
		wantMetric(t, b.registry, series+" 0\n")
	}
}

// metricValue is the value of the counter or gauge, or the count of the histogram, named name
// whose labels include labels, or 0 when there is none.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	return metricOf(t, reg, name, labels, func(h *dto.Histogram) float64 { return float64(h.GetSampleCount()) })
}

// histogramSum is the sum of the first series of the histogram name with labels, 0 if none.
func histogramSum(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	return metricOf(t, reg, name, labels, (*dto.Histogram).GetSampleSum)
}

// metricOf is the value of the first series of name with labels, 0 if none; of a histogram, as
// of reads it.
func metricOf(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string, of func(*dto.Histogram) float64) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for k, want := range labels {
				if got[k] != want {
					continue series
				}
			}
			if h := m.GetHistogram(); h != nil {
				return of(h)
			}
			if g := m.GetGauge(); g != nil {
				return g.GetValue()
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}
