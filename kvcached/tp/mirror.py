"""The scheduling rank's side of tensor parallelism: one Leader per instance, one TableMirror
per page table (the ``PageMirror`` a table's ``set_mirror`` takes).

The leader sends each request to every peer before the local table acts, then collects the
replies, so the ranks map in parallel (See Note [Leader rounds]). Lock rule: ``Leader.lock``
serialises rounds; a TableMirror holds it from ``*_start`` to ``*_finish`` (the page table calls
both on one thread, with no lock of its own taken); every other public method takes it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from ..errors import KVCachedConfigError, KVCachedTPError
from .channel import (
    ERROR,
    HELLO,
    MAP,
    OK,
    OOM,
    OP_NAMES,
    QUERY,
    REGISTER,
    RELEASE_CACHED,
    STOP,
    STOPPED,
    UNMAP,
    LinkBase,
    Reply,
)

logger = logging.getLogger("kvcached")


class _Round:
    """One request in flight to some peers: what was sent, and to whom (a plain class with
    slots: one is made per map, on the allocator's path)."""

    __slots__ = ("op", "seq", "table_id", "page_ids", "deadline", "peers")

    def __init__(self, op: int, seq: int, table_id: int, page_ids: list[int], deadline: float, peers: list) -> None:
        self.op, self.seq, self.table_id, self.page_ids, self.deadline, self.peers = \
            op, seq, table_id, page_ids, deadline, peers


_OK_REPLY = Reply(0, OK, 0, (0,) * 5)


class Leader:
    """Sends page operations to the peer ranks of one instance and collects their replies.

    ``num_rounds`` counts requests sent (each to every peer it concerns), ``rounds_by_thread``
    the same per sending thread: tests and benchmarks read them to show that the pool's fast
    path sends nothing from the caller's thread."""

    def __init__(self, channel: LinkBase) -> None:
        self.channel = channel
        self.lock = threading.Lock()
        self.num_rounds = 0
        self.rounds_by_thread: Counter[int] = Counter()
        self.stopped = False
        self.peer_backend: tuple[str, int, bool] | None = None     # hello's answer: (kind, granularity, integrated)
        self._seq = 0
        self._gather = getattr(channel, "gather", None)
        self._peer_list = list(self.peers)
        self._num_peers = len(self._peer_list)
        self._all_peers = sum(1 << peer for peer in self.peers)
        self._ok_replies = {peer: _OK_REPLY for peer in self.peers}

    @property
    def peers(self) -> range:
        return range(1, self.channel.world_size)

    # -- rounds (assume the lock) --------------------------------------------------------------
    def _post(self, op: int, table_id: int, page_ids: list[int], args: tuple[int, ...] = (),
              peers=None) -> _Round:
        """Send a request to every peer (or `peers`). Raises KVCachedTPError (channel broken)
        if a peer cannot be reached."""
        name = OP_NAMES[op]
        self.channel.check(operation=name)
        if self.stopped:
            raise KVCachedTPError(f"tensor-parallel {name}: the instance's peers were stopped by shutdown_kvcached(); "
                                  f"call init_kvcached() again on every rank", operation=name)
        self._seq += 1
        self.num_rounds += 1
        self.rounds_by_thread[threading.get_ident()] += 1
        # a peer answers REGISTER once its own alloc_kv_cache came or its wait for it (one
        # timeout) ended: that wait comes on top of the answer's time
        rnd = _Round(op, self._seq, table_id, page_ids, self.channel.deadline(2 if op == REGISTER else 1),
                     self._peer_list if peers is None else list(peers))
        self.channel.send(op, self._seq, table_id, page_ids, args, rnd.peers)
        return rnd

    def _collect(self, rnd: _Round, gathered: tuple[int, int] | None = None) -> dict[int, Reply]:
        """Every peer's reply (and what follows it), within the round's deadline. Over shared
        memory a round sent to every peer is first gathered in one call (unless `gathered`
        holds that call's result already); the replies that are OK with nothing to read then
        share one Reply (its seq is not kept)."""
        channel = self.channel
        if not rnd.deadline:                # a lean round: its deadline counts from here
            rnd.deadline = channel.deadline()
        if self._gather is None or len(rnd.peers) != self._num_peers:
            return {peer: channel.receive(peer, rnd.seq, rnd.op, rnd.deadline) for peer in rnd.peers}
        answered, ok = self._gather(rnd.seq) if gathered is None else gathered
        if ok == self._all_peers and (rnd.op == MAP or rnd.op == UNMAP):
            return self._ok_replies         # nothing in a map's or unmap's OK reply is read
        return {peer: channel.receive(peer, rnd.seq, rnd.op, rnd.deadline, waited=bool(answered >> peer & 1))
                for peer in rnd.peers}

    def call(self, op: int, table_id: int = 0, page_ids: list[int] | None = None,
             args: tuple[int, ...] = ()) -> dict[int, Reply]:
        """One request to every peer and their replies. Raises KVCachedTPError if a peer is
        unreachable or late. Takes the lock."""
        with self.lock:
            return self._collect(self._post(op, table_id, page_ids or [], args))

    @staticmethod
    def _refusal(replies: dict[int, Reply], name: str) -> str:
        """The peers' error messages, one line each ("" when every peer answered OK)."""
        lines = []
        for peer, reply in replies.items():
            if reply.status == ERROR:
                lines.append(f"rank {peer}: {reply.payload}")
            elif reply.status == STOPPED:
                lines.append(f"rank {peer} has shut kvcached down (shutdown_kvcached() ran there), so it cannot "
                             f"{name}")
        return "; ".join(lines)

    # -- instance-wide requests ----------------------------------------------------------------
    def hello(self, page_bytes: int) -> tuple[str, int, bool]:
        """Check that every peer serves this instance with the same page size; the peers'
        backend as (kind, granularity in bytes, integrated memory), which a leader without pages
        takes for its own. Raises KVCachedConfigError naming the peer that differs."""
        from .follower import BACKEND_CODES

        replies = self.call(HELLO, 0, [], (page_bytes, self.channel.world_size))
        refusal = self._refusal(replies, "start")
        if refusal:
            raise KVCachedConfigError(f"tensor-parallel ranks disagree: {refusal}")
        backends = {peer: (BACKEND_CODES[r.args[0]] if 0 <= r.args[0] < len(BACKEND_CODES) else "",
                           r.args[1], bool(r.args[2])) for peer, r in replies.items()}
        first = backends[1]
        for peer, backend in backends.items():
            if backend != first:
                raise KVCachedConfigError(
                    f"tensor-parallel ranks disagree: rank {peer} has a {backend[0]} backend of {backend[1]}-byte "
                    f"granules, rank 1 a {first[0]} backend of {first[1]}: give every rank a device of one kind")
        return first

    def register(self, table_id: int, geometry: tuple[int, ...]) -> None:
        """Wait until every peer has the page table of `table_id` with the same geometry (a peer
        waits up to KVCACHED_TP_TIMEOUT_S for its alloc_kv_cache, then answers). Raises
        KVCachedConfigError naming the peer that differs or lacks it, KVCachedTPError for one
        that is gone."""
        refusal = self._refusal(self.call(REGISTER, table_id, [], geometry), f"register KV group {table_id}")
        if refusal:
            raise KVCachedConfigError(f"KV group {table_id} cannot be mirrored: {refusal}")

    def _mapped(self, replies: dict[int, Reply], table_id: int) -> dict[int, list[int]]:
        refusal = self._refusal(replies, f"report KV group {table_id}")
        if refusal:
            raise KVCachedTPError(f"tensor-parallel query of KV group {table_id} failed: {refusal}", operation="query")
        return {peer: list(reply.payload or []) for peer, reply in replies.items()}

    def mapped_everywhere(self, table_id: int, table) -> dict[int, list[int]]:
        """{rank: its mapped page ids of `table_id`, ascending}, rank 0's (`table`) included;
        read under the lock, so no map or unmap is half done. O(pages) per rank."""
        with self.lock:
            peers = self._mapped(self._collect(self._post(QUERY, table_id, [])), table_id)
            return {0: table.mapped_page_ids(), **peers}

    def check_peers(self, table_id: int, table) -> None:
        """Assert that every peer maps exactly the page ids `table` maps here."""
        mapped = self.mapped_everywhere(table_id, table)
        for rank, ids in mapped.items():
            assert ids == mapped[0], f"group {table_id}: rank {rank} maps {ids}, rank 0 maps {mapped[0]}"

    def release_cached(self) -> None:
        """Every peer gives its backend's cached physical handles back (a lowered limit)."""
        refusal = self._refusal(self.call(RELEASE_CACHED), "release cached handles")
        if refusal:
            logger.warning("tensor-parallel release of cached handles: %s", refusal)

    def stop(self) -> None:
        """Tell every peer to unmap all its pages and stop serving (shutdown_kvcached). Raises
        KVCachedTPError if a peer is gone; the leader is stopped either way."""
        try:
            if self.channel.broken is None:
                self.call(STOP)
        finally:
            self.stopped = True

    def table_mirror(self, table_id: int) -> TableMirror:
        return TableMirror(self, table_id)


class TableMirror:
    """The PageMirror of one page table on the scheduling rank (Note [Mirrored page table] in
    core/pagetable.pyx): maps and unmaps its page ids on every peer, all or nothing."""

    def __init__(self, leader: Leader, table_id: int) -> None:
        self.leader = leader
        self.table_id = table_id
        self._round: _Round | None = None

    def _start(self, op: int, page_ids: list[int]) -> None:
        leader = self.leader
        leader.lock.acquire()
        try:
            if leader._gather is not None and leader.channel.broken is None and not leader.stopped:
                # the lean round over shared memory: See Note [Leader rounds]
                leader._seq += 1
                leader.num_rounds += 1
                leader.rounds_by_thread[threading.get_ident()] += 1
                leader.channel.send(op, leader._seq, self.table_id, page_ids, (), leader._peer_list)
                self._round = _Round(op, leader._seq, self.table_id, page_ids, 0.0, leader._peer_list)
            else:
                self._round = leader._post(op, self.table_id, list(page_ids))
        except BaseException:
            leader.lock.release()
            raise

    def map_start(self, page_ids: list[int]) -> None:
        self._start(MAP, page_ids)

    def map_finish(self, mapped_here: bool) -> bool:
        """True when every peer mapped; otherwise the peers that did have unmapped again. Raises
        KVCachedTPError for a peer that is gone or refused with an error (not out of memory)."""
        rnd, self._round = self._round, None
        assert rnd is not None, "map_finish without map_start"
        leader = self.leader
        undo_here = False           # the lock stays held until map_undone: See Note [Mirrored page table]
        try:
            gathered = None
            if leader._gather is not None and len(rnd.peers) == leader._num_peers:
                gathered = leader._gather(rnd.seq)
                if mapped_here and gathered[1] == leader._all_peers:
                    return True
            replies = leader._collect(rnd, gathered)
            mapped = [peer for peer, reply in replies.items() if reply.status == OK]
            if mapped_here and len(mapped) == len(replies):
                return True
            if mapped:                      # See Note [Leader rounds]: the rollback round
                self.leader._collect(self.leader._post(UNMAP, self.table_id, rnd.page_ids, peers=mapped))
            refused = {peer: r for peer, r in replies.items() if r.status not in (OK, OOM)}
            if refused:
                raise KVCachedTPError(
                    f"tensor-parallel map of page ids {rnd.page_ids[:8]}{'...' if len(rnd.page_ids) > 8 else ''} of "
                    f"KV group {self.table_id} failed: {self.leader._refusal(refused, 'map')}. Every rank is as "
                    f"before the map.", next(iter(refused)), "map")
            undo_here = mapped_here
            return False
        finally:
            if not undo_here:
                leader.lock.release()

    def map_undone(self) -> None:
        """The table has undone its own map of the round map_finish returned False for: the next
        round and mapped_everywhere may take the lock now, and see every rank as before."""
        self.leader.lock.release()

    def unmap_start(self, page_ids: list[int]) -> None:
        self._start(UNMAP, page_ids)

    def unmap_finish(self) -> None:
        rnd, self._round = self._round, None
        assert rnd is not None, "unmap_finish without unmap_start"
        leader = self.leader
        try:
            gathered = None
            if leader._gather is not None and len(rnd.peers) == leader._num_peers:
                gathered = leader._gather(rnd.seq)
                if gathered[1] == leader._all_peers:
                    return
            replies = leader._collect(rnd, gathered)
        finally:
            leader.lock.release()
        for peer, reply in replies.items():
            if reply.status == ERROR:
                raise KVCachedTPError(f"tensor-parallel unmap of KV group {self.table_id} failed on rank {peer}: "
                                      f"{reply.payload}", peer, "unmap")
            if reply.count and reply.status == OK:
                logger.warning("tensor-parallel rank %d could not unmap %d page id(s) of group %d yet; it retries "
                               "them before its next map", peer, reply.count, self.table_id)

    def release_cached(self) -> None:
        self.leader.release_cached()

    def check_peers(self, table) -> None:
        self.leader.check_peers(self.table_id, table)


# Note [Leader rounds]
# A map of page ids is one round: the leader sends the request (map_start; over gloo each peer's
# reply buffer is posted first), the local table maps while the peers do, then map_finish
# collects the replies, so a TP map costs the slowest rank plus one round trip rather than the
# sum of the ranks. Over shared memory a map or unmap is a lean round (TableMirror._start): the
# request is posted and every reply gathered in one call each, and no object is made per peer
# unless one did not answer OK at once (the general _collect then takes over, the round's
# deadline counting from there); measured in one process (the reply posted by the same thread,
# so no wake-up in it), the leader's cost of a round, which a TP map pays on top of the round
# trip, fell by ~40 % (benchmarks/HISTORY.md).
# All or nothing: if any rank (this one included) was out of memory, the peers that mapped get a
# second round, UNMAP of the same ids, before map_finish returns False, and the table undoes its
# own map; the allocator then sees out of memory and alloc returns None with every rank as
# before. A peer that refuses with an error (no such table, a driver error) is rolled back the
# same way and raised as KVCachedTPError. A peer that is unreachable or late breaks the channel
# (Note [Gloo timeouts] in channel): nothing can be rolled back on it, the call raises, and so
# does every later one. The refill thread's rounds batch a whole refill into one request, and the
# pool's fast path (alloc from pooled pages, free into the pool) sends nothing: the pool is mapped
# on every rank ahead of time.
