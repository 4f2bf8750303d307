"""Which vLLM releases the integration supports, and the check every entry point runs first.

The elastic BlockPool subclasses vLLM's and relies on the fields and call order of one minor
release (its free queue, ``ref_cnt``, ``_maybe_evict_cached_block``, the coordinator building its
pool by the module-level name ``BlockPool``), which vLLM changes between minors without notice.
"""

from __future__ import annotations

import re
from importlib import metadata

from ...errors import KVCachedConfigError

SUPPORTED_VLLM = ">=0.33.0,<0.34"
SUPPORTED_MINOR = (0, 33)
# The install line of the README's vLLM section: --no-deps keeps the user's own torch, which
# vLLM's requirements would replace with the CUDA build they pin.
INSTALL_COMMAND = "pip install --no-deps vllm==0.33.0"
_RELEASE = re.compile(r"(\d+)\.(\d+)")


def installed_vllm_version() -> str | None:
    """The version string of the installed vllm distribution, or None if there is none."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def check_vllm_version(version: str | None = None) -> str:
    """Return ``version`` (default: the installed one) if it is a supported vLLM release.

    Raises KVCachedConfigError naming the version found and the supported range when vLLM is
    missing, unparsable or of another minor release. O(1); changes nothing.
    """
    if version is None:
        version = installed_vllm_version()
    if version is None:
        raise KVCachedConfigError(
            f"vLLM is not installed; kvcached's vLLM integration supports vllm{SUPPORTED_VLLM}: install it "
            f"with `{INSTALL_COMMAND}` next to your own torch (README: vLLM)")
    match = _RELEASE.match(version)
    if match is None or (int(match[1]), int(match[2])) != SUPPORTED_MINOR:
        raise KVCachedConfigError(
            f"vllm {version} is installed, but kvcached's vLLM integration supports vllm{SUPPORTED_VLLM} "
            f"only (its BlockPool depends on that release's internals): install it with `{INSTALL_COMMAND}` "
            f"next to your own torch, or run vLLM without kvcached (unset KVCACHED_VLLM, do not call enable())")
    return version
