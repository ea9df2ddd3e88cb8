# shellcheck shell=bash
# One run at a time on this machine; sourced by scripts/test.sh, scripts/bench.sh,
# scripts/bench-compare.sh and scripts/sidroot.sh. They stop and restart the machine's
# PostgreSQL and RabbitMQ and the nodes of scripts/sidroot.sh, whose names and ports are the
# machine's whatever SIDROOT_DIR says: a second run at the same time would stop, or wipe, what
# the first is testing against.
#
# The lock (flock(1)) is held by a small process of its own that lives as long as the run's
# shell. Not by the shell: every process the run starts would inherit the descriptor, Go's
# os/exec passes it on too, and a server restarted by a test would hold the lock for good.

alone_lock=${RUN_ALONE_LOCK:-/run/lock/outbox-inbox-tests.lock}

# alone WHO: waits while another run holds the lock, then holds it until this shell exits.
# WHO names this run to a run that waits for it. The scripts this run starts pass at once: they
# see RUN_ALONE_HOLDER, the run's pid and lock, and the pid alive (a script run as another user
# than the run cannot see that, and would wait for it). Without flock(1) (util-linux), or a lock
# file it may open, it says so and does not wait.
alone() {
  local held_by=${RUN_ALONE_HOLDER:-}
  if [ -n "$held_by" ] && [ "${held_by#*:}" = "$alone_lock" ] && kill -0 "${held_by%%:*}" 2>/dev/null; then
    return 0 # a script of the run that holds it
  fi
  if ! command -v flock >/dev/null; then
    printf '%s: no flock(1) here: not checking for another run on this machine\n' "$1" >&2
    return 0
  fi
  # Made readable by anyone, as a run as root and one as another user must see the same lock;
  # read-only after that (flock needs no more, and a file another user made may not be written).
  if ! { [ -e "$alone_lock" ] || (umask 022 && : >>"$alone_lock"); } 2>/dev/null || [ ! -r "$alone_lock" ]; then
    printf '%s: cannot open %s: not checking for another run on this machine\n' "$1" "$alone_lock" >&2
    return 0
  fi
  # The holder says "held" on a pipe (a FIFO whose name is gone once both ends are open). Each
  # side watches the other while it waits: a holder whose run was killed while it waited for
  # the lock gives up, rather than take the lock for nobody.
  local ready got holder
  ready=$(mktemp -u)
  mkfifo "$ready"
  exec 7<>"$ready"
  rm -f "$ready"
  (
    trap '' INT TERM # it ends with the run's shell, after the run's own cleanup
    exec 9<"$alone_lock"
    if ! flock -n 9; then
      printf '%s: waiting for another run on this machine to end (%s; lock %s)\n' \
        "$1" "$(cat "$alone_lock.holder" 2>/dev/null || echo "holder unknown")" "$alone_lock" >&2
      until flock -w 1 9; do kill -0 "$$" 2>/dev/null || exit 0; done
    fi
    # Another user's file here may not be opened to be written, though it may be removed.
    local holder_file="$alone_lock.holder" who="pid $$, $1"
    (umask 000 && { echo "$who" >"$holder_file" || { rm -f "$holder_file" && echo "$who" >"$holder_file"; }; }) 2>/dev/null || true
    echo held >&7
    exec 7>&- </dev/null >/dev/null 2>&1
    while kill -0 "$$" 2>/dev/null; do sleep 1; done
  ) &
  holder=$!
  until read -r -t 1 got <&7; do
    kill -0 "$holder" 2>/dev/null || break
  done
  exec 7>&-
  [ "${got:-}" = held ] || { printf '%s: could not take the lock %s\n' "$1" "$alone_lock" >&2; return 1; }
  export RUN_ALONE_HOLDER="$$:$alone_lock"
  alone_holder=$holder
}

# alone_end_processes ends what the run's shell started and still runs (a go test, its test
# binaries, what they run), for the run's EXIT trap, before its cleanup: bash runs that trap on
# a signal but leaves the foreground commands running, and the lock goes with the shell, so an
# orphaned test would go on restarting servers under the next run's lock. Each process found is
# stopped (SIGSTOP) and the search made again until it finds no more, as a go test whose test
# binary ended would start the next; then all get SIGTERM, and those left after 10 s SIGKILL.
# The lock's holder is spared: it ends by itself, after the shell. /proc is read by the shell
# itself, forking nothing: a command run to list the processes would be one of them.
alone_end_processes() {
  local -a found=() todo
  local -A children seen=()
  local stat line pid ppid more=1
  while [ "$more" = 1 ]; do
    more=0 children=()
    for stat in /proc/[0-9]*/stat; do
      read -r line 2>/dev/null <"$stat" || continue # gone meanwhile
      pid=${stat#/proc/} line=${line##*) }           # the fields after the command's name
      ppid=${line#* }
      children[${ppid%% *}]+=" ${pid%/stat}"
    done
    todo=($$)
    while [ "${#todo[@]}" -gt 0 ]; do
      pid=${todo[0]} todo=("${todo[@]:1}")
      for pid in ${children[$pid]:-}; do
        if [ "$pid" = "${alone_holder:-}" ] || [ -n "${seen[$pid]:-}" ]; then continue; fi
        kill -STOP "$pid" 2>/dev/null || continue
        seen[$pid]=1 found+=("$pid") todo+=("$pid") more=1
      done
    done
  done
  [ "${#found[@]}" -gt 0 ] || return 0
  kill -TERM "${found[@]}" 2>/dev/null || true
  kill -CONT "${found[@]}" 2>/dev/null || true
  for _ in $(seq 100); do
    alone_running "${found[@]}" >/dev/null || return 0
    sleep 0.1
  done
  printf 'ending the processes the run left, which outlived SIGTERM by 10 s: %s\n' "$(alone_running "${found[@]}")" >&2
  kill -KILL "${found[@]}" 2>/dev/null || true
}

# alone_running PID...: prints those that still run (a zombie has ended), and fails if none does.
alone_running() {
  local pid line state running=""
  for pid in "$@"; do
    read -r line 2>/dev/null <"/proc/$pid/stat" || continue
    state=${line##*) }
    [ "${state%% *}" = Z ] || running+=" $pid"
  done
  [ -n "$running" ] && printf '%s\n' "${running# }"
}
