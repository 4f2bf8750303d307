"""The table of KVCACHED_* settings: type, default, bounds and meaning, parsed and validated once.

Nothing else in kvcached reads the environment. ``settings()`` reads it on first use and caches
the result; ``reload_settings()`` reads it again (tests, or after ``shutdown_kvcached``).

A ``KVCACHED_*`` variable that is no setting (not in SETTINGS, nor in NOT_SETTINGS) is most likely
a misspelling, which would otherwise be ignored without a word: reading the settings warns once
per process per name, with ``warnings.warn(..., UnknownSettingWarning)``, naming the closest
setting. A setting of a global budget set without ``KVCACHED_GLOBAL_BUDGET`` has no effect, and
warns likewise (``IgnoredSettingWarning``). See Note [Warning of unknown variables].

Every value is checked here against what its users accept (a size against the int64 fields of
the budget's segment, a name against what names a segment), so that every error of a setting
names its variable; See Note [Errors name the variable].
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from .errors import KVCachedConfigError
from .limits import I64_MAX
from .sizes import SIZE_HELP, parse_size

LAYOUTS = ("auto", "per_layer", "interleaved", "page_grouped")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], object]
    default: object
    doc: str


_INT_RE = re.compile(r"\s*[+-]?[0-9]+\s*")


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not _INT_RE.fullmatch(text):
            raise ValueError(f"must be a whole number in [{lo}, {hi}]")
        try:
            value = int(text)
        except ValueError:              # more digits than int() converts: far out of range
            raise ValueError(f"must be in [{lo}, {hi}]") from None
        if not lo <= value <= hi:
            raise ValueError(f"must be in [{lo}, {hi}]")
        return value

    return parse


def _float_in(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"must be a number of seconds in [{lo}, {hi}]") from None
        if not lo <= value <= hi:              # NaN fails this too
            raise ValueError(f"must be in [{lo}, {hi}]")
        return value

    return parse


def _choice(options: tuple[str, ...], upper: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().upper() if upper else text.strip().lower()
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return value

    return parse


def _auto_or(parse: Callable[[str], object]) -> Callable[[str], object]:
    """"auto", or what `parse` accepts."""
    def parse_or_auto(text: str) -> object:
        if text.strip().lower() == "auto":
            return "auto"
        try:
            return parse(text)
        except ValueError as exc:
            raise ValueError(f"must be auto or {str(exc).removeprefix('must be ')}") from None

    return parse_or_auto


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be 0/1, true/false, yes/no or on/off")


def _size(text: str) -> int:
    """Bytes, at most I64_MAX: what the budget's segment stores sizes in."""
    value = parse_size(text)
    if value > I64_MAX:
        raise ValueError(f"must be at most {I64_MAX} bytes (8 EiB - 1, what the budget's int64 fields hold), "
                         f"not {value}")
    return value


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("must be a number in [0.001, 1000000]") from None
    if not 0.001 <= value <= 1e6:              # NaN fails this too
        raise ValueError("must be in [0.001, 1000000]")
    return value


MAX_NAME_BYTES = 200        # most UTF-8 bytes of an instance or budget name (kvcached.shm.files)


def _name(text: str) -> str:
    value = text.strip()
    try:
        encoded = value.encode()
    except UnicodeEncodeError:      # os.environ keeps undecodable bytes as lone surrogates
        raise ValueError("is not valid UTF-8; use letters, digits, '_', '-' or '.'") from None
    if (not value or value in (".", "..") or "/" in value or not value.isprintable()
            or len(encoded) > MAX_NAME_BYTES):
        raise ValueError(f"must be a non-empty name of at most {MAX_NAME_BYTES} UTF-8 bytes, without '/' or "
                         f"unprintable characters; use letters, digits, '_', '-' or '.'")
    return value


