"""The service of a tensor-parallel rank > 0: applies the scheduling rank's maps and unmaps to
this rank's page tables and answers each request.

One daemon thread receives requests (over kvcached.tp.shm or kvcached.tp.channel) and handles
them one at a time. Lock rule: ``_cond`` guards the tables, ``_fast`` and the closed flag and is
held while a request is handled here, so a local shutdown never tears a table down under a map.
The segment's fast path (shm) applies a map or unmap without it, on a table it found in
``_fast``: a shutdown that closes that table meanwhile is serialised with the map by the table's
own lock, and a map that comes second fails as closed and is answered as an error, as a request
after close() is refused. See Note [Follower life cycle].
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from .._threads import start_daemon
from ..errors import DriverError, KVCachedTPError
from .channel import (
    ERROR,
    HELLO,
    MAP,
    OK,
    OOM,
    QUERY,
    REGISTER,
    RELEASE_CACHED,
    STOP,
    STOPPED,
    UNMAP,
    LinkBase,
    Request,
)

BACKEND_CODES = ("", "cuda", "host")      # a backend kind in a hello reply

if TYPE_CHECKING:
    from ..core import Backend, PageTable

logger = logging.getLogger("kvcached")


class Follower:
    """Serves one instance's page operations on this rank's backend.

    Page ids that this rank failed to unmap (its table marks them 2) are kept per table and
    unmapped again before each later map of that table; a map that asks for one still stuck is
    out of memory on this rank (the scheduling rank rolls every rank back)."""

    def __init__(self, channel: LinkBase, backend: Backend, page_bytes: int) -> None:
        self.channel = channel
        self.backend = backend
        self.page_bytes = page_bytes
        self.num_requests = 0                           # handled here (the segment counts the rest: num_served)
        self.error: BaseException | None = None         # why serving ended, if not by STOP
        self.stopped = threading.Event()                # the service thread has ended
        self._cond = threading.Condition()
        self._tables: dict[int, tuple[PageTable, tuple[int, ...]]] = {}
        self._streams: dict[int, int] = {}              # table id -> the stream an unmap waits for
        self._stuck: dict[int, set[int]] = {}
        self._fast: dict[int, PageTable] = {}           # shm: the tables whose rounds the segment applies itself
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = start_daemon(self._serve, f"kvcached-tp-rank{self.channel.rank}")

    def add_table(self, table_id: int, table: PageTable, geometry: tuple[int, ...], stream: int = 0) -> None:
        """Serve `table` under `table_id` (alloc_kv_cache on this rank); wakes a REGISTER that waits.
        Each unmap of the table first waits for the work queued on `stream` (a CUstream as int)
        on this rank's device: the scheduling rank's fence covers only its own device."""
        with self._cond:
            self._tables[table_id] = (table, geometry)
            self._streams[table_id] = stream
            self._stuck[table_id] = set()
            self._refresh_fast(table_id)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop applying requests (later ones are answered STOPPED); the caller then closes the
        tables. Does not wait for the thread: See Note [Follower life cycle]."""
        with self._cond:
            self._closed = True
            self._tables.clear()
            self._fast.clear()
            self._cond.notify_all()

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        """Whether serving ended (STOP from the scheduling rank, or its loss) within `timeout_s`;
        if it did, the thread is joined (it only returns then)."""
        if not self.stopped.wait(timeout_s):
            return False
        self._thread.join()
        return True

    # -- the service thread ------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            self._serve_loop()
        except Exception as exc:                 # the scheduling rank is gone: nothing to answer
            self.error = exc.with_traceback(None)   # no frame (and its gloo work) outlives the thread
            with self._cond:
                if not self._closed:
                    logger.error("tensor-parallel rank %d: lost the scheduling rank (%s); its pages stay mapped "
                                 "until shutdown_kvcached() here", self.channel.rank, str(exc).splitlines()[0][:200])
        finally:
            self.channel.release()          # before `stopped`: the process group may be destroyed after it
            self.stopped.set()

    def _serve_loop(self) -> None:
        """Receive, apply and answer requests until STOP."""
        if self.channel.kind == "shm":
            return self._serve_rounds()
        channel = self.channel
        while True:
            channel.wait_request()
            if self._answer(channel.read_request()) == STOP:
                return

    def _answer(self, req: Request) -> int:
        """Handle `req` the general way and answer it; its op."""
        self.num_requests += 1
        status, count, args, payload = self._handle(req)
        with self._cond:
            self._refresh_fast(req.table_id)
        self.channel.answer(req, status, count, args, payload)
        return req.op

    def _serve_rounds(self) -> None:
        """The shared-memory loop: the segment applies and answers every map or unmap of a
        table in ``_fast`` itself, without the GIL around the driver calls and without a Python
        object per page id (RoundSegment.serve); the rest comes here. See Note [Round segment]
        in tp/rounds.pyx."""
        channel = self.channel
        while True:
            try:
                got = channel.serve(self._fast, self._streams)
            except KVCachedTPError:
                raise                           # rank 0 is gone
            except Exception as exc:            # the table raised: the request is ours to answer
                self._fast_failed(channel.read_request(), exc)
                continue
            req = channel.read_request()
            if got == 2:
                self._fast_refused(req)
            elif self._answer(req) == STOP:
                return

    def _refresh_fast(self, table_id: int) -> None:
        """Whether `table_id`'s maps and unmaps take the fast path: a live table with no page id
        stuck after a failed unmap (those need the checks of _map). Assumes _cond."""
        entry = self._tables.get(table_id)
        if entry is None or self._closed or self._stuck.get(table_id):
            self._fast.pop(table_id, None)
        else:
            self._fast[table_id] = entry[0]

    def _fast_failed(self, req: Request, exc: Exception) -> None:
        """The fast path raised: what the table's undo left mapped is unmapped again later (as
        _map and _unmap do), and the error goes back to the scheduling rank."""
        logger.error("tensor-parallel rank %d: %s failed: %s", self.channel.rank, req.name, exc)
        with self._cond:
            entry = self._tables.get(req.table_id)
            if entry is not None:
                self._stuck[req.table_id].update(p for p in req.page_ids if entry[0].is_mapped(p))
                self._refresh_fast(req.table_id)
        self.num_requests += 1
        self.channel.answer(req, *self._error(f"{req.name} failed: {type(exc).__name__}: {exc}"))

    def _fast_refused(self, req: Request) -> None:
        """The fast path's unmap left some page ids mapped (the driver refused): they are
        retried before the next map of the table."""
        with self._cond:
            table = self._tables[req.table_id][0]
            stuck = self._stuck[req.table_id]
            stuck.update(p for p in req.page_ids if table.is_mapped(p))
            self._refresh_fast(req.table_id)
            left = len(stuck.intersection(req.page_ids))
        logger.warning("tensor-parallel rank %d: %d page id(s) of group %d could not be unmapped; retried "
                       "before the next map", self.channel.rank, left, req.table_id)
        self.num_requests += 1
        self.channel.answer(req, OK, left, (), None)

    def _handle(self, req: Request):
        """(status, count, reply args, payload tensor or None) for one request."""
        with self._cond:
            if req.op == STOP:
                self._unmap_everything()
                self._closed = True
                return OK, 0, (), None
            if self._closed:
                return STOPPED, 0, (), None
            if len(req.page_ids) != req.num_ids:
                return self._error(f"received a {req.name} request of {req.num_ids} page ids that carries "
                                   f"{len(req.page_ids)}: the control channel was corrupted; restart every rank")
            try:
                if req.op == HELLO:
                    return self._hello(*req.args[:2])
                if req.op == RELEASE_CACHED:
                    self.backend.release_cached()
                    return OK, 0, (), None
                if req.op == REGISTER:
                    return self._register(req.table_id, req.args)
                entry = self._tables.get(req.table_id)
                if entry is None:
                    return self._error(f"has no KV group {req.table_id}: call alloc_kv_cache(..., group_id="
                                       f"{req.table_id}) on every rank")
                table = entry[0]
                if req.op == MAP:
                    return self._map(req.table_id, table, req.page_ids)
                if req.op == UNMAP:
                    return OK, self._unmap(req.table_id, table, req.page_ids), (), None
                if req.op == QUERY:
                    ids = table.mapped_page_ids()
                    return OK, len(ids), (), ids
                return self._error(f"does not know operation {req.op}")
            except Exception as exc:
                logger.exception("tensor-parallel rank %d: %s failed", self.channel.rank, req.name)
                return self._error(f"{req.name} failed: {type(exc).__name__}: {exc}")

    def _error(self, text: str):
        return ERROR, 0, (), f"rank {self.channel.rank} {text}"[:4000]

    def _hello(self, page_bytes: int, world_size: int):
        if (page_bytes, world_size) != (self.page_bytes, self.channel.world_size):
            return self._error(f"has pages of {self.page_bytes} bytes in a world of {self.channel.world_size}, the "
                               f"scheduling rank {page_bytes} bytes in {world_size}: pass the same page_size_bytes "
                               f"(KVCACHED_PAGE_SIZE_MB) and world_size to init_kvcached on every rank")
        # this rank's backend, for a leader without pages (init_kvcached(device="none"))
        kind = BACKEND_CODES.index(self.backend.kind) if self.backend.kind in BACKEND_CODES else 0
        return OK, 0, (kind, self.backend.granularity, int(self.backend.integrated_memory)), None

    def _register(self, table_id: int, geometry: tuple[int, ...]):
        """Wait (KVCACHED_TP_TIMEOUT_S, the lock released meanwhile) for this rank's
        alloc_kv_cache of `table_id`, then compare geometries."""
        if not self._cond.wait_for(lambda: self._closed or table_id in self._tables, self.channel.timeout_s):
            return self._error(f"did not call alloc_kv_cache(..., group_id={table_id}) within KVCACHED_TP_TIMEOUT_S="
                               f"{self.channel.timeout_s:g} s: call it on every rank, with the same shape")
        if self._closed:
            return STOPPED, 0, (), None
        mine = self._tables[table_id][1]
        if tuple(mine) != tuple(geometry[:len(mine)]):
            return self._error(f"holds KV group {table_id} as (layout, num_pages, segments per page, bytes per "
                               f"segment) = {tuple(mine)}, the scheduling rank as {tuple(geometry[:len(mine)])}: pass "
                               f"the same shape, block size, dtype and KVCACHED_LAYOUT on every rank")
        return OK, 0, (), None

    def _map(self, table_id: int, table, page_ids: list[int]):
        stuck = self._retry_stuck(table_id, table)
        if stuck.intersection(page_ids):
            return OOM, 0, (), None                 # still mapped here after a failed unmap
        try:
            ok = table.map(page_ids)
        except Exception:
            # what the table's undo left mapped (marked 2) is unmapped again later
            stuck.update(p for p in page_ids if table.is_mapped(p))
            raise
        return (OK if ok else OOM), 0, (), None

    def _unmap(self, table_id: int, table, page_ids: list[int]) -> int:
        """Unmap what this rank has of `page_ids`; returns how many stay stuck (mapped)."""
        ids = [p for p in page_ids if table.is_mapped(p)]
        stuck = self._stuck[table_id]
        if ids:
            self.backend.wait_for_stream(self._streams[table_id])
            try:
                table.unmap(ids)
            except DriverError:
                stuck.update(p for p in ids if table.is_mapped(p))
                logger.warning("tensor-parallel rank %d: %d page id(s) of group %d could not be unmapped; retried "
                               "before the next map", self.channel.rank, len(stuck), table_id)
        return len(stuck.intersection(page_ids))

    def _retry_stuck(self, table_id: int, table) -> set[int]:
        stuck = self._stuck[table_id]
        if stuck:
            ids = sorted(p for p in stuck if table.is_mapped(p))
            try:
                if ids:
                    table.unmap(ids)
            except DriverError:
                pass
            stuck.intersection_update(p for p in ids if table.is_mapped(p))
        return stuck

    def _unmap_everything(self) -> None:
        """STOP: every page of every table goes (close() of the tables follows at shutdown)."""
        for table_id, (table, _) in self._tables.items():
            ids = table.mapped_page_ids()
            if ids:
                try:
                    self.backend.wait_for_stream(self._streams[table_id])
                    table.unmap(ids)
                except DriverError:
                    logger.warning("tensor-parallel rank %d: group %d: %d page id(s) stay mapped until "
                                   "shutdown_kvcached() here", self.channel.rank, table_id, table.num_mapped)


# Note [Follower life cycle]
# A rank > 0 starts its service in init_kvcached and registers each page table as alloc_kv_cache
# makes it. Serving ends when the scheduling rank sends STOP (its shutdown_kvcached: every page is
# unmapped first) or when its connection fails (it died). shutdown_kvcached on this rank closes
# the service first (under the lock, so a request being applied finishes), then closes the tables;
# a request that comes later is answered STOPPED (an unmap or stop is then fine for the scheduling
# rank, a map is an error). The thread is not joined: it may be blocked in a gloo receive, which
# only a message or the connection's loss ends (gloo cannot abort a pending receive), and it is a
# daemon, so it never holds up the process's exit; wait_stopped() waits for it where wanted.
