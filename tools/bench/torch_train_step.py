"""Times one GPT training step (forward, backward, AdamW) in PyTorch, for
bench/train_step, which runs it in the same session and prints the ratio.

The model is tools/reference/models.py's GPT, the twin of nn/gpt.c. Set up
at its fastest on this CPU (docs/design.md, "Thread counts, and PyTorch at its fastest"): the caller sets
BLIS_ARCH_TYPE (AVX-512 CPUs), MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
OMP_NUM_THREADS and BLIS_NUM_THREADS; this script sets torch.set_num_threads.

Prints one line: "torch_step_ms MEDIAN BEST" (milliseconds).
Usage: /usr/bin/python3 torch_train_step.py THREADS STEPS WARMUP VOCAB BLOCK LAYERS HEADS DIM BATCH SEQ [DROPOUT]
(DROPOUT: the GPT's dropout, default 0.)
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from models import GPT  # noqa: E402


def main():
    threads, steps, warmup, vocab, block, layers, heads, dim, batch, seq = map(int, sys.argv[1:11])
    dropout = float(sys.argv[11]) if len(sys.argv) > 11 else 0.0
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = GPT(vocab, block, layers, heads, dim, dropout)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    y = torch.randint(0, vocab, (batch, seq), generator=g)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        if i >= warmup:
            times.append((t1 - t0) * 1e3)
    print("torch_step_ms %.3f %.3f" % (statistics.median(times), min(times)))


if __name__ == "__main__":
    main()
