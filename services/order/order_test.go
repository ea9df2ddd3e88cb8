package main

import (
	"bytes"
	"compress/gzip"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

type testBundle struct {
	db        *gorm.DB
	store     *Store // the API's
	readiness *sql.DB
	srv       *httptest.Server
	logs      *testenv.Logs // the API's and the router's
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	testenv.Connections(t, testenv.DefaultConnections+platform.ReadinessConns)
	d := testenv.NewDatabase(t)
	d.Migrate(t, platform.Library(messaging.MigrateOutbox), platform.Migrations(migrations, "migrations", "order_schema"))
	testenv.Draw(t, platform.ReadinessConns)
	readiness, err := platform.OpenReadinessDB("order", d.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = readiness.Close() })
	log, logs := testenv.NewLogger(t)
	router := platform.NewRouter(log, prometheus.NewRegistry(), platform.DatabaseReady(readiness))
	store := &Store{db: d.DB, driver: d.Driver(t)}
	(&api{store: store, log: log}).routes(router)
	srv := httptest.NewServer(router)
	t.Cleanup(srv.Close)
	return &testBundle{db: d.DB, store: store, readiness: readiness, srv: srv, logs: logs}
}

// outboxRow is a row of outbox_messages, as these tests read it.
type outboxRow struct {
	ID            uuid.UUID
	Type          string
	Payload       json.RawMessage
	CorrelationID string
	ProcessedAt   *time.Time
}

func (r outboxRow) message() messaging.Message {
	return messaging.Message{ID: r.ID, Type: r.Type, Payload: r.Payload, CorrelationID: r.CorrelationID}
}

// outboxRowOf reads the one outbox row of type msgType.
func outboxRowOf(t *testing.T, db *gorm.DB, msgType string) outboxRow {
	t.Helper()
	var row outboxRow
	if err := db.Table("outbox_messages").Take(&row, "type = ?", msgType).Error; err != nil {
		t.Fatal(err)
	}
	return row
}

const validBody = `{"customer_id": "c-42", "lines": [{"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250}, {"sku": "SKU-2", "quantity": 1, "unit_price_cents": 99}]}`

func (b *testBundle) post(t *testing.T, body, contentType, key string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, b.srv.URL+"/orders", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	return do(t, req)
}

func do(t *testing.T, req *http.Request) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, body
}

// counts returns the number of orders, order lines and outbox rows.
func (b *testBundle) counts(t *testing.T) [3]int64 {
	t.Helper()
	return [3]int64{
		testenv.Count(t, b.db, "SELECT count(*) FROM orders"),
		testenv.Count(t, b.db, "SELECT count(*) FROM order_lines"),
		testenv.Count(t, b.db, "SELECT count(*) FROM outbox_messages"),
	}
}

func TestPlaceOrderSavesOrderLinesAndEventTogether(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// A charset of UTF-8 is taken in any case, quoted or not; another is refused (415).
	resp, body := b.post(t, validBody, `application/json; charset="UTF-8"`, "")
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	var o Order
	if err := json.Unmarshal(body, &o); err != nil {
		t.Fatal(err)
	}
	if o.ID == uuid.Nil || o.CustomerID != "c-42" || len(o.Lines) != 2 || o.TotalCents != 2599 || o.CreatedAt.IsZero() {
		t.Fatalf("order = %+v, want c-42 with 2 lines totalling 2599", o)
	}
	if loc := resp.Header.Get("Location"); loc != "/orders/"+o.ID.String() {
		t.Fatalf("Location = %q", loc)
	}
	if c := b.counts(t); c != [3]int64{1, 2, 1} {
		t.Fatalf("orders, lines, outbox = %v, want [1 2 1]", c)
	}
	row := outboxRowOf(t, b.db, events.OrderPlacedType)
	ev, err := events.DecodeOrderPlaced(row.message())
	if err != nil {
		t.Fatal(err)
	}
	if ev.OrderID != o.ID || ev.TotalCents != 2599 || ev.CustomerID != "c-42" || len(ev.Lines) != 2 || !ev.PlacedAt.Equal(o.CreatedAt) {
		t.Fatalf("outbox event = %+v, want the order's", ev)
	}
	if row.ProcessedAt != nil || row.CorrelationID != o.ID.String() {
		t.Fatalf("outbox row = %+v, want unsent with the order id as correlation id", row)
	}

	// And it reads back.
	resp, body = do(t, mustRequest(t, http.MethodGet, b.srv.URL+"/orders/"+o.ID.String()))
	var got Order
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &got) != nil || got.TotalCents != 2599 || len(got.Lines) != 2 || got.Lines[1].SKU != "SKU-2" {
		t.Fatalf("GET = %d %s", resp.StatusCode, body)
	}
}

func mustRequest(t *testing.T, method, url string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	return req
}

func TestBadRequestsGetProblemsAndWriteNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	manyLines := `{"customer_id":"c","lines":[` + strings.TrimSuffix(strings.Repeat(`{"sku":"s","quantity":1,"unit_price_cents":1},`, MaxLines+1), ",") + `]}`
	type badRequest struct {
		name, body, contentType string
		status                  int
	}
	cases := []badRequest{
		{"malformed JSON", `{"customer_id": "c-1", "lines": [`, "application/json", 400},
		{"not an object", `[1, 2]`, "application/json", 422},
		{"empty body", ``, "application/json", 400},
		{"trailing data", validBody + `{}`, "application/json", 400},
		{"unknown field", `{"customer_id":"c","lines":[{"sku":"s","quantity":1,"unit_price_cents":1}],"total_cents":1}`, "application/json", 400},
		{"unknown line field", `{"customer_id":"c","lines":[{"sku":"s","quantity":1,"unit_price_cents":1,"discount":5}]}`, "application/json", 400},
		{"field name in another case", `{"Customer_ID":"c","lines":[{"sku":"s","quantity":1,"unit_price_cents":1}]}`, "application/json", 400},
		{"line field name in another case", `{"customer_id":"c","lines":[{"SKU":"s","quantity":1,"unit_price_cents":1}]}`, "application/json", 400},
		{"field twice", `{"customer_id":"c","customer_id":"d","lines":[{"sku":"s","quantity":1,"unit_price_cents":1}]}`, "application/json", 400},
		{"line field twice", `{"customer_id":"c","lines":[{"sku":"s","quantity":1,"quantity":2,"unit_price_cents":1}]}`, "application/json", 400},
		{"field twice after a number beyond float64", `{"customer_id":"c","lines":[{"sku":"s","quantity":1e400,"unit_price_cents":1}],"customer_id":"d"}`, "application/json", 400},
		{"quantity as string", `{"customer_id":"c","lines":[{"sku":"s","quantity":"2","unit_price_cents":1}]}`, "application/json", 422},
		{"fractional quantity", `{"customer_id":"c","lines":[{"sku":"s","quantity":1.5,"unit_price_cents":1}]}`, "application/json", 422},
		{"overflowing quantity", `{"customer_id":"c","lines":[{"sku":"s","quantity":1e30,"unit_price_cents":1}]}`, "application/json", 422},
		{"overflowing price", `{"customer_id":"c","lines":[{"sku":"s","quantity":1,"unit_price_cents":99999999999999999999}]}`, "application/json", 422},
		{"no lines", `{"customer_id":"c","lines":[]}`, "application/json", 422},
		{"null body", `null`, "application/json", 422},
		{"zero quantity", `{"customer_id":"c","lines":[{"sku":"s","quantity":0,"unit_price_cents":1}]}`, "application/json", 422},
		{"negative quantity", `{"customer_id":"c","lines":[{"sku":"s","quantity":-3,"unit_price_cents":1}]}`, "application/json", 422},
		{"huge quantity", `{"customer_id":"c","lines":[{"sku":"s","quantity":10001,"unit_price_cents":1}]}`, "application/json", 422},
		{"negative price", `{"customer_id":"c","lines":[{"sku":"s","quantity":1,"unit_price_cents":-1}]}`, "application/json", 422},
		{"price over the limit", `{"customer_id":"c","lines":[{"sku":"s","quantity":1,"unit_price_cents":100000001}]}`, "application/json", 422},
		{"empty customer", `{"customer_id":"  ","lines":[{"sku":"s","quantity":1,"unit_price_cents":1}]}`, "application/json", 422},
		{"empty sku", `{"customer_id":"c","lines":[{"sku":"","quantity":1,"unit_price_cents":1}]}`, "application/json", 422},
		{"huge customer id", `{"customer_id":"` + strings.Repeat("c", MaxIDLength+1) + `","lines":[{"sku":"s","quantity":1,"unit_price_cents":1}]}`, "application/json", 422},
		{"control characters", `{"customer_id":"c\u0000x","lines":[{"sku":"s","quantity":1,"unit_price_cents":1}]}`, "application/json", 422},
		{"customer id with space around", `{"customer_id":" c-42 ","lines":[{"sku":"s","quantity":1,"unit_price_cents":1}]}`, "application/json", 422},
		{"sku with a zero-width space", `{"customer_id":"c","lines":[{"sku":"SKU\u200b-1","quantity":1,"unit_price_cents":1}]}`, "application/json", 422},
		{"sku with a line separator", `{"customer_id":"c","lines":[{"sku":"SKU-1\u2028Total: 0.00","quantity":1,"unit_price_cents":1}]}`, "application/json", 422},
		{"sku with a bidirectional override", `{"customer_id":"c","lines":[{"sku":"SKU\u202e1","quantity":1,"unit_price_cents":1}]}`, "application/json", 422},
		{"invalid UTF-8", "{\"customer_id\":\"c\xff\",\"lines\":[{\"sku\":\"s\",\"quantity\":1,\"unit_price_cents\":1}]}", "application/json", 400},
		{"a lone low surrogate", `{"customer_id":"c\udfff","lines":[{"sku":"s","quantity":1,"unit_price_cents":1}]}`, "application/json", 400},
		{"a lone high surrogate", `{"customer_id":"c","lines":[{"sku":"\ud83d","quantity":1,"unit_price_cents":1}]}`, "application/json", 400},
		{"a high surrogate before no low one", `{"customer_id":"\ud83d\u0041","lines":[{"sku":"s","quantity":1,"unit_price_cents":1}]}`, "application/json", 400},
		{"Latin-1", "{\"customer_id\":\"Jos\xe9\",\"lines\":[{\"sku\":\"s\",\"quantity\":1,\"unit_price_cents\":1}]}", "application/json", 400},
		{"too many lines", manyLines, "application/json", 422},
		{"2 MiB body", `{"customer_id":"` + strings.Repeat("c", 2<<20) + `"}`, "application/json", 413},
		{"2 MiB of no JSON", strings.Repeat("x", 2<<20), "application/json", 413},
		{"2 MiB behind an unknown field", `{"nope":1,"customer_id":"` + strings.Repeat("c", 2<<20) + `"}`, "application/json", 413},
		{"text/plain", validBody, "text/plain", 415},
		{"no content type", validBody, "", 415},
		{"a charset other than UTF-8", validBody, "application/json; charset=utf-16", 415},
		{"a charset other than UTF-8, in capitals", validBody, "application/json; charset=ISO-8859-1", 415},
	}
	// Ids that look empty, or like c-42 or SKU-1 without the invisible character, in either field.
	for name, id := range map[string]string{
		"a Hangul filler":                   `\u3164`,
		"a braille blank":                   `\u2800`,
		"a Hangul choseong filler":          `\u115f`,
		"a Hangul jungseong filler":         `\u1160`,
		"a halfwidth Hangul filler":         `\uffa0`,
		"a combining grapheme joiner":       `c-42\u034f`,
		"a variation selector":              `c-42\ufe0f`,
		"an ideographic variation selector": `c-42\udb40\udd00`, // U+E0100
		"a braille blank inside":            `SKU\u28001`,
	} {
		cases = append(cases,
			badRequest{"customer id " + name, `{"customer_id":"` + id + `","lines":[{"sku":"s","quantity":1,"unit_price_cents":1}]}`, "application/json", 422},
			badRequest{"sku " + name, `{"customer_id":"c","lines":[{"sku":"` + id + `","quantity":1,"unit_price_cents":1}]}`, "application/json", 422})
	}
	for _, c := range cases {
		resp, body := b.post(t, c.body, c.contentType, "")
		if resp.StatusCode != c.status {
			t.Errorf("%s: status %d, want %d (%s)", c.name, resp.StatusCode, c.status, body)
			continue
		}
		var p platform.Problem
		if ct := resp.Header.Get("Content-Type"); ct != "application/problem+json" || json.Unmarshal(body, &p) != nil || p.Status != c.status || p.Detail == "" {
			t.Errorf("%s: not a problem+json body with a detail: %s %s", c.name, ct, body)
		}
	}
	if c := b.counts(t); c != [3]int64{0, 0, 0} {
		t.Fatalf("bad requests wrote rows: orders, lines, outbox = %v", c)
	}

	// Paths and headers.
	for url, status := range map[string]int{
		"/orders/not-a-uuid":                       400,
		"/orders/" + uuid.NewString():              404,
		"/orders/01234567-89ab-cdef-0123-456789ab": 400,
	} {
		resp, body := do(t, mustRequest(t, http.MethodGet, b.srv.URL+url))
		if resp.StatusCode != status || resp.Header.Get("Content-Type") != "application/problem+json" {
			t.Errorf("GET %s = %d %s, want %d problem+json", url, resp.StatusCode, body, status)
		}
	}
	if resp, _ := b.post(t, validBody, "application/json", strings.Repeat("k", 256)); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("256-character Idempotency-Key: status %d, want 400", resp.StatusCode)
	}
	// A tab is the one control character HTTP carries inside a header's value.
	if resp, _ := b.post(t, validBody, "application/json", "k\tey"); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("Idempotency-Key with a tab: status %d, want 400", resp.StatusCode)
	}
	// Bytes beyond ASCII reach the server (HTTP allows them as obs-text), and are refused there.
	if resp, _ := b.post(t, validBody, "application/json", "clé-1"); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("Idempotency-Key with a non-ASCII character: status %d, want 400", resp.StatusCode)
	}
	// A key given empty (an unset variable) or twice is not the absence of one: its client
	// believes its retries safe.
	for name, keys := range map[string][]string{"empty": {""}, "blank": {"  "}, "given twice": {"k-1", "k-2"}} {
		req := mustRequest(t, http.MethodPost, b.srv.URL+"/orders")
		req.Body = io.NopCloser(strings.NewReader(validBody))
		req.Header.Set("Content-Type", "application/json")
		req.Header["Idempotency-Key"] = keys
		if resp, body := do(t, req); resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "Idempotency-Key") {
			t.Errorf("Idempotency-Key %s: %d %s, want a 400 that names it", name, resp.StatusCode, body)
		}
	}
	if c := b.counts(t); c != [3]int64{0, 0, 0} {
		t.Fatalf("bad requests wrote rows: orders, lines, outbox = %v", c)
	}
}

