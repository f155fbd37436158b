#!/usr/bin/env python3
"""Write the optimizer and gradient-clipping test vectors of
tests/fixtures/optim/ from torch 1.13 (CPU).

usage: /usr/bin/python3 tools/reference/make_optim_vectors.py [OUTDIR]
       (Debian 12's system python3 with the python3-torch package;
        OUTDIR defaults to tests/fixtures/optim beside this script's repo)

Every file is raw little-endian values, C order, concatenated, in the dtype
its name says (f32 or f64); index.txt lists each file, its layout and the
exact torch calls. See tests/fixtures/optim/PROVENANCE.md.

Trajectories: three parameters of shapes (3, 4), (5,) and (67,) (67 so that
torch's AVX2 kernels run both their 8-wide vector loop and their scalar
tail) start from fixed values; each of 10 steps sets .grad to a fixed
tensor (torch.manual_seed + randn, scaled per step so that amsgrad's maximum
matters) and calls optimizer.step(). inputs_<dt>.bin holds the initial
values then the gradients of every step; <case>.bin holds the parameters
after every step. In the *_skip cases parameter 1 has grad None at steps 2
and 6 (0-based), so it is skipped there, as torch does.

Clipping: clip_<case>.bin holds max_norm, the total norm returned by
torch.nn.utils.clip_grad_norm_ and the gradients before and after;
norms_<dt>.bin holds tensors of many sizes and their torch.norm(x, 2).
"""
import os
import struct
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "tests", "fixtures", "optim")
os.makedirs(OUT, exist_ok=True)

SHAPES = [(3, 4), (5,), (67,)]
STEPS = 10
SKIP_PARAM = 1
SKIP_STEPS = (2, 6)
DTYPES = {"f32": torch.float32, "f64": torch.float64}

index = []


def dump(name, tensors, dt):
    with open(os.path.join(OUT, name), "wb") as f:
        for t in tensors:
            f.write(t.detach().to(DTYPES[dt]).contiguous().numpy().tobytes())


def make_inputs(dt):
    """Initial parameters and per-step gradients (all exactly representable
    in f32, so the f64 set holds the same values)."""
    g = torch.Generator().manual_seed(1234)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = []
    for k in range(STEPS):
        scale = [0.5, 2.0, 0.1, 1.0, 3.0, 0.05, 1.5, 0.2, 1.0, 0.7][k]
        grads.append([torch.randn(s, generator=g) * scale for s in SHAPES])
    init = [t.to(DTYPES[dt]) for t in init]
    grads = [[t.to(DTYPES[dt]) for t in gs] for gs in grads]
    return init, grads


INPUT_CODE = ("g = torch.Generator().manual_seed(1234); init = [torch.randn(s, generator=g) for s in "
              "[(3, 4), (5,), (67,)]]; for k in range(10): grads[k] = [torch.randn(s, generator=g) * "
              "[0.5, 2.0, 0.1, 1.0, 3.0, 0.05, 1.5, 0.2, 1.0, 0.7][k] for s in shapes] (then .to(dtype))")

# name -> (dtype, optimizer constructor code, skip, lr change at step 5 or None)
CASES = [
    ("sgd_plain", "f32", "torch.optim.SGD(ps, lr=0.1, foreach=False)", False, None),
    ("sgd_momentum", "f32", "torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False)", False, None),
    ("sgd_dampening", "f32", "torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, foreach=False)", False,
     None),
    ("sgd_nesterov", "f32", "torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=False)", False,
     None),
    ("sgd_weight_decay", "f32",
     "torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)", False, None),
    ("sgd_maximize", "f32",
     "torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, maximize=True, foreach=False)", False, None),
    ("sgd_momentum_skip", "f32", "torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, foreach=False)", True,
     None),
    ("adam_default", "f32", "torch.optim.Adam(ps, foreach=False)", False, None),
    ("adam_lr", "f32", "torch.optim.Adam(ps, lr=0.05, betas=(0.8, 0.99), eps=1e-6, foreach=False)", False, None),
    ("adam_weight_decay", "f32", "torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, foreach=False)", False, None),
    ("adam_amsgrad", "f32", "torch.optim.Adam(ps, lr=0.05, amsgrad=True, foreach=False)", False, None),
    ("adam_maximize", "f32", "torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, maximize=True, foreach=False)",
     False, None),
    ("adam_skip", "f32", "torch.optim.Adam(ps, lr=0.05, amsgrad=True, foreach=False)", True, None),
    ("adamw_default", "f32", "torch.optim.AdamW(ps, foreach=False)", False, None),
    ("adamw_amsgrad", "f32", "torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, amsgrad=True, foreach=False)",
     False, None),
    ("adamw_lr_change", "f32", "torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05, foreach=False)", False, 0.003),
    ("adamw_maximize_skip", "f32", "torch.optim.AdamW(ps, lr=0.01, maximize=True, foreach=False)", True, None),
    ("sgd_nesterov_f64", "f64",
     "torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False)", False, None),
    ("adam_amsgrad_f64", "f64", "torch.optim.Adam(ps, lr=0.05, weight_decay=0.1, amsgrad=True, foreach=False)",
     False, None),
    ("adamw_default_f64", "f64", "torch.optim.AdamW(ps, foreach=False)", False, None),
]


