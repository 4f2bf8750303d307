"""Smoke run of bench_tp.py (CI): TP=1 and TP=2 on the host backend, one layout, a few repeats.

Checks what the benchmark reports, never how fast: every figure is there, and the pool served
the alloc/free cycle: a cycle through the pool sends no message. A free that finds the pool
topped up to its maximum by the refill thread meanwhile unmaps its page on the calling thread,
one round to the peers; under a parallel test load that was 2 rounds in 2000 cycles, so the
check allows a few, where a cycle that missed the pool would send at least one each.
"""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench_tp.py"


def test_bench_tp_quick(tmp_path):
    out = tmp_path / "tp.json"
    subprocess.run([sys.executable, str(BENCH), "--quick", "--repeats", "5", "--tp", "1", "2", "--layouts",
                    "interleaved", "--json", str(out)], check=True, timeout=600)
    results = json.loads(out.read_text())["results"]
    for tp in ("1", "2"):
        row = results[tp]["interleaved"]
        assert set(row) == {"map_us", "unmap_us", "alloc_free_pool_off_us", "alloc16_free_pool_on_us",
                            "messages_per_pool_cycle"} | ({"round_trip_us"} if tp == "2" else set()), row
        assert row["messages_per_pool_cycle"] < 0.05, row
