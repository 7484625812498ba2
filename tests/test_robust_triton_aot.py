"""Ahead-of-time compilation of the Triton ``coordinate_select`` kernel
(backends/triton/robust.py) for sm_80 and sm_90, no GPU needed: every data dtype x
mode, both skip flags and three tile shapes compiles to PTX and a cubin, its loads of the
clients are global loads of the data dtype, and ptxas reports its registers (and no
failure).  Runs tests/_aot_compile.py's compiler in a subprocess with TRITON_INTERPRET
unset (``run_script``), as tests/test_triton_aot.py does for the other kernels.
"""

from __future__ import annotations

import pytest

from conftest import import_triton_module

import_triton_module("triton")

import _aot_compile as A  # noqa: E402

pytestmark = pytest.mark.slow  # ~16 variants x 2 archs through ptxas: minutes on a loaded 2-core machine

SCRIPT = r"""
import json, sys, importlib
sys.path[:0] = sys.argv[1:3]
import torch
import _aot_compile as A
import fedopt_kernels.backends.triton as TB
RB = importlib.import_module("fedopt_kernels.backends.triton.robust")
named = []
for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
    acc = TB.acc_dtype(dt)
    # every dtype with each mode, each skip flag and three tile shapes (CP = 2, 32, 128)
    for C, mode, skip in ((2, 0, False), (20, 0, False), (20, 1, True), (100, 0, True)):
        cp, block = RB.tile_shape(C)
        types = dict(x_ptr="*" + A.TY[dt], keep_ptr="*i1", count_ptr="*i64", out_ptr="*" + A.TY[dt],
                     bad_ptr="*i8", skip_ptr="*i1", C="i64", N="i64", nblk="i64")
        cx = dict(ACC=TB.TL_DTYPES[acc], CP=cp, BLOCK=block, MODE=mode, HAS_SKIP=skip)
        v = dict(kernel=RB.coordinate_select_kernel, cx=cx, types=types, warps=4,
                 ptrs=["x_ptr", "keep_ptr", "count_ptr", "out_ptr", "bad_ptr", "skip_ptr"])
        named.append((dict(dtype=str(dt).replace("torch.", ""), C=C, mode=mode, skip=skip), v))
json.dump(A.report(named), sys.stdout)
"""


@pytest.fixture(scope="module")
def report():
    return A.run_script(SCRIPT)


def _scalar_load(dtype: str) -> str:
    return {"float16": "ld.global.b16", "bfloat16": "ld.global.b16", "float32": "ld.global.b32",
            "float64": "ld.global.b64"}[dtype]


def test_every_variant_compiles_for_sm80_and_sm90(report):
    assert len(report["results"]) == 4 * 4
    A.assert_compiled(report, lambda e: f"coordinate_select_kernel[{e['dtype']}, C={e['C']}, mode={e['mode']}, "
                                        f"skip={e['skip']}]")
    for e in report["results"]:
        for arch, r in e["archs"].items():
            loads = {k: n for k, n in r["mem"].items() if k.startswith("ld.global")}
            assert any(k.startswith(_scalar_load(e["dtype"])) or k.startswith(_scalar_load(e["dtype"])[:-3])
                       for k in loads), (e, arch, loads)
