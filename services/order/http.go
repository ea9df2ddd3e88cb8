package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/go-chi/chi/v5"

	"github.com/outboxkit/outbox-inbox/internal/platform"
)

// requestTimeout bounds a request's database work: a locked or stalled database turns into a
// 503 the client can retry, not a hanging connection.
const requestTimeout = 5 * time.Second

type api struct {
	store    *Store
	log      *slog.Logger
	failures platform.FailureLog // the database's, each operation's logged once per interval
}

func (a *api) routes(r chi.Router) {
	r.Post("/orders", a.placeOrder)
	r.Get("/orders/{id}", a.getOrder)
	r.Post("/orders/{id}/cancel", a.cancelOrder)
}

func (a *api) placeOrder(w http.ResponseWriter, r *http.Request) {
	if !isJSON(r.Header.Get("Content-Type")) {
		platform.WriteProblem(w, http.StatusUnsupportedMediaType, "Content-Type must be application/json, in UTF-8 (a charset, if given, must be utf-8, utf8 or us-ascii)")
		return
	}
	if !unencoded(w, r) {
		return
	}
	// Given, a key must be one and not empty: a client whose key came from an unset variable
	// believes its retries safe, and each would place an order of its own.
	keys := r.Header.Values("Idempotency-Key")
	if len(keys) > 1 || len(keys) == 1 && keys[0] == "" {
		platform.WriteProblem(w, http.StatusBadRequest, "Idempotency-Key, when given, must be one non-empty key")
		return
	}
	key := r.Header.Get("Idempotency-Key")
	if len(key) > 255 || strings.IndexFunc(key, func(c rune) bool { return c > unicode.MaxASCII || unicode.IsControl(c) }) >= 0 {
		platform.WriteProblem(w, http.StatusBadRequest, "Idempotency-Key must be at most 255 printable ASCII characters")
		return
	}
	cmd, ok := decodeCommand(w, http.MaxBytesReader(w, r.Body, MaxBodyBytes), DecodePlaceOrder, orderInvalid)
	if !ok {
		return
	}

	ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
	defer cancel()
	order, replayed, err := a.place(ctx, cmd, key)
	var invalid violations
	switch {
	case errors.As(err, &invalid):
		writeViolations(w, orderInvalid, invalid)
		return
	case errors.Is(err, ErrIdempotencyConflict):
		platform.WriteProblem(w, http.StatusUnprocessableEntity, err.Error())
		return
	case errors.Is(err, errKeyUnchecked):
		a.unavailable(w, r, "place order", "the order is invalid, unless this Idempotency-Key placed it before, which the service could not check: try again with the same key", err)
		return
	case err != nil:
		a.unavailable(w, r, "place order", placeRetryAdvice(key), err)
		return
	}
	w.Header().Set("Location", "/orders/"+order.ID.String())
	if replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	} else {
		// Not the customer: its id becomes an e-mail mailbox, personal data, which logs keep out
		// of reach of its erasure; the order id leads to it.
		a.log.InfoContext(ctx, "order placed", "order_id", order.ID, "total_cents", order.TotalCents)
	}
	platform.WriteJSON(w, http.StatusCreated, order)
}

const orderInvalid = "the order is invalid"

// errKeyUnchecked is a command the rules refuse whose key the database could not look up: it
// is invalid unless that key placed it before, and nothing is written either way.
var errKeyUnchecked = errors.New("the order is invalid, and the order of its Idempotency-Key could not be looked up")

// place places cmd with key, or replays the order key placed from it. A command the rules
// refuse is refused with its violations, unless key placed it: the rules of its day took it,
// and its retry across the deploy that tightened them must find its order, not a 422.
func (a *api) place(ctx context.Context, cmd PlaceOrder, key string) (order Order, replayed bool, err error) {
	invalid := violations(cmd.Validate())
	if len(invalid) == 0 {
		return a.store.Place(ctx, cmd, key)
	}
	if key == "" {
		return Order{}, false, invalid
	}
	order, err = a.store.Replay(ctx, cmd, key)
	switch {
	case errors.Is(err, ErrNotFound), errors.Is(err, ErrIdempotencyConflict):
		return Order{}, false, invalid
	case err != nil:
		return Order{}, false, fmt.Errorf("%w: %w", errKeyUnchecked, err)
	}
	return order, true, nil
}

// violations are a command's violations of the rules, as an error.
type violations []Violation

func (v violations) Error() string { return fmt.Sprintf("%d violations of the rules", len(v)) }

