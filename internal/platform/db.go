package platform

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" driver of OpenReadinessDB
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// OpenDB opens the service's database, trying each second until it answers or ctx ends: the
// services start in any order, and one that gave up would exit 1 and wait out the
// orchestrator's restart back-off (up to 5 min on Kubernetes) after the database came. A
// service waits live and not ready (see startingServer). The connection carries
// application_name=service, so its sessions can be told apart in pg_stat_activity. Its errors
// name DATABASE_URL, where rawURL comes from, and never hold a password (see openError).
//
// It waits also while the server refuses the connection (a wrong password, no such role or
// database: SQLSTATE 28P01, 28000, 3D000): on Kubernetes, CloudNativePG creates the roles and
// databases of deploy/k8s/postgres.yaml only once the server is up, so these refusals pass;
// so does a setting's that names a role or a tablespace not created yet (role=,
// default_tablespace=), which CloudNativePG's managed roles and declarative tablespaces are
// for a while. Any other refusal of a setting the connection carries does not pass (see
// refusedSetting): it fails at once.
func OpenDB(ctx context.Context, log *slog.Logger, service, rawURL string, maxConns int) (*gorm.DB, error) {
	dsn, err := WithApplicationName(rawURL, service)
	if err != nil {
		return nil, errNotAURL
	}
	db, err := gorm.Open(postgres.Open(dsn), &gorm.Config{
		Logger: logger.Discard,
		// The loop below waits for the database instead of failing on the first try.
		DisableAutomaticPing: true,
		// A read names its model's columns, never SELECT *: pgx caches each prepared statement,
		// and a cached SELECT * fails once a migration adds a column to its table, on every
		// replica still serving while a rolling upgrade migrates.
		QueryFields: true,
	})
	if err != nil {
		return nil, openError("open database", err, rawURL, dsn)
	}
	sqlDB, err := db.DB()
	if err != nil {
		return nil, openError("open database", err, rawURL, dsn)
	}
	// A pool of maxConns for one part (requests, the consumers' work, or the sender's; see
	// Pools), which no other part's load can take.
	sqlDB.SetMaxOpenConns(maxConns)
	sqlDB.SetMaxIdleConns(maxConns)
	sqlDB.SetConnMaxLifetime(30 * time.Minute)
	sqlDB.SetConnMaxIdleTime(5 * time.Minute)

	if err := waitForDatabase(ctx, log, service, rawURL, dsn, sqlDB.PingContext); err != nil {
		_ = sqlDB.Close()
		return nil, err
	}
	return db, nil
}

// waitForDatabase pings pool, whose URL is dsn (rawURL as configured), until the server takes
// the connection, or refuses a setting of it (which waiting would not change), or ctx ends.
// The wait is logged at its first failure and every waitLogEvery after, with the latest: a
// database away for hours logs no line a second.
func waitForDatabase(ctx context.Context, log *slog.Logger, pool, rawURL, dsn string, ping func(context.Context) error) error {
	// failure is the last ping's error that the context did not cause: why it was still
	// waiting when it was stopped.
	var failure error
	var logged time.Time
	for {
		pingCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
		err := ping(pingCtx)
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			if failure == nil {
				failure = err
			}
			return fmt.Errorf("%w (%w)", openError("waiting for the database", failure, rawURL, dsn), ctx.Err())
		}
		if refusedSetting(err) {
			return openError("the server refuses a setting of its query (pgx sends PostgreSQL each query parameter it does not read itself, as a setting)", err, rawURL, dsn)
		}
		if failure == nil || time.Since(logged) >= waitLogEvery {
			log.Warn("waiting for the database", "pool", pool, "error", err)
			logged = time.Now()
		}
		failure = err
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// waitLogEvery is how often waitForDatabase (OpenDB's and OpenBackground's wait) logs after the
// first failure.
const waitLogEvery = 30 * time.Second

// refusedSetting reports whether err is a server's refusal, at login, of a setting the
// connection's startup packet carried, where pgx puts every query parameter of the URL it does
// not read itself (a name misspelt, a Password= in capitals, pgxpool's pool_max_conns):
// PostgreSQL's, for a name it does not know (42704; 42602 for a malformed custom one), a value
// it does not take (22023, but for one that names a role or tablespace that does not exist
// yet, see missingObject), one set only at the server's start or in its configuration (55P02),
// one the role may not set (42501, from its set_config routine: the same code refuses a
// database's CONNECT, which a provisioner may grant later); or a pooler's that passes no such
// parameter (PgBouncer's "unsupported startup parameter", 08P01, a code it gives to passing
// failures too). The same URL is refused the same way at every try, so
// waiting would only hold the service live and never ready.
func refusedSetting(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case "42704", "42602", "55P02":
		return true
	case "22023":
		return !missingObject(pgErr)
	case "42501":
		return strings.HasPrefix(pgErr.Routine, "set_config")
	case "08P01":
		return strings.HasPrefix(pgErr.Message, "unsupported startup parameter")
	}
	return false
}

