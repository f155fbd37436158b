/*
 * Wrap policies over ts_fully_shard (fully_shard.h): shard every module of
 * a type, or every module whose parameters not yet taken by a sharded
 * descendant reach a count (FSDP1's size_based_auto_wrap_policy). Both walk
 * the tree bottom-up (children before their parent, siblings in PyTorch's
 * order) and never shard the root: the caller ends with
 * ts_fully_shard(root), as FSDP2 users end with fully_shard(model).
 * Floor 7 (internal.h, "Floors"): may call floors 1-6 (ts_fully_shard).
 */
#include "fully_shard/fully_shard.h"
#include "fully_shard/internal.h"

#include <stdio.h>
#include <string.h>

/* One module of the tree, in pre-order, with its fully qualified name. */
typedef struct tree_entry {
    char *fqn;
    ts_module *m;
} tree_entry;

typedef struct tree_list {
    tree_entry *e;
    int n, cap;
} tree_list;

static ts_status count_module(void *ctx, const char *fqn, ts_module *m)
{
    (void)fqn;
    (void)m;
    ((tree_list *)ctx)->cap++;
    return TS_OK;
}

static ts_status add_module(void *ctx, const char *fqn, ts_module *m)
{
    tree_list *l = ctx;
    if (l->n >= l->cap) /* the tree changed between the two walks: cannot happen on one thread */
        return ts_error(TS_ERR_INTERNAL, "fsdp policy: the module tree grew while it was listed");
    char *s = ts__strdup(TS_MEM_NN, fqn);
    if (!s) return TS_ERR_NO_MEMORY;
    l->e[l->n].fqn = s;
    l->e[l->n].m = m;
    l->n++;
    return TS_OK;
}

static void tree_list_free(tree_list *l)
{
    for (int i = 0; i < l->n; i++) ts__free(TS_MEM_NN, l->e[i].fqn);
    ts__free(TS_MEM_NN, l->e);
    memset(l, 0, sizeof *l);
}

/* True when module `a` (fqn) is an ancestor of module `b` (fqn). */
static bool is_ancestor(const char *a, const char *b)
{
    if (!*a) return *b != '\0';
    size_t n = strlen(a);
    return strncmp(a, b, n) == 0 && b[n] == '.';
}

/* Lists the tree under root in post-order (every module after its
 * descendants, siblings in order): *order_out holds n indices into l->e
 * (l->e itself is in pre-order, root first). */
static ts_status list_post_order(const char *fn, ts_module *root, tree_list *l, int **order_out)
{
    memset(l, 0, sizeof *l);
    ts_status st = ts_module_named_modules(root, count_module, l);
    if (st) return st;
    if (l->cap <= 0) return ts_error(TS_ERR_INTERNAL, "%s: the module tree lists no modules", fn);
    l->e = ts__calloc(TS_MEM_NN, (size_t)l->cap, sizeof *l->e);
    int *order = ts__calloc(TS_MEM_NN, (size_t)l->cap, sizeof *order);
    int *stack = ts__calloc(TS_MEM_NN, (size_t)l->cap, sizeof *stack);
    if (!l->e || !order || !stack) {
        st = TS_ERR_NO_MEMORY;
        goto done;
    }
    if ((st = ts_module_named_modules(root, add_module, l))) goto done;
    int top = 0, k = 0;
    for (int i = 0; i < l->n; i++) {
        while (top > 0 && !is_ancestor(l->e[stack[top - 1]].fqn, l->e[i].fqn)) order[k++] = stack[--top];
        stack[top++] = i;
    }
    while (top > 0) order[k++] = stack[--top];
done:
    ts__free(TS_MEM_NN, stack);
    if (st) {
        ts__free(TS_MEM_NN, order);
        tree_list_free(l);
        return st;
    }
    *order_out = order;
    return TS_OK;
}

static ts_status check_root(const char *fn, ts_module *root)
{
    if (!root || !root->vtable) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the root module is NULL", fn);
    if (ts_module_is_fsdp(root))
        return ts_error(TS_ERR_ALREADY,
                        "%s: the root (%s) is already sharded, so its group holds every parameter left: apply the "
                        "policy first, then ts_fully_shard(root)",
                        fn, ts_module_type_name(root));
    return TS_OK;
}

