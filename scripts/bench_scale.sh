#!/usr/bin/env bash
# GPT-2-scale runs measured (issue 20 §5; docs/scale.md), in one invocation:
#
#   small   GPT-2-small shape (12 layers, d 768, 12 heads, seq 512, vocab
#           50257, AdamW, batch 1 per rank, f32) with examples/train_gpt
#           --vocab at W = 1, 2, 4, 8 ranks on this host (tools/tsrun), and
#           2 hosts x 4 ranks in network namespaces (scripts/netns_hosts.sh;
#           skipped with a message where they cannot be made);
#   torch   torch 1.13's unsharded step on the same model
#           (tools/reference/torch_gpt_step.py, Debian's /usr/bin/python3);
#   medium  GPT-2-medium shape (24 layers, d 1024, 16 heads) at W = 8 under
#           tsrun --memory-per-rank CAP, CAP below its unsharded training
#           state (parameters, gradients and AdamW's two moments in f32: 16
#           bytes a parameter), with --param-dtype bf16
#           --checkpoint-activations, for 5 steps on one random batch
#           (--data-batches 1, which the model can learn): the loss must
#           fall (last below first); and
#           the W = 1 run under the same cap, which train_gpt must refuse up
#           front (exit 2, "exceeds the memory cap") from its estimate.
#
# Prints one markdown table: per row the estimate of the peak RSS and of
# the tensors, the tensor peak and the peak RSS (VmHWM) of the largest
# rank, the median step time (steps after the first; the slowest rank's),
# tokens/s (all ranks), and the step time over torch's. Peak learning
# rates: 6e-4 (small), 3e-4 (medium), GPT-3's for those sizes (3e-3,
# train_gpt's default for its character model, makes the loss of random
# tokens climb at this size). Every train_gpt
# rank and torch compute on --threads threads (TS_NUM_THREADS /
# torch.set_num_threads), 1 by default: at W ranks the C side uses W cores.
#
#   scripts/bench_scale.sh [--quick] [--build DIR] [--steps N] [--torch-steps N]
#       [--worlds "1 2 4 8"] [--threads N] [--medium-steps N] [--medium-cap SIZE]
#       [--no-two-hosts] [--no-torch] [--no-medium] [--keep DIR]
#
# --quick: a tiny shape (2 layers, d 64, 4 heads, seq 64, vocab 1000; medium:
#   2 layers, d 256, vocab 50257) through every row, in about a minute.
# --steps N: train_gpt steps per run (default 5: the first is left out of the
#   median); --torch-steps N: torch's timed steps after 1 warmup (default 5).
# --medium-cap SIZE: the per-rank cap of the medium rows, bytes or tsrun's
#   units (default: 0.33 of the unsharded training state, 2.0 GiB: above the
#   W = 8 estimate with deferred init, 1.6 GiB, and a third of what one
#   rank would need; with --quick 0.9 of it).
# --keep DIR: keep every run's log and JSON there (default: a temporary
#   folder, removed). Exit status: 0 when every row that ran passed its
#   check (runs completed; the medium loss fell; W = 1 refused), else 1.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$here/../build quick=0 steps=5 torch_steps=5 worlds="1 2 4 8" threads=1 medium_steps=5 medium_cap=""
two_hosts=1 torch=1 medium=1 keep=""
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) quick=1 ;;
    --build) build=$2; shift ;;
    --steps) steps=$2; shift ;;
    --torch-steps) torch_steps=$2; shift ;;
    --worlds) worlds=$2; shift ;;
    --threads) threads=$2; shift ;;
    --medium-steps) medium_steps=$2; shift ;;
    --medium-cap) medium_cap=$2; shift ;;
    --no-two-hosts) two_hosts=0 ;;
    --no-torch) torch=0 ;;
    --no-medium) medium=0 ;;
    --keep) keep=$2; shift ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench_scale: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
    esac
    shift
done
for v in "$steps" "$torch_steps" "$threads" "$medium_steps"; do
    [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "bench_scale: '$v' is not a positive integer" >&2; exit 2; }
