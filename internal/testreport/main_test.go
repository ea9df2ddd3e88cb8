package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A package that timed out fails without a failing test: the report shows the start of its
// panic and the test that never ended, with the end of its output, and fails.
func TestATimedOutPackageNamesTheTestStillRunning(t *testing.T) {
	stream := strings.Join([]string{
		`{"Action":"run","Package":"p","Test":"TestQuick"}`,
		`{"Action":"pass","Package":"p","Test":"TestQuick"}`,
		`{"Action":"run","Package":"p","Test":"TestHangs"}`,
		`{"Action":"output","Package":"p","Test":"TestHangs","Output":"waiting for the relay\n"}`,
		`{"Action":"output","Package":"p","Output":"panic: test timed out after 15m0s\n"}`,
		`{"Action":"output","Package":"p","Output":"running tests:\n"}`,
		`{"Action":"output","Package":"p","Output":"\tTestHangs (15m0s)\n"}`,
		`{"Action":"output","Package":"p","Output":"FAIL\tp\t900.1s\n"}`,
		`{"Action":"fail","Package":"p","Elapsed":900.1}`,
	}, "\n")
	r, err := read(strings.NewReader(stream))
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if r.report(&out, nil, nil, 0) {
		t.Fatal("the report passed a package that timed out")
	}
	for _, want := range []string{"panic: test timed out after 15m0s", "\tTestHangs (15m0s)", "--- NO RESULT: TestHangs (p)", "waiting for the relay", "1 passed, 0 failed"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the report lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "NO RESULT: TestQuick") {
		t.Errorf("the report lists a test that ended:\n%s", out.String())
	}
}

// -want counts the tests the -run pattern names, top-level ones: a subtest is not one of them,
// so a test that did not run is not made up for by another's subtests.
func TestWantCountsTopLevelTestsOnly(t *testing.T) {
	stream := strings.Join([]string{
		`{"Action":"run","Package":"p","Test":"TestA"}`,
		`{"Action":"run","Package":"p","Test":"TestA/one"}`,
		`{"Action":"pass","Package":"p","Test":"TestA/one"}`,
		`{"Action":"run","Package":"p","Test":"TestA/two"}`,
		`{"Action":"pass","Package":"p","Test":"TestA/two"}`,
		`{"Action":"pass","Package":"p","Test":"TestA"}`,
		`{"Action":"output","Package":"p","Output":"ok  \tp\t1.0s\n"}`,
		`{"Action":"pass","Package":"p","Elapsed":1}`,
	}, "\n")
	r, err := read(strings.NewReader(stream))
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if r.report(&out, nil, nil, 2) {
		t.Fatalf("the report passed with 1 of the 2 wanted tests run (and 2 subtests):\n%s", out.String())
	}
	out.Reset()
	if !r.report(&out, nil, nil, 1) {
		t.Fatalf("the report failed with the 1 wanted test run:\n%s", out.String())
	}
}

// skipStream is a go test -json stream of package p in which each test of reasons skipped,
// saying its reason as t.Skip does.
func skipStream(reasons map[string]string) string {
	var lines []string
	for name, reason := range reasons {
		lines = append(lines,
			`{"Action":"run","Package":"p","Test":"`+name+`"}`,
			`{"Action":"output","Package":"p","Test":"`+name+`","Output":"    p_test.go:12: `+reason+`\n"}`,
			`{"Action":"output","Package":"p","Test":"`+name+`","Output":"--- SKIP: `+name+` (0.00s)\n"}`,
			`{"Action":"skip","Package":"p","Test":"`+name+`"}`)
	}
	return strings.Join(append(lines,
		`{"Action":"output","Package":"p","Output":"ok  \tp\t1.0s\n"}`,
		`{"Action":"pass","Package":"p","Elapsed":1}`), "\n")
}

const benchSkip = "the benchmark suite takes minutes; run scripts/bench.sh (BENCH=1)"

