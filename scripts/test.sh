#!/usr/bin/env bash
# The one test command (docs/testing.md says what each phase does; .ci/run calls it).
#
# Checks that PostgreSQL and RabbitMQ answer at TEST_DATABASE_URL / TEST_AMQP_URL, starts the
# local ones if they are installed but stopped, drops what killed test runs left on them, then
# runs gofmt, go vet, the linters and promtool. Then the tests, each phase with the race
# detector and a skip report:
#   1. the whole suite against RabbitMQ 4.3, the broker compose ships: a node of its own that
#      scripts/sidroot.sh provisions (once, cached) and starts beside the machine's;
#   2. the library's suite (pkg/messaging/...) against the machine's RabbitMQ (3.10 here),
#      the oldest broker the library supports, with the services' suite and the end-to-end
#      exactly-once and fault tests; and the library's against RabbitMQ 4.0 (Debian 13's,
#      started the same way), between the two;
#   3. alone, the tests that restart the real servers, against each broker in turn.
# Between 2 and 3, a short fuzz pass, with neither.
# In compose mode (TEST_SERVERS=compose) compose's test broker (4.3) stands in for all.
set -euo pipefail
cd "$(dirname "$0")/.."

export TEST_DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}"
export TEST_AMQP_URL="${TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/}"

say() { printf '== %s\n' "$*"; }
die() { printf 'scripts/test.sh: %s\n' "$*" >&2; exit 1; }

# A shell that ran `eval "$(scripts/sidroot.sh env)"` for a focused test would send the machine
# broker's phases to the 4.3 node, under the 3.10 node's name: this run starts its own nodes.
[ -z "${TEST_SIDROOT:-}" ] || die "TEST_SIDROOT is set: this shell holds scripts/sidroot.sh env's variables (TEST_AMQP_URL, TEST_RABBITMQCTL, TEST_SIDROOT, TEST_RABBITMQ_PROMETHEUS_URL); run scripts/test.sh from a shell without them, as it starts its own nodes"

. scripts/servers.sh
. scripts/alone.sh
alone scripts/test.sh

# A `pkill -f scripts/test.sh` (how a CI run is killed) signals the run's shell and every fork of
# it, as they have its command line. A fork dies at once (the EXIT trap is the run's shell's
# alone), and what it ran, re-parented, would escape the walk from $$ that ends the run's
# processes at exit, and go on under the next run's lock. So no shell stands between the run's
# and what it runs: the functions that run a command for it (sidroot, with_broker) become it
# (exec), and are called in a fork only.
forked() { [ "$BASHPID" != "$$" ] || die "$1 was called in the run's own shell, which it would replace"; }

# sidroot sid|trixie ARGS...: becomes scripts/sidroot.sh ARGS for the RabbitMQ 4.3 root (sid) or
# the 4.0 one (trixie). The trixie root runs on its own default directory and ports whatever
# SIDROOT_DIR and the ports say for the 4.3 one: it must not share them.
sidroot() {
  forked sidroot
  if [ "$1" = trixie ]; then
    shift
    exec env -u SIDROOT_DIR -u SIDROOT_AMQP_PORT -u SIDROOT_METRICS_PORT SIDROOT_SUITE=trixie scripts/sidroot.sh "$@"
  fi
  shift
  exec env SIDROOT_SUITE=sid scripts/sidroot.sh "$@"
}

