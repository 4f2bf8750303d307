"""``python -m kvcached.demo`` end to end: two real instance processes serving tiny models under a
real global budget, as a new user runs it (host backend). The fast lane runs it once with phases
of 1 s (what it writes, says and leaves behind); the slow tests run ``--quick`` (memory following
the load) and ``--hold``. Starting the instances (torch, transformers, two models) takes most of
a run."""

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
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached.demo.__main__ import DEFAULT_OUT, png_path
from kvcached.demo.figures import describe, phase_figures
from kvcached.demo.run import TokenRates

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO}
DEMO_TIMEOUT_S = 300            # two model builds and 10 s of phases on a loaded 2-core machine
SHORT_PHASE_S = 1.0             # the demo's shortest phases (--phase-seconds)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# The live view's line per instance (stdout is not a terminal): tokens so far and tokens/s.
VIEW_ROW = re.compile(r"(\w+): [0-9.]+ MiB mapped, \d+ running, \d+ waiting, \d+ preempted, (\d+) tokens "
                      r"\((\d+) tok/s\)")
VIEW_TIME = re.compile(r"^\[\s*([0-9.]+) s\] ")


def _demo(out, *args: str) -> list[str]:
    """The demo on the host backend, --quick unless `args` sets the phases."""
    quick = [] if "--phase-seconds" in args else ["--quick"]
    return [sys.executable, "-m", "kvcached.demo", *quick, "--device", "cpu", "--out", str(out), *args]


def _phase_values(record: dict, phase: int, instance: int, field: str = "mapped_bytes") -> list[int]:
    span = record["phases"][phase]
    return [s["instances"][instance][field] for s in record["samples"]
            if span["start_s"] <= s["t_s"] < span["end_s"]]


def _leftovers(record: dict) -> list[str]:
    paths = [f"/dev/shm/kvcached.{i['ipc_name']}" for i in record["instances"]]
    paths.append(f"/dev/shm/kvcached-budget.{record['budget']['name']}")
    return [p for p in paths if os.path.exists(p)]


def _run_demo(tmp_path_factory, *args: str):
    """One run of the demo with ``--out memory`` (no .png: the PNG is memory.png): (completed
    process, record read from the JSON beside the PNG, the PNG's path)."""
    tmp_path = tmp_path_factory.mktemp("demo")
    done = subprocess.run(_demo(tmp_path / "memory", *args), check=False, cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "memory.json") as f:
        record = json.load(f)
    return done, record, tmp_path / "memory.png"


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """A run with the shortest phases: what the demo writes, prints and leaves behind."""
    return _run_demo(tmp_path_factory, "--phase-seconds", str(SHORT_PHASE_S))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """A ``--quick`` run: phases long enough for the memory to follow the load."""
    return _run_demo(tmp_path_factory)


