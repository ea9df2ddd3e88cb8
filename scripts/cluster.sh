#!/usr/bin/env bash
# A three-node RabbitMQ cluster on this host, for the cluster tests (TEST_CLUSTER=1), without
# Docker and without touching the machine's own broker:
#
#   scripts/cluster.sh start     start three nodes and cluster them; prints AMQP_URL
#   scripts/cluster.sh stop      stop them and delete everything they left
#   scripts/cluster.sh ctl N ... rabbitmqctl against node N (1-3)
#   scripts/cluster.sh queues N ... rabbitmq-queues against node N
#   scripts/cluster.sh diagnostics N ... rabbitmq-diagnostics against node N
#   scripts/cluster.sh kill N    SIGKILL node N, as a crash would
#   scripts/cluster.sh revive N  start node N again; it rejoins the cluster
#   scripts/cluster.sh cut N     (CLUSTER_NETNS=1) cut node N off the network: from the other
#                                nodes and from every client
#   scripts/cluster.sh heal N    (CLUSTER_NETNS=1) connect node N again
#   scripts/cluster.sh listening N  (CLUSTER_NETNS=1) print yes if node N's AMQP listener is
#                                open, no if not, as seen inside its namespace (so even while
#                                it is cut off); fail if it cannot tell
#
# Each node has its own node name (outbox-inbox-N@localhost), AMQP port (CLUSTER_PORT + N - 1,
# default 5681-5683), distribution port (AMQP port + 20000) and data directory under
# CLUSTER_DIR (default: $TMPDIR/outbox-inbox-cluster). They share one Erlang cookie there.
# `cluster_partition_handling = pause_minority`: a node cut off from the other two pauses
# instead of going on alone (the default, ignore, stays split after the partition heals). That
# is Mnesia's, so 3.x's, the installed RabbitMQ here (3.10): 4.3 accepts the key and ignores it.
#
# CLUSTER_NETNS=1 runs each node in a network namespace of its own, because a partition needs
# a network to cut: on loopback, Erlang distribution goes straight between the nodes' ports
# and no proxy sits in its way. Node N is outbox-inbox-N@NET.N.2 (long names, NET from
# CLUSTER_NET, default 10.77), AMQP on NET.N.2:5672, with its own epmd in its namespace. A
# veth pair links each namespace to a bridge in the root namespace (NET.0.1/16), so the nodes
# reach each other and the clients reach them over layer 2 (no IP forwarding to turn on), and
# `cut N` is taking node N's port of the bridge down. net_ticktime is 10 s (CLUSTER_TICKTIME)
# rather than 60, for the nodes and their CLI tools alike, so a partition is found in seconds.
# The namespaces and links are named oi-n1..3, oi-v1..3 and oi-br: one such cluster at a time.
# Needs root.
set -euo pipefail

dir=${CLUSTER_DIR:-${TMPDIR:-/tmp}/outbox-inbox-cluster}
base_port=${CLUSTER_PORT:-5681}
bin=${RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}
netns=${CLUSTER_NETNS:-0}
net=${CLUSTER_NET:-10.77}
ticktime=${CLUSTER_TICKTIME:-10}
bridge=oi-br
netns_dir=/run/netns # where ip netns keeps the namespaces it names

die() { printf 'scripts/cluster.sh: %s\n' "$*" >&2; exit 1; }
netns_mode() { [ "$netns" = 1 ]; }
addr() { if netns_mode; then printf '%s.%s.2' "$net" "$1"; else printf '127.0.0.1'; fi; }
node() { if netns_mode; then printf 'outbox-inbox-%s@%s' "$1" "$(addr "$1")"; else printf 'outbox-inbox-%s@localhost' "$1"; fi; }
port() { if netns_mode; then printf 5672; else printf '%s' $((base_port + $1 - 1)); fi; }
ns() { printf 'oi-n%s' "$1"; }   # node N's namespace
veth() { printf 'oi-v%s' "$1"; } # its link's end in the root namespace, on the bridge

# env_for N: the environment of node N's server and tools, one variable a line.
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
    "RABBITMQ_ENABLED_PLUGINS_FILE=$d/enabled_plugins"
  if netns_mode; then
    # The CLI tools are Erlang nodes too: with the default ticktime they would tick less often
    # than the node expects, and a long command would be dropped as a dead peer.
    printf '%s\n' \
      "RABBITMQ_USE_LONGNAME=true" \
      "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel net_ticktime $ticktime" \
      "RABBITMQ_CTL_ERL_ARGS=-kernel net_ticktime $ticktime"
  else
    echo "ERL_EPMD_ADDRESS=127.0.0.1"
  fi
}
run_as() {
  local n=$1 vars; shift
  mapfile -t vars < <(env_for "$n")
  if netns_mode; then
    ip netns exec "$(ns "$n")" env "${vars[@]}" "$@"
  else
    env "${vars[@]}" "$@"
  fi
}
ctl() { local n=$1; shift; run_as "$n" "$bin/rabbitmqctl" -n "$(node "$n")" "$@"; }
queues() { local n=$1; shift; run_as "$n" "$bin/rabbitmq-queues" -n "$(node "$n")" "$@"; }
diagnostics() { local n=$1; shift; run_as "$n" "$bin/rabbitmq-diagnostics" -n "$(node "$n")" "$@"; }

