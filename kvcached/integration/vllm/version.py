"""Which vLLM releases the integration supports, and the check every entry point runs first.

The elastic BlockPool extends vLLM's through its public methods (Note [Extending vLLM's pool]),
and enable() rebinds the names vLLM builds its pool and KV tensors by; both are checked against
each supported minor release by CI (vLLM's own tests/v1/core with this pool, .ci/run_vllm).
Anything that differs between the supported releases is kept here, in SUPPORTED_RELEASES.
"""

from __future__ import annotations

import re
from importlib import metadata

from ...errors import KVCachedConfigError

# minor release -> the release CI pins for it (.ci/vllm_env.sh); the newest last.
SUPPORTED_RELEASES: dict[tuple[int, int], str] = {(0, 32): "0.32.0", (0, 33): "0.33.0"}
SUPPORTED_VLLM = ">=0.32.0,<0.34"
# The install line of the README's vLLM section: --no-deps keeps the user's own torch, which
# vLLM's requirements would replace with the CUDA build they pin.
INSTALL_COMMAND = f"pip install --no-deps vllm=={SUPPORTED_RELEASES[max(SUPPORTED_RELEASES)]}"
_RELEASE = re.compile(r"(\d+)\.(\d+)")


def supported_minors() -> str:
    """The supported minor releases in words, e.g. "0.32.x and 0.33.x"."""
    names = [f"{major}.{minor}.x" for major, minor in sorted(SUPPORTED_RELEASES)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def installed_vllm_version() -> str | None:
    """The version string of the installed vllm distribution, or None if there is none."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def check_vllm_version(version: str | None = None) -> str:
    """Return ``version`` (default: the installed one) if it is a supported vLLM release.

    Raises KVCachedConfigError naming the version found and the supported releases when vLLM is
    missing, unparsable or of another minor release. O(1); changes nothing.
    """
    if version is None:
        version = installed_vllm_version()
    if version is None:
        raise KVCachedConfigError(
            f"vLLM is not installed; kvcached's vLLM integration supports vllm {supported_minors()} "
            f"(vllm{SUPPORTED_VLLM}): install it with `{INSTALL_COMMAND}` next to your own torch (README: vLLM)")
    match = _RELEASE.match(version)
    if match is None or (int(match[1]), int(match[2])) not in SUPPORTED_RELEASES:
        raise KVCachedConfigError(
            f"vllm {version} is installed, but kvcached's vLLM integration supports vllm {supported_minors()} "
            f"(vllm{SUPPORTED_VLLM}) only, the releases its BlockPool is tested against: install one with "
            f"`{INSTALL_COMMAND}` next to your own torch, or run vLLM without kvcached (unset KVCACHED_VLLM, do "
            f"not call enable())")
    return version
