"""kvcached's background threads: daemons that never take a signal meant for the application.

A signal sent to the process (``kill``, Ctrl-C) goes to any thread that does not block it. A
Python handler runs only on the main thread, but if the kernel picks one of kvcached's threads,
the main thread is not woken: blocked in ``read()``, a server would sit through a Ctrl-C until
the read returns. So each thread starts with the asynchronous signals blocked (its creator blocks
them around ``start``, and the new thread inherits that mask from its first instruction). The
synchronous ones (a fault in that thread itself) stay deliverable.

Pure Python, imports nothing of kvcached.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

SYNCHRONOUS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP,
               signal.SIGSYS, signal.SIGABRT}
BLOCKED = signal.valid_signals() - SYNCHRONOUS


def start_daemon(target: Callable[..., object], name: str, args: tuple = ()) -> threading.Thread:
    """Start ``target(*args)`` on a new daemon thread named ``name`` with ``BLOCKED`` blocked;
    the calling thread's own mask is as before once it returns."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    return thread
