"""Tensor parallelism (kvcached.tp) with real ranks: one process per rank, gloo over localhost,
the host backend with small pages (tests/_tp_procs.py runs the ranks).

Rank 0 allocates and the other ranks map the same page ids: after every step each rank maps
exactly rank 0's page ids, out of memory on any rank rolls every rank back, a follower's failed
unmap is retried, and a rank that is killed or stopped makes rank 0's next call raise
KVCachedTPError within KVCACHED_TP_TIMEOUT_S, never hang. GPU variants (marker gpu) run the same
scenarios with CudaBackend(device=rank) on two devices.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from _tp_procs import wait_for_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "_tp_procs.py")
RUN_S = 300                     # every rank imports torch: generous on a loaded 2-core machine


class Ranks:
    """WORLD processes running one scenario; killed at the end whatever happened."""

    def __init__(self, tmp_path, scenario: str, world: int, cfg: dict | None = None, **env: str) -> None:
        self.workdir = str(tmp_path)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
        environ.update({"PYTHONPATH": REPO, "KVCACHED_TRACKER": "0", "KVCACHED_TP_TIMEOUT_S": "60",
                        "OMP_NUM_THREADS": "1"})
        environ.update({f"KVCACHED_{k}": str(v) for k, v in env.items()})
        self.procs = [subprocess.Popen([sys.executable, SCRIPT, scenario, str(rank), str(world), self.workdir,
                                        json.dumps(cfg or {})], env=environ, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
                      for rank in range(world)]
        self.deadline = time.monotonic() + RUN_S

    def wait(self, ranks=None) -> dict:
        """Wait for the ranks (default all) to exit; assert each exited 0; rank 0's result."""
        outputs = {}
        for rank, proc in enumerate(self.procs):
            if ranks is not None and rank not in ranks:
                continue
            try:
                out, _ = proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                out, _ = proc.communicate()
                pytest.fail(f"rank {rank} did not finish within {RUN_S} s (hang):\n{out}")
            outputs[rank] = out
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{out}"
        with open(os.path.join(self.workdir, "result.json")) as f:
            return json.load(f)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        for proc in self.procs:
            proc.communicate()


def _two_gpus() -> bool:
    from kvcached import core

    return core.cuda_unavailable_reason() is None and core.cuda_device_count() >= 2


def _one_gpu() -> bool:
    from kvcached import core

    return core.cuda_unavailable_reason() is None and core.cuda_device_count() >= 1


LAYOUTS = ["per_layer", "interleaved"]
# Scenarios that run on the host backend in CI and on two GPUs where there are two (marker gpu).
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                              pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices")])]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tp2_alloc_free_map_on_every_rank(tmp_path, layout):
    with Ranks(tmp_path, "basic", 2, LAYOUT=layout, MIN_RESERVED_PAGES=1, MAX_RESERVED_PAGES=4) as ranks:
        assert ranks.wait()["rounds"] > 0


@pytest.mark.parametrize("small_rank", [0, 1])
def test_tp2_out_of_memory_on_one_rank_rolls_back_both(tmp_path, small_rank):
    cfg = {"small_rank": small_rank, "small_pages": 3}
    with Ranks(tmp_path, "oom", 2, cfg, LAYOUT="per_layer", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0) as ranks:
        assert ranks.wait()["pages"] == 3


@pytest.mark.parametrize("device", DEVICES)
def test_tp2_pool_refill_and_trim_are_one_message_each(tmp_path, device):
    with Ranks(tmp_path, "batched", 2, {"device": device}, LAYOUT="per_layer", MIN_RESERVED_PAGES=4,
               MAX_RESERVED_PAGES=4) as ranks:
        ranks.wait()


def test_tp2_model_based(tmp_path):
    """Random sequences, the pool on and a rank that runs out of memory (so the refill thread's
    rounds and callers' maps both roll back), checked against every rank after each step."""
    cfg = {"small_rank": 1, "small_pages": 5, "examples": 20}
    with Ranks(tmp_path, "model", 2, cfg, LAYOUT="interleaved", MIN_RESERVED_PAGES=1,
               MAX_RESERVED_PAGES=3) as ranks:
        counts = ranks.wait()
    assert counts["alloc"] > 0 and counts["none"] > 0, counts        # both outcomes were exercised


def test_tp2_follower_retries_a_failed_unmap(tmp_path):
    with Ranks(tmp_path, "unmap_fault", 2, {"unmap_faults": 2}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
               MAX_RESERVED_PAGES=0) as ranks:
        ranks.wait()


@pytest.mark.parametrize("device", DEVICES)
def test_tp2_tracker_and_budget_count_every_rank(tmp_path, device):
    tag = f"{os.getpid()}-{tmp_path.name}"[-40:]
    page_bytes = 2 << 20 if device == "cuda" else 16 << 10          # _tp_procs.configure's
    with Ranks(tmp_path, "instance", 2, {"device": device}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
               MAX_RESERVED_PAGES=0, TRACKER=1, IPC_NAME=f"tp-{tag}", GLOBAL_BUDGET=f"tp-budget-{tag}",
               GLOBAL_BUDGET_BYTES=3 * 2 * 4 * page_bytes) as ranks:     # 3 page ids x 2 ranks
        ranks.wait()


def test_tp2_geometry_mismatch_names_the_rank(tmp_path):
    with Ranks(tmp_path, "mismatch", 2, LAYOUT="interleaved", TP_TIMEOUT_S=30) as ranks:
        assert "rank 1" in ranks.wait()["error"]


