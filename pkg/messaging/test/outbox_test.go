package test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"io/fs"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/statements"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/internal/testhook"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/sqldriver"
)

func TestEnqueueCommitsAndRollsBackWithBusinessData(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.DB
	if err := db.Exec("CREATE TABLE orders (id uuid PRIMARY KEY)").Error; err != nil {
		t.Fatal(err)
	}
	placeOrder := func(fail bool) error {
		return db.Transaction(func(tx *gorm.DB) error {
			msg := newMessage(t, 0)
			if err := tx.Exec("INSERT INTO orders (id) VALUES (?)", msg.ID).Error; err != nil {
				return err
			}
			if err := messaging.Enqueue(context.Background(), b.drv, tx, msg); err != nil {
				return err
			}
			if fail {
				return errors.New("business rule failed after enqueue")
			}
			return nil
		})
	}

	if err := placeOrder(false); err != nil {
		t.Fatal(err)
	}
	if err := placeOrder(true); err == nil {
		t.Fatal("want the failing transaction's error")
	}

	if n := testenv.Count(t, db, "SELECT count(*) FROM orders"); n != 1 {
		t.Errorf("orders = %d, want 1 (the rolled-back one must not exist)", n)
	}
	if n := testenv.Count(t, db, "SELECT count(*) FROM outbox_messages"); n != 1 {
		t.Errorf("outbox rows = %d, want 1 (the rolled-back one must not exist)", n)
	}
	if n := testenv.Count(t, db, `SELECT count(*) FROM outbox_messages o JOIN orders ON orders.id = o.id
		WHERE o.type = 'OrderPlaced' AND o.processed_at IS NULL AND o.attempts = 0 AND o.next_attempt_at <= now()`); n != 1 {
		t.Errorf("committed outbox row is not a due, unsent OrderPlaced row with the order's id")
	}
}

// One Enqueue of more messages than a statement with a parameter per value could carry
// (PostgreSQL takes at most 65,535): every row is written, in the caller's transaction, and a
// rollback leaves none.
func TestEnqueueTakesMoreMessagesThanOneStatementCarries(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.DB
	const n = 30_000
	batch := func() ([]messaging.Message, []uuid.UUID) {
		msgs, ids := make([]messaging.Message, n), make([]uuid.UUID, n)
		for i := range msgs {
			msgs[i] = newMessage(t, i)
			ids[i] = msgs[i].ID
		}
		return msgs, ids
	}

	rolledBack, _ := batch()
	err := db.Transaction(func(tx *gorm.DB) error {
		if err := messaging.Enqueue(context.Background(), b.drv, tx, rolledBack...); err != nil {
			t.Fatalf("enqueue %d messages: %v", n, err)
		}
		return errors.New("roll back")
	})
	if err == nil {
		t.Fatal("want the rolled-back transaction's error")
	}
	if got := testenv.Count(t, db, "SELECT count(*) FROM outbox_messages"); got != 0 {
		t.Fatalf("after a rollback: %d outbox rows, want 0", got)
	}

	committed, ids := batch()
	if err := db.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, committed...) }); err != nil {
		t.Fatalf("enqueue %d messages: %v", n, err)
	}
	if got := testenv.Count(t, db, "SELECT count(*) FROM outbox_messages"); got != n {
		t.Fatalf("%d outbox rows, want %d", got, n)
	}
	if got := testenv.Count(t, db, "SELECT count(*) FROM outbox_messages WHERE id IN ?", ids); got != n {
		t.Fatalf("%d of the %d enqueued ids found", got, n)
	}
	if got := testenv.Count(t, db, "SELECT count(DISTINCT (payload->>'n')::int) FROM outbox_messages"); got != n {
		t.Fatalf("%d distinct payloads, want %d", got, n)
	}
}

