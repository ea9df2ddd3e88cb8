package platform

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

func TestEnvReportsEveryProblemByName(t *testing.T) {
	t.Parallel()
	env := EnvFrom(map[string]string{
		"AMQP_URL":             "http://user:hunter2@host/",
		"LOG_LEVEL":            "loud",
		"DB_MAX_CONNS":         "1",
		"N":                    "7",
		"D":                    "90s",
		"B":                    "maybe",
		"HTTP_ADDR":            "8080",
		"CONSUMER_CONCURRENCY": "8",
		"CONSUMER_PREFETCH":    "2",
		"HTTP_LATENCY_TARGET":  "-5ms",
	})
	c := ReadCommon(env, ":8080")
	ReadConsumerSettings(env)
	if n := env.Int("N", 1, 1, 10); n != 7 {
		t.Errorf("N = %d, want 7", n)
	}
	if d := env.Duration("D", time.Second, time.Second, time.Hour); d != 90*time.Second {
		t.Errorf("D = %s, want 90s", d)
	}
	env.Bool("B", false)
	err := env.Err()
	if err == nil {
		t.Fatal("want errors")
	}
	msg := err.Error()
	for _, want := range []string{"DATABASE_URL: required", "AMQP_URL: scheme must be one of amqp, amqps", "LOG_LEVEL: must be one of", "DB_MAX_CONNS: must be an integer from 4 to 1000", "HTTP_ADDR: must be host:port", "CONSUMER_PREFETCH: must be at least CONSUMER_BATCH_SIZE", "B: must be true or false", "HTTP_LATENCY_TARGET: must be 0 (off) or a duration such as 1s or 5m, from 1ms to 1m0s"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q lacks %q", msg, want)
		}
	}
	if strings.Contains(msg, "hunter2") || strings.Contains(msg, "\n") {
		t.Errorf("error must be one line without secrets: %q", msg)
	}
	if c.LogFormat != "text" {
		t.Errorf("defaults not applied: %+v", c)
	}
}

func TestRedactHidesPasswords(t *testing.T) {
	t.Parallel()
	for _, u := range []string{"amqp://app:hunter2@rabbitmq:5672/", "postgres://app@db/x?password=hunter2&sslmode=disable", "postgres://db/x?sslpassword=hunter2",
		"postgres://db/x?Password=hunter2", "postgres://db/x?SSLPASSWORD=hunter2", "postgres://db/x?password=a&password=hunter2"} {
		if got := Redact(u); strings.Contains(got, "hunter2") {
			t.Errorf("Redact(%q) = %q", u, got)
		}
	}
}

func TestAMQPURLTakesOneURLPerNode(t *testing.T) {
	t.Parallel()
	list := "amqp://app:hunter2@rabbit-1:5672/shop, amqp://app:hunter2@rabbit-2:5672/shop,amqps://app:hunter2@rabbit-3/shop"
	env := EnvFrom(map[string]string{"AMQP_URL": list})
	if got := env.URLList("AMQP_URL", "amqp", "amqps"); got != list || env.Err() != nil {
		t.Fatalf("URLList = %q, %v; want the list", got, env.Err())
	}
	// The default vhost, however it is written, as the AMQP client reads it.
	for _, same := range []string{"amqp://a@n1,amqp://a@n2/", "amqp://a@n1/%2F,amqp://a@n2", "amqp://a@n1/,amqp://a@n2/%2f"} {
		env := EnvFrom(map[string]string{"AMQP_URL": same})
		if env.URLList("AMQP_URL", "amqp", "amqps"); env.Err() != nil {
			t.Errorf("AMQP_URL=%q: %v, want one vhost, the default", same, env.Err())
		}
	}
	if got := RedactList(list); strings.Contains(got, "hunter2") || strings.Count(got, "rabbit-") != 3 {
		t.Errorf("RedactList = %q, want three URLs without their password", got)
	}
	for value, want := range map[string]string{
		"amqp://a@n1/shop,amqp://a@n2/other":       `AMQP_URL: every entry must name the same vhost: "shop" and "other" differ`,
		"amqp://a@n1,amqp://a@n2/shop":             `AMQP_URL: every entry must name the same vhost: "/" and "shop" differ`,
		"amqp://a@n1/shop,http://a@n2/shop":        "AMQP_URL: entry 2 of 2: scheme must be one of amqp, amqps",
		"amqp://a@n1/shop,not a url":               "AMQP_URL: entry 2 of 2: not a valid URL",
		" , ":                                      "AMQP_URL: not a valid URL",
		"amqp://app:hunter2@n1/shop,ftp://n2/shop": "AMQP_URL: entry 2 of 2: scheme must be one of",
	} {
		env := EnvFrom(map[string]string{"AMQP_URL": value})
		env.URLList("AMQP_URL", "amqp", "amqps")
		if err := env.Err(); err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("AMQP_URL=%q: %v, want %q and no password", value, err, want)
		}
	}
}

