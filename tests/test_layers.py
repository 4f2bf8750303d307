"""The package's import graph follows its layers: no cycle, no import pointing up.

The layer order: cli -> runtime -> kv_cache_manager -> layout, tp -> core (the facade) ->
core.blockalloc -> core.freebuckets, core.blockargs -> core.pagealloc -> core.refill -> core.pagesets ->
core.pagetable, core.ledger -> core.hostmem -> core.vmm (the compiled core, its .pyx and .pxd read for import and cimport lines),
with the shared-memory and utility modules below; ops, serving, integration and demo use only the
public API. Parses the sources (every import statement, those inside functions included), so it
imports nothing.
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvcached"

# Bottom first; a module may import its own layer or any below it (cycles are checked apart).
LAYERS = (
    {"errors", "sizes", "checks", "config", "limits", "compaction", "_steps", "_threads", "core._posix"},
    {"core.vmm"},
    {"core.hostmem"},
    {"core.pagetable", "core.ledger"},               # ledger: the backend of a TP leader without pages
    {"core.pagesets"},                              # the page ledger
    {"core.refill"},                                # the pool's refill policy, below the allocator it drives
    {"core.pagealloc"},
    {"core.freebuckets", "core.blockargs"},         # the block allocator's parts
    {"core.blockalloc", "core._probes"},             # _probes: test hooks over the parts below
    {"core", "shm"},                                # core: the compiled core's facade; shm: segments, budgets, the poller
    {"layout", "tp"},                               # tp: the page-table mirror of tensor parallelism and its transports
    {"kv_cache_manager"},
    {"runtime"},
    {""},                                           # the package: public API re-exports
    {"cli"},
)
# The public API: what applications built on kvcached may import from it.
# tp.named: the rendezvous by name of an engine whose scheduler is in no process group of its
# workers (its links go to init_kvcached(tp_link=)).
PUBLIC = {"", "runtime", "kv_cache_manager", "limits", "shm.client", "shm.segment", "shm.budget", "errors",
          "checks", "config", "sizes", "tp.named"}
# Applications, bottom first: each may import the public API, itself and the ones below it.
APPS = ("ops", "serving", "integration", "demo")


def module_name(path: Path) -> str:
    """Dotted name below the package ("" for kvcached itself), e.g. "cli.kvctl"."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


CORE = PACKAGE / "core"
# `from kvcached(.x) (c)import a, b`, `from . cimport x`, `(c)import kvcached.x`, `include "f.pxi"`
_CYTHON_IMPORT = re.compile(r"^[ \t]*(?:from\s+(\.+[\w.]*|kvcached[\w.]*)\s+c?import\s+(\([\w\s,]+\)|[\w \t,]+)"
                            r"|c?import\s+(kvcached[\w.]*)|include\s+\"(\w+\.pxi)\")", re.MULTILINE)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.pyx"):
        found[module_name(path)] = path
    for path in CORE.glob("*.pxd"):                 # declarations only (no .pyx): e.g. _posix.pxd
        found.setdefault(module_name(path), path)
    return found


def cython_sources(path: Path) -> list[Path]:
    """A compiled module's .pyx and its .pxd contract."""
    return [p for p in dict.fromkeys([path, path.with_suffix(".pxd")]) if p.exists()]


def imported(target: str, names: list[str], known: set[str]) -> set[str]:
    """What `from target import names` imports: each name that is a module, else `target`."""
    return {sub if (sub := f"{target}.{alias}".strip(".")) in known else target for alias in names}


def cython_imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """imports_of for Cython: the kvcached modules its sources import or cimport."""
    found: set[str] = set()
    for source in cython_sources(path):
        for m in _CYTHON_IMPORT.finditer(source.read_text()):
            target = (m[1] or m[3]).removeprefix("kvcached").lstrip(".")
            names = [n.strip() for n in (m[2] or "").strip("()").split(",") if n.strip()]
            found |= imported(target, names or [""], known)
    found.discard(name)
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of kvcached that ``name`` imports, by the dotted names of ``modules()``."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if name else []
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "kvcached" or alias.name.startswith("kvcached."):
                    found.add(alias.name[len("kvcached."):] if "." in alias.name else "")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_package else here[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module == "kvcached" or (node.module or "").startswith("kvcached."):
                target = node.module[len("kvcached"):].lstrip(".")
            else:
                continue
            found |= imported(target, [alias.name for alias in node.names], known)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: (imports_of if path.suffix == ".py" else cython_imports_of)(name, path, set(known))
            for name, path in known.items()}


def layer_of(name: str) -> int | None:
    for rank, layer in enumerate(LAYERS):
        if name in layer or name.split(".")[0] in layer - {""}:
            return rank
    return None


def app_of(name: str) -> int | None:
    top = name.split(".")[0]
    return APPS.index(top) if top in APPS else None


def test_the_parser_sees_known_edges():
    """The check can fail: it finds imports that exist, relative and absolute, in functions too,
    and the Cython sources' cimports (.pyx and .pxd)."""
    edges = graph()
    known = {
        ("runtime", "kv_cache_manager"),            # a relative import
        ("ops.attention", "ops.triton_decode"),     # inside a function
        ("cli.kvctl", "shm.client"),                # a module named in `from ... import`
        ("core", "core.blockalloc"),                # the facade's re-exports
        ("core.pagetable", "core.vmm"),             # cimport
        ("core.pagealloc", "core.refill"),          # cimport
        ("core.blockalloc", "core.pagealloc"),      # cimport
        ("tp.rounds", "core.pagetable"),            # cimport, from outside the core
        ("tp.shm", "tp.rounds"),                    # the round transport beside its one user
    }
    missing = sorted(f"{source} -> {target}" for source, target in known if target not in edges[source])
    assert not missing, f"the parser missed imports that exist: {missing}"


def test_no_import_cycle():
    try:
        list(graphlib.TopologicalSorter(graph()).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle in kvcached: {' -> '.join(exc.args[1])}")


def test_imports_point_down():
    upward = []
    for source, targets in graph().items():
        for target in targets:
            app = app_of(source)
            if app is not None:
                target_app = app_of(target)
                if target_app is None and target not in PUBLIC:
                    upward.append(f"{source} -> {target} (not public API)")
                elif target_app is not None and target_app > app:
                    upward.append(f"{source} -> {target} (a higher application)")
                continue
            rank, target_rank = layer_of(source), layer_of(target)
            assert rank is not None, f"kvcached.{source} is in no layer: add it to LAYERS or APPS"
            if target_rank is None or target_rank > rank:
                upward.append(f"{source} -> {target}")
    assert not upward, "imports pointing up: " + "; ".join(sorted(upward))


def test_the_serving_scheduler_imports_no_torch():
    """The scheduler decides on host state only; the runner is what touches the device."""
    tree = ast.parse((PACKAGE / "serving" / "scheduler.py").read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module}
    assert "torch" not in roots, "kvcached.serving.scheduler imports torch"
