"""Sizes as operators type them (512M, 1.5G, 10%) and as they read them (1.50 GiB).

Units are binary: K, M, G, T, P are powers of 1024, with or without "i"/"B" ("2G" = "2GiB" =
"2GB"), because page sizes and GPU memory are counted in powers of two. Decimals are computed
exactly in integers (1.5G is 1610612736), then rounded down to whole bytes.
"""

from __future__ import annotations

import re

_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"      # ASCII digits only (\d would take "٣")
_SIZE_RE = re.compile(_NUMBER + r"\s*(?:([KMGTP])(?:I?B)?|B)?", re.IGNORECASE)
_PERCENT_RE = re.compile(_NUMBER + r"\s*%")
SIZE_HELP = "bytes (4096), a binary unit (512M, 2G, 1.5G) or a percentage of the capacity (10%)"


def parse_size(text: str, capacity_bytes: int | None = None) -> int:
    """Bytes meant by ``text``; a percentage is of ``capacity_bytes``.

    Raises:
        ValueError: malformed or negative size, a percentage above 100, or a percentage where no
            capacity is known. The message names the text and the accepted forms.
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"size {text!r} must be text: {SIZE_HELP}")
    stripped = text.strip()
    if stripped.startswith("-"):
        raise ValueError(f"size {stripped!r} is negative: give a size >= 0 ({SIZE_HELP})")
    percent = _PERCENT_RE.fullmatch(stripped)
    if percent:
        numerator, denominator = _exact(percent.group(1))
        if numerator > 100 * denominator:
            raise ValueError(f"size {stripped!r} is above 100% of the capacity: give 0% to 100%")
        if not capacity_bytes:
            raise ValueError(
                f"size {stripped!r} is a percentage, but no capacity is known here: give bytes "
                "such as 512M or 2G")
        return numerator * capacity_bytes // (100 * denominator)
    match = _SIZE_RE.fullmatch(stripped)
    if not match:
        raise ValueError(f"size {stripped!r} is malformed: give {SIZE_HELP}")
    numerator, denominator = _exact(match.group(1))
    return numerator * 1024 ** _UNITS[(match.group(2) or "").upper()] // denominator


def _exact(decimal: str) -> tuple[int, int]:
    """``"1.25"`` -> (125, 100): the number as an exact fraction of integers."""
    whole, _, fraction = decimal.partition(".")
    return int(whole + fraction or "0"), 10 ** len(fraction)


def format_bytes(num_bytes: int) -> str:
    """``num_bytes`` in the largest binary unit that keeps it >= 1, e.g. ``1.50 GiB``; "-" for a
    negative value (no limit)."""
    if num_bytes < 0:
        return "-"
    if num_bytes < 1024:
        return f"{num_bytes} B"
    value, unit = float(num_bytes), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if round(value, 2) < 1024:            # never "1024.00 KiB": that is 1.00 MiB
            break
    return f"{value:.2f} {unit}"