// One Enqueue of more rows than one insert takes (8 MiB of JSON; here a bound of 64 KiB, lowered
// through testhook, and 300 messages of 1 KiB) inserts them in several statements, behind a
// savepoint, in the caller's transaction, through each driver: every row is committed, and the
// transaction goes on. An id stored already, in the second insert, fails the Enqueue with the
// server's error, and rolls the transaction back to before the messages: it goes on, none of
// them written. The relays are notified once at the commit, or, through WithoutNotify, not at
// all, as by one insert.
func TestEnqueueOfSeveralInsertsIsAllOrNothing(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+4) // a pool of one per other driver, and a LISTEN
	d := testenv.NewDatabase(t)
	d.MigrateLibrary(t)
	must(t, d.DB.Exec("CREATE TABLE driver_work (message_id uuid PRIMARY KEY)").Error)
	ctx := testhook.WithEnqueueBatchBytes(context.Background(), 64<<10)
	messages := func() []messaging.Message {
		msgs := make([]messaging.Message, 300)
		for i := range msgs {
			m, err := messaging.NewMessage(eventType, map[string]any{"n": i, "filler": strings.Repeat("x", 1<<10)})
			must(t, err)
			msgs[i] = m
		}
		return msgs
	}

	testenv.Draw(t, 1)
	listener, err := pgx.Connect(ctx, d.URL)
	must(t, err)
	_, err = listener.Exec(ctx, "LISTEN "+statements.NotifyChannel)
	must(t, err)
	gormDrv := d.Driver(t)
	for _, c := range []struct {
		drv  messaging.Driver[*gorm.DB]
		mark string
	}{{gormDrv, "after the plain commit"}, {messaging.WithoutNotify[*gorm.DB](gormDrv), "after the quiet commit"}} {
		must(t, d.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(ctx, c.drv, tx, messages()...) }))
		must(t, d.DB.Exec("SELECT pg_notify(?, ?)", statements.NotifyChannel, c.mark).Error)
	}
	var got []string
	for !slices.Contains(got, "after the quiet commit") {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		n, err := listener.WaitForNotification(wctx)
		cancel()
		if err != nil {
			t.Fatalf("notifications so far %q, then: %v", got, err)
		}
		got = append(got, n.Payload)
	}
	must(t, listener.Close(ctx))
	if want := []string{"", "after the plain commit", "after the quiet commit"}; !slices.Equal(got, want) {
		t.Errorf("notifications %q, want %q: one from the plain commit of several inserts, none from the quiet one", got, want)
	}

	testenv.Draw(t, 1)
	pool := newPgxPool(t, d.URL, 1)
	defer pool.Close()
	testSeveralInserts(ctx, t, d, "pgx", pgxCase(pool), messages)
	for _, driver := range []string{"pgx", "postgres"} {
		testenv.Draw(t, 1)
		db, err := sql.Open(driver, d.URL)
		must(t, err)
		db.SetMaxOpenConns(1)
		testSeveralInserts(ctx, t, d, "database/sql "+driver, sqlCase(sqldriver.New(db), db, false), messages)
		must(t, db.Close())
	}
	testSeveralInserts(ctx, t, d, "GORM", gormCase(gormDrv, d.DB), messages)
}

// testSeveralInserts enqueues messages() of several inserts under ctx through c's driver, in a
// transaction that then writes a row of driver_work and commits: once all new, once with a
// message of the first enqueue's again, in the second insert.
func testSeveralInserts[Tx any](ctx context.Context, t *testing.T, d *testenv.Database, name string, c driverCase[Tx], messages func() []messaging.Message) {
	t.Helper()
	count := func(msgs []messaging.Message) int64 {
		ids := make([]uuid.UUID, len(msgs))
		for i, m := range msgs {
			ids[i] = m.ID
		}
		return testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE id IN ?", ids)
	}
	enqueue := func(msgs []messaging.Message) (enqueued error) {
		tx, err := c.begin(ctx)
		must(t, err)
		enqueued = messaging.Enqueue(ctx, c.drv, tx, msgs...)
		if err := c.work(ctx, tx, msgs[0].ID); err != nil {
			_ = c.rollback(ctx, tx)
			t.Fatalf("%s: the transaction's statement after an Enqueue that returned %v: %v", name, enqueued, err)
		}
		if err := c.commit(ctx, tx); err != nil {
			t.Fatalf("%s: commit after an Enqueue that returned %v: %v", name, enqueued, err)
		}
		if n := testenv.Count(t, d.DB, "SELECT count(*) FROM driver_work WHERE message_id = ?", msgs[0].ID); n != 1 {
			t.Fatalf("%s: the transaction's own row committed %d times, want once", name, n)
		}
		return enqueued
	}

	first := messages()
	if err := enqueue(first); err != nil {
		t.Fatalf("%s: enqueue %d messages in several inserts: %v", name, len(first), err)
	}
	if n := count(first); n != int64(len(first)) {
		t.Fatalf("%s: %d of the %d messages committed", name, n, len(first))
	}

	again := messages()
	again[80] = first[80] // in the second insert: each takes some 50 messages
	err := enqueue(again)
	var coded interface{ SQLState() string }
	if !errors.As(err, &coded) || coded.SQLState() != "23505" || !strings.Contains(err.Error(), "insert messages ") || strings.Contains(err.Error(), "messages 0 to") {
		t.Fatalf("%s: enqueue of an id stored already, past the first insert: %v; want the unique violation of an insert after the first", name, err)
	}
	if n := count(again); n != 1 {
		t.Errorf("%s: %d of the messages of a failed Enqueue committed, want only the one stored before", name, n-1)
	}
}

func TestEnqueueRefusesToRunOutsideATransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	err := messaging.Enqueue(context.Background(), b.drv, b.db.DB, newMessage(t, 0)) // a plain handle, not a transaction
	if !errors.Is(err, messaging.ErrNotInTransaction) {
		t.Fatalf("Enqueue outside a transaction = %v, want ErrNotInTransaction", err)
	}
	if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages"); n != 0 {
		t.Fatalf("outbox rows = %d, want 0", n)
	}
}

// An id that is not a UUIDv7 is refused too: the cleanup finds sent rows through the primary
// key up to the UUIDv7 of its cutoff, and a random (v4) or name-based (v5) id sorts anywhere,
// so its row would stay in the outbox for good.
func TestEnqueueRejectsMessagesWithoutIDOrJSONPayload(t *testing.T) {
	t.Parallel()
	b := setup(t)
	bad := []messaging.Message{
		{Type: eventType, Payload: []byte(`{}`)},
		{ID: newMessage(t, 0).ID, Type: eventType, Payload: []byte(`not json`)},
		{ID: newMessage(t, 0).ID, Payload: []byte(`{}`)},
		{ID: uuid.New(), Type: eventType, Payload: []byte(`{}`)},
		{ID: uuid.NewSHA1(uuid.NameSpaceURL, []byte("order-42")), Type: eventType, Payload: []byte(`{}`)},
	}
	for _, m := range bad {
		err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, m) })
		if err == nil {
			t.Errorf("Enqueue(%+v) succeeded, want an error", m)
		} else if m.ID != uuid.Nil && m.ID.Version() != 7 && !strings.Contains(err.Error(), "UUIDv7") {
			t.Errorf("Enqueue of id %s (version %d): %v, want an error that asks for a UUIDv7", m.ID, m.ID.Version(), err)
		}
	}
	if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages"); n != 0 {
		t.Fatalf("outbox rows = %d, want 0", n)
	}
}

// AMQP carries the type, routing key, correlation id and header names as short strings of at
// most 255 bytes, and all the properties in one frame, and RabbitMQ takes a header CC or BCC as
// an array only: Enqueue refuses a message that breaks
// either, writing nothing, instead of leaving the relay a row that can never be sent.
func TestEnqueueRejectsEnvelopesAMQPCannotCarry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	long := strings.Repeat("x", 256)
	bad := map[string]func(*messaging.Message){
		"type":           func(m *messaging.Message) { m.Type = long },
		"routing key":    func(m *messaging.Message) { m.RoutingKey = long },
		"correlation id": func(m *messaging.Message) { m.CorrelationID = long },
		"header name":    func(m *messaging.Message) { m.Headers = map[string]string{long: "v"} },
		"headers":        func(m *messaging.Message) { m.Headers = map[string]string{"big": strings.Repeat("x", 128<<10)} },
		// RabbitMQ's extra routing keys, an array: a string closes the relay's channel.
		"CC header":  func(m *messaging.Message) { m.Headers = map[string]string{"CC": "audit"} },
		"BCC header": func(m *messaging.Message) { m.Headers = map[string]string{"BCC": "audit"} },
	}
	for what, spoil := range bad {
		m := newMessage(t, 0)
		spoil(&m)
		err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, m) })
		if !errors.Is(err, messaging.ErrInvalidEnvelope) || !strings.Contains(err.Error(), m.ID.String()) {
			t.Errorf("Enqueue of a message with a %s AMQP cannot carry = %v, want ErrInvalidEnvelope naming the message", what, err)
		}
	}
	if n := testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages"); n != 0 {
		t.Fatalf("outbox rows = %d, want 0", n)
	}
	atLimit := newMessage(t, 0)
	atLimit.CorrelationID = long[1:]
	if err := b.db.DB.Transaction(func(tx *gorm.DB) error { return messaging.Enqueue(context.Background(), b.drv, tx, atLimit) }); err != nil {
		t.Fatalf("Enqueue of a 255-byte correlation id = %v, want nil", err)
	}
}

