/* Sharded checkpoints (checkpoint/checkpoint.h; docs/checkpoint.md).
 *
 * Save: every rank lists what it holds (ck_item: a key, its global shape,
 * the rows of dim 0 it holds, whether it writes them) and writes the
 * pieces it is the lowest holder of into its own safetensors file with
 * ts_safetensors_save (temporary name, fsync, rename, folder fsync); the
 * file's __metadata__ "ts_ckpt" says, per key, its kind, global shape,
 * first row and placements. After a status all-reduce (every file
 * durable), rank 0 reads the files' headers, builds the index, writes it
 * to a temporary name, fsyncs, renames it over index.json, fsyncs the
 * folder, and only then removes the files no index names any more.
 *
 * Load: every rank parses the index (checkpoint/index.c), checks keys,
 * dtypes and shapes against what it holds, reads into temporaries the
 * byte ranges of the rows it owns now (pread, checking each file's size
 * and header against the index), agrees with the other ranks that every
 * rank succeeded, and only then copies into the model, optimizer and
 * extras. */
#define _GNU_SOURCE
#include "checkpoint/internal.h"

#include "comm/comm.h"
#include "fully_shard/fully_shard.h"
#include "mesh/mesh.h"
#include "optim/optim.h"
#include "tensor/tensor.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#define CK_INDEX "index.json"
#define CK_META_KEY "ts_ckpt"
#define CK_SHOWN 200

void (*ts__ckpt_crash_hook)(const char *point, int rank);

static void crash_point(const char *point, int rank)
{
    if (ts__ckpt_crash_hook) ts__ckpt_crash_hook(point, rank);
}

ts_ckpt_options ts_ckpt_options_default(void) { return (ts_ckpt_options){.strict = true}; }

static const char *const kind_names[] = {"model", "optim", "extra", "rank_extra"};

/* ------------------------------------------------------------ items */

/* One tensor this rank saves or loads. */
/* The longest parameter name a key holds (fully_shard's names are as long). */
#define CK_FQN_MAX 512

typedef struct ck_item {
    char *key;
    ts__ckpt_kind kind;
    ts_tensor *t; /* the tensor (a shard S, a parameter, buffer, state or extra; borrowed); NULL: an
                             optimizer state not created yet */
    ts_dtype dtype;
    int ndim;
    int64_t shape[TS_MAX_DIMS]; /* global */
    int64_t row0, rows;         /* the rows of dim 0 this rank holds (0-d: 0, 1) */
    bool sharded;               /* t is a shard of a group parameter */
    bool writes;                /* this rank is the lowest holder of these rows */
    char placements[96];        /* "Shard(0)" or "Replicate(),Shard(0)" */
    int opt_index;              /* optimizer states: the parameter's index */
    const char *opt_state;
    ts_tensor *tmp;        /* load: the rows read */
    ts_fsdp_shard_info sh; /* sharded: where its group parameter's shard sits (sh.shard NULL: not sharded) */
} ck_item;

typedef struct ck_list {
    ck_item *it;
    int n, cap;
} ck_list;

static void ck_list_free(ck_list *l)
{
    for (int i = 0; i < l->n; i++) {
        ts__free(TS_MEM_OTHER, l->it[i].key);
        ts_tensor_free(l->it[i].tmp);
    }
    ts__free(TS_MEM_OTHER, l->it);
    memset(l, 0, sizeof *l);
}

static ck_item *ck_add(ck_list *l, const char *prefix, const char *name, const char *suffix)
{
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 32;
        ck_item *p = ts__calloc(TS_MEM_OTHER, (size_t)cap, sizeof *p);
        if (!p) return NULL;
        if (l->n) memcpy(p, l->it, (size_t)l->n * sizeof *p);
        ts__free(TS_MEM_OTHER, l->it);
        l->it = p;
        l->cap = cap;
    }
    size_t len = strlen(prefix) + strlen(name) + strlen(suffix) + 1;
    char *key = ts__malloc(TS_MEM_OTHER, len);
    if (!key) return NULL;
    snprintf(key, len, "%s%s%s", prefix, name, suffix);
    ck_item *it = &l->it[l->n++];
    memset(it, 0, sizeof *it);
    it->key = key;
    it->opt_index = -1;
    return it;
}

/* The rows of dim 0 that shard rank r of sh holds (fully_shard.h,
 * ts_fsdp_shard_info). */
static void ck_chunk(const ts_fsdp_shard_info *sh, int r, int64_t *row0, int64_t *rows)
{
    ts_chunk_range(ts_dtensor_shape(sh->dtensor)[0], sh->shard_world, r, row0, rows);
}

/* Fills the geometry of an item that is (like) the tensor t of the model:
 * a group parameter's shard (sh->shard non-NULL) or a whole tensor. */
static void ck_geometry(ck_item *it, const ts_fsdp_shard_info *sh, const ts_tensor *t, int wrank)
{
    if (sh && sh->shard) {
        it->ndim = ts_dtensor_ndim(sh->dtensor);
        memset(it->shape, 0, sizeof it->shape);
        memcpy(it->shape, ts_dtensor_shape(sh->dtensor), (size_t)it->ndim * sizeof(int64_t));
        ck_chunk(sh, sh->shard_rank, &it->row0, &it->rows);
        it->sharded = true;
        it->writes = it->rows > 0 && (!sh->replicate_group || ts_comm_rank(sh->replicate_group) == 0);
        const ts_placement *pl = ts_dtensor_placements(sh->dtensor);
        int nd = ts_mesh_ndim(ts_dtensor_mesh(sh->dtensor));
        it->placements[0] = '\0';
        for (int d = 0; d < nd; d++) {
            char b[32];
            size_t used = strlen(it->placements);
            snprintf(it->placements + used, sizeof it->placements - used, "%s%s", d ? "," : "",
                     ts_placement_str(pl[d], b, sizeof b));
        }
        return;
    }
    it->ndim = ts_tensor_ndim(t);
    memcpy(it->shape, ts_tensor_shape(t), (size_t)it->ndim * sizeof(int64_t));
    it->row0 = 0;
    it->rows = it->ndim ? it->shape[0] : 1;
    it->sharded = false;
    it->writes = wrank == 0;
    snprintf(it->placements, sizeof it->placements, "Replicate()");
}

typedef struct ck_ctx {
    const char *op;
    ts_module *model;
    const ts_ckpt_options *o;
    ts_named_params np;
    ts_comm *world;
    int rank, W;
    ck_list items;
} ck_ctx;

static void ck_ctx_fini(ck_ctx *c)
{
    ck_list_free(&c->items);
    ts_named_params_free(&c->np);
}

/* Lists everything this rank saves (loading false: only the optimizer
 * states that exist) or loads (loading: every state the optimizer keeps,
 * t NULL where not created yet). */
