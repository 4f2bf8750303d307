"""vLLM's process layout at tensor parallelism, as real processes, for tests/integration/vllm/test_tp.py.

``python tests/integration/vllm/_vllm_tp_procs.py scheduler SCENARIO TP WORKDIR`` is vLLM's engine
core: it starts TP worker processes as its children (``... worker RANK TP WORKDIR``), as vLLM's
multiprocess executor does, waits until each has allocated its KV cache, then builds vLLM's
scheduler-side KVCacheManager with kvcached enabled (its coordinator builds the ElasticBlockPool,
which leads) and runs SCENARIO; it prints one line, REPLY and its result as JSON. A worker
initialises vLLM's distributed groups (gloo over a file store in WORKDIR) under a current VllmConfig
of the multiprocess executor, then calls kvcached's worker hook with the same KVCacheConfig. Files
in WORKDIR are the events between the processes (``ready<rank>``, ``blocks.json``, ``wrote<rank>``),
waited for with generous deadlines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
for path in (REPO, os.path.join(REPO, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch
from _procs import wait_until

REPLY = "REPLY "
WAIT_S = 300.0
NUM_BLOCKS = 2048               # 8 page ids of 1 MiB: 256 blocks of 4 KiB a page
PROMPT_TOKENS = 1000            # 250 blocks of 4 tokens: about one page id
LAYERS = ("layer.0", "layer.1")


def kv_cache_config():
    """The KVCacheConfig of every process: two full-attention layers in one tensor, a region each
    (vLLM's layer-outermost placement), blocks of 4 tokens x 2 heads x 64 x K and V in float32
    (4 KiB)."""
    from _vllm_contract import TOKENS_PER_BLOCK
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=TOKENS_PER_BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    region = spec.page_size_bytes * NUM_BLOCKS
    tensor = KVCacheTensor(size=region * len(LAYERS), layers=list(LAYERS), layer_stride=region,
                           block_stride=spec.page_size_bytes)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def wait_for_file(path: str, procs=(), timeout_s: float = WAIT_S) -> None:
    """Wait for another process to create `path`; fail at once if one of `procs` exited."""
    def appeared() -> bool:
        if os.path.exists(path):
            return True
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {proc.args[3]} exited with {proc.returncode} before {path} appeared")
        return False

    wait_until(appeared, timeout_s, what=f"{path} to appear")


def write_file(path: str, text: str = "") -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# -- a worker ------------------------------------------------------------------------------------

def worker(rank: int, tp: int, workdir: str) -> None:
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    from kvcached import shutdown_kvcached, wait_for_scheduler
    from kvcached.integration.vllm.kv_tensors import allocate_kv_cache

    vllm_config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="mp"))
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(tp, rank, f"file://{workdir}/dist-store", rank, backend="gloo")
        initialize_model_parallel(tp, 1)
        kv_caches = allocate_kv_cache(kv_cache_config(), "cpu")
    write_file(f"{workdir}/ready{rank}")
    wait_for_file(f"{workdir}/blocks.json")
    with open(f"{workdir}/blocks.json") as f:
        block_ids = json.load(f)
    for index, name in enumerate(LAYERS):      # the rows of blocks the scheduler handed out are backed here
        kv_caches[name][block_ids] = rank * 10 + index
    ok = all(bool((kv_caches[name][block_ids] == rank * 10 + index).all()) for index, name in enumerate(LAYERS))
    write_file(f"{workdir}/wrote{rank}", json.dumps(ok))
    stopped = wait_for_scheduler(WAIT_S)
    shutdown_kvcached()
    sys.exit(0 if stopped and ok else 1)


# -- the scheduler (vLLM's engine core) -------------------------------------------------------

def scheduler(scenario: str, tp: int, workdir: str) -> None:
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", str(rank), str(tp), workdir])
             for rank in range(tp)]
    try:
        for rank in range(tp):
            wait_for_file(f"{workdir}/ready{rank}", procs)
        result = SCENARIOS[scenario](procs, tp, workdir)
    finally:
        for proc in procs:
            if proc.poll() is None and scenario != "serve":
                proc.terminate()                # what vLLM's executor does to its workers at shutdown
        codes = [proc.wait(WAIT_S) for proc in procs]
    result["worker_codes"] = codes
    print(REPLY + json.dumps(result), flush=True)


def _scheduler_manager():
    from _vllm_contract import scheduler_manager
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    return scheduler_manager(kv_cache_config(), max_model_len=8192, enable_caching=False)


def _leader():
    from kvcached.runtime import runtime

    rt = runtime()
    return rt.tp, rt.groups[0].page_table


def serve(procs, tp: int, workdir: str) -> dict:
    """Requests admitted and freed through vLLM's KVCacheManager under a global budget of 3 page
    ids of every rank: every worker maps exactly the pages the scheduler's pool holds and writes
    the rows of the blocks it handed out; the budget and the tracker count every rank."""
    from _vllm_contract import admit, make_request

    from kvcached import shutdown_kvcached
    from kvcached.shm.budget import read_budget
    from kvcached.shm.client import read_segment
    from kvcached.shm.files import own_identity
    from kvcached.tp import named

    manager = _scheduler_manager()
    pool = manager.block_pool
    leader, table = _leader()
    result = {"files_left": os.path.exists(named.segment_path(own_identity())),
              "world_size": pool.manager.world_size, "page_bytes": pool.manager.page_bytes,
              "table_page_bytes": table.page_bytes}
    requests = [make_request(str(i), [i] * PROMPT_TOKENS) for i in range(3)]
    block_ids = []
    for request in requests:
        _, (ids,) = admit(manager, request)
        block_ids += ids
    mapped = leader.mapped_everywhere(0, table)
    result["mapped_after_admit"] = {str(rank): len(ids) for rank, ids in mapped.items()}
    result["same_after_admit"] = all(ids == mapped[0] for ids in mapped.values())
    # The budget holds 3 page ids of every rank: a fourth request is refused, not admitted on
    # the strength of one rank's bytes; the tracker publishes every rank's.
    result["fourth"] = admit(manager, make_request("3", [3] * PROMPT_TOKENS))[1]
    budget = os.environ["KVCACHED_GLOBAL_BUDGET"]
    result["budget_held"] = read_budget(budget).held_bytes
    wait_until(lambda: read_segment(pool.manager.ipc_name).used_bytes == result["budget_held"], WAIT_S,
               what="the tracker to publish every rank's bytes")        # every 10 ms
    result["tracker_used"] = read_segment(pool.manager.ipc_name).used_bytes
    write_file(f"{workdir}/blocks.json", json.dumps(block_ids))
    result["wrote"] = []
    for rank in range(tp):
        wait_for_file(f"{workdir}/wrote{rank}", procs)
        with open(f"{workdir}/wrote{rank}") as f:
            result["wrote"].append(json.load(f))
    for request in requests[1:]:    # the first request's blocks and the null block share page 0
        manager.free(request)
    mapped = leader.mapped_everywhere(0, table)
    result["mapped_after_free"] = {str(rank): len(ids) for rank, ids in mapped.items()}
    result["same_after_free"] = all(ids == mapped[0] for ids in mapped.values())
    shutdown_kvcached()             # every worker is told to unmap and stop
    return result


def kill(procs, tp: int, workdir: str) -> dict:
    """A worker SIGKILLed mid-run: the scheduler's next allocation that maps raises
    KVCachedTPError, within a bound, naming the rank."""
    from _vllm_contract import admit, make_request

    from kvcached.errors import KVCachedTPError

    manager = _scheduler_manager()
    admit(manager, make_request("first", [1] * PROMPT_TOKENS))
    victim = procs[-1]
    victim.kill()
    victim.wait(WAIT_S)
    start = time.monotonic()
    result = {"victim_rank": tp}
    try:
        admit(manager, make_request("second", [2] * PROMPT_TOKENS))
        result["error"] = None
    except KVCachedTPError as exc:
        result.update(error=str(exc), rank=exc.rank, operation=exc.operation)
    result["elapsed_s"] = time.monotonic() - start
    result["free_after"] = manager.block_pool.get_num_free_blocks()
    try:                            # later calls keep failing, at once: the link is broken for good
        result["later"] = admit(manager, make_request("third", [3] * PROMPT_TOKENS))
    except KVCachedTPError as exc:
        result["later"] = str(exc)
    return result


SCENARIOS = {"serve": serve, "kill": kill}

if __name__ == "__main__":
    role = sys.argv[1]
    if role == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        scheduler(sys.argv[2], int(sys.argv[3]), sys.argv[4])
