/* hvd-train: an allreduce through memory the ranks of one node share, for Horovod's MPI operations.
 *
 * Why: on one node, the MPIs' own MPI_Allreduce reaches a third of a memory copy's bandwidth or less on large
 * buffers (bench section "mpi", docs/install.md): they move the data through their shared-memory transports as
 * messages, several full passes over the buffer per rank. Here each rank passes over its buffer about twice, as a
 * copy does: a block at a time, every rank stages its block in a shared slot small enough to stay in cache, each
 * reduces its own 1/n of the block from all the slots, and each copies the reduced block back, so only the
 * buffer's own reads and writes reach main memory.
 *
 * The shared memory is a file in /dev/shm that rank 0 makes and every rank maps, removed as soon as all have
 * mapped it, so nothing is left behind however the job ends. (Not an MPI-3 shared window: Open MPI 5's wheel
 * prints an error from its UCX one-sided component whenever a window is made, and a window it cannot make ends the
 * job, where this falls back.) It is used only when all ranks of the communicator share one node (as the MPI sees
 * it) and the memory could be mapped on all of them; otherwise, and for the types and reductions it does not
 * have, the caller uses MPI_Allreduce.
 *
 * Every rank computes one segment of each block and copies the others' segments, so all ranks hold bitwise the
 * same result; each segment is summed in rank order, so the result does not depend on timing.
 *
 * Plain C (C99 with GCC/Clang atomics): Horovod's C++ sources include it, and bench/mpi_allreduce.c times it
 * beside each MPI's own MPI_Allreduce. */
#ifndef HVDT_SHM_ALLREDUCE_H
#define HVDT_SHM_ALLREDUCE_H

