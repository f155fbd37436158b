#!/usr/bin/env bash
# Simulated hosts on one machine: network namespaces joined by a veth pair
# (2 hosts) or a bridge (more), each with its own loopback and address, for
# the multi-host tests (tests/comm/test_multihost.c) and benchmarks
# (docs/multihost.md). Needs root and iproute2.
#
#   netns_hosts.sh check             exit 0 when namespaces can be made here;
#                                    else print why on stdout and exit 77
#   netns_hosts.sh up NAME N         N hosts: host i is the namespace NAME-h<i>
#                                    with 10.213.0.<i+1>/24 (and lo up)
#   netns_hosts.sh run NAME I CMD... run CMD on host I (see below); its status
#   netns_hosts.sh addr I            print host I's address
#   netns_hosts.sh pids NAME I       the pids of every process on host I
#   netns_hosts.sh down NAME         kill every process of the hosts, remove them
#   netns_hosts.sh reap              remove the hosts of runs whose process is
#                                    gone (names ts<anything>-p<pid>-...)
#   netns_hosts.sh agent NAME-hI CMD OpenMPI's rsh agent: run the shell command
#                                    CMD on that host (mpirun --mca
#                                    plm_rsh_agent "netns_hosts.sh agent")
#
# A host runs its commands in its network namespace and in IPC, pid and
# mount namespaces of its own (unshare), as a machine of its own would:
# UCX decides that shared memory reaches a peer by the kernel's boot id
# and the IPC namespace, and its CMA by the pid namespace, so without them
# ranks of two "hosts" would still talk through shared memory. The host
# name stays the same on every host (tensorshard must not rely on it).
# Traffic goes only to the namespaces' own addresses: nothing is attached
# to the machine's own network.
set -euo pipefail

SUBNET=10.213.0

need_root() {
    if [ "$(id -u)" -ne 0 ]; then echo "not root (network namespaces need CAP_SYS_ADMIN)"; exit 77; fi
    if ! command -v ip >/dev/null 2>&1; then echo "no 'ip' command (install iproute2)"; exit 77; fi
    if ! command -v unshare >/dev/null 2>&1; then echo "no 'unshare' command (util-linux)"; exit 77; fi
}

check() {
    need_root
    local ns="tscheck-p$$"
    local err
    if ! err=$(ip netns add "$ns" 2>&1); then echo "ip netns add failed: $err"; exit 77; fi
    if ! err=$(ip netns exec "$ns" unshare --ipc --pid --fork --mount-proc true 2>&1); then
        ip netns del "$ns" 2>/dev/null || true
        echo "unshare in a network namespace failed: $err"; exit 77
    fi
    if ! err=$(ip link add "tsck$$a" netns "$ns" type veth peer name "tsck$$b" netns "$ns" 2>&1); then
        ip netns del "$ns" 2>/dev/null || true
        echo "cannot create a veth pair: $err"; exit 77
    fi
    ip netns del "$ns"
}

down() {
    local name=$1
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${name}-(h[0-9]+|sw)$" || true); do
        # every process of the host (its tsrun, ranks, orted), then the namespace
        for _ in 1 2 3; do
            local pids
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            [ -z "$pids" ] && break
            kill -9 $pids 2>/dev/null || true
            sleep 0.05
        done
        ip netns del "$ns" 2>/dev/null || true
    done
}

