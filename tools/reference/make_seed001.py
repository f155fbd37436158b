#!/usr/bin/env python3
"""Write tests/fixtures/seed001/losses.json from torch 1.13 (CPU): the five
losses of seed 001's script, for examples/seed001_encoder.c and its test
(Test(fully_shard_examples, seed001_encoder_*) in
tests/fully_shard/test_examples.c).

usage: /usr/bin/python3 tools/reference/make_seed001.py [OUTDIR]
       (Debian 12's system python3 with the python3-torch package; OUTDIR
        defaults to tests/fixtures/seed001 beside this script's repo)

Seed 001's script, on one process and without FSDP (one rank: FSDP's
all-gathers and reduce-scatters are copies there, so the numbers are
those of the plain model; the seed's script draws no seed, this one calls
torch.manual_seed(SEED) first):

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.TransformerEncoderLayer(128, 4, dropout=P) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 16, 128)          # (seq 8, batch 16, d 128): batch_first=False
    for step in range(5):
        opt.zero_grad()
        loss = model(x).abs().mean()
        loss.backward()
        opt.step()

with PyTorch's defaults otherwise: dim_feedforward 2048, activation relu,
layer_norm_eps 1e-5, batch_first False, norm_first False; AdamW betas
(0.9, 0.999), eps 1e-8, weight_decay 1e-2, foreach False (1.13's default:
the single-tensor loop). The model is in train mode (nn.Module's default,
as in the seed's script), so TransformerEncoderLayer takes its python path
(torch._transformer_encoder_layer_fwd, the fused fast path, is only taken
without grad in eval mode) and every dropout draws its mask from the
default generator, in the order the forward calls them.

Runs (each from torch.manual_seed(0)):

  dropout_0.1   P = 0.1 (the seed's default), batch_first False
  dropout_0     P = 0.0
  batch_first   P = 0.1, batch_first=True on every layer, and the input
                drawn as torch.randn(16, 8, 128) (batch 16, seq 8): the
                other layout's dropout order

Output: losses.json with, per run, its name, the calls, and "losses": the
five loss.item() values (float32 values written as Python floats, so
exactly). The script is deterministic (one intra-op thread): a second run
writes an identical file.
"""
import json
import os
import sys

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "tests", "fixtures", "seed001")

SEED = 0
STEPS = 5
LR = 1e-4

RUNS = [
    dict(name="dropout_0.1", dropout=0.1, batch_first=False, x_shape=[8, 16, 128]),
    dict(name="dropout_0", dropout=0.0, batch_first=False, x_shape=[8, 16, 128]),
    dict(name="batch_first", dropout=0.1, batch_first=True, x_shape=[16, 8, 128]),
]


def run(dropout, batch_first, x_shape):
    torch.manual_seed(SEED)
    model = nn.Sequential(*[nn.TransformerEncoderLayer(128, 4, dropout=dropout, batch_first=batch_first)
                            for _ in range(4)])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x = torch.randn(*x_shape)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(x).abs().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    os.makedirs(OUT, exist_ok=True)
    out = {"torch": torch.__version__, "seed": SEED, "steps": STEPS,
           "adamw": dict(lr=LR, betas=[0.9, 0.999], eps=1e-8, weight_decay=1e-2, foreach=False),
           "runs": []}
    for r in RUNS:
        losses = run(r["dropout"], r["batch_first"], r["x_shape"])
        calls = ("torch.manual_seed(%d); model = nn.Sequential(*[nn.TransformerEncoderLayer(128, 4, dropout=%s%s) "
                 "for _ in range(4)]); opt = torch.optim.AdamW(model.parameters(), lr=1e-4); "
                 "x = torch.randn(%s); 5 x (opt.zero_grad(); loss = model(x).abs().mean(); loss.backward(); "
                 "opt.step())" % (SEED, r["dropout"], ", batch_first=True" if r["batch_first"] else "",
                                  ", ".join(str(s) for s in r["x_shape"])))
        out["runs"].append(dict(name=r["name"], dropout=r["dropout"], batch_first=r["batch_first"],
                                x_shape=r["x_shape"], calls=calls, losses=losses))
        print("%-12s %s" % (r["name"], " ".join("%.9g" % v for v in losses)))
    with open(os.path.join(OUT, "losses.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
