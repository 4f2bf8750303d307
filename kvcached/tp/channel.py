"""The control channel of a tensor-parallel instance: message format and gloo transport.

The scheduling rank (group rank 0) sends requests; every other rank answers each one with one
reply. Messages are int64 tensors sent point to point (``isend``/``irecv``) over a gloo group,
so they travel beside the model's NCCL group; every wait on the scheduling rank is bounded by a
deadline. See Note [TP messages], Note [Posting receives] and Note [Gloo timeouts].
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any

from ..errors import KVCachedTPError

# Operations (request slot 0).
HELLO, REGISTER, MAP, UNMAP, QUERY, RELEASE_CACHED, STOP = 1, 2, 3, 4, 5, 6, 7
OP_NAMES = {HELLO: "hello", REGISTER: "register", MAP: "map", UNMAP: "unmap", QUERY: "query",
            RELEASE_CACHED: "release cached handles", STOP: "stop"}
# Reply statuses (reply slot 1).
OK, OOM, ERROR, STOPPED = 0, 1, 2, 3

# Gloo tags: each a FIFO of its own, so a receive posted ahead for the next request never takes
# the overflow ids or a reply's payload (Note [TP messages]).
TAG_HEADER, TAG_IDS, TAG_PAYLOAD = 0, 1, 2
HEADER_SLOTS = 8                # op, seq, table_id, num_ids, arg0..arg3
INLINE_IDS = 56                 # page ids carried in the request itself
REQUEST_SLOTS = HEADER_SLOTS + INLINE_IDS
REPLY_SLOTS = 8                 # seq, status, count, arg0..arg4
NUM_ARGS = 4
# The group's own timeout bounds a follower's wait for the next request, which may come after
# any idle time: so it is long, and the scheduling rank bounds its waits itself (Note [Gloo timeouts]).
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class Request:
    op: int
    seq: int
    table_id: int
    page_ids: list[int]             # the inline ones until the overflow is received
    args: tuple[int, ...]
    num_ids: int

    @property
    def name(self) -> str:
        return OP_NAMES.get(self.op, f"op {self.op}")


@dataclass
class Reply:
    seq: int
    status: int
    count: int
    args: tuple[int, ...]
    payload: Any = None             # QUERY: the page ids; ERROR: the peer's message


def _torch():
    import torch
    import torch.distributed as dist

    return torch, dist


def encode_request(msg, op: int, seq: int, table_id: int, page_ids: list[int], args: tuple[int, ...] = ()):
    """Fill `msg` (a numpy view of a request tensor) in place; returns the overflow tensor (ids
    past INLINE_IDS, sent second on TAG_IDS) or None."""
    msg[:HEADER_SLOTS] = 0
    msg[0], msg[1], msg[2], msg[3] = op, seq, table_id, len(page_ids)
    if args:
        msg[4:4 + len(args)] = args
    inline = page_ids[:INLINE_IDS]
    if inline:
        msg[HEADER_SLOTS:HEADER_SLOTS + len(inline)] = inline
    if len(page_ids) <= INLINE_IDS:
        return None
    torch, _ = _torch()
    return torch.tensor(page_ids[INLINE_IDS:], dtype=torch.int64)


def decode_request(msg) -> Request:
    """A Request from `msg` (a numpy view), copied out so the buffer can take the next one."""
    head = msg[:HEADER_SLOTS].tolist()
    n = head[3]
    return Request(head[0], head[1], head[2], msg[HEADER_SLOTS:HEADER_SLOTS + min(n, INLINE_IDS)].tolist(),
                   tuple(head[4:4 + NUM_ARGS]), n)


def encode_reply(msg, seq: int, status: int, count: int = 0, args: tuple[int, ...] = ()) -> None:
    """Fill `msg` (a numpy view of a reply tensor) in place."""
    msg[:] = 0
    msg[0], msg[1], msg[2] = seq, status, count
    if args:
        msg[3:3 + len(args)] = args


def buffer(slots: int):
    """(int64 tensor, its numpy view): messages are filled and read through the view."""
    torch, _ = _torch()
    tensor = torch.zeros(slots, dtype=torch.int64)
    return tensor, tensor.numpy()


def text_tensor(text: str):
    torch, _ = _torch()
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


class LinkBase:
    """What both transports share: the rank, the timeout, and the broken state.

    A transport carries requests from group rank 0 to the others and one reply back for each:
    on rank 0 ``send`` (one request to some peers) then ``receive`` (one peer's reply, within a
    deadline), on the others ``wait_request`` (op and table id), ``read_request`` (the whole
    request) then ``answer``. ``peer`` arguments are group
    ranks. A failed or timed-out wait breaks the link for good (the ranks may no longer agree on
    what is mapped): every later call raises KVCachedTPError naming the first failure. Not
    thread-safe: its one user on each rank (the leader's lock, the follower's service thread)
    serialises calls."""

    kind = ""
    rank: int
    world_size: int
    timeout_s: float
    broken: str | None

    def check(self, peer: int | None = None, operation: str | None = None) -> None:
        """Raise KVCachedTPError if the link broke before."""
        if self.broken is not None:
            raise KVCachedTPError(
                f"tensor-parallel control channel is broken since: {self.broken} Every rank of this instance "
                f"must be restarted (shutdown_kvcached() on each rank that lives, then init_kvcached()).",
                peer, operation)

    def deadline(self, timeouts: int = 1) -> float:
        """The monotonic time `timeouts` times KVCACHED_TP_TIMEOUT_S from now."""
        return time.monotonic() + timeouts * self.timeout_s

    def fail(self, peer: int, operation: str, what: str, exc: BaseException | None = None) -> None:
        """Break the link: rank `peer` `what` during `operation`. Always raises KVCachedTPError."""
        self.broken = f"tensor-parallel rank {peer} {what} during {operation}; it died or hangs."
        raise KVCachedTPError(
            f"{self.broken} kvcached cannot keep the ranks' KV memory in step: restart every rank of this "
            f"instance (raise KVCACHED_TP_TIMEOUT_S if rank {peer} is only slow).", peer, operation) from exc

    def out_of_step(self, peer: int, seq: int, expected: int, operation: str) -> None:
        self.broken = f"tensor-parallel rank {peer} answered request {seq} to request {expected}."
        raise KVCachedTPError(f"{self.broken} The control channel is out of step: restart every rank.",
                              peer, operation)

    def release(self) -> None:
        """Drop whatever the serving side still holds of the transport (its thread ends)."""


class Channel(LinkBase):
    """Point-to-point messages over one gloo group, between group rank 0 and the others: the
    transport across hosts. See Note [TP messages], Note [Posting receives], Note [Gloo timeouts]."""

    kind = "gloo"

    def __init__(self, group, timeout_s: float) -> None:
        _, dist = _torch()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self.timeout_s = timeout_s
        self.broken: str | None = None
        self._posted: dict = {}                         # rank 0: peer -> (send works, reply work)
        self._request = self._request_np = None         # rank 0: the request buffer, reused
        self._replies: dict = {}                        # rank 0: peer -> reply buffer
        self._requests = None                           # rank > 0: two request buffers, in turn
        self._turn = 0
        self._pending = None                            # rank > 0: the receive posted for the next request
        self._reply = None                              # rank > 0: the reply buffer, reused
        self._current: Request | None = None            # rank > 0: the request being handled

    # -- primitives ----------------------------------------------------------------------------
    def isend(self, peer: int, tensor, tag: int = TAG_HEADER):
        _, dist = _torch()
        return dist.isend(tensor, dst=self.global_ranks[peer], group=self.group, tag=tag)

    def irecv(self, peer: int, tensor, tag: int = TAG_HEADER):
        _, dist = _torch()
        return dist.irecv(tensor, src=self.global_ranks[peer], group=self.group, tag=tag)

    def wait(self, work, deadline: float, peer: int, operation: str) -> None:
        """Wait for `work` until the monotonic `deadline`; KVCachedTPError (channel broken) when
        the peer's connection fails or the deadline passes."""
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError("deadline passed")
            work.wait(datetime.timedelta(seconds=remaining))
        except Exception as exc:
            timed_out = "Timed out" in str(exc) or isinstance(exc, TimeoutError)
            what = (f"did not answer within KVCACHED_TP_TIMEOUT_S={self.timeout_s:g} s" if timed_out
                    else f"is unreachable ({str(exc).splitlines()[0][:200]})")
            self.fail(peer, operation, what, exc)

    # -- rank 0 ----------------------------------------------------------------------------------
    def send(self, op: int, seq: int, table_id: int, page_ids: list[int], args: tuple[int, ...], peers) -> None:
        """Post each peer's reply buffer, then send it the request (See Note [Posting receives]).
        Raises KVCachedTPError (link broken) if a peer cannot be reached."""
        if self._request is None:
            self._request, self._request_np = buffer(REQUEST_SLOTS)
            self._replies = {peer: buffer(REPLY_SLOTS) for peer in range(1, self.world_size)}
        extra = encode_request(self._request_np, op, seq, table_id, page_ids, args)
        self._posted.clear()
        for peer in peers:
            try:
                reply_work = self.irecv(peer, self._replies[peer][0])
                sends = [self.isend(peer, self._request)]
                if extra is not None:
                    sends.append(self.isend(peer, extra, TAG_IDS))
            except Exception as exc:
                self.fail(peer, OP_NAMES.get(op, str(op)), f"is unreachable ({str(exc).splitlines()[0][:200]})",
                          exc)
            self._posted[peer] = (sends, reply_work)

    def receive(self, peer: int, seq: int, op: int, deadline: float) -> Reply:
        """`peer`'s reply to request `seq` (and its payload), within `deadline`."""
        torch, _ = _torch()
        name = OP_NAMES.get(op, str(op))
        sends, reply_work = self._posted.pop(peer)
        for work in sends:
            self.wait(work, deadline, peer, name)
        self.wait(reply_work, deadline, peer, name)
        got, status, count, *args = self._replies[peer][1].tolist()
        if got != seq:
            self.out_of_step(peer, got, seq, name)
        payload = None
        if count and (status == ERROR or (status == OK and op == QUERY)):
            buf = torch.empty(count, dtype=torch.uint8 if status == ERROR else torch.int64)
            self.wait(self.irecv(peer, buf, TAG_PAYLOAD), deadline, peer, name)
            payload = bytes(buf.numpy()).decode(errors="replace") if status == ERROR else buf.tolist()
        return Reply(got, status, count, tuple(args), payload)

    # -- ranks > 0 -------------------------------------------------------------------------------
    def wait_request(self) -> tuple[int, int]:
        """Wait (without bound) for the next request; (op, table id) of it, read_request() the
        whole. The next one's receive is posted as soon as a request is in, while rank 0 only
        waits, and none after STOP (Note [Posting receives])."""
        torch, _ = _torch()
        if self._requests is None:
            self._requests = [buffer(REQUEST_SLOTS), buffer(REQUEST_SLOTS)]
            self._turn = 0
        if self._pending is None:
            self._pending = self.irecv(0, self._requests[self._turn][0])
        self._pending.wait()
        req = decode_request(self._requests[self._turn][1])
        if req.op != STOP:
            self._turn ^= 1
            self._pending = self.irecv(0, self._requests[self._turn][0])
        else:
            self._pending = None
        if req.num_ids > INLINE_IDS:
            extra = torch.empty(req.num_ids - INLINE_IDS, dtype=torch.int64)
            self.irecv(0, extra, TAG_IDS).wait()
            req.page_ids += extra.tolist()
        self._current = req
        return req.op, req.table_id

    def read_request(self) -> Request:
        return self._current

    def answer(self, req: Request, status: int, count: int, args: tuple[int, ...], payload) -> None:
        """Send the reply to `req`; `payload`: a list of page ids (QUERY) or text (ERROR), or None."""
        torch, _ = _torch()
        if self._reply is None:
            self._reply = buffer(REPLY_SLOTS)
        tensor = None
        if isinstance(payload, str):
            tensor = text_tensor(payload)
        elif payload:
            tensor = torch.tensor(payload, dtype=torch.int64)
        if tensor is not None:
            count = tensor.numel()
        encode_reply(self._reply[1], req.seq, status, count, args)
        works = [self.isend(0, self._reply[0])]
        if tensor is not None:
            works.append(self.isend(0, tensor, TAG_PAYLOAD))
        for work in works:
            work.wait()

    def release(self) -> None:
        self._pending = self._current = None