# At exit, whatever ended the run (a failure, a signal): what it started that still runs (on a
# signal bash leaves its commands running, a go test among them), then, if the server restarts
# had begun and not ended (restarting), the servers (restore_servers), then the nodes this run
# started or began to start (a start that failed half-way may leave its node running), and the
# report. Each step runs even if another fails, and none changes the run's exit status; a second
# SIGINT (an impatient Ctrl-C) does not cut it short, as it would leave them running (what the
# cleanup runs inherits SIGINT ignored). Set up before the first command that may be left running.
started=""
restarting=""
report="$(mktemp -d)"
# shellcheck disable=SC2317 # run by the EXIT trap
cleanup() {
  local root
  trap '' INT
  alone_end_processes
  [ -z "$restarting" ] || restore_servers || true
  for root in $started; do
    (sidroot "$root" stop) || printf 'scripts/test.sh: could not stop the %s node (scripts/sidroot.sh stop)\n' "$root" >&2
  done
  rm -rf "$report"
}
trap cleanup EXIT
# A SIGINT to the run's pid alone (not to its process group, as a terminal's Ctrl-C is) would be
# lost: bash lets the foreground command go on, and carries on when it ends unsignalled. Trapped,
# it ends the run once that command ends, or at once while a `wait` waits (interruptible, below).
# SIGTERM ends the run at once as it is (bash runs the EXIT trap, then dies).
trap 'trap "" INT; exit 130' INT

# interruptible COMMAND...: COMMAND (a program, or a function that becomes one) in the background,
# waited for, so that a SIGINT ends the run at once. Bash starts it with SIGINT ignored; the
# cleanup ends it with SIGTERM.
interruptible() { "$@" & wait $!; }

# retry DESCRIPTION COMMAND...: runs COMMAND up to 3 times, 15 s then 30 s apart, for the steps
# that download: cmd/go does not retry a failed fetch from the module proxy, and a fresh machine
# fetches every module and tool. A failure that is not the network's fails 3 times, as it would once.
retry() {
  local what=$1 try; shift
  for try in 1 2 3; do
    interruptible "$@" && return 0
    [ "$try" = 3 ] || { say "$what failed (try $try of 3); trying again in $((try * 15)) s" >&2; interruptible sleep $((try * 15)); }
  done
  die "$what failed 3 times"
}

wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...
  local secs=$1 what=$2; shift 2
  for _ in $(seq "$secs"); do "$@" && return 0; sleep 1; done
  die "$what did not come up within ${secs}s"
}

ensure_postgres() {
  command -v pg_isready >/dev/null || die "PostgreSQL client tools (pg_isready) are not installed; install PostgreSQL 15+ or point TEST_DATABASE_URL at a reachable server"
  pg_ready && return 0
  is_local "$TEST_DATABASE_URL" || die "PostgreSQL does not answer at $(host_port "$TEST_DATABASE_URL") (TEST_DATABASE_URL)"
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ] && [ -n "$(ls /etc/postgresql)" ]; then
    say "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
    wait_for 60 PostgreSQL pg_ready
  else
    die "PostgreSQL does not answer at $(host_port "$TEST_DATABASE_URL") and no local cluster is installed (pg_ctlcluster); install PostgreSQL or set TEST_DATABASE_URL"
  fi
}

ensure_rabbitmq() {
  if ! rabbit_ready; then
    is_local "$TEST_AMQP_URL" || die "RabbitMQ does not answer at $(host_port "$TEST_AMQP_URL") (TEST_AMQP_URL)"
    command -v rabbitmqctl >/dev/null || die "RabbitMQ does not answer at $(host_port "$TEST_AMQP_URL") and is not installed here (rabbitmq-server); install RabbitMQ 3.10+ (4.x in the compose files; the phases against the machine's RabbitMQ stand for 3.10: with another version, set TEST_MACHINE_RABBITMQ to its major.minor) or set TEST_AMQP_URL"
    if timeout 30 rabbitmqctl -q ping >/dev/null 2>&1; then
      say "starting the RabbitMQ application (the node runs, the app was stopped)"
      rabbitmqctl -q start_app
    else
      say "starting RabbitMQ"
      rabbitmq-server -detached
    fi
    timeout 120 rabbitmqctl -q await_startup >/dev/null 2>&1 || true
    wait_for 60 RabbitMQ rabbit_ready
  fi
  no_rabbit_alarm
}

# rabbit_alarm_clear succeeds while the machine's broker has no alarm, and prints what it
# reports. check_alarms, not check_local_alarms: RabbitMQ 4.3's checks nothing.
rabbit_alarm_clear() { timeout 60 rabbitmq-diagnostics -q check_alarms 2>&1; }

