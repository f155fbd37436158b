#!/usr/bin/env python3
"""Keeps the README and docs/environment.md true to the code.

Usage: check_readme.py SOURCE_ROOT HEADER...

1. Every code block of README.md preceded by a line
   `<!-- file: PATH -->` is the file PATH (relative to SOURCE_ROOT)
   exactly, so the README's quickstart and examples/quickstart.c (built
   and run by tests/fully_shard/test_quickstart.c) cannot drift apart.
2. Every `ts_...` identifier the README names (functions, types, options
   in the FSDP2 table) is a word of one of the public HEADERs.
3. Every variable in the first column of docs/environment.md's table is
   read somewhere in the library or tools sources (a variable the code no
   longer reads is not documented as working).

Exits 0 when all hold; otherwise prints each problem and exits 1.
"""
import pathlib
import re
import sys


def code_blocks_with_files(text):
    """(line number, path, block text) for each block marked `<!-- file: PATH -->`."""
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        m = re.fullmatch(r"<!-- file: (\S+) -->", line.strip())
        if not m:
            continue
        j = i + 1
        if j >= len(lines) or not lines[j].startswith("```"):
            out.append((i + 1, m.group(1), None))
            continue
        k = j + 1
        while k < len(lines) and not lines[k].startswith("```"):
            k += 1
        out.append((i + 1, m.group(1), "\n".join(lines[j + 1:k]) + "\n"))
    return out


def main(argv):
    if len(argv) < 3:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    root = pathlib.Path(argv[1])
    readme = (root / "README.md").read_text(encoding="utf-8")
    problems = []

    blocks = code_blocks_with_files(readme)
    if not any(p == "examples/quickstart.c" for _, p, _ in blocks):
        problems.append("README.md: no code block marked <!-- file: examples/quickstart.c -->")
    for line, path, block in blocks:
        if block is None:
            problems.append(f"README.md:{line}: the marker for {path} is not followed by a code block")
            continue
        want = (root / path).read_text(encoding="utf-8")
        if block != want:
            a, b = block.split("\n"), want.split("\n")
            n = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
            problems.append(f"README.md:{line}: the block differs from {path} at its line {n + 1}:\n"
                            f"  README: {a[n] if n < len(a) else '(end)'}\n"
                            f"  {path}: {b[n] if n < len(b) else '(end)'}")

    words = set()
    for h in argv[2:]:
        words.update(re.findall(r"\b\w+\b", pathlib.Path(h).read_text(encoding="utf-8")))
    for name in sorted(set(re.findall(r"(?<![\w/.-])ts_[a-z0-9_]+", readme))):
        if name not in words:
            problems.append(f"README.md names {name}, which no public header declares")

    env_doc = root / "docs" / "environment.md"
    sources = [p for d in ("base", "tensor", "nn", "optim", "comm", "mesh", "dtensor", "fully_shard",
                           "checkpoint", "text", "tools") for p in (root / d).rglob("*.[ch]")]
    code = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sources)
    table_vars = re.findall(r"^\| `([A-Z][A-Z0-9_]+)`", env_doc.read_text(encoding="utf-8"), re.M)
    if not table_vars:
        problems.append("docs/environment.md: no variable in its table")
    for var in table_vars:
        if f'"{var}"' not in code and f'"{var}=' not in code:
            problems.append(f"docs/environment.md documents {var}, which no source under the library or tools reads")

    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