#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Bytes of one rank's staging slot, so of a block. Each block costs two barriers; blocks of 1 MB stay in the
 * caches (a core's L2 and the shared L3) and made the fastest sweep on the 2-core machine the figures in
 * docs/install.md come from (1 MB against 128 KB-2 MB). */
#ifndef HVDT_SHM_BLOCK_BYTES
#define HVDT_SHM_BLOCK_BYTES (1024 * 1024)
#endif
/* How a rank waits for the others at a barrier: HVDT_SHM_SPINS polls, then HVDT_SHM_YIELDS polls each after
 * giving up the core, then asleep on a futex. A few spins suffice for a peer on a core of its own; a peer sharing
 * this core arrives only once it is given the core. Measured with 2 and 3 ranks on 2 cores (4 KB-1 MB): 2000 spins
 * made 3 oversubscribed ranks 10-20 times slower at 4-16 KB than 50 spins and 1000 yields, and 2 ranks no faster. */
#ifndef HVDT_SHM_SPINS
#define HVDT_SHM_SPINS 50
#endif
#ifndef HVDT_SHM_YIELDS
#define HVDT_SHM_YIELDS 1000
#endif
/* Buffers smaller than this keep to MPI_Allreduce (hvdt_shm_pays); HVD_TRAIN_SHM_MIN_BYTES overrides it, and the
 * ranks take the largest value any of them was given. Through Horovod, on a 16-core node and on a 2-core VM, up to
 * 1 MB each allreduce took one or two of Horovod's cycles either way (docs/install.md): the shared memory gained
 * nothing there. From 4 MB on it was faster on the 16-core node (2 and 4 ranks, every run); on the 2-core VM some
 * launches were faster and others slower than MPICH's own. */
#ifndef HVDT_SHM_MIN_BYTES
#define HVDT_SHM_MIN_BYTES (1024 * 1024)
#endif

enum hvdt_shm_type { HVDT_SHM_FLOAT32, HVDT_SHM_FLOAT64, HVDT_SHM_BFLOAT16, HVDT_SHM_INT32, HVDT_SHM_INT64 };

/* One rank's flags, each on a cache line of its own so that ranks spinning on them do not disturb each other. */
struct hvdt_shm_flags {
    uint32_t arrived; /* barriers this rank has reached */
    uint32_t pad0[15];
    uint32_t sleepers; /* ranks asleep on `arrived` (futex) */
    uint32_t pad1[15];
};

struct hvdt_shm {
    char *base; /* the mapping: each rank's part, one after another */
    size_t bytes;
    int rank, size;
    uint32_t barriers; /* this rank's count of barriers passed */
    size_t min_bytes;  /* the smallest buffer it takes (hvdt_shm_pays); the same on every rank */
    struct hvdt_shm_flags *flags[64];
    char *slot[64];    /* each rank's staging slot for a block of its buffer */
    char *reduced[64]; /* each rank's reduced segment of the block */
};

static inline size_t hvdt_shm_type_size(enum hvdt_shm_type type) {
    switch (type) {
    case HVDT_SHM_FLOAT64: case HVDT_SHM_INT64: return 8;
    case HVDT_SHM_BFLOAT16: return 2;
    default: return 4;
    }
}

/* A rank's part of the shared memory: its flags, its slot and its reduced segment, in whole pages. */
static inline size_t hvdt_shm_rank_bytes(int size) {
    size_t segment = (HVDT_SHM_BLOCK_BYTES / size + 63) / 64 * 64;
    return (sizeof(struct hvdt_shm_flags) + HVDT_SHM_BLOCK_BYTES + segment + 4095) / 4096 * 4096;
}

/* Maps the file rank 0 made (rank 0 makes it first); NULL where that fails. */
static inline char *hvdt_shm_map(const char *path, size_t bytes, int make) {
    int fd = make ? open(path, O_RDWR | O_CREAT | O_EXCL, 0600) : open(path, O_RDWR);
    if (fd < 0)
        return NULL;
    char *base = NULL;
    /* Allocated now, not on first touch: a /dev/shm too full for it (Docker's is 64 MB, shared with DataLoader
     * workers) fails here, and the ranks keep to MPI_Allreduce, where ftruncate's pages would end the job with
     * SIGBUS at the first write beyond what is free. */
    if (!make || posix_fallocate(fd, 0, (off_t)bytes) == 0) {
        void *at = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        base = at == MAP_FAILED ? NULL : (char *)at;
    }
    close(fd);
    return base;
}

/* Collective over `comm`. Returns NULL on every rank when any rank does not want it (`wanted` 0), when the ranks
 * do not all share one node, or there are more than 64 of them or one alone; the caller then keeps to
 * MPI_Allreduce. */
static inline struct hvdt_shm *hvdt_shm_create(MPI_Comm comm, int wanted) {
    int size, rank, node_size, all_local;
    MPI_Comm node;
    MPI_Comm_size(comm, &size);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
    /* Every rank must take the same decision, or some would wait for peers that keep to MPI_Allreduce. */
    int local = wanted && node_size == size;
    MPI_Allreduce(&local, &all_local, 1, MPI_INT, MPI_MIN, comm);
    if (!all_local || size < 2 || size > 64)
        return NULL;

    /* Rank 0 names and makes the file; the others map it once it exists. */
    static unsigned made = 0;
    char path[96];
    size_t per_rank = hvdt_shm_rank_bytes(size), bytes = per_rank * (size_t)size;
    snprintf(path, sizeof(path), "/dev/shm/hvd-train-allreduce-%ld-%u", (long)getpid(), made++);
    MPI_Bcast(path, (int)sizeof(path), MPI_CHAR, 0, comm);
    char *base = rank == 0 ? hvdt_shm_map(path, bytes, 1) : NULL;
    int made_it = base != NULL;
    MPI_Bcast(&made_it, 1, MPI_INT, 0, comm);
    if (made_it && rank != 0)
        base = hvdt_shm_map(path, bytes, 0);
    int mapped = base != NULL, all_mapped;
    MPI_Allreduce(&mapped, &all_mapped, 1, MPI_INT, MPI_MIN, comm);
    if (made_it && rank == 0)
        unlink(path); /* every rank that could map it has: the memory lives on in the mappings alone */
    struct hvdt_shm *shm = all_mapped ? (struct hvdt_shm *)calloc(1, sizeof(struct hvdt_shm)) : NULL;
    int ready = shm != NULL, all_ready;
    MPI_Allreduce(&ready, &all_ready, 1, MPI_INT, MPI_MIN, comm);
    if (!all_ready) { /* a full /dev/shm, none at all (some containers), or no memory: MPI_Allreduce instead */
        if (base != NULL)
            munmap(base, bytes);
        free(shm);
        return NULL;
    }
    /* The smallest buffer worth it, agreed (every rank must choose the same way for the same buffer). */
    const char *min_env = getenv("HVD_TRAIN_SHM_MIN_BYTES");
    long long min_bytes = min_env != NULL && *min_env != '\0' ? atoll(min_env) : (long long)HVDT_SHM_MIN_BYTES;
    MPI_Allreduce(MPI_IN_PLACE, &min_bytes, 1, MPI_LONG_LONG, MPI_MAX, comm);
    shm->min_bytes = min_bytes > 0 ? (size_t)min_bytes : 0;
    shm->base = base;
    shm->bytes = bytes;
    shm->rank = rank;
    shm->size = size;
    memset(base + per_rank * (size_t)rank, 0, per_rank); /* first touched by its rank: its pages near its core */
    for (int r = 0; r < size; r++) {
        char *part = base + per_rank * (size_t)r;
        shm->flags[r] = (struct hvdt_shm_flags *)part;
        shm->slot[r] = part + sizeof(struct hvdt_shm_flags);
        shm->reduced[r] = shm->slot[r] + HVDT_SHM_BLOCK_BYTES;
    }
    MPI_Barrier(comm); /* every rank's flags zeroed before any rank uses them */
    return shm;
}

/* Not collective: each rank unmaps its view (the file is long gone). */
static inline void hvdt_shm_free(struct hvdt_shm *shm) {
    if (shm == NULL)
        return;
    munmap(shm->base, shm->bytes);
    free(shm);
}

static inline void hvdt_shm_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int hvdt_shm_reached(const uint32_t *flag, uint32_t target) {
    return (int32_t)(__atomic_load_n(flag, __ATOMIC_ACQUIRE) - target) >= 0;
}

/* Waits until rank `r` has reached barrier `target` (see HVDT_SHM_SPINS); the futex lives in the shared memory,
 * and the peer wakes it when it arrives. */
static inline void hvdt_shm_wait(struct hvdt_shm *shm, int r, uint32_t target) {
    struct hvdt_shm_flags *f = shm->flags[r];
    for (int i = 0; i < HVDT_SHM_SPINS; i++) {
        if (hvdt_shm_reached(&f->arrived, target))
            return;
        hvdt_shm_pause();
    }
    for (int i = 0; i < HVDT_SHM_YIELDS; i++) {
        if (hvdt_shm_reached(&f->arrived, target))
            return;
        sched_yield();
    }
    while (!hvdt_shm_reached(&f->arrived, target)) {
        __atomic_add_fetch(&f->sleepers, 1, __ATOMIC_SEQ_CST);
        uint32_t seen = __atomic_load_n(&f->arrived, __ATOMIC_SEQ_CST);
        if ((int32_t)(seen - target) < 0) {
            /* A timeout bounds the sleep should a wake-up ever be missed; it does not end the wait. */
            struct timespec limit = {0, 10 * 1000 * 1000};
            syscall(SYS_futex, &f->arrived, FUTEX_WAIT, seen, &limit, NULL, 0);
        }
        __atomic_sub_fetch(&f->sleepers, 1, __ATOMIC_SEQ_CST);
    }
}

/* All ranks have reached this point: stores before it on any rank are visible after it on every rank. */
static inline void hvdt_shm_barrier(struct hvdt_shm *shm) {
    uint32_t target = ++shm->barriers;
    struct hvdt_shm_flags *mine = shm->flags[shm->rank];
    __atomic_store_n(&mine->arrived, target, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&mine->sleepers, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, &mine->arrived, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
    for (int r = 0; r < shm->size; r++)
        if (r != shm->rank)
            hvdt_shm_wait(shm, r, target);
}

/* `restrict` (C) and `__restrict__` (C++) let the compiler vectorize the sums: a slot and a segment never overlap. */
#ifdef __cplusplus
#define HVDT_RESTRICT __restrict__
#else
#define HVDT_RESTRICT restrict
#endif

/* GCC vectorizes these loops at -O3 only (Horovod builds at -O2): the sums are most of the work held in cache. */
#if defined(__GNUC__) && !defined(__clang__)
#define HVDT_SHM_VECTORIZED __attribute__((optimize("O3")))
#else
#define HVDT_SHM_VECTORIZED
#endif

/* out[i] = the sum over ranks, in rank order, of their parts of the block from element `first`, for `count`
 * elements: `part[r]` points at rank r's element `first` (the caller's own buffer for its own rank, a slot for the
 * others). */
#define HVDT_SHM_SUM(T)                                                                                         \
    HVDT_SHM_VECTORIZED static inline void hvdt_shm_sum_##T(const void *const *part, int size, size_t count,           \
                                                     T *HVDT_RESTRICT out) {                                    \
        const T *HVDT_RESTRICT a = (const T *)part[0];                                                          \
        const T *HVDT_RESTRICT b = (const T *)part[1];                                                          \
        for (size_t i = 0; i < count; i++)                                                                      \
            out[i] = a[i] + b[i];                                                                               \
        for (int r = 2; r < size; r++) {                                                                        \
            const T *HVDT_RESTRICT c = (const T *)part[r];                                                      \
            for (size_t i = 0; i < count; i++)                                                                  \
                out[i] += c[i];                                                                                 \
        }                                                                                                       \
    }
HVDT_SHM_SUM(float)
HVDT_SHM_SUM(double)
HVDT_SHM_SUM(int32_t)
HVDT_SHM_SUM(int64_t)

#define HVDT_SHM_SCALE(T)                                                                                       \
    HVDT_SHM_VECTORIZED static inline void hvdt_shm_scale_##T(T *out, size_t count, T scale) {                  \
        for (size_t i = 0; i < count; i++)                                                                      \
            out[i] = scale * out[i];                                                                            \
    }