done
build=$(cd "$build" && pwd) || exit 2
gpt=$build/examples/train_gpt tsrun=$build/tools/tsrun
for x in "$gpt" "$tsrun"; do
    [ -x "$x" ] || { echo "bench_scale: $x is not built (ninja -C $build examples/train_gpt tools/tsrun)" >&2; exit 2; }
done
if [ -n "$keep" ]; then mkdir -p "$keep" && out=$(cd "$keep" && pwd); else out=$(mktemp -d /tmp/bench-scale.XXXXXX); fi
ns_name=""
cleanup() {
    [ -n "$ns_name" ] && "$here/netns_hosts.sh" down "$ns_name" >/dev/null 2>&1
    [ -z "$keep" ] && rm -rf "$out"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "$quick" = 1 ]; then
    small=(--layers 2 --dim 64 --heads 4 --seq 64 --vocab 1000) mshape=(--layers 2 --dim 256 --heads 4 --seq 64 --vocab 50257)
    cap_frac=0.9 small_name="quick (2 layers, d 64, seq 64, vocab 1000)" medium_name="quick medium (2 layers, d 256, seq 64, vocab 50257)"
else
    small=(--layers 12 --dim 768 --heads 12 --seq 512 --vocab 50257) mshape=(--layers 24 --dim 1024 --heads 16 --seq 512 --vocab 50257)
    cap_frac=0.33 small_name="GPT-2-small (12 layers, d 768, 12 heads, seq 512, vocab 50257)"
    medium_name="GPT-2-medium (24 layers, d 1024, 16 heads, seq 512, vocab 50257)"
fi
export TS_NUM_THREADS=$threads
fail=0
rows=()  # "label|kind|file|note": kind c (a train_gpt JSON), t (torch JSON), r (a refusal log), s (skipped)

# train_gpt on this host: run LABEL W JSON LOG [tsrun flags --] [train_gpt flags]
run_c() {
    local label=$1 w=$2 json=$3 log=$4; shift 4
    local pre=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do pre+=("$1"); shift; done
    shift
    rm -f "$json"
    echo "bench_scale: $label: tsrun ${pre[*]} --nproc-per-node $w train_gpt $*" >&2
    timeout 7200 "$tsrun" "${pre[@]}" --nproc-per-node "$w" "$gpt" "$@" --report-json "$json" >"$log" 2>&1
}

cflags=(--batch 1 --steps "$steps" --lr 6e-4)
for w in $worlds; do
    j=$out/small-w$w.json l=$out/small-w$w.log
    if run_c "small W=$w" "$w" "$j" "$l" -- "${small[@]}" "${cflags[@]}"; then
        rows+=("W = $w|c|$j|")
    else
        rows+=("W = $w|s||failed: $(tail -1 "$l")"); fail=1
    fi
done

if [ "$two_hosts" = 1 ]; then
    if why=$("$here/netns_hosts.sh" check 2>&1); then
        ns_name="tsscale-p$$"
        "$here/netns_hosts.sh" up "$ns_name" 2 >/dev/null
        export TS_STORE_TOKEN
        TS_STORE_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
        j=$out/small-2x4.json l=$out/small-2x4.log
        rm -f "$j"
        echo "bench_scale: small 2 hosts x 4 ranks (namespaces $ns_name)" >&2
        hostflags=(--nnodes 2 --nproc-per-node 4 --master-addr 10.213.0.1 --master-port 29500)
        "$here/netns_hosts.sh" run "$ns_name" 1 timeout 7200 "$tsrun" "${hostflags[@]}" --node-rank 1 "$gpt" \
            "${small[@]}" "${cflags[@]}" >"$l.h1" 2>&1 &
        other=$!
        "$here/netns_hosts.sh" run "$ns_name" 0 timeout 7200 "$tsrun" "${hostflags[@]}" --node-rank 0 "$gpt" \
            "${small[@]}" "${cflags[@]}" --report-json "$j" >"$l" 2>&1
        st=$?
        wait "$other"; st1=$?
        if [ $st = 0 ] && [ $st1 = 0 ] && [ -s "$j" ]; then rows+=("2 hosts x 4|c|$j|UCX over TCP (veth)")
        else rows+=("2 hosts x 4|s||failed (host 0 exit $st, host 1 exit $st1): $(tail -1 "$l")"); fail=1; fi
        "$here/netns_hosts.sh" down "$ns_name" >/dev/null 2>&1
        ns_name=""
    else
        echo "bench_scale: 2 hosts x 4 ranks skipped: $why" >&2
        rows+=("2 hosts x 4|s||skipped: $why")
    fi
