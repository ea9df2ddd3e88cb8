#!/usr/bin/env bash
# Newer servers than this machine's, without Docker: a Debian root (debootstrap) with RabbitMQ
# from Debian's own packages, run beside the machine's own servers and never touching them.
# SIDROOT_SUITE picks the root:
#   sid (default)  Debian unstable: RabbitMQ 4.3, the broker compose ships, and Prometheus 3.5;
#                  scripts/test.sh runs the whole suite against it
#   trixie         Debian 13: RabbitMQ 4.0, between the two; scripts/test.sh runs the library's
#                  suite against it
#
#   scripts/sidroot.sh provision   make the root and install the packages, once: it is cached
#                                  (SIDROOT_DIR) and a later call returns at once
#   scripts/sidroot.sh start       provision if needed, then start the root's RabbitMQ node on a
#                                  fresh data directory and wait until it serves; prints the
#                                  exports of `env`
#   scripts/sidroot.sh stop        shut the node down and release the root's mounts
#   scripts/sidroot.sh env         the variables the tests read: TEST_AMQP_URL of the node,
#                                  TEST_RABBITMQCTL (how to run rabbitmqctl against it),
#                                  TEST_SIDROOT, TEST_RABBITMQ_PROMETHEUS_URL
#   scripts/sidroot.sh ctl ARGS    rabbitmqctl against the node
#   scripts/sidroot.sh version     the RabbitMQ (and Prometheus) versions installed
#   scripts/sidroot.sh compose     prints the root's RabbitMQ version, and fails unless it is
#                                  the major.minor of the image docker-compose.yml ships
#
# The node is rabbit43@localhost (sid) or rabbit40@localhost (trixie): AMQP on
# 127.0.0.1:SIDROOT_AMQP_PORT (default 5674, trixie 5675), distribution on that port + 20000,
# its Prometheus endpoint on 127.0.0.1:SIDROOT_METRICS_PORT (default 15694, trixie 15695),
# registered with the machine's epmd (or its own, if none runs). guest/guest works from
# loopback. Needs root (debootstrap, chroot, mount) and, for the first provisioning, Debian's
# package mirror (about a minute, and about 800 MB on disk).
set -euo pipefail

die() { printf 'scripts/sidroot.sh: %s\n' "$*" >&2; exit 1; }
say() { printf 'sidroot: %s\n' "$*" >&2; }

suite=${SIDROOT_SUITE:-sid}
case "$suite" in
  sid) node=rabbit43@localhost port=5674 packages="rabbitmq-server prometheus" ;;
  trixie) node=rabbit40@localhost port=5675 packages="rabbitmq-server" ;;
  *) die "SIDROOT_SUITE=$suite: want sid (RabbitMQ 4.3 and Prometheus) or trixie (RabbitMQ 4.0)" ;;
esac
# Absolute, as /proc/self/mounts names the root's mounts (release) and the tests read TEST_SIDROOT.
root=$(realpath -m "${SIDROOT_DIR:-/var/cache/outbox-inbox/debian-$suite}")
amqp_port=${SIDROOT_AMQP_PORT:-$port}
metrics_port=${SIDROOT_METRICS_PORT:-$((port + 10020))}
marker="$root/.outbox-inbox-provisioned"
here=$(cd "$(dirname "$0")" && pwd)

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot and mount)"

# in_root runs a command inside the root, as root, with the node's home.
in_root() { chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/var/lib/rabbitmq LANG=C.UTF-8 "$@"; }
ctl() { in_root rabbitmqctl -n "$node" "$@"; }

