# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.blockargs: what callers hand the block allocator, checked and converted.

Block counts and ids arrive as Python ints of any size, numpy and torch ints, lists and int32
buffers; alloc's result goes back as a list of shared int objects (Note [Block id objects]); the
constructor's page intervals are checked in O(pages) and its arrays against the host memory the
process can still allocate (Note [Bookkeeping memory]). The hot conversions are inline C in
blockargs.pxd; the slow paths, which raise, are here. Nothing here holds state.
"""

from libc.stdint cimport int32_t, int64_t
from cpython.long cimport PyLong_AsLongLongAndOverflow
from operator import index as _index

from kvcached.errors import BlockStateError, KVCachedConfigError


cdef object int32_view_source(object buf):
    # numpy arrays and anything with the buffer protocol as they are; torch CPU tensors via .numpy()
    try:
        view = memoryview(buf)
    except TypeError:
        if hasattr(buf, "numpy"):
            return int32_view_source(buf.numpy())
        raise
    if view.format.lstrip("@=<>!") == "?":      # other dtypes fail the int32 view (ValueError)
        raise TypeError("the id buffer holds bools, not block ids; pass a contiguous int32 buffer "
                        "(numpy.int32, torch.int32, array.array('i'))")
    return buf


cdef long long count_of(object n, str what, int* overflow) except? -1:
    """A block count from an int-like n that is not an exact int (numpy and torch ints); bools
    and floats refused. Past int64 it sets overflow (the sign) as PyLong_AsLongLongAndOverflow
    does; see Note [Counts and ids past int32]."""
    if isinstance(n, bool) or getattr(n, "dtype", None) is not None and str(n.dtype) == "bool":
        raise TypeError(f"{what}(n={n!r}): n must be an integer count, not a bool")
    return PyLong_AsLongLongAndOverflow(_index(n), overflow)


cdef int32_t block_id_of(object item, int32_t max_block_id) except -1:
    """A block id from an item kvc_ids_from_list left: an int-like that is not an exact int
    (numpy, torch ints) or one out of [0, max_block_id), of any size. Bools refused."""
    if isinstance(item, bool):
        raise TypeError(f"block id {item!r} is a bool, not a block id; nothing was freed.")
    v = _index(item)
    if not 0 <= v < max_block_id:
        raise BlockStateError(
            f"block id {v} is not a block id of this allocator (valid: [0, {max_block_id})); nothing was freed.")
    return <int32_t>v


cdef object _host_headroom():
    """(bytes, what) this process can still allocate, the least of the figures the system gives
    (see Note [Bookkeeping memory]); None when it gives none."""
    import os
    import resource
    figures = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    figures.append((int(line.split()[1]) * 1024, "the available physical memory (MemAvailable)"))
                    break
    except OSError:
        pass
    if not figures:
        try:
            figures.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the free physical memory"))
        except (ValueError, OSError):
            pass
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        if path is not None:
            base = "/sys/fs/cgroup" + path.rstrip("/")
            with open(base + "/memory.max") as f:
                top = f.read().strip()
            if top != "max":
                with open(base + "/memory.current") as f:
                    current = int(f.read())
                figures.append((int(top) - current, f"the cgroup's memory.max ({top} bytes, {current} in use)"))
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        in_use = {resource.RLIMIT_AS: int(fields[0]) * resource.getpagesize(),
                  resource.RLIMIT_DATA: int(fields[5]) * resource.getpagesize()}
    except (OSError, IndexError, ValueError):
        in_use = {}
    for limit, name in ((resource.RLIMIT_AS, "RLIMIT_AS"), (resource.RLIMIT_DATA, "RLIMIT_DATA")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY and limit in in_use:
            figures.append((soft - in_use[limit], f"the {name} limit ({soft} bytes, {in_use[limit]} in use)"))
    return min(figures) if figures else None


cdef tuple page_intervals(page_first_block, page_num_blocks, int num_pages, int64_t id_to_page_num,
                          int64_t id_to_page_den, int64_t max_block_id):
    """The intervals as int64 arrays (first, count), one entry per page, checked: lengths, ratio,
    max_block_id, no negative count, every interval inside [0, max_block_id) and mapping to its
    own page. O(pages), whatever the number of blocks (Note [Bookkeeping memory])."""
    import numpy as np
    cdef int P = num_pages, p
    first = np.asarray(page_first_block, dtype=np.int64).reshape(-1)
    count = np.asarray(page_num_blocks, dtype=np.int64).reshape(-1)
    if first.size != P or count.size != P:
        raise KVCachedConfigError(
            f"page_first_block / page_num_blocks have {first.size} / {count.size} entries; the page "
            f"table has {P} page ids: give one entry per page id.")
    if id_to_page_num < 1 or id_to_page_den < 1:
        raise KVCachedConfigError(
            f"id_to_page_num={id_to_page_num}, id_to_page_den={id_to_page_den} must both be >= 1 "
            f"(dense layouts: block_bytes, page_bytes; sparse ids: 1, ids_per_page).")
    if not 0 <= max_block_id < (1 << 31):
        raise KVCachedConfigError(f"max_block_id={max_block_id} must be in [0, 2**31)")
    if (count < 0).any():
        bad = int(np.flatnonzero(count < 0)[0])
        raise KVCachedConfigError(f"page {bad} has page_num_blocks={int(count[bad])} < 0")
    used = count > 0
    if ((first < 0) | (first + count > max_block_id))[used].any():
        bad = int(np.flatnonzero(used & ((first < 0) | (first + count > max_block_id)))[0])
        raise KVCachedConfigError(
            f"page {bad}'s ids [{int(first[bad])}, {int(first[bad] + count[bad])}) fall outside [0, {max_block_id})")
    # b * num // den never decreases with b, so an interval maps to its page when both of
    # its ends do: O(pages), where one entry per block cost ~32 bytes (Note [Bookkeeping memory])
    lo = np.where(used, first, 0)
    hi = np.where(used, first + count - 1, 0)
    if used.any() and max(int(hi.max()), 1) * id_to_page_num >= (1 << 62):
        raise KVCachedConfigError("block_id * id_to_page_num overflows 62 bits; reduce the ratio")
    page_ids = np.arange(P, dtype=np.int64)
    bad_lo = used & (lo * id_to_page_num // id_to_page_den != page_ids)
    bad_hi = used & (hi * id_to_page_num // id_to_page_den != page_ids)
    if (bad_lo | bad_hi).any():
        p = int(np.flatnonzero(bad_lo | bad_hi)[0])
        b = int(lo[p] if bad_lo[p] else hi[p])
        raise KVCachedConfigError(
            f"block {b} is in page {p}'s interval but maps to page {b * id_to_page_num // id_to_page_den} "
            f"by ({b} * {id_to_page_num}) // {id_to_page_den}: the intervals and the ratio disagree.")
    return first, count


cdef int check_bookkeeping_fits(int64_t needed, int64_t total, int64_t max_block_id, int num_pages) except -1:
    """Raise KVCachedConfigError, before anything is allocated, when `needed` bytes of bookkeeping
    exceed what the process can still allocate (Note [Bookkeeping memory])."""
    cdef int P = num_pages
    headroom = _host_headroom()
    if headroom is not None and needed > headroom[0]:
        raise KVCachedConfigError(
            f"{total} blocks (ids below {max_block_id}, {P} pages) need {needed} bytes "
            f"({needed / (1 << 30):.1f} GiB) of host memory for the block allocator's bookkeeping (9 bytes per block id, 8 more per id below "
            f"{<int>ID_CACHE_MAX}), but {max(0, headroom[0])} bytes are left under {headroom[1]}: ask for fewer blocks "
            f"(num_blocks), or give the process more memory.")
    return 0


# Note [Block id objects]
# alloc returns a list of Python ints, and above 256 each new int is a heap object: making and
# later destroying them cost ~15 ns each, about 60 % of alloc(256)+free's time, more than all the
# bookkeeping (benchmarks/HISTORY.md). So the allocator keeps one int object per block id below
# ID_CACHE_MAX, made the first time the id is handed out, and hands out new references to it:
# ints are immutable, so sharing them is invisible to callers (only `is` could tell). The table
# is calloc'ed (untouched parts cost no memory); what is used costs 8 bytes of pointer and one
# 32-byte int per id ever handed out (2.5 MB for 64K blocks), released with the allocator. Only
# pages ever adopted can hold cached ids, so __dealloc__ walks just those. Filled and read with
# the GIL held (alloc builds its list with it), so no lock is needed.
# The entries of every id a page can hand out are written once at construction, so that the
# memory behind them is faulted in then: a page fault in alloc waits behind the refill thread's
# driver calls, which hold the process's address-space lock (every 4th alloc(16) of the
# page-grouped ramp took tens of times its median, its ids being 4096 apart, one fresh OS page
# per page id; benchmarks/HISTORY.md). Sparse ids touch one OS page per page id below
# ID_CACHE_MAX (at most 4 MiB).
#
# Note [Bookkeeping memory]
# The allocator's host memory is its arrays: per block id one state byte (max_block_id of them,
# written at construction), per usable block 4 bytes of free stack and 4 of held stack (allocated
# up front but only touched as pages are adopted and blocks held), 8 bytes of id-object table per
# id below ID_CACHE_MAX (written at construction, Note [Block id objects]), and ~35 bytes per
# page. The constructor's checks used numpy arrays of one int64 per block — ~32 bytes per block
# at their peak — so KVCacheManager(10**9, ...) asked for ~32 GB and was killed by the OOM killer
# without a word; they now look at each page's first and last id only (b * num // den never
# decreases with b), O(pages). Before allocating, the constructor compares the arrays' total with
# what the process can still allocate: the kernel's MemAvailable, the cgroup's memory.max less
# its use, and the RLIMIT_AS / RLIMIT_DATA soft limits less the process's size, and refuses with
# the figures (KVCachedConfigError) rather than die midway. The whole total is compared, touched
# or not: what is reserved counts against the limits now and is touched as the cache fills.
#
# Note [Counts and ids past int32]
# Counts arrive as Python ints of any size. alloc and try_to_reserve read them with
# PyLong_AsLongLongAndOverflow (one call, no exception on the way) and compare with total_blocks
# before sizing anything by them: a count above it, up to 2**64 and past, can never be served, so
# it is the contract's "more than is available" — None / False at once, counted as a failed
# alloc, nothing else changed — where a C int argument raised a bare OverflowError and a count
# just below 2**31 had a buffer of 4 bytes per id malloc'ed first. Negative counts of any size
# raise ValueError naming n. free converts a list of exact ints in range in one C loop
# (kvc_ids_from_list, borrowed items, no reference counting), leaving numpy ints and ids out of
# range, of any size, to block_id_of, which raises BlockStateError naming the id.
