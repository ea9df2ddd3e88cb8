package platform

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Env reads configuration from environment variables and collects every problem, each naming
// its variable, so a misconfigured process reports them all at once and stops.
type Env struct {
	lookup func(string) (string, bool)
	errs   []error
}

// NewEnv reads from the process environment.
func NewEnv() *Env { return &Env{lookup: os.LookupEnv} }

// EnvFrom reads from a map (for tests).
func EnvFrom(vars map[string]string) *Env {
	return &Env{lookup: func(k string) (string, bool) { v, ok := vars[k]; return v, ok }}
}

func (e *Env) get(name string) (string, bool) {
	v, ok := e.lookup(name)
	v = strings.TrimSpace(v)
	return v, ok && v != ""
}

func (e *Env) fail(name, format string, args ...any) {
	e.errs = append(e.errs, fmt.Errorf("%s: "+format, append([]any{name}, args...)...))
}

// Err reports every problem found so far as one line, or nil.
func (e *Env) Err() error {
	if len(e.errs) == 0 {
		return nil
	}
	msgs := make([]string, len(e.errs))
	for i, err := range e.errs {
		msgs[i] = err.Error()
	}
	return errors.New("config: " + strings.Join(msgs, "; "))
}

// String returns the variable, or def when unset.
func (e *Env) String(name, def string) string {
	if v, ok := e.get(name); ok {
		return v
	}
	return def
}

// OneOf returns the variable, which must be one of allowed, or def when unset.
func (e *Env) OneOf(name, def string, allowed ...string) string {
	v := strings.ToLower(e.String(name, def))
	for _, a := range allowed {
		if v == a {
			return v
		}
	}
	e.fail(name, "must be one of %s", strings.Join(allowed, ", "))
	return def
}

// URL returns a required URL whose scheme is one of schemes, that names a host (see
// NamesHost), that has no @ after it (see AtAfterHost), and that its client reads (see
// clientRefusal). Errors never echo the value: it may hold a password.
func (e *Env) URL(name string, schemes ...string) string {
	v, ok := e.get(name)
	if !ok {
		e.fail(name, "required")
		return ""
	}
	u, err := url.Parse(v)
	switch {
	case AtAfterHost(v): // first: such a password often makes the URL unparseable too
		e.fail(name, "%s", AtAfterHostProblem)
	case err != nil || u.Scheme == "":
		e.fail(name, "not a valid URL")
	case !slices.Contains(schemes, u.Scheme):
		e.fail(name, "scheme must be one of %s", strings.Join(schemes, ", "))
	case !NamesHost(u):
		e.fail(name, "names no host: give one after //, or for PostgreSQL's Unix socket its directory in host= (%s:///database?host=/var/run/postgresql)", u.Scheme)
	case !PortsInRange(u):
		e.fail(name, "%s", badURLPort)
	default:
		if why := clientRefusal(u, v); why != "" {
			e.fail(name, "%s", why)
			return ""
		}
		return v
	}
	return ""
}