SETTINGS: tuple[Setting, ...] = (
    Setting("KVCACHED_PAGE_SIZE_MB", _int_in(1, 1024), 2,
            "Page size of one KV buffer in MiB; a multiple of the driver granularity (2 MiB on CUDA)."),
    Setting("KVCACHED_MIN_RESERVED_PAGES", _int_in(0, 1 << 20), 5,
            "The background thread keeps at least this many mapped, unused pages ready."),
    Setting("KVCACHED_MAX_RESERVED_PAGES", _int_in(0, 1 << 20), 10,
            "Freed pages beyond this many mapped, unused pages are unmapped."),
    Setting("KVCACHED_LAYOUT", _choice(LAYOUTS), "auto",
            "Memory layout of the KV tensors; auto picks per platform (see kvcached.layout)."),
    Setting("KVCACHED_ZERO_PAGE", _bool, False,
            "Back every unallocated page with one shared read-only zero page."),
    Setting("KVCACHED_IDLE_TRIM_S", _float_in(0.0, 86400.0), 30.0,
            "Seconds without alloc/free after which the reserved pool is trimmed; 0 disables."),
    Setting("KVCACHED_TRACKER", _bool, True,
            "Publish usage and accept limits through a shared-memory segment (kvctl, kvtop)."),
    Setting("KVCACHED_IPC_NAME", _name, None,
            "Name of this instance's shared-memory segment; default kvcached_<pid>_<n>."),
    Setting("KVCACHED_GLOBAL_BUDGET", _name, None,
            "Name of a shared budget segment; instances naming the same one never map more in sum."),
    Setting("KVCACHED_GLOBAL_BUDGET_BYTES", _size, None,
            f"Size of the global budget, used when this instance creates it: {SIZE_HELP}."),
    Setting("KVCACHED_GLOBAL_BUDGET_POLICY", _choice(("fair", "first_come")), "fair",
            "How the holders of a global budget share it, used when this instance creates it: fair "
            "(weighted max-min shares, enforced while someone waits) or first_come."),
    Setting("KVCACHED_SHARE_WEIGHT", _weight, 1.0,
            "This instance's weight in a fair global budget: holders with unmet demand share it in "
            "proportion to their weights."),
    Setting("KVCACHED_SHARE_MIN", _size, 0,
            f"Bytes of a fair global budget guaranteed to this instance as far as it wants them: {SIZE_HELP}."),
    Setting("KVCACHED_LOG_LEVEL", _choice(LOG_LEVELS, upper=True), "WARNING",
            "Logging level of the kvcached logger."),
    Setting("KVCACHED_DEBUG_CHECKS", _bool, False,
            "Run check_invariants() after every allocator step (slow; for debugging)."),
    Setting("KVCACHED_TP_TIMEOUT_S", _float_in(0.1, 86400.0), 60.0,
            "Seconds the scheduling rank waits for a tensor-parallel peer to answer a page operation "
            "before the call raises KVCachedTPError (the peer died or hangs)."),
    Setting("KVCACHED_TP_TRANSPORT", _choice(("auto", "shm", "gloo")), "auto",
            "How the scheduling rank of a tensor-parallel instance reaches the other ranks: shm (rounds in "
            "a shared-memory segment, the ranks of one host), gloo (messages over torch.distributed, any "
            "host), or auto (shm when every rank could map the segment, else gloo). Set the same on every rank."),
    Setting("KVCACHED_TP_SPIN_US", _auto_or(_int_in(0, 100_000)), "auto",
            "Microseconds a rank polls for the other side of a shared-memory round before it sleeps on "
            "the semaphore: a wake-up from sleep costs tens of microseconds on an idle many-core host, "
            "polling costs a core the other side may need on a small one. auto: 50 where the process "
            "may run on at least 4 CPUs, else 0."),
    Setting("KVCACHED_VLLM", _bool, False,
            "Let vLLM's plugin loader enable kvcached (kvcached.integration.vllm.register); off, "
            "installing kvcached changes nothing in vLLM."),
)


# KVCACHED_* variables of this project's own scripts and CI, read by them and not by kvcached:
# no warning for these. .ci/vllm_pool_plugin.py: which pool vLLM's tests run and its page size;
# scripts/gpu_check.sh: the commit its report names; .ci/vllm_env.sh: where vLLM's venvs go and
# whether a finished one is kept.
NOT_SETTINGS = frozenset({"KVCACHED_VLLM_POOL", "KVCACHED_VLLM_PAGE_BYTES", "KVCACHED_COMMIT",
                          "KVCACHED_CI_VLLM_DIR", "KVCACHED_CI_VLLM_REUSE"})
_NAMES = tuple(s.name for s in SETTINGS)


# The settings of a global budget: without KVCACHED_GLOBAL_BUDGET there is none, and they do nothing.
BUDGET_SETTINGS = ("KVCACHED_GLOBAL_BUDGET_BYTES", "KVCACHED_GLOBAL_BUDGET_POLICY", "KVCACHED_SHARE_WEIGHT",
                   "KVCACHED_SHARE_MIN")


class UnknownSettingWarning(UserWarning):
    """A KVCACHED_* environment variable that is no setting: kvcached ignores it."""


class IgnoredSettingWarning(UserWarning):
    """A setting that has no effect as the environment stands: kvcached ignores it."""


def unknown_settings(environ: Mapping[str, str]) -> dict[str, str | None]:
    """{name: the closest setting's name, or None} for every ``KVCACHED_*`` variable of
    ``environ`` that is neither a setting nor in NOT_SETTINGS, sorted by name. O(variables x
    settings)."""
    return {name: _closest(name) for name in sorted(environ)
            if name.startswith("KVCACHED_") and name not in _NAMES and name not in NOT_SETTINGS}


def _closest(name: str) -> str | None:
    """The setting ``name`` most likely misspells, compared without the common prefix (which
    would make every name look close)."""
    suffixes = [known[len("KVCACHED_"):] for known in _NAMES]
    match = difflib.get_close_matches(name[len("KVCACHED_"):], suffixes, n=1)
    return f"KVCACHED_{match[0]}" if match else None