// Ids beyond ASCII are ids like any other, and so is a letter with a combining mark after it:
// only the invisible characters are refused (see checkID). Each is kept as sent.
func TestIdsBeyondASCIIArePlaced(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cmd := PlaceOrder{CustomerID: "José", Lines: []Line{
		{SKU: "顧客-1", Quantity: 1, UnitPriceCents: 100},
		{SKU: "Jose\u0301-2", Quantity: 1, UnitPriceCents: 100},
		{SKU: "Straße-3", Quantity: 1, UnitPriceCents: 100},
	}}
	raw, err := json.Marshal(cmd)
	if err != nil {
		t.Fatal(err)
	}
	resp, body := b.post(t, string(raw), "application/json", "")
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("%s: %d %s, want 201", raw, resp.StatusCode, body)
	}
	var placed Order
	if err := json.Unmarshal(body, &placed); err != nil {
		t.Fatal(err)
	}
	o, err := b.store.Get(context.Background(), placed.ID)
	if err != nil {
		t.Fatal(err)
	}
	if o.CustomerID != cmd.CustomerID || len(o.Lines) != len(cmd.Lines) {
		t.Fatalf("stored %+v, want %+v", o, cmd)
	}
	for i, l := range o.Lines {
		if l.SKU != cmd.Lines[i].SKU {
			t.Errorf("line %d stored with SKU %q, want %q", i, l.SKU, cmd.Lines[i].SKU)
		}
	}
}

// A value of the wrong JSON type is a 422 whose errors array names the field and says, in
// JSON's terms, what it must be: no Go type names.
func TestWrongJSONTypesNameTheirField(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for body, want := range map[string]platform.FieldError{
		`{"customer_id":5,"lines":[{"sku":"s","quantity":1,"unit_price_cents":1}]}`:                                                   {Field: "customer_id", Message: "must be a string, got JSON number"},
		`{"customer_id":"c","lines":[{"sku":"s","quantity":1.5,"unit_price_cents":1}]}`:                                               {Field: "lines[0].quantity", Message: "must be a whole number in digits (no fraction or exponent, not even .0) from -9223372036854775808 to 9223372036854775807, got JSON number 1.5"},
		`{"customer_id":"c","lines":[{"sku":"s","quantity":1,"unit_price_cents":1e20}]}`:                                              {Field: "lines[0].unit_price_cents", Message: "must be a whole number in digits (no fraction or exponent, not even .0) from -9223372036854775808 to 9223372036854775807, got JSON number 1e20"},
		`{"customer_id":"c","lines":[{"sku":"s","quantity":1,"unit_price_cents":1},{"sku":["x"],"quantity":1,"unit_price_cents":1}]}`: {Field: "lines[1].sku", Message: "must be a string, got JSON array"},
		`{"customer_id":"c","lines":[{"sku":"s","quantity":1e400,"unit_price_cents":1}]}`:                                             {Field: "lines[0].quantity", Message: "must be a whole number in digits (no fraction or exponent, not even .0) from -9223372036854775808 to 9223372036854775807, got JSON number 1e400"},
		`{"customer_id":"c","lines":{"sku":"s","quantity":1,"unit_price_cents":1}}`:                                                   {Field: "lines", Message: "must be an array, got JSON object"},
		// A field left out, or null, would decode as 0: a line without its price would be free.
		`{"customer_id":"c","lines":[{"sku":"s","quantity":2}]}`:                         {Field: "lines[0].unit_price_cents", Message: "is required"},
		`{"customer_id":"c","lines":[{"sku":"s","quantity":2,"unit_price_cents":null}]}`: {Field: "lines[0].unit_price_cents", Message: "is required, and must not be null"},
		`{"customer_id":"c","lines":[{"sku":"s","unit_price_cents":1}]}`:                 {Field: "lines[0].quantity", Message: "is required"},
		`{"lines":[{"sku":"s","quantity":1,"unit_price_cents":1}]}`:                      {Field: "customer_id", Message: "is required"},
		`{"customer_id":"c","lines":null}`:                                               {Field: "lines", Message: "is required, and must not be null"},
	} {
		resp, raw := b.post(t, body, "application/json", "")
		var p platform.Problem
		if resp.StatusCode != http.StatusUnprocessableEntity || json.Unmarshal(raw, &p) != nil || len(p.Errors) != 1 || p.Errors[0] != want ||
			strings.Contains(string(raw), "main.") || strings.Contains(string(raw), "int64") {
			t.Errorf("%s: %d %s, want 422 with errors [%+v]", body, resp.StatusCode, raw, want)
		}
	}
	if c := b.counts(t); c != [3]int64{0, 0, 0} {
		t.Fatalf("bad requests wrote rows: orders, lines, outbox = %v", c)
	}
}

func TestIdempotencyKeyReturnsTheFirstOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first, body := b.post(t, validBody, "application/json", "key-1")
	if first.StatusCode != http.StatusCreated {
		t.Fatalf("first: %d %s", first.StatusCode, body)
	}
	// The same command with other spacing is the same command.
	again, body2 := b.post(t, strings.ReplaceAll(validBody, " ", ""), "application/json", "key-1")
	if again.StatusCode != http.StatusCreated || again.Header.Get("Location") != first.Header.Get("Location") || again.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %s %s", again.StatusCode, again.Header.Get("Location"), body2)
	}
	if !bytes.Equal(body, body2) {
		t.Fatalf("replay body differs:\n%s\n%s", body, body2)
	}
	other, body3 := b.post(t, strings.Replace(validBody, `"quantity": 2`, `"quantity": 3`, 1), "application/json", "key-1")
	if other.StatusCode != http.StatusUnprocessableEntity || other.Header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("same key, other body: %d %s", other.StatusCode, body3)
	}
	if c := b.counts(t); c != [3]int64{1, 2, 1} {
		t.Fatalf("orders, lines, outbox = %v, want one order", c)
	}
}

func TestConcurrentRequestsWithOneIdempotencyKeyPlaceOneOrder(t *testing.T) {
	t.Parallel()
	placeConcurrentlyWithOneKey(t, setup(t))
}