func (a *api) getOrder(w http.ResponseWriter, r *http.Request) {
	id, err := platform.ParseUUID(chi.URLParam(r, "id"))
	if err != nil {
		platform.WriteProblem(w, http.StatusBadRequest, "id must be a UUID (8-4-4-4-12 hex digits)")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
	defer cancel()
	order, err := a.store.Get(ctx, id)
	switch {
	case errors.Is(err, ErrNotFound):
		platform.WriteProblem(w, http.StatusNotFound, "no order with this id")
	case err != nil:
		a.unavailable(w, r, "get order", "try again", err)
	default:
		platform.WriteJSON(w, http.StatusOK, order)
	}
}

func (a *api) cancelOrder(w http.ResponseWriter, r *http.Request) {
	id, err := platform.ParseUUID(chi.URLParam(r, "id"))
	if err != nil {
		platform.WriteProblem(w, http.StatusBadRequest, "id must be a UUID (8-4-4-4-12 hex digits)")
		return
	}
	if !unencoded(w, r) {
		return
	}
	body := http.MaxBytesReader(w, r.Body, MaxBodyBytes)
	if !jsonOrNoBody(r.Header.Get("Content-Type"), body) {
		platform.WriteProblem(w, http.StatusUnsupportedMediaType, "a body must be application/json, in UTF-8 (a charset, if given, must be utf-8, utf8 or us-ascii)")
		return
	}
	const cancellationInvalid = "the cancellation is invalid"
	cmd, ok := decodeCommand(w, body, DecodeCancelOrder, cancellationInvalid)
	if !ok {
		return
	}
	if invalid := cmd.Validate(); len(invalid) > 0 {
		writeViolations(w, cancellationInvalid, invalid)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
	defer cancel()
	order, changed, err := a.store.Cancel(ctx, id, cmd)
	switch {
	case errors.Is(err, ErrNotFound):
		platform.WriteProblem(w, http.StatusNotFound, "no order with this id")
		return
	case err != nil:
		a.unavailable(w, r, "cancel order", "the order may have been cancelled: try again, which cannot cancel it twice", err)
		return
	}
	if changed {
		a.log.InfoContext(ctx, "order cancelled", "order_id", order.ID)
	}
	platform.WriteJSON(w, http.StatusOK, order)
}

// unencoded reports whether r's body has no content coding (none named, or only identity), and
// answers 415 if it has one: the service decodes none, and would read a gzip body as JSON that
// is not UTF-8. Accept-Encoding says which it takes (RFC 9110, section 15.5.16).
func unencoded(w http.ResponseWriter, r *http.Request) bool {
	for _, v := range r.Header.Values("Content-Encoding") {
		for coding := range strings.SplitSeq(v, ",") {
			if c := strings.TrimSpace(coding); c != "" && !strings.EqualFold(c, "identity") {
				w.Header().Set("Accept-Encoding", "identity")
				platform.WriteProblem(w, http.StatusUnsupportedMediaType, "Content-Encoding is not supported: send the body uncompressed")
				return false
			}
		}
	}
	return true
}

// jsonOrNoBody reports whether a request body is JSON, or absent: a body without a content type
// is refused like one of another type.
func jsonOrNoBody(contentType string, body io.Reader) bool {
	if contentType == "" {
		var b [1]byte
		n, _ := body.Read(b[:])
		return n == 0
	}
	return isJSON(contentType)
}

// isJSON reports whether contentType is application/json in UTF-8, the one encoding the service
// decodes (RFC 8259, section 8.1): a body declared UTF-16 is refused for its type, not read as
// malformed UTF-8. "utf8", unregistered but common, is taken for UTF-8, and US-ASCII, a subset
// of it.
func isJSON(contentType string) bool {
	mt, params, err := mime.ParseMediaType(contentType)
	if err != nil || mt != "application/json" {
		return false
	}
	charset, given := params["charset"]
	return !given || slices.ContainsFunc([]string{"utf-8", "utf8", "us-ascii"}, func(c string) bool { return strings.EqualFold(charset, c) })
}

// decodeCommand decodes a command, answering the problem itself when it cannot: ok=false means
// the response is written. invalid is the problem's title for a field of the wrong type.
func decodeCommand[C any](w http.ResponseWriter, body io.Reader, decode func(io.Reader) (C, error), invalid string) (cmd C, ok bool) {
	cmd, err := decode(body)
	if err != nil {
		var de *DecodeError
		switch {
		case errors.As(err, &de) && de.Field != "":
			platform.WriteProblem(w, de.Status, invalid, platform.FieldError{Field: de.Field, Message: de.Detail})
		case errors.As(err, &de):
			platform.WriteProblem(w, de.Status, de.Detail)
		default:
			platform.WriteProblem(w, http.StatusBadRequest, "unreadable body")
		}
		return cmd, false
	}
	return cmd, true
}

// writeViolations answers a command's violations of the rules with a 422 titled invalid.
func writeViolations(w http.ResponseWriter, invalid string, violations []Violation) {
	fields := make([]platform.FieldError, len(violations))
	for i, v := range violations {
		fields[i] = platform.FieldError{Field: v.Field, Message: v.Message}
	}
	platform.WriteProblem(w, http.StatusUnprocessableEntity, invalid, fields...)
}

// placeRetryAdvice is what a client whose order met a database failure should do: the order
// may have been placed, so only a retry with the same key is safe.
func placeRetryAdvice(key string) string {
	if key == "" {
		return "the order may have been placed: check before placing it again, and send an Idempotency-Key, with which a retry cannot place an order twice"
	}
	return "the order may have been placed: try again with the same Idempotency-Key, which cannot place it twice"
}

// unavailable answers a database failure with 503 and detail, which tells the client how to
// retry, or, if the client went away, abandons the response; logged either way, once per
// interval. A change may have been saved even so: a commit cut off by the deadline, or by the
// client's going, may have gone through.
func (a *api) unavailable(w http.ResponseWriter, r *http.Request, op, detail string, err error) {
	a.failures.Unavailable(w, r, a.log, op, "the order database is unavailable; "+detail, err)
}
