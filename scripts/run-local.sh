#!/usr/bin/env bash
# Runs the whole system without Docker, against a local PostgreSQL and RabbitMQ:
# creates the three databases if missing, builds the three services, starts them with
# prefixed logs (also kept in .run/<service>.log) and stops them all on Ctrl-C.
#
#   scripts/run-local.sh
#   PG_URL=postgres://postgres@127.0.0.1:5432 AMQP_URL=amqp://guest:guest@127.0.0.1:5672/ scripts/run-local.sh
#
# Without SMTP_ADDR the notification service "delivers" confirmations to its log; set
# SMTP_ADDR=127.0.0.1:1025 to send them to a local Mailpit.
set -euo pipefail
cd "$(dirname "$0")/.."

PG_URL="${PG_URL:-postgres://postgres@127.0.0.1:5432}"
AMQP_URL="${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/}"
LOG_LEVEL="${LOG_LEVEL:-info}"

command -v psql >/dev/null || { echo "run-local: psql not found (install the PostgreSQL client)" >&2; exit 1; }
# The services are the folders of services/, each with a database <name>_db.
services=$(cd services && for d in */; do if [ -f "$d/main.go" ]; then printf "%s " "${d%/}"; fi; done)
for s in $services; do
  db="${s}_db"
  if [ "$(psql "$PG_URL/postgres?sslmode=disable" -qAtc "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]; then
    psql "$PG_URL/postgres?sslmode=disable" -qc "CREATE DATABASE $db"
    echo "run-local: created database $db"
  fi
done

mkdir -p bin .run
for s in $services; do
  go build -o "bin/$s" "./services/$s"
done

pids=()
stop() {
  trap - INT TERM EXIT
  [ ${#pids[@]} -gt 0 ] && kill -TERM "${pids[@]}" 2>/dev/null || true
  wait || true
  echo "run-local: stopped"
}
trap stop INT TERM EXIT

# start NAME VAR=VALUE...: runs bin/NAME with its output prefixed by [NAME].
start() {
  local name=$1; shift
  env "$@" "bin/$name" > >(sed -u "s/^/[$name] /" | tee ".run/$name.log") 2>&1 &
  pids+=($!)
}

wait_ready() {
  local name=$1 url=$2
  for _ in $(seq 60); do
    curl -fsS "$url/readyz" >/dev/null 2>&1 && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "run-local: $name exited; see .run/$name.log" >&2; exit 1; }
    sleep 0.5
  done
  echo "run-local: $name not ready after 30 s" >&2
  exit 1
}

common=(AMQP_URL="$AMQP_URL" LOG_LEVEL="$LOG_LEVEL")
# Any order works (each service declares the whole topology); consumers first only so that the
# walkthrough's first order finds them ready.
start invoicing "${common[@]}" DATABASE_URL="$PG_URL/invoicing_db?sslmode=disable" HTTP_ADDR=127.0.0.1:8081
wait_ready invoicing http://127.0.0.1:8081
start notification "${common[@]}" DATABASE_URL="$PG_URL/notification_db?sslmode=disable" HTTP_ADDR=127.0.0.1:8082 SMTP_ADDR="${SMTP_ADDR:-}"
wait_ready notification http://127.0.0.1:8082
start order "${common[@]}" DATABASE_URL="$PG_URL/order_db?sslmode=disable" HTTP_ADDR=127.0.0.1:8080
wait_ready order http://127.0.0.1:8080

cat <<MSG
run-local: all three services are ready.
  place an order:  curl -i -X POST localhost:8080/orders -H 'Content-Type: application/json' \\
                     -d '{"customer_id":"c-42","lines":[{"sku":"SKU-1","quantity":2,"unit_price_cents":1250}]}'
  invoices:        curl localhost:8081/invoices
  notifications:   curl localhost:8082/notifications
  the experiment:  scripts/walkthrough.sh   (in another terminal)
Ctrl-C stops everything.
MSG
wait
