"""Shared fixtures over the allocator stacks of tests/_stacks.py."""

from __future__ import annotations

import pytest

from _stacks import GRANULARITY, Stack, make_stack
from kvcached.core import HostBackend


@pytest.fixture
def stack_factory():
    """make_stack(...) whose background threads are stopped at teardown."""
    made: list[Stack] = []

    def factory(**kwargs) -> Stack:
        s = make_stack(**kwargs)
        made.append(s)
        return s

    yield factory
    for s in made:
        s.close()


@pytest.fixture
def budget_name():
    """A global budget's name no other test uses; the budget is deleted afterwards if it was made."""
    from _procs import unique_name
    from kvcached.errors import KVCachedError
    from kvcached.shm.budget import delete_budget

    name = unique_name("budget")
    yield name
    try:
        delete_budget(name, force=True)
    except KVCachedError:
        pass


@pytest.fixture
def host_backend() -> HostBackend:
    """A host backend of 64 KiB granules with room for 16 of them (small enough to run out)."""
    return HostBackend(GRANULARITY, 16 * GRANULARITY)


# -- no shared-memory file left behind ------------------------------------------------------

def _shm_files_of_this_run() -> set[str]:
    """/dev/shm files named by _procs.unique_name (``test-<tag>-<pid>-<hex>``) or default segment
    names (``kvcached_<pid>_<n>``) of this test process: the ones its tests made, whoever runs
    beside it."""
    import os
    import re

    pid = os.getpid()
    ours = re.compile(rf"-{pid}-[0-9a-f]{{8}}|kvcached_{pid}_[0-9]")
    try:
        return {entry for entry in os.listdir("/dev/shm") if ours.search(entry)}
    except FileNotFoundError:
        return set()


@pytest.fixture
def tracker():
    """An instance segment of this process (kvcached.shm.owner), closed after the test."""
    from _procs import unique_name
    from kvcached.shm.owner import MemInfoTracker

    t = MemInfoTracker(unique_name("trk"), capacity_bytes=8 << 30, page_size_bytes=2 << 20)
    yield t
    t.close()


@pytest.fixture
def shm_clean():
    """Fail the test if it left a shared-memory file (segment, budget, scratch file) it made;
    remove what it left, so that one failure leaves nothing for the next run. Use it for a whole
    module with ``pytestmark = pytest.mark.usefixtures("shm_clean")``."""
    import os

    before = _shm_files_of_this_run()
    yield
    left = sorted(_shm_files_of_this_run() - before)
    for entry in left:
        try:
            os.unlink(os.path.join("/dev/shm", entry))
        except FileNotFoundError:
            pass
    assert not left, f"shared-memory files left behind in /dev/shm: {left}"


# -- the runtime-level fixture of test_kv_cache_manager / test_runtime / test_kv_cache_manager_integrity ----

def _own_segments() -> set:
    import glob
    import os

    return set(glob.glob(f"/dev/shm/kvcached.kvcached_{os.getpid()}_*"))


@pytest.fixture
def kv_env(monkeypatch):
    """Set KVCACHED_* variables for one test and reload the settings; afterwards shut kvcached
    down, restore the environment and check that no shared-memory segment of ours is left.

    Call it as ``kv_env(LAYOUT="interleaved", MIN_RESERVED_PAGES=0, ...)`` (names without the
    KVCACHED_ prefix) before init_kvcached. The tracker is off unless TRACKER=1 is passed."""
    import os

    from kvcached import config
    from kvcached.runtime import shutdown_kvcached

    shutdown_kvcached()
    for name in [n for n in os.environ if n.startswith("KVCACHED_")]:
        monkeypatch.delenv(name)
    before = _own_segments()

    def setenv(**values) -> None:
        values.setdefault("TRACKER", 0)
        for name, value in values.items():
            monkeypatch.setenv(f"KVCACHED_{name}", str(value))
        config.reload_settings()

    yield setenv
    shutdown_kvcached()
    monkeypatch.undo()
    config.reload_settings()
    left = _own_segments() - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
