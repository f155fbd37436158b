/* Three wrap policies on one model (seed 000): Sequential(Block(), Block()),
 * each Block a module type of its own holding two Linear(6, 6, bias=False)
 * (a, b; forward b(relu(a(x)))), 144 parameters in all, sharded on four
 * ranks three ways:
 *
 *   no policy                       ts_fully_shard(root) alone: 1 FSDP module, 1 group
 *   ts_fsdp_apply_by_type(Block)    each Block, then the root:  3 FSDP modules, 2 groups
 *                                   (FSDP1's ModuleWrapPolicy({Block}))
 *   ts_fsdp_apply_by_size(min=30)   each Linear (36 >= 30; nothing is left to the Blocks),
 *                                   then the root: 5 FSDP modules, 4 groups
 *                                   (FSDP1's size_based_auto_wrap_policy)
 *
 * The root owns no parameters once its children took them all: it is an
 * FSDP module without a group, and gathers nothing. Each line gives the
 * FSDP module count, the groups that own parameters and, per group, this
 * rank's shards. Sharding is per parameter (FSDP2) rather than one flat
 * parameter per group (FSDP1, the seed's (36,), (18,) and (9,)): each (6, 6)
 * weight is split by rows as torch.chunk does, (2, 6) on ranks 0 to 2 and
 * (0, 6) on rank 3. Each sharded model then runs one forward and backward,
 * whose output must equal the unsharded model's. Run with four ranks:
 *
 *     build/tools/tsrun --nproc-per-node 4 build/examples/wrap_policies */
#include "common.h"

/* ------------------------------------------------------------ Block */

typedef struct block {
    ts_module base;
    ts_module *a, *b;
} block;

static ts_status block_forward(ts_module *m, int n_in, ts_tensor *const *in, int *n_out, ts_tensor **out)
{
    block *bk = (block *)m;
    if (n_in != 1) return ts_error(TS_ERR_INVALID_ARGUMENT, "Block: takes one input, got %d", n_in);
    ts_tensor *h = NULL, *r = NULL;
    ts_status st = ts_module_call1(bk->a, in[0], &h);
    if (!st) st = ts_relu(h, &r);
    if (!st) st = ts_module_call1(bk->b, r, &out[0]);
    ts_tensor_free(r);
    ts_tensor_free(h);
    if (!st) *n_out = 1;
    return st;
}

static ts_status block_visit(ts_module *m, const ts_module_visitor *v)
{
    block *bk = (block *)m;
    ts_status st = TS_OK;
    if (v->child && !(st = v->child(v->ctx, "a", bk->a))) st = v->child(v->ctx, "b", bk->b);
    return st;
}

static void block_free(ts_module *m)
{
    block *bk = (block *)m;
    ts_module_free(bk->a);
    ts_module_free(bk->b);
    free(bk);
}

static const ts_module_vtable block_vtable = {
    .type_name = "Block", .forward = block_forward, .visit = block_visit, .free = block_free};

static ts_status block_new(ts_module **out)
{
    block *bk = calloc(1, sizeof *bk);
    if (!bk) return ts_error(TS_ERR_NO_MEMORY, "Block: out of memory");
    ts_module_init(&bk->base, &block_vtable);
    ts_status st = ts_linear_new(6, 6, false, &bk->a);
    if (!st) st = ts_linear_new(6, 6, false, &bk->b);
    if (st) {
        block_free(&bk->base);
        return st;
    }
    *out = &bk->base;
    return TS_OK;
}

/* torch.manual_seed(0); nn.Sequential(Block(), Block()) */
static ts_module *build(void)
{
    ts_manual_seed(0);
    ts_module *blocks[2], *model;
    CHECK(block_new(&blocks[0]));
    CHECK(block_new(&blocks[1]));
    CHECK(ts_sequential_new(2, blocks, &model));
    return model;
}

/* ------------------------------------------------------------ report */

typedef struct fsdp_list {
    char fqn[16][64];
    ts_module *m[16];
    int n;
} fsdp_list;

static ts_status list_fsdp(void *ctx, const char *fqn, ts_module *m)
{
    fsdp_list *l = ctx;
    if (!ts_module_is_fsdp(m)) return TS_OK;
    if (l->n == 16) return ts_error(TS_ERR_INVALID_ARGUMENT, "more than 16 FSDP modules");
    snprintf(l->fqn[l->n], sizeof l->fqn[0], "%s", fqn);
    l->m[l->n++] = m;
    return TS_OK;
}

static bool is_within(const char *module_fqn, const char *param_fqn)
{
    size_t n = strlen(module_fqn);
    return n == 0 || (strncmp(module_fqn, param_fqn, n) == 0 && param_fqn[n] == '.');
}

