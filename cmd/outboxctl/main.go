// Command outboxctl is the operator's tool for a service's outbox and inbox (in its database)
// and for the dead-letter queues of its consumers (on the broker).
//
// Usage:
//
//	outboxctl status [--db URL]
//	outboxctl retry [--id UUID | --type TYPE] [--limit N] [--batch N] [--dry-run] [--yes] [--db URL]
//	outboxctl outbox park --id UUID [--reason TEXT] [--dry-run] [--db URL]
//	outboxctl outbox unpark --id UUID [--dry-run] [--db URL]
//	outboxctl outbox drop --id UUID [--dry-run] [--yes] [--db URL]
//	outboxctl inbox show --id UUID [--consumer NAME] [--db URL]
//	outboxctl dlq list QUEUE [--limit N] [--type TYPE] [--reason TEXT] [--show-body] [--show-headers] [--amqp URL]
//	outboxctl dlq redrive QUEUE [--id ID | --type TYPE --reason TEXT] [--limit N] [--dry-run] [--yes] [--amqp URL]
//	outboxctl dlq drop QUEUE (--id ID | --without-id) [--limit N] [--dry-run] [--yes] [--amqp URL]
//	outboxctl version
//
// Every command takes -o json for output a script reads, and --help. --db defaults to
// DATABASE_URL and --amqp to AMQP_URL, so in a service's container it needs neither; flags may
// come before or after QUEUE. A command that changes anything shows what it would do with
// --dry-run: retry and the outbox commands then change nothing; dlq redrive and dlq drop move
// and delete nothing, but the messages they look at and hand back (as dlq list does) may change
// place in the queue. One that would act on more than one item, or delete a message, asks first
// on a terminal. Without one, as in a script, a retry or a redrive goes on
// (it loses nothing: the inbox skips what was handled already), and a drop refuses unless
// given --yes. No URL it prints shows a password.
//
// Exit status: 0 done; 1 failed (database, broker); 2 a mistake in the command line, or a
// dead-letter queue too long to take without --limit; 3 nothing
// matched (no such row or message, or not in a state the command acts on; inbox show: no
// record); 4 not confirmed, so nothing was done (dead letters looked at may have changed place). A failure is one line on stderr; a mistake
// in the command line is followed by the command's usage.
//
// The command line is cobra's: the subcommand tree, the help of each command, flags wherever
// they stand, as in the river CLI.
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net/url"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"unicode"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/mattn/go-isatty"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/outboxkit/outbox-inbox/internal/platform"
)

// The exit statuses.
const (
	exitOK           = 0
	exitFailure      = 1
	exitUsage        = 2
	exitNoMatch      = 3
	exitNotConfirmed = 4
)

// synopsis is every command, as the root's help shows them (and the package comment).
const synopsis = `  outboxctl status [--db URL]
  outboxctl retry [--id UUID | --type TYPE] [--limit N] [--batch N] [--dry-run] [--yes] [--db URL]
  outboxctl outbox park --id UUID [--reason TEXT] [--dry-run] [--db URL]
  outboxctl outbox unpark --id UUID [--dry-run] [--db URL]
  outboxctl outbox drop --id UUID [--dry-run] [--yes] [--db URL]
  outboxctl inbox show --id UUID [--consumer NAME] [--db URL]
  outboxctl dlq list QUEUE [--limit N] [--type TYPE] [--reason TEXT] [--show-body] [--show-headers] [--amqp URL]
  outboxctl dlq redrive QUEUE [--id ID | --type TYPE --reason TEXT] [--limit N] [--dry-run] [--yes] [--amqp URL]
  outboxctl dlq drop QUEUE (--id ID | --without-id) [--limit N] [--dry-run] [--yes] [--amqp URL]
  outboxctl version`

const exitStatusHelp = `Exit status:
  0  done
  1  failed: the database or the broker did not answer, or refused
  2  a mistake in the command line; or a dead-letter queue too long to take without --limit
     (dlq list, dlq redrive, dlq drop: more than 10,000 waiting; nothing taken)
  3  nothing matched: no such row or message, or not in a state the command acts on
     (inbox show: no record of the message)
  4  not confirmed: declined or interrupted at the prompt, or a drop with no terminal to ask
     on and no --yes; nothing done (dead letters looked at may have changed place in the queue)`