// The unique key decides under READ COMMITTED, where a request that waited for the first one's
// commit then sees its row: the store's transactions ask for it, so a database whose default is
// REPEATABLE READ answers the waiting requests with the first order, not serialization failures.
func TestOneIdempotencyKeyPlacesOneOrderWhateverTheDatabasesDefaultIsolation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.repeatableReadByDefault(t)
	placeConcurrentlyWithOneKey(t, b)
}

// repeatableReadByDefault makes REPEATABLE READ the default isolation of the test database's
// transactions from now on, for the store's as for any other.
func (b *testBundle) repeatableReadByDefault(t *testing.T) {
	t.Helper()
	if err := b.db.Exec("DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation = %L', current_database(), 'repeatable read'); END $$").Error; err != nil {
		t.Fatal(err)
	}
	sqlDB, err := b.db.DB()
	if err != nil {
		t.Fatal(err)
	}
	sqlDB.SetMaxIdleConns(0) // the connections opened from now on take the new default
	var isolation string
	if err := b.db.Raw("SHOW default_transaction_isolation").Scan(&isolation).Error; err != nil || isolation != "repeatable read" {
		t.Fatalf("default_transaction_isolation = %q, %v; want repeatable read", isolation, err)
	}
}

// placeConcurrentlyWithOneKey posts one order ten times at once with one Idempotency-Key: each
// must be answered 201 with the same order, and one order written.
func placeConcurrentlyWithOneKey(t *testing.T, b *testBundle) {
	t.Helper()
	const n = 10
	locations := make(chan string, n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			req, err := http.NewRequest(http.MethodPost, b.srv.URL+"/orders", strings.NewReader(validBody))
			if err != nil {
				t.Error(err)
				return
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", "same-key")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusCreated {
				t.Errorf("status %d", resp.StatusCode)
			}
			locations <- resp.Header.Get("Location")
		})
	}
	wg.Wait()
	close(locations)
	seen := map[string]bool{}
	for l := range locations {
		seen[l] = true
	}
	if len(seen) != 1 {
		t.Fatalf("%d different orders for one key: %v", len(seen), seen)
	}
	if c := b.counts(t); c != [3]int64{1, 2, 1} {
		t.Fatalf("orders, lines, outbox = %v, want one order", c)
	}
}

func TestDatabaseFailureIsA503(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sqlDB, err := b.db.DB()
	if err != nil {
		t.Fatal(err)
	}
	_ = sqlDB.Close()
	_ = b.readiness.Close()
	// The outcome is not known (a commit cut off may have gone through): the answer says how
	// to retry safely rather than that nothing was saved.
	for key, advice := range map[string]string{"": "check before placing it again", "k-1": "try again with the same Idempotency-Key"} {
		resp, body := b.post(t, validBody, "application/json", key)
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" || resp.Header.Get("Content-Type") != "application/problem+json" ||
			!strings.Contains(string(body), advice) {
			t.Fatalf("POST with the database gone, Idempotency-Key %q = %d %s, want a 503 problem that says to %s", key, resp.StatusCode, body, advice)
		}
	}
	// An outage fails every request alike: one line says so, not one per request, and the
	// clients are told to come back at spread-out times.
	retryAfter := map[string]bool{}
	for range 50 {
		resp, _ := b.post(t, validBody, "application/json", "")
		retryAfter[resp.Header.Get("Retry-After")] = true
	}
	if n := len(b.logs.Lines("place order failed")); n != 1 {
		t.Errorf("%d 'place order failed' lines for 52 failed requests, want 1 (one per 10 s at most)", n)
	}
	if len(retryAfter) < 2 {
		t.Errorf("Retry-After %v over 50 answers, want it spread over 1 to 3 s", retryAfter)
	}
	resp, body := do(t, mustRequest(t, http.MethodGet, b.srv.URL+"/readyz"))
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Content-Type") != "application/problem+json" ||
		!strings.Contains(string(body), `"detail":"the database does not answer"`) {
		t.Fatalf("/readyz with the database gone = %d %s, want a 503 problem saying the database does not answer", resp.StatusCode, body)
	}
}

// With the database gone, an invalid command with an Idempotency-Key cannot be told from the
// retry of an order that key placed under the rules of its day: the answer is a 503 that says
// so, to be retried with the same key, not a 422 a client would give up on, nor the advice that
// the order may have been placed, which only a valid command's failure can say. Without a key
// the command is invalid whatever the database holds: a 422.
func TestAnInvalidOrderWhoseKeyCannotBeLookedUpIsA503(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sqlDB, err := b.db.DB()
	if err != nil {
		t.Fatal(err)
	}
	_ = sqlDB.Close()
	invalid := strings.Replace(validBody, `"quantity": 2`, `"quantity": 0`, 1)
	resp, raw := b.post(t, invalid, "application/json", "key-unchecked")
	var problem struct{ Detail string }
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" || resp.Header.Get("Content-Type") != "application/problem+json" ||
		json.Unmarshal(raw, &problem) != nil ||
		problem.Detail != "the order database is unavailable; the order is invalid, unless this Idempotency-Key placed it before, which the service could not check: try again with the same key" {
		t.Errorf("an invalid order with a key, the database gone: %d %v %s; want a 503 problem saying it is invalid unless its key placed it", resp.StatusCode, resp.Header, raw)
	}
	resp, raw = b.post(t, invalid, "application/json", "")
	if resp.StatusCode != http.StatusUnprocessableEntity || resp.Header.Get("Content-Type") != "application/problem+json" || !strings.Contains(string(raw), `"lines[0].quantity"`) {
		t.Errorf("an invalid order without a key, the database gone: %d %s; want a 422 naming lines[0].quantity", resp.StatusCode, raw)
	}
}