// A skip is allowed by its whole reason, word for word: one that only mentions an allowed
// reason, or the variable it names, is a skip nobody allowed, and does not count for -want.
func TestAllowedSkipsMatchTheirWholeReason(t *testing.T) {
	r, err := read(strings.NewReader(skipStream(map[string]string{
		"TestBench":   benchSkip,
		"TestFlaky":   "flaky on a busy machine; " + benchSkip,
		"TestMention": "needs BENCH=1 and TEST_LONG=1",
	})))
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if r.report(&out, reasons{benchSkip}, nil, 0) {
		t.Fatalf("the report passed skips whose reasons only mention an allowed one:\n%s", out.String())
	}
	_, notAllowed, found := strings.Cut(out.String(), "not on the allowed list")
	if !found {
		t.Fatalf("the report lists no skip as not allowed:\n%s", out.String())
	}
	for _, name := range []string{"TestFlaky", "TestMention"} {
		if !strings.Contains(notAllowed, name) {
			t.Errorf("%s is not among the skips not allowed:\n%s", name, out.String())
		}
	}
	if strings.Contains(notAllowed, "TestBench ") {
		t.Errorf("TestBench, skipped for the allowed reason, is among the skips not allowed:\n%s", out.String())
	}

	r, err = read(strings.NewReader(skipStream(map[string]string{"TestBench": benchSkip, "TestMention": "needs BENCH=1"})))
	if err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if !r.report(&out, reasons{benchSkip, "needs BENCH=1"}, nil, 2) {
		t.Fatalf("the report failed with both skips' reasons allowed:\n%s", out.String())
	}
	out.Reset()
	if r.report(&out, reasons{benchSkip}, nil, 2) {
		t.Fatalf("-want 2 passed with one of the 2 tests skipped for a reason not allowed:\n%s", out.String())
	}
}