// usageTemplate is cobra's, but for the root it lists every command with its flags, and ends
// with the exit statuses; a command that holds others shows no line of its own.
const usageTemplate = `Usage:{{if not .HasAvailableSubCommands}}
  {{.UseLine}}{{else if .HasParent}}
  {{.CommandPath}} COMMAND{{else}}
` + synopsis + `{{end}}{{if .HasExample}}

Examples:
{{.Example}}{{end}}{{if and .HasAvailableSubCommands .HasParent}}

Commands:{{range .Commands}}{{if .IsAvailableCommand}}
  {{rpad .Name .NamePadding }} {{.Short}}{{end}}{{end}}{{end}}{{if .HasAvailableLocalFlags}}

Flags:
{{.LocalFlags.FlagUsages | trimTrailingWhitespaces}}{{end}}{{if .HasAvailableInheritedFlags}}

Global Flags:
{{.InheritedFlags.FlagUsages | trimTrailingWhitespaces}}{{end}}{{if not .HasParent}}

` + exitStatusHelp + `{{end}}{{if .HasAvailableSubCommands}}

Use "{{.CommandPath}} COMMAND --help" for more about a command.{{end}}
`

func main() {
	ctx, stop := context.WithCancel(context.Background())
	go stopOnSignals(stop)
	code := run(ctx, os.Args[1:], streams{
		in: os.Stdin, out: os.Stdout, err: os.Stderr,
		// The question goes to stderr and the answer comes from stdin: both must be a person's.
		interactive: isTerminal(os.Stdin) && isTerminal(os.Stderr),
	})
	os.Exit(code)
}

// stopOnSignals calls stop at the first of stopSignals, and kills the process at the second:
// the first one's orderly stop may wait on a broker or a database that does not answer.
func stopOnSignals(stop context.CancelFunc) {
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, stopSignals()...)
	<-signals
	fmt.Fprintln(os.Stderr, "outboxctl: stopping once what is under way has settled; a second signal stops it at once")
	stop()
	second := (<-signals).(syscall.Signal)
	signal.Reset()
	_ = syscall.Kill(os.Getpid(), second)
}

// stopSignals are the signals that stop a command in order: an interrupt, a SIGTERM, and a
// hang-up (the terminal or the SSH session closed: killed by it, a redrive would leave what it
// holds to the broker's order, and its record of what moved unwritten), unless the hang-up is
// ignored, as under nohup, which asks to outlive it.
func stopSignals() []os.Signal {
	signals := []os.Signal{os.Interrupt, syscall.SIGTERM}
	if !signal.Ignored(syscall.SIGHUP) {
		signals = append(signals, syscall.SIGHUP)
	}
	return signals
}

func isTerminal(f *os.File) bool {
	return isatty.IsTerminal(f.Fd()) || isatty.IsCygwinTerminal(f.Fd())
}

// streams are where a run reads and writes, and whether a person is there to answer.
type streams struct {
	in          io.Reader
	out, err    io.Writer
	interactive bool
}

// usageError is a mistake in the command line.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// Errors that choose their exit status; a command wraps them with what it was about.
var (
	errNoMatch      = errors.New("nothing matched")
	errNotConfirmed = errors.New("not confirmed")
)

// answered is a command's way of exiting with code after it printed its answer, with nothing to
// add on stderr (inbox show: no record).
type answered struct{ code int }

func (a answered) Error() string { return fmt.Sprintf("exit status %d", a.code) }

// commandError carries what a command's own code returned. The others come from the command
// line's parsing: flags, arguments, unknown commands.
type commandError struct{ err error }

func (e commandError) Error() string { return e.err.Error() }
func (e commandError) Unwrap() error { return e.err }

// run runs the command args names and returns the process's exit status.
func run(ctx context.Context, args []string, s streams) int {
	root := newRoot(s)
	root.SetArgs(append([]string{}, args...)) // never nil: cobra would read os.Args
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return exitOK
	}
	name := "outboxctl"
	if cmd != nil {
		name = cmd.CommandPath()
	}
	code := exitCode(err)
	var a answered
	switch {
	case errors.As(err, &a):
	case code == exitUsage:
		fmt.Fprintf(s.err, "%s: %s\n", name, hideSecrets(err.Error(), args))
		if cmd != nil {
			fmt.Fprintf(s.err, "\n%s", cmd.UsageString())
		}
	default:
		// One line, whatever the error holds (pgx errors span several), without control
		// characters: it may quote a message id or a queue name, which a terminal would act on.
		fmt.Fprintf(s.err, "%s: %s\n", name, printable(hideSecrets(err.Error(), args), math.MaxInt))
	}
	return code
}