// Bodies built to make decoding costly cost little, and each gets its 4xx: brackets nested as
// deep as the size allows (the field check recurses only as deep as the command's type),
// hundreds of thousands of tiny lines (encoding/json would build them all before Validate
// counts them), an object of many keys where a string belongs, and one huge key, which the
// problem does not echo whole.
// Not parallel: it counts the process's allocations.
func TestCostlyBodiesCostLittle(t *testing.T) {
	many := func(elem string) string {
		return strings.TrimSuffix(strings.Repeat(elem+",", (1<<20)/(len(elem)+1)), ",")
	}
	var keys strings.Builder
	for i := range 60_000 {
		fmt.Fprintf(&keys, `"%d":0,`, i)
	}
	for _, c := range []struct {
		name, body string
		status     int
	}{
		{"nested brackets", strings.Repeat("[", 64<<10), 400},
		{"nested brackets for the lines", `{"customer_id": "c", "lines": [` + strings.Repeat("[", 64<<10), 400},
		{"nested objects for a string", `{"customer_id": ` + strings.Repeat(`{"a": `, 16<<10), 400},
		{"nested brackets in a line", `{"customer_id": "c", "lines": [{"sku": ` + strings.Repeat("[", 64<<10), 400},
		{"a million bytes of zeros for lines", `{"customer_id": "c", "lines": [` + many("0") + `]}`, 422},
		{"a million bytes of empty lines", `{"customer_id": "c", "lines": [` + many("{}") + `]}`, 422},
		{"many keys where a string belongs", `{"customer_id": {` + strings.TrimSuffix(keys.String(), ",") + `}, "lines": []}`, 422},
		{"one key of a megabyte", `{"` + strings.Repeat("k", 1<<20) + `": 1}`, 400},
		{"a number of a megabyte", `{"customer_id": "c", "lines": [{"quantity": ` + strings.Repeat("9", 1<<20) + `}]}`, 422},
		{"a wrong shape, then a million bytes of zeros for lines", `{"customer_id": [], "lines": [` + many("0") + `]}`, 422},
		{"a wrong line, then a million bytes of empty lines", `{"customer_id": "c", "lines": [[], ` + many("{}") + `]}`, 422},
	} {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, err := DecodePlaceOrder(strings.NewReader(c.body))
		runtime.ReadMemStats(&after)
		var de *DecodeError
		if !errors.As(err, &de) || de.Status != c.status {
			t.Errorf("%s (%d bytes): %v, want a %d", c.name, len(c.body), err, c.status)
			continue
		}
		if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 24<<20 {
			t.Errorf("%s (%d bytes): %d MiB allocated to decode it, want at most 24", c.name, len(c.body), alloc>>20)
		}
		if len(de.Detail) > 300 {
			t.Errorf("%s: a problem detail of %d bytes, want it short", c.name, len(de.Detail))
		}
	}
}

// A body's field names are the API's, exactly and once each: encoding/json alone would take
// Customer_ID (or ſku, with a long s) for customer_id and the last of two customer_ids.
func TestDecodeRejectsFieldsNotSpelledExactlyOnce(t *testing.T) {
	t.Parallel()
	for body, want := range map[string]string{
		`{"Customer_ID":"c","lines":[]}`:                      `unknown field "Customer_ID": field names are case-sensitive, this one is "customer_id"`,
		`{"customer_id":"c","lines":[{},{"\u017fku":"s"}]}`:   `unknown field "lines[1].ſku": field names are case-sensitive, this one is "sku"`,
		`{"customer_id":"c","lines":[{"discount":5}]}`:        `unknown field "lines[0].discount"`,
		`{"customer_id":"c","lines":[],"customer_id":"d"}`:    `field "customer_id" appears twice`,
		`{"customer_id":"c","lines":[{"sku":"s","sku":"t"}]}`: `field "lines[0].sku" appears twice`,
	} {
		_, err := DecodePlaceOrder(strings.NewReader(body))
		var de *DecodeError
		if !errors.As(err, &de) || de.Status != http.StatusBadRequest || de.Field != "" || de.Detail != want {
			t.Errorf("%s: %v, want a 400 saying %s", body, err, want)
		}
	}
	if _, err := DecodeCancelOrder(strings.NewReader(`{"reason":"a","reason":"b"}`)); err == nil || err.Error() != `field "reason" appears twice` {
		t.Errorf("a reason twice: %v, want a 400", err)
	}
	if cmd, err := DecodePlaceOrder(strings.NewReader(validBody)); err != nil || cmd.CustomerID != "c-42" || len(cmd.Lines) != 2 {
		t.Errorf("the valid body: %+v, %v", cmd, err)
	}
}

func FuzzDecodePlaceOrder(f *testing.F) {
	f.Add([]byte(validBody))
	f.Add([]byte(`{"customer_id":"c","lines":[{"sku":"s","quantity":10000,"unit_price_cents":100000000}]}`))
	f.Add([]byte(`{"lines":[{"quantity":1e300}]}`))
	f.Add([]byte(`{"customer_id":"\u0000"}{}`))
	f.Add([]byte("{\"customer_id\":\"c\",\"lines\":[{\"sku\":\"s\x01\"}]}")) // not JSON inside an array
	f.Fuzz(func(t *testing.T, body []byte) {
		cmd, err := DecodePlaceOrder(bytes.NewReader(body))
		if err != nil {
			var de *DecodeError
			if !errors.As(err, &de) || (de.Status != 400 && de.Status != 422 && de.Status != 413) {
				t.Fatalf("decode error %v is not a 400/413/422 DecodeError", err)
			}
			return
		}
		if len(cmd.Validate()) > 0 {
			return
		}
		o := NewOrder(cmd, uuid.New(), time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC))
		for _, l := range o.Lines {
			if l.Quantity < 1 || l.Quantity > MaxQuantity || l.UnitPriceCents < 0 || l.UnitPriceCents > MaxUnitPriceCents || l.SKU == "" {
				t.Fatalf("a valid command with line %+v", l)
			}
		}
		if o.TotalCents < 0 || o.TotalCents > MaxLines*MaxQuantity*MaxUnitPriceCents {
			t.Fatalf("total %d outside what the limits allow", o.TotalCents)
		}
		// What the order publishes, its consumers accept.
		msg, err := messaging.NewMessage(events.OrderPlacedType, o.Placed())
		if err != nil {
			t.Fatalf("event of a valid order does not marshal: %v", err)
		}
		if _, err := events.DecodeOrderPlaced(msg); err != nil {
			t.Fatalf("the consumers reject the event of a valid order: %v", err)
		}
	})
}

// loneSurrogate finds an escaped surrogate without its pair, and only that: a pair, an escaped
// backslash before "u", and other escapes are no finding.
func TestLoneSurrogate(t *testing.T) {
	t.Parallel()
	for body, want := range map[string]int{
		`"\ud83d\ude00"`:                       -1, // a pair: U+1F600
		`"\\udfff"`:                            -1, // a backslash, then the letters udfff
		`"\u00e9\n\"\/"`:                       -1,
		`"\\\udfff"`:                           3,
		`"a\udfff"`:                            2,
		`"\ud83d"`:                             1,
		`"\ud83d\u0041"`:                       1,
		`"\ude00\ud83d"`:                       1,
		`"\ud83d\ud83d"`:                       1,
		`"\ud83d\ude0"`:                        1,
		`["\u0041", "\uDBFF\uDFFF", "\uDC00"]`: 28,
	} {
		if got := loneSurrogate([]byte(body)); got != want {
			t.Errorf("loneSurrogate(%s) = %d, want %d", body, got, want)
		}
	}
}

// Each key finds its own order: a replay answers the order its key placed, not another one the
// database happens to return first.
func TestIdempotencyKeyFindsItsOwnOrderAmongOthers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if resp, body := b.post(t, strings.Replace(validBody, "c-42", "c-without-key", 1), "application/json", ""); resp.StatusCode != http.StatusCreated {
		t.Fatalf("order without a key: %d %s", resp.StatusCode, body)
	}
	locations := map[string]string{}
	for _, key := range []string{"key-a", "key-b", "key-c"} {
		resp, body := b.post(t, strings.Replace(validBody, "c-42", "c-"+key, 1), "application/json", key)
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("first with %s: %d %s", key, resp.StatusCode, body)
		}
		locations[key] = resp.Header.Get("Location")
	}
	for _, key := range []string{"key-c", "key-b", "key-a"} {
		resp, body := b.post(t, strings.Replace(validBody, "c-42", "c-"+key, 1), "application/json", key)
		var o Order
		if resp.StatusCode != http.StatusCreated || resp.Header.Get("Idempotent-Replayed") != "true" || resp.Header.Get("Location") != locations[key] ||
			json.Unmarshal(body, &o) != nil || o.CustomerID != "c-"+key {
			t.Errorf("replay with %s: %d %s %s, want a replay of %s", key, resp.StatusCode, resp.Header.Get("Location"), body, locations[key])
		}
	}
	if c := b.counts(t); c != [3]int64{4, 8, 4} {
		t.Fatalf("orders, lines, outbox = %v, want four orders", c)
	}
}