// missingObject reports whether pgErr, a 22023, is a setting's check refusing a value for naming
// an object that does not exist: PostgreSQL's check of role= (and session_authorization=) says
// so in its message, default_tablespace='s in its detail, both from call_string_check_hook. The
// object may be created later; a value of the wrong form, refused by the same routine
// (DateStyle=x) or by parse_and_validate_value, never passes. The text is PostgreSQL's in
// English: a server whose lc_messages translates it has its missing objects taken for refusals
// that last.
func missingObject(pgErr *pgconn.PgError) bool {
	return pgErr.Routine == "call_string_check_hook" &&
		(strings.Contains(pgErr.Message, "does not exist") || strings.Contains(pgErr.Detail, "does not exist"))
}

// WithApplicationName returns rawURL with application_name=name in its query, unless the URL
// gives a name of its own, and the rest of its query as written (see setParam): how a
// connection's sessions show in pg_stat_activity. Its error is url.Parse's, which quotes rawURL,
// password and all.
func WithApplicationName(rawURL, name string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", err
	}
	setParam(u, "application_name", name, false)
	return u.String(), nil
}

// setParam sets key=value in u's query: in place of the value it has, if replace, else only if
// it has none, or an empty one. pgx reads a query as libpq does: percent-escapes only, a + as
// a plus, and a key given more than once by its last occurrence; setParam reads and writes it
// so. The rest of the query stays as written, where url.Values would read a + as a space and
// write a space back as a +, turning options=-c%20search_path%3Dapp into the
// -c+search_path=app PostgreSQL refuses.
func setParam(u *url.URL, key, value string, replace bool) {
	var kept []string
	var last string
	for pair := range strings.SplitSeq(u.RawQuery, "&") {
		k, v, _ := strings.Cut(pair, "=")
		if name, err := url.PathUnescape(k); err == nil && name == key {
			last = v
			continue
		}
		if pair != "" {
			kept = append(kept, pair)
		}
	}
	if !replace && strings.Trim(last, " ") != "" {
		return
	}
	// QueryEscape escapes a + as %2B, so each + it leaves is a space, which pgx reads as %20.
	escaped := strings.ReplaceAll(url.QueryEscape(value), "+", "%20")
	u.RawQuery = strings.Join(append(kept, key+"="+escaped), "&")
}

// IndexPlansURL returns rawURL with the settings that make every statement of its sessions
// use an index where one serves: enable_sort and enable_seqscan off, from the connection's
// start. A pool whose statements must walk an index in order and find rows by key gets them
// so: the notification sender's, whose transactions then need no statement to set them, and
// the background pool's, where the relay's batches need none (the backlog gauges and the
// cleanups, which keep to their indexes too, still set theirs). Without them, a generic plan
// cached while the table was nearly empty scans it whole, and keeps doing so as it grows,
// until an ANALYZE; and a planner without statistics sorts the whole backlog. jit is off too:
// a sequential scan where no index serves still runs, but its prohibitive cost estimate would
// have PostgreSQL compile the statement, half a second (seen with sorts in the cleanups).
func IndexPlansURL(rawURL string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", errNotAURL
	}
	for _, setting := range []string{"enable_sort", "enable_seqscan", "jit"} {
		setParam(u, setting, "off", true)
	}
	return u.String(), nil
}