# Note [TP messages]
# A request is one int64 tensor of REQUEST_SLOTS: op, sequence number, table id (the KV group's
# group_id: an instance may hold several page tables), the number of page ids, four op arguments,
# then up to INLINE_IDS page ids; a longer id list follows as a second tensor of exactly the
# remaining ids (the follower knows its length from the header). A reply is REPLY_SLOTS int64s:
# the request's sequence number, a status (OK, OOM, ERROR, STOPPED), a count and arguments; a
# QUERY reply is followed by `count` page ids, an ERROR reply by `count` bytes of UTF-8 text (the
# peer's own error message, so the scheduling rank raises with it). Fixed-size tensors because a
# gloo receive needs its buffer up front; one tensor per message in the common case because each
# message is a round of the transport (a refill round of up to max_reserved pages fits inline).
# Buffers are made once and filled through numpy views (a torch op per field cost ~5 us each).
# Headers, overflow ids and reply payloads travel on their own tags (TAG_HEADER, TAG_IDS,
# TAG_PAYLOAD), so a receive posted ahead on one never matches another.
#
# Note [Posting receives]
# Gloo's TCP transport sends data only once the receiver has posted its receive: posting writes
# a ready notice to the sender's socket, and a send that comes first waits for that notice, a
# second trip. So every receive is posted ahead, at a time when the other side only waits: the
# leader posts a round's reply buffers before sending the request, and a follower posts the
# next request's buffer as soon as a request is in, before applying it. Never while the other
# side may be sending: gloo's transport thread and the caller's isend/irecv share one lock per
# peer, so a notice that lands during a call makes one wait for the other, and on a busy host
# the holder can be off the CPU for a scheduler slice (~4 ms). None is left pending after STOP,
# so a tp_group passed by the caller can carry a later instance (a stale receive would swallow
# its first request). Waits are in the calling thread (a receiver thread adds a wake-up per
# message) and never spin: gloo's work objects report is_completed() only after wait(), so
# polling can only watch the buffer, and a polling rank kept the transport thread that must
# deliver its message off the CPU. The figure that decides: an empty request's round trip took
# about as long however the receives were placed (on two GPUs three times a map's own time, the
# whole of a TP map's extra cost); gloo's floor is four thread wake-ups a round trip, each side's
# transport thread, then the waiting thread. The placements measured are in benchmarks/HISTORY.md
# (bench_tp, where the round trip goes); the transports' current figures in benchmarks/README.md
# (bench_tp).
#
# Note [Gloo timeouts]
# Gloo applies the group's timeout to every wait without an explicit one, and a wait that times
# out signals the error to every pending operation of the rank's transport context: the group is
# unusable afterwards. Followers wait for the next request with no explicit timeout, for as long
# as the instance is idle, so kvcached's own group is made with IDLE_TIMEOUT (a year); the
# scheduling rank passes an explicit deadline (KVCACHED_TP_TIMEOUT_S) to each of its waits, and
# a peer that is SIGKILLed closes its sockets, which fails those waits at once. Either failure
# breaks the channel for good: the peers' mapped state is then unknown.
