/*
 * BLIS set-up: the kernel set chosen from cpuid before BLIS initialises,
 * and the BLIS thread count.
 *
 * BLIS 0.9 picks its kernels from cpuid itself, but it does not know recent
 * CPUs: on AMD Zen 5, and on Intel Xeons whose brand string does not let it
 * count the FMA units (virtual machines report "Intel(R) Xeon(R)
 * Processor"), it falls back to the haswell or the generic kernels, 1.5 to
 * 5 times slower than skx. BLIS reads BLIS_ARCH_TYPE (an arch_t number,
 * parsed with strtol) once, in bli_init(); an id its build does not have
 * aborts the process, and a kernel set the CPU cannot execute dies with
 * SIGILL. So the library reads cpuid (and XCR0 for the OS's register-state
 * support), sets BLIS_ARCH_TYPE to a kernel set the CPU runs unless the
 * user set a usable one, and only then calls bli_init().
 */
#define _GNU_SOURCE
#include "tensor/blis_arch.h"
#include "tensor/internal.h"

#include <blis.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define TS__X86 1
#else
#define TS__X86 0
#endif

_Static_assert(BLIS_ARCH_SKX == 0 && BLIS_ARCH_HASWELL == 3 && BLIS_ARCH_ZEN3 == 6 && BLIS_ARCH_ZEN2 == 7 &&
                   BLIS_ARCH_GENERIC == 25 && BLIS_NUM_ARCHS == TS__BLIS_ARCH_COUNT,
               "BLIS arch_t numbering differs from BLIS 0.9's");

/* ------------------------------------------------------------------ cpuid */

void ts__cpu_info_query(ts__cpu_info *out)
{
    memset(out, 0, sizeof *out);
#if TS__X86
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return;
    unsigned max_leaf = a;
    char vendor[13];
    memcpy(vendor, &b, 4);
    memcpy(vendor + 4, &d, 4);
    memcpy(vendor + 8, &c, 4);
    vendor[12] = '\0';
    if (strcmp(vendor, "GenuineIntel") == 0) out->vendor = TS__CPU_INTEL;
    else if (strcmp(vendor, "AuthenticAMD") == 0) out->vendor = TS__CPU_AMD;
    else if (strcmp(vendor, "HygonGenuine") == 0) out->vendor = TS__CPU_HYGON;

    if (max_leaf < 1 || !__get_cpuid(1, &a, &b, &c, &d)) return;
    uint32_t base_family = (a >> 8) & 0xF;
    uint32_t base_model = (a >> 4) & 0xF;
    out->family = base_family == 0xF ? base_family + ((a >> 20) & 0xFF) : base_family;
    out->model = (base_family == 0x6 || base_family == 0xF) ? (((a >> 16) & 0xF) << 4) | base_model : base_model;
    out->sse3 = c & (1u << 0);
    out->ssse3 = c & (1u << 9);
    out->fma3 = c & (1u << 12);
    bool osxsave = c & (1u << 27);
    out->avx = c & (1u << 28);
    out->f16c = c & (1u << 29);

    if (osxsave) {
        /* XGETBV with ecx = 0 reads XCR0 (the state the OS saves on a
         * context switch); written as asm so no -mxsave is needed. */
        uint32_t xcr0_lo, xcr0_hi;
        __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
        (void)xcr0_hi;
        out->os_ymm = (xcr0_lo & 0x6) == 0x6;
        out->os_zmm = (xcr0_lo & 0xE6) == 0xE6;
        out->os_amx = (xcr0_lo & 0x60000u) == 0x60000u;
    }

    if (max_leaf >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        out->avx2 = b & (1u << 5);
        out->avx512f = b & (1u << 16);
        out->avx512dq = b & (1u << 17);
        out->avx512pf = b & (1u << 26);
        out->avx512er = b & (1u << 27);
        out->avx512cd = b & (1u << 28);
        out->avx512bw = b & (1u << 30);
        out->avx512vl = b & (1u << 31);
        out->amx_bf16 = d & (1u << 22);
        out->amx_tile = d & (1u << 24);
        if (a >= 1) {
            __cpuid_count(7, 1, a, b, c, d);
            out->avx512bf16 = a & (1u << 5);
        }
    }
    if (__get_cpuid(0x80000000u, &a, &b, &c, &d) && a >= 0x80000001u) {
        __get_cpuid(0x80000001u, &a, &b, &c, &d);
        out->fma4 = c & (1u << 16);
    }
#endif
}