HVDT_SHM_SCALE(float)
HVDT_SHM_SCALE(double)

/* bfloat16: summed in float32 over all ranks and rounded once, then, for an average, scaled in float32 and rounded
 * again, as Horovod scales a bfloat16 buffer. In chunks through a float32 accumulator, so that each loop is simple
 * enough for the compiler to vectorize (the conversions are shifts, the rounding a select). */
#define HVDT_SHM_BF16_CHUNK 1024
HVDT_SHM_VECTORIZED static inline void hvdt_shm_bf16_widen(const uint16_t *in, size_t count, float *acc, int add) {
    for (size_t i = 0; i < count; i++) {
        uint32_t word = (uint32_t)in[i] << 16;
        float value;
        memcpy(&value, &word, sizeof(value));
        acc[i] = add ? acc[i] + value : value;
    }
}

HVDT_SHM_VECTORIZED static inline void hvdt_shm_bf16_narrow(const float *acc, size_t count, uint16_t *out) {
    for (size_t i = 0; i < count; i++) {
        uint32_t word;
        memcpy(&word, &acc[i], sizeof(word));
        uint32_t rounded = (word + 0x7fffu + ((word >> 16) & 1u)) >> 16;
        out[i] = (uint16_t)((word & 0x7fffffffu) > 0x7f800000u ? ((word >> 16) | 0x0040u) : rounded);
    }
}