// -collect lists the top-level tests skipped for one of its reasons, word for word, per
// package as a -run pattern; -skipped appends, so that several phases collect into one file.
func TestCollectTakesWholeReasonsAndAppends(t *testing.T) {
	restart := "restarts the shared servers; set TEST_SERVER_RESTARTS=1 and run alone"
	r, err := read(strings.NewReader(skipStream(map[string]string{
		"TestRestart":     restart,
		"TestRestart/sub": restart,
		"TestOther":       "see " + restart,
		"TestBench":       benchSkip,
	})))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := r.collect(reasons{restart}), "p ^(TestRestart)$\n"; got != want {
		t.Errorf("collect = %q, want %q", got, want)
	}
	if got := r.collect(nil); got != "" {
		t.Errorf("collect without reasons = %q, want nothing", got)
	}
	file := filepath.Join(t.TempDir(), "restarts")
	for _, s := range []string{"a ^(TestA)$\n", "", "b ^(TestB)$\n"} {
		if err := appendFile(file, s); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := os.ReadFile(file); err != nil || string(got) != "a ^(TestA)$\nb ^(TestB)$\n" {
		t.Errorf("the file holds %q (%v), want both phases' lines", got, err)
	}
}

// A later phase runs the tests -collect lists, by their top-level names: a subtest skipped for
// one of those reasons would never run there, and fails the run, saying so; the same skip of a
// top-level test passes.
func TestASubtestSkippedForACollectedReasonFails(t *testing.T) {
	restart := "restarts the shared servers; set TEST_SERVER_RESTARTS=1 and run alone"
	r, err := read(strings.NewReader(skipStream(map[string]string{"TestRestart": restart})))
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if !r.report(&out, reasons{restart}, reasons{restart}, 1) {
		t.Fatalf("the report failed a top-level test skipped for a collected reason:\n%s", out.String())
	}
	r, err = read(strings.NewReader(skipStream(map[string]string{"TestSuite/restart": restart})))
	if err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if r.report(&out, reasons{restart}, reasons{restart}, 0) {
		t.Fatalf("the report passed a subtest skipped for a collected reason, which no phase would run:\n%s", out.String())
	}
	if _, nested, found := strings.Cut(out.String(), "subtests skipped for a reason whose tests a later phase runs"); !found || !strings.Contains(nested, "TestSuite/restart") {
		t.Fatalf("the report does not name the subtest as one no phase would run:\n%s", out.String())
	}
}

// A skip message of several lines is its reason whole: testing writes its first line after the
// file and line, and indents the others 4 more, each an output event of its own (and test2json
// cuts a long line into several). A skip whose first line alone is an allowed reason is one
// nobody allowed, and -collect does not take it; the whole message, allowed, passes.
func TestAMultiLineSkipIsMatchedWhole(t *testing.T) {
	restart := "restarts the shared servers; set TEST_SERVER_RESTARTS=1 and run alone"
	var stream []string
	// t.Skip(benchSkip + "\nbut this one is flaky too")
	stream = append(stream, skipEvents("TestBench", `=== RUN   TestBench\n`, `    p_test.go:12: `+benchSkip+`\n`, `        but this one is flaky too\n`)...)
	// t.Log("connecting"); t.Skip(restart + "\n\n(and it is slow)"), its first line cut in two
	stream = append(stream, skipEvents("TestRestart", `    p_test.go:20: connecting\n`, `    p_test.go:21: restarts the shared servers; `,
		`set TEST_SERVER_RESTARTS=1 and run alone\n`, `        \n`, `        (and it is slow)\n`)...)
	stream = append(stream, `{"Action":"output","Package":"p","Output":"ok  \tp\t1.0s\n"}`, `{"Action":"pass","Package":"p","Elapsed":1}`)
	r, err := read(strings.NewReader(strings.Join(stream, "\n")))
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{
		"TestBench":   benchSkip + "\nbut this one is flaky too",
		"TestRestart": restart + "\n\n(and it is slow)",
	} {
		if got := r.reason(test{"p", name}); got != want {
			t.Errorf("%s's reason = %q, want %q", name, got, want)
		}
	}
	var out strings.Builder
	if r.report(&out, reasons{benchSkip, restart}, reasons{restart}, 0) {
		t.Errorf("the report passed skips whose first line only is an allowed reason:\n%s", out.String())
	}
	if got := r.collect(reasons{restart}); got != "" {
		t.Errorf("collect took a skip by its first line: %q", got)
	}
	out.Reset()
	if !r.report(&out, reasons{benchSkip + "\nbut this one is flaky too", restart + "\n\n(and it is slow)"}, nil, 2) {
		t.Errorf("the report failed skips whose whole reasons are allowed:\n%s", out.String())
	}
}

// skipEvents is the go test -json events of test name of package p that printed outputs (each
// a line, as test2json makes it an event) and skipped.
func skipEvents(name string, outputs ...string) []string {
	lines := []string{`{"Action":"run","Package":"p","Test":"` + name + `"}`}
	for _, o := range outputs {
		lines = append(lines, `{"Action":"output","Package":"p","Test":"`+name+`","Output":"`+o+`"}`)
	}
	return append(lines,
		`{"Action":"output","Package":"p","Test":"`+name+`","Output":"--- SKIP: `+name+` (0.00s)\n"}`,
		`{"Action":"skip","Package":"p","Test":"`+name+`"}`)
}

// t.Skip("reason\n") is skipped for "reason": testing ends the message it prints with an
// indented blank line for the newline (t.Skip adds one of its own), a line of nothing, not of
// the reason. The events are those go test -json (Go 1.26) writes for these calls.
func TestASkipReasonEndingInANewlineIsItsText(t *testing.T) {
	restart := "restarts the shared servers; set TEST_SERVER_RESTARTS=1 and run alone"
	var stream []string
	// t.Skip(benchSkip + "\n")
	stream = append(stream, skipEvents("TestBench", `=== RUN   TestBench\n`, `    p_test.go:5: `+benchSkip+`\n`, `        \n`)...)
	// t.Skip(restart + "\n\n")
	stream = append(stream, skipEvents("TestRestart", `    p_test.go:9: `+restart+`\n`, `        \n`, `        \n`)...)
	// t.Skip(restart + "\nand slow\n")
	stream = append(stream, skipEvents("TestSlow", `    p_test.go:13: `+restart+`\n`, `        and slow\n`, `        \n`)...)
	stream = append(stream, `{"Action":"output","Package":"p","Output":"ok  \tp\t1.0s\n"}`, `{"Action":"pass","Package":"p","Elapsed":1}`)
	r, err := read(strings.NewReader(strings.Join(stream, "\n")))
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"TestBench": benchSkip, "TestRestart": restart, "TestSlow": restart + "\nand slow"} {
		if got := r.reason(test{"p", name}); got != want {
			t.Errorf("%s's reason = %q, want %q", name, got, want)
		}
	}
	var out strings.Builder
	if !r.report(&out, reasons{benchSkip, restart, restart + "\nand slow"}, reasons{restart}, 3) {
		t.Errorf("the report failed skips whose reasons, ending in a newline, are allowed:\n%s", out.String())
	}
	if got, want := r.collect(reasons{restart}), "p ^(TestRestart)$\n"; got != want {
		t.Errorf("collect = %q, want %q", got, want)
	}
}

