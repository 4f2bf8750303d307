# cython: language_level=3
"""The round segment of a tensor-parallel instance on one host: shared memory in which the
scheduling rank (0) posts a request (map / unmap of page ids, or a control request) and every
other rank answers in its own slot, each side waiting on a process-shared POSIX semaphore of the
segment without the GIL. The C contract is rounds.pxd; the protocol above it (what a request
means, liveness, who creates and unlinks the file) is kvcached/tp/shm.py. See Note [Round segment].
"""

from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t
from libc.string cimport memcpy, memset

from kvcached.core._posix cimport (
    CLOCK_MONOTONIC,
    EINTR,
    ETIMEDOUT,
    MAP_FAILED,
    MAP_SHARED,
    PROT_READ,
    PROT_WRITE,
    errno,
    fstat,
    ftruncate,
    mmap,
    munmap,
    sem_clockwait,
    sem_init,
    sem_trywait,
    sem_post,
    stat,
    timespec,
    clock_gettime,
    usleep,
)
from kvcached.core.pagetable cimport PageTable
from kvcached.core.vmm cimport _OOM, check_os

from kvcached.errors import KVCachedConfigError, KVCachedTPError

cdef extern from *:
    """
    #if defined(__x86_64__) || defined(__i386__)
    #include <immintrin.h>
    static inline void kvcached_cpu_relax(void) { _mm_pause(); }
    #elif defined(__aarch64__)
    static inline void kvcached_cpu_relax(void) { __asm__ __volatile__("yield" ::: "memory"); }
    #else
    static inline void kvcached_cpu_relax(void) { }
    #endif
    """
    void cpu_relax "kvcached_cpu_relax"() nogil

cdef int _RELAX_PER_CHECK = 32          # pause instructions between two polls of the semaphore


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef uint64_t _MAGIC = 0x314D53505443564B   # "KVCTPSM1"
cdef int64_t _VERSION = 1
REQUEST_SLOTS = _REQUEST_SLOTS
REPLY_SLOTS = _REPLY_SLOTS
MAX_RANKS = _MAX_RANKS

# Request ops the fast path applies; they match kvcached.tp.channel's MAP and UNMAP.
cdef int _OP_MAP = 3
cdef int _OP_UNMAP = 4
# Reply statuses, as kvcached.tp.channel's OK and OOM.
cdef int _OK = 0
cdef int _STATUS_OOM = 1


cdef inline size_t _align(size_t n) noexcept nogil:
    return (n + 63) & ~(<size_t>63)


def segment_bytes(int world_size, int64_t capacity_ids) -> int:
    """Bytes of a segment for `world_size` ranks whose requests carry up to `capacity_ids` page ids."""
    return (_align(sizeof(SegmentHeader)) + _align(world_size * sizeof(RankSlot)) + _align(capacity_ids * 4)
            + world_size * _align(capacity_ids * 4))