ts_status ts_fsdp_apply_by_type(ts_module *root, const char *type_name, const ts_fsdp_options *options, int *count_out)
{
    const char *fn = "fsdp_apply_by_type";
    ts_status st = check_root(fn, root);
    if (st) return st;
    if (!type_name || !*type_name)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the type name is %s", fn, type_name ? "empty" : "NULL");
    tree_list l;
    int *order;
    if ((st = list_post_order(fn, root, &l, &order))) return st;
    int count = 0, matched = 0;
    for (int k = 0; k < l.n && !st; k++) {
        int i = order[k];
        ts_module *m = l.e[i].m;
        if (i == 0 || strcmp(ts__fsdp_own_type(m), type_name) != 0) continue;
        matched++;
        if (ts_module_is_fsdp(m)) continue;
        if ((st = ts_fully_shard(m, options)))
            ts_error(st, "%s: sharding '%s' (%s): %s", fn, l.e[i].fqn, type_name, ts_last_error());
        else count++;
    }
    if (!st && !matched) {
        /* not an error (a policy may match nothing), but a typo would
         * silently leave everything to the root: say which types exist */
        char types[512] = "";
        size_t len = 0;
        for (int i = 1; i < l.n && len < sizeof types; i++) {
            const char *t = ts__fsdp_own_type(l.e[i].m);
            bool seen = false;
            for (int j = 1; j < i && !seen; j++) seen = strcmp(ts__fsdp_own_type(l.e[j].m), t) == 0;
            if (seen) continue;
            int w = snprintf(types + len, sizeof types - len, "%s%s", len ? ", " : "", t);
            len += w > 0 ? (size_t)w : 0;
        }
        ts_logf(TS_LOG_WARN, "%s: no module below the root has type '%s' (types below it: %s); nothing was sharded", fn,
                type_name, len ? types : "none");
    }
    ts__free(TS_MEM_NN, order);
    tree_list_free(&l);
    if (!st && count_out) *count_out = count;
    return st;
}

/* Elements of the parameters of m's subtree that no group has taken yet
 * (each tensor once; the options' ignored parameters not counted). */
static ts_status free_numel(ts_module *m, const ts_fsdp_options *o, int64_t *out)
{
    ts_named_params np;
    ts_status st = ts_module_named_parameters(m, &np);
    if (st) return st;
    int64_t n = 0;
    for (int i = 0; i < np.n; i++) {
        ts_tensor *t = *np.items[i].slot;
        /* a shard, or a persistent parameter: some group has it */
        if (!t || ts_fsdp_param_dtensor(t) || ts__fsdp_is_persistent(t)) continue;
        bool ignored = false;
        for (int j = 0; o && j < o->n_ignored_params && !ignored; j++) ignored = o->ignored_params[j] == t;
        if (!ignored) n += ts_tensor_numel(t);
    }
    ts_named_params_free(&np);
    *out = n;
    return TS_OK;
}

ts_status ts_fsdp_apply_by_size(ts_module *root, int64_t min_params, const ts_fsdp_options *options, int *count_out)
{
    const char *fn = "fsdp_apply_by_size";
    ts_status st = check_root(fn, root);
    if (st) return st;
    if (min_params <= 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: min_params must be at least 1, got %lld", fn,
                        (long long)min_params);
    tree_list l;
    int *order;
    if ((st = list_post_order(fn, root, &l, &order))) return st;
    /* FSDP1's defaults: a MultiheadAttention is a leaf (nothing inside it
     * is wrapped on its own) and a ModuleList is never wrapped (it has no
     * forward that could gather its parameters). */
    bool *inside_leaf = ts__calloc(TS_MEM_NN, (size_t)l.n, sizeof *inside_leaf);
    if (!inside_leaf) st = TS_ERR_NO_MEMORY;
    for (int i = 0; i < l.n && !st; i++) {
        if (strcmp(ts__fsdp_own_type(l.e[i].m), "MultiheadAttention") != 0) continue;
        for (int j = i + 1; j < l.n && is_ancestor(l.e[i].fqn, l.e[j].fqn); j++) inside_leaf[j] = true;
    }
    int count = 0;
    for (int k = 0; k < l.n && !st; k++) {
        int i = order[k];
        ts_module *m = l.e[i].m;
        if (i == 0 || inside_leaf[i] || ts_module_is_fsdp(m) || strcmp(ts__fsdp_own_type(m), "ModuleList") == 0)
            continue;
        int64_t n;
        if ((st = free_numel(m, options, &n))) break;
        if (n < min_params) continue;
        if ((st = ts_fully_shard(m, options)))
            ts_error(st, "%s: sharding '%s' (%s, %lld parameters left): %s", fn, l.e[i].fqn, ts__fsdp_own_type(m),
                     (long long)n, ts_last_error());
        else count++;
    }
    ts__free(TS_MEM_NN, inside_leaf);
    ts__free(TS_MEM_NN, order);
    tree_list_free(&l);
    if (!st && count_out) *count_out = count;
    return st;
}
