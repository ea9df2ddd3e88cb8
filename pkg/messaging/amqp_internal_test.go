package messaging

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
)

// A correlation id that no message could carry on is read as none, from the property and from
// the header alike: a handler that passes it on would have its Enqueue refused on every
// delivery. One that can travel is kept, the property before the header.
func TestFromDeliveryKeepsOnlyACorrelationIDThatCanTravelOn(t *testing.T) {
	long := strings.Repeat("c", maxShortString+1)
	for _, tc := range []struct {
		name, property, header, want string
	}{
		{"property", "req-1", "", "req-1"},
		{"header, without the property", "", "req-2", "req-2"},
		{"the property before the header", "req-1", "req-2", "req-1"},
		{"255 bytes", "", long[1:], long[1:]},
		{"a header over 255 bytes", "", long, ""},
		{"a NUL in the property", "a\x00b", "", ""},
		{"a NUL in the header", "", "a\x00b", ""},
		{"invalid UTF-8", "a\xffb", "", ""},
		{"a property that cannot travel, then the header", "a\x00b", "req-2", "req-2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := amqp.Delivery{MessageId: uuid.New().String(), Body: []byte(`{}`), CorrelationId: tc.property, Headers: amqp.Table{}}
			if tc.header != "" {
				d.Headers[correlationIDHeader] = tc.header
			}
			m, err := fromDelivery(d, 0)
			if err != nil {
				t.Fatal(err)
			}
			if m.CorrelationID != tc.want {
				t.Fatalf("correlation id %q, want %q", truncate(m.CorrelationID), tc.want)
			}
			if m.CorrelationID != "" {
				if err := checkEnvelope("", "k", toPublishing(m, ""), 0); err != nil || unstorable(m) != "" {
					t.Fatalf("a message carrying it on is refused: %v %s", err, unstorable(m))
				}
			}
		})
	}
}

// A field cut for a log line or an error is cut before the character the limit falls in, and
// so stays valid UTF-8; invalid already, it is cut near the limit all the same.
func TestCutUTF8CutsAtACharacter(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		s    string
		n    int
		want string
	}{
		{"abc", 3, "abc"},
		{"abcd", 3, "abc"},
		{"aé", 2, "a"},
		{"é", 1, ""},
		{"a😀b", 4, "a"}, // inside a 4-byte character, at its last byte
		{"a😀b", 5, "a😀"},
		{"a\x80\x80\x80\x80\x80", 5, "a\x80\x80\x80\x80"}, // no character to step back to
	} {
		if got := cutUTF8(tc.s, tc.n); got != tc.want {
			t.Errorf("cutUTF8(%q, %d) = %q, want %q", tc.s, tc.n, got, tc.want)
		}
	}
	long := strings.Repeat("a", maxEchoed-1) + "é"
	if got := truncate(long); !utf8.ValidString(got) || got != long[:maxEchoed-1]+"…" {
		t.Errorf("truncate of %d ASCII bytes then é = %q, want them and an ellipsis", maxEchoed-1, got)
	}
}

// CheckBrokerURL refuses a list that names no broker or has any URL that does not parse, and
// never quotes it.
func TestCheckBrokerURLRefusesAnyURLThatDoesNotParse(t *testing.T) {
	const password = "s3cret"
	good, bad := "amqp://guest:guest@127.0.0.1:5672/", "amqp://user:"+password+"@host/%zz"
	for list, want := range map[string]string{
		good:               "",
		good + ", " + good: "",
		"":                 "names no broker",
		" , ":              "names no broker",
		bad:                "1 of its 1 broker URLs do not",
		good + "," + bad:   "1 of its 2 broker URLs do not",
		"http://host/":     "1 of its 1 broker URLs do not",
	} {
		err := CheckBrokerURL(list)
		switch {
		case want == "" && err != nil, want != "" && (err == nil || !strings.Contains(err.Error(), want)):
			t.Errorf("CheckBrokerURL(%q) = %v, want %q", list, err, want)
		case err != nil && strings.Contains(err.Error(), password):
			t.Errorf("CheckBrokerURL quotes the password: %v", err)
		}
	}
}
