"""Smoke run of bench_share.py --quick (CI): three real processes of a tiny model under one budget,
two setups, each trace run twice. Checks what it reports, never how fast."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "bench_share.py"


@pytest.mark.slow
def test_bench_share_quick_repeated(tmp_path):
    out = tmp_path / "share.json"
    subprocess.run([sys.executable, str(BENCH), "--quick", "--seconds", "1.5", "--setups", "first_come,fair",
                    "--repeats", "2", "--json", str(out)], check=True, timeout=600)
    result = json.loads(out.read_text())
    arrivals = [len(times) for times in result["trace"]]
    assert [res["setup"] for res in result["results"]] == ["first_come", "fair"]
    for res in result["results"]:
        for row, arrived in zip(res["rows"], arrivals):
            assert row["runs"] == 2 and row["arrived"] == row["finished"] == 2 * arrived, row
            assert len(row["ttft_p99_ms_per_run"]) == 2
            assert row["ttft_p50_ms"] <= row["ttft_p99_ms"]
            assert 0 <= row["swapped_out"] <= row["preemptions"]
        for model, requests in res["requests"].items():
            assert sorted({q["run"] for q in requests}) == [0, 1]
            assert all(q["arrival"] <= q["first"] <= q["finish"] for q in requests)
        caps = [c for samples in res["caps"].values() for _, c in samples]
        assert res["setup"] == "fair" or all(c is None for c in caps)     # first come never caps
