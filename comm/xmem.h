/*
 * Cross-memory reads and the same-host probe (comm/xmem.c): the pieces
 * that the UCX transport's shared-memory bypass (comm/ucx_shm.c), the
 * direct collectives (comm/coll_direct.c) and the rendezvous of
 * ts_dist_init (comm/dist.c) share. Internal to comm/; never installed.
 *
 * A read goes through process_vm_readv: single copy, from another process
 * of this host that ptrace rules let this one read (same user, or
 * CAP_SYS_PTRACE; the same pid namespace).
 *
 * The probe: a process publishes its host id (ts__host_id) and pid; a
 * peer whose published id equals this process's own (ts__host_same) runs
 * on this host, in this pid namespace, so its pid names it here, and
 * ts__host_watch opens a pidfd on it (readable once it has exited).
 */
#ifndef TS_COMM_XMEM_H
#define TS_COMM_XMEM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

/* Reads the remote list rv (nr entries, addresses in process pid) into
 * the local list l (nl entries) of equal total length, IOV_MAX entries per
 * call, resuming after short reads and EINTR. Both lists are consumed
 * (advanced past what was read). Returns 0, or the errno of the call that
 * failed (EIO for a read of 0 bytes); *done_out (may be NULL) gets the
 * bytes read either way. */
int ts__xmem_readv(pid_t pid, struct iovec *l, size_t nl, struct iovec *rv, size_t nr, size_t *done_out);

/* Reads len bytes at addr of process pid into dst: ts__xmem_readv of one
 * entry each. Returns 0 or an errno as ts__xmem_readv. */
int ts__xmem_read(pid_t pid, void *dst, uint64_t addr, size_t len);

/* Which processes one host id groups (the two forms the store holds). */
typedef enum {
    /* "<boot id>/pid:[<pid namespace>]": processes whose pids mean the
     * same here (ts_dist_init's rendezvous, which watches them) */
    TS_HOST_ID_PIDS,
    /* "<boot id (36)>/<pid namespace>/<network namespace>", NUL-padded to
     * n bytes: also apart per network namespace, which the launcher gives
     * each of its nodes with their own --master-addr, so that traffic
     * between them goes over the network (the UCX transport) */
    TS_HOST_ID_NET,
} ts_host_id_kind;

/* This process's host id of the given kind into out (n bytes, always
 * NUL-terminated). The boot id tells kernels apart; the pid namespace
 * whether a peer's pid names the same process here. */
void ts__host_id(ts_host_id_kind kind, char *out, size_t n);

/* The same-host probe's verdict on a peer that published host id `peer`
 * (compared over at most n bytes): true when it equals `mine` (this
 * process's ts__host_id of the same kind). */
bool ts__host_same(const char *mine, const char *peer, size_t n);

/* Opens a pidfd on pid, a process of this host (ts__host_same): >= 0,
 * or -1 with errno set (ESRCH: the process is gone already; ENOSYS on a
 * kernel without pidfd_open). The caller closes it. */
int ts__host_watch(pid_t pid);

#endif /* TS_COMM_XMEM_H */
