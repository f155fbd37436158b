#!/usr/bin/env python3
"""The call graph between the files of fully_shard/, from their objects.

For each fully_shard object file (build/libtensorshard*.p/fully_shard_*.o)
`nm` gives the symbols it defines and those it leaves undefined; file A
calls file B when A leaves undefined a symbol B defines. Prints each
file's callees (with the symbols) and every cycle between files (strongly
connected components of more than one file); exits 1 when there is one.

With --floors, also checks the floors of fully_shard/internal.h: a file
may call files on lower floors and, on its own floor, the files listed
before it; any other edge is printed as "upward" (and exits 1).

Usage: tools/fsdp_floors.py [--floors] [BUILD_DIR]   (default: build)
"""
import glob
import os
import subprocess
import sys


def symbols(obj):
    out = subprocess.run(["nm", obj], check=True, capture_output=True, text=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRVWGS" and parts[1].isupper():
            defined.add(parts[2])
    return defined, undefined


def sccs(nodes, edges):
    index, low, stack, on, comps, i = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = i[0]
        i[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return comps


# The floors of fully_shard/internal.h ("Floors"), each in its order.
FLOORS = [
    ["common", "repr", "mp_policy"],
    ["param"],
    ["offload", "persist"],
    ["param_group"],
    ["state"],
    ["materialize", "accum", "state_dict", "fully_shard"],
    ["explicit", "policy", "summary", "memory", "grad_scaler"],
]


def rank(f):
    for i, floor in enumerate(FLOORS):
        if f in floor:
            return (i + 1, floor.index(f))
    return None


def main():
    args = [a for a in sys.argv[1:] if a != "--floors"]
    check_floors = "--floors" in sys.argv[1:]
    build = args[0] if args else "build"
    objs = sorted(glob.glob(os.path.join(build, "libtensorshard*.p", "fully_shard_*.o")))
    if not objs:
        sys.exit("no fully_shard objects under %s" % build)
    files, owner = {}, {}
    for o in objs:
        name = os.path.basename(o)[len("fully_shard_"):]
        name = name[: -len(".c.o")] if name.endswith(".c.o") else name[: -len(".o")]
        if name in files:
            continue  # the static and shared library's copies of one file
        files[name] = symbols(o)
        for s in files[name][0]:
            owner[s] = name
    edges = {f: {} for f in files}
    for f, (_, und) in files.items():
        for s in und:
            g = owner.get(s)
            if g and g != f:
                edges[f].setdefault(g, []).append(s)
    for f in sorted(files):
        callees = ", ".join("%s (%d)" % (g, len(edges[f][g])) for g in sorted(edges[f]))
        print("%-14s -> %s" % (f, callees or "-"))
    cycles = [c for c in sccs(files, edges) if len(c) > 1]
    for c in cycles:
        print("cycle: " + " <-> ".join(c))
        for f in c:
            for g in sorted(edges[f]):
                if g in c:
                    print("  %s -> %s: %s" % (f, g, " ".join(sorted(edges[f][g]))))
    if not cycles:
        print("no cycle between the files of fully_shard/")
    bad = 0
    if check_floors:
        for f in sorted(files):
            for g in sorted(edges[f]):
                rf, rg = rank(f), rank(g)
                if rf is None or rg is None or rg >= rf:
                    bad += 1
                    print("upward: %s (floor %s) -> %s (floor %s): %s" % (
                        f, rf and rf[0], g, rg and rg[0], " ".join(sorted(edges[f][g]))))
        if not bad:
            print("every call goes down the floors (or to a floor-mate listed before)")
    return 1 if cycles or bad else 0


if __name__ == "__main__":
    sys.exit(main())
