package main

import (
	"bytes"
	"testing"
	"time"

	"github.com/google/uuid"

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
