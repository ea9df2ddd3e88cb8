// Command outboxctl is the operator's tool for the outbox of a service's database and for the
// dead-letter queues of its consumers (README, "When something goes wrong").
//
// Usage:
//
//	outboxctl status [--db URL]
//	outboxctl retry [--id UUID] [--db URL]
//	outboxctl dlq list QUEUE [--amqp URL]
//	outboxctl dlq redrive QUEUE [--id UUID] [--amqp URL]
//
// --db defaults to DATABASE_URL and --amqp to AMQP_URL, so in a service's container it needs
// neither. Flags may come before or after QUEUE. It exits 0 on success, 1 on a failure and 2
// on a mistake in the command line, with one line on stderr that says why; no URL it prints
// shows a password.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"unicode"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

const usage = `usage:
  outboxctl status [--db URL]                          unsent outbox rows, the oldest one's age, the most attempts, the latest errors
  outboxctl retry [--id UUID] [--db URL]               make the failed outbox rows, or the one, due now
  outboxctl dlq list QUEUE [--amqp URL]                what waits in QUEUE.dlq: message id, type, why
  outboxctl dlq redrive QUEUE [--id UUID] [--amqp URL] move messages from QUEUE.dlq back to QUEUE, their ids unchanged
--db defaults to $DATABASE_URL and --amqp to $AMQP_URL; flags may come before or after QUEUE.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// command is one subcommand: it reads its own flags and arguments from args.
type command func(ctx context.Context, args []string, stdout io.Writer) error

// usageError is a mistake in the command line.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// run runs the command named by args and returns the process's exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	name, cmd, rest, err := lookup(args)
	if err == nil {
		err = cmd(ctx, rest, stdout)
	}
	var usageErr usageError
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprint(stdout, usage)
		return 0
	case errors.As(err, &usageErr):
		fmt.Fprintf(stderr, "outboxctl%s: %s\n%s", name, hideSecrets(err.Error(), args), usage)
		return 2
	default:
		// One line, whatever the error holds (pgx errors span several).
		fmt.Fprintf(stderr, "outboxctl%s: %s\n", name, strings.Join(strings.Fields(hideSecrets(err.Error(), args)), " "))
		return 1
	}
}

// lookup finds the command args name, and returns its name (with a leading space, for
// messages) and its arguments.
func lookup(args []string) (name string, cmd command, rest []string, err error) {
	if len(args) == 0 {
		return "", nil, nil, usageError{"no command given"}
	}
	switch args[0] {
	case "status":
		return " status", status, args[1:], nil
	case "retry":
		return " retry", retry, args[1:], nil
	case "dlq":
		if len(args) > 1 && args[1] == "list" {
			return " dlq list", dlqList, args[2:], nil
		}
		if len(args) > 1 && args[1] == "redrive" {
			return " dlq redrive", dlqRedrive, args[2:], nil
		}
		return " dlq", nil, nil, usageError{"dlq needs list or redrive"}
	case "help", "-h", "-help", "--help":
		return "", nil, nil, flag.ErrHelp
	}
	return "", nil, nil, usageError{fmt.Sprintf("unknown command %q", args[0])}
}

// newFlags returns an empty flag set for the command name; run reports its errors.
func newFlags(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs
}

// parse parses args with fs wherever the flags stand, before or after the positional
// arguments, and returns those, of which it wants exactly positional. The flag package alone
// stops at the first argument that is not a flag.
func parse(fs *flag.FlagSet, args []string, positional ...string) ([]string, error) {
	var got []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, usageError{err.Error()}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			break
		}
		if len(rest) < len(args) && args[len(args)-len(rest)-1] == "--" { // all after -- is positional
			got = append(got, rest...)
			break
		}
		got, args = append(got, rest[0]), rest[1:]
	}
	if len(got) != len(positional) {
		if len(positional) == 0 {
			return nil, usageError{fmt.Sprintf("unexpected argument %q", got[0])}
		}
		return nil, usageError{fmt.Sprintf("want %s, got %d arguments", strings.Join(positional, " "), len(got))}
	}
	return got, nil
}

// urlFrom returns the flag's value, or else the environment variable's. A missing or
// malformed URL is a usage error that names where it came from, never its value: it may hold a
// password.
func urlFrom(flagName, value, variable string, schemes ...string) (string, error) {
	source := "--" + flagName
	if value == "" {
		value, source = os.Getenv(variable), variable
	}
	if value == "" {
		return "", usageError{fmt.Sprintf("no URL: give --%s URL or set %s", flagName, variable)}
	}
	// A broker's may list one URL per node of a cluster, as AMQP_URL does.
	for _, one := range messaging.SplitURLs(value) {
		if u, err := url.Parse(one); err != nil || u.Host == "" || !slices.Contains(schemes, u.Scheme) {
			return "", usageError{fmt.Sprintf("%s is not a URL, or a comma-separated list of URLs, with scheme %s", source, strings.Join(schemes, " or "))}
		}
	}
	return value, nil
}

// hideSecrets replaces in msg every password of a URL given in args, in DATABASE_URL or in
// AMQP_URL: drivers' errors are not trusted to leave them out.
func hideSecrets(msg string, args []string) string {
	for _, arg := range append([]string{os.Getenv("DATABASE_URL"), os.Getenv("AMQP_URL")}, args...) {
		values := []string{arg}
		if _, v, ok := strings.Cut(arg, "="); ok { // --db=URL
			values = append(values, v)
		}
		for _, v := range values {
			for _, one := range messaging.SplitURLs(v) {
				for _, secret := range passwords(one) {
					msg = strings.ReplaceAll(msg, secret, "xxxxx")
				}
			}
		}
	}
	return msg
}

// passwords returns the passwords rawURL holds, as written and escaped: in its user part, and
// in the password= and sslpassword= parameters a PostgreSQL URL may carry.
func passwords(rawURL string) []string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil
	}
	var out []string
	for _, p := range []string{u.Query().Get("password"), u.Query().Get("sslpassword")} {
		if p != "" {
			out = append(out, p, url.QueryEscape(p))
		}
	}
	if p, ok := u.User.Password(); ok && p != "" {
		out = append(out, p, url.QueryEscape(p), url.PathEscape(p))
	}
	return out
}

// printable makes text from a message or a database row safe to print in a table: one line, no
// control characters (a terminal would act on escape sequences), at most limit bytes.
func printable(s string, limit int) string {
	s = strings.ToValidUTF8(s, "?")
	s = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > limit {
		s = strings.ToValidUTF8(s[:limit], "") + "…"
	}
	if s == "" {
		return "-"
	}
	return s
}
