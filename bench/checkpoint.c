/* bench/checkpoint: saving and loading a GPT trained with fully_shard on W
 * ranks (tsrun), sharded (ts_ckpt_save / ts_ckpt_load, model and AdamW
 * state) and full (ts_ckpt_save_full / ts_ckpt_load_full, the model),
 * against the reference that gathers a full state dict on rank 0 and
 * writes it with ts_safetensors_save (and reads it back whole with
 * ts_safetensors_load into ts_fsdp_load_full_state_dict), in the same run.
 *
 * Per operation: the median wall time over --reps repetitions (each ends
 * with a barrier, so it is the slowest rank's), the bytes it wrote (files
 * in the folder) or this rank read (ts_ckpt_info.bytes_read), and the
 * peak of extra tensor storage (TS_MEM_STORAGE above what was live) on
 * rank 0 during it: the gather-free sharded save needs none, the streamed
 * full save one tensor, the reference the whole model.
 *
 * Usage: tsrun --nproc-per-node 2 bench_checkpoint [--dir D] [--reps N]
 *        [--layers L] [--dim D]
 * Defaults: a folder under /tmp (removed at the end; a --dir folder keeps
 * the files), 5 reps, 4 layers, d 256 (about 13 MB of
 * float32 parameters and 26 MB of AdamW state). */
#define _GNU_SOURCE
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench/bench_common.h"
#include "tensorshard.h"

static ts_module *build(int layers, int dim, ts_optim **opt)
{
    ts_gpt_config g = ts_gpt_config_default();
    g.vocab_size = 256, g.block_size = 64, g.n_layer = layers, g.n_head = 4, g.d_model = dim;
    ts_manual_seed(1);
    ts_module *m;
    CHECK(ts_gpt_new(&g, &m));
    for (int l = 0; l < layers; l++) {
        char name[32];
        ts_module *b;
        snprintf(name, sizeof name, "blocks.%d", l);
        CHECK(ts_module_get_submodule(m, name, &b));
        CHECK(ts_fully_shard(b, NULL));
    }
    CHECK(ts_fully_shard(m, NULL));
    ts_param_list pl;
    CHECK(ts_module_parameters(m, &pl));
    CHECK(ts_adamw_new(pl.n, pl.items, NULL, opt));
    /* one step so that the AdamW state exists: gradients of ones */
    for (int i = 0; i < pl.n; i++) {
        ts_tensor *t = pl.items[i], *lv = NULL, *gr = NULL;
        CHECK(ts_tensor_local_view(t, &lv));
        CHECK(ts_tensor_zeros(ts_tensor_dtype(lv), ts_tensor_ndim(lv), ts_tensor_shape(lv), &gr));
        CHECK(ts_tensor_fill_(gr, 1.0));
        CHECK(ts_tensor_set_grad(t, gr));
        ts_tensor_free(gr);
        ts_tensor_free(lv);
    }
    CHECK(ts_optim_step(*opt));
    ts_param_list_free(&pl);
    return m;
}

static uint64_t folder_bytes(const char *dir)
{
    DIR *d = opendir(dir);
    uint64_t n = 0;
    struct dirent *de;
    while (d && (de = readdir(d))) {
        struct stat sb;
        if (de->d_name[0] != '.' && fstatat(dirfd(d), de->d_name, &sb, 0) == 0 && S_ISREG(sb.st_mode))
            n += (uint64_t)sb.st_size;
    }
    if (d) closedir(d);
    return n;
}

enum { SAVE, LOAD, SAVE_FULL, LOAD_FULL, REF_SAVE, REF_LOAD, N_OPS };
static const char *const op_names[N_OPS] = {"ts_ckpt_save (sharded, +AdamW)", "ts_ckpt_load (sharded, +AdamW)",
                                            "ts_ckpt_save_full (model)",      "ts_ckpt_load_full (model)",
                                            "reference save (gather+write)",  "reference load (read+copy)"};

