/* The files a checkpoint save writes and a load reads, against another
 * user of a shared folder: the index's temporary file is never one another
 * uid planted (a file it owns, or a symbolic link), the files' modes are
 * 0644 at most under the umask, and a load refuses rank files or an index
 * that are symbolic links. The tests run as root: a planted file is given
 * to uid 65534 with fchown, in a sticky world-writable folder (mode 01777),
 * as in a shared /tmp. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/internal.h"
#include "tests/helpers.h"

#define OTHER_UID 65534

static char *tmp_dir(mode_t mode)
{
    char *d = th_tmp_dir("ts_ckpt_files");
    cr_assert_eq(chmod(d, mode), 0);
    return d;
}

/* Linear(4, 3), unsharded, on one rank. */
static ts_module *model_new(void)
{
    ts_module *m = NULL;
    TH_OK(ts_linear_new(4, 3, true, &m));
    return m;
}

/* The name of the first file of dir that starts with prefix, or "". */
static void find_file(const char *dir, const char *prefix, char *out, size_t cap)
{
    out[0] = '\0';
    DIR *d = opendir(dir);
    cr_assert(d);
    struct dirent *de;
    while ((de = readdir(d)))
        if (!strncmp(de->d_name, prefix, strlen(prefix))) {
            snprintf(out, cap, "%s", de->d_name);
            break;
        }
    closedir(d);
}

/* Files of dir whose name contains ".tmp." (temporaries of a save). */
static int count_tmp(const char *dir, const char *except)
{
    int n = 0;
    DIR *d = opendir(dir);
    cr_assert(d);
    struct dirent *de;
    while ((de = readdir(d))) n += strstr(de->d_name, ".tmp.") && (!except || strcmp(de->d_name, except));
    closedir(d);
    return n;
}

/* ------------------------------------------------------------ the index's temporary */

/* What the hook plants, after rank 0's file is durable and before the
 * index is written: under the name the index's temporary had
 * (".index.json.tmp.<save id>", the save id read from the rank file's
 * name), a file of another uid, mode 0666, or a symbolic link to a file
 * outside the folder. */
static const char *g_dir;
static bool g_plant_link;
static const char *g_link_target;
static char g_planted[600];
static ino_t g_planted_ino;

static void plant_hook(const char *point, int rank)
{
    if (strcmp(point, "file_done") || rank != 0) return;
    char rf[300];
    find_file(g_dir, "rank00000-", rf, sizeof rf);
    cr_assert(rf[0], "no rank file in '%s' at file_done", g_dir);
    char id[17];
    cr_assert_eq(sscanf(rf, "rank00000-%16[0-9a-f].safetensors", id), 1, "%s", rf);
    snprintf(g_planted, sizeof g_planted, "%s/.index.json.tmp.%s", g_dir, id);
    if (g_plant_link) {
        cr_assert_eq(symlink(g_link_target, g_planted), 0, "symlink: %s", strerror(errno));
    } else {
        int fd = open(g_planted, O_WRONLY | O_CREAT | O_EXCL, 0666);
        cr_assert(fd >= 0, "planting '%s': %s", g_planted, strerror(errno));
        cr_assert_eq(fchmod(fd, 0666), 0);
        cr_assert_eq(fchown(fd, OTHER_UID, OTHER_UID), 0, "fchown: %s", strerror(errno));
        struct stat sb;
        cr_assert_eq(fstat(fd, &sb), 0);
        g_planted_ino = sb.st_ino;
        close(fd);
    }
}

/* The index was written into a file another uid pre-created under its
 * predictable temporary name (".index.json.tmp.<save id>", the save id
 * public in the rank files' names), then renamed into place: index.json
 * belonged to that uid, mode 0666. Now the temporary's name is random and
 * created exclusively: index.json is the saver's, the planted file is
 * never written, and a planted symbolic link is never followed. */
