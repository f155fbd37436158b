#!/usr/bin/python3
"""Writes the seed corpus of fuzz_store into fuzz/corpus/store/.

Standard library only (Debian's python3). Each seed is a script of records
for the fuzz target (fuzz/fuzz_store.c): a control byte c, then for
c % 4 in 0..2 the next c // 4 + 1 bytes arriving on connection c % 4, or
for c % 4 == 3 a clock step of (c // 4) * 7 ms. The bytes are store
protocol frames (comm/store_internal.h); the core's token is "tok". A few seeds are
deliberately malformed so that the fuzzer starts next to each drop path.
Run from anywhere:
    python3 fuzz/make_store_corpus.py
"""
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "store")

HELLO, SET, GET, CHECK, WAIT, ADD, CAS, DELETE = range(1, 9)


def frame(op, key=b"", val=b"", arg=0):
    body = struct.pack("<BI", op, len(key)) + key + struct.pack("<I", len(val)) + val + struct.pack("<Q", arg)
    return struct.pack("<I", len(body)) + body


def hello(token=b"tok", version=1):
    return frame(HELLO, b"", token, version)


def on(conn, data, chunk=64):
    """Records delivering `data` on connection `conn` in chunks."""
    out = b""
    for i in range(0, len(data), chunk):
        part = data[i:i + chunk]
        out += bytes([((len(part) - 1) << 2) | conn]) + part
    return out


def tick(ms):
    out = b""
    while ms > 0:
        step = min(ms // 7 or 1, 63)
        out += bytes([(step << 2) | 3])
        ms -= step * 7
    return out


def cas_value(expected, desired):
    return struct.pack("<I", len(expected)) + expected + desired


SEEDS = {
    # well-formed sessions
    "set_get": on(0, hello() + frame(SET, b"k", b"v\x00\x01") + frame(GET, b"k", arg=100)),
    "wake_waiter": on(0, hello() + frame(GET, b"addr/1", arg=5000))
    + on(1, hello() + frame(SET, b"addr/1", b"\x00ucx\x00")),
    "wait_timeout": on(0, hello() + frame(WAIT, b"never", arg=30)) + tick(40) + on(0, frame(CHECK, b"never")),
    "counter": on(0, hello() + frame(ADD, b"c", arg=1) + frame(ADD, b"c", arg=2**64 - 3) + frame(GET, b"c", arg=1)
                  + frame(SET, b"s", b"abc") + frame(ADD, b"s", arg=1)),
    "compare_set": on(0, hello() + frame(CAS, b"x", cas_value(b"", b"first")) + frame(CAS, b"x", cas_value(b"no", b"z"))
                      + frame(CAS, b"x", cas_value(b"first", b"second")) + frame(CAS, b"y", cas_value(b"a", b"b"))),
    "delete": on(0, hello() + frame(SET, b"d", b"1") + frame(DELETE, b"d") + frame(DELETE, b"d") + frame(CHECK, b"d")),
    "barrier": on(0, hello() + frame(ADD, b"barrier/b/count", arg=1) + frame(WAIT, b"barrier/b/0/done", arg=1000))
    + on(1, hello() + frame(ADD, b"barrier/b/count", arg=1) + frame(SET, b"barrier/b/0/done")),
    "three_waiters": on(0, hello() + frame(GET, b"k", arg=70)) + on(1, hello() + frame(WAIT, b"k", arg=140))
    + on(2, hello() + frame(GET, b"j", arg=7)) + tick(80) + on(2, frame(SET, b"k", b"v")),
    "byte_at_a_time": on(0, hello() + frame(SET, b"key", b"value"), chunk=1),
    "many_keys_big_value": on(0, hello() + b"".join(frame(SET, b"key/%d" % i, b"v") for i in range(20))
                              + frame(SET, b"big", bytes(range(256)) * 6) + frame(GET, b"big", arg=1)),
    "pipelined": on(0, hello() + frame(SET, b"p", b"1") + frame(GET, b"p", arg=5) + frame(CHECK, b"q")
                    + frame(DELETE, b"p")),
    # drops
    "wrong_token": on(0, hello(b"bad") + frame(SET, b"k", b"v")) + on(1, hello() + frame(CHECK, b"k")),
    "no_hello": on(0, frame(SET, b"k", b"v")),
    "garbage": on(0, bytes(range(7, 200, 3))),
    "oversized": on(0, hello() + struct.pack("<IBI", 0xFFFFFFF0, SET, 1)),
    "huge_key": on(0, hello() + struct.pack("<IBI", 100, GET, 0xFFFFFFFF)),
    "length_mismatch": on(0, hello() + frame(SET, b"key", b"value")[:12] + struct.pack("<I", 4) + b"value" + bytes(8)),
    "pending_then_more": on(0, hello() + frame(GET, b"w", arg=1000) + frame(SET, b"w", b"x")),
    "bad_version": on(0, hello(version=2)),
}


def main():
    os.makedirs(OUT, exist_ok=True)
    for name in os.listdir(OUT):
        os.remove(os.path.join(OUT, name))
    for name, data in SEEDS.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(SEEDS)} seeds ({sum(map(len, SEEDS.values()))} bytes) to {OUT}")


if __name__ == "__main__":
    main()