fi

torch_json=""
if [ "$torch" = 1 ]; then
    if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
        torch_json=$out/torch.json
        echo "bench_scale: torch unsharded step, $threads thread(s)" >&2
        if /usr/bin/python3 "$here/../tools/reference/torch_gpt_step.py" "${small[@]}" --batch 1 --steps "$torch_steps" \
            --lr 6e-4 --warmup 1 --threads "$threads" >"$torch_json" 2>"$out/torch.log"; then
            rows+=("torch 1.13, unsharded|t|$torch_json|$threads thread(s)")
        else
            rows+=("torch 1.13, unsharded|s||failed: $(tail -1 "$out/torch.log")"); torch_json=""; fail=1
        fi
    else
        rows+=("torch 1.13, unsharded|s||skipped: Debian's python3-torch is not installed (apt-get install python3-torch)")
    fi
fi

medium_line=""
if [ "$medium" = 1 ]; then
    # the unsharded training state: 16 bytes per parameter (f32 parameter, gradient, AdamW's two moments)
    read -r L D T V < <(printf '%s %s %s %s\n' "${mshape[1]}" "${mshape[3]}" "${mshape[7]}" "${mshape[9]}")
    nparam=$((L * (12 * D * D + 13 * D) + 2 * V * D + T * D + 2 * D))
    state=$((16 * nparam))
    cap=${medium_cap:-$(awk -v s="$state" -v f="$cap_frac" 'BEGIN {printf "%d", s * f}')}
    # the cap in bytes for the table (tsrun's units: binary, K M G T, with an optional i/B)
    cap_bytes=$(awk -v c="$cap" 'BEGIN {
        if (!match(c, /^[0-9]+(\.[0-9]+)? ?/)) { print -1; exit }
        n = substr(c, 1, RLENGTH) + 0; u = tolower(substr(c, RLENGTH + 1)); sub(/i?b$/, "", u)
        k = index("kmgtpe", u); if (u != "" && (length(u) != 1 || k == 0)) { print -1; exit }
        printf "%.0f", n * 2 ^ (10 * (u == "" ? 0 : k)) }')
    [ "$cap_bytes" -gt 0 ] 2>/dev/null || { echo "bench_scale: --medium-cap '$cap' is not a size (bytes, or 2GiB, 1.5G, 800M)" >&2; exit 2; }
    mflags=("${mshape[@]}" --batch 1 --steps "$medium_steps" --lr 3e-4 --data-batches 1 --param-dtype bf16 --checkpoint-activations)
    j=$out/medium-w8.json l=$out/medium-w8.log
    if run_c "medium W=8" 8 "$j" "$l" --memory-per-rank "$cap" -- "${mflags[@]}"; then
        if /usr/bin/python3 -c 'import json,sys; l=json.load(open(sys.argv[1]))["losses"]; sys.exit(0 if l[-1] < l[0] else 1)' "$j"; then
            rows+=("medium W = 8, cap|c|$j|bf16 + AC; loss falls")
        else
            rows+=("medium W = 8, cap|c|$j|bf16 + AC; LOSS DID NOT FALL"); fail=1
        fi
    else
        rows+=("medium W = 8, cap|s||failed: $(tail -1 "$l")"); fail=1
    fi
    l=$out/medium-w1.log
    echo "bench_scale: medium W=1 under the same cap (must be refused)" >&2
    timeout 600 "$tsrun" --memory-per-rank "$cap" --nproc-per-node 1 "$gpt" "${mflags[@]}" >"$l" 2>&1
    st=$?
    if grep -q "exceeds the memory cap" "$l"; then
        rows+=("medium W = 1, cap|r|$l|refused up front (exit $st)")
    else
        rows+=("medium W = 1, cap|s||NOT REFUSED (exit $st): $(tail -1 "$l")"); fail=1
    fi
    medium_line="Medium rows: $medium_name, $nparam parameters, unsharded training state $state bytes ($(awk -v s="$state" 'BEGIN {printf "%.2f", s / 1073741824}') GiB); --memory-per-rank $cap ($(awk -v s="$cap_bytes" 'BEGIN {printf "%.2f", s / 1073741824}') GiB), --param-dtype bf16 --checkpoint-activations --lr 3e-4 --data-batches 1 (one random batch), $medium_steps steps."
