#!/usr/bin/env python3
"""Write the random-number, initializer and bf16/f16 test vectors of
tests/fixtures/rng/ from torch 1.13 (CPU).

usage: /usr/bin/python3 tools/reference/make_rng_vectors.py [OUTDIR]
       (Debian 12's system python3 with the python3-torch package;
        OUTDIR defaults to tests/fixtures/rng beside this script's repo)

Adapted from reference/torch-rng/make_vectors.py: the first twelve vectors
are that script's (so a run also proves the shared vectors are reproduced on
this machine), the rest are new. See tests/fixtures/rng/PROVENANCE.md.

For every vector NAME it writes NAME.bin (the raw little-endian values of the
tensors in the list `res`, C order, concatenated) and NAME.txt (a '#'
header with the exact torch code and each tensor's shape and dtype, then
one value per line; for the new vectors only when they hold at most 300
values). index.txt
lists name, shapes/dtypes and code.

The half-precision vectors (half_*) are described in PROVENANCE.md; the
checksums of the exhaustive/sweep conversions go to half_crc32.txt, and the
CRC-32s of a few million-value runs to rng_crc32.txt.
"""
import math
import os
import struct
import sys
import zlib

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "tests", "fixtures", "rng")
os.makedirs(OUT, exist_ok=True)

TXT_MAX_VALUES = 300

# ---------------------------------------------------------------- vectors
# name -> code; the code leaves the tensors to dump in the list `res`.

SHARED = [
    ("linear4x4_seed0_weight",
     "torch.manual_seed(0); m = torch.nn.Linear(4, 4, bias=False); res = [m.weight]"),
    ("randn_4x8_seed42",
     "torch.manual_seed(42); res = [torch.randn(4, 8)]"),
    ("linear8x8_seed42_weight_bias",
     "torch.manual_seed(42); m = torch.nn.Linear(8, 8); res = [m.weight, m.bias]"),
    ("seq2linear4_seed0_weights",
     "torch.manual_seed(0); m = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.ReLU(), "
     "torch.nn.Linear(4, 4, bias=False)); res = [m[0].weight, m[2].weight]"),
    ("randn_2x3_seed42",
     "torch.manual_seed(42); res = [torch.randn(2, 3)]"),
    ("randn_17_seed0",
     "torch.manual_seed(0); res = [torch.randn(17)]"),
    ("rand_8_seed0",
     "torch.manual_seed(0); res = [torch.rand(8)]"),
    ("randint_0_10_12_seed0",
     "torch.manual_seed(0); res = [torch.randint(0, 10, (12,))]"),
    ("randperm_10_seed0",
     "torch.manual_seed(0); res = [torch.randperm(10)]"),
    ("embedding10x3_seed0_weight",
     "torch.manual_seed(0); m = torch.nn.Embedding(10, 3); res = [m.weight]"),
    ("linear64x32_seed0_weight_bias",
     "torch.manual_seed(0); m = torch.nn.Linear(64, 32); res = [m.weight, m.bias]"),
    ("encoderlayer_d8_h2_ff16_seed0_params",
     "torch.manual_seed(0); m = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16); "
     "res = [p for _, p in m.named_parameters()]"),
]

SIZES = "[1, 15, 16, 17, 31, 33, 100, 1000]"