// A key replays only the very command it placed: a change to any of its values, a price or a
// SKU as much as a quantity, is another command, refused with 422, and places nothing.
func TestIdempotencyKeyWithAnyOtherCommandIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if resp, body := b.post(t, validBody, "application/json", "key-1"); resp.StatusCode != http.StatusCreated {
		t.Fatalf("first: %d %s", resp.StatusCode, body)
	}
	for name, body := range map[string]string{
		"another customer": strings.Replace(validBody, `"c-42"`, `"c-43"`, 1),
		"another SKU":      strings.Replace(validBody, `"SKU-2"`, `"SKU-3"`, 1),
		"another price":    strings.Replace(validBody, `"unit_price_cents": 1250`, `"unit_price_cents": 1251`, 1),
		"another line":     strings.Replace(validBody, `]}`, `, {"sku": "SKU-3", "quantity": 1, "unit_price_cents": 5}]}`, 1),
		"a line less":      `{"customer_id": "c-42", "lines": [{"sku": "SKU-1", "quantity": 2, "unit_price_cents": 1250}]}`,
	} {
		if body == validBody {
			t.Fatalf("%s: the body did not change", name)
		}
		resp, raw := b.post(t, body, "application/json", "key-1")
		if resp.StatusCode != http.StatusUnprocessableEntity || resp.Header.Get("Content-Type") != "application/problem+json" || resp.Header.Get("Idempotent-Replayed") != "" {
			t.Errorf("same key, %s: %d %s, want a 422 problem", name, resp.StatusCode, raw)
		}
	}
	if c := b.counts(t); c != [3]int64{1, 2, 1} {
		t.Fatalf("orders, lines, outbox = %v, want the first order only", c)
	}
}

// refusedSinceCommand is an order whose SKU holds U+2028, which the rules took before they
// refused it: its body and its command.
func refusedSinceCommand(t *testing.T) (string, PlaceOrder) {
	t.Helper()
	body := strings.Replace(validBody, `"SKU-1"`, `"SKU\u20281"`, 1)
	cmd, err := DecodePlaceOrder(strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if len(cmd.Validate()) == 0 {
		t.Fatalf("%s is valid: the test needs a command the rules refuse", body)
	}
	return body, cmd
}

// A key replays its order even when the rules have since refused its command: a retry across
// the deploy that tightened them (its first answer lost, a 503 after the commit) must find the
// order, not a 422. A command the rules refuse places nothing with any other key, or none.
func TestIdempotencyKeyReplaysAnOrderTheRulesRefuseSince(t *testing.T) {
	t.Parallel()
	b := setup(t)
	body, cmd := refusedSinceCommand(t)
	// The Store does not validate: the order as the rules before U+2028's refusal placed it.
	placed, _, err := b.store.Place(t.Context(), cmd, "key-before-the-deploy")
	if err != nil {
		t.Fatal(err)
	}
	before := b.counts(t)
	resp, raw := b.post(t, body, "application/json", "key-before-the-deploy")
	var o Order
	if resp.StatusCode != http.StatusCreated || resp.Header.Get("Idempotent-Replayed") != "true" || resp.Header.Get("Location") != "/orders/"+placed.ID.String() ||
		json.Unmarshal(raw, &o) != nil || o.ID != placed.ID || o.Lines[0].SKU != "SKU\u20281" {
		t.Errorf("retry with the key of an order the rules refuse since: %d %v %s, want a replay of %s", resp.StatusCode, resp.Header, raw, placed.ID)
	}
	for name, c := range map[string]struct{ body, key string }{
		"an unknown key":           {body, "key-never-used"},
		"no key":                   {body, ""},
		"the key, another command": {strings.Replace(body, `"quantity": 2`, `"quantity": 3`, 1), "key-before-the-deploy"},
	} {
		resp, raw := b.post(t, c.body, "application/json", c.key)
		if resp.StatusCode != http.StatusUnprocessableEntity || resp.Header.Get("Content-Type") != "application/problem+json" ||
			!strings.Contains(string(raw), `"lines[0].sku"`) || resp.Header.Get("Idempotent-Replayed") != "" {
			t.Errorf("%s: %d %s, want a 422 naming lines[0].sku", name, resp.StatusCode, raw)
		}
	}
	if c := b.counts(t); c != before {
		t.Fatalf("orders, lines, outbox = %v after the retries, want %v as before", c, before)
	}
}

// The retry of an order the rules refuse since, made while its first request is still at work
// (an old replica, mid-rollout, between its insert and its commit), waits for that request, as
// a retry of a valid one does at Place's insert: it is answered the order once that commits, and
// the 422 once that rolls back, not a 422 while an order is about to exist.
func TestReplayOfAnInvalidOrderWaitsForItsPlacement(t *testing.T) {
	t.Parallel()
	b := setup(t)
	body, cmd := refusedSinceCommand(t)
	release := b.holdOutboxInserts(t)
	type placed struct {
		order Order
		err   error
	}
	place := func(ctx context.Context, key string) <-chan placed {
		done := make(chan placed, 1)
		go func() {
			o, _, err := b.store.Place(ctx, cmd, key)
			done <- placed{o, err}
		}()
		return done
	}
	type answer struct {
		status   int
		replayed string
		location string
		body     string
	}
	retry := func(key string) <-chan answer {
		done := make(chan answer, 1)
		go func() {
			req, err := http.NewRequest(http.MethodPost, b.srv.URL+"/orders", strings.NewReader(body))
			if err != nil {
				done <- answer{body: err.Error()}
				return
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", key)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				done <- answer{body: err.Error()}
				return
			}
			defer resp.Body.Close()
			raw, err := io.ReadAll(resp.Body)
			if err != nil {
				raw = []byte(err.Error())
			}
			done <- answer{resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), resp.Header.Get("Location"), string(raw)}
		}()
		return done
	}
	abort, cancelPlacement := context.WithCancel(context.Background())
	defer cancelPlacement()
	rolledBack, committed := place(abort, "key-rolled-back"), place(context.Background(), "key-committed")
	testenv.Eventually(t, 10*time.Second, func() bool {
		return testenv.Count(t, b.db, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'advisory'") == 2
	}, "the placements did not reach their outbox inserts")
	retries := map[string]<-chan answer{"key-rolled-back": retry("key-rolled-back"), "key-committed": retry("key-committed")}
	testenv.Eventually(t, 10*time.Second, func() bool {
		for key, r := range retries {
			select {
			case a := <-r:
				t.Fatalf("the retry with %s was answered %d %s while its placement was uncommitted; want it to wait for the placement", key, a.status, a.body)
			default:
			}
		}
		return len(b.lockWaits(t)) == 2
	}, "the retries did not wait for their placements")

	cancelPlacement()
	if p := <-rolledBack; p.err == nil {
		t.Fatal("the placement whose context was cancelled committed")
	}
	if a := <-retries["key-rolled-back"]; a.status != http.StatusUnprocessableEntity || a.replayed != "" || !strings.Contains(a.body, `"lines[0].sku"`) {
		t.Errorf("the retry of a placement rolled back: %d %s, want a 422 naming lines[0].sku", a.status, a.body)
	}
	release()
	p := <-committed
	if p.err != nil {
		t.Fatal(p.err)
	}
	if a := <-retries["key-committed"]; a.status != http.StatusCreated || a.replayed != "true" || a.location != "/orders/"+p.order.ID.String() {
		t.Errorf("the retry of a placement committed: %d %s %s, want a replay of %s", a.status, a.location, a.body, p.order.ID)
	}
	if c := b.counts(t); c != [3]int64{1, 2, 1} {
		t.Fatalf("orders, lines, outbox = %v, want the committed order alone", c)
	}
}

// The hash a command's Idempotency-Key is stored with is pinned: it is kept in request_hash, so
// a change to how a command hashes (a field added to PlaceOrder or Line without omitempty, one
// renamed or moved, another encoder) makes every retry across the deploy that ships it, with
// the same key and body, a 422 as another command. Change these values only with a migration
// of the stored hashes, or a plan for the keys in flight.
func TestCommandHashIsStable(t *testing.T) {
	t.Parallel()
	for want, cmd := range map[string]PlaceOrder{
		// validBody's command.
		"76c040b8d0c97d6fd480d89303c36f266343d8468bcaaf2163fe405f989b6a3e": {CustomerID: "c-42", Lines: []Line{
			{SKU: "SKU-1", Quantity: 2, UnitPriceCents: 1250}, {SKU: "SKU-2", Quantity: 1, UnitPriceCents: 99},
		}},
		// Beyond ASCII, and characters encoding/json escapes for HTML: hashed as it writes them.
		"506e7eaa1dbd3e8c3abbe9b5ca820d495084882273d30e640ee3751631711eb1": {CustomerID: "José", Lines: []Line{
			{SKU: "A&B<1>", Quantity: MaxQuantity, UnitPriceCents: 0},
		}},
	} {
		if got, err := commandHash(cmd); err != nil || got != want {
			t.Errorf("commandHash(%+v) = %s, %v; want %s", cmd, got, err, want)
		}
	}
}

// Only a replay says so, and only the first placement is logged: the first request with a key
// placed the order, the second placed nothing.
func TestOnlyTheReplayIsMarkedReplayed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first, body := b.post(t, validBody, "application/json", "key-first")
	if first.StatusCode != http.StatusCreated {
		t.Fatalf("first: %d %s", first.StatusCode, body)
	}
	if v, ok := first.Header["Idempotent-Replayed"]; ok {
		t.Errorf("the first request with a key answered Idempotent-Replayed: %q; it placed the order", v)
	}
	var o Order
	if err := json.Unmarshal(body, &o); err != nil {
		t.Fatal(err)
	}
	if again, body := b.post(t, validBody, "application/json", "key-first"); again.StatusCode != http.StatusCreated || again.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %s", again.StatusCode, body)
	}
	// Each line is written before its response.
	if lines := b.logs.Lines(`msg="order placed"`, "order_id="+o.ID.String()); len(lines) != 1 {
		t.Errorf("%d lines \"order placed\" for one order placed once and replayed once, want 1; logs:\n%s", len(lines), b.logs)
	}
}