# no_rabbit_alarm fails the run while the machine's broker has an alarm: it blocks every
# publisher, and the suite would fail without saying why. A memory alarm may be a test's: those
# that raise one (pkg/messaging/test's restart tests) set the watermark to 0 and set it back in
# a cleanup that a killed test binary does not run, and the node keeps it until it restarts.
# That one, when it is the only alarm, is undone here: the node's configured watermark (its
# application environment, which setting it at run time leaves as it was) set again. Beside
# another, the run stops at once, naming them. (The nodes of scripts/sidroot.sh start afresh
# each run.)
no_rabbit_alarm() {
  local alarms line memory="" others="" was configured
  alarms=$(rabbit_alarm_clear) && return 0
  # One line an alarm ("Memory alarm on node …", "Free disk space alarm on node …", "File
  # descriptor limit alarm on node …"): only a memory alarm alone is undone.
  while IFS= read -r line; do
    case "$line" in
      *"Memory alarm on node"*) memory=1 ;;
      *" alarm on node"*) others+="${others:+; }$line" ;;
    esac
  done <<<"$alarms"
  [ -z "$others" ] || die "RabbitMQ reports an alarm the tests do not raise, which is not theirs to undo: $others (rabbitmq-diagnostics check_alarms: $alarms)"
  [ -n "$memory" ] || die "RabbitMQ reports an alarm, or could not be asked (rabbitmq-diagnostics check_alarms): $alarms"
  was=$(timeout 60 rabbitmqctl -q eval 'vm_memory_monitor:get_vm_memory_high_watermark().' 2>&1) ||
    die "RabbitMQ has a memory alarm, and rabbitmqctl could not read its watermark: $was"
  configured=$(timeout 60 rabbitmqctl -q eval '{ok, W} = application:get_env(rabbit, vm_memory_high_watermark), ok = vm_memory_monitor:set_vm_memory_high_watermark(W), W.' 2>&1) ||
    die "RabbitMQ has a memory alarm (watermark $was), and rabbitmqctl could not set its configured watermark again: $configured"
  say "RabbitMQ had a memory alarm at a watermark of $was (a test binary killed before its cleanup leaves 0); set back to the node's configured $configured"
  for _ in $(seq 30); do
    alarms=$(rabbit_alarm_clear) && return 0
    sleep 1
  done
  die "RabbitMQ keeps its memory alarm at its configured watermark ($configured): this machine is short of memory for it ($alarms)"
}

# restore_servers, in the cleanup of a run that ended (a signal, a failure) during the server
# restarts: the checks that end a run, so that the servers are up as they would leave them. The
# restart tests start the servers again in cleanups of their own, which a test binary ended by
# the run's cleanup does not run: the machine's RabbitMQ app stopped, PostgreSQL stopped or a
# memory watermark of 0 would stay until the next run's checks. Best effort, and bounded: each
# server's check in a fork of its own (one that fails says why, and the other goes on), for
# 60 s at most; what they still run then is ended as the run's processes are. (A fork has the
# run's command line: a second `pkill -f scripts/test.sh` meanwhile ends it.)
# shellcheck disable=SC2317 # run by the EXIT trap
restore_servers() {
  local -a checks=()
  local pid until=$((SECONDS + 60))
  say "the run ended during the server restarts, whose tests start the servers again in cleanups an ended test binary does not run: checking them (60 s at most)"
  if [ "$mode" = compose ]; then
    (compose_servers) &
    checks+=("$!")
  else
    (ensure_postgres) &
    checks+=("$!")
    (ensure_rabbitmq) &
    checks+=("$!")
  fi
  while alone_running "${checks[@]}" >/dev/null && [ "$SECONDS" -lt "$until" ]; do sleep 0.1; done
  if alone_running "${checks[@]}" >/dev/null; then
    printf 'scripts/test.sh: the checks of the servers did not end within 60 s; ending them\n' >&2
    alone_end_processes
  fi
  for pid in "${checks[@]}"; do
    wait "$pid" || printf 'scripts/test.sh: a server may be left down (stopped by a restart test the run ended); the next run checks it again\n' >&2
  done
}