// A PostgreSQL URL may give its host, or its Unix socket's directory, in host= instead of
// after //, as libpq and pgx read it; a URL that names no host at all is refused, saying so.
func TestDatabaseURLMayGiveItsHostInTheQuery(t *testing.T) {
	t.Parallel()
	const noHost = "config: DATABASE_URL: names no host: give one after //, or for PostgreSQL's Unix socket its directory in host= (postgres:///database?host=/var/run/postgresql)"
	for v, want := range map[string]string{
		"postgres:///orders?host=/var/run/postgresql":                "",
		"postgresql://app:hunter2@/orders?host=/tmp&sslmode=disable": "",
		"postgres://app@db:5432/orders":                              "",
		"postgres://app@h1:5432,h2:5432/orders":                      "",
		"postgres:///orders":                                         noHost,
		"postgres:///orders?host=":                                   noHost,
		"postgres:/orders?host=/var/run/postgresql":                  noHost, // pgx reads only postgres:// as a URL
		"postgres:orders?host=/var/run/postgresql":                   noHost,
		"http://db/orders":                                           "config: DATABASE_URL: scheme must be one of postgres, postgresql",
		"db/orders":                                                  "config: DATABASE_URL: not a valid URL",
	} {
		env := EnvFrom(map[string]string{"DATABASE_URL": v})
		got := env.URL("DATABASE_URL", "postgres", "postgresql")
		switch err := env.Err(); {
		case want == "" && (err != nil || got != v):
			t.Errorf("DATABASE_URL=%q: %q, %v; want it taken", v, got, err)
		case want != "" && (err == nil || err.Error() != want):
			t.Errorf("DATABASE_URL=%q: %v; want %q", v, err, want)
		}
	}

	// What the services make of such a URL still names the socket.
	socket := "postgres://app:hunter2@/orders?host=/var/run/postgresql"
	dsn, err := WithApplicationName(socket, "svc")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil || cfg.Host != "/var/run/postgresql" || cfg.Database != "orders" || cfg.RuntimeParams["application_name"] != "svc" {
		t.Fatalf("pgx reads %q as %+v, %v; want the socket, the database and the application name", dsn, cfg, err)
	}
	if got := Redact(socket); strings.Contains(got, "hunter2") || !strings.Contains(got, "host=%2Fvar%2Frun%2Fpostgresql") {
		t.Errorf("Redact(%q) = %q", socket, got)
	}

	// And a service connects through it (over TCP here: the test server's socket may be elsewhere).
	testenv.Connections(t, testenv.DefaultConnections+ReadinessConns)
	d := testenv.NewDatabase(t)
	env := EnvFrom(map[string]string{"DATABASE_URL": testenv.HostInQuery(t, d.URL)})
	inQuery := env.URL("DATABASE_URL", "postgres", "postgresql")
	if err := env.Err(); err != nil {
		t.Fatal(err)
	}
	testenv.Draw(t, ReadinessConns)
	db, err := OpenReadinessDB("svc", inQuery)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := DatabaseReady(db)(context.Background()); err != nil {
		t.Fatalf("readiness through %s: %v", Redact(inQuery), err)
	}
}

// An address's port is a number from 0 to 65535, checked at start like every other setting.
func TestAddrChecksItsPort(t *testing.T) {
	t.Parallel()
	checkAddrs(t, "PPROF_ADDR", (*Env).Addr, map[string]string{
		":8080":         "",
		"0.0.0.0:0":     "",
		"[::1]:65535":   "",
		"mail:25":       "",
		":notaport":     "PPROF_ADDR: port must be a number from 0 to 65535",
		"0.0.0.0:99999": "PPROF_ADDR: port must be a number from 0 to 65535",
		":-1":           "PPROF_ADDR: port must be a number from 0 to 65535",
		":http":         "PPROF_ADDR: port must be a number from 0 to 65535",
		"8080":          "PPROF_ADDR: must be host:port or :port",
		"host:":         "PPROF_ADDR: must be host:port or :port",
	})
}

