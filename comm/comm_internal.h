/* Internal: worlds over a given transport (comm.h). Not installed. */
#ifndef TS_COMM_INTERNAL_H
#define TS_COMM_INTERNAL_H

#include "comm/comm.h"
#include "comm/transport.h"

/* Creates a world (group id 0) over `t`, taking ownership of it, and
 * starts its communication thread, which alone drives `t` from now on.
 * timeout_s is the per-collective deadline (<= 0: 300 s). A world of size
 * 1 runs its collectives on the caller's thread. */
ts_status ts__world_new(ts_transport *t, double timeout_s, ts_comm **world_out);
/* Fails what is still pending (TS_ERR_COMM), joins the thread, destroys
 * the transport. Bounded in time. Accepts NULL. */
void ts__world_free(ts_comm *world);

/* Sets the per-collective deadline of c's world for collectives started
 * from now on (> 0; tests shorten it). Any thread. Ignores NULL and the
 * one-rank group. */
void ts__comm_set_timeout(ts_comm *c, double timeout_s);
/* Turns the collectives' fingerprints (comm.c, "Fingerprints") on or off
 * for collectives submitted from now on; default on, TS_COMM_CHECK=0 off.
 * Every rank must switch at the same point of its sequence of
 * collectives (the benchmark measures both). Any thread. */
void ts__comm_set_check(ts_comm *c, bool on);

/* The world ts_dist_init made (comm/dist.c), NULL when none; lock-free,
 * any thread. ts_comm_world() should return it when not NULL. */
ts_comm *ts__dist_current(void);

#endif
