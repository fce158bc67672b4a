#!/usr/bin/env bash
# Start a throw-away, real Slurm cluster on this machine for the tests (root, Debian 12, no systemd).
#
#   slurm/testcluster/start.sh DIR [NODES]    # NODES: 1 (default) or 2
#   eval "$(slurm/testcluster/start.sh /tmp/c10-slurm 2)"   # or later: . DIR/env.sh
#   sbatch --nodes=2 --ntasks-per-node=1 slurm/train.sbatch ...
#   slurm/testcluster/stop.sh DIR
#
# NODES=1: one slurmd, node "localhost" on 127.0.0.1.
# NODES=2: slurmd "node1" and "node2", each in its own network namespace (c10-n1, c10-n2) on a
#   private bridge c10-br0 (10.200.0.0/24, never leaves the machine), with its own hostname and a
#   private /etc/hosts, so node names resolve inside jobs: Lightning takes MASTER_ADDR from the
#   first host of SLURM_NODELIST and gloo connects to it from the other nodes.
# Each node advertises 16 CPUs whatever the machine has, so slurm/train.sbatch's own
# --ntasks-per-node=2 x --cpus-per-task=8 fits; no GPUs.
# Config, state, logs, sockets and pid files all live under DIR; nothing is written to /etc.
# Env: SLURM_CTLD_PORT (16817), SLURMD_PORT (16818), TESTCLUSTER_CPUS (16), TESTCLUSTER_NET (10.200.0).
# stdout gets one line, `export SLURM_CONF=DIR/etc/slurm.conf` (also written to DIR/env.sh);
# progress goes to stderr. On failure: one ERROR line plus a log tail, stop.sh DIR, exit 1.
set -Eeuo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH
HERE=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: $0 DIR [NODES]" >&2; exit 2; }
NODES=${2:-1}
CTLD_PORT=${SLURM_CTLD_PORT:-16817}
SLURMD_PORT=${SLURMD_PORT:-16818}
CPUS=${TESTCLUSTER_CPUS:-16}
NET=${TESTCLUSTER_NET:-10.200.0}
BR=c10-br0                                   # names differ from shared/slurm-lab's slt-*

