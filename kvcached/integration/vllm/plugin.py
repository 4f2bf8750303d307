"""Switching kvcached into vLLM and out again: the ``vllm.general_plugins`` entry point and
``enable()`` / ``disable()`` for code that builds the engine itself.

Nothing happens at import time. ``enable()`` rebinds two module-level names that vLLM looks up
when it builds its KV cache, and ``disable()`` puts vLLM's own objects back. See Note [Hooks].
The entry point ``register()`` does nothing unless KVCACHED_VLLM=1: See Note [An opt-in entry
point].
"""

from __future__ import annotations

import importlib
import logging
import threading

from ...config import settings
from ...errors import KVCachedConfigError
from .version import check_vllm_version

logger = logging.getLogger("kvcached")

SCHEDULER_HOOKS = (("vllm.v1.core.kv_cache_coordinator", "BlockPool"),)
WORKER_HOOKS = (("vllm.v1.worker.gpu_model_runner", "allocate_kv_cache"),
                ("vllm.v1.worker.gpu.attn_utils", "allocate_kv_cache"))

_lock = threading.Lock()
_saved: dict[tuple[str, str], object] = {}      # (module, name) -> vLLM's own object


def register() -> None:
    """The ``vllm.general_plugins`` entry point, which vLLM calls in every process it starts (maybe
    more than once) once kvcached is installed: nothing unless KVCACHED_VLLM=1, then ``enable()``;
    where that cannot work (vLLM missing or of another release, its worker modules not importable)
    one warning on the ``kvcached`` logger, and vLLM is left as it is. A bad KVCACHED_* value
    is that one warning too (the settings' own error, naming the variable). Never raises. See
    Note [An opt-in entry point]."""
    try:
        if not settings().vllm:
            return
    except KVCachedConfigError as exc:
        logger.warning("kvcached's vLLM plugin leaves vLLM as it is: %s", exc)
        return
    try:
        enable()
    except (KVCachedConfigError, ImportError) as exc:      # ImportError: a vLLM whose own modules fail
        logger.warning("KVCACHED_VLLM=1, but kvcached is not enabled in vLLM, which runs as it is: %s", exc)


def enable(*, worker: bool = True) -> None:
    """Make vLLM build its scheduler's BlockPool as an ElasticBlockPool and, with worker=True,
    its KV cache tensors with kvcached (allocate_kv_cache) and register the sleep-mode backend
    "kvcached" (kvcached.integration.vllm.sleep). Idempotent.

    Raises KVCachedConfigError, changing nothing, for an unsupported vLLM version or a worker
    module that cannot be imported. Logs the vLLM release it found and the names it rebound."""
    version = check_vllm_version()
    from .block_pool import ElasticBlockPool

    hooks: list[tuple[str, str, object]] = [(module, name, ElasticBlockPool) for module, name in SCHEDULER_HOOKS]
    if worker:
        from .kv_tensors import allocate_kv_cache

        hooks += [(module, name, allocate_kv_cache) for module, name in WORKER_HOOKS]
        try:
            from .sleep import register_sleep_backend
        except ImportError as exc:
            raise KVCachedConfigError(f"kvcached cannot hook into vLLM's sleep mode: {exc}") from exc
    with _lock:
        targets = [(_import(module), module, name, replacement) for module, name, replacement in hooks]
        for target, module, name, replacement in targets:
            current = getattr(target, name)
            if current is replacement:
                continue
            _saved.setdefault((module, name), current)
            setattr(target, name, replacement)
        if worker:
            register_sleep_backend()    # stays registered: See Note [Hooks]
    logger.info("kvcached enabled in vLLM %s: %s", version, ", ".join(f"{m}.{n}" for m, n, _ in hooks))


def disable() -> None:
    """Put vLLM's own BlockPool and allocate_kv_cache back where enable() replaced them (pools
    and tensors already made stay as they are). Idempotent."""
    with _lock:
        for (module, name), original in list(_saved.items()):
            setattr(importlib.import_module(module), name, original)
            del _saved[(module, name)]


def is_enabled() -> bool:
    """Whether enable() replaced anything that disable() has not put back."""
    with _lock:
        return bool(_saved)


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise KVCachedConfigError(f"kvcached cannot hook into vLLM: importing {module} failed ({exc}); install "
                                  f"vLLM's dependencies for this platform, or call enable(worker=False) to "
                                  f"make only the scheduler elastic") from exc


# Note [Hooks]
# vLLM's KVCacheCoordinator builds its pool as `BlockPool(...)`, a name it looks up in its own
# module (vllm.v1.core.kv_cache_coordinator) when the scheduler is made; the GPU model runners
# call `allocate_kv_cache(...)` from their modules when the KV cache is initialised. Rebinding
# those names is the narrowest switch vLLM 0.32 and 0.33 offer (no configuration option selects a pool
# class or a KV allocator): vllm.v1.core.block_pool.BlockPool itself stays vLLM's class, so
# anything else that subclasses or builds it is untouched. The sleep-mode backend "kvcached" is
# registered in vLLM's SleepModeBackendFactory (Note [A sleep-mode backend]); vLLM has no call
# that unregisters one, so disable() leaves it there, used only by an engine that names it. The
# names are rebound only by
# enable(), which the plugin entry point calls (KVCACHED_VLLM=1) or the user calls before building
# the engine; the version check comes first: only the releases CI tests the pool against are enabled.
#
# Note [An opt-in entry point]
# vLLM calls every vllm.general_plugins entry point in every process it starts, so a plain
# `pip install kvcached` beside vLLM would swap its BlockPool and KV allocation with no one
# asking, and on another vLLM release (or without its GPU worker modules) make vLLM fail to
# start. register() therefore reads KVCACHED_VLLM (kvcached.config) first and returns at once
# unless it is set, importing nothing of vLLM. Set, it calls enable(); what enable() refuses
# (KVCachedConfigError, nothing rebound), or a vLLM that fails to import its own scheduler
# modules (ImportError), becomes one warning and vLLM runs with its own pool, as it would
# without kvcached: the plugin must never be the reason vLLM does not start. So is a
# bad KVCACHED_* value (the switch itself, or any other: the table is read whole), which
# everywhere else raises KVCachedConfigError: the warning is that error's message, naming the
# variable and its fix. enable() called by the user's own code raises all of these: there the
# call is the request.
