import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pytest_addoption(parser):
    parser.addoption("--bench-device", choices=("cpu", "cuda"), default="cpu",
                     help="backend of the manager benchmarks (test_bench_manager.py); default cpu")


@pytest.fixture(scope="session")
def bench_device(request):
    device = request.config.getoption("--bench-device")
    if device == "cuda":
        from kvcached.core import cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason is not None:
            pytest.skip(f"--bench-device cuda: {reason}")
    return device
