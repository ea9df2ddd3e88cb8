package platform

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"
)

// A JSON line writes a duration as the text line does, and a text line is unchanged.
func TestLogLinesWriteDurationsReadably(t *testing.T) {
	var js, text bytes.Buffer
	NewLogger(&js, "order", "json", "info").Info("started", "outbox_retention", 168*time.Hour, "took", 1500*time.Millisecond)
	NewLogger(&text, "order", "text", "info").Info("started", "took", 1500*time.Millisecond)
	var line map[string]any
	if err := json.Unmarshal(js.Bytes(), &line); err != nil {
		t.Fatalf("%s: %v", js.Bytes(), err)
	}
	if line["outbox_retention"] != "168h0m0s" || line["took"] != "1.5s" || line["service"] != "order" {
		t.Errorf("JSON line %s: want outbox_retention 168h0m0s and took 1.5s, as text", js.Bytes())
	}
	if !bytes.Contains(text.Bytes(), []byte("took=1.5s")) {
		t.Errorf("text line %s: want took=1.5s", text.Bytes())
	}
}