// clientRefusal says why the client that will use raw, pgx or the AMQP client, refuses to read
// it (an sslmode or a heartbeat it does not know, a space in a vhost), "" if it reads it: such a
// URL passes url.Parse, and would otherwise fail at the first connection, in an error that
// names no variable, or, for the broker, at every reconnection. The files a PostgreSQL URL
// or the environment names (sslrootcert, sslcert, sslkey) are left to the pool's own start,
// which reads them (a deployment's test renders URLs whose files exist only in the container):
// all three are emptied for the check, which PGSSLROOTCERT and the like do not override. An
// amqps URL's files have no such start, and are read here (see amqpTLSRefusal). A
// PostgreSQL URL's parameters named as pgxpool's are (pool_max_conns, …), in any case, are
// refused too: only the background pool is pgxpool's, and it sets its own size; the others,
// database/sql's, pass them to PostgreSQL as settings, as pgxpool does one whose case is not
// its own (its names are case-sensitive, PostgreSQL's are not), which it refuses at every
// login. The reason never holds the URL's password.
func clientRefusal(u *url.URL, raw string) string {
	var err error
	via := ""
	switch u.Scheme {
	case "postgres", "postgresql":
		for _, key := range slices.Sorted(maps.Keys(u.Query())) {
			if strings.HasPrefix(strings.ToLower(key), "pool_") {
				return fmt.Sprintf("%q: the service's pools take no pool_ parameter, as pgxpool's are named (DB_MAX_CONNS sizes them), and pgx would pass it to PostgreSQL as a setting, which it refuses", key)
			}
		}
		checked := *u
		q := checked.Query()
		for _, file := range []string{"sslrootcert", "sslcert", "sslkey"} {
			q.Set(file, "")
		}
		checked.RawQuery = q.Encode()
		if _, err = pgx.ParseConfig(checked.String()); err != nil {
			if names := pgEnvSet(); len(names) > 0 {
				via = fmt.Sprintf(", with %s set in the environment, which it reads too", strings.Join(names, ", "))
			}
		}
	case "amqp", "amqps":
		var uri amqp.URI
		if uri, err = amqp.ParseURI(raw); err == nil {
			if why := amqpTLSRefusal(uri); why != "" {
				return MaskPasswords(why, raw)
			}
		}
	}
	if err == nil {
		return ""
	}
	return "the client refuses it" + via + ": " + MaskPasswords(WithoutQuotedURL(err.Error()), raw)
}

// pgEnvVariables are the variables pgx reads from the process's environment beside the URL
// (pgconn's parseEnvSettings), the URL's own parameters overriding them, less PGSSLROOTCERT,
// PGSSLCERT and PGSSLKEY, which clientRefusal's check overrides.
var pgEnvVariables = []string{
	"PGAPPNAME", "PGCHANNELBINDING", "PGCONNECT_TIMEOUT", "PGDATABASE", "PGHOST", "PGMAXPROTOCOLVERSION",
	"PGMINPROTOCOLVERSION", "PGOPTIONS", "PGPASSFILE", "PGPASSWORD", "PGPORT", "PGREQUIREAUTH", "PGSERVICE",
	"PGSERVICEFILE", "PGSSLCERTMODE", "PGSSLMODE", "PGSSLNEGOTIATION", "PGSSLPASSWORD", "PGSSLSNI",
	"PGTARGETSESSIONATTRS", "PGTZ", "PGUSER",
}

// pgEnvSet lists the pgEnvVariables the process's environment sets, as pgx takes them: not
// empty, but for PGSSLCERTMODE, which it refuses empty. A refusal of DATABASE_URL names them,
// since one of them may be the cause (PGSSLMODE=verify-ful). The process's environment, not
// Env's: pgx reads the process's.
func pgEnvSet() []string {
	var set []string
	for _, name := range pgEnvVariables {
		if v, ok := os.LookupEnv(name); v != "" || ok && name == "PGSSLCERTMODE" {
			set = append(set, name)
		}
	}
	return set
}