static ts_status ck_collect(ck_ctx *c, bool loading)
{
    const char *op = c->op;
    bool idle = false;
    ts_status st = ts_fsdp_is_idle(c->model, &idle);
    if (!st && !idle) st = ts_error(TS_ERR_STATE, "%s: not inside a forward or backward", op);
    if (st) return st;
    /* the world of the model: the one its groups' meshes were made over,
     * or the initialized world (a one-rank group without one) */
    ts_comm *world = NULL;
    if ((st = ts_fsdp_world(c->model, &world))) return st;
    c->world = world;
    c->rank = ts_comm_rank(c->world);
    c->W = ts_comm_size(c->world);
    if ((st = ts_module_named_tensors(c->model, &c->np))) return st;
    /* the model */
    for (int i = 0; i < c->np.n; i++) {
        ts_tensor *t = *c->np.items[i].slot;
        ts_fsdp_shard_info sh;
        if ((st = ts_fsdp_param_shard_info(c->model, t, &sh))) return st;
        ck_item *it = ck_add(&c->items, "", c->np.items[i].name, "");
        if (!it) return TS_ERR_NO_MEMORY;
        it->kind = TS__CKPT_MODEL;
        it->t = sh.shard ? sh.shard : t;
        it->sh = sh;
        it->dtype = ts_tensor_dtype(it->t);
        ck_geometry(it, &sh, t, c->rank);
    }
    /* the optimizer, keyed by its parameters' first names */
    ts_optim *o = c->o ? c->o->optim : NULL;
    for (int i = 0; o && i < ts_optim_num_params(o); i++) {
        ts_tensor *pt = ts_optim_param(o, i);
        int at = -1; /* model item k is np.items[k], its shard (or tensor) already found above */
        for (int k = 0; k < c->np.n && at < 0; k++)
            if (*c->np.items[k].slot == pt || c->items.it[k].t == pt) at = k;
        if (at < 0 || c->np.items[at].is_buffer)
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "%s: the optimizer's parameter %d (shape %s) is not a parameter of the model (build the "
                            "optimizer from the model's parameters after fully_shard)",
                            op, i, ts_tensor_shape_str(pt, (char[96]){0}, 96));
        ts_fsdp_shard_info sh = c->items.it[at].sh; /* copied: ck_add below may move the items */
        const char *names[4];
        int ns = ts_optim_num_states(o);
        for (int s = 0; s < ns; s++) names[s] = ts_optim_state_name(o, s);
        for (int s = 0; s < ns; s++) {
            ts_tensor *state = ts_optim_state(o, i, names[s]);
            if (!state && !loading) continue;
            char suffix[64];
            snprintf(suffix, sizeof suffix, ".%s", names[s]);
            ck_item *it = ck_add(&c->items, "optim.state.", c->np.items[at].name, suffix);
            if (!it) return TS_ERR_NO_MEMORY;
            it->kind = TS__CKPT_OPTIM;
            it->t = state;
            it->opt_index = i;
            it->opt_state = names[s];
            if (!strcmp(names[s], "step")) { /* 0-d float32, the same on every rank */
                it->dtype = TS_F32;
                it->ndim = 0;
                it->row0 = 0;
                it->rows = 1;
                it->writes = c->rank == 0;
                snprintf(it->placements, sizeof it->placements, "Replicate()");
            } else {
                it->dtype = ts_tensor_dtype(pt);
                ck_geometry(it, &sh, *c->np.items[at].slot, c->rank);
            }
        }
    }
    /* the extras */
    const ts_state_dict *ex = c->o ? c->o->extra : NULL, *rex = c->o ? c->o->rank_extra : NULL;
    for (int pass = 0; pass < 2; pass++) {
        const ts_state_dict *sd = pass ? rex : ex;
        for (int i = 0; sd && i < ts_state_dict_size(sd); i++) {
            const char *name = ts_state_dict_name(sd, i);
            if (pass && ex && ts_state_dict_get(ex, name))
                return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: '%.*s' is both an extra and a rank extra", op, CK_SHOWN,
                                name);
            ts_tensor *t = ts_state_dict_tensor(sd, i);
            if (ts_tensor_is_shard(t))
                return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: extra '%.*s' is a shard; give plain tensors", op,
                                CK_SHOWN, name);
            ck_item *it = ck_add(&c->items, pass ? "rank_extra." : "extra.", name, "");
            if (!it) return TS_ERR_NO_MEMORY;
            it->kind = pass ? TS__CKPT_RANK_EXTRA : TS__CKPT_EXTRA;
            it->t = t;
            it->dtype = ts_tensor_dtype(t);
            ck_geometry(it, NULL, t, c->rank);
            if (pass) it->writes = true;
        }
    }
    return TS_OK;
}

/* ------------------------------------------------------------ collectives */

/* Every rank's status and a value: returns the most negative status of all
 * ranks (this rank's own, with its message, when it failed), and the
 * maximum of the values in *val. Without communication on one rank. */
static ts_status ck_agree(ck_ctx *c, ts_status mine, int64_t *val)
{
    if (c->W <= 1) return mine;
    int64_t two = 2;
    ts_tensor *t = NULL;
    ts_status st = ts_tensor_new_cpu(true, TS_I64, 1, &two, &t);
    if (st) return st; /* the others then time out in the all-reduce: nothing better is possible */
    int64_t *d = ts_tensor_data(t);
    d[0] = -(int64_t)mine;
    d[1] = val ? *val : 0;
    st = ts_all_reduce(c->world, t, TS_REDUCE_MAX, NULL);
    ts_status agreed = st ? st : (ts_status)(-d[0]);
    if (!st && val) *val = d[1];
    ts_tensor_free(t);
    if (st) return st;
    if (mine == agreed) return mine;
    if (mine)
        return ts_error(agreed, "%s: rank %d failed (%s: %s) and another rank with %s", c->op, c->rank,
                        ts_status_name(mine), ts_last_error(), ts_status_name(agreed));
    return ts_error(agreed,
                    "%s: another rank failed with %s (its message is in its log and ts_last_error); nothing "
                    "changed on rank %d",
                    c->op, ts_status_name(agreed), c->rank);
}

/* The sum over the ranks of v (after every rank succeeded). */
static ts_status ck_sum(ck_ctx *c, int64_t *v)
{
    if (c->W <= 1) return TS_OK;
    int64_t one = 1;
    ts_tensor *t = NULL;
    ts_status st = ts_tensor_new_cpu(true, TS_I64, 1, &one, &t);
    if (st) return st;
    ((int64_t *)ts_tensor_data(t))[0] = *v;
    st = ts_all_reduce(c->world, t, TS_REDUCE_SUM, NULL);
    if (!st) *v = ((int64_t *)ts_tensor_data(t))[0];
    ts_tensor_free(t);
    return st;
}

/* ------------------------------------------------------------ paths */

static char *path_join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = ts__malloc(TS_MEM_OTHER, n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static void rank_file_name(char *buf, size_t len, int rank, uint64_t id)
{
    snprintf(buf, len, "rank%05d-%016llx.safetensors", rank, (unsigned long long)id);
}

/* Is name one of ours ("rankNNNNN-<16 hex>.safetensors", or a temporary
 * of one or of the index)? */
static bool ck_our_file(const char *name)
{
    if (!strncmp(name, "." CK_INDEX ".tmp.", strlen("." CK_INDEX ".tmp."))) return true;
    const char *s = name[0] == '.' ? name + 1 : name;
    unsigned r;
    char hex[17];
    int used = 0;
    if (sscanf(s, "rank%5u-%16[0-9a-f]%n", &r, hex, &used) != 2 || strlen(hex) != 16) return false;
    return !strncmp(s + used, ".safetensors", strlen(".safetensors"));
}

static ts_status ck_mkdir(const char *op, const char *dir)
{
    struct stat sb;
    if (stat(dir, &sb) == 0) {
        if (!S_ISDIR(sb.st_mode)) return ts_error(TS_ERR_IO, "%s: '%s' exists and is not a folder", op, dir);
        return TS_OK;
    }
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return ts_error(TS_ERR_IO, "%s: cannot create the folder '%s': %s", op, dir, strerror(errno));
    return TS_OK;
}

/* Rank 0: takes the folder's save lock: flock on the folder itself
 * (exclusive, not waiting; no file is added). Two saves into one folder
 * at once would each remove the files of the other that its index does
 * not name. A file system without flock (an old NFS) saves unlocked. */
static ts_status ck_lock(const char *op, const char *dir, int *fd_out)
{
    *fd_out = -1;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ts_error(TS_ERR_IO, "%s: cannot open the folder '%s': %s", op, dir, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        close(fd);
        if (e == EWOULDBLOCK)
            return ts_error(TS_ERR_STATE,
                            "%s: another save into '%s' is under way (it holds the folder's lock); saves into one "
                            "folder must not overlap (each would remove the other's files)",
                            op, dir);
        return TS_OK; /* no locks here: unlocked, as before */
    }
    *fd_out = fd;
    return TS_OK;
}

static ts_status ck_sync_dir(const char *op, const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ts_error(TS_ERR_IO, "%s: cannot open the folder '%s' to sync it: %s", op, dir, strerror(errno));
    ts_status st = TS_OK;
    if (fsync(fd) != 0 && errno != EINVAL && errno != ENOTSUP)
        st = ts_error(TS_ERR_IO, "%s: syncing the folder '%s' failed: %s", op, dir, strerror(errno));
    close(fd);
    return st;
}

/* Opens a file of a checkpoint folder for reading, without following a
 * symbolic link: a checkpoint is a folder of regular files, and a link
 * inside it (to a file of another user, or outside the folder) is refused.
 * Returns the descriptor, or -1 with the error recorded in *st. */
static int ck_open_file(const char *op, const char *path, const char *what, ts_status *st)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd >= 0) return fd;
    struct stat sb;
    if (errno == ELOOP || (lstat(path, &sb) == 0 && S_ISLNK(sb.st_mode)))
        *st = ts_error(TS_ERR_IO,
                       "%s: '%s'%s is a symbolic link; a checkpoint is a folder of regular files and links in "
                       "it are not followed",
                       op, path, what);
    else *st = ts_error(TS_ERR_IO, "%s: cannot open '%s'%s: %s", op, path, what, strerror(errno));
    return -1;
}

static ts_status ck_read_small_file(const char *op, const char *path, char **buf_out, size_t *len_out)
{
    ts_status ost = TS_OK;
    int fd = ck_open_file(op, path, "", &ost);
    if (fd < 0) return ost;
    struct stat sb;
    ts_status st = TS_OK;
    char *buf = NULL;
    if (fstat(fd, &sb) != 0) st = ts_error(TS_ERR_IO, "%s: cannot stat '%s': %s", op, path, strerror(errno));
    else if (!S_ISREG(sb.st_mode)) st = ts_error(TS_ERR_IO, "%s: '%s' is not a regular file", op, path);
    else if ((uint64_t)sb.st_size > ((uint64_t)1 << 31))
        st = ts_error(TS_ERR_FORMAT, "%s: '%s' has %lld bytes, more than an index may have", op, path,
                      (long long)sb.st_size);
    else if (!(buf = ts__malloc(TS_MEM_OTHER, (size_t)sb.st_size + 1))) st = TS_ERR_NO_MEMORY;
    else st = ts_safetensors_read_at(op, path, fd, buf, (size_t)sb.st_size, 0, "the index");
    close(fd);
    if (st) {
        ts__free(TS_MEM_OTHER, buf);
        return st;
    }
    *buf_out = buf;
    *len_out = (size_t)sb.st_size;
    return TS_OK;
}

