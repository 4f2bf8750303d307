# PageTable: what one page id maps, mapped all-or-nothing. See Note [Page table].

cdef int _check_ranges_alive(list ranges) except -1:
    """Raise MappingError if a range was freed: its addresses may belong to someone else now."""
    cdef VirtualRange r
    for r in ranges:
        if r.freed:
            raise MappingError(f"{r!r} of this page table was freed; its addresses may belong to someone "
                               f"else now, so nothing is mapped or unmapped there")
    return 0


cdef void _trim_handle_cache(Backend backend, int keep) noexcept nogil:
    """Release cached handles from the top of the cache until `keep` remain (best effort).

    A failed map recycles what it acquired: the cache hits go back where they were, but handles
    it created would stay cached, holding memory the caller did not have before the call. They
    were pushed last, so releasing the top down to the count seen at the start undoes exactly
    them. See Note [Page table]."""
    cdef uint64_t handle
    cdef size_t size_bytes
    while True:
        pthread_mutex_lock(&backend._lock)
        if backend.cache_count <= keep:
            pthread_mutex_unlock(&backend._lock)
            return
        backend.cache_count -= 1
        handle = backend.cache_handles[backend.cache_count]
        size_bytes = backend.cache_sizes[backend.cache_count]
        backend.cached_bytes -= size_bytes
        pthread_mutex_unlock(&backend._lock)
        backend._release_counted(handle, size_bytes)


cdef enum:
    _SMALL_IDS = 16        # map/unmap check this many ids without numpy (Note [Page table validation])

cdef enum:
    _STAGE_NONE = 0        # nothing done for the segment in progress
    _STAGE_ACQUIRED = 1    # its handle acquired
    _STAGE_ZERO_OFF = 2    # the zero page unmapped from its address
    _STAGE_MAPPED = 3      # its handle mapped (access not yet set)