def ignored_settings(environ: Mapping[str, str]) -> list[str]:
    """The settings of ``environ`` that have no effect: those of BUDGET_SETTINGS while
    KVCACHED_GLOBAL_BUDGET is not set. O(1)."""
    if "KVCACHED_GLOBAL_BUDGET" in environ:
        return []
    return [name for name in BUDGET_SETTINGS if name in environ]


_warned: set[str] = set()  # the unknown and ignored names this process has warned of


def _warn_of_unused(environ: Mapping[str, str]) -> None:
    """One UnknownSettingWarning per unknown name and process; one IgnoredSettingWarning naming
    the ignored settings not warned of yet. See Note [Warning of unknown variables]."""
    for name, closest in unknown_settings(environ).items():
        if name in _warned:
            continue
        _warned.add(name)
        hint = f"did you mean {closest}?" if closest else "no setting has a similar name."
        warnings.warn(f"{name} is not a kvcached setting and is ignored; {hint} The settings are "
                      "the table in kvcached/config.py (README: Configuration).",
                      UnknownSettingWarning, stacklevel=3)
    ignored = [name for name in ignored_settings(environ) if name not in _warned]
    if ignored:
        _warned.update(ignored)
        one = len(ignored) == 1
        them = "it" if one else "them"
        warnings.warn(f"{', '.join(ignored)} {'is' if one else 'are'} set, but KVCACHED_GLOBAL_BUDGET is not: this "
                      f"instance shares no global budget and ignores {them}. Set KVCACHED_GLOBAL_BUDGET to the name "
                      f"of the budget the instances share, or unset {them}.", IgnoredSettingWarning, stacklevel=3)


@dataclass(frozen=True)
class Settings:
    page_size_mb: int
    min_reserved_pages: int
    max_reserved_pages: int
    layout: str
    zero_page: bool
    idle_trim_s: float
    tracker: bool
    ipc_name: str | None
    global_budget: str | None
    global_budget_bytes: int | None
    global_budget_policy: str
    share_weight: float
    share_min: int
    log_level: str
    debug_checks: bool
    tp_timeout_s: float
    tp_transport: str
    tp_spin_us: int | str           # "auto" or microseconds
    vllm: bool


def _read(environ: dict[str, str]) -> Settings:
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        raw = environ.get(setting.name)
        if raw is None:
            values[setting.name] = setting.default
            continue
        try:
            values[setting.name] = setting.parse(raw)
        except ValueError as exc:
            raise KVCachedConfigError(
                f"{setting.name}={raw!r} is invalid: {exc}. {setting.doc} Default: {setting.default!r}."
            ) from None
    lo, hi = values["KVCACHED_MIN_RESERVED_PAGES"], values["KVCACHED_MAX_RESERVED_PAGES"]
    if lo > hi:
        raise KVCachedConfigError(
            f"KVCACHED_MIN_RESERVED_PAGES={lo} exceeds KVCACHED_MAX_RESERVED_PAGES={hi}: "
            f"set the minimum to at most {hi} or the maximum to at least {lo}."
        )
    return Settings(*(values[s.name] for s in SETTINGS))


_cached: Settings | None = None


def settings() -> Settings:
    """The settings of this process, read from the environment on first use."""
    global _cached
    if _cached is None:
        environ = dict(os.environ)
        _warn_of_unused(environ)
        _cached = _read(environ)
    return _cached


def reload_settings() -> Settings:
    """Read the environment again (after it changed), validating every value."""
    global _cached
    _cached = None
    return settings()


# Note [Warning of unknown variables]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# KVCACHED_PAGE_SIZE=4 (for KVCACHED_PAGE_SIZE_MB) was ignored silently: the instance ran with
# 2 MiB pages and nothing said why. An unknown name cannot be refused the way a bad value is
# (KVCachedConfigError): other tools share the prefix (NOT_SETTINGS lists this project's own),
# and an old deployment's leftover variable must not stop a server. So it warns, once per name
# and process (settings are read again after every shutdown_kvcached), with the closest name
# difflib finds in SETTINGS. warnings.warn rather than the kvcached logger: it reaches stderr
# even when the application configured no logging (and before KVCACHED_LOG_LEVEL applies), it
# names its category, so `-W error::kvcached.config.UnknownSettingWarning` makes a CI job fail
# on a misspelling, and an application can silence it with the warnings filter.
# A budget's settings (BUDGET_SETTINGS) without KVCACHED_GLOBAL_BUDGET are known names that do
# nothing (an operator set the weight and forgot the budget's name): the same warning, once per
# name and process, as an IgnoredSettingWarning naming them and the fix.
#
# Note [Errors name the variable]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A value the table took but its user refused raised later, in the words of that user:
# KVCACHED_GLOBAL_BUDGET_BYTES=9999999999P parsed (2**83 bytes) and the budget then refused
# "budget_bytes=... must be an int in [0, I64_MAX]", naming no variable. So each parser accepts
# only what its users accept: sizes up to I64_MAX (every size setting ends in an int64 field of a
# segment), names printable as a segment's name must be (kvcached.shm.files.validate_name).
# The settings' users still check what they are given, as any caller's arguments.
