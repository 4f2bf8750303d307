"""``python -m kvcached.demo``: the options, then kvcached.demo.run."""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_OUT = "kvcached-demo.png"
# Seconds per phase, (normal, --quick), on the host backend and on CUDA, where the Llama-3-8B-shaped
# models take longer to fill and drain their caches.
PHASE_S = {"cpu": (4.0, 2.5), "cuda": (8.0, 5.0)}

EPILOG = f"""\
Phases: llama busy -> both busy -> qwen2 busy -> llama busy again. The load is a fixed set of
clients, each sending its next request when the last one finished; the phases move them from one
instance to the other (half each when both are busy). An idle instance finishes what it holds and
its pool is trimmed after 0.3 s, so its pages go back to the budget and the other instance maps
them. When the budget is short, the loop preempts its newest request (blocks freed, the request
recomputed later; none is lost).

The PNG goes to --out (default ./{DEFAULT_OUT}, in the current directory; .png is added to a
path without it, and an existing directory gets {DEFAULT_OUT} inside it), the samples it was
drawn from to the same path with .json instead of .png. --hold keeps both instances serving
afterwards, the phases repeating, until Ctrl-C, and prints the kvctl/kvtop commands to watch them
from another terminal.
"""


def _phase_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 1.0 <= value <= 600.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in [1, 600]")
    return value


def png_path(out: str) -> str:
    """The absolute path of the PNG that ``--out out`` names: ``out`` itself if it ends in .png,
    ``out/kvcached-demo.png`` for an existing directory, else ``out`` with .png added.

    Raises ValueError naming the path and the fix when its directory does not exist or the PNG
    or the JSON beside it would have to replace a directory."""
    path = os.path.abspath(out)
    if os.path.isdir(path):
        path = os.path.join(path, DEFAULT_OUT)
    elif not path.lower().endswith(".png"):
        path += ".png"
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise ValueError(f"--out {out!r}: directory {folder} does not exist; create it or pick another path")
    for target in (path, os.path.splitext(path)[0] + ".json"):
        if os.path.isdir(target):
            raise ValueError(f"--out {out!r}: {target} is a directory; name a file, or that directory to write "
                             f"{DEFAULT_OUT} inside it")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcached.demo", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Two models share one device's KV memory under a global budget; the memory follows the load. "
                    "About 30 s on a 2-core CPU (host backend); --quick takes about 20 s.")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: CUDA if usable, else cpu: the host backend)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="PATH",
                        help=f"where to write the PNG (default: ./{DEFAULT_OUT}; .png is added if missing, a "
                             f"directory gets {DEFAULT_OUT} inside it); the samples go beside it as .json")
    parser.add_argument("--phase-seconds", type=_phase_seconds, default=None, metavar="S",
                        help="length of each of the 4 phases (default: 4 on cpu, 8 on CUDA; 2.5 and 5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="short phases, for tests and a first look")
    parser.add_argument("--hold", action="store_true",
                        help="after the run, keep the instances serving until Ctrl-C (try kvctl list / kvtop)")
    args = parser.parse_args(argv)

    from ..errors import KVCachedConfigError
    from ..runtime import resolve_device
    from .run import DemoError, Options, run, terminate_on_sigterm

    try:
        device = resolve_device(args.device)
    except KVCachedConfigError as exc:
        parser.error(str(exc))
    try:
        out_png = png_path(args.out)
    except ValueError as exc:
        parser.error(str(exc))
    phase_s = args.phase_seconds or PHASE_S["cpu" if device == "cpu" else "cuda"][args.quick]
    terminate_on_sigterm()
    try:
        return run(Options(device=device, out_png=out_png, phase_s=phase_s, hold=args.hold))
    except DemoError as exc:
        print(f"kvcached demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