cdef class PageTable:
    """Maps the page ids of one KV group through a backend.

    Page id p backs `num_segments` mappings of `map_bytes` each: segment i at
    `segment_base[i] + p * map_bytes` (a layout gives the segments: 2·L of them for per_layer,
    one compound mapping for interleaved and page_grouped). With `zero_page`, every page id that
    is not mapped shows one shared read-only zero page instead of faulting.

    Not thread-safe by itself: the page allocator serialises calls per page id.
    """

    def __init__(self, Backend backend not None, list segments not None, size_t map_bytes, int num_pages, bint zero_page=False):
        """segments: [(VirtualRange, offset_bytes)], one per mapping of a page id.

        Raises MappingError if a segment's pages do not fit its range or are misaligned,
        KVCachedConfigError for empty or non-positive sizes, OutOfDeviceMemory if the zero page
        cannot be had."""
        cdef VirtualRange r
        cdef int i
        cdef uint64_t handle = 0
        if num_pages <= 0 or not segments:
            raise KVCachedConfigError(f"a page table needs num_pages > 0 and segments (got {num_pages}, {len(segments)})")
        backend.check_aligned(map_bytes, "map_bytes")
        span_bytes = <object>map_bytes * <object>num_pages     # Python ints: no size_t wrap-around
        spans = []
        for item, offset in segments:
            if not isinstance(item, VirtualRange):
                raise MappingError(f"segment range {item!r} is not a VirtualRange (make one with backend.reserve)")
            r = item
            if r.backend is not backend:
                raise MappingError("every segment's range must belong to the page table's backend")
            if r.freed:
                raise MappingError(f"{r!r} was freed; reserve a new range")
            r.check_offset(offset, span_bytes)
            spans.append((r.address + offset, len(spans)))
        spans.sort()
        for (start, i), (next_start, j) in zip(spans, spans[1:]):
            if next_start < start + span_bytes:
                raise MappingError(
                    f"segments {i} and {j} overlap: each spans {span_bytes} bytes (map_bytes x num_pages) "
                    f"from 0x{start:x} and 0x{next_start:x}; give each its own offsets")
        self.backend = backend
        self.num_pages = num_pages
        self.num_segments = len(segments)
        self.map_bytes = map_bytes
        self.ranges = [r for r, _ in segments]
        self.segment_base = <uintptr_t*>malloc(self.num_segments * sizeof(uintptr_t))
        self.handles = <uint64_t*>calloc(<size_t>num_pages * self.num_segments, sizeof(uint64_t))
        self.mapped = <uint8_t*>calloc(num_pages, 1)
        if self.segment_base == NULL or self.handles == NULL or self.mapped == NULL:
            raise MemoryError("no memory for the page table")
        for i, (r, offset) in enumerate(segments):
            self.segment_base[i] = r.address + <size_t>offset
        if zero_page:
            self._map_zero_page()

    def _map_zero_page(self):
        cdef uint64_t handle = 0
        cdef int p, s
        cdef uintptr_t address
        if self.backend.acquire_handle(self.map_bytes, &handle) == _OOM:
            raise OutOfDeviceMemory("zero page", 2, "out of memory", f"{self.map_bytes} bytes for the shared zero page")
        self.zero_handle = handle
        self.zero_page = True
        # The handle may come from the cache, holding a former page's data: zero it on both backends.
        if isinstance(self.backend, CudaBackend):
            address = self.segment_base[0]
            self.backend._map(address, self.map_bytes, handle)
            self.backend._set_access(address, self.map_bytes, True)
            (<CudaBackend>self.backend).memset(address, 0, self.map_bytes)
            self.backend._unmap(address, self.map_bytes)
        elif isinstance(self.backend, HostBackend):
            check_os(fallocate((<HostBackend>self.backend).fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                               <long>(handle - 1), <long>self.map_bytes) != 0, "fallocate(PUNCH_HOLE)")
        with nogil:
            for p in range(self.num_pages):
                for s in range(self.num_segments):
                    address = self.segment_base[s] + <size_t>p * self.map_bytes
                    self.backend._map(address, self.map_bytes, self.zero_handle)
                    self.backend._set_access(address, self.map_bytes, False)

    def __dealloc__(self):
        if self.handles != NULL and self.backend is not None:
            try:
                self.close()
            except Exception:
                pass
        free(self.segment_base)
        free(self.handles)
        free(self.mapped)

    # -- the data path -----------------------------------------------------------------------
    cdef int map_pages(self, const int32_t* page_ids, int n) except -1 nogil:
        """Map every page id in `page_ids` (each valid and unmapped: the caller checked).

        Returns 0, or _OOM with the table exactly as before. On a driver error, undoes this
        call's steps and raises."""
        cdef int pages_done = 0, segments_done = 0, stage = _STAGE_NONE, rc = -1
        cdef int cached_before = self.backend.cache_count    # a racy read is fine: see _trim_handle_cache
        try:
            rc = self._map_forward(page_ids, n, &pages_done, &segments_done, &stage)
        finally:
            if rc != 0:
                self._map_rollback(page_ids, pages_done, segments_done, stage)
                _trim_handle_cache(self.backend, cached_before)
        return rc

    cdef int _map_forward(self, const int32_t* page_ids, int n, int* pages_done, int* segments_done,
                          int* stage) except -1 nogil:
        cdef int i, s, rc
        cdef int32_t p
        cdef uint64_t handle
        cdef uintptr_t address
        for i in range(n):
            p = page_ids[i]
            for s in range(self.num_segments):
                address = self.segment_base[s] + <size_t>p * self.map_bytes
                stage[0] = _STAGE_NONE
                rc = self.backend.acquire_handle(self.map_bytes, &handle)
                if rc != 0:
                    return rc
                self.handles[<size_t>p * self.num_segments + s] = handle
                stage[0] = _STAGE_ACQUIRED
                if self.zero_page:
                    self.backend._unmap(address, self.map_bytes)
                stage[0] = _STAGE_ZERO_OFF
                self.backend._map(address, self.map_bytes, handle)
                stage[0] = _STAGE_MAPPED
                self.backend._set_access(address, self.map_bytes, True)
                segments_done[0] = s + 1
            self.mapped[p] = 1
            self.num_mapped += 1
            pages_done[0] = i + 1
            segments_done[0] = 0
        return 0

    cdef void _map_rollback(self, const int32_t* page_ids, int pages_done, int segments_done, int stage) noexcept nogil:
        # Best effort: a failure while undoing is reported as unraisable, never hides the first.
        cdef int i, s
        cdef int32_t p
        cdef uintptr_t address
        cdef size_t index
        if pages_done < 0:
            return
        p = page_ids[pages_done]
        # the segment in progress, by how far it got
        address = self.segment_base[segments_done] + <size_t>p * self.map_bytes if segments_done < self.num_segments else 0
        index = <size_t>p * self.num_segments + segments_done
        if segments_done < self.num_segments and stage >= _STAGE_ACQUIRED:
            if stage >= _STAGE_MAPPED:
                self.backend._unmap(address, self.map_bytes)
            if self.zero_page and stage >= _STAGE_ZERO_OFF:
                self._remap_zero(address)
            self.backend.recycle_handle(self.handles[index], self.map_bytes)
            self.handles[index] = 0
        for s in range(segments_done):
            self._unmap_segment(p, s)
        for i in range(pages_done):
            p = page_ids[i]
            for s in range(self.num_segments):
                self._unmap_segment(p, s)
            self.mapped[p] = 0
            self.num_mapped -= 1

    cdef void _remap_zero(self, uintptr_t address) noexcept nogil:
        self.backend._map(address, self.map_bytes, self.zero_handle)
        self.backend._set_access(address, self.map_bytes, False)

    cdef int _unmap_segment(self, int32_t page_id, int segment) except -1 nogil:
        cdef uintptr_t address = self.segment_base[segment] + <size_t>page_id * self.map_bytes
        cdef size_t index = <size_t>page_id * self.num_segments + segment
        cdef uint64_t handle = self.handles[index]
        if handle == 0:
            return 0
        self.backend._unmap(address, self.map_bytes)
        self.handles[index] = 0
        self.backend.recycle_handle(handle, self.map_bytes)
        if self.zero_page:
            self.backend._map(address, self.map_bytes, self.zero_handle)
            self.backend._set_access(address, self.map_bytes, False)
        return 0

    cdef int unmap_pages(self, const int32_t* page_ids, int n) except -1 nogil:
        """Unmap every page id in `page_ids` (each mapped: the caller checked); handles go back
        through the backend's cache. Raises on a driver error (the page stays marked mapped,
        with the segments not yet unmapped still in place)."""
        cdef int i, s
        cdef int32_t p
        for i in range(n):
            p = page_ids[i]
            for s in range(self.num_segments):
                self._unmap_segment(p, s)
            self.mapped[p] = 0
            self.num_mapped -= 1
        return 0

    # -- Python surface: validates, then calls the data path ---------------------------------
    cdef int _small_ids(self, page_ids, bint want_mapped, int32_t* out) except -2:
        """The fast check of map/unmap (Note [Page table validation]): for a list or tuple of at
        most _SMALL_IDS exact ints, validate as _checked_ids does (same errors, same order) and
        copy them to out; returns their count. -1: not such a sequence, use _checked_ids."""
        cdef Py_ssize_t n, i, j
        if type(page_ids) is not list and type(page_ids) is not tuple:
            return -1
        n = len(page_ids)
        if n > _SMALL_IDS:
            return -1
        for i in range(n):
            if type(page_ids[i]) is not int:
                return -1
        for i in range(n):
            x = page_ids[i]
            if x < 0 or x >= self.num_pages:       # Python compare: no overflow for huge ints
                raise MappingError(f"page id {x} is out of range [0, {self.num_pages})")
            out[i] = <int32_t>(<long long>x)
        for i in range(1, n):
            for j in range(i):
                if out[i] == out[j]:
                    raise MappingError(f"page ids {list(page_ids)} contain duplicates")
        for i in range(n):
            if (self.mapped[out[i]] != 0) != want_mapped:
                raise MappingError(f"page {out[i]} is {'not ' if want_mapped else 'already '}mapped")
        return <int>n

    cdef object _checked_ids(self, page_ids, bint want_mapped):
        import numpy as np
        ids = np.asarray(page_ids)
        if ids.size == 0:
            return np.empty(0, dtype=np.int32)
        if ids.dtype.kind not in "iu":
            raise MappingError(f"page ids must be integers, got dtype {ids.dtype} ({page_ids!r:.80})")
        if ids.dtype.kind == "u" and ids.max() >= self.num_pages:
            raise MappingError(f"page id {ids.max()} is out of range [0, {self.num_pages})")
        ids = np.ascontiguousarray(ids.astype(np.int64).reshape(-1))
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_pages):
            bad = ids[(ids < 0) | (ids >= self.num_pages)][0]
            raise MappingError(f"page id {bad} is out of range [0, {self.num_pages})")
        if np.unique(ids).size != ids.size:
            raise MappingError(f"page ids {ids.tolist()} contain duplicates")
        for p in ids.tolist():
            if bool(self.mapped[p]) != want_mapped:
                raise MappingError(f"page {p} is {'not ' if want_mapped else 'already '}mapped")
        return ids.astype(np.int32)

    def map(self, page_ids) -> bool:
        """Map the given page ids, all or nothing. Returns False (nothing changed) when out of
        memory. Raises MappingError for an id out of range, repeated or already mapped."""
        cdef int rc = 0, n
        cdef int32_t small[_SMALL_IDS]
        cdef int32_t[::1] ids
        n = self._small_ids(page_ids, False, small)
        if n >= 0:
            _check_ranges_alive(self.ranges)
            if n == 0:
                return True
            with nogil:
                rc = self.map_pages(small, n)
            return rc == 0
        ids = self._checked_ids(page_ids, False)
        _check_ranges_alive(self.ranges)
        if ids.shape[0] == 0:
            return True
        with nogil:
            rc = self.map_pages(&ids[0], <int>ids.shape[0])
        return rc == 0

    def unmap(self, page_ids) -> None:
        """Unmap the given page ids. Raises MappingError (nothing changed) for an id out of range,
        repeated or not mapped."""
        cdef int n
        cdef int32_t small[_SMALL_IDS]
        cdef int32_t[::1] ids
        n = self._small_ids(page_ids, True, small)
        if n >= 0:
            _check_ranges_alive(self.ranges)
            if n > 0:
                with nogil:
                    self.unmap_pages(small, n)
            return
        ids = self._checked_ids(page_ids, True)
        _check_ranges_alive(self.ranges)
        if ids.shape[0] == 0:
            return
        with nogil:
            self.unmap_pages(&ids[0], <int>ids.shape[0])

    def driver_floor(self, int page_id, int repeats=50):
        """Benchmark hook: what mapping `page_id` costs in driver calls alone. Takes one handle
        per segment (through the cache) once, then `repeats` times maps every segment and unmaps
        them again, timing each pass over all segments in two ways: "raw" (CUDA: cuMemMap +
        cuMemSetAccess straight from cydriver, the context bound once per pass; host: the
        backend's primitives) and "primitives" (the backend's _map + _set_access, which bind the
        context per call, as map_pages does). Returns {"raw_map_us", "raw_unmap_us",
        "primitives_map_us"}: lists of µs per pass. The page table's state is not touched: the
        page id must be unmapped and the zero page off. Raises MappingError otherwise."""
        cdef uint64_t* handles
        cdef int s, r, got = 0, rc
        cdef int nseg = self.num_segments
        cdef size_t mb = self.map_bytes
        cdef uintptr_t base
        cdef double t0, t1, t2
        cdef bint cuda = isinstance(self.backend, CudaBackend)
        cdef CudaBackend cb = self.backend if cuda else None
        if not 0 <= page_id < self.num_pages or self.mapped[page_id] or self.zero_page:
            raise MappingError(f"driver_floor needs an unmapped page id in [0, {self.num_pages}) and no zero page")
        _check_ranges_alive(self.ranges)
        raw_map, raw_unmap, prim_map = [], [], []
        handles = <uint64_t*>calloc(nseg, sizeof(uint64_t))
        if handles == NULL:
            raise MemoryError
        try:
            for s in range(nseg):
                rc = self.backend.acquire_handle(mb, &handles[s])
                if rc != 0:
                    raise OutOfDeviceMemory("driver_floor", 2, "out of memory", f"{nseg} handles of {mb} bytes")
                got += 1
            for r in range(repeats):
                with nogil:
                    t0 = _now()
                    if cuda:
                        cb._bind()
                        for s in range(nseg):
                            base = self.segment_base[s] + <size_t>page_id * mb
                            check(cydriver.cuMemMap(<cydriver.CUdeviceptr>base, mb, 0,
                                                    <cydriver.CUmemGenericAllocationHandle>handles[s], 0), "cuMemMap")
                            check(cydriver.cuMemSetAccess(<cydriver.CUdeviceptr>base, mb, &cb.access_rw, 1),
                                  "cuMemSetAccess")
                    else:
                        for s in range(nseg):
                            base = self.segment_base[s] + <size_t>page_id * mb
                            self.backend._map(base, mb, handles[s])
                            self.backend._set_access(base, mb, True)
                    t1 = _now()
                    if cuda:
                        cb._bind()
                        for s in range(nseg):
                            check(cydriver.cuMemUnmap(<cydriver.CUdeviceptr>(self.segment_base[s] + <size_t>page_id * mb), mb),
                                  "cuMemUnmap")
                    else:
                        for s in range(nseg):
                            self.backend._unmap(self.segment_base[s] + <size_t>page_id * mb, mb)
                    t2 = _now()
                raw_map.append((t1 - t0) * 1e6)
                raw_unmap.append((t2 - t1) * 1e6)
                with nogil:
                    t0 = _now()
                    for s in range(nseg):
                        base = self.segment_base[s] + <size_t>page_id * mb
                        self.backend._map(base, mb, handles[s])
                        self.backend._set_access(base, mb, True)
                    t1 = _now()
                    for s in range(nseg):
                        self.backend._unmap(self.segment_base[s] + <size_t>page_id * mb, mb)
                prim_map.append((t1 - t0) * 1e6)
        finally:
            for s in range(got):
                self.backend.recycle_handle(handles[s], mb)
            free(handles)
        return {"raw_map_us": raw_map, "raw_unmap_us": raw_unmap, "primitives_map_us": prim_map}

    def is_mapped(self, int page_id) -> bool:
        if not 0 <= page_id < self.num_pages:
            raise MappingError(f"page id {page_id} is out of range [0, {self.num_pages})")
        return bool(self.mapped[page_id])

    def mapped_page_ids(self) -> list:
        return [p for p in range(self.num_pages) if self.mapped[p]]

    @property
    def mapped_bytes(self) -> int:
        """Physical bytes mapped for page ids (the zero page not counted)."""
        return self.num_mapped * self.num_segments * self.map_bytes

    @property
    def page_bytes(self) -> int:
        """Physical bytes one page id maps, over all its segments."""
        return self.num_segments * self.map_bytes

    def segment_addresses(self, int page_id) -> list:
        """Where each mapping of `page_id` lies."""
        if not 0 <= page_id < self.num_pages:
            raise MappingError(f"page id {page_id} is out of range [0, {self.num_pages})")
        return [self.segment_base[s] + page_id * self.map_bytes for s in range(self.num_segments)]

    def close(self):
        """Unmap every page id and release the zero page; the table is empty afterwards."""
        cdef int p, s
        cdef uintptr_t address
        if self.handles == NULL:
            return
        if self.num_mapped or self.zero_page:
            _check_ranges_alive(self.ranges)
        for p in range(self.num_pages):
            if self.mapped[p]:
                for s in range(self.num_segments):
                    self._unmap_segment(p, s)
                self.mapped[p] = 0
                self.num_mapped -= 1
        if self.zero_page:
            self.zero_page = False
            with nogil:
                for p in range(self.num_pages):
                    for s in range(self.num_segments):
                        address = self.segment_base[s] + <size_t>p * self.map_bytes
                        self.backend._unmap(address, self.map_bytes)
            self.backend.recycle_handle(self.zero_handle, self.map_bytes)
            self.zero_handle = 0

    def check_invariants(self):
        """O(pages · segments): handles present exactly for mapped page ids; counters agree."""
        count = 0
        seen = set()
        for p in range(self.num_pages):
            for s in range(self.num_segments):
                handle = self.handles[<size_t>p * self.num_segments + s]
                has = handle != 0
                assert has == bool(self.mapped[p]), f"page {p} segment {s}: handle {has}, mapped {self.mapped[p]}"
                if has:
                    assert handle not in seen, f"page {p} segment {s}: handle {handle} mapped twice"
                    assert handle != self.zero_handle, f"page {p} segment {s}: holds the zero page's handle"
                    seen.add(handle)
            count += self.mapped[p]
        assert count == self.num_mapped, f"num_mapped {self.num_mapped} != {count}"
        assert self.zero_page == (self.zero_handle != 0), f"zero_page {self.zero_page}, zero handle {self.zero_handle}"