// An address to dial needs its host and a port a dial can reach: SMTP_ADDR=:25 or mail:0 was
// taken at start and failed at every e-mail.
func TestDialAddrNeedsAHostAndAPort(t *testing.T) {
	t.Parallel()
	checkAddrs(t, "SMTP_ADDR", (*Env).DialAddr, map[string]string{
		"mail:25":     "",
		"[::1]:65535": "",
		"127.0.0.1:1": "",
		":25":         "SMTP_ADDR: must be host:port",
		"mail":        "SMTP_ADDR: must be host:port",
		"mail:":       "SMTP_ADDR: must be host:port",
		"mail:0":      "SMTP_ADDR: port must be a number from 1 to 65535",
		"mail:65536":  "SMTP_ADDR: port must be a number from 1 to 65535",
		"mail:smtp":   "SMTP_ADDR: port must be a number from 1 to 65535",
	})
}

// checkAddrs reads each value of name with read: one whose want is "" must be taken, any other
// refused with want in the error, leaving the default "".
func checkAddrs(t *testing.T, name string, read func(*Env, string, string) string, cases map[string]string) {
	t.Helper()
	for v, want := range cases {
		env := EnvFrom(map[string]string{name: v})
		got := read(env, name, "")
		switch err := env.Err(); {
		case want == "" && (err != nil || got != v):
			t.Errorf("%s=%q: %q, %v; want it taken", name, v, got, err)
		case want != "" && (err == nil || !strings.Contains(err.Error(), want) || got != ""):
			t.Errorf("%s=%q: %q, %v; want the default and %q", name, v, got, err, want)
		}
	}
}

