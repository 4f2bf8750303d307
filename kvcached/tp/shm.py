"""The shared-memory transport of a tensor-parallel instance: rounds in one segment that every
rank of the host maps (kvcached.tp.rounds), set up over the instance's gloo group.

``rendezvous`` runs in init_kvcached on every rank: rank 0 creates the segment under /dev/shm
and broadcasts its name over the group; every other rank maps it and records its identity;
an all-gather tells every rank whether all could; rank 0 then unlinks the file (the mappings
stay), so a process that dies leaves nothing behind. ``ShmChannel`` is then the link
(kvcached.tp.channel.LinkBase) that the Leader and the Follower use. See Note [Round segment]
in kvcached/tp/rounds.pyx and Note [Choosing the transport].
"""

from __future__ import annotations

import os
import socket

from ..config import settings
from .rounds import RoundSegment
from ..errors import KVCachedConfigError
from ..shm.files import SHM_DIR, create_exclusive, own_identity, owner_alive
from .channel import ERROR, OK, OP_NAMES, QUERY, LinkBase, Reply, Request

CAPACITY_IDS = 1 << 20          # page ids per request: every page of a table (2 TiB of 2 MiB pages)
LEADER_SLICE_S = 0.02           # rank 0 checks that a silent peer still lives this often
FOLLOWER_SLICE_S = 0.2          # a serving rank checks that rank 0 still lives this often
FILE_PREFIX = "kvcached-tp."
AUTO_SPIN_US = 50               # KVCACHED_TP_SPIN_US=auto on a host of AUTO_SPIN_MIN_CPUS or more
AUTO_SPIN_MIN_CPUS = 4


def spin_ns() -> int:
    """How long a wait of this process polls before it sleeps, from KVCACHED_TP_SPIN_US. See
    Note [Polling before sleeping] in kvcached/tp/rounds.pyx."""
    spin_us = settings().tp_spin_us
    if spin_us == "auto":
        spin_us = AUTO_SPIN_US if len(os.sched_getaffinity(0)) >= AUTO_SPIN_MIN_CPUS else 0
    return int(spin_us) * 1000


class ShmChannel(LinkBase):
    """The link of one rank over a round segment (the ranks of one host)."""

    kind = "shm"

    def __init__(self, segment: RoundSegment, rank: int, timeout_s: float, path: str = "") -> None:
        self.segment = segment
        segment.spin_ns = spin_ns()
        self.rank = rank
        self.world_size = segment.world_size
        self.timeout_s = timeout_s
        self.path = path                # where the segment was (unlinked once every rank mapped it)
        self.broken: str | None = None
        self._current: Request | None = None

    # -- rank 0 ----------------------------------------------------------------------------------
    def send(self, op: int, seq: int, table_id: int, page_ids: list[int], args: tuple[int, ...], peers) -> None:
        self.segment.post(op, seq, table_id, page_ids, args, peers)

    def receive(self, peer: int, seq: int, op: int, deadline: float, waited: bool = False) -> Reply:
        """`peer`'s reply to request `seq`, within `deadline` (`waited`: gather() took it in
        already); between waits of LEADER_SLICE_S a peer whose process is gone fails the round
        at once."""
        segment = self.segment
        if not waited and not segment.wait_reply(peer, LEADER_SLICE_S):
            self._wait_longer(peer, op, deadline)
        got, status, count, *args = segment.reply(peer)
        if got != seq:
            self.out_of_step(peer, got, seq, OP_NAMES.get(op, str(op)))
        payload = None
        if count and status == ERROR:
            payload = segment.reply_text(peer, count)
        elif count and status == OK and op == QUERY:
            payload = segment.reply_ids(peer, count)
        return Reply(got, status, count, tuple(args), payload)

    def _wait_longer(self, peer: int, op: int, deadline: float) -> None:
        import time

        name = OP_NAMES.get(op, str(op))
        while True:
            if owner_alive(*self.segment.identity(peer)) is False:
                self.fail(peer, name, f"is gone (process {self.segment.identity(peer)[0]} exited)")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.fail(peer, name, f"did not answer within KVCACHED_TP_TIMEOUT_S={self.timeout_s:g} s")
            if self.segment.wait_reply(peer, min(remaining, LEADER_SLICE_S)):
                return

    def gather(self, rnd_seq: int) -> tuple[int, int]:
        """RoundSegment.gather over every peer, one slice: (answered mask, OK mask)."""
        return self.segment.gather(rnd_seq, LEADER_SLICE_S)

    # -- ranks > 0 -------------------------------------------------------------------------------
    def serve(self, tables: dict, streams: dict) -> int:
        """RoundSegment.serve until a request needs the caller (1, or 2: an unmap left some page
        ids mapped); without bound while rank 0 lives. Raises KVCachedTPError once rank 0's
        process is gone, and what a table raised in the fast path (the request is the caller's)."""
        segment = self.segment
        while True:
            self._current = None
            got = segment.serve(self.rank, tables, streams, FOLLOWER_SLICE_S)
            if got:
                return got
            if owner_alive(*segment.identity(0)) is False:
                self.fail(0, "wait for a request", f"is gone (process {segment.identity(0)[0]} exited)")

    def read_request(self) -> Request:
        if self._current is None:
            op, seq, table_id, num_ids, *args = self.segment.request()
            try:
                ids = self.segment.request_ids()
            except Exception:
                ids = []                # the follower answers that the request is malformed
            self._current = Request(op, seq, table_id, ids, tuple(args), num_ids)
        return self._current

    def answer(self, req: Request, status: int, count: int, args: tuple[int, ...], payload) -> None:
        if isinstance(payload, str):
            payload = payload.encode()
        self.segment.answer(self.rank, req.seq, status, count, args, payload)

    def release(self) -> None:
        self._current = None


