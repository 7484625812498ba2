"""MKL's Conditional Numerical Reproducibility (CNR), strict mode, for the whole process.

torch's CPU matrix products (``torch.mm``/``bmm``/``linear`` in fp32 and fp64, and
``ops.ragged_bmm``'s per-client GEMMs) run MKL's GEMMs.  By default their bits can depend
on where the operands lie in memory (MKL peels to alignment) and on the code path MKL
picks for the CPU (AVX2, AVX-512, ...: Intel and AMD run different kernels).  The batched
simulation engine promises that a client's bits depend on its own data only, and its
clients' rows lie at offsets that change with their place in a round -- so it needs
MKL's own promise: strict CNR (``MKL_CBWR=AUTO,STRICT``) gives bits that do not depend on
alignment, for a fixed number of threads, on whatever branch MKL runs.

MKL fixes its mode at its first computation, for the whole process.  So this module sets
it once, when fedopt_kernels is imported (:func:`enable_strict`, called by
``fedopt_kernels.backends``), through the entry point torch's MKL exports
(``mkl_serv_cbwr_set``, which ``mkl_cbwr_set`` wraps), unless

* the user set ``MKL_CBWR`` -- their choice is left as it is;
* ``FEDOPT_MKL_STRICT=0`` -- opt out (strict against default, per real-run round on
  an AMD EPYC: MLP 0.97-1.06, CNN 1.00-1.01 -- within this shared machine's noise;
  docs/determinism.md);
* torch has no MKL (``torch.backends.mkl.is_available()`` is False: then torch's BLAS,
  OpenBLAS on aarch64 for instance, runs as it runs and nothing here changes it);
* MKL already ran a computation in this process (torch used before fedopt_kernels was
  imported): MKL refuses the change (MKL_CBWR_ERR_MODE_CHANGE_FAILURE); a
  RuntimeWarning says so and how to fix it.

:func:`status` reports what holds (``fedopt info`` prints it).
"""

from __future__ import annotations

import ctypes
import os
import warnings
from typing import Optional

import torch

ENV_VAR = "FEDOPT_MKL_STRICT"

# mkl_cbwr.h
BRANCH_OFF, AUTO, COMPATIBLE, AVX2, AVX512, AVX512_E1 = 1, 2, 3, 10, 12, 14
STRICT = 0x10000
_ALL, _BRANCH = -1, 1
_MODE_CHANGE_FAILURE = -8
_BRANCHES = {0: "OFF", BRANCH_OFF: "OFF", AUTO: "AUTO", COMPATIBLE: "COMPATIBLE", 4: "SSE2", 6: "SSSE3",
             7: "SSE4_1", 8: "SSE4_2", 9: "AVX", AVX2: "AVX2", 11: "AVX512_MIC", AVX512: "AVX512",
             13: "AVX512_MIC_E1", AVX512_E1: "AVX512_E1"}

_state = {"set_by": None, "error": None, "tried": False}


def _library():
    """torch's MKL service functions (statically linked into libtorch_cpu and exported),
    or None where torch was built without MKL."""
    if not torch.backends.mkl.is_available():
        return None
    candidates = [os.path.join(os.path.dirname(torch.__file__), "lib", name)
                  for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll")]
    for path in [p for p in candidates if os.path.exists(p)] + [None]:
        try:
            lib = ctypes.CDLL(path)
            lib.mkl_serv_cbwr_set.argtypes = [ctypes.c_int]
            lib.mkl_serv_cbwr_get.argtypes = [ctypes.c_int]
            lib.mkl_serv_cbwr_get_auto_branch.argtypes = []
            return lib
        except (OSError, AttributeError):
            continue
    return None


def mode_name(value: int) -> str:
    """``mkl_cbwr_get(MKL_CBWR_ALL)``'s value as ``MKL_CBWR`` spells it: ``AUTO,STRICT``."""
    name = _BRANCHES.get(value & 0xFFFF, f"branch {value & 0xFFFF}")
    return name + (",STRICT" if value & STRICT else "")


def enable_strict() -> None:
    """Sets MKL's mode to ``AUTO,STRICT`` unless the user chose otherwise (``MKL_CBWR``,
    ``FEDOPT_MKL_STRICT=0``); once per process; warns if MKL already ran."""
    if _state["tried"]:
        return
    _state["tried"] = True
    if os.environ.get("MKL_CBWR"):
        _state["set_by"] = f"MKL_CBWR={os.environ['MKL_CBWR']} (set by the user)"
        return
    if os.environ.get(ENV_VAR, "1") == "0":
        _state["set_by"] = f"{ENV_VAR}=0: MKL's default"
        return
    lib = _library()
    if lib is None:
        _state["error"] = "torch was built without MKL"
        return
    code = lib.mkl_serv_cbwr_set(AUTO | STRICT)
    if code == 0:
        _state["set_by"] = "fedopt_kernels"
        return
    if code == _MODE_CHANGE_FAILURE:
        _state["error"] = ("MKL had already run a computation in this process when fedopt_kernels was imported, "
                           "so its mode could not change")
        warnings.warn(f"{_state['error']}: MKL runs as {mode_name(lib.mkl_serv_cbwr_get(_ALL))}, and a client's "
                      "bits may depend on where its rows lie.  Import fedopt_kernels before any torch "
                      "computation, or set MKL_CBWR=AUTO,STRICT in the environment.", RuntimeWarning, stacklevel=3)
    else:
        _state["error"] = f"mkl_cbwr_set(AUTO,STRICT) returned {code}"


def status() -> dict:
    """``mode``: MKL's CNR mode now (``AUTO,STRICT``, ``OFF`` ...; None without MKL);
    ``strict``: whether it is strict; ``auto_branch``: the branch MKL picks for this CPU
    (``AUTO`` where MKL does not dispatch by instruction set: non-Intel CPUs);
    ``intel_cpu``: MKL's own vendor check; ``set_by`` and ``error``: who chose the mode,
    or why it is not strict."""
    lib = _library()
    if lib is None:
        return {"mode": None, "strict": False, "auto_branch": None, "intel_cpu": None, "set_by": None,
                "error": "torch was built without MKL"}
    value = lib.mkl_serv_cbwr_get(_ALL)
    intel: Optional[bool] = None
    try:
        intel = bool(lib.mkl_serv_intel_cpu_true())
    except AttributeError:
        pass
    return {"mode": mode_name(value), "strict": bool(value & STRICT),
            "auto_branch": _BRANCHES.get(lib.mkl_serv_cbwr_get_auto_branch(), "unknown"), "intel_cpu": intel,
            "set_by": _state["set_by"], "error": _state["error"]}
