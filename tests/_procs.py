"""Real processes for the tracker, budget and CLI tests: roles run as scripts, and helpers that
start them.

Run as ``python tests/_procs.py ROLE ...`` (PYTHONPATH = repository root). Every role that must
be ready before the test goes on prints ``READY`` on stdout; long-lived roles exit when their
stdin closes, so a test ends them cleanly by closing it (or kills them to test the other paths).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from kvcached.limits import classify_limit_request  # noqa: E402
from kvcached.shm.budget import Budget  # noqa: E402
from kvcached.shm.owner import MemInfoTracker  # noqa: E402
from kvcached.shm.segment import OFFSETS  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": REPO}


# ------------------------------------------------------------------------------------------
# Helpers for the tests
# ------------------------------------------------------------------------------------------

def unique_name(tag: str) -> str:
    """A segment name no other test (or test run) uses."""
    return f"test-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Proc:
    """A role running in a child process, started and past READY."""

    def __init__(self, role: str, *args: str, wait: bool = True,
                 prefix: tuple[str, ...] = ()) -> None:
        """``prefix``: a command that runs the role, e.g. ``unshare`` into a new pid namespace."""
        self.role = role
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, __file__, role, *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, text=True)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        line = self.readline(timeout_s=30)
        if line.strip() != "READY":
            self.popen.kill()
            _, err = self.popen.communicate()
            raise RuntimeError(f"{self.role} did not start: {line!r}\n{err}")

    def send(self, line: str) -> None:
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def readline(self, timeout_s: float) -> str:
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"no output from pid {self.pid} in {timeout_s} s")
        return self.popen.stdout.readline()

    def finish(self, timeout_s: float = 30) -> tuple[int, str, str]:
        """Close stdin (the role exits) and return (exit status, stdout, stderr)."""
        out, err = self.popen.communicate(input="", timeout=timeout_s)
        return self.popen.returncode, out, err

    def kill(self, signum: int = signal.SIGKILL, timeout_s: float = 30) -> int:
        self.popen.send_signal(signum)
        return self.popen.wait(timeout_s)

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        """End the role as a test would leave it: by closing stdin (it cleans up), killing it
        only if it does not exit."""
        try:
            self.popen.communicate(input="" if self.popen.poll() is None else None, timeout=20)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.communicate()


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it holds; a generous timeout turns a hang into a failure."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def poke_segment(path: str, field: str, *values: int) -> None:
    """Write i64 ``values`` at ``field``'s offset of a segment file, as another program could."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack(f"={len(values)}q", *values), OFFSETS[field])
    finally:
        os.close(fd)


