package platform

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

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
			_, err := OpenBackground(context.Background(), slog.New(slog.DiscardHandler), "svc", rawURL, 1)
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

// A setting the server refuses at login, which pgx sends for every query parameter it does not
// read itself, fails OpenDB at once, naming DATABASE_URL and never the password: a URL that is
// refused so at every try would otherwise keep the service waiting, live and never ready. The
// refusals that may pass are still waited out: the database's CONNECT not granted yet (42501
// too), a role or a tablespace a setting names not created yet (22023 too), as CloudNativePG
// creates its managed roles and declarative tablespaces once the server is up.
func TestOpenDBFailsAtOnceOnASettingTheServerRefuses(t *testing.T) {
	t.Parallel()
	testenv.Connections(t, testenv.DefaultConnections+1) // OpenDB's, one at a time
	d := testenv.NewDatabase(t)
	testenv.Draw(t, 1)
	// A role that may log in, but neither set a superuser's settings nor connect to d's database.
	role := testenv.UniqueName("plain")
	if err := d.DB.Exec("CREATE ROLE " + role + " LOGIN").Error; err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.DB.Exec("DROP ROLE IF EXISTS " + role).Error })
	// with is d's URL with query added, and role for its user if not "".
	with := func(role, query string) string {
		u, err := url.Parse(d.URL)
		if err != nil {
			t.Fatal(err)
		}
		if role != "" {
			u.User = url.User(role)
		}
		if query != "" {
			u.RawQuery = strings.TrimPrefix(u.RawQuery+"&"+query, "&")
		}
		return u.String()
	}
	open := func(rawURL string, wait time.Duration) (time.Duration, error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		start := time.Now()
		db, err := OpenDB(ctx, slog.New(slog.DiscardHandler), "svc", rawURL, 1)
		if err == nil {
			CloseDB(db)
			t.Fatalf("OpenDB(%s) opened a pool", rawURL)
		}
		return time.Since(start), err
	}
	const wait = 20 * time.Second
	for _, tc := range []struct{ role, query, code string }{
		{"", "statement_timeout_ms=1000", "42704"}, // no such name
		{"", "Password=hunter2", "42704"},          // pgx reads password= alone
		{"", "pool_max_conns=10", "42704"},         // pgxpool's; refused at start too
		{"", "statement_timeout=5x", "22023"},
		{"", "application_name=x&lock_timeout=-1ms", "22023"},
		{"", "shared_buffers=1GB", "55P02"},
		{"", "options=-c%20statement_timeout_ms%3D1000", "42704"},
		{"", "my-ext.x=1", "42602"},
		{role, "log_statement=all", "42501"}, // a superuser's setting
	} {
		took, err := open(with(tc.role, tc.query), wait)
		if took > wait/2 || errors.Is(err, context.DeadlineExceeded) || !strings.HasPrefix(err.Error(), "DATABASE_URL: the server refuses a setting") ||
			!strings.Contains(err.Error(), tc.code) || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("OpenDB with %s: %v after %s; want at once an error that names DATABASE_URL and the refusal (%s), and no password", tc.query, err, took.Round(time.Millisecond), tc.code)
		}
	}
	if err := d.DB.Exec("REVOKE CONNECT ON DATABASE " + d.Name + " FROM PUBLIC").Error; err != nil {
		t.Fatal(err)
	}
	const short = 2500 * time.Millisecond
	for _, tc := range []struct{ role, query, code, why string }{
		{role, "", "42501", "without CONNECT on the database"},
		{"", "role=" + testenv.UniqueName("nosuchrole"), "22023", "with a role not created yet"},
		{"", "default_tablespace=" + testenv.UniqueName("nosuchspace"), "22023", "with a tablespace not created yet"},
	} {
		took, err := open(with(tc.role, tc.query), short)
		if took < short || !errors.Is(err, context.DeadlineExceeded) || !strings.HasPrefix(err.Error(), "DATABASE_URL: waiting for the database") ||
			!strings.Contains(err.Error(), tc.code) {
			t.Errorf("OpenDB %s (%s): %v after %s; want it to wait (%s) until its context ended", tc.why, tc.query, err, took.Round(time.Millisecond), tc.code)
		}
	}
}

