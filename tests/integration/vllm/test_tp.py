"""vLLM at tensor parallelism: vLLM's engine-core process with the scheduler's pool leads, its TP
worker processes (its children, as vLLM's multiprocess executor starts them) follow; real
processes with vLLM's own classes, host backend (tests/integration/vllm/_vllm_tp_procs.py runs the roles).
See Note [vLLM at TP > 1] in kvcached/integration/vllm/tp.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import _vllm_contract  # noqa: F401  (skips this module without a supported vLLM)
import pytest

from _vllm_tp_procs import REPLY, WAIT_S

from kvcached.errors import KVCachedConfigError, KVCachedError
from kvcached.integration.vllm import ElasticBlockPool
from kvcached.integration.vllm.tp import join_scheduler
from kvcached.shm.budget import delete_budget
from kvcached.shm.files import own_identity
from kvcached.tp import named

PROCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vllm_tp_procs.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(PROCS))))
TP = 2
PAGE = 1 << 20


def run_scheduler(scenario: str, tmp_path) -> dict:
    """vLLM's engine core (the scheduler process) and its TP workers, under a global budget of
    3 page ids of every rank (2 layers each); the scheduler's result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env.update(PYTHONPATH=REPO, VLLM_TARGET_DEVICE="cpu", KVCACHED_PAGE_SIZE_MB=str(PAGE >> 20),
               KVCACHED_MIN_RESERVED_PAGES="0", KVCACHED_MAX_RESERVED_PAGES="0",
               KVCACHED_GLOBAL_BUDGET=f"vllm-tp-{os.getpid()}-{tmp_path.name}"[-40:],
               KVCACHED_GLOBAL_BUDGET_BYTES=str(3 * TP * 2 * PAGE))
    try:
        proc = subprocess.run([sys.executable, PROCS, "scheduler", scenario, str(TP), str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=2 * WAIT_S)
    finally:
        with contextlib.suppress(KVCachedError):       # its holders have exited: no live slot
            delete_budget(env["KVCACHED_GLOBAL_BUDGET"])
    lines = [line for line in proc.stdout.splitlines() if line.startswith(REPLY)]
    assert proc.returncode == 0 and lines, f"scheduler exited with {proc.returncode}:\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len(REPLY):])


@pytest.mark.slow                   # three processes that import vLLM: about a minute
def test_the_schedulers_pool_leads_the_tp_workers(tmp_path):
    """Blocks handed out by vLLM's KVCacheManager are backed on every worker (each writes and
    reads the rows), the ranks map the same pages as the scheduler's ledger, frees unmap them
    everywhere, the manager, the budget and the tracker count every worker's bytes, the
    rendezvous files are gone once the scheduler leads, and shutdown stops the workers cleanly."""
    result = run_scheduler("serve", tmp_path)
    assert result["files_left"] is False
    assert result["world_size"] == TP
    assert result["page_bytes"] == TP * result["table_page_bytes"]      # limits and budget count every rank
    assert result["same_after_admit"] and result["same_after_free"], result
    assert set(result["mapped_after_admit"]) == {str(r) for r in range(TP + 1)}
    assert result["mapped_after_admit"]["0"] == 3 and result["mapped_after_free"]["0"] == 1, result
    assert result["fourth"] is None, result                             # the budget counts every rank
    assert result["budget_held"] == result["tracker_used"] == 3 * result["page_bytes"], result
    assert result["wrote"] == [True] * TP
    assert result["worker_codes"] == [0] * TP


@pytest.mark.slow
def test_a_killed_worker_fails_the_schedulers_next_allocation(tmp_path):
    """A worker SIGKILLed mid-run: the scheduler's next allocation that needs a page raises
    KVCachedTPError naming the rank, within a fraction of a second rather than hanging; later
    allocations never hand out blocks of pages the ranks may not hold."""
    result = run_scheduler("kill", tmp_path)
    assert result["error"] is not None, result
    assert result["rank"] == result["victim_rank"] == TP and result["operation"] == "map"
    assert f"rank {TP} is gone" in result["error"] and "restart every rank" in result["error"]
    assert result["elapsed_s"] < 5.0, result
    later = result["later"]
    assert later == [0, None] or "broken" in later, later


def test_a_worker_with_kvcached_initialised_otherwise_is_refused(vllm_kv):
    """kvcached already initialised in a TP worker as a single rank: refused naming the rank it
    must be, before anything joins."""
    with pytest.raises(KVCachedConfigError, match="as rank 0 of 1, but at tensor_parallel_size=2 TP rank 1 must be "
                                                  "rank 2 of 3"):
        join_scheduler("cpu", 1, 2, 1 << 20)
    assert not os.path.exists(named.segment_path(named.parent_identity()))


def test_a_card_of_another_version_is_refused(vllm_kv):
    named.publish_card(own_identity(), {"version": 99})
    try:
        with pytest.raises(KVCachedConfigError, match="card of version 99, this kvcached reads version 1"):
            ElasticBlockPool(8, enable_caching=False, hash_block_size=4)
    finally:
        named.remove(own_identity())
