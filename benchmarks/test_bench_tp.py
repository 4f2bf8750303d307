"""Smoke run of bench_tp.py (CI): TP=1, and TP=2 over both transports, on the host backend, one
layout, a few repeats.

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
    assert set(results) == {"1", "2 shm", "2 gloo"}, results
    for run, row in ((run, results[run]["interleaved"]) for run in results):
        peers = {"round_trip_us", "round_trip_p99_us", "transport"} if run != "1" else set()
        assert set(row) == {"map_us", "unmap_us", "alloc_free_pool_off_us", "alloc16_free_pool_on_us",
                            "messages_per_pool_cycle"} | peers, row
        assert run == "1" or row["transport"] == run.split()[1], row     # each ran over the transport named
        assert row["messages_per_pool_cycle"] < 0.05, row
