/* Temporary files for atomic writes (base/base.h: Files).
 *
 * Every file the library writes atomically (safetensors files, a
 * checkpoint's rank files and index, the trace) is first created under a
 * name nobody can guess, with O_CREAT | O_EXCL | O_NOFOLLOW and mode 0600,
 * so that in a folder other users can write (a shared, sticky /tmp) a file
 * or symbolic link planted under the temporary's name is never opened,
 * truncated or written through: the create fails with EEXIST and the next
 * random name is tried. The caller writes, gives the file its final mode
 * (ts__file_mode), fsyncs, renames it over the target and removes it on
 * every failure path. */
#define _GNU_SOURCE
#include "base/base.h"
#include "base/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

static ts_status random_u64(const char *op, uint64_t *out)
{
    uint64_t v = 0;
    size_t got = 0;
    while (got < sizeof v) {
        ssize_t r = getrandom((char *)&v + got, sizeof v - got, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0)
            return ts_error(TS_ERR_IO, "%s: getrandom for a temporary file name failed: %s", op, strerror(errno));
        got += (size_t)r;
    }
    *out = v;
    return TS_OK;
}

ts_status ts__tmp_create(ts_mem_tag tag, const char *op, const char *dir, const char *base, const char *target,
                         char **tmp_out, int *fd_out)
{
    if (!op || !dir || !base || !target || !tmp_out || !fd_out)
        return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__tmp_create: NULL argument");
    size_t tlen = strlen(dir) + strlen(base) + 64;
    char *tmp = ts__malloc(tag, tlen);
    if (!tmp) return TS_ERR_NO_MEMORY;
    for (int attempt = 0; attempt < 16; attempt++) {
        uint64_t r = 0;
        ts_status st = random_u64(op, &r);
        if (st) {
            ts__free(tag, tmp);
            return st;
        }
        snprintf(tmp, tlen, "%s/.%s" TS__TMP_INFIX "%ld.%016llx", dir, base, (long)getpid(), (unsigned long long)r);
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd >= 0) {
            *tmp_out = tmp;
            *fd_out = fd;
            return TS_OK;
        }
        if (errno != EEXIST) {
            ts_status e = ts_error(TS_ERR_IO, "%s: cannot create the temporary file '%s' for '%s': %s", op, tmp, target,
                                   strerror(errno));
            ts__free(tag, tmp);
            return e;
        }
    }
    ts__free(tag, tmp);
    return ts_error(TS_ERR_IO, "%s: 16 random temporary file names for '%s' in '%s' all exist", op, target, dir);
}

ts_status ts__tmp_create_beside(ts_mem_tag tag, const char *op, const char *path, char **tmp_out, int *fd_out)
{
    if (!op || !path) return ts_error(TS_ERR_INVALID_ARGUMENT, "ts__tmp_create_beside: NULL argument");
    const char *slash = strrchr(path, '/');
    char dir[4096];
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    return ts__tmp_create(tag, op, dir, slash ? slash + 1 : path, path, tmp_out, fd_out);
}

/* The umask is read from /proc/self/status: umask() itself would change
 * it for every thread for a moment. 022 if it cannot be read. */
unsigned ts__file_mode(unsigned max_mode)
{
    unsigned mask = 022;
    FILE *f = fopen("/proc/self/status", "re");
    if (f) {
        char line[128];
        while (fgets(line, sizeof line, f)) {
            unsigned m;
            if (sscanf(line, "Umask: %o", &m) == 1) {
                mask = m & 0777;
                break;
            }
        }
        fclose(f);
    }
    return max_mode & 0777 & ~mask;
}
