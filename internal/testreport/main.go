// Command testreport reads `go test -json` on standard input and makes its skips visible: it
// prints each package's result line as go test would, the output of every failed test, and
// every skipped test with its reason. It fails when a test failed, when a test skipped for a
// reason that is not, word for word, one of the -allow flags' (a reason that merely mentions
// one is a skip nobody allowed), or when fewer tests ran than -want. With -skipped FILE it also
// appends to FILE, for the skips whose reason is one of the -collect flags', one line per
// package: the package, then a -run pattern of those tests (scripts/test.sh runs them in a
// later phase; several phases may collect into one FILE). That phase runs top-level tests, so
// a subtest that skips for a -collect reason fails the run: nothing would ever run it.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strings"
)

// event is one line of `go test -json` (see `go doc test2json`).
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
	Elapsed float64
}

type test struct{ pkg, name string }

func main() {
	var allow, collect reasons
	flag.Var(&allow, "allow", "a skip reason allowed, exactly (repeatable; none: no skip is allowed)")
	flag.Var(&collect, "collect", "a skip reason, exactly, whose tests -skipped lists (repeatable)")
	skipped := flag.String("skipped", "", "file to append the collected skipped tests to")
	want := flag.Int("want", 0, "fail unless at least this many top-level tests ran (subtests do not count)")
	flag.Parse()
	r, err := read(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testreport:", err)
		os.Exit(2)
	}
	ok := r.report(os.Stdout, allow, collect, *want)
	if *skipped != "" {
		if err := appendFile(*skipped, r.collect(collect)); err != nil {
			fmt.Fprintln(os.Stderr, "testreport:", err)
			os.Exit(2)
		}
	}
	if !ok {
		os.Exit(1)
	}
}

// reasons are skip reasons, each given in full by a flag of its own.
type reasons []string

func (rs *reasons) String() string { return strings.Join(*rs, "; ") }

func (rs *reasons) Set(v string) error {
	*rs = append(*rs, v)
	return nil
}

// appendFile appends s to the file at path, which it creates if need be.
func appendFile(path, s string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	_, err = f.WriteString(s)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// run is what a `go test -json` stream told.
type run struct {
	output  map[test][]string // each test's output lines; a package's own under name ""
	results map[test]string   // pass, fail or skip
	order   []test            // tests and packages, as they ended
	started []test            // tests, as they started
}

// crashLines is how much of a package's own output is shown when it failed without a failing
// test (a timeout's panic, with the tests still running, comes first).
const crashLines = 40

func read(in io.Reader) (*run, error) {
	r := &run{output: map[test][]string{}, results: map[test]string{}}
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var e event
		if err := json.Unmarshal(line, &e); err != nil || e.Action == "" {
			fmt.Println(string(line)) // go test's own words (a build failure, say)
			continue
		}
		key := test{e.Package, e.Test}
		switch e.Action {
		case "build-output":
			fmt.Print(e.Output) // why a package did not build
		case "output":
			r.output[key] = append(r.output[key], e.Output)
		case "run":
			r.started = append(r.started, key)
		case "pass", "fail", "skip":
			r.results[key] = e.Action
			r.order = append(r.order, key)
		}
	}
	return r, sc.Err()
}

// crash prints what tells why pkg failed when none of its tests did: the start of its own
// output (a timeout's panic names the tests still running), and the tests that started and
// never ended, with the end of their output.
func (r *run) crash(w io.Writer, pkg string) {
	fmt.Fprintf(w, "--- %s failed without a failing test (a timeout or a crash); its output:\n", pkg)
	shown := 0
	for _, l := range r.output[test{pkg, ""}] {
		if shown == crashLines {
			fmt.Fprintln(w, "    …")
			break
		}
		fmt.Fprint(w, "    ", l)
		shown++
	}
	for _, k := range r.started {
		if _, ended := r.results[k]; k.pkg != pkg || ended {
			continue
		}
		fmt.Fprintf(w, "--- NO RESULT: %s (%s), the end of its output:\n", k.name, k.pkg)
		out := r.output[k]
		for _, l := range out[max(0, len(out)-crashLines):] {
			fmt.Fprint(w, "    ", l)
		}
	}
}