# The test servers of deploy/compose.test.yml, started unless they answer already.
compose_servers() {
  command -v docker >/dev/null || die "TEST_SERVERS=compose needs Docker"
  if ! pg_ready || ! rabbit_ready; then
    say "starting the test servers: docker compose -f $compose_test_file up -d --wait"
    docker compose -f "$compose_test_file" up -d --wait
  fi
  wait_for 60 PostgreSQL pg_ready
  wait_for 60 RabbitMQ rabbit_ready
}

command -v go >/dev/null || die "Go is not installed (need Go 1.26)"
env --default-signal=INT --version >/dev/null 2>&1 || die "env does not take --default-signal (need GNU coreutils 8.31 or later)"
mode_and_why=$(servers_mode) || exit 1
mode=${mode_and_why%%:*}
say "test servers: $mode_and_why"
# Every skip is printed with its reason, and one whose reason is not one of these, word for
# word, fails the run: a test that silently stopped running is a guarantee nobody checks, and a
# reason matched in part would pass any skip that mentions one. They are the reasons the tests'
# t.Skip calls give (the table in docs/testing.md): a test that rewords one fails here until
# this list follows.
restart_reasons=( # the skips phase 3 runs
  'restarts the shared servers; set TEST_SERVER_RESTARTS=1 and run alone (scripts/test.sh does)'
  'restarts the shared PostgreSQL; set TEST_SERVER_RESTARTS=1 and run alone'
)
allowed_skips=(
  'a 5 min broker outage, about 6 min in all: set TEST_LONG=1 to run it'
  'the benchmark suite takes minutes; run scripts/bench.sh (BENCH=1)'
  'starts a three-node RabbitMQ cluster (scripts/cluster.sh); set TEST_CLUSTER=1'
  "${restart_reasons[@]}"
)
restart_allowed=() # the skips allowed in phase 3 itself
if [ "$mode" = compose ]; then
  # The tests that need pg_ctlcluster on this host skip, saying so; nowhere else may they. So
  # does the one that needs the Prometheus of scripts/sidroot.sh's root (TEST_SIDROOT), which
  # this mode does not start.
  export TEST_SERVERS=compose
  compose_skip='restarts PostgreSQL with pg_ctlcluster, which this host lacks: the test servers run in deploy/compose.test.yml (TEST_SERVERS=compose)'
  # shellcheck disable=SC2016 # the reason's own words, not an expansion
  allowed_skips+=("$compose_skip"
    'needs a real Prometheus: set TEST_SIDROOT (eval "$(scripts/sidroot.sh env)"), whose Debian unstable root has Prometheus 3.5')
  restart_allowed=("$compose_skip")
  compose_servers
else
  ensure_postgres
  ensure_rabbitmq
fi
say "PostgreSQL and RabbitMQ answer"
# testreport takes each reason in a flag of its own.
allow=() collect=() restart_allow=()
for r in "${allowed_skips[@]}"; do allow+=(-allow "$r"); done
for r in "${restart_reasons[@]}"; do collect+=(-collect "$r"); done
for r in "${restart_allowed[@]}"; do restart_allow+=(-allow "$r"); done

# A test binary killed by its -timeout runs none of its cleanups, and what it made stays on the
# servers, run after run: its databases (testenv's test_ and example_, each with 12 hex digits)
# and its vhosts (e2e_, example_, perms_ and topology_, each with 12: systest's, the examples',
# deploy's and the library's tests'). Dropped here, under the lock, before this run makes its
# own; only those nobody is connected to (a killed binary's connections are gone), so a
# `go test` run beside this one usually keeps its own (not one made but not yet connected to),
# and one it cannot drop (gone meanwhile, say) is a warning.
# (The nodes of scripts/sidroot.sh start on a fresh data directory. The library's queues,
# exchanges, users and policies in the vhost / are not swept: a killed run leaves them.)
if [ "$mode" = compose ]; then
  admin_psql() { docker compose -f "$compose_test_file" exec -T postgres psql -U postgres -d postgres "$@"; }
  admin_ctl() { docker compose -f "$compose_test_file" exec -T rabbitmq rabbitmqctl "$@"; }
