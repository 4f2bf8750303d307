"""kvcached.sizes: sizes as operators type them and as they read them, exact and round-tripping."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached.sizes import format_bytes, parse_size

UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("4096", 4096), (" 4096 ", 4096), ("512M", 512 << 20), ("512 MiB", 512 << 20),
    ("512mb", 512 << 20), ("2G", 2 << 30), ("2GiB", 2 << 30), ("2gb", 2 << 30), ("1.5G", 3 << 29),
    ("1.5g", 3 << 29), (".5K", 512), ("1.K", 1024), ("7B", 7), ("7 b", 7), ("1T", 1 << 40), ("1P", 1 << 50),
    ("0.0001K", 0), ("1.0009K", 1024),                # rounded down to whole bytes
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text, capacity, expected", [
    ("10%", 1000, 100), ("100%", 4096, 4096), ("0%", 4096, 0), ("12.5 %", 800, 100), ("33.3%", 10, 3),
])
def test_parse_percentage(text, capacity, expected):
    assert parse_size(text, capacity) == expected


@pytest.mark.parametrize("text, match", [
    ("-1", "negative"), ("-1G", "negative"), (" -0", "negative"), ("", "malformed"), ("G", "malformed"),
    ("1.5X", "malformed"), ("1 2", "malformed"), ("1e3", "malformed"), ("0x10", "malformed"),
    ("٣G", "malformed"), ("1..5G", "malformed"), ("1GiBB", "malformed"), ("nan", "malformed"),
    ("inf", "malformed"), ("100.1%", "above 100%"), ("101%", "above 100%"), ("10%", "no capacity"),
])
def test_parse_size_refuses(text, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_size(text)
    assert repr(text.strip()) in str(info.value)


@pytest.mark.parametrize("text", ["9" * 5000, "1." + "0" * 5000 + "G", "9" * 65 + "%"])
def test_too_many_digits_are_refused_naming_the_limit(text):
    """int() refuses more than 4300 digits with advice about sys.set_int_max_str_digits: no fix
    for a size."""
    with pytest.raises(ValueError, match=r"digits: give at most 64") as info:
        parse_size(text, 1 << 30)
    assert repr(text[:24]) in str(info.value) and "set_int_max_str_digits" not in str(info.value)


@pytest.mark.parametrize("value", [None, 4096, 1.5, b"4K"])
def test_parse_size_wants_text(value):
    with pytest.raises(TypeError, match="must be text"):
        parse_size(value)


@pytest.mark.parametrize("num_bytes, text", [
    (-1, "-"), (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (3 << 29, "1.50 GiB"),
    (1 << 50, "1.00 PiB"), (1 << 60, "1024.00 PiB"), ((1 << 20) - 1, "1.00 MiB"), ((1 << 30) - 1, "1.00 GiB"),
])
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text


@settings(max_examples=500, deadline=None)
@given(n=st.integers(0, 1 << 62), unit=st.sampled_from(sorted(UNITS)), suffix=st.sampled_from(["", "B", "iB"]),
       space=st.sampled_from(["", " "]))
def test_whole_units_are_exact(n, unit, suffix, space):
    text = f"{n}{space}{unit}{suffix if unit else ('B' if suffix else '')}"
    assert parse_size(text) == n * 1024 ** UNITS[unit]
    assert parse_size(text.lower()) == n * 1024 ** UNITS[unit]


@settings(max_examples=500, deadline=None)
@given(whole=st.integers(0, 10**6), fraction=st.text("0123456789", min_size=1, max_size=12),
       unit=st.sampled_from(sorted(set(UNITS) - {""})))
def test_decimals_are_exact(whole, fraction, unit):
    """A decimal of a unit is computed as an exact fraction, then rounded down: no float error."""
    scale = 1024 ** UNITS[unit]
    got = parse_size(f"{whole}.{fraction}{unit}")
    assert got == (int(f"{whole}{fraction}") * scale) // 10 ** len(fraction)


@pytest.mark.parametrize("text, fix", [
    ("0.5", "write 512MiB or 0.5GiB"), (" 0.5 ", "write 512MiB or 0.5GiB"), (".5", "write 512MiB or .5GiB"),
    ("1.5", "write 1536MiB or 1.5GiB"), ("0.3", "write 307.2MiB or 0.3GiB"), ("4096.5", "4096.5GiB"),
    ("0.5B", "give whole bytes, or a larger unit (0.5K)"), ("7.25 b", "(7.25K)"),
])
def test_a_fraction_of_a_byte_is_refused(text, fix):
    """`kvctl limit NAME 0.5` meant half a GiB, not 0 B (which releases everything)."""
    with pytest.raises(ValueError, match="whole number of bytes") as info:
        parse_size(text)
    assert repr(text.strip()) in str(info.value) and fix in str(info.value)


@pytest.mark.parametrize("text, expected", [("4096.0", 4096), ("4096.", 4096), ("0.000", 0), ("7.00B", 7)])
def test_a_whole_number_written_with_a_point_is_taken(text, expected):
    assert parse_size(text) == expected


@settings(max_examples=500, deadline=None)
@given(whole=st.integers(0, 10**6), fraction=st.text("0123456789", min_size=1, max_size=12).filter(
           lambda digits: digits.strip("0")),
       leading_point=st.booleans(), suffix=st.sampled_from(["", " ", "B", " B", "b"]))
def test_random_fractions_of_a_byte_are_refused(whole, fraction, leading_point, suffix):
    """Every number with a non-zero fraction and no unit (or B) is refused, naming the text; a
    suggestion given is itself a size, and means the number in GiB exactly."""
    number = f".{fraction}" if leading_point else f"{whole}.{fraction}"
    text = number + suffix
    with pytest.raises(ValueError, match="whole number of bytes") as info:
        parse_size(text)
    message = str(info.value)
    assert repr(text.strip()) in message
    suggested = re.search(r"write (\S+)MiB or (\S+)GiB$", message)
    if suffix.strip():
        assert suggested is None and f"({number}K)" in message
        assert parse_size(f"{number}K") == int(number.replace(".", "") or "0") * 1024 // 10 ** len(fraction)
        return
    exact = int((number.split(".")[0] or "0") + fraction) * (1 << 30) // 10 ** len(fraction)
    assert parse_size(suggested.group(1) + "MiB") == parse_size(suggested.group(2) + "GiB") == exact


@settings(max_examples=1000, deadline=None)
@given(n=st.integers(0, (1 << 60) - 1))
def test_format_then_parse_round_trip(n):
    """format_bytes shows three significant figures at least: parsing it back lands within 0.5%."""
    text = format_bytes(n)
    assert re.fullmatch(r"\d+ B|\d{1,4}\.\d\d [KMGTP]iB", text), text
    assert not text.startswith("1024.00") or text.endswith("PiB"), text
    back = parse_size(text)
    assert abs(back - n) <= max(1, n // 200 + 1), (n, text, back)


@settings(max_examples=300, deadline=None)
@given(percent=st.integers(0, 100), capacity=st.integers(1, 1 << 50))
def test_percentages_are_exact(percent, capacity):
    assert parse_size(f"{percent}%", capacity) == percent * capacity // 100
    assert parse_size(f"{percent}.0%", capacity) == percent * capacity // 100
