#!/usr/bin/env python3
"""The layering rules of docs/design.md ("Layers"), checked on the sources.

usage: check_layering.py SOURCE_ROOT [STATIC_LIBRARY] [--pending FILE]

Reads every .c and .h of the library folders, resolves each
`#include "x/y.h"` (or `"y.h"`, beside the including file) and fails on:

  (a) an include that runs up the layer order, or sideways between two
      layers of one floor (comm, nn and optim know nothing of each other);
  (b) an include of another layer's private header: one that meson.build
      does not install. tensor/kernels.h is the one allowed private door
      (docs/design.md, "The one private door");
  (c) a cycle of calls between the files of fully_shard/, read from the
      static library's members with nm (undefined symbols of one object
      defined by another), or a call up its floors (FSDP_FLOORS, the table
      of fully_shard/internal.h: a file calls files on lower floors and,
      on its own floor, those listed before it); skipped, and said so,
      without a library.

It prints the include graph of the layers (layer -> layers it includes,
with counts), the file graph of fully_shard/, and every violation with its
file, line, included header and reason. Exit status 1 on any violation.

--pending FILE names private includes not yet replaced by a public door
(issue 22 §3 lands in slices), one `file: header` per line ('#' starts a
comment). They are printed as pending, not failed. The list can only
shrink: an entry that no longer matches an include fails the check (the
wall is mended: delete the line), and only private-header includes may be
pending, never an upward or sideways one or a call cycle.
"""
import os
import re
import subprocess
import sys
from collections import defaultdict

# The floors, lowest first (docs/design.md#layers). Folders on one floor
# are siblings: none may include another.
FLOORS = [
    ['base'],
    ['tensor'],
    ['text', 'safetensors'],
    ['comm', 'nn', 'optim'],
    ['mesh'],
    ['dtensor'],
    ['fully_shard'],
    ['checkpoint'],
]
FLOOR = {layer: i for i, floor in enumerate(FLOORS) for layer in floor}
# The one private header another layer may include: the per-dtype buffer
# kernels, which optim's fused steps and comm's reductions run on local
# buffers (docs/design.md#the-one-private-door). And base's internal
# header, once base.h's ts__* names move there (issue 22 §3): the
# allocator hook and the assert every layer uses, the library's own
# runtime as libuv's src/uv-common.h is (docs/design.md, same section).
ALLOWED_PRIVATE = {'tensor/kernels.h', 'base/internal.h'}

# The floors of fully_shard/ (fully_shard/internal.h, "Floors"), lowest
# first, each in its order: PyTorch's _fsdp_common, _fsdp_param, offload
# and persistence, _fsdp_param_group, _fsdp_state, the API, the extras.
FSDP_FLOORS = [
    ['common', 'repr', 'mp_policy'],
    ['param'],
    ['offload', 'persist'],
    ['param_group'],
    ['state'],
    ['materialize', 'accum', 'state_dict', 'fully_shard'],
    ['explicit', 'policy', 'summary', 'memory', 'grad_scaler'],
]
FSDP_RANK = {f + '.c': (i + 1, floor.index(f)) for i, floor in enumerate(FSDP_FLOORS) for f in floor}

INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def installed_headers(root):
    """Headers meson.build installs: the public doors of the layers."""
    text = open(os.path.join(root, 'meson.build'), encoding='utf-8').read()
    out = set()
    for call in re.findall(r'install_headers\(([^)]*)\)', text):
        for name in re.findall(r"'([^']+\.h)'", call):
            out.add(name)
    return out


def layer_files(root):
    for layer in sorted(FLOOR):
        d = os.path.join(root, layer)
        if not os.path.isdir(d):
            continue
        for dirpath, _, names in os.walk(d):
            for n in sorted(names):
                if n.endswith(('.c', '.h')):
                    yield layer, os.path.relpath(os.path.join(dirpath, n), root)


def resolve(root, src, inc):
    """The repository path an include names, or None if outside the tree."""
    beside = os.path.normpath(os.path.join(os.path.dirname(src), inc))
    if os.path.exists(os.path.join(root, beside)):
        return beside
    if os.path.exists(os.path.join(root, inc)):
        return os.path.normpath(inc)
    return None


def check_includes(root, violations, private_includes):
    public = installed_headers(root)
    graph = defaultdict(lambda: defaultdict(int))
    for layer, src in layer_files(root):
        with open(os.path.join(root, src), encoding='utf-8', errors='replace') as f:
            lines = f.readlines()
        for lineno, line in enumerate(lines, 1):
            m = INCLUDE_RE.match(line)
            if not m:
                continue
            target = resolve(root, src, m.group(1))
            if target is None:
                continue
            to = target.split('/')[0] if '/' in target else '<root>'
            if to == layer:
                continue
            graph[layer][to] += 1
            where = '%s:%d: #include "%s"' % (src, lineno, m.group(1))
            if to not in FLOOR:
                violations.append('%s: %s is not a library layer' % (where, target))
                continue
            if FLOOR[to] > FLOOR[layer]:
                violations.append('%s: upward (%s is above %s)' % (where, to, layer))
            elif FLOOR[to] == FLOOR[layer]:
                violations.append('%s: sideways (%s and %s are siblings on one floor)'
                                  % (where, to, layer))
            if target not in public and target not in ALLOWED_PRIVATE:
                private_includes.append((src, m.group(1), len(violations)))
                violations.append('%s: private header of %s (not installed; only %s may cross)'
                                  % (where, to, ', '.join(sorted(ALLOWED_PRIVATE))))
    print('include graph of the layers (layer -> layers it includes: #includes):')
    for layer in sorted(graph, key=lambda l: (FLOOR.get(l, 99), l)):
        edges = graph[layer]
        print('  %-12s -> %s' % (layer, ', '.join(
            '%s %d' % (t, edges[t]) for t in sorted(edges, key=lambda t: (FLOOR.get(t, 99), t)))))
    for layer in sorted(FLOOR, key=lambda l: (FLOOR[l], l)):
        if layer not in graph and os.path.isdir(os.path.join(root, layer)):
            print('  %-12s -> (none)' % layer)


