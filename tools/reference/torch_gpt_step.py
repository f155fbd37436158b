"""The unsharded GPT training step in PyTorch, for scripts/bench_scale.sh
(issue 20 §5): times forward, loss, backward, gradient clipping and AdamW
on the model examples/train_gpt builds, and reports the process's peak
RSS, as one JSON object on stdout.

The model is tools/reference/models.py's GPT, the twin of nn/gpt.c
(tok_emb, pos_emb, pre-LN blocks, ln_f, a bias-free lm_head NOT tied to
tok_emb: train_gpt's default), with dropout 0. The step is train_gpt's:
cross-entropy on random token ids in [0, vocab) (fresh ones each step),
clip_grad_norm_(1.0), AdamW(lr, weight_decay=0.01), zero_grad(set_to_none).
The time is the median of --steps steps after --warmup ones.

Threads: torch.set_num_threads(--threads). A train_gpt rank computes on
TS_NUM_THREADS threads (1 when unset), so to compare one rank with torch
give the same number here (bench_scale.sh passes its --threads, default 1).

Run with Debian's torch 1.13: /usr/bin/python3 tools/reference/torch_gpt_step.py
  --layers 12 --dim 768 --heads 12 --seq 512 --vocab 50257 --batch 1 --steps 5 --warmup 1 --threads 1
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from models import GPT  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 12), ("dim", 768), ("heads", 12), ("seq", 512), ("vocab", 50257),
                          ("batch", 1), ("steps", 5), ("warmup", 1), ("threads", 1), ("seed", 1337)):
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args()
    if a.dim % a.heads or min(a.layers, a.dim, a.heads, a.seq, a.batch, a.steps, a.threads) < 1 or a.vocab < 2:
        ap.error("sizes must be positive, --dim a multiple of --heads, --vocab at least 2")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = GPT(a.vocab, a.seq, a.layers, a.heads, a.dim, 0.0)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(a.seed + 1)
    times, losses = [], []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        tok = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
        logits = model(tok[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), tok[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        t1 = time.perf_counter()
        if i >= a.warmup:
            times.append(t1 - t0)
    med = statistics.median(times)
    print(json.dumps({
        "program": "torch_gpt_step", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "layers": a.layers, "dim": a.dim, "heads": a.heads, "seq": a.seq, "vocab": a.vocab, "batch": a.batch,
        "n_params": n_params, "tied": False, "steps": a.steps, "warmup": a.warmup,
        "step_s_median": med, "step_s_best": min(times), "tokens_per_s": a.batch * a.seq / med,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "losses": losses,
    }))


if __name__ == "__main__":
    main()