// Of the refusals whose code may mean a passing failure too, only a setting's is taken for
// one that lasts: PgBouncer's 08P01 that names a startup parameter, not its other 08P01s;
// PostgreSQL's 42501 from its set_config routine, not a database's CONNECT withheld.
func TestRefusedSettingTellsASettingsRefusalFromAPassingOne(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  pgconn.PgError
		want bool
	}{
		{pgconn.PgError{Code: "08P01", Message: "unsupported startup parameter: enable_sort"}, true},
		{pgconn.PgError{Code: "08P01", Message: "pgbouncer cannot connect to server"}, false},
		{pgconn.PgError{Code: "42501", Message: "permission denied to set parameter \"log_statement\"", Routine: "set_config_option"}, true},
		{pgconn.PgError{Code: "42501", Message: "permission denied to set parameter \"log_statement\"", Routine: "set_config_with_handle"}, true},
		{pgconn.PgError{Code: "42501", Message: "permission denied for database \"orders\"", Routine: "CheckMyDatabase"}, false},
		{pgconn.PgError{Code: "57P03", Message: "the database system is starting up"}, false},
		// PostgreSQL 15's, for role= (or options=-c role=) and default_tablespace= naming what
		// a provisioner creates once the server is up, and for a value no later login takes.
		{pgconn.PgError{Code: "22023", Message: "role \"app_owner\" does not exist", Routine: "call_string_check_hook"}, false},
		{pgconn.PgError{Code: "22023", Message: "invalid value for parameter \"default_tablespace\": \"fast\"", Detail: "Tablespace \"fast\" does not exist.", Routine: "call_string_check_hook"}, false},
		{pgconn.PgError{Code: "22023", Message: "invalid value for parameter \"DateStyle\": \"x\"", Detail: "Unrecognized key word: \"x\".", Routine: "call_string_check_hook"}, true},
		{pgconn.PgError{Code: "22023", Message: "invalid value for parameter \"statement_timeout\": \"5x\"", Routine: "parse_and_validate_value"}, true},
		{pgconn.PgError{Code: "3D000", Message: "database \"orders\" does not exist"}, false},
	} {
		err := fmt.Errorf("failed to connect: %w", errors.Join(errors.New("dial tcp: connection refused"), &tc.err))
		if got := refusedSetting(err); got != tc.want {
			t.Errorf("refusedSetting(%s %s, routine %q) = %v, want %v", tc.err.Code, tc.err.Message, tc.err.Routine, got, tc.want)
		}
	}
}

// The connection strings the pools are opened with keep each parameter's value as pgx reads it,
// as libpq does, + for a plus: options=-c%20search_path%3Dapp must reach the server as
// -c search_path=app, not -c+search_path=app, which it refuses, and a password p+q must stay
// p+q. Their own settings are set in place of those the URL has.
func TestPoolURLsKeepTheirParametersValues(t *testing.T) {
	t.Parallel()
	const rawURL = "postgres://app@db/x?options=-c%20search_path%3Dapp&search_path=a%2Bb&password=p+q&jit=on&application_name="
	for name, tc := range map[string]struct {
		rewrite  func(string) (string, error)
		key, set string
	}{
		"WithApplicationName": {func(raw string) (string, error) { return WithApplicationName(raw, "svc") }, "application_name", "svc"},
		"IndexPlansURL":       {IndexPlansURL, "jit", "off"},
	} {
		dsn, err := tc.rewrite(rawURL)
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := pgx.ParseConfig(dsn)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if got := cfg.RuntimeParams["options"]; got != "-c search_path=app" {
			t.Errorf("%s gives the server options %q, want %q", name, got, "-c search_path=app")
		}
		if got := cfg.RuntimeParams["search_path"]; got != "a+b" {
			t.Errorf("%s gives the server search_path %q, want %q", name, got, "a+b")
		}
		if got := cfg.RuntimeParams[tc.key]; got != tc.set {
			t.Errorf("%s gives the server %s %q, want %q", name, tc.key, got, tc.set)
		}
		if cfg.Password != "p+q" {
			t.Errorf("%s gives the server the password %q, want %q", name, cfg.Password, "p+q")
		}
	}
}

// setParam writes its value as pgx decodes a query, percent-escapes only (a + is a plus, a
// space is %20), and reads a repeated key as pgx does, by its last occurrence.
func TestSetParamWritesWhatPgxReads(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		query, value string
		replace      bool
		want         string
	}{
		{"", "a b+c&d=e%", false, "a b+c&d=e%"},
		{"application_name=x", "a b+c", true, "a b+c"},
		{"application_name=mine&application_name=", "svc", false, "svc"},
		{"application_name=&application_name=mine", "svc", false, "mine"},
		{"application_name=mine&jit=on&application_name=yours", "svc", false, "yours"},
		{"application_name=mine&application_name=yours", "svc", true, "svc"},
	} {
		u, err := url.Parse("postgres://app@db/x?" + tc.query)
		if err != nil {
			t.Fatal(err)
		}
		setParam(u, "application_name", tc.value, tc.replace)
		cfg, err := pgx.ParseConfig(u.String())
		if err != nil {
			t.Fatalf("setParam(%q, %q, replace %v) gives %s: %v", tc.query, tc.value, tc.replace, u, err)
		}
		if got := cfg.RuntimeParams["application_name"]; got != tc.want {
			t.Errorf("setParam(%q, %q, replace %v) gives %s, whose application_name pgx reads as %q; want %q", tc.query, tc.value, tc.replace, u, got, tc.want)
		}
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
