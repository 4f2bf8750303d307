"""Smoke run of bench_share_change.py (CI): two real processes under a fair budget on the host
backend, two rounds. Checks what it reports and that the order of events holds, never how fast."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench_share_change.py"


def test_bench_share_change_two_rounds(tmp_path):
    out = tmp_path / "change.json"
    subprocess.run([sys.executable, str(BENCH), "--rounds", "2", "--json", str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["rounds"] == 2 and result["share_interval_ms"] > 0
    for kind in ("cap", "freed", "mapped"):
        assert 0 <= result[kind]["p50_ms"] <= result[kind]["p99_ms"] <= result[kind]["max_ms"], result
    assert result["cap"]["max_ms"] <= result["freed"]["max_ms"], result      # A frees once capped
