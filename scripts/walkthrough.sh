#!/usr/bin/env bash
# The seeds' experiment against a running system, in plain words:
#   1. place 3 orders            => 3 invoices and 3 confirmations
#   2. reset one outbox row      => the consumers log the duplicate; the counts stay 3
#   3. stop the broker for ~8 s while placing orders, start it again
#                                => every order is invoiced and confirmed exactly once
# It exits non-zero if any expectation fails.
#
# Works against `docker compose up` (the default when its services run) or
# scripts/run-local.sh (WALKTHROUGH_MODE=local). Needs curl; psql in local mode.
set -euo pipefail
cd "$(dirname "$0")/.."

ORDER_URL="${ORDER_URL:-http://localhost:8080}"
INVOICING_URL="${INVOICING_URL:-http://localhost:8081}"
NOTIFICATION_URL="${NOTIFICATION_URL:-http://localhost:8082}"
ORDER_DATABASE_URL="${ORDER_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/order_db?sslmode=disable}"
OUTAGE_SECONDS="${OUTAGE_SECONDS:-8}"

if [ -z "${WALKTHROUGH_MODE:-}" ]; then
  if command -v docker >/dev/null && docker compose ps --status running --services 2>/dev/null | grep -qx order; then
    WALKTHROUGH_MODE=compose
  else
    WALKTHROUGH_MODE=local
  fi
fi

say()  { printf '\n== %s\n' "$*"; }
info() { printf '   %s\n' "$*"; }
fail() { printf '\nFAILED: %s\n' "$*" >&2; exit 1; }

order_sql() {
  if [ "$WALKTHROUGH_MODE" = compose ]; then
    docker compose exec -T postgres psql -U order -d order_db -qAtc "$1"
  else
    psql "$ORDER_DATABASE_URL" -qAtc "$1"
  fi
}
broker() { # broker stop|start
  if [ "$WALKTHROUGH_MODE" = compose ]; then
    docker compose "$1" rabbitmq >/dev/null
  else
    rabbitmqctl -q "${1}_app"
  fi
}

service_logs() { # service_logs NAME -> the service's log so far
  if [ "$WALKTHROUGH_MODE" = compose ]; then
    docker compose logs --no-color --no-log-prefix "$1" 2>/dev/null
  elif [ -f ".run/$1.log" ]; then
    sed -E 's/^\[[a-z]+\] //' ".run/$1.log"
  fi
}
show_log() { # show_log NAME TEXT [TEXT]: print the service's last log line holding both, if its log is at hand
  local line
  line=$(service_logs "$1" | grep -F -- "$2" | grep -F -- "${3:-$2}" | tail -n1 || true)
  if [ -n "$line" ]; then info "  [$1] $line"; else info "  ($1's log is not at hand here; look for: $2 ${3:-})"; fi
}

place_order() { # place_order CUSTOMER -> prints the order id
  local out
  out=$(curl -sS -w '\n%{http_code}' -X POST "$ORDER_URL/orders" -H 'Content-Type: application/json' \
    -d "{\"customer_id\":\"$1\",\"lines\":[{\"sku\":\"SKU-1\",\"quantity\":2,\"unit_price_cents\":1250}]}")
  [ "$(tail -n1 <<<"$out")" = 201 ] || fail "POST /orders answered $(tail -n1 <<<"$out"): $(head -n1 <<<"$out")"
  head -n1 <<<"$out" | sed -E 's/.*"id":"([0-9a-f-]{36})".*/\1/'
}

count() { # count URL -> number of items in the JSON array it returns
  curl -fsS "$1" | grep -o '"order_id"' | wc -l | tr -d ' '
}
invoices_of()      { count "$INVOICING_URL/invoices?order_id=$1"; }
confirmations_of() { curl -fsS "$NOTIFICATION_URL/notifications?order_id=$1" | grep -o '"status":"sent"' | wc -l | tr -d ' '; }
duplicates() { # duplicates URL CONSUMER -> inbox_duplicates_total of that consumer
  curl -fsS "$1/metrics" | awk -v c="inbox_duplicates_total{consumer=\"$2\"}" '$1 == c { print $2; found=1 } END { if (!found) print 0 }'
}