int main(int argc, char **argv)
{
    int reps = 5, layers = 4, dim = 256;
    bool keep = false; /* --dir given: the files stay */
    char dir[256] = "";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--layers")) layers = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--dim")) dim = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--dir")) snprintf(dir, sizeof dir, "%s", argv[i + 1]), keep = true;
        else {
            fprintf(stderr, "usage: tsrun --nproc-per-node 2 %s [--dir D] [--reps N] [--layers L] [--dim D]\n",
                    argv[0]);
            return 2;
        }
    }
    if ((argc - 1) % 2 || reps < 1 || layers < 1 || dim < 4 || dim % 4) {
        fprintf(stderr, "usage: tsrun --nproc-per-node 2 %s [--dir D] [--reps N] [--layers L] [--dim D]\n", argv[0]);
        return 2;
    }
    CHECK(ts_dist_init(NULL));
    ts_comm *world = ts_dist_world();
    int rank = ts_comm_rank(world), W = ts_comm_size(world);
    if (!dir[0])
        snprintf(dir, sizeof dir, "/tmp/ts_bench_ckpt.%s", getenv("MASTER_PORT") ? getenv("MASTER_PORT") : "0");
    char sdir[300], full[300], ref[300];
    snprintf(sdir, sizeof sdir, "%s/sharded", dir);
    snprintf(full, sizeof full, "%s/full.safetensors", dir);
    snprintf(ref, sizeof ref, "%s/ref.safetensors", dir);
    if (rank == 0) mkdir(dir, 0777);
    CHECK(ts_barrier(world, NULL));
    ts_optim *opt = NULL, *opt2 = NULL;
    ts_module *m = build(layers, dim, &opt), *m2 = build(layers, dim, &opt2);
    int64_t params = 0;
    ts_param_list pl;
    CHECK(ts_module_parameters(m, &pl));
    for (int i = 0; i < pl.n; i++) {
        const ts_dtensor *d = ts_fsdp_param_dtensor(pl.items[i]);
        int64_t n = 1;
        for (int k = 0; k < (d ? ts_dtensor_ndim(d) : ts_tensor_ndim(pl.items[i])); k++)
            n *= d ? ts_dtensor_shape(d)[k] : ts_tensor_shape(pl.items[i])[k];
        params += n;
    }
    ts_param_list_free(&pl);
    double t[N_OPS][64];
    uint64_t bytes[N_OPS] = {0};
    size_t peak[N_OPS] = {0};
    if (reps > 64) reps = 64;
    for (int r = 0; r < reps; r++)
        for (int op = 0; op < N_OPS; op++) {
            CHECK(ts_barrier(world, NULL));
            size_t base = ts_mem_live_bytes(TS_MEM_STORAGE);
            ts_mem_reset_peak();
            double t0 = bench_now_s();
            ts_ckpt_options o = ts_ckpt_options_default();
            ts_ckpt_info info = {0};
            switch (op) {
            case SAVE:
                o.optim = opt;
                CHECK(ts_ckpt_save(sdir, m, &o));
                break;
            case LOAD:
                o.optim = opt2;
                CHECK(ts_ckpt_load(sdir, m2, &o, &info));
                bytes[op] = info.bytes_read;
                break;
            case SAVE_FULL: CHECK(ts_ckpt_save_full(full, m, NULL, 0)); break;
            case LOAD_FULL: CHECK(ts_ckpt_load_full(full, m2, true)); break;
            case REF_SAVE: {
                ts_state_dict *sd = NULL;
                CHECK(ts_fsdp_full_state_dict(m, true, &sd));
                if (rank == 0) CHECK(ts_safetensors_save(ref, sd, NULL, 0));
                ts_state_dict_free(sd);
                break;
            }
            case REF_LOAD: {
                ts_state_dict *sd = NULL;
                CHECK(ts_safetensors_load(ref, &sd));
                CHECK(ts_fsdp_load_full_state_dict(m2, sd, true));
                ts_state_dict_free(sd);
                break;
            }
            }
            CHECK(ts_barrier(world, NULL));
            t[op][r] = bench_now_s() - t0;
            size_t p = ts_mem_peak_bytes(TS_MEM_STORAGE) - base;
            if (p > peak[op]) peak[op] = p;
            if (op == SAVE && rank == 0) bytes[op] = folder_bytes(sdir);
            if (op == SAVE_FULL && rank == 0) bytes[op] = folder_bytes(dir) - folder_bytes(sdir);
        }
    if (rank == 0) {
        struct stat sb;
        if (stat(full, &sb) == 0) bytes[SAVE_FULL] = (uint64_t)sb.st_size;
        if (stat(ref, &sb) == 0) bytes[REF_SAVE] = (uint64_t)sb.st_size;
        bytes[LOAD_FULL] = 0;
        printf("bench_checkpoint: %d ranks, GPT %d layers, d %d: %lld parameters (%.1f MB float32), AdamW state "
               "2x that; folder %s\n",
               W, layers, dim, (long long)params, (double)params * 4 / 1e6, dir);
        printf("%-32s %10s %14s %22s\n", "operation", "median ms", "MB written", "peak extra MB (rank 0)");
        for (int op = 0; op < N_OPS; op++) {
            double med = bench_median(t[op], reps) * 1e3;
            bool wr = op == SAVE || op == SAVE_FULL || op == REF_SAVE;
            char b[32] = "-";
            if (wr || op == LOAD) snprintf(b, sizeof b, "%s%.2f", wr ? "" : "read ", (double)bytes[op] / 1e6);
            printf("%-32s %10.1f %14s %22.2f\n", op_names[op], med, b, (double)peak[op] / 1e6);
        }
        printf("ratio full save / reference save: %.2f; full load / reference load: %.2f\n",
               bench_median(t[SAVE_FULL], reps) / bench_median(t[REF_SAVE], reps),
               bench_median(t[LOAD_FULL], reps) / bench_median(t[REF_LOAD], reps));
    }
    if (rank == 0 && !keep) { /* the files this run wrote */
        DIR *d = opendir(sdir);
        struct dirent *de;
        while (d && (de = readdir(d)))
            if (de->d_name[0] != '.' || strlen(de->d_name) > 2) unlinkat(dirfd(d), de->d_name, 0);
        if (d) closedir(d);
        rmdir(sdir);
        unlink(full);
        unlink(ref);
        rmdir(dir);
    }
    ts_optim_free(opt);
    ts_optim_free(opt2);
    ts_module_free(m);
    ts_module_free(m2);
    CHECK(ts_barrier(world, NULL));
    CHECK(ts_dist_finalize());
    return 0;
}
