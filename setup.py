"""Build kvcached's compiled core (kvcached/core: vmm, hostmem, pagetable, pagesets, refill, pagealloc,
freebuckets, blockargs, blockalloc) against cuda-bindings' cydriver.

See Note [Which cuda.h] for how the header is chosen and why the pairing is checked here
instead of failing deep inside the C++ compiler.
"""

import os
import re
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup


def _bindings_version() -> tuple[int, int]:
    try:
        from importlib.metadata import version

        text = version("cuda-bindings")
    except Exception:
        sys.exit(
            "kvcached build: cuda-bindings is not installed in the build environment.\n"
            "  Fix: pip install 'cuda-bindings==13.5.*' 'nvidia-cuda-runtime==13.5.*', or build with\n"
            "  build isolation (plain `pip install .`), which installs both."
        )
    major, minor = (int(x) for x in text.split(".")[:2])
    return major, minor


def _header_version(include_dir: Path) -> tuple[int, int]:
    match = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", (include_dir / "cuda.h").read_text(errors="replace"))
    if not match:
        return (0, 0)
    number = int(match.group(1))
    return number // 1000, (number % 1000) // 10


def _candidate_include_dirs() -> list[tuple[str, Path]]:
    found = []
    if os.environ.get("CUDA_HOME"):
        found.append(("$CUDA_HOME", Path(os.environ["CUDA_HOME"]) / "include"))
    for key in ("purelib", "platlib"):
        found.append(("nvidia-cuda-runtime wheel", Path(sysconfig.get_paths()[key]) / "nvidia" / "cu13" / "include"))
    for entry in sys.path:
        if entry:
            found.append(("nvidia-cuda-runtime wheel", Path(entry) / "nvidia" / "cu13" / "include"))
    found.append(("/usr/local/cuda", Path("/usr/local/cuda/include")))
    return found


def _compatible(bindings: tuple[int, int], header: tuple[int, int]) -> bool:
    # Measured: 13.1-13.4 cydriver.pxd build against 13.0 headers; 13.5 needs 13.5 headers.
    if bindings[0] != header[0]:
        return False
    return header[1] >= 5 if bindings[1] >= 5 else True


def find_cuda_include() -> str:
    bindings = _bindings_version()
    seen = []
    for origin, path in _candidate_include_dirs():
        if not (path / "cuda.h").is_file():
            continue
        header = _header_version(path)
        seen.append(f"{path} (CUDA {header[0]}.{header[1]}, from {origin})")
        if _compatible(bindings, header):
            return str(path)
    wanted = f"{bindings[0]}.{bindings[1]}"
    sys.exit(
        f"kvcached build: no cuda.h that cuda-bindings {wanted} can compile against.\n"
        f"  Looked at: {', '.join(seen) or 'nothing found'}.\n"
        f"  Fix: pip install 'nvidia-cuda-runtime=={wanted}.*' (ships nvidia/cu13/include/cuda.h), "
        f"or set CUDA_HOME to a CUDA {wanted} toolkit, or install a cuda-bindings matching your toolkit."
    )


# The compiled core: one extension module per layer, each cimporting only the ones before it, each
# with a .pxd contract and a .pyi stub (shipped as package data). The generated C++ goes to build/.
# _probes: test hooks for the C structs of pagesets and freebuckets, apart from the production modules.
CORE_MODULES = ("vmm", "hostmem", "ledger", "pagetable", "pagesets", "refill", "pagealloc", "freebuckets", "blockargs",
                "blockalloc", "_probes")
# tp/rounds: the round segment of tensor parallelism over shared memory, beside its one user
# (tp/shm.py); it cimports the page table and the checked calls of the core.
TP_MODULES = ("tp/rounds",)


def extensions():
    from Cython.Build import cythonize

    include_dirs = [find_cuda_include()]
    modules = [
        Extension(
            f"kvcached.{name.replace('/', '.')}",
            sources=[f"kvcached/{name}.pyx"],
            include_dirs=include_dirs,
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-Wno-unused-function", "-Wno-deprecated-declarations"],
        )
        for name in [f"core/{module}" for module in CORE_MODULES] + list(TP_MODULES)
    ]
    return cythonize(
        modules,
        build_dir="build",
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True, "embedsignature": True},
    )


setup(ext_modules=extensions())

# Note [Which cuda.h]
# cydriver.pxd is generated per cuda-bindings release and names structs that older headers lack:
# the 13.5 .pxd fails against 13.0 headers ("CUDA_FABRIC_COPY_BATCH_OP_st does not name a type")
# while 13.1-13.4 compile against 13.0. We take the first header, in the order $CUDA_HOME, the
# build environment's nvidia-cuda-runtime wheel, /usr/local/cuda, that the installed bindings
# can compile against, and stop with the fix otherwise.