// A port inside a URL is checked at start too: url.Parse takes any digits, and a dial to port
// 99999 or 0 failed at each reconnection with an error naming no variable.
func TestURLPortsAreInRange(t *testing.T) {
	t.Parallel()
	wantReadCommon(t, []envCase{
		{"DATABASE_URL", "postgres://db:5432/x", ""},
		{"DATABASE_URL", "postgres://db/x", ""},
		{"DATABASE_URL", "postgres://h1:5432,h2:65535/x", ""},
		{"DATABASE_URL", "postgres://[::1]:5432/x", ""},
		{"DATABASE_URL", "postgres://[::1]/x", ""},
		{"DATABASE_URL", "postgres://db:99999/x", "DATABASE_URL: a port in the URL must be a number from 1 to 65535"},
		{"DATABASE_URL", "postgres://h1:70000,h2:5432/x", "DATABASE_URL: a port in the URL must be a number from 1 to 65535"},
		{"DATABASE_URL", "postgres://db:0/x", "DATABASE_URL: a port in the URL must be a number from 1 to 65535"},
		{"DATABASE_URL", "postgres://db:/x", ""}, // an empty port is the default, to pgx too
		{"DATABASE_URL", "postgres:///x?host=/run/postgresql&port=5433", ""},
		{"DATABASE_URL", "postgres://h1,h2/x?port=5432,", ""},
		{"DATABASE_URL", "postgres:///x?host=/run/postgresql&port=99999", "DATABASE_URL: a port in the URL must be a number from 1 to 65535"},
		{"DATABASE_URL", "postgres://h1,h2/x?port=5432,0", "DATABASE_URL: a port in the URL must be a number from 1 to 65535"},
		{"DATABASE_URL", "postgres://db/x?port=%2B5432", "DATABASE_URL: a port in the URL must be a number from 1 to 65535"},
		{"AMQP_URL", "amqp://guest:guest@mq:5672/", ""},
		{"AMQP_URL", "amqp://mq:65536/", "AMQP_URL: a port in the URL must be a number from 1 to 65535"},
		{"AMQP_URL", "amqp://mq:/", ""},
		{"AMQP_URL", "amqp://a:5672/,amqp://b:0/", "AMQP_URL: entry 2 of 2: a port in the URL must be a number from 1 to 65535"},
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318", ""},
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:431800", "OTEL_EXPORTER_OTLP_ENDPOINT: a port in the URL must be a number from 1 to 65535"},
		{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://jaeger:4318/v1/traces", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: is not read: set OTEL_EXPORTER_OTLP_ENDPOINT"},
	})
}

// A URL that url.Parse takes but its client does not (a heartbeat in Go's duration syntax, an
// sslmode misspelt) is refused at start, naming its variable and the client's reason without
// the password: the broker's would otherwise fail at every reconnection, in a loop that names
// no variable, and the database's at its first connection. The files an amqps URL names, which
// the AMQP client reads at every dial, are read too: a CA file missing or without a
// certificate, a client certificate without its key or that does not load with it; an amqp
// URL that names them, which the client ignores, connecting in clear. The files
// a PostgreSQL URL names are read later, by the pool. A refusal of DATABASE_URL names the PG*
// variables set in the environment, which pgx reads beside the URL.
func TestURLsTheirClientsRefuseAreRefusedAtStart(t *testing.T) {
	// The PG* variables of the shell that runs the test (PGHOST, PGUSER for psql) would be
	// named in the refusals: none here, but for those the test sets.
	for _, name := range pgEnvVariables {
		t.Setenv(name, "")
		_ = os.Unsetenv(name)
	}
	dir := t.TempDir()
	cert, key := writeCertificate(t, dir)
	missing := filepath.Join(dir, "missing.pem")
	const mq = "amqps://app:hunter2@mq/shop?"
	wantReadCommon(t, []envCase{
		{"AMQP_URL", mq + "cacertfile=" + cert, ""},
		{"AMQP_URL", mq + "cacertfile=" + cert + "&certfile=" + cert + "&keyfile=" + key + "&server_name_indication=mq.example", ""},
		{"AMQP_URL", mq + "certfile=" + cert + "&keyfile=" + key, ""},
		{"AMQP_URL", mq + "cacertfile=" + missing, "AMQP_URL: cacertfile: open " + missing + ": no such file or directory"},
		{"AMQP_URL", mq + "cacertfile=" + key, "AMQP_URL: cacertfile: " + key + " holds no PEM certificate"},
		{"AMQP_URL", mq + "certfile=" + cert, "AMQP_URL: certfile and keyfile must be given together"},
		{"AMQP_URL", mq + "keyfile=" + key, "AMQP_URL: certfile and keyfile must be given together"},
		{"AMQP_URL", mq + "certfile=" + cert + "&keyfile=" + missing, "AMQP_URL: certfile, keyfile: open " + missing},
		{"AMQP_URL", mq + "certfile=" + key + "&keyfile=" + cert, "AMQP_URL: certfile, keyfile: tls: "},
		{"AMQP_URL", "amqps://a/shop?cacertfile=" + cert + "," + mq + "cacertfile=" + missing, "AMQP_URL: entry 2 of 2: cacertfile: open " + missing},
		{"AMQP_URL", "amqp://app:hunter2@mq/shop?cacertfile=" + cert, "AMQP_URL: cacertfile, certfile, keyfile and server_name_indication are for amqps only: with amqp the client connects without TLS"},
		{"AMQP_URL", "amqp://mq/shop?server_name_indication=mq.example", "AMQP_URL: cacertfile, certfile, keyfile and server_name_indication are for amqps only"},
		{"AMQP_URL", "amqp://app:hunter2@mq:5672/?heartbeat=10s", "AMQP_URL: the client refuses it: heartbeat is not an uint16"},
		{"AMQP_URL", "amqp://mq/?connection_timeout=5s", "AMQP_URL: the client refuses it: connection_timeout is not an integer"},
		{"AMQP_URL", "amqp://a/shop,amqp://app:hunter2@b/shop?channel_max=70000", "AMQP_URL: entry 2 of 2: the client refuses it: channel_max is not an uint16"},
		{"AMQP_URL", "amqp://mq/?heartbeat=10", ""},
		{"DATABASE_URL", "postgres://app:hunter2@db/x?sslmode=requir", "DATABASE_URL: the client refuses it: failed to configure TLS (sslmode is invalid)"},
		{"DATABASE_URL", "postgres://app:hunter2@db/x?connect_timeout=5s", "DATABASE_URL: the client refuses it: invalid connect_timeout"},
		{"DATABASE_URL", "postgres://app:hunter2@db/x?sslmode=verify-full&sslrootcert=/nowhere/ca.crt", ""},
		{"AMQP_URL", "amqp://app:p@mq/?heartbeat=10s", "AMQP_URL: the client refuses it: heartbeat is not an uint16"},
	})
	// The files are left for the pool to read, whether the URL or the environment names them,
	// and a certificate named in one with its key in the other is not taken for half a pair.
	t.Setenv("PGSSLROOTCERT", "/nowhere/else.crt")
	t.Setenv("PGSSLKEY", "/nowhere/client.key")
	wantReadCommon(t, []envCase{
		{"DATABASE_URL", "postgres://db/x?sslmode=verify-full&sslrootcert=/nowhere/ca.crt", ""},
		{"DATABASE_URL", "postgres://db/x?sslmode=verify-full", ""},
		{"DATABASE_URL", "postgres://db/x?sslmode=verify-full&sslcert=/nowhere/client.crt", ""},
		{"DATABASE_URL", "postgres://db/x?sslmode=requir", "DATABASE_URL: the client refuses it: failed to configure TLS (sslmode is invalid)"},
	})
	// pgx reads PGSSLMODE and the like beside the URL: a refusal they may cause names them.
	t.Setenv("PGSSLMODE", "verify-ful")
	t.Setenv("PGPORT", "5433")
	wantReadCommon(t, []envCase{
		{"DATABASE_URL", "postgres://app:hunter2@db/x", "DATABASE_URL: the client refuses it, with PGPORT, PGSSLMODE set in the environment, which it reads too: failed to configure TLS (sslmode is invalid)"},
		{"DATABASE_URL", "postgres://db/x?sslmode=disable", ""},
	})
}

// Parameters named as pgxpool's are in DATABASE_URL, in any case, are refused at start: only the
// background pool is pgxpool's, and it sets its size itself; the other pools pass them to
// PostgreSQL as settings, as pgxpool does one not in its own case, which it refuses at every
// login. The reason says so, not that Pool_Health_Check_Period is pgxpool's: it is not.
func TestPgxpoolParametersAreRefusedAtStart(t *testing.T) {
	t.Parallel()
	const why = `: the service's pools take no pool_ parameter, as pgxpool's are named (DB_MAX_CONNS sizes them), and pgx would pass it to PostgreSQL as a setting`
	wantReadCommon(t, []envCase{
		{"DATABASE_URL", "postgres://app:hunter2@db/x?pool_max_conns=10", `DATABASE_URL: "pool_max_conns"` + why},
		{"DATABASE_URL", "postgres://app@db/x?sslmode=disable&Pool_Health_Check_Period=1m&Password=hunter2", `DATABASE_URL: "Pool_Health_Check_Period"` + why},
		{"DATABASE_URL", "postgres://app@db/x?application_name=pool_a", ""},
	})
}

// envCase is a variable's value, and what ReadCommon must say of it: "" to take it, else a
// part of its error.
type envCase struct{ name, value, want string }

// wantReadCommon reads each case beside a valid environment; no error may quote a password
// (the cases' is hunter2).
func wantReadCommon(t *testing.T, cases []envCase) {
	t.Helper()
	for _, tc := range cases {
		switch err := readCommonWith(tc.name, tc.value); {
		case tc.want == "" && err != nil:
			t.Errorf("%s=%s: %v, want it taken", tc.name, tc.value, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "hunter2")):
			t.Errorf("%s=%s: %v, want %q and no password", tc.name, tc.value, err, tc.want)
		}
	}
}

