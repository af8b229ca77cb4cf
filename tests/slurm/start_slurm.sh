#!/usr/bin/env bash
# A real two-node SLURM with 8 fake GPUs a node on this machine (two slurmd, nodes <host> and
# <host>-1), for tests and for trying the SLURM profile by hand. Needs root (apt-get, mknod,
# /etc/slurm).
#
#   tests/slurm/start_slurm.sh          install SLURM if missing, write /etc/slurm/{slurm,gres}.conf
#                                       from the templates beside this script, make the fake GPU
#                                       devices, start slurmctld and a slurmd per node, wait until
#                                       the nodes are idle; prints `slurmctld_pid=N` and a
#                                       `slurmd_pid=N` per node
#   tests/slurm/start_slurm.sh stop     stop the daemons named in the pid files it wrote
#
# It refuses to start when a slurmctld or slurmd is already running: it never takes over or
# stops daemons that it did not start.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
RUN_DIR=/run/slurm-ci                  # the pid files (SlurmctldPidFile / SlurmdPidFile)
FAKE_GPU_DIR=/opt/fakegpu              # named in gres.conf.in
CONF_DIR=/etc/slurm                    # the default path; see slurm.conf.in
MARKER="# tests/slurm/start_slurm.sh"
WAIT_S=${SLURM_CI_WAIT_S:-90}

log() { echo "start_slurm: $*" >&2; }
# running, and not a zombie that nobody has reaped yet
alive() { local st; st=$(ps -o stat= -p "$1" 2>/dev/null) && [[ -n "$st" && "$st" != Z* ]]; }
die() { log "error: $*"; exit 1; }

stop() {
    local file pid
    for file in "$RUN_DIR"/slurmd-*.pid "$RUN_DIR/slurmctld.pid"; do
        [[ -f "$file" ]] || continue
        pid=$(<"$file")
        if [[ -n "$pid" ]] && alive "$pid"; then
            log "stopping $(basename "$file" .pid) (pid $pid)"
            kill -TERM "$pid" || true
            for _ in $(seq 1 100); do alive "$pid" || break; sleep 0.1; done
            if alive "$pid"; then kill -KILL "$pid" || true; fi
        fi
        rm -f "$file"
    done
}

if [[ "${1:-start}" == stop ]]; then
    stop
    exit 0
fi
[[ "${1:-start}" == start ]] || die "usage: $0 [start|stop]"
[[ $(id -u) == 0 ]] || die "must run as root (apt-get, mknod, $CONF_DIR)"

# --- install
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v sbatch >/dev/null; then
    log "installing SLURM (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >&2
fi

# --- nothing of ours, or anyone's, may be running already
for name in slurmctld slurmd; do
    if pid=$(pgrep -x "$name" | head -n1) && [[ -n "$pid" ]]; then
        die "$name is already running (pid $pid); stop it first (\`$0 stop\` if this script started it)"
    fi
done

# --- fake GPUs: character devices (regular files give no CUDA_VISIBLE_DEVICES)
mkdir -p "$FAKE_GPU_DIR"
for i in 0 1 2 3 4 5 6 7; do
    dev="$FAKE_GPU_DIR/nvidia$i"
    [[ -c "$dev" ]] || { rm -f "$dev"; mknod -m 666 "$dev" c 195 "$i"; }
done

# --- config: keep a copy of a slurm.conf that this script did not write
host=$(hostname -s)
mkdir -p "$CONF_DIR"
for name in slurm.conf gres.conf; do
    target="$CONF_DIR/$name"
    if [[ -f "$target" ]] && ! grep -qF "$MARKER" "$target"; then
        backup="$target.before-slurm-ci.$(date +%s)"
        log "keeping the existing $target as $backup"
        cp -p "$target" "$backup"
    fi
    { echo "$MARKER wrote this file from $name.in"; sed "s/@HOST@/$host/g" "$HERE/$name.in"; } \
        >"$target.tmp"
    mv "$target.tmp" "$target"
done

NODES=("$host" "$host-1")
mkdir -p "$RUN_DIR" /var/spool/slurmctld /var/log/slurm
for node in "${NODES[@]}"; do mkdir -p "/var/spool/slurmd/$node"; done
rm -f "$RUN_DIR"/slurmctld.pid "$RUN_DIR"/slurmd*.pid

# --- start: the Debian names (under the *-wlm names the node's Gres is silently dropped);
# -c starts from a clean job state
wait_pidfile() {
    local f="$RUN_DIR/$1.pid"
    for _ in $(seq 1 100); do
        [[ -s "$f" ]] && alive "$(<"$f")" && return 0
        sleep 0.1
    done
    tail -n 20 "/var/log/slurm/$1.log" >&2 || true
    stop
    die "$1 did not start"
}
slurmctld -c
wait_pidfile slurmctld
for node in "${NODES[@]}"; do
    slurmd -N "$node"
    wait_pidfile "slurmd-$node"
done

state=""
deadline=$((SECONDS + WAIT_S))
while ((SECONDS < deadline)); do
    # a daemon can exit after writing its pid file (a fatal error in the config)
    for file in "$RUN_DIR/slurmctld.pid" "$RUN_DIR"/slurmd-*.pid; do
        alive "$(<"$file")" || { state="$(basename "$file" .pid) exited"; break 2; }
    done
    state=$(timeout 10 sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ' || true)
    [[ "$state" == "idle " ]] && break
    sleep 1
done
if [[ "$state" != "idle " ]]; then
    log "node states '$state' after $((SECONDS - deadline + WAIT_S))s"
    timeout 10 sinfo -N -o "%N %T %G %E" >&2 || true
    tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd-*.log >&2 || true
    stop
    die "the nodes did not become idle"
fi
log "nodes ${NODES[*]} idle with $(timeout 10 sinfo -h -o %G | head -n1) each"
echo "slurmctld_pid=$(<"$RUN_DIR/slurmctld.pid")"
for node in "${NODES[@]}"; do echo "slurmd_pid=$(<"$RUN_DIR/slurmd-$node.pid")"; done