// PostgreSQL cannot store everything a Message can hold: a NUL character in text or jsonb, and
// in jsonb an unpaired surrogate, invalid UTF-8 or a number beyond numeric's range, which
// encoding/json's Valid all lets through; nor an occurred-at time outside the years 1 to
// 9999, nor two rows of one id; and what it would store changed, invalid UTF-8 in any text
// (the rows travel as JSON, which carries each bad byte as U+FFFD). Enqueue refuses such a
// message, saying what, before any statement: the caller's transaction is not aborted, and its
// other work and messages commit. A payload with an escaped backslash before u0000 holds no NUL
// and is stored, and so is an id far ahead of the clock (a business time made into an id; the
// cleanup takes its sent row by processed_at).
func TestEnqueueRefusesWhatPostgreSQLCannotStoreAndTheTransactionGoesOn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.DB
	if err := db.Exec("CREATE TABLE orders (id uuid PRIMARY KEY)").Error; err != nil {
		t.Fatal(err)
	}
	payload := func(p string) func(*messaging.Message) { return func(m *messaging.Message) { m.Payload = []byte(p) } }
	bad := []struct {
		spoil func(*messaging.Message)
		want  string
	}{
		{payload(`{"note":"a\u0000b"}`), "its payload holds a NUL character"},
		{payload(`{"note":"\ud800"}`), "its payload holds a high surrogate without its low one"},
		{payload("{\"note\":\"\xff\"}"), "its payload holds invalid UTF-8"},
		{payload(`{"n":1e131072}`), "its payload holds the number 1e131072, beyond PostgreSQL's numeric range"},
		{func(m *messaging.Message) { m.CorrelationID = "a\x00b" }, "its correlation id holds a NUL character"},
		{func(m *messaging.Message) { m.Headers = map[string]string{"tenant": "a\x00b"} }, `its header "tenant" holds a NUL character`},
		{func(m *messaging.Message) { m.Type = "Order\xffPlaced" }, "its type is not valid UTF-8"},
		{func(m *messaging.Message) { m.RoutingKey = strings.Repeat("k", 254) + "\xff" }, "its routing key is not valid UTF-8"},
		{func(m *messaging.Message) { m.Exchange = "orders\xff" }, "its exchange is not valid UTF-8"},
		{func(m *messaging.Message) { m.Headers = map[string]string{"ten\xffant": "a"} }, "has a name that is not valid UTF-8"},
		// Within AMQP's 255 bytes as given, past them as stored: each bad byte becomes U+FFFD.
		{func(m *messaging.Message) { m.CorrelationID = strings.Repeat("\xff", 100) }, "its correlation id is not valid UTF-8"},
		{func(m *messaging.Message) {
			m.TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\xff"
		}, "its trace parent is not valid UTF-8"},
		{func(m *messaging.Message) {
			m.TraceParent, m.TraceState = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "vendor=\xff"
		}, "its trace state is not valid UTF-8"},
		{func(m *messaging.Message) { m.Headers = map[string]string{"tenant": "a\xffb"} }, `its header "tenant" has a value that is not valid UTF-8`},
		{func(m *messaging.Message) { m.OccurredAt = time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC) }, "in the year 10000, outside the years 1 to 9999"},
		{func(m *messaging.Message) { m.OccurredAt = time.Date(0, 12, 31, 0, 0, 0, 0, time.UTC) }, "in the year 0, outside the years 1 to 9999"},
	}
	kept := newMessage(t, 0)
	setIDTime(&kept, time.Date(2100, 1, 1, 0, 0, 0, 0, time.UTC))
	kept.Payload = []byte(`{"path":"C:\\u0000","n":1e131071}`)
	kept.CorrelationID = "Zürich \"北\"\t\\ 😀"
	kept.Headers = map[string]string{"città": kept.CorrelationID}
	err := db.Transaction(func(tx *gorm.DB) error {
		if err := tx.Exec("INSERT INTO orders (id) VALUES (?)", kept.ID).Error; err != nil {
			return err
		}
		for _, tc := range bad {
			m := newMessage(t, 0)
			tc.spoil(&m)
			if err := messaging.Enqueue(context.Background(), b.drv, tx, m); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Enqueue = %v, want an error saying %q", err, tc.want)
			}
		}
		twice := newMessage(t, 0)
		if err := messaging.Enqueue(context.Background(), b.drv, tx, twice, newMessage(t, 0), twice); err == nil || !strings.Contains(err.Error(), "message 0 has its id already") {
			t.Errorf("Enqueue of one message twice = %v, want an error saying the id is message 0's", err)
		}
		return messaging.Enqueue(context.Background(), b.drv, tx, kept)
	})
	if err != nil {
		t.Fatalf("the transaction after the refusals: %v, want it to commit", err)
	}
	if n := testenv.Count(t, db, "SELECT count(*) FROM orders"); n != 1 {
		t.Errorf("orders = %d, want 1", n)
	}
	var path string
	if err := db.Raw("SELECT payload->>'path' FROM outbox_messages WHERE id = ?", kept.ID).Scan(&path).Error; err != nil || path != `C:\u0000` {
		t.Errorf("stored payload path = %q (%v), want C:\\u0000 as text", path, err)
	}
	var correlationID, header string
	if err := db.Raw("SELECT correlation_id, headers->>'città' FROM outbox_messages WHERE id = ?", kept.ID).Row().Scan(&correlationID, &header); err != nil ||
		correlationID != kept.CorrelationID || header != kept.CorrelationID {
		t.Errorf("stored correlation id %q and header %q (%v), want both %q", correlationID, header, err, kept.CorrelationID)
	}
	if n := testenv.Count(t, db, "SELECT count(*) FROM outbox_messages"); n != 1 {
		t.Errorf("outbox rows = %d, want 1 (the message PostgreSQL can store)", n)
	}
}

