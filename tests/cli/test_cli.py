"""Tests of kvctl and kvtop, run as real processes (``python -m``) against real instances."""

from __future__ import annotations

import json
import os
import signal

import pytest

from _procs import KvtopTerminal, Proc, kvctl, run_module, unique_name
from kvcached.errors import KVCachedError
from kvcached.shm import segment as seg
from kvcached.shm.budget import budget_path, delete_budget, read_budget, set_budget
from kvcached.shm.client import read_segment
from kvcached.sizes import format_bytes, parse_size

GiB, MiB = 1 << 30, 1 << 20

pytestmark = pytest.mark.usefixtures("shm_clean")


def _instance():
    """A live instance watching for limit requests: capacity 4 GiB, limit 2 GiB at revision 0,
    64 MiB used."""
    name = unique_name("cli")
    with Proc("hold", name, "--capacity", str(4 * GiB), "--limit", str(2 * GiB), "--used",
              str(64 * MiB), "--watch") as proc:
        yield name, proc


instance = pytest.fixture(_instance)
# For tests that send no limit request: one instance for the whole module.
unchanged_instance = pytest.fixture(_instance, scope="module", name="unchanged_instance")


@pytest.mark.parametrize("args", [[], ["list"], ["limit"], ["watch"], ["gc"], ["delete"],
                                  ["budget"]])
def test_kvctl_help(args):
    result = kvctl(*args, "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: kvctl")