NEW = [
    # --- rand / randn, one manual_seed(1000 + n) per size
    ("rand_f32_sizes",
     "res = []\nfor n in %s:\n    torch.manual_seed(1000 + n); res.append(torch.rand(n))" % SIZES),
    ("rand_f64_sizes",
     "res = []\nfor n in %s:\n    torch.manual_seed(1000 + n); res.append(torch.rand(n, dtype=torch.float64))" % SIZES),
    ("randn_f32_sizes",
     "res = []\nfor n in %s:\n    torch.manual_seed(1000 + n); res.append(torch.randn(n))" % SIZES),
    ("randn_f64_sizes",
     "res = []\nfor n in %s:\n    torch.manual_seed(1000 + n); res.append(torch.randn(n, dtype=torch.float64))" % SIZES),
    # --- seeds: only the low 32 bits reach the engine; negative = two's complement
    ("rand_seeds",
     "res = []\nfor s in [0, 1, 42, 2**31 - 1, 2**32 - 1, 2**32 + 7, 2**63 - 1, -1, -123456789, 2**64 - 1]:\n"
     "    torch.manual_seed(s); res.append(torch.rand(4))"),
    # --- normal_(mean, std): scalar path (5), exact block (16), block + tail (37), 1000
    ("normal_f32_mean_std",
     "res = []\nfor k, (m, s) in enumerate([(0.25, 2.5), (-3.0, 0.1), (1000.0, 0.001)]):\n"
     "    torch.manual_seed(100 + k)\n"
     "    for n in [5, 16, 37, 1000]:\n"
     "        res.append(torch.empty(n).normal_(m, s))"),
    ("normal_f64_mean_std",
     "res = []\nfor k, (m, s) in enumerate([(0.25, 2.5), (-3.0, 0.1)]):\n"
     "    torch.manual_seed(200 + k)\n"
     "    for n in [5, 16, 37, 200]:\n"
     "        res.append(torch.empty(n, dtype=torch.float64).normal_(m, s))"),
    # --- uniform_(from, to), 37 elements per pair, one seed for the whole sequence
    ("uniform_f32_bounds",
     "torch.manual_seed(3); res = []\n"
     "for a, b in [(-2.5, 7.25), (-0.125, 0.125), (3.0, 3.0), (-1e30, 1e30), (0.1, 0.2)]:\n"
     "    res.append(torch.empty(37).uniform_(a, b))"),
    ("uniform_f64_bounds",
     "torch.manual_seed(4); res = []\n"
     "for a, b in [(-2.5, 7.25), (-0.125, 0.125), (3.0, 3.0), (-1e30, 1e30), (0.1, 0.2)]:\n"
     "    res.append(torch.empty(37, dtype=torch.float64).uniform_(a, b))"),
    # --- integers
    ("randint_ranges",
     "torch.manual_seed(5); res = [torch.randint(-5, 5, (20,)), torch.randint(0, 2**32, (10,)), "
     "torch.randint(0, 2**32 - 1, (10,)), torch.randint(-2**40, 2**40, (10,)), "
     "torch.randint(-2**63, 2**63 - 1, (8,)), torch.randint(7, 8, (3,)), torch.rand(2)]"),
    ("randperm_100",
     "torch.manual_seed(0); res = [torch.randperm(100), torch.randperm(1), torch.randperm(2), torch.rand(3)]"),
    # --- the scalar-path normal cache carried across calls
    ("normal_cache_seq",
     "torch.manual_seed(0); res = [torch.randn(3), torch.randn(20), torch.randn(5), torch.rand(7), torch.randn(1), "
     "torch.randn(3, dtype=torch.float64), torch.randn(16), torch.randn(2), torch.empty(3).normal_(2.0, 0.5)]"),
    # --- non-contiguous fills (TensorIterator order = ascending strides); res holds C-order copies
    ("noncontig_fills",
     "torch.manual_seed(0); res = []\n"
     "t = torch.empty(8, 4).t(); t.normal_(); res.append(t)\n"                        # (4, 8) strides (1, 4)
     "t = torch.empty(8, 4).t(); t.uniform_(-1.0, 1.0); res.append(t)\n"
     "t = torch.empty(6, 10)[:, ::2]; t.uniform_(-1.0, 1.0); res.append(t)\n"          # (6, 5) strides (10, 2)
     "t = torch.empty(2, 3, 4).permute(2, 0, 1); t.normal_(0.5, 2.0); res.append(t)\n"  # (4, 2, 3) strides (1, 12, 4)
     "t = torch.empty(4, 6, dtype=torch.float64).t(); t.normal_(); res.append(t)\n"    # (6, 4) f64
     "t = torch.empty(5, 8)[1:4, 2:7]; t.normal_(); res.append(t)\n"                   # (3, 5) strides (8, 1)
     "t = torch.empty(40)[::2]; t.normal_(); res.append(t)\n"                          # (20,) stride 2
     "t = torch.empty(8, 4).t(); t.bernoulli_(0.3); res.append(t)\n"
     "res = [r.contiguous() for r in res]"),
    # --- bernoulli_ (no MKL in this build: U53 < p, two draws per element) and dropout
    ("bernoulli_p",
     "torch.manual_seed(0); res = [torch.empty(37).bernoulli_(0.3), torch.empty(20, dtype=torch.float64).bernoulli_(0.7), "
     "torch.empty(5).bernoulli_(0.0), torch.empty(5).bernoulli_(1.0), torch.rand(2)]"),
    ("dropout_masks",
     "x = (torch.arange(40, dtype=torch.float32).reshape(5, 8) - 17.0) * 0.37\n"
     "torch.manual_seed(0); res = [x, F.dropout(x, 0.5, True), F.dropout(x, 0.1, True), F.dropout(x, 0.0, True), "
     "F.dropout(x, 1.0, True), torch.rand(2)]"),
    # --- torch.nn.init; manual_seed(k) before entry k
    ("init_kaiming_uniform",
     "res = []\n"
     "for k, (shape, dt, a, mode, nl) in enumerate([((4, 4), torch.float32, math.sqrt(5), 'fan_in', 'leaky_relu'),\n"
     "        ((8, 3, 3, 3), torch.float32, 0, 'fan_in', 'leaky_relu'), ((5, 7), torch.float32, 0, 'fan_out', 'relu'),\n"
     "        ((6, 2, 5), torch.float32, 0.2, 'fan_in', 'leaky_relu'), ((3, 4), torch.float32, 0, 'fan_in', 'tanh'),\n"
     "        ((4, 4), torch.float64, math.sqrt(5), 'fan_in', 'leaky_relu')]):\n"
     "    torch.manual_seed(k); t = torch.empty(shape, dtype=dt)\n"
     "    torch.nn.init.kaiming_uniform_(t, a=a, mode=mode, nonlinearity=nl); res.append(t)"),
    ("init_kaiming_normal",
     "res = []\n"
     "for k, (shape, dt, a, mode, nl) in enumerate([((16, 8), torch.float32, 0, 'fan_in', 'relu'),\n"
     "        ((3, 4), torch.float32, 0, 'fan_in', 'leaky_relu'), ((6, 4, 3), torch.float32, 0, 'fan_out', 'relu'),\n"
     "        ((5, 5), torch.float64, 0.1, 'fan_in', 'leaky_relu')]):\n"
     "    torch.manual_seed(k); t = torch.empty(shape, dtype=dt)\n"
     "    torch.nn.init.kaiming_normal_(t, a=a, mode=mode, nonlinearity=nl); res.append(t)"),
    ("init_xavier_uniform",
     "res = []\n"
     "for k, (shape, dt, gain) in enumerate([((24, 8), torch.float32, 1.0),\n"
     "        ((3, 5, 2), torch.float32, torch.nn.init.calculate_gain('tanh')), ((7, 3), torch.float64, 1.0)]):\n"
     "    torch.manual_seed(k); t = torch.empty(shape, dtype=dt)\n"
     "    torch.nn.init.xavier_uniform_(t, gain=gain); res.append(t)"),
    ("init_xavier_normal",
     "res = []\n"
     "for k, (shape, dt, gain) in enumerate([((1, 1, 8), torch.float32, 1.0), ((20, 10), torch.float32, 0.5),\n"
     "        ((4, 6), torch.float64, 2.0)]):\n"
     "    torch.manual_seed(k); t = torch.empty(shape, dtype=dt)\n"
     "    torch.nn.init.xavier_normal_(t, gain=gain); res.append(t)"),
    ("init_zero_element",
     "torch.manual_seed(9); torch.nn.init.kaiming_uniform_(torch.empty(0, 5)); "
     "torch.nn.init.kaiming_normal_(torch.empty(3, 0)); torch.nn.init.xavier_uniform_(torch.empty(0, 4)); "
     "res = [torch.rand(2)]"),
    ("init_calculate_gain",
     "g = torch.nn.init.calculate_gain\n"
     "res = [torch.tensor([float(g('linear')), float(g('sigmoid')), float(g('tanh')), float(g('relu')), "
     "float(g('leaky_relu')), float(g('leaky_relu', math.sqrt(5))), float(g('leaky_relu', 0)), "
     "float(g('leaky_relu', 0.2)), float(g('selu')), float(g('conv2d'))], dtype=torch.float64)]"),
    # --- torch.get_rng_state() bytes (5056, uint8)
    ("rng_state",
     "res = []\n"
     "torch.manual_seed(123); torch.randn(3); res.append(torch.get_rng_state())\n"
     "torch.manual_seed(0); res.append(torch.get_rng_state())\n"
     "torch.manual_seed(-1); res.append(torch.get_rng_state())\n"
     "torch.manual_seed(2**32 + 7); torch.rand(700); res.append(torch.get_rng_state())\n"
     "torch.manual_seed(7); torch.randn(1, dtype=torch.float64); res.append(torch.get_rng_state())"),
    ("rng_state_resume",
     "torch.manual_seed(123); torch.randn(3); s = torch.get_rng_state(); "
     "res = [s, torch.randn(5), torch.rand(3)]"),
]


