"""The demo's parent process: the budget, two instances, the phases, the samples, the picture.

The parent does not import torch: it creates the global budget, starts the
two instances (kvcached.demo.instance), moves the clients between them, and samples once per tick
what kvctl would show (each instance's segment and the budget) beside the serving counters the
instances report over their pipes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import secrets
import signal
import time
from collections import deque
from dataclasses import asdict, dataclass

from ..errors import KVCachedError
from ..shm.budget import delete_budget, read_budget, set_budget
from ..shm.client import delete_segment, read_segment
from ..sizes import format_bytes
from . import figures, plot
from .instance import InstanceSpec, Workload, serve
from .schedule import Phase, phase_at, phases
from .view import Frame, Row, make_view

TICK_S = 0.2                    # samples and view refreshes: five a second
RATE_WINDOW_S = 1.0             # tokens/s over this window
READY_TIMEOUT_S = 300.0         # model building on a loaded machine
STOP_TIMEOUT_S = 20.0
FAMILIES = ("llama", "qwen2")   # the two instances, in the order of the view and the plot

# See Note [Sizing the demo].
CPU_WORKLOAD = Workload(preset="tiny", dtype="float32", page_size_bytes=8 << 10, num_blocks=4096, block_size=16,
                        max_running=48, clients=40, prompt_tokens=(64, 192), new_tokens=(16, 48))
CPU_BUDGET_BYTES = 5 << 19                  # 2.5 MiB
CUDA_WORKLOAD = Workload(preset="llama3-8b", dtype="bfloat16", page_size_bytes=2 << 20, num_blocks=8192,
                         block_size=16, max_running=64, clients=64, prompt_tokens=(128, 512), new_tokens=(16, 64))
CUDA_BUDGET_BYTES = 2 << 30
# Pool bounds and idle trim short enough that an idle instance visibly gives its pages back.
POOL_SETTINGS = {"KVCACHED_MIN_RESERVED_PAGES": "2", "KVCACHED_MAX_RESERVED_PAGES": "4",
                 "KVCACHED_IDLE_TRIM_S": "0.3", "KVCACHED_TRACKER": "1"}


class DemoError(Exception):
    """An instance failed or did not start; the message says which and why."""


@dataclass
class Options:
    device: str                     # "cpu" or "cuda:N"
    out_png: str                    # where the PNG goes: kvcached.demo.__main__.png_path, ends in .png
    phase_s: float
    hold: bool
    seed: int = 0


class _Instance:
    """The parent's side of one instance: its process, pipe, and latest counters."""

    def __init__(self, context, spec: InstanceSpec) -> None:
        self.spec = spec
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=serve, args=(spec, child_conn), name=f"kvcached-demo-{spec.name}",
                                       daemon=True)
        self.process.start()
        child_conn.close()
        self.info: dict = {}                    # what the instance said when ready
        self.counters = {"running": 0, "waiting": 0, "preemptions": 0, "generated_tokens": 0}
        self.clients = 0

    def receive(self) -> None:
        """Take every message waiting on the pipe. Raises DemoError if the instance failed."""
        try:
            while self.conn.poll():
                kind, value = self.conn.recv()
                if kind == "ready":
                    self.info = value
                elif kind == "stats":
                    self.counters = value
                elif kind == "error":
                    raise DemoError(f"instance {self.spec.name} failed:\n{value}")
        except (EOFError, OSError):
            raise DemoError(f"instance {self.spec.name} (pid {self.process.pid}) exited with status "
                            f"{self.process.exitcode}") from None

    def set_clients(self, clients: int) -> None:
        if clients != self.clients:
            self.conn.send(("clients", clients))
            self.clients = clients

    def stop(self) -> None:
        """Ask the instance to shut down; one still building its model is terminated (SIGTERM:
        kvcached closes its segment and budget handle on the way out)."""
        if not self.info:
            self.process.terminate()
            return
        try:
            self.conn.send(("stop", None))
        except OSError:
            pass

    def join(self) -> None:
        """Wait for the process to exit (killing it if it hangs); remove its segment if it died
        without doing so."""
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
        try:
            delete_segment(self.spec.ipc_name)      # refuses a live owner (Note [Telling a dead owner] in shm.files)
        except KVCachedError:
            pass                                # gone already: the instance shut down cleanly


