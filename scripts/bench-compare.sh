#!/usr/bin/env bash
# Measures another revision's binaries and this checkout's in one run, phase by phase, with
# this checkout's benchmark, each against the broker compose ships:
#   scripts/bench-compare.sh REV [PHASE_REGEXP]
# e.g. scripts/bench-compare.sh 5a2f3e5 '^(consumer|overload)$'. REV's binaries are built in a
# temporary git worktree. A phase the older binaries cannot run (a variable they do not know, a
# metric they do not export) fails in its own table; the exit status is that of this checkout's
# runs (non-zero if any failed). BENCH_ROUNDS=N repeats the pair N times in alternating order.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/bench-compare.sh REV [PHASE_REGEXP]}
phases=${2:-.}
. scripts/alone.sh
alone scripts/bench-compare.sh
# The broker compose ships, whatever SIDROOT_SUITE a shell holds for the tests.
export SIDROOT_SUITE=sid
work=$(mktemp -d)
# Set before the start: a start that fails half-way may leave its node running.
trap 'alone_end_processes; scripts/sidroot.sh stop; git worktree remove --force "$work/src" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
sidroot_env=$(scripts/sidroot.sh start)
eval "$sidroot_env"
scripts/sidroot.sh compose
git worktree add --detach "$work/src" "$rev" >/dev/null
mkdir "$work/bin"
for svc in order invoicing notification; do
  (cd "$work/src" && GOWORK=off go build -o "$work/bin/$svc" "./services/$svc")
done
run() {
  BENCH=1 go test -count=1 -run "^TestPerformance\$/$phases" -v -timeout 60m ./bench/ 2>&1 |
    { grep -vE '^ *(=== RUN|--- PASS|PASS$|ok )' || true; }
}
before() {
  echo "## before: $(git rev-parse --short "$rev")$1"
  BENCH_BINARIES="$work/bin" run || true
}
after() {
  echo "## after: $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')$1"
  run || status=$?
}
# BENCH_ROUNDS=N measures each side N times, in the order before-after, after-before, ...: the
# machine's speed drifts within minutes, and a pair always run in one order measures the drift
# along with the change.
rounds=${BENCH_ROUNDS:-1}
status=0
for ((i = 1; i <= rounds; i++)); do
  label=$([ "$rounds" -gt 1 ] && echo " (round $i of $rounds)" || true)
  if ((i % 2)); then
    before "$label"
    after "$label"
  else
    after "$label"
    before "$label"
  fi
done
exit "$status"