static ts_status ck_load_index(const char *op, const char *dir, ts__ckpt_index **out)
{
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return ts_error(TS_ERR_IO, "%s: cannot open the checkpoint folder '%s': %s", op, dir, strerror(errno));
    char *path = path_join(dir, CK_INDEX);
    if (!path) return TS_ERR_NO_MEMORY;
    char *buf = NULL;
    size_t len = 0;
    ts_status st = ck_read_small_file(op, path, &buf, &len);
    if (!st) st = ts__ckpt_index_parse(path, buf, len, out);
    ts__free(TS_MEM_OTHER, buf);
    ts__free(TS_MEM_OTHER, path);
    return st;
}

/* ------------------------------------------------------------ save */

static ts_status ck_random_id(uint64_t *out)
{
    uint64_t v = 0;
    size_t got = 0;
    while (got < sizeof v) {
        ssize_t r = getrandom((char *)&v + got, sizeof v - got, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return ts_error(TS_ERR_IO, "ts_ckpt_save: getrandom failed: %s", strerror(errno));
        got += (size_t)r;
    }
    *out = (v & 0x7fffffffffffffffull) | 1; /* positive: it goes through a MAX all-reduce */
    return TS_OK;
}

static json_t *shape_json(int ndim, const int64_t *shape)
{
    json_t *a = json_array();
    for (int d = 0; a && d < ndim; d++)
        if (json_array_append_new(a, json_integer((json_int_t)shape[d])) != 0) {
            json_decref(a);
            return NULL;
        }
    return a;
}

static json_t *placements_json(const char *s)
{
    json_t *a = json_array();
    char buf[96];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); a && tok; tok = strtok_r(NULL, ",", &save))
        if (json_array_append_new(a, json_string(tok)) != 0) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* ts__ckpt_hash of the bytes of t in row-major order (as safetensors writes them). */
static ts_status ck_piece_hash(const ts_tensor *t, uint64_t *out)
{
    size_t n = (size_t)ts_tensor_numel(t) * ts_dtype_size(ts_tensor_dtype(t));
    if (ts_tensor_is_contiguous(t)) {
        *out = ts__ckpt_hash(ts_tensor_data(t), n);
        return TS_OK;
    }
    void *buf = ts__malloc(TS_MEM_OTHER, n ? n : 1);
    if (!buf) return TS_ERR_NO_MEMORY;
    ts_status st = ts_tensor_copy_to(t, buf, n);
    if (!st) *out = ts__ckpt_hash(buf, n);
    ts__free(TS_MEM_OTHER, buf);
    return st;
}

/* The number of pairs: n itself, or, for TS_CKPT_META_END, those before
 * the {NULL, NULL} end (-1 when there is none within TS_CKPT_META_MAX). */
static int ck_meta_count(const ts_ckpt_meta *meta, int n)
{
    if (n != TS_CKPT_META_END || !meta) return n;
    for (int i = 0; i <= TS_CKPT_META_MAX; i++)
        if (!meta[i].key && !meta[i].value) return i;
    return -1;
}

static int ck_opt_meta_count(const ts_ckpt_options *o) { return o ? ck_meta_count(o->metadata, o->n_metadata) : 0; }

/* Writes this rank's file (every piece it writes; a rank with none writes
 * none) and sets *wrote. */
static ts_status ck_write_rank_file(ck_ctx *c, const char *dir, uint64_t id, bool *wrote)
{
    const char *op = c->op;
    ts_state_dict *sd = NULL;
    json_t *desc = json_object(), *pieces = json_object();
    char *mjson = NULL, *path = NULL;
    const char **meta = NULL;
    ts_status st = ts_state_dict_new(&sd);
    if (!st && (!desc || !pieces || json_object_set(desc, "pieces", pieces) != 0)) st = TS_ERR_NO_MEMORY;
    char idhex[17];
    snprintf(idhex, sizeof idhex, "%016llx", (unsigned long long)id);
    if (!st &&
        (json_object_set_new(desc, "rank", json_integer(c->rank)) ||
         json_object_set_new(desc, "world", json_integer(c->W)) ||
         json_object_set_new(desc, "save_id", json_string(idhex))))
        st = TS_ERR_NO_MEMORY;
    int nw = 0;
    for (int i = 0; i < c->items.n && !st; i++) {
        ck_item *it = &c->items.it[i];
        if (!it->writes || ts_state_dict_get(sd, it->key)) continue; /* a tied weight's second name is its own key */
        ts_tensor *lv = NULL;
        if ((st = ts_tensor_local_view(it->t, &lv))) break;
        st = ts_state_dict_set(sd, it->key, lv);
        ts_tensor_free(lv);
        if (st) break;
        /* the checksum of the bytes the file will hold: a strided tensor (an extra given as a
         * view), which safetensors writes compacted, is hashed compacted too (index version 2:
         * every piece has one) */
        char hhex[17] = "";
        uint64_t hash = 0;
        if ((st = ck_piece_hash(ts_state_dict_get(sd, it->key), &hash))) break;
        snprintf(hhex, sizeof hhex, "%016llx", (unsigned long long)hash);
        json_t *e = json_object(), *sh = shape_json(it->ndim, it->shape), *pl = placements_json(it->placements);
        bool ok = e && sh && pl && !json_object_set_new(e, "kind", json_string(kind_names[it->kind])) &&
            !json_object_set(e, "shape", sh) && !json_object_set(e, "placements", pl) &&
            !json_object_set_new(e, "row", json_integer((json_int_t)it->row0)) &&
            !json_object_set_new(e, "hash", json_string(hhex));
        json_decref(sh);
        json_decref(pl);
        if (!ok || json_object_set_new(pieces, it->key, e) != 0) {
            if (!ok) json_decref(e);
            st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: key '%.*s' cannot be written to JSON (not valid UTF-8?)", op,
                          CK_SHOWN, it->key);
        }
        nw++;
    }
    json_decref(pieces);
    *wrote = false;
    if (!st && nw) {
        mjson = json_dumps(desc, JSON_COMPACT);
        int nm = ck_opt_meta_count(c->o);
        meta = ts__calloc(TS_MEM_OTHER, (size_t)(2 * nm + 2), sizeof *meta);
        char name[64];
        rank_file_name(name, sizeof name, c->rank, id);
        path = path_join(dir, name);
        if (!mjson || !meta || !path) st = TS_ERR_NO_MEMORY;
        for (int i = 0; !st && i < nm; i++) {
            meta[2 * i] = c->o->metadata[i].key;
            meta[2 * i + 1] = c->o->metadata[i].value;
        }
        if (!st) {
            meta[2 * nm] = CK_META_KEY;
            meta[2 * nm + 1] = mjson;
            st = ts_safetensors_save(path, sd, meta, nm + 1);
            *wrote = !st;
        }
    }
    free(mjson); /* json_dumps allocates with jansson's allocator (libc) */
    ts__free(TS_MEM_OTHER, meta);
    ts__free(TS_MEM_OTHER, path);
    json_decref(desc);
    ts_state_dict_free(sd);
    return st;
}