else
  command -v psql >/dev/null || die "psql is not installed (the PostgreSQL client, with pg_isready); install it"
  admin_psql() { psql "$TEST_DATABASE_URL" "$@"; }
  admin_ctl() { rabbitmqctl "$@"; }
fi
leftover_dbs=$(admin_psql -qAtX -c "SELECT datname FROM pg_database d WHERE datname ~ '^(test|example)_[0-9a-f]{12}\$'
  AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname)") ||
  die "could not list the databases (psql)"
leftover_vhosts=$(admin_ctl -q list_vhosts --no-table-headers name) || die "could not list the vhosts (rabbitmqctl list_vhosts)"
in_use=$(admin_ctl -q list_connections --no-table-headers vhost) || die "could not list the connections (rabbitmqctl list_connections)"
leftover_vhosts=$(printf '%s\n' "$leftover_vhosts" | grep -E '^(e2e|example|perms|topology)_[0-9a-f]{12}$' |
  grep -vxF -f <(printf '%s\n' "$in_use") || true)
dropped_dbs=0 dropped_vhosts=0
for db in $leftover_dbs; do
  if out=$(admin_psql -qX -c "DROP DATABASE IF EXISTS $db" 2>&1); then
    dropped_dbs=$((dropped_dbs + 1))
  else
    echo "warning: could not drop the leftover database $db: $out" >&2
  fi
done
for vhost in $leftover_vhosts; do
  if out=$(admin_ctl -q delete_vhost "$vhost" 2>&1); then
    dropped_vhosts=$((dropped_vhosts + 1))
  else
    echo "warning: could not delete the leftover vhost $vhost: $out" >&2
  fi
done
say "left by earlier runs: dropped $dropped_dbs test databases and $dropped_vhosts test vhosts"

say "gofmt"
unformatted=$(gofmt -l .)
[ -z "$unformatted" ] || die "gofmt would change: $unformatted"

# The library and its drivers, their tests and the examples are modules of their own (go.work
# joins them): ./... stops at a module's boundary, their import paths do not.
library_packages=github.com/outboxkit/outbox-inbox/pkg/messaging/...
example_packages=github.com/outboxkit/outbox-inbox/examples/...

# Every module the builds below need, fetched once here where a transient failure is retried
# (go vet, the linters and go test would each fail on it).
retry "fetching the modules (go list -deps -test)" go list -deps -test ./... "$library_packages" "$example_packages" >/dev/null

say "go vet"
interruptible go vet ./... "$library_packages" "$example_packages"

# golangci-lint, pinned (.golangci.yml holds the linters). Installed from the Go module proxy
# into GOPATH/bin the first time, which takes a few minutes; later runs reuse it.
GOLANGCI_LINT_VERSION=2.15.0
lint="$(go env GOPATH)/bin/golangci-lint"
if ! "$lint" version 2>/dev/null | grep -q "version $GOLANGCI_LINT_VERSION "; then
  say "installing golangci-lint v$GOLANGCI_LINT_VERSION"
  # GOBIN set: go install puts it where $lint looks, whatever GOBIN the environment has.
  retry "installing golangci-lint v$GOLANGCI_LINT_VERSION from the Go module proxy" \
    env GOBIN="$(dirname "$lint")" go install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v$GOLANGCI_LINT_VERSION"
  "$lint" version 2>/dev/null | grep -q "version $GOLANGCI_LINT_VERSION " || die "$lint is not golangci-lint v$GOLANGCI_LINT_VERSION after installing it"