def dtname(t):
    return str(t.dtype).replace("torch.", "")


def write_vector(name, code, full_txt):
    env = {"torch": torch, "F": F, "math": math}
    exec(code, env)
    res = [t.detach().contiguous() for t in env["res"]]
    total = sum(t.numel() for t in res)
    brief = total > TXT_MAX_VALUES and not full_txt
    pnames = [n for n, _ in env["m"].named_parameters()] if "named_parameters" in code else [None] * len(res)
    with open(os.path.join(OUT, name + ".bin"), "wb") as fb, open(os.path.join(OUT, name + ".txt"), "w") as ft:
        ft.write("# torch %s, CPU, default dtype float32\n" % torch.__version__)
        for line in code.split("\n"):
            ft.write("# code: %s\n" % line)
        for k, t in enumerate(res):
            ft.write("# tensor %d: shape %s dtype %s (%d values, C order)%s\n" % (
                k, tuple(t.shape), dtname(t), t.numel(), (" " + pnames[k]) if pnames[k] else ""))
        if brief:
            ft.write("# (%d values: see %s.bin)\n" % (total, name))
        for t in res:
            fb.write(t.numpy().tobytes())
            if brief:
                continue
            for v in t.flatten().tolist():
                if t.dtype == torch.float32:
                    ft.write("%.9g 0x%08x\n" % (v, struct.unpack("<I", struct.pack("<f", v))[0]))
                elif t.dtype == torch.float64:
                    ft.write("%.17g 0x%016x\n" % (v, struct.unpack("<Q", struct.pack("<d", v))[0]))
                else:
                    ft.write("%d\n" % v)
    return (name, code, [(tuple(t.shape), dtname(t)) for t in res])


