"""Sizes as operators type them (512M, 1.5G, 10%) and as they read them (1.50 GiB).

Units are binary: K, M, G, T, P are powers of 1024, with or without "i"/"B" ("2G" = "2GiB" =
"2GB"), because page sizes and GPU memory are counted in powers of two. Decimals of a unit are
computed exactly in integers (1.5G is 1610612736), then rounded down to whole bytes. A number
without a unit (or with B) counts bytes and must be whole (``4096``, ``4096.0``): ``0.5`` is
refused, not read as 0 B. See Note [A fraction of a byte].
"""

from __future__ import annotations

import re

_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"      # ASCII digits only (\d would take "٣")
_SIZE_RE = re.compile(_NUMBER + r"\s*(?:([KMGTP])(?:I?B)?|B)?", re.IGNORECASE)
_PERCENT_RE = re.compile(_NUMBER + r"\s*%")
MAX_DIGITS = 64      # digits of a size's number: 8 EiB has 19, and int() refuses past 4300
SIZE_HELP = "whole bytes (4096), a binary unit (512M, 2G, 1.5G) or a percentage of the capacity (10%)"


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
        numerator, denominator = _exact(percent.group(1), stripped)
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
    number, unit = match.group(1), (match.group(2) or "").upper()
    numerator, denominator = _exact(number, stripped)
    if not unit and numerator % denominator:
        raise ValueError(_fraction_of_a_byte(stripped, number, numerator, denominator))
    return numerator * 1024 ** _UNITS[unit] // denominator


def _fraction_of_a_byte(text: str, number: str, numerator: int, denominator: int) -> str:
    """The message refusing ``text``, a number of bytes with a fraction. See Note [A fraction of
    a byte]."""
    if text[-1] in "bB":
        return (f"size {text!r} is not a whole number of bytes: give whole bytes, or a larger "
                f"unit ({number}K)")
    mib = _decimal(numerator * 1024, denominator)      # exact: 1024 / 10**k ends
    return (f"size {text!r}: a size without a unit is a whole number of bytes; write {mib}MiB or "
            f"{number}GiB")


def _decimal(numerator: int, denominator: int) -> str:
    """``numerator / denominator`` (a power of ten) as a decimal, no trailing zeros."""
    whole, rest = divmod(numerator, denominator)
    digits = str(rest).rjust(len(str(denominator)) - 1, "0").rstrip("0")
    return f"{whole}.{digits}" if digits else str(whole)


def _exact(decimal: str, text: str) -> tuple[int, int]:
    """``"1.25"`` -> (125, 100): the number as an exact fraction of integers. Raises ValueError
    naming ``text`` (the size it is part of) past MAX_DIGITS digits."""
    whole, _, fraction = decimal.partition(".")
    digits = whole + fraction or "0"
    if len(digits) > MAX_DIGITS:
        raise ValueError(f"size {text[:24]!r}... has {len(digits)} digits: give at most {MAX_DIGITS} ({SIZE_HELP})")
    return int(digits), 10 ** len(fraction)


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


# Note [A fraction of a byte]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A number without a unit counts bytes, and decimals are rounded down to whole bytes, so `kvctl
# limit NAME 0.5` used to mean a limit of 0 B: the instance released everything, where the
# operator had meant half a GiB (and KVCACHED_GLOBAL_BUDGET_BYTES=0.5 made a budget nobody could
# take a page from). A unit makes rounding harmless (0.0001K is a fraction of one byte off); a
# bare number with a fraction is a unit forgotten, so it is refused, and the message offers the
# GiB reading in two exact spellings (0.5 -> 512MiB or 0.5GiB: 1024 / 10**k is always a finite
# decimal). A whole number written with a point (4096.0) means what it says and is taken.
