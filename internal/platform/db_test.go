package platform

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// A read through the services' GORM handle names its columns: pgx caches each statement it
// prepares, and a cached SELECT * fails once its table gains a column ("cached plan must not
// change result type"), as a rolling upgrade's migration does to the replicas still serving.
func TestReadsSurviveAColumnAddedUnderThem(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1) // and the pool under test
	d := testenv.NewDatabase(t)
	testenv.Draw(t, 1)
	ctx := context.Background()
	db, err := OpenDB(ctx, slog.New(slog.DiscardHandler), "test", d.URL, 1)
	if err != nil {
		t.Fatal(err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sqlDB.Close() })
	if err := d.DB.Exec("CREATE TABLE things (id int PRIMARY KEY, name text); INSERT INTO things VALUES (1, 'one')").Error; err != nil {
		t.Fatal(err)
	}
	type thing struct {
		ID   int
		Name string
	}
	read := func(when string) {
		var got thing
		if err := db.Table("things").Take(&got, "id = ?", 1).Error; err != nil || got.Name != "one" {
			t.Fatalf("%s: read %+v, %v; want thing one", when, got, err)
		}
	}
	read("before the migration") // prepared and cached on the pool's one connection
	if err := d.DB.Exec("ALTER TABLE things ADD COLUMN added_later int").Error; err != nil {
		t.Fatal(err)
	}
	read("after a column was added")
}

// A pool that cannot be opened says so naming DATABASE_URL, and never with a password in it:
// the start-up check leaves the CA file to the pool (it empties sslrootcert), and pgx quotes
// the URL it cannot use, masking only a password= in lower case. No server is needed: the CA
// file is read first.
func TestPoolOpenErrorsNameDATABASE_URLAndNoPassword(t *testing.T) {
	t.Parallel()
	const tls = "sslmode=verify-full&sslrootcert=/nowhere/ca.crt"
	open := map[string]func(rawURL string) error{
		"OpenDB": func(rawURL string) error {
			_, err := OpenDB(context.Background(), slog.New(slog.DiscardHandler), "svc", rawURL, 1)
			return err
		},
		"OpenBackground": func(rawURL string) error {
			_, err := OpenBackground(context.Background(), "svc", rawURL, 1)
			return err
		},
	}
	for _, rawURL := range []string{
		"postgres://app@db.invalid/x?Password=hunter2&" + tls,
		"postgres://app:hunter2@db.invalid/x?" + tls,
		"postgres://app@db.invalid/x?SSLPASSWORD=hun%74er2&" + tls,
		"postgres://app:hun%74er2@db.invalid/x?PASSWORD=hunter2x&" + tls,
	} {
		for name, open := range open {
			err := open(rawURL)
			switch {
			case err == nil:
				t.Errorf("%s(%s) opened a pool, want the CA file's error", name, rawURL)
			case strings.Contains(err.Error(), "hun"):
				t.Errorf("%s(%s): %v, which holds the password", name, rawURL, err)
			case !strings.HasPrefix(err.Error(), "DATABASE_URL: ") || !strings.Contains(err.Error(), "/nowhere/ca.crt"):
				t.Errorf("%s(%s): %v, want an error that names DATABASE_URL and the missing CA file", name, rawURL, err)
			}
		}
	}
}

// Stopped while the server refuses the connection (here: no such database, SQLSTATE 3D000),
// OpenDB says why it was still waiting, naming DATABASE_URL, and that it was stopped.
func TestOpenDBStoppedWhileRefusedSaysWhy(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(testenv.DatabaseURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + testenv.UniqueName("nonexistent")
	testenv.Draw(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 2500*time.Millisecond)
	defer cancel()
	db, err := OpenDB(ctx, slog.New(slog.DiscardHandler), "svc", u.String(), 1)
	if err == nil {
		CloseDB(db)
		t.Fatalf("OpenDB(%s) opened a pool", u)
	}
	if !strings.HasPrefix(err.Error(), "DATABASE_URL: ") || !strings.Contains(err.Error(), "3D000") || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("OpenDB(%s): %v; want an error that names DATABASE_URL and the refusal (3D000), and wraps the deadline", u, err)
	}
}

// With nothing listening at the database's address, OpenDB waits, saying so at once (then every
// waitLogEvery), until
// its context ends, however long that is: the services start in any order. One that gave up
// after a minute exited 1 every minute, and Kubernetes' crash-loop back-off (up to 5 min) then
// held its start back long after the database came; it waits live and not ready instead (see
// startingServer). No server is needed: the port is closed.
func TestOpenDBWaitsForTheDatabaseUntilItsContextEnds(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "postgres://postgres@" + ln.Addr().String() + "/none?sslmode=disable"
	_ = ln.Close()
	log, logs := testenv.NewLogger(t)
	const wait = 2500 * time.Millisecond
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	db, err := OpenDB(ctx, log, "svc", closed, 1)
	took := time.Since(start)
	if err == nil {
		CloseDB(db)
		t.Fatalf("OpenDB(%s) opened a pool", closed)
	}
	if took < wait || !errors.Is(err, context.DeadlineExceeded) || !strings.HasPrefix(err.Error(), "DATABASE_URL: waiting for the database") {
		t.Fatalf("OpenDB returned after %s: %v; want it to wait until its context ended (%s), then an error that names DATABASE_URL and wraps the deadline", took, err, wait)
	}
	if n := len(logs.Lines("waiting for the database", "connect")); n != 1 {
		t.Fatalf("%d lines of the wait in %s, want one, with the error (the same failure is logged every %s):\n%s", n, wait, waitLogEvery, logs)
	}
}

// refusingDB is a pool whose statements fail, as behind a connection pooler that refuses the
// startup parameters IndexPlansURL gives: with err at once (Query), or after the statement ran
// (its rows' Err). Only Query is implemented.
type refusingDB struct {
	messaging.DB
	query, rows error
}

func (d refusingDB) Query(context.Context, string, ...any) (messaging.Rows, error) {
	if d.query != nil {
		return nil, d.query
	}
	return failedRows{d.rows}, nil
}

// failedRows are rows that end with err before the first.
type failedRows struct{ err error }

func (failedRows) Next() bool        { return false }
func (failedRows) Scan(...any) error { return nil }
func (r failedRows) Err() error      { return r.err }
func (failedRows) Close()            {}

// A pool whose plan settings cannot even be read (a pooler that refuses a connection's startup
// parameters fails its statements) stops the start with an error that names DATABASE_URL, as
// one whose sessions lack the settings does.
func TestUnreadablePlanSettingsNameDATABASE_URL(t *testing.T) {
	t.Parallel()
	refused := errors.New("unsupported startup parameter: enable_sort")
	for name, db := range map[string]refusingDB{"the query": {query: refused}, "its rows": {rows: refused}} {
		err := checkIndexPlans(context.Background(), db, "background pool")
		if err == nil || !strings.HasPrefix(err.Error(), "DATABASE_URL: ") || !errors.Is(err, refused) {
			t.Errorf("%s failing: %v; want an error that names DATABASE_URL and wraps the refusal", name, err)
		}
	}
}
