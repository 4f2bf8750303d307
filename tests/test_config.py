"""kvcached.config: every KVCACHED_* setting, read from a real environment, good and bad values.

A bad value raises KVCachedConfigError naming the variable, the value and what is accepted, and
leaves the cached settings as they were.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys
import uuid
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached import config
from kvcached.checks import as_int
from kvcached.errors import KVCachedConfigError
from kvcached.limits import I64_MAX
from kvcached.shm.budget import check_weight
from kvcached.shm.files import validate_name

# name -> (good values as typed, what each parses to), bad values
CASES = {
    "KVCACHED_PAGE_SIZE_MB": ([("2", 2), (" 64 ", 64), ("1", 1), ("1024", 1024), ("+4", 4)],
                              ["0", "-2", "1025", "2.0", "2M", "", "x", "1_0", "٣", "nan", "9" * 5000]),
    "KVCACHED_MIN_RESERVED_PAGES": ([("0", 0), ("5", 5), ("10", 10)],
                                    ["-1", str((1 << 20) + 1), "1.5", "five", ""]),
    "KVCACHED_MAX_RESERVED_PAGES": ([("10", 10), ("20", 20), (str(1 << 20), 1 << 20)],
                                    ["-1", str((1 << 20) + 1), "1e3", "ten", ""]),
    "KVCACHED_LAYOUT": ([("auto", "auto"), ("per_layer", "per_layer"), (" Interleaved ", "interleaved"),
                         ("PAGE_GROUPED", "page_grouped")],
                        ["", "perlayer", "dense", "per-layer"]),
    "KVCACHED_ZERO_PAGE": ([("1", True), ("true", True), ("Yes", True), ("on", True), ("0", False),
                            ("false", False), ("NO", False), ("off", False), ("", False)],
                           ["2", "y", "enabled", "-1"]),
    "KVCACHED_IDLE_TRIM_S": ([("0", 0.0), ("30", 30.0), ("0.5", 0.5), ("86400", 86400.0), ("1e2", 100.0)],
                             ["-1", "86401", "nan", "inf", "-inf", "30s", ""]),
    "KVCACHED_TRACKER": ([("1", True), ("0", False), ("on", True)], ["maybe", "10"]),
    "KVCACHED_VLLM": ([("1", True), ("0", False), ("on", True)], ["maybe", "2"]),
    "KVCACHED_IPC_NAME": ([("serve", "serve"), (" a.b-c_1 ", "a.b-c_1"), ("é" * 100, "é" * 100)],
                          ["", "  ", "a/b", ".", "..", "a\nb", "a\x7fb", "x" * 201, "é" * 101,
                           "bad\udcffutf8", "a\x85b", "a\u00a0b", "a\u2028b"]),
    "KVCACHED_GLOBAL_BUDGET": ([("gpu0", "gpu0")], ["", "a/b", "bad\udcff", "y" * 201, "a\x85b"]),
    "KVCACHED_GLOBAL_BUDGET_BYTES": ([("4096", 4096), ("512M", 512 << 20), ("1.5G", 3 << 29), ("0", 0),
                                      ("4096.0", 4096)],
                                     ["-1G", "10%", "1.5X", "G", "", "0.5", "1.5 B", "9999999999P", "8E",
                                      str(1 << 63), "9" * 5000]),
    "KVCACHED_GLOBAL_BUDGET_POLICY": ([("fair", "fair"), (" First_Come ", "first_come")],
                                      ["", "fifo", "first-come", "1"]),
    "KVCACHED_SHARE_WEIGHT": ([("1", 1.0), ("0.5", 0.5), ("3", 3.0), ("0.001", 0.001), ("1e6", 1e6)],
                              ["0", "-1", "0.0001", "1e7", "nan", "inf", "heavy", ""]),
    "KVCACHED_SHARE_MIN": ([("0", 0), ("512M", 512 << 20), ("4096", 4096), (str(I64_MAX), I64_MAX)],
                           ["-1", "10%", "", "0.5", "9999999999P", str(1 << 63), "9" * 5000]),
    "KVCACHED_LOG_LEVEL": ([("debug", "DEBUG"), ("INFO", "INFO"), (" warning ", "WARNING"),
                            ("critical", "CRITICAL")],
                           ["", "verbose", "WARN", "10"]),
    "KVCACHED_DEBUG_CHECKS": ([("1", True), ("off", False)], ["2", "debug"]),
    "KVCACHED_TP_TIMEOUT_S": ([("60", 60.0), ("0.1", 0.1), (" 5 ", 5.0), ("86400", 86400.0), ("1e1", 10.0)],
                              ["0", "0.05", "-1", "86401", "nan", "inf", "10s", ""]),
    "KVCACHED_TP_TRANSPORT": ([("auto", "auto"), (" SHM ", "shm"), ("gloo", "gloo")],
                              ["", "nccl", "tcp", "sh m"]),
    "KVCACHED_TP_SPIN_US": ([("auto", "auto"), (" AUTO ", "auto"), ("0", 0), ("50", 50), ("100000", 100000)],
                            ["", "-1", "100001", "5.5", "fast", "auto50"]),
}

FIELDS = dict(zip((s.name for s in config.SETTINGS), config.Settings.__dataclass_fields__))


@pytest.fixture
def env(monkeypatch):
    """A clean KVCACHED_* environment; the settings are read again afterwards."""
    for name in [n for n in os.environ if n.startswith("KVCACHED_")]:
        monkeypatch.delenv(name)
    config.reload_settings()
    yield monkeypatch
    monkeypatch.undo()
    config.reload_settings()


def test_every_setting_is_tested():
    assert set(CASES) == {s.name for s in config.SETTINGS}
    assert len(FIELDS) == len(config.SETTINGS) == len(config.Settings.__dataclass_fields__)


def test_defaults(env):
    s = config.reload_settings()
    for setting in config.SETTINGS:
        assert getattr(s, FIELDS[setting.name]) == setting.default, setting.name
    assert config.settings() is s                     # read once, cached


@pytest.mark.parametrize("name", sorted(CASES))
def test_good_values(env, name):
    for text, expected in CASES[name][0]:
        env.setenv(name, text)
        if name == "KVCACHED_MIN_RESERVED_PAGES":
            env.setenv("KVCACHED_MAX_RESERVED_PAGES", str(1 << 20))
        if name in config.BUDGET_SETTINGS:
            env.setenv("KVCACHED_GLOBAL_BUDGET", "gpu0")        # without it they are ignored (and warn)
        got = getattr(config.reload_settings(), FIELDS[name])
        assert got == expected and type(got) is type(expected), (name, text, got)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_values_name_the_setting(env, name):
    if name in config.BUDGET_SETTINGS:
        env.setenv("KVCACHED_GLOBAL_BUDGET", "gpu0")
    good = config.reload_settings()
    for text in CASES[name][1]:
        env.setenv(name, text)
        with pytest.raises(KVCachedConfigError) as info:
            config.reload_settings()
        message = str(info.value)
        assert name in message and "invalid" in message and "Default" in message, message
        env.delenv(name)
        assert config.reload_settings() == good


def _budget_size(value: int) -> None:
    as_int(value, "budget_bytes", minimum=0, maximum=I64_MAX)       # as the budget checks its sizes


# How the settings' users check a value the table took: each raises for one it refuses (Note
# [Errors name the variable] in kvcached.config).
USERS = {"KVCACHED_IPC_NAME": validate_name, "KVCACHED_GLOBAL_BUDGET": validate_name,
         "KVCACHED_GLOBAL_BUDGET_BYTES": _budget_size, "KVCACHED_SHARE_MIN": _budget_size,
         "KVCACHED_SHARE_WEIGHT": check_weight}
SIZE_TEXT = st.from_regex(r"\s?[+-]?[0-9]{1,30}(\.[0-9]{0,4})?\s?([KMGTPkmgtpEe](i?[Bb])?|[Bb%])?", fullmatch=True)


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=60, deadline=None)
@given(text=st.one_of(st.text(max_size=30), SIZE_TEXT, st.sampled_from(["9999999999P", "9" * 5000, "1e999"])))
def test_every_value_is_taken_or_refused_naming_the_variable(name, text):
    """Whatever a variable holds, reading the settings takes it, and then its users accept it, or
    raises KVCachedConfigError naming the variable: 9999999999P was taken and later refused as
    "budget_bytes=11258999067300340093157376 ...", naming none."""
    try:
        value = getattr(config._read({name: text}), FIELDS[name])
    except KVCachedConfigError as exc:
        assert name in str(exc), str(exc)
        return
    if name in USERS and value is not None:
        USERS[name](value)


def test_invalid_utf8_from_the_real_environment(env):
    """os.environ holds undecodable bytes as lone surrogates; the setting refuses them."""
    if not hasattr(os, "environb"):
        pytest.skip("no bytes environment on this platform")
    os.environb[b"KVCACHED_IPC_NAME"] = b"pool\xff"
    try:
        assert os.environ["KVCACHED_IPC_NAME"] == "pool\udcff"
        with pytest.raises(KVCachedConfigError, match="KVCACHED_IPC_NAME.*UTF-8"):
            config.reload_settings()
    finally:
        del os.environb[b"KVCACHED_IPC_NAME"]


@pytest.mark.parametrize("lo, hi", [(6, 5), (11, 10), (1 << 20, 0)])
def test_min_above_max(env, lo, hi):
    env.setenv("KVCACHED_MIN_RESERVED_PAGES", str(lo))
    env.setenv("KVCACHED_MAX_RESERVED_PAGES", str(hi))
    with pytest.raises(KVCachedConfigError, match=f"KVCACHED_MIN_RESERVED_PAGES={lo} exceeds .*={hi}"):
        config.reload_settings()


def test_min_default_above_a_low_max(env):
    env.setenv("KVCACHED_MAX_RESERVED_PAGES", "2")      # default minimum 5 is above it
    with pytest.raises(KVCachedConfigError, match="at most 2"):
        config.reload_settings()
    env.setenv("KVCACHED_MIN_RESERVED_PAGES", "2")
    s = config.reload_settings()
    assert (s.min_reserved_pages, s.max_reserved_pages) == (2, 2)


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(0, 1 << 20), hi=st.integers(0, 1 << 20))
def test_pool_bounds_random(lo, hi):
    environ = {"KVCACHED_MIN_RESERVED_PAGES": str(lo), "KVCACHED_MAX_RESERVED_PAGES": str(hi)}
    if lo > hi:
        with pytest.raises(KVCachedConfigError):
            config._read(environ)
    else:
        s = config._read(environ)
        assert (s.min_reserved_pages, s.max_reserved_pages) == (lo, hi)


@settings(max_examples=200, deadline=None)
@given(value=st.floats(allow_nan=True, allow_infinity=True))
def test_idle_trim_random(value):
    environ = {"KVCACHED_IDLE_TRIM_S": repr(value)}
    if math.isfinite(value) and 0 <= value <= 86400:
        assert config._read(environ).idle_trim_s == value
    else:
        with pytest.raises(KVCachedConfigError, match="KVCACHED_IDLE_TRIM_S"):
            config._read(environ)


@settings(max_examples=200, deadline=None)
@given(value=st.floats(allow_nan=True, allow_infinity=True))
def test_tp_timeout_random(value):
    """A peer must get a positive, bounded time to answer: 0 would fail every call at once."""
    environ = {"KVCACHED_TP_TIMEOUT_S": repr(value)}
    if math.isfinite(value) and 0.1 <= value <= 86400:
        assert config._read(environ).tp_timeout_s == value
    else:
        with pytest.raises(KVCachedConfigError, match="KVCACHED_TP_TIMEOUT_S"):
            config._read(environ)


def test_nothing_else_reads_the_environment():
    """Reads only: an application (the demo) may set KVCACHED_* for the instances it starts."""
    reads = re.compile(r"os\.environ(\.get\b|\.copy\b|\[[^\]]*\](?!\s*=[^=]))|getenv\(|environb|dict\(os\.environ\)")
    package = pathlib.Path(config.__file__).parent
    for path in package.rglob("*"):
        if path.suffix not in (".py", ".pyx", ".pxi") or path.name == "config.py":
            continue
        found = reads.search(path.read_text())
        assert found is None, f"{path.relative_to(package)} reads the environment ({found.group(0)})"


# -- KVCACHED_* variables that are no setting ----------------------------------------------------

KNOWN = {s.name for s in config.SETTINGS}
REPO = pathlib.Path(config.__file__).parent.parent


@pytest.mark.parametrize("name, closest", [
    ("KVCACHED_PAGE_SIZE", "KVCACHED_PAGE_SIZE_MB"), ("KVCACHED_IDLE_TRIM", "KVCACHED_IDLE_TRIM_S"),
    ("KVCACHED_MIN_RESERVED_PAGE", "KVCACHED_MIN_RESERVED_PAGES"), ("KVCACHED_TRACKR", "KVCACHED_TRACKER"),
    ("KVCACHED_GLOBAL_BUDGET_BYTE", "KVCACHED_GLOBAL_BUDGET_BYTES"), ("KVCACHED_XYZZY", None),
])
def test_unknown_settings_name_the_closest(name, closest):
    assert config.unknown_settings({name: "1", "KVCACHED_LAYOUT": "auto", "PATH": "/bin"}) == {name: closest}


@settings(max_examples=300, deadline=None)
@given(names=st.lists(st.one_of(
    st.sampled_from(sorted(KNOWN | config.NOT_SETTINGS)),
    st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789", max_size=24).map(lambda t: "KVCACHED_" + t),
    st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=24)), max_size=8))
def test_unknown_settings_are_exactly_the_unknown_kvcached_variables(names):
    environ = {name: "1" for name in names}
    unknown = config.unknown_settings(environ)
    assert set(unknown) == {n for n in environ if n.startswith("KVCACHED_") and n not in KNOWN
                            and n not in config.NOT_SETTINGS}
    assert all(closest is None or closest in KNOWN for closest in unknown.values())


def test_an_unknown_variable_warns_once_per_process(env):
    name = f"KVCACHED_ZERO_PAGES_{uuid.uuid4().hex.upper()}"
    env.setenv(name, "1")
    with pytest.warns(config.UnknownSettingWarning, match=f"{name} is not a kvcached setting"):
        config.reload_settings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.reload_settings()  # the same name again: silent


def _settings_in_a_fresh_process(**environ: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    code = "from kvcached import config; config.reload_settings(); config.reload_settings()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**base, "PYTHONPATH": str(REPO), **environ})


def test_misspelled_variables_warn_once_each_naming_the_setting_meant():
    """They were ignored silently: KVCACHED_PAGE_SIZE=4 left the page size at 2 MiB."""
    result = _settings_in_a_fresh_process(KVCACHED_PAGE_SIZE="4", KVCACHED_IDLE_TRIM="1",
                                          KVCACHED_VLLM_POOL="stock", KVCACHED_LAYOUT="auto")
    assert result.returncode == 0, result.stderr
    warned = re.findall(r"UnknownSettingWarning: (KVCACHED_\w+) is not a kvcached setting and is "
                        r"ignored; did you mean (KVCACHED_\w+)\?", result.stderr)
    assert sorted(warned) == [("KVCACHED_IDLE_TRIM", "KVCACHED_IDLE_TRIM_S"),
                              ("KVCACHED_PAGE_SIZE", "KVCACHED_PAGE_SIZE_MB")], result.stderr


def test_budget_settings_without_a_budget_warn_once_naming_them_and_the_fix():
    """They were ignored without a word: KVCACHED_SHARE_WEIGHT=3 without KVCACHED_GLOBAL_BUDGET."""
    result = _settings_in_a_fresh_process(KVCACHED_GLOBAL_BUDGET_BYTES="9G", KVCACHED_SHARE_WEIGHT="3",
                                          KVCACHED_SHARE_MIN="1G")
    assert result.returncode == 0, result.stderr
    warned = re.findall(r"IgnoredSettingWarning: (.*)", result.stderr)
    assert warned == ["KVCACHED_GLOBAL_BUDGET_BYTES, KVCACHED_SHARE_WEIGHT, KVCACHED_SHARE_MIN are set, but "
                      "KVCACHED_GLOBAL_BUDGET is not: this instance shares no global budget and ignores them. Set "
                      "KVCACHED_GLOBAL_BUDGET to the name of the budget the instances share, or unset them."], \
        result.stderr


@pytest.mark.parametrize("environ", [{"KVCACHED_SHARE_WEIGHT": "3", "KVCACHED_GLOBAL_BUDGET": "gpu0"},
                                     {"KVCACHED_GLOBAL_BUDGET": "gpu0"}, {}])
def test_budget_settings_warn_nothing_with_a_budget_or_unset(environ):
    assert config.ignored_settings(environ) == []


def test_known_variables_warn_nothing():
    result = _settings_in_a_fresh_process(**{"KVCACHED_LAYOUT": "auto", "KVCACHED_VLLM_POOL": "stock"})
    assert result.returncode == 0 and "Warning" not in result.stderr, result.stderr


def test_the_project_sets_no_unknown_variable():
    """Tests, benchmarks, scripts, CI and the README name only settings or NOT_SETTINGS, so that
    none of them warns (``KVCACHED_MIN/MAX_...`` in prose is two settings; this file names
    misspellings on purpose; benchmarks/HISTORY.md keeps past rounds verbatim, with the names of
    their time)."""
    token = re.compile(r"KVCACHED_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_/])")
    paths = [REPO / "README.md", REPO / "pyproject.toml"]
    for folder in ("tests", "benchmarks", "scripts", ".ci", "kvcached/demo"):
        paths += [p for p in (REPO / folder).rglob("*") if p.is_file() and p.suffix in (
            ".py", ".sh", ".md", ".toml", ".txt", "")]
    found = {(name, str(p.relative_to(REPO))) for p in paths if p.name not in ("test_config.py", "HISTORY.md")
             for name in token.findall(p.read_text(errors="replace"))}
    assert {(name, where) for name, where in found if name not in KNOWN | config.NOT_SETTINGS} == set()
