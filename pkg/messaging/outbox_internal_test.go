package messaging

import "testing"

// A JSON text carries a NUL only as the escape \u0000; an escaped backslash before u0000 is
// text, which PostgreSQL's jsonb stores.
func TestJSONHasNULReadsEscapes(t *testing.T) {
	for _, tc := range []struct {
		json string
		want bool
	}{
		{`{"a":"x"}`, false},
		{`{"a":"\u0000"}`, true},
		{`{"\u0000":1}`, true},
		{`{"a":"x\u00001"}`, true},
		{`{"a":"\\u0000"}`, false},
		{`{"a":"\\\u0000"}`, true},
		{`{"a":"\u00e9\n\"\\"}`, false},
		{`{"a":"\u0001"}`, false},
	} {
		if got := jsonHasNUL([]byte(tc.json)); got != tc.want {
			t.Errorf("jsonHasNUL(%s) = %v, want %v", tc.json, got, tc.want)
		}
	}
}