# net_up: the bridge, and a namespace per node linked to it.
net_up() {
  [ "$(id -u)" = 0 ] || die "CLUSTER_NETNS=1 needs root (ip netns)"
  if ip link show "$bridge" >/dev/null 2>&1 || [ -e "$netns_dir/oi-n1" ] || [ -e "$netns_dir/oi-n2" ] || [ -e "$netns_dir/oi-n3" ]; then
    die "a namespaced cluster exists already (CLUSTER_NETNS=1 scripts/cluster.sh stop removes it)"
  fi
  ip link add "$bridge" type bridge
  ip addr add "$net.0.1/16" dev "$bridge"
  ip link set "$bridge" up
  for n in 1 2 3; do
    ip netns add "$(ns "$n")"
    ip link add "$(veth "$n")" type veth peer name "$(veth "$n")n" netns "$(ns "$n")"
    ip link set "$(veth "$n")" master "$bridge" up
    ip -n "$(ns "$n")" addr add "$(addr "$n")/16" dev "$(veth "$n")n"
    ip -n "$(ns "$n")" link set "$(veth "$n")n" up
    ip -n "$(ns "$n")" link set lo up # epmd and the CLI tools talk to the node over it
  done
}

# net_down: end what runs in the namespaces (all of it started here: the nodes, their epmd),
# then delete the links and the namespaces. Leaves nothing when there is nothing to delete.
net_down() {
  for n in 1 2 3; do
    [ -e "$netns_dir/$(ns "$n")" ] || continue
    local pids
    pids=$(ip netns pids "$(ns "$n")")
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
  done
  for n in 1 2 3; do
    ip link del "$(veth "$n")" 2>/dev/null || true # takes its peer in the namespace with it
    ip netns del "$(ns "$n")" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
}

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
listeners.tcp.1 = $(addr "$n"):$(port "$n")
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
  if netns_mode; then net_up; fi
  prepare
  for n in 1 2 3; do start_node "$n"; done
  for n in 2 3; do
    ctl "$n" -q stop_app
    ctl "$n" -q join_cluster "$(node 1)"
    ctl "$n" -q start_app
  done
  ctl 1 -q await_online_nodes 3 >/dev/null
  local urls=()
  for n in 1 2 3; do urls+=("amqp://guest:guest@$(addr "$n"):$(port "$n")/"); done
  (IFS=,; echo "AMQP_URL=${urls[*]}")
}

stop() {
  # Every node connected first: a node shutting down waits on its links to the others, and on
  # one to a node cut off it would wait for good.
  if netns_mode; then for n in 1 2 3; do heal "$n" 2>/dev/null || true; done; fi
  for n in 1 2 3; do
    [ -d "$dir/node$n" ] || continue
    ctl "$n" -q shutdown >/dev/null 2>&1 || true
    kill_node "$n" 2>/dev/null || true
  done
  if netns_mode; then net_down; fi
  rm -rf "$dir"
}

# kill_node N: SIGKILL node N's Erlang VM (the node writes its OS pid to its pid file, which a
# SIGKILL leaves behind). The pid must still be that VM's, started with the node's name in its
# environment (the VM's command line does not hold it): a pid the system gave to another
# process since must not be killed.
kill_node() {
  local pidfile="$dir/node$1/pid" pid environ
  [ -s "$pidfile" ] || return 1
  pid=$(cat "$pidfile")
  environ=$(tr '\0' '\n' 2>/dev/null <"/proc/$pid/environ") || return 1
  grep -qxF -- "RABBITMQ_NODENAME=$(node "$1")" <<<"$environ" || return 1
  kill -9 "$pid"
  rm -f "$pidfile"
}

# cut N, heal N: node N's link to the bridge goes down, or up. Down, nothing reaches the node
# and nothing leaves it: no RST, no FIN, as when a switch port or a cable fails.
cut() { netns_mode || die "cut needs CLUSTER_NETNS=1"; ip link set "$(veth "$1")" down; }
heal() { netns_mode || die "heal needs CLUSTER_NETNS=1"; ip link set "$(veth "$1")" up; }

# listening N: whether node N listens for AMQP. A paused node closes its listener; ss reads the
# socket table without connecting, so asking often neither shows in the node's log nor costs
# an Erlang VM's start, as each CLI call does.
# It tells "no" from a failure to ask: a failed ss must not pass for a closed listener.
listening() {
  netns_mode || die "listening needs CLUSTER_NETNS=1"
  local sockets
  sockets=$(ip netns exec "$(ns "$1")" ss -Hltn "sport = :$(port "$1")") || die "ss failed in $(ns "$1")"
  if [ -n "$sockets" ]; then echo yes; else echo no; fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  ctl) shift; n=$1; shift; ctl "$n" "$@" ;;
  queues) shift; n=$1; shift; queues "$n" "$@" ;;
  diagnostics) shift; n=$1; shift; diagnostics "$n" "$@" ;;
  kill) kill_node "$2" || die "node $2 is not running" ;;
  revive) start_node "$2" ;;
  cut) cut "$2" ;;
  heal) heal "$2" ;;
  listening) listening "$2" ;;
  *) die "usage: scripts/cluster.sh start|stop|ctl N ARGS|queues N ARGS|diagnostics N ARGS|kill N|revive N|cut N|heal N|listening N" ;;
esac