class TokenRates:
    """Tokens/s per instance over the last ``window_s`` seconds of one monotonic clock.

    The clock is the caller's and must never go back: the phase clock restarts with every run of
    the phases (--hold), so it cannot be this one. See Note [Rates over one clock].
    """

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s={window_s!r} must be a positive number of seconds")
        self.window_s = window_s
        self._samples: deque[tuple[float, tuple[int, ...]]] = deque()     # (now_s, tokens so far per instance)

    def add(self, now_s: float, tokens: list[int]) -> list[float]:
        """Record the token counts at ``now_s`` and return each one's rate since the newest sample
        at least window_s older (the oldest one early on; 0.0 for the first sample). O(1)
        amortised.

        Raises ValueError, recording nothing, if now_s is before the last sample's time or the
        number of counts changed."""
        if self._samples:
            last_s, last_tokens = self._samples[-1]
            if now_s < last_s:
                raise ValueError(f"now_s={now_s!r} is before the last sample's {last_s!r}: the rates need one "
                                 f"clock that never goes back (time.monotonic())")
            if len(tokens) != len(last_tokens):
                raise ValueError(f"{len(tokens)} token counts, but the earlier samples have {len(last_tokens)}")
        samples = self._samples
        samples.append((now_s, tuple(tokens)))
        while len(samples) > 1 and samples[1][0] <= now_s - self.window_s:
            samples.popleft()
        first_s, first_tokens = samples[0]
        if now_s <= first_s:
            return [0.0] * len(tokens)
        return [(count - first) / (now_s - first_s) for count, first in zip(tokens, first_tokens)]


class _Recorder:
    """Samples per tick; tokens/s from the counters' change over RATE_WINDOW_S."""

    def __init__(self, instances: list[_Instance], budget_name: str) -> None:
        self.instances, self.budget_name = instances, budget_name
        self.samples: list[dict] = []
        self._rates = TokenRates()

    def sample(self, t_s: float, keep: bool) -> dict:
        """What every instance holds and does now (``t_s``: the phase clock, for the record);
        appended to ``samples`` if ``keep``."""
        budget = read_budget(self.budget_name)
        holders = {holder.pid: holder for holder in budget.holders}
        rates = self._rates.add(time.monotonic(),
                                [instance.counters["generated_tokens"] for instance in self.instances])
        rows = []
        for instance, rate in zip(self.instances, rates):
            try:
                snap = read_segment(instance.spec.ipc_name)
                used, reserved = snap.used_bytes, snap.reserved_bytes
            except KVCachedError:
                used = reserved = 0               # the segment is gone: the instance is shutting down
            holder = holders.get(instance.info.get("pid"))
            rows.append({"mapped_bytes": used + reserved, "used_bytes": used, "reserved_bytes": reserved,
                         "share_bytes": holder.share_bytes if holder else 0,
                         "cap_bytes": holder.cap_bytes if holder else None,
                         "demand_bytes": holder.demand_bytes if holder else 0,
                         "clients": instance.clients, **instance.counters, "tokens_per_s": round(rate, 1)})
        record = {"t_s": round(t_s, 3), "held_bytes": budget.held_bytes, "policy": budget.policy, "instances": rows}
        if keep:
            self.samples.append(record)
        return record


def _frame(plan: list[Phase], index: int, t_s: float, sample: dict, instances: list[_Instance], budget_name: str,
           budget_bytes: int, holding: bool) -> Frame:
    rows = tuple(Row(name=inst.spec.name, model=inst.spec.workload.preset,
                     clients=s["clients"], mapped_bytes=s["mapped_bytes"], used_bytes=s["used_bytes"],
                     reserved_bytes=s["reserved_bytes"], running=s["running"], waiting=s["waiting"],
                     preemptions=s["preemptions"], generated_tokens=s["generated_tokens"],
                     tokens_per_s=s["tokens_per_s"])
                 for inst, s in zip(instances, sample["instances"]))
    label = f"phase {index + 1}/{len(plan)}: {plan[index].label}"
    if holding:
        label += " (holding; Ctrl-C stops)"
    return Frame(t_s=t_s, total_s=0.0 if holding else plan[-1].end_s, phase=label, budget_name=budget_name,
                 budget_bytes=budget_bytes, held_bytes=sample["held_bytes"], rows=rows)


