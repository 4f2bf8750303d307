"""KVCACHED_VLLM: the ``vllm.general_plugins`` entry point is inert until asked for, and where it
cannot work it warns once and leaves vLLM as it is, so installing kvcached never stops vLLM.

vLLM calls the entry point in every process it starts, so each case is a fresh subprocess with
the environment under test: vLLM missing (``python -S`` with only this repository on the path:
no site-packages), vLLM of another release (a real distribution record of it first on the path),
and the supported release where it is installed (those cases skip without it; .ci/run_vllm runs
them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvcached import config
from kvcached.errors import KVCachedConfigError
from kvcached.integration.vllm.version import INSTALL_COMMAND, SUPPORTED_VLLM, check_vllm_version

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ENTRY_POINT = "kvcached = kvcached.integration.vllm:register"      # as pyproject.toml declares it


def _supported_vllm_installed() -> bool:
    try:
        check_vllm_version()
    except KVCachedConfigError:
        return False
    return True


needs_vllm = pytest.mark.skipif(not _supported_vllm_installed(), reason=f"needs vllm{SUPPORTED_VLLM} installed")

# Runs the code given in a fresh interpreter; prints one JSON line: the kvcached logger's records,
# whether kvcached is enabled, whether anything of vLLM was imported, and what the code reported.
PROBE = """
import json, logging, sys
sys.path[:0] = {paths!r}
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
logging.getLogger("kvcached").addHandler(Keep())
logging.getLogger("kvcached").setLevel(logging.DEBUG)
from kvcached.integration import vllm as kv
report = {{}}
{code}
print(json.dumps({{"records": records, "enabled": kv.is_enabled(),
                   "vllm_imported": "vllm" in sys.modules, **report}}))
"""

# What vLLM's scheduler and worker look up: vLLM's own objects, or ours.
STOCK_HOOKS = """
import vllm.v1.core.block_pool as bp, vllm.v1.core.kv_cache_coordinator as kc, vllm.v1.worker.utils as wu
import vllm.v1.worker.gpu_model_runner as runner, vllm.v1.worker.gpu.attn_utils as attn
report["stock"] = (kc.BlockPool is bp.BlockPool and bp.BlockPool.__module__ == "vllm.v1.core.block_pool"
                   and runner.allocate_kv_cache is wu.allocate_kv_cache is attn.allocate_kv_cache)
