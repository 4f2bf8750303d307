"""Clean-up that runs every step even when one fails, then raises the first failure.

Shared by the manager's teardown and the runtime's shutdown: a failing step (a driver error while
unmapping, a tracker that cannot unlink its segment) must not leave the steps after it undone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Steps:
    """Run clean-up steps with ``run``; ``raise_first`` raises the first that failed, if any."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []

    def run(self, action: Callable[..., Any], *args: Any) -> None:
        """Call ``action(*args)``; keep an Exception it raises for ``raise_first``."""
        try:
            action(*args)
        except Exception as exc:            # keep cleaning up; the first failure is raised at the end
            self.errors.append(exc)

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]
