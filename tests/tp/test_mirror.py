"""Tensor parallelism (kvcached.tp) with real ranks: one process per rank, gloo over localhost,
the host backend with small pages (tests/tp/_tp_procs.py runs the ranks).

Rank 0 allocates and the other ranks map the same page ids: after every step each rank maps
exactly rank 0's page ids, out of memory on any rank rolls every rank back, a follower's failed
unmap is retried, and a rank that is killed or stopped makes rank 0's next call raise
KVCachedTPError within KVCACHED_TP_TIMEOUT_S, never hang. Every scenario runs over both transports
(the shared-memory segment and gloo). GPU variants (marker gpu) run the same scenarios with
CudaBackend(device=rank) on two devices.

The ranks of a world start once per module and run its scenarios in turn, each a kvcached
instance of its own (See Note [One world, many instances] in tests/tp/_tp_procs.py); a scenario
that kills a rank gets fresh processes.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from _tp_procs import REPLY, wait_for_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "tp", "_tp_procs.py")
RUN_S = 300                     # every rank imports torch: generous on a loaded 2-core machine


class Ranks:
    """WORLD rank processes in one gloo world, running jobs (scenarios) in turn; killed at the
    end whatever happened. A job that fails or times out leaves them unusable (`broken`)."""

    def __init__(self, workdir, world: int) -> None:
        self.workdir, self.world, self.jobs, self.broken = str(workdir), world, 0, False
        self.env: dict[str, str] = {}           # KVCACHED_* (without the prefix) of every job
        self.deadline = time.monotonic() + RUN_S
        environ = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
        environ.update({"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
        self.procs = [subprocess.Popen([sys.executable, SCRIPT, str(rank), str(world), self.workdir], env=environ,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
                      for rank in range(world)]
        self.replies: list[queue.Queue] = [queue.Queue() for _ in self.procs]
        self.output: list[list[str]] = [[] for _ in self.procs]
        for rank, proc in enumerate(self.procs):
            threading.Thread(target=self._read, args=(rank, proc), daemon=True).start()

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        """Rank `rank`'s output lines; (True, result) queued for each reply, (False, None) at its exit."""
        for line in proc.stdout:
            if line.startswith(REPLY):
                self.replies[rank].put((True, json.loads(line[len(REPLY):])))
            else:
                self.output[rank].append(line)
        self.replies[rank].put((False, None))

    def start(self, scenario: str, cfg: dict | None = None, **env) -> str:
        """Send every rank the job; its workdir (where the ranks and the test leave events)."""
        self.jobs += 1
        workdir = os.path.join(self.workdir, f"{self.jobs}-{scenario}")
        os.mkdir(workdir)
        environ = {"KVCACHED_TRACKER": "0", "KVCACHED_TP_TIMEOUT_S": "60"}
        environ.update({f"KVCACHED_{k}": str(v) for k, v in {**self.env, **env}.items()})
        job = json.dumps({"scenario": scenario, "cfg": cfg or {}, "env": environ, "workdir": workdir}) + "\n"
        for rank in range(self.world):
            self.output[rank].clear()
            self.procs[rank].stdin.write(job)
            self.procs[rank].stdin.flush()
        self.deadline = time.monotonic() + RUN_S
        return workdir

    def wait(self, ranks=None) -> dict | None:
        """Wait for the ranks (default all) to answer the job; fail naming the rank that exited or
        did not answer in time, with its output; rank 0's result."""
        results = {}
        for rank in range(self.world) if ranks is None else ranks:
            try:
                replied, results[rank] = self.replies[rank].get(timeout=max(1.0, self.deadline - time.monotonic()))
            except queue.Empty:
                self.broken = True
                self.kill()
                pytest.fail(f"rank {rank} did not finish within {RUN_S} s (hang):\n{''.join(self.output[rank])}")
            if not replied:
                self.broken = True
                self.kill()
                pytest.fail(f"rank {rank} ended its output (exit status {self.procs[rank].wait()}):\n"
                            f"{''.join(self.output[rank])}")
        return results.get(0)

    def run(self, scenario: str, cfg: dict | None = None, **env) -> dict | None:
        """One job on every rank, waited for: rank 0's result."""
        self.start(scenario, cfg, **env)
        return self.wait()

    def close(self) -> list[int | None]:
        """Let the ranks leave their world (those still running); their exit codes."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=RUN_S))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill()
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        for proc in self.procs:
            proc.wait()


@pytest.fixture(params=["shm", "gloo"])
def transport(request):
    """Both transports of rank 0's rounds: the shared-memory segment and gloo messages."""
    return request.param