/* Rank 0: reads every rank's file header and builds the index. */
static ts_status ck_build_index(ck_ctx *c, const char *dir, uint64_t id, json_t **out)
{
    const char *op = c->op;
    char idhex[17];
    snprintf(idhex, sizeof idhex, "%016llx", (unsigned long long)id);
    json_t *root = json_object(), *files = json_array(), *tensors = json_object(), *meta = json_object();
    ts_status st = root && files && tensors && meta ? TS_OK : TS_ERR_NO_MEMORY;
    if (!st &&
        (json_object_set_new(root, "format", json_string("tensorshard-dcp")) ||
         json_object_set_new(root, "version", json_integer(TS__CKPT_INDEX_VERSION)) ||
         json_object_set_new(root, "save_id", json_string(idhex)) ||
         json_object_set_new(root, "world", json_integer(c->W)) || json_object_set(root, "metadata", meta) ||
         json_object_set(root, "files", files) || json_object_set(root, "tensors", tensors)))
        st = TS_ERR_NO_MEMORY;
    for (int i = 0, nm = ck_opt_meta_count(c->o); !st && i < nm; i++) {
        const char *k = c->o->metadata[i].key, *v = c->o->metadata[i].value;
        json_t *js = json_string(v);
        if (!js || json_object_set_new(meta, k, js) != 0)
            st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: metadata pair %d is not valid UTF-8", op, i);
    }
    ts_optim *o = c->o ? c->o->optim : NULL;
    if (!st && o) {
        /* the hyperparameters as torch's state dict has them: "param_groups": [{"lr": ..., "betas": [..]}] */
        ts_optim_hparams hp;
        (void)ts_optim_hparams_get(o, &hp); /* o is not NULL: cannot fail */
        json_t *oj = json_object(), *groups = json_array(), *gj = json_object();
        bool bad = !oj || !groups || !gj || json_object_set_new(oj, "kind", json_string(ts_optim_kind_name(o))) ||
            json_object_set_new(oj, "steps", json_integer((json_int_t)ts_optim_step_count(o))) ||
            json_object_set_new(gj, "lr", json_real(hp.lr)) ||
            json_object_set_new(gj, "weight_decay", json_real(hp.weight_decay)) ||
            json_object_set_new(gj, "maximize", json_boolean(hp.maximize));
        if (!bad && hp.sgd)
            bad = json_object_set_new(gj, "momentum", json_real(hp.momentum)) ||
                json_object_set_new(gj, "dampening", json_real(hp.dampening)) ||
                json_object_set_new(gj, "nesterov", json_boolean(hp.nesterov));
        else if (!bad)
            bad = json_object_set_new(gj, "betas", json_pack("[ff]", hp.beta1, hp.beta2)) ||
                json_object_set_new(gj, "eps", json_real(hp.eps)) ||
                json_object_set_new(gj, "amsgrad", json_boolean(hp.amsgrad));
        if (!bad)
            bad = json_array_append(groups, gj) || json_object_set(oj, "param_groups", groups) ||
                json_object_set(root, "optim", oj);
        json_decref(gj);
        json_decref(groups);
        json_decref(oj);
        if (bad) st = TS_ERR_NO_MEMORY;
    }
    int nfiles = 0;
    for (int r = 0; r < c->W && !st; r++) {
        char name[64];
        rank_file_name(name, sizeof name, r, id);
        char *path = path_join(dir, name);
        if (!path) {
            st = TS_ERR_NO_MEMORY;
            break;
        }
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) {
            if (errno != ENOENT) st = ts_error(TS_ERR_IO, "%s: cannot open '%s': %s", op, path, strerror(errno));
            ts__free(TS_MEM_OTHER, path);
            continue; /* a rank with nothing to write */
        }
        ts_safetensors_header h;
        st = ts_safetensors_header_read(op, path, fd, &h);
        close(fd);
        if (st) {
            ts__free(TS_MEM_OTHER, path);
            break;
        }
        json_t *m = json_object_get(json_object_get(h.root, "__metadata__"), CK_META_KEY);
        json_t *desc = json_is_string(m) ? json_loads(json_string_value(m), 0, NULL) : NULL;
        json_t *dp = json_object_get(desc, "pieces");
        if (!json_is_object(dp)) st = ts_error(TS_ERR_FORMAT, "%s: '%s' lacks its " CK_META_KEY " metadata", op, path);
        json_t *fj = json_object();
        if (!st &&
            (!fj || json_object_set_new(fj, "name", json_string(name)) ||
             json_object_set_new(fj, "rank", json_integer(r)) ||
             json_object_set_new(fj, "size", json_integer((json_int_t)h.file_size)) || json_array_append(files, fj)))
            st = TS_ERR_NO_MEMORY;
        json_decref(fj);
        for (size_t k = 0; k < h.n && !st; k++) {
            const ts_safetensors_entry *e = &h.entries[k];
            json_t *pd = json_object_get(dp, e->name), *tj = json_object_get(tensors, e->name);
            if (!pd) {
                st = ts_error(TS_ERR_FORMAT, "%s: '%s': tensor '%s' is not described in its metadata", op, path,
                              e->name);
                break;
            }
            if (!tj) {
                tj = json_object();
                if (!tj || json_object_set(tj, "kind", json_object_get(pd, "kind")) ||
                    json_object_set_new(tj, "dtype", json_string(ts_safetensors_dtype_name(e->dtype))) ||
                    json_object_set(tj, "shape", json_object_get(pd, "shape")) ||
                    json_object_set(tj, "placements", json_object_get(pd, "placements")) ||
                    json_object_set_new(tj, "pieces", json_array()) || json_object_set_new(tensors, e->name, tj)) {
                    st = TS_ERR_NO_MEMORY;
                    break;
                }
            } else if (strcmp(json_string_value(json_object_get(tj, "dtype")), ts_safetensors_dtype_name(e->dtype)) ||
                       !json_equal(json_object_get(tj, "shape"), json_object_get(pd, "shape"))) {
                st = ts_error(TS_ERR_STATE, "%s: ranks disagree on the dtype or shape of '%s' (%s)", op, e->name, path);
                break;
            }
            json_t *pj = json_object();
            if (!pj || json_object_set_new(pj, "file", json_integer(nfiles)) ||
                json_object_set_new(pj, "rank", json_integer(r)) ||
                json_object_set(pj, "row", json_object_get(pd, "row")) ||
                json_object_set_new(pj, "rows", json_integer((json_int_t)(e->ndim ? e->shape[0] : 1))) ||
                json_object_set_new(pj, "offset", json_integer((json_int_t)(h.data_start + e->begin))) ||
                json_object_set_new(pj, "length", json_integer((json_int_t)(e->end - e->begin))) ||
                (json_object_get(pd, "hash") && json_object_set(pj, "hash", json_object_get(pd, "hash"))) ||
                json_array_append_new(json_object_get(tj, "pieces"), pj))
                st = TS_ERR_NO_MEMORY;
        }
        json_decref(desc);
        ts_safetensors_header_fini(&h);
        ts__free(TS_MEM_OTHER, path);
        nfiles++;
    }
    json_decref(files);
    json_decref(tensors);
    json_decref(meta);
    if (st) {
        json_decref(root);
        return st;
    }
    *out = root;
    return TS_OK;
}

/* Rank 0: parses the index built, as a load will, before it replaces the
 * previous one: a save never commits an index that cannot be loaded. */
static ts_status ck_validate_index(ck_ctx *c, const char *dir, const json_t *root)
{
    char *text = json_dumps(root, JSON_COMPACT);
    if (!text) return ts_error(TS_ERR_NO_MEMORY, "%s: cannot serialise the index", c->op);
    ts__ckpt_index *ix = NULL;
    ts_status st = ts__ckpt_index_parse(dir, text, strlen(text), &ix);
    free(text); /* json_dumps allocates with jansson's allocator (libc) */
    ts__ckpt_index_free(ix);
    if (st) {
        char why[512];
        snprintf(why, sizeof why, "%s", ts_last_error());
        return ts_error(TS_ERR_STATE,
                        "%s: the files the ranks wrote do not make a whole checkpoint (was every rank "
                        "given the same folder?); the previous checkpoint is kept: %s",
                        c->op, why);
    }
    return TS_OK;
}

/* Rank 0: writes the index atomically: a temporary file of a random
 * name created exclusively, without following links, mode 0600
 * (ts__tmp_create), given mode 0644 under the umask, fsync'ed, renamed
 * over index.json, folder fsync'ed. The temporary is removed on every
 * failure. *renamed tells whether the new index is in place. */
static ts_status ck_commit_index(ck_ctx *c, const char *dir, json_t *root, bool *renamed)
{
    const char *op = c->op;
    *renamed = false;
    char *text = json_dumps(root, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
    if (!text) return ts_error(TS_ERR_NO_MEMORY, "%s: cannot serialise the index", op);
    char *final = path_join(dir, CK_INDEX), *tmp = NULL;
    ts_status st = final ? TS_OK : TS_ERR_NO_MEMORY;
    int fd = -1;
    if (!st) st = ts__tmp_create(TS_MEM_OTHER, op, dir, CK_INDEX, final, &tmp, &fd);
    size_t len = strlen(text), done = 0;
    while (!st && done < len) {
        ssize_t w = write(fd, text + done, len - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) st = ts_error(TS_ERR_IO, "%s: writing '%s': %s", op, tmp, w < 0 ? strerror(errno) : "no progress");
        else done += (size_t)w;
    }
    if (!st) crash_point("index_tmp", c->rank);
    if (!st && fchmod(fd, (mode_t)ts__file_mode(0644)) != 0)
        st = ts_error(TS_ERR_IO, "%s: setting the mode of '%s' failed: %s", op, tmp, strerror(errno));
    if (!st && fsync(fd) != 0) st = ts_error(TS_ERR_IO, "%s: fsync of '%s' failed: %s", op, tmp, strerror(errno));
    if (fd >= 0 && close(fd) != 0 && !st) st = ts_error(TS_ERR_IO, "%s: closing '%s': %s", op, tmp, strerror(errno));
    if (!st) crash_point("index_synced", c->rank);
    if (!st && rename(tmp, final) != 0)
        st = ts_error(TS_ERR_IO, "%s: cannot rename '%s' to '%s': %s", op, tmp, final, strerror(errno));
    if (!st) {
        *renamed = true;
        crash_point("index_renamed", c->rank);
        st = ck_sync_dir(op, dir);
    } else if (tmp) {
        unlink(tmp);
    }
    free(text); /* json_dumps allocates with jansson's allocator (libc) */
    ts__free(TS_MEM_OTHER, tmp);
    ts__free(TS_MEM_OTHER, final);
    return st;
}

/* Rank 0, after the new index is durable: removes our files (rank files
 * and temporaries) that the index does not name: names of our patterns
 * that are regular files with the owner of the index just written (this
 * process's user, or the user a file server maps it to, as NFS's
 * root_squash does); a file or link another user planted under such a
 * name in a shared folder is left alone. Best effort. */
static void ck_cleanup(const char *dir, const json_t *index)
{
    DIR *d = opendir(dir);
    if (!d) return;
    const json_t *files = json_object_get(index, "files");
    struct stat ib;
    uid_t owner = fstatat(dirfd(d), CK_INDEX, &ib, AT_SYMLINK_NOFOLLOW) == 0 ? ib.st_uid : geteuid();
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!ck_our_file(de->d_name)) continue;
        bool keep = false;
        for (size_t i = 0; i < json_array_size(files) && !keep; i++)
            keep = !strcmp(json_string_value(json_object_get(json_array_get(files, i), "name")), de->d_name);
        struct stat sb;
        if (!keep && fstatat(dirfd(d), de->d_name, &sb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(sb.st_mode) &&
            sb.st_uid == owner)
            unlinkat(dirfd(d), de->d_name, 0);
    }
    closedir(d);
}