/* ------------------------------------------------------- arch id tables */

/* BLIS's names (bli_arch_string), indexed by arch_t. */
static const char *const arch_names[TS__BLIS_ARCH_COUNT] = {
    "skx",     "knl",       "knc",       "haswell",     "sandybridge", "penryn",    "zen3",
    "zen2",    "zen",       "excavator", "steamroller", "piledriver",  "bulldozer", "armsve",
    "a64fx",   "firestorm", "thunderx2", "cortexa57",   "cortexa53",   "cortexa15", "cortexa9",
    "power10", "power9",    "power7",    "bgq",         "generic",
};

const char *ts__blis_arch_id_name(int id) { return id >= 0 && id < TS__BLIS_ARCH_COUNT ? arch_names[id] : NULL; }

bool ts__blis_arch_configured(int id)
{
    switch (id) {
#ifdef BLIS_CONFIG_SKX
    case BLIS_ARCH_SKX:
#endif
#ifdef BLIS_CONFIG_KNL
    case BLIS_ARCH_KNL:
#endif
#ifdef BLIS_CONFIG_HASWELL
    case BLIS_ARCH_HASWELL:
#endif
#ifdef BLIS_CONFIG_SANDYBRIDGE
    case BLIS_ARCH_SANDYBRIDGE:
#endif
#ifdef BLIS_CONFIG_PENRYN
    case BLIS_ARCH_PENRYN:
#endif
#ifdef BLIS_CONFIG_ZEN3
    case BLIS_ARCH_ZEN3:
#endif
#ifdef BLIS_CONFIG_ZEN2
    case BLIS_ARCH_ZEN2:
#endif
#ifdef BLIS_CONFIG_ZEN
    case BLIS_ARCH_ZEN:
#endif
#ifdef BLIS_CONFIG_EXCAVATOR
    case BLIS_ARCH_EXCAVATOR:
#endif
#ifdef BLIS_CONFIG_STEAMROLLER
    case BLIS_ARCH_STEAMROLLER:
#endif
#ifdef BLIS_CONFIG_PILEDRIVER
    case BLIS_ARCH_PILEDRIVER:
#endif
#ifdef BLIS_CONFIG_BULLDOZER
    case BLIS_ARCH_BULLDOZER:
#endif
#ifdef BLIS_CONFIG_GENERIC
    case BLIS_ARCH_GENERIC:
#endif
        return true;
    default: return false;
    }
}

/* The instruction sets each x86 kernel set is compiled for (BLIS's
 * config/<name>/make_defs.mk and the checks of its bli_cpuid.c). Only the
 * x86 ids are ever runnable here; the ARM and POWER ones are not in an
 * x86 build. */
bool ts__blis_arch_runnable(int id, const ts__cpu_info *c)
{
    bool ymm = c->avx && c->os_ymm;
    bool avx2_fma = ymm && c->avx2 && c->fma3;
    switch (id) {
    case BLIS_ARCH_SKX:
        return avx2_fma && c->os_zmm && c->avx512f && c->avx512dq && c->avx512cd && c->avx512bw && c->avx512vl;
    case BLIS_ARCH_KNL: return avx2_fma && c->os_zmm && c->avx512f && c->avx512cd && c->avx512pf && c->avx512er;
    case BLIS_ARCH_HASWELL:
    case BLIS_ARCH_ZEN3:
    case BLIS_ARCH_ZEN2:
    case BLIS_ARCH_ZEN:
    case BLIS_ARCH_EXCAVATOR: return avx2_fma;
    case BLIS_ARCH_SANDYBRIDGE: return ymm;
    case BLIS_ARCH_PENRYN: return c->sse3 && c->ssse3;
    case BLIS_ARCH_STEAMROLLER:
    case BLIS_ARCH_PILEDRIVER: return ymm && c->fma3 && c->fma4;
    case BLIS_ARCH_BULLDOZER: return ymm && c->fma4;
    case BLIS_ARCH_GENERIC: return true;
    default: return false;
    }
}

