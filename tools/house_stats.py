#!/usr/bin/env python3
"""Figures on the library's code, for reviews and closing notes.

usage: house_stats.py [SOURCE_ROOT] [--unused] [--check]

Prints, over the .c and .h files of the library folders:
  - the ten longest functions (file:line, name, lines from the line of
    the name to the closing brace), found by a brace matcher that skips
    comments, strings, character constants and preprocessor lines;
  - the ten longest files (lines);
  - every direct libc allocation call (malloc, calloc, realloc, free,
    strdup, strndup, aligned_alloc, posix_memalign) outside base/alloc.c,
    the allocator hook itself (docs/design.md#ownership): each one
    bypasses the per-tag counters of ts_mem_live_bytes. A call whose line
    or the four lines above it say in a comment why it stays with libc
    (memory a library hands over, such as json_dumps' result, or state
    that outlives the allocator: the comment names "libc") is listed
    apart as kept;
with --unused, also the internal (ts__*) functions the library defines
that no code in the repository calls (library, tests, tools, bench,
examples, fuzz): dead code candidates. With --check the exit status is 1
when an allocation bypasses the hook or (with --unused) an internal
function is called nowhere, so a test can hold the rule.
"""
import os
import re
import sys
from collections import Counter

LAYERS = ['base', 'tensor', 'text', 'safetensors', 'comm', 'nn', 'optim', 'mesh',
          'dtensor', 'fully_shard', 'checkpoint']
OTHER_CODE = ['tests', 'tools', 'bench', 'examples', 'fuzz']
ALLOC_HOOK = 'base/alloc.c'
LIBC_ALLOC = ['malloc', 'calloc', 'realloc', 'free', 'strdup', 'strndup',
              'aligned_alloc', 'posix_memalign']
ALLOC_RE = re.compile(r'(?<![\w.>])(%s)\s*\(' % '|'.join(LIBC_ALLOC))
KEYWORDS = {'if', 'for', 'while', 'switch', 'return', 'sizeof', 'do', 'else'}