// indexPlansSQL reads the settings IndexPlansURL gives a session: "off,off,off".
const indexPlansSQL = `SELECT concat_ws(',', current_setting('enable_sort'), current_setting('enable_seqscan'), current_setting('jit'))`

// checkIndexPlans fails unless db's sessions have the settings IndexPlansURL asks for: a
// connection pooler between the service and PostgreSQL may drop a connection's startup
// parameters, and the pool's statements would then plan without them, unseen.
func checkIndexPlans(ctx context.Context, db messaging.DB, pool string) error {
	rows, err := db.Query(ctx, indexPlansSQL)
	if err != nil {
		return fmt.Errorf("DATABASE_URL: read the plan settings of the %s: %w", pool, err)
	}
	defer rows.Close()
	var got string
	for rows.Next() {
		if err := rows.Scan(&got); err != nil {
			return fmt.Errorf("DATABASE_URL: read the plan settings of the %s: %w", pool, err)
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("DATABASE_URL: read the plan settings of the %s: %w", pool, err)
	}
	if got != "off,off,off" {
		return fmt.Errorf("DATABASE_URL: the sessions of the %s have enable_sort, enable_seqscan and jit %q, where their connection string sets them off: does a connection pooler drop startup parameters?", pool, got)
	}
	return nil
}

// ReadinessConns is how many of DB_MAX_CONNS readiness checks keep for themselves (see
// OpenReadinessDB); the pool has the rest.
const ReadinessConns = 1

// OpenReadinessDB returns the handle readiness checks ping the database through: a
// connection of its own, apart from the pool that requests and workers share, so a saturated
// pool cannot make every replica unready at once. It connects at the first check, and again
// after its connection breaks. Its sessions carry application_name=service-readiness.
func OpenReadinessDB(service, rawURL string) (*sql.DB, error) {
	dsn, err := WithApplicationName(rawURL, service+"-readiness")
	if err != nil {
		return nil, errNotAURL
	}
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, openError("open readiness connection", err, rawURL, dsn)
	}
	db.SetMaxOpenConns(ReadinessConns)
	db.SetMaxIdleConns(ReadinessConns)
	db.SetConnMaxLifetime(30 * time.Minute)
	return db, nil
}

// DatabaseReady is the readiness check of the database behind db (see OpenReadinessDB): it
// must answer a ping within 2 s.
func DatabaseReady(db *sql.DB) ReadyFunc {
	return func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		if err := db.PingContext(ctx); err != nil {
			return &NotReadyError{Reason: "the database does not answer", Err: err}
		}
		return nil
	}
}

// errNotAURL is the error of a DATABASE_URL that url.Parse refuses: its error would quote the
// URL, password and all (Env.URL refuses such a URL at start, so this is a safety net).
var errNotAURL = errors.New("DATABASE_URL: not a valid URL")

// openError is err, from opening a pool on urls (DATABASE_URL as given, and as made into the
// pool's connection string), as an error that names DATABASE_URL and holds none of its
// passwords. pgx quotes a URL it cannot use, masking only the passwords it reads (password= in
// lower case, not Password=): that quotation is left out, and every password the URLs carry
// (SecretParam) is masked wherever it still appears. Nothing is wrapped: the cause keeps the
// URL in its text and fields.
func openError(what string, err error, urls ...string) error {
	return fmt.Errorf("DATABASE_URL: %s: %s", what, MaskPasswords(WithoutQuotedURL(err.Error()), urls...))
}

// WithoutQuotedURL is pgx's error text why without the URL it quotes ("cannot parse `URL`: "),
// whose passwords pgx masks only as well as it reads them.
func WithoutQuotedURL(why string) string {
	if i := strings.Index(why, "cannot parse `"); i >= 0 {
		if j := strings.Index(why[i:], "`: "); j >= 0 {
			why = why[:i] + why[i+j+len("`: "):]
		}
	}
	return why
}