fi
say "golangci-lint (every module of go.work)"
# Each module is linted from its own directory: ./... stops at a module's boundary. The list is
# read first: a failing command substitution in a for loop's word list is not caught by set -e,
# and would lint nothing and pass.
modules=$(go list -m -f '{{.Dir}}')
[ -n "$modules" ] || die "go list -m named no module to lint"
for module in $modules; do
  (cd "$module" && exec "$lint" run ./...) &
  wait $!
done

# promtool, pinned to the Prometheus release the observability profile runs: Prometheus
# 3.16.0 is Go module version 0.316.0 (deploy/observability_test.go holds docker-compose.yml's
# prom/prometheus image to it). Installed the same way, from the Go module proxy into
# GOPATH/bin the first time; later runs reuse it. The remove_all_sd build tag (Prometheus
# 3.10+) leaves out the service discovery providers and their cloud SDKs: that halves the
# build, to about 8 CPU-minutes (18 minutes here on 2 busy cores, against 43 without the tag).
# enable_dns_sd keeps the one prometheus.yml uses (the cluster profile's replicas, found through
# Docker's DNS). Every run checks the Prometheus configuration and the alert rules and runs the
# rules' unit tests; without promtool the run fails.
PROMTOOL_VERSION=0.316.0
PROMTOOL_TAGS=remove_all_sd,enable_dns_sd
PROMTOOL="$(go env GOPATH)/bin/promtool"
export PROMTOOL
promtool_build() {
  go version -m "$PROMTOOL" 2>/dev/null | awk '$1 == "mod" { v = $3 } $1 == "build" && $2 ~ /^-tags=/ { t = substr($2, 7) } END { print v " " t }'
}
if [ "$(promtool_build)" != "v$PROMTOOL_VERSION $PROMTOOL_TAGS" ]; then
  say "installing promtool v$PROMTOOL_VERSION (Prometheus 3.${PROMTOOL_VERSION#0.3}), tags $PROMTOOL_TAGS"
  retry "installing promtool v$PROMTOOL_VERSION from the Go module proxy (it checks deploy/prometheus)" \
    env GOBIN="$(dirname "$PROMTOOL")" go install -tags "$PROMTOOL_TAGS" "github.com/prometheus/prometheus/cmd/promtool@v$PROMTOOL_VERSION"
  [ "$(promtool_build)" = "v$PROMTOOL_VERSION $PROMTOOL_TAGS" ] || die "$PROMTOOL is not promtool v$PROMTOOL_VERSION with tags $PROMTOOL_TAGS after installing it"
fi
say "promtool: Prometheus configuration, alert rules and their tests"
"$PROMTOOL" check config deploy/prometheus/prometheus.yml
"$PROMTOOL" check rules deploy/prometheus/alerts.yml
"$PROMTOOL" test rules deploy/prometheus/alerts_test.yml

machine_amqp_url=$TEST_AMQP_URL
# The RabbitMQ the phases against the machine's broker stand for: the oldest the library
# supports. A machine with another may name its major.minor here to run them all the same.
machine_rabbitmq=${TEST_MACHINE_RABBITMQ:-3.10}
sidroot_env=""
trixie_env=""
interruptible go build -o "$report/testreport" ./internal/testreport
interruptible go test -c -o "$report/brokercheck" ./internal/testenv

if [ "$mode" = local ]; then
  say "RabbitMQ 4.3 beside the machine's broker (scripts/sidroot.sh; the first run provisions it)"
  started=sid
  interruptible sidroot sid start >"$report/sid.env" || die "could not start RabbitMQ 4.3 (scripts/sidroot.sh start)"
  sidroot_env=$(<"$report/sid.env")
  say "$(sidroot sid version | tr '\n' ' ')"
  # The phases against "4.3" stand for compose's broker: as scripts/bench.sh does, fail on a
  # root whose RabbitMQ is another major.minor (Debian unstable moved on) rather than test that.
  compose_rabbitmq=$(sidroot sid compose) ||
    die "the sid root's RabbitMQ is not the major.minor docker-compose.yml ships (scripts/sidroot.sh compose, above): the suite would not run against compose's broker"
  say "$compose_rabbitmq"
