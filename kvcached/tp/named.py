"""A rendezvous by name for the ranks of one host: the round segment of an instance whose ranks
share no torch.distributed group, named after the process that leads it.

An engine whose scheduling process is not in its workers' process group (vLLM's engine core
beside the workers of its multiprocess executor) cannot run ``shm.rendezvous``, which travels
over such a group. Here the instance is named after its leader's identity (pid and start time):
the ranks > 0 know it (their parent, for vLLM), so they ``join`` with no message at all and the
leader ``lead``s later, when it needs them. The files are under /dev/shm:

    kvcached-tp.lead.<pid>.<start>        the round segment (kvcached.tp.rounds)
    kvcached-tp.lead.<pid>.<start>.card   what the ranks tell the leader (JSON), optional

The first rank to join creates the segment complete (initialised under a hidden name, then
linked into place) with the leader's identity in its slot 0; the others map it and record theirs.
The leader maps it, checks that slot 0 is itself, waits for every rank's identity, then unlinks
both files. Files left by a leader that died before it led are removed by the next join on the
host. See Note [Named rendezvous].
"""

from __future__ import annotations

import json
import os
import time

from .rounds import RoundSegment
from ..errors import KVCachedConfigError, KVCachedTPError
from ..shm.files import PID_NS, SHM_DIR, TMP_PREFIX, own_identity, owner_alive, process_start_time
from .shm import CAPACITY_IDS, FILE_PREFIX, ShmChannel

LEAD_PREFIX = FILE_PREFIX + "lead."
CARD_SUFFIX = ".card"
JOIN_POLL_S = 0.01                  # the leader looks at the ranks' identities this often while they join

Identity = tuple[int, int, int]     # (pid, start time in clock ticks, pid namespace)


def parent_identity() -> Identity:
    """The identity of this process's parent (the leader of a vLLM worker)."""
    ppid = os.getppid()
    return ppid, process_start_time(ppid) or 0, PID_NS


def segment_path(leader: Identity) -> str:
    """Where the round segment of the instance led by `leader` is, until the leader leads."""
    return os.path.join(SHM_DIR, f"{LEAD_PREFIX}{leader[0]}.{leader[1]}")


def join(leader: Identity, rank: int, world_size: int, timeout_s: float) -> ShmChannel:
    """Join, as `rank` (1..world_size-1), the instance that `leader` will lead: map its round
    segment (created here by the first rank to come) and record this process in it. Returns
    the link a Follower serves; it waits for the leader's requests for as long as the leader
    lives. O(1); removes the files of leaders on this host that died before leading.

    Raises KVCachedConfigError when `rank` is outside [1, world_size), when the segment of this
    leader was made for another world size, or when another live process joined as `rank`."""
    if not 1 <= rank < world_size:
        raise KVCachedConfigError(f"rank={rank} is outside [1, {world_size}) for a named tensor-parallel instance of "
                                  f"{world_size} ranks: rank 0 is the leader")
    sweep()
    path = segment_path(leader)
    segment = None
    while segment is None:
        segment = _attach(path, world_size, leader)
        if segment is None:
            segment = _create(path, world_size, leader)
    holder = segment.identity(rank)
    if holder[0] and holder[:2] != own_identity()[:2] and owner_alive(*holder) is not False:
        raise KVCachedConfigError(
            f"tensor-parallel rank {rank} of the instance led by process {leader[0]} was joined by process "
            f"{holder[0]}, which still runs: every worker must join with its own rank (its TP rank + 1)")
    segment.set_identity(rank, *own_identity())
    return ShmChannel(segment, rank, timeout_s, path)


def lead(world_size: int, timeout_s: float) -> ShmChannel:
    """Lead the instance named after this process: map its segment, wait (up to `timeout_s`)
    until ranks 1..world_size-1 have joined, then unlink its files. Returns rank 0's link.

    Raises KVCachedConfigError when no rank joined (no segment), or when the segment was made
    for another world size or another leader; KVCachedTPError naming the ranks that did not
    join within `timeout_s`, or that joined and died."""
    me = own_identity()
    path = segment_path(me)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise KVCachedConfigError(
            f"no tensor-parallel rank joined an instance led by this process ({path} does not exist): the ranks "
            f"join from their own processes, children of this one, before it leads") from None
    try:
        segment = _map(fd, world_size, path)
    finally:
        os.close(fd)
    try:
        if segment.identity(0)[:2] != me[:2]:
            raise KVCachedConfigError(f"{path} names process {segment.identity(0)[0]} as its leader, not this process "
                                      f"({me[0]}): it belongs to another instance")
        _wait_for_ranks(segment, world_size, timeout_s)
    finally:
        remove(me)                  # every rank has mapped it, or this instance failed: See Note [Named rendezvous]
    return ShmChannel(segment, 0, timeout_s, path)