static int cmp_meta_key(const void *a, const void *b)
{
    return strcmp((*(const ts_ckpt_meta *const *)a)->key, (*(const ts_ckpt_meta *const *)b)->key);
}

/* The metadata pairs given (ts_ckpt_meta): a count and a list that agree,
 * no NULL or empty key, no NULL value, no key twice, and (reserved: a
 * sharded save's files) not our own record's key. UTF-8 is checked where
 * the strings become JSON. */
static ts_status ck_check_meta(const char *op, const ts_ckpt_meta *meta, int n_arg, bool reserved)
{
    int n = ck_meta_count(meta, n_arg);
    if (n_arg == TS_CKPT_META_END && meta && n < 0)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the metadata list has no {NULL, NULL} end within %d pairs", op,
                        TS_CKPT_META_MAX);
    if (n < 0 || (n > 0 && !meta))
        return ts_error(TS_ERR_INVALID_ARGUMENT,
                        "%s: %d metadata pairs with %s list (a count, or TS_CKPT_META_END for a list ended by {NULL, "
                        "NULL})",
                        op, n_arg, meta ? "a" : "a NULL");
    for (int i = 0; i < n; i++) {
        if (!meta[i].key || !meta[i].value)
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: metadata pair %d of %d has a NULL %s", op, i, n,
                            meta[i].key ? "value" : "key");
        if (!meta[i].key[0])
            return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: metadata pair %d of %d has an empty key", op, i, n);
        if (reserved && !strcmp(meta[i].key, CK_META_KEY))
            return ts_error(TS_ERR_INVALID_ARGUMENT,
                            "%s: metadata pair %d has the key '" CK_META_KEY "', reserved for the checkpoint's own "
                            "record in every file",
                            op, i);
    }
    if (n < 2) return TS_OK;
    const ts_ckpt_meta **by_key = ts__malloc(TS_MEM_OTHER, (size_t)n * sizeof *by_key);
    if (!by_key) return TS_ERR_NO_MEMORY;
    for (int i = 0; i < n; i++) by_key[i] = &meta[i];
    qsort(by_key, (size_t)n, sizeof *by_key, cmp_meta_key);
    ts_status st = TS_OK;
    for (int i = 1; i < n && !st; i++)
        if (!strcmp(by_key[i - 1]->key, by_key[i]->key)) {
            int a = (int)(by_key[i - 1] - meta), b = (int)(by_key[i] - meta);
            st = ts_error(TS_ERR_INVALID_ARGUMENT, "%s: metadata pairs %d and %d both have the key '%.*s'", op,
                          a < b ? a : b, a < b ? b : a, CK_SHOWN, by_key[i]->key);
        }
    ts__free(TS_MEM_OTHER, by_key);
    return st;
}

/* TS_ERR_STATE naming the first tensor of model (parameters and buffers,
 * state-dict order) on the meta device: it has no values to save. */
static ts_status ck_check_materialized(const char *op, ts_module *model)
{
    ts_named_params np = {0};
    ts_status st = ts_module_named_tensors(model, &np); /* the first meta name is the same with or without the
                                                             tied duplicates: a duplicate follows its first name */
    for (int i = 0; i < np.n && !st; i++)
        if (ts_tensor_is_meta(*np.items[i].slot))
            st = ts_error(TS_ERR_STATE,
                          "%s: '%s' is on the meta device: call ts_fsdp_materialize (or load a checkpoint) first", op,
                          np.items[i].name);
    ts_named_params_free(&np);
    return st;
}

static ts_status ck_check_common(const char *op, const char *dir, ts_module *model, const ts_ckpt_options *o)
{
    if (!dir || !model) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op);
    if (!dir[0]) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: the folder name is empty", op);
    return o ? ck_check_meta(op, o->metadata, o->n_metadata, true) : TS_OK;
}

ts_status ts_ckpt_save(const char *dir, ts_module *model, const ts_ckpt_options *options)
{
    ck_ctx c = {.op = "ts_ckpt_save", .model = model, .o = options};
    ts_status st = ck_check_common(c.op, dir, model, options);
    if (!st) st = ck_check_materialized(c.op, model); /* a model on the meta device has no values */
    if (st) return st;
    st = ck_collect(&c, false);
    if (!c.world) { /* the groups could not be listed: nothing collective is possible */
        ck_ctx_fini(&c);
        return st;
    }
    if (!st && c.rank == 0) st = ck_mkdir(c.op, dir);
    int lock_fd = -1;
    if (!st && c.rank == 0) st = ck_lock(c.op, dir, &lock_fd);
    /* agree, and take rank 0's id for this save's file names */
    int64_t id = 0;
    if (!st && c.rank == 0) {
        uint64_t r = 0;
        st = ck_random_id(&r);
        id = (int64_t)r;
    }
    if (c.W > 1 || st) st = ck_agree(&c, st, &id);
    bool wrote = false;
    if (!st) {
        crash_point("file_begin", c.rank);
        st = ck_write_rank_file(&c, dir, (uint64_t)id, &wrote);
        if (!st) crash_point("file_done", c.rank);
    }
    st = ck_agree(&c, st, NULL);
    int64_t n_wrote = wrote;
    if (!st) st = ck_sum(&c, &n_wrote);
    /* rank 0: the index; tell the others whether it is in place */
    int64_t renamed = 0;
    json_t *index = NULL;
    if (!st && c.rank == 0) {
        bool rn = false;
        st = ck_build_index(&c, dir, (uint64_t)id, &index);
        /* every file written must be in it, and it must be a whole checkpoint (a rank given another folder
         * wrote its file there: rank 0 does not see it) */
        size_t seen = index ? json_array_size(json_object_get(index, "files")) : 0;
        if (!st && (int64_t)seen != n_wrote)
            st = ts_error(TS_ERR_STATE,
                          "%s: %lld ranks wrote a file but rank 0 finds %zu in '%s': every rank must be given the same "
                          "folder (on a file system every rank sees); the previous checkpoint is kept",
                          c.op, (long long)n_wrote, seen, dir);
        if (!st) st = ck_validate_index(&c, dir, index);
        if (!st) st = ck_commit_index(&c, dir, index, &rn);
        renamed = rn;
    }
    if (c.W > 1) {
        ts_status s2 = ck_agree(&c, st, &renamed);
        if (!st) st = s2;
    }
    if (st && !renamed && wrote) { /* the old index stays: our new file is garbage */
        char name[64];
        rank_file_name(name, sizeof name, c.rank, (uint64_t)id);
        char *path = path_join(dir, name);
        if (path) unlink(path);
        ts__free(TS_MEM_OTHER, path);
    }
    if (!st && c.rank == 0) {
        crash_point("dir_synced", c.rank);
        ck_cleanup(dir, index);
        crash_point("cleaned", c.rank);
    }
    json_decref(index);
    if (lock_fd >= 0) close(lock_fd); /* releases the lock */
    ck_ctx_fini(&c);
    return st;
}

/* ------------------------------------------------------------ load */

typedef struct ck_reader {
    const char *op;
    const char *dir;
    const ts__ckpt_index *ix;
    int *fds;                    /* per file, -1 until opened */
    ts_safetensors_header *hdrs; /* per file, read when opened */
    uint64_t bytes;
} ck_reader;

/* The file's own record (its "ts_ckpt" metadata: the world, rank and
 * save id it was written by) agrees with the index: an index whose
 * "world" or file list was edited, or a rank file of another save, is
 * refused before any of its bytes are used. */
