/* Printing a module tree as PyTorch's repr does: one line per leaf with
 * its extra_repr and slots, nested parentheses for modules with children,
 * a shared submodule printed once and named where it appears again
 * (ts_module_repr, ts_module_print). */
#include "nn/internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------ printing */

/* A growing text buffer; the first failure sticks in st. */
typedef struct sbuf {
    char *p;
    size_t n, cap;
    ts_status st;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t len)
{
    if (b->st) return;
    if (b->n + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + len + 1) cap *= 2;
        char *p = ts__malloc(TS_MEM_NN, cap);
        if (!p) {
            b->st = TS_ERR_NO_MEMORY;
            return;
        }
        if (b->n) memcpy(p, b->p, b->n);
        ts__free(TS_MEM_NN, b->p);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_indent(sbuf *b, int depth)
{
    for (int i = 0; i < depth; i++) sb_str(b, "  ");
}

typedef struct print_ctx {
    sbuf *b;
    int count;    /* slots printed on this line */
    bool buffers; /* this pass prints buffers */
    /* children of the module being printed */
    const char **child_names;
    ts_module **children;
    int n_children, cap_children;
    ts_status st;
} print_ctx;

static void print_slot(print_ctx *c, const char *name, ts_tensor **slot)
{
    if (!slot || !*slot) return;
    char shape[96];
    sb_str(c->b, c->count++ ? ", " : "  ");
    if (c->buffers) sb_str(c->b, "buffer ");
    sb_str(c->b, name);
    sb_str(c->b, " ");
    ts_dtype dt = ts_tensor_dtype(*slot);
    if (dt != TS_F32) {
        sb_str(c->b, ts_dtype_name(dt));
        sb_str(c->b, " ");
    }
    sb_str(c->b, ts_tensor_shape_str(*slot, shape, sizeof shape));
    if (ts_tensor_is_shard(*slot)) sb_str(c->b, " [shard]");
}

static ts_status print_param(void *ctx, const char *name, ts_tensor **slot)
{
    print_slot(ctx, name, slot);
    return TS_OK;
}

static ts_status print_buffer(void *ctx, const char *name, ts_tensor **slot)
{
    print_slot(ctx, name, slot);
    return TS_OK;
}

static ts_status print_child(void *ctx, const char *name, ts_module *child)
{
    print_ctx *c = ctx;
    if (!child) return TS_OK;
    if (c->n_children == c->cap_children) {
        int cap = c->cap_children ? 2 * c->cap_children : 8;
        void *nn, *nc;
        if (ts__grow_pair(c->child_names, sizeof *c->child_names, c->children, sizeof *c->children, c->n_children, cap,
                          &nn, &nc))
            return TS_ERR_NO_MEMORY;
        c->child_names = nn;
        c->children = nc;
        c->cap_children = cap;
    }
    char *copy = ts__strdup(TS_MEM_NN, name ? name : "");
    if (!copy) return TS_ERR_NO_MEMORY;
    c->child_names[c->n_children] = copy;
    c->children[c->n_children++] = child;
    return TS_OK;
}

typedef struct print_seen {
    ts_module **m;
    char **fqn;
    int n, cap;
} print_seen;

static ts_status seen_add(print_seen *s, ts_module *m, const char *fqn)
{
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 16;
        void *nm, *nf;
        if (ts__grow_pair(s->m, sizeof *s->m, s->fqn, sizeof *s->fqn, s->n, cap, &nm, &nf)) return TS_ERR_NO_MEMORY;
        s->m = nm;
        s->fqn = nf;
        s->cap = cap;
    }
    char *copy = ts__strdup(TS_MEM_NN, fqn);
    if (!copy) return TS_ERR_NO_MEMORY;
    s->m[s->n] = m;
    s->fqn[s->n++] = copy;
    return TS_OK;
}

