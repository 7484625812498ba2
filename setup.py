"""Build of fedopt_kernels' C++ extensions.

* ``fedopt_kernels._C``: the CPU kernels (OpenMP, at::vec), always built.
* ``fedopt_kernels._C_cuda``: the CUDA kernels, built when a CUDA toolkit and a CUDA
  build of torch are both present.

Environment switches:

* ``FEDOPT_BUILD_CUDA=auto|0|1`` (default ``auto``): ``1`` fails the build when CUDA is
  not usable, ``0`` never builds it, ``auto`` builds it when possible and otherwise
  prints one line saying why not.
* ``FEDOPT_CUDA_ARCH_LIST`` (default ``8.0;9.0+PTX``: machine code for A100 and H100,
  plus PTX that newer GPUs JIT-compile), also honours ``TORCH_CUDA_ARCH_LIST``.
* ``CUDA_HOME`` / ``CUDA_PATH``: the toolkit root; otherwise it is found from ``nvcc``
  (following wrapper scripts, which point at the real toolkit) or ``/usr/local/cuda*``.

torch must already be installed: build with ``pip install --no-build-isolation .``
(build isolation would download a second, different torch to build against).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _is_toolkit(root: str | None) -> bool:
    return bool(root) and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")) and (
        os.path.exists(os.path.join(root, "bin", "nvcc")))


def _toolkit_from_nvcc() -> str | None:
    """Toolkit root of the ``nvcc`` on PATH, looking through wrapper scripts."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    nvcc = os.path.realpath(nvcc)
    root = os.path.dirname(os.path.dirname(nvcc))
    if _is_toolkit(root):
        return root
    try:  # a wrapper script: look for the absolute path of the real nvcc inside it
        with open(nvcc, "r", errors="ignore") as f:
            text = f.read(65536)
    except OSError:
        return None
    for match in re.findall(r"(/[^\s\"']+)/bin/nvcc", text):
        if _is_toolkit(match):
            return match
    return None


def find_cuda_home() -> tuple[str | None, str]:
    """Return ``(root, how)``: the CUDA toolkit root and how it was found."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if _is_toolkit(root):
            return root, var
    root = _toolkit_from_nvcc()
    if root:
        return root, "nvcc on PATH"
    for root in ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True):
        if _is_toolkit(root):
            return root, "default location"
    return None, "no CUDA toolkit found (set CUDA_HOME)"


def cuda_build_decision() -> tuple[bool, str]:
    mode = os.environ.get("FEDOPT_BUILD_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"FEDOPT_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return False, "FEDOPT_BUILD_CUDA=0"
    import torch

    root, how = find_cuda_home()
    reason = None
    if torch.version.cuda is None:
        reason = f"torch {torch.__version__} is a CPU-only build"
    elif root is None:
        reason = how
    if reason is not None:
        if mode == "1":
            raise SystemExit(f"FEDOPT_BUILD_CUDA=1 but the CUDA extension cannot be built: {reason}")
        return False, reason
    # torch.utils.cpp_extension reads CUDA_HOME when it is imported.
    os.environ["CUDA_HOME"] = root
    return True, f"CUDA {torch.version.cuda} toolkit at {root} ({how})"


def extensions():
    # Decide (and set CUDA_HOME) BEFORE importing torch.utils.cpp_extension, which reads
    # CUDA_HOME once at import time and would otherwise guess /usr/local from the wrapper.
    build_cuda, why = cuda_build_decision()
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    # -Wno-unknown-pragmas: GCC < 13 warns about the "#pragma unroll" in torch headers.
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas"]
    include = [os.path.join(ROOT, "csrc", "include")]
    cpu_sources = ["csrc/registration.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    exts = [
        CppExtension(
            "fedopt_kernels._C",
            cpu_sources,
            include_dirs=include,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    ]
    if build_cuda:
        arch_list = os.environ.get("FEDOPT_CUDA_ARCH_LIST") or os.environ.get("TORCH_CUDA_ARCH_LIST") or "8.0;9.0+PTX"
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        print(f"fedopt_kernels: building the CUDA extension for sm {arch_list}: {why}", file=sys.stderr)
        exts.append(
            CUDAExtension(
                "fedopt_kernels._C_cuda",
                sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp")),
                include_dirs=include,
                extra_compile_args={
                    "cxx": ["-O3", "-std=c++20"],
                    "nvcc": ["-O3", "-std=c++20", "-lineinfo"],
                },
            )
        )
    else:
        print(f"fedopt_kernels: skipping the CUDA extension: {why}", file=sys.stderr)
    return exts


def cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


setup(ext_modules=extensions(), cmdclass=cmdclass())
