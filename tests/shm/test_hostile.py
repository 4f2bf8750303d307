"""Files at kvcached's names under /dev/shm that kvcached did not write: FIFOs, directories,
symbolic links, other users' files, arbitrary bytes, segments and budgets with fields out of
range. Every reader (kvctl list/watch/gc/delete/budget, kvtop --once, an instance starting, a
holder joining a budget) must answer with an exit status and a message naming the path: never
hang, never a traceback. Real files under /dev/shm and real processes; no mocks."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _procs import ENV, kvctl, run_module, unique_name
from kvcached.cli import kvctl as kvctl_cli
from kvcached.cli import kvtop as kvtop_cli
from kvcached.errors import KVCachedError
from kvcached.limits import I64_MAX
from kvcached.shm import budget as kb
from kvcached.shm import segment as seg
from kvcached.shm.budget import Budget
from kvcached.shm.owner import MemInfoTracker

MiB = 1 << 20
NOBODY = 65534          # a uid that is not ours, for files of another user (root only)
I64_MIN = -(1 << 63)

HANG_S = 60            # far beyond any reader's few milliseconds: only a hang reaches it

pytestmark = pytest.mark.usefixtures("shm_clean")


@pytest.fixture(autouse=True)
def one_at_a_time() -> Iterator[None]:
    """The tests here make FIFOs, directories and links at kvcached names and run
    `kvctl gc --force`, which removes such entries of this user wherever they are: one test at a
    time across test processes (xdist), so that none removes what another is testing. (A plain
    gc elsewhere removes only regular files that are no segment or budget: the tests allow that.)"""
    with open(os.path.join(tempfile.gettempdir(), "kvcached-test-hostile.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# -- running the readers ------------------------------------------------------------------------

class Hung(BaseException):
    """A reader did not return. A BaseException, so that Hypothesis stops at once instead of
    shrinking through more examples that hang too (it catches pytest's own timeout failure)."""


@contextlib.contextmanager
def within(what: str, seconds: float = HANG_S) -> Iterator[None]:
    """Raise Hung if the block runs longer than ``seconds``: SIGALRM interrupts a blocking
    system call, such as the open() of a FIFO. Restores the alarm pytest-timeout had set."""
    def alarm(signum: int, frame: object) -> None:
        raise Hung(f"{what} did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, left - (time.monotonic() - started)))


@dataclass
class Ran:
    status: int
    out: str
    err: str


def run_main(main: Callable[[list[str]], int], *args: str) -> Ran:
    """``main(args)`` in this process (a kvctl or kvtop entry point), its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with within(f"{main.__module__} {' '.join(args)}"), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        status = main(list(args))
    return Ran(status, out.getvalue(), err.getvalue())


def ctl(*args: str) -> Ran:
    return run_main(kvctl_cli.main, *args)


def start_instance(name: str) -> str | None:
    """Start an instance under ``name`` in this process and close it: None, or the error."""
    try:
        with within(f"MemInfoTracker({name!r})"):
            MemInfoTracker(name).close()
    except KVCachedError as exc:
        return str(exc)
    return None


def join_budget(name: str) -> str | None:
    """Join budget ``name`` as a holder and leave: None, or the error."""
    try:
        with within(f"Budget.open({name!r})"):
            Budget.open(name).close()
    except KVCachedError as exc:
        return str(exc)
    return None


# -- making entries ------------------------------------------------------------------------------

def segment_image(name: str, **fields: int) -> bytes:
    """A segment as the owner writes it (owner: this process, any start time), then ``fields``."""
    values = {field: 0 for field in seg.FIELDS}
    values.update(magic=seg.MAGIC, version=seg.VERSION, segment_bytes=seg.SEGMENT_BYTES,
                  pid=os.getpid(), limit_bytes=-1, name=name.encode())
    values.update(fields)
    return seg.LAYOUT.pack(*(values[field] for field in seg.FIELDS))


HEADER_FIELDS = ("segment_bytes", "budget_bytes", "held_bytes", "num_slots", "created_ns",
                 "recovered_bytes", "stale_after_ns", "policy")
SLOT_FIELDS = ("pid", "start_time", "pid_ns", "held_bytes", "token", "heartbeat_ns",
               "demand_bytes", "weight_milli", "min_bytes", "cap_bytes")


def budget_image(name: str, header: dict[str, int] | None = None,
                 slots: dict[int, dict[str, int]] | None = None) -> bytes:
    """A budget laid out as the budget module's docstring table says, then ``header`` fields and
    ``slots`` ({slot: {field: value}}) on top."""
    values = dict(zip(HEADER_FIELDS, (kb.SEGMENT_BYTES, MiB, 0, kb.NUM_SLOTS, 1, 0,
                                      10 * 10**9, 1)))
    values.update(header or {})
    raw = bytearray(struct.pack("=4sI8q248s", kb.MAGIC, kb.VERSION,
                                *(values[f] for f in HEADER_FIELDS), name.encode()))
    raw += bytes(kb.NUM_SLOTS * kb.SLOT_BYTES)
    for index, fields in (slots or {}).items():
        for field, value in fields.items():
            struct.pack_into("=q", raw, kb.SLOTS_OFFSET + index * kb.SLOT_BYTES
                             + 8 * SLOT_FIELDS.index(field), value)
    return bytes(raw)


def write_file(path: str, content: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, content)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Whatever is at ``path``, gone (test clean-up)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


@pytest.fixture
def scratch():
    """A directory outside /dev/shm, for the targets of symbolic links."""
    with tempfile.TemporaryDirectory(prefix="kvcached-hostile-") as where:
        yield where


def dead_pid() -> int:
    """A pid no process has now (a child that ran and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


# -- the failures found, one test each -------------------------------------------------------

def test_a_fifo_at_a_segment_name_hangs_nothing():
    """Every reader opened the FIFO with a plain open() and waited for a writer forever: kvctl
    list/watch/gc/delete, kvtop, and an instance starting under that name. Run as processes,
    as an operator would, each under a timeout."""
    name = unique_name("fifo")
    path = seg.segment_path(name)
    os.mkfifo(path, 0o600)
    try:
        for args in (["list"], ["watch", "--count", "1"], ["gc"]):
            ran = kvctl(*args, timeout_s=HANG_S)
            assert ran.returncode == 0 and "Traceback" not in ran.stderr, (args, ran.stderr)
            assert f"{path} is a FIFO" in ran.stderr and "--force" in ran.stderr, args
        assert os.path.exists(path)                     # gc without --force reports it
        top = run_module("kvcached.cli.kvtop", "--once", timeout_s=HANG_S)
        assert top.returncode == 0 and f"{path} is a FIFO" in top.stderr, top.stderr
        refused = kvctl("delete", name, timeout_s=HANG_S)
        assert refused.returncode == 1 and f"{path} is a FIFO" in refused.stderr
        assert f"kvctl delete {name} --force" in refused.stderr
        start = f"from kvcached.shm.owner import MemInfoTracker; MemInfoTracker({name!r})"
        started = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True,
                                 env=ENV, timeout=HANG_S)
        assert started.returncode == 1 and f"{path} is a FIFO" in started.stderr
        assert "another name (KVCACHED_IPC_NAME)" in started.stderr
        forced = kvctl("gc", "--force", timeout_s=HANG_S)
        assert forced.returncode == 0 and f"removed segment {name} (a FIFO" in forced.stdout
        assert not os.path.lexists(path)
    finally:
        remove(path)


@pytest.mark.parametrize("field, value", [
    ("pid", 1 << 32), ("pid", I64_MAX), ("pid", -1), ("used_bytes", I64_MIN),
    ("reserved_bytes", -1), ("capacity_bytes", I64_MIN), ("limit_bytes", -2),
    ("heartbeat_ns", I64_MIN), ("segment_bytes", 4096)])
def test_a_segment_field_out_of_range_is_reported_and_collected(field, value):
    """A pid of 2**32 made kvctl list/watch/gc and kvtop die of OverflowError (os.kill), a
    negative usage made kvtop die building its bar: the segment is now unreadable, named with
    the field and its value, and gc removes it."""
    name = unique_name("range")
    path = seg.segment_path(name)
    write_file(path, segment_image(name, **{field: value}))
    try:
        for ran in (ctl("list"), ctl("list", "--json"), ctl("watch", "--count", "1"),
                    run_main(kvtop_cli.main, "--once", "--width", "150")):
            assert ran.status == 0
            assert name not in ran.out or not os.path.exists(path)     # (a concurrent gc)
            assert f"{field} is {value}" in ran.err or not os.path.exists(path), ran.err
        gc = ctl("gc")
        assert gc.status == 0 and not os.path.exists(path)
        assert name not in gc.out or f"removed segment {name} (not a valid segment)" in gc.out
        write_file(path, segment_image(name, **{field: value}))
        assert start_instance(name) is None                # taken over: no instance wrote it
        assert not os.path.exists(path)
    finally:
        remove(path)


def test_a_directory_at_a_segment_name():
    """kvctl delete --force crashed on it (IsADirectoryError); an instance starting under the
    name too. Now: refused with the fix named, and --force removes the empty directory."""
    name = unique_name("dirseg")
    path = seg.segment_path(name)
    os.mkdir(path, 0o700)
    try:
        refused = ctl("delete", name)
        assert refused.status == 1 and f"{path} is a directory" in refused.err
        assert "directory" in (start_instance(name) or "")
        listed = ctl("list")
        assert listed.status == 0 and f"{path} is a directory" in listed.err
        forced = ctl("delete", name, "--force")
        assert forced.status == 0, forced.err
        assert not os.path.lexists(path)
        os.mkdir(path, 0o700)
        with open(os.path.join(path, "inside"), "w"):
            pass
        kept = ctl("delete", name, "--force")
        assert kept.status == 1 and "not empty" in kept.err and path in kept.err
        assert os.path.exists(os.path.join(path, "inside"))  # never a directory's contents
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, "inside"))
        remove(path)


