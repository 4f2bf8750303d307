"""kvcached.tp.named: ranks > 0 join an instance named after its leader before the leader exists,
the leader leads later; real processes on the host backend. See Note [Named rendezvous]."""

from __future__ import annotations

import os
import subprocess
import sys

import _tp_procs as tp_procs
import pytest
import torch

from kvcached import alloc_kv_cache, init_kvcached, shutdown_kvcached
from kvcached.errors import KVCachedConfigError, KVCachedTPError
from kvcached.runtime import runtime
from kvcached.shm.files import own_identity
from kvcached.tp import named

PROCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_named_procs.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(PROCS)))
PAGE = 16 << 10


def start_follower(rank: int, world_size: int, workdir) -> subprocess.Popen:
    """A rank > 0 that joins the instance this process will lead."""
    env = {**os.environ, "PYTHONPATH": REPO, "KVCACHED_TRACKER": "0", "KVCACHED_MIN_RESERVED_PAGES": "0",
           "KVCACHED_MAX_RESERVED_PAGES": "0"}
    return subprocess.Popen([sys.executable, PROCS, *map(str, own_identity()), str(rank), str(world_size),
                             str(workdir), str(PAGE)], env=env)


def wait_ready(procs, workdir) -> None:
    for rank, proc in enumerate(procs, start=1):
        path = os.path.join(workdir, f"ready{rank}")
        tp_procs.wait_for_file(path)
        assert proc.poll() is None, f"rank {rank} exited with {proc.returncode}"


@pytest.fixture
def own_instance():
    """Files of an instance led by this process are removed afterwards, whatever the test did."""
    yield own_identity()
    named.remove(own_identity())


@pytest.mark.slow
def test_ranks_join_first_and_the_leader_without_pages_leads_later(kv_env, tmp_path, own_instance):
    """Two ranks join and make their tensors with no leader yet; the leader maps the segment,
    unlinks the files, and its allocations are mapped on both ranks; shutdown stops them."""
    kv_env(MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0)
    tp_procs.configure(PAGE)
    procs = [start_follower(rank, 3, tmp_path) for rank in (1, 2)]
    try:
        wait_ready(procs, tmp_path)
        assert os.path.exists(named.segment_path(own_instance))
        link = named.lead(3, tp_procs.WAIT_S)
        assert not os.path.exists(named.segment_path(own_instance))      # unlinked once every rank joined
        init_kvcached(tp_rank=0, world_size=3, device="none", page_size_bytes=PAGE, tp_link=link)
        alloc_kv_cache((2, tp_procs.NUM_BLOCKS, tp_procs.BLOCK, tp_procs.HEADS, tp_procs.DIM), tp_procs.BLOCK,
                       torch.float32, "none", tp_procs.LAYERS)
        manager = tp_procs.manager()
        assert manager.world_size == 2
        blocks = manager.alloc(3 * tp_procs.BLOCKS_PER_PAGE)
        group = runtime().groups[0]
        mapped = runtime().tp.mapped_everywhere(0, group.page_table)
        assert len(mapped[0]) == 3 and mapped[1] == mapped[2] == mapped[0]
        manager.free(blocks)
        runtime().tp.check_peers(0, group.page_table)
        shutdown_kvcached()
        assert [proc.wait(tp_procs.WAIT_S) for proc in procs] == [0, 0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_lead_without_any_rank_names_the_fix(own_instance):
    with pytest.raises(KVCachedConfigError, match="no tensor-parallel rank joined an instance led by this process"):
        named.lead(3, 1.0)


def test_lead_names_the_ranks_that_did_not_join(own_instance):
    """Rank 1 joined, rank 2 never does: the leader gives up after its timeout naming rank 2,
    and leaves no file behind."""
    named.join(own_instance, 1, 3, 1.0)
    with pytest.raises(KVCachedTPError, match=r"rank\(s\) \[2\] of 2 did not join within"):
        named.lead(3, 0.2)
    assert not os.path.exists(named.segment_path(own_instance))


def test_join_refuses_another_world_size_and_ranks_outside_it(own_instance):
    named.join(own_instance, 1, 3, 1.0)
    with pytest.raises(KVCachedConfigError, match="does not hold the round segment of 4 ranks"):
        named.join(own_instance, 2, 4, 1.0)
    with pytest.raises(KVCachedConfigError, match=r"rank=3 is outside \[1, 3\)"):
        named.join(own_instance, 3, 3, 1.0)


@pytest.mark.slow
def test_a_rank_held_by_a_live_process_is_refused(kv_env, tmp_path, own_instance):
    kv_env()
    proc = start_follower(1, 2, tmp_path)
    try:
        wait_ready([proc], tmp_path)
        with pytest.raises(KVCachedConfigError, match=f"joined by process {proc.pid}, which still runs"):
            named.join(own_instance, 1, 2, 1.0)
    finally:
        proc.kill()
        proc.wait()


def test_files_of_a_leader_that_died_before_leading_are_swept(tmp_path):
    """A leader killed before it led leaves its files; the next join on the host removes them."""
    out = subprocess.run([sys.executable, "-c", "from kvcached.shm.files import own_identity; "
                          "print(*own_identity())"], env={**os.environ, "PYTHONPATH": REPO},
                         capture_output=True, text=True, check=True).stdout
    dead = tuple(map(int, out.split()))
    named.join(dead, 1, 2, 1.0)
    named.publish_card(dead, {"version": 0})
    assert os.path.exists(named.segment_path(dead)) and named.read_card(dead) == {"version": 0}
    assert named.sweep() >= 1
    assert not os.path.exists(named.segment_path(dead)) and named.read_card(dead) is None
