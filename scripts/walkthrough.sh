#!/usr/bin/env bash
# The seeds' experiment against a running system, in plain words:
#   1. place 3 orders            => 3 invoices, and per order a confirmation and an invoice notice
#   2. reset one OrderPlaced row of the order outbox
#                                => both consumers log the duplicate; the counts stay
#   3. reset one InvoiceIssued row of the invoicing outbox
#                                => notification logs the duplicate; still one invoice notice
#                                   per order
#   4. cancel an order, then cancel it again
#                                => its invoice turns void and its customer is told once; the
#                                   second cancel answers 200 and writes no second event
#   5. stop the broker for ~8 s while placing orders, start it again
#                                => the relay logs the outage once as it starts and once as
#                                   it ends, charges no outbox row for it, and every order is
#                                   invoiced and notified exactly once
# It exits non-zero if any expectation fails.
#
# Works against `docker compose up` (the default when its services run) or
# scripts/run-local.sh (WALKTHROUGH_MODE=local). Needs curl; psql in local mode.
set -euo pipefail
cd "$(dirname "$0")/.."

ORDER_URL="${ORDER_URL:-http://localhost:${ORDER_PORT:-8080}}"
INVOICING_URL="${INVOICING_URL:-http://localhost:${INVOICING_PORT:-8081}}"
NOTIFICATION_URL="${NOTIFICATION_URL:-http://localhost:${NOTIFICATION_PORT:-8082}}"
ORDER_DATABASE_URL="${ORDER_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/order_db?sslmode=disable}"
INVOICING_DATABASE_URL="${INVOICING_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/invoicing_db?sslmode=disable}"
OUTAGE_SECONDS="${OUTAGE_SECONDS:-8}"

# Compose mode when this project's containers all run, local mode when there are none; it
# says which and why. Local mode stops the developer's own broker (rabbitmqctl stop_app), so
# it is never chosen by default while containers of this project exist but are not all
# running: then it stops instead. WALKTHROUGH_MODE=compose|local overrides.
case "${WALKTHROUGH_MODE:-}" in
  compose|local) mode_reason="WALKTHROUGH_MODE=$WALKTHROUGH_MODE" ;;
  "")
    if ! command -v docker >/dev/null 2>&1; then
      WALKTHROUGH_MODE=local mode_reason="docker is not installed"
    elif ! containers=$(docker compose ps --all --quiet 2>/dev/null); then
      why=$(docker compose ps --all --quiet 2>&1 >/dev/null | grep . | head -n1 || true)
      WALKTHROUGH_MODE=local mode_reason="docker compose is not available (${why:-docker compose ps failed})"
    elif [ -z "$containers" ]; then
      WALKTHROUGH_MODE=local mode_reason="docker compose ps lists no container of this project"
    else
      services=$(docker compose config --services | LC_ALL=C sort)
      running=$(docker compose ps --status running --services | LC_ALL=C sort)
      not_running=$(LC_ALL=C comm -23 <(printf '%s\n' "$services") <(printf '%s\n' "$running") | paste -sd' ' -)
      if [ -n "$not_running" ]; then
        printf 'walkthrough: this project has containers, but not all its services run (not running: %s).\n' "$not_running" >&2
        printf '  Start them (docker compose up -d --wait) or remove them (docker compose down) and run again,\n' >&2
        printf '  or choose explicitly: WALKTHROUGH_MODE=compose|local (local stops the local broker).\n' >&2
        exit 1
      fi
      WALKTHROUGH_MODE=compose mode_reason="docker compose ps shows the services running"
    fi
    ;;
  *) printf 'walkthrough: WALKTHROUGH_MODE=%s, want compose or local\n' "$WALKTHROUGH_MODE" >&2; exit 2 ;;
esac
printf '%s mode: %s\n' "$WALKTHROUGH_MODE" "$mode_reason"
# Local mode stops the machine's broker: it waits while a test run or a benchmark uses it, as
# they wait for each other (scripts/alone.sh).
if [ "$WALKTHROUGH_MODE" = local ]; then
  . scripts/alone.sh
  alone scripts/walkthrough.sh
fi

say()  { printf '\n== %s\n' "$*"; }
info() { printf '   %s\n' "$*"; }
fail() { printf '\nFAILED: %s\n' "$*" >&2; exit 1; }

