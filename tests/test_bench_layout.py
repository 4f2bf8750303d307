"""benchmarks/bench_layout.py runs end to end on the CPU (torch path, host backend, tiny sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_layout.py"


def test_bench_layout_cpu_smoke(tmp_path):
    out = tmp_path / "layout.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--layers", "2", "--seqs", "3",
                           "--tokens", "40", "--reps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = {row["cache"]: row for row in result["rows"]}
    assert set(rows) == {"per_layer", "interleaved", "page_grouped", "plain"}
    for name, row in rows.items():
        assert row["step_ms"] > 0 and row["read_gbps"] > 0 and row["layers"] == 2 and row["seqs"] == 3
        assert ("map_us_per_page_id" in row) == (name != "plain")
        assert row["vs_plain_pct"] is not None
    assert "page_grouped" in done.stdout and result["copy_gbps"] > 0
