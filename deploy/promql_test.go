package deploy_test

import (
	"slices"
	"strings"
	"testing"
	"unicode"
)

// promqlKeywords are the words of PromQL that are not metric names where they stand alone.
var promqlKeywords = map[string]bool{
	"and": true, "or": true, "unless": true, "atan2": true, "bool": true, "offset": true,
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	"start": true, "end": true, "Inf": true, "NaN": true, "inf": true, "nan": true,
}

// promqlAggregations may be followed by a grouping before their parenthesis
// (sum by (job) (...)), so they are never metric names either.
var promqlAggregations = map[string]bool{
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
	"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true,
	"limitk": true, "limit_ratio": true,
}

// promqlGroupings take a parenthesised list of label names.
var promqlGroupings = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
}

// metricNames returns the metric names a PromQL expression selects, in order of first
// appearance. It is a lexer, not a parser: enough for our own dashboard and rules, whose
// syntax promtool checks. It skips strings, label matchers ({...}), ranges ([...]), numbers
// and durations, function and aggregation names, keywords, and the label lists of by,
// without, on, ignoring, group_left and group_right.
func metricNames(expr string) []string {
	var names []string
	rs := []rune(expr)
	// skipTo returns the index just past the bracket that closes the one at i, stepping over
	// strings.
	skipTo := func(i int, opening, closing rune) int {
		depth := 0
		for ; i < len(rs); i++ {
			switch rs[i] {
			case '"', '\'', '`':
				i = skipString(rs, i) - 1
			case opening:
				depth++
			case closing:
				depth--
				if depth == 0 {
					return i + 1
				}
			}
		}
		return i
	}
	nextNonSpace := func(i int) int {
		for i < len(rs) && unicode.IsSpace(rs[i]) {
			i++
		}
		return i
	}
	for i := 0; i < len(rs); {
		c := rs[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			i = skipString(rs, i)
		case c == '{':
			i = skipTo(i, '{', '}')
		case c == '[':
			i = skipTo(i, '[', ']')
		case c == '$': // a Grafana variable such as $__rate_interval
			i++
			for i < len(rs) && isIdentRune(rs[i], false) {
				i++
			}
		case unicode.IsDigit(c) || (c == '.' && i+1 < len(rs) && unicode.IsDigit(rs[i+1])):
			for i < len(rs) && (isIdentRune(rs[i], false) || rs[i] == '.' || ((rs[i] == '+' || rs[i] == '-') && (rs[i-1] == 'e' || rs[i-1] == 'E'))) {
				i++
			}
		case isIdentRune(c, true):
			start := i
			for i < len(rs) && isIdentRune(rs[i], false) {
				i++
			}
			word := string(rs[start:i])
			after := nextNonSpace(i)
			switch {
			case promqlGroupings[word]:
				if after < len(rs) && rs[after] == '(' {
					i = skipTo(after, '(', ')')
				}
			case promqlKeywords[word] || promqlAggregations[word]:
			case after < len(rs) && rs[after] == '(':
				// a function call
			default:
				if !slices.Contains(names, word) {
					names = append(names, word)
				}
			}
		default:
			i++
		}
	}
	return names
}

func isIdentRune(r rune, first bool) bool {
	if r == '_' || r == ':' || (r < unicode.MaxASCII && unicode.IsLetter(r)) {
		return true
	}
	return !first && r < unicode.MaxASCII && unicode.IsDigit(r)
}

// skipString returns the index just past the string literal that starts at i.
func skipString(rs []rune, i int) int {
	quote := rs[i]
	for i++; i < len(rs); i++ {
		switch {
		case rs[i] == '\\' && quote != '`':
			i++
		case rs[i] == quote:
			return i + 1
		}
	}
	return i
}

func TestMetricNames(t *testing.T) {
	t.Parallel()
	for expr, want := range map[string][]string{
		`up == 0`: {"up"},
		`max by (job) (outbox_oldest_pending_age_seconds) > 300`:                                            {"outbox_oldest_pending_age_seconds"},
		`sum by (job, type) (increase(outbox_publish_failures_total[10m])) > 0`:                             {"outbox_publish_failures_total"},
		`sum(rate(a_total{outcome="requeued", q=~"x\"(y)"}[5m])) / sum(rate(a_total[5m] offset 1h)) > 0.05`: {"a_total"},
		`histogram_quantile(0.95, sum by (consumer, le) (rate(h_seconds_bucket[$__rate_interval])))`:        {"h_seconds_bucket"},
		`sum by (queue) (rabbitmq_detailed_queue_messages{queue=~".+\\.dlq"})`:                              {"rabbitmq_detailed_queue_messages"},
		`a * on (job) group_left (version) b_info or c unless d:recorded 1e3 + 2.5e-3 + Inf`:                {"a", "b_info", "c", "d:recorded"},
		`count without (instance) (up) and bool 1`:                                                          {"up"},
		`{__name__="not_found_by_name"}`:                                                                    nil,
		`rate(x[5m:30s])`:                                                                                   {"x"},
	} {
		if got := metricNames(expr); !slices.Equal(got, want) {
			t.Errorf("metricNames(%s) = %v, want %v", expr, got, want)
		}
	}
	if got := metricNames(strings.Repeat("(", 3)); got != nil {
		t.Errorf("metricNames of unbalanced parentheses = %v, want none", got)
	}
}