// readCommonWith reads the common configuration with name set to value, beside a valid
// DATABASE_URL and AMQP_URL, and returns its error.
func readCommonWith(name, value string) error {
	vars := map[string]string{"DATABASE_URL": "postgres://db/x", "AMQP_URL": "amqp://mq/"}
	vars[name] = value
	env := EnvFrom(vars)
	ReadCommon(env, ":8080")
	return env.Err()
}

// HTTP_LATENCY_TARGET is 0, off, or a p99 an HTTP API can hold: a nanosecond target would
// halve admission's limit at every window.
func TestLatencyTargetIsOffOrAtLeastAMillisecond(t *testing.T) {
	t.Parallel()
	read := func(v string) (time.Duration, error) {
		env := EnvFrom(map[string]string{"DATABASE_URL": "postgres://db/x", "AMQP_URL": "amqp://mq/", "HTTP_LATENCY_TARGET": v})
		return ReadCommon(env, ":8080").LatencyTarget, env.Err()
	}
	for v, want := range map[string]time.Duration{"0": 0, "0s": 0, "1ms": time.Millisecond, "250ms": 250 * time.Millisecond, "1m": time.Minute} {
		if got, err := read(v); got != want || err != nil {
			t.Errorf("HTTP_LATENCY_TARGET=%s: %s, %v; want %s", v, got, err, want)
		}
	}
	for _, v := range []string{"1ns", "999us", "-1ms", "61s", "fast"} {
		if _, err := read(v); err == nil || err.Error() != "config: HTTP_LATENCY_TARGET: must be 0 (off) or a duration such as 1s or 5m, from 1ms to 1m0s" {
			t.Errorf("HTTP_LATENCY_TARGET=%s: %v, want it refused", v, err)
		}
	}
}