"""


def _probe(code: str, *, switch: str | None, vllm: str, paths: tuple[str, ...] = (),
           extra_env: dict[str, str] | None = None) -> dict:
    """Run ``code`` after the probe's set-up with KVCACHED_VLLM=switch (None: unset) and no other
    KVCACHED_* variable but extra_env's; vllm is "missing" (no site-packages at all) or
    "installed" (this interpreter's, whatever it holds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env.update(KVCACHED_TRACKER="0", **(extra_env or {}))
    if switch is not None:
        env["KVCACHED_VLLM"] = switch
    args = [sys.executable]
    if vllm == "missing":
        args.append("-S")
        env["PYTHONPATH"] = REPO
    else:
        env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    source = PROBE.format(paths=list(paths), code=textwrap.dedent(code))
    done = subprocess.run([*args, "-c", source], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _other_release(tmp_path, version: str = "0.31.0") -> str:
    """A directory holding the distribution record of vllm ``version``, as pip writes it."""
    dist = tmp_path / f"vllm-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return str(tmp_path)


def _plugin_record(tmp_path) -> str:
    """A directory holding a distribution record that declares kvcached's entry point."""
    dist = tmp_path / "kvcached_plugin_probe-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcached-plugin-probe\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT}\n")
    return str(tmp_path)


def _warnings(result: dict) -> list[str]:
    assert all(level in ("WARNING", "INFO", "DEBUG") for level, _ in result["records"]), result
    return [message for level, message in result["records"] if level == "WARNING"]


@pytest.mark.parametrize("switch", [None, "0", "off"])
def test_without_the_switch_register_does_nothing_and_imports_no_vllm(tmp_path, switch):
    for vllm, paths in (("missing", ()), ("installed", ()), ("installed", (_other_release(tmp_path),))):
        result = _probe("kv.register(); kv.register()", switch=switch, vllm=vllm, paths=paths)
        assert result == {"records": [], "enabled": False, "vllm_imported": False}, (vllm, paths, result)


@needs_vllm
def test_without_the_switch_vllms_plugin_loader_leaves_vllm_stock(tmp_path):
    """vLLM's own load_general_plugins() finds the entry point and calls register(): without
    KVCACHED_VLLM, BlockPool and both KV allocation functions stay vLLM's."""
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        report["loaded"] = "kvcached.integration.vllm" in sys.modules
    """
    code = textwrap.dedent(code) + STOCK_HOOKS
    result = _probe(code, switch=None, vllm="installed", paths=(_plugin_record(tmp_path),))
    assert result["loaded"] and result["stock"] and not result["enabled"], result
    assert _warnings(result) == []


@needs_vllm
def test_switched_on_vllms_plugin_loader_enables_kvcached(tmp_path):
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm.v1.core.kv_cache_coordinator as kc, vllm.v1.worker.gpu_model_runner as runner
        report["ours"] = kc.BlockPool is kv.ElasticBlockPool and runner.allocate_kv_cache is kv.allocate_kv_cache
    """
    result = _probe(code, switch="1", vllm="installed", paths=(_plugin_record(tmp_path),))
    assert result["ours"] and result["enabled"] and _warnings(result) == [], result


def test_switched_on_without_vllm_register_warns_once_and_returns():
    result = _probe("kv.register()", switch="1", vllm="missing")
    (warning,) = _warnings(result)
    assert "KVCACHED_VLLM=1" in warning and "vLLM is not installed" in warning and INSTALL_COMMAND in warning
    assert not result["enabled"] and not result["vllm_imported"]


@pytest.mark.parametrize("version", ["0.31.0", "0.34.1"])
def test_switched_on_with_another_vllm_release_register_warns_once_and_patches_nothing(tmp_path, version):
    code = "kv.register()\n"
    if _supported_vllm_installed():         # the real vLLM imports beside the record: look at it
        code += STOCK_HOOKS
    result = _probe(code, switch="1", vllm="installed", paths=(_other_release(tmp_path, version),))
    (warning,) = _warnings(result)
    assert f"vllm {version} is installed" in warning and SUPPORTED_VLLM in warning, warning
    assert not result["enabled"] and result.get("stock", True), result


@needs_vllm
def test_switched_on_without_vllms_worker_modules_register_warns_once_and_patches_nothing():
    """vLLM 0.33 whose GPU model runner does not import (a platform without its kernels): the
    scheduler hook alone would be possible, but nothing is rebound."""
    code = """
        sys.modules["vllm.v1.worker.gpu_model_runner"] = None     # importing it raises ImportError
        kv.register()
        import vllm.v1.core.block_pool as bp, vllm.v1.core.kv_cache_coordinator as kc
        report["stock"] = kc.BlockPool is bp.BlockPool
    """
    result = _probe(code, switch="1", vllm="installed")
    (warning,) = _warnings(result)
    assert "vllm.v1.worker.gpu_model_runner" in warning, warning
    assert result["stock"] and not result["enabled"], result


@pytest.mark.parametrize("switch, variable, value", [("maybe", "KVCACHED_VLLM", "maybe"),
                                                    ("1", "KVCACHED_PAGE_SIZE_MB", "two")])
def test_a_bad_setting_is_one_warning_naming_it_and_nothing_changes(switch, variable, value):
    """The settings are read whole: a bad value of the switch or of any other setting, which
    raises KVCachedConfigError anywhere else, is one warning per call from vLLM's plugin loader."""
    code = "kv.register(); kv.register()\n" + (STOCK_HOOKS if _supported_vllm_installed() else "")
    result = _probe(code, switch=switch, vllm="installed", extra_env={variable: value})
    warnings = _warnings(result)
    assert len(warnings) == 2 and all(f"{variable}={value!r} is invalid" in w for w in warnings), result
    assert not result["enabled"] and result.get("stock", True), result


@pytest.mark.parametrize("vllm", ["missing", "other"])
def test_enable_raises_with_the_readmes_install_line(tmp_path, vllm):
    code = """
        from kvcached.errors import KVCachedConfigError
        try:
            kv.enable()
        except KVCachedConfigError as exc:
            report["refused"] = str(exc)
    """
    if vllm == "missing":
        result = _probe(code, switch="1", vllm="missing")
        assert "vLLM is not installed" in result["refused"], result
    else:
        result = _probe(code, switch="1", vllm="installed", paths=(_other_release(tmp_path),))
        assert "vllm 0.31.0 is installed" in result["refused"], result
    assert f"`{INSTALL_COMMAND}` next to your own torch" in result["refused"], result
    assert not result["enabled"] and _warnings(result) == []
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    vllm_section = " ".join(readme.split("### vLLM", 1)[1].split("\n## ", 1)[0].split())
    assert f"`{INSTALL_COMMAND}` next to your own torch" in vllm_section, "the README's install line differs"


def test_the_switch_is_a_setting_documented_in_the_readme():
    setting = next(s for s in config.SETTINGS if s.name == "KVCACHED_VLLM")
    assert setting.default is False
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    assert "| `KVCACHED_VLLM` | 0 |" in readme
    assert "KVCACHED_VLLM=1" in readme.split("### vLLM", 1)[1].split("\n## ", 1)[0]
