#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/slurm (``nox -s slurm``): Debian's slurm-wlm and munge.
#
#   tests/slurm/cluster.sh start   install what is missing, write the config, start munged, slurmctld and slurmd,
#                                  wait until the node is idle
#   tests/slurm/cluster.sh stop    cancel any job left, stop the daemons that ``start`` started (by their pid files)
#                                  and wait for them
#
# Everything lives in one state directory ($LOONGFORGE_SLURM_STATE, default /tmp/loongforge-slurm): the config,
# the munge key and socket, spool and state directories, pid files and daemon logs. Nothing under /etc is
# written, so a machine's own Slurm (if any) is untouched; clients find this cluster through
# SLURM_CONF=$STATE/slurm.conf. ``start`` is idempotent: run twice, it leaves the running daemons alone.
#
# The node is "localhost" with 2 CPUs and no cgroups: processes are tracked through /proc
# (proctrack/linuxproc) and not confined (task/none), which works in containers that have no writable cgroup
# hierarchy. The daemons run as root (SlurmUser=root), as the container's user.
set -euo pipefail

STATE=${LOONGFORGE_SLURM_STATE:-/tmp/loongforge-slurm}
CONF=$STATE/slurm.conf
export SLURM_CONF=$CONF
DAEMONS=(slurmd slurmctld munged)   # stop order

log() { echo "[slurm-cluster] $*" >&2; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
            && command -v munged >/dev/null; then
        return
    fi
    log "installing slurmctld, slurmd, slurm-client and munge (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

write_config() {
    mkdir -p "$STATE"/{munge,ctld,spool,log}
    chmod 700 "$STATE" "$STATE/munge"
    if [ ! -s "$STATE/munge/munge.key" ]; then
        dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$STATE/munge/munge.key"
    fi
    local mem_mb
    mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    cat >"$CONF" <<CONF
# Written by tests/slurm/cluster.sh: a one-node test cluster on localhost.
ClusterName=loongforge-test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket.2,cred_expire=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=4
KillWait=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
    # No cgroup plugin is used (see above); an explicit cgroup.conf keeps slurmd from probing the host's.
    cat >"$STATE/cgroup.conf" <<CONF
# Written by tests/slurm/cluster.sh: no cgroup plugin is configured in slurm.conf.
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
CONF
}

running() { # NAME: whether our pid file names a live process called NAME (not a pid reused since)
    local pidfile=$STATE/$1.pid
    [ -s "$pidfile" ] && [ "$(cat "/proc/$(cat "$pidfile")/comm" 2>/dev/null)" = "$1" ]
}

start_daemons() {
    running munged || munged --force --socket="$STATE/munge/munge.socket.2" --key-file="$STATE/munge/munge.key" \
        --pid-file="$STATE/munged.pid" --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/munged.seed"
    running slurmctld || slurmctld -c -f "$CONF"   # -c: no jobs left from an earlier start
    running slurmd || slurmd -f "$CONF" -N localhost
}

wait_idle() {
    local state=""
    for _ in $(seq 1 120); do
        state=$(sinfo --noheader --nodes=localhost --format=%T 2>/dev/null || true)
        case $state in
            idle*) log "node localhost is idle (SLURM_CONF=$CONF)"; return ;;
            down*|drain*) scontrol update nodename=localhost state=resume 2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    log "node never became idle (last state: '${state:-none}'); daemon logs follow"
    tail -n 20 "$STATE"/log/*.log >&2 || true
    exit 1
}

stop_daemons() {
    local name pid
    if running slurmctld && running slurmd; then  # a test that failed may have left a job running
        scancel --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 1 60); do [ -z "$(squeue --noheader 2>/dev/null)" ] && break; sleep 0.5; done
    fi
    for name in "${DAEMONS[@]}"; do
        if running "$name"; then
            pid=$(cat "$STATE/$name.pid")
            kill "$pid"
            for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && { log "$name ($pid) ignored SIGTERM: killing it"; kill -9 "$pid"; }
            log "stopped $name ($pid)"
        fi
        rm -f "$STATE/$name.pid"
    done
}

case ${1:-} in
    start) install_packages; write_config; start_daemons; wait_idle ;;
    stop) stop_daemons ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