# ------------------------------------------------------------ half vectors

def f32_from_bits(u32):
    return torch.from_numpy(np.ascontiguousarray(u32, dtype=np.uint32).view(np.float32))


def to_half_scalar(src, dtype):
    """float32 -> dtype through TensorIterator's scalar loop (a strided
    destination): c10::BFloat16(float) / c10::Half(float)."""
    dst = torch.empty(src.numel(), 2, dtype=dtype)[:, 0]
    dst.copy_(src)
    return dst.contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def to_half_vector(src, dtype):
    """float32 -> dtype by a contiguous .to(): the AVX2 vectorised convert."""
    return src.to(dtype).view(torch.int16).numpy().view(np.uint16).copy()


def half_to_f32(bits16, dtype, strided):
    t = torch.from_numpy(np.ascontiguousarray(bits16, dtype=np.uint16).view(np.int16)).view(dtype)
    if strided:
        dst = torch.empty(t.numel(), 2)[:, 0]
        dst.copy_(t)
        out = dst.contiguous()
    else:
        out = t.float()
    return out.view(torch.int32).numpy().view(np.uint32).copy()


def is_nan32(u):
    return ((u & 0x7F800000) == 0x7F800000) & ((u & 0x007FFFFF) != 0)


F32_INTERESTING = [
    0x00000000, 0x80000000,                          # +0, -0
    0x7F800000, 0xFF800000,                          # +-inf
    0x7F7FFFFF, 0xFF7FFFFF,                          # +-FLT_MAX (bf16: rounds to inf)
    0x7F7F7FFF, 0x7F7F8000, 0x7F7E8000, 0x7F7F0000,  # near FLT_MAX: below tie, tie up to inf, tie to even, exact
    0x00000001, 0x80000001, 0x007FFFFF, 0x00800000,  # f32 subnormals, min normal
    0x00008000, 0x00018000, 0x0000FFFF, 0x00010000,  # bf16 ties among subnormals
    0x3F800000, 0xBF800000, 0x3F808000, 0x3F818000,  # 1, -1, bf16 tie to even (down), tie (up)
    0x3F808001, 0x3F807FFF, 0xBF808000, 0xBF818000,
    0x3DCCCCCD, 0x40490FDB, 0x3EAAAAAB, 0xC2F6E979,  # 0.1, pi, 1/3, -123.456
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000,  # f16: max finite, just below overflow tie, tie -> inf, 65536
    0xC77FF000, 0x501502F9, 0xD01502F9,              # -65520 -> -inf, +-1e10
    0x33800000, 0x33000000, 0x33000001, 0x32FFFFFF,  # f16: 2^-24, 2^-25 (tie -> 0), just above, below
    0x33400000, 0x33C00000, 0x34200000, 0x34400000,  # f16 subnormal ties: 0.75, 1.5, 2.5, 3 x 2^-24
    0x38800000, 0x387FFFFF, 0x387FE000, 0x387FF000,  # f16 min normal and around it
    0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001,  # f16 ties at 1.0 (even down, up), neighbours
    0xB3000000, 0xB3400000, 0x80800000, 0x8000FFFF,  # negatives
    # NaNs: quiet, signalling, payloads, negative; 0x7FFF8000 would carry into
    # the sign bit under the plain rounding formula
    0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF800001,
    0x7FBFFFFF, 0x7FA00000, 0x7F802000, 0x7FC02000, 0x7FFF8000, 0xFFFF8000, 0x7FD55555,
]