// MaskPasswords replaces in msg every password of the urls (URLPasswords) with xxxxx: one of
// 8 bytes or more wherever it appears, a shorter one where it stands as a word of its own, not
// inside a longer one (a password p must not turn "tcp" into "tcxxxxx"). A password that is its
// user's name is left: the name shows it anyway, and masking it would mask that name, and every
// word that spells it (compose's invoicing:invoicing would make invoicing.dlq read xxxxx.dlq).
func MaskPasswords(msg string, urls ...string) string {
	var secrets []string
	for _, raw := range urls {
		user, _, _ := userInfo(raw)
		name, _ := url.PathUnescape(user)
		for _, p := range URLPasswords(raw) {
			if p != user && p != name {
				secrets = append(secrets, p)
			}
		}
	}
	// Longest first, so that a password that holds another is masked whole.
	slices.SortFunc(secrets, func(a, b string) int { return len(b) - len(a) })
	for _, s := range secrets {
		if len(s) >= 8 {
			msg = strings.ReplaceAll(msg, s, "xxxxx")
		} else {
			msg = maskWord(msg, s)
		}
	}
	return msg
}

// maskWord replaces secret in msg with xxxxx wherever it is not part of a longer word, as a
// regular expression's \b would bound it.
func maskWord(msg, secret string) string {
	first, _ := utf8.DecodeRuneInString(secret)
	last, _ := utf8.DecodeLastRuneInString(secret)
	var b strings.Builder
	for {
		i := strings.Index(msg, secret)
		if i < 0 {
			b.WriteString(msg)
			return b.String()
		}
		end := i + len(secret)
		before, _ := utf8.DecodeLastRuneInString(msg[:i])
		after, _ := utf8.DecodeRuneInString(msg[end:])
		b.WriteString(msg[:i])
		if wordRune(first) && wordRune(before) || wordRune(last) && wordRune(after) {
			b.WriteString(msg[i:end])
		} else {
			b.WriteString("xxxxx")
		}
		msg = msg[end:]
	}
}

// wordRune reports whether r continues a word (utf8.RuneError: the text began or ended there).
func wordRune(r rune) bool {
	return r != utf8.RuneError && (r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r))
}

// URLPasswords are the passwords of rawURL, in its user part and its query (SecretParam), each
// as written, decoded and encoded again, since a message may quote any. It reads a URL
// url.Parse refuses too.
func URLPasswords(rawURL string) []string {
	var found []string
	add := func(raw string) {
		found = append(found, raw)
		for _, unescape := range []func(string) (string, error){url.QueryUnescape, url.PathUnescape} {
			if dec, err := unescape(raw); err == nil {
				// Decoded, and encoded again as a URL rebuilt from it writes it (%2f as %2F,
				// %20 as +).
				found = append(found, dec, url.QueryEscape(dec), url.PathEscape(dec))
			}
		}
	}
	if _, password, ok := userInfo(rawURL); ok {
		add(password)
	}
	rest := rawURL
	if _, after, ok := strings.Cut(rest, "://"); ok {
		rest = after
	}
	if _, after, ok := strings.Cut(rest, "?"); ok {
		query, _, _ := strings.Cut(after, "#")
		for pair := range strings.SplitSeq(query, "&") {
			key, value, _ := strings.Cut(pair, "=")
			if k, err := url.QueryUnescape(key); err == nil && SecretParam(k) || SecretParam(key) {
				add(value)
			}
		}
	}
	// An empty password would mask the whole message, between every character.
	return slices.DeleteFunc(found, func(s string) bool { return s == "" })
}

// userInfo returns the user name and password of rawURL's authority, as written.
func userInfo(rawURL string) (user, password string, ok bool) {
	rest := rawURL
	if _, after, found := strings.Cut(rest, "://"); found {
		rest = after
	}
	authority := rest
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		authority = rest[:i]
	}
	i := strings.LastIndex(authority, "@")
	if i < 0 {
		return "", "", false
	}
	return strings.Cut(authority[:i], ":")
}

// CloseDB closes the pool behind db.
func CloseDB(db *gorm.DB) {
	if sqlDB, err := db.DB(); err == nil {
		_ = sqlDB.Close()
	}
}
