# shellcheck shell=bash
# One run at a time on this machine; sourced by scripts/test.sh, scripts/bench.sh,
# scripts/bench-compare.sh, scripts/sidroot.sh and scripts/walkthrough.sh (in local mode). They
# stop and restart the machine's PostgreSQL and RabbitMQ and the nodes of scripts/sidroot.sh,
# whose names and ports are the machine's whatever SIDROOT_DIR says: a second run at the same
# time would stop, or wipe, what the first is testing against.
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
# orphaned test would go on restarting servers under the next run's lock. All are stopped
# (SIGSTOP, alone_stop_descendants), then get SIGTERM and SIGCONT; until they have ended, /proc
# is read again every 0.1 s, and any new one (a process that handles SIGTERM may start another,
# as may one stopped as it forked, once it goes on) is stopped and ended the same way. After
# 10 s, those left are stopped again, with what they started meanwhile, and get SIGKILL. The
# lock's holder is spared: it ends by itself, after the shell. /proc is read by the shell
# itself, forking nothing: a command run to list the processes would be one of them.
alone_end_processes() {
  local -a found=() new=()
  local -A seen=()
  local until=$((SECONDS + 10))
  alone_stop_descendants || return 0
  while [ "$SECONDS" -lt "$until" ]; do
    if [ "${#new[@]}" -gt 0 ]; then
      kill -TERM "${new[@]}" 2>/dev/null || true
      kill -CONT "${new[@]}" 2>/dev/null || true
    fi
    sleep 0.1
    alone_stop_descendants || alone_running "${found[@]}" >/dev/null || return 0
  done
  # Stopped again, with what they started meanwhile, so that none starts another as they end.
  local left
  left=$(alone_running "${found[@]}") || return 0
  # shellcheck disable=SC2086 # pids
  kill -STOP $left 2>/dev/null || true
  alone_stop_descendants || true
  left=$(alone_running "${found[@]}") || return 0
  printf 'ending the processes the run left, which outlived SIGTERM by 10 s: %s\n' "$left" >&2
  # shellcheck disable=SC2086 # pids
  kill -KILL $left 2>/dev/null || true
}

# alone_stop_descendants stops (SIGSTOP) each process descended from this shell that it has not
# stopped before (the lock's holder and what that runs spared), reading /proc again until a
# reading finds no new one (one not yet stopped may start another meanwhile), or 10 times: one
# stopped before and let go on may start others without end. It walks through those stopped
# before too, as what they started before they stopped is new. It adds each
# as PID:START (its start time, as /proc gives it: a pid is soon reused) to the caller's found,
# and sets the caller's new to their pids; it fails if there was none.
alone_stop_descendants() {
  local -A children start
  local -a todo fields
  local stat line pid i more=1 passes=0
  new=()
  while [ "$more" = 1 ] && [ "$((passes += 1))" -le 10 ]; do
    more=0 children=() start=()
    for stat in /proc/[0-9]*/stat; do
      read -r line 2>/dev/null <"$stat" || continue # gone meanwhile
      pid=${stat#/proc/} line=${line##*) }           # the fields after the command's name
      pid=${pid%/stat}
      # shellcheck disable=SC2206 # state, ppid, ...: a letter and numbers, nothing to glob
      fields=($line)
      [ "${#fields[@]}" -ge 20 ] || continue # a name with a newline in it: cut short, not the run's
      children[${fields[1]}]+=" $pid"
      start[$pid]=${fields[19]}
    done
    todo=($$)
    for ((i = 0; i < ${#todo[@]}; i++)); do
      for pid in ${children[${todo[i]}]:-}; do
        [ "$pid" != "${alone_holder:-}" ] || continue
        todo+=("$pid")
        [ -z "${seen[$pid:${start[$pid]}]:-}" ] || continue
        kill -STOP "$pid" 2>/dev/null || continue
        seen[$pid:${start[$pid]}]=1 found+=("$pid:${start[$pid]}") new+=("$pid") more=1
      done
    done
  done
  [ "${#new[@]}" -gt 0 ]
}

# alone_running PID[:START]...: prints the pids of those that still run (a zombie has ended; one
# whose start time is not START is another process that got its pid), and fails if none does.
alone_running() {
  local pid want line running="" fields
  for pid in "$@"; do
    want=${pid#*:} pid=${pid%%:*}
    read -r line 2>/dev/null <"/proc/$pid/stat" || continue
    # shellcheck disable=SC2206 # a letter and numbers, nothing to glob
    fields=(${line##*) }) # the start time, the 22nd field of all, is the 20th of these
    [ "${#fields[@]}" -ge 20 ] || continue
    [ "${fields[0]}" != Z ] || continue
    [ "$want" = "$pid" ] || [ "$want" = "${fields[19]}" ] || continue
    running+=" $pid"
  done
  [ -n "$running" ] && printf '%s\n' "${running# }"
}
