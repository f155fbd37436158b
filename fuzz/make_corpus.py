#!/usr/bin/python3
"""Writes the seed corpus of fuzz_safetensors into fuzz/corpus/safetensors/.

Standard library only (Debian's python3); the files follow the safetensors
format: little-endian u64 header length, JSON header padded with spaces to
a multiple of 8, then the data. A few seeds are deliberately malformed so
that the fuzzer starts next to each error path. Run from anywhere:
    python3 fuzz/make_corpus.py
"""
import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "safetensors")

SIZES = {"F32": 4, "F64": 8, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "BOOL": 1}


def pack(header, data, pad=True):
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def tensors(entries, metadata=None):
    """entries: (name, dtype, shape, raw bytes), laid out in order."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in entries:
        n = SIZES[dtype]
        for d in shape:
            n *= d
        assert len(raw) == n, name
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
        data += raw
    return pack(header, data)


def seeds():
    f32 = struct.pack("<4f", 1.0, -2.0, 0.5, float("inf"))
    yield "empty", pack({}, b"")
    yield "metadata_only", pack({"__metadata__": {"format": "pt"}}, b"")
    yield "spec_example", tensors(
        [("w", "F32", [2], f32[:8]), ("s", "BOOL", [], b"\x01"), ("e", "I64", [0], b"")], {"format": "pt"})
    yield "every_dtype", tensors([
        ("f32", "F32", [2, 2], f32),
        ("f64", "F64", [1], struct.pack("<d", -0.0)),
        ("bf16", "BF16", [2], b"\x80\x3f\xc0\x7f"),
        ("f16", "F16", [2], b"\x00\x3c\x00\x7c"),
        ("i64", "I64", [1], struct.pack("<q", -7)),
        ("i32", "I32", [1, 1], struct.pack("<i", 9)),
        ("bool", "BOOL", [3], b"\x00\x01\x01"),
    ])
    yield "scalars_and_empty", tensors([
        ("s", "F64", [], struct.pack("<d", 3.5)),
        ("e0", "F32", [0], b""),
        ("e1", "BF16", [2, 0, 3], b""),
        ("s2", "I32", [], struct.pack("<i", -1)),
    ])
    # "__metadata__": null is accepted (the Rust reader's Option)
    yield "eight_dims_null_metadata", pack({
        "__metadata__": None,
        "t": {"dtype": "BOOL", "shape": [1, 1, 1, 1, 1, 1, 2, 1], "data_offsets": [0, 2]},
    }, b"\x01\x00")
    # the Rust writer sorts by dtype alignment, so header order differs
    # from offset order; extra fields are ignored
    yield "offset_order", pack({
        "__metadata__": {"a": "b"},
        "small": {"dtype": "F16", "shape": [1], "data_offsets": [8, 10]},
        "big": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8], "extra": 1},
    }, struct.pack("<q", 5) + b"\x00\x3c")
    # malformed, one of each kind
    yield "bad_overlap", pack({
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }, bytes(12))
    yield "bad_gap", pack({
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
    }, bytes(12))
    yield "bad_dtype", pack({"a": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}, bytes(4))
    yield "bad_shape", pack({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
    yield "bad_truncated", tensors([("w", "F64", [2], bytes(16))])[:-5]
    yield "bad_length", struct.pack("<Q", 1 << 40) + b"{}      "
    yield "bad_json", struct.pack("<Q", 8) + b'{"a":[1,'
    yield "bad_header_past_end", struct.pack("<Q", 100) + b"{}      "
    yield "bad_start", pack([], b"")
    yield "bad_metadata_value", pack({"__metadata__": {"step": 12}}, b"")
    yield "bad_entry_not_object", pack({"a": [0, 4]}, bytes(4))
    yield "bad_nine_dims", pack({"a": {"dtype": "BOOL", "shape": [1] * 9, "data_offsets": [0, 1]}}, b"\x01")
    yield "bad_empty_name", pack({"": {"dtype": "I32", "shape": [], "data_offsets": [0, 4]}}, bytes(4))
    yield "bad_shape_overflow", pack({"a": {"dtype": "F64", "shape": [1 << 62, 8], "data_offsets": [0, 0]}}, b"")
    # the fuzzer's first finding: within 64 bits but over ts_tensor_empty's
    # INT64_MAX / 16 limit, which once gave TS_ERR_INVALID_ARGUMENT
    yield "bad_span_limit", pack({"a": {"dtype": "F64", "shape": [92233720368, 7387904, 0],
                                        "data_offsets": [0, 0]}}, b"")
    yield "bad_offsets", pack({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, -4]}}, bytes(4))
    yield "bad_trailing_bytes", tensors([("w", "I32", [1], bytes(4))]) + b"\x00\x00"
    yield "bad_duplicate", struct.pack("<Q", 16) + b'{"a":{},"a":{}} '


def main():
    os.makedirs(OUT, exist_ok=True)
    total = 0
    for name, blob in seeds():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(blob)
        total += len(blob)
    print(f"wrote {len(list(seeds()))} seeds, {total} bytes, to {OUT}")


if __name__ == "__main__":
    main()
