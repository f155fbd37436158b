#define _GNU_SOURCE
/*
 * Cross-memory reads and the same-host probe (xmem.h). Calls only libc
 * and ts__host_parts (comm/launch_env.c).
 */
#include "comm/xmem.h"

#include "comm/comm_internal.h" /* ts__host_parts */

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ------------------------------------------------------------ reads */

/* Consumes `bytes` from the list v from entry i on; returns the first
 * entry with bytes left. */
static size_t iov_advance(struct iovec *v, size_t i, size_t bytes)
{
    while (bytes) {
        size_t k = bytes < v[i].iov_len ? bytes : v[i].iov_len;
        v[i].iov_base = (char *)v[i].iov_base + k;
        v[i].iov_len -= k;
        bytes -= k;
        if (!v[i].iov_len) i++;
    }
    return i;
}

int ts__xmem_readv(pid_t pid, struct iovec *l, size_t nl, struct iovec *rv, size_t nr, size_t *done_out)
{
    size_t li = 0, ri = 0, done = 0;
    int e = 0;
    while (li < nl && ri < nr) {
        if (!l[li].iov_len) {
            li++;
            continue;
        }
        if (!rv[ri].iov_len) {
            ri++;
            continue;
        }
        size_t ln = nl - li < IOV_MAX ? nl - li : IOV_MAX, rn = nr - ri < IOV_MAX ? nr - ri : IOV_MAX;
        ssize_t n = process_vm_readv(pid, l + li, ln, rv + ri, rn, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            e = errno;
            break;
        }
        if (n == 0) {
            e = EIO;
            break;
        }
        done += (size_t)n;
        li = iov_advance(l, li, (size_t)n);
        ri = iov_advance(rv, ri, (size_t)n);
    }
    if (done_out) *done_out = done;
    return e;
}

int ts__xmem_read(pid_t pid, void *dst, uint64_t addr, size_t len)
{
    struct iovec l = {dst, len}, rv = {(void *)(uintptr_t)addr, len};
    return ts__xmem_readv(pid, &l, 1, &rv, 1, NULL);
}

/* ------------------------------------------------------------ the probe */

/* Not the host name: two network namespaces of one machine
 * (scripts/netns_hosts.sh), containers and cloned machines share theirs.
 * The boot id tells kernels apart, the pid namespace says whether the
 * peer's pid means the same process here, and (TS_HOST_ID_NET) the
 * network namespace makes each address a host of its own, as the
 * launcher sees it (nodes with their own --master-addr), so that traffic
 * between them goes over the network as it would between machines. */
void ts__host_id(ts_host_id_kind kind, char *out, size_t n)
{
    char boot[64], pidns[64], netns[64];
    ts__host_parts(boot, sizeof boot, pidns, sizeof pidns, netns, sizeof netns);
    if (kind == TS_HOST_ID_PIDS) {
        for (char *p = pidns; *p; p++)
            if (*p == ' ') *p = '_';
        snprintf(out, n, "%s/%s", boot, pidns);
        return;
    }
    memset(out, 0, n);
    /* "pid:[4026531836]" -> "4026531836" */
    const char *p = strchr(pidns, '['), *q = strchr(netns, '[');
    snprintf(out, n, "%.36s/%.*s/%.*s", boot, p ? (int)strcspn(p + 1, "]") : 1, p ? p + 1 : "?",
             q ? (int)strcspn(q + 1, "]") : 1, q ? q + 1 : "?");
}

bool ts__host_same(const char *mine, const char *peer, size_t n) { return strncmp(mine, peer, n) == 0; }

int ts__host_watch(pid_t pid) { return (int)syscall(SYS_pidfd_open, pid, 0); }