// Output printed after a skip's message (by a Cleanup, say) is not its reason when a line of
// another indentation comes between them. A line directly after the message, indented as
// testing indents a message's further lines, is one of them as far as the stream tells: go
// test -json writes the same events for t.Skip("a\nb") as for t.Skip("a") followed by a
// Cleanup's fmt.Println("        b"). It is taken as part of the reason, so that a message
// whose first line alone is allowed is not passed for it; the report says that its first line
// alone is an allowed reason, and what the lines after it may be.
func TestOutputAfterASkipMessage(t *testing.T) {
	var stream []string
	stream = append(stream, skipEvents("TestLogged", `    p_test.go:5: `+benchSkip+`\n`,
		`    p_test.go:3: a Cleanup's t.Log\n`, `        and its second line\n`)...)
	stream = append(stream, skipEvents("TestPrinted", `    p_test.go:5: `+benchSkip+`\n`,
		`cleanup: dropped the database\n`, `        with its 3 tables\n`)...)
	stream = append(stream, skipEvents("TestRightAfter", `    p_test.go:5: `+benchSkip+`\n`, `        printed by a Cleanup\n`)...)
	stream = append(stream, `{"Action":"output","Package":"p","Output":"ok  \tp\t1.0s\n"}`, `{"Action":"pass","Package":"p","Elapsed":1}`)
	r, err := read(strings.NewReader(strings.Join(stream, "\n")))
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{
		// The last message is the reason: a Cleanup's t.Log after the skip is (see reason).
		"TestLogged":     "a Cleanup's t.Log\nand its second line",
		"TestPrinted":    benchSkip,
		"TestRightAfter": benchSkip + "\nprinted by a Cleanup",
	} {
		if got := r.reason(test{"p", name}); got != want {
			t.Errorf("%s's reason = %q, want %q", name, got, want)
		}
	}
	var out strings.Builder
	if r.report(&out, reasons{benchSkip}, nil, 0) {
		t.Fatalf("the report passed a skip whose reason has lines after its allowed first one:\n%s", out.String())
	}
	_, notAllowed, _ := strings.Cut(out.String(), "not on the allowed list")
	if strings.Contains(notAllowed, "TestPrinted") {
		t.Errorf("TestPrinted, its reason allowed and a Cleanup's output after another line, is not allowed:\n%s", out.String())
	}
	_, right, found := strings.Cut(notAllowed, "TestRightAfter")
	if !found {
		t.Fatalf("TestRightAfter is not among the skips not allowed:\n%s", out.String())
	}
	right, _, _ = strings.Cut(right, "\n  p ")
	for _, want := range []string{"its first line alone is an allowed reason", "Cleanup"} {
		if !strings.Contains(right, want) {
			t.Errorf("the report says not %q of TestRightAfter:\n%s", want, out.String())
		}
	}
	if _, logged, _ := strings.Cut(notAllowed, "TestLogged"); strings.Contains(strings.SplitN(logged, "\n  p ", 2)[0], "allowed reason") {
		t.Errorf("the report says of TestLogged, no line of whose reason is allowed, that one is:\n%s", out.String())
	}
}