def strip(text, keep_preprocessor=False):
    """The text with comments, strings, character constants and
    preprocessor lines blanked (newlines kept, so line numbers hold)."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if keep_preprocessor:
            pass
        elif line_start and c == '#' or (line_start and c in ' \t' and
                                       text[i:].lstrip(' \t').startswith('#')):
            # a preprocessor line, with its continuations
            while i < n:
                if text[i] == '\\' and i + 1 < n and text[i + 1] == '\n':
                    out.append(' \n')
                    i += 2
                    continue
                if text[i] == '\n':
                    break
                out.append(' ')
                i += 1
            continue
        if c == '/' and text.startswith('/*', i):
            j = text.find('*/', i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r'[^\n]', ' ', text[i:j]))
            i = j
            continue
        if c == '/' and text.startswith('//', i):
            j = text.find('\n', i)
            j = n if j < 0 else j
            out.append(' ' * (j - i))
            i = j
            continue
        if c in '"\'':
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == '\\' else 1
            j += 1
            out.append(c + re.sub(r'[^\n]', ' ', text[i + 1:j - 1]) + c)
            i = j
            line_start = False
            continue
        out.append(c)
        if c == '\n':
            line_start = True
        elif c not in ' \t':
            line_start = False
        i += 1
    return ''.join(out)


def functions(code):
    """(name, first line, last line) of each function body in stripped code."""
    found = []
    depth = 0
    stmt_start = 0
    i, n = 0, len(code)
    while i < n:
        c = code[i]
        if c == '{':
            if depth == 0:
                head = code[stmt_start:i].rstrip()
                if head.endswith(')') and '=' not in head.split('(')[0]:
                    # the identifier before the '(' that the final ')' closes
                    k, d = len(head) - 1, 0
                    while k >= 0:
                        if head[k] == ')':
                            d += 1
                        elif head[k] == '(':
                            d -= 1
                            if d == 0:
                                break
                        k -= 1
                    m = re.search(r'(\w+)\s*$', head[:k])
                    if m and m.group(1) not in KEYWORDS:
                        pos = stmt_start + m.start(1)
                        # matching close brace
                        j, d = i, 0
                        while j < n:
                            if code[j] == '{':
                                d += 1
                            elif code[j] == '}':
                                d -= 1
                                if d == 0:
                                    break
                            j += 1
                        found.append((m.group(1), code.count('\n', 0, pos) + 1,
                                      code.count('\n', 0, j) + 1))
                        i = j + 1
                        stmt_start = i
                        continue
            depth += 1
        elif c == '}':
            depth -= 1
            if depth == 0:
                stmt_start = i + 1
        elif c == ';' and depth == 0:
            stmt_start = i + 1
        i += 1
    return found


def sources(root, folders, exts=('.c', '.h')):
    for folder in folders:
        d = os.path.join(root, folder)
        if not os.path.isdir(d):
            continue
        for dirpath, dirs, names in os.walk(d):
            dirs[:] = sorted(x for x in dirs if not x.startswith('build'))
            for name in sorted(names):
                if name.endswith(exts):
                    yield os.path.relpath(os.path.join(dirpath, name), root)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith('--')]
    root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
    want_unused = '--unused' in sys.argv
    check = '--check' in sys.argv
    unused = []
    funcs, file_lines, allocs = [], [], []
    stripped = {}
    for path in sources(root, LAYERS):
        text = open(os.path.join(root, path), encoding='utf-8', errors='replace').read()
        code = strip(text)
        stripped[path] = code
        file_lines.append((text.count('\n'), path))
        for name, first, last in functions(code):
            funcs.append((last - first + 1, path, first, name))
        if path != ALLOC_HOOK:
            for m in ALLOC_RE.finditer(code):
                line = code.count('\n', 0, m.start()) + 1
                src_lines = text.split('\n')
                near = '\n'.join(src_lines[max(0, line - 5):line])
                kept = re.search(r'(/\*|//)[^\n]*libc', near) is not None or \
                    re.search(r'libc[^\n]*\*/', near) is not None
                allocs.append((path, line, m.group(1), src_lines[line - 1].strip(), kept))

    print('ten longest library functions (lines, file:line, name):')
    for lines, path, first, name in sorted(funcs, key=lambda f: (-f[0], f[1], f[2]))[:10]:
        print('  %5d  %s:%d  %s' % (lines, path, first, name))
    print('ten longest library files (lines):')
    for lines, path in sorted(file_lines, key=lambda f: (-f[0], f[1]))[:10]:
        print('  %5d  %s' % (lines, path))
    bypass = [a for a in allocs if not a[4]]
    kept = [a for a in allocs if a[4]]
    print('direct libc allocation calls outside %s: %d (and %d kept with libc, said why)'
          % (ALLOC_HOOK, len(bypass), len(kept)))
    per_file = Counter(a[0] for a in bypass)
    for path, count in sorted(per_file.items(), key=lambda x: (-x[1], x[0])):
        print('  %3d  %s' % (count, path))
    for path, line, fn, src, _ in bypass:
        print('    %s:%d: %s: %s' % (path, line, fn, src[:100]))
    print('kept with libc (a comment says why):')
    for path, line, fn, src, _ in kept:
        print('    %s:%d: %s: %s' % (path, line, fn, src[:100]))

    if want_unused:
        # macros count as uses here (TS_ASSERT calls ts__assert_fail)
        with_macros = {}
        for path in list(stripped) + list(sources(root, OTHER_CODE)):
            with_macros[path] = strip(open(os.path.join(root, path), encoding='utf-8',
                                           errors='replace').read(), keep_preprocessor=True)
        words = Counter()
        header_words = Counter()
        for path, code in with_macros.items():
            for w in re.findall(r'\bts__\w+', code):
                words[w] += 1
                if path.endswith('.h'):
                    header_words[w] += 1
        defined = sorted({(f[3], f[1], f[2]) for f in funcs if f[3].startswith('ts__')})
        print('internal functions defined but called nowhere (definition + prototypes only):')
        for name, path, line in defined:
            # the definition and one prototype in a header are not uses
            protos = header_words[name] - (1 if path.endswith('.h') else 0)
            uses = words[name] - 1 - min(protos, 1)
            if uses <= 0:
                print('  %s:%d  %s' % (path, line, name))
                unused.append(name)
    return 1 if check and (bypass or unused) else 0


if __name__ == '__main__':
    sys.exit(main())