// exitCode is the exit status err stands for.
func exitCode(err error) int {
	var cmdErr commandError
	var usage usageError
	var a answered
	switch {
	case !errors.As(err, &cmdErr), errors.As(err, &usage):
		return exitUsage
	case errors.As(err, &a):
		return a.code
	case errors.Is(err, errNotConfirmed):
		return exitNotConfirmed
	case isNoMatch(err):
		return exitNoMatch
	}
	return exitFailure
}

// newRoot builds the command tree, writing to s.
func newRoot(s streams) *cobra.Command {
	var format string
	root := &cobra.Command{
		Use:   "outboxctl",
		Short: "the operator's tool for the outbox, the inbox and the dead-letter queues",
		Long: `outboxctl is the operator's tool for a service's outbox and inbox (in its database, --db or
DATABASE_URL) and for the dead-letter queues of its consumers (on the broker, --amqp or
AMQP_URL). Every command takes -o json. A command that changes anything shows what it would do
with --dry-run: retry and the outbox commands then change nothing; a dlq command moves and
deletes nothing, but the messages it looks at and hands back may change place in the queue (see
dlq list --help). One that would act on more than one item, or delete a message, asks first on
a terminal. Without one (a script), retry and dlq redrive go on, since
they lose nothing (the inbox skips what was handled already), and a drop refuses unless given
--yes. Flags may come before or after QUEUE. No URL it prints shows a password.`,
		Version:       readVersion().String(),
		SilenceErrors: true,
		SilenceUsage:  true,
		// Without a command it is a mistake, not a request for help.
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{"no command given"}
			}
			return usageError{fmt.Sprintf("unknown command %q", args[0])}
		},
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if err := noEmptyFlags(cmd); err != nil {
				return err
			}
			if err := noZeroLimit(cmd); err != nil {
				return err
			}
			if format != "table" && format != "json" {
				return usageError{fmt.Sprintf("-o %q: want table or json", printable(format, 32))}
			}
			return nil
		},
	}
	root.SetVersionTemplate("outboxctl {{.Version}}\n")
	root.SetUsageTemplate(usageTemplate)
	root.PersistentFlags().StringVarP(&format, "output", "o", "table", "output format: table or json")
	root.SetIn(s.in)
	root.SetOut(s.out)
	root.SetErr(s.err)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{withTwoDashes(err.Error())} })
	root.CompletionOptions.DisableDefaultCmd = true
	c := &cli{streams: s, format: &format}
	root.AddCommand(c.statusCommand(), c.retryCommand(), c.outboxCommand(), c.inboxCommand(), c.dlqCommand(), c.versionCommand())
	return root
}

// noEmptyFlags refuses a flag given with an empty value. Left out, a filter picks everything
// and a URL comes from its variable; given empty, as a script's unset variable gives it, it
// must not do the same: --id "$ID" would turn a one-message action into one on all. Blank is
// empty too: --reason " " is in nearly every reason.
func noEmptyFlags(cmd *cobra.Command) error {
	var empty []string
	cmd.Flags().Visit(func(f *pflag.Flag) {
		if f.Value.Type() == "string" && strings.TrimSpace(f.Value.String()) == "" {
			empty = append(empty, "--"+f.Name)
		}
	})
	if len(empty) > 0 {
		return usageError{fmt.Sprintf("%s given an empty or blank value: leave it out, or give it one", strings.Join(empty, ", "))}
	}
	return nil
}

// limitZeroIsAll marks a command, by its annotations, whose --limit 0 means all of them.
const limitZeroIsAll = "limit-zero-is-all"

// noZeroLimit refuses a --limit given as 0 or less on a command that changes something. Left
// out, --limit is its default (all); given 0, as a script's computed --limit "$N" gives it, it
// must not mean all: it would move a whole dead-letter queue or backlog. dlq list, which moves
// and deletes nothing, takes 0 for all of them, as without --limit, and refuses only less.
// Above 2^31-1 is refused too.
func noZeroLimit(cmd *cobra.Command) error {
	f := cmd.Flags().Lookup("limit")
	if f == nil || !f.Changed {
		return nil
	}
	n, err := cmd.Flags().GetInt("limit")
	if err != nil {
		return err
	}
	if n > math.MaxInt32 {
		// PostgreSQL reads the statements' limits as an integer.
		return usageError{fmt.Sprintf("--limit %d: want at most %d", n, math.MaxInt32)}
	}
	if n > 0 {
		return nil
	}
	if cmd.Annotations[limitZeroIsAll] != "" {
		if n == 0 {
			return nil
		}
		return usageError{fmt.Sprintf("--limit %d: want 0 (all of them, if no more than %d wait) or more", n, mostWithoutLimit)}
	}
	return usageError{fmt.Sprintf("--limit %d: want 1 or more, or leave it out for all", n)}
}

