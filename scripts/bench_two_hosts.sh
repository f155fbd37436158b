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
#
#   scripts/bench_two_hosts.sh --step [BUILDDIR] [ROUNDS] [-- bench_fsdp_step flags]
# instead: the GPT training step on 2 hosts x 2 ranks, bench_fsdp_step
# (its "fsdp" row) against torch 1.13 DDP over gloo on the same model and
# batch (tools/bench/torch_ddp_step.py with torchrun-style variables, one
# process per rank, gloo on the hosts' veth), ROUNDS times alternately
# (default 2), and the ratio of the medians (issue 12 §5: target <= 0.80).
# `-- --hsdp 2` shards over a (2 hosts, 2 ranks) mesh instead of all 4
# ranks (HSDP: only the gradients' all-reduce crosses the hosts).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
step=0
if [ "${1:-}" = "--step" ]; then step=1; shift; fi
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

if [ "$step" = 1 ]; then
    rounds=2
    if [[ "${1:-}" =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
    [ "${1:-}" = "--" ] && shift
    extra=("$@")
    ddp=${TS_BENCH_DDP_SCRIPT:-$here/../tools/bench/torch_ddp_step.py}  # the opt branch adds it
    fsdp_ms=() ddp_ms=()
    for ((k = 0; k < rounds; k++)); do
        echo "==== round $((k + 1)) of $rounds: bench_fsdp_step, 2 hosts x 2 ranks"
        "$here/netns_hosts.sh" run "$name" 1 timeout 1800 "$build/tools/tsrun" --nnodes 2 --node-rank 1 \
            --nproc-per-node 2 --master-addr 10.213.0.1 --master-port 29500 "$build/bench/bench_fsdp_step" \
            "${extra[@]}" >/dev/null 2>&1 &
        other=$!
        out=$("$here/netns_hosts.sh" run "$name" 0 timeout 1800 "$build/tools/tsrun" --nnodes 2 --node-rank 0 \
            --nproc-per-node 2 --master-addr 10.213.0.1 --master-port 29500 --no-prefix \
            "$build/bench/bench_fsdp_step" "${extra[@]}" 2>&1) || true
        wait "$other" || true
        echo "$out"
        ms=$(printf '%s\n' "$out" | awk '$1 == "fsdp" && $2 ~ /^[0-9.]+$/ {print $2; exit}')
        [ -n "$ms" ] && fsdp_ms+=("$ms")
        if [ ! -f "$ddp" ] || ! /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
            echo "torch DDP skipped: needs tools/bench/torch_ddp_step.py and Debian's python3-torch"
            continue
        fi
        echo "==== round $((k + 1)) of $rounds: torch DDP (gloo), 2 hosts x 2 ranks"
        pids=()
        for r in 3 2 1 0; do
            h=$((r / 2))
            ifname=$(ip -n "$name-h$h" -o link show | awk -F': ' '$2 !~ /^lo/ {print $2}' | cut -d@ -f1 | head -1)
            env RANK=$r LOCAL_RANK=$((r % 2)) WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 MASTER_ADDR=10.213.0.1 \
                MASTER_PORT=29600 GLOO_SOCKET_IFNAME="$ifname" \
                "$here/netns_hosts.sh" run "$name" "$h" timeout 1800 /usr/bin/python3 "$ddp" --steps 9 \
                >"/tmp/$name.ddp$r" 2>&1 &
            pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || true; done
        cat "/tmp/$name.ddp0"
        ms=$(awk '$1 == "ddp_step_ms" {print $2; exit}' "/tmp/$name.ddp0")
        rm -f /tmp/"$name".ddp?
        [ -n "$ms" ] && ddp_ms+=("$ms")
    done
    med() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {if (NR) print (NR % 2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
    f=$(med "${fsdp_ms[@]}") d=$(med "${ddp_ms[@]}")
    echo "==== 2 hosts x 2 ranks: fully_shard step ${f:-?} ms (median of ${#fsdp_ms[@]}), torch DDP ${d:-?} ms (median of ${#ddp_ms[@]})"
    if [ -n "$f" ] && [ -n "$d" ]; then
        awk -v f="$f" -v d="$d" 'BEGIN {r = f / d; printf "fsdp / ddp = %.3f (target <= 0.80: %s)\n", r, r <= 0.80 ? "ok" : "not met"}'
    fi
    exit 0
fi

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