def test_parse_size_and_format_bytes():
    assert parse_size("1.5G") == 3 * GiB // 2 and parse_size("512M") == 512 * MiB
    assert parse_size("4096") == parse_size("4K") == parse_size("4KiB") == parse_size("4kb")
    assert parse_size("10%", 1000) == 100 and parse_size("33.3%", 1000) == 333
    assert parse_size(".5K") == 512 and parse_size("0") == 0
    for text, message in (("1.5.5G", "malformed"), ("-1", "negative"), ("nan", "malformed"),
                          ("101%", "above 100%"), ("5%", "no capacity")):
        with pytest.raises(ValueError, match=message):
            parse_size(text)
    assert [format_bytes(n) for n in (-1, 0, 1023, 1024, 3 * GiB // 2)] == [
        "-", "0 B", "1023 B", "1.00 KiB", "1.50 GiB"]


def test_kvtop_help():
    result = run_module("kvcached.cli.kvtop", "--help")
    assert result.returncode == 0 and "--once" in result.stdout


@pytest.mark.parametrize("args, status, message", [
    (["limit", "no-such-instance-x", "1G"], 1, "no kvcached instance named 'no-such-instance-x'"),
    (["limit", "{name}", "12 parsecs"], 1, "size '12 parsecs' is malformed"),
    (["limit", "{name}", "-1G"], 1, "size '-1G' is negative"),
    (["limit", "{name}", "-5"], 1, "size '-5' is negative"),
    (["limit", "{name}", "150%"], 1, "above 100%"),
    (["limit", "{name}", "1G", "--revision", "-3"], 1, "--revision=-3 must be an int in [0, "),
    (["limit", "{name}", "1G", "--timeout", "-1"], 1, "--timeout -1.0 is negative"),
    (["limit", "{name}", "99999999999999999999"], 1, "above the largest limit a segment holds"),
    (["limit", "{name}", "99999999T"], 1, "above the largest limit a segment holds"),
    (["limit", "{name}", "1G", "--revision", "99999999999999999999"], 1,
     "the largest a segment holds"),
    (["limit", "bad/name", "1G"], 1, "segment name 'bad/name' is invalid"),
    (["delete", "no-such-instance-y"], 1, "no kvcached instance named 'no-such-instance-y'"),
    (["watch", "--interval", "0"], 1, "--interval 0.0 is invalid"),
    (["budget", "no-such-budget-z"], 1, "no budget named 'no-such-budget-z'"),
    (["budget", "b", "10%"], 1, "no capacity is known"),
    (["limit", "{name}", "0.5"], 1,
     "size '0.5': a size without a unit is a whole number of bytes; write 512MiB or 0.5GiB"),
    (["budget", "{name}", "1.5"], 1, "size '1.5': a size without a unit is a whole number of bytes"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    (["limit", "{name}"], 2, "required: SIZE"),
])
def test_kvctl_bad_input(unchanged_instance, args, status, message):
    name, _ = unchanged_instance
    result = kvctl(*(a.format(name=name) for a in args))
    assert result.returncode == status, result
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert read_segment(name).request_seq == 0  # nothing was sent
    assert not os.path.exists(budget_path(name))  # nor a budget created


def test_list_json_and_table(unchanged_instance):
    name, proc = unchanged_instance
    result = kvctl("list", "--json")
    assert result.returncode == 0, result.stderr
    records = {r["name"]: r for r in json.loads(result.stdout)}
    mine = records[name]
    assert (mine["pid"], mine["state"], mine["capacity_bytes"], mine["limit_bytes"],
            mine["used_bytes"]) == (proc.pid, "alive", 4 * GiB, 2 * GiB, 64 * MiB)
    table = kvctl("list").stdout.splitlines()
    assert table[0].split() == ["NAME", "PID", "STATE", "LIMIT", "USED", "RESERVED", "CAPACITY",
                                "STATUS", "REV"]
    row = next(line for line in table if line.startswith(name + " "))
    assert "alive" in row and "2.00 GiB" in row and "64.00 MiB" in row and "4.00 GiB" in row


def test_limit_shrink_regrow_restore_zero(instance):
    name, proc = instance
    """Shrink, regrow, restore the original, a percentage, 0 (deferred: 64 MiB are in use)."""
    steps = [("1G", GiB, "applied"), ("3G", 3 * GiB, "applied"), ("2G", 2 * GiB, "applied"),
             ("25%", GiB, "applied"), ("0", 0, "deferred"), ("2147483648", 2 * GiB, "applied")]
    windows = []
    for size, limit_bytes, status in steps:
        result = kvctl("limit", name, size, "--timeout", "10")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"{name}: {status} limit ")
        snap = read_segment(name)
        assert (snap.limit_bytes, snap.limit_status, snap.ack_status) == (limit_bytes, status,
                                                                          status)
        windows.append((snap.request_ns, snap.ack_ns))
    assert read_segment(name).limit_revision == len(steps)
    status, out, err = proc.finish()
    assert status == 0, err
    calls = [json.loads(line) for line in out.splitlines()]
    assert [(c["limit_bytes"], c["revision"], c["status"]) for c in calls] == [
        (limit_bytes, revision, status)
        for revision, (_, limit_bytes, status) in enumerate(steps, start=1)]
    for call, (requested_ns, acknowledged_ns) in zip(calls, windows):
        assert requested_ns <= call["t_ns"] <= acknowledged_ns  # seen after the request, once


def test_limit_stale_and_conflicting_revisions(instance):
    name, _ = instance
    assert kvctl("limit", name, "1G", "--revision", "5", "--timeout", "10").returncode == 0
    stale = kvctl("limit", name, "512M", "--revision", "4", "--timeout", "10")
    assert stale.returncode == 3 and "stale: its revision is 5" in stale.stderr
    conflict = kvctl("limit", name, "512M", "--revision", "5", "--timeout", "10")
    assert conflict.returncode == 3 and "omit --revision or pass 6" in conflict.stderr
    same = kvctl("limit", name, "1G", "--revision", "5", "--timeout", "10")
    assert same.returncode == 0
    snap = read_segment(name)
    assert (snap.limit_bytes, snap.limit_revision) == (GiB, 5)


def test_limit_json(instance):
    name, _ = instance
    result = kvctl("limit", name, "512M", "--json", "--timeout", "10")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["acknowledged"] and record["state"]["limit_bytes"] == 512 * MiB
    assert record["request"]["revision"] == record["state"]["limit_revision"] == 1


def test_limit_times_out_when_nobody_watches():
    name = unique_name("nowatch")
    with Proc("hold", name):
        result = kvctl("limit", name, "1G", "--timeout", "0.2")
        assert result.returncode == 4
        assert "did not acknowledge" in result.stderr and "stays pending" in result.stderr
        assert read_segment(name).request_limit_bytes == GiB


def test_dead_instance_list_gc_delete():
    name, live = unique_name("dead"), unique_name("live")
    with Proc("hold", live), Proc("hold", name) as doomed:
        doomed.kill(signal.SIGKILL)
        # A gc run by a concurrent test may collect the dead segment at any point from here.
        records = {r["name"]: r for r in json.loads(kvctl("list", "--json").stdout)}
        assert records.get(name, {"state": "dead"})["state"] == "dead"
        assert records[live]["state"] == "alive"
        refused = kvctl("limit", name, "1G")
        assert refused.returncode == 1
        assert "is dead" in refused.stderr or "no kvcached instance" in refused.stderr
        path = seg.segment_path(name)
        gc = kvctl("gc")
        assert gc.returncode == 0 and not os.path.exists(path)
        assert f"removed segment {name} (owner dead)" in gc.stdout or name not in gc.stdout
        assert live not in gc.stdout
        with pytest.raises(KVCachedError):
            read_segment(name)
        alive = kvctl("delete", live)
        assert alive.returncode == 1 and "is alive" in alive.stderr
        assert kvctl("delete", live, "--force").returncode == 0
        with pytest.raises(KVCachedError):
            read_segment(live)


def test_watch_prints_instances(unchanged_instance):
    name, _ = unchanged_instance
    result = kvctl("watch", "--count", "2", "--interval", "0.05")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if f" + {name} " in line)
    assert "alive" in line and "limit 2.00 GiB" in line


