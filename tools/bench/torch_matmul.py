"""Times torch.matmul in bfloat16 (and float32) on bench_matmul's shapes,
for bench/matmul.c, which runs it in the same session and prints it beside
the library's figures. PyTorch 1.13 on CPU multiplies bfloat16 through
oneDNN (mkldnn matmul, float32 accumulation) when the CPU has AVX-512;
float16 matmul is not implemented on CPU there ("addmm_impl_cpu_" not
implemented for 'Half'), so there is no float16 row.

The caller sets BLIS_ARCH_TYPE (AVX-512 CPUs), MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, OMP_NUM_THREADS and BLIS_NUM_THREADS
(docs/design.md, "Thread counts, and PyTorch at its fastest"); this script sets torch.set_num_threads.

Operands are laid out as bench_matmul's: the Linear forward multiplies x by
a transposed view of W, the weight gradient a transposed view of dY.

Prints one line per shape and dtype: "torch NAME DTYPE GFLOPS" (median).
Usage: /usr/bin/python3 torch_matmul.py THREADS REPS [DTYPES]
  DTYPES: comma-separated, of bf16 and f32 (default bf16)
"""
import statistics
import sys
import time

import torch


def main():
    threads, reps = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    M, K, N = 8192, 768, 3072
    x = torch.rand(M, K) - 0.5
    w = torch.rand(N, K) - 0.5
    dy = torch.rand(M, N) - 0.5
    sq = {s: (torch.rand(s, s) - 0.5, torch.rand(s, s) - 0.5) for s in (512, 1024, 2048)}
    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    for name in sys.argv[3].split(",") if len(sys.argv) > 3 else ["bf16"]:
        dt = dtypes[name]
        xd, wd, dyd = x.to(dt), w.to(dt), dy.to(dt)
        cases = [("fwd", xd, wd.t()), ("dx", dyd, wd), ("dw", dyd.t(), xd)]
        for s in (512, 1024, 2048):
            cases.append(("sq%d" % s, sq[s][0].to(dt), sq[s][1].to(dt)))
        for tag, a, b in cases:
            flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
            for _ in range(2 if flops > 1e9 else 5):
                torch.matmul(a, b)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                torch.matmul(a, b)
                times.append(time.perf_counter() - t0)
            print("torch %s %s %.2f" % (tag, name, flops / statistics.median(times) * 1e-9), flush=True)


if __name__ == "__main__":
    main()
