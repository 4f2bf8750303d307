"""The validators of arguments shared by every public entry point: integers, and kv_layout.

Engines pass numpy and torch integers as often as Python ints, so anything with ``__index__`` is
accepted; bools (an int subclass that is always a mistake here) and floats (``16.0``, NaN, inf)
are refused, as is a value outside its bounds. The message names the argument, the value, the
accepted range and, where the caller gives one, the fix.

``kv_layout`` is checked here because the runtime, the layouts, the ops and the serving caches
all take it, and the ops and serving may import only the public API, which the layouts are not.
"""

from __future__ import annotations

import operator

from .errors import KVCachedArgumentError, KVCachedConfigError

KV_LAYOUTS = ("NHD", "HND")     # a block's tokens before its heads, or its heads before its tokens


def as_int(value: object, name: str, *, minimum: int | None = None, maximum: int | None = None,
           hint: str = "", error: type[Exception] = KVCachedConfigError) -> int:
    """``value`` as a Python int within [minimum, maximum] (either bound may be None).

    Raises ``error`` (KVCachedConfigError unless the caller names another, e.g. ValueError) for a
    bool, a non-integer or a value out of bounds. O(1).
    """
    number = None
    if not isinstance(value, bool) and not (hasattr(value, "dtype") and str(value.dtype) == "bool"):
        try:
            number = operator.index(value)  # type: ignore[arg-type]  # checked by the except
        except TypeError:
            number = None
    if number is None or (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise error(f"{name}={value!r} must be {_describe(minimum, maximum)}{'; ' + hint if hint else ''}")
    return number


def _describe(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum == 1:
        return "a positive int"
    if minimum is not None:
        return f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def check_kv_layout(kv_layout: object, *, has_heads: bool = True) -> str:
    """``kv_layout`` if it is one of KV_LAYOUTS; "HND" only where a block has a head dimension
    (``has_heads``: not MLA's latent buffer).

    Raises KVCachedArgumentError (a KVCachedConfigError and a ValueError) naming the value and
    the fix. O(1).
    """
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise KVCachedArgumentError(
            f"kv_layout={kv_layout!r} is unknown; use 'NHD' ([blocks, block_size, heads, dim]) or 'HND' "
            f"([blocks, heads, block_size, dim])")
    if kv_layout == "HND" and not has_heads:
        raise KVCachedArgumentError("kv_layout='HND' has no meaning for MLA (no head dimension); use NHD")
    return kv_layout  # type: ignore[return-value]  # one of KV_LAYOUTS, checked above
