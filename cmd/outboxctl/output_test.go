package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// The rows retry prints a batch at a time in -o json make, byte for byte, the document
// writeJSON makes of them all at once: with rows in several batches, with none, interrupted,
// in a dry run.
func TestRowStreamWritesWhatWriteJSONWrites(t *testing.T) {
	t.Parallel()
	errText := `refused: "<b>&"`
	row := func(i int) messaging.OutboxMessage {
		return messaging.OutboxMessage{ID: uuid.New(), Type: "OrderPlaced", OccurredAt: time.Unix(int64(i), 0),
			Attempts: i, LastError: &errText, NextAttemptAt: time.Unix(int64(i), 5)}
	}
	for _, tc := range []struct {
		name        string
		batches     [][]messaging.OutboxMessage
		dryRun      bool
		interrupted bool
	}{
		{"several batches", [][]messaging.OutboxMessage{{row(1), row(2)}, {}, {row(3)}}, false, false},
		{"none", nil, false, false},
		{"an empty batch, interrupted", [][]messaging.OutboxMessage{{}}, false, true},
		{"one batch, interrupted", [][]messaging.OutboxMessage{{row(4)}}, false, true},
		{"a dry run", [][]messaging.OutboxMessage{{row(5)}, {row(6)}}, true, false},
		{"a dry run of none", nil, true, false},
	} {
		var streamed, whole bytes.Buffer
		s := &rowStream{w: &streamed, json: true, dryRun: tc.dryRun}
		want := outboxRowsResult{DryRun: tc.dryRun, Rows: []outboxRow{}, Interrupted: tc.interrupted}
		for _, b := range tc.batches {
			if err := s.add(b); err != nil {
				t.Fatal(err)
			}
			want.Rows = append(want.Rows, toOutboxRows(b)...)
		}
		if err := s.end("", tc.interrupted); err != nil {
			t.Fatal(err)
		}
		want.Count = len(want.Rows)
		if err := writeJSON(&whole, want); err != nil {
			t.Fatal(err)
		}
		if streamed.String() != whole.String() {
			t.Errorf("%s: streamed\n%s\nwant\n%s", tc.name, streamed.String(), whole.String())
		}
	}
}

// A rowStream whose output failed (a closed pipe) writes nothing more to it: each later add,
// and end, returns that failure, and retry stops between batches rather than write again.
func TestRowStreamWritesNothingOnceItsOutputFailed(t *testing.T) {
	t.Parallel()
	for _, asJSON := range []bool{false, true} {
		w := &failsAfterFirstWrite{}
		s := &rowStream{w: w, json: asJSON}
		row := messaging.OutboxMessage{ID: uuid.New(), Type: "OrderPlaced"}
		if err := s.add([]messaging.OutboxMessage{row}); err != nil {
			t.Fatalf("json %v: the first add: %v", asJSON, err)
		}
		for i, err := range []error{s.add([]messaging.OutboxMessage{row}), s.add([]messaging.OutboxMessage{row}), s.end("1 row", false)} {
			if !errors.Is(err, syscall.EPIPE) {
				t.Errorf("json %v: write %d after the output failed: %v; want EPIPE", asJSON, i+2, err)
			}
		}
		if w.writes != 2 {
			t.Errorf("json %v: %d writes reached the output; want 2, the one that failed the last", asJSON, w.writes)
		}
	}
}

// failsAfterFirstWrite is an output whose reader went away after the first write.
type failsAfterFirstWrite struct{ writes int }

func (w *failsAfterFirstWrite) Write(p []byte) (int, error) {
	if w.writes++; w.writes > 1 {
		return 0, syscall.EPIPE
	}
	return len(p), nil
}

// dlq drop prints its record of a message after acknowledging it: a header JSON cannot write as
// a number (NaN, an infinity, from a producer in another language, nested too) is written as its
// text, and the record is not lost to an encoding error. A message without headers has them
// as {}, as the record's shape says.
func TestADroppedMessagesRecordIsWrittenWhateverItsHeadersHold(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	format := "json"
	c := &cli{streams: streams{out: &out}, format: &format}
	var none bytes.Buffer
	if err := (&cli{streams: streams{out: &none}, format: &format}).printDropped("invoicing", "invoicing.dlq", messaging.DeadLetter{MessageID: "m0"}, dropDone); err != nil ||
		!bytes.Contains(none.Bytes(), []byte(`"headers": {}`)) {
		t.Errorf("the record of a message without headers: %v\n%s\nwant \"headers\": {}", err, none.String())
	}
	d := messaging.DeadLetter{MessageID: "m1", Headers: amqp.Table{
		"ratio": math.NaN(), "limit": float32(math.Inf(1)), "score": 0.5,
		"nested": amqp.Table{"low": math.Inf(-1)}, "list": []any{math.NaN(), "x"},
	}}
	if err := c.printDropped("invoicing", "invoicing.dlq", d, dropDone); err != nil {
		t.Fatalf("the record of a dropped message with NaN headers: %v", err)
	}
	var got struct {
		Message struct {
			Headers map[string]any `json:"headers"`
		} `json:"message"`
	}
	if err := json.Unmarshal(out.Bytes(), &got); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	h := got.Message.Headers
	if h["ratio"] != "NaN" || h["limit"] != "+Inf" || h["score"] != 0.5 ||
		h["nested"].(map[string]any)["low"] != "-Inf" || h["list"].([]any)[0] != "NaN" {
		t.Errorf("headers = %v, want NaN, +Inf, 0.5, -Inf and NaN", h)
	}
}
