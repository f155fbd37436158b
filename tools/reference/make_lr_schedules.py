#!/usr/bin/python3
"""Write tests/fixtures/optim/lr_schedules.json: the learning rate torch
1.13's schedulers give at each step, for the schedules of optim/optim.h
(ts_lr_schedule), for tests/optim/test_lr_schedule.c.

usage: /usr/bin/python3 tools/reference/make_lr_schedules.py [OUT.json]
       (Debian 12's system python3 with python3-torch 1.13.1; OUT defaults
        to tests/fixtures/optim/lr_schedules.json beside this script's repo)

Every case drives one optimizer, torch.optim.SGD([p], lr=base_lr) over a
single zero parameter p = torch.zeros(1, requires_grad=True), and records
the rate each step uses:

    for k in range(n):
        lrs.append(opt.param_groups[0]["lr"])   # the lr of step k (0-based)
        opt.step()
        sched.step()

which is what ts_lr_at(&s, k) returns (k = the steps already taken). The
schedulers, with W = warmup_steps, T = total_steps, b = base_lr,
m = min_lr (the same calls are written into each case's "torch" field):

    warmup:   LinearLR(opt, start_factor=1/W, end_factor=1.0, total_iters=W-1)
              (b (k+1)/W for k < W, then b)
    constant: LambdaLR(opt, lambda k: 1.0)
    warmup_constant: the warmup alone
    cosine:   SequentialLR(opt, [warmup, CosineAnnealingLR(opt, T_max=T-W, eta_min=m)],
                           milestones=[W])
              (W = 0: the CosineAnnealingLR alone); n = T + 1 steps, since
              CosineAnnealingLR climbs again after T_max where ours stays at m
    linear:   SequentialLR(opt, [warmup, LinearLR(opt, start_factor=1.0,
                           end_factor=m/b, total_iters=T-W)], milestones=[W])
    wsd:      torch 1.13 has no warmup-stable-decay scheduler; it is the
              composition SequentialLR(opt, [warmup, LambdaLR(opt, lambda k: 1.0),
              LinearLR(opt, start_factor=1.0, end_factor=m/b, total_iters=T-S)],
              milestones=[W, S]) with S = max(W, T - round(f T)), the
              decay's start (optim.h); the test also checks it against the
              formula on its own.

SequentialLR (1.13) resets the lr to b at construction, steps the first
scheduler, and calls step(0) on the next one at its milestone, so each
later scheduler starts from its closed form at 0 (b) and goes on with its
recursive form (get_lr): LinearLR's and CosineAnnealingLR's chained
updates, whose rounding differs from the closed forms by a few ulps
(the test's tolerance says how much).

Floats are written with Python's repr (the shortest string that reads
back to the same double), so the values the test reads are torch's bits.
Deterministic: a second run writes the same bytes.
"""
import json
import os
import sys
import warnings

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, SequentialLR

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "tests", "fixtures", "optim",
                                                         "lr_schedules.json")


def run(kind, base_lr, warmup, total, min_lr=0.0, decay_fraction=0.0, steps=None):
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=base_lr)
    calls = []

    def warmup_sched():
        calls.append("w = LinearLR(opt, start_factor=1/%d, end_factor=1.0, total_iters=%d)" % (warmup, warmup - 1))
        return LinearLR(opt, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup - 1)

    def chain(after, milestones):
        """The warmup (when W > 0), then the schedulers `after` it."""
        if warmup > 0:
            scheds = [warmup_sched()] + after
            calls.append("SequentialLR(opt, [w, %s], milestones=%s)" % (", ".join(n for n, _ in later_names),
                                                                         [warmup] + milestones))
            return SequentialLR(opt, scheds, milestones=[warmup] + milestones)
        if len(after) == 1:
            return after[0]
        calls.append("SequentialLR(opt, [%s], milestones=%s)" % (", ".join(n for n, _ in later_names), milestones))
        return SequentialLR(opt, after, milestones=milestones)

    later_names = []

    def named(name, call, make):
        later_names.append((name, call))
        calls.append("%s = %s" % (name, call))
        return make()

    if kind == "constant":
        sched = named("c", "LambdaLR(opt, lambda k: 1.0)", lambda: LambdaLR(opt, lambda k: 1.0))
        n = steps
    elif kind == "warmup_constant":
        sched = warmup_sched()
        n = steps
    elif kind == "cosine":
        c = named("c", "CosineAnnealingLR(opt, T_max=%d, eta_min=%r)" % (total - warmup, min_lr),
                  lambda: CosineAnnealingLR(opt, T_max=total - warmup, eta_min=min_lr))
        sched = chain([c], [])
        n = total + 1
    elif kind == "linear":
        d = named("d", "LinearLR(opt, start_factor=1.0, end_factor=%r, total_iters=%d)" % (min_lr / base_lr,
                                                                                           total - warmup),
                  lambda: LinearLR(opt, start_factor=1.0, end_factor=min_lr / base_lr, total_iters=total - warmup))
        sched = chain([d], [])
        n = steps
    elif kind == "wsd":
        start = max(warmup, total - round(decay_fraction * total))
        s = named("s", "LambdaLR(opt, lambda k: 1.0)", lambda: LambdaLR(opt, lambda k: 1.0))
        d = named("d", "LinearLR(opt, start_factor=1.0, end_factor=%r, total_iters=%d)" % (min_lr / base_lr,
                                                                                           total - start),
                  lambda: LinearLR(opt, start_factor=1.0, end_factor=min_lr / base_lr, total_iters=total - start))
        sched = chain([s, d], [start])
        n = steps
    else:
        raise ValueError(kind)
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return {"kind": kind, "base_lr": base_lr, "warmup_steps": warmup, "total_steps": total, "min_lr": min_lr,
            "decay_fraction": decay_fraction, "torch": "; ".join(calls), "lr": lrs}


def main():
    torch.set_num_threads(1)
    # SequentialLR's own step(0) at a milestone warns that epoch= is deprecated
    warnings.filterwarnings("ignore", message="The epoch parameter")
    cases = [
        run("constant", 0.3, 0, 0, steps=12),
        run("warmup_constant", 1e-3, 5, 0, steps=20),
        run("warmup_constant", 0.5, 2, 0, steps=6),
        run("cosine", 1.0, 4, 12, 0.1),
        run("cosine", 3e-3, 10, 100, 3e-4),
        run("cosine", 6e-4, 0, 50, 0.0),
        run("cosine", 3e-3, 31, 300, 3e-4),
        run("linear", 1.0, 4, 12, 0.1, steps=16),
        run("linear", 3e-3, 10, 100, 3e-4, steps=110),
        run("linear", 0.01, 0, 30, 0.0, steps=35),
        run("wsd", 1.0, 4, 20, 0.1, 0.25, steps=24),
        run("wsd", 3e-3, 10, 100, 0.0, 0.2, steps=105),
        run("wsd", 2e-3, 0, 40, 2e-4, 0.1, steps=44),
        run("wsd", 1.0, 5, 10, 0.0, 0.9, steps=12),  # the decay would reach into the warmup: it starts at W
    ]
    doc = {
        "about": "torch %s learning rates per step (tools/reference/make_lr_schedules.py; the exact calls in "
                 "each case's 'torch')" % torch.__version__,
        "cases": cases,
    }
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print("wrote %d cases to %s" % (len(cases), OUT))


if __name__ == "__main__":
    main()