Test(checkpoint_files, planted_index_temporary_is_never_written, .timeout = 60)
{
    char *ck = tmp_dir(01777), *outside = tmp_dir(0700), target[400];
    snprintf(target, sizeof target, "%s/root-only", outside);
    FILE *f = fopen(target, "w");
    cr_assert(f);
    fputs("root only\n", f);
    fclose(f);
    cr_assert_eq(chmod(target, 0600), 0);
    ts_module *m = model_new();
    g_dir = ck;
    g_link_target = target;
    ts__ckpt_crash_hook = plant_hook;
    for (int link = 0; link < 2; link++) {
        g_plant_link = link;
        g_planted[0] = '\0';
        TH_OK(ts_ckpt_save(ck, m, NULL));
        cr_assert(g_planted[0], "the hook did not run");
        char ip[600];
        snprintf(ip, sizeof ip, "%s/index.json", ck);
        struct stat sb, pb;
        cr_assert_eq(lstat(ip, &sb), 0);
        cr_assert(S_ISREG(sb.st_mode), "index.json is not a regular file");
        cr_assert_eq(sb.st_uid, getuid(), "index.json belongs to uid %u, not the saver's %u", (unsigned)sb.st_uid,
                     (unsigned)getuid());
        cr_assert_eq(sb.st_mode & 07777, 0644 & ~(mode_t)022, "index.json has mode %o", (unsigned)(sb.st_mode & 07777));
        /* the planted file or link is as planted: not written, not renamed away, not removed */
        cr_assert_eq(lstat(g_planted, &pb), 0, "the planted '%s' is gone", g_planted);
        if (link) {
            cr_assert(S_ISLNK(pb.st_mode));
        } else {
            cr_assert_neq(sb.st_ino, g_planted_ino, "index.json is the planted inode");
            cr_assert_eq(pb.st_size, 0, "the planted file holds %lld bytes", (long long)pb.st_size);
            cr_assert_eq(pb.st_uid, OTHER_UID);
        }
        char buf[64] = "";
        f = fopen(target, "r");
        cr_assert(f);
        cr_assert(fgets(buf, sizeof buf, f));
        fclose(f);
        cr_assert_str_eq(buf, "root only\n", "the link's target was written: '%s'", buf);
        cr_assert_eq(count_tmp(ck, strrchr(g_planted, '/') + 1), 0, "temporaries left by the save");
        TH_OK(ts_ckpt_load(ck, m, NULL, NULL));
        unlink(g_planted);
    }
    ts__ckpt_crash_hook = NULL;
    ts_module_free(m);
    th_rm_rf(ck);
    th_rm_rf(outside);
    free(ck);
    free(outside);
}

/* A save that fails after the index's temporary was written (its rename
 * refused: a folder stands where index.json goes) leaves no temporary and
 * no rank file behind. */
static void block_hook(const char *point, int rank)
{
    (void)rank;
    if (strcmp(point, "index_synced")) return;
    char ip[600];
    snprintf(ip, sizeof ip, "%s/index.json", g_dir);
    cr_assert_eq(mkdir(ip, 0700), 0);
}

Test(checkpoint_files, failed_save_leaves_no_temporary, .timeout = 60)
{
    char *ck = tmp_dir(01777);
    ts_module *m = model_new();
    g_dir = ck;
    ts__ckpt_crash_hook = block_hook;
    cr_assert_eq(ts_ckpt_save(ck, m, NULL), TS_ERR_IO);
    ts__ckpt_crash_hook = NULL;
    cr_assert_eq(count_tmp(ck, NULL), 0, "temporaries left by the failed save");
    char rf[300];
    find_file(ck, "rank", rf, sizeof rf);
    cr_assert_str_empty(rf, "the failed save left '%s'", rf);
    ts_module_free(m);
    th_rm_rf(ck);
    free(ck);
}

/* ------------------------------------------------------------ modes */

