"""The one validator of integer arguments, shared by every public entry point.

Engines pass numpy and torch integers as often as Python ints, so anything with ``__index__`` is
accepted; bools (an int subclass that is always a mistake here) and floats (``16.0``, NaN, inf)
are refused, as is a value outside its bounds. The message names the argument, the value, the
accepted range and, where the caller gives one, the fix.
"""

from __future__ import annotations

import operator

from .errors import KVCachedConfigError


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
