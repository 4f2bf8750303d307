"""The round segment (kvcached.tp.rounds) and the shared-memory link (kvcached.tp.shm) on real
shared memory: a request and its replies cross a real process intact (seeded random rounds), a
segment whose header or size was changed is refused naming the field, and a reply out of step,
a peer that died, a peer that never answers and a scheduling rank that died each fail with
KVCachedTPError in bounded time, never a hang. The ranks of a whole instance over this link run
in tests/tp/test_mirror.py (every scenario over both transports)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest

from kvcached.tp.rounds import RoundSegment, segment_bytes
from kvcached.errors import KVCachedConfigError, KVCachedTPError
from kvcached.shm.files import own_identity
from kvcached.tp.channel import ERROR, HELLO, MAP, OK, QUERY, STOP
from kvcached.tp.shm import ShmChannel

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAPACITY = 4096
WAIT_S = 60.0

# Offsets of the header fields (SegmentHeader in tp/rounds.pxd): magic, version, world_size,
# capacity_ids, total_bytes, then 64 identities of 3 int64, then the request.
FIELDS = {"magic": 0, "version": 8, "world_size": 16, "capacity_ids": 24, "total_bytes": 32}
REQUEST_OFFSET = 40 + 64 * 3 * 8


@pytest.fixture
def segment_file():
    """(path, fd) of a fresh file under /dev/shm, removed afterwards."""
    path = f"/dev/shm/kvcached-test-rounds.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    yield path, fd
    os.close(fd)
    if os.path.exists(path):
        os.unlink(path)


def _pair(fd, world: int = 2, timeout_s: float = WAIT_S):
    """A leader's and rank 1's ShmChannel over one segment (two mappings in this process)."""
    lead = RoundSegment(fd, world, CAPACITY, True)
    lead.set_identity(0, *own_identity())
    peer = RoundSegment(fd, world, CAPACITY, False)
    peer.set_identity(1, *own_identity())
    return ShmChannel(lead, 0, timeout_s), ShmChannel(peer, 1, timeout_s)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


ECHO = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from kvcached.tp.rounds import RoundSegment
from kvcached.shm.files import own_identity
fd = os.open(sys.argv[2], os.O_RDWR)
seg = RoundSegment(fd, int(sys.argv[3]), int(sys.argv[4]), False)
rank = int(sys.argv[5])
seg.spin_ns = int(sys.argv[6])
seg.set_identity(rank, *own_identity())
print("attached", flush=True)
while True:
    if not seg.wait_request(rank, 60.0):
        sys.exit("no request within 60 s")
    op, seq, table_id, n, *args = seg.request()
    ids = seg.request_ids()
    # the echo: ids reversed plus the rank, the args summed, the table id as the status's count
    seg.answer(rank, seq, 0, 0, (sum(args), table_id, n, rank), [p + rank for p in reversed(ids)])
    if op == 7:
        break
"""


@pytest.mark.parametrize("world, spin_ns", [(2, 0), (3, 0), (2, 200_000)])
def test_rounds_cross_processes_intact(segment_file, world, spin_ns):
    """Seeded random rounds (0..CAPACITY ids, random args, random subsets of the peers) to real
    processes, every wait sleeping at once or polling first: every reply is the peer's answer to
    exactly that request."""
    path, fd = segment_file
    lead = RoundSegment(fd, world, CAPACITY, True)
    lead.spin_ns = spin_ns
    peers = [subprocess.Popen([sys.executable, "-c", ECHO, REPO, path, str(world), str(CAPACITY), str(rank),
                               str(spin_ns)], stdout=subprocess.PIPE, text=True) for rank in range(1, world)]
    try:
        for proc in peers:
            assert proc.stdout.readline().strip() == "attached"
        rng = random.Random(22)
        for seq in range(1, 301):
            n = rng.choice([0, 1, 2, 56, 57, rng.randrange(CAPACITY + 1)])
            ids = [rng.randrange(1 << 31) for _ in range(n)]
            args = tuple(rng.randrange(-(1 << 40), 1 << 40) for _ in range(rng.randrange(5)))
            to = sorted(rng.sample(range(1, world), rng.randint(1, world - 1)))
            op = STOP if seq == 300 else MAP
            if op == STOP:
                to = list(range(1, world))
            lead.post(op, seq, seq % 7, ids, args, to)
            for rank in to:
                assert lead.wait_reply(rank, WAIT_S), f"rank {rank} did not answer request {seq}"
                got, status, count, *rest = lead.reply(rank)
                assert (got, status, count) == (seq, OK, n) and rest == [sum(args), seq % 7, n, rank, 0]
                assert lead.reply_ids(rank, count) == [p + rank for p in reversed(ids)]
        for proc in peers:
            assert proc.wait(WAIT_S) == 0
    finally:
        for proc in peers:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_attach_refuses_a_changed_header(segment_file, field):
    path, fd = segment_file
    RoundSegment(fd, 2, CAPACITY, True)
    os.pwrite(fd, (0x5A5A5A5A).to_bytes(8, "little"), FIELDS[field])
    with pytest.raises(KVCachedTPError, match=f"field {field} is 0x5a5a5a5a"):
        RoundSegment(fd, 2, CAPACITY, False)


