"""Smoke run of bench_share_change.py (CI): two real processes under a fair budget on the host
backend, two rounds. Checks what it reports and that the order of events holds, never how fast."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached import core

BENCH = Path(__file__).resolve().parent / "bench_share_change.py"


def test_bench_share_change_two_rounds(tmp_path):
    out = tmp_path / "change.json"
    subprocess.run([sys.executable, str(BENCH), "--rounds", "2", "--json", str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["rounds"] == 2 and result["share_interval_ms"] > 0
    for kind in ("cap", "freed", "mapped"):
        assert 0 <= result[kind]["p50_ms"] <= result[kind]["p99_ms"] <= result[kind]["max_ms"], result
    assert result["cap"]["max_ms"] <= result["freed"]["max_ms"], result      # A frees once capped


@pytest.mark.gpu
@pytest.mark.skipif(core.cuda_unavailable_reason() is not None,
                    reason="CUDA is not usable here (kvcached.core.cuda_unavailable_reason())")
def test_bench_share_change_over_device_memory(tmp_path):
    """The same over CUDA's 2 MiB pages (its cache was once one page: A could never fill the budget)."""
    out = tmp_path / "change.json"
    subprocess.run([sys.executable, str(BENCH), "--device", "cuda", "--rounds", "2", "--json", str(out)], check=True,
                   timeout=300)
    assert json.loads(out.read_text())["rounds"] == 2