def test_a_directory_at_a_budget_name():
    """An empty directory at a budget's name made kvctl gc die (IsADirectoryError): gc reports
    it, gc --force removes it, and a holder joining the budget is told what to do."""
    name = unique_name("dirbud")
    path = kb.budget_path(name)
    os.mkdir(path, 0o700)
    try:
        gc = ctl("gc")
        assert gc.status == 0 and f"{path} is a directory" in gc.err and "--force" in gc.err
        assert os.path.isdir(path)
        listed = ctl("budget")
        assert listed.status == 0 and f"budget {name!r} is unreadable" in listed.err
        assert f"{path} is a directory" in (join_budget(name) or "")
        with pytest.raises(KVCachedError, match="is a directory"):
            Budget.open(name, budget_bytes=MiB)
        forced = ctl("gc", "--force")
        assert forced.status == 0 and f"removed budget {name} (a directory" in forced.out
        assert not os.path.lexists(path)
    finally:
        remove(path)


@pytest.mark.parametrize("slots", [
    {i: {"pid": 0, "held_bytes": (1 << 62) + 5} for i in range(3)},     # free slots holding bytes
    {i: {"pid": "dead", "held_bytes": (1 << 62) + 5} for i in range(3)},  # sum past an i64
    {0: {"pid": 1 << 32, "held_bytes": 1}},
    {0: {"pid": "dead", "held_bytes": -1}},
    {0: {"pid": "dead", "heartbeat_ns": -5}},
], ids=["free-holding", "sum-overflow", "pid-2**32", "negative-held", "negative-heartbeat"])
def test_a_budget_with_slots_out_of_range(slots):
    """A budget whose slots hold values no kvcached writes made every new holder and kvctl gc
    die of struct.error (a sum past an i64): the holder is refused with the slot, the field and
    the fix named; gc removes the file as no budget."""
    name = unique_name("slots")
    path = kb.budget_path(name)
    pid = dead_pid()
    write_file(path, budget_image(name, slots={
        i: {k: pid if v == "dead" else v for k, v in fields.items()}
        for i, fields in slots.items()}))
    try:
        message = join_budget(name) or ""
        if os.path.exists(path):   # (else a gc of a test beside this one removed it first)
            assert f"{path}: slot" in message and "outside" in message, message
            assert "kvctl gc" in message and f"kvctl budget {name} --delete --force" in message
        listed = ctl("budget")
        assert listed.status == 0
        assert f"budget {name!r} is unreadable" in listed.err or not os.path.exists(path)
        gc = ctl("gc")
        assert gc.status == 0, gc.err
        assert not os.path.exists(path)
        assert name not in gc.out or f"removed budget {name} (slot" in gc.out
    finally:
        remove(path)