// cli is what every command shares: the streams and the output format.
type cli struct {
	streams
	format *string
}

func (c *cli) json() bool { return *c.format == "json" }

// action makes fn a command's RunE; what it returns is the command's (see commandError).
func action(fn func(ctx context.Context, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		if err := fn(cmd.Context(), args); err != nil {
			return commandError{err}
		}
		return nil
	}
}

// group is a command that only holds others: alone, or with an unknown name, it is a mistake.
func group(use, short string, children ...*cobra.Command) *cobra.Command {
	cmd := &cobra.Command{
		Use:   use,
		Short: short,
		Args:  cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var names []string
			for _, c := range cmd.Commands() {
				names = append(names, c.Name())
			}
			if len(args) == 0 {
				return usageError{fmt.Sprintf("%s needs a command: %s", use, strings.Join(names, ", "))}
			}
			return usageError{fmt.Sprintf("unknown command %q for %s: want %s", printable(args[0], 64), use, strings.Join(names, ", "))}
		},
	}
	cmd.AddCommand(children...)
	return cmd
}

// withTwoDashes adds what was meant to pflag's "unknown shorthand flag: 'd' in -db": a long
// flag with one dash, as Go's flag package (and earlier versions of outboxctl) took it.
func withTwoDashes(msg string) string {
	i := strings.LastIndex(msg, " in -")
	if !strings.HasPrefix(msg, "unknown shorthand flag: ") || i < 0 {
		return msg
	}
	name, _, _ := strings.Cut(msg[i+len(" in -"):], "=")
	if len(name) < 2 {
		return msg
	}
	return msg + "; a long flag takes two dashes: --" + name
}

// confirmBulk is confirm for an action on many items that loses nothing if it was not meant (a
// retry, a redrive: the inbox skips what was handled already). Without a terminal to ask on, as
// in a script that runs the plain command, it goes on, and says so on stderr.
func (c *cli) confirmBulk(ctx context.Context, yes bool, question string) error {
	if !yes && !c.interactive {
		fmt.Fprintf(c.err, "%s: no terminal to ask on; going on (--dry-run lists them first)\n", question)
		return nil
	}
	return c.confirm(ctx, yes, question)
}

// confirm returns nil if the action may go on: --yes was given, or the person at the terminal
// answered yes to question. Without a terminal it refuses, with errNotConfirmed: for an action
// that cannot be undone.
func (c *cli) confirm(ctx context.Context, yes bool, question string) error {
	if yes {
		return nil
	}
	if !c.interactive {
		return fmt.Errorf("%w: %s: there is no terminal to ask on; check with --dry-run, then give --yes", errNotConfirmed, question)
	}
	fmt.Fprintf(c.err, "%s? [y/N] ", question)
	answer := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(c.in).ReadString('\n')
		answer <- line
	}()
	select {
	case <-ctx.Done():
		fmt.Fprintln(c.err)
		return fmt.Errorf("%w: %s: interrupted", errNotConfirmed, question)
	case line := <-answer:
		if a := strings.ToLower(strings.TrimSpace(line)); a == "y" || a == "yes" {
			return nil
		}
		return fmt.Errorf("%w: %s: declined", errNotConfirmed, question)
	}
}

// urlFrom returns the flag's value, or else the environment variable's: one URL, with one of
// schemes, that parse (the client's own parser) accepts. A missing or malformed URL is a usage
// error that names where it came from, never its value: it may hold a password. Malformed
// includes a password with a / ? or # left unescaped (see platform.AtAfterHost), which
// hideSecrets could not find to hide. (A PostgreSQL URL may name several hosts, commas and
// all, or a Unix socket's directory in host=, as the services accept it.)
func urlFrom(flagName, value, variable string, parse func(string) error, schemes ...string) (string, error) {
	one := func(v string) []string { return []string{v} }
	return checkedURLs(flagName, value, variable, one, "a URL", parse, schemes)
}