def test_the_demo_writes_a_png_and_says_where(short_run):
    from PIL import Image

    done, _, png = short_run
    with open(png, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    with Image.open(png) as image:
        image.verify()                       # a complete, uncorrupted PNG
    with Image.open(png) as image:
        assert image.width >= 800 and image.height >= 500
    assert f"memory per instance over time: {png} (samples: {png.with_suffix('.json')})" in done.stdout
    assert not png.with_suffix("").exists()


def test_the_output_reports_both_instances_serving(short_run):
    done, record, _ = short_run
    names = [i["name"] for i in record["instances"]]
    assert names == ["llama", "qwen2"]
    final = record["samples"][-1]["instances"]
    for name, last in zip(names, final):
        assert f"{name}: {last['generated_tokens']} tokens generated, {last['preemptions']} preemptions" in done.stdout
        assert last["generated_tokens"] > 0
    for name in names:                       # the live view's lines (stdout is not a terminal)
        assert any(name in line and "tok/s" in line and "preempted" in line for line in done.stdout.splitlines())
    for line in describe(record):            # the sharing figures, one line per phase
        assert line in done.stdout


def _record(phases, samples, budget=1000):
    return {"budget": {"bytes": budget}, "instances": [{"name": "a"}, {"name": "b"}],
            "phases": [{"label": label, "share": share, "start_s": start, "end_s": end}
                       for label, share, start, end in phases],
            "samples": [{"t_s": t, "instances": [{"mapped_bytes": a}, {"mapped_bytes": b}]} for t, a, b in samples]}


def test_phase_figures_settled_parts_and_time_to_a_quarter():
    """b joins in the second phase: its time to 25 % of the budget counts from that phase's
    start; the parts held are the means over each phase's second half only."""
    record = _record([("a busy", [1.0, 0.0], 0.0, 4.0), ("both", [0.5, 0.5], 4.0, 8.0)],
                     [(0.5, 100, 0), (2.0, 900, 0), (3.0, 1000, 0), (4.5, 900, 100), (5.25, 700, 250),
                      (6.0, 500, 500), (7.0, 400, 600)])
    first, second = phase_figures(record)
    assert first["held"] == [0.95, 0.0] and first["newly_loaded"] == [True, False]
    assert first["reached_s"] == [2.0, None]
    assert second["held"] == [0.45, 0.55] and second["newly_loaded"] == [False, True]
    assert second["reached_s"] == [None, 1.25]
    assert describe(record)[1] == "both: budget held over the second half: a 45%, b 55% (newly loaded, held 25% after 1.25 s)"


def test_phase_figures_say_when_a_new_load_never_got_a_quarter():
    record = _record([("a busy", [1.0, 0.0], 0.0, 2.0), ("b busy", [0.0, 1.0], 2.0, 4.0)],
                     [(0.5, 1000, 0), (1.5, 1000, 0), (2.5, 1000, 0), (3.5, 900, 100)])
    assert phase_figures(record)[1]["reached_s"] == [None, None]
    assert "b 10% (newly loaded, never held 25%)" in describe(record)[1]


@pytest.mark.slow
def test_memory_follows_the_load_under_the_budget(quick_run):
    _, record, _ = quick_run
    # The budget binds: some request somewhere was preempted for lack of memory.
    assert sum(last["preemptions"] for last in record["samples"][-1]["instances"]) > 0
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


def test_the_demo_leaves_nothing_behind(short_run):
    _, record, _ = short_run
    assert _leftovers(record) == []
    for instance in record["instances"]:
        assert not os.path.exists(f"/proc/{instance['pid']}") or _zombie_or_other(instance["pid"])


def _remove_leftovers(output: str) -> None:
    """Remove what a demo killed by SIGKILL left: its budget and its instances' segments."""
    from kvcached.shm.budget import delete_budget
    from kvcached.errors import KVCachedError
    from kvcached.shm.client import delete_segment

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


def _read_cycles(proc: subprocess.Popen, cycles: int, timeout_s: float, seen: list[str]) -> list[str]:
    """The lines of ``cycles`` whole runs of the phases while holding: up to the start of the next."""
    lines: list[str] = []
    for _ in range(cycles + 1):
        lines += _read_until(proc, "-- phase 1/4", timeout_s, seen).splitlines()
    return lines[:-1]


def _rows(lines: list[str]) -> dict[str, list[tuple[float, int, int]]]:
    """{instance: [(t_s, tokens so far, tokens/s)]} from the live view's lines."""
    rows: dict[str, list[tuple[float, int, int]]] = {}
    for line in lines:
        clock = VIEW_TIME.match(line)
        if clock is None:
            continue
        for name, tokens, rate in VIEW_ROW.findall(line):
            rows.setdefault(name, []).append((float(clock[1]), int(tokens), int(rate)))
    return rows


def _check_rates(name: str, rows: list[tuple[float, int, int]]) -> None:
    """The rates shown while holding agree with the token counts shown. A rate spans at least the
    last second (TokenRates keeps the newest sample at least RATE_WINDOW_S old), so it is at most
    the tokens made since a line shown more than a second earlier, per second; and over the whole
    hold the rates add up to the tokens made."""
    assert len(rows) >= 10, rows
    for index, (t_s, tokens, rate) in enumerate(rows):
        earlier = [row for row in rows[:index] if row[0] <= t_s - 1.2]    # the clock is shown rounded
        if earlier:
            assert rate <= tokens - earlier[-1][1] + 0.5, (name, rows[max(0, index - 3):index + 1])
    shown = sum(rate * (t_s - before[0]) for before, (t_s, _, rate) in zip(rows, rows[1:]))
    made = rows[-1][1] - rows[0][1]
    assert made > 0 and 0.6 * made <= shown <= 1.5 * made, (name, shown, made, rows)


@pytest.mark.slow
def test_hold_keeps_the_instances_until_ctrl_c(tmp_path):
    """Two runs of the phases while holding, with ``--out`` naming a directory (the PNG goes
    inside it): the instances serve on, the tokens/s shown agree with the tokens made across the
    restarts of the phase clock, and Ctrl-C stops everything."""
    out_dir = tmp_path / "plots"
    out_dir.mkdir()
    png = out_dir / DEFAULT_OUT
    proc = subprocess.Popen(_demo(out_dir, "--hold"), cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        output = _read_until(proc, "until Ctrl-C", DEMO_TIMEOUT_S, seen)
        assert f"memory per instance over time: {png} (samples: {png.with_suffix('.json')})" in output
        output += _read_until(proc, "kvtop", 10, seen)
        assert "kvctl list" in output
        with open(png.with_suffix(".json")) as f:
            record = json.load(f)               # written before holding
        names = {i["ipc_name"] for i in record["instances"]}
        listed = subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", "list", "--json"], check=True, env=ENV,
                                capture_output=True, text=True, timeout=60)
        alive = {entry["name"] for entry in json.loads(listed.stdout) if entry["state"] == "alive"}
        assert names <= alive, output
        budget = subprocess.run([sys.executable, "-m", "kvcached.cli.kvctl", "budget", record["budget"]["name"]],
                                check=True, env=ENV, capture_output=True, text=True, timeout=60)
        assert "2 holder(s)" in budget.stdout, budget.stdout + budget.stderr
        held = _read_cycles(proc, 2, DEMO_TIMEOUT_S, seen)
        for name, rows in _rows(held).items():
            _check_rates(name, rows)
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


# -- the rates: one monotonic clock across the runs of the phases -----------------------------------

def test_rates_stay_true_across_a_restart_of_the_phase_clock():
    """The demo's first run of the phases, then --hold running them again: the phase clock
    restarts at 0, the monotonic one goes on. Two instances making 100 and 40 tokens/s show 100
    and 40 all along, with no zero while tokens climb and no spike at the restart."""
    rates = TokenRates(window_s=1.0)
    tick_s, cycle_s, mono_s = 0.2, 10.0, 1000.0
    phase_clock = [round(i * tick_s, 3) for i in range(int(cycle_s / tick_s))]
    shown = []
    for _run in range(3):                               # the first run and two cycles while holding
        for _t_s in phase_clock:
            shown.append(rates.add(mono_s, [round(100 * (mono_s - 1000.0)), round(40 * (mono_s - 1000.0))]))
            mono_s += tick_s
        mono_s += 1.3                                   # writing the PNG between the first run and the hold
    assert shown[0] == [0.0, 0.0]
    for later in shown[1:]:
        assert later == pytest.approx([100.0, 40.0], rel=1e-6)


ticks = st.lists(st.tuples(st.floats(0.0, 3.0), st.integers(0, 500), st.integers(0, 500)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(ticks=ticks, window_s=st.sampled_from([0.5, 1.0, 2.5]))
def test_rate_is_the_tokens_since_the_newest_sample_a_window_old(ticks, window_s):
    """Against the whole history: each rate is (tokens now - tokens then) / (now - then), then
    being the newest sample at least window_s old (the oldest while none is), 0 for no interval."""
    rates = TokenRates(window_s)
    history: list[tuple[float, list[int]]] = []
    now_s, tokens = 5.0, [0, 0]
    for gap_s, more_a, more_b in ticks:
        now_s += gap_s
        tokens = [tokens[0] + more_a, tokens[1] + more_b]
        got = rates.add(now_s, tokens)
        history.append((now_s, tokens))
        old = [sample for sample in history if sample[0] <= now_s - window_s]
        then_s, then_tokens = old[-1] if old else history[0]
        want = [0.0, 0.0] if now_s <= then_s else [(n - t) / (now_s - then_s) for n, t in zip(tokens, then_tokens)]
        assert got == pytest.approx(want), (now_s, history)
        assert all(rate >= 0 for rate in got)


def test_rates_refuse_a_clock_that_goes_back_and_stay_as_they_were():
    rates = TokenRates(1.0)
    rates.add(10.0, [0])
    rates.add(11.0, [50])
    with pytest.raises(ValueError, match=r"now_s=10\.5 is before the last sample's 11\.0"):
        rates.add(10.5, [60])
    with pytest.raises(ValueError, match="2 token counts, but the earlier samples have 1"):
        rates.add(12.0, [60, 1])
    assert rates.add(12.0, [150]) == [100.0]           # as if the refused calls never happened
    with pytest.raises(ValueError, match="window_s=0"):
        TokenRates(0)


# -- --out: the path the PNG really goes to -------------------------------------------------------

def test_out_without_png_gets_it_and_a_directory_gets_the_default_name_inside(tmp_path):
    assert png_path(str(tmp_path / "run1")) == str(tmp_path / "run1.png")
    assert png_path(str(tmp_path / "run.v2")) == str(tmp_path / "run.v2.png")
    assert png_path(str(tmp_path / "memory.png")) == str(tmp_path / "memory.png")
    assert png_path(str(tmp_path / "MEMORY.PNG")) == str(tmp_path / "MEMORY.PNG")
    assert png_path(str(tmp_path)) == str(tmp_path / DEFAULT_OUT)
    assert png_path(str(tmp_path) + "/") == str(tmp_path / DEFAULT_OUT)


def test_out_that_cannot_be_written_is_refused_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist; create it or pick another path"):
        png_path(str(tmp_path / "missing" / "memory.png"))
    (tmp_path / "taken.png").mkdir()                    # the PNG would replace a directory
    with pytest.raises(ValueError, match=r"taken\.png is a directory; name a file"):
        png_path(str(tmp_path / "taken"))
    (tmp_path / "data.json").mkdir()                    # so would the JSON beside it
    with pytest.raises(ValueError, match=r"data\.json is a directory"):
        png_path(str(tmp_path / "data.png"))


def test_the_command_line_refuses_a_bad_out_before_starting_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvcached.demo", "--device", "cpu", "--out",
                           str(tmp_path / "missing" / "x")], check=False, cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "does not exist; create it or pick another path" in done.stderr, done.stderr
    assert done.stdout == ""