def publish_card(leader: Identity, card: dict) -> None:
    """Leave `card` (JSON-serialisable) for `leader` to read, replacing a previous one at once."""
    path = segment_path(leader) + CARD_SUFFIX
    tmp = os.path.join(SHM_DIR, f"{TMP_PREFIX}{os.getpid()}.{os.urandom(6).hex()}")
    with open(tmp, "w") as f:
        json.dump(card, f)
    os.replace(tmp, path)


def read_card(leader: Identity | None = None) -> dict | None:
    """The card left for `leader` (default: this process), or None if there is none. O(1)."""
    path = segment_path(leader or own_identity()) + CARD_SUFFIX
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def remove(leader: Identity) -> None:
    """Unlink the files of the instance led by `leader` (the mappings stay)."""
    for path in (segment_path(leader), segment_path(leader) + CARD_SUFFIX):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def sweep() -> int:
    """Unlink the files of every instance on this host whose leader is gone (it died before it
    led: a leader that led unlinked them). Returns how many instances were swept. O(files in
    /dev/shm)."""
    swept = set()
    for entry in os.listdir(SHM_DIR):
        if not entry.startswith(LEAD_PREFIX):
            continue
        pid, _, start = entry[len(LEAD_PREFIX):].removesuffix(CARD_SUFFIX).partition(".")
        if not (pid.isdigit() and start.isdigit()):
            continue
        leader = (int(pid), int(start), PID_NS)
        if owner_alive(*leader) is False:
            remove(leader)
            swept.add(leader)
    return len(swept)


def _map(fd: int, world_size: int, path: str) -> RoundSegment:
    try:
        return RoundSegment(fd, world_size, CAPACITY_IDS, False)
    except KVCachedTPError as exc:
        raise KVCachedConfigError(f"{path} does not hold the round segment of {world_size} ranks ({exc}): every rank "
                                  f"and the leader must agree on the world size (the TP size + 1)") from None


def _attach(path: str, world_size: int, leader: Identity) -> RoundSegment | None:
    """The segment at `path`, mapped; None if there is none."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        segment = _map(fd, world_size, path)
    finally:
        os.close(fd)
    if segment.identity(0)[:2] != leader[:2]:
        raise KVCachedConfigError(f"{path} names process {segment.identity(0)[0]} as its leader, not {leader[0]}: it "
                                  f"belongs to another instance")
    return segment


def _create(path: str, world_size: int, leader: Identity) -> RoundSegment | None:
    """A new segment at `path`, initialised under a hidden name and linked into place (a rank
    that maps it never sees it half made); None if another rank linked one first."""
    tmp = os.path.join(SHM_DIR, f"{TMP_PREFIX}{os.getpid()}.{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        segment = RoundSegment(fd, world_size, CAPACITY_IDS, True)
        segment.set_identity(0, *leader)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        return segment
    finally:
        os.close(fd)
        os.unlink(tmp)


def _wait_for_ranks(segment: RoundSegment, world_size: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        missing, dead = [], []
        for rank in range(1, world_size):
            identity = segment.identity(rank)
            if not identity[0]:
                missing.append(rank)
            elif owner_alive(*identity) is False:
                dead.append(f"{rank} (process {identity[0]})")
        if dead:
            raise KVCachedTPError(f"tensor-parallel rank(s) {', '.join(dead)} joined and exited before the leader "
                                  f"led: restart every rank", operation="lead")
        if not missing:
            return
        if time.monotonic() > deadline:
            raise KVCachedTPError(
                f"tensor-parallel rank(s) {missing} of {world_size - 1} did not join within KVCACHED_TP_TIMEOUT_S="
                f"{timeout_s:g} s: each must join (its allocate_kv_cache) before the leader leads", operation="lead")
        time.sleep(JOIN_POLL_S)


# Note [Named rendezvous]
# shm.rendezvous names the segment over the instance's gloo group, but a scheduler process that
# is not in its workers' group has no such channel, and vLLM builds that group among the workers
# only. What both sides do know is the leader: vLLM's multiprocess executor starts every worker
# as a child of the engine core's process, where the scheduler (and its pool) lives. So the
# name is the leader's pid and start time (a reused pid gets another start time): a worker
# derives it from its parent, the leader from itself; no variable has to be set before vLLM
# starts its processes, and two engines on one host never meet. Order is free: in vLLM the
# workers allocate their KV cache (and join) before the engine core builds its scheduler (and
# leads), so a follower serves before any leader exists; its serving loop already stops once
# slot 0's process is gone, and slot 0 holds the leader's identity from the start, so a worker
# whose engine core died before leading stops too. The leader unlinks the files as soon as every
# rank joined (the mappings stay), so a running instance leaves nothing in /dev/shm; a leader
# killed before it led leaves them, and the next join on the host sweeps them by the identity
# in their name. A card (JSON, replaced atomically) carries what only the ranks know to the
# leader: for vLLM the world size, the page size and the KV geometry of their allocate_kv_cache,
# which the scheduler's pool (built from num_gpu_blocks alone) repeats.