@pytest.fixture
def ranks(worlds, transport):
    """worlds(world) whose jobs run over `transport`."""

    def get(world: int) -> Ranks:
        ranks = worlds(world)
        ranks.env = {"TP_TRANSPORT": transport}
        return ranks

    return get


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """ranks(world): the module's rank processes of that world size, started on first use and
    again after a job broke them (a rank that ended between jobs fails the next test)."""
    worlds: dict[int, Ranks] = {}

    def get(world: int) -> Ranks:
        ranks = worlds.get(world)
        if ranks is not None and not ranks.broken:
            ended = [rank for rank, proc in enumerate(ranks.procs) if proc.poll() is not None]
            if ended:
                ranks.broken = True
                pytest.fail(f"rank {ended[0]} of {world} ended between jobs:\n{''.join(ranks.output[ended[0]])}")
        if ranks is None or ranks.broken:
            if ranks is not None:
                ranks.kill()
            worlds[world] = Ranks(tmp_path_factory.mktemp(f"tp{world}"), world)
        return worlds[world]

    yield get
    for world in worlds.values():
        codes = world.close()
        assert world.broken or codes == [0] * world.world, f"the ranks left their world with {codes}"


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
def test_tp2_alloc_free_map_on_every_rank(ranks, layout):
    assert ranks(2).run("basic", LAYOUT=layout, MIN_RESERVED_PAGES=1, MAX_RESERVED_PAGES=4)["rounds"] > 0


@pytest.mark.parametrize("small_rank", [0, 1])
def test_tp2_out_of_memory_on_one_rank_rolls_back_both(ranks, small_rank):
    cfg = {"small_rank": small_rank, "small_pages": 3}
    assert ranks(2).run("oom", cfg, LAYOUT="per_layer", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0)["pages"] == 3


@pytest.mark.parametrize("device", DEVICES)
def test_tp2_pool_refill_and_trim_are_one_message_each(ranks, device):
    ranks(2).run("batched", {"device": device}, LAYOUT="per_layer", MIN_RESERVED_PAGES=4, MAX_RESERVED_PAGES=4)


def test_tp2_model_based(ranks):
    """Random sequences, the pool on and a rank that runs out of memory (so the refill thread's
    rounds and callers' maps both roll back), checked against every rank after each step."""
    cfg = {"small_rank": 1, "small_pages": 5, "examples": 20}
    counts = ranks(2).run("model", cfg, LAYOUT="interleaved", MIN_RESERVED_PAGES=1, MAX_RESERVED_PAGES=3)
    assert counts["alloc"] > 0 and counts["none"] > 0, counts        # both outcomes were exercised


def test_tp2_follower_retries_a_failed_unmap(ranks):
    ranks(2).run("unmap_fault", {"unmap_faults": 2}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
                 MAX_RESERVED_PAGES=0)


@pytest.mark.parametrize("device", DEVICES)
def test_tp2_tracker_and_budget_count_every_rank(ranks, tmp_path, device):
    tag = f"{os.getpid()}-{tmp_path.name}"[-40:]
    page_bytes = 2 << 20 if device == "cuda" else 16 << 10          # _tp_procs.configure's
    ranks(2).run("instance", {"device": device}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0,
                 TRACKER=1, IPC_NAME=f"tp-{tag}", GLOBAL_BUDGET=f"tp-budget-{tag}",
                 GLOBAL_BUDGET_BYTES=3 * 2 * 4 * page_bytes)             # 3 page ids x 2 ranks