up() {
    local name=$1 n=$2
    need_root
    if ! [[ "$n" =~ ^[0-9]+$ ]] || [ "$n" -lt 2 ] || [ "$n" -gt 16 ]; then
        echo "netns_hosts.sh: N=$n: 2..16 hosts" >&2; exit 2
    fi
    if [ ${#name} -gt 20 ]; then echo "netns_hosts.sh: NAME '$name' is longer than 20 characters" >&2; exit 2; fi
    trap 'down "$name"' ERR
    local i
    for ((i = 0; i < n; i++)); do
        ip netns add "$name-h$i"
        ip -n "$name-h$i" link set lo up
    done
    # interface names are at most 15 bytes: a short hash of NAME
    local tag
    tag=$(printf '%s' "$name" | cksum | awk '{printf "%08x", $1}')
    if [ "$n" -eq 2 ]; then
        ip link add "v${tag}0" netns "$name-h0" type veth peer name "v${tag}1" netns "$name-h1"
        for i in 0 1; do
            ip -n "$name-h$i" addr add "$SUBNET.$((i + 1))/24" dev "v${tag}$i"
            ip -n "$name-h$i" link set "v${tag}$i" up
        done
    else
        ip netns add "$name-sw"
        ip -n "$name-sw" link add br0 type bridge
        ip -n "$name-sw" link set br0 up
        for ((i = 0; i < n; i++)); do
            ip link add "v${tag}$i" netns "$name-h$i" type veth peer name "p$i" netns "$name-sw"
            ip -n "$name-sw" link set "p$i" master br0
            ip -n "$name-sw" link set "p$i" up
            ip -n "$name-h$i" addr add "$SUBNET.$((i + 1))/24" dev "v${tag}$i"
            ip -n "$name-h$i" link set "v${tag}$i" up
        done
    fi
    # a veth pair has no carrier for a moment after it is up, and UCX
    # leaves out interfaces that are not running: wait (5 s at most)
    for ((i = 0; i < n; i++)); do
        local k
        for ((k = 0; k < 100; k++)); do
            [ "$(ip netns exec "$name-h$i" cat "/sys/class/net/v${tag}$i/operstate" 2>/dev/null)" = up ] && break
            sleep 0.05
        done
        if [ "$k" -eq 100 ]; then
            echo "netns_hosts.sh: v${tag}$i on host $i is not up after 5 s" >&2
            down "$name"
            exit 1
        fi
    done
    trap - ERR
}

run() {
    local name=$1 i=$2
    shift 2
    exec ip netns exec "$name-h$i" unshare --ipc --pid --fork --kill-child --mount-proc "$@"
}

# OpenMPI's rsh agent (mpirun --mca plm_rsh_agent "netns_hosts.sh agent"):
# $1 a host's namespace (NAME-h<i>), the rest the shell command to run there.
# With a host name of its own (a UTS namespace): OpenMPI's daemons name
# their node by it, and two daemons of one name fail MPI_Init with 2
# processes per host ("getting local rank failed").
agent() {
    local ns=$1
    shift
    exec ip netns exec "$ns" unshare --ipc --pid --uts --fork --kill-child --mount-proc \
        /bin/sh -c 'hostname "$0" && eval "$*"' "$ns" "$*"
}

reap() {
    local ns pid
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^ts[A-Za-z0-9]*-p[0-9]+-' || true); do
        pid=$(printf '%s' "$ns" | sed -E 's/^ts[A-Za-z0-9]*-p([0-9]+)-.*/\1/')
        if ! kill -0 "$pid" 2>/dev/null; then down "${ns%-*}"; fi
    done
}

cmd=${1:-}
case "$cmd" in
check) check ;;
up) [ $# -eq 3 ] || { echo "usage: $0 up NAME N" >&2; exit 2; }; up "$2" "$3" ;;
run) [ $# -ge 4 ] || { echo "usage: $0 run NAME I CMD..." >&2; exit 2; }; shift; run "$@" ;;
addr) [ $# -eq 2 ] || { echo "usage: $0 addr I" >&2; exit 2; }; echo "$SUBNET.$(($2 + 1))" ;;
pids) [ $# -eq 3 ] || { echo "usage: $0 pids NAME I" >&2; exit 2; }; ip netns pids "$2-h$3" ;;
down) [ $# -eq 2 ] || { echo "usage: $0 down NAME" >&2; exit 2; }; down "$2" ;;
agent) [ $# -ge 3 ] || { echo "usage: $0 agent NAME-h<i> CMD..." >&2; exit 2; }; shift; agent "$@" ;;
reap) reap ;;
*) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
