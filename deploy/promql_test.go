package deploy_test

import (
	"fmt"
	"regexp"
	"slices"
	"strconv"
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
// appearance (see vectorSelectors).
func metricNames(expr string) []string {
	var names []string
	for _, sel := range vectorSelectors(expr) {
		if !slices.Contains(names, sel.metric) {
			names = append(names, sel.metric)
		}
	}
	return names
}

// vectorSelector is a metric name and the label matchers that follow it, if any.
type vectorSelector struct {
	metric   string
	matchers []labelMatcher
}

// labelMatcher is one matcher of a selector: label, op (=, !=, =~ or !~) and value, unquoted,
// or err if it does not read as one.
type labelMatcher struct {
	label, op, value string
	err              error
}

// vectorSelectors returns the selectors of a PromQL expression that name a metric, in order.
// It is a lexer, not a parser: enough for our own dashboard and rules, whose syntax promtool
// checks. It skips strings, ranges ([...]), numbers and durations, function and aggregation
// names, keywords, the label lists of by, without, on, ignoring, group_left and group_right,
// and selectors without a metric name ({__name__=...}).
func vectorSelectors(expr string) []vectorSelector {
	var sels []vectorSelector
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
			case after < len(rs) && rs[after] == '{':
				i = skipTo(after, '{', '}')
				sels = append(sels, vectorSelector{metric: word, matchers: labelMatchers(rs[after+1 : max(i-1, after+1)])})
			default:
				sels = append(sels, vectorSelector{metric: word})
			}
		default:
			i++
		}
	}
	return sels
}

// labelMatcherRE is one matcher, up to its value's opening quote.
var labelMatcherRE = regexp.MustCompile(`^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*`)

// labelMatchers reads the matchers between a selector's braces.
func labelMatchers(rs []rune) []labelMatcher {
	var ms []labelMatcher
	for rest := strings.TrimSpace(string(rs)); rest != ""; {
		loc := labelMatcherRE.FindStringSubmatchIndex(rest)
		if loc == nil {
			return append(ms, labelMatcher{err: fmt.Errorf("no label matcher at %q", rest)})
		}
		m := labelMatcher{label: rest[loc[2]:loc[3]], op: rest[loc[4]:loc[5]]}
		value := []rune(rest[loc[1]:])
		end := 0
		if len(value) > 0 && strings.ContainsRune(`"'`+"`", value[0]) {
			end = skipString(value, 0)
		}
		quoted := string(value[:end])
		if strings.HasPrefix(quoted, "'") {
			// PromQL's single quotes read as Go's double ones.
			quoted = `"` + strings.ReplaceAll(strings.ReplaceAll(quoted[1:len(quoted)-1], `\'`, `'`), `"`, `\"`) + `"`
		}
		var err error
		if m.value, err = strconv.Unquote(quoted); err != nil {
			m.err = fmt.Errorf("label %s: value %q: %w", m.label, quoted, err)
		}
		ms = append(ms, m)
		rest = strings.TrimSpace(string(value[end:]))
		rest = strings.TrimSpace(strings.TrimPrefix(rest, ","))
	}
	return ms
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

func TestVectorSelectors(t *testing.T) {
	t.Parallel()
	got := vectorSelectors(`sum(rate(a_total{outcome="requeued", q=~"x\"(y)", r!='it\'s',s!~` + "`a|b`" + `}[5m])) / b > 0 and c{}`)
	want := []vectorSelector{
		{metric: "a_total", matchers: []labelMatcher{{"outcome", "=", "requeued", nil}, {"q", "=~", `x"(y)`, nil}, {"r", "!=", "it's", nil}, {"s", "!~", "a|b", nil}}},
		{metric: "b"}, {metric: "c"},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("vectorSelectors = %v, want %v", got, want)
	}
	for _, bad := range []string{`a{b}`, `a{b="c}`, `a{b=c}`} {
		if ms := vectorSelectors(bad)[0].matchers; len(ms) == 0 || ms[len(ms)-1].err == nil {
			t.Errorf("vectorSelectors(%s) = %v, want an error", bad, ms)
		}
	}
}