// A payload over 16 MiB, RabbitMQ 4's default max_message_size, is refused with ErrTooLarge
// before any statement, whatever the driver: the caller's transaction goes on, and its next
// statement and commit succeed. Stored whole, a larger one would never be delivered, and one
// past some 32 MiB (an array of small numbers) takes the server more memory than it allocates
// at once: the insert fails and aborts the transaction. A payload of 16 MiB is stored. The
// payloads are one long string, which jsonb parses in little memory, and one mostly of white
// space, which jsonb prints back small: the bound holds for the payload as given too.
func TestEnqueueRefusesAPayloadOverTheBoundAndTheTransactionGoesOn(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+2) // a pool of one per other driver
	d := testenv.NewDatabase(t)
	d.MigrateLibrary(t)
	must(t, d.DB.Exec("CREATE TABLE driver_work (message_id uuid PRIMARY KEY)").Error)
	const bound = 16 << 20
	testenv.Draw(t, 1)
	pool := newPgxPool(t, d.URL, 1)
	defer pool.Close()
	testPayloadBound(t, d, "pgx", pgxCase(pool), bound)
	testenv.Draw(t, 1)
	db, err := sql.Open("pgx", d.URL)
	must(t, err)
	defer func() { must(t, db.Close()) }()
	db.SetMaxOpenConns(1)
	testPayloadBound(t, d, "database/sql", sqlCase(sqldriver.New(db), db, false), bound)
	testPayloadBound(t, d, "GORM", gormCase(d.Driver(t), d.DB), bound)
}

