# The C-level contract of kvcached.tp.rounds: the shared-memory segment over which the scheduling
# rank of a tensor-parallel instance sends rounds (map / unmap of page ids, and the rarer control
# requests) to the other ranks of its host, and they answer. Waiting is on process-shared POSIX
# semaphores inside the segment, without the GIL. See Note [Round segment] in rounds.pyx.

from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t

from kvcached.core._posix cimport sem_t
from kvcached.core.pagetable cimport PageTable

cdef enum:
    _REQUEST_SLOTS = 8          # op, seq, table_id, num_ids, arg0..arg3
    _REPLY_SLOTS = 8            # seq, status, count, arg0..arg4
    _MAX_RANKS = 64             # world sizes a segment can hold

cdef struct SegmentHeader:      # at offset 0; written once by the creator, read-only afterwards
    uint64_t magic              # _MAGIC: a round segment of this layout
    int64_t version             # _VERSION
    int64_t world_size          # ranks, the scheduling rank (0) included
    int64_t capacity_ids        # page ids one request (or a query's reply) can carry
    int64_t total_bytes         # the segment's size, checked against the file's
    int64_t identity[_MAX_RANKS][3]     # per rank: pid, start time, pid namespace (0 until it attached)
    int64_t request[_REQUEST_SLOTS]     # the request in flight (written by rank 0 before it posts)

cdef struct RankSlot:           # one per rank > 0
    sem_t request_ready         # posted by rank 0 once the request is written
    sem_t reply_ready           # posted by this rank once its reply is written
    int64_t reply[_REPLY_SLOTS] # this rank's answer to the request in flight

cdef class RoundSegment:
    # Lock rule: none inside. Rank 0 writes the request and reads replies under the Leader's lock;
    # each rank > 0 reads the request and writes its own slot from its one service thread; the
    # semaphores order the two sides (a post publishes every write made before it).
    cdef char* base                             # the mapping of the whole segment (MAP_SHARED)
    cdef readonly size_t total_bytes            # its size
    cdef readonly int world_size                # ranks, rank 0 included
    cdef readonly int64_t capacity_ids          # page ids a request or query reply can carry
    cdef SegmentHeader* header                  # at base
    cdef RankSlot* slots                        # [world_size]; slot 0 unused
    cdef int32_t* ids                           # [capacity_ids]: the request's page ids
    cdef char* payloads                         # [world_size][capacity_ids * 4]: each rank's reply payload
    cdef readonly bint created                  # this process made the segment
    cdef readonly uint64_t num_served           # requests serve() applied and answered itself
    cdef public int64_t spin_ns                 # a wait polls this long before it sleeps (0: never)

    cdef int _wait(self, sem_t* sem, double timeout_s) except -1 nogil     # 1 posted, 0 timed out, or raises
    cdef int _check_rank(self, int rank) except -1                          # 0, or raises KVCachedTPError
    cdef int _fence_stream(self, PageTable table, uintptr_t stream) except -1 nogil     # 0 once `stream`'s work is done, or raises
