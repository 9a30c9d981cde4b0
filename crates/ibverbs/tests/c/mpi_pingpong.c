/* A two-rank MPI ping-pong that checks every byte it receives, for crates/ibverbs/tests/mpi.rs:
 * for each size, rank 0 sends a pattern, rank 1 checks it and answers with another, rank 0
 * checks that; "pingpong: verified" at the end, and exit status 1 on any wrong byte or length. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned char pattern(int dir, int iter, size_t size, size_t i)
{
    return (unsigned char)(i * 31 + (size_t)iter * 7 + size + (size_t)dir * 101);
}

int main(int argc, char **argv)
{
    int rank, nranks;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    if (nranks != 2) {
        if (rank == 0)
            fprintf(stderr, "pingpong: needs 2 ranks, got %d\n", nranks);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int iters = argc > 1 ? atoi(argv[1]) : 100;
    const size_t sizes[] = {1, 64, 4096, 65536, 1 << 20, 4 << 20};
    const size_t max = 4 << 20;
    unsigned char *buf = malloc(max);
    long bad = 0;
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        size_t size = sizes[s];
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int it = 0; it < iters; it++) {
            if (rank == 0) {
                for (size_t i = 0; i < size; i++) buf[i] = pattern(0, it, size, i);
                MPI_Send(buf, (int)size, MPI_BYTE, 1, it, MPI_COMM_WORLD);
                memset(buf, 0, size);
                MPI_Status st;
                MPI_Recv(buf, (int)size, MPI_BYTE, 1, it, MPI_COMM_WORLD, &st);
                int n;
                MPI_Get_count(&st, MPI_BYTE, &n);
                if ((size_t)n != size) bad++;
                for (size_t i = 0; i < size; i++) bad += buf[i] != pattern(1, it, size, i);
            } else {
                MPI_Status st;
                memset(buf, 0, size);
                MPI_Recv(buf, (int)size, MPI_BYTE, 0, it, MPI_COMM_WORLD, &st);
                int n;
                MPI_Get_count(&st, MPI_BYTE, &n);
                if ((size_t)n != size) bad++;
                for (size_t i = 0; i < size; i++) bad += buf[i] != pattern(0, it, size, i);
                for (size_t i = 0; i < size; i++) buf[i] = pattern(1, it, size, i);
                MPI_Send(buf, (int)size, MPI_BYTE, 0, it, MPI_COMM_WORLD);
            }
        }
        double us = (MPI_Wtime() - t0) * 1e6 / iters / 2;
        if (rank == 0)
            printf("size %zu iterations %d one-way %.2f us\n", size, iters, us);
    }
    long total = 0;
    MPI_Allreduce(&bad, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("pingpong: %s, %ld bad bytes\n", total ? "FAILED" : "verified", total);
    free(buf);
    MPI_Finalize();
    return total ? 1 : 0;
}
