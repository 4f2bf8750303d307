"""``python -m kvcached.demo`` end to end: two real instance processes serving tiny models under a
real global budget, as a new user runs it (``--quick``, host backend)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}
DEMO_TIMEOUT_S = 300            # two model builds and 10 s of phases on a loaded 2-core machine
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.slow


def _demo(tmp_path, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvcached.demo", "--quick", "--device", "cpu", "--out",
            str(tmp_path / "memory.png"), *args]


def _phase_values(record: dict, phase: int, instance: int, field: str = "mapped_bytes") -> list[int]:
    span = record["phases"][phase]
    return [s["instances"][instance][field] for s in record["samples"]
            if span["start_s"] <= s["t_s"] < span["end_s"]]


def _leftovers(record: dict) -> list[str]:
    paths = [f"/dev/shm/kvcached.{i['ipc_name']}" for i in record["instances"]]
    paths.append(f"/dev/shm/kvcached-budget.{record['budget']['name']}")
    return [p for p in paths if os.path.exists(p)]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One run of the demo: (completed process, record read from the JSON beside the PNG)."""
    tmp_path = tmp_path_factory.mktemp("demo")
    done = subprocess.run(_demo(tmp_path), check=False, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=DEMO_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "memory.json") as f:
        record = json.load(f)
    return done, record, tmp_path / "memory.png"


def test_the_demo_writes_a_png_and_says_where(quick_run):
    from PIL import Image

    done, _, png = quick_run
    with open(png, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    with Image.open(png) as image:
        image.verify()                       # a complete, uncorrupted PNG
    with Image.open(png) as image:
        assert image.width >= 800 and image.height >= 500
    assert str(png) in done.stdout


def test_the_output_reports_both_instances_serving(quick_run):
    done, record, _ = quick_run
    names = [i["name"] for i in record["instances"]]
    assert names == ["llama", "qwen2"]
    final = record["samples"][-1]["instances"]
    for name, last in zip(names, final):
        assert f"{name}: {last['generated_tokens']} tokens generated, {last['preemptions']} preemptions" in done.stdout
        assert last["generated_tokens"] > 0
    for name in names:                       # the live view's lines (stdout is not a terminal)
        assert any(name in line and "tok/s" in line and "preempted" in line for line in done.stdout.splitlines())
    # The budget binds: some request somewhere was preempted for lack of memory.
    assert sum(last["preemptions"] for last in final) > 0


def test_memory_follows_the_load_under_the_budget(quick_run):
    _, record, _ = quick_run
    budget = record["budget"]["bytes"]
    held = [s["held_bytes"] for s in record["samples"]]
    assert max(held) <= budget                # the budget is never exceeded ...
    assert max(held) >= 0.8 * budget          # ... and it is what limits the instances
    labels = [p["label"] for p in record["phases"]]
    assert labels == ["llama busy", "both busy", "qwen2 busy", "llama busy again"]
    llama, qwen2 = 0, 1
    # Each instance maps more while its clients are on it than after they moved to the other.
    assert max(_phase_values(record, 0, llama)) > min(_phase_values(record, 2, llama))
    assert max(_phase_values(record, 2, qwen2)) > min(_phase_values(record, 0, qwen2))
    assert max(_phase_values(record, 2, qwen2)) > min(_phase_values(record, 3, qwen2))
    assert max(_phase_values(record, 3, llama)) > min(_phase_values(record, 2, llama))
    # The busy instance takes most of the budget.
    assert max(_phase_values(record, 0, llama)) >= 0.6 * budget
    assert max(_phase_values(record, 2, qwen2)) >= 0.6 * budget


def test_the_demo_leaves_nothing_behind(quick_run):
    _, record, _ = quick_run
    assert _leftovers(record) == []
    for instance in record["instances"]:
        assert not os.path.exists(f"/proc/{instance['pid']}") or _zombie_or_other(instance["pid"])


def _remove_leftovers(output: str) -> None:
    """Remove what a demo killed by SIGKILL left: its budget and its instances' segments."""
    from kvcached.budget import delete_budget
    from kvcached.errors import KVCachedError
    from kvcached.mem_info_tracker import delete_segment

    match = re.search(r"global budget (demo-\S+) ", output)
    if match is None:
        return
    for remove, name in ((delete_budget, match.group(1)), (delete_segment, f"{match.group(1)}-llama"),
                         (delete_segment, f"{match.group(1)}-qwen2")):
        try:
            remove(name)                        # refuses a live owner
        except KVCachedError:
            pass


def _zombie_or_other(pid: int) -> bool:
    """True if /proc/pid is not a live kvcached demo instance (a reused pid, or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z" or b"multiprocessing" not in cmdline


def _read_until(proc: subprocess.Popen, text: str, timeout_s: float, seen: list[str]) -> str:
    """stdout of ``proc`` up to and including the first line containing ``text`` (each line read is
    also appended to ``seen``)."""
    start = len(seen)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen[start:])
    raise AssertionError(f"{text!r} not in the output within {timeout_s} s:\n" + "".join(seen[start:]))


def test_hold_keeps_the_instances_until_ctrl_c(tmp_path):
    proc = subprocess.Popen(_demo(tmp_path, "--hold"), cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        output = _read_until(proc, "until Ctrl-C", DEMO_TIMEOUT_S, seen)
        output += _read_until(proc, "kvtop", 10, seen)
        assert "kvctl list" in output
        with open(tmp_path / "memory.json") as f:
            record = json.load(f)               # written before holding
        names = {i["ipc_name"] for i in record["instances"]}
        listed = subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", "list", "--json"], check=True, env=ENV,
                                capture_output=True, text=True, timeout=60)
        alive = {entry["name"] for entry in json.loads(listed.stdout) if entry["state"] == "alive"}
        assert names <= alive, output
        budget = subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", "budget", record["budget"]["name"]],
                                check=True, env=ENV, capture_output=True, text=True, timeout=60)
        assert "2 holder(s)" in budget.stdout, budget.stdout + budget.stderr
        os.killpg(proc.pid, signal.SIGINT)      # Ctrl-C reaches the whole process group
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:                 # the test failed: take the demo and its instances down
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            _remove_leftovers("".join(seen))
    assert proc.returncode == 130, output + rest
    assert "interrupted" in rest
    assert _leftovers(record) == []
