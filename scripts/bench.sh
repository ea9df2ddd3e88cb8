#!/usr/bin/env bash
# The performance figures, each next to a baseline measured in the same run (this machine is
# shared and noisy: the ratio is the figure that counts). Prints one table at the end.
# Runs against the RabbitMQ compose ships (scripts/sidroot.sh starts it afresh, and stops it at
# the end) and the local PostgreSQL (TEST_DATABASE_URL). Takes about 10 minutes; BENCH_PHASES (a regexp of phase names:
# relay, post, latency-notify, overload, consumer, consumer-notification, sender, ...) runs
# some of them.
# Exits non-zero when a figure misses its target (the test fails after printing the table) or
# the test fails otherwise: with pipefail the pipeline's status is go test's, and grep's own (1
# when it prints nothing) is left out.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/alone.sh
alone scripts/bench.sh
# The broker compose ships, whatever SIDROOT_SUITE a shell holds for the tests.
export SIDROOT_SUITE=sid
# Set before the start: a start that fails half-way may leave its node running. First ends what
# the run still runs (on a signal bash leaves go test running, which would outlive the lock).
trap 'alone_end_processes; scripts/sidroot.sh stop' EXIT
sidroot_env=$(scripts/sidroot.sh start)
eval "$sidroot_env"
scripts/sidroot.sh compose
BENCH=1 go test -count=1 -run "^TestPerformance\$/${BENCH_PHASES:-.}" -v -timeout 60m ./bench/ 2>&1 |
  { grep -vE '^ *(=== RUN|--- PASS|PASS$|ok )' || true; }
