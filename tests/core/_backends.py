"""Helpers shared by test_vmm, test_pagetable, test_vmm_dlpack and test_vmm_cuda.

A plain module, not a conftest: the tests import what they use. Everything here works on real
memory: host pages are read and written through ctypes, faults are observed in child processes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from kvcached import core

OS_PAGE = os.sysconf("SC_PAGE_SIZE")
REPO_ROOT = Path(__file__).resolve().parents[2]
SIGSEGV_RC = -signal.SIGSEGV


def host_backend(granularity: int = OS_PAGE, capacity_granules: int = 64, cache_capacity: int | None = None):
    """A HostBackend of tiny pages (one OS page by default) and a small pool, so that the rare
    transitions (pool full, cache full) happen after a handful of steps."""
    backend = core.HostBackend(granularity=granularity, capacity_bytes=granularity * capacity_granules)
    if cache_capacity is not None:
        backend.set_handle_cache_capacity(cache_capacity)
    return backend


def read(address: int, n: int) -> bytes:
    return ctypes.string_at(address, n)


def fill(address: int, byte: int, n: int) -> None:
    ctypes.memset(address, byte, n)


def pool_bytes(backend) -> int:
    """Bytes of real memory the host backend's pool memfd holds now (st_blocks, 512-byte units)."""
    return os.fstat(backend.pool_fd).st_blocks * 512


def live_state(backend, *tables) -> dict:
    """What a failed call must leave as it was: live memory, cache contents, mapped page ids.
    (num_creates / num_releases / num_cache_hits are cumulative and may record the attempt.)"""
    stats = backend.stats()
    state = {key: stats[key] for key in ("physical_bytes", "cached_bytes", "cached_handles")}
    state["live_handles"] = stats["num_creates"] - stats["num_releases"]
    for i, table in enumerate(tables):
        table.check_invariants()
        state[f"table{i}"] = (table.mapped_page_ids(), table.num_mapped, table.mapped_bytes)
    return state


def run_child(code: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter that imports this checkout's kvcached; never raises on the
    child's exit status (tests assert on returncode / stdout)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=str(REPO_ROOT),
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_segfaults_after(result: subprocess.CompletedProcess, marker: str = "ok") -> None:
    """The child printed `marker` (so everything before the faulting access worked) and then died
    of SIGSEGV without printing 'survived'."""
    detail = f"rc={result.returncode}\nstdout={result.stdout!r}\nstderr={result.stderr[-2000:]}"
    assert marker in result.stdout.split(), detail
    assert "survived" not in result.stdout, detail
    assert result.returncode == SIGSEGV_RC, detail


def proc_maps_has(address: int) -> bool:
    """True while some mapping of this process covers `address` (reserved or mapped)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def cuda_reason() -> str | None:
    return core.cuda_unavailable_reason()