// amqpTLSRefusal says why the AMQP client could not set up TLS with the files an amqps URL
// names, or would not set it up at all for an amqp URL that names them, "" if neither: it reads
// them at each dial, so a file missing or wrong would fail every (re)connection as if the
// broker were down, in errors that name no variable. As the client reads them: a cacertfile it
// cannot read fails the dial, one with no PEM certificate leaves it trusting nothing; a
// certfile without its keyfile, or a keyfile without its certfile, it drops without a word,
// connecting without a client certificate; a pair that does not load fails the dial.
func amqpTLSRefusal(uri amqp.URI) string {
	if uri.Scheme != "amqps" {
		// The client reads them for amqps only: with amqp it connects in clear, without a word.
		if uri.CACertFile != "" || uri.CertFile != "" || uri.KeyFile != "" || uri.ServerName != "" {
			return "cacertfile, certfile, keyfile and server_name_indication are for amqps only: with amqp the client connects without TLS"
		}
		return ""
	}
	if uri.CACertFile != "" {
		pem, err := os.ReadFile(uri.CACertFile)
		if err != nil {
			return fmt.Sprintf("cacertfile: %v", err)
		}
		if !x509.NewCertPool().AppendCertsFromPEM(pem) {
			return fmt.Sprintf("cacertfile: %s holds no PEM certificate", uri.CACertFile)
		}
	}
	switch {
	case uri.CertFile == "" && uri.KeyFile == "":
		return ""
	case uri.CertFile == "" || uri.KeyFile == "":
		return "certfile and keyfile must be given together: the client connects without a client certificate otherwise"
	}
	// Its error names no secret: a key's bytes are never quoted.
	if _, err := tls.LoadX509KeyPair(uri.CertFile, uri.KeyFile); err != nil {
		return fmt.Sprintf("certfile, keyfile: %v", err)
	}
	return ""
}

// NamesHost reports whether u names the server to connect to: a host after //, or, in a
// PostgreSQL URL with an empty one, a host= parameter, which libpq and pgx take for a host or
// a Unix socket's directory. pgx reads a URL only if it starts with postgres:// or
// postgresql://: postgres:/db?host=… is no URL to it.
func NamesHost(u *url.URL) bool {
	if u.Host != "" {
		return true
	}
	postgres := u.Scheme == "postgres" || u.Scheme == "postgresql"
	return postgres && !u.OmitHost && u.Opaque == "" && u.Query().Get("host") != ""
}

// AtAfterHost reports whether rawURL has an @ after its authority (in its path, query or
// fragment): the mark of a password with a / ? or # left unescaped, which ends the authority
// early and puts the rest of the password where Redact and Redacted do not hide it. A URL
// with no authority (no //) has none.
func AtAfterHost(rawURL string) bool {
	_, rest, _ := strings.Cut(rawURL, ":")
	rest, ok := strings.CutPrefix(rest, "//")
	if !ok {
		return false
	}
	end := strings.IndexAny(rest, "/?#")
	return end >= 0 && strings.Contains(rest[end:], "@")
}

// AtAfterHostProblem is the problem of a URL AtAfterHost reports, for an error that names
// where the URL came from. It names no part of the URL: any part may be the password's.
const AtAfterHostProblem = "has an @ after its host: percent-encode a / ? or # in the password (%2F, %3F, %23), and write any other @ as %40"

// badURLPort is the problem of a URL whose port is out of range.
const badURLPort = "a port in the URL must be a number from 1 to 65535"

// PortsInRange reports whether every port u names is from 1 to 65535. Its host part may list
// several hosts, as a PostgreSQL URL may (h1:5432,h2:5433); a host without a port, or with an
// empty one (db:), takes the scheme's default, as pgx, the AMQP client and net/http take it. A
// PostgreSQL URL may also give its ports in port= (one, or one per host, empty ones the default),
// which pgx reads in place of those in the host part: the only way to give one to a Unix
// socket's directory in host=. url.Parse checks only that a port in the host part is digits, so
// 99999 or 0 would fail at the first dial instead, in an error that names no variable, again at
// each reconnection.
func PortsInRange(u *url.URL) bool {
	ports := make([]string, 0, 2)
	for host := range strings.SplitSeq(u.Host, ",") {
		i := strings.LastIndex(host, ":")
		if i < 0 || strings.HasSuffix(host, "]") { // no port, or a bare [IPv6] address
			continue
		}
		ports = append(ports, host[i+1:])
	}
	if u.Scheme == "postgres" || u.Scheme == "postgresql" {
		for _, list := range u.Query()["port"] {
			ports = append(ports, strings.Split(list, ",")...)
		}
	}
	for _, p := range ports {
		if p == "" {
			continue
		}
		// As pgx reads one: decimal digits, no sign.
		if n, err := strconv.ParseUint(p, 10, 64); err != nil || n < 1 || n > 65535 {
			return false
		}
	}
	return true
}

