"""A Hugging Face GPT-2 file with random weights, and the logits of HF's
module on fixed input ids: the fixtures of tests/checkpoint/test_hf_gpt2.c
(docs/gpt2-weights.md).

No pretrained file can be downloaded here and transformers is not
installed, so HFGPT2 below is GPT-2 written from the published
architecture (transformers' models/gpt2/modeling_gpt2.py: GPT2Model and
GPT2LMHeadModel in eval mode), with the same parameter names:

  wte, wpe                     token and position embeddings
  h.N.ln_1, h.N.ln_2, ln_f     LayerNorm, eps 1e-5
  h.N.attn.c_attn              Conv1D(3d, d): weight (d, 3d), x @ W + b;
                               the output split in q, k, v along the last dim
  h.N.attn.c_proj              Conv1D(d, d)
  h.N.mlp.c_fc, h.N.mlp.c_proj Conv1D(4d, d), Conv1D(d, 4d)
  activation                   gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  attention                    q k^T / sqrt(head_dim), causal (the lower
                               triangle kept, the rest set to the dtype's
                               minimum), softmax, @ v, heads merged
  lm_head                      Linear(d, vocab, bias=False) tied to wte

Every parameter is drawn (weights N(0, 0.2), biases N(0, 0.1), layer-norm
weights 1 + N(0, 0.1)), so that a wrong transpose, split or activation
shows in the logits; HF initializes weights with std 0.02 and biases to 0.

The file is written as the Rust safetensors writer (save_pretrained)
writes it: {"__metadata__": {"format": "pt"}} first, then the tensors
sorted by name (all F32), compact JSON padded with spaces to a multiple of
8 bytes, the data in header order. Names are GPT2Model's (no
"transformer." prefix, no lm_head: it is tied), as the hub's gpt2 file;
no attention buffers (h.N.attn.bias), as transformers saves them now.

As a check on the mapping docs/gpt2-weights.md gives, the script also
loads the weights into tools/reference/models.py's GPT (the PyTorch twin
of nn/gpt.c, with the tanh GELU and tied weights), Conv1D weights
transposed, and asserts that its logits are HF's within 1e-5.

Files (in --out):
  model.safetensors   the GPT-2 file
  logits.safetensors  "ids" int64 (B, T) and "logits" float32 (B, T, vocab),
                      HF's module on ids (eval mode)

Made with Debian 12's python3-torch 1.13 (torch 1.13.0a0), by:

  /usr/bin/python3 tools/reference/make_hf_gpt2.py --out tests/fixtures/hf_gpt2

(2 layers, d_model 64, 4 heads, vocab 300, n_positions 32, ids (2, 32),
seed 2121). A GPT-2-small-shaped file for train_gpt --init-from-hf (about
500 MB; not committed):

  /usr/bin/python3 tools/reference/make_hf_gpt2.py --layers 12 --dim 768 --heads 12 \\
      --vocab 50257 --positions 1024 --std 0.02 --no-logits --out /tmp/gpt2-small
"""
import argparse
import json
import math
import os
import struct
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a Linear whose weight is stored
    (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def gelu_new(x):
    """transformers.activations.NewGELUActivation."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Attention(nn.Module):
    """GPT2Attention (scale_attn_weights, no cross-attention)."""

    def __init__(self, d, n_head, n_positions):
        super().__init__()
        self.d, self.n_head = d, n_head
        self.c_attn = Conv1D(3 * d, d)
        self.c_proj = Conv1D(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(n_positions, n_positions, dtype=torch.bool))
                             .view(1, 1, n_positions, n_positions), persistent=False)

    def split_heads(self, x):
        B, T, _ = x.size()
        return x.view(B, T, self.n_head, self.d // self.n_head).permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(self.d, dim=2)
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype)
        T = q.size(-2)
        causal = self.bias[:, :, :T, :T]
        w = torch.where(causal, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype))
        w = nn.functional.softmax(w, dim=-1)
        a = torch.matmul(w, v)
        B = a.size(0)
        a = a.permute(0, 2, 1, 3).contiguous().view(B, T, self.d)
        return self.c_proj(a)


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = Conv1D(4 * d, d)
        self.c_proj = Conv1D(d, 4 * d)

    def forward(self, x):
        return self.c_proj(gelu_new(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d, n_head, n_positions):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = Attention(d, n_head, n_positions)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class HFGPT2(nn.Module):
    """GPT2Model's parameters under its names; forward is GPT2LMHeadModel's
    logits (lm_head tied to wte)."""

    def __init__(self, vocab, n_positions, d, n_layer, n_head):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(n_positions, d)
        self.h = nn.ModuleList([Block(d, n_head, n_positions) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d, eps=1e-5)

    def forward(self, ids):
        T = ids.size(1)
        x = self.wte(ids) + self.wpe(torch.arange(T, dtype=torch.int64))
        for b in self.h:
            x = b(x)
        return nn.functional.linear(self.ln_f(x), self.wte.weight)


def randomize(model, std):
    g = torch.Generator().manual_seed(2121)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * (std / 2))
            elif name.startswith("ln") or ".ln_" in name:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def save_safetensors(path, tensors, metadata):
    """The Rust writer's layout: metadata first, tensors sorted by name
    (one dtype), compact JSON padded with spaces to 8 bytes."""
    dtypes = {torch.float32: "F32", torch.int64: "I64"}
    header = {"__metadata__": metadata} if metadata is not None else {}
    blobs, off = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        data = t.numpy().tobytes()
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def twin_logits(hf, ids, vocab, n_positions, d, n_layer, n_head, gelu_approx="tanh"):
    """models.GPT (nn/gpt.c's twin) with HF's weights, mapped as
    checkpoint/hf_gpt2.c maps them."""
    g = models.GPT(vocab, n_positions, n_layer, n_head, d, tie_weights=True, gelu_approx=gelu_approx)
    sd = hf.state_dict()
    ours = {"tok_emb.weight": sd["wte.weight"], "pos_emb.weight": sd["wpe.weight"],
            "ln_f.weight": sd["ln_f.weight"], "ln_f.bias": sd["ln_f.bias"], "lm_head.weight": sd["wte.weight"]}
    for i in range(n_layer):
        h, b = "h.%d." % i, "blocks.%d." % i
        ours.update({
            b + "ln1.weight": sd[h + "ln_1.weight"], b + "ln1.bias": sd[h + "ln_1.bias"],
            b + "attn.in_proj_weight": sd[h + "attn.c_attn.weight"].t(), b + "attn.in_proj_bias": sd[h + "attn.c_attn.bias"],
            b + "attn.out_proj.weight": sd[h + "attn.c_proj.weight"].t(), b + "attn.out_proj.bias": sd[h + "attn.c_proj.bias"],
            b + "ln2.weight": sd[h + "ln_2.weight"], b + "ln2.bias": sd[h + "ln_2.bias"],
            b + "mlp.0.weight": sd[h + "mlp.c_fc.weight"].t(), b + "mlp.0.bias": sd[h + "mlp.c_fc.bias"],
            b + "mlp.2.weight": sd[h + "mlp.c_proj.weight"].t(), b + "mlp.2.bias": sd[h + "mlp.c_proj.bias"],
        })
    g.load_state_dict(ours, strict=True)
    g.train()  # MultiheadAttention's composite path (dropout is 0)
    with torch.no_grad():
        return g(ids)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=300)
    ap.add_argument("--positions", type=int, default=32)
    ap.add_argument("--std", type=float, default=0.2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--no-logits", action="store_true", help="write the model file only")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(2121)
    hf = HFGPT2(a.vocab, a.positions, a.dim, a.layers, a.heads).eval()
    randomize(hf, a.std)
    save_safetensors(os.path.join(a.out, "model.safetensors"), hf.state_dict(), {"format": "pt"})
    if a.no_logits:
        return
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, a.vocab, (a.batch, a.positions), generator=g, dtype=torch.int64)
    with torch.no_grad():
        logits = hf(ids)
    twin = twin_logits(hf, ids, a.vocab, a.positions, a.dim, a.layers, a.heads)
    diff = (twin - logits).abs().max().item()
    assert diff < 1e-5, "models.GPT with the mapped weights is off by %g" % diff
    # the fixture tells the activations apart: erf's GELU is far off
    erf = twin_logits(hf, ids, a.vocab, a.positions, a.dim, a.layers, a.heads, gelu_approx="none")
    erf_diff = (erf - logits).abs().max().item()
    assert erf_diff > 1e-3, "erf's GELU gives the same logits (%g): the fixture cannot tell them apart" % erf_diff
    save_safetensors(os.path.join(a.out, "logits.safetensors"), {"ids": ids, "logits": logits}, None)
    print("wrote %s: logits %s, |logits| max %.3g, models.GPT twin within %.3g, erf GELU off by %.3g" %
          (a.out, tuple(logits.shape), logits.abs().max().item(), diff, erf_diff))


if __name__ == "__main__":
    main()
