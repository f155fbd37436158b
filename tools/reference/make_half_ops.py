#!/usr/bin/env python3
"""Write the bf16/f16 op fixtures of tests/fixtures/half/ from torch 1.13
(CPU), for tests/tensor/test_half_ops.c.

usage: /usr/bin/python3 tools/reference/make_half_ops.py [OUTDIR]
       (Debian 12's system python3 with the python3-torch package, torch
        1.13.1, CPU capability AVX2; OUTDIR defaults to tests/fixtures/half
        beside this script's repo)

torch.manual_seed(0), one intra-op thread; then the inputs, drawn in float32
(randn) and converted with .to(dtype) for dtype in (bfloat16, float16):

  x, y, g   (3, 257)  randn;           xp = |randn| + 0.25 (3, 257)
  yb        (257,)    randn;           ybp = |randn| + 0.25 (257,)
  gr        (3,)      randn;           g0  () randn      (cotangents)

For every case of CASES below and each dtype: the inputs that are floating
get requires_grad, the case runs, the output is backpropagated with the
cotangent of its shape (g, gr or g0), and the script records the output
and the .grad of every input. Where torch 1.13 has no kernel for the dtype
(most unary float16 ops on CPU: "not implemented for 'Half'") it writes an
"unsupported" line instead.

Output: ops.bin, the raw little-endian values concatenated (bf16/f16 as
their 16-bit patterns, int64 indices, float32 for casts to float32), and
index.txt, one line per tensor:

    tensor NAME DTYPE NDIM D0 D1 ... OFFSET NBYTES
    unsupported DTYPE CASE REASON...

NAME is "<dtype>.<case>.<what>" with what = in.<input>, out, or
grad.<input>. Deterministic: a second run writes identical files.
"""
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "tests", "fixtures", "half")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

# name: (inputs, function, cotangent)
CASES = [
    ("neg", ["x"], lambda x: -x, "g"),
    ("exp", ["x"], torch.exp, "g"),
    ("log", ["xp"], torch.log, "g"),
    ("sqrt", ["xp"], torch.sqrt, "g"),
    ("rsqrt", ["xp"], torch.rsqrt, "g"),
    ("tanh", ["x"], torch.tanh, "g"),
    ("sigmoid", ["x"], torch.sigmoid, "g"),
    ("relu", ["x"], torch.relu, "g"),
    ("gelu", ["x"], F.gelu, "g"),
    ("gelu_tanh", ["x"], lambda x: F.gelu(x, approximate="tanh"), "g"),
    ("abs", ["x"], torch.abs, "g"),
    ("pow2", ["x"], lambda x: x ** 2.0, "g"),
    ("pow3", ["x"], lambda x: x ** 3.0, "g"),
    ("pow0.5", ["xp"], lambda x: x ** 0.5, "g"),
    ("pow1.7", ["xp"], lambda x: x ** 1.7, "g"),
    ("add_s", ["x"], lambda x: x + 0.1, "g"),
    ("sub_s", ["x"], lambda x: x - 0.1, "g"),
    ("rsub_s", ["x"], lambda x: 0.1 - x, "g"),
    ("mul_s", ["x"], lambda x: x * 0.1, "g"),
    ("div_s", ["x"], lambda x: x / 0.3, "g"),
    ("add", ["x", "y"], torch.add, "g"),
    ("sub", ["x", "y"], torch.sub, "g"),
    ("mul", ["x", "y"], torch.mul, "g"),
    ("div", ["x", "xp"], torch.div, "g"),
    ("add_b", ["x", "yb"], torch.add, "g"),
    ("mul_b", ["x", "yb"], torch.mul, "g"),
    ("div_b", ["x", "ybp"], torch.div, "g"),
    ("sum_all", ["x"], lambda x: x.sum(), "g0"),
    ("sum1", ["x"], lambda x: x.sum(1), "gr"),
    ("mean_all", ["x"], lambda x: x.mean(), "g0"),
    ("mean1", ["x"], lambda x: x.mean(1), "gr"),
    ("amax1", ["x"], lambda x: x.amax(1), "gr"),
    ("max1", ["x"], lambda x: x.max(1)[0], "gr"),
    ("cat", ["x", "y"], lambda x, y: torch.cat([x, y], 0), "gcat"),
    ("where", ["x", "y"], lambda x, y: torch.where(x > 0, x, y), "g"),
    ("masked_fill", ["x"], lambda x: x.masked_fill(x > 0.5, 0.25), "g"),
    ("to_f32", ["x"], lambda x: x.float(), "gf"),
    ("t_contiguous", ["x"], lambda x: x.t().contiguous(), "gt"),
]


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = {
        "x": torch.randn(3, 257), "y": torch.randn(3, 257), "g": torch.randn(3, 257),
        "xp": torch.randn(3, 257).abs() + 0.25, "yb": torch.randn(257),
        "ybp": torch.randn(257).abs() + 0.25, "gr": torch.randn(3), "g0": torch.randn(()),
        "gcat": torch.randn(6, 257), "gt": torch.randn(257, 3),
    }
    os.makedirs(OUT, exist_ok=True)
    blob = bytearray()
    index = []

    def put(name, t):
        t = t.detach().contiguous()
        if t.dtype in (torch.bfloat16, torch.float16):
            raw = t.view(torch.int16).numpy().tobytes()
        else:
            raw = t.numpy().tobytes()
        dn = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
              torch.int64: "int64"}[t.dtype]
        index.append("tensor %s %s %d %s %d %d" % (name, dn, t.dim(), " ".join(str(s) for s in t.shape),
                                                  len(blob), len(raw)))
        blob.extend(raw)

    for dn, dt in DTYPES.items():
        inp = {k: v.to(dt) for k, v in base.items()}
        inp["gf"] = base["g"]  # the cotangent of a cast to float32 is float32
        for k in ("x", "y", "g", "xp", "yb", "ybp", "gr", "g0", "gcat", "gt"):
            put("%s.in.%s" % (dn, k), inp[k])
        for name, args, fn, cot in CASES:
            xs = [inp[a].clone().requires_grad_() for a in args]
            try:
                out = fn(*xs)
                out.backward(inp[cot])
            except RuntimeError as e:
                index.append("unsupported %s %s %s" % (dn, name, str(e).splitlines()[0]))
                continue
            put("%s.%s.out" % (dn, name), out)
            for a, t in zip(args, xs):
                put("%s.%s.grad.%s" % (dn, name, a), t.grad)
    with open(os.path.join(OUT, "ops.bin"), "wb") as f:
        f.write(bytes(blob))
    with open(os.path.join(OUT, "index.txt"), "w") as f:
        f.write("# written by tools/reference/make_half_ops.py (torch %s); see its docstring\n" % torch.__version__)
        f.write("\n".join(index) + "\n")


if __name__ == "__main__":
    main()