/* `rank R | tag: fsdp units U groups with parameters G local shards [[...], ...]`:
 * a parameter belongs to the group of the innermost FSDP module above it. */
static void report(const char *tag, ts_module *model, int rank)
{
    fsdp_list l = {.n = 0};
    CHECK(ts_module_named_modules(model, list_fsdp, &l));
    ts_named_params np;
    CHECK(ts_module_named_parameters(model, &np));
    char line[2048];
    size_t n = 0;
    int groups = 0;
    for (int g = 0; g < l.n; g++) {
        ts_fsdp_group_info info;
        CHECK(ts_fsdp_group_info_get(l.m[g], &info));
        if (info.n_params == 0) continue;
        n += (size_t)snprintf(line + n, sizeof line - n, "%s[", groups ? ", " : "");
        int found = 0;
        for (int i = 0; i < np.n; i++) {
            int owner = -1;
            for (int k = 0; k < l.n; k++)
                if (is_within(l.fqn[k], np.items[i].name) && (owner < 0 || strlen(l.fqn[k]) > strlen(l.fqn[owner])))
                    owner = k;
            if (owner != g) continue;
            char shape[64];
            n += (size_t)snprintf(line + n, sizeof line - n, "%s%s", found ? ", " : "",
                                  ts_tensor_shape_str(*np.items[i].slot, shape, sizeof shape));
            found++;
        }
        if (found != info.n_params) {
            fprintf(stderr, "error: the group of '%s' holds %d parameters, %d found below it\n", l.fqn[g],
                    info.n_params, found);
            exit(1);
        }
        n += (size_t)snprintf(line + n, sizeof line - n, "]");
        groups++;
    }
    ts_named_params_free(&np);
    printf("rank %d | %s: fsdp units %d groups with parameters %d local shards [%s]\n", rank, tag, l.n, groups, line);
    fflush(stdout);
}

/* The sum of model(ones(2, 6)), after a backward through it. */
static double forward_backward(ts_module *model)
{
    int64_t xs[2] = {2, 6};
    ts_tensor *x, *y, *s;
    double v;
    CHECK(ts_tensor_ones(TS_F32, 2, xs, &x));
    CHECK(ts_module_call1(model, x, &y));
    CHECK(ts_sum(y, 0, NULL, false, &s));
    CHECK(ts_tensor_item(s, &v));
    CHECK(ts_backward(s, NULL, false));
    ts_tensor_free(s);
    ts_tensor_free(y);
    ts_tensor_free(x);
    return v;
}

static void check_same(const char *tag, double got, double want)
{
    if (got != want) {
        fprintf(stderr, "error: %s: the sharded model's output sum %.10f differs from the unsharded %.10f\n", tag, got,
                want);
        exit(1);
    }
}

int main(int argc, char **argv)
{
    /* no flags: --help prints this, anything else is refused (exit 2) */
    ex_parse_flags(argc, argv,
                   "Seed 000's two-Block model sharded three ways (root only, by type, by size). Run under tsrun "
                   "--nproc-per-node 4.",
                   NULL, 0);
    CHECK(ts_launch_rank_guard());
    CHECK(ts_dist_init(NULL));
    int rank = ts_comm_rank(ts_dist_world()), world = ts_comm_size(ts_dist_world());
    if (world != 4) {
        fprintf(stderr, "wrap_policies runs on 4 ranks (tsrun --nproc-per-node 4), not %d\n", world);
        ts_dist_finalize();
        return 2;
    }
    ts_module *model = build();
    double want = forward_backward(model);
    ts_module_free(model);

    const char *tag = "no policy";
    model = build();
    CHECK(ts_fully_shard(model, NULL));
    report(tag, model, rank);
    check_same(tag, forward_backward(model), want);
    ts_module_free(model);

    tag = "ts_fsdp_apply_by_type(Block)";
    model = build();
    int count = 0;
    CHECK(ts_fsdp_apply_by_type(model, "Block", NULL, &count));
    CHECK(ts_fully_shard(model, NULL));
    report(tag, model, rank);
    check_same(tag, forward_backward(model), want);
    ts_module_free(model);

    tag = "ts_fsdp_apply_by_size(min=30)";
    model = build();
    CHECK(ts_fsdp_apply_by_size(model, 30, NULL, &count));
    CHECK(ts_fully_shard(model, NULL));
    report(tag, model, rank);
    check_same(tag, forward_backward(model), want);
    ts_module_free(model);

    CHECK(ts_dist_finalize());
    return 0;
}
