"""Launches against the GPU's multiprocessors: how many programs of a compiled kernel one holds,
and which launch choice leaves the fullest last wave. Host-side only; no triton import, so the
rule runs (and is tested) on any machine. See Note [Pipeline stages] in triton_decode."""

from __future__ import annotations

import math


def programs_per_sm(kernel: object) -> int:
    """How many programs of a compiled Triton kernel one multiprocessor holds at once, as the
    driver counts it from the kernel's registers, shared memory and threads; 1 where the driver
    cannot say (every choice then ties)."""
    from cuda.bindings import driver

    kernel._init_handles()      # type: ignore[attr-defined]  # loads the binary: its function handle exists from then on
    metadata = kernel.metadata  # type: ignore[attr-defined]
    status, programs = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        driver.CUfunction(kernel.function), metadata.num_warps * 32, metadata.shared)  # type: ignore[attr-defined]
    return int(programs) if status == driver.CUresult.CUDA_SUCCESS and programs > 0 else 1


def fullest_last_wave(programs: int, per_sm: dict[int, int], sms: int) -> int:
    """The choice (a key of ``per_sm``: how many programs a multiprocessor holds with it) whose
    last wave of ``programs`` over ``sms`` multiprocessors is the fullest; the first on a tie."""
    def fill(choice: int) -> float:
        waves = programs / (per_sm[choice] * sms)
        return waves / math.ceil(waves)
    return max(per_sm, key=fill)