// URLList returns a comma-separated list of URLs, one per node of a cluster, each as URL
// checks it, all naming the same vhost (see VhostOf).
func (e *Env) URLList(name string, schemes ...string) string {
	v, ok := e.get(name)
	if !ok {
		e.fail(name, "required")
		return ""
	}
	urls := SplitURLs(v)
	if len(urls) == 0 {
		e.fail(name, "not a valid URL")
		return ""
	}
	var vhost string
	for i, raw := range urls {
		entry := ""
		if len(urls) > 1 {
			entry = fmt.Sprintf("entry %d of %d: ", i+1, len(urls))
		}
		if AtAfterHost(raw) {
			e.fail(name, "%s%s", entry, AtAfterHostProblem)
			return ""
		}
		u, err := url.Parse(raw)
		if err != nil || u.Host == "" {
			e.fail(name, "%snot a valid URL", entry)
			return ""
		}
		if !slices.Contains(schemes, u.Scheme) {
			e.fail(name, "%sscheme must be one of %s", entry, strings.Join(schemes, ", "))
			return ""
		}
		if !PortsInRange(u) {
			e.fail(name, "%s%s", entry, badURLPort)
			return ""
		}
		if why := clientRefusal(u, raw); why != "" {
			e.fail(name, "%s%s", entry, why)
			return ""
		}
		if i > 0 && VhostOf(u) != vhost {
			e.fail(name, "every entry must name the same vhost: %q and %q differ", vhost, VhostOf(u))
			return ""
		}
		vhost = VhostOf(u)
	}
	return v
}

// VhostOf is the vhost an AMQP URL names, read as the AMQP client reads it: no path, or "/"
// alone, is the default vhost "/"; otherwise the path without its leading slash, decoded
// ("/%2F" is "/" too). outboxctl checks its list of brokers with it, as URLList does.
func VhostOf(u *url.URL) string {
	if len(u.Path) <= 1 {
		return "/"
	}
	return u.Path[1:]
}

// Int returns an integer in [lo, hi], or def when unset.
func (e *Env) Int(name string, def, lo, hi int) int {
	v, ok := e.get(name)
	if !ok {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		e.fail(name, "must be an integer from %d to %d", lo, hi)
		return def
	}
	return n
}

// DurationOrOff is Duration where 0 is also allowed, for "off".
func (e *Env) DurationOrOff(name string, def, lo, hi time.Duration) time.Duration {
	v, ok := e.get(name)
	if !ok {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil || d != 0 && (d < lo || d > hi) {
		e.fail(name, "must be 0 (off) or a duration such as 1s or 5m, from %s to %s", lo, hi)
		return def
	}
	return d
}

// Duration returns a Go duration ("1s", "5m") in [lo, hi], or def when unset.
func (e *Env) Duration(name string, def, lo, hi time.Duration) time.Duration {
	v, ok := e.get(name)
	if !ok {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < lo || d > hi {
		e.fail(name, "must be a duration such as 1s or 5m, from %s to %s", lo, hi)
		return def
	}
	return d
}

// Bool returns true/false (also 1/0), or def when unset.
func (e *Env) Bool(name string, def bool) bool {
	v, ok := e.get(name)
	if !ok {
		return def
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		e.fail(name, "must be true or false")
		return def
	}
	return b
}

// Redact hides the passwords of a URL, in its user part and in its query (see SecretParam), for
// logging the effective configuration.
func Redact(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparseable)"
	}
	q := u.Query()
	for key := range q {
		if SecretParam(key) {
			q.Set(key, "xxxxx")
		}
	}
	u.RawQuery = q.Encode()
	return u.Redacted()
}

// SecretParam reports whether a URL's query parameter holds a password: password= or
// sslpassword=, as a PostgreSQL URL may carry them, in any case. pgx and libpq read them in
// lower case only; a value written otherwise is a password all the same, sent to the server as
// a setting it refuses.
func SecretParam(key string) bool {
	return strings.EqualFold(key, "password") || strings.EqualFold(key, "sslpassword")
}