static ts_status ck_check_file_desc(ck_reader *r, int f, const char *path)
{
    const ts__ckpt_file *fi = &r->ix->files[f];
    json_t *m = json_object_get(json_object_get(r->hdrs[f].root, "__metadata__"), CK_META_KEY);
    json_t *desc = json_is_string(m) ? json_loads(json_string_value(m), 0, NULL) : NULL;
    json_t *w = json_object_get(desc, "world"), *rk = json_object_get(desc, "rank"),
           *sid = json_object_get(desc, "save_id");
    ts_status st = TS_OK;
    if (!json_is_integer(w) || !json_is_integer(rk) || !json_is_string(sid))
        st = ts_error(TS_ERR_FORMAT,
                      "%s: '%s' lacks its " CK_META_KEY " record (\"world\", \"rank\", \"save_id\"): not a "
                      "file of a checkpoint",
                      r->op, path);
    else if (json_integer_value(w) != r->ix->world)
        st = ts_error(TS_ERR_FORMAT, "%s: the index's \"world\" is %d, but '%s' was written by a world of %lld", r->op,
                      r->ix->world, path, (long long)json_integer_value(w));
    else if (json_integer_value(rk) != fi->rank)
        st = ts_error(TS_ERR_FORMAT, "%s: the index gives '%s' \"rank\" %d, but rank %lld wrote it", r->op, path,
                      fi->rank, (long long)json_integer_value(rk));
    else if (strcmp(json_string_value(sid), r->ix->save_id) != 0)
        st = ts_error(TS_ERR_FORMAT, "%s: the index's \"save_id\" is '%.40s', but '%s' belongs to save '%.40s'", r->op,
                      r->ix->save_id, path, json_string_value(sid));
    json_decref(desc);
    return st;
}

static ts_status ck_open(ck_reader *r, int f)
{
    if (r->fds[f] >= 0) return TS_OK;
    char *path = path_join(r->dir, r->ix->files[f].name);
    if (!path) return TS_ERR_NO_MEMORY;
    ts_status st = TS_OK;
    int fd = ck_open_file(r->op, path, ", named by the index,", &st);
    if (fd >= 0 && !(st = ts_safetensors_header_read(r->op, path, fd, &r->hdrs[f]))) {
        if (r->hdrs[f].file_size != r->ix->files[f].size)
            st = ts_error(TS_ERR_FORMAT, "%s: '%s' has %llu bytes but the index records %llu (truncated or replaced)",
                          r->op, path, (unsigned long long)r->hdrs[f].file_size,
                          (unsigned long long)r->ix->files[f].size);
        if (!st) st = ck_check_file_desc(r, f, path);
        if (st) ts_safetensors_header_fini(&r->hdrs[f]);
    }
    ts__free(TS_MEM_OTHER, path);
    if (st) {
        if (fd >= 0) close(fd);
        return st;
    }
    r->fds[f] = fd;
    return TS_OK;
}

/* Checks a piece against its file's header: the same key, dtype, rows
 * and byte range. */
static ts_status ck_check_piece(ck_reader *r, const ts__ckpt_tensor *t, const ts__ckpt_piece *p)
{
    const ts_safetensors_header *h = &r->hdrs[p->file];
    for (size_t k = 0; k < h->n; k++) {
        const ts_safetensors_entry *e = &h->entries[k];
        if (strcmp(e->name, t->key)) continue;
        int64_t rows = e->ndim ? e->shape[0] : 1;
        bool same_cols = e->ndim == t->ndim;
        for (int d = 1; same_cols && d < e->ndim; d++) same_cols = e->shape[d] == t->shape[d];
        if (e->dtype != t->dtype || !same_cols || rows != p->rows || h->data_start + e->begin != p->offset ||
            e->end - e->begin != p->length)
            return ts_error(TS_ERR_FORMAT,
                            "%s: '%s/%s': tensor '%.*s' (%s, %lld rows, bytes [%llu, +%llu)) does not agree with the "
                            "index (%s, %lld rows, bytes [%llu, +%llu))",
                            r->op, r->dir, r->ix->files[p->file].name, CK_SHOWN, t->key,
                            ts_safetensors_dtype_name(e->dtype), (long long)rows,
                            (unsigned long long)(h->data_start + e->begin), (unsigned long long)(e->end - e->begin),
                            ts_safetensors_dtype_name(t->dtype), (long long)p->rows, (unsigned long long)p->offset,
                            (unsigned long long)p->length);
        return TS_OK;
    }
    return ts_error(TS_ERR_FORMAT, "%s: '%s/%s' holds no tensor '%.*s', which the index says it holds", r->op, r->dir,
                    r->ix->files[p->file].name, CK_SHOWN, t->key);
}

/* Reads rows [row0, row0 + rows) of t (whose rank_only >= 0: that rank's
 * piece) into dst (contiguous). */
static ts_status ck_read_rows(ck_reader *r, const ts__ckpt_tensor *t, int64_t row0, int64_t rows, int rank_only,
                              unsigned char *dst)
{
    int64_t got = 0;
    for (int k = 0; k < t->n_pieces; k++) {
        const ts__ckpt_piece *p = &t->pieces[k];
        if (rank_only >= 0 && p->rank != rank_only) continue;
        int64_t a = row0 > p->row ? row0 : p->row, b = row0 + rows < p->row + p->rows ? row0 + rows : p->row + p->rows;
        if (a >= b) continue;
        ts_status st = ck_open(r, p->file);
        if (!st) st = ck_check_piece(r, t, p);
        size_t n = (size_t)((uint64_t)(b - a) * t->row_bytes);
        char what[CK_SHOWN + 40];
        snprintf(what, sizeof what, "rows of '%.*s'", CK_SHOWN, t->key);
        if (!st && n)
            st = ts_safetensors_read_at(r->op, r->ix->files[p->file].name, r->fds[p->file],
                                        dst + (uint64_t)(a - row0) * t->row_bytes, n,
                                        p->offset + (uint64_t)(a - p->row) * t->row_bytes, what);
        /* a piece read whole is checked against its checksum (a piece read in part, when
         * resharding, is not: that would need the rest of its bytes) */
        if (!st && n && p->has_hash && a == p->row && b == p->row + p->rows) {
            uint64_t h = ts__ckpt_hash(dst + (uint64_t)(a - row0) * t->row_bytes, n);
            if (h != p->hash)
                st =
                    ts_error(TS_ERR_FORMAT,
                             "%s: '%s/%s': the %zu bytes of '%.*s' (rows [%lld, %lld), at byte %llu) have checksum "
                             "%016llx, but the index records %016llx: the file is corrupted",
                             r->op, r->dir, r->ix->files[p->file].name, n, CK_SHOWN, t->key, (long long)a, (long long)b,
                             (unsigned long long)p->offset, (unsigned long long)h, (unsigned long long)p->hash);
        }
        if (st) return st;
        r->bytes += n;
        got += b - a;
    }
    if (got != rows && t->row_bytes)
        return ts_error(TS_ERR_FORMAT, "%s: the checkpoint holds %lld of the %lld rows of '%.*s' this rank needs",
                        r->op, (long long)got, (long long)rows, CK_SHOWN, t->key);
    return TS_OK;
}

static void append(char *buf, size_t cap, const char *fmt, const char *a, const char *b, const char *c2)
{
    size_t n = strlen(buf);
    if (n + 1 < cap) snprintf(buf + n, cap - n, fmt, a, b, c2);
}

#define shape_str ts_shape_str

