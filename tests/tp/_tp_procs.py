"""The ranks of a tensor-parallel kvcached instance, as real processes, for tests/tp/test_mirror.py.

Run as ``python tests/tp/_tp_procs.py RANK WORLD WORKDIR`` (PYTHONPATH = the repository root). Every
rank joins a gloo world through a file store in WORKDIR once, then runs jobs in turn, one JSON
line each on stdin: ``{"scenario", "cfg", "env", "workdir"}``. For a job, a rank sets KVCACHED_*
to ``env``, initialises kvcached with tp_rank=RANK on the host backend and makes the KV tensors;
rank 0 runs the scenario (its assertions fail the process) while the other ranks serve until
rank 0 shuts down (``cfg`` may ask for several instances in turn over one gloo group of their
own, passed as tp_group). Each rank answers a job with one line, REPLY and rank 0's result as
JSON; a failed job ends the process with its traceback. Files in the job's workdir are the
events the test and the ranks wait on (``ready``, ``go``), with generous deadlines. See Note
[One world, many instances].
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for path in (REPO, os.path.join(REPO, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch
import torch.distributed as dist

from kvcached import KVCacheManager, alloc_kv_cache, init_kvcached, shutdown_kvcached
from kvcached import runtime as kv_runtime
from kvcached.config import reload_settings
from kvcached.errors import KVCachedConfigError, KVCachedTPError
from _procs import wait_until

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8
BLOCK_BYTES = BLOCK * HEADS * DIM * 4
NUM_PAGES = 64
WAIT_S = 120.0
PAGE_BYTES = BLOCKS_PER_PAGE = NUM_BLOCKS = PAGE_ID_BYTES = 0     # set by configure()


def configure(page_bytes: int) -> None:
    """Pages of `page_bytes` per buffer (16 KiB on the host, 2 MiB on CUDA)."""
    global PAGE_BYTES, BLOCKS_PER_PAGE, NUM_BLOCKS, PAGE_ID_BYTES
    PAGE_BYTES = page_bytes
    BLOCKS_PER_PAGE = PAGE_BYTES // BLOCK_BYTES
    NUM_BLOCKS = NUM_PAGES * BLOCKS_PER_PAGE
    PAGE_ID_BYTES = PAGE_BYTES * LAYERS * 2       # one page id on one rank: every layer, K and V


def wait_for_file(path: str, timeout_s: float = WAIT_S) -> None:
    """Wait for another process to create `path` (an event between processes)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.02)