// SplitURLs splits a comma-separated list of URLs, one per node of a cluster; a single URL is a
// list of one.
func SplitURLs(list string) []string {
	var urls []string
	for u := range strings.SplitSeq(list, ",") {
		if u = strings.TrimSpace(u); u != "" {
			urls = append(urls, u)
		}
	}
	return urls
}

// RedactList redacts each URL of a comma-separated list.
func RedactList(list string) string {
	urls := SplitURLs(list)
	for i, u := range urls {
		urls[i] = Redact(u)
	}
	return strings.Join(urls, ",")
}

// Addr returns a listen address (host:port, host optional, port a number from 0 to 65535, 0
// for any free one), or def when unset. A bad port is refused at start, with the variable
// named, not when the address is first listened on.
func (e *Env) Addr(name, def string) string {
	v := e.String(name, def)
	if v == "" {
		return v
	}
	_, port, err := net.SplitHostPort(v)
	if err != nil || port == "" {
		e.fail(name, "must be host:port or :port")
		return def
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		e.fail(name, "port must be a number from 0 to 65535")
		return def
	}
	return v
}

// DialAddr returns an address to dial (host:port, both required, the port a number from 1 to
// 65535), or def when unset: a missing host or port 0 is refused at start, with the variable
// named, where the dial would fail only at its first use (SMTP_ADDR: the first e-mail).
func (e *Env) DialAddr(name, def string) string {
	v := e.String(name, def)
	if v == "" {
		return v
	}
	host, port, err := net.SplitHostPort(v)
	if err != nil || host == "" || port == "" {
		e.fail(name, "must be host:port")
		return def
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 {
		e.fail(name, "port must be a number from 1 to 65535")
		return def
	}
	return v
}

// Check records a problem that involves several variables, named in names.
func (e *Env) Check(ok bool, names, problem string) {
	if !ok {
		e.fail(names, "%s", problem)
	}
}

// Common is the configuration every service reads.
type Common struct {
	DatabaseURL string
	AMQPURL     string
	HTTPAddr    string
	LogFormat   string
	LogLevel    string
	// DBMaxConns is every database connection the process opens, shared out between its
	// parts' pools (see Pools).
	DBMaxConns int
	// OTLPEndpoint is OTEL_EXPORTER_OTLP_ENDPOINT: spans are exported there, and nowhere when
	// it is unset.
	OTLPEndpoint string
	// PprofAddr is PPROF_ADDR: where Go's profiler (/debug/pprof/) is served, on a listener of
	// its own; unset (the default), nowhere.
	PprofAddr string
	// MaxInFlight is HTTP_MAX_IN_FLIGHT: how many API requests may be at work at once (see
	// Admission); 0, the default, means as many as the requests' pool has connections.
	MaxInFlight int
	// LatencyTarget is HTTP_LATENCY_TARGET: the admitted requests' p99 that admission control
	// lowers its limit to hold (see Admission); 0 keeps the limit at MaxInFlight. Otherwise
	// it is at least MinLatencyTarget.
	LatencyTarget time.Duration
}

// MinLatencyTarget is the least HTTP_LATENCY_TARGET other than 0: a request that reads the
// database takes longer, so a lower target would halve the limit at every window, down to
// one request at a time.
const MinLatencyTarget = time.Millisecond

// DefaultDBMaxConns is how many database connections a service opens unless DB_MAX_CONNS
// says, all its pools together.
const DefaultDBMaxConns = 20

// ReadCommon reads DATABASE_URL, AMQP_URL, HTTP_ADDR, LOG_FORMAT, LOG_LEVEL, DB_MAX_CONNS,
// OTEL_EXPORTER_OTLP_ENDPOINT, PPROF_ADDR, HTTP_MAX_IN_FLIGHT and HTTP_LATENCY_TARGET, and
// checks OTEL_RESOURCE_ATTRIBUTES.
func ReadCommon(env *Env, defaultAddr string) Common {
	checkResourceAttributes(env)
	c := Common{
		DatabaseURL: env.URL("DATABASE_URL", "postgres", "postgresql"),
		AMQPURL:     env.URLList("AMQP_URL", "amqp", "amqps"),
		HTTPAddr:    env.Addr("HTTP_ADDR", defaultAddr),
		LogFormat:   env.OneOf("LOG_FORMAT", "text", "text", "json"),
		LogLevel:    env.OneOf("LOG_LEVEL", "info", "debug", "info", "warn", "error"),
		// 4 is a floor for the variable alone; Pools.Check works out what the settings given
		// need (7 for order's smallest, more for the consumers'), and names them if short.
		DBMaxConns:    env.Int("DB_MAX_CONNS", DefaultDBMaxConns, 4, 1000),
		OTLPEndpoint:  readOTLPEndpoint(env),
		PprofAddr:     env.Addr("PPROF_ADDR", ""),
		MaxInFlight:   env.Int("HTTP_MAX_IN_FLIGHT", 0, 1, 100_000),
		LatencyTarget: env.DurationOrOff("HTTP_LATENCY_TARGET", DefaultLatencyTarget, MinLatencyTarget, time.Minute),
	}
	// The profiler could not listen beside the service: its start would fail, at every restart.
	// Not against an HTTP_ADDR refused above (Addr then gives the default): one error is enough.
	httpAddrTaken := env.String("HTTP_ADDR", defaultAddr) == c.HTTPAddr
	env.Check(c.PprofAddr == "" || !httpAddrTaken || !samePort(c.HTTPAddr, c.PprofAddr), "PPROF_ADDR",
		"must not be HTTP_ADDR's port on the same host, or with either on every interface: give the profiler a port of its own")
	return c
}

// samePort reports whether listeners on the addresses a and b (host:port, as Addr takes them)
// would want the same port: the same one but 0 (any free one), on the same host, or with either
// host empty or unspecified (every interface). localhost is 127.0.0.1: Go listens there for it.
func samePort(a, b string) bool {
	hostA, portA, errA := net.SplitHostPort(a)
	hostB, portB, errB := net.SplitHostPort(b)
	if errA != nil || errB != nil {
		return false
	}
	pa, errA := strconv.ParseUint(portA, 10, 16)
	pb, errB := strconv.ParseUint(portB, 10, 16)
	if errA != nil || errB != nil || pa != pb || pa == 0 {
		return false
	}
	everywhere := func(host string) bool {
		ip := net.ParseIP(host)
		return host == "" || ip != nil && ip.IsUnspecified()
	}
	ip := func(host string) net.IP {
		if strings.EqualFold(strings.TrimSuffix(host, "."), "localhost") {
			return net.IPv4(127, 0, 0, 1)
		}
		return net.ParseIP(host)
	}
	ipA, ipB := ip(hostA), ip(hostB)
	return everywhere(hostA) || everywhere(hostB) || strings.EqualFold(hostA, hostB) || ipA != nil && ipA.Equal(ipB)
}

// LogAttrs lists the effective configuration with secrets masked.
func (c Common) LogAttrs() []any {
	var maxInFlight any = c.MaxInFlight
	if c.MaxInFlight == 0 {
		maxInFlight = "the requests' pool size" // the default; 0 itself is refused
	}
	return []any{
		"database_url", Redact(c.DatabaseURL), "amqp_url", RedactList(c.AMQPURL), "http_addr", c.HTTPAddr,
		"log_format", c.LogFormat, "log_level", c.LogLevel, "db_max_conns", c.DBMaxConns,
		"otel_exporter_otlp_endpoint", Redact(c.OTLPEndpoint), "pprof_addr", c.PprofAddr, "http_max_in_flight", maxInFlight,
		"http_latency_target", c.LatencyTarget,
	}
}