def test_tp2_geometry_mismatch_names_the_rank(ranks):
    assert "rank 1" in ranks(2).run("mismatch", LAYOUT="interleaved", TP_TIMEOUT_S=30)["error"]


@pytest.mark.slow
def test_tp2_rank_without_its_kv_tensors_is_named(ranks):
    """Rank 1 never calls alloc_kv_cache: it answers rank 0's registration with an error once its
    own wait (KVCACHED_TP_TIMEOUT_S) ends, and rank 0 waits for that answer, so its
    alloc_kv_cache raises KVCachedConfigError naming rank 1 (not a lost rank) and the shutdown
    that follows stops rank 1 cleanly."""
    error = ranks(2).run("unregistered", LAYOUT="interleaved", TP_TIMEOUT_S=5)["error"]
    assert "did not call alloc_kv_cache" in error, error


def test_tp_leader_without_pages(ranks):
    """Rank 0 with device="none" leads two ranks that hold the memory; rank 2 runs out first."""
    counts = ranks(3).run("ledger", {"ledger": True, "small_rank": 2, "small_pages": 6, "steps": 80},
                          LAYOUT="auto", MIN_RESERVED_PAGES=1, MAX_RESERVED_PAGES=3)
    assert counts["alloc"] > 0 and counts["none"] > 0, counts        # both outcomes were exercised


def test_leader_without_pages_is_rank_0_of_a_world():
    from kvcached import init_kvcached, shutdown_kvcached
    from kvcached.errors import KVCachedConfigError

    shutdown_kvcached()
    for kwargs in ({}, {"tp_rank": 1, "world_size": 2}):
        with pytest.raises(KVCachedConfigError, match="device='none' .* is for rank 0"):
            init_kvcached(device="none", **kwargs)