ts_status ts_ckpt_load(const char *dir, ts_module *model, const ts_ckpt_options *options, ts_ckpt_info *info_out)
{
    ck_ctx c = {.op = "ts_ckpt_load", .model = model, .o = options};
    ts_status st = ck_check_common(c.op, dir, model, options);
    if (st) return st;
    bool strict = options ? options->strict : true;
    st = ck_collect(&c, true);
    if (!c.world) {
        ck_ctx_fini(&c);
        return st;
    }
    if (!st) st = ts_fsdp_reshard_tree(model);
    ts__ckpt_index *ix = NULL;
    if (!st) st = ck_load_index(c.op, dir, &ix);
    ts_optim *o = options ? options->optim : NULL;
    if (!st && o && ix->has_optim && strcmp(ix->optim_kind, ts_optim_kind_name(o)) != 0)
        st = ts_error(TS_ERR_INVALID_ARGUMENT,
                      "%s: '%s' holds the state of a %.40s optimizer; the optimizer given is %s", c.op, dir,
                      ix->optim_kind, ts_optim_kind_name(o));
    if (!st && o && !ix->has_optim && strict)
        st = ts_error(TS_ERR_NOT_FOUND,
                      "%s: '%s' holds no optimizer state (saved without one); load with strict false "
                      "to load the model only",
                      c.op, dir);
    bool same_world = ix && ix->world == c.W;
    /* match keys; shapes, then dtypes, then (strict) missing and unexpected keys */
    char shapes[1024] = "", dtypes[1024] = "", missing[1024] = "", unexpected[1024] = "";
    const ts__ckpt_tensor **found = NULL;
    if (!st && c.items.n && !(found = ts__calloc(TS_MEM_OTHER, (size_t)c.items.n, sizeof *found)))
        st = TS_ERR_NO_MEMORY;
    for (int i = 0; i < c.items.n && !st; i++) {
        ck_item *it = &c.items.it[i];
        const ts__ckpt_tensor *t = ts__ckpt_index_find(ix, it->key);
        if (it->kind == TS__CKPT_OPTIM && !ix->has_optim) continue;
        if (it->kind == TS__CKPT_RANK_EXTRA && !same_world) continue;
        if (!t || t->kind != it->kind) {
            /* an optimizer parameter without any saved state had no state at save: it keeps none */
            bool any = false;
            if (it->kind == TS__CKPT_OPTIM) {
                const char *names[4];
                int ns = ts_optim_num_states(o);
                for (int s = 0; s < ns; s++) names[s] = ts_optim_state_name(o, s);
                const char *dot = strrchr(it->key, '.');
                for (int s = 0; s < ns && !any; s++) {
                    char k2[CK_FQN_MAX + 64];
                    snprintf(k2, sizeof k2, "%.*s.%s", (int)(dot - it->key), it->key, names[s]);
                    any = ts__ckpt_index_find(ix, k2) != NULL;
                }
                if (!any) continue;
            }
            append(missing, sizeof missing, " '%s'%s%s", it->key, "", "");
            continue;
        }
        char a[128], b[128];
        if (t->ndim != it->ndim || memcmp(t->shape, it->shape, (size_t)t->ndim * sizeof(int64_t)) != 0)
            append(shapes, sizeof shapes, " '%s' is %s in the checkpoint, %s here;", it->key,
                   shape_str(t->ndim, t->shape, a, sizeof a), shape_str(it->ndim, it->shape, b, sizeof b));
        else if (t->dtype != it->dtype)
            append(dtypes, sizeof dtypes, " '%s' is %s in the checkpoint, %s here;", it->key, ts_dtype_name(t->dtype),
                   ts_dtype_name(it->dtype));
        else found[i] = t;
        if (it->kind == TS__CKPT_RANK_EXTRA) {
            bool mine = false;
            for (int k = 0; k < t->n_pieces; k++) mine |= t->pieces[k].rank == c.rank;
            if (!mine) {
                found[i] = NULL;
                append(missing, sizeof missing, " '%s' (of rank %s)%s", it->key, c.rank == 0 ? "0" : "this", "");
            }
        }
    }
    /* model keys of the checkpoint the model does not have */
    for (int k = 0; !st && k < ix->n_tensors; k++) {
        const ts__ckpt_tensor *t = &ix->tensors[k];
        if (t->kind != TS__CKPT_MODEL) continue;
        bool have = false;
        for (int i = 0; i < c.items.n && !have; i++) have = !strcmp(c.items.it[i].key, t->key);
        if (!have) append(unexpected, sizeof unexpected, " '%s'%s%s", t->key, "", "");
    }
    if (!st && *shapes) st = ts_error(TS_ERR_SHAPE, "%s: '%s': shape mismatch:%s", c.op, dir, shapes);
    if (!st && *dtypes) st = ts_error(TS_ERR_DTYPE, "%s: '%s': dtype mismatch:%s", c.op, dir, dtypes);
    if (!st && strict && (*missing || *unexpected))
        st = ts_error(TS_ERR_NOT_FOUND, "%s: '%s': missing keys:%s; unexpected keys:%s", c.op, dir,
                      *missing ? missing : " none", *unexpected ? unexpected : " none");
    /* read this rank's rows into temporaries */
    ck_reader rd = {.op = c.op, .dir = dir, .ix = ix};
    if (!st && ix->n_files) {
        rd.fds = ts__malloc(TS_MEM_OTHER, (size_t)ix->n_files * sizeof *rd.fds);
        rd.hdrs = ts__calloc(TS_MEM_OTHER, (size_t)ix->n_files, sizeof *rd.hdrs);
        if (!rd.fds || !rd.hdrs) st = TS_ERR_NO_MEMORY;
        for (int f = 0; rd.fds && f < ix->n_files; f++) rd.fds[f] = -1;
    }
    for (int i = 0; i < c.items.n && !st; i++) {
        ck_item *it = &c.items.it[i];
        const ts__ckpt_tensor *t = found[i];
        if (!t) continue;
        int64_t shape[TS_MAX_DIMS];
        memcpy(shape, it->shape, sizeof shape);
        if (it->ndim) shape[0] = it->rows;
        if ((st = ts_tensor_new_cpu(false, it->dtype, it->ndim, shape, &it->tmp))) break;
        st = ck_read_rows(&rd, t, it->row0, it->rows, it->kind == TS__CKPT_RANK_EXTRA ? c.rank : -1,
                          ts_tensor_data(it->tmp));
    }
    for (int f = 0; rd.fds && f < ix->n_files; f++)
        if (rd.fds[f] >= 0) {
            close(rd.fds[f]);
            ts_safetensors_header_fini(&rd.hdrs[f]);
        }
    ts__free(TS_MEM_OTHER, rd.fds);
    ts__free(TS_MEM_OTHER, rd.hdrs);
    st = ck_agree(&c, st, NULL);
    /* a model on the meta device (deferred init) gets its bytes here,
     * without running its initializers: the checkpoint gives the values */
    if (!st) st = ts_fsdp_materialize_empty(model);
    /* every rank read everything: copy in */
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < c.items.n && !st; i++) {
        ck_item *it = &c.items.it[i];
        if (!it->tmp) continue;
        ts_tensor *dst = it->t, *lv = NULL;
        if (it->kind == TS__CKPT_OPTIM && (st = ts_optim_state_create(o, it->opt_index, it->opt_state, &dst))) break;
        if (!(st = ts_tensor_local_view(dst, &lv))) st = ts_tensor_copy_(lv, it->tmp);
        ts_tensor_free(lv);
    }
    ts_grad_mode_set(prev);
    if (!st && o && ix->has_optim) (void)ts_optim_set_step_count(o, ix->optim_steps); /* >= 0: the index checked it */
    if (!st && info_out)
        *info_out = (ts_ckpt_info){.saved_world = ix->world,
                                   .loaded_world = c.W,
                                   .rank_extra_loaded = same_world && options && options->rank_extra,
                                   .optim_steps = ix->has_optim ? ix->optim_steps : 0,
                                   .bytes_read = rd.bytes};
    ts__free(TS_MEM_OTHER, found);
    ts__ckpt_index_free(ix);
    ck_ctx_fini(&c);
    return st;
}

ts_status ts_ckpt_metadata(const char *dir, const char *key, char **value_out)
{
    static const char op[] = "ts_ckpt_metadata";
    if (!dir || !key || !value_out) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", op);
    ts__ckpt_index *ix = NULL;
    ts_status st = ck_load_index(op, dir, &ix);
    if (st) return st;
    const json_t *v = ix->metadata ? json_object_get(ix->metadata, key) : NULL;
    if (!v) st = ts_error(TS_ERR_NOT_FOUND, "%s: '%s' has no metadata key '%.*s'", op, dir, CK_SHOWN, key);
    char *s = NULL;
    if (!st) s = strdup(json_string_value(v)); /* libc: the caller free()s it (checkpoint.h) */
    if (!st && !s) st = TS_ERR_NO_MEMORY;
    ts__ckpt_index_free(ix);
    if (!st) *value_out = s;
    return st;
}

/* ------------------------------------------------------------ full files */