service_sql() { # service_sql ROLE DATABASE URL QUERY: QUERY on a service's own database
  if [ "$WALKTHROUGH_MODE" = compose ]; then
    docker compose exec -T postgres psql -U "$1" -d "$2" -qAtc "$4"
  else
    psql "$3" -qAtc "$4"
  fi
}
order_sql()     { service_sql order order_db "$ORDER_DATABASE_URL" "$1"; }
invoicing_sql() { service_sql invoicing invoicing_db "$INVOICING_DATABASE_URL" "$1"; }
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
log_lines() { # log_lines NAME TEXT... -> the service's log lines holding every TEXT
  local lines text
  lines=$(service_logs "$1" || true); shift
  for text in "$@"; do lines=$(grep -F -- "$text" <<<"$lines" || true); done
  [ -z "$lines" ] || printf '%s\n' "$lines"
}
log_count() { # log_count NAME TEXT... -> how many lines of the service's log hold every TEXT
  log_lines "$@" | grep -c . || true
}
show_log() { # show_log NAME TEXT...: print the service's last log line holding every TEXT, if its log is at hand
  local line
  line=$(log_lines "$@" | tail -n1)
  if [ -n "$line" ]; then info "  [$1] $line"; else info "  ($1's log is not at hand here; look for: ${*:2})"; fi
}
# expect_log NAME TEXT...: the service logs a line holding every TEXT within 10 s; show it.
# Nothing to check when its log is not at hand.
expect_log() {
  local deadline=$((SECONDS + 10))
  if [ -z "$(service_logs "$1")" ]; then info "  ($1's log is not at hand here; look for: ${*:2})"; return 0; fi
  until [ "$(log_count "$@")" -gt 0 ]; do
    [ $SECONDS -ge $deadline ] && fail "$1 logged no line with: ${*:2}"
    sleep 0.5
  done
  show_log "$@"
}

place_order() { # place_order CUSTOMER -> prints the order id
  local out
  out=$(curl -sS -w '\n%{http_code}' -X POST "$ORDER_URL/orders" -H 'Content-Type: application/json' \
    -d "{\"customer_id\":\"$1\",\"lines\":[{\"sku\":\"SKU-1\",\"quantity\":2,\"unit_price_cents\":1250}]}")
  [ "$(tail -n1 <<<"$out")" = 201 ] || fail "POST /orders answered $(tail -n1 <<<"$out"): $(head -n1 <<<"$out")"
  head -n1 <<<"$out" | sed -E 's/.*"id":"([0-9a-f-]{36})".*/\1/'
}

cancel_order() { # cancel_order ID REASON: the answer must be 200 with the order cancelled
  local out
  out=$(curl -sS -w '\n%{http_code}' -X POST "$ORDER_URL/orders/$1/cancel" -H 'Content-Type: application/json' \
    -d "{\"reason\":\"$2\"}")
  [ "$(tail -n1 <<<"$out")" = 200 ] || fail "POST /orders/$1/cancel answered $(tail -n1 <<<"$out"): $(head -n1 <<<"$out")"
  grep -qF '"status":"cancelled"' <<<"$out" || fail "POST /orders/$1/cancel answered 200 without status \"cancelled\": $(head -n1 <<<"$out")"
}

invoice_of() { # invoice_of ID -> the statuses of the order's invoices, comma-separated
  curl -fsS "$INVOICING_URL/invoices?order_id=$1" | grep -o '"status":"[a-z]*"' | cut -d'"' -f4 | paste -sd, - || true
}
sent_to() { # sent_to ID -> the kinds of the order's sent notifications, sorted, comma-separated
  curl -fsS "$NOTIFICATION_URL/notifications?order_id=$1" | tr '}' '\n' | grep -F '"status":"sent"' |
    grep -o '"kind":"[a-z_]*"' | cut -d'"' -f4 | LC_ALL=C sort | paste -sd, - || true
}
state() { echo "invoice=$(invoice_of "$1") sent=$(sent_to "$1")"; } # state ID -> what the order has
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

# want ID -> the state the order should settle in: one invoice, issued, with a sent confirmation
# and invoice notice; for the order cancelled in step 4, the invoice void and a sent
# cancellation notice as well (it was invoiced before it was cancelled).
cancelled=""
want() {
  if [ "$1" = "$cancelled" ]; then echo "invoice=void sent=invoice,order_cancelled,order_confirmation"
  else echo "invoice=issued sent=invoice,order_confirmation"; fi
}

# wait_exactly_once SECONDS ID... : every order settles in the state it should (see want).
wait_exactly_once() {
  local secs=$1; shift
  local deadline=$((SECONDS + secs)) id bad
  while :; do
    bad=""
    for id in "$@"; do
      if [ "$(state "$id")" != "$(want "$id")" ]; then bad=$id; break; fi
    done
    [ -z "$bad" ] && return 0
    [ $SECONDS -ge $deadline ] && fail "order $bad has $(state "$bad"), want $(want "$bad")"
    sleep 0.5
  done
}

