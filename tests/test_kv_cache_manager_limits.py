"""KVCacheManager at the edges of its integer and memory ranges, on the host backend: counts past
int32 and int64 through alloc / try_to_reserve, and a num_blocks whose allocator bookkeeping does
not fit in the host memory the process may use."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached import KVCacheManager, init_kvcached
from kvcached.errors import KVCachedArgumentError

from _stacks import KV_PAGE_BYTES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("layout", ["interleaved", "page_grouped"])
def test_huge_counts_are_none_through_the_manager(kv_env, layout):
    kv_env(LAYOUT=layout, MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=2)
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
    m = KVCacheManager(64, 16, 2 * 32 * 2, 2)
    live = m.alloc(5)

    @settings(max_examples=40, deadline=None)
    @given(n=st.one_of(st.sampled_from([2**31, 2**63, 2**64 + 1]), st.integers(min_value=2**31, max_value=2**70)),
           as_numpy=st.booleans())
    def check(n, as_numpy):
        arg = np.uint64(n) if as_numpy and n < 2**64 else n
        before = (m._blocks.block_states().tolist(), m.available_size(), m.get_mapped_memory_size())
        assert m.alloc(arg) is None
        assert m.try_to_reserve(arg) is False
        assert (m._blocks.block_states().tolist(), m.available_size(), m.get_mapped_memory_size()) == before
        with pytest.raises(ValueError, match=rf"alloc\(n=-{n}\)"):
            m.alloc(-n)
        with pytest.raises(KVCachedArgumentError):
            m.try_to_reserve(-n)

    check()
    m.free(live)
    m.check_invariants()
    m.close()


_HUGE_MANAGER = """
import json, os, resource, sys, time
os.environ["KVCACHED_TRACKER"] = "0"
from kvcached import KVCacheManager, init_kvcached

def vm_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()

init_kvcached(device="cpu", page_size_bytes=2 << 20)
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (6 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
try:
    KVCacheManager(10**9, 1, 1, 1, num_kv_buffers=1)
    out = {"error": None}
except Exception as exc:
    out = {"error": type(exc).__name__, "message": str(exc), "s": time.perf_counter() - t0,
           "rss_growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0}
# a failed constructor leaves nothing behind: the group takes a manager that fits
m = KVCacheManager(1000, 1, 1, 1, num_kv_buffers=1)
out["after"] = m.alloc(3) is not None
m.close()
print(json.dumps(out))
"""


def test_num_blocks_beyond_host_memory_is_refused_with_the_figures():
    # 10**9 one-byte blocks: ~9 GB of allocator bookkeeping, in a process that may map 6 GiB more
    # (it was killed by the OOM killer, or raised numpy's MemoryError under a cap)
    env = {**os.environ, "PYTHONPATH": REPO, "KVCACHED_DEBUG_CHECKS": "0"}
    proc = subprocess.run([sys.executable, "-c", _HUGE_MANAGER], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] == "KVCachedConfigError", out
    assert "1000000000 blocks" in out["message"] and "num_blocks" in out["message"], out
    assert re.search(r"need \d+ bytes \(.* GiB\) of host memory .* bytes are left under the RLIMIT_AS limit",
                     out["message"]), out
    assert out["s"] < 10 and out["rss_growth"] < 64 << 20, out
    assert out["after"], out