log() { echo "[testcluster] $*" >&2; }
TAIL=""     # the log die() shows; set by each step
CLEANUP=0   # set once we have started something, so die() undoes it
die() {
  [ "$BASHPID" = $$ ] || exit 1   # in a $(...) subshell: let the main shell report it
  trap - ERR; set +e
  [ -s "$TAIL" ] || TAIL=""
  log "ERROR: $*${TAIL:+ (last lines of $TAIL below)}"
  [ -z "$TAIL" ] || tail -n 15 "$TAIL" 2>/dev/null | sed 's/^/    /' >&2
  [ "$CLEANUP" = 0 ] || "$HERE/stop.sh" "$DIR" >/dev/null 2>&1
  exit 1
}
trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
since() { awk -v a="$T1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
wait_for() {  # wait_for SECONDS COMMAND...: poll every 0.1 s
  local end=$((SECONDS + $1)); shift
  until "$@"; do [ $SECONDS -lt $end ] || return 1; sleep 0.1; done
}

[ "$(id -u)" = 0 ] || die "must run as root (it starts daemons and, for NODES=2, network namespaces)"
[ "$NODES" = 1 ] || [ "$NODES" = 2 ] || die "NODES must be 1 or 2, not '$NODES'"
mkdir -p "$1"; DIR=$(cd "$1" && pwd -P)
# unix sockets are capped at 107 bytes: DIR/spool/node/node_JOBID.STEPID must fit
[ ${#DIR} -le 60 ] || die "DIR is too long for Slurm's unix sockets (${#DIR} > 60 chars): $DIR"
CONF=$DIR/etc/slurm.conf

# --- 1. packages (Debian's Slurm 22.05 + munge: 8 packages, ~13 MB)
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null ||
   ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  log "installing slurmctld slurmd slurm-client munge"
  mkdir -p "$DIR/log"; TAIL=$DIR/log/apt.log
  { apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      -o DPkg::Lock::Timeout=120 slurmctld slurmd slurm-client munge; } >"$TAIL" 2>&1 ||
    die "apt-get install failed"
fi
for t in ip ss nsenter unshare timeout; do command -v $t >/dev/null || die "$t not found"; done

# --- 2. a cluster from an earlier run in DIR is stopped; another DIR's cluster is left alone
if [ -e "$DIR/run/slurmctld.pid" ] || [ -e "$DIR/run/munged.pid" ] || [ -e "$DIR/cluster.env" ]; then
  log "stopping what an earlier run left in $DIR"; "$HERE/stop.sh" "$DIR" >&2
fi
if [ "$NODES" = 2 ]; then
  [ ! -e /sys/class/net/$BR ] ||
    die "bridge $BR exists (cluster in '$(cat /sys/class/net/$BR/ifalias)'): run stop.sh on that DIR first"
  for i in 1 2; do
    [ ! -e /run/netns/c10-n$i ] || die "netns c10-n$i exists: run stop.sh on the DIR that made it"
  done
  [[ "$(ip -o -4 addr)" != *" $NET.1/"* ]] ||
    die "$NET.1 is already on an interface (shared/slurm-lab's cluster?): set TESTCLUSTER_NET"
fi
for port in "$CTLD_PORT" "$SLURMD_PORT"; do
  [ -z "$(ss -Htln "sport = :$port")" ] || die "TCP port $port is in use: set SLURM_CTLD_PORT / SLURMD_PORT"
done

CLEANUP=1
T1=$(date +%s.%N)   # start-up time is measured from here
rm -rf "$DIR/state" "$DIR/spool" "$DIR/run" "$DIR/log" "$DIR/env.sh"
mkdir -p "$DIR"/{etc,state,spool,run,log,munge}
chmod 755 "$DIR" "$DIR"/{etc,state,spool,run,log,munge}   # munged refuses group/other-writable dirs
printf 'NODES=%s\nBR=%s\n' "$NODES" "$BR" >"$DIR/cluster.env"   # read by stop.sh

# --- 3. network (NODES=2): bridge at $NET.1 in this namespace, node i at $NET.(10+i) in c10-n$i
if [ "$NODES" = 2 ]; then
  NAMES=(node1 node2); CTL_NAME=$(hostname -s); CTL_ADDR=$NET.1
  ip link add $BR type bridge
  ip link set $BR alias "$DIR"          # ownership mark, checked by stop.sh
  ip addr add "$CTL_ADDR/24" dev $BR
  ip link set $BR up
  for i in 1 2; do
    ip netns add c10-n$i
    ip link add c10-v${i}h type veth peer name c10-v${i}n
    ip link set c10-v${i}h master $BR up
    ip link set c10-v${i}n netns c10-n$i
    ip -n c10-n$i addr add "$NET.$((10 + i))/24" dev c10-v${i}n
    ip -n c10-n$i link set c10-v${i}n up
    ip -n c10-n$i link set lo up
  done
  # bind-mounted over /etc/hosts inside each node, a file a node (the same text; a test may give one node
  # another view of a name, rewriting its file in place)
  for n in node1 node2; do
    printf '127.0.0.1 localhost\n%s %s\n%s node1\n%s node2\n' \
      "$CTL_ADDR" "$CTL_NAME" "$NET.11" "$NET.12" >"$DIR/etc/hosts.$n"
  done
else
  NAMES=(localhost); CTL_NAME=localhost; CTL_ADDR=127.0.0.1
fi

# --- 4. munged with a private key and socket (nothing in /etc/munge or /run/munge is used)
MSOCK=$DIR/munge/munge.socket       # a unix socket: reachable from every network namespace
TAIL=$DIR/log/munged.log
[ -s "$DIR/munge/munge.key" ] || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$DIR/munge/munge.key"
rm -f "$MSOCK" "$MSOCK.lock"
munged --force --key-file="$DIR/munge/munge.key" --socket="$MSOCK" --pid-file="$DIR/run/munged.pid" \
       --log-file="$TAIL" --seed-file="$DIR/munge/munged.seed" || die "munged did not start"
munge_ok() { munge -S "$MSOCK" -n 2>/dev/null | unmunge -S "$MSOCK" >/dev/null 2>&1; }
wait_for 10 munge_ok || die "munge round-trip failed"

# --- 5. slurm.conf
# slurmd -C prints the real hardware; config_overrides lets us advertise $CPUS CPUs instead.
MEM=$(env -u SLURM_CONF slurmd -C | sed -n 's/.*\(RealMemory=[0-9]*\).*/\1/p' | head -n1)
{
cat <<EOF
# written by slurm/testcluster/start.sh $DIR $NODES at $(date -u +%FT%TZ), rewritten at every start
ClusterName=c10test
SlurmctldHost=$CTL_NAME($CTL_ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire (default 120 s) is also how long a requeued job waits before it may start again
AuthInfo=socket=$MSOCK,cred_expire=10
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no mail program here; without this slurmctld logs an error per job
MailProg=/bin/true
# no cgroups: works in containers without a usable cgroup hierarchy
ProctrackType=proctrack/linuxproc
# task/affinity binds a task to its cores only where srun is asked to (--cpu-bind=cores, SLURM_CPU_BIND=cores):
# by default nothing is bound, since each node advertises more CPUs than this machine may have
TaskPlugin=task/affinity
TaskPluginParam=None
# no accounting (no slurmdbd): sacct does not work, use scontrol show job (kept MinJobAge s)
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# the default batch_sched_delay=3 makes every sbatch wait ~3 s for the next scheduler pass;
# sched_interval=1: a requeued job that becomes eligible (see cred_expire) starts within ~1 s
# (nothing else wakes the scheduler then: by default it waits for the next 10 s node ping)
SchedulerParameters=batch_sched_delay=0,sched_interval=1
# the tests requeue batch jobs (scontrol requeue)
JobRequeue=1
# job ids differ from one cluster to the next, so a new job never meets an old job's outputs/slurm/<id>/
FirstJobId=$(( $(date +%s) % 900000 + 1000 ))
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
SlurmdParameters=config_overrides
EOF
for i in "${!NAMES[@]}"; do
  n=${NAMES[$i]}
  if [ "$NODES" = 2 ]; then addr=$NET.$((11 + i)); else addr=127.0.0.1; fi
  echo "NodeName=$n NodeHostname=$n NodeAddr=$addr CPUs=$CPUS $MEM State=UNKNOWN"
done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} >"$CONF"
export SLURM_CONF=$CONF

# --- 6. slurmctld, then one slurmd per node
TAIL=$DIR/log/slurmctld.log
slurmctld -i || die "slurmctld did not start"
ctld_up() { timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; }
wait_for 15 ctld_up || die "slurmctld does not answer on port $CTLD_PORT"
for i in "${!NAMES[@]}"; do
  n=${NAMES[$i]}; TAIL=$DIR/log/slurmd-$n.log
  mkdir -p "$DIR/spool/$n"
  if [ "$NODES" = 2 ]; then
    # nsenter --net, not `ip netns exec`: that one remounts /sys, hides /sys/fs/cgroup, and
    # slurmd 22.05 then refuses to start. The mount namespace holds the private /etc/hosts.
    nsenter --net=/run/netns/c10-n$((i + 1)) unshare --mount --uts \
      sh -c "mount --bind '$DIR/etc/hosts.$n' /etc/hosts && hostname $n && exec slurmd -N $n" ||
      die "slurmd $n did not start"
  else
    slurmd -N "$n" || die "slurmd $n did not start"
  fi
done
TAIL=$DIR/log/slurmctld.log
all_idle() { [ "$(timeout 5 sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ')" = "idle " ]; }
wait_for 30 all_idle || die "nodes not idle after 30 s: $(sinfo -h -N -o '%N=%T' | tr '\n' ' ')"
T_IDLE=$(since)

# --- 7. smoke test: a batch job whose srun runs one task per node, each printing its hostname
#        (node "localhost" is this machine, so there the job sees this machine's hostname).
#        slurmctld schedules no batch job in its first ~3 s; this absorbs that wait too.
[ "$NODES" = 2 ] && expect="node1 node2 " || expect="$(hostname) "
TAIL=$DIR/log/smoke.out
# (not sbatch --wait: it polls every 2..10 s)
jid=$(sbatch --parsable -N"$NODES" --ntasks-per-node=1 -o "$TAIL" --wrap 'srun hostname')
job_state() { timeout 5 scontrol show job "$jid" 2>/dev/null | grep -o 'JobState=[A-Z_]*' || true; }
job_done() { [[ "$(job_state)" =~ =(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)$ ]]; }
wait_for 60 job_done || die "smoke job $jid (srun hostname) not done after 60 s"
[ "$(job_state)" = JobState=COMPLETED ] || die "smoke job $jid (srun hostname): $(job_state)"
[ "$(sort "$TAIL" | tr '\n' ' ')" = "$expect" ] || die "smoke job: expected hostnames '$expect'"
TAIL=$DIR/log/slurmctld.log
# let the nodes leave COMPLETING, else the next job waits for them
wait_for 10 all_idle || true

echo "export SLURM_CONF=$CONF" >"$DIR/env.sh"
log "up: ${NAMES[*]} ($CPUS CPUs each), idle after ${T_IDLE}s, smoke job done after $(since)s; pids:" \
    "munged $(cat "$DIR/run/munged.pid") slurmctld $(cat "$DIR/run/slurmctld.pid")" \
    "$(for n in "${NAMES[@]}"; do printf 'slurmd-%s %s ' "$n" "$(cat "$DIR/run/slurmd-$n.pid")"; done)"
echo "export SLURM_CONF=$CONF"