def rendezvous(group, rank: int, world_size: int, timeout_s: float, forced: bool) -> ShmChannel | None:
    """Set up the round segment over `group` (collective: every rank calls it). Returns this
    rank's ShmChannel, or None when some rank could not map the segment (another host, no
    /dev/shm) and `forced` is False: the caller falls back to gloo. Raises KVCachedConfigError
    naming the ranks that could not, when `forced`."""
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0)
    segment, path, why = None, "", ""
    if rank == 0:
        try:
            path, segment = _create(world_size)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
    mine = path
    try:
        shared = [path, CAPACITY_IDS, why]
        dist.broadcast_object_list(shared, src=src, group=group)
        path, capacity, why = shared
        if rank and path:
            try:
                segment = _attach(path, world_size, capacity, rank)
            except Exception as exc:
                segment, why = None, f"{type(exc).__name__}: {exc}"
        outcome = [None] * world_size
        dist.all_gather_object(outcome, (segment is not None, why, socket.gethostname()), group=group)
    finally:
        if mine:                    # every rank has mapped it or given up: See Note [Choosing the transport]
            try:
                os.unlink(mine)
            except FileNotFoundError:
                pass
    failed = {r: (reason, host) for r, (ok, reason, host) in enumerate(outcome) if not ok}
    if failed:
        if forced:
            raise KVCachedConfigError(
                "KVCACHED_TP_TRANSPORT=shm but rank(s) could not map the round segment: "
                + "; ".join(f"rank {r} on {host}: {reason or 'no segment was made'}" for r, (reason, host)
                            in failed.items())
                + ". Shared memory needs every rank on one host with the same /dev/shm; set "
                  "KVCACHED_TP_TRANSPORT=gloo (or auto) on every rank.")
        return None
    assert segment is not None
    return ShmChannel(segment, rank, timeout_s, path)


def _create(world_size: int) -> tuple[str, RoundSegment]:
    path = os.path.join(SHM_DIR, f"{FILE_PREFIX}{os.getpid()}.{os.urandom(6).hex()}")
    fd = create_exclusive(path, b"")
    if fd is None:
        raise FileExistsError(path)
    try:
        segment = RoundSegment(fd, world_size, CAPACITY_IDS, True)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    segment.set_identity(0, *own_identity())
    return path, segment


def _attach(path: str, world_size: int, capacity: int, rank: int) -> RoundSegment:
    fd = os.open(path, os.O_RDWR)
    try:
        segment = RoundSegment(fd, world_size, capacity, False)
    finally:
        os.close(fd)
    segment.set_identity(rank, *own_identity())
    return segment


# Note [Choosing the transport]
# KVCACHED_TP_TRANSPORT picks how rank 0 reaches the others: "shm" (the round segment), "gloo"
# (messages over torch.distributed) or "auto". Whether shared memory works is not guessed from
# host names: rank 0 makes the segment and every rank tries to map it; only if all could (one
# host, one /dev/shm: containers with their own /dev/shm cannot) is it used, else auto falls
# back to gloo and shm raises naming the ranks. Both ways the gloo group is made first, since
# the set-up itself (the segment's name, the outcome) travels over it. The file is unlinked by
# rank 0 right after the all-gather (or its failure), so no crash of another rank leaves a
# segment in /dev/shm; only rank 0 killed between creation and the all-gather leaves one, named
# kvcached-tp.<pid>.<random>.