fi
# with_broker 4.3|4.0|machine COMMAND...: becomes COMMAND against that broker (see forked), with
# TEST_WANT_RABBITMQ the version prefix it stands for (in compose mode compose's 4.3 stands for
# all), which broker_version checks. SIGINT is set back to its default (GNU env 8.31+), which a
# background command's is not: the tests, and what they run, get it as a foreground command would.
with_broker() {
  forked with_broker
  export TEST_WANT_RABBITMQ=$1.
  [ "$1" != machine ] || TEST_WANT_RABBITMQ=$machine_rabbitmq.
  if [ "$1" = 4.3 ] && [ -n "$sidroot_env" ]; then
    eval "$sidroot_env"
  elif [ "$1" = 4.0 ]; then
    eval "$trixie_env"
  else
    export TEST_AMQP_URL="$machine_amqp_url"
    unset TEST_RABBITMQCTL TEST_SIDROOT TEST_RABBITMQ_PROMETHEUS_URL
  fi
  shift
  exec env --default-signal=INT "$@"
}

# broker_version BROKER sets version to the version BROKER's server gave in the AMQP handshake,
# and fails the run unless it is the one the phases against BROKER stand for: called before each
# phase, so that one whose URL reached another broker (the machine's upgraded, say) does not
# pass while testing that version no longer. The check is internal/testenv's test, built above.
# It runs in the run's shell, not in a command substitution's fork (see forked).
broker_version() {
  local out minor re=': the broker at [^[:space:]]+ is RabbitMQ ([^[:space:],]+)'
  if ! out=$(with_broker "$1" "$report/brokercheck" -test.run '^TestTheBrokerIsTheRabbitMQTheRunWants$' -test.v 2>&1); then
    printf '%s\n' "$out" >&2
    # The machine's broker is whatever RabbitMQ the machine has: TEST_MACHINE_RABBITMQ, not the
    # TEST_WANT_RABBITMQ the test names (with_broker sets it from that), lets it stand for them.
    if [ "$1" = machine ] && [[ $out =~ $re ]]; then
      version=${BASH_REMATCH[1]} minor=X.Y
      [[ ! $version =~ ^[0-9]+\.[0-9]+ ]] || minor=${BASH_REMATCH[0]}
      die "the machine's RabbitMQ is $version, not the $machine_rabbitmq these phases stand for; set TEST_MACHINE_RABBITMQ=$minor to run them against it anyway"
    fi
    die "the broker of the phases against $1 is not the RabbitMQ they stand for"
  fi
  version=$(printf '%s\n' "$out" | sed -n 's/.*: the broker at [^ ]* is RabbitMQ //p')
  [ -n "$version" ] || { printf '%s\n' "$out" >&2; die "internal/testenv's TestTheBrokerIsTheRabbitMQTheRunWants did not name the broker's version: was it renamed?"; }
}

# suite BROKER PACKAGES...: the parallel suite against BROKER, adding the tests it skipped for
# phase 3 to $report/restarts-BROKER. Its pipelines, here and below, run in the background and
# are waited for, as interruptible's commands are: with pipefail, wait gives the pipeline's status.
# The -timeout is each package's, and ./e2e/ sets it: it took 711 s of 15 min in a clean run,
# its systems (45 connections each, TestReplicasUnderLoad's 79) taking turns in the budget of
# 87 (max_connections 100) with no queue to keep smaller reservations from going first
# (internal/testenv/budget.go), so 25 min leaves it room for a slower machine or a longer wait.
suite() {
  local broker=$1; shift
  with_broker "$broker" go test -json -race -count=1 -timeout 25m "$@" |
    "$report/testreport" "${allow[@]}" "${collect[@]}" -skipped "$report/restarts-$broker" &
  wait $!
}