ts_status ts_ckpt_save_full(const char *path, ts_module *model, const ts_ckpt_meta *metadata, int n_metadata)
{
    ck_ctx c = {.op = "ts_ckpt_save_full", .model = model};
    if (!path || !model) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", c.op);
    ts_status mat = ck_check_materialized(c.op, model); /* a model on the meta device has no values */
    if (mat) return mat;
    /* checked on every rank; a rank's bad list fails every rank at the first agreement below */
    ts_status mst = ck_check_meta(c.op, metadata, n_metadata, false);
    if (!mst) n_metadata = ck_meta_count(metadata, n_metadata); /* TS_CKPT_META_END: the pairs before the end */
    char why[512] = "";
    if (mst) snprintf(why, sizeof why, "%s", ts_last_error());
    ts_status st = ck_collect(&c, false);
    if (!c.world) {
        ck_ctx_fini(&c);
        return mst ? ts_error(mst, "%s", why) : st;
    }
    if (!st && mst) st = ts_error(mst, "%s", why);
    /* rank 0 writes the header of every tensor, then streams them in */
    ts_safetensors_writer *s = NULL;
    ts_safetensors_desc *descs = NULL;
    if (!st && c.rank == 0) {
        if (c.items.n && !(descs = ts__calloc(TS_MEM_OTHER, (size_t)c.items.n, sizeof *descs))) st = TS_ERR_NO_MEMORY;
        for (int i = 0; !st && i < c.items.n; i++)
            descs[i] = (ts_safetensors_desc){c.items.it[i].key, c.items.it[i].dtype, c.items.it[i].ndim,
                                             c.items.it[i].shape, NULL};
        const char **flat = NULL; /* the pairs as safetensors takes them: key, value, key, ... */
        if (!st && n_metadata && !(flat = ts__calloc(TS_MEM_OTHER, 2 * (size_t)n_metadata, sizeof *flat)))
            st = TS_ERR_NO_MEMORY;
        for (int i = 0; !st && i < n_metadata; i++) {
            flat[2 * i] = metadata[i].key;
            flat[2 * i + 1] = metadata[i].value;
        }
        if (!st) st = ts_safetensors_writer_open(c.op, path, c.items.n, descs, flat, n_metadata, &s);
        ts__free(TS_MEM_OTHER, flat);
        ts__free(TS_MEM_OTHER, descs);
    }
    st = ck_agree(&c, st, NULL);
    ts_status wst = TS_OK; /* rank 0's write status: it keeps receiving after a failed write */
    for (int i = 0; i < c.items.n && !st; i++) {
        ck_item *it = &c.items.it[i];
        ts_tensor *lv = NULL, *full = NULL;
        if (!it->sharded) {
            if (c.rank == 0 && !wst && !(wst = ts_tensor_local_view(it->t, &lv)))
                wst = ts_safetensors_writer_put(s, lv);
            ts_tensor_free(lv);
            continue;
        }
        const ts_fsdp_shard_info *sh = &it->sh;
        if (sh->replicate_group && ts_comm_rank(sh->replicate_group) != 0) continue; /* HSDP: replica 0 sends */
        ts_comm *pg = sh->shard_group;
        int pr = ts_comm_rank(pg), pw = ts_comm_size(pg);
        if (pr != 0) { /* this rank's rows to the shard group's rank 0, which is world rank 0 */
            if (it->rows > 0 && !(st = ts_tensor_local_view(it->t, &lv))) st = ts_send(pg, lv, 0, i, NULL);
            ts_tensor_free(lv);
            continue;
        }
        if ((st = ts_tensor_new_cpu(false, it->dtype, it->ndim, it->shape, &full))) break;
        for (int r = 0; r < pw && !st; r++) {
            int64_t row0 = 0, nrows = 0;
            ck_chunk(sh, r, &row0, &nrows);
            if (nrows == 0) continue;
            ts_tensor *rows = NULL;
            if (!(st = ts_narrow(full, 0, row0, nrows, &rows))) {
                if (r == 0) {
                    if (!(st = ts_tensor_local_view(it->t, &lv))) st = ts_tensor_copy_(rows, lv);
                    ts_tensor_free(lv);
                    lv = NULL;
                } else {
                    st = ts_recv(pg, rows, r, i, NULL);
                }
            }
            ts_tensor_free(rows);
        }
        if (!st && !wst) wst = ts_safetensors_writer_put(s, full);
        ts_tensor_free(full);
    }
    if (c.rank == 0 && s) {
        if (!st && !wst) wst = ts_safetensors_writer_commit(s);
        else ts_safetensors_writer_abort(s);
    }
    if (!st) st = wst;
    st = ck_agree(&c, st, NULL);
    ck_ctx_fini(&c);
    return st;
}

static int cmp_entry_name(const void *a, const void *b)
{
    return strcmp((*(const ts_safetensors_entry *const *)a)->name, (*(const ts_safetensors_entry *const *)b)->name);
}

ts_status ts_ckpt_load_full(const char *path, ts_module *model, bool strict)
{
    ck_ctx c = {.op = "ts_ckpt_load_full", .model = model};
    if (!path || !model) return ts_error(TS_ERR_INVALID_ARGUMENT, "%s: NULL argument", c.op);
    ts_status st = ck_collect(&c, true);
    if (!st) st = ts_fsdp_reshard_tree(model);
    int fd = -1;
    ts_safetensors_header h = {0};
    bool have_h = false;
    if (!st && (fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK)) < 0)
        st = ts_error(TS_ERR_IO, "%s: cannot open '%s': %s", c.op, path, strerror(errno));
    if (!st) have_h = !(st = ts_safetensors_header_read(c.op, path, fd, &h));
    /* the file's names, sorted, for lookups */
    const ts_safetensors_entry **byname = NULL;
    if (!st && h.n && !(byname = ts__malloc(TS_MEM_OTHER, h.n * sizeof *byname))) st = TS_ERR_NO_MEMORY;
    for (size_t k = 0; !st && k < h.n; k++) byname[k] = &h.entries[k];
    if (!st && h.n > 1) qsort(byname, h.n, sizeof *byname, cmp_entry_name);
    const ts_safetensors_entry **found = NULL;
    if (!st && c.items.n && !(found = ts__calloc(TS_MEM_OTHER, (size_t)c.items.n, sizeof *found)))
        st = TS_ERR_NO_MEMORY;
    char shapes[1024] = "", dtypes[1024] = "", missing[1024] = "", unexpected[1024] = "";
    for (int i = 0; i < c.items.n && !st; i++) {
        ck_item *it = &c.items.it[i];
        ts_safetensors_entry probe = {.name = it->key};
        const ts_safetensors_entry *pp = &probe,
                                   **e = h.n ? bsearch(&pp, byname, h.n, sizeof *byname, cmp_entry_name) : NULL;
        if (!e) {
            append(missing, sizeof missing, " '%s'%s%s", it->key, "", "");
            continue;
        }
        char a[128], b[128];
        if ((*e)->ndim != it->ndim || memcmp((*e)->shape, it->shape, (size_t)it->ndim * sizeof(int64_t)) != 0)
            append(shapes, sizeof shapes, " '%s' is %s in the file, %s in the model;", it->key,
                   shape_str((*e)->ndim, (*e)->shape, a, sizeof a), shape_str(it->ndim, it->shape, b, sizeof b));
        else if ((*e)->dtype != it->dtype)
            append(dtypes, sizeof dtypes, " '%s' is %s in the file, %s in the model;", it->key,
                   ts_dtype_name((*e)->dtype), ts_dtype_name(it->dtype));
        else found[i] = *e;
    }
    for (size_t k = 0; !st && k < h.n; k++) {
        bool have = false;
        for (int i = 0; i < c.items.n && !have; i++) have = !strcmp(c.items.it[i].key, h.entries[k].name);
        if (!have) append(unexpected, sizeof unexpected, " '%s'%s%s", h.entries[k].name, "", "");
    }
    if (!st && *shapes) st = ts_error(TS_ERR_SHAPE, "%s: '%s':%s", c.op, path, shapes);
    if (!st && *dtypes)
        st = ts_error(TS_ERR_DTYPE, "%s: '%s': dtype mismatch:%s convert the file's tensors first", c.op, path, dtypes);
    if (!st && strict && (*missing || *unexpected))
        st = ts_error(TS_ERR_NOT_FOUND, "%s: '%s': missing keys:%s; unexpected keys:%s", c.op, path,
                      *missing ? missing : " none", *unexpected ? unexpected : " none");
    /* a model on the meta device (deferred init) gets its bytes here,
     * without running its initializers: the file gives the values */
    if (!st) st = ts_fsdp_materialize_empty(model);
    /* one tensor at a time: this rank's rows into a temporary, then in */
    bool prev = ts_grad_mode_set(false);
    for (int i = 0; i < c.items.n && !st; i++) {
        ck_item *it = &c.items.it[i];
        const ts_safetensors_entry *e = found[i];
        if (!e) continue;
        int64_t shape[TS_MAX_DIMS];
        memcpy(shape, it->shape, sizeof shape);
        if (it->ndim) shape[0] = it->rows;
        ts_tensor *tmp = NULL, *lv = NULL;
        if ((st = ts_tensor_new_cpu(false, it->dtype, it->ndim, shape, &tmp))) break;
        uint64_t total_rows = it->ndim ? (uint64_t)it->shape[0] : 1;
        uint64_t row_bytes = total_rows ? (e->end - e->begin) / total_rows : 0;
        size_t n = (size_t)(row_bytes * (uint64_t)it->rows);
        char what[CK_SHOWN + 40];
        snprintf(what, sizeof what, "rows of '%.*s'", CK_SHOWN, it->key);
        if (n)
            st = ts_safetensors_read_at(c.op, path, fd, ts_tensor_data(tmp), n,
                                        h.data_start + e->begin + row_bytes * (uint64_t)it->row0, what);
        if (!st && !(st = ts_tensor_local_view(it->t, &lv))) st = ts_tensor_copy_(lv, tmp);
        ts_tensor_free(lv);
        ts_tensor_free(tmp);
    }
    ts_grad_mode_set(prev);
    ts__free(TS_MEM_OTHER, found);
    ts__free(TS_MEM_OTHER, byname);
    if (have_h) ts_safetensors_header_fini(&h);
    if (fd >= 0) close(fd);
    ck_ctx_fini(&c);
    return st;
}