static inline void hvdt_shm_sum_bf16(const void *const *part, int size, size_t count, uint16_t *out, float scale) {
    float acc[HVDT_SHM_BF16_CHUNK];
    for (size_t done = 0; done < count; done += HVDT_SHM_BF16_CHUNK) {
        size_t n = count - done < HVDT_SHM_BF16_CHUNK ? count - done : HVDT_SHM_BF16_CHUNK;
        for (int r = 0; r < size; r++)
            hvdt_shm_bf16_widen((const uint16_t *)part[r] + done, n, acc, r > 0);
        hvdt_shm_bf16_narrow(acc, n, out + done);
        if (scale != 1.0f) {
            hvdt_shm_bf16_widen(out + done, n, acc, 0);
            for (size_t i = 0; i < n; i++)
                acc[i] *= scale;
            hvdt_shm_bf16_narrow(acc, n, out + done);
        }
    }
}

/* Whether `count` elements of `type` are enough for the shared memory to beat MPI_Allreduce (HVDT_SHM_MIN_BYTES). */
static inline int hvdt_shm_pays(const struct hvdt_shm *shm, size_t count, enum hvdt_shm_type type) {
    return count * hvdt_shm_type_size(type) >= shm->min_bytes;
}

/* Rank r's share of `count` elements: [first(r), first(r + 1)). */
static inline size_t hvdt_shm_first(size_t count, int r, int size) {
    return count * (size_t)r / (size_t)size;
}

