"""Tests of kvcached.shm.segment and kvcached.shm.client: the format, the reader's seqlock, limit
requests, delete and gc, over real segments under /dev/shm and real processes, no mocks."""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _procs import Proc, poke_segment, unique_name
from kvcached.errors import KVCachedConfigError, KVCachedError
from kvcached.limits import I64_MAX, NO_LIMIT
from kvcached.shm import segment as seg
from kvcached.shm.client import gc_segments, list_segments, read_segment, request_limit
from kvcached.shm.owner import MemInfoTracker

pytestmark = pytest.mark.usefixtures("shm_clean")


def test_docstring_table_matches_layout():
    rows = re.findall(r"^(\d+)\s+(char\[\d*\]|byte\[\]|u32|[iu]64)\s+(\w+|\(reserved\))\s",
                      seg.__doc__, re.MULTILINE)
    documented = {field: int(offset) for offset, _, field in rows if field != "(reserved)"}
    assert documented == seg.OFFSETS
    assert seg.LAYOUT.size == seg.SEGMENT_BYTES


def test_reader_never_sees_a_torn_publish():
    """A writer process publishes used = reserved = k as fast as it can; every snapshot read
    meanwhile that claims to be consistent must show equal values, rising. (A reader may give up
    and say so, consistent=False, when the writer is inside on every attempt: on a loaded machine
    a writer spinning flat out can starve it. That is liveness, not a torn read.)"""
    name = unique_name("seqlock")
    with Proc("writer", name, "1.5") as writer:
        last, distinct = -1, set()
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:
            snap = read_segment(name)
            if not snap.consistent:
                continue
            assert snap.used_bytes == snap.reserved_bytes, snap
            assert snap.used_bytes >= last
            assert snap.usage_seq % 2 == 0
            last = snap.used_bytes
            distinct.add(last)
        status, out, _ = writer.finish()
    assert status == 0 and int(out.strip()) > 0
    assert len(distinct) > 10  # the reader really ran against a moving writer


def test_sigkilled_owner_is_stale_and_collected():
    name = unique_name("kill")
    with Proc("hold", name) as holder:
        assert read_segment(name).alive
        holder.kill(signal.SIGKILL)
        snap = read_segment(name)
    assert (snap.alive, snap.stale) == (False, True)
    assert name in {s.name for s in list_segments() if s.stale}
    assert gc_segments().removed.get(name, "owner dead") == "owner dead"  # (or a concurrent gc took it)
    with pytest.raises(KVCachedError, match="no kvcached instance named"):
        read_segment(name)


def test_gc_keeps_live_segments(tracker):
    assert tracker.name not in gc_segments().removed
    assert read_segment(tracker.name).alive


def test_request_validation(tracker):
    with pytest.raises(KVCachedConfigError, match="limit_bytes=-2"):
        request_limit(tracker.name, -2)
    with pytest.raises(KVCachedConfigError, match="revision=-2"):
        request_limit(tracker.name, 0, revision=-2)
    with pytest.raises(KVCachedError, match="no kvcached instance named"):
        request_limit(unique_name("missing"), 0)
    assert read_segment(tracker.name).request_seq == 0


# -- values a segment cannot hold, and requests no operator can make --------------------------

@pytest.fixture(scope="module")
def shared_tracker():
    t = MemInfoTracker(unique_name("shared"))
    yield t
    t.close()


def _request_block(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    return raw[seg.OFFSETS["request_seq"]:seg.OFFSETS["request_ns"] + 8]


_INTS = st.one_of(st.integers(-(1 << 70), 1 << 70), st.sampled_from(
    [-2, -1, 0, I64_MAX, I64_MAX + 1, 1 << 63, 99999999999999999999]))


@settings(max_examples=150, deadline=None)
@given(limit=st.one_of(_INTS, st.sampled_from([True, 1.5, float("nan"), float("inf"), "1",
                                                np.int64(7), np.uint64(1 << 63)])),
       revision=st.one_of(st.none(), _INTS, st.sampled_from([False, 2.0, np.int32(3)])))
def test_request_limit_writes_only_what_a_segment_holds(shared_tracker, limit, revision):
    """A request within [NO_LIMIT, I64_MAX] x [0, I64_MAX] is written whole; anything else is
    refused with KVCachedConfigError naming the value, and the request block is untouched (the
    sequence even)."""
    path = shared_tracker.path
    before = _request_block(path)
    valid_limit = (not isinstance(limit, (bool, float, str))
                   and NO_LIMIT <= int(limit) <= I64_MAX)
    valid_revision = revision is None or (not isinstance(revision, (bool, float))
                                          and 0 <= int(revision) <= I64_MAX)
    last = read_segment(shared_tracker.name)
    if valid_limit and valid_revision and revision is None and max(
            last.limit_revision, last.request_revision) == I64_MAX:
        with pytest.raises(KVCachedError, match="no next revision"):
            request_limit(shared_tracker.name, limit, revision)
        assert _request_block(path) == before
        return
    if valid_limit and valid_revision:
        request = request_limit(shared_tracker.name, limit, revision)
        snap = read_segment(shared_tracker.name)
        assert (snap.request_limit_bytes, snap.request_seq) == (int(limit), request.request_seq)
        assert snap.request_seq % 2 == 0
        return
    with pytest.raises(KVCachedConfigError, match="limit_bytes=|revision=") as info:
        request_limit(shared_tracker.name, limit, revision)
    assert repr(limit if not valid_limit else revision) in str(info.value)
    assert _request_block(path) == before


def test_no_revision_past_the_largest(tracker):
    poke_segment(tracker.path, "limit_revision", I64_MAX)
    before = _request_block(tracker.path)
    with pytest.raises(KVCachedError, match="no next revision"):
        request_limit(tracker.name, 1 << 20)
    assert _request_block(tracker.path) == before


def test_gc_removes_files_that_are_not_segments():
    short, foreign = (seg.segment_path(unique_name(tag)) for tag in ("short", "foreign"))
    with open(short, "wb") as f:
        f.write(b"KVCT")
    with open(foreign, "wb") as f:
        f.write(b"\x1b]0;pwned\x07".ljust(seg.SEGMENT_BYTES, b"\0"))
    removed = gc_segments().removed
    for path in (short, foreign):  # removed by this gc (or by a concurrent test's)
        assert not os.path.exists(path)
        assert removed.get(os.path.basename(path)[len(seg.SEGMENT_PREFIX):],
                           "not a valid segment") == "not a valid segment"