mount_proc() { mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"; }

provision() {
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$packages" ]; then
    return 0
  fi
  local start=$SECONDS
  if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap from the machine's Debian suite"
    # A fresh machine may have no package lists yet, or old ones naming versions the mirror no
    # longer serves: then the lists are updated and the install tried again.
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; then
      say "apt-get install debootstrap failed; updating the package lists (apt-get update) and trying again"
      apt-get update -q >/dev/null || die "apt-get update failed (needed to install debootstrap)"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null ||
        die "could not install debootstrap (apt-get install debootstrap)"
    fi
  fi
  # A half-made root (an interrupted run) is started over: first whatever is still mounted in
  # it, then the files, never across a mount point (rm would delete through a mount).
  release
  rm -rf --one-file-system "$root"
  mkdir -p "$(dirname "$root")"
  say "making a Debian $suite root in $root (debootstrap, about a minute)"
  debootstrap --variant=minbase "$suite" "$root" >"$root.log" 2>&1 ||
    die "debootstrap failed; see $root.log"
  # No package may start a service inside the root: the node is started by this script only.
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
  chmod +x "$root/usr/sbin/policy-rc.d"
  cp /etc/hosts "$root/etc/hosts"
  cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
  mount_proc
  say "installing $packages inside it"
  # The mirror may serve a snapshot whose Release file has expired; its signatures still count.
  in_root apt-get -q -o Acquire::Check-Valid-Until=false update >>"$root.log" 2>&1 ||
    die "apt-get update in the root failed; see $root.log"
  in_root env DEBIAN_FRONTEND=noninteractive apt-get -q -y -o Acquire::Check-Valid-Until=false \
    install --no-install-recommends $packages >>"$root.log" 2>&1 ||
    die "apt-get install $packages in the root failed; see $root.log"
  in_root apt-get clean
  configure
  echo "$packages" >"$marker"
  say "provisioned in $((SECONDS - start)) s: $(version | tr '\n' ' ')"
}

# configure writes the node's own configuration inside the root.
configure() {
  cat >"$root/etc/rabbitmq/rabbitmq-env.conf" <<EOF
NODENAME=$node
NODE_PORT=$amqp_port
DIST_PORT=$((amqp_port + 20000))
ERL_EPMD_ADDRESS=127.0.0.1
EOF
  cat >"$root/etc/rabbitmq/rabbitmq.conf" <<EOF
listeners.tcp.local = 127.0.0.1:$amqp_port
prometheus.tcp.ip = 127.0.0.1
prometheus.tcp.port = $metrics_port
EOF
  echo '[rabbitmq_prometheus].' >"$root/etc/rabbitmq/enabled_plugins"
}

running() { ctl -q ping >/dev/null 2>&1; }

# shut_down stops the node and waits until it no longer answers: a node left running would keep
# its name, so that the next start's wait would find the old node, data and all.
shut_down() {
  ctl -q shutdown >/dev/null 2>&1 || true
  for _ in $(seq 30); do
    running || return 0
    sleep 1
  done
  die "RabbitMQ $node still answers 30 s after its shutdown; stop it (scripts/sidroot.sh ctl shutdown) and try again"
}

start() {
  provision
  mount_proc
  configure
  if running; then
    say "stopping the node left running by an earlier run"
    shut_down
  fi
  # A fresh data directory each time: no queue, vhost or user left over from an earlier run.
  rm -rf "$root/var/lib/rabbitmq/mnesia" "$root/var/log/rabbitmq"/*
  in_root rabbitmq-server -detached >&2 # to stderr: callers eval what start prints
  for _ in $(seq 60); do
    if ctl -q await_startup --timeout 5 >/dev/null 2>&1; then
      env_lines
      return 0
    fi
    sleep 1
  done
  die "RabbitMQ $node did not start within a minute; see $root/var/log/rabbitmq/"
}

stop() {
  [ -d "$root" ] || return 0
  if running; then
    shut_down
  fi
  release
}

# release unmounts what is mounted in the root, once nothing runs inside it any more: the /proc
# of start and provision, and whatever an interrupted debootstrap left (it mounts /proc and
# /sys in the root, and unmounts them only if it gets to exit by itself). Deepest first.
release() {
  [ -d "$root" ] || return 0
  local mounts m
  mounts=$(awk -v r="$root" '$2 == r || index($2, r "/") == 1 { print $2 }' /proc/self/mounts | sort -r)
  for m in $mounts; do
    umount "$m" 2>/dev/null || umount -l "$m"
  done
}

env_lines() {
  printf 'export TEST_AMQP_URL=amqp://guest:guest@127.0.0.1:%s/\n' "$amqp_port"
  printf 'export TEST_RABBITMQCTL="env SIDROOT_SUITE=%s SIDROOT_DIR=%s %s ctl"\n' "$suite" "$root" "$here/sidroot.sh"
  printf 'export TEST_SIDROOT=%s\n' "$root"
  printf 'export TEST_RABBITMQ_PROMETHEUS_URL=http://127.0.0.1:%s/metrics\n' "$metrics_port"
}

version() {
  in_root dpkg-query -W -f '${Package} ${Version}\n' $packages erlang-base
}

# compose checks that the root's RabbitMQ is the one compose ships, by major.minor (Debian's
# package need not be the image's patch release), so that no figure is measured on another.
compose() {
  local want have minor
  want=$(sed -n 's/^ *image: rabbitmq:\([0-9][0-9.]*\).*/\1/p' "$here/../docker-compose.yml" | sort -u)
  [ -n "$want" ] && [ "$(printf '%s\n' "$want" | wc -l)" = 1 ] ||
    die "docker-compose.yml should name one RabbitMQ image version, names: ${want:-none}"
  minor=$(printf '%s' "$want" | cut -d. -f1,2)
  case "$minor" in *.*) ;; *) die "docker-compose.yml's RabbitMQ image $want names no minor version" ;; esac
  have=$(in_root dpkg-query -W -f '${Version}' rabbitmq-server) || die "no RabbitMQ in $root: run scripts/sidroot.sh provision"
  case "$have" in
    "$minor".*) printf 'RabbitMQ %s (%s), as compose ships %s\n' "$have" "$suite" "$want" ;;
    *) die "the $suite root's RabbitMQ is $have, compose ships $want: no figure of it would be compose's" ;;
  esac
}

. "$here/alone.sh"
case "${1:-}" in
  provision) alone "scripts/sidroot.sh provision"; provision ;;
  start) alone "scripts/sidroot.sh start"; start ;;
  stop) alone "scripts/sidroot.sh stop"; stop ;;
  env) env_lines ;;
  ctl) shift; ctl "$@" ;;
  version) version ;;
  compose) compose ;;
  *) die "usage: scripts/sidroot.sh provision|start|stop|env|ctl ARGS|version|compose" ;;
esac
