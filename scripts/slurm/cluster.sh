#!/usr/bin/env bash
# A throwaway SLURM cluster on this machine, for trying the job scripts and for the tests.
#
#   scripts/slurm/cluster.sh start [--nodes 1|2]   # prints the SLURM_CONF line to export
#   scripts/slurm/cluster.sh status
#   scripts/slurm/cluster.sh stop                  # cancels jobs, stops every daemon
#
# Runs as root. Installs Debian's slurm-wlm, munge and libpmix-dev when missing. Everything
# it writes lives under $HYBRIDDL_SLURM_DIR (default /run/hybriddl-slurm) and /tmp/slurm-node*;
# the system's own /etc/slurm and munge are left alone. Every daemon it starts carries
# HYBRIDDL_SLURM_CLUSTER=<that directory> in its environment, which is how `stop` finds
# them (and the slurmstepd processes they fork) without killing anything by name.
# Idempotent: `start` on a running cluster of the same size only reports it.
set -euo pipefail

DIR=${HYBRIDDL_SLURM_DIR:-/run/hybriddl-slurm}
CONF=$DIR/etc/slurm.conf
CTLD_PORT=${HYBRIDDL_SLURMCTLD_PORT:-16817}
PACKAGES=(slurm-wlm munge libpmix-dev)

die() { echo "cluster.sh: $*" >&2; exit 2; }

usage() { die "usage: cluster.sh start|stop|status [--nodes 1|2]"; }

nodes_configured() { grep -c '^NodeName=' "$CONF" 2>/dev/null || echo 0; }

