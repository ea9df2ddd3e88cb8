package main

import (
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
	if r.report(&out, "", 0) {
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
	if r.report(&out, "^$", 2) {
		t.Fatalf("the report passed with 1 of the 2 wanted tests run (and 2 subtests):\n%s", out.String())
	}
	out.Reset()
	if !r.report(&out, "^$", 1) {
		t.Fatalf("the report failed with the 1 wanted test run:\n%s", out.String())
	}
}