def run_module(module: str, *args: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    """``python -m module args`` with the repository on PYTHONPATH (not the installed script)."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout_s)


def kvctl(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    return run_module("kvcached.cli.kvctl", *args, timeout_s=timeout_s)


class KvtopTerminal:
    """``kvtop`` on a pseudo-terminal, as an operator sees it. Use it as a context manager: on
    exit a kvtop that did not quit is killed and the terminal closed."""

    def __init__(self, rows: int, cols: int, interval_s: float = 0.1):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child: kvtop on the pseudo-terminal
            os.execve(sys.executable, [sys.executable, "-m", "kvcached.cli.kvtop", "--interval", str(interval_s)],
                      {**ENV, "TERM": "xterm"})
        self.status: int | None = None
        self.resize(rows, cols)

    def resize(self, rows: int, cols: int) -> None:
        """Set the terminal size (kvtop gets SIGWINCH)."""
        import fcntl
        import termios

        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def read_until(self, needles: list[bytes], timeout_s: float) -> bytes:
        """What kvtop draws until every needle has appeared, or timeout_s has passed."""
        screen, deadline = b"", time.monotonic() + timeout_s
        while not all(n in screen for n in needles) and time.monotonic() < deadline:
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if ready:
                try:
                    screen += os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    break
        return screen

    def quit(self, timeout_s: float) -> int | None:
        """Press q and wait for kvtop to exit: its exit status, or None if it is still running."""
        os.write(self.fd, b"q")
        deadline = time.monotonic() + timeout_s
        while self.status is None and time.monotonic() < deadline:
            self.read_until([b"\0never"], 0.1)  # drain the screen so the child never blocks
            done, raw = os.waitpid(self.pid, os.WNOHANG)
            self.status = os.waitstatus_to_exitcode(raw) if done else None
        return self.status

    def __enter__(self) -> KvtopTerminal:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


# ------------------------------------------------------------------------------------------
# Roles
# ------------------------------------------------------------------------------------------

class ModelManager:
    """The limit semantics the manager implements, reduced to what the tests need: a limit below
    the usage is deferred; each call is printed as a JSON line (order is what tests check)."""

    def __init__(self, limit_bytes: int, used_bytes: int) -> None:
        self.limit_bytes, self.revision, self.used_bytes = limit_bytes, 0, used_bytes

    def apply(self, limit_bytes: int, revision: int) -> dict:
        kind = classify_limit_request(self.limit_bytes, self.revision, limit_bytes, revision)
        if kind in ("stale", "conflict"):
            status = kind
        else:
            self.limit_bytes, self.revision = limit_bytes, revision
            status = "deferred" if limit_bytes < self.used_bytes else "applied"
        print(json.dumps({"limit_bytes": limit_bytes, "revision": revision, "status": status,
                          "t_ns": time.time_ns()}), flush=True)
        return {"status": status, "limit_bytes": self.limit_bytes, "revision": self.revision}


def wait_for_stdin_to_close() -> None:
    """Print READY, then wait until the test closes stdin, or a signal's handler raises.

    A handler runs only at the main thread's next bytecode: a signal that lands between READY and
    a blocking ``read()`` would wait for the read to return (the test sends it as soon as it sees
    READY). The wake-up fd makes such a signal end the wait too."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    print("READY", flush=True)
    while sys.stdin not in select.select([sys.stdin, wake_r], [], [])[0]:
        os.read(wake_r, 512)  # a signal whose handler returned: wait on
    sys.stdin.read()


def role_hold(args: argparse.Namespace) -> None:
    if args.own_sigterm:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    tracker = MemInfoTracker(args.name, capacity_bytes=args.capacity,
                             page_size_bytes=2 << 20, limit_bytes=args.limit)
    tracker.publish(args.used, args.reserved)
    if args.limit >= 0:
        tracker.set_limit(args.limit, 0)
    if args.watch:
        tracker.start_watcher(ModelManager(args.limit, args.used).apply)
    wait_for_stdin_to_close()


def role_writer(args: argparse.Namespace) -> None:
    tracker = MemInfoTracker(args.name)
    publish = tracker.publish
    print("READY", flush=True)
    k = 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        for _ in range(1000):
            k += 1
            publish(k, k)
    print(k, flush=True)
    tracker.close()


def role_busy(args: argparse.Namespace) -> None:
    """Publish flat out, with the watcher on, until stdin closes; answer each ``report`` line with
    ``{"publishes", "detached"}`` (why the tracker stopped writing its file, or null)."""
    tracker = MemInfoTracker(args.name, capacity_bytes=1 << 30,
                             heartbeat_interval_s=args.heartbeat_s)
    tracker.start_watcher(ModelManager(-1, 0).apply)
    print("READY", flush=True)
    publishes = 0
    while True:
        for _ in range(100):
            publishes += 1
            tracker.publish(publishes, publishes)
        if select.select([sys.stdin], [], [], 0)[0]:
            line = sys.stdin.readline()
            if not line:
                break
            print(json.dumps({"publishes": publishes, "detached": tracker._detached}), flush=True)
    tracker.close()


def role_budget_worker(args: argparse.Namespace) -> None:
    """Churn on a budget; ``actual[idx]`` shadows what this worker holds: raised after a
    successful acquire, lowered before a release (so it never exceeds what the budget says)."""
    budget = Budget.open(args.name)
    fd = os.open(args.actual, os.O_RDWR)
    actual = memoryview(mmap.mmap(fd, 8 * 64)).cast("q")
    rng = random.Random(args.seed)
    held, acquired, refused = 0, 0, 0
    print("READY", flush=True)
    sys.stdin.readline()  # "go": all workers start together
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        if held and rng.random() < 0.5:
            amount = rng.randint(1, held)
            actual[args.idx] = held - amount
            budget.release(amount)
            held -= amount
        else:
            amount = rng.randint(1, args.max_bytes)
            if budget.try_acquire(amount):
                held += amount
                actual[args.idx] = held
                acquired += 1
            else:
                refused += 1
    actual[args.idx] = 0
    budget.release(held)
    budget.check_invariants()
    budget.close()
    print(json.dumps({"acquired": acquired, "refused": refused}), flush=True)


def role_budget_die_midway(args: argparse.Namespace) -> None:
    """Hold ``held`` bytes, then SIGKILL this process between the slot's and the total's write of
    one more acquisition or release of ``amount`` (holder._between_slot_and_total)."""
    from kvcached.shm.budget import holder

    handle = Budget.open(args.name)
    if not handle.try_acquire(args.held):
        raise SystemExit(f"could not acquire {args.held} bytes")
    holder._between_slot_and_total = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if args.op == "acquire":
        handle.try_acquire(args.amount)
    else:
        handle.release(args.amount)
    print("SURVIVED", flush=True)


def role_budget_outlive(args: argparse.Namespace) -> None:
    """Hold some of a budget; after the test changed the file (stdin line), use the handle and
    report what each call did."""
    from kvcached.errors import KVCachedError

    handle = Budget.open(args.name)
    assert handle.try_acquire(args.bytes)
    print("READY", flush=True)
    sys.stdin.readline()
    report = {"free_bytes": handle.free_bytes()}
    try:
        report["acquired"] = handle.try_acquire(1)
    except KVCachedError as exc:
        report["acquire_error"] = str(exc)
    handle.release(args.bytes)
    report["held_after_release"] = handle.held_bytes
    handle.close()
    print(json.dumps(report), flush=True)


def role_budget_hog(args: argparse.Namespace) -> None:
    budget = Budget.open(args.name)
    if not budget.try_acquire(args.bytes):
        raise SystemExit(f"could not acquire {args.bytes} bytes")
    print("READY", flush=True)
    sys.stdin.read()


def role_budget_demand(args: argparse.Namespace) -> None:
    """Hold nothing of a budget and wait for ``demand`` bytes of it (Budget.set_demand)."""
    budget = Budget.open(args.name)
    budget.set_demand(args.demand)
    print("READY", flush=True)
    sys.stdin.read()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role", required=True)
    p = sub.add_parser("hold")
    p.add_argument("name")
    p.add_argument("--capacity", type=int, default=1 << 30)
    p.add_argument("--used", type=int, default=0)
    p.add_argument("--reserved", type=int, default=0)
    p.add_argument("--limit", type=int, default=-1)
    p.add_argument("--watch", action="store_true")
    p.add_argument("--own-sigterm", action="store_true")
    p.set_defaults(run=role_hold)
    p = sub.add_parser("busy")
    p.add_argument("name")
    p.add_argument("--heartbeat-s", type=float, default=0.1)
    p.set_defaults(run=role_busy)
    p = sub.add_parser("writer")
    p.add_argument("name")
    p.add_argument("seconds", type=float)
    p.set_defaults(run=role_writer)
    p = sub.add_parser("budget-worker")
    p.add_argument("name")
    p.add_argument("idx", type=int)
    p.add_argument("actual")
    p.add_argument("seconds", type=float)
    p.add_argument("seed", type=int)
    p.add_argument("max_bytes", type=int)
    p.set_defaults(run=role_budget_worker)
    p = sub.add_parser("budget-die-midway")
    p.add_argument("name")
    p.add_argument("held", type=int)
    p.add_argument("op", choices=["acquire", "release"])
    p.add_argument("amount", type=int)
    p.set_defaults(run=role_budget_die_midway)
    p = sub.add_parser("budget-outlive")
    p.add_argument("name")
    p.add_argument("bytes", type=int)
    p.set_defaults(run=role_budget_outlive)
    p = sub.add_parser("budget-hog")
    p.add_argument("name")
    p.add_argument("bytes", type=int)
    p.set_defaults(run=role_budget_hog)
    p = sub.add_parser("budget-demand")
    p.add_argument("name")
    p.add_argument("demand", type=int)
    p.set_defaults(run=role_budget_demand)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
