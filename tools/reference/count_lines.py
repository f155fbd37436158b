"""Counts the lines of a C or Python program, as docs/custom-modules.md
reports them: all lines (what `wc -l` prints) and code lines (neither
blank nor only comment: C's /* */ and // comments, Python's # comments and
docstrings), for the whole file and for its model part, the lines from the
one holding "the block type" to the one before "the program" (the section
markers of examples/custom_module.c and tools/reference/custom_module_fsdp2.py).

    python3 tools/reference/count_lines.py FILE...   (standard library only)
"""
import io
import sys
import tokenize


def c_code_lines(text):
    """Indices of the lines that hold C code outside comments."""
    code, i, line, state = set(), 0, 0, None  # state: None, 'block', 'line', '"', "'"
    while i < len(text):
        ch, nxt = text[i], text[i + 1] if i + 1 < len(text) else ''
        if ch == '\n':
            line += 1
            if state == 'line':
                state = None
        elif state == 'block':
            if ch == '*' and nxt == '/':
                state, i = None, i + 1
        elif state == 'line':
            pass
        elif state in ('"', "'"):
            code.add(line)
            if ch == '\\':
                i += 1
            elif ch == state:
                state = None
        elif ch == '/' and nxt == '*':
            state, i = 'block', i + 1
        elif ch == '/' and nxt == '/':
            state = 'line'
        elif not ch.isspace():
            code.add(line)
            if ch in ('"', "'"):
                state = ch
        i += 1
    return code


def py_code_lines(text):
    """Indices of the lines that hold Python code (not comments or docstrings)."""
    code, logical = set(), []
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip:
            logical.append(tok)
        if tok.type == tokenize.NEWLINE or tok.type == tokenize.ENDMARKER:
            if not (len(logical) == 1 and logical[0].type == tokenize.STRING):  # a docstring
                for t in logical:
                    code.update(range(t.start[0] - 1, t.end[0]))
            logical = []
    return code


def count(path):
    text = open(path, encoding='utf-8').read()
    lines = text.split('\n')[:-1] if text.endswith('\n') else text.split('\n')
    code = py_code_lines(text) if path.endswith('.py') else c_code_lines(text)
    start = next((i for i, s in enumerate(lines) if 'the block type' in s), 0)
    end = next((i for i, s in enumerate(lines) if 'the program' in s and i > start), len(lines))
    model = range(start, end)
    return (len(lines), sum(1 for i in range(len(lines)) if i in code),
            len(model), sum(1 for i in model if i in code))


def main():
    print('%-45s %8s %8s %8s %8s' % ('file', 'lines', 'code', 'model', 'model code'))
    for path in sys.argv[1:]:
        print('%-45s %8d %8d %8d %8d' % ((path,) + count(path)))


if __name__ == '__main__':
    main()