def test_budget_commands():
    name = unique_name("cli-bud")
    try:
        created = kvctl("budget", name, "1.5G")
        assert created.returncode == 0 and "1.50 GiB" in created.stdout
        assert "dead after 10 s without a heartbeat" in created.stdout
        assert read_budget(name).budget_bytes == 3 * GiB // 2
        assert kvctl("budget", name, "1.5G", "--stale-after", "30").returncode == 0
        assert read_budget(name).stale_after_s == 30
        refused = kvctl("budget", name, "1.5G", "--stale-after", "0.01")
        assert refused.returncode == 1 and "stale_after_s=0.01 is invalid" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
        shown = json.loads(kvctl("budget", name, "--json").stdout)
        assert (shown["budget_bytes"], shown["held_bytes"]) == (3 * GiB // 2, 0)
        listing = kvctl("budget")
        assert listing.returncode == 0 and name in listing.stdout
        assert kvctl("budget", name, "-2G").returncode == 1
        deleted = kvctl("budget", name, "--delete")
        assert deleted.returncode == 0
        with pytest.raises(KVCachedError):
            read_budget(name)
    finally:
        try:
            delete_budget(name, force=True)
        except KVCachedError:
            pass


def test_budget_policy_and_share_commands():
    """--policy switches a budget's policy; `kvctl share` sets a live holder's weight and
    minimum by pid; the human and JSON views show each holder's share, cap and demand."""
    name = unique_name("cli-fair")
    try:
        created = kvctl("budget", name, "8M", "--policy", "first_come")
        assert created.returncode == 0 and "first_come" in created.stdout
        assert read_budget(name).policy == "first_come"
        assert "fair" in kvctl("budget", name, "--policy", "fair").stdout
        assert read_budget(name).policy == "fair"
        bad = kvctl("budget", name, "--policy", "fifo")
        assert bad.returncode == 2 and "invalid choice" in bad.stderr
        with Proc("budget-demand", name, str(4 * MiB)) as holder:
            shared = kvctl("share", name, str(holder.pid), "--weight", "2.5", "--min", "1M")
            assert shared.returncode == 0, shared.stderr
            line = next(ln for ln in shared.stdout.splitlines() if f"pid {holder.pid:>8}" in ln)
            assert "share 4.00 MiB" in line and "cap none" in line and "demand 4.00 MiB" in line
            assert "weight 2.5" in line and "min 1.00 MiB" in line
            (h,) = json.loads(kvctl("budget", name, "--json").stdout)["holders"]
            assert (h["pid"], h["weight"], h["min_bytes"], h["demand_bytes"], h["share_bytes"]) == (
                holder.pid, 2.5, MiB, 4 * MiB, 4 * MiB)
            assert h["cap_bytes"] == (1 << 63) - 1
            unknown = kvctl("share", name, "999999999", "--weight", "1")
            assert unknown.returncode == 1 and "pid 999999999" in unknown.stderr
            neither = kvctl("share", name, str(holder.pid))
            assert neither.returncode == 1 and "--weight, --min" in neither.stderr
            negative = kvctl("share", name, str(holder.pid), "--weight", "-1")
            assert negative.returncode == 1 and "weight=" in negative.stderr
    finally:
        try:
            delete_budget(name, force=True)
        except KVCachedError:
            pass


def test_corrupt_budgets_are_listed_and_removed_by_gc_and_delete_force():
    """A budget file another program truncated or overwrote: `kvctl budget` names it (it hid it),
    `kvctl budget NAME --delete --force` removes it and `kvctl gc` too (both failed on it), and
    a readable budget beside them stays."""
    good, truncated, scribbled, forced = (unique_name(t) for t in ("good", "trunc", "scrib", "forced"))
    try:
        for name in (good, truncated, scribbled, forced):
            set_budget(name, MiB)
        os.truncate(budget_path(truncated), 0)
        os.truncate(budget_path(forced), 100)
        with open(budget_path(scribbled), "r+b") as f:
            f.write(b"\x1b[2J")
        for args in (["budget"], ["budget", "--json"]):
            listing = kvctl(*args)
            assert listing.returncode == 0, listing.stderr
            assert good in listing.stdout and "\x1b" not in listing.stderr
            for name in (truncated, scribbled, forced):  # (unless a concurrent gc took it)
                assert (f"budget {name!r} is unreadable" in listing.stderr
                        or not os.path.exists(budget_path(name))), listing.stderr
        assert [b["name"] for b in json.loads(kvctl("budget", "--json").stdout)].count(good) == 1
        refused = kvctl("budget", forced, "--delete")
        assert refused.returncode == 1 and ("--delete --force" in refused.stderr
                                            or "no budget named" in refused.stderr)  # a concurrent gc
        deleted = kvctl("budget", forced, "--delete", "--force")
        assert deleted.returncode in (0, 1), deleted.stderr  # 1: a concurrent gc came first
        assert deleted.returncode == 0 or "no budget named" in deleted.stderr
        assert not os.path.exists(budget_path(forced))
        gc = kvctl("gc")
        assert gc.returncode == 0, gc.stderr
        for name in (truncated, scribbled):
            assert not os.path.exists(budget_path(name))
            assert f"removed budget {name} (" in gc.stdout or name not in gc.stdout
        assert "\x1b" not in gc.stdout
        assert read_budget(good).budget_bytes == MiB
    finally:
        for name in (good, truncated, scribbled, forced):
            try:
                delete_budget(name, force=True)
            except KVCachedError:
                pass


def test_kvtop_once_renders_every_instance(unchanged_instance):
    name, _ = unchanged_instance
    other = unique_name("top")
    with Proc("hold", other, "--used", str(256 * MiB), "--reserved", str(128 * MiB)):
        result = run_module("kvcached.cli.kvtop", "--once", "--width", "120")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    figures = next(i for i, line in enumerate(lines) if line.startswith(other + " "))
    assert "used 256.00 MiB" in lines[figures] and "reserved 128.00 MiB" in lines[figures]
    bar = lines[figures + 1]
    assert len(bar) == 120 and bar.count("#") == 29 and bar.count("+") == 15  # 117 cells: 1 GiB
    assert any(line.startswith(name + " ") for line in lines)
    limited = lines[next(i for i, line in enumerate(lines) if line.startswith(name + " ")) + 1]
    assert "|" in limited  # 2 GiB limit of 4 GiB capacity


def test_kvtop_in_a_terminal_follows_resize_and_quits_on_q(unchanged_instance):
    name, _ = unchanged_instance
    with KvtopTerminal(40, 160) as top:
        assert name.encode() in top.read_until([name.encode()], 20)
        top.resize(20, 90)
        assert name.encode() in top.read_until([name.encode()], 20)  # redrawn after the resize
        assert top.quit(20) == 0


def test_kvtop_refuses_a_pipe_without_once():
    result = run_module("kvcached.cli.kvtop")
    assert result.returncode == 2 and "use --once" in result.stderr


def _poke_name(path: str, name: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, name.ljust(256, b"\0"), seg.OFFSETS["name"])
    finally:
        os.close(fd)


def test_tampered_names_are_escaped_never_printed_raw():
    """A segment whose name bytes another program rewrote, and a file whose very name carries
    control characters: every command shows them escaped (\\x1b), never raw."""
    name = unique_name("tamper")
    evil_file = seg.segment_path(unique_name("evilfile")) + "\x1b[2J\x07"
    with Proc("hold", name):
        _poke_name(read_segment(name).path, b"evil\x1b]0;pwned\x07\x1b[31mred\n\xc2\x9bx")
        with open(evil_file, "wb") as f:
            f.write(b"not a segment")
        outputs = {
            "list": kvctl("list"), "watch": kvctl("watch", "--count", "1"),
            "kvtop": run_module("kvcached.cli.kvtop", "--once", "--width", "200")}
        for command, result in outputs.items():
            assert result.returncode == 0, (command, result.stderr)
            for stream in (result.stdout, result.stderr):
                assert not any(c in stream for c in "\x1b\x07\x9b"), (command, stream)
            assert "evil\\x1b]0;pwned\\x07\\x1b[31mred\\n\\x9bx" in result.stdout, command
        # The odd file is skipped, escaped (unless a gc of a concurrent test removed it first).
        assert "\\x1b[2J" in outputs["list"].stderr or not os.path.exists(evil_file)
        records = json.loads(kvctl("list", "--json").stdout)  # JSON escapes by itself
        assert any(r["name"].startswith("evil\x1b") for r in records)
        existed = os.path.exists(evil_file)
        gc = kvctl("gc")
        assert gc.returncode == 0 and "\x1b" not in gc.stdout and "\x07" not in gc.stdout
        assert "\\x1b[2J\\x07 (not a valid segment)" in gc.stdout or not existed
        assert not os.path.exists(evil_file)