def _drive(plan: list[Phase], instances: list[_Instance], recorder: _Recorder, view, budget_bytes: int,
           holding: bool) -> None:
    """Run the phases once (or, holding, over and over until Ctrl-C), a tick at a time."""
    total_s = plan[-1].end_s
    start = next_tick = time.monotonic()
    current = None
    while True:
        t_s = time.monotonic() - start
        index = phase_at(plan, t_s % total_s if holding else t_s)
        if index is None:
            return
        for instance in instances:
            instance.receive()
        if index != current:
            current = index
            for instance, share in zip(instances, plan[index].share):
                instance.set_clients(round(share * instance.spec.workload.clients))
        sample = recorder.sample(t_s, keep=not holding)
        view.show(_frame(plan, index, t_s, sample, instances, recorder.budget_name, budget_bytes, holding))
        next_tick += TICK_S
        time.sleep(max(0.0, next_tick - time.monotonic()))


def _wait_ready(instances: list[_Instance]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all(instance.info for instance in instances):
        for instance in instances:
            instance.receive()
            if not instance.info and not instance.process.is_alive():
                instance.receive()                  # its last words, if any
                raise DemoError(f"instance {instance.spec.name} exited with status {instance.process.exitcode} "
                                f"before it was ready")
        if time.monotonic() > deadline:
            raise DemoError(f"the instances were not ready after {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _hold_commands(budget_name: str, budget_bytes: int, instances: list[_Instance]) -> str:
    first = instances[0].spec.ipc_name
    cap = f"{budget_bytes // 2 >> 20}M"             # half the budget
    commands = (("kvctl list", "both instances: used, reserved, capacity"),
                ("kvtop", "the same, live (q quits)"),
                (f"kvctl budget {budget_name}", "the budget and what each instance holds"),
                (f"kvctl limit {first} {cap}", "cap one instance: it preempts and gives pages back"),
                (f"kvctl limit {first} none", "and lift the cap"))
    width = max(len(command) for command, _ in commands)
    heading = ("The instances keep serving, the phases repeating, until Ctrl-C. "
               "In another terminal (same environment):")
    return "\n".join([heading] +
                     [f"  {command:<{width}}  # {what}" for command, what in commands])


def run(options: Options) -> int:
    """The whole demo; 0 when the phases ran and the PNG was written, 130 on Ctrl-C."""
    tag = f"demo-{os.getpid()}-{secrets.token_hex(2)}"
    cuda = options.device != "cpu"
    workload, budget_bytes = (CUDA_WORKLOAD, CUDA_BUDGET_BYTES) if cuda else (CPU_WORKLOAD, CPU_BUDGET_BYTES)
    specs = [InstanceSpec(name=family, family=family, ipc_name=f"{tag}-{family}", device=options.device,
                          seed=options.seed + i, workload=workload,
                          settings={**POOL_SETTINGS, "KVCACHED_IPC_NAME": f"{tag}-{family}",
                                    "KVCACHED_GLOBAL_BUDGET": tag})
             for i, family in enumerate(FAMILIES)]
    plan = phases(FAMILIES, options.phase_s)
    set_budget(tag, budget_bytes)
    print(f"kvcached demo on {options.device}: two instances ({' and '.join(FAMILIES)}, {workload.preset} models) "
          f"share the global budget {tag} of {format_bytes(budget_bytes)}; the load moves between them in "
          f"{len(plan)} phases of {options.phase_s:g} s.", flush=True)
    context = multiprocessing.get_context("spawn")
    instances: list[_Instance] = []
    try:
        instances = [_Instance(context, spec) for spec in specs]
        print("starting the instances (building the models and their KV caches) ...", flush=True)
        started = time.monotonic()
        _wait_ready(instances)
        print(f"both ready after {time.monotonic() - started:.1f} s:", flush=True)
        for instance in instances:
            info = instance.info
            print(f"  {instance.spec.name}: pid {info['pid']}, segment {info['ipc_name']} (kvctl list shows it), "
                  f"KV capacity {format_bytes(info['capacity_bytes'])} in pages of {format_bytes(info['page_bytes'])} "
                  f"(all layers), {format_bytes(info['token_bytes'])} per token", flush=True)
        recorder = _Recorder(instances, tag)
        with make_view(1 / TICK_S) as view:
            _drive(plan, instances, recorder, view, budget_bytes, holding=False)
        record = {"device": options.device, "budget": {"name": tag, "bytes": budget_bytes},
                  "workload": asdict(workload),
                  "instances": [{"name": i.spec.name, "family": i.spec.family, "preset": workload.preset, **i.info}
                                for i in instances],
                  "phases": [asdict(phase) for phase in plan], "samples": recorder.samples}
        _write(record, options.out_png)
        if options.hold:
            print(_hold_commands(tag, budget_bytes, instances), flush=True)
            with make_view(1 / TICK_S) as view:
                _drive(plan, instances, recorder, view, budget_bytes, holding=True)
        return 0
    except KeyboardInterrupt:
        print("interrupted: stopping the instances", flush=True)
        return 130
    finally:
        # A second Ctrl-C must not cut the clean-up short (the instances ignore SIGINT).
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for instance in instances:
            instance.stop()
        for instance in instances:
            instance.join()
        delete_budget(tag, force=True)
        signal.signal(signal.SIGINT, previous)


def _write(record: dict, out_png: str) -> None:
    json_path = os.path.splitext(out_png)[0] + ".json"
    with open(json_path, "w") as f:
        json.dump(record, f, indent=1)
    plot.write_png(record, out_png)
    summary = []
    for index, instance in enumerate(record["instances"]):
        last = record["samples"][-1]["instances"][index]
        summary.append(f"{instance['name']}: {last['generated_tokens']} tokens generated, "
                       f"{last['preemptions']} preemptions")
    print("; ".join(summary), flush=True)
    for line in figures.describe(record):
        print(line, flush=True)
    print(f"memory per instance over time: {os.path.abspath(out_png)} (samples: {os.path.abspath(json_path)})",
          flush=True)


def terminate_on_sigterm() -> None:
    """SIGTERM takes the same path as Ctrl-C: instances stopped, budget removed."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


# Note [Sizing the demo]
# ~~~~~~~~~~~~~~~~~~~~~~
# The budget must be what limits the instances, so the clients of a busy instance need more KV
# memory than the budget holds: on the CPU, 40 clients with ~150 tokens each in the cache at 512
# bytes per token (the tiny models in fp32) want ~3 MiB against a budget of 2.5 MiB; on CUDA, 64
# clients of the Llama-3-8B shapes in bf16 (128 KiB per token) with ~350 tokens each want ~2.7 GiB
# against 2 GiB. Few tokens are generated per request (16 to 64 on CUDA, 16 to 48 on the CPU) so
# that an idle instance drains its requests early in the next phase. Alone,
# a busy instance maps the whole budget and preempts; with the clients split, each half wants
# ~60% of the budget, so the two compete: the budget is first come, first served (nothing divides
# it), and the instance that had the memory keeps what its clients need while the newcomer runs on
# the rest, preempting. Pages are small on the host backend (8 KiB per buffer, four blocks; a
# page id maps 32 KiB) so that pages empty, and go back to the budget, while an instance is busy;
# a pool of 2 to 4 pages trimmed after 0.3 s idle makes an idle instance give everything back
# within the phase. The kvcached defaults (2 MiB pages, a pool of 5 to 10, trim after 30 s) suit
# an engine, not a 20-second picture.
#
# Note [Rates over one clock]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The rates used to come from a window keyed by the phase clock, which starts again at 0 when
# --hold runs the phases again. The window still held the first run's last second, at times
# ahead of the new ones: nothing aged out, the oldest sample lay in the "future", and the busy
# instance showed 0 tok/s while its tokens climbed, until the new clock passed the old samples'
# times and a rate over ten seconds of tokens divided by a fraction of a second came out (130943
# tok/s). TokenRates takes time.monotonic(), one series for the whole process, and refuses a
# time that goes back. It keeps the newest sample at least window_s old, so a tick that comes
# late (a loaded machine) still has a rate over the real interval rather than none.