def touch(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write("1")
    os.replace(path + ".tmp", path)


def manager(**kwargs) -> KVCacheManager:
    return KVCacheManager(NUM_BLOCKS, BLOCK, HEADS * DIM * 4, LAYERS, **kwargs)


def leader():
    return kv_runtime.runtime().tp


def table():
    return kv_runtime.runtime().groups[0].page_table


def mapped_everywhere() -> dict[int, list[int]]:
    """{rank: mapped page ids of group 0}, rank 0's included, none half mapped."""
    return leader().mapped_everywhere(0, table())


def assert_same_everywhere() -> list[int]:
    mapped = mapped_everywhere()
    assert all(ids == mapped[0] for ids in mapped.values()), mapped
    return mapped[0]


def alloc_pages(m: KVCacheManager, pages: int) -> list[int] | None:
    return m.alloc(pages * BLOCKS_PER_PAGE)


# -- scenarios on rank 0 (each returns the result of its job) ------------------------------------

def basic(cfg: dict, workdir: str) -> dict:
    """Alloc and free map and unmap on every rank; the pool's fast path sends nothing from the
    caller's thread; the instance counts every rank's memory. Pool bounds 1..4 (environment)."""
    world = dist.get_world_size()
    many = list(range(1, NUM_PAGES, 2))           # more ids than a request carries inline
    assert table().map(many)
    assert assert_same_everywhere() == many
    table().unmap(many)
    assert assert_same_everywhere() == []
    m = manager(world_size=world)
    assert m.page_bytes == PAGE_ID_BYTES * world and m.world_size == world
    blocks = [alloc_pages(m, 1) for _ in range(3)]
    assert all(b is not None for b in blocks)
    m.check_invariants()
    mapped = assert_same_everywhere()
    assert len(mapped) >= 3
    m._pages.stop()                                   # no refill between the two reads below
    assert m.get_mapped_memory_size() == len(table().mapped_page_ids()) * PAGE_ID_BYTES * world
    m._pages.start()
    kv = kv_runtime.runtime().groups[0].tensors
    kv[0][0, blocks[0][0]].fill_(1.5)                 # the memory is really there on rank 0
    for b in blocks:
        m.free(b)
    m.trim()                                          # the pool goes, on every rank
    assert assert_same_everywhere() == []
    me = threading.get_ident()
    m.free(m.alloc(16))                               # maps the page the cycles below reuse
    sent = leader().rounds_by_thread[me]
    for _ in range(200):
        m.free(m.alloc(16))
    assert leader().rounds_by_thread[me] == sent, (sent, leader().rounds_by_thread[me])
    m.check_invariants()
    limit = m.set_memory_limit(PAGE_ID_BYTES * world, revision=1)
    assert limit["status"] == "applied" and limit["mapped_bytes"] <= PAGE_ID_BYTES * world, limit
    assert len(assert_same_everywhere()) <= 1
    forked_child_touches_nothing(m)
    m.close()
    assert assert_same_everywhere() == []
    return {"rounds": leader().num_rounds}


def forked_child_touches_nothing(m: KVCacheManager) -> None:
    """A child forked from rank 0 refuses the manager, and its shutdown and exit send nothing to
    the peers: the instance goes on as before."""
    from kvcached.errors import KVCachedClosedError

    held = m.alloc(16)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                m.alloc(1)
            except KVCachedClosedError:
                shutdown_kvcached()
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert assert_same_everywhere()                   # the peers still answer, in step
    m.free(held)
    m.check_invariants()


def oom(cfg: dict, workdir: str) -> dict:
    """One rank has room for `cfg["small_pages"]` page ids: past them alloc returns None and every
    rank is as before; freeing makes room again."""
    m = manager()
    small = cfg["small_pages"]
    held = []
    for _ in range(small):
        ids = alloc_pages(m, 1)
        assert ids is not None
        held.append(ids)
    before = assert_same_everywhere()
    assert len(before) == small
    for n in (1, 2, 5):
        assert alloc_pages(m, n) is None
        assert assert_same_everywhere() == before
        m.check_invariants()
    m.free(held.pop())
    again = alloc_pages(m, 1)
    assert again is not None
    assert len(assert_same_everywhere()) == small
    m.close()
    return {"pages": small}


def model(cfg: dict, workdir: str) -> dict:
    """Hypothesis: random alloc / free / trim / limit sequences; after each step every rank maps
    exactly rank 0's page ids and the allocator's invariants hold."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    world = dist.get_world_size()
    alloc = st.tuples(st.just("alloc"), st.integers(1, 3 * BLOCKS_PER_PAGE))
    steps = st.lists(st.one_of(
        alloc, alloc, alloc,
        st.tuples(st.just("free"), st.integers(0, 1 << 30)),
        st.tuples(st.just("trim"), st.just(0)),
        st.tuples(st.just("limit"), st.integers(-1, NUM_PAGES)),
        st.tuples(st.just("reserve"), st.integers(0, 2 * BLOCKS_PER_PAGE))), min_size=8, max_size=30)
    counts = {"none": 0, "alloc": 0}

    @settings(max_examples=cfg.get("examples", 25), deadline=None, database=None)
    @given(ops=steps)
    @example(ops=[("alloc", 3 * BLOCKS_PER_PAGE)] * 3)   # past a small rank's pages: both outcomes, every run
    def run(ops):
        m = manager()
        live: list[list[int]] = []
        revision = 0
        try:
            for op, arg in ops:
                if op == "alloc":
                    ids = m.alloc(arg)
                    counts["none" if ids is None else "alloc"] += 1
                    if ids is not None:
                        assert len(set(ids)) == arg
                        live.append(ids)
                elif op == "free" and live:
                    m.free(live.pop(arg % len(live)))
                elif op == "trim":
                    m.trim()
                elif op == "limit":
                    revision += 1
                    m.set_memory_limit(-1 if arg < 0 else arg * PAGE_ID_BYTES * world, revision=revision)
                elif op == "reserve":
                    if m.try_to_reserve(arg):
                        m.free_reserved()
                m.check_invariants()                  # rank 0's allocator, then every rank's pages
        finally:
            m.close()
        assert assert_same_everywhere() == []

    run()
    return counts


def killed(cfg: dict, workdir: str) -> dict:
    """The test kills (or stops) rank 1 once ``ready`` exists; the next call that needs it raises
    KVCachedTPError within the timeout, and so does every later one, at once."""
    m = manager()
    held = alloc_pages(m, 1)
    assert held is not None
    touch(os.path.join(workdir, "ready"))
    wait_for_file(os.path.join(workdir, "go"))
    t0 = time.monotonic()
    try:
        alloc_pages(m, 1)
    except KVCachedTPError as exc:
        first = str(exc)
        assert exc.rank == 1 and exc.operation == "map", (exc.rank, exc.operation)
    else:
        raise AssertionError("alloc with a dead rank did not raise")
    elapsed = time.monotonic() - t0
    assert "rank 1" in first and "restart every rank" in first, first
    try:
        m.free(held)                                  # its unmap needs the peer: the error is kept
        m.trim()                                      # off the caller's path, or raised; the trim
    except KVCachedTPError:                           # settles an unmap the background thread
        pass                                          # took (it retries one that failed there)
    else:
        assert isinstance(m._pages.last_error, KVCachedTPError), m._pages.last_error
    m._blocks.check_invariants()                      # rank 0's own state is settled
    assert table().mapped_page_ids() == [], table().mapped_page_ids()
    t1 = time.monotonic()
    try:
        alloc_pages(m, 1)
    except KVCachedTPError as exc:
        assert "broken" in str(exc), str(exc)
    else:
        raise AssertionError("alloc after a rank died did not raise")
    later = time.monotonic() - t1
    try:
        shutdown_kvcached()
    except KVCachedTPError:
        pass
    return {"elapsed_s": elapsed, "later_s": later, "first": first}


def killed_at(cfg: dict, workdir: str) -> dict:
    """The test kills rank 1 once ``ready`` exists; then rank 0 takes one step that needs it
    (cfg "step": map, unmap, query or stop): it raises KVCachedTPError naming rank 1 (an unmap
    may keep it off the caller's path, in the allocator's last_error), and shutdown ends."""
    step, error = cfg["step"], None
    m = manager()
    held = alloc_pages(m, 1)
    assert held is not None
    if step == "stop":                                # nothing mapped: the shutdown's one round is STOP
        m.free(held)
        m.trim()
    touch(os.path.join(workdir, "ready"))
    wait_for_file(os.path.join(workdir, "go"))
    t0 = time.monotonic()
    try:
        if step == "map":
            alloc_pages(m, 1)
        elif step == "unmap":
            m.free(held)
            m.trim()
            # the unmap is the free's, trim's or the background thread's, whichever held map_lock
            # first (Note [Deferred unmap]); the thread's error lands in last_error when it ends
            wait_until(lambda: m._pages.last_error is not None, WAIT_S, "the unmap's error in last_error")
            error = m._pages.last_error
        elif step == "query":
            mapped_everywhere()
        else:
            shutdown_kvcached()
    except KVCachedTPError as exc:
        error = exc
    elapsed = time.monotonic() - t0
    assert isinstance(error, KVCachedTPError) and error.rank == 1, repr(error)
    assert "rank 1" in str(error), str(error)
    try:
        shutdown_kvcached()
    except KVCachedTPError:
        pass
    return {"elapsed_s": elapsed, "error": str(error)}


def ledger(cfg: dict, workdir: str) -> dict:
    """Rank 0 holds no pages (init_kvcached(device="none"), a scheduler process without a device):
    its tables keep the books and the other ranks hold the memory. Seeded random allocs and frees
    with the pool on and a rank that runs out of memory first; after every step every rank maps
    exactly the page ids rank 0's books say, and the manager counts the ranks with pages."""
    world = dist.get_world_size()
    rt = kv_runtime.runtime()
    assert rt.backend.holds_memory is False and rt.groups[0].tensors == [], rt.groups[0].tensors
    m = manager(world_size=world - 1)
    assert m.world_size == world - 1 and m.page_bytes == PAGE_ID_BYTES * (world - 1), (m.world_size, m.page_bytes)
    rng = random.Random(cfg.get("seed", 0))
    held, counts = [], {"alloc": 0, "none": 0}
    for _ in range(cfg.get("steps", 60)):
        if held and rng.random() < 0.45:
            m.free(held.pop(rng.randrange(len(held))))
        else:
            ids = alloc_pages(m, rng.randint(1, 3))
            counts["none" if ids is None else "alloc"] += 1
            if ids is not None:
                held.append(ids)
        m.check_invariants()
        assert_same_everywhere()
    for ids in held:
        m.free(ids)
    m.trim()
    assert assert_same_everywhere() == []
    m.close()
    return counts


def unmap_fault(cfg: dict, workdir: str) -> dict:
    """Rank 1's first two unmaps fail: the page it could not unmap is out of memory there (alloc
    returns None, every rank as before) until its retry succeeds."""
    m = manager()
    ids = alloc_pages(m, 1)
    m.free(ids)
    m.trim()                                          # the unmap is done (rank 1's #1 fails: page 0 stays)
    mapped = mapped_everywhere()
    assert mapped[0] == [] and mapped[1] == [0], mapped
    assert alloc_pages(m, 1) is None                  # page 0 again: rank 1's retry (#2) fails: OOM
    mapped = mapped_everywhere()
    assert mapped[0] == [] and mapped[1] == [0], mapped
    ids = alloc_pages(m, 1)                           # retry #3 works, then the map
    assert ids is not None
    assert assert_same_everywhere() == [0]
    m.free(ids)
    m.trim()
    assert assert_same_everywhere() == []
    m.close()
    return {}


def instance(cfg: dict, workdir: str) -> dict:
    """The tracker's segment and the global budget see one instance of every rank's memory: a
    budget of 3 page ids on every rank lets exactly 3 be mapped (pool 0)."""
    from kvcached.shm.budget import delete_budget, read_budget
    from kvcached.shm.client import read_segment

    world = dist.get_world_size()
    instance_page = PAGE_ID_BYTES * world
    m = manager()
    name, budget = m.ipc_name, os.environ["KVCACHED_GLOBAL_BUDGET"]
    assert name is not None
    seen = read_segment(name)
    assert (seen.page_size_bytes, seen.capacity_bytes) == (instance_page, m.num_pages * instance_page), seen
    held = []
    while (ids := alloc_pages(m, 1)) is not None:
        held.append(ids)
    assert len(held) == 3 and m.available_size() == 0, (len(held), m.available_size())
    assert len(assert_same_everywhere()) == 3
    assert read_budget(budget).held_bytes == 3 * instance_page
    deadline = time.monotonic() + WAIT_S              # the publisher writes every 10 ms
    while read_segment(name).used_bytes != 3 * instance_page:
        assert time.monotonic() < deadline, read_segment(name)
        time.sleep(0.01)
    for ids in held:
        m.free(ids)
    m.trim()
    assert read_budget(budget).held_bytes == 0 and assert_same_everywhere() == []
    m.close()
    delete_budget(budget)
    return {}


def batched(cfg: dict, workdir: str) -> dict:
    """A refill round of the pool (4 pages) is one message; so is a trim of it."""
    me = threading.get_ident()
    before = leader().num_rounds
    m = manager()
    deadline = time.monotonic() + WAIT_S
    while m.stats()["pages"]["reserved"] < 4:
        assert time.monotonic() < deadline, m.stats()["pages"]
        time.sleep(0.01)
    assert leader().num_rounds - before == 1, leader().num_rounds - before     # the refill thread's one round
    mine = leader().rounds_by_thread[me]
    m.trim()
    assert leader().rounds_by_thread[me] - mine == 1
    assert assert_same_everywhere() == []
    m.close()
    return {}


def leader_killed(cfg: dict, workdir: str) -> dict:
    """Rank 0 maps a page, then waits to be killed by the test (rank 1's side is in main())."""
    m = manager()
    assert alloc_pages(m, 1) is not None
    touch(os.path.join(workdir, "ready"))
    wait_for_file(os.path.join(workdir, "never"))
    return {}


def short(cfg: dict, workdir: str) -> dict:
    """A few allocs and frees, every rank checked after each: one of several instances in turn."""
    m = manager()
    held = [alloc_pages(m, 1) for _ in range(3)]
    assert all(ids is not None for ids in held)
    assert len(assert_same_everywhere()) == 3
    for ids in held:
        m.free(ids)
    m.close()
    assert assert_same_everywhere() == []
    return {"rounds": leader().num_rounds}


def fenced(cfg: dict, workdir: str) -> dict:
    """Rank 1 queues a slow kernel that reads page 0; rank 0 frees the page and lowers the
    limit to 0 while it runs: rank 1's unmap must wait for its own queued work (rank 0's
    fence covers only rank 0's device). See fenced_follower."""
    m = manager()
    ids = alloc_pages(m, 1)
    assert ids is not None and ids[0] == 0, ids
    touch(os.path.join(workdir, "mapped"))
    wait_for_file(os.path.join(workdir, "queued"))
    m.free(ids)
    assert m.set_memory_limit(0, revision=1)["status"] in ("applied", "deferred")
    m._pages.drain(True)
    assert assert_same_everywhere() == []
    m.close()
    return {"rounds": leader().num_rounds}


def fenced_follower(workdir: str, device: str) -> None:
    """Rank 1's side of `fenced`: write block 0, queue ~0.5 s of spinning and then a read of it
    on the current stream, let rank 0 unmap, and check the read saw the data."""
    wait_for_file(os.path.join(workdir, "mapped"))
    kv = kv_runtime.runtime().groups[0].tensors
    kv[0][0, 0].fill_(7.0)
    torch.cuda.synchronize(device)
    out = torch.empty_like(kv[0][0, 0])
    torch.cuda._sleep(2_000_000_000 // 1000 * 500)
    out.copy_(kv[0][0, 0])
    touch(os.path.join(workdir, "queued"))
    torch.cuda.synchronize(device)                 # an illegal address here if unmapped under the kernel
    assert bool((out == 7.0).all()), "rank 1 read its page after it was unmapped"


SCENARIOS = {f.__name__: f for f in (basic, oom, model, killed, killed_at, ledger, unmap_fault, instance, batched,
                                     leader_killed, short, fenced)}


# -- every rank --------------------------------------------------------------------------------

# Scenarios whose rank 0 alloc_kv_cache must refuse (set up by run_instance), and a word its error names.
REFUSED = {"mismatch": "num_pages", "unregistered": "alloc_kv_cache"}


# The line that ends a rank's answer to a job; rank 0's result follows it as JSON.
REPLY = "tp-rank-reply: "


def main() -> None:
    rank, world, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank,
                            world_size=world)
    for line in sys.stdin:
        job = json.loads(line)
        result = run_job(job["scenario"], rank, world, job["workdir"], job["cfg"], job["env"])
        print(REPLY + json.dumps(result), flush=True)
    dist.destroy_process_group()


def run_job(scenario: str, rank: int, world: int, workdir: str, cfg: dict, env: dict[str, str]) -> dict | None:
    """One job: KVCACHED_* set to `env` alone, then `cfg["instances"]` instances in turn; rank 0's
    result (None on the other ranks)."""
    for name in [n for n in os.environ if n.startswith("KVCACHED_")]:
        del os.environ[name]
    os.environ.update(env)
    reload_settings()
    configure(2 << 20 if cfg.get("device") == "cuda" else 16 << 10)
    tp_group = dist.new_group(backend="gloo") if cfg.get("tp_group") else None
    result = None
    for _ in range(cfg.get("instances", 1)):
        result = run_instance(scenario, rank, world, workdir, cfg, tp_group)
    return result


def run_instance(scenario: str, rank: int, world: int, workdir: str, cfg: dict, tp_group) -> dict | None:
    """One kvcached instance on this rank, from init_kvcached to shutdown_kvcached; rank 0's
    result."""
    cuda = cfg.get("device") == "cuda"
    device = ("cuda:0" if cfg.get("one_gpu") else f"cuda:{rank}") if cuda else "cpu"
    if cfg.get("ledger") and rank == 0:
        device = "none"                         # a leader without pages: Note [Leader without pages]
    small = cfg.get("small_rank") == rank       # host backend: room for small_pages page ids
    init_kvcached(tp_rank=rank, world_size=world, device=device, page_size_bytes=PAGE_BYTES, tp_group=tp_group,
                  host_capacity_bytes=None if cuda else (cfg["small_pages"] if small else 4 * NUM_PAGES) * PAGE_ID_BYTES)
    wanted = os.environ.get("KVCACHED_TP_TRANSPORT", "auto")
    if wanted != "auto":                          # the instance runs over the transport asked for
        assert kv_runtime.runtime().tp.channel.kind == wanted, (kv_runtime.runtime().tp.channel.kind, wanted)
    num_blocks = NUM_BLOCKS + (BLOCKS_PER_PAGE if scenario == "mismatch" and rank == 1 else 0)
    shape = (2, num_blocks, BLOCK, HEADS, DIM)
    backend = kv_runtime.runtime().backend
    if rank and cfg.get("unmap_faults"):
        backend.inject_fault("unmap", after=0, times=cfg["unmap_faults"])
    result = None
    if scenario in REFUSED and rank == 0:
        try:
            alloc_kv_cache(shape, BLOCK, torch.float32, device, LAYERS)
        except KVCachedConfigError as exc:
            assert "rank 1" in str(exc) and REFUSED[scenario] in str(exc), str(exc)
            result = {"error": str(exc)}
        else:
            raise AssertionError(f"{scenario}: rank 0's alloc_kv_cache did not raise")
    elif not (scenario == "unregistered" and rank):
        alloc_kv_cache(shape, BLOCK, torch.float32, device, LAYERS)
    if rank and scenario == "fenced":
        fenced_follower(workdir, device)
    if rank:
        try:
            manager()
        except KVCachedConfigError as exc:
            assert f"tp_rank={rank}" in str(exc), str(exc)
        else:
            raise AssertionError(f"a KVCacheManager on rank {rank} did not raise")
        assert kv_runtime.wait_for_scheduler(WAIT_S), "rank 0 did not shut down"
        follower, groups = kv_runtime.runtime().tp, kv_runtime.runtime().groups
        mapped = groups[0].page_table.mapped_page_ids() if groups else []
        if scenario == "leader_killed":               # serving ended with the lost connection
            assert follower.error is not None and len(mapped) == 1, (follower.error, mapped)
        else:
            assert follower.error is None and mapped == [], (follower.error, mapped)
        shutdown_kvcached()
        if scenario == "leader_killed":
            touch(os.path.join(workdir, f"rank{rank}.done"))
    else:
        random.seed(0)
        if result is None:
            result = SCENARIOS[scenario](cfg, workdir)
        shutdown_kvcached()
    return result


if __name__ == "__main__":
    main()


# Note [One world, many instances]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rank process spends most of its life importing torch (seconds on a loaded 2-core machine),
# against a fraction of a second for a scenario. So the ranks join their gloo world once and run
# the scenarios of a test module in turn, each one a kvcached instance from init_kvcached to
# shutdown_kvcached with the settings of its test: this is what an engine that restarts kvcached
# inside one torch.distributed world does, and every instance makes its own gloo group for its
# messages (or is given one), so none sees an earlier one's traffic. A scenario that kills or
# stops a rank, or one that fails, leaves a world that cannot be used again: the test side starts
# fresh processes for the first, and after the second.
