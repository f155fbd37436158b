#!/usr/bin/env python3
"""Write the bfloat16 / float16 nn fixtures of tests/fixtures/half/nn/ from torch
1.13 (CPU), for tests/tensor/test_half_nn_ops.c and tests/nn/test_half_parity.c.

usage: /usr/bin/python3 tools/reference/make_half_nn.py [OUTDIR]
       (Debian 12's system python3 with the python3-torch package, 1.13;
        OUTDIR defaults to tests/fixtures/half/nn beside this script's repo,
        a directory of its own beside the other 16-bit fixtures)

Two groups, each NAME.bin (raw little-endian values of the tensors listed
for NAME in index.json, C order, concatenated: bfloat16 and float16 as
their 16-bit patterns, float32, int64) plus its entry in index.json
(per tensor: name, dtype, shape, byte offset, byte count):

ops (torch.set_num_threads(1); every input drawn with torch.randn after
torch.manual_seed(SEED) in float32, then .to(dtype); each op's upstream
gradient drawn the same way; the C test reads the inputs from the file):

  layer_norm.<dt>.*    F.layer_norm(x (4, 3, 24), (24,), w, b, eps=1e-5);
                       backward of (y * g).sum(): gx, gw, gb
  softmax.<dt>.*       F.softmax(x (5, 17), -1); backward with g
  log_softmax.<dt>.*   F.log_softmax(x (5, 17), -1); backward with g
  embedding.<dt>.*     F.embedding(idx (3, 5) int64 with repeated rows,
                       weight (10, 6)); backward with g (3, 5, 6)
  cross_entropy.<dt>.* F.cross_entropy(logits (6, 9), targets (6,),
                       ignore_index=-100; targets[2] = -100), reduction
                       mean; backward of the loss (gradient 1)
  dropout.<dt>.*       torch.manual_seed(DROP_SEED); F.dropout(x (4, 33),
                       p=0.1, training=True); backward with g
  attention.<dt>.*     the attention of F.multi_head_attention_forward
                       (torch 1.13, need_weights=False) on q, k, v
                       (B=2, T=S=5, E=8, H=2) with the causal bool mask:
                       q_scaled = q / sqrt(hd); A = baddbmm(mask_f, q_scaled,
                       k^T); P = softmax(A); [dropout p=0.25 after
                       torch.manual_seed(DROP_SEED) for attention_drop];
                       O = bmm(P, v); heads are column blocks of E, as in
                       ts_attention; backward with g: gq, gk, gv

  <dt> is bf16 for every op (torch 1.13's CPU kernels of layer_norm,
  softmax, dropout's bernoulli and matmul have no float16), and also f16
  for embedding (which has one).

gpt_bf16 (the model of tests/fixtures/parity "gpt": tools/reference/
models.py's GPT(vocab_size=11, block_size=8, n_layer=2, n_head=2,
d_model=16, dropout=0.0, tie_weights=False), seed 303):
  torch.manual_seed(303); m = GPT(...); m.train(); m.to(torch.bfloat16);
  torch.manual_seed(304); seq = torch.randint(0, 11, (2, 7));
  idx = seq[:, :-1]; targets = seq[:, 1:]; logits = m(idx);
  loss = F.cross_entropy(logits.view(-1, 11), targets.view(-1));
  loss.backward(). Recorded: param.<fqn> (bfloat16), input.idx,
  input.targets, output (bfloat16), loss (bfloat16, 0-d), grad.<fqn>
  (bfloat16).

The script is deterministic: a second run writes identical files.
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import models  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "tests", "fixtures", "half", "nn")
SEED = 1010
DROP_SEED = 2020
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32", torch.int64: "int64"}


class Blob:
    def __init__(self):
        self.entries = []
        self.data = bytearray()

    def add(self, name, t):
        t = t.detach().contiguous()
        raw_t = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
        raw = raw_t.numpy().tobytes()  # little-endian on this machine (x86-64)
        self.entries.append(dict(name=name, dtype=NAMES[t.dtype], shape=list(t.shape), offset=len(self.data),
                                 nbytes=len(raw)))
        self.data.extend(raw)


def rnd(shape, dt):
    return torch.randn(*shape).to(dt)


def leaf(t):
    return t.clone().requires_grad_(True)


def op_layer_norm(b, tag, dt):
    x, w, bb = rnd((4, 3, 24), dt), rnd((24,), dt), rnd((24,), dt)
    g = rnd((4, 3, 24), dt)
    xl, wl, bl = leaf(x), leaf(w), leaf(bb)
    y = F.layer_norm(xl, (24,), wl, bl, eps=1e-5)
    y.backward(g)
    for k, v in dict(x=x, w=w, b=bb, g=g, y=y, gx=xl.grad, gw=wl.grad, gb=bl.grad).items():
        b.add("layer_norm.%s.%s" % (tag, k), v)


def op_softmax(b, tag, dt, log):
    name = "log_softmax" if log else "softmax"
    x, g = rnd((5, 17), dt), rnd((5, 17), dt)
    xl = leaf(x)
    y = (F.log_softmax if log else F.softmax)(xl, -1)
    y.backward(g)
    for k, v in dict(x=x, g=g, y=y, gx=xl.grad).items():
        b.add("%s.%s.%s" % (name, tag, k), v)


def op_embedding(b, tag, dt):
    w = rnd((10, 6), dt)
    idx = torch.tensor([[1, 3, 3, 7, 1], [0, 3, 9, 1, 1], [3, 2, 3, 1, 5]], dtype=torch.int64)
    g = rnd((3, 5, 6), dt)
    wl = leaf(w)
    y = F.embedding(idx, wl)
    y.backward(g)
    for k, v in dict(w=w, idx=idx, g=g, y=y, gw=wl.grad).items():
        b.add("embedding.%s.%s" % (tag, k), v)


def op_cross_entropy(b, tag, dt):
    x = rnd((6, 9), dt)
    t = torch.tensor([3, 0, -100, 8, 5, 3], dtype=torch.int64)
    xl = leaf(x)
    loss = F.cross_entropy(xl, t, ignore_index=-100)
    loss.backward()
    for k, v in dict(x=x, t=t, loss=loss, gx=xl.grad).items():
        b.add("cross_entropy.%s.%s" % (tag, k), v)


def op_dropout(b, tag, dt):
    x, g = rnd((4, 33), dt), rnd((4, 33), dt)
    xl = leaf(x)
    torch.manual_seed(DROP_SEED)
    y = F.dropout(xl, p=0.1, training=True)
    y.backward(g)
    for k, v in dict(x=x, g=g, y=y, gx=xl.grad).items():
        b.add("dropout.%s.%s" % (tag, k), v)


def attention(q, k, v, H, mask, p):
    """F.multi_head_attention_forward's core (torch 1.13), heads as column
    blocks of E."""
    B, T, E = q.shape
    S = k.shape[1]
    hd = E // H
    heads = lambda t, n: t.view(B, n, H, hd).transpose(1, 2).reshape(B * H, n, hd)
    qh, kh, vh = heads(q, T), heads(k, S), heads(v, S)
    mf = torch.zeros_like(mask, dtype=q.dtype)
    mf.masked_fill_(mask, float("-inf"))
    qs = qh / math.sqrt(hd)
    a = torch.baddbmm(mf, qs, kh.transpose(-2, -1))
    a = F.softmax(a, dim=-1)
    if p > 0.0:
        torch.manual_seed(DROP_SEED)
        a = F.dropout(a, p=p)
    o = torch.bmm(a, vh)
    return o.view(B, H, T, hd).transpose(1, 2).reshape(B, T, E)


def op_attention(b, tag, dt, p):
    name = "attention_drop" if p > 0 else "attention"
    q, k, v, g = rnd((2, 5, 8), dt), rnd((2, 5, 8), dt), rnd((2, 5, 8), dt), rnd((2, 5, 8), dt)
    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    ql, kl, vl = leaf(q), leaf(k), leaf(v)
    y = attention(ql, kl, vl, 2, mask, p)
    y.backward(g)
    for kk, vv in dict(q=q, k=k, v=v, g=g, y=y, gq=ql.grad, gk=kl.grad, gv=vl.grad).items():
        b.add("%s.%s.%s" % (name, tag, kk), vv)


def make_ops():
    b = Blob()
    torch.manual_seed(SEED)
    op_layer_norm(b, "bf16", torch.bfloat16)
    op_softmax(b, "bf16", torch.bfloat16, False)
    op_softmax(b, "bf16", torch.bfloat16, True)
    op_embedding(b, "bf16", torch.bfloat16)
    op_embedding(b, "f16", torch.float16)
    op_cross_entropy(b, "bf16", torch.bfloat16)
    op_dropout(b, "bf16", torch.bfloat16)
    op_attention(b, "bf16", torch.bfloat16, 0.0)
    op_attention(b, "bf16", torch.bfloat16, 0.25)
    return b


GPT_CFG = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=16, dropout=0.0)


def make_gpt():
    b = Blob()
    torch.manual_seed(303)
    m = models.GPT(**GPT_CFG, tie_weights=False)
    m.train()
    m.to(torch.bfloat16)
    names = [n for n, _ in m.named_parameters()]
    for n, p in m.named_parameters():
        b.add("param." + n, p)
    torch.manual_seed(304)
    seq = torch.randint(0, GPT_CFG["vocab_size"], (2, 7))
    idx, targets = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    b.add("input.idx", idx)
    b.add("input.targets", targets)
    logits = m(idx)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    loss.backward()
    b.add("output", logits)
    b.add("loss", loss)
    for n, p in m.named_parameters():
        b.add("grad." + n, p.grad)
    return b, names, loss


def main():
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    index = {"torch": torch.__version__, "groups": []}
    ops = make_ops()
    gpt, names, loss = make_gpt()
    for name, blob, extra in (("ops", ops, dict(seed=SEED, dropout_seed=DROP_SEED)),
                              ("gpt_bf16", gpt, dict(seed=303, input_seed=304, config=dict(
                                  kind="gpt", tie_weights=False, batch=2, seq=6, **GPT_CFG),
                                  params=names, loss=float(loss)))):
        fname = name + ".bin"
        with open(os.path.join(OUT, fname), "wb") as f:
            f.write(bytes(blob.data))
        index["groups"].append(dict(name=name, file=fname, **extra, tensors=blob.entries))
        print("%-9s %6d bytes, %d tensors" % (name, len(blob.data), len(blob.entries)))
    with open(os.path.join(OUT, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
