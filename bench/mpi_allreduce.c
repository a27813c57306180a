/* An MPI's in-place allreduce of float32 sums, as Horovod's DistributedOptimizer calls it (MPI_Allreduce with
 * MPI_IN_PLACE on its fusion buffer), and the shared-memory allreduce the project's Horovod build calls instead on
 * one node (scripts/horovod/shm_allreduce.h, set up through this MPI), each timed for each power-of-4 size from 4 KB to
 * MAX_BYTES.
 *
 *   mpicc -O2 -Iscripts bench/mpi_allreduce.c -o mpi_allreduce && mpirun -np 2 ./mpi_allreduce MAX_BYTES MIN_SECONDS
 *
 * bench/run.py builds it with each MPI's own mpicc (section mpi). Rank 0 prints one JSON object: the MPI's library
 * version and, per size, the median seconds of one call of each over 5 rounds, each round at least MIN_SECONDS of
 * calls (ranks agree on the count, so no rank waits in a call the others never make). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shm_allreduce.h"

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Seconds per call of `calls` allreduces, the slowest rank's: the MPI's own, or through `shm` where it is given. */
static double timed(struct hvdt_shm *shm, float *buf, int count, int calls) {
    MPI_Barrier(MPI_COMM_WORLD);
    double start = MPI_Wtime();
    for (int i = 0; i < calls; i++) {
        if (shm != NULL)
            hvdt_shm_allreduce(shm, buf, buf, (size_t)count, HVDT_SHM_FLOAT32, 1.0);
        else
            MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    double mine = (MPI_Wtime() - start) / calls, slowest;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return slowest;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size, len;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    long max_bytes = argc > 1 ? atol(argv[1]) : 64L << 20;
    double min_seconds = argc > 2 ? atof(argv[2]) : 0.3;
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    MPI_Get_library_version(version, &len);
    for (int i = 0; i < len; i++)  /* one line, and nothing JSON would need escaped */
        if (version[i] == '\n' || version[i] == '"' || version[i] == '\\' || version[i] == '\t') version[i] = ' ';
    while (len > 0 && version[len - 1] == ' ') version[--len] = '\0';

    struct hvdt_shm *shm = hvdt_shm_create(MPI_COMM_WORLD, 1);
    if (shm == NULL) {
        fprintf(stderr, "mpi_allreduce: the ranks do not share one node, so there is no shared-memory allreduce\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    float *buf = malloc(max_bytes);
    if (buf == NULL) {
        fprintf(stderr, "mpi_allreduce: cannot allocate %ld bytes\n", max_bytes);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (rank == 0) printf("{\"library\": \"%s\", \"ranks\": %d, \"sweep\": [", version, size);
    for (long bytes = 4096; bytes <= max_bytes; bytes *= 4) {
        int count = (int)(bytes / sizeof(float));
        if (rank == 0) printf("%s{\"bytes\": %ld", bytes == 4096 ? "" : ", ", bytes);
        for (int way = 0; way < 2; way++) {
            struct hvdt_shm *through = way == 0 ? NULL : shm;
            memset(buf, 0, bytes);  /* zeros: sums that stay finite however many calls run */
            timed(through, buf, count, 2);  /* warm-up: connections, pages */
            /* Calls per round: enough for min_seconds at the first estimate, agreed (the maximum) across ranks. */
            double once = timed(through, buf, count, 3);
            int calls = once > 0 ? (int)(min_seconds / once) + 1 : 1000, agreed;
            MPI_Allreduce(&calls, &agreed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
            double rounds[5];
            for (int r = 0; r < 5; r++) rounds[r] = timed(through, buf, count, agreed);
            qsort(rounds, 5, sizeof(double), by_value);
            if (rank == 0) printf(", \"%s\": %.9g", way == 0 ? "seconds" : "shm_seconds", rounds[2]);
        }
        if (rank == 0) printf("}");
    }
    if (rank == 0) printf("]}\n");
    free(buf);
    hvdt_shm_free(shm);
    MPI_Finalize();
    return 0;
}