// testPayloadBound enqueues, through c's driver and in one transaction, a message whose payload
// is a byte over bound, then one as long but mostly white space, then one of bound bytes, then
// writes a row of driver_work and commits.
func testPayloadBound[Tx any](t *testing.T, d *testenv.Database, name string, c driverCase[Tx], bound int) {
	t.Helper()
	ctx := context.Background()
	payload := func(size int) []byte { // {"filler":"xx…x"}, size bytes
		const head, tail = `{"filler":"`, `"}`
		return []byte(head + strings.Repeat("x", size-len(head)-len(tail)) + tail)
	}
	over, spaced, atBound := newMessage(t, 0), newMessage(t, 2), newMessage(t, 1)
	over.Payload, atBound.Payload = payload(bound+1), payload(bound)
	// [1   …   ], bound+1 bytes: jsonb prints it back as [1], so only the bound on the payload
	// as given refuses it.
	spaced.Payload = []byte("[1" + strings.Repeat(" ", bound+1-len("[1]")) + "]")
	tx, err := c.begin(ctx)
	must(t, err)
	refused := messaging.Enqueue(ctx, c.drv, tx, over)
	spacedRefused := messaging.Enqueue(ctx, c.drv, tx, spaced)
	stored := messaging.Enqueue(ctx, c.drv, tx, atBound)
	if err := c.work(ctx, tx, atBound.ID); err != nil {
		_ = c.rollback(ctx, tx)
		t.Fatalf("%s: the transaction's statement after the Enqueue of a payload over the bound, which returned %v: %v", name, refused, err)
	}
	if err := c.commit(ctx, tx); err != nil {
		t.Fatalf("%s: commit after the Enqueue of a payload over the bound, which returned %v: %v", name, refused, err)
	}
	if !errors.Is(refused, messaging.ErrTooLarge) || !strings.Contains(refused.Error(), over.ID.String()) {
		t.Errorf("%s: Enqueue of a payload of %d bytes = %v, want ErrTooLarge naming the message", name, bound+1, refused)
	}
	if !errors.Is(spacedRefused, messaging.ErrTooLarge) || !strings.Contains(spacedRefused.Error(), spaced.ID.String()) {
		t.Errorf("%s: Enqueue of a payload of %d bytes, mostly white space = %v, want ErrTooLarge naming the message", name, bound+1, spacedRefused)
	}
	if stored != nil {
		t.Errorf("%s: Enqueue of a payload of %d bytes = %v, want it stored", name, bound, stored)
	}
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM driver_work WHERE message_id = ?", atBound.ID); n != 1 {
		t.Errorf("%s: the transaction's own row committed %d times, want once", name, n)
	}
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE id = ? AND octet_length(payload->>'filler') = ?", atBound.ID, bound-len(`{"filler":""}`)); n != 1 {
		t.Errorf("%s: %d rows of the payload at the bound, whole, want 1", name, n)
	}
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE id IN (?, ?)", over.ID, spaced.ID); n != 0 {
		t.Errorf("%s: %d rows of the payloads over the bound, want none", name, n)
	}
}

