"""Smoke run of bench_gemm.py --quick (CI): every projection of both arrangements and the step
sums are reported, the fused step counting the same weight bytes as the separate one."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench_gemm.py"


def test_bench_gemm_quick(tmp_path):
    out = tmp_path / "gemm.json"
    subprocess.run([sys.executable, str(BENCH), "--quick", "--m", "4,8", "--reps", "2", "--json", str(out)],
                   check=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    for m in (4, 8):
        names = {r["gemm"] for r in rows if r["m"] == m}
        assert names == {"q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up", "lm_head", "step, separate",
                         "step, fused"}, names
        steps = {r["gemm"]: r for r in rows if r["m"] == m and r["gemm"].startswith("step")}
        separate, fused = steps["step, separate"], steps["step, fused"]
        # equal bytes: GB/s x seconds agree
        assert abs(separate["gb_per_s"] * separate["us"] - fused["gb_per_s"] * fused["us"]) \
            <= 1e-6 * separate["gb_per_s"] * separate["us"], steps
    qkv = next(r for r in rows if r["gemm"] == "qkv")
    q, k = (next(r for r in rows if r["gemm"] == name) for name in ("q", "k"))
    assert qkv["out"] == q["out"] + 2 * k["out"] and qkv["in"] == q["in"], (qkv, q, k)