// report prints the results and tells whether they pass. A skip for one of the collected
// reasons is one a later phase runs, by its top-level test's name: a subtest's is not allowed.
func (r *run) report(w io.Writer, allowed, collected reasons, want int) bool {
	ok := true
	passed, failed := 0, 0
	ran := 0 // top-level tests that ran or skipped for an allowed reason, for -want
	var skips, bad, nested []string
	failedTests := map[string]bool{} // packages with a failed test
	for k, res := range r.results {
		if k.name != "" && res == "fail" {
			failedTests[k.pkg] = true
		}
	}
	for _, k := range r.order {
		res := r.results[k]
		if k.name == "" {
			// The package's own result line, as go test prints it.
			for _, l := range r.output[k] {
				if strings.HasPrefix(l, "ok ") || strings.HasPrefix(l, "FAIL") || strings.HasPrefix(l, "?") || strings.HasPrefix(l, "---") {
					fmt.Fprint(w, l)
				}
			}
			if res == "fail" {
				ok = false
				if !failedTests[k.pkg] {
					r.crash(w, k.pkg)
				}
			}
			continue
		}
		topLevel := !strings.Contains(k.name, "/")
		switch res {
		case "pass":
			passed++
			if topLevel {
				ran++
			}
		case "fail":
			failed++
			if topLevel {
				ran++
			}
			ok = false
			fmt.Fprintf(w, "--- FAIL: %s (%s)\n", k.name, k.pkg)
			for _, l := range r.output[k] {
				fmt.Fprint(w, "    ", l)
			}
		case "skip":
			reason := r.reason(k)
			line := fmt.Sprintf("  %s %s: %s", k.pkg, k.name, strings.ReplaceAll(reason, "\n", "\n      "))
			skips = append(skips, line)
			switch {
			case !topLevel && slices.Contains(collected, reason):
				nested = append(nested, line)
			case !slices.Contains(allowed, reason):
				if n := allowedHead(reason, allowed); n > 0 {
					head := "line alone is"
					if n > 1 {
						head = fmt.Sprintf("%d lines alone are", n)
					}
					line += fmt.Sprintf("\n      (its first %s an allowed reason: the lines after are its message's own, or"+
						" output printed right after it (by a Cleanup, say) at the indentation testing gives a message's"+
						" further lines, which the stream does not tell apart; the whole must be allowed)", head)
				}
				bad = append(bad, line)
			case topLevel:
				ran++ // accounted for: it skipped for a reason the run allows
			}
		}
	}
	slices.Sort(skips)
	fmt.Fprintf(w, "skipped tests (%d):\n", len(skips))
	for _, s := range skips {
		fmt.Fprintln(w, s)
	}
	if len(bad) > 0 {
		ok = false
		slices.Sort(bad)
		fmt.Fprintf(w, "tests skipped for a reason not on the allowed list (docs/testing.md, Skips):\n%s\n", strings.Join(bad, "\n"))
	}
	if len(nested) > 0 {
		ok = false
		slices.Sort(nested)
		fmt.Fprintf(w, "subtests skipped for a reason whose tests a later phase runs (-collect): it runs top-level tests by name, so these would never run; skip their top-level test instead:\n%s\n", strings.Join(nested, "\n"))
	}
	if ran < want {
		ok = false
		fmt.Fprintf(w, "%d top-level tests ran or skipped for an allowed reason, want at least %d: a test was renamed or lost its skip\n", ran, want)
	}
	fmt.Fprintf(w, "%d passed, %d failed, %d skipped\n", passed, failed, len(skips))
	return ok
}

// reason is the message a skipped test gave, whole: its last message in its output, a line
// "file.go:N: text" and the lines directly after it that testing indents 4 spaces more, a
// message's second and later lines (unindented, joined by newlines), less the blank ones it
// ends with (t.Skip("reason\n") prints "reason" and an indented blank line). The output is
// read as one text: test2json makes each line an event of its own, and cuts a long one into
// several. Output printed after the message (by a Cleanup, say) is not part of it once another
// line comes between; printed directly after it at that indentation, it is a line of the
// message as far as the stream tells, so it is taken as one (report says so where the lines
// before it are an allowed reason): a message whose first line alone is allowed is not passed
// for one. A Cleanup's t.Log after the skip is the last message, and so the reason.
func (r *run) reason(k test) string {
	reason := "(no reason given)"
	lines := strings.Split(strings.Join(r.output[k], ""), "\n")
	for i := 0; i < len(lines); i++ {
		l := strings.TrimSpace(lines[i])
		if at := strings.Index(l, ".go:"); at > 0 && !strings.HasPrefix(l, "---") && !strings.HasPrefix(l, "===") {
			if j := strings.Index(l[at+4:], ": "); j >= 0 {
				message := []string{l[at+4+j+2:]}
				more := lines[i][:len(lines[i])-len(strings.TrimLeft(lines[i], " "))] + "    "
				for i+1 < len(lines) && strings.HasPrefix(lines[i+1], more) {
					i++
					message = append(message, strings.TrimPrefix(lines[i], more))
				}
				for len(message) > 1 && strings.TrimSpace(message[len(message)-1]) == "" {
					message = message[:len(message)-1]
				}
				reason = strings.Join(message, "\n")
			}
		}
	}
	return reason
}

// allowedHead is how many of reason's first lines, fewer than all, are an allowed reason by
// themselves; 0 if none are.
func allowedHead(reason string, allowed reasons) int {
	lines := strings.Split(reason, "\n")
	for n := len(lines) - 1; n > 0; n-- {
		if slices.Contains(allowed, strings.Join(lines[:n], "\n")) {
			return n
		}
	}
	return 0
}

// collect lists, per package, the top-level tests whose skip reason is one of these, as a -run
// pattern.
func (r *run) collect(these reasons) string {
	byPkg := map[string][]string{}
	for _, k := range r.order {
		if k.name != "" && !strings.Contains(k.name, "/") && r.results[k] == "skip" && slices.Contains(these, r.reason(k)) {
			byPkg[k.pkg] = append(byPkg[k.pkg], regexp.QuoteMeta(k.name))
		}
	}
	var b strings.Builder
	pkgs := make([]string, 0, len(byPkg))
	for p := range byPkg {
		pkgs = append(pkgs, p)
	}
	slices.Sort(pkgs)
	for _, p := range pkgs {
		fmt.Fprintf(&b, "%s ^(%s)$\n", p, strings.Join(byPkg[p], "|"))
	}
	return b.String()
}
