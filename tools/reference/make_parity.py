#!/usr/bin/env python3
"""Write the model parity fixtures of tests/fixtures/parity/ from torch 1.13
(CPU), for tests/nn/test_parity.c.

usage: /usr/bin/python3 tools/reference/make_parity.py [OUTDIR]
       (Debian 12's system python3 with the python3-torch package; OUTDIR
        defaults to tests/fixtures/parity beside this script's repo)

For every model of MODELS (twins in tools/reference/models.py):

  1. torch.manual_seed(seed); build the model; model.train() (dropout is
     0 everywhere, so train mode changes nothing numerically; it keeps
     torch 1.13 off the fused inference fast paths of MultiheadAttention
     and TransformerEncoderLayer, which the C code does not mirror). Record
     every named_parameters() value (the C test checks them bit for bit)
     and keep a deep copy of the initial model.
  2. torch.manual_seed(seed + 1); draw the inputs and targets (randn /
     randint, after building); record them.
  3. forward, loss (mse_loss or cross_entropy, mean reduction), backward;
     record the output, the loss and every parameter's .grad by name.
  4. From a deep copy of the initial model: torch.optim.AdamW(lr=1e-2,
     other arguments default) for 10 steps on the same batch
     (zero_grad, forward, loss, backward, step); record the loss before
     each step and once more after the last: 11 values, losses[k] being
     the loss after k steps. The same with torch.optim.SGD(lr=0.05,
     momentum=0.9) from another deep copy.

Output: NAME.bin, the raw little-endian values (float32; int64 for token
ids) of the tensors listed for NAME in index.json, C order, concatenated;
index.json gives for each model its file, seeds, configuration and, per
tensor, name, dtype, shape and byte offset. Names: "param.<fqn>",
"grad.<fqn>", "input.<what>", "output", "loss" (a 0-d tensor),
"adamw_losses" and "sgd_losses" (11 values each). The script is
deterministic (one intra-op thread): a second run writes identical files.
"""
import copy
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import models  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "tests", "fixtures", "parity")

ADAMW = dict(lr=1e-2)               # betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2, amsgrad False
SGD = dict(lr=0.05, momentum=0.9)   # dampening 0, weight_decay 0, nesterov False
STEPS = 10

# ---------------------------------------------------------------- models
# Each: build() -> module; inputs() -> dict of tensors (drawn after
# manual_seed(seed + 1)); run(model, inputs) -> (output, loss).


def mlp_inputs():
    x = torch.randn(5, 8)
    target = torch.randn(5, 4)
    return {"x": x, "target": target}


def mlp_run(m, inp):
    out = m(inp["x"])
    return out, F.mse_loss(out, inp["target"])


def enc_inputs():
    x = torch.randn(2, 5, 16)
    target = torch.randn(2, 5, 16)
    return {"x": x, "target": target}


def enc_run(m, inp):
    out = m(inp["x"])
    return out, F.mse_loss(out, inp["target"])


GPT_CFG = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16, dropout=0.0)


def gpt_inputs():
    seq = torch.randint(0, GPT_CFG["vocab_size"], (2, 7))
    return {"idx": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous()}


def gpt_run(m, inp):
    logits = m(inp["idx"])
    return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), inp["targets"].view(-1))


MODELS = [
    dict(name="mlp", seed=101,
         config=dict(kind="mlp", sizes=[8, 16, 4], batch=5),
         build=lambda: models.mlp(8, 16, 4), inputs=mlp_inputs, run=mlp_run,
         calls="models.mlp(8, 16, 4) = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)); "
               "x = torch.randn(5, 8); target = torch.randn(5, 4); loss = F.mse_loss(m(x), target)"),
    dict(name="encoder", seed=202,
         config=dict(kind="encoder", d_model=16, nhead=2, dim_feedforward=32, num_layers=2, batch=2, seq=5),
         build=lambda: models.encoder(16, 2, 32, 2), inputs=enc_inputs, run=enc_run,
         calls="models.encoder(16, 2, 32, 2) = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, "
               "dim_feedforward=32, dropout=0.0, batch_first=True), 2); x = torch.randn(2, 5, 16); "
               "target = torch.randn(2, 5, 16); loss = F.mse_loss(m(x), target)"),
    dict(name="encoder_prenorm_gelu", seed=505,
         config=dict(kind="encoder", d_model=16, nhead=2, dim_feedforward=32, num_layers=2, batch=2, seq=5,
                     norm_first=True, gelu=True),
         build=lambda: models.encoder(16, 2, 32, 2, norm_first=True, activation="gelu"), inputs=enc_inputs,
         run=enc_run,
         calls="models.encoder(16, 2, 32, 2, norm_first=True, activation='gelu') = nn.TransformerEncoder("
               "nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, activation='gelu', "
               "batch_first=True, norm_first=True), 2); x = torch.randn(2, 5, 16); target = torch.randn(2, 5, 16); "
               "loss = F.mse_loss(m(x), target)"),
    dict(name="gpt", seed=303,
         config=dict(kind="gpt", tie_weights=False, batch=2, seq=6, **GPT_CFG),
         build=lambda: models.GPT(**GPT_CFG, tie_weights=False), inputs=gpt_inputs, run=gpt_run,
         calls="models.GPT(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16, dropout=0.0, "
               "tie_weights=False); seq = torch.randint(0, 11, (2, 7)); idx = seq[:, :-1]; targets = seq[:, 1:]; "
               "logits = m(idx); loss = F.cross_entropy(logits.view(-1, 11), targets.view(-1))"),
    dict(name="gpt_tied", seed=404,
         config=dict(kind="gpt", tie_weights=True, batch=2, seq=6, **GPT_CFG),
         build=lambda: models.GPT(**GPT_CFG, tie_weights=True), inputs=gpt_inputs, run=gpt_run,
         calls="as gpt, with tie_weights=True (lm_head.weight is tok_emb.weight)"),
]


