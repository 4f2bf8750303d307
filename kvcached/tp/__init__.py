"""Tensor parallelism: one kvcached instance spread over the ranks of a TP group.

Every rank holds its share of the KV heads for the same block ids, so a page id is usable only
once every rank has mapped it. The scheduling rank (tp_rank 0) owns the allocator and decides;
its page tables carry a ``TableMirror`` (mirror.py) that repeats each map and unmap on the other
ranks, whose ``Follower`` service (follower.py) applies them to their own page tables. Control
travels through a shared-memory segment between the ranks of one host (shm.py over
kvcached.tp.rounds), or over a gloo group of torch.distributed across hosts (channel.py); the
gloo group is made either way, beside the model's NCCL group, and carries the set-up.

    channel.py   message format, what a transport offers (LinkBase), the gloo transport
    shm.py       the shared-memory transport and its rendezvous
    named.py     a rendezvous by name, for ranks that share no torch.distributed group
    mirror.py    Leader (rank 0): rounds of requests; TableMirror: the PageTable's PageMirror
    follower.py  Follower (ranks > 0): the service thread
"""

from __future__ import annotations

from ..errors import KVCachedConfigError
from .channel import IDLE_TIMEOUT, Channel, LinkBase
from .follower import Follower
from .mirror import Leader, TableMirror


def open_channel(tp_rank: int, world_size: int, tp_group, timeout_s: float, transport: str = "auto") -> LinkBase:
    """The control channel of this rank: over `tp_group` (a gloo group whose group ranks are the
    TP ranks), or over a gloo group made here beside whatever the default group's backend is;
    then, unless `transport` is "gloo", the round segment in shared memory when every rank can
    map it (Note [Choosing the transport] in shm.py). Collective: every rank of the group (of the
    default group, when it makes one) must call it, with the same `transport`.

    Raises KVCachedConfigError when torch.distributed is not initialised or does not match, or
    when `transport` is "shm" and some rank cannot map the segment."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise KVCachedConfigError(f"world_size={world_size} needs torch.distributed ({exc})") from None
    if not (dist.is_available() and dist.is_initialized()):
        raise KVCachedConfigError(
            f"world_size={world_size} needs torch.distributed initialised on every rank first "
            f"(torch.distributed.init_process_group); kvcached then makes its own gloo group for its control messages")
    if tp_group is None:
        if (dist.get_world_size(), dist.get_rank()) != (world_size, tp_rank):
            raise KVCachedConfigError(
                f"tp_rank={tp_rank}, world_size={world_size} do not match torch.distributed's rank "
                f"{dist.get_rank()} of {dist.get_world_size()}: pass those, or pass tp_group= (a gloo group of "
                f"the TP ranks, made by dist.new_group(ranks, backend='gloo') on every rank)")
        tp_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    else:
        backend = str(dist.get_backend(tp_group)).lower()
        if "gloo" not in backend:
            raise KVCachedConfigError(f"tp_group uses the {backend} backend; kvcached's control messages are CPU "
                                      f"tensors and need a gloo group: dist.new_group(ranks, backend='gloo')")
        if (dist.get_world_size(tp_group), dist.get_rank(tp_group)) != (world_size, tp_rank):
            raise KVCachedConfigError(
                f"tp_rank={tp_rank}, world_size={world_size} do not match tp_group's rank "
                f"{dist.get_rank(tp_group)} of {dist.get_world_size(tp_group)}: pass the group rank and size")
    if transport != "gloo":
        from .shm import rendezvous

        link = rendezvous(tp_group, tp_rank, world_size, timeout_s, forced=transport == "shm")
        if link is not None:
            return link
    return Channel(tp_group, timeout_s)


__all__ = ["Channel", "Follower", "Leader", "LinkBase", "TableMirror", "open_channel"]
