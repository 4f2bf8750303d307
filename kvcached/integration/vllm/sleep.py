"""vLLM's sleep mode with kvcached: a sleep-mode backend that gives the KV cache's pages back to
kvcached on sleep and makes the pools usable again on wake-up.

vLLM 0.33 selects the mechanism of ``LLM.sleep()`` / ``wake_up()`` by name
(``sleep_mode_backend``, ``SleepModeBackendFactory``); ``enable()`` registers this one as
``"kvcached"``. Weights and the other tagged allocations stay with vLLM's CuMem allocator where
the platform has one. See Note [Sleep] in block_pool and Note [A sleep-mode backend] below.

Importing this module imports vLLM; it changes nothing in vLLM (``enable()`` registers).
"""

from __future__ import annotations

from vllm.device_allocator.sleep_mode_backend import CuMemBackend, SleepModeBackend, SleepModeBackendFactory
from vllm.platforms import current_platform

from ...errors import KVCachedConfigError
from .block_pool import live_pools

BACKEND_NAME = "kvcached"
KV_CACHE_TAG = "kv_cache"


def register_sleep_backend() -> None:
    """Register KVCachedSleepBackend with vLLM as sleep_mode_backend="kvcached". Idempotent."""
    try:
        SleepModeBackendFactory.get_backend_class(BACKEND_NAME)
    except ValueError:                  # not registered yet
        SleepModeBackendFactory.register_backend(BACKEND_NAME, __name__, KVCachedSleepBackend.__name__)


def release_kv_cache() -> int:
    """Put every live ElasticBlockPool of this process to sleep (ElasticBlockPool.sleep): no KV
    page stays mapped and none is handed out until restore_kv_cache(). Returns the number of pools.

    Raises BlockStateError, with no pool changed, while a pool has a block in use. O(blocks)."""
    pools = live_pools()
    busy = [pool for pool in pools if not pool.asleep
            and pool.free_block_queue.num_free_blocks != pool.num_gpu_blocks - 1]
    if busy:                            # all or nothing: refused before any pool sleeps
        busy[0].sleep()                 # raises BlockStateError, naming its blocks in use
    for pool in pools:
        pool.sleep()
    return len(pools)


def restore_kv_cache() -> int:
    """Wake every sleeping ElasticBlockPool of this process (ElasticBlockPool.wake_up). Returns
    the number of pools woken."""
    asleep = [pool for pool in live_pools() if pool.asleep]
    for pool in asleep:
        pool.wake_up()
    return len(asleep)


class KVCachedSleepBackend(SleepModeBackend):
    """vLLM's sleep-mode backend for engines whose KV cache is kvcached's: the KV cache's pages go
    back to kvcached on suspend (and on discard of the "kv_cache" tag) and the pools become
    usable on resume; everything else (weights, runtime state, CUDA graphs) goes through vLLM's
    CuMem backend where the platform has sleep mode, and stays where it is otherwise (CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self._cumem = CuMemBackend() if current_platform.is_sleep_mode_available() else None

    def suspend(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise KVCachedConfigError(f"sleep level={level!r}: vLLM's sleep-mode backends take level 1 (offload "
                                      f"weights) or 2 (discard them); level 0 pauses the scheduler only")
        release_kv_cache()              # raises, nothing changed, while a block is in use
        if self._cumem is not None:
            try:
                self._cumem.suspend(level)
            except BaseException:
                restore_kv_cache()
                raise
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        if self._cumem is not None:
            self._cumem.resume(tags)
        if tags is None or KV_CACHE_TAG in tags:
            restore_kv_cache()
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        if KV_CACHE_TAG in tags:
            release_kv_cache()
        others = tuple(tag for tag in tags if tag != KV_CACHE_TAG)
        if others:
            if self._cumem is None:
                raise KVCachedConfigError(
                    f"discard({tags!r}): this platform ({type(current_platform).__name__}) has no sleep-mode "
                    f"allocator for {others!r}; kvcached discards only the {KV_CACHE_TAG!r} tag here")
            self._cumem.discard(others)
        self._state = "SUSPENDED"

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True         # as CuMemBackend: memory is released, communicators are untouched


# Note [A sleep-mode backend]
# vLLM's default sleep backend ("cumem") releases what was allocated inside its CuMem pools; the
# KV allocation runs inside the "kv_cache" pool, but kvcached's tensors are views of kvcached's
# own virtual ranges, so that pool is empty and a cumem sleep would free nothing of the KV cache
# (and wake would remap nothing). vLLM 0.33 selects the backend by name
# (ModelConfig.sleep_mode_backend, SleepModeBackendFactory, which third parties register with
# from a general plugin): enable() registers this one, and allocate_kv_cache refuses sleep mode
# with another backend, naming this one. The KV part is the pools' (Note [Sleep] in block_pool):
# the worker's backend runs in the scheduler's process (Note [One process]), so it reaches the
# pools that own the pages. The rest is delegated to CuMemBackend unchanged where vLLM has sleep
# mode (CUDA, ROCm, XPU); on vLLM's CPU platform there is nothing else to release.
