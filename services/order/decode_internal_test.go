package main

import (
	"errors"
	"net/http"
	"strings"
	"testing"
)

// A body that is JSON but not an object is refused while decoding, before a key is looked up:
// a null too, which encoding/json would take as an empty command, an order to validate and
// replay, or a cancel without a reason. An empty cancel body is still one without a reason.
func TestDecodeRefusesABodyThatIsNotAnObject(t *testing.T) {
	t.Parallel()
	for body, want := range map[string]string{
		`null`:    "the body must be an object, got JSON null",
		" null\n": "the body must be an object, got JSON null",
		`5`:       "the body must be an object, got JSON number",
		`"x"`:     "the body must be an object, got JSON string",
		`true`:    "the body must be an object, got JSON bool",
		`[]`:      "the body must be an object, got JSON array",
	} {
		for name, decode := range map[string]func(string) error{
			"place":  func(b string) error { _, err := DecodePlaceOrder(strings.NewReader(b)); return err },
			"cancel": func(b string) error { _, err := DecodeCancelOrder(strings.NewReader(b)); return err },
		} {
			var de *DecodeError
			if err := decode(body); !errors.As(err, &de) || de.Status != http.StatusUnprocessableEntity || de.Field != "" || de.Detail != want {
				t.Errorf("%s %q: %v, want a 422 saying %s", name, body, err, want)
			}
		}
	}
	for _, body := range []string{"", `{}`, `{"reason": null}`} {
		if cmd, err := DecodeCancelOrder(strings.NewReader(body)); err != nil || cmd.Reason != "" {
			t.Errorf("cancel %q: %+v, %v, want a cancel without a reason", body, cmd, err)
		}
	}
}
