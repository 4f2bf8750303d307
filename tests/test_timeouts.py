"""The suite's own guard: a test that hangs fails alone, with a traceback, within the timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_test_has_a_timeout(pytestconfig):
    assert float(pytestconfig.getini("timeout")) > 0, "pyproject.toml sets no per-test timeout"


@pytest.mark.slow
def test_a_hanging_test_fails_alone_with_a_traceback(tmp_path):
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import threading

        def test_hangs():
            threading.Event().wait()

        def test_after():
            pass
    """))
    # the project's configuration, with its timeout cut to 2 s
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", os.path.join(REPO, "pyproject.toml"),
                           "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-o", "timeout=2",
                           str(tmp_path / "test_hang.py")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Timeout" in out and "test_hangs" in out and "1 failed, 1 passed" in out, out