# Note [Page table]
# A page id is the unit the allocator hands out, and one page id may need several mappings
# (per_layer: one per (layer, K/V) buffer). map_pages is all-or-nothing: it records how far it got
# (pages done, segments of the page in progress, and the stage of the segment in progress), and on
# out of memory or a driver error undoes exactly those steps, so the caller sees the table as it
# was, live memory included: handles this call created are released again rather than left in the
# cache (physical and cached bytes as before); only the cumulative counters (num_creates,
# num_releases, num_cache_hits) show the attempt. Handles go back through the backend's cache, so a
# page unmapped and mapped again soon after skips cuMemCreate. With the zero page on, an unmapped
# page id shows the one shared zero page, read-only: engines that read unallocated blocks (padding)
# read zeros instead of faulting, at the price of mapping every page id at creation and an extra
# unmap + map per page map and unmap. The zero page's handle may come from the cache, so it is
# zeroed when the table is made.
#
# Note [Page table validation]
# PageTable.map/unmap are the Python surface (tests, benchmarks, tools; the allocators call the
# nogil map_pages directly). Their numpy check of the ids (asarray, unique, astype) costs ~10 us,
# a quarter of a compound page map on the H200 (~45 us), so a list or tuple of up to _SMALL_IDS
# exact ints is checked in a C loop instead, with the same errors in the same order (range, then
# duplicates, then mapped state). Anything else (arrays, numpy ints, bools, floats) takes the numpy
# path, which is what decides how those are accepted or refused.