// HTTP_MAX_IN_FLIGHT is 1 to 100000, as the docs say; unset, it is 0, which stands for the
// requests' pool size and which the variable itself refuses.
func TestMaxInFlightIsFromOneToAHundredThousand(t *testing.T) {
	t.Parallel()
	read := func(v string) (int, error) {
		vars := map[string]string{"DATABASE_URL": "postgres://db/x", "AMQP_URL": "amqp://mq/"}
		if v != "unset" {
			vars["HTTP_MAX_IN_FLIGHT"] = v
		}
		env := EnvFrom(vars)
		return ReadCommon(env, ":8080").MaxInFlight, env.Err()
	}
	for v, want := range map[string]int{"unset": 0, "1": 1, "64": 64, "100000": 100_000} {
		if got, err := read(v); got != want || err != nil {
			t.Errorf("HTTP_MAX_IN_FLIGHT=%s: %d, %v; want %d", v, got, err, want)
		}
	}
	for _, v := range []string{"0", "100001", "-1", "abc", "1e3", "2.5"} {
		if got, err := read(v); got != 0 || err == nil || err.Error() != "config: HTTP_MAX_IN_FLIGHT: must be an integer from 1 to 100000" {
			t.Errorf("HTTP_MAX_IN_FLIGHT=%s: %d, %v; want it refused by name", v, got, err)
		}
	}
}

// DB_MAX_CONNS is checked against everything the parts hold together, and the error says what
// each part needs.
func TestPoolsAreCheckedTogether(t *testing.T) {
	t.Parallel()
	env := EnvFrom(map[string]string{"DATABASE_URL": "postgres://db/x", "AMQP_URL": "amqp://mq/", "DB_MAX_CONNS": "12",
		"CONSUMER_CONCURRENCY": "6", "OUTBOX_LANES": "2"})
	c := ReadCommon(env, ":8080")
	relaying, consuming := ReadRelaySettings(env), ReadConsumerSettings(env)
	p := PoolsOf(&relaying, &consuming, 0)
	p.Check(env, c)
	err := env.Err()
	if err == nil || !strings.Contains(err.Error(), "DB_MAX_CONNS: 12 is too few: the readiness check 1, the relay (OUTBOX_LANES + 2) 4, the cleanups 2, the consumer (CONSUMER_CONCURRENCY + 1) 7 and requests at least 2 need 16") {
		t.Fatalf("error %v, want the sum of every part named", err)
	}
	if got := p.Requests(Common{DBMaxConns: 20}); got != 20-1-4-2-7 {
		t.Fatalf("requests get %d of 20, want what the parts leave", got)
	}
	// The notification service: a consumer and a sender, whose backlog gauges read over a
	// background connection of their own, beside the inbox's cleanup.
	p = PoolsOf(nil, &consuming, 1)
	if p.Background != 2 || p.Work != 7 || p.Sender != 1 {
		t.Fatalf("a consumer and a sender get %d background, %d work and %d sender connections, want 2 (the cleanup, the sender's gauges), 7 and 1", p.Background, p.Work, p.Sender)
	}
	if got := p.Requests(Common{DBMaxConns: 20}); got != 20-1-2-7-1 {
		t.Fatalf("requests get %d of 20 beside a sender, want what the parts leave", got)
	}
	p.Check(env, c)
	if err := env.Err(); err == nil || !strings.Contains(err.Error(), "the cleanups 1, the consumer (CONSUMER_CONCURRENCY + 1) 7, the sender 1, the sender's backlog gauges 1 and requests at least 2 need 13") {
		t.Fatalf("error %v, want the sender counted", err)
	}
	fine := EnvFrom(map[string]string{"DATABASE_URL": "postgres://db/x", "AMQP_URL": "amqp://mq/"})
	PoolsOf(&relaying, &consuming, 0).Check(fine, ReadCommon(fine, ":8080"))
	if err := fine.Err(); err != nil {
		t.Fatalf("the defaults do not fit the default DB_MAX_CONNS: %v", err)
	}
}

// The start line says what HTTP_MAX_IN_FLIGHT is in effect: its default is not the 0 that
// stands for it, which the variable itself refuses.
func TestStartLineSaysTheDefaultMaxInFlight(t *testing.T) {
	attr := func(c Common) any {
		a := c.LogAttrs()
		for i := 0; i+1 < len(a); i += 2 {
			if a[i] == "http_max_in_flight" {
				return a[i+1]
			}
		}
		return nil
	}
	if got := attr(Common{}); got != "the requests' pool size" {
		t.Errorf("default: http_max_in_flight=%v, want the requests' pool size", got)
	}
	if got := attr(Common{MaxInFlight: 7}); got != 7 {
		t.Errorf("HTTP_MAX_IN_FLIGHT=7: http_max_in_flight=%v, want 7", got)
	}
}

