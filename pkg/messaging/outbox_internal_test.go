package messaging

import "testing"

// What jsonb refuses in JSON that encoding/json's Valid accepts, each case checked against
// PostgreSQL 15 ('…'::jsonb): a NUL, an unpaired surrogate, invalid UTF-8, a number beyond
// numeric's range. An escaped backslash before u0000 is text, and the numbers at the limits
// are stored.
func TestJSONBRefusals(t *testing.T) {
	for _, tc := range []struct {
		json   string
		refuse bool
	}{
		{`{"a":"x","n":[1,-2.5,3e5,true,null]}`, false},
		{`{"a":"\u0000"}`, true},
		{`{"\u0000":1}`, true},
		{`{"a":"x\u00001"}`, true},
		{`{"a":"\\u0000"}`, false},
		{`{"a":"\\\u0000"}`, true},
		{`{"a":"\u00e9\n\"\\","b":"\u0001"}`, false},
		{`{"a":"\ud83d\ude00"}`, false},
		{`{"a":"\ud800"}`, true},
		{`{"a":"\ud800x"}`, true},
		{`{"a":"\ud800\u0041"}`, true},
		{`{"a":"\udc00"}`, true},
		{"{\"a\":\"\xff\"}", true},
		{`[1e131071, 10e131070, 1.0e131071, 0.0001e131075, 0e999999, 1e-16383, 0.1e-16382, -1E+5]`, false},
		{`[1e131072]`, true},
		{`[123e131070]`, true},
		{`[1e-16384]`, true},
		{`[1.5e-16383]`, true},
		{`[0e-99999]`, true},
		{`[0.000e-16381]`, true},
		{`{"a":"1e999999"}`, false},
		{`[0e1073741822, -0.0E+0, 0e-0]`, false},
		{`[0e1073741823]`, true},
		{`{"a":-0.0E+9999999999}`, true},
	} {
		if got := jsonbRefusal([]byte(tc.json)); (got != "") != tc.refuse {
			t.Errorf("jsonbRefusal(%s) = %q, want refused: %v", tc.json, got, tc.refuse)
		}
	}
}