install_packages() {
    # libpmix-dev ships the libpmix.so that Slurm's pmix plugin loads; without it slurmd
    # starts but every `srun --mpi=pmix` step fails.
    local missing=()
    for package in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" \
            || missing+=("$package")
    done
    [ ${#missing[@]} -eq 0 ] && return
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    echo "cluster.sh: installing ${missing[*]}" >&2
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${missing[@]}" >&2
}

# Processes whose environment names this cluster's directory: our daemons and their steps.
our_processes() {
    local environ pid
    for environ in /proc/[0-9]*/environ; do
        pid=${environ#/proc/}; pid=${pid%/environ}
        [ "$pid" = "$$" ] && continue
        if tr "\0" "\n" 2>/dev/null < "$environ" | grep -qx "HYBRIDDL_SLURM_CLUSTER=$DIR"; then
            echo "$pid"
        fi
    done
}

running() {
    local pidfile=$1
    [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

wait_until() {  # wait_until SECONDS COMMAND...: poll COMMAND until it succeeds, or fail
    local seconds=$1 deadline
    shift
    deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || return 1
        sleep 0.1
    done
}

write_config() {
    local nodes=$1 host cpus i
    host=$(hostname)
    cpus=$(nproc)
    mkdir -p "$DIR"/{etc,log,run,state,munge}
    cat > "$CONF" <<EOF
# Written by hybriddl's scripts/slurm/cluster.sh: a throwaway cluster on one machine.
ClusterName=hybriddl
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=10: a requeued job may start again 10 s after it ended (default 120 s).
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# Each node its own TmpFS: PMIx makes a directory there per step and two nodes on one
# machine would collide ("Cannot create directory ... File exists").
TmpFS=/tmp/slurm-%n
# pgid: with linuxproc a background process of a requeued job was left running.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Schedule every 1-2 s (defaults 30/60 s) so a requeued job starts again within seconds.
SchedulerParameters=bf_interval=1,sched_interval=2
JobRequeue=1
ReturnToService=2
MpiDefault=pmix
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
EOF
    for i in $(seq 1 "$nodes"); do
        echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=$cpus State=UNKNOWN" >> "$CONF"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
    # Pip's Open MPI has no munge security component: PMIx clients must use native.
    echo "PMIxEnv=PMIX_SECURITY_MODE=native" > "$DIR/etc/mpi.conf"
    : > "$DIR/etc/plugstack.conf"
}

start_munge() {
    running "$DIR/munge/munged.pid" && return
    chown munge:munge "$DIR/munge"
    chmod 755 "$DIR/munge"  # the socket must be reachable by every user
    if [ ! -s "$DIR/munge/munge.key" ]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    fi
    chown munge:munge "$DIR/munge/munge.key"
    chmod 400 "$DIR/munge/munge.key"
    HYBRIDDL_SLURM_CLUSTER=$DIR runuser -u munge -- /usr/sbin/munged \
        --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
        --seed-file="$DIR/munge/munged.seed"
    wait_until 10 test -S "$DIR/munge/munge.socket" || die "munged did not start (log: $DIR/munge)"
}

start_daemon() {  # start_daemon PIDFILE LOG COMMAND...: in the background, in its own session
    local pidfile=$1 log=$2
    shift 2
    running "$pidfile" && return
    HYBRIDDL_SLURM_CLUSTER=$DIR SLURM_CONF=$CONF setsid "$@" >> "$log" 2>&1 < /dev/null &
}

nodes_idle() {
    local nodes=$1
    [ "$(SLURM_CONF=$CONF sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" -eq "$nodes" ]
}

no_jobs_running() {
    [ -z "$(SLURM_CONF=$CONF squeue -h -t running,completing,configuring -o %i 2>/dev/null)" ]
}

cmd_start() {
    local nodes=$1 i
    [ "$(id -u)" -eq 0 ] || die "must run as root (it starts munged, slurmctld and slurmd)"
    install_packages
    if running "$DIR/run/slurmctld.pid" && [ "$(nodes_configured)" -ne "$nodes" ]; then
        cmd_stop
    fi
    if ! running "$DIR/run/slurmctld.pid"; then
        rm -rf "$DIR/state"
        write_config "$nodes"
    fi
    start_munge
    start_daemon "$DIR/run/slurmctld.pid" "$DIR/log/slurmctld.out" \
        /usr/sbin/slurmctld -D -i -f "$CONF"
    for i in $(seq 1 "$nodes"); do
        mkdir -p "/tmp/slurm-node$i" "$DIR/spool-node$i"
        start_daemon "$DIR/run/slurmd-node$i.pid" "$DIR/log/slurmd-node$i.out" \
            /usr/sbin/slurmd -D -N "node$i" -f "$CONF"
    done
    wait_until 30 nodes_idle "$nodes" || die "$nodes node(s) not idle within 30 s (logs: $DIR/log)"
    echo "export SLURM_CONF=$CONF"
}

cmd_stop() {
    local pids pid
    if [ -f "$CONF" ] && running "$DIR/run/slurmctld.pid"; then
        SLURM_CONF=$CONF scancel --full --quiet --user=root 2>/dev/null || true
        # Jobs end through slurmd (their steps' processes die with them); give them 15 s.
        wait_until 15 no_jobs_running || true
    fi
    pids=$(our_processes)
    [ -n "$pids" ] && kill $pids 2>/dev/null || true
    for _ in $(seq 1 100); do
        pids=$(our_processes)
        [ -z "$pids" ] && break
        sleep 0.1
    done
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
    rm -rf "$DIR" /tmp/slurm-node1 /tmp/slurm-node2
}

cmd_status() {
    if [ -f "$CONF" ] && running "$DIR/run/slurmctld.pid"; then
        echo "export SLURM_CONF=$CONF"
        SLURM_CONF=$CONF sinfo -N
        SLURM_CONF=$CONF squeue
    else
        echo "cluster.sh: not running" >&2
        return 1
    fi
}

command=${1:-}
[ $# -gt 0 ] && shift
nodes=1
while [ $# -gt 0 ]; do
    case $1 in
        --nodes) nodes=${2:-}; shift 2 || usage ;;
        *) usage ;;
    esac
done
[[ $nodes == 1 || $nodes == 2 ]] || die "--nodes $nodes: give 1 or 2"
case $command in
    start) cmd_start "$nodes" ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) usage ;;
esac
