#!/usr/bin/env bash
# bench_collectives on two hosts (issue 12 §4): two network namespaces
# joined by a veth pair (scripts/netns_hosts.sh), `tsrun --nnodes 2` on
# each, UCX over TCP between them; 1 rank per host, then 2 (shared memory
# within a host). Each table comes with ucx_perftest between the hosts and
# OpenMPI over the same namespaces (when mpirun and bench_collectives_mpi
# are there). Needs root and iproute2; removes its namespaces on exit.
#
#   scripts/bench_two_hosts.sh [BUILDDIR] [-- bench_collectives flags]
# e.g. scripts/bench_two_hosts.sh build -- --max-mib 16
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
build=$(cd "$build" && pwd)
ns=$("$here/netns_hosts.sh" check) || { echo "bench_two_hosts: cannot make hosts here: $ns" >&2; exit 1; }
name="tsbench-p$$"
trap '"$here/netns_hosts.sh" down "$name"' EXIT INT TERM
"$here/netns_hosts.sh" up "$name" 2
export TS_STORE_TOKEN
TS_STORE_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export TS_BENCH_NETNS="$name" TS_BENCH_NETNS_SCRIPT="$here/netns_hosts.sh"
for per in 1 2; do
    echo "==== 2 hosts x $per rank(s)"
    "$here/netns_hosts.sh" run "$name" 1 timeout 900 "$build/tools/tsrun" --nnodes 2 --node-rank 1 \
        --nproc-per-node "$per" --master-addr 10.213.0.1 --master-port 29500 \
        "$build/bench/bench_collectives" "$@" >/dev/null 2>&1 &
    other=$!
    "$here/netns_hosts.sh" run "$name" 0 timeout 900 "$build/tools/tsrun" --nnodes 2 --node-rank 0 \
        --nproc-per-node "$per" --master-addr 10.213.0.1 --master-port 29500 --no-prefix \
        "$build/bench/bench_collectives" "$@"
    wait "$other"
done
