#!/usr/bin/env bash
# A three-node RabbitMQ cluster on this host, for the cluster tests (TEST_CLUSTER=1), without
# Docker and without touching the machine's own broker:
#
#   scripts/cluster.sh start     start three nodes and cluster them; prints AMQP_URL
#   scripts/cluster.sh stop      stop them and delete everything they left
#   scripts/cluster.sh ctl N ... rabbitmqctl against node N (1-3)
#   scripts/cluster.sh queues N ... rabbitmq-queues against node N
#   scripts/cluster.sh kill N    SIGKILL node N, as a crash would
#   scripts/cluster.sh revive N  start node N again; it rejoins the cluster
#
# Each node has its own node name (outbox-inbox-N@localhost), AMQP port (CLUSTER_PORT + N - 1,
# default 5681-5683), distribution port (AMQP port + 20000) and data directory under
# CLUSTER_DIR (default: $TMPDIR/outbox-inbox-cluster). They share one Erlang cookie there.
# `cluster_partition_handling = pause_minority`: a node cut off from the other two pauses
# instead of going on alone (the default, ignore, stays split after the partition heals).
set -euo pipefail

dir=${CLUSTER_DIR:-${TMPDIR:-/tmp}/outbox-inbox-cluster}
base_port=${CLUSTER_PORT:-5681}
bin=${RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}

die() { printf 'scripts/cluster.sh: %s\n' "$*" >&2; exit 1; }
node() { printf 'outbox-inbox-%s@localhost' "$1"; }
port() { printf '%s' $((base_port + $1 - 1)); }

# env_for N: the environment of node N's server and tools.
env_for() {
  local n=$1 d="$dir/node$1"
  printf '%s\n' \
    "HOME=$dir" \
    "RABBITMQ_CONF_ENV_FILE=$d/rabbitmq-env.conf" \
    "RABBITMQ_NODENAME=$(node "$n")" \
    "RABBITMQ_NODE_PORT=$(port "$n")" \
    "RABBITMQ_DIST_PORT=$(($(port "$n") + 20000))" \
    "RABBITMQ_CONFIG_FILE=$d/rabbitmq.conf" \
    "RABBITMQ_MNESIA_BASE=$d/mnesia" \
    "RABBITMQ_LOG_BASE=$d/log" \
    "RABBITMQ_PID_FILE=$d/pid" \
    "RABBITMQ_ENABLED_PLUGINS_FILE=$d/enabled_plugins" \
    "ERL_EPMD_ADDRESS=127.0.0.1"
}
run_as() { local n=$1; shift; env $(env_for "$n") "$@"; }
ctl() { local n=$1; shift; run_as "$n" "$bin/rabbitmqctl" -n "$(node "$n")" "$@"; }
queues() { local n=$1; shift; run_as "$n" "$bin/rabbitmq-queues" -n "$(node "$n")" "$@"; }

prepare() {
  mkdir -p "$dir"
  if [ ! -f "$dir/.erlang.cookie" ]; then
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$dir/.erlang.cookie"
    chmod 400 "$dir/.erlang.cookie"
  fi
  for n in 1 2 3; do
    local d="$dir/node$n"
    mkdir -p "$d/mnesia" "$d/log"
    : > "$d/rabbitmq-env.conf"
    echo '[].' > "$d/enabled_plugins"
    cat > "$d/rabbitmq.conf" <<CONF
listeners.tcp.1 = 127.0.0.1:$(port "$n")
cluster_partition_handling = pause_minority
loopback_users.guest = false
CONF
  done
}

start_node() {
  run_as "$1" "$bin/rabbitmq-server" -detached >/dev/null 2>&1 || die "node $1 did not start (logs: $dir/node$1/log)"
  # -detached returns before the node is reachable: wait for it to answer, then to boot.
  for _ in $(seq 60); do ctl "$1" -q ping >/dev/null 2>&1 && break; sleep 1; done
  ctl "$1" -q --timeout 120 await_startup >/dev/null 2>&1 || die "node $1 did not finish starting (logs: $dir/node$1/log)"
}

start() {
  command -v "$bin/rabbitmq-server" >/dev/null || die "RabbitMQ is not installed at $bin (RABBITMQ_BIN)"
  prepare
  for n in 1 2 3; do start_node "$n"; done
  for n in 2 3; do
    ctl "$n" -q stop_app
    ctl "$n" -q join_cluster "$(node 1)"
    ctl "$n" -q start_app
  done
  ctl 1 -q await_online_nodes 3 >/dev/null
  local urls=()
  for n in 1 2 3; do urls+=("amqp://guest:guest@127.0.0.1:$(port "$n")/"); done
  (IFS=,; echo "AMQP_URL=${urls[*]}")
}

stop() {
  for n in 1 2 3; do
    [ -d "$dir/node$n" ] || continue
    ctl "$n" -q shutdown >/dev/null 2>&1 || true
    kill_node "$n" 2>/dev/null || true
  done
  rm -rf "$dir"
}

# kill_node N: SIGKILL node N's Erlang VM (the node writes its OS pid to its pid file).
kill_node() {
  local pidfile="$dir/node$1/pid"
  [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null || return 1
  kill -9 "$(cat "$pidfile")"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  ctl) shift; n=$1; shift; ctl "$n" "$@" ;;
  queues) shift; n=$1; shift; queues "$n" "$@" ;;
  kill) kill_node "$2" || die "node $2 is not running" ;;
  revive) start_node "$2" ;;
  *) die "usage: scripts/cluster.sh start|stop|ctl N ARGS|queues N ARGS|kill N|revive N" ;;
esac