H16_INTERESTING = [
    0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF,
    0x7C00, 0xFC00, 0x7C01, 0x7D00, 0x7DFF, 0x7E00, 0x7E01, 0x7FFF, 0xFC01, 0xFE00, 0xFFFF,
    0x7F80, 0xFF80, 0x7F81, 0x7FBF, 0x7FC0, 0x7FC1, 0xFFC0, 0x7F7F, 0x0080, 0x007F,
]


def crc_u16(a):
    return zlib.crc32(np.ascontiguousarray(a, dtype="<u2").tobytes()) & 0xFFFFFFFF


def crc_u32(a):
    return zlib.crc32(np.ascontiguousarray(a, dtype="<u4").tobytes()) & 0xFFFFFFFF


def write_half():
    rng = np.random.default_rng(12345)
    rand_all = rng.integers(0, 2**32, size=10000, dtype=np.uint64).astype(np.uint32)
    # 2000 more with exponents where f16 results are finite and nonzero (2^-26 .. 2^17)
    mant = rng.integers(0, 2**23, size=2000, dtype=np.uint64).astype(np.uint32)
    expo = rng.integers(101, 145, size=2000, dtype=np.uint64).astype(np.uint32)
    sign = rng.integers(0, 2, size=2000, dtype=np.uint64).astype(np.uint32)
    rand_f16 = (sign << 31) | (expo << 23) | mant
    inputs = np.concatenate([np.array(F32_INTERESTING, dtype=np.uint32), rand_all, rand_f16])
    src = f32_from_bits(inputs)

    bf_s, bf_v = to_half_scalar(src, torch.bfloat16), to_half_vector(src, torch.bfloat16)
    hf_s, hf_v = to_half_scalar(src, torch.float16), to_half_vector(src, torch.float16)
    nan = is_nan32(inputs)
    # the scalar c10 conversion and the vectorised one agree except for NaN,
    # where the AVX2 bf16 convert of torch 1.13 writes 0xFFFF instead of 0x7FC0
    assert (bf_s[~nan] == bf_v[~nan]).all()
    assert (bf_s[nan] == 0x7FC0).all() and (bf_v[nan] == 0xFFFF).all()
    assert (hf_s == hf_v).all()

    with open(os.path.join(OUT, "half_from_f32.bin"), "wb") as f:
        f.write(inputs.astype("<u4").tobytes())
        f.write(bf_s.astype("<u2").tobytes())
        f.write(hf_s.astype("<u2").tobytes())

    h16 = np.array(H16_INTERESTING, dtype=np.uint16)
    f_from_h = half_to_f32(h16, torch.float16, True)
    f_from_b = half_to_f32(h16, torch.bfloat16, True)
    assert (f_from_h == half_to_f32(h16, torch.float16, False)).all()
    assert (f_from_b == half_to_f32(h16, torch.bfloat16, False)).all()
    with open(os.path.join(OUT, "half_to_f32.bin"), "wb") as f:
        f.write(h16.astype("<u2").tobytes())
        f.write(f_from_h.astype("<u4").tobytes())
        f.write(f_from_b.astype("<u4").tobytes())

    with open(os.path.join(OUT, "half_to_f32.txt"), "w") as f:
        f.write("# torch %s: 16-bit pattern -> float32 bits (from float16, from bfloat16)\n" % torch.__version__)
        for a, b, c in zip(h16.tolist(), f_from_h.tolist(), f_from_b.tolist()):
            f.write("0x%04x 0x%08x 0x%08x\n" % (a, b, c))
    with open(os.path.join(OUT, "half_from_f32.txt"), "w") as f:
        f.write("# torch %s: float32 bits -> bfloat16 bits, float16 bits (scalar c10 path)\n" % torch.__version__)
        f.write("# %d values: %d interesting (listed), 10000 random, 2000 random in f16 range: see .bin\n"
                % (len(inputs), len(F32_INTERESTING)))
        for k in range(len(F32_INTERESTING)):
            f.write("0x%08x 0x%04x 0x%04x\n" % (inputs[k], bf_s[k], hf_s[k]))

    # exhaustive 16 -> 32 and a 2^24-pattern sweep of 32 -> 16, as CRC-32s
    all16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    e_h = half_to_f32(all16, torch.float16, True)
    e_b = half_to_f32(all16, torch.bfloat16, True)
    assert (e_h == half_to_f32(all16, torch.float16, False)).all()
    assert (e_b == half_to_f32(all16, torch.bfloat16, False)).all()
    sweep = ((np.arange(2**24, dtype=np.uint64) * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    s_src = f32_from_bits(sweep)
    s_bf = to_half_scalar(s_src, torch.bfloat16)
    s_hf = to_half_scalar(s_src, torch.float16)
    snan = is_nan32(sweep)
    s_bfv = to_half_vector(s_src, torch.bfloat16)
    assert (s_bf[~snan] == s_bfv[~snan]).all()
    assert (s_hf == to_half_vector(s_src, torch.float16)).all()
    with open(os.path.join(OUT, "half_crc32.txt"), "w") as f:
        f.write("# torch %s. CRC-32 (zlib.crc32, IEEE) of little-endian outputs.\n" % torch.__version__)
        f.write("# f16_to_f32_all / bf16_to_f32_all: the float32 bits of every 16-bit pattern 0..65535, in order.\n")
        f.write("# f32_to_bf16_sweep / f32_to_f16_sweep: the 16-bit results for the float32 bit patterns\n")
        f.write("#   (k * 0x9E3779B1) mod 2^32, k = 0 .. 2^24-1, in order (scalar c10 path).\n")
        f.write("f16_to_f32_all 0x%08x\n" % crc_u32(e_h))
        f.write("bf16_to_f32_all 0x%08x\n" % crc_u32(e_b))
        f.write("f32_to_bf16_sweep 0x%08x\n" % crc_u16(s_bf))
        f.write("f32_to_f16_sweep 0x%08x\n" % crc_u16(s_hf))
    return len(inputs)


# ------------------------------------------------------- large-run CRCs
# name -> code leaving one tensor in `r`; only its CRC-32 is stored
# (rng_crc32.txt), so that a large run costs a line, not megabytes.
BIG = [
    ("randn_f32_seed0_1048576", "torch.manual_seed(0); r = torch.randn(2**20)"),
    ("randn_f32_seed1_1000003", "torch.manual_seed(1); r = torch.randn(1000003)"),
    ("normal_f32_seed42_1000003_mean0.25_std2.5", "torch.manual_seed(42); r = torch.empty(1000003).normal_(0.25, 2.5)"),
    ("randn_f64_seed2_262147", "torch.manual_seed(2); r = torch.randn(262147, dtype=torch.float64)"),
    ("normal_f32_seed3_transposed_512x256", "torch.manual_seed(3); r = torch.empty(256, 512).t().normal_()"),
    ("normal_f64_seed4_transposed_256x256_mean-1_std3",
     "torch.manual_seed(4); r = torch.empty(256, 256, dtype=torch.float64).t().normal_(-1.0, 3.0)"),
    ("uniform_f32_seed5_1048576_-3_5", "torch.manual_seed(5); r = torch.empty(2**20).uniform_(-3.0, 5.0)"),
    ("uniform_f64_seed6_262144_-3_5", "torch.manual_seed(6); r = torch.empty(2**18, dtype=torch.float64).uniform_(-3.0, 5.0)"),
    ("randint_seed7_262144_-1000_1000", "torch.manual_seed(7); r = torch.randint(-1000, 1000, (2**18,))"),
    ("randperm_seed8_100000", "torch.manual_seed(8); r = torch.randperm(100000)"),
    ("bernoulli_f32_seed9_262144_p0.3", "torch.manual_seed(9); r = torch.empty(2**18).bernoulli_(0.3)"),
]


def write_big():
    with open(os.path.join(OUT, "rng_crc32.txt"), "w") as f:
        f.write("# torch %s. CRC-32 (zlib.crc32) of the C-order little-endian bytes of `r` after each code;\n"
                "# the name says seed, dtype and size (the test repeats the call).\n" % torch.__version__)
        for name, code in BIG:
            env = {"torch": torch}
            exec(code, env)
            r = env["r"].contiguous()
            f.write("%s 0x%08x %s\n" % (name, zlib.crc32(r.numpy().tobytes()) & 0xFFFFFFFF, code))


def main():
    index = [write_vector(name, code, True) for name, code in SHARED]
    index += [write_vector(name, code, False) for name, code in NEW]
    with open(os.path.join(OUT, "index.txt"), "w") as f:
        for name, code, shapes in index:
            f.write("%s\t%s\t%s\n" % (name, shapes, code.replace("\n", " \\n ")))
    n = write_half()
    write_big()
    print("wrote %d vectors and the half vectors (%d float32 patterns) to %s" % (len(index), n, OUT))


if __name__ == "__main__":
    main()