int ts__blis_arch_choose(const ts__cpu_info *c)
{
    /* Candidates, fastest first; the first one that is configured and
     * runnable wins. skx comes first on every CPU with AVX-512 (Intel
     * since Skylake-SP, AMD since Zen 4): its kernels are the fastest BLIS
     * 0.9 has on all of them. */
    int cand[8];
    int n = 0;
    cand[n++] = BLIS_ARCH_SKX;
    cand[n++] = BLIS_ARCH_KNL;
    bool amd_like = c->vendor == TS__CPU_AMD || c->vendor == TS__CPU_HYGON;
    if (amd_like && c->family >= 0x19) {
        cand[n++] = BLIS_ARCH_ZEN3;
        cand[n++] = BLIS_ARCH_ZEN2;
    } else if (amd_like && (c->family == 0x17 || c->family == 0x18)) {
        cand[n++] = BLIS_ARCH_ZEN2;
        cand[n++] = BLIS_ARCH_ZEN;
    }
    cand[n++] = BLIS_ARCH_HASWELL;
    cand[n++] = BLIS_ARCH_SANDYBRIDGE;
    cand[n++] = BLIS_ARCH_PENRYN;
    cand[n++] = BLIS_ARCH_GENERIC;
    for (int i = 0; i < n; i++)
        if (ts__blis_arch_configured(cand[i]) && ts__blis_arch_runnable(cand[i], c)) return cand[i];
    return -1;
}

/* ---------------------------------------------------------- the set-up */

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static const char *arch_name = "unknown";

/* Why BLIS_ARCH_TYPE holds what it holds, for the log line. */
static char arch_reason[160];

/* Reads a user's BLIS_ARCH_TYPE as BLIS 0.9 does (strtol: leading blanks
 * and trailing junk ignored), and also accepts a kernel-set name ("skx"),
 * which BLIS itself would read as 0. Returns the id, -1 for BLIS's
 * "detect", -2 when the value is neither a number nor a name, -3 for a
 * number that is no arch id. */
static int parse_user_arch(const char *s)
{
    const char *p = s;
    while (*p == ' ' || *p == '\t') p++;
    for (int id = 0; id < TS__BLIS_ARCH_COUNT; id++)
        if (strcasecmp(p, arch_names[id]) == 0) return id;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s) return -2;
    if (errno != 0 || v < -1 || v >= TS__BLIS_ARCH_COUNT) return -3;
    return (int)v;
}

/* Decides BLIS_ARCH_TYPE and sets it; returns the id BLIS should report
 * (-1 if the build has nothing we can choose and BLIS detects itself). */
static int choose_and_set_arch(void)
{
    ts__cpu_info cpu;
    ts__cpu_info_query(&cpu);
    int chosen = ts__blis_arch_choose(&cpu);

    const char *user = getenv("BLIS_ARCH_TYPE");
    if (user) {
        int id = parse_user_arch(user);
        if (id >= 0 && ts__blis_arch_configured(id) && ts__blis_arch_runnable(id, &cpu)) {
            snprintf(arch_reason, sizeof arch_reason, "from BLIS_ARCH_TYPE=%s", user);
            /* the number BLIS understands (a name would read as 0) */
            char num[16];
            snprintf(num, sizeof num, "%d", id);
            setenv("BLIS_ARCH_TYPE", num, 1);
            return id;
        }
        if (id != -1) {
            const char *what, *blis_would;
            if (id == -2) {
                what = "not a BLIS kernel-set number or name";
                blis_would = "read it as 0 (skx)";
            } else if (id == -3 || !ts__blis_arch_configured(id)) {
                what = "not a kernel set this BLIS build has";
                blis_would = "abort";
            } else {
                what = "a kernel set this CPU cannot execute";
                blis_would = "die with SIGILL";
            }
            ts_logf(TS_LOG_WARN, "BLIS_ARCH_TYPE=%s is %s (BLIS would %s); using '%s', chosen from cpuid", user, what,
                    blis_would, chosen >= 0 ? arch_names[chosen] : "BLIS's own choice");
        }
    }
    if (chosen < 0) {
        if (user) unsetenv("BLIS_ARCH_TYPE");
        snprintf(arch_reason, sizeof arch_reason, "BLIS's own detection (no known kernel set in this build)");
        return -1;
    }
    char num[16];
    snprintf(num, sizeof num, "%d", chosen);
    setenv("BLIS_ARCH_TYPE", num, 1);
    snprintf(arch_reason, sizeof arch_reason, "chosen from cpuid (%s family 0x%x model 0x%x%s%s)",
             cpu.vendor == TS__CPU_INTEL       ? "Intel"
                 : cpu.vendor == TS__CPU_AMD   ? "AMD"
                 : cpu.vendor == TS__CPU_HYGON ? "Hygon"
                                               : "other",
             cpu.family, cpu.model,
             ts__blis_arch_runnable(BLIS_ARCH_SKX, &cpu)           ? ", AVX-512 with OS zmm state"
                 : ts__blis_arch_runnable(BLIS_ARCH_HASWELL, &cpu) ? ", AVX2+FMA with OS ymm state"
                                                                   : "",
             user ? ", replacing BLIS_ARCH_TYPE" : "");
    return chosen;
}