// A password with a / ? or # left unescaped ends the URL's authority early: the rest of it
// lands in the path, query or fragment, which Redact shows. Such a URL is refused, naming its
// variable and not the value.
func TestAPasswordLeftUnescapedIsRefused(t *testing.T) {
	t.Parallel()
	const secret = "hunter2"
	for _, tc := range []struct{ name, value, want string }{
		{"DATABASE_URL", "postgres://app:12/" + secret + "@db:5432/orders", "DATABASE_URL: has an @ after its host"},
		{"DATABASE_URL", "postgres://app:12?" + secret + "@db:5432/orders", "DATABASE_URL: has an @ after its host"},
		{"DATABASE_URL", "postgres://app:12#" + secret + "@db:5432/orders", "DATABASE_URL: has an @ after its host"},
		{"DATABASE_URL", "postgres://app:pa/" + secret + "@db:5432/orders", "DATABASE_URL: has an @ after its host"}, // unparseable as well
		{"AMQP_URL", "amqp://app:5/" + secret + "@mq:5672/", "AMQP_URL: has an @ after its host"},
		{"AMQP_URL", "amqp://app:5?" + secret + "@mq:5672/", "AMQP_URL: has an @ after its host"},
		{"AMQP_URL", "amqp://app:5#" + secret + "@mq:5672/", "AMQP_URL: has an @ after its host"},
		{"AMQP_URL", "amqp://app@mq1:5672/,amqp://app:5#" + secret + "@mq2:5672/", "AMQP_URL: entry 2 of 2: has an @ after its host"},
		// Masked in the start line too, and quoted by the exporter's errors, host and path.
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "https://app:12/" + secret + "@collector:4318", "OTEL_EXPORTER_OTLP_ENDPOINT: has an @ after its host"},
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "https://app:12?" + secret + "@collector:4318", "OTEL_EXPORTER_OTLP_ENDPOINT: has an @ after its host"},
	} {
		err := readCommonWith(tc.name, tc.value)
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "percent-encode") || strings.Contains(err.Error(), secret) {
			t.Errorf("%s=%s: %v, want %q, how to mend it, and no password", tc.name, tc.value, err, tc.want)
		}
	}
	// Escaped, the same passwords are taken, as is an @ escaped in the query.
	for name, value := range map[string]string{
		"DATABASE_URL":                "postgres://app:12%2F" + secret + "%3F%23@db:5432/orders?options=-c%20x%40y",
		"AMQP_URL":                    "amqp://app:5%2F" + secret + "%23@mq1:5672/,amqp://app:5%3F" + secret + "@mq2:5672/",
		"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/otlp%40team",
	} {
		if err := readCommonWith(name, value); err != nil {
			t.Errorf("%s with its password escaped: %v, want it taken", name, err)
		}
	}
}

// OTEL_EXPORTER_OTLP_ENDPOINT is refused with a user or a query: the exporter sends spans to the
// URL's host and path only, so the credentials of https://user:token@collector:4318 were never
// sent and every export failed, with nothing to say why. The error says where they go instead,
// and shows no password.
func TestOTLPEndpointRefusesWhatTheExporterWouldDrop(t *testing.T) {
	t.Parallel()
	const secret = "hunter2"
	for value, want := range map[string]string{
		"https://app:" + secret + "@collector:4318": "OTEL_EXPORTER_OTLP_HEADERS",
		"https://app@collector:4318":                "OTEL_EXPORTER_OTLP_HEADERS",
		"https://collector:4318/?token=" + secret:   "a query",
	} {
		err := readCommonWith("OTEL_EXPORTER_OTLP_ENDPOINT", value)
		if err == nil || !strings.Contains(err.Error(), "OTEL_EXPORTER_OTLP_ENDPOINT: ") || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), secret) {
			t.Errorf("OTEL_EXPORTER_OTLP_ENDPOINT=%s: %v; want it refused, naming the variable and %q, and no secret", value, err, want)
		}
	}
}

// OTEL_EXPORTER_OTLP_ENDPOINT is the receiver's base URL, to which the exporter adds /v1/traces
// itself: http://jaeger:4318/v1/traces was taken, and every export went to
// /v1/traces/v1/traces, refused 404. A path ending so is refused at start, naming the variable;
// a receiver behind a path of its own is taken.
func TestOTLPEndpointIsTheReceiversBaseURL(t *testing.T) {
	t.Parallel()
	const want = "OTEL_EXPORTER_OTLP_ENDPOINT: is the receiver's base URL"
	wantReadCommon(t, []envCase{
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318/v1/traces", want},
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318/v1/traces/", want},
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "https://gateway.example/otlp/v1/traces", want},
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318", ""},
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318/", ""},
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "https://gateway.example/otlp", ""},
	})
	if err := readCommonWith("OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318/v1/traces"); err == nil || !strings.Contains(err.Error(), "drop /v1/traces") {
		t.Errorf("OTEL_EXPORTER_OTLP_ENDPOINT=http://jaeger:4318/v1/traces: %v, want it to say to drop /v1/traces", err)
	}
}

