"""Times one GPT training step (forward, backward, AdamW) under torch 1.13's
DistributedDataParallel over gloo, for bench/fsdp_step, which runs it in
the same session as its own modes and prints fsdp / ddp.

The model is tools/reference/models.py's GPT (the twin of nn/gpt.c), each
rank's batch the one bench/fsdp_step gives that rank (token i: (7 i + 13
rank) % vocab, target (11 i + 5 rank) % vocab), the loss cross-entropy
(mean), the optimizer AdamW (lr 1e-3, weight_decay 1e-2, as
ts_adamw_options_default). One thread per rank (torch.set_num_threads(1),
OMP/MKL/BLIS threads 1). DDP set up at its fastest for this model:
gradient_as_bucket_view=True (the gradients are views of the buckets, no
copy in or out), static_graph=True (the graph is the same every step: no
search for unused parameters, buckets rebuilt once in the order the
gradients come), broadcast_buffers=False (the model has no buffers to
sync), and the bucket size given (--bucket-mb; bench/fsdp_step's README
entry reports the sweep that chose the default). Every step starts with a
barrier, as bench/fsdp_step's; times are rank 0's.

Ranks: with torchrun-style RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and
LOCAL_RANK) in the environment this process is that one rank (for several
hosts, e.g. 2 hosts x 2 ranks); otherwise it is rank 0 of --nproc local
ranks and starts the others itself (MASTER_ADDR 127.0.0.1, a free port).

Output, rank 0, one line per configuration and round:
  ddp_step_ms MEDIAN BEST bucket_mb=B foreach=F static_graph=S
--bucket-mb, --foreach (AdamW's foreach) and --static-graph take comma
lists (e.g. --bucket-mb 1,4,25 --foreach 0,1): one DDP model per
combination, their steps interleaved (the order rotating every step) so
that a machine whose load drifts slows them alike.
--serve: after the warm-up steps, rank 0 prints "ddp_ready" and reads
lines from stdin: "run N" runs N timed steps of every configuration and prints their lines
(flushed); "quit" or end of input ends every rank. bench/fsdp_step uses
this to alternate DDP rounds with its own.

Usage: /usr/bin/python3 torch_ddp_step.py [--nproc 2] [--steps 9] [--warmup 2]
       [--layers 4] [--dim 256] [--heads 4] [--seq 128] [--batch 4]
       [--vocab 64] [--bucket-mb 1[,B...]] [--foreach 1[,0]] [--static-graph 1[,0]]
       [--serve]
"""
import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "BLIS_NUM_THREADS"):
    os.environ[_v] = "1"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from models import GPT  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--bucket-mb", default="1")
    p.add_argument("--foreach", default="1")
    p.add_argument("--static-graph", default="1")
    p.add_argument("--serve", action="store_true")
    a = p.parse_args()
    a.buckets = [float(x) for x in a.bucket_mb.split(",") if x]
    a.foreachs = [int(x) for x in a.foreach.split(",") if x]
    a.statics = [int(x) for x in a.static_graph.split(",") if x]
    if a.steps < 1 or a.nproc < 1 or not a.buckets or not a.foreachs or not a.statics or a.dim % a.heads:
        p.error("need --steps >= 1, --nproc >= 1, a bucket size, and dim divisible by heads")
    return a


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Config:
    """One DDP model with its optimizer and bucket size."""

    def __init__(self, a, bucket_mb, foreach, static_graph):
        torch.manual_seed(1)
        model = GPT(a.vocab, a.seq, a.layers, a.heads, a.dim)
        model.train()
        self.ddp = DDP(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
                       static_graph=bool(static_graph), broadcast_buffers=False)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-3, weight_decay=1e-2, foreach=bool(foreach))
        self.label = "bucket_mb=%g foreach=%d static_graph=%d" % (bucket_mb, foreach, static_graph)
        self.times = []

    def step(self, x, y, vocab):
        logits = self.ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def batch(a, rank):
    n = a.batch * a.seq
    i = torch.arange(n, dtype=torch.int64)
    x = ((i * 7 + rank * 13) % a.vocab).reshape(a.batch, a.seq)
    y = (i * 11 + rank * 5) % a.vocab
    return x, y


def run_steps(cfgs, n, x, y, a, record):
    for s in range(n):
        for j in range(len(cfgs)):
            c = cfgs[(j + s) % len(cfgs)]
            dist.barrier()
            t0 = time.perf_counter()
            c.step(x, y, a.vocab)
            t1 = time.perf_counter()
            if record:
                c.times.append((t1 - t0) * 1e3)


def report(cfgs, rank):
    for c in cfgs:
        if rank == 0 and c.times:
            print("ddp_step_ms %.3f %.3f %s" % (statistics.median(c.times), min(c.times), c.label), flush=True)
        c.times = []


def rank_main(a, rank, world):
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    cfgs = [Config(a, b, f, g) for b in a.buckets for f in a.foreachs for g in a.statics]
    x, y = batch(a, rank)
    run_steps(cfgs, a.warmup, x, y, a, False)
    if not a.serve:
        run_steps(cfgs, a.steps, x, y, a, True)
        report(cfgs, rank)
    else:
        if rank == 0:
            print("ddp_ready", flush=True)
        cmd = torch.zeros(1, dtype=torch.int64)
        while True:
            if rank == 0:
                line = sys.stdin.readline().split()
                n = int(line[1]) if len(line) == 2 and line[0] == "run" and int(line[1]) > 0 else 0
                cmd[0] = n
            dist.broadcast(cmd, 0)
            n = int(cmd[0])
            if n <= 0:
                break
            run_steps(cfgs, n, x, y, a, True)
            report(cfgs, rank)
    dist.barrier()
    dist.destroy_process_group()


def main():
    a = parse()
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env:
        rank_main(a, int(env["RANK"]), int(env["WORLD_SIZE"]))
        return 0
    # rank 0 here, the others started as children with torchrun's variables
    port = str(free_port())
    kids = []
    for r in range(1, a.nproc):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(a.nproc), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=port)
        kids.append(subprocess.Popen([sys.executable] + sys.argv, env=e, stdin=subprocess.DEVNULL))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(a.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    try:
        rank_main(a, 0, a.nproc)
    finally:
        rc = 0
        for k in kids:
            try:
                rc |= k.wait(timeout=60)
            except subprocess.TimeoutExpired:
                k.kill()
                rc |= 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