// The limits are inclusive: a command at every one of them is placed, with its total.
// Lengths count characters, not bytes.
func TestCommandAtEveryLimitIsPlaced(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cmd := PlaceOrder{CustomerID: strings.Repeat("é", MaxIDLength)}
	for i := range MaxLines {
		l := Line{SKU: fmt.Sprintf("%s%03d", strings.Repeat("ß", MaxIDLength-3), i), Quantity: MaxQuantity, UnitPriceCents: MaxUnitPriceCents}
		if i%2 == 1 {
			l.Quantity, l.UnitPriceCents = 1, 0
		}
		cmd.Lines = append(cmd.Lines, l)
	}
	raw, err := json.Marshal(cmd)
	if err != nil {
		t.Fatal(err)
	}
	resp, body := b.post(t, string(raw), "application/json", "")
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("a command at the limits: %d %s, want 201", resp.StatusCode, body)
	}
	var o Order
	if err := json.Unmarshal(body, &o); err != nil {
		t.Fatal(err)
	}
	if want := int64(MaxLines/2) * MaxQuantity * MaxUnitPriceCents; o.TotalCents != want || len(o.Lines) != MaxLines || o.CustomerID != cmd.CustomerID {
		t.Fatalf("order of %d lines totalling %d for %q, want %d lines totalling %d", len(o.Lines), o.TotalCents, o.CustomerID, MaxLines, want)
	}
	if c := b.counts(t); c != [3]int64{1, MaxLines, 1} {
		t.Fatalf("orders, lines, outbox = %v, want [1 %d 1]", c, MaxLines)
	}

	reason := strings.Repeat("ü", MaxReasonLength)
	cancel, err := json.Marshal(CancelOrder{Reason: reason})
	if err != nil {
		t.Fatal(err)
	}
	resp, body = b.cancel(t, o.ID.String(), string(cancel), "application/json")
	var cancelled Order
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &cancelled) != nil || cancelled.CancelReason != reason {
		t.Fatalf("a cancellation with a reason of %d characters: %d %s, want 200", MaxReasonLength, resp.StatusCode, body)
	}
}

// An id is a UUID in its canonical text, 8-4-4-4-12 hex digits, in either case: not the other
// forms uuid.Parse takes, which would let x<id>y, {<id>}, urn:uuid:<id> and the bare 32 digits
// name the order <id>. Neither a read nor a cancel goes through with one.
func TestIdsInAnyOtherFormAreRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	o := b.place(t)
	id := o.ID.String()
	for name, other := range map[string]string{
		"between two other characters": "x" + id + "y",
		"in braces":                    "{" + id + "}",
		"as a URN":                     "urn:uuid:" + id,
		"without hyphens":              strings.ReplaceAll(id, "-", ""),
	} {
		var p platform.Problem
		if resp, raw := b.get(t, other); resp.StatusCode != http.StatusBadRequest || resp.Header.Get("Content-Type") != "application/problem+json" || json.Unmarshal(raw, &p) != nil || p.Status != http.StatusBadRequest {
			t.Errorf("GET of the id %s (%s): %d %s, want a 400 problem", name, other, resp.StatusCode, raw)
		}
		if resp, raw := b.cancel(t, other, "", ""); resp.StatusCode != http.StatusBadRequest || resp.Header.Get("Content-Type") != "application/problem+json" || json.Unmarshal(raw, &p) != nil || p.Status != http.StatusBadRequest {
			t.Errorf("cancel of the id %s (%s): %d %s, want a 400 problem", name, other, resp.StatusCode, raw)
		}
	}
	if n := b.cancellations(t); n != 0 {
		t.Fatalf("%d OrderCancelled events after cancels of ids not in canonical form, want 0", n)
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM orders WHERE status <> 'placed'"); n != 0 {
		t.Fatal("a cancel of an id not in canonical form cancelled the order")
	}
	if resp, raw := b.get(t, strings.ToUpper(id)); resp.StatusCode != http.StatusOK {
		t.Fatalf("GET of the id in upper case: %d %s, want 200: hex digits are case-insensitive", resp.StatusCode, raw)
	}
}