cdef class RoundSegment:
    """One instance's round segment, mapped in this process.

    ``RoundSegment(fd, world_size, capacity_ids, create=True)`` sizes the file of `fd` and
    initialises it (header, semaphores); ``create=False`` maps one another process made and
    checks that its header matches what was agreed: a segment that does not (another layout,
    another world size, a tampered file) raises KVCachedTPError naming the field. The fd may be
    closed afterwards. Page ids are int32; a request carries at most `capacity_ids` of them.
    """

    def __cinit__(self, int fd, int world_size, int64_t capacity_ids, bint create):
        cdef stat st
        cdef size_t size
        cdef void* addr
        cdef int r
        if not 2 <= world_size <= _MAX_RANKS:
            raise KVCachedConfigError(f"world_size={world_size} is outside [2, {_MAX_RANKS}] for a round segment; "
                                      f"use KVCACHED_TP_TRANSPORT=gloo for larger tensor-parallel groups")
        if not 1 <= capacity_ids <= (1 << 28):
            raise KVCachedConfigError(f"capacity_ids={capacity_ids} is outside [1, {1 << 28}]")
        size = segment_bytes(world_size, capacity_ids)
        if create:
            check_os(ftruncate(fd, <long>size), b"ftruncate")
        else:
            check_os(fstat(fd, &st), b"fstat")
            if <size_t>st.st_size != size:
                raise KVCachedTPError(f"round segment holds {st.st_size} bytes, {size} expected for {world_size} ranks "
                                      f"and {capacity_ids} page ids: it was changed or belongs to another instance; "
                                      f"restart every rank", operation="attach")
        addr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if addr == MAP_FAILED:
            check_os(-1, b"mmap")
        self.base = <char*>addr
        self.total_bytes = size
        self.world_size = world_size
        self.capacity_ids = capacity_ids
        self.created = create
        self.header = <SegmentHeader*>self.base
        self.slots = <RankSlot*>(self.base + _align(sizeof(SegmentHeader)))
        self.ids = <int32_t*>(<char*>self.slots + _align(world_size * sizeof(RankSlot)))
        self.payloads = <char*>self.ids + _align(capacity_ids * 4)
        if create:
            memset(self.base, 0, _align(sizeof(SegmentHeader)) + _align(world_size * sizeof(RankSlot)))
            for r in range(1, world_size):
                check_os(sem_init(&self.slots[r].request_ready, 1, 0), b"sem_init")
                check_os(sem_init(&self.slots[r].reply_ready, 1, 0), b"sem_init")
            self.header.version = _VERSION
            self.header.world_size = world_size
            self.header.capacity_ids = capacity_ids
            self.header.total_bytes = <int64_t>size
            self.header.magic = _MAGIC           # last: a reader that sees it sees the rest
        else:
            self.check_header()

    def __dealloc__(self):
        # The semaphores are not destroyed: another rank may still wait on one (sem_destroy of a
        # waited-on semaphore is undefined), and on Linux they own nothing outside the segment.
        if self.base != NULL:
            munmap(self.base, self.total_bytes)
            self.base = NULL

    def check_header(self) -> None:
        """Raise KVCachedTPError if the header is not the one this segment was made with."""
        expected = {"magic": (self.header.magic, _MAGIC), "version": (self.header.version, _VERSION),
                    "world_size": (self.header.world_size, self.world_size),
                    "capacity_ids": (self.header.capacity_ids, self.capacity_ids),
                    "total_bytes": (self.header.total_bytes, <int64_t>self.total_bytes)}
        for name, (found, wanted) in expected.items():
            if found != wanted:
                raise KVCachedTPError(f"round segment field {name} is {found:#x}, {wanted:#x} expected: the segment "
                                      f"was changed or belongs to another instance; restart every rank",
                                      operation="attach")

    cdef int _check_rank(self, int rank) except -1:
        if not 0 < rank < self.world_size:
            raise KVCachedConfigError(f"rank {rank} is outside [1, {self.world_size}) of this round segment")
        return 0

    # -- identities (liveness is judged above, from these) ---------------------------------------
    def set_identity(self, int rank, int64_t pid, int64_t start_time, int64_t pid_ns) -> None:
        """Record the process that serves `rank` (0: the scheduling rank)."""
        if not 0 <= rank < self.world_size:
            raise KVCachedConfigError(f"rank {rank} is outside [0, {self.world_size})")
        self.header.identity[rank][0] = pid
        self.header.identity[rank][1] = start_time
        self.header.identity[rank][2] = pid_ns

    def identity(self, int rank) -> tuple:
        """(pid, start time, pid namespace) of `rank`'s process; pid 0 until it attached."""
        if not 0 <= rank < self.world_size:
            raise KVCachedConfigError(f"rank {rank} is outside [0, {self.world_size})")
        return (self.header.identity[rank][0], self.header.identity[rank][1], self.header.identity[rank][2])

    # -- waiting ----------------------------------------------------------------------------------
    cdef int _wait(self, sem_t* sem, double timeout_s) except -1 nogil:
        cdef timespec now, until
        cdef long whole
        cdef int rc, i
        cdef int64_t spin_until
        if sem_trywait(sem) == 0:            # posted already: no clock read, no futex call
            return 1
        if self.spin_ns > 0:                 # See Note [Polling before sleeping]
            spin_until = _now_ns() + min(self.spin_ns, <int64_t>(timeout_s * 1e9))
            while True:
                for i in range(_RELAX_PER_CHECK):
                    cpu_relax()
                if sem_trywait(sem) == 0:
                    return 1
                if _now_ns() >= spin_until:
                    break
        clock_gettime(CLOCK_MONOTONIC, &now)
        whole = <long>timeout_s
        until.tv_sec = now.tv_sec + whole
        until.tv_nsec = now.tv_nsec + <long>((timeout_s - whole) * 1e9)
        if until.tv_nsec >= 1000000000:
            until.tv_sec += 1
            until.tv_nsec -= 1000000000
        while True:
            rc = sem_clockwait(sem, CLOCK_MONOTONIC, &until)
            if rc == 0:
                return 1
            if errno == ETIMEDOUT:
                return 0
            if errno != EINTR:
                check_os(-1, b"sem_clockwait")

    # -- the scheduling rank's side --------------------------------------------------------------
    def post(self, int op, int64_t seq, int table_id, page_ids, args, peers) -> None:
        """Write a request (page ids: a sequence of ints, args: up to 4 ints) and wake every rank
        in `peers`. O(len(page_ids)). Raises KVCachedConfigError when the ids do not fit."""
        cdef int64_t n = len(page_ids), i = 0
        cdef int64_t* request = self.header.request
        cdef int peer
        if n > self.capacity_ids:
            raise KVCachedConfigError(
                f"a request of {n} page ids exceeds this round segment's {self.capacity_ids}: use larger pages "
                f"(KVCACHED_PAGE_SIZE_MB) or KVCACHED_TP_TRANSPORT=gloo")
        for p in page_ids:
            self.ids[i] = p
            i += 1
        request[0] = op
        request[1] = seq
        request[2] = table_id
        request[3] = n
        request[4] = request[5] = request[6] = request[7] = 0
        if len(args) > 4:
            raise KVCachedConfigError(f"a request carries at most 4 arguments, not {len(args)}")
        i = 4
        for a in args:
            request[i] = a
            i += 1
        for peer in peers:
            self._check_rank(peer)
            self.slots[peer].reply[0] = -1       # no reply to this request yet
            check_os(sem_post(&self.slots[peer].request_ready), b"sem_post")

    def wait_reply(self, int peer, double timeout_s) -> bool:
        """Whether `peer` answered within `timeout_s` (waits without the GIL)."""
        cdef int rc
        self._check_rank(peer)
        with nogil:
            rc = self._wait(&self.slots[peer].reply_ready, timeout_s)
        return rc == 1

    def reply(self, int peer) -> tuple:
        """`peer`'s reply: (seq, status, count, arg0..arg4)."""
        self._check_rank(peer)
        cdef int64_t* r = self.slots[peer].reply
        return (r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7])

    def reply_ids(self, int peer, int64_t count) -> list:
        """The `count` page ids `peer` put in its payload. Raises KVCachedTPError if count is out of range."""
        self._check_rank(peer)
        if not 0 <= count <= self.capacity_ids:
            raise KVCachedTPError(f"rank {peer} replied with {count} page ids, outside [0, {self.capacity_ids}]: "
                                  f"the round segment was changed; restart every rank", peer, "query")
        cdef int32_t* payload = <int32_t*>(self.payloads + peer * _align(self.capacity_ids * 4))
        return [payload[i] for i in range(count)]

    def reply_text(self, int peer, int64_t count) -> str:
        """The `count` bytes of UTF-8 text `peer` put in its payload (its error message)."""
        self._check_rank(peer)
        count = max(0, min(count, self.capacity_ids * 4))
        cdef char* payload = self.payloads + peer * _align(self.capacity_ids * 4)
        return payload[:count].decode(errors="replace")

    # -- a serving rank's side -------------------------------------------------------------------
    def wait_request(self, int rank, double timeout_s) -> bool:
        """Whether a request for `rank` came within `timeout_s` (waits without the GIL)."""
        cdef int rc
        self._check_rank(rank)
        with nogil:
            rc = self._wait(&self.slots[rank].request_ready, timeout_s)
        return rc == 1

    def request(self) -> tuple:
        """The request in flight: (op, seq, table_id, num_ids, arg0..arg3)."""
        cdef int64_t* r = self.header.request
        return (r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7])

    def request_ids(self) -> list:
        """The request's page ids. Raises KVCachedTPError if its count is out of range."""
        cdef int64_t n = self.header.request[3]
        if not 0 <= n <= self.capacity_ids:
            raise KVCachedTPError(f"request of {n} page ids, outside [0, {self.capacity_ids}]: the round segment "
                                  f"was changed; restart every rank", operation="request")
        return [self.ids[i] for i in range(n)]

    def answer(self, int rank, int64_t seq, int status, int64_t count=0, args=(), payload=None) -> None:
        """Write `rank`'s reply (payload: a list of page ids, or bytes) and wake the scheduling rank."""
        cdef int64_t i
        cdef int64_t* r
        cdef const unsigned char[:] raw
        cdef int32_t* ids
        cdef char* out
        self._check_rank(rank)
        out = self.payloads + rank * _align(self.capacity_ids * 4)
        if payload is not None:
            if isinstance(payload, (bytes, bytearray)):
                raw = payload
                count = min(len(payload), self.capacity_ids * 4)
                if count:
                    memcpy(out, &raw[0], count)
            else:
                count = len(payload)
                if count > self.capacity_ids:
                    raise KVCachedConfigError(f"a reply of {count} page ids exceeds the round segment's "
                                              f"{self.capacity_ids}")
                ids = <int32_t*>out
                i = 0
                for p in payload:
                    ids[i] = p
                    i += 1
        if len(args) > 5:
            raise KVCachedConfigError(f"a reply carries at most 5 arguments, not {len(args)}")
        r = self.slots[rank].reply
        r[1] = status
        r[2] = count
        r[3] = r[4] = r[5] = r[6] = r[7] = 0
        i = 3
        for a in args:
            r[i] = a
            i += 1
        r[0] = seq
        check_os(sem_post(&self.slots[rank].reply_ready), b"sem_post")

    def gather(self, int64_t seq, double timeout_s) -> tuple:
        """Wait (without the GIL, each up to `timeout_s`) for every rank's reply to request `seq`:
        (answered, ok), bit masks of the ranks (bit r for rank r) whose reply came, and of those
        whose reply is OK with nothing to read (count 0, the right seq). The common round is one
        call; a rank outside `ok` is read with reply() (answered) or waited for again."""
        cdef uint64_t answered = 0, ok = 0
        cdef int peer
        cdef int64_t* r
        with nogil:
            for peer in range(1, self.world_size):
                if self._wait(&self.slots[peer].reply_ready, timeout_s) == 1:
                    answered |= (<uint64_t>1) << peer
                    r = self.slots[peer].reply
                    if r[0] == seq and r[1] == _OK and r[2] == 0:
                        ok |= (<uint64_t>1) << peer
        return answered, ok

    def serve(self, int rank, dict tables, dict streams, double timeout_s) -> int:
        """A serving rank's loop: wait for requests (without the GIL, `timeout_s` at most) and
        apply each map or unmap of a table in `tables` ({table id: PageTable}) through apply()
        (`streams`: {table id: the stream its unmap waits for}), until one needs the caller.
        Returns 0 when none came within `timeout_s`, 1 when the request in flight is for the
        caller to handle and answer, 2 when apply() returned -2 (the caller records the page ids
        left mapped and answers). Raises what apply() raises (the request is then the caller's)."""
        cdef int rc, done
        cdef int64_t* req = self.header.request
        self._check_rank(rank)
        while True:
            with nogil:
                rc = self._wait(&self.slots[rank].request_ready, timeout_s)
            if rc == 0:
                return 0
            if req[0] != _OP_MAP and req[0] != _OP_UNMAP:
                return 1
            table = tables.get(req[2])
            if table is None:
                return 1
            done = self.apply(rank, <PageTable?>table, streams.get(req[2], 0))
            if done == -1:
                return 1
            if done == -2:
                return 2
            self.num_served += 1

    def apply(self, int rank, PageTable table, uintptr_t stream=0) -> int:
        """The fast path of a serving rank: apply the request in flight (a map or an unmap) to
        `table` without the GIL and answer it. Returns the status answered (0 mapped or unmapped,
        1 out of memory: `table` as before); -1 when nothing was done or answered (another op,
        an id out of range or already mapped): the caller then handles the request itself; -2
        when an unmap was done but the driver refused some (they stay marked 2): the caller
        records them and answers. An unmap first waits for the work queued on
        `stream` on this rank's device (its own fence). Raises what the table raises (nothing
        answered then)."""
        cdef int64_t* req = self.header.request
        cdef int64_t op = req[0], n = req[3], i
        cdef int rc = 0
        cdef bint any_mapped = False
        if (op != _OP_MAP and op != _OP_UNMAP) or not 0 < n <= self.capacity_ids or n > table.num_pages:
            return -1
        for i in range(n):
            if not 0 <= self.ids[i] < table.num_pages:
                return -1
            if table.mapped[self.ids[i]]:
                if op == _OP_MAP:
                    return -1
                any_mapped = True
        if op == _OP_MAP:
            with nogil:
                rc = table.map_pages(self.ids, <int>n)
            status = _OK if rc == 0 else _STATUS_OOM
        else:
            if any_mapped:
                with nogil:
                    self._fence_stream(table, stream)
                    rc = table.unmap_pages(self.ids, <int>n)
                if rc != 0:
                    return -2            # some stay mapped (marked 2): the caller records them and answers
            status = _OK
        self.answer(rank, req[1], status)
        return status

    cdef int _fence_stream(self, PageTable table, uintptr_t stream) except -1 nogil:
        cdef uintptr_t fence = 0
        table.backend._record_fence(stream, &fence)
        try:
            while table.backend._fence_done(fence) != 1:
                usleep(50)
        finally:
            table.backend._release_fence(fence)
        return 0


