# The C-level contract of kvcached.core.blockargs: what callers hand the block allocator, checked and
# converted — block counts, block ids (lists and int32 buffers), the lists of ids it hands back, the
# page intervals of its constructor and whether its bookkeeping fits in host memory. Each raises a
# specific exception naming the value (or is noexcept C that leaves the odd cases to one that
# does). It cimports nothing of the core; blockalloc cimports it.

from libc.stdint cimport int32_t, int64_t
from cpython.ref cimport PyObject

cdef extern from *:
    """
    /* Fill list[0..n) with the ints ids[0..n), reusing the allocator's id objects (see
       Note [Block id objects]); an id at or above cache_len gets a new int. -1 with
       MemoryError set when an int cannot be made (the list's remaining items stay NULL). */
    static inline int kvc_fill_id_list(PyObject* list, const int32_t* ids, Py_ssize_t n,
                                       PyObject** cache, int32_t cache_len) {
        for (Py_ssize_t i = 0; i < n; i++) {
            int32_t b = ids[i];
            PyObject* o;
            if (b < cache_len) {
                o = cache[b];
                if (o == NULL) {
                    o = PyLong_FromLong(b);
                    if (o == NULL) return -1;
                    cache[b] = o;
                }
                Py_INCREF(o);
            } else {
                o = PyLong_FromLong(b);
                if (o == NULL) return -1;
            }
            PyList_SET_ITEM(list, i, o);
        }
        return 0;
    }
    /* out[i] = list[i] for i = start, start + 1, ... while the item is an exact int in
       [0, max_id): returns the index of the first item that is not (n when none), for the
       caller's slow path (numpy ints, bad ids). Borrowed items, no exception set. */
    static inline Py_ssize_t kvc_ids_from_list(PyObject* list, Py_ssize_t start, Py_ssize_t n,
                                               int32_t* out, int32_t max_id) {
        for (Py_ssize_t i = start; i < n; i++) {
            PyObject* o = PyList_GET_ITEM(list, i);
            int overflow;
            long long v;
            if (!PyLong_CheckExact(o)) return i;
            v = PyLong_AsLongLongAndOverflow(o, &overflow);
            if (overflow || v < 0 || v >= max_id) return i;
            out[i] = (int32_t)v;
        }
        return n;
    }
    """
    int kvc_fill_id_list(object lst, const int32_t* ids, Py_ssize_t n, PyObject** cache,
                         int32_t cache_len) except -1
    Py_ssize_t kvc_ids_from_list(object lst, Py_ssize_t start, Py_ssize_t n, int32_t* out,
                                 int32_t max_id) noexcept

cdef enum:
    ID_CACHE_MAX = 1 << 22      # ids below this reuse one int object each; Note [Block id objects]

cdef object int32_view_source(object buf)                                   # buf, or raises TypeError
cdef long long count_of(object n, str what, int* overflow) except? -1        # a count from an int-like; TypeError for bools
cdef int32_t block_id_of(object item, int32_t max_block_id) except -1       # or raises TypeError / BlockStateError
cdef tuple page_intervals(page_first_block, page_num_blocks, int num_pages, int64_t id_to_page_num,
                          int64_t id_to_page_den, int64_t max_block_id)      # (first, count), or raises KVCachedConfigError
cdef int check_bookkeeping_fits(int64_t needed, int64_t total, int64_t max_block_id,
                                int num_pages) except -1                     # 0, or raises KVCachedConfigError


cdef inline int ids_from_list(list ids, Py_ssize_t n, int32_t* out, int32_t max_block_id) except -1:
    """out[0..n) = the block ids of `ids` (n items): exact ints in range in one C loop, the others
    (numpy ints, or raise) one by one. See Note [Counts and ids past int32]."""
    cdef Py_ssize_t i = kvc_ids_from_list(ids, 0, n, out, max_block_id)
    while i < n:
        out[i] = block_id_of(ids[i], max_block_id)
        i = kvc_ids_from_list(ids, i + 1, n, out, max_block_id)
    return 0
