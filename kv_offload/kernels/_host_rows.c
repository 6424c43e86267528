/* Row copies between host tensors, compiled: the CPU copier's one loop (kernels/cpu.py),
 * and the stable order of row ids that plans them (kernels/plan.py).
 *
 * copy_rows(dst, dst_stride, dst_part_stride, dst_ids, dst_start, dst_rows,
 *           src, src_stride, src_part_stride, src_ids, src_start, src_rows,
 *           count, parts, part_bytes, streaming)
 *
 * Row i of the copy is `parts` runs of `part_bytes` contiguous bytes (a segment's refs:
 * kernels/geometry.py). Part p of row i moves from `src + s * src_stride + p *
 * src_part_stride` to `dst + d * dst_stride + p * dst_part_stride`, where s is src_ids[i]
 * (the address of an int64 array) or, with src_ids 0, src_start + i; d likewise.
 * Addresses and strides are in bytes. The caller (kernels/cpu.py) owns the checks of the
 * views (rows contiguous, buffers alive); this file still checks every row index against
 * its side's `rows` before it copies that row (two compares a row), so a planning bug is
 * an IndexError naming the row, never a write outside a buffer. Rows before the bad one
 * are copied: the caller fails the whole job. The GIL is released for the loop, so the copier's threads run
 * their shares at once.
 *
 * Why compiled: numpy's fancy assignment and torch's index_select move one 2 KiB page at
 * a time at about half the rate of one large copy. The large copy is faster for a reason
 * a row loop can share: past a size, glibc's memcpy writes with non-temporal stores, which
 * do not first read each destination cache line (no read-for-ownership) and do not evict
 * the cache. A row copy of 2 KiB is far below that size, so every row costs a read of the
 * destination too. `streaming` (the copier sets it for jobs larger than the last-level
 * cache, whose bytes would not stay cached anyway) writes each 16-byte-aligned row with
 * SSE2 non-temporal stores and ends with a store fence, so the rows are visible to any
 * thread that later synchronises with this one. Elsewhere (not x86-64, unaligned rows,
 * small jobs) it is memcpy per row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAMING 1
#else
#define HAVE_STREAMING 0
#endif

/* Rows whose source lines are requested ahead of the copy: the copier hands the pairs over
 * in destination order, so a load's sources (pool rows) are scattered, and each row would
 * otherwise wait for memory. */
#define AHEAD 4
#define PREFETCH_BYTES 4096 /* of each part: the hardware prefetcher streams the rest */

static void copy_part(char *dst, const char *src, size_t nbytes, int streaming) {
#if HAVE_STREAMING
    if (streaming && ((uintptr_t)dst & 15) == 0 && (nbytes & 15) == 0) {
        __m128i *d = (__m128i *)dst;
        const __m128i *s = (const __m128i *)src;
        for (size_t j = 0; j < nbytes / 16; j++)
            _mm_stream_si128(d + j, _mm_loadu_si128(s + j));
        return;
    }
#else
    (void)streaming;
#endif
    memcpy(dst, src, nbytes);
}

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long dst, dst_ids, src, src_ids;
    long long dst_stride, dst_part_stride, dst_start, dst_rows;
    long long src_stride, src_part_stride, src_start, src_rows;
    long long count, parts, part_bytes;
    int streaming;
    if (!PyArg_ParseTuple(args, "KLLKLLKLLKLLLLLp", &dst, &dst_stride, &dst_part_stride,
                          &dst_ids, &dst_start, &dst_rows, &src, &src_stride,
                          &src_part_stride, &src_ids, &src_start, &src_rows, &count, &parts,
                          &part_bytes, &streaming))
        return NULL;
    if (count < 0 || parts < 0 || part_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "copy_rows: count %lld, parts %lld and part_bytes "
                     "%lld must not be negative", count, parts, part_bytes);
        return NULL;
    }
    const int64_t *dids = (const int64_t *)(uintptr_t)dst_ids;
    const int64_t *sids = (const int64_t *)(uintptr_t)src_ids;
    char *dbase = (char *)(uintptr_t)dst;
    const char *sbase = (const char *)(uintptr_t)src;
    long long ahead_bytes = part_bytes < PREFETCH_BYTES ? part_bytes : PREFETCH_BYTES;
    long long bad = -1, bad_d = 0, bad_s = 0; /* the first row out of range, if any */
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < count; i++) {
        if (i + AHEAD < count) {
            long long s = sids ? sids[i + AHEAD] : src_start + i + AHEAD;
            if (s >= 0 && s < src_rows) /* (a bad one is reported when its row comes) */
                for (long long p = 0; p < parts; p++)
                    for (long long b = 0; b < ahead_bytes; b += 64)
                        __builtin_prefetch(sbase + s * src_stride + p * src_part_stride + b,
                                           0, 3);
        }
        long long d = dids ? dids[i] : dst_start + i;
        long long s = sids ? sids[i] : src_start + i;
        if (d < 0 || d >= dst_rows || s < 0 || s >= src_rows) {
            bad = i, bad_d = d, bad_s = s;
            break;
        }
        char *drow = dbase + d * dst_stride;
        const char *srow = sbase + s * src_stride;
        for (long long p = 0; p < parts; p++)
            copy_part(drow + p * dst_part_stride, srow + p * src_part_stride,
                      (size_t)part_bytes, streaming);
    }
