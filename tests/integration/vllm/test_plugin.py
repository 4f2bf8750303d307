"""kvcached.integration.vllm switched on and off: importing changes nothing in vLLM, enable()
and disable() swap vLLM's pool (and the worker's allocate_kv_cache) and restore them, another
vLLM release is refused, and the plugin's entry point is declared.

Skipped without a supported vLLM (tests/integration/vllm/_vllm_contract.py). Subprocesses for
what must not leak into this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from _vllm_contract import vllm_manager
from vllm.v1.core import block_pool as vllm_block_pool
from vllm.v1.core import kv_cache_coordinator as vllm_coordinator

from kvcached.errors import KVCachedConfigError
from kvcached.integration.vllm import ElasticBlockPool, allocate_kv_cache, disable, enable, is_enabled
from kvcached.integration.vllm.version import SUPPORTED_VLLM, check_vllm_version

STOCK_BLOCK_POOL = vllm_block_pool.BlockPool
ENTRY_POINT = "kvcached = kvcached.integration.vllm:register"      # as pyproject.toml declares it


def _run_python(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVCACHED_TRACKER="0", **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300, check=False)


def test_importing_kvcached_changes_nothing_in_vllm():
    result = _run_python("""
        import kvcached, kvcached.integration, kvcached.integration.vllm as kv
        from kvcached.integration.vllm import ElasticBlockPool, allocate_kv_cache
        import vllm.v1.core.block_pool as bp, vllm.v1.core.kv_cache_coordinator as kc
        assert kc.BlockPool is bp.BlockPool and bp.BlockPool.__module__ == "vllm.v1.core.block_pool", kc.BlockPool
        assert not kv.is_enabled()
        print("unchanged")
    """)
    assert result.returncode == 0 and "unchanged" in result.stdout, result.stderr


def test_enable_swaps_the_coordinators_pool_and_disable_restores_it(vllm_kv):
    assert not is_enabled()
    enable(worker=False)
    enable(worker=False)                                    # idempotent
    assert is_enabled() and vllm_coordinator.BlockPool is ElasticBlockPool
    assert vllm_block_pool.BlockPool is STOCK_BLOCK_POOL    # vLLM's class itself is untouched
    disable()
    disable()
    assert not is_enabled() and vllm_coordinator.BlockPool is STOCK_BLOCK_POOL
    assert type(vllm_manager(16, elastic=False).block_pool) is STOCK_BLOCK_POOL
    assert type(vllm_manager(16, elastic=True).block_pool) is ElasticBlockPool


def test_enable_with_the_worker_hook_swaps_allocate_kv_cache(vllm_kv):
    import importlib

    try:
        runners = [importlib.import_module(m) for m in ("vllm.v1.worker.gpu_model_runner",
                                                        "vllm.v1.worker.gpu.attn_utils")]
    except ImportError as exc:
        pytest.skip(f"vLLM's GPU worker modules do not import here: {exc}")
    stock = [runner.allocate_kv_cache for runner in runners]
    enable()
    assert all(runner.allocate_kv_cache is allocate_kv_cache for runner in runners)
    disable()
    assert [runner.allocate_kv_cache for runner in runners] == stock


def test_enable_logs_the_vllm_release_it_found(vllm_kv, caplog):
    import vllm

    with caplog.at_level("INFO", logger="kvcached"):
        enable(worker=False)
    disable()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvcached" and "enabled" in r.getMessage()]
    assert line.startswith(f"kvcached enabled in vLLM {vllm.__version__}: "), line


def test_the_pool_forwards_vllms_own_constructor_arguments(vllm_kv):
    """vLLM's BlockPool takes different keyword arguments per release (0.33 added
    num_hash_lookahead_tokens): the pool takes whatever the installed one takes, and no other."""
    import inspect

    parameters = set(inspect.signature(STOCK_BLOCK_POOL.__init__).parameters) - {"self"}
    pool = ElasticBlockPool(**{"num_gpu_blocks": 16, "enable_caching": True, "hash_block_size": 16})
    try:
        assert pool.enable_caching and pool.num_gpu_blocks == 16
        with pytest.raises(TypeError, match="no_such_argument"):
            ElasticBlockPool(16, True, 16, no_such_argument=1)
        if "num_hash_lookahead_tokens" in parameters:
            lookahead = ElasticBlockPool(16, True, 16, num_hash_lookahead_tokens=2)
            assert lookahead.num_hash_lookahead_tokens == 2
            lookahead.close()
    finally:
        pool.close()


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.33.0", "0.3.3", "0.3", "nightly", ""])
def test_version_check_names_the_version_and_the_supported_range(version):
    with pytest.raises(KVCachedConfigError) as info:
        check_vllm_version(version)
    assert repr(version)[1:-1] in str(info.value) and SUPPORTED_VLLM in str(info.value)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.4", "0.33.0", "0.33.7", "0.33.1.dev4+g1234abc", "0.33.0rc1"])
def test_version_check_accepts_the_supported_minor(version):
    assert check_vllm_version(version) == version


def test_enable_refuses_another_vllm_release_and_changes_nothing(tmp_path):
    # A real distribution record of vllm 0.31.0 first on sys.path: what metadata then reports.
    dist = tmp_path / "vllm-0.31.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.0\n")
    result = _run_python(f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        from kvcached.errors import KVCachedConfigError, KVCachedError
        import kvcached.integration.vllm as kv
        try:
            kv.enable()
        except KVCachedConfigError as exc:
            print("refused:", exc)
        else:
            raise SystemExit("enabled on vllm 0.31.0")
        import vllm.v1.core.block_pool as bp, vllm.v1.core.kv_cache_coordinator as kc
        assert kc.BlockPool is bp.BlockPool and not kv.is_enabled()
        try:
            kv.ElasticBlockPool
        except KVCachedConfigError:
            print("pool refused")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("refused: vllm 0.31.0 is installed") == 1, result.stdout
    assert SUPPORTED_VLLM in result.stdout and "pool refused" in result.stdout


def test_entry_point_is_declared_when_kvcached_is_installed():
    from importlib import metadata

    points = [p for p in metadata.entry_points(group="vllm.general_plugins") if p.value.startswith("kvcached")]
    if not points:
        pytest.skip("kvcached is not installed with its vllm.general_plugins entry point here")
    from kvcached.integration.vllm import register

    assert [f"{p.name} = {p.value}" for p in points] == [ENTRY_POINT] and [p.load() for p in points] == [register]