fi

# the table
/usr/bin/python3 - "$torch_json" "${rows[@]}" <<'EOF'
import json, re, sys
torch_json, rows = sys.argv[1], sys.argv[2:]
tor = json.load(open(torch_json)) if torch_json else None
mib = lambda b: "%.0f" % (b / 1048576)
print("| run | params | est. RSS MiB | est. tensors MiB | tensor peak MiB | peak RSS MiB | RSS / est. | step ms | tokens/s | C / torch step | note |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for row in rows:
    label, kind, path, note = row.split("|", 3)
    if kind == "c":
        j = json.load(open(path))
        rk = j["ranks"]
        big = max(rk, key=lambda r: r["vmhwm_bytes"])
        est = max(r["estimate_rss_bytes"] for r in rk)
        step = j["step_s_median_max"]
        ratio = "%.2f" % (step / tor["step_s_median"]) if tor and "medium" not in label else "-"  # torch: the small shape
        extra = "losses %s" % " ".join("%.3f" % x for x in j["losses"]) if "medium" in label else ""
        print("| %s | %.1fM | %s | %s | %s | %s | %.3f | %.0f | %.0f | %s | %s |" % (
            label, j["n_params"] / 1e6, mib(est), mib(max(r["estimate_tensors_bytes"] for r in rk)),
            mib(max(r["tensor_peak_bytes"] for r in rk)), mib(big["vmhwm_bytes"]),
            big["vmhwm_bytes"] / big["estimate_rss_bytes"], step * 1e3, j["tokens_per_s"], ratio,
            "; ".join(x for x in (note, extra) if x)))
    elif kind == "t":
        print("| %s | %.1fM | - | - | - | %s | - | %.0f | %.0f | 1 | %s |" % (
            label, tor["n_params"] / 1e6, mib(tor["peak_rss_bytes"]), tor["step_s_median"] * 1e3,
            tor["tokens_per_s"], note))
    elif kind == "r":
        msg = open(path).read()
        m = re.search(r"estimated peak per rank, ([^ ]+ [A-Za-z]+).*memory cap of ([^ ]+ [A-Za-z]+)", msg)
        print("| %s | - | %s | - | - | - | - | - | - | - | %s%s |" % (
            label, m.group(1) if m else "?", note, " (cap %s)" % m.group(2) if m else ""))
    else:
        print("| %s | - | - | - | - | - | - | - | - | - | %s |" % (label, note.replace("|", "/")))
EOF
echo
echo "Small rows: $small_name, batch 1 per rank, f32, $steps steps (median of steps 2-$steps; the slowest rank's); tokens/s: all ranks at that pace; $threads thread(s) per rank (TS_NUM_THREADS) and for torch."
[ -n "$medium_line" ] && echo "$medium_line"
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores; $(date -u '+%Y-%m-%d %H:%M UTC')"
[ -n "$keep" ] && echo "logs and JSON: $out"
exit $fail
