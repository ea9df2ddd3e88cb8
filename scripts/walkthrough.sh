#!/usr/bin/env bash
# The seeds' experiment against a running system, in plain words:
#   1. place 3 orders            => 3 invoices and 3 confirmations
#   2. reset one outbox row      => the consumers log the duplicate; the counts stay 3
#   3. stop the broker for ~8 s while placing orders, start it again
#                                => the relay logs the outage once as it starts and once as
#                                   it ends, charges no outbox row for it, and every order is
#                                   invoiced and confirmed exactly once
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
log_count() { # log_count NAME TEXT -> how many lines of the service's log hold TEXT
  service_logs "$1" | grep -cF -- "$2" || true
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
notices_of() { # notices_of ID KIND -> the order's sent notifications of that kind
  curl -fsS "$NOTIFICATION_URL/notifications?order_id=$1" | tr '}' '\n' | grep -F "\"kind\":\"$2\"" | grep -c '"status":"sent"' || true
}
confirmations_of() { notices_of "$1" order_confirmation; }
metric() { # metric URL SAMPLE DEFAULT -> the value of SAMPLE (labels included) on URL/metrics, DEFAULT if absent
  curl -fsS "$1/metrics" | awk -v s="$2" -v d="$3" '$1 == s { print $2; found=1 } END { if (!found) print d }'
}
duplicates() { metric "$1" "inbox_duplicates_total{consumer=\"$2\"}" 0; } # duplicates URL CONSUMER
broker_up() { metric "$ORDER_URL" 'outbox_relay_broker_up{exchange="orders"}' absent; } # the relay's view of the broker
wait_broker_up() { # wait_broker_up WANT: the relay's gauge shows WANT within 10 s
  local deadline=$((SECONDS + 10))
  until [ "$(broker_up)" = "$1" ]; do
    [ $SECONDS -ge $deadline ] && fail "outbox_relay_broker_up{exchange=\"orders\"} is $(broker_up), want $1"
    sleep 0.5
  done
}
charged_rows() { # charged_rows SINCE -> outbox rows since then with an attempt or an error recorded
  order_sql "SELECT count(*) FROM outbox_messages WHERE occurred_at >= '$1' AND (attempts <> 0 OR last_error IS NOT NULL)"
}

# expect_one_more NAME BEFORE TEXT: the service's log holds exactly one more line with TEXT
# than the BEFORE it held when the outage began (waiting a little for it to be written), and
# shows it. Nothing to check when the log is not at hand.
expect_one_more() {
  local deadline=$((SECONDS + 10)) n
  if [ -z "$(service_logs "$1")" ]; then info "  ($1's log is not at hand here; look for: $3)"; return 0; fi
  while n=$(log_count "$1" "$3"); [ "$n" -le "$2" ] && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
  [ "$n" -eq $(($2 + 1)) ] || fail "$1 logged $((n - $2)) \"$3\" line(s) for one broker outage, want 1"
  show_log "$1" "$3"
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
paused="broker unavailable; relay paused" resumed="broker available again; relay resumed" failed="outbox publish failed"
paused_before=$(log_count order "$paused") resumed_before=$(log_count order "$resumed") failed_before=$(log_count order "$failed")
since=$(order_sql "SELECT now()") # this outage's rows: older ones may carry an earlier broker's verdict
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
wait_broker_up 0
info "the relay noticed the outage once and paused (outbox_relay_broker_up{exchange=\"orders\"} is 0):"
expect_one_more order "$paused_before" "$paused"
[ "$(charged_rows "$since")" = 0 ] || fail "$(charged_rows "$since") outbox rows were charged an attempt for the broker's outage"
info "$(order_sql "SELECT count(*) FROM outbox_messages WHERE processed_at IS NULL") rows wait, none charged an attempt: the outage is the broker's fault, not theirs"
broker start
info "RabbitMQ started again; nobody restarts anything"
wait_exactly_once 120 "${ids[@]}" "${outage[@]}"
info "all $(( ${#ids[@]} + ${#outage[@]} )) orders have exactly one invoice and one sent confirmation"
wait_broker_up 1
info "the relay logged the end of the outage: how long it lasted and how many rows waited:"
expect_one_more order "$resumed_before" "$resumed"
[ "$(charged_rows "$since")" = 0 ] || fail "$(charged_rows "$since") outbox rows were charged an attempt for the broker's outage"
[ "$(log_count order "$failed")" = "$failed_before" ] || fail "the relay logged \"$failed\" for a broker outage; that line is for the broker's verdict on one message"
info "every row of the outage still has attempts = 0 and no last_error, and no \"$failed\" line:"
info "that line, and a row's backoff, are for the broker's verdict on one message (nack, unroutable, too large)"

say "Done: nothing lost, nothing done twice."