def test_attach_refuses_another_size_or_world(segment_file):
    path, fd = segment_file
    RoundSegment(fd, 2, CAPACITY, True)
    with pytest.raises(KVCachedTPError, match="holds .* bytes"):
        RoundSegment(fd, 3, CAPACITY, False)               # another world size: another size
    os.ftruncate(fd, segment_bytes(2, CAPACITY) + 4096)
    with pytest.raises(KVCachedTPError, match="was changed or belongs to another instance"):
        RoundSegment(fd, 2, CAPACITY, False)
    with pytest.raises(KVCachedConfigError, match="world_size=1 is outside"):
        RoundSegment(fd, 1, CAPACITY, False)


def test_request_too_large_names_the_fix(segment_file):
    leader, _ = _pair(segment_file[1])
    with pytest.raises(KVCachedConfigError, match="KVCACHED_TP_TRANSPORT=gloo"):
        leader.send(MAP, 1, 0, list(range(CAPACITY + 1)), (), [1])
    with pytest.raises(KVCachedConfigError, match="at most 4 arguments"):
        leader.send(HELLO, 1, 0, [], (1, 2, 3, 4, 5), [1])


def test_malformed_request_count_is_seen(segment_file):
    """A request whose id count was changed in the segment reaches the follower as a request
    whose ids do not match its count (answered as an error there, not a crash)."""
    path, fd = segment_file
    leader, follower = _pair(fd)
    leader.send(MAP, 1, 0, [3, 4], (), [1])
    os.pwrite(fd, (CAPACITY + 1).to_bytes(8, "little"), REQUEST_OFFSET + 3 * 8)
    assert follower.serve({}, {}) == 1
    req = follower.read_request()
    assert req.num_ids == CAPACITY + 1 and req.page_ids == []


def test_reply_out_of_step_breaks_the_link(segment_file):
    leader, follower = _pair(segment_file[1])
    leader.send(HELLO, 5, 0, [], (), [1])
    assert follower.serve({}, {}) == 1
    req = follower.read_request()
    req.seq = 4                                            # an answer to another request
    follower.answer(req, OK, 0, (), None)
    with pytest.raises(KVCachedTPError, match="answered request 4 to request 5"):
        leader.receive(1, 5, HELLO, time.monotonic() + WAIT_S)
    with pytest.raises(KVCachedTPError, match="broken since"):
        leader.check()


def test_query_reply_count_out_of_range(segment_file):
    leader, follower = _pair(segment_file[1])
    leader.send(QUERY, 1, 0, [], (), [1])
    assert follower.serve({}, {}) == 1
    follower.answer(follower.read_request(), OK, CAPACITY + 1, (), None)
    with pytest.raises(KVCachedTPError, match="outside"):
        leader.receive(1, 1, QUERY, time.monotonic() + WAIT_S)


def test_error_text_comes_back(segment_file):
    leader, follower = _pair(segment_file[1])
    leader.send(MAP, 1, 0, [1], (), [1])
    assert follower.serve({}, {}) == 1
    follower.answer(follower.read_request(), ERROR, 0, (), "rank 1 has no KV group 0: é")
    reply = leader.receive(1, 1, MAP, time.monotonic() + WAIT_S)
    assert (reply.status, reply.payload) == (ERROR, "rank 1 has no KV group 0: é")


