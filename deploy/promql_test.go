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
	for word, i := nextWord(rs, 0); word != ""; word, i = nextWord(rs, i) {
		after := skipSpace(rs, i)
		switch {
		case promqlGroupings[word]:
			if after < len(rs) && rs[after] == '(' {
				i = skipBracket(rs, after, '(', ')')
			}
		case promqlKeywords[word] || promqlAggregations[word]:
		case after < len(rs) && rs[after] == '(':
			// a function call
		case after < len(rs) && rs[after] == '{':
			i = skipBracket(rs, after, '{', '}')
			sels = append(sels, vectorSelector{metric: word, matchers: labelMatchers(rs[after+1 : max(i-1, after+1)])})
		default:
			sels = append(sels, vectorSelector{metric: word})
		}
	}
	return sels
}

// nextWord returns the first word of PromQL's from i on, literals (skipLiteral) stepped over,
// and the index just past it; "" and the end of rs if none is left.
func nextWord(rs []rune, i int) (word string, end int) {
	for i < len(rs) {
		if next, skipped := skipLiteral(rs, i); skipped {
			i = next
			continue
		}
		if !isIdentRune(rs[i], true) {
			i++
			continue
		}
		return wordAt(rs, i)
	}
	return "", len(rs)
}

// skipLiteral returns the index just past what starts at i if it is no word of PromQL's: a
// string, a selector's matchers ({...}), a range ([...]), a Grafana variable
// ($__rate_interval), a number or a duration; skipped is false, and i returned, otherwise.
func skipLiteral(rs []rune, i int) (next int, skipped bool) {
	c := rs[i]
	switch {
	case c == '"' || c == '\'' || c == '`':
		return skipString(rs, i), true
	case c == '{':
		return skipBracket(rs, i, '{', '}'), true
	case c == '[':
		return skipBracket(rs, i, '[', ']'), true
	case c == '$':
		i++
		for i < len(rs) && isIdentRune(rs[i], false) {
			i++
		}
		return i, true
	case unicode.IsDigit(c) || (c == '.' && i+1 < len(rs) && unicode.IsDigit(rs[i+1])):
		for i < len(rs) && (isIdentRune(rs[i], false) || rs[i] == '.' || ((rs[i] == '+' || rs[i] == '-') && (rs[i-1] == 'e' || rs[i-1] == 'E'))) {
			i++
		}
		return i, true
	}
	return i, false
}

// skipBracket returns the index just past the bracket that closes the one at i, stepping over
// strings.
func skipBracket(rs []rune, i int, opening, closing rune) int {
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

// skipSpace returns the index of the first rune from i that is not white space.
func skipSpace(rs []rune, i int) int {
	for i < len(rs) && unicode.IsSpace(rs[i]) {
		i++
	}
	return i
}

// wordAt returns the identifier that starts at i ("" if none does) and the index just past it.
func wordAt(rs []rune, i int) (string, int) {
	if i >= len(rs) || !isIdentRune(rs[i], true) {
		return "", i
	}
	start := i
	for i < len(rs) && isIdentRune(rs[i], false) {
		i++
	}
	return string(rs[start:i]), i
}

// grouping is a label list that decides which labels a result keeps: an aggregation's by or
// without, or a binary operation's on or ignoring.
type grouping struct {
	op     string   // the aggregation (sum, max …), or on or ignoring
	clause string   // by, without, on or ignoring; "" for an aggregation with neither
	labels []string // as listed
}

func (g grouping) String() string {
	if g.op == g.clause {
		return fmt.Sprintf("%s (%s)", g.op, strings.Join(g.labels, ", "))
	}
	if g.clause == "" {
		return g.op + "(…)"
	}
	return fmt.Sprintf("%s %s (%s)", g.op, g.clause, strings.Join(g.labels, ", "))
}

// groupings returns the groupings of a PromQL expression, in order: each aggregation's, with
// its by or without written before its argument (sum by (job) (x)) or after it
// (sum(x) by (job)), and each on or ignoring of a binary operation. The label lists of
// group_left and group_right, which add labels to those on or ignoring keeps, are not
// groupings. Like vectorSelectors, a lexer: strings, selectors' matchers and ranges are
// stepped over.
func groupings(expr string) []grouping {
	var out []grouping
	rs := []rune(expr)
	// labelList reads the parenthesised list at i, if there is one, and returns the index
	// past it.
	labelList := func(i int) ([]string, int) {
		if i >= len(rs) || rs[i] != '(' {
			return nil, i
		}
		end := skipBracket(rs, i, '(', ')')
		var labels []string
		for l := range strings.SplitSeq(string(rs[i+1:max(end-1, i+1)]), ",") {
			if l = strings.Trim(strings.TrimSpace(l), "\"'`"); l != "" {
				labels = append(labels, l)
			}
		}
		return labels, end
	}
	// clauseAt reads a by or without and its list at i, if there is one.
	clauseAt := func(i int) (clause string, labels []string, end int) {
		word, after := wordAt(rs, skipSpace(rs, i))
		if word != "by" && word != "without" {
			return "", nil, i
		}
		labels, end = labelList(skipSpace(rs, after))
		return word, labels, end
	}
	for word, i := nextWord(rs, 0); word != ""; word, i = nextWord(rs, i) {
		switch {
		case promqlAggregations[word]:
			g := grouping{op: word}
			var argument int
			g.clause, g.labels, argument = clauseAt(i)
			argument = skipSpace(rs, argument)
			if argument >= len(rs) || rs[argument] != '(' {
				continue // no aggregation: a label or metric of that name
			}
			if g.clause == "" {
				g.clause, g.labels, _ = clauseAt(skipBracket(rs, argument, '(', ')'))
			}
			out = append(out, g)
			// On into the argument; a by or without after it is stepped over below.
			i = argument
		case word == "on" || word == "ignoring":
			var labels []string
			labels, i = labelList(skipSpace(rs, i))
			out = append(out, grouping{op: word, clause: word, labels: labels})
		case promqlGroupings[word]: // by, without, group_left, group_right
			_, i = labelList(skipSpace(rs, i))
		}
	}
	return out
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

func TestGroupings(t *testing.T) {
	t.Parallel()
	for expr, want := range map[string]string{
		`up == 0`:                           `[]`,
		`max by (namespace, job) (x) > 300`: `[max by (namespace, job)]`,
		`sum(rate(x[5m])) by (namespace,job) / sum without (instance) (y)`: `[sum by (namespace, job) sum without (instance)]`,
		`histogram_quantile(0.95, sum by (job, le) (rate(h_bucket[5m])))`:  `[sum by (job, le)]`,
		`sum(x{q="by (a)"})`: `[sum(…)]`,
		`a > 0 and on (namespace, job) sum by (namespace, job) (b) == 0`:              `[on (namespace, job) sum by (namespace, job)]`,
		`a * ignoring (instance) group_left (version) b_info`:                         `[ignoring (instance)]`,
		`topk by (queue) (3, count by ("namespace", queue) (x))`:                      `[topk by (queue) count by (namespace, queue)]`,
		`max by(namespace,job)(x) unless on(namespace) max(y) by (namespace)`:         `[max by (namespace, job) on (namespace) max by (namespace)]`,
		`label_replace(k{deployment=~"a|b"}, "job", "$1", "deployment", "(.+)") == 0`: `[]`,
		`count(x) without (job)`: `[count without (job)]`,
	} {
		if got := fmt.Sprint(groupings(expr)); got != want {
			t.Errorf("groupings(%s) = %s, want %s", expr, got, want)
		}
	}
}
