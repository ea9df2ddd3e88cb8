#!/usr/bin/env bash
# The performance figures, each next to a baseline measured in the same run (this machine is
# shared and noisy: the ratio is the figure that counts). Prints one table at the end.
# Needs the local PostgreSQL and RabbitMQ (TEST_DATABASE_URL / TEST_AMQP_URL) and about 4 minutes.
# Exits non-zero when a figure misses its target (the test fails after printing the table) or
# the test fails otherwise: with pipefail the pipeline's status is go test's, and grep's own (1
# when it prints nothing) is left out.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=1 go test -count=1 -run '^TestPerformance$' -v -timeout 40m ./bench/ 2>&1 |
  { grep -vE '^ *(=== RUN|--- PASS|PASS$|ok )' || true; }