// jsonb gives a number back as numeric prints it, written out in full, and the relay sends
// that text: a payload of 130 numbers 1e131071, 1 KiB as given, reads back as 17 MB, which no
// default RabbitMQ 4 takes, and as large in memory at every attempt. Enqueue measures a payload
// as jsonb gives it back (less the spaces it adds, which the publisher drops) and refuses one
// over 16 MiB with ErrTooLarge, before any statement: the transaction goes on and commits. The
// measure is PostgreSQL's own: for each form of number, a payload of exactly 16 MiB by the
// compacted text PostgreSQL gives back is stored, and one a byte longer refused.
func TestEnqueueMeasuresAPayloadAsPostgreSQLGivesItBack(t *testing.T) {
	t.Parallel()
	d := testenv.NewDatabase(t)
	d.MigrateLibrary(t)
	must(t, d.DB.Exec("CREATE TABLE orders (id uuid PRIMARY KEY)").Error)
	const bound = 16 << 20
	// printed is the length of payload p as the relay sends it: jsonb's text, compacted.
	printed := func(p string) int {
		var text string
		must(t, d.DB.Raw("SELECT ?::jsonb::text", p).Scan(&text).Error)
		var b bytes.Buffer
		must(t, json.Compact(&b, []byte(text)))
		return b.Len()
	}
	type attempt struct {
		m      messaging.Message
		stored bool
	}
	attempts := []attempt{{newMessage(t, 0), false}}
	attempts[0].m.Payload = []byte("[" + strings.Repeat("1e131071,", 129) + "1e131071]")
	// 1e999 makes each payload longer as given back than as given: only the new measure can
	// refuse the one a byte over, shorter than 16 MiB as given.
	for _, number := range []string{`1e131071`, `-1e131071`, `0.0001e131075`, `1.5e-7`, `-123.45e-10`,
		`12e-1`, `100e-2`, `-0.0`, `0e-16383`, `-1e-16383`} {
		payload := func(pad int) []byte { return []byte(`[1e999,` + number + `,"` + strings.Repeat("x", pad) + `"]`) }
		pad := bound - printed(string(payload(0)))
		atBound, over := newMessage(t, 0), newMessage(t, 0)
		atBound.Payload, over.Payload = payload(pad), payload(pad+1)
		attempts = append(attempts, attempt{over, false}, attempt{atBound, true})
	}
	errs := make([]error, len(attempts))
	ctx := context.Background()
	drv := d.Driver(t)
	err := d.DB.Transaction(func(tx *gorm.DB) error {
		for i, a := range attempts {
			errs[i] = messaging.Enqueue(ctx, drv, tx, a.m)
		}
		return tx.Exec("INSERT INTO orders (id) VALUES (?)", uuid.New()).Error
	})
	if err != nil {
		t.Fatalf("the transaction after the refusals: %v, want it to commit", err)
	}
	for i, a := range attempts {
		switch {
		case a.stored && errs[i] != nil:
			t.Errorf("Enqueue of %.30s… (%d bytes as given) = %v, want it stored", a.m.Payload, len(a.m.Payload), errs[i])
		case !a.stored && (!errors.Is(errs[i], messaging.ErrTooLarge) || !strings.Contains(errs[i].Error(), "as PostgreSQL's jsonb gives it back")):
			t.Errorf("Enqueue of %.30s… (%d bytes as given) = %v, want ErrTooLarge for its size as jsonb gives it back", a.m.Payload, len(a.m.Payload), errs[i])
		}
		want := int64(0)
		if a.stored {
			want = 1
		}
		if n := testenv.Count(t, d.DB, "SELECT count(*) FROM outbox_messages WHERE id = ?", a.m.ID); n != want {
			t.Errorf("%d rows of %.30s…, want %d", n, a.m.Payload, want)
		}
	}
	if n := testenv.Count(t, d.DB, "SELECT count(*) FROM orders"); n != 1 {
		t.Errorf("orders = %d, want the transaction's own row", n)
	}
}

// setIDTime sets the time in m's UUIDv7 id, its 48-bit big-endian millisecond timestamp.
func setIDTime(m *messaging.Message, t time.Time) {
	ms := t.UnixMilli()
	for i := range 6 {
		m.ID[i] = byte(ms >> (40 - 8*i))
	}
}

// A payload of JSON null (NewMessage of a nil map, slice or pointer) is a JSON value like any
// other: stored as jsonb's null, in the caller's transaction, which commits its other work, and
// sent as the body null.
func TestEnqueueStoresANullPayloadAndTheRelaySendsIt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := b.db.DB
	must(t, db.Exec("CREATE TABLE orders (id uuid PRIMARY KEY)").Error)
	msg, err := messaging.NewMessage(eventType, map[string]any(nil))
	if err != nil || string(msg.Payload) != "null" {
		t.Fatalf("NewMessage of a nil map = %q, %v; want the payload null", msg.Payload, err)
	}
	err = db.Transaction(func(tx *gorm.DB) error {
		if err := tx.Exec("INSERT INTO orders (id) VALUES (?)", msg.ID).Error; err != nil {
			return err
		}
		return messaging.Enqueue(context.Background(), b.drv, tx, msg)
	})
	if err != nil {
		t.Fatalf("the transaction that enqueued a null payload: %v, want it to commit", err)
	}
	if n := testenv.Count(t, db, "SELECT count(*) FROM orders"); n != 1 {
		t.Errorf("orders = %d, want 1", n)
	}
	var stored string
	if err := db.Raw("SELECT payload::text FROM outbox_messages WHERE id = ?", msg.ID).Scan(&stored).Error; err != nil || stored != "null" {
		t.Fatalf("stored payload = %q (%v), want null", stored, err)
	}
	res, err := b.relay(t, b.publisher(t, testenv.AMQPURL()), nil).ProcessBatch(context.Background())
	if err != nil || res != (messaging.BatchResult{Claimed: 1, Sent: 1}) {
		t.Fatalf("batch = %+v, %v; want the row claimed and sent", res, err)
	}
	got := testenv.Drain(t, b.ch, b.queue, 200*time.Millisecond)
	if len(got) != 1 || string(got[0].Body) != "null" {
		t.Fatalf("deliveries = %d, want one with the body null", len(got))
	}
}

