package messaging

import (
	"strings"
	"testing"
)

// jsonb gives each number back as numeric prints it, written out in full, and the relay sends
// that text: jsonbRefusal's length of it is PostgreSQL 15's, each case's want checked with
// octet_length(x::jsonb::text), less the space jsonb adds after each ',' and ':' (the
// publisher drops them again). A string comes back as long or shorter: its length as given
// bounds it.
func TestJSONBPrintedLength(t *testing.T) {
	for _, tc := range []struct {
		json string
		want int64
	}{
		{`0`, 1}, {`-0`, 1}, {`0.0`, 3}, {`-0.0`, 3}, {`0e5`, 1}, {`0e-3`, 5}, {`-0e-3`, 5},
		{`0.000e-16380`, 16385}, {`0e-16383`, 16385}, {`0e1073741822`, 1},
		{`1`, 1}, {`-1`, 2}, {`12`, 2}, {`1.5`, 3}, {`-1.50`, 5},
		{`1e5`, 6}, {`1E+5`, 6}, {`-1e5`, 7}, {`1.5e-7`, 10}, {`-1.5E-7`, 11}, {`12e-1`, 3},
		{`100e-2`, 4}, {`0.001e3`, 1}, {`0.001`, 5}, {`123.456e1`, 7}, {`123.456e-1`, 7},
		{`123.456e5`, 8}, {`9.99e2`, 3}, {`1e0`, 1}, {`1e-0`, 1}, {`5e-1`, 3}, {`0.5e1`, 1},
		{`-0.05e1`, 4}, {`123e-5`, 7}, {`-123.45e-10`, 15},
		{`1234567890123456789012345678901234567890`, 40}, {`0.000000000000000000000000001`, 29},
		{`1e131071`, 131072}, {`-1e131071`, 131073}, {`0.0001e131075`, 131072},
		{`10e131070`, 131072}, {`1.0e131071`, 131072},
		{`1e-16383`, 16385}, {`-1e-16383`, 16386}, {`0.1e-16382`, 16385}, {`1.5e-16382`, 16385},
		// Whole payloads: white space dropped, numbers written out, strings as given.
		{`{"a": 1e5, "b" : [ -0.0 , 1.5e-7 ]}`, 33},
		{" [ ] \n", 2},
		{`{"s":"a\"b\\c\nd\t","n":12e-1,"t":true,"f":false,"z":null}`, 56},
		{`[1e131071,-1E+131071,0e-16383]`, 278534},
		{`"1e131071"`, 10},
		{`{"x":{"y":[[],{}]}}`, 19},
		{`["\u00e9\ud83d\ude00\/"]`, 24}, // jsonb's 11: ["é😀/"]
	} {
		why, got := jsonbRefusal([]byte(tc.json))
		if why != "" || got != tc.want {
			t.Errorf("jsonbRefusal(%.40s) = %q, %d, want \"\", %d", tc.json, why, got, tc.want)
		}
	}
}

// The measure rides on the scan for what jsonb refuses: a payload of numbers costs no
// allocation, however many it holds.
func TestJSONBPrintedLengthAllocatesNothing(t *testing.T) {
	payload := []byte("[" + strings.Repeat(`1e131071,-1.5e-7,12,`, 1000) + `0]`)
	if n := testing.AllocsPerRun(10, func() { _, _ = jsonbRefusal(payload) }); n != 0 {
		t.Errorf("jsonbRefusal of 3,001 numbers allocates %v times, want none", n)
	}
}