# Note [Round segment]
# ~~~~~~~~~~~~~~~~~~~~
# Between processes of one host a round trip through a pair of process-shared POSIX semaphores
# (a futex each) costs a twentieth to a fiftieth of gloo's send and receive (four thread wake-ups
# a round trip; benchmarks/HISTORY.md), so the ranks of one host exchange their rounds in
# shared memory: rank 0 writes the request (op, seq, table id, page ids, args) into the segment's
# one request area, then posts the request semaphore of every rank it concerns; each rank waits
# on its own semaphore, applies the request and writes its reply (seq, status, count, args, and
# a payload: a query's page ids or an error's text) into its own slot, then posts its reply
# semaphore, on which rank 0 waits. A post is a release and a wait an acquire, so whatever one
# side wrote before its post the other reads after its wait; one request is in flight at a time
# (the Leader's lock), so the request area is never written while a rank reads it. Waits are
# bounded (sem_clockwait on CLOCK_MONOTONIC) and the callers wait in slices, checking between
# them that the other side's process still lives (the identities in the header): a rank that is
# killed fails the round within a slice, one that is stopped within KVCACHED_TP_TIMEOUT_S.
# The semaphores are never destroyed (another process may wait on one); the file is unlinked
# once every rank mapped it, so nothing is left in /dev/shm when a process dies.
# The common round costs rank 0 two calls: post() and gather() (every peer's reply in one wait
# without the GIL; a reply that is OK with nothing to read needs no Python object); a serving
# rank's serve() applies a map or unmap and answers it without returning to Python. A wait
# first tries sem_trywait (a reply already posted costs no clock read and no futex call), then
# sleeps on the semaphore. Polling instead of sleeping was measured and rejected: on a loaded
# 2-core host polling a reply for up to 30 us before sleeping made the empty round trip 1.6 x as
# long (p50) and its p99 2-5 x; letting both sides poll for 20 or 100 us made the p50 6-22 x as
# long and the p99 milliseconds (benchmarks/HISTORY.md): the poller takes the core the other side
# needs. Note [Polling before sleeping] says when it pays.
#
# Note [Polling before sleeping]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On a host with idle cores the opposite holds: there a sleeping waiter's core drops into a deep
# idle state, and waking it through the futex took most of an empty round trip on an idle
# 16-core host, three times the loaded 2-core host's (benchmarks/HISTORY.md). So a wait may poll
# the semaphore for spin_ns first (sem_trywait between bursts of pause instructions, without the
# GIL, never past its timeout) and sleep only if nothing came: a rank that just answered a round is
# then still polling when the next one comes, as during an allocation burst. The spin is set per
# segment from KVCACHED_TP_SPIN_US (kvcached.tp.shm): by default only where this process may run
# on at least 4 CPUs, so that the poller never takes the core the other side needs.