static mode_t mode_of(const char *dir, const char *name)
{
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct stat sb;
    cr_assert_eq(stat(p, &sb), 0, "%s: %s", p, strerror(errno));
    return sb.st_mode & 07777;
}

/* Under umask 0 the rank files were 0666 (anyone could rewrite a
 * checkpoint): every file of a checkpoint is now 0644 at most under the
 * umask, the full file too; under umask 077 they are 0600. */
Test(checkpoint_files, modes_are_0644_at_most_under_the_umask, .timeout = 60)
{
    static const mode_t masks[2] = {0, 077}, want[2] = {0644, 0600};
    ts_module *m = model_new();
    for (int i = 0; i < 2; i++) {
        char *dir = tmp_dir(0700), ck[400], full[400];
        snprintf(ck, sizeof ck, "%s/ck", dir);
        snprintf(full, sizeof full, "%s/full.safetensors", dir);
        mode_t old = umask(masks[i]);
        ts_status st = ts_ckpt_save(ck, m, NULL);
        ts_status st2 = ts_ckpt_save_full(full, m, NULL, 0);
        umask(old);
        TH_OK(st);
        TH_OK(st2);
        char rf[300];
        find_file(ck, "rank00000-", rf, sizeof rf);
        cr_assert(rf[0]);
        cr_assert_eq(mode_of(ck, rf), want[i], "umask %03o: rank file mode %o", (unsigned)masks[i],
                     (unsigned)mode_of(ck, rf));
        cr_assert_eq(mode_of(ck, "index.json"), want[i], "umask %03o: index mode %o", (unsigned)masks[i],
                     (unsigned)mode_of(ck, "index.json"));
        cr_assert_eq(mode_of(dir, "full.safetensors"), want[i], "umask %03o: full file mode %o", (unsigned)masks[i],
                     (unsigned)mode_of(dir, "full.safetensors"));
        th_rm_rf(ck);
        th_rm_rf(dir);
        free(dir);
    }
    ts_module_free(m);
}

/* ------------------------------------------------------------ links on load */

/* A checkpoint is a folder of regular files: index.json or a rank file
 * replaced by a symbolic link (to the same bytes, elsewhere) loaded
 * through the link; now it is TS_ERR_IO saying so, and nothing changes. */
Test(checkpoint_files, symlinked_index_or_rank_file_is_refused, .timeout = 60)
{
    char *dir = tmp_dir(0700), ck[400];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    ts_module *m = model_new();
    TH_OK(ts_ckpt_save(ck, m, NULL));
    char rf[300];
    find_file(ck, "rank00000-", rf, sizeof rf);
    cr_assert(rf[0]);
    const char *names[2] = {"index.json", rf};
    for (int i = 0; i < 2; i++) {
        char in[700], out[700];
        snprintf(in, sizeof in, "%s/%s", ck, names[i]);
        snprintf(out, sizeof out, "%s/moved-%d", dir, i);
        cr_assert_eq(rename(in, out), 0);
        cr_assert_eq(symlink(out, in), 0);
        ts_status st = ts_ckpt_load(ck, m, NULL, NULL);
        cr_assert_eq(st, TS_ERR_IO, "a symlinked %s loaded: %s", names[i], ts_status_name(st));
        cr_assert(strstr(ts_last_error(), "symbolic link") && strstr(ts_last_error(), names[i]), "%s", ts_last_error());
        if (i == 0) {
            char *v = NULL;
            cr_assert_eq(ts_ckpt_metadata(ck, "x", &v), TS_ERR_IO);
            cr_assert(strstr(ts_last_error(), "symbolic link"), "%s", ts_last_error());
        }
        cr_assert_eq(unlink(in), 0);
        cr_assert_eq(rename(out, in), 0);
        TH_OK(ts_ckpt_load(ck, m, NULL, NULL));
    }
    ts_module_free(m);
    th_rm_rf(ck);
    th_rm_rf(dir);
    free(dir);
}
