"""The main manager cases of bench_manager.py as pytest-benchmark tests, per layout.

    pytest benchmarks/ --benchmark-only                          # measure (host backend)
    pytest benchmarks/ --benchmark-only --bench-device cuda      # measure on the GPU
    pytest benchmarks/ --benchmark-disable                       # run each once (CI)

Same model as bench_manager.py (32 layers, 8x128 bf16, block 16, 2 MiB pages) with a smaller
cache (4096 blocks, 64 page ids) so that a CI run stays short.
"""

import pytest

from bench_alloc import cycle, threads_ops
from bench_manager import LAYOUTS, Instance, driver_floor

NUM_BLOCKS = 4096
# The fast lane (-m "not slow") runs the first layout only: each instance maps 32 layers.
FAST_LAYOUTS = [LAYOUTS[0], *(pytest.param(layout, marks=pytest.mark.slow) for layout in LAYOUTS[1:])]


@pytest.fixture(params=FAST_LAYOUTS)
def pooled(request, bench_device):
    inst = Instance(bench_device, request.param, num_blocks=NUM_BLOCKS)
    inst.warm_pool()
    yield inst
    inst.close()


@pytest.fixture(params=FAST_LAYOUTS)
def unpooled(request, bench_device):
    inst = Instance(bench_device, request.param, pool=(0, 0), num_blocks=NUM_BLOCKS)
    yield inst
    inst.close()


@pytest.mark.parametrize("k", [16, 256])
def test_manager_alloc_free_pool_on(benchmark, pooled, k):
    benchmark(cycle(pooled.m, k))
    assert pooled.m.stats()["allocated"] == 0


def test_manager_alloc_free_pool_0(benchmark, unpooled):
    benchmark.pedantic(cycle(unpooled.m, 16), rounds=20 if unpooled.layout != "per_layer" else 5, iterations=1)
    assert unpooled.pages.stats()["reserved"] == 0


def test_manager_available_size(benchmark, pooled):
    assert benchmark(pooled.m.available_size) > 0


def test_manager_threads_alloc_free(benchmark, pooled):
    ops = benchmark.pedantic(threads_ops, args=(pooled.m, 8), kwargs={"seconds": 0.05}, rounds=1, iterations=1)
    assert ops > 0


def test_manager_map_one_page(benchmark, unpooled):
    pt = unpooled.table
    unpooled.pages.stop()
    p = pt.num_pages - 1

    def map_unmap():
        assert pt.map([p])
        pt.unmap([p])
    benchmark.pedantic(map_unmap, rounds=5 if unpooled.layout == "per_layer" else 20, iterations=1)
    assert not pt.is_mapped(p)


def test_driver_floor_leaves_the_table_and_backend_as_they_were(unpooled):
    """The floor maps and unmaps a page id's segments behind the table's back: afterwards the page
    is unmapped, every handle it made is released, and a mapped page id is refused."""
    pt, b = unpooled.table, unpooled.backend
    unpooled.pages.stop()
    p = pt.num_pages - 1
    physical = b.physical_bytes
    floor = driver_floor(pt, p, 3)
    assert set(floor) == {"map_us", "unmap_us"} and all(len(v) == 3 and min(v) > 0 for v in floor.values())
    assert not pt.is_mapped(p) and b.physical_bytes == physical
    pt.check_invariants()
    assert pt.map([p])
    with pytest.raises(ValueError, match=f"{p} is mapped"):
        driver_floor(pt, p, 1)
    pt.unmap([p])
