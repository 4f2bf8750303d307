"""Shared fixtures over the allocator stacks of tests/_stacks.py."""

from __future__ import annotations

import pytest

from _stacks import GRANULARITY, Stack, make_stack
from kvcached._core import HostBackend


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
def host_backend() -> HostBackend:
    """A host backend of 64 KiB granules with room for 16 of them (small enough to run out)."""
    return HostBackend(GRANULARITY, 16 * GRANULARITY)