# wait_duplicate URL CONSUMER BEFORE: the consumer's inbox_duplicates_total goes from BEFORE up
# by exactly one within 20 s.
wait_duplicate() {
  local deadline=$((SECONDS + 20))
  until [ "$(duplicates "$1" "$2")" != "$3" ]; do
    [ $SECONDS -ge $deadline ] && fail "$2 did not report the duplicate within 20 s"
    sleep 0.5
  done
  [ "$(duplicates "$1" "$2")" = $(($3 + 1)) ] || fail "inbox_duplicates_total{consumer=\"$2\"} went from $3 to $(duplicates "$1" "$2"), want $(($3 + 1))"
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
info "each of the 3 orders has exactly one invoice, one sent confirmation and one sent invoice notice"

say "2. Faking a redelivery: resetting the OrderPlaced outbox row of order ${ids[0]}"
inv_before=$(duplicates "$INVOICING_URL" invoicing); not_before=$(duplicates "$NOTIFICATION_URL" notification)
msg=$(order_sql "UPDATE outbox_messages SET processed_at = NULL, next_attempt_at = now() WHERE type = 'OrderPlaced' AND payload->>'order_id' = '${ids[0]}' RETURNING id")
[ -n "$msg" ] || fail "no OrderPlaced outbox row for order ${ids[0]}"
info "message $msg is unsent again; the order relay publishes it a second time with the same message id"
wait_duplicate "$INVOICING_URL" invoicing "$inv_before"
wait_duplicate "$NOTIFICATION_URL" notification "$not_before"
info "both consumers skipped it (inbox_duplicates_total went up by one each); their logs:"
expect_log invoicing "duplicate message skipped" "consumer=invoicing" "message_id=$msg"
expect_log notification "duplicate message skipped" "consumer=notification" "message_id=$msg"
wait_exactly_once 10 "${ids[@]}"
info "still exactly one invoice and one notification of each kind per order"

say "3. Faking a redelivery one hop down the chain: resetting the InvoiceIssued outbox row of order ${ids[0]} in the invoicing database"
not_before=$(duplicates "$NOTIFICATION_URL" notification)
msg=$(invoicing_sql "UPDATE outbox_messages SET processed_at = NULL, next_attempt_at = now() WHERE type = 'InvoiceIssued' AND payload->>'order_id' = '${ids[0]}' RETURNING id")
[ -n "$msg" ] || fail "no InvoiceIssued outbox row for order ${ids[0]} in the invoicing database"
info "message $msg is unsent again; the invoicing service's own relay publishes it a second time with the same message id"
wait_duplicate "$NOTIFICATION_URL" notification "$not_before"
info "the notification service skipped it (inbox_duplicates_total{consumer=\"notification\"} went up by one); its log:"
expect_log notification "duplicate message skipped" "consumer=notification" "message_id=$msg"
wait_exactly_once 10 "${ids[@]}"
info "still one invoice notice per order, each e-mailed once"

cancelled=${ids[2]}
say "4. Cancelling order $cancelled"
cancel_order "$cancelled" "ordered by mistake"
info "POST /orders/$cancelled/cancel answered 200 with status \"cancelled\""
wait_exactly_once 30 "${ids[@]}"
info "GET /invoices?order_id=$cancelled: its one invoice is now $(invoice_of "$cancelled")"
info "GET /notifications?order_id=$cancelled: sent $(sent_to "$cancelled")"
info "the logs of the cancellation along the chain:"
expect_log order 'msg="order cancelled"' "order_id=$cancelled"
expect_log invoicing 'msg="invoice voided"' "order_id=$cancelled"
expect_log notification 'msg="notification recorded"' "order_id=$cancelled" "kind=order_cancelled"
cancel_order "$cancelled" "ordered by mistake"
events=$(order_sql "SELECT count(*) FROM outbox_messages WHERE type = 'OrderCancelled' AND payload->>'order_id' = '$cancelled'")
[ "$events" = 1 ] || fail "order $cancelled has $events OrderCancelled outbox rows after two cancellations, want 1"
if [ -n "$(service_logs order)" ] && [ "$(log_count order 'msg="order cancelled"' "order_id=$cancelled")" != 1 ]; then
  fail "the order service logged the cancellation of $cancelled $(log_count order 'msg="order cancelled"' "order_id=$cancelled") times, want 1"
fi
info "cancelling again answered 200 as well, and wrote nothing: the order outbox holds one OrderCancelled for it"
wait_exactly_once 10 "${ids[@]}"
info "still one invoice per order, and one notification per order and kind"

say "5. Stopping the broker for ${OUTAGE_SECONDS} s while orders keep coming"
paused="broker unavailable; relay paused" resumed="broker available again; relay resumed" failed="outbox publish failed"
paused_before=$(log_count order "$paused") resumed_before=$(log_count order "$resumed") failed_before=$(log_count order "$failed")
since=$(order_sql "SELECT now()") # this outage's rows: older ones may carry an earlier broker's verdict
# A failure or a Ctrl-C during the outage must not leave the broker stopped: on a developer's
# machine it is their own RabbitMQ.
trap 'broker start || true' EXIT
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
trap - EXIT
info "RabbitMQ started again; nobody restarts anything"
wait_exactly_once 120 "${ids[@]}" "${outage[@]}"
info "all $(( ${#ids[@]} + ${#outage[@]} )) orders have exactly one invoice and one sent notification of each kind they earned"
wait_broker_up 1
info "the relay logged the end of the outage: how long it lasted and how many rows waited:"
expect_one_more order "$resumed_before" "$resumed"
[ "$(charged_rows "$since")" = 0 ] || fail "$(charged_rows "$since") outbox rows were charged an attempt for the broker's outage"
[ "$(log_count order "$failed")" = "$failed_before" ] || fail "the relay logged \"$failed\" for a broker outage; that line is for the broker's verdict on one message"
info "every row of the outage still has attempts = 0 and no last_error, and no \"$failed\" line:"
info "that line, and a row's backoff, are for the broker's verdict on one message (nack, unroutable, too large)"

say "Done: nothing lost, nothing done twice."
