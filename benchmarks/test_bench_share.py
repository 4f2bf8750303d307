"""Smoke run of bench_share.py --quick (CI): three real processes of a tiny model under one budget,
two setups, each trace run twice. Checks what it reports, never how fast."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "bench_share.py"
sys.path.insert(0, str(BENCH.parent))

import bench_share  # noqa: E402


def test_arrivals_fall_in_each_models_on_phase():
    """The trace: seeded (the same every call), sorted, and every arrival of model m inside one
    of its "on" phases, which start m/3 of a period after model 0's."""
    setup = bench_share.Setup(device="cpu", preset="tiny", dtype="float32", seconds=40.0, period=6.0, on=0.5,
                              rate=20.0, budget=1 << 20, prompt=4, new=4, max_running=8, max_batch_tokens=64,
                              page_bytes=None, threads=1, sample_s=0.01, seed=3)
    trace = bench_share.arrival_trace(setup)
    assert trace == bench_share.arrival_trace(setup) and len(trace) == bench_share.MODELS
    for m, times in enumerate(trace):
        assert times == sorted(times) and len(times) > 100
        for t in times:
            within = (t - m * setup.period / bench_share.MODELS) % setup.period
            assert 0 <= t < setup.seconds and within < setup.on * setup.period, (m, t)


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