def test_dead_peer_fails_the_round_at_once(segment_file):
    """A peer whose process is gone fails the round within a slice, long before the timeout."""
    leader, _ = _pair(segment_file[1], timeout_s=600)
    leader.segment.set_identity(1, _dead_pid(), 0, 0)
    leader.send(MAP, 1, 0, [1], (), [1])
    t0 = time.monotonic()
    with pytest.raises(KVCachedTPError, match="rank 1 is gone") as info:
        leader.receive(1, 1, MAP, leader.deadline())
    assert time.monotonic() - t0 < 30 and info.value.rank == 1 and info.value.operation == "map"


def test_silent_peer_times_out(segment_file):
    """A peer that lives but never answers (stopped, hung) fails the round at the timeout."""
    leader, _ = _pair(segment_file[1], timeout_s=0.5)
    leader.send(HELLO, 1, 0, [], (), [1])
    t0 = time.monotonic()
    with pytest.raises(KVCachedTPError, match="did not answer within KVCACHED_TP_TIMEOUT_S=0.5 s"):
        leader.receive(1, 1, HELLO, leader.deadline())
    assert 0.5 <= time.monotonic() - t0 < 30


def test_a_polling_wait_ends_at_its_timeout(segment_file):
    """A wait that polls before it sleeps never polls past its timeout: with a minute's spin, a
    wait of 50 ms for a reply that never comes returns False long before the minute."""
    leader, _ = _pair(segment_file[1])
    leader.segment.spin_ns = 60 * 10**9
    t0 = time.monotonic()
    assert not leader.segment.wait_reply(1, 0.05)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("value, expected", [("0", 0), ("7", 7000), ("auto", None)])
def test_spin_comes_from_the_setting(segment_file, monkeypatch, value, expected):
    """KVCACHED_TP_SPIN_US sets every channel's segment; auto polls only on 4 CPUs or more."""
    from kvcached import config

    monkeypatch.setenv("KVCACHED_TP_SPIN_US", value)
    config.reload_settings()
    try:
        leader, follower = _pair(segment_file[1])
    finally:
        monkeypatch.undo()
        config.reload_settings()
    if expected is None:
        expected = 50_000 if len(os.sched_getaffinity(0)) >= 4 else 0
    assert leader.segment.spin_ns == follower.segment.spin_ns == expected


def test_follower_sees_the_scheduling_rank_gone(segment_file):
    _, follower = _pair(segment_file[1])
    follower.segment.set_identity(0, _dead_pid(), 0, 0)
    with pytest.raises(KVCachedTPError, match="rank 0 is gone"):
        follower.serve({}, {})


def test_gather_reads_every_peer_in_one_call(segment_file):
    """gather(): OK replies of the right seq in `ok`; a reply out of step or with something to
    read only in `answered`; a silent peer in neither."""
    leader, _ = _pair(segment_file[1], world=4)
    peers = [RoundSegment(segment_file[1], 4, CAPACITY, False) for _ in range(3)]
    leader.send(HELLO, 9, 0, [], (), [1, 2, 3])
    for rank, seg in enumerate(peers[:2], start=1):
        assert seg.wait_request(rank, WAIT_S)
    peers[0].answer(1, 9, OK)
    peers[1].answer(2, 9, OK, 1, (), [5])                 # a payload: read with receive()
    answered, ok = leader.segment.gather(9, 0.05)
    assert (answered, ok) == (0b0110, 0b0010)


def test_concurrent_rounds_from_threads_stay_in_step(segment_file):
    """The Leader's lock is the one rule: rounds from several threads, each under a lock, are
    answered in step by one serving thread (a seeded random mix of sizes)."""
    leader, follower = _pair(segment_file[1])
    lock = threading.Lock()
    seqs = iter(range(1, 10**6))
    done = threading.Event()

    def serve():
        while not done.is_set():
            if follower.serve({}, {}) == 1:
                req = follower.read_request()
                follower.answer(req, OK, 0, (len(req.page_ids),), None)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    errors = []

    def client(seed):
        rng = random.Random(seed)
        try:
            for _ in range(200):
                ids = list(range(rng.randrange(100)))
                with lock:
                    seq = next(seqs)
                    leader.send(MAP, seq, 0, ids, (), [1])
                    reply = leader.receive(1, seq, MAP, leader.deadline())
                assert reply.args[0] == len(ids)
        except BaseException as exc:
            errors.append(exc)

    clients = [threading.Thread(target=client, args=(seed,)) for seed in range(4)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(WAIT_S)
    done.set()
    leader.send(HELLO, next(seqs), 0, [], (), [1])          # wakes the server to see `done`
    server.join(WAIT_S)
    assert not errors, errors[0]
