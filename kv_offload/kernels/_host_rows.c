/* Row copies between host tensors, compiled: the CPU copier's one loop (kernels/cpu.py).
 *
 * copy_rows(dst, dst_stride, dst_part_stride, dst_ids, dst_start,
 *           src, src_stride, src_part_stride, src_ids, src_start,
 *           count, parts, part_bytes, streaming)
 *
 * Row i of the copy is `parts` runs of `part_bytes` contiguous bytes (a segment's refs:
 * kernels/geometry.py). Part p of row i moves from `src + s * src_stride + p *
 * src_part_stride` to `dst + d * dst_stride + p * dst_part_stride`, where s is src_ids[i]
 * (the address of an int64 array) or, with src_ids 0, src_start + i; d likewise.
 * Addresses and strides are in bytes. The caller
 * (kernels/cpu.py) owns every check: ids in range, rows contiguous, buffers alive; this
 * file only moves bytes. The GIL is released for the loop, so the copier's threads run
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
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAMING 1
#else
#define HAVE_STREAMING 0
#endif

/* Rows whose source lines are requested ahead of the copy: where the sources are scattered
 * (pairs by id on both sides), each row would otherwise wait for memory. */
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
    long long dst_stride, dst_part_stride, dst_start, src_stride, src_part_stride, src_start;
    long long count, parts, part_bytes;
    int streaming;
    if (!PyArg_ParseTuple(args, "KLLKLKLLKLLLLp", &dst, &dst_stride, &dst_part_stride,
                          &dst_ids, &dst_start, &src, &src_stride, &src_part_stride,
                          &src_ids, &src_start, &count, &parts, &part_bytes, &streaming))
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
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < count; i++) {
        if (i + AHEAD < count) {
            long long s = sids ? sids[i + AHEAD] : src_start + i + AHEAD;
            for (long long p = 0; p < parts; p++)
                for (long long b = 0; b < ahead_bytes; b += 64)
                    __builtin_prefetch(sbase + s * src_stride + p * src_part_stride + b, 0, 3);
        }
        long long d = dids ? dids[i] : dst_start + i;
        long long s = sids ? sids[i] : src_start + i;
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
    Py_RETURN_NONE;
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
    {"has_streaming", has_streaming, METH_NOARGS,
     "Whether this build writes streaming rows with non-temporal stores (x86-64)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_host_rows", "Compiled row copies for the CPU copier.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__host_rows(void) { return PyModule_Create(&module); }
