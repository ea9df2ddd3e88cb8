package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/outboxkit/outbox-inbox/internal/platform"
)

// MaxBodyBytes is the largest request body accepted (413 beyond): as much as admission reads
// before a request takes its place, so that a body is not read while holding one, unless
// admission's read-ahead budget had no room for it.
const MaxBodyBytes = platform.MaxBufferedBody

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
// fields (names are case-sensitive), no field twice in one object, no trailing data. Malformed JSON is a 400; well-formed JSON with a value of the wrong type or
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
		return zero, readError(err)
	}
	// encoding/json would replace each invalid byte with U+FFFD and store and publish a string
	// the client never sent; JSON between systems is UTF-8 (RFC 8259, section 8.1).
	if !utf8.Valid(body) {
		return zero, &DecodeError{Status: http.StatusBadRequest, Detail: "malformed JSON: the body is not valid UTF-8"}
	}
	// An escaped surrogate without its pair ("\udfff") is valid JSON but no character: it
	// would become U+FFFD the same way.
	if at := loneSurrogate(body); at >= 0 {
		return zero, &DecodeError{Status: http.StatusBadRequest, Detail: fmt.Sprintf("malformed JSON at byte %d: an escaped UTF-16 surrogate without its pair", at+1)}
	}
	// encoding/json takes "Customer_ID" for customer_id and the last of two "customer_id"s,
	// and a field left out for its zero value: a client that sent any of these is told, not
	// guessed at. checkFields' other errors cannot happen in valid JSON.
	// A malformed body goes straight to the decoder, which says where (and builds nothing
	// before it has checked the whole body).
	var de *DecodeError
	if json.Valid(body) {
		fields := json.NewDecoder(bytes.NewReader(body))
		fields.UseNumber() // a number beyond float64's range (1e400) is a token like any other
		if err := checkBody(fields, reflect.TypeFor[T]()); errors.As(err, &de) {
			return zero, de
		}
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&cmd); err != nil {
		return zero, decodeError(err, body)
	}
	if err := dec.Decode(&struct{}{}); !errors.Is(err, io.EOF) {
		return zero, &DecodeError{Status: http.StatusBadRequest, Detail: "body must hold a single JSON object"}
	}
	return cmd, nil
}

// loneSurrogate returns the offset of the first \u escape in body of a UTF-16 surrogate that is
// not half of a pair (a high one followed at once by an escaped low one), or -1. A backslash
// in valid JSON is always inside a string and starts an escape, so body is read escape by
// escape, without tracking strings; in invalid JSON what it finds does not matter, the
// decoder refuses the body anyway.
func loneSurrogate(body []byte) int {
	for i := 0; i < len(body); i++ {
		if body[i] != '\\' {
			continue
		}
		r, ok := escapedRune(body[i:])
		switch {
		case !ok: // \n, \", \\ and the like: skip the escaped byte
			i++
		case utf16.IsSurrogate(r) && r < 0xdc00: // high: its low half must follow
			low, ok := escapedRune(body[i+6:])
			if !ok || utf16.DecodeRune(r, low) == utf8.RuneError {
				return i
			}
			i += 11
		case utf16.IsSurrogate(r):
			return i
		default:
			i += 5
		}
	}
	return -1
}

// escapedRune reads a \uXXXX escape at the start of b.
func escapedRune(b []byte) (rune, bool) {
	if len(b) < 6 || b[0] != '\\' || b[1] != 'u' {
		return 0, false
	}
	n, err := strconv.ParseUint(string(b[2:6]), 16, 16)
	return rune(n), err == nil
}

// readError is the problem of err, the error reading a body: over the limit, or the
// connection's (a stalled upload, a body cut short, a reset). The connection's error names the
// server's address (read tcp 10.0.0.5:8080->...), which is not the client's to see, and is no
// fault of the JSON.
func readError(err error) *DecodeError {
	var (
		tooLarge *http.MaxBytesError
		netErr   net.Error
	)
	switch {
	case errors.As(err, &tooLarge):
		return &DecodeError{Status: http.StatusRequestEntityTooLarge, Detail: fmt.Sprintf("body exceeds %d bytes", tooLarge.Limit)}
	case errors.Is(err, os.ErrDeadlineExceeded), errors.As(err, &netErr) && netErr.Timeout():
		return &DecodeError{Status: http.StatusRequestTimeout, Detail: "the request body did not arrive in time"}
	default:
		return &DecodeError{Status: http.StatusBadRequest, Detail: "the request body could not be read"}
	}
}

