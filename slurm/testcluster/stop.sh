#!/usr/bin/env bash
# Stop the cluster that slurm/testcluster/start.sh started in DIR.
#
#   slurm/testcluster/stop.sh DIR
#
# Cancels all jobs, stops slurmd(s), slurmctld and munged by the pid files under DIR (checking
# /proc/PID/comm first), kills what is left of this cluster's jobs (processes whose environment
# names this DIR's slurm.conf and a job id), and for NODES=2 removes the c10-* namespaces, veths
# and bridge, if this DIR made them. Never kills by name; every wait is bounded, then SIGKILL.
# Safe to run twice, or when nothing runs. Keeps DIR/log for post-mortems. Exit status 0.
set -uo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH
[ $# = 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
[ -d "$1" ] || exit 0
DIR=$(cd "$1" && pwd -P)
export SLURM_CONF=$DIR/etc/slurm.conf
NODES=1; BR=c10-br0
[ -f "$DIR/cluster.env" ] && . "$DIR/cluster.env"
log() { echo "[testcluster] $*" >&2; }
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
gone() {  # gone SECONDS PID: wait up to SECONDS for PID to exit
  local i; for ((i = 0; i < $1 * 10; i++)); do alive "$2" || return 0; sleep 0.1; done; ! alive "$2"
}

stop_pids() {  # stop_pids COMM PIDFILE...: SIGTERM them all, wait up to 10 s, then SIGKILL
  local want=$1 f p; local -a pids=(); shift
  for f; do
    p=$(cat "$f" 2>/dev/null) || continue
    if alive "$p" && [ "$(cat /proc/$p/comm 2>/dev/null)" = "$want" ]; then
      log "stopping $want ($p)"; kill -TERM "$p"; pids+=("$p")
    elif alive "$p"; then log "pid $p in $f is not $want, left alone"; fi
  done
  for p in "${pids[@]}"; do
    gone 10 "$p" || { log "$want ($p) ignored SIGTERM, SIGKILL"; kill -KILL "$p"; gone 2 "$p"; }
  done
  rm -f "$@"
}

# 1. cancel jobs while slurmctld can still do it cleanly
if alive "$(cat "$DIR/run/slurmctld.pid" 2>/dev/null)"; then
  jobs=$(timeout 10 squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs $jobs"; timeout 10 scancel $jobs
    for _ in $(seq 100); do [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
  fi
fi

# 2. daemons, by pid file
stop_pids slurmd "$DIR"/run/slurmd-*.pid &   # each takes ~2 s, so side by side
stop_pids slurmctld "$DIR/run/slurmctld.pid"
wait
stop_pids munged "$DIR/run/munged.pid"        # last: the others use it

# 3. leftovers of this cluster's jobs: slurmstepd (inherits SLURM_CONF from slurmd) and tasks
#    (Slurm sets SLURM_CONF and SLURM_JOB_ID in their environment). Not us, not our callers.
keep=" $$ "; p=$$
while [ "${p:-1}" -gt 1 ]; do p=$(ps -o ppid= -p "$p" | tr -d ' '); keep+="$p "; done
for d in /proc/[0-9]*; do
  p=${d#/proc/}; [[ "$keep" == *" $p "* ]] && continue
  env=$(tr "\0" "\n" 2>/dev/null <"$d/environ") || continue
  grep -qxF "SLURM_CONF=$SLURM_CONF" <<<"$env" || continue
  if [ "$(cat "$d/comm" 2>/dev/null)" = slurmstepd ] || grep -q '^SLURM_JOB_ID=' <<<"$env"; then
    log "killing leftover $(cat "$d/comm" 2>/dev/null) ($p)"; kill -KILL "$p" 2>/dev/null
  fi
done

# 4. network namespaces (NODES=2), only if the bridge is ours (start.sh put DIR in its alias)
if [ "$NODES" = 2 ]; then
  owner=$(cat /sys/class/net/$BR/ifalias 2>/dev/null || echo "$DIR")
  if [ "$owner" != "$DIR" ]; then
    log "$BR belongs to the cluster in $owner, left alone"
  else
    for i in 1 2; do
      if [ -e /run/netns/c10-n$i ]; then
        for p in $(ip netns pids c10-n$i 2>/dev/null); do
          log "killing $(cat /proc/$p/comm 2>/dev/null) ($p) left in c10-n$i"; kill -KILL "$p" 2>/dev/null
        done
        ip netns del c10-n$i
      fi
      ip link del c10-v${i}h 2>/dev/null   # normally gone with its namespace
    done
    ip link del $BR 2>/dev/null && log "removed c10-n1, c10-n2 and $BR"
  fi
fi
rm -f "$DIR/cluster.env" "$DIR/env.sh"
exit 0