def sccs(nodes, edges):
    """Tarjan's strongly connected components."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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
            out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def check_fully_shard_calls(root, lib, violations):
    if not lib or not os.path.exists(lib):
        print('fully_shard file graph: skipped (no static library given)')
        return
    prefix = 'fully_shard_'
    sources = sorted(n for n in os.listdir(os.path.join(root, 'fully_shard')) if n.endswith('.c'))
    member_of = {prefix + n + '.o': n for n in sources}
    out = subprocess.run(['nm', '-A', lib], check=True, capture_output=True, text=True).stdout
    defined, undefined = defaultdict(set), defaultdict(set)
    for line in out.splitlines():
        # libtensorshard.a:fully_shard_state.c.o:0000000000000000 T name
        parts = line.split(':')
        if len(parts) < 3 or parts[1] not in member_of:
            continue
        fields = parts[2].split()
        if len(fields) < 2:
            continue
        kind, name = fields[-2], fields[-1]
        f = member_of[parts[1]]
        if kind == 'U':
            undefined[f].add(name)
        elif kind.isupper():
            defined[f].add(name)
    owner = {}
    for f, names in defined.items():
        for n in names:
            owner[n] = f
    edges = defaultdict(dict)
    for f, names in undefined.items():
        for n in names:
            g = owner.get(n)
            if g and g != f:
                edges[f].setdefault(g, []).append(n)
    print('fully_shard file graph (file -> files whose functions it calls: symbols):')
    for f in sources:
        e = edges.get(f, {})
        print('  %-16s -> %s' % (f, ', '.join('%s %d' % (g, len(e[g])) for g in sorted(e)) or '(none)'))
    for comp in sccs(sources, {f: set(e) for f, e in edges.items()}):
        if len(comp) < 2:
            continue
        detail = []
        for f in comp:
            for g in sorted(edges.get(f, {})):
                if g in comp:
                    names = sorted(edges[f][g])
                    detail.append('\n      %s -> %s: %s%s' % (f, g, ', '.join(names[:3]),
                                                            ', ...' if len(names) > 3 else ''))
        violations.append('fully_shard/: call cycle between %s (calls inside it:%s)'
                          % (', '.join(comp), ''.join(detail)))
    for f in sources:
        for g in sorted(edges.get(f, {})):
            rf, rg = FSDP_RANK.get(f), FSDP_RANK.get(g)
            if rf is None or rg is None or rg >= rf:
                names = sorted(edges[f][g])
                violations.append('fully_shard/%s (floor %s) calls %s (floor %s) above it or unplaced: %s%s'
                                  % (f, rf and rf[0], g, rg and rg[0], ', '.join(names[:3]),
                                     ', ...' if len(names) > 3 else ''))


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    args = sys.argv[1:]
    pending_file = None
    if '--pending' in args:
        i = args.index('--pending')
        if i + 1 >= len(args):
            sys.exit('--pending needs a file\n' + __doc__)
        pending_file = args[i + 1]
        del args[i:i + 2]
    root = args[0]
    lib = args[1] if len(args) > 1 else None
    violations, private_includes = [], []
    check_includes(root, violations, private_includes)
    check_fully_shard_calls(root, lib, violations)
    if pending_file:
        pending = set()
        with open(pending_file, encoding='utf-8') as f:
            for line in f:
                line = line.split('#', 1)[0].strip()
                if line:
                    pending.add(line)
        seen, waived = set(), set()
        for src, inc, k in private_includes:
            key = '%s: %s' % (src, inc)
            if key in pending:
                seen.add(key)
                waived.add(k)
        print('\n%d pending private include(s) (%s; the list may only shrink):'
              % (len(waived), os.path.basename(pending_file)))
        for k in sorted(waived):
            print('  ' + violations[k])
        violations = [v for k, v in enumerate(violations) if k not in waived]
        for key in sorted(pending - seen):
            violations.append('%s: listed as pending in %s but no longer included: delete the line'
                              % (key, os.path.basename(pending_file)))
    if violations:
        print('\n%d violation(s):' % len(violations))
        for v in violations:
            print('  ' + v)
        return 1
    print('\nno violation: no upward, sideways or private cross-layer include, '
          'no call cycle between the files of fully_shard/')
    return 0


if __name__ == '__main__':
    sys.exit(main())