// decodeError is the problem of err, an error decoding body, in which it names a field by its
// path.
func decodeError(err error, body []byte) *DecodeError {
	var (
		syntax *json.SyntaxError
		typ    *json.UnmarshalTypeError
	)
	switch {
	case errors.As(err, &syntax):
		return &DecodeError{Status: http.StatusBadRequest, Detail: fmt.Sprintf("malformed JSON at byte %d", syntax.Offset)}
	case errors.Is(err, io.EOF):
		return &DecodeError{Status: http.StatusBadRequest, Detail: emptyBody}
	case errors.Is(err, io.ErrUnexpectedEOF):
		return &DecodeError{Status: http.StatusBadRequest, Detail: "malformed JSON: unexpected end"}
	case errors.As(err, &typ):
		want := expectedJSON(typ.Type)
		if typ.Field == "" {
			return &DecodeError{Status: http.StatusUnprocessableEntity, Detail: fmt.Sprintf("the body must be %s, got JSON %s", want, printableKey(typ.Value))}
		}
		field := fieldAt(body, typ.Offset)
		if field == "" {
			field = typ.Field
		}
		return &DecodeError{Status: http.StatusUnprocessableEntity, Field: field, Detail: fmt.Sprintf("must be %s, got JSON %s", want, printableKey(typ.Value))}
	default:
		return &DecodeError{Status: http.StatusBadRequest, Detail: err.Error()}
	}
}

// maxArrayElements bounds the elements of an array in a body: encoding/json builds the whole
// slice before Validate can count it, and half a million one-byte elements (a 1 MiB body) cost
// 200 MB. Ten times the most lines an order may have, so that Validate still says why.
const maxArrayElements = 10 * MaxLines

// checkBody checks the body dec reads, of Go type t, with checkFields: its first fault, or,
// if it has none, its first required field left out or null. A malformed body (400) is told
// as such before its missing values (422), wherever in the body each is. A body of null is
// refused too: encoding/json would leave the command empty, not say it is missing.
func checkBody(dec *json.Decoder, t reflect.Type) error {
	var missing error
	null, err := checkFields(dec, t, "", &missing)
	switch {
	case err != nil:
		return err
	case null:
		return wrongShape("", t, "null")
	}
	return missing
}

// checkFields reads the value dec is at and returns a *DecodeError for the first of its
// objects' keys that is not one of the fields of t, the Go type it decodes into, spelled
// exactly (by its json tag), or is repeated in its object, for an array of more than
// maxArrayElements, and for an array or object where t has none (a 422, the first of the
// decoder's own errors: it would go on decoding, and build every line of a million after it);
// path is where the value is, as fieldAt names it, and null reports a JSON null there. The
// first required field left out or null goes to *missing (checkObject), and the reading goes
// on. dec must hold valid JSON. The recursion is as deep as t, whatever the body's nesting.
func checkFields(dec *json.Decoder, t reflect.Type, path string, missing *error) (null bool, err error) {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	tok, err := dec.Token()
	if err != nil {
		return false, err
	}
	switch tok {
	case json.Delim('['):
		if t.Kind() != reflect.Slice && t.Kind() != reflect.Array {
			return false, wrongShape(path, t, "array")
		}
		for i := 0; dec.More(); i++ {
			if i == maxArrayElements {
				return false, &DecodeError{Status: http.StatusUnprocessableEntity, Field: path, Detail: fmt.Sprintf("far too many elements (over %d)", maxArrayElements)}
			}
			if _, err := checkFields(dec, t.Elem(), fmt.Sprintf("%s[%d]", path, i), missing); err != nil {
				return false, err
			}
		}
	case json.Delim('{'):
		if t.Kind() != reflect.Struct {
			return false, wrongShape(path, t, "object")
		}
		if err := checkObject(dec, jsonFields(t), path, missing); err != nil {
			return false, err
		}
	default:
		return tok == nil, nil // a scalar
	}
	_, err = dec.Token() // the closing delimiter
	return false, err
}

