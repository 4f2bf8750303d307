"""pytest plugin: run vLLM's own tests with kvcached's ElasticBlockPool in place of vLLM's BlockPool.

Load it with ``-p vllm_pool_plugin`` (this folder on PYTHONPATH): pytest imports it before any
conftest or test module, so every module of vLLM that is imported afterwards sees our pool.
KVCACHED_VLLM_POOL selects the pool: "kvcached" (default) or "stock" (vLLM's own, the baseline).
KVCACHED_VLLM_PAGE_BYTES sets kvcached's page size (default: kvcached's own, 2 MiB).
See Note [Swapping the pool into vLLM's tests].
"""

from __future__ import annotations

import os

import pytest

POOL = os.environ.get("KVCACHED_VLLM_POOL", "kvcached")
if POOL not in ("kvcached", "stock"):
    raise pytest.UsageError(f"KVCACHED_VLLM_POOL={POOL!r}: use 'kvcached' (our pool) or 'stock' (vLLM's)")

_built = 0      # ElasticBlockPools constructed during the run


def _swap_in_elastic_pool() -> type:
    """Initialise kvcached on the host backend and enable it in vLLM as a user would."""
    os.environ.setdefault("KVCACHED_TRACKER", "0")
    os.environ.setdefault("KVCACHED_MIN_RESERVED_PAGES", "0")
    from kvcached import init_kvcached
    page_bytes = os.environ.get("KVCACHED_VLLM_PAGE_BYTES")
    init_kvcached(device="cpu", page_size_bytes=None if page_bytes is None else int(page_bytes))

    from kvcached.integration import vllm as kvcached_vllm
    kvcached_vllm.enable()
    pool = kvcached_vllm.ElasticBlockPool

    import vllm.v1.core.block_pool
    vllm.v1.core.block_pool.BlockPool = pool

    build = pool.__init__

    def counted_init(self, *args, **kwargs) -> None:
        global _built
        _built += 1
        build(self, *args, **kwargs)

    pool.__init__ = counted_init
    return pool


EXPECTED = _swap_in_elastic_pool() if POOL == "kvcached" else None


def pytest_report_header(config: pytest.Config) -> str:
    import vllm
    name = "vLLM's stock BlockPool" if EXPECTED is None else f"{EXPECTED.__module__}.{EXPECTED.__qualname__}"
    return f"vllm {vllm.__version__}; block pool: {name}"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Every collected test module that names BlockPool must see the pool under test."""
    if EXPECTED is None:
        return
    stale = sorted({item.module.__name__ for item in items
                    if getattr(item, "module", None) is not None
                    and getattr(item.module, "BlockPool", EXPECTED) is not EXPECTED})
    if stale:
        raise pytest.UsageError(f"these modules imported vLLM's BlockPool before the swap: {stale}")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if EXPECTED is not None:
        terminalreporter.write_line(f"kvcached ElasticBlockPools built: {_built}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A run that never built our pool proves nothing about it. Its own exit status: some of
    # vLLM's tests fail on a CPU anyway (TESTS_FAILED), and the CI script accepts that one.
    if EXPECTED is not None and _built == 0 and session.testscollected:
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR


# Note [Swapping the pool into vLLM's tests]
# vLLM's coordinator builds its pool through the name that enable() rebinds, which covers the
# tests that go through KVCacheManager or the Scheduler. Other tests build a pool directly with
# `from vllm.v1.core.block_pool import BlockPool`; rebinding that module's name too, before the
# test modules are imported, makes those tests exercise our pool as well (enable() leaves it
# alone on purpose: it is vLLM's base class). The collection check refuses a run in which a
# test module still holds vLLM's class, and the count of pools built refuses a run that never
# constructed ours, so a green run really is a run of vLLM's tests against ElasticBlockPool.