@pytest.mark.parametrize("where", ["segment", "budget"])
def test_a_symbolic_link_is_never_followed(where, scratch):
    """A link at a kvcached name pointing at a file elsewhere: the file is never read or written
    through it (an operator's `kvctl budget NAME SIZE` wrote into the target before)."""
    name = unique_name("link")
    target = os.path.join(scratch, "target")
    content = budget_image(name) if where == "budget" else segment_image(name)
    with open(target, "wb") as f:
        f.write(content)
    path = kb.budget_path(name) if where == "budget" else seg.segment_path(name)
    os.symlink(target, path)
    try:
        if where == "budget":
            changed = ctl("budget", name, "2M")
            assert changed.status == 1 and f"{path} is a symbolic link" in changed.err
            assert f"{path} is a symbolic link" in (join_budget(name) or "")
        else:
            limited = ctl("limit", name, "1M", "--timeout", "0")
            assert limited.status == 1 and f"{path} is a symbolic link" in limited.err
            assert f"{path} is a symbolic link" in (start_instance(name) or "")
        with open(target, "rb") as f:
            assert f.read() == content                  # untouched
        gc = ctl("gc")
        assert gc.status == 0 and os.path.islink(path) and "is a symbolic link" in gc.err
        forced = ctl("gc", "--force")
        assert forced.status == 0 and not os.path.lexists(path) and os.path.exists(target)
    finally:
        remove(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_another_users_file_is_never_used_or_collected():
    """Another user's file at a kvcached name is reported with its owner, never read, never
    joined, never removed by gc (--force included); `kvctl delete --force` names it and
    removes it where this user may."""
    seg_name, bud_name = unique_name("theirs"), unique_name("theirb")
    seg_path, bud_path = seg.segment_path(seg_name), kb.budget_path(bud_name)
    write_file(seg_path, segment_image(seg_name))
    write_file(bud_path, budget_image(bud_name))
    os.chown(seg_path, NOBODY, NOBODY)
    os.chown(bud_path, NOBODY, NOBODY)
    try:
        listed = ctl("list")
        assert f"{seg_path} is a regular file owned by uid {NOBODY}" in listed.err, listed.err
        assert f"{bud_path} is a regular file owned by uid {NOBODY}" in ctl("budget").err
        assert f"owned by uid {NOBODY}" in (start_instance(seg_name) or "")
        assert f"owned by uid {NOBODY}" in (join_budget(bud_name) or "")
        for args in (["gc"], ["gc", "--force"]):
            assert ctl(*args).status == 0
            assert os.path.exists(seg_path) and os.path.exists(bud_path)
        assert ctl("delete", seg_name, "--force").status == 0
        assert ctl("budget", bud_name, "--delete", "--force").status == 0
        assert not os.path.exists(seg_path) and not os.path.exists(bud_path)
    finally:
        remove(seg_path)
        remove(bud_path)


# -- everything at once: hypothesis ---------------------------------------------------------------

VALUES = st.one_of(
    st.sampled_from([0, 1, -1, 1 << 22, (1 << 22) + 1, 1 << 31, 1 << 32, I64_MAX, I64_MIN]),
    st.integers(I64_MIN, I64_MAX))
SIZES = st.one_of(
    st.sampled_from([0, 4, 7, 8, 40, 320, seg.SEGMENT_BYTES - 1, seg.SEGMENT_BYTES,
                     kb.SEGMENT_BYTES - 1, kb.SEGMENT_BYTES, kb.SEGMENT_BYTES + 1]),
    st.integers(0, 2 * kb.SEGMENT_BYTES))
SEGMENT_INTS = [f for f in seg.FIELDS if f not in ("magic", "version", "name")]


@st.composite
def entries(draw: st.DrawFn, where: str) -> tuple[str, object]:
    """(kind, what to make): random bytes (sometimes after a valid head), a valid segment or
    budget with random field values, a FIFO, an empty directory, a link to a file elsewhere, a
    dangling link, or (as root) a valid file of another user."""
    kinds = ["bytes", "fields", "fifo", "dir", "symlink", "dangling"]
    kind = draw(st.sampled_from(kinds + (["foreign"] if os.geteuid() == 0 else [])))
    if kind == "bytes":
        head = draw(st.sampled_from([b"", seg.MAGIC + struct.pack("=I", seg.VERSION),
                                     kb.MAGIC + struct.pack("=I", kb.VERSION), kb.MAGIC]))
        size = draw(SIZES)
        return kind, (head + random.Random(draw(st.integers(0, 2**32))).randbytes(size))[:size]
    if kind in ("fields", "foreign") and where == "segment":
        fields = draw(st.dictionaries(st.sampled_from(SEGMENT_INTS), VALUES, max_size=4))
        if draw(st.booleans()):
            fields["version"] = draw(st.sampled_from([0, 2, 1 << 31]))
        return kind, fields
    if kind in ("fields", "foreign"):
        header = draw(st.dictionaries(st.sampled_from(HEADER_FIELDS), VALUES, max_size=3))
        slots = draw(st.dictionaries(
            st.integers(0, 3),
            st.dictionaries(st.sampled_from(SLOT_FIELDS),
                            st.one_of(VALUES, st.just(os.getpid())), max_size=5),
            max_size=3))
        return kind, (header, slots)
    return kind, None


def make(where: str, name: str, path: str, kind: str, what: object, scratch: str) -> None:
    if kind == "bytes":
        write_file(path, what)
    elif kind in ("fields", "foreign") and where == "segment":
        write_file(path, segment_image(name, **what))
    elif kind in ("fields", "foreign"):
        header, slots = what
        write_file(path, budget_image(name, header, slots))
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "dir":
        os.mkdir(path, 0o700)
    elif kind == "symlink":
        os.symlink(os.path.join(scratch, "target"), path)
    else:
        os.symlink(os.path.join(scratch, "nowhere"), path)
    if kind == "foreign":
        os.chown(path, NOBODY, NOBODY)


def named(ran: Ran, name: str, path: str) -> bool:
    """The output names the entry: by its name or its path (or it is gone: a concurrent gc)."""
    text = ran.out + ran.err
    return name in text or path in text or not os.path.lexists(path)


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(where=st.sampled_from(["segment", "budget"]), data=st.data())
def test_every_reader_answers_whatever_is_at_a_name(where, data, scratch):
    """Whatever is at a segment's or a budget's name, every reader returns an exit status (or a
    KVCachedError) naming the entry when it cannot use it; a readable one is listed; --force
    removes it; nothing is read or written through a link. Each call runs under ``within``."""
    name = unique_name("hostile")
    path = seg.segment_path(name) if where == "segment" else kb.budget_path(name)
    kind, what = data.draw(entries(where), label="entry")
    target = os.path.join(scratch, "target")
    target_content = (segment_image(name) if where == "segment" else budget_image(name))
    with open(target, "wb") as f:
        f.write(target_content)
    make(where, name, path, kind, what, scratch)
    try:
        for args in (["list", "--json"], ["watch", "--count", "1"], ["budget", "--json"]):
            ran = ctl(*args)
            assert ran.status == 0, (args, ran.err)
            listed = {r["path"] for r in json.loads(ran.out)} if "--json" in args else set()
            if args[0] == ("list" if where == "segment" else "budget"):
                assert path in listed or named(ran, name, path), (args, ran.err)
        top = run_main(kvtop_cli.main, "--once", "--width", "200")
        assert top.status == 0
        if where == "segment":
            assert named(ctl("delete", name), name, path)
            message = start_instance(name)
        else:
            shown = ctl("budget", name)
            assert shown.status in (0, 1) and (shown.status == 0 or named(shown, name, path))
            assert named(ctl("budget", name, "--delete"), name, path)
            message = join_budget(name)
        assert message is None or name in message or path in message, message
        force = ["--force"] if data.draw(st.booleans(), label="gc --force") else []
        assert ctl("gc", *force).status == 0
        forced = (ctl("delete", name, "--force") if where == "segment"
                  else ctl("budget", name, "--delete", "--force"))
        assert forced.status == 0 or "no kvcached instance named" in forced.err or (
            "no budget named" in forced.err), forced.err
        assert not os.path.lexists(path)
        with open(target, "rb") as f:
            assert f.read() == target_content            # nothing went through a link
    finally:
        remove(path)
