package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
)

// MaxBodyBytes is the largest request body accepted (413 beyond).
const MaxBodyBytes = 1 << 20

// DecodeError is a request body that cannot become a command; Status is its HTTP status.
type DecodeError struct {
	Status int
	Detail string
}

func (e *DecodeError) Error() string { return e.Detail }

// DecodePlaceOrder reads a place-order command strictly: one JSON object, no unknown fields,
// no trailing data. Malformed JSON is a 400; well-formed JSON with a value of the wrong type or
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
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cmd); err != nil {
		return zero, decodeError(err)
	}
	if err := dec.Decode(&struct{}{}); !errors.Is(err, io.EOF) {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			return zero, decodeError(err)
		}
		return zero, &DecodeError{http.StatusBadRequest, "body must hold a single JSON object"}
	}
	return cmd, nil
}

func decodeError(err error) *DecodeError {
	var (
		syntax   *json.SyntaxError
		typ      *json.UnmarshalTypeError
		tooLarge *http.MaxBytesError
	)
	switch {
	case errors.As(err, &tooLarge):
		return &DecodeError{http.StatusRequestEntityTooLarge, fmt.Sprintf("body exceeds %d bytes", tooLarge.Limit)}
	case errors.As(err, &syntax):
		return &DecodeError{http.StatusBadRequest, fmt.Sprintf("malformed JSON at byte %d", syntax.Offset)}
	case errors.Is(err, io.EOF):
		return &DecodeError{http.StatusBadRequest, emptyBody}
	case errors.Is(err, io.ErrUnexpectedEOF):
		return &DecodeError{http.StatusBadRequest, "malformed JSON: unexpected end"}
	case errors.As(err, &typ):
		field := typ.Field
		if field == "" {
			field = "body"
		}
		return &DecodeError{http.StatusUnprocessableEntity, fmt.Sprintf("%s: expected %s, got JSON %s", field, typ.Type, typ.Value)}
	default:
		// Unknown fields ("json: unknown field \"x\"") and other shape errors.
		return &DecodeError{http.StatusBadRequest, err.Error()}
	}
}