# The end-to-end tests of exactly once and of faults, run against the machine's broker as well:
# the services over the oldest broker the library supports. The rest of ./e2e/ runs against 4.3
# only: the walkthrough and the trace take the same paths as these, the configuration errors
# reach no broker, the alerts need 4.3's Prometheus, the server restarts run alone.
machine_e2e_tests='TestReplicasUnderLoad|TestKilledServicesUnderLoad|TestGracefulShutdownUnderLoad|TestPoisonMessagesAreDeadLettered|TestBrokerOutage60s|TestAConsumerThatStartsLastMissesNothing'

broker_version 4.3
say "go test -race, the whole suite, against RabbitMQ 4.3 ($version)"
suite 4.3 ./... "$library_packages" "$example_packages"
if [ "$mode" = local ]; then
  broker_version machine
  say "go test -race, the library's suite ($library_packages), against the machine's RabbitMQ ($version)"
  suite machine $library_packages
  say "go test -race, the services' suite and the end-to-end exactly-once and fault tests, against the machine's RabbitMQ"
  suite machine ./services/...
  # Each of these tests must run: none may skip. The -timeout is suite's: these systems take
  # turns in the same connection budget (TestReplicasUnderLoad's 79 among them).
  with_broker machine go test -json -race -count=1 -timeout 25m -run "^($machine_e2e_tests)\$" ./e2e/ |
    "$report/testreport" -want "$(printf '%s' "$machine_e2e_tests" | awk -F'|' '{ print NF }')" &
  wait $!
  say "RabbitMQ 4.0 beside them (SIDROOT_SUITE=trixie scripts/sidroot.sh; the first run provisions it)"
  started="$started trixie"
  interruptible sidroot trixie start >"$report/trixie.env" || die "could not start RabbitMQ 4.0 (SIDROOT_SUITE=trixie scripts/sidroot.sh start)"
  trixie_env=$(<"$report/trixie.env")
  say "$(sidroot trixie version | tr '\n' ' ')"
  trixie_rabbitmq=$(sidroot trixie version | awk '$1 == "rabbitmq-server" { print $2 }') ||
    die "could not read the trixie root's RabbitMQ version (SIDROOT_SUITE=trixie scripts/sidroot.sh version)"
  case "$trixie_rabbitmq" in
    4.0.*) ;;
    *) die "the trixie root's RabbitMQ is ${trixie_rabbitmq:-not installed}, not 4.0: the library's suite would not run against the 4.0 it names" ;;
  esac
  broker_version 4.0
  say "go test -race, the library's suite, against RabbitMQ 4.0 ($version)"
  suite 4.0 $library_packages
fi

say "go test -fuzz (order command decoder and validator, briefly)"
interruptible go test -run '^$' -fuzz '^FuzzDecodePlaceOrder$' -fuzztime "${FUZZ_TIME:-10s}" ./services/order

# These stop RabbitMQ and restart PostgreSQL: nothing else may run meanwhile (one package at a
# time, after the suites). They are exactly the tests the parallel phases skipped for
# TEST_SERVER_RESTARTS, whatever their names, and each must run here. They start the servers
# again in their cleanup; we check once more anyway (and so does the run's cleanup, if a signal
# or a failure ends the run before that: restarting).
status=0
restarting=1
for broker in 4.3 4.0 machine; do
  [ -f "$report/restarts-$broker" ] || continue
  broker_version "$broker"
  say "go test -race (server restarts, alone), against $( [ "$broker" = machine ] && echo "the machine's RabbitMQ" || echo "RabbitMQ $broker") ($version)"
  [ -s "$report/restarts-$broker" ] || die "the parallel phase against $broker skipped no server-restart test: were they renamed or removed?"
  while read -r pkg pattern; do
    want=$(printf '%s' "$pattern" | awk -F'|' '{ print NF }')
    with_broker "$broker" env TEST_SERVER_RESTARTS=1 go test -json -race -count=1 -p 1 -timeout 10m -run "$pattern" "$pkg" </dev/null |
      "$report/testreport" -want "$want" "${restart_allow[@]}" &
    wait $! || status=$?
  done < "$report/restarts-$broker"
done
if [ "$mode" = compose ]; then compose_servers; else ensure_postgres; ensure_rabbitmq; fi
restarting=""
exit "$status"