// gzipped compresses s.
func gzipped(t *testing.T, s string) string {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	if _, err := zw.Write([]byte(s)); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.String()
}

// A body with a content coding is refused with 415 and Accept-Encoding: identity, not read as
// JSON (a gzip body is not UTF-8), and writes nothing; identity is no coding, and is taken.
func TestEncodedBodiesAreRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	o := b.place(t)
	send := func(path, body, encoding string) (*http.Response, []byte) {
		req, err := http.NewRequest(http.MethodPost, b.srv.URL+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Content-Encoding", encoding)
		return do(t, req)
	}
	for _, c := range []struct{ path, body, encoding string }{
		{"/orders", gzipped(t, validBody), "gzip"},
		{"/orders", validBody, "identity, br"},
		{"/orders/" + o.ID.String() + "/cancel", gzipped(t, `{"reason": "x"}`), "gzip"},
		{"/orders/" + o.ID.String() + "/cancel", `{"reason": "x"}`, "deflate"},
	} {
		resp, raw := send(c.path, c.body, c.encoding)
		var p platform.Problem
		if resp.StatusCode != http.StatusUnsupportedMediaType || resp.Header.Get("Content-Type") != "application/problem+json" ||
			json.Unmarshal(raw, &p) != nil || !strings.Contains(p.Detail, "Content-Encoding") || resp.Header.Get("Accept-Encoding") != "identity" {
			t.Errorf("POST %s with Content-Encoding %s: %d %s %s, want a 415 problem that names Content-Encoding, with Accept-Encoding: identity",
				c.path, c.encoding, resp.StatusCode, resp.Header, raw)
		}
	}
	if c := b.counts(t); c != [3]int64{1, 2, 1} {
		t.Fatalf("orders, lines, outbox = %v after encoded bodies, want only the first order's [1 2 1]", c)
	}
	if n := testenv.Count(t, b.db, "SELECT count(*) FROM orders WHERE status <> 'placed'"); n != 0 {
		t.Fatal("an encoded cancel cancelled the order")
	}
	if resp, raw := send("/orders", validBody, "Identity"); resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST with Content-Encoding Identity: %d %s, want 201", resp.StatusCode, raw)
	}
}

// withoutDatabase is the service's handler, built as main builds it, with a database that
// requests never reach: what these tests send fails before.
func withoutDatabase(t *testing.T, inFlight int) http.Handler {
	t.Helper()
	return servedOn(t, inFlight, &platform.Base{DatabaseReady: func(context.Context) error { return nil }}, &Store{})
}

// servedOn is the service's handler on base and store, built as main builds it: the order API
// behind admission control of inFlight places (HTTP_MAX_IN_FLIGHT), no latency target. It
// sets base's Registry, a fresh one, and Admission.
func servedOn(t *testing.T, inFlight int, base *platform.Base, store *Store) http.Handler {
	t.Helper()
	log, _ := testenv.NewLogger(t)
	base.Registry = prometheus.NewRegistry()
	adm, err := platform.NewAdmission(log, base.Registry, inFlight, 0)
	if err != nil {
		t.Fatal(err)
	}
	base.Admission = adm
	return handler(log, base, store)
}

// failingBody sends its prefix, then fails with err.
type failingBody struct {
	prefix io.Reader
	err    error
}

func (f failingBody) Read(p []byte) (int, error) {
	if n, _ := f.prefix.Read(p); n > 0 {
		return n, nil
	}
	return 0, f.err
}

// A body the connection fails to deliver is the connection's fault, not a malformed one: a
// stalled upload is a 408, another failure a 400, and neither problem carries the connection's
// error, which names the server's address.
func TestUnreadableBodiesGetAProblemWithoutTheConnectionsError(t *testing.T) {
	t.Parallel()
	h := withoutDatabase(t, 4)
	server := &net.TCPAddr{IP: net.IPv4(172, 18, 0, 5), Port: 8080}
	client := &net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 51234}
	opError := func(err error) error {
		return &net.OpError{Op: "read", Net: "tcp", Source: server, Addr: client, Err: err}
	}
	for _, c := range []struct {
		name   string
		err    error
		status int
	}{
		{"timeout", opError(os.ErrDeadlineExceeded), http.StatusRequestTimeout},
		{"reset", opError(&os.SyscallError{Syscall: "read", Err: syscall.ECONNRESET}), http.StatusBadRequest},
		{"cut short", io.ErrUnexpectedEOF, http.StatusBadRequest},
	} {
		for _, path := range []string{"/orders", "/orders/" + uuid.NewString() + "/cancel"} {
			req := httptest.NewRequest(http.MethodPost, path, failingBody{strings.NewReader(`{"customer_id": "c-`), c.err})
			req.Header.Set("Content-Type", "application/json")
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			var p platform.Problem
			if rec.Code != c.status || rec.Header().Get("Content-Type") != "application/problem+json" || json.Unmarshal(rec.Body.Bytes(), &p) != nil || p.Detail == "" {
				t.Errorf("%s, POST %s: %d %s, want a %d problem", c.name, path, rec.Code, rec.Body, c.status)
			}
			for _, leak := range []string{"tcp", server.IP.String(), client.IP.String(), "8080", "EOF", "connection reset"} {
				if strings.Contains(rec.Body.String(), leak) {
					t.Errorf("%s, POST %s: the problem %s gives away %q", c.name, path, rec.Body, leak)
				}
			}
		}
	}
}

// The JSON the service reads is UTF-8: a charset parameter may say so in any case, as the
// unregistered but common utf8, or as US-ASCII, its subset; any other is refused (415).
func TestIsJSONTakesUTF8AndItsSubsetOnly(t *testing.T) {
	t.Parallel()
	for ct, want := range map[string]bool{
		"application/json":                     true,
		"application/json; charset=utf-8":      true,
		`application/json; charset="UTF-8"`:    true,
		"application/json; charset=UTF8":       true,
		"application/json; charset=us-ascii":   true,
		"application/json; charset=utf-16":     false,
		"application/json; charset=iso-8859-1": false,
		"text/json; charset=utf-8":             false,
		"application/json; charset=":           false,
		"":                                     false,
	} {
		if got := isJSON(ct); got != want {
			t.Errorf("isJSON(%q) = %v, want %v", ct, got, want)
		}
	}
}