/* A positive int from the environment, or 0 when unset; -1 when set to
 * something else. */
static int env_positive_int(const char *name)
{
    const char *s = getenv(name);
    if (!s || !*s) return 0;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0 || v < 1 || v > 4096) return -1;
    return (int)v;
}

static char threads_reason[96];

static int default_num_threads(void)
{
    int t = env_positive_int("TS_NUM_THREADS");
    if (t > 0) {
        snprintf(threads_reason, sizeof threads_reason, "TS_NUM_THREADS");
        return t;
    }
    if (t < 0)
        ts_logf(TS_LOG_WARN, "TS_NUM_THREADS=%s is not a thread count (1 to 4096); ignoring it",
                getenv("TS_NUM_THREADS"));
    int lws = env_positive_int("LOCAL_WORLD_SIZE");
    if (lws > 0) {
        int cores = ts_cpu_count();
        int n = cores / lws;
        if (n < 1) n = 1;
        snprintf(threads_reason, sizeof threads_reason, "%d cores / LOCAL_WORLD_SIZE=%d", cores, lws);
        return n;
    }
    snprintf(threads_reason, sizeof threads_reason, "default for a process started without a launcher");
    return 1;
}

static void blis_init_once(void)
{
    int expected = choose_and_set_arch();
    bli_init();
    arch_t id = bli_arch_query_id();
    arch_name = bli_arch_string(id);
    if (expected >= 0 && (int)id != expected)
        ts_logf(TS_LOG_WARN,
                "BLIS runs the '%s' kernels, not '%s': something in this process initialised BLIS before "
                "tensorshard could choose them; call ts_blis_arch_name() before any other BLIS use",
                arch_name, arch_names[expected]);
    int n = default_num_threads();
    bli_thread_set_num_threads(n);
    ts_logf(TS_LOG_INFO, "BLIS %s: '%s' kernels, %s; %d thread%s (%s)", bli_info_get_version_str(), arch_name,
            arch_reason, n, n == 1 ? "" : "s", threads_reason);
}

void ts__blis_ensure_init(void) { pthread_once(&init_once, blis_init_once); }

const char *ts_blis_arch_name(void)
{
    ts__blis_ensure_init();
    return arch_name;
}

void ts_set_num_threads(int n)
{
    ts__blis_ensure_init();
    if (n < 1) {
        ts_logf(TS_LOG_WARN, "ts_set_num_threads(%d): using 1 thread", n);
        n = 1;
    }
    bli_thread_set_num_threads(n);
}

int ts_get_num_threads(void)
{
    ts__blis_ensure_init();
    /* BLIS's own global setting, so a direct bli_thread_set_num_threads
     * shows too */
    dim_t n = bli_thread_get_num_threads();
    return n < 1 ? 1 : n > INT_MAX ? INT_MAX : (int)n;
}

size_t ts__blis_pack_bytes(void)
{
    ts__blis_ensure_init();
    cntx_t *cx = bli_gks_query_cntx();
    if (!cx) return 0;
    dim_t mc = bli_cntx_get_blksz_def_dt(BLIS_FLOAT, BLIS_MC, cx),
          kc = bli_cntx_get_blksz_def_dt(BLIS_FLOAT, BLIS_KC, cx),
          nc = bli_cntx_get_blksz_def_dt(BLIS_FLOAT, BLIS_NC, cx);
    dim_t threads = bli_thread_get_num_threads();
    if (mc < 0 || kc < 0 || nc < 0) return 0;
    return (size_t)(mc * kc + kc * nc) * sizeof(float) * (size_t)(threads < 1 ? 1 : threads);
}