def run_case(name, dt, ctor, skip, lr_change):
    init, grads = make_inputs(dt)
    ps = [t.clone().requires_grad_(True) for t in init]
    opt = eval(ctor)
    out = []
    for k in range(STEPS):
        if lr_change is not None and k == 5:
            for grp in opt.param_groups:
                grp["lr"] = lr_change
        for i, p in enumerate(ps):
            p.grad = None if (skip and i == SKIP_PARAM and k in SKIP_STEPS) else grads[k][i].clone()
        opt.step()
        out += [p.detach().clone() for p in ps]
    dump(name + ".bin", out, dt)
    code = f"ps = [init copies, requires_grad]; opt = {ctor}; for k in range(10): "
    if lr_change is not None:
        code += f"(at k == 5: opt.param_groups[0]['lr'] = {lr_change}); "
    code += "p.grad = grads[k][i].clone()"
    if skip:
        code += f" (None for p{SKIP_PARAM} at k in {SKIP_STEPS})"
    code += "; opt.step()"
    index.append((name + ".bin", f"{dt}: 10 steps x [p0 (3,4), p1 (5,), p2 (67,)] after each step", code))


# ------------------------------------------------------------------- clip

CLIP_CASES = [
    # name, dtype, shapes, scale, max_norm
    ("clip_scaled", "f32", [(3, 4), (5,), (1000,)], 1.0, 1.0),
    ("clip_unscaled", "f32", [(3, 4), (5,)], 0.1, 100.0),
    ("clip_single", "f32", [(7, 9)], 2.0, 0.5),
    ("clip_many", "f32", [(3,), (4, 4), (9,), (1,), (2, 3, 5), (17,), (8,), (11, 2), (6,), (13,)], 1.5, 2.0),
    ("clip_scaled_f64", "f64", [(3, 4), (5,), (300,)], 1.0, 1.0),
]


def run_clip(name, dt, shapes, scale, max_norm):
    g = torch.Generator().manual_seed(99)
    ps = []
    for s in shapes:
        p = torch.zeros(s, dtype=DTYPES[dt], requires_grad=True)
        p.grad = (torch.randn(s, generator=g) * scale).to(DTYPES[dt])
        ps.append(p)
    before = [p.grad.clone() for p in ps]
    total = torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type=2.0, error_if_nonfinite=True)
    assert total.dtype == DTYPES[dt]
    after = [p.grad.clone() for p in ps]
    dump(name + ".bin", [torch.tensor([max_norm]), total.reshape(1)] + before + after, dt)
    index.append((name + ".bin",
                  f"{dt}: [max_norm, total_norm, grads before (shapes {shapes}), grads after]",
                  f"g = torch.Generator().manual_seed(99); p.grad = (torch.randn(s, generator=g) * {scale})"
                  f".to({DTYPES[dt]}) for s in shapes; total = torch.nn.utils.clip_grad_norm_(ps, {max_norm}, "
                  "norm_type=2.0, error_if_nonfinite=True)"))


NORM_SIZES = list(range(1, 81)) + [127, 1001, 4099]


def run_norms(dt):
    """torch.norm(g, 2) of one tensor of each size in NORM_SIZES (values
    scaled by 10**k for k in -3..3), as clip_grad_norm_ computes it per
    gradient."""
    g = torch.Generator().manual_seed(7)
    grads, norms = [], []
    for n in NORM_SIZES:
        x = (torch.randn(n, generator=g) * 10.0 ** (n % 7 - 3)).to(DTYPES[dt])
        grads.append(x)
        norms.append(torch.norm(x, 2))
        p = torch.zeros(n, dtype=DTYPES[dt], requires_grad=True)
        p.grad = x.clone()
        assert torch.nn.utils.clip_grad_norm_([p], float("inf")).item() == norms[-1].item()
    dump(f"norms_{dt}.bin", grads + [torch.stack(norms)], dt)
    index.append((f"norms_{dt}.bin", f"{dt}: 83 tensors of sizes 1..80, 127, 1001, 4099, then their 83 norms",
                  "g = torch.Generator().manual_seed(7); for n in (1..80, 127, 1001, 4099): x = (torch.randn(n, generator=g) * "
                  f"10.0 ** (n % 7 - 3)).to({DTYPES[dt]}); norm = torch.norm(x, 2) (equal to "
                  "clip_grad_norm_([p], inf) with p.grad = x)"))


def main():
    torch.set_num_threads(1)  # f64 norms over 32768+ elements depend on it; ours are smaller anyway
    for dt in DTYPES:
        init, grads = make_inputs(dt)
        dump(f"inputs_{dt}.bin", init + [t for gs in grads for t in gs], dt)
        index.append((f"inputs_{dt}.bin", f"{dt}: p0 (3,4), p1 (5,), p2 (67,) initial, then 10 x their grads",
                      INPUT_CODE))
    for c in CASES:
        run_case(*c)
    for c in CLIP_CASES:
        run_clip(*c)
    for dt in DTYPES:
        run_norms(dt)
    with open(os.path.join(OUT, "index.txt"), "w") as f:
        f.write(f"# torch {torch.__version__}; written by tools/reference/make_optim_vectors.py\n")
        f.write("# file | layout (little-endian, C order, concatenated) | code\n")
        for name, layout, code in index:
            f.write(f"{name} | {layout} | {code}\n")


if __name__ == "__main__":
    main()