func TestEnqueueNotifiesTheRelayOnCommit(t *testing.T) {
	t.Parallel()
	b := setupWith(t, 1) // a LISTEN connection of the test's own
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, b.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "LISTEN "+statements.NotifyChannel); err != nil {
		t.Fatal(err)
	}

	// Every enqueue notifies alike, so which transaction a notification came from shows only
	// in where it arrives among marks the listener sends itself, each after the step it names:
	// none after a rolled-back enqueue, none while an enqueuing transaction is open, one at its
	// commit. A notification sent outside the caller's transaction would come before a mark.
	mark := func(step string) {
		t.Helper()
		if _, err := conn.Exec(ctx, "SELECT pg_notify($1, $2)", statements.NotifyChannel, step); err != nil {
			t.Fatal(err)
		}
	}
	_ = b.db.DB.Transaction(func(tx *gorm.DB) error {
		if err := messaging.Enqueue(context.Background(), b.drv, tx, newMessage(t, 0)); err != nil {
			t.Fatal(err)
		}
		return errors.New("roll back")
	})
	mark("after the rollback")
	must(t, b.db.DB.Transaction(func(tx *gorm.DB) error {
		if err := messaging.Enqueue(context.Background(), b.drv, tx, newMessage(t, 1)); err != nil {
			return err
		}
		mark("while the transaction is open")
		return nil
	}))
	mark("after the commit")

	var got []string
	for !slices.Contains(got, "after the commit") {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			t.Fatalf("notifications so far %q, then: %v", got, err)
		}
		if n.Channel != statements.NotifyChannel {
			t.Fatalf("notification on %q, want %q", n.Channel, statements.NotifyChannel)
		}
		got = append(got, n.Payload)
	}
	if want := []string{"after the rollback", "while the transaction is open", "", "after the commit"}; !slices.Equal(got, want) {
		t.Errorf("notifications %q, want %q: the enqueue's one, at its commit", got, want)
	}
	if rows := testenv.Count(t, b.db.DB, "SELECT count(*) FROM outbox_messages"); rows != 1 {
		t.Fatalf("outbox rows = %d, want 1", rows)
	}
}

func TestMigrationsAreIdempotentAndSafeConcurrently(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	pool := db.Driver(t).DB()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 4 {
		wg.Go(func() {
			errs <- messaging.MigrateOutbox(context.Background(), pool)
			errs <- messaging.MigrateInbox(context.Background(), pool)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	versions, err := fs.Glob(messaging.Schema, "schema/outbox/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	if n := testenv.Count(t, db.DB, "SELECT count(*) FROM messaging_outbox_schema WHERE version_id > 0"); n != int64(len(versions)) {
		t.Errorf("%d outbox migrations recorded, want each of the %d once", n, len(versions))
	}
	// The partial index that keeps the relay's claim cheap however many sent rows pile up.
	if n := testenv.Count(t, db.DB, `SELECT count(*) FROM pg_indexes WHERE tablename = 'outbox_messages'
		AND indexdef LIKE '%WHERE (processed_at IS NULL)%'`); n != 1 {
		t.Errorf("partial index on unprocessed outbox rows: found %d, want 1", n)
	}
	if n := testenv.Count(t, db.DB, `SELECT count(*) FROM pg_constraint WHERE conrelid = 'inbox_messages'::regclass
		AND contype = 'p' AND array_length(conkey, 1) = 2`); n != 1 {
		t.Errorf("inbox_messages needs a primary key on (message_id, consumer)")
	}
}
