package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"unicode/utf8"
)

// MaxBodyBytes is the largest request body accepted (413 beyond).
const MaxBodyBytes = 1 << 20

// DecodeError is a request body that cannot become a command; Status is its HTTP status. Field
// names the field whose value has the wrong JSON type, if that is the fault.
type DecodeError struct {
	Status int
	Detail string
	Field  string
}

func (e *DecodeError) Error() string {
	if e.Field != "" {
		return e.Field + ": " + e.Detail
	}
	return e.Detail
}

// DecodePlaceOrder reads a place-order command strictly: one JSON object in UTF-8, no unknown
// fields, no trailing data. Malformed JSON is a 400; well-formed JSON with a value of the wrong type or
// out of range (a quantity of 1e30) is a 422; a body over the limit is a 413.
func DecodePlaceOrder(r io.Reader) (PlaceOrder, error) { return decodeStrict[PlaceOrder](r) }

// DecodeCancelOrder reads a cancel command as strictly; an empty body is a cancel without a
// reason.
func DecodeCancelOrder(r io.Reader) (CancelOrder, error) {
	cmd, err := decodeStrict[CancelOrder](r)
	var de *DecodeError
	if errors.As(err, &de) && de.Detail == emptyBody {
		return CancelOrder{}, nil
	}
	return cmd, err
}

const emptyBody = "empty body"

func decodeStrict[T any](r io.Reader) (T, error) {
	var cmd, zero T
	// The whole body first: one over the limit is a 413 whatever it holds, not a 400 for the
	// first fault the decoder meets before the limit.
	body, err := io.ReadAll(r)
	if err != nil {
		return zero, decodeError(err, nil)
	}
	// encoding/json would replace each invalid byte with U+FFFD and store and publish a string
	// the client never sent; JSON between systems is UTF-8 (RFC 8259, section 8.1).
	if !utf8.Valid(body) {
		return zero, &DecodeError{Status: http.StatusBadRequest, Detail: "malformed JSON: the body is not valid UTF-8"}
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cmd); err != nil {
		return zero, decodeError(err, body)
	}
	if err := dec.Decode(&struct{}{}); !errors.Is(err, io.EOF) {
		return zero, &DecodeError{Status: http.StatusBadRequest, Detail: "body must hold a single JSON object"}
	}
	return cmd, nil
}

// decodeError is err's problem; body is what was decoded, to name a field by its path.
func decodeError(err error, body []byte) *DecodeError {
	var (
		syntax   *json.SyntaxError
		typ      *json.UnmarshalTypeError
		tooLarge *http.MaxBytesError
	)
	switch {
	case errors.As(err, &tooLarge):
		return &DecodeError{Status: http.StatusRequestEntityTooLarge, Detail: fmt.Sprintf("body exceeds %d bytes", tooLarge.Limit)}
	case errors.As(err, &syntax):
		return &DecodeError{Status: http.StatusBadRequest, Detail: fmt.Sprintf("malformed JSON at byte %d", syntax.Offset)}
	case errors.Is(err, io.EOF):
		return &DecodeError{Status: http.StatusBadRequest, Detail: emptyBody}
	case errors.Is(err, io.ErrUnexpectedEOF):
		return &DecodeError{Status: http.StatusBadRequest, Detail: "malformed JSON: unexpected end"}
	case errors.As(err, &typ):
		want := expectedJSON(typ.Type)
		if typ.Field == "" {
			return &DecodeError{Status: http.StatusUnprocessableEntity, Detail: fmt.Sprintf("the body must be %s, got JSON %s", want, typ.Value)}
		}
		field := fieldAt(body, typ.Offset)
		if field == "" {
			field = typ.Field
		}
		return &DecodeError{Status: http.StatusUnprocessableEntity, Field: field, Detail: fmt.Sprintf("must be %s, got JSON %s", want, typ.Value)}
	default:
		// Unknown fields ("json: unknown field \"x\"") and other shape errors.
		return &DecodeError{Status: http.StatusBadRequest, Detail: err.Error()}
	}
}

// expectedJSON says in JSON's terms what a value of Go type t must be, without naming Go types.
func expectedJSON(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		bits := t.Bits() - 1
		return fmt.Sprintf("a whole number from -%d to %d", uint64(1)<<bits, uint64(1)<<bits-1)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return fmt.Sprintf("a whole number from 0 to %d", uint64(1)<<(t.Bits()-1)<<1-1)
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Bool:
		return "true or false"
	case reflect.Slice, reflect.Array:
		return "an array"
	default:
		return "an object"
	}
}

// fieldAt names the value of body that ends at offset (an opening bracket or brace ending its
// value there) by its path with array indices, as the validator names fields:
// lines[1].quantity, where json.UnmarshalTypeError's Field says lines.quantity. Its Offset
// points there. "" if no value ends at offset.
func fieldAt(body []byte, offset int64) string {
	type frame struct {
		array bool
		index int    // an array's current element
		key   string // an object's current key
		inKey bool   // an object's next token is a key
	}
	var stack []*frame
	next := func() { // the value at the top of the stack is done
		if len(stack) == 0 {
			return
		}
		if f := stack[len(stack)-1]; f.array {
			f.index++
		} else {
			f.inKey = true
		}
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber() // a number beyond float64's range (1e400) is a token like any other
	for {
		tok, err := dec.Token()
		if err != nil {
			return ""
		}
		if d, ok := tok.(json.Delim); ok && (d == '}' || d == ']') {
			stack = stack[:len(stack)-1]
			next()
			continue
		}
		if n := len(stack); n > 0 && stack[n-1].inKey {
			stack[n-1].key, stack[n-1].inKey = tok.(string), false
			continue
		}
		if dec.InputOffset() == offset {
			var path strings.Builder
			for _, f := range stack {
				switch {
				case f.array:
					fmt.Fprintf(&path, "[%d]", f.index)
				case path.Len() > 0:
					path.WriteString("." + f.key)
				default:
					path.WriteString(f.key)
				}
			}
			return path.String()
		}
		if d, ok := tok.(json.Delim); ok {
			stack = append(stack, &frame{array: d == '[', inKey: d == '{'})
			continue
		}
		next()
	}
}