# wait_exactly_once SECONDS ID... : every order gets one invoice and one sent confirmation.
wait_exactly_once() {
  local secs=$1; shift
  local deadline=$((SECONDS + secs)) id bad
  while :; do
    bad=""
    for id in "$@"; do
      if [ "$(invoices_of "$id")" != 1 ] || [ "$(confirmations_of "$id")" != 1 ]; then bad=$id; break; fi
    done
    [ -z "$bad" ] && return 0
    [ $SECONDS -ge $deadline ] && fail "order $bad has $(invoices_of "$bad") invoice(s) and $(confirmations_of "$bad") sent confirmation(s), want 1 and 1"
    sleep 0.5
  done
}

say "Mode: $WALKTHROUGH_MODE. Checking the three services are ready"
for url in "$ORDER_URL" "$INVOICING_URL" "$NOTIFICATION_URL"; do
  curl -fsS "$url/readyz" >/dev/null || fail "$url/readyz is not 200: start the system first (docker compose up --build, or scripts/run-local.sh)"
done
info "order, invoicing and notification are ready"

say "1. Placing 3 orders"
ids=()
for c in alice bob carol; do
  id=$(place_order "$c"); ids+=("$id")
  info "order $id placed for $c (201 Created)"
done
wait_exactly_once 30 "${ids[@]}"
info "each of the 3 orders has exactly one invoice and one sent confirmation"

say "2. Faking a redelivery: resetting the outbox row of order ${ids[0]}"
inv_before=$(duplicates "$INVOICING_URL" invoicing); not_before=$(duplicates "$NOTIFICATION_URL" notification)
msg=$(order_sql "UPDATE outbox_messages SET processed_at = NULL, next_attempt_at = now() WHERE payload->>'order_id' = '${ids[0]}' RETURNING id")
[ -n "$msg" ] || fail "no outbox row for order ${ids[0]}"
info "message $msg is unsent again; the relay publishes it a second time with the same message id"
deadline=$((SECONDS + 20))
until [ "$(duplicates "$INVOICING_URL" invoicing)" != "$inv_before" ] && [ "$(duplicates "$NOTIFICATION_URL" notification)" != "$not_before" ]; do
  [ $SECONDS -ge $deadline ] && fail "the consumers did not report the duplicate within 20 s"
  sleep 0.5
done
info "both consumers skipped it (inbox_duplicates_total went up by one each); their logs:"
show_log invoicing "duplicate message skipped" "message_id=$msg"
show_log notification "duplicate message skipped" "message_id=$msg"
wait_exactly_once 10 "${ids[@]}"
info "still exactly one invoice and one confirmation per order"

say "3. Stopping the broker for ${OUTAGE_SECONDS} s while orders keep coming"
broker stop
info "RabbitMQ stopped"
outage=()
end=$((SECONDS + OUTAGE_SECONDS))
while [ $SECONDS -lt $end ]; do
  id=$(place_order "during-outage"); outage+=("$id")
  curl -fsS "$ORDER_URL/readyz" >/dev/null || fail "the order service is not ready during a broker outage"
  sleep 1
done
info "${#outage[@]} orders accepted during the outage (201 each); their events wait in the outbox"
info "the relay records each failed attempt and backs off:"
show_log order "outbox publish failed"
broker start
info "RabbitMQ started again; nobody restarts anything"
wait_exactly_once 120 "${ids[@]}" "${outage[@]}"
info "all $(( ${#ids[@]} + ${#outage[@]} )) orders have exactly one invoice and one sent confirmation"

say "Done: nothing lost, nothing done twice."