static ts_status print_module(sbuf *b, print_seen *seen, ts_module *m, const char *name, const char *fqn, int depth)
{
    sb_indent(b, depth);
    if (depth > 0) {
        sb_str(b, "(");
        sb_str(b, name);
        sb_str(b, "): ");
    }
    sb_str(b, ts_module_type_name(m));
    for (int i = 0; i < seen->n; i++)
        if (seen->m[i] == m) {
            sb_str(b, " (shared with '");
            sb_str(b, seen->fqn[i]);
            sb_str(b, "')\n");
            return b->st;
        }
    ts_status st = seen_add(seen, m, fqn);
    if (st) return st;
    if (!m->vtable) {
        sb_str(b, "\n");
        return b->st;
    }
    char er[512] = "";
    if (m->vtable->extra_repr && m->vtable->extra_repr(m, er, sizeof er) < 0) er[0] = '\0';
    sbuf slots = {0};
    print_ctx c = {.b = &slots};
    {
        ts_module_visitor cv = {NULL, print_child, &c, NULL};
        ts_module_visitor pv = {print_param, NULL, &c, NULL};
        ts_module_visitor bv = {NULL, NULL, &c, print_buffer};
        st = ts_module_visit(m, &cv);
        if (!st) st = ts_module_visit(m, &pv); /* own parameters, then buffers */
        c.buffers = true;
        if (!st) st = ts_module_visit(m, &bv);
    }
    if (!st) st = slots.st;
    if (!st && !c.n_children) { /* a leaf: one line */
        sb_str(b, "(");
        sb_str(b, er);
        sb_str(b, ")");
        if (slots.n) sb_str(b, slots.p);
        sb_str(b, "\n");
    } else if (!st) { /* settings, own slots and children inside, as PyTorch */
        sb_str(b, "(\n");
        if (er[0]) {
            sb_indent(b, depth + 1);
            sb_str(b, er);
            sb_str(b, "\n");
        }
        if (slots.n) {
            sb_indent(b, depth + 1);
            sb_str(b, slots.p + 2); /* without the leading "  " */
            sb_str(b, "\n");
        }
        for (int i = 0; i < c.n_children && !st && !b->st; i++) {
            char cfqn[512];
            if ((st = ts__module_fqn_join(cfqn, sizeof cfqn, fqn, c.child_names[i]))) break;
            st = print_module(b, seen, c.children[i], c.child_names[i], cfqn, depth + 1);
        }
        sb_indent(b, depth);
        sb_str(b, ")\n");
    }
    ts__free(TS_MEM_NN, slots.p);
    for (int i = 0; i < c.n_children; i++) ts__free(TS_MEM_NN, (void *)c.child_names[i]);
    ts__free(TS_MEM_NN, c.child_names);
    ts__free(TS_MEM_NN, c.children);
    return st ? st : b->st;
}

static ts_status render(const char *fn, ts_module *m, sbuf *b)
{
    if (!m) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: module is NULL", fn);
    print_seen seen = {0};
    memset(b, 0, sizeof *b);
    ts_status st = print_module(b, &seen, m, "", "", 0);
    for (int i = 0; i < seen.n; i++) ts__free(TS_MEM_NN, seen.fqn[i]);
    ts__free(TS_MEM_NN, seen.m);
    ts__free(TS_MEM_NN, seen.fqn);
    if (st) {
        ts__free(TS_MEM_NN, b->p);
        b->p = NULL;
        return st == TS_ERR_NO_MEMORY ? ts_error(st, "%s: out of memory", fn) : st;
    }
    return TS_OK;
}

ts_status ts_module_repr(ts_module *m, char *buf, size_t cap, size_t *len_out)
{
    if (!len_out || (cap && !buf))
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_repr: NULL %s", len_out ? "buf" : "len_out");
    sbuf b;
    ts_status st = render("ts_module_repr", m, &b);
    if (st) return st;
    if (cap) {
        size_t n = b.n < cap - 1 ? b.n : cap - 1;
        if (n) memcpy(buf, b.p, n);
        buf[n] = '\0';
    }
    *len_out = b.n;
    ts__free(TS_MEM_NN, b.p);
    return TS_OK;
}

ts_status ts_module_print(ts_module *m, FILE *f)
{
    if (!f) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts_module_print: the FILE is NULL");
    sbuf b;
    ts_status st = render("ts_module_print", m, &b);
    if (st) return st;
    /* flushed, so that a full disk or a closed pipe is this call's error */
    if ((b.n && fwrite(b.p, 1, b.n, f) != b.n) || fflush(f) != 0 || ferror(f))
        st = ts_error(TS_ERR_IO, "ts_module_print: writing %zu bytes failed: %s", b.n, strerror(errno));
    ts__free(TS_MEM_NN, b.p);
    return st;
}