def trajectory(model0, inp, run, make_opt):
    m = copy.deepcopy(model0)  # deepcopy keeps the tie (one Parameter)
    opt = make_opt(m.parameters())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        _, loss = run(m, inp)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    with torch.no_grad():
        losses.append(run(m, inp)[1].item())
    return torch.tensor(losses, dtype=torch.float32)


def main():
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    os.makedirs(OUT, exist_ok=True)
    index = {"torch": torch.__version__, "steps": STEPS,
             "adamw": dict(ADAMW, betas=[0.9, 0.999], eps=1e-8, weight_decay=1e-2),
             "sgd": dict(SGD, dampening=0.0, weight_decay=0.0, nesterov=False),
             "models": []}
    for spec in MODELS:
        torch.manual_seed(spec["seed"])
        model = spec["build"]()
        model.train()
        model0 = copy.deepcopy(model)
        entries = []
        blob = bytearray()

        def add(name, t):
            a = t.detach().contiguous().numpy()
            dt = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64"}[a.dtype]
            raw = a.astype(a.dtype.newbyteorder("<")).tobytes()
            entries.append(dict(name=name, dtype=dt, shape=list(a.shape), offset=len(blob), nbytes=len(raw)))
            blob.extend(raw)

        names = [n for n, _ in model.named_parameters()]
        for n, p in model.named_parameters():
            add("param." + n, p)
        torch.manual_seed(spec["seed"] + 1)
        inp = spec["inputs"]()
        for k, v in inp.items():
            add("input." + k, v)
        out, loss = spec["run"](model, inp)
        loss.backward()
        add("output", out)
        add("loss", loss)
        for n, p in model.named_parameters():
            add("grad." + n, p.grad)
        adamw = trajectory(model0, inp, spec["run"], lambda ps: torch.optim.AdamW(ps, **ADAMW))
        sgd = trajectory(model0, inp, spec["run"], lambda ps: torch.optim.SGD(ps, **SGD))
        add("adamw_losses", adamw)
        add("sgd_losses", sgd)
        fname = spec["name"] + ".bin"
        with open(os.path.join(OUT, fname), "wb") as f:
            f.write(bytes(blob))
        index["models"].append(dict(name=spec["name"], file=fname, seed=spec["seed"], input_seed=spec["seed"] + 1,
                                    mode="train", config=spec["config"], calls=spec["calls"], params=names,
                                    loss=loss.item(), adamw_losses=adamw.tolist(), sgd_losses=sgd.tolist(),
                                    tensors=entries))
        print("%-9s %6d bytes, %d params, loss %.7g, adamw %.7g -> %.7g, sgd %.7g -> %.7g" % (
            spec["name"], len(blob), len(names), loss.item(), adamw[0], adamw[-1], sgd[0], sgd[-1]))
    with open(os.path.join(OUT, "index.json"), "w") as f:
        f.write(dump_index(index))


def dump_index(obj, indent=0):
    """JSON with lists of numbers or names, and each tensor entry, on one
    line (readable, and a third of json.dump(indent=1)'s size)."""
    pad = " " * (indent + 1)
    flat = lambda v: not isinstance(v, (dict, list)) or (isinstance(v, list) and all(
        not isinstance(x, (dict, list)) for x in v)) or (isinstance(v, dict) and "offset" in v)
    if flat(obj):
        return json.dumps(obj)
    if isinstance(obj, list):
        items = [pad + dump_index(v, indent + 1) for v in obj]
        text = "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    else:
        items = [pad + json.dumps(k) + ": " + dump_index(v, indent + 1) for k, v in obj.items()]
        text = "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    return text + ("\n" if indent == 0 else "")


if __name__ == "__main__":
    main()
