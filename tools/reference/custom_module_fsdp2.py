"""examples/custom_module.c written with PyTorch FSDP2, for comparing the code
a user writes (docs/custom-modules.md gives the line counts of both).

Not run by the tests: FSDP2's fully_shard needs torch >= 2.4
(torch.distributed._composable.fsdp; torch.distributed.fsdp from 2.6), and
this machine has Debian 12's torch 1.13. It follows the C program step for
step: the same block, model, sharding (each block, then the root), AdamW,
batch, printed losses and buffer count; the C program also prints
ts_fsdp_summary, which PyTorch has no counterpart of.

    torchrun --nproc-per-node 2 tools/reference/custom_module_fsdp2.py [--skip-gain-rank 1]
"""
import argparse
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


# ------------------------------------------------------------ the block type

class ResidualBlock(nn.Module):
    """y = x + gain * tanh(fc(x)); counts its training forwards."""

    def __init__(self, dim, skip_gain=False):
        super().__init__()
        self.dim, self.skip_gain = dim, skip_gain
        self.fc = nn.Linear(dim, dim)
        self.gain = nn.Parameter(torch.empty(dim))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.int64))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.constant_(self.gain, 0.5)
        self.num_batches_tracked.zero_()

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if not self.skip_gain:
            h = h * self.gain
        if self.training:
            self.num_batches_tracked += 1
        return x + h

    def extra_repr(self):
        return f"dim={self.dim}"


# ------------------------------------------------------------ the program

IN, HID, BATCH, STEPS = 4, 16, 16, 20


def xval(r, j):
    return math.sin(0.37 * (r * IN + j) + 0.1)


def make_batch(row0, rows):
    rs = range(row0, row0 + rows)
    x = torch.tensor([[xval(r, j) for j in range(IN)] for r in rs])
    y = torch.tensor([[math.sin(2 * xval(r, 0)) + 0.5 * xval(r, 1) * xval(r, 2) - 0.3 * xval(r, 3) ** 2]
                      for r in rs])
    return x, y


def main():
    p = argparse.ArgumentParser(description="A user-defined module type, sharded bottom-up and trained with AdamW.")
    p.add_argument("--skip-gain-rank", type=int, default=-1,
                   help="this rank's blocks do not use gain (-1: none)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert BATCH % world == 0, f"the batch of {BATCH} rows does not split over {world} ranks"
    torch.manual_seed(0)
    skip = rank == args.skip_gain_rank
    model = nn.Sequential(nn.Linear(IN, HID), ResidualBlock(HID, skip), ResidualBlock(HID, skip),
                          nn.Linear(HID, 1))
    for m in model.modules():
        if isinstance(m, ResidualBlock):
            fully_shard(m)
    fully_shard(model)
    if rank == 0:
        print(model)
    print(f"rank {rank}: 1.gain holds {tuple(model[1].gain.to_local().shape)} of ({HID},)")

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = BATCH // world
    x, y = make_batch(rank * rows, rows)
    for step in range(STEPS):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        avg = loss.detach()
        dist.all_reduce(avg)  # gloo has no AVG
        if rank == 0:
            print(f"step {step:2d} loss {avg.item() / world:.8f}")

    print(f"rank {rank}: 2.num_batches_tracked = {model[2].num_batches_tracked.item()}")
    if args.skip_gain_rank >= 0:
        g = model[1].gain.to_local()
        print(f"rank {rank}: 1.gain rows trained {(g != 0.5).sum().item()} of {g.numel()}"
              + (" (this rank skips gain)" if skip else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
