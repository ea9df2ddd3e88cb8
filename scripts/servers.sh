# shellcheck shell=bash
# Where the test servers come from; sourced by scripts/test.sh. Kept apart so that
# scripts/servers_test.go can exercise each decision with stand-in commands.

# host:port of a URL such as scheme://user:pass@host:port/path; without a port, the scheme's.
host_port() {
  local scheme="${1%%://*}" rest="${1#*://}"
  rest="${rest#*@}"; rest="${rest%%[/?]*}"
  case "$rest" in
    \[*\]:*|[!\[]*:*) printf '%s' "$rest" ;;
    *) case "$scheme" in
         postgres|postgresql) printf '%s:5432' "$rest" ;;
         amqps) printf '%s:5671' "$rest" ;;
         *) printf '%s:5672' "$rest" ;;
       esac ;;
  esac
}
tcp_open() { local hp; hp=$(host_port "$1"); timeout 2 bash -c "</dev/tcp/${hp%:*}/${hp##*:}" 2>/dev/null; }
is_local() { case "$(host_port "$1")" in 127.0.0.1:*|localhost:*|\[::1\]:*) return 0 ;; *) return 1 ;; esac; }

# Without the client tools (compose mode), an open port is the best sign of life there is.
pg_ready() {
  if command -v pg_isready >/dev/null; then pg_isready -d "$TEST_DATABASE_URL" -t 2 >/dev/null 2>&1; else tcp_open "$TEST_DATABASE_URL"; fi
}
rabbit_ready() { tcp_open "$TEST_AMQP_URL"; }

compose_test_file=deploy/compose.test.yml
compose_test_running() { docker compose -f "$compose_test_file" ps -q rabbitmq 2>/dev/null | grep -q .; }

# servers_mode prints how the suite gets its servers, and why, as "MODE: reason":
#   local    the servers answer here, or are installed here and can be started;
#   compose  the servers of deploy/compose.test.yml, with Docker (TEST_SERVERS=compose).
# With neither, it says on standard error how to get them, and fails.
servers_mode() {
  case "${TEST_SERVERS:-}" in
    local|compose) echo "$TEST_SERVERS: TEST_SERVERS says so"; return 0 ;;
    "") ;;
    *) echo "TEST_SERVERS must be local or compose, got \"$TEST_SERVERS\"" >&2; return 1 ;;
  esac
  if pg_ready && rabbit_ready; then
    if ! command -v rabbitmqctl >/dev/null && command -v docker >/dev/null && compose_test_running; then
      echo "compose: the servers that answer are deploy/compose.test.yml's, and this host has no rabbitmqctl"
    else
      echo "local: PostgreSQL and RabbitMQ answer at TEST_DATABASE_URL and TEST_AMQP_URL"
    fi
    return 0
  fi
  if command -v pg_ctlcluster >/dev/null || command -v rabbitmqctl >/dev/null; then
    echo "local: the servers are installed here; starting what does not answer"
    return 0
  fi
  if command -v docker >/dev/null; then
    echo "compose: no server answers or is installed here, and Docker is"
    return 0
  fi
  {
    echo "neither PostgreSQL ($(host_port "$TEST_DATABASE_URL")) nor RabbitMQ ($(host_port "$TEST_AMQP_URL")) answers, none is installed, and there is no Docker."
    echo "  Either install PostgreSQL 15+ and RabbitMQ 3.10+ locally (postgres with trust auth, guest/guest;"
    echo "  the phases against this machine's RabbitMQ stand for 3.10, the oldest the library supports:"
    echo "  with another version, set TEST_MACHINE_RABBITMQ to its major.minor to run them against it),"
    echo "  or install Docker and run this again: it then starts both from $compose_test_file"
    echo "  (docker compose -f $compose_test_file up -d --wait)."
  } >&2
  return 1
}
