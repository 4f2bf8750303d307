"""The main allocator cases as pytest-benchmark tests.

    pytest benchmarks/ --benchmark-only      # measure
    pytest benchmarks/ --benchmark-disable   # run each once (CI)
"""

import pytest

from bench_alloc import Setup, cycle, threads_ops, warm_pool


@pytest.fixture(params=[1, 64], ids=["segments1", "segments64"])
def pooled(request):
    s = Setup("host", request.param, num_pages=64)
    warm_pool(s)
    yield s
    s.close()


@pytest.fixture(params=[1, 64], ids=["segments1", "segments64"])
def unpooled(request):
    s = Setup("host", request.param, num_pages=16, min_reserved=0, max_reserved=0)
    yield s
    s.close()


@pytest.mark.parametrize("k", [1, 16, 256])
def test_alloc_free_pool_on(benchmark, pooled, k):
    benchmark(cycle(pooled.blocks, k))
    assert pooled.blocks.stats()["allocated"] == 0


@pytest.mark.parametrize("k", [1, 16])
def test_alloc_free_pool_off(benchmark, unpooled, k):
    benchmark(cycle(unpooled.blocks, k))
    assert unpooled.table.num_mapped == 0


def test_available_blocks(benchmark, pooled):
    assert benchmark(pooled.blocks.available_blocks) > 0


def test_free_1024(benchmark):
    s = Setup("host", 1, num_pages=64, min_reserved=0, max_reserved=32)
    try:
        def setup():
            return (s.blocks.alloc(1024),), {}
        benchmark.pedantic(s.blocks.free, setup=setup, rounds=50)
    finally:
        s.close()


@pytest.mark.parametrize("threads", [1, 8])
def test_threads_alloc_free(benchmark, pooled, threads):
    ops = benchmark.pedantic(threads_ops, args=(pooled.blocks, threads), kwargs={"seconds": 0.05}, rounds=1, iterations=1)
    assert ops > 0