def test_tp2_rank_without_its_kv_tensors_is_named(tmp_path):
    """Rank 1 never calls alloc_kv_cache: it answers rank 0's registration with an error once its
    own wait (KVCACHED_TP_TIMEOUT_S) ends, and rank 0 waits for that answer, so its
    alloc_kv_cache raises KVCachedConfigError naming rank 1 (not a lost rank) and the shutdown
    that follows stops rank 1 cleanly."""
    with Ranks(tmp_path, "unregistered", 2, LAYOUT="interleaved", TP_TIMEOUT_S=5) as ranks:
        error = ranks.wait()["error"]
    assert "did not call alloc_kv_cache" in error, error


def test_tp2_instances_in_turn_over_one_tp_group(tmp_path):
    """init_kvcached(tp_group=g) twice over one gloo group: the first instance leaves no receive
    posted that would take the second's messages (Note [Posting receives])."""
    with Ranks(tmp_path, "short", 2, {"tp_group": True, "instances": 2}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
               MAX_RESERVED_PAGES=0, TP_TIMEOUT_S=30) as ranks:
        assert ranks.wait()["rounds"] > 0


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_tp2_dead_rank_raises_within_the_timeout(tmp_path, how):
    """A follower SIGKILLed (its sockets close) or SIGSTOPped (it never answers): rank 0's next
    map raises KVCachedTPError naming rank 1, by the timeout, and nothing hangs."""
    timeout_s = 5
    with Ranks(tmp_path, "killed", 2, LAYOUT="interleaved", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0,
               TP_TIMEOUT_S=timeout_s) as ranks:
        wait_for_file(os.path.join(ranks.workdir, "ready"), RUN_S)
        os.kill(ranks.procs[1].pid, how)
        if how == signal.SIGKILL:
            ranks.procs[1].wait(RUN_S)
        open(os.path.join(ranks.workdir, "go"), "w").close()
        result = ranks.wait(ranks=[0])
        ranks.kill()
    assert "rank 1" in result["first"]
    if how == signal.SIGSTOP:
        assert "KVCACHED_TP_TIMEOUT_S=5" in result["first"], result["first"]
    # bounded: the timeout plus a margin for a loaded machine (a hang ends at RUN_S instead)
    assert result["elapsed_s"] < timeout_s + 60 and result["later_s"] < 60, result


@pytest.mark.parametrize("device", DEVICES)
def test_tp2_follower_outlives_a_killed_scheduling_rank(tmp_path, device):
    """Rank 0 SIGKILLed: rank 1's service ends with the lost connection at once (no timeout to
    wait), and its shutdown and exit are clean."""
    with Ranks(tmp_path, "leader_killed", 2, {"device": device}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
               MAX_RESERVED_PAGES=0, TP_TIMEOUT_S=600) as ranks:
        wait_for_file(os.path.join(ranks.workdir, "ready"), RUN_S)
        os.kill(ranks.procs[0].pid, signal.SIGKILL)
        out, _ = ranks.procs[1].communicate(timeout=RUN_S)
        assert ranks.procs[1].returncode == 0, out
        assert os.path.exists(os.path.join(ranks.workdir, "rank1.done")), out


def test_tp4(tmp_path):
    """Four ranks; rank 3 runs out of memory first."""
    with Ranks(tmp_path, "oom", 4, {"small_rank": 3, "small_pages": 2}, LAYOUT="interleaved",
               MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0) as ranks:
        assert ranks.wait()["pages"] == 2


def test_tp4_pool_on(tmp_path):
    with Ranks(tmp_path, "basic", 4, LAYOUT="per_layer", MIN_RESERVED_PAGES=1, MAX_RESERVED_PAGES=4) as ranks:
        ranks.wait()


# -- two GPUs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scenario", ["basic", "model", "unmap_fault"])
@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices")
def test_tp2_gpu(tmp_path, layout, scenario):
    cfg = {"device": "cuda", "examples": 10, "unmap_faults": 2 if scenario == "unmap_fault" else 0}
    pool = (0, 0) if scenario == "unmap_fault" else (1, 4)
    with Ranks(tmp_path, scenario, 2, cfg, LAYOUT=layout if scenario != "unmap_fault" else "interleaved",
               MIN_RESERVED_PAGES=pool[0], MAX_RESERVED_PAGES=pool[1]) as ranks:
        ranks.wait()


@pytest.mark.gpu
@pytest.mark.skipif(not _one_gpu(), reason="needs a CUDA device")
@pytest.mark.parametrize("max_reserved", [0, 2])
def test_tp2_follower_unmap_waits_for_its_stream(tmp_path, max_reserved):
    """Both ranks on one GPU (each its own context): rank 1's kernel still reads page 0 when rank
    0 unmaps it; the follower must fence its own work first (before: an illegal address)."""
    with Ranks(tmp_path, "fenced", 2, {"device": "cuda", "one_gpu": True}, LAYOUT="interleaved",
               MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=max_reserved) as ranks:
        ranks.wait()


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices")
def test_tp2_gpu_killed_rank(tmp_path):
    with Ranks(tmp_path, "killed", 2, {"device": "cuda"}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
               MAX_RESERVED_PAGES=0, TP_TIMEOUT_S=10) as ranks:
        wait_for_file(os.path.join(ranks.workdir, "ready"), RUN_S)
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        ranks.procs[1].wait(RUN_S)
        open(os.path.join(ranks.workdir, "go"), "w").close()
        result = ranks.wait(ranks=[0])
    assert "rank 1" in result["first"]
