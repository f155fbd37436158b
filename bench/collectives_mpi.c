/* bench/collectives_mpi: OpenMPI's side of bench/collectives. Times
 * MPI_Allgather (out of place and MPI_IN_PLACE), MPI_Reduce_scatter_block
 * and MPI_Allreduce on f32 at the sizes of bench/collectives, with the same
 * method (a barrier before each call, median of K calls after 2 warm-up
 * calls, buffers allocated and touched once per size), and prints, on rank
 * 0, one line per measurement:
 *   mpi <kind> <size bytes> <median seconds>
 * with kind ag, ag_ip, rs or ar. bench_collectives starts it through
 * mpirun in its own run and parses these lines; it is built only when
 * meson finds MPI (Debian: openmpi-bin, libopenmpi-dev).
 *
 * Usage: mpirun -np 2 bench_collectives_mpi [--iters N] [--max-mib M] */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_SIZES 8
static const int64_t sizes[N_SIZES] = {4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};

static int iters_for(int64_t size, int fixed)
{
    if (fixed > 0) return fixed;
    if (size <= (256 << 10)) return 20;
    if (size <= (4 << 20)) return 10;
    return 5;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

enum { AG, AG_IP, RS, AR, N_KIND };
static const char *kind_names[N_KIND] = {"ag", "ag_ip", "rs", "ar"};

static double time_kind(int kind, int64_t size, int iters, int rank, int ws)
{
    int64_t total = size / 4, part = total / ws;
    float *big = malloc((size_t)size), *small = malloc((size_t)part * 4 + 4);
    if (!big || !small) {
        fprintf(stderr, "bench_collectives_mpi: out of memory at %lld bytes\n", (long long)size);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int64_t i = 0; i < total; i++) big[i] = kind == AR ? 0.0f : 1.0f;
    for (int64_t i = 0; i < part; i++) small[i] = 1.0f;
    double t[64];
    iters = iters > 64 ? 64 : iters;
    for (int i = -2; i < iters; i++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        if (kind == AG) MPI_Allgather(small, (int)part, MPI_FLOAT, big, (int)part, MPI_FLOAT, MPI_COMM_WORLD);
        else if (kind == AG_IP)
            MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, big, (int)part, MPI_FLOAT, MPI_COMM_WORLD);
        else if (kind == RS) MPI_Reduce_scatter_block(big, small, (int)part, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        else MPI_Allreduce(MPI_IN_PLACE, big, (int)total, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        if (i >= 0) t[i] = MPI_Wtime() - t0;
    }
    (void)rank;
    free(big);
    free(small);
    qsort(t, (size_t)iters, sizeof *t, cmp_d);
    return iters % 2 ? t[iters / 2] : 0.5 * (t[iters / 2 - 1] + t[iters / 2]);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, ws, fixed = 0;
    long max_mib = 64;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ws);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) fixed = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--max-mib") && i + 1 < argc) max_mib = atol(argv[++i]);
    }
    for (int k = 0; k < N_KIND; k++)
        for (int s = 0; s < N_SIZES && sizes[s] <= max_mib * (1 << 20); s++) {
            double t = time_kind(k, sizes[s], iters_for(sizes[s], fixed), rank, ws);
            if (rank == 0) printf("mpi %s %lld %.9f\n", kind_names[k], (long long)sizes[s], t);
        }
    fflush(stdout);
    MPI_Finalize();
    return 0;
}