// PPROF_ADDR on HTTP_ADDR's port, on the same host or either on every interface, was taken,
// and the service then stopped at start when the profiler could not listen, in a restart loop.
// It is refused at start, naming PPROF_ADDR; another port, or the same port on another host, is
// taken, and so is port 0 for both (each gets a free port of its own). localhost is 127.0.0.1,
// where Go listens for it (not ::1, a socket of its own).
func TestPprofAddrMustNotBeHTTPAddr(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		http, pprof string
		refused     bool
	}{
		{":8080", ":8080", true},
		{":8080", "127.0.0.1:8080", true},
		{"127.0.0.1:8080", ":8080", true},
		{"127.0.0.1:8080", "127.0.0.1:8080", true},
		{"0.0.0.0:8080", "127.0.0.1:8080", true},
		{"[::]:8080", "10.0.0.1:8080", true},
		{"localhost:8080", "127.0.0.1:8080", true},
		{"127.0.0.1:8080", "LocalHost:8080", true},
		{"localhost:8080", "[::1]:8080", false},
		{":8080", ":6060", false},
		{"127.0.0.1:8080", "10.0.0.1:8080", false},
		{"127.0.0.1:0", "127.0.0.1:0", false},
		{":8080", "", false},
	} {
		env := EnvFrom(map[string]string{"DATABASE_URL": "postgres://db/x", "AMQP_URL": "amqp://mq/", "HTTP_ADDR": c.http, "PPROF_ADDR": c.pprof})
		ReadCommon(env, ":8080")
		err := env.Err()
		switch {
		case c.refused && (err == nil || !strings.Contains(err.Error(), "PPROF_ADDR: ")):
			t.Errorf("HTTP_ADDR=%s PPROF_ADDR=%s: %v, want it refused, naming PPROF_ADDR", c.http, c.pprof, err)
		case !c.refused && err != nil:
			t.Errorf("HTTP_ADDR=%s PPROF_ADDR=%s: %v, want it taken", c.http, c.pprof, err)
		}
	}
}

// An HTTP_ADDR refused at start is reported alone: PPROF_ADDR is not checked against the
// default that stands in for it, which would add a clash the operator never configured.
func TestABadHTTPAddrIsNotAlsoAPprofClash(t *testing.T) {
	t.Parallel()
	env := EnvFrom(map[string]string{"DATABASE_URL": "postgres://db/x", "AMQP_URL": "amqp://mq/", "HTTP_ADDR": "8080", "PPROF_ADDR": ":8080"})
	ReadCommon(env, ":8080")
	if err := env.Err(); err == nil || !strings.Contains(err.Error(), "HTTP_ADDR: ") || strings.Contains(err.Error(), "PPROF_ADDR") {
		t.Fatalf("HTTP_ADDR=8080 PPROF_ADDR=:8080: %v, want HTTP_ADDR refused, and nothing about PPROF_ADDR", err)
	}
}

// A CONSUMER_BATCH_SIZE that does not parse is reported as such, and CONSUMER_PREFETCH is not
// judged against the default that stands in for it: a prefetch of 10 is no problem of its own.
func TestAPrefetchIsNotJudgedAgainstABatchSizeThatDoesNotParse(t *testing.T) {
	t.Parallel()
	for _, batch := range []string{"abc", "0", "1001"} {
		env := EnvFrom(map[string]string{"CONSUMER_BATCH_SIZE": batch, "CONSUMER_PREFETCH": "10"})
		ReadConsumerSettings(env)
		err := env.Err()
		if err == nil || !strings.Contains(err.Error(), "CONSUMER_BATCH_SIZE: must be an integer from 1 to 1000") {
			t.Errorf("CONSUMER_BATCH_SIZE=%s: %v, want it refused", batch, err)
		}
		if err != nil && strings.Contains(err.Error(), "CONSUMER_PREFETCH") {
			t.Errorf("CONSUMER_BATCH_SIZE=%s CONSUMER_PREFETCH=10: %v, want no problem of CONSUMER_PREFETCH's", batch, err)
		}
	}
	// One that parses is still checked against.
	env := EnvFrom(map[string]string{"CONSUMER_BATCH_SIZE": "20", "CONSUMER_PREFETCH": "10"})
	ReadConsumerSettings(env)
	if err := env.Err(); err == nil || !strings.Contains(err.Error(), "CONSUMER_PREFETCH: must be at least CONSUMER_BATCH_SIZE") {
		t.Errorf("CONSUMER_BATCH_SIZE=20 CONSUMER_PREFETCH=10: %v, want the prefetch refused", err)
	}
}