def test_tp2_instances_in_turn_over_one_tp_group(ranks):
    """init_kvcached(tp_group=g) twice over one gloo group: the first instance leaves no receive
    posted that would take the second's messages (Note [Posting receives])."""
    assert ranks(2).run("short", {"tp_group": True, "instances": 2}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
                        MAX_RESERVED_PAGES=0, TP_TIMEOUT_S=30)["rounds"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_tp2_dead_rank_raises_within_the_timeout(tmp_path, how, transport):
    """A follower SIGKILLed (its sockets close) or SIGSTOPped (it never answers): rank 0's next
    map raises KVCachedTPError naming rank 1, by the timeout, and nothing hangs."""
    timeout_s = 5
    with Ranks(tmp_path, 2) as ranks:
        workdir = ranks.start("killed", LAYOUT="interleaved", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0,
                              TP_TIMEOUT_S=timeout_s, TP_TRANSPORT=transport)
        wait_for_file(os.path.join(workdir, "ready"), RUN_S)
        os.kill(ranks.procs[1].pid, how)
        if how == signal.SIGKILL:
            ranks.procs[1].wait(RUN_S)
        open(os.path.join(workdir, "go"), "w").close()
        result = ranks.wait(ranks=[0])
    assert "rank 1" in result["first"]
    if how == signal.SIGSTOP:
        assert "KVCACHED_TP_TIMEOUT_S=5" in result["first"], result["first"]
    # bounded: the timeout plus a margin for a loaded machine (a hang ends at RUN_S instead)
    assert result["elapsed_s"] < timeout_s + 60 and result["later_s"] < 60, result


@pytest.mark.slow
@pytest.mark.parametrize("step", ["map", "unmap", "query", "stop"])
def test_tp2_rank_killed_before_each_step(tmp_path, step, transport):
    """Rank 1 SIGKILLed, then rank 0 maps, unmaps, queries or shuts down: each fails naming rank
    1 (its process gone: at once over shared memory, the closed socket over gloo), never by
    the timeout, and rank 0 shuts down."""
    with Ranks(tmp_path, 2) as ranks:
        workdir = ranks.start("killed_at", {"step": step}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
                              MAX_RESERVED_PAGES=0, TP_TIMEOUT_S=600, TP_TRANSPORT=transport)
        wait_for_file(os.path.join(workdir, "ready"), RUN_S)
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        ranks.procs[1].wait(RUN_S)
        open(os.path.join(workdir, "go"), "w").close()
        result = ranks.wait(ranks=[0])
    assert result["elapsed_s"] < 120, result                # far below the 600 s timeout


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_tp2_follower_outlives_a_killed_scheduling_rank(tmp_path, device, transport):
    """Rank 0 SIGKILLed: rank 1's service ends with the lost connection at once (no timeout to
    wait), and its shutdown and exit are clean."""
    with Ranks(tmp_path, 2) as ranks:
        workdir = ranks.start("leader_killed", {"device": device}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
                              MAX_RESERVED_PAGES=0, TP_TIMEOUT_S=600, TP_TRANSPORT=transport)
        wait_for_file(os.path.join(workdir, "ready"), RUN_S)
        os.kill(ranks.procs[0].pid, signal.SIGKILL)
        ranks.wait(ranks=[1])
        assert os.path.exists(os.path.join(workdir, "rank1.done"))
        assert ranks.close()[1] == 0, "".join(ranks.output[1])


@pytest.mark.slow
def test_tp4(ranks):
    """Four ranks; rank 3 runs out of memory first."""
    assert ranks(4).run("oom", {"small_rank": 3, "small_pages": 2}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
                        MAX_RESERVED_PAGES=0)["pages"] == 2


@pytest.mark.slow
def test_tp4_pool_on(ranks):
    ranks(4).run("basic", LAYOUT="per_layer", MIN_RESERVED_PAGES=1, MAX_RESERVED_PAGES=4)


# -- two GPUs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scenario", ["basic", "model", "unmap_fault"])
@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices")
def test_tp2_gpu(ranks, layout, scenario):
    cfg = {"device": "cuda", "examples": 10, "unmap_faults": 2 if scenario == "unmap_fault" else 0}
    pool = (0, 0) if scenario == "unmap_fault" else (1, 4)
    ranks(2).run(scenario, cfg, LAYOUT=layout if scenario != "unmap_fault" else "interleaved",
                 MIN_RESERVED_PAGES=pool[0], MAX_RESERVED_PAGES=pool[1])


@pytest.mark.gpu
@pytest.mark.skipif(not _one_gpu(), reason="needs a CUDA device")
@pytest.mark.parametrize("max_reserved", [0, 2])
def test_tp2_follower_unmap_waits_for_its_stream(ranks, max_reserved):
    """Both ranks on one GPU (each its own context): rank 1's kernel still reads page 0 when rank
    0 unmaps it; the follower must fence its own work first (before: an illegal address)."""
    ranks(2).run("fenced", {"device": "cuda", "one_gpu": True}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
                 MAX_RESERVED_PAGES=max_reserved)


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices")
def test_tp2_gpu_killed_rank(tmp_path):
    with Ranks(tmp_path, 2) as ranks:
        workdir = ranks.start("killed", {"device": "cuda"}, LAYOUT="interleaved", MIN_RESERVED_PAGES=0,
                              MAX_RESERVED_PAGES=0, TP_TIMEOUT_S=10)
        wait_for_file(os.path.join(workdir, "ready"), RUN_S)
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        ranks.procs[1].wait(RUN_S)
        open(os.path.join(workdir, "go"), "w").close()
        result = ranks.wait(ranks=[0])
    assert "rank 1" in result["first"]