// urlListFrom is urlFrom for a broker's URL, which may list one URL per node of a cluster,
// comma-separated, as AMQP_URL does.
func urlListFrom(flagName, value, variable string, parse func(string) error, schemes ...string) (string, error) {
	return checkedURLs(flagName, value, variable, platform.SplitURLs, "a URL, or a comma-separated list of URLs,", parse, schemes)
}

// checkedURLs is urlFrom with split cutting the value into the URLs it holds, and what saying
// what it should be.
func checkedURLs(flagName, value, variable string, split func(string) []string, what string, parse func(string) error, schemes []string) (string, error) {
	source := "--" + flagName
	if value == "" {
		value, source = os.Getenv(variable), fmt.Sprintf("%s (the default of --%s)", variable, flagName)
	}
	if value == "" {
		return "", usageError{fmt.Sprintf("no URL: give --%s URL or set %s", flagName, variable)}
	}
	urls := split(value)
	if len(urls) == 0 {
		return "", usageError{fmt.Sprintf("%s names no URL", source)}
	}
	var vhost string
	for i, one := range urls {
		if platform.AtAfterHost(one) {
			return "", usageError{fmt.Sprintf("%s %s", source, platform.AtAfterHostProblem)}
		}
		u, err := url.Parse(one)
		if err != nil || !platform.NamesHost(u) || !slices.Contains(schemes, u.Scheme) || !platform.PortsInRange(u) {
			return "", usageError{fmt.Sprintf("%s is not %s with scheme %s", source, what, strings.Join(schemes, " or "))}
		}
		// A parameter the client refuses (connect_timeout=x, heartbeat=abc) is the command
		// line's mistake too, found before anything is done rather than at the connection.
		if err := parse(one); err != nil {
			return "", usageError{fmt.Sprintf("%s does not parse: %v", source, err)}
		}
		// A list is one cluster's nodes, dialled in random order: entries naming different
		// vhosts would act on whichever answered. The services refuse such a list too.
		if i > 0 && platform.VhostOf(u) != vhost {
			return "", usageError{fmt.Sprintf("%s names different vhosts, %q and %q: every entry must name the same vhost",
				source, printable(vhost, 64), printable(platform.VhostOf(u), 64))}
		}
		vhost = platform.VhostOf(u)
	}
	return value, nil
}

// parsePostgresURL parses rawURL as openDB's pgxpool will. pgx's error quotes the URL, its
// password masked at best: only what is wrong, which follows it, is kept. A certificate it
// names that cannot be read is the environment's fault, not the command line's: openDB meets
// it again and fails with it. (pgx reports a service file it cannot read without the file's
// error, so that is exit 2.)
func parsePostgresURL(rawURL string) error {
	_, err := pgxpool.ParseConfig(rawURL)
	var parseErr *pgconn.ParseConfigError
	if !errors.As(err, &parseErr) {
		return err
	}
	if _, unreadable := errors.AsType[*fs.PathError](err); unreadable {
		return nil
	}
	msg := err.Error()
	if i := strings.LastIndex(msg, "`: "); i >= 0 {
		msg = msg[i+len("`: "):]
	}
	return errors.New(msg)
}

// parseAMQPURL parses one broker URL as the library's dial will. Its errors do not quote the
// URL once net/url has accepted it, as checkedURLs makes sure first.
func parseAMQPURL(rawURL string) error {
	_, err := amqp.ParseURI(rawURL)
	return err
}

// hideSecrets replaces in msg every password of a URL given in args, in DATABASE_URL or in
// AMQP_URL (see platform.MaskPasswords): drivers' errors are not trusted to leave them out.
func hideSecrets(msg string, args []string) string {
	var urls []string
	for _, arg := range append([]string{os.Getenv("DATABASE_URL"), os.Getenv("AMQP_URL")}, args...) {
		values := []string{arg}
		if _, v, ok := strings.Cut(arg, "="); ok { // --db=URL
			values = append(values, v)
		}
		for _, v := range values {
			// Whole, as a PostgreSQL URL of several hosts, and cut at its commas, as a list of
			// brokers' URLs.
			urls = append(append(urls, v), platform.SplitURLs(v)...)
		}
	}
	return platform.MaskPasswords(msg, urls...)
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
