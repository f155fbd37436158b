#!/usr/bin/python3
"""Loads a sharded checkpoint written by `train_gpt --save DIR` into the
PyTorch twin of the model (tools/reference/models.py's GPT) and prints the
loss of the batch that the next training step draws, which
`train_gpt --resume DIR` prints as its first step's loss.

    /usr/bin/python3 tools/reference/load_sharded.py DIR [--data FILE]

The checkpoint (checkpoint/checkpoint.h, docs/checkpoint.md) is a folder:
index.json names the files ("files": [{"name", "rank"}]) and, for every
key, its dtype, global shape and the pieces of it that each rank's
safetensors file holds ("pieces": [{"file": index, "rank", "row", "rows",
"offset" from the file's start, "length", "hash"}]). This script
reads the index, assembles each full tensor from its pieces (the bytes
through torch.frombuffer: Debian 12's torch 1.13 has no safetensors
module), loads the model's keys into GPT(...) built from the sizes in the
checkpoint's metadata (strict: every parameter, nothing else), and
rebuilds the next batch from the data-order generator's state that the
checkpoint carries (mt19937, the 5056-byte torch.get_rng_state() layout):
the text is --data FILE, or the built-in grammar corpus, regenerated here
and checked against the length and hash the checkpoint records. Each
piece's bytes are checked against its "hash" (when the index has one).

Prints:
    checkpoint DIR: step K of N, saved on W ranks, P parameters (...)
    loss on the batch of step K+1: X.XXXX
    logits[0, 0, :4]: ...

Exit status 0, or 1 with a message on stderr.
Debian 12's python3-torch (1.13), run with /usr/bin/python3.
"""
import argparse
import json
import os
import struct
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT  # noqa: E402

DTYPES = {
    "F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool,
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
}


def fail(msg):
    print("load_sharded.py: " + msg, file=sys.stderr)
    sys.exit(1)


# ------------------------------------------------------------ the index

M64 = (1 << 64) - 1
P1, P2, P3 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9


def _mix(h, w):
    h ^= (w * P2) & M64
    h = ((h << 31) | (h >> 33)) & M64
    return (h * P1) & M64


def piece_hash(b):
    """The checksum of a piece's bytes that the index records as "hash"
    (docs/checkpoint.md; checkpoint/index.c's ts__ckpt_hash)."""
    n = len(b)
    nb = n // 32 * 32
    words = struct.unpack(f"<{nb // 8}Q", b[:nb])
    lanes = [(P1 + P2) & M64, P2, 0, (-P1) & M64]
    for i in range(0, len(words), 4):
        for k in range(4):
            lanes[k] = _mix(lanes[k], words[i + k])
    h = (n * P3) & M64
    for k in range(4):
        h = _mix(h, lanes[k])
    i = nb
    while i + 8 <= n:
        h = _mix(h, struct.unpack_from("<Q", b, i)[0])
        i += 8
    if i < n:
        h = _mix(h, int.from_bytes(b[i:] + bytes(8 - (n - i)), "little") ^ (n - i))
    h ^= h >> 33
    h = (h * P2) & M64
    h ^= h >> 29
    h = (h * P3) & M64
    return h ^ (h >> 32)