/* Sums `count` elements of `type` over the ranks of the communicator `shm` was made on, from `send` into `recv`
 * on every rank (send == recv: in place). Collective: every rank calls it with the same type and count.
 * `scale` multiplies the sums of float32, float64 and bfloat16 (an average's 1/size), as Horovod scales a buffer
 * after MPI_Allreduce (in the same precision and order, so the bits are the same), but while the segment is in
 * cache instead of in another pass over the whole buffer; the integer types take 1.0, and the caller scales them.
 *
 * Per block: each rank stages the block in its slot, all but its own segment, which it reads from `send` itself;
 * it sums its segment over all ranks into its reduced segment; then it copies every rank's reduced segment into
 * `recv`. In place, a rank writes its segment of `recv` only after the barrier that ends every rank's summing. */
static inline void hvdt_shm_allreduce(struct hvdt_shm *shm, const void *send, void *recv, size_t count,
                                      enum hvdt_shm_type type, double scale) {
    size_t es = hvdt_shm_type_size(type), per_block = HVDT_SHM_BLOCK_BYTES / es;
    const void *part[64];
    for (size_t done = 0; done < count; done += per_block) {
        size_t n = count - done < per_block ? count - done : per_block;
        const char *src = (const char *)send + done * es;
        char *dst = (char *)recv + done * es, *slot = shm->slot[shm->rank];
        size_t first = hvdt_shm_first(n, shm->rank, shm->size), end = hvdt_shm_first(n, shm->rank + 1, shm->size);
        memcpy(slot, src, first * es);
        memcpy(slot + end * es, src + end * es, (n - end) * es);
        hvdt_shm_barrier(shm); /* every slot holds this block */
        for (int r = 0; r < shm->size; r++)
            part[r] = r == shm->rank ? src + first * es : shm->slot[r] + first * es;
        void *out = shm->reduced[shm->rank];
        switch (type) {
        case HVDT_SHM_FLOAT32:
            hvdt_shm_sum_float(part, shm->size, end - first, (float *)out);
            if (scale != 1.0)
                hvdt_shm_scale_float((float *)out, end - first, (float)scale);
            break;
        case HVDT_SHM_FLOAT64:
            hvdt_shm_sum_double(part, shm->size, end - first, (double *)out);
            if (scale != 1.0)
                hvdt_shm_scale_double((double *)out, end - first, scale);
            break;
        case HVDT_SHM_INT32: hvdt_shm_sum_int32_t(part, shm->size, end - first, (int32_t *)out); break;
        case HVDT_SHM_INT64: hvdt_shm_sum_int64_t(part, shm->size, end - first, (int64_t *)out); break;
        case HVDT_SHM_BFLOAT16:
            hvdt_shm_sum_bf16(part, shm->size, end - first, (uint16_t *)out, (float)scale);
            break;
        }
        hvdt_shm_barrier(shm); /* every segment reduced */
        for (int r = 0; r < shm->size; r++) {
            size_t at = hvdt_shm_first(n, r, shm->size);
            memcpy(dst + at * es, shm->reduced[r], (hvdt_shm_first(n, r + 1, shm->size) - at) * es);
        }
        /* No third barrier: a rank stages the next block in its slot only after every rank has summed from the
         * slots (the barrier above), and writes its next segment only after the next block's first barrier,
         * which every rank reaches after its copies above. */
    }
}

#endif