#if HAVE_STREAMING
    if (streaming)
        _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "copy_rows: row %lld of %lld copies destination row "
                     "%lld (of %lld) from source row %lld (of %lld): out of range", bad, count,
                     bad_d, dst_rows, bad_s, src_rows);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* A buffer of at least `nbytes` for the calling thread, kept between its calls and freed
 * when the thread ends. Fresh memory costs a page fault per 4 KiB at first touch, and glibc
 * gives a freed buffer of this size back to the kernel: a version of the sort below that
 * allocated its own each call took 771 page faults a call. It grows to 8 bytes per id of
 * the largest job the thread has sorted (1 MiB for 128k ids). */
typedef struct {
    size_t capacity;
    void *data;
} Scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p) {
    free(((Scratch *)p)->data);
    free(p);
}

static void scratch_key_create(void) { (void)pthread_key_create(&scratch_key, scratch_free); }

static void *scratch(size_t nbytes) {
    pthread_once(&scratch_once, scratch_key_create);
    Scratch *s = pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = calloc(1, sizeof(*s));
        if (s == NULL || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (nbytes > s->capacity) {
        free(s->data);
        s->data = malloc(nbytes);
        s->capacity = s->data ? nbytes : 0;
    }
    return s->data;
}

/* order_ids(ids, count, limit, order) -> bool
 *
 * The stable ascending order of `count` int64 ids in [0, limit) (both addresses of int64
 * arrays): False, with `order` untouched, when the ids are in order already; else True,
 * with `order` filled. A least-significant-digit radix sort on 11-bit digits: one pass
 * reads the ids and counts every digit, then each digit is a pass that moves (id,
 * position) pairs to their buckets, whose 2048 counts stay in L1. O(count) for any limit
 * up to 2**32 (at most 3 passes). The caller (plan.py: argsort_ids) sends it the ids that
 * numpy cannot place by counting: spread over a range much larger than their number, or
 * repeated; there numpy sorts by comparison, about 10 times slower for 128k ids
 * (benchmarks/bench_plan_sort.py). An id out of range is a ValueError naming it: this
 * file must never write outside `order`. */
#define DIGIT_BITS 11
#define DIGITS (1 << DIGIT_BITS)
#define MAX_PASSES 3

static PyObject *order_ids(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ids_address, order_address;
    long long count, limit;
    if (!PyArg_ParseTuple(args, "KLLK", &ids_address, &count, &limit, &order_address))
        return NULL;
    if (count < 0 || count > 0xFFFFFFFFLL || limit < 0 || limit > (1LL << 32)) {
        PyErr_Format(PyExc_ValueError, "order_ids: count %lld must be in [0, 2**32) and "
                     "limit %lld in [0, 2**32]", count, limit);
        return NULL;
    }
    const int64_t *ids = (const int64_t *)(uintptr_t)ids_address;
    int64_t *order = (int64_t *)(uintptr_t)order_address;
    int passes = 1;
    while (passes < MAX_PASSES && (1LL << (DIGIT_BITS * passes)) < limit)
        passes++;
    uint32_t counts[MAX_PASSES][DIGITS]; /* 24 KiB: on the stack, in L1 */
    long long bad = -1;
    int sorted = 1, no_memory = 0;
    Py_BEGIN_ALLOW_THREADS
    memset(counts, 0, sizeof(counts));
    for (long long i = 0; i < count; i++) {
        int64_t id = ids[i];
        if (id < 0 || id >= limit) {
            bad = i;
            break;
        }
        if (i && id < ids[i - 1])
            sorted = 0;
        counts[0][id & (DIGITS - 1)]++; /* (every digit, also past `passes`: no branch) */
        counts[1][(id >> DIGIT_BITS) & (DIGITS - 1)]++;
        counts[2][(id >> (2 * DIGIT_BITS)) & (DIGITS - 1)]++;
    }
    if (bad < 0 && !sorted) {
        /* Between passes, each id travels as one uint64: the id (its digits) above, its
         * position below. Passes alternate between `order` (8 bytes an id too) and this
         * thread's scratch buffer, arranged so that the last pass reads the scratch and
         * writes the positions into `order`. */
        uint64_t *spare = passes > 1 ? scratch((size_t)count * sizeof(uint64_t)) : NULL;
        no_memory = passes > 1 && spare == NULL;
        uint64_t *in = NULL;
        for (int p = 0; p < passes && !no_memory; p++) {
            uint32_t *to = counts[p], next = 0; /* counts -> where each digit's first goes */
            for (int d = 0; d < DIGITS; d++) {
                uint32_t c = to[d];
                to[d] = next;
                next += c;
            }
            int shift = DIGIT_BITS * p;
            uint64_t *out = (passes - 1 - p) % 2 ? spare : (uint64_t *)order;
            /* (four loops, not one with branches inside: half the time of the general one) */
            if (p == 0 && passes == 1) {
                for (long long i = 0; i < count; i++)
                    order[to[ids[i] & (DIGITS - 1)]++] = i;
            } else if (p == 0) {
                for (long long i = 0; i < count; i++)
                    out[to[ids[i] & (DIGITS - 1)]++] = (uint64_t)ids[i] << 32 | (uint64_t)i;
            } else if (p == passes - 1) {
                for (long long i = 0; i < count; i++)
                    order[to[(in[i] >> (32 + shift)) & (DIGITS - 1)]++] =
                        (int64_t)(in[i] & 0xFFFFFFFFu);
            } else {
                for (long long i = 0; i < count; i++)
                    out[to[(in[i] >> (32 + shift)) & (DIGITS - 1)]++] = in[i];
            }
            in = out;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "order_ids: id %lld at position %lld is out of range; "
                     "expected 0 <= id < %lld", (long long)ids[bad], bad, limit);
        return NULL;
    }
    if (no_memory)
        return PyErr_NoMemory();
    if (sorted)
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

static PyObject *has_streaming(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(HAVE_STREAMING);
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst, dst_stride, dst_part_stride, dst_ids, dst_start, src, src_stride, "
     "src_part_stride, src_ids, src_start, count, parts, part_bytes, streaming): move "
     "`count` rows (see the file's comment)."},
    {"order_ids", order_ids, METH_VARARGS,
     "order_ids(ids, count, limit, order) -> bool: the stable order of int64 ids in "
     "[0, limit) written to `order`, or False if they are in order (see the file)."},
    {"has_streaming", has_streaming, METH_NOARGS,
     "Whether this build writes streaming rows with non-temporal stores (x86-64)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_host_rows",
    "Compiled row copies and row-id sorting for the CPU copier.", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__host_rows(void) { return PyModule_Create(&module); }