class Checkpoint:
    """The index of a sharded checkpoint and the bytes of its pieces."""

    def __init__(self, folder):
        self.folder = folder
        path = os.path.join(folder, "index.json")
        try:
            with open(path) as f:
                self.index = json.load(f)
        except OSError as e:
            fail(f"{path}: {e.strerror}")
        except ValueError as e:
            fail(f"{path}: not JSON: {e}")
        self.tensors = self.index.get("tensors")
        if not isinstance(self.tensors, dict):
            fail(f"{path}: no \"tensors\" object")
        self.metadata = self.index.get("metadata", {})
        self.files = [f["name"] for f in self.index.get("files", [])]
        self.world = int(self.index.get("world", 1))
        self.version = self.index.get("version")
        if self.version not in (1, 2):  # docs/checkpoint.md, "Index versions"
            fail(f"{path}: \"version\" is {self.version!r}; this reader knows 1 and 2")

    def meta(self, key):
        if key not in self.metadata:
            fail(f"{self.folder}: the metadata has no {key!r} (not a checkpoint of train_gpt --save)")
        return self.metadata[key]

    def _piece(self, p, dtype, tail):
        """The rows of one piece (its bytes at an offset from the start of
        the file it names), as a tensor (rows, *tail)."""
        if not 0 <= p["file"] < len(self.files):
            fail(f"{self.folder}: a piece names file {p['file']} of {len(self.files)}")
        path = os.path.join(self.folder, self.files[p["file"]])
        off = p["offset"]
        with open(path, "rb") as f:
            f.seek(off)
            raw = f.read(p["length"])
        if len(raw) != p["length"]:
            fail(f"{path}: {p['length']} bytes at {off} run past the end of the file")
        if "hash" not in p and self.version >= 2:
            fail(f"{path}: a piece of a version 2 index has no \"hash\"")
        if "hash" in p and f"{piece_hash(raw):016x}" != p["hash"]:
            fail(f"{path}: the {len(raw)} bytes at {off} have checksum {piece_hash(raw):016x}, but the index "
                 f"records {p['hash']}: the file is corrupted")
        if not raw:
            return torch.empty((0,) + tuple(tail), dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape((p["rows"],) + tuple(tail))

    def tensor(self, key):
        """The full tensor `key`, assembled from its pieces by their rows."""
        e = self.tensors.get(key)
        if e is None:
            fail(f"{self.folder}: no tensor {key!r} in the index")
        dtype, shape = DTYPES[e["dtype"]], tuple(e["shape"])
        if not shape:  # 0-d: one piece
            return self._piece(dict(e["pieces"][0], rows=1), dtype, ()).reshape(())
        full = torch.empty(shape, dtype=dtype)
        covered = torch.zeros(shape[0], dtype=torch.bool)
        for p in e["pieces"]:
            r0, rows = p["row"], p["rows"]
            full[r0:r0 + rows] = self._piece(p, dtype, shape[1:])
            covered[r0:r0 + rows] = True
        if not bool(covered.all()):
            fail(f"{self.folder}: the pieces of {key!r} do not cover its {shape[0]} rows")
        return full

    def rank_tensor(self, key, rank):
        """rank_extra.<name> as rank `rank` saved it."""
        e = self.tensors.get(key)
        if e is None:
            fail(f"{self.folder}: no tensor {key!r} in the index")
        dtype, shape = DTYPES[e["dtype"]], tuple(e["shape"])
        for p in e["pieces"]:
            if p.get("rank") == rank:
                return self._piece(dict(p, rows=shape[0] if shape else 1), dtype, shape[1:]).reshape(shape)
        fail(f"{self.folder}: {key!r} has no piece of rank {rank}")


# ------------------------------------------------------------ mt19937


class MT19937:
    """tensor/rng.c's generator from its get_state bytes: the raw 32-bit
    outputs of ts_generator_random."""

    def __init__(self, state_bytes):
        b = bytes(state_bytes)
        if len(b) != 5056:
            fail(f"a generator state of {len(b)} bytes (want 5056)")
        (self.left,) = struct.unpack_from("<i", b, 8)
        (self.next,) = struct.unpack_from("<Q", b, 16)
        self.mt = [struct.unpack_from("<Q", b, 24 + 8 * i)[0] & 0xFFFFFFFF for i in range(624)]

    @classmethod
    def seeded(cls, seed):
        g = cls.__new__(cls)
        g.mt = [seed & 0xFFFFFFFF]
        for j in range(1, 624):
            g.mt.append((1812433253 * (g.mt[j - 1] ^ (g.mt[j - 1] >> 30)) + j) & 0xFFFFFFFF)
        g.left, g.next = 1, 0
        return g

    def _twist(self):
        p = self.mt

        def tw(u, v):
            return (((u & 0x80000000) | (v & 0x7FFFFFFF)) >> 1) ^ (0x9908B0DF if v & 1 else 0)

        for k in range(624 - 397):
            p[k] = p[k + 397] ^ tw(p[k], p[k + 1])
        for k in range(624 - 397, 623):
            p[k] = p[k + 397 - 624] ^ tw(p[k], p[k + 1])
        p[623] = p[396] ^ tw(p[623], p[0])
        self.left, self.next = 624, 0

    def random(self):
        self.left -= 1
        if self.left == 0:
            self._twist()
        y = self.mt[self.next]
        self.next += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        return y & 0xFFFFFFFF


def grammar_corpus(length=200000, seed=7):
    """examples/common.h's ex_grammar_corpus (gcc evaluates the
    arguments of its snprintf right to left)."""
    det = ["the", "a", "every", "some"]
    adj = ["small", "red", "quiet", "old", "bright", ""]
    noun = ["cat", "dog", "bird", "fish", "child", "robot"]
    verb = ["sees", "likes", "chases", "finds", "follows"]
    end = [".", "!", " today.", " again."]
    g = MT19937.seeded(seed)

    def pick(a):
        return a[g.random() % len(a)]

    out, n = [], 0
    while n < length:
        a1 = pick(adj)
        a2 = pick(adj)
        e, n2, d2, v, n1, d1 = pick(end), pick(noun), pick(det), pick(verb), pick(noun), pick(det)
        line = f"{d1} {a1}{' ' if a1 else ''}{n1} {v} {d2} {a2}{' ' if a2 else ''}{n2}{e}\n"
        out.append(line)
        n += len(line)
    return "".join(out)[:length]


def text_id(text):
    h = 14695981039346656037
    for c in text:
        h = ((h ^ c) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{len(text)}:{h:016x}"


# ------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="a folder written by train_gpt --save DIR")
    ap.add_argument("--data", help="the text file it trained on (default: the built-in grammar corpus)")
    a = ap.parse_args()

    ck = Checkpoint(a.dir)
    cfg = dict(kv.split("=") for kv in ck.meta("train_gpt.config").split())
    flags = dict(kv.split("=", 1) for kv in ck.meta("train_gpt.flags").split())
    hexv = ck.meta("train_gpt.vocab")
    vocab = [int(hexv[i:i + 2], 16) for i in range(0, len(hexv), 2)]
    seq, layers, heads, dim = (int(cfg[k]) for k in ("seq", "layers", "heads", "dim"))

    model = GPT(len(vocab), seq, layers, heads, dim)
    want = model.state_dict()
    sd = {k: ck.tensor(k) for k in want}
    extra = sorted(k for k in ck.tensors if k not in want and not k.startswith(("optim.", "extra.", "rank_extra.")))
    if extra:
        fail(f"{a.dir}: model keys the twin does not have: {', '.join(extra)}")
    for k, t in sd.items():
        if t.shape != want[k].shape:
            fail(f"{a.dir}: {k} is {tuple(t.shape)}, the twin's is {tuple(want[k].shape)}")
    model.load_state_dict({k: t.to(want[k].dtype) for k, t in sd.items()}, strict=True)
    n_params = sum(t.numel() for t in model.parameters())

    step = int(ck.tensor("extra.step").reshape(-1)[0])
    world = ck.world
    print(f"checkpoint {a.dir}: step {step} of {flags['--steps']}, saved on {world} rank{'s' if world > 1 else ''}, "
          f"{n_params} parameters (GPT {layers} layers, {heads} heads, d_model {dim}, vocabulary {len(vocab)})")

    # the text, checked against the one it trained on
    if a.data:
        with open(a.data, "rb") as f:
            text = f.read()
    else:
        text = grammar_corpus().encode()
    if text_id(text) != ck.meta("train_gpt.text"):
        fail(f"the text ({text_id(text)}) is not the one the checkpoint trained on ({ck.meta('train_gpt.text')}); "
             "give its --data FILE")
    ids_of = {c: i for i, c in enumerate(vocab)}

    # the next step's batches: one data order drawn by every rank
    # (--global-batch G, rank r keeps sequences [r G/W, (r+1) G/W)) or
    # each rank's own (--batch B)
    G, B = int(flags["--global-batch"]), int(flags["--batch"])
    span = len(text) - seq - 1
    batches = []
    if G:
        g = MT19937(ck.tensor("extra.data_rng").numpy().tobytes())
        starts = [g.random() % span for _ in range(G)]
        batches = [starts[r * (G // world):(r + 1) * (G // world)] for r in range(world)]
    else:
        for r in range(world):
            g = MT19937(ck.rank_tensor("rank_extra.data_rng", r).numpy().tobytes())
            batches.append([g.random() % span for _ in range(B)])

    model.eval()
    losses = []
    with torch.no_grad():
        for starts in batches:
            x = torch.tensor([[ids_of[text[s + t]] for t in range(seq)] for s in starts], dtype=torch.int64)
            y = torch.tensor([[ids_of[text[s + t + 1]] for t in range(seq)] for s in starts], dtype=torch.int64)
            logits = model(x)
            losses.append(float(F.cross_entropy(logits.reshape(-1, len(vocab)), y.reshape(-1))))
            if len(losses) == 1:
                first_logits = logits[0, 0, :4].tolist()
    loss = sum(losses) / len(losses)  # train_gpt's all-reduce average over the ranks
    print(f"loss on the batch of step {step + 1}: {loss:.4f}")
    print("logits[0, 0, :4]: " + ", ".join(f"{v:.6f}" for v in first_logits))


if __name__ == "__main__":
    main()
