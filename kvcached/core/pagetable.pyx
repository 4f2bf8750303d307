# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.pagetable: what one page id maps, through a backend of kvcached.core.vmm.

PageTable maps every segment of a page id all-or-nothing, with rollback (Note [Page table]), an
optional shared read-only zero page, failed unmaps kept rather than lost (Note [Failed unmap] in
pagealloc), and an optional mirror on peer ranks (Note [Mirrored page table]). The C contract is
pagetable.pxd; it cimports only vmm; pagealloc and blockalloc cimport it.
"""

from libc.stdint cimport int32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc

from kvcached.core._posix cimport pthread_mutex_destroy, pthread_mutex_init, pthread_mutex_lock, pthread_mutex_unlock
from kvcached.core.vmm cimport (
    _OOM, Backend, VirtualRange, _raise_if_oom, lifecycle_check, lifecycle_check_owned,
    lifecycle_close, lifecycle_init, lifecycle_live, lifecycle_name, lifecycle_owned,
)

from kvcached.errors import KVCachedConfigError, MappingError, OutOfDeviceMemory

# PageTable: what one page id maps, mapped all-or-nothing. See Note [Page table].

cdef int _check_ranges_alive(list ranges) except -1:
    """Raise MappingError if a range was freed: its addresses may belong to someone else now."""
    cdef VirtualRange r
    for r in ranges:
        if r.freed:
            raise MappingError(f"{r!r} of this page table was freed; its addresses may belong to someone "
                               f"else now, so nothing is mapped or unmapped there")
    return 0


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

    Thread-safe: `lock` serialises map_pages, unmap_pages and close (the page allocator also
    holds its map_lock around them); it is only ever waited on without the GIL, and a failure
    path may take the GIL while holding it. In a forked child every method raises and close()
    does nothing (Note [Fork and close]).
    """

    def __cinit__(self, *args, **kwargs):
        pthread_mutex_init(&self.lock, NULL)
        lifecycle_init(&self.life)

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
        # The handle may come from the cache, holding a former page's data: zero it (the CUDA
        # backend maps it at the first segment's first page meanwhile, unmapped until below).
        self.backend._zero_fill(handle, self.map_bytes, self.segment_base[0])
        with nogil:
            for p in range(self.num_pages):
                for s in range(self.num_segments):
                    address = self.segment_base[s] + <size_t>p * self.map_bytes
                    self._remap_zero(address)

    def __dealloc__(self):
        if lifecycle_owned(&self.life):             # a forked child touches nothing: Note [Fork and close]
            if self.handles != NULL and self.backend is not None and lifecycle_live(&self.life):
                try:
                    self.close()
                except Exception:
                    pass
            pthread_mutex_destroy(&self.lock)
        free(self.segment_base)
        free(self.handles)
        free(self.mapped)

    @property
    def lifecycle(self) -> str:
        """"live", "closed" (close() was called) or "forked" (inherited by a forked child)."""
        return lifecycle_name(&self.life)

    cdef int _check_usable(self) except -1 nogil:
        return lifecycle_check(&self.life, b"page table",
                               b"its KV tensors were shut down; call init_kvcached and alloc_kv_cache again.")

    # -- the data path -----------------------------------------------------------------------
    cdef int map_pages(self, const int32_t* page_ids, int n) except -1 nogil:
        """Map every page id in `page_ids` (each valid and unmapped: the caller checked) here
        and, with a mirror, on its peers too (Note [Mirrored page table]): 0, or _OOM with
        every table as before. Raises what _map_local or the mirror raises, nothing left
        mapped but what an undo could not unmap (marked 2)."""
        if self.mirror is None:                 # a racy read: the mirror is set before any map
            return self._map_local(page_ids, n)
        with gil:
            return self._map_mirrored(page_ids, n)

    cdef int _map_mirrored(self, const int32_t* page_ids, int n) except -1:
        cdef int rc = -1
        mirror = self.mirror
        ids = [page_ids[i] for i in range(n)]
        mirror.map_start(ids)                   # raises: nothing mapped anywhere
        try:
            with nogil:
                rc = self._map_local(page_ids, n)
        except BaseException:
            mirror.map_finish(False)            # the peers undo; the local error goes on
            raise
        try:
            peers_mapped = mirror.map_finish(rc == 0)
        except BaseException:
            if rc == 0:
                with nogil:
                    self._unmap_local(page_ids, n)
            raise
        if rc == 0 and not peers_mapped:
            try:
                with nogil:
                    self._unmap_local(page_ids, n)  # what fails to go stays marked 2: the caller settles it
            finally:
                mirror.map_undone()     # only now may the mirror's next round or reader run
            rc = _OOM
        return rc

    cdef int _map_local(self, const int32_t* page_ids, int n) except -1 nogil:
        """Map every page id in `page_ids` on this table's backend.

        Returns 0, or _OOM with the table exactly as before. On a driver error, undoes this
        call's steps and raises it; a step of the undo that fails too leaves its page id marked
        mapped (mapped = 2: to be unmapped, never used) and is counted in
        num_rollback_failures, the undo going on past it. Raises KVCachedClosedError when closed or
        in a forked child. Takes `lock`."""
        cdef int pages_done = 0, segments_done = 0, stage = _STAGE_NONE, rc = -1
        cdef int cached_before
        self._check_usable()        # before the lock, which the parent's thread may have held at fork
        pthread_mutex_lock(&self.lock)
        try:
            self._check_usable()    # again under it: close() may have come between
            cached_before = self.backend.cache_count    # a hint: see _undo_map
            try:
                rc = self._map_forward(page_ids, n, &pages_done, &segments_done, &stage)
            finally:
                if rc != 0:
                    self._undo_map(page_ids, pages_done, segments_done, stage, cached_before, rc == -1)
        finally:
            pthread_mutex_unlock(&self.lock)
        return rc

    cdef int _undo_map(self, const int32_t* page_ids, int pages_done, int segments_done, int stage,
                       int cached_before, bint raising) except -1 nogil:
        """Roll a failed map back (Note [Page table]). Every step is tried; when the map itself
        raised (`raising`), that error goes on and the undo's own failures are only counted;
        after out of memory, the undo's first failure is raised."""
        with gil:
            first = None
            try:
                self._map_rollback(page_ids, pages_done, segments_done, stage)
            except BaseException as exc:
                first = exc
            try:
                # The rollback recycled what the map acquired: cache hits went back where they
                # were, but handles the map created would stay cached, holding memory the caller
                # did not have before. They were pushed last, so the cache's top down to the
                # count seen at the start is exactly them (a racy count only releases more).
                self.backend.release_cached_above(cached_before)
            except BaseException as exc:
                first = exc if first is None else first
                self.num_rollback_failures += 1
            if first is not None:
                self.last_rollback_error = first
                if not raising:
                    raise first
        return 0

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
                rc = self.backend._map(address, self.map_bytes, handle)
                if rc != 0:
                    return rc
                stage[0] = _STAGE_MAPPED
                rc = self.backend._set_access(address, self.map_bytes, True)
                if rc != 0:
                    return rc
                segments_done[0] = s + 1
            self.mapped[p] = 1
            self.num_mapped += 1
            pages_done[0] = i + 1
            segments_done[0] = 0
        return 0

    cdef int _map_rollback(self, const int32_t* page_ids, int pages_done, int segments_done, int stage) except -1:
        """Undo a failed _map_forward (GIL held: a failure path). Every step is tried even after
        one fails; a page id with a segment still mapped afterwards stays marked mapped (2: to
        be unmapped before any use, never handed out) and counted. Raises the first failure."""
        cdef int i, s
        cdef int32_t p = page_ids[pages_done]
        cdef uintptr_t address
        cdef size_t index
        cdef uint64_t handle
        first = None
        if segments_done < self.num_segments and stage >= _STAGE_ACQUIRED:
            # the segment in progress, by how far it got
            address = self.segment_base[segments_done] + <size_t>p * self.map_bytes
            index = <size_t>p * self.num_segments + segments_done
            handle = self.handles[index]
            try:
                if stage >= _STAGE_MAPPED:
                    self.backend._unmap(address, self.map_bytes)
            except BaseException as exc:
                first = exc                         # still mapped: the handle stays with the page
            else:
                self.handles[index] = 0
                try:
                    self.backend.recycle_handle(handle, self.map_bytes)
                except BaseException as exc:
                    first = exc if first is None else first
                if self.zero_page and stage >= _STAGE_ZERO_OFF:
                    try:
                        self._remap_zero(address)
                    except BaseException as exc:
                        first = exc if first is None else first
        for s in range(segments_done):
            first = self._unmap_segment_caught(p, s, first)
        if self._page_has_handles(p):
            self.mapped[p] = 2
            self.num_mapped += 1
        for i in range(pages_done):
            p = page_ids[i]
            for s in range(self.num_segments):
                first = self._unmap_segment_caught(p, s, first)
            if self._page_has_handles(p):
                self.mapped[p] = 2
            else:
                self.mapped[p] = 0
                self.num_mapped -= 1
        if first is not None:
            self.num_rollback_failures += 1
            raise first
        return 0

    cdef object _unmap_segment_caught(self, int32_t page_id, int segment, object first):
        # _unmap_segment, for the undo and close loops: returns the first failure seen so far
        try:
            if self._unmap_segment(page_id, segment) == 1:
                return self.last_unmap_error if first is None else first
        except BaseException as exc:
            return exc if first is None else first
        return first

    cdef bint _page_has_handles(self, int32_t page_id) noexcept nogil:
        cdef int s
        for s in range(self.num_segments):
            if self.handles[<size_t>page_id * self.num_segments + s] != 0:
                return True
        return False

    cdef int _remap_zero(self, uintptr_t address) except -1 nogil:
        """Show the shared zero page, read-only, at `address` (nothing mapped there). Raises on
        failure, out of memory included, with nothing mapped there."""
        cdef int rc = self.backend._map(address, self.map_bytes, self.zero_handle)
        _raise_if_oom(rc, "map(zero page)", self.map_bytes)
        try:
            rc = self.backend._set_access(address, self.map_bytes, False)
        finally:
            if rc != 0:     # never leave the zero page writable (or inaccessible but mapped)
                self.backend._unmap(address, self.map_bytes)
        return _raise_if_oom(rc, "set_access(zero page)", self.map_bytes)

    cdef int _unmap_segment(self, int32_t page_id, int segment) except -1 nogil:
        """Unmap one segment of a page id (hold `lock`); its handle goes back through the cache
        and, with the zero page, the zero page shows there again. Returns 0, or 1 when the
        unmap itself failed: the segment stays mapped with its handle, so a later call retries
        it, and the error is in last_unmap_error (Note [Failed unmap]). Raises when giving the
        handle back or showing the zero page fails (the segment is unmapped then)."""
        cdef uintptr_t address = self.segment_base[segment] + <size_t>page_id * self.map_bytes
        cdef size_t index = <size_t>page_id * self.num_segments + segment
        cdef uint64_t handle = self.handles[index]
        cdef int code
        if handle == 0:
            return 0
        code = self.backend._unmap_status(address, self.map_bytes)
        if code != 0:
            with gil:
                self.last_unmap_error = self.backend._unmap_error(code)
                self.num_unmap_failures += 1
            return 1
        self.handles[index] = 0
        try:
            self.backend.recycle_handle(handle, self.map_bytes)
        finally:
            if self.zero_page:
                self._remap_zero(address)
        return 0

    cdef int unmap_pages(self, const int32_t* page_ids, int n) except -1 nogil:
        """_unmap_local, and with a mirror the same ids on its peers (Note [Mirrored page
        table]): this table's page ids are unmapped even when the mirror fails, whose error is
        raised afterwards."""
        if self.mirror is None:
            return self._unmap_local(page_ids, n)
        with gil:
            return self._unmap_mirrored(page_ids, n)

    cdef int _unmap_mirrored(self, const int32_t* page_ids, int n) except -1:
        cdef int failed = 0
        mirror = self.mirror
        first = None
        try:
            mirror.unmap_start([page_ids[i] for i in range(n)])
        except BaseException as exc:
            first = exc
        with nogil:
            failed = self._unmap_local(page_ids, n)
        if first is None:
            try:
                mirror.unmap_finish()
            except BaseException as exc:
                first = exc
        if first is not None:
            raise first
        return failed

    cdef int _unmap_local(self, const int32_t* page_ids, int n) except -1 nogil:
        """Unmap the page ids in `page_ids` that are mapped (others are skipped); handles go back
        through the backend's cache. Returns how many could not be unmapped because the driver
        refused an unmap: each stays marked mapped (2: only unmapping may follow) with the
        segments that did not go, the error in last_unmap_error; the others are still tried
        (Note [Failed unmap]). Raises for other failures (releasing a handle, the zero page),
        stopping there; callers read mapped[] to tell what was unmapped. Works on a closed table
        (on what a failed close left); raises KVCachedClosedError in a forked child. Takes `lock`."""
        cdef int i, s, bad, failed = 0
        cdef int32_t p
        lifecycle_check_owned(&self.life, b"page table")   # a forked child raises before the lock (its holder may be the parent's thread)
        pthread_mutex_lock(&self.lock)
        try:
            self.backend._check_live()
            for i in range(n):
                p = page_ids[i]
                if self.mapped[p] == 0:
                    continue
                self.mapped[p] = 2                  # until its last segment is gone
                bad = 0
                for s in range(self.num_segments):
                    bad |= self._unmap_segment(p, s)
                if bad:
                    failed += 1
                else:
                    self.mapped[p] = 0
                    self.num_mapped -= 1
        finally:
            pthread_mutex_unlock(&self.lock)
        return failed

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
        repeated or not mapped; DriverError when the driver refused to unmap some (they stay
        mapped, marked 2, and the others are unmapped: call unmap on them again)."""
        cdef int n
        cdef int32_t small[_SMALL_IDS]
        cdef int32_t[::1] ids
        cdef int failed = 0
        n = self._small_ids(page_ids, True, small)
        if n >= 0:
            _check_ranges_alive(self.ranges)
            if n > 0:
                with nogil:
                    failed = self.unmap_pages(small, n)
        else:
            ids = self._checked_ids(page_ids, True)
            _check_ranges_alive(self.ranges)
            if ids.shape[0] > 0:
                with nogil:
                    failed = self.unmap_pages(&ids[0], <int>ids.shape[0])
        if failed:
            raise self.last_unmap_error

    def set_mirror(self, mirror) -> None:
        """Repeat every map and unmap of this table through `mirror` from now on (None: stop).

        `mirror` has map_start(ids), map_finish(mapped_here) -> bool, map_undone(),
        unmap_start(ids) and unmap_finish(); see Note [Mirrored page table] for the contract. Attaching needs a
        table with no page id mapped (peers start empty too): MappingError otherwise."""
        if mirror is not None:
            for name in ("map_start", "map_finish", "map_undone", "unmap_start", "unmap_finish"):
                if not callable(getattr(mirror, name, None)):
                    raise KVCachedConfigError(f"mirror {mirror!r} has no method {name}(); see PageTable.set_mirror")
        self._check_usable()
        with nogil:
            pthread_mutex_lock(&self.lock)
        try:
            self._check_usable()
            if mirror is not None and self.num_mapped:
                raise MappingError(f"set_mirror needs a table with no page id mapped ({self.num_mapped} are); "
                                   f"attach the mirror before the first map")
            self.mirror = mirror
        finally:
            pthread_mutex_unlock(&self.lock)

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
        """Unmap every page id and release the zero page, then mark the table closed: map raises
        KVCachedClosedError from then on; unmap still unmaps what a failed close left mapped. Every
        page is tried; the first failure is raised at the end (the pages it concerns stay
        mapped, counted). Idempotent; does nothing in a forked child. Takes `lock`."""
        if self.handles == NULL or not lifecycle_live(&self.life):
            return
        with nogil:
            pthread_mutex_lock(&self.lock)
        try:
            if not lifecycle_live(&self.life):
                return
            if self.num_mapped or self.zero_page:
                _check_ranges_alive(self.ranges)
            lifecycle_close(&self.life)
            self._close_locked()
        finally:
            pthread_mutex_unlock(&self.lock)

    cdef int _close_locked(self) except -1:
        cdef int p, s
        cdef uintptr_t address
        cdef bint zero_left = False
        first = None
        for p in range(self.num_pages):
            if self.mapped[p]:
                self.mapped[p] = 2
                for s in range(self.num_segments):
                    first = self._unmap_segment_caught(p, s, first)
                if not self._page_has_handles(p):
                    self.mapped[p] = 0
                    self.num_mapped -= 1
        if self.zero_page:
            for p in range(self.num_pages):
                for s in range(self.num_segments):
                    if self.handles[<size_t>p * self.num_segments + s] != 0:
                        zero_left = True            # a page's own mapping that could not go
                        continue
                    address = self.segment_base[s] + <size_t>p * self.map_bytes
                    try:
                        self.backend._unmap(address, self.map_bytes)
                    except BaseException as exc:
                        first = exc if first is None else first
                        zero_left = True
            if not zero_left:                       # else still mapped somewhere: never reused
                self.zero_page = False
                try:
                    self.backend.recycle_handle(self.zero_handle, self.map_bytes)
                finally:
                    self.zero_handle = 0
        if first is not None:
            raise first
        return 0

    def check_invariants(self):
        """O(pages · segments): handles present for every segment of a mapped page id (1), none
        for an unmapped one, any for one being unmapped after a failure (2); no handle twice;
        counters agree."""
        count = 0
        seen = set()
        for p in range(self.num_pages):
            assert self.mapped[p] in (0, 1, 2), f"page {p}: mapped byte {self.mapped[p]}"
            for s in range(self.num_segments):
                handle = self.handles[<size_t>p * self.num_segments + s]
                has = handle != 0
                if self.mapped[p] != 2:
                    assert has == bool(self.mapped[p]), f"page {p} segment {s}: handle {has}, mapped {self.mapped[p]}"
                if has:
                    assert handle not in seen, f"page {p} segment {s}: handle {handle} mapped twice"
                    assert handle != self.zero_handle, f"page {p} segment {s}: holds the zero page's handle"
                    seen.add(handle)
            count += self.mapped[p] != 0
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
# The undo itself calls the driver and can fail. It runs with the GIL (a failure path), tries every
# step, and raises its first failure at the end — unless the map raised already, whose error then
# goes on (the undo's is kept in last_rollback_error). A page id that still has a segment mapped
# after the undo is marked mapped = 2: the allocator never hands it out, only unmaps it again
# (Note [Failed unmap]). Out of memory from cuMemMap / cuMemSetAccess (host: ENOMEM from mmap or
# mprotect, e.g. at vm.max_map_count) is out of memory like cuMemCreate's: a value, undone, None.
#
# Note [Page table validation]
# PageTable.map/unmap are the Python surface (tests, benchmarks, tools; the allocators call the
# nogil map_pages directly). Their numpy check of the ids (asarray, unique, astype) costs about a
# quarter of a compound page map (benchmarks/HISTORY.md), so a list or tuple of up to _SMALL_IDS
# exact ints is checked in a C loop instead, with the same errors in the same order (range, then
# duplicates, then mapped state). Anything else (arrays, numpy ints, bools, floats) takes the numpy
# path, which is what decides how those are accepted or refused.


# Note [Mirrored page table]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under tensor parallelism every rank holds its share of the KV heads for the same page ids, so
# a page id is usable only once every rank has mapped it. The scheduling rank's table carries a
# mirror (kvcached/tp) and stays the one place that decides; map_pages and unmap_pages call it:
#
#   mirror.map_start(ids)         before mapping here: the peers start mapping at once, so the
#                                 ranks map in parallel. Raising: nothing was mapped anywhere.
#   mirror.map_finish(ok) -> bool always called after a map_start that returned, with whether
#                                 this table mapped them; waits for the peers. True: every peer
#                                 mapped all of them. False, or ok False: every peer that mapped
#                                 has unmapped them again before it returns. Raising (a peer
#                                 gone): this table unmaps them and the error goes on.
#   mirror.map_undone()           after map_finish(True) returned False, once this table has
#                                 unmapped them too. Until then the mirror stays serialised:
#                                 a reader of every rank's pages (kvcached.tp's
#                                 mapped_everywhere) once saw this table one page ahead of its
#                                 peers in that window, when a peer was out of memory.
#   mirror.unmap_start(ids)       before unmapping here; peers unmap what they have of ids.
#   mirror.unmap_finish()         after; waits for them. This table unmaps either way, then a
#                                 mirror error is raised.
#
# The mirror serialises its own start/finish pairs (a refill and an alloc may map at once) and
# is called with the GIL held and no lock of this table taken. close() unmaps locally only: the
# mirror's owner tears the peers down. Out of memory anywhere is out of memory: the map returns
# _OOM with every rank as before, so an alloc returns None.