// checkObject reads an object's keys and values, dec past its opening brace, for checkFields:
// every key one of fields, none twice; and each required field there and not null, or the
// first that is not goes to *missing, unless one went there before. A required field left
// out would decode as its zero value: a line without its price would be free.
func checkObject(dec *json.Decoder, fields map[string]jsonField, path string, missing *error) error {
	at := func(key string) string {
		if path == "" {
			return key
		}
		return path + "." + key
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		key, _ := tok.(string)
		field, known := fields[key]
		switch {
		case seen[key]:
			return &DecodeError{Status: http.StatusBadRequest, Detail: fmt.Sprintf("field %q appears twice", printableKey(at(key)))}
		case !known:
			return &DecodeError{Status: http.StatusBadRequest, Detail: unknownField(printableKey(at(key)), key, fields)}
		}
		seen[key] = true
		null, err := checkFields(dec, field.typ, at(key), missing)
		if err != nil {
			return err
		}
		if null && field.required && *missing == nil {
			*missing = &DecodeError{Status: http.StatusUnprocessableEntity, Field: printableKey(at(key)), Detail: "is required, and must not be null"}
		}
	}
	for _, name := range slices.Sorted(maps.Keys(fields)) {
		if fields[name].required && !seen[name] && *missing == nil {
			*missing = &DecodeError{Status: http.StatusUnprocessableEntity, Field: at(name), Detail: "is required"}
		}
	}
	return nil
}

// wrongShape is the problem of an array or object (got) at path where t is something else.
func wrongShape(path string, t reflect.Type, got string) *DecodeError {
	if path == "" {
		return &DecodeError{Status: http.StatusUnprocessableEntity, Detail: fmt.Sprintf("the body must be %s, got JSON %s", expectedJSON(t), got)}
	}
	return &DecodeError{Status: http.StatusUnprocessableEntity, Field: printableKey(path), Detail: fmt.Sprintf("must be %s, got JSON %s", expectedJSON(t), got)}
}

// printableKey cuts a field's path, or a value, to 100 bytes for a problem's detail: a body of
// one 1 MiB key or number must not come back whole.
func printableKey(at string) string {
	if len(at) <= 100 {
		return at
	}
	return strings.ToValidUTF8(at[:100], "") + "..."
}

// jsonField is a struct field as a body names it: its Go type, and whether a body must give it
// (tagged required:"true").
type jsonField struct {
	typ      reflect.Type
	required bool
}

// jsonFields maps the JSON names of struct t's fields to them. Embedded structs are not
// followed: none of the commands has one.
func jsonFields(t reflect.Type) map[string]jsonField {
	fields := map[string]jsonField{}
	for f := range t.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch {
		case !f.IsExported() || name == "-":
			continue
		case name == "":
			name = f.Name
		}
		fields[name] = jsonField{typ: f.Type, required: f.Tag.Get("required") == "true"}
	}
	return fields
}

// unknownField is the problem of key, at path at, which is none of fields; one that differs
// from a field only in case says which it would be.
func unknownField(at, key string, fields map[string]jsonField) string {
	for name := range fields {
		if strings.EqualFold(name, key) {
			return fmt.Sprintf("unknown field %q: field names are case-sensitive, this one is %q", at, name)
		}
	}
	return fmt.Sprintf("unknown field %q", at)
}

// expectedJSON says in JSON's terms what a value of Go type t must be, without naming Go types.
func expectedJSON(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		bits := t.Bits() - 1
		return fmt.Sprintf("a whole number in digits (no fraction or exponent, not even .0) from -%d to %d", uint64(1)<<bits, uint64(1)<<bits-1)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return fmt.Sprintf("a whole number in digits (no fraction or exponent, not even .0) from 0 to %d", uint64(1)<<(t.Bits()-1)<<1-1)
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
