"""Ahead-of-time compilation of the compressed decode-aggregate's Triton kernels
(backends/triton/compressed.py) for sm_80 and sm_90, no GPU needed: each codec's
variant (int8, int4, fp8), the top-k pair and the fused encodes (int8/int4, fp8, and top-k's radix
select: backends/triton/topk_encode.py) compile to PTX and a cubin, read their
codes with byte loads (never a dense fp32 copy), keep the sum unfused (no FMA: the bits
of the CPU kernel) and ptxas reports no failure.  tests/_aot_compile.py's compiler in a
subprocess with TRITON_INTERPRET unset, as tests/test_robust_triton_aot.py does.
"""

from __future__ import annotations

import pytest

from conftest import import_triton_module

import_triton_module("triton")

import _aot_compile as A  # noqa: E402

pytestmark = pytest.mark.slow  # 11 kernels (21 variants) x 2 archs through ptxas: a minute or two on a loaded 2-core machine

SCRIPT = r"""
import json, sys, importlib
sys.path[:0] = sys.argv[1:3]
import _aot_compile as A
K = importlib.import_module("fedopt_kernels.backends.triton.compressed")
from fedopt_kernels.backends.compressed import TRITON_BLOCK
block_types = dict(codes_ptr="*i8", scales_ptr="*fp32", w_ptr="*fp32", out_ptr="*fp32", part_ptr="*fp32",
                   skip_ptr="*i1", gamma_ptr="*fp32", gamma_value="fp64", C="i64", N="i64", L="i64", NB="i64",
                   block="i64", nblk="i64")
variants = []
for kind, codes in ((0, "*i8"), (1, "*i8"), (2, "*u8")):
    t = dict(block_types, codes_ptr=codes)
    variants.append((f"block kind={kind}", dict(kernel=K.block_decode_aggregate_kernel, types=t, warps=4,
        options=dict(enable_fp_fusion=False),
        cx=dict(KIND=kind, HAS_SKIP=kind == 1, GAMMA_KIND=0, BLOCK=TRITON_BLOCK),
        ptrs=["codes_ptr", "scales_ptr", "w_ptr", "out_ptr", "part_ptr"])))
variants.append(("topk scatter", dict(kernel=K.topk_scatter_kernel, warps=4, cx=dict(BLOCK=TRITON_BLOCK),
    options=dict(enable_fp_fusion=False),
    types=dict(values_ptr="*fp32", indices_ptr="*i64", w_ptr="*fp32", acc_ptr="*fp32", part_ptr="*fp32", i="i64",
               k="i64", nkblk="i64", N="i64"), ptrs=["values_ptr", "indices_ptr", "acc_ptr"])))
variants.append(("topk finish", dict(kernel=K.topk_finish_kernel, warps=4, options=dict(enable_fp_fusion=False),
    cx=dict(HAS_SKIP=True, GAMMA_KIND=0, BLOCK=TRITON_BLOCK),
    types=dict(acc_ptr="*fp32", out_ptr="*fp32", part_ptr="*fp32", skip_ptr="*i1", gamma_ptr="*fp32",
               gamma_value="fp64", N="i64"), ptrs=["acc_ptr", "out_ptr"])))
for stochastic, int4 in ((False, False), (True, True)):
    variants.append((f"quantize stochastic={stochastic} int4={int4}", dict(kernel=K.block_quantize_kernel, warps=4,
        cx=dict(QMAX=7.0 if int4 else 127.0, INT4=int4, STOCHASTIC=stochastic, HALF=128, BF16_BITS=int4),
        types=dict(x_ptr="*i16" if int4 else "*fp32", codes_ptr="*u8" if int4 else "*i8", scales_ptr="*fp32", N="i64", block="i64",
                   key="i64", client="i64"), ptrs=["x_ptr", "codes_ptr", "scales_ptr"])))
for bf16 in (False, True):
    variants.append((f"fp8 encode bf16={bf16}", dict(kernel=K.fp8_encode_kernel, warps=4, cx=dict(BLOCK=256, BF16_BITS=bf16),
        types=dict(x_ptr="*i16" if bf16 else "*fp32", codes_ptr="*u8", scales_ptr="*fp32", N="i64", block="i64"),
        ptrs=["x_ptr", "codes_ptr", "scales_ptr"])))
T = importlib.import_module("fedopt_kernels.backends.triton.topk_encode")
for bf16 in (False, True):
    x_ty = "*i16" if bf16 else "*fp32"
    for p in (0, 7):
        variants.append((f"topk encode histogram pass={p} bf16={bf16}", dict(kernel=T.topk_histogram_kernel, warps=4,
            cx=dict(PASS=p, BLOCK=T.TOPK_BLOCK, BF16_BITS=bf16), types=dict(x_ptr=x_ty, ws_ptr="*i64", N="i64"),
            ptrs=["x_ptr", "ws_ptr"])))
    variants.append((f"topk encode count bf16={bf16}", dict(kernel=T.topk_count_kernel, warps=4,
        cx=dict(BLOCK=T.TOPK_BLOCK, BF16_BITS=bf16), types=dict(x_ptr=x_ty, ws_ptr="*i64", counts_ptr="*i64", N="i64"),
        ptrs=["x_ptr", "ws_ptr", "counts_ptr"])))
    variants.append((f"topk encode write bf16={bf16}", dict(kernel=T.topk_write_kernel, warps=4,
        cx=dict(BLOCK=T.TOPK_BLOCK, BF16_BITS=bf16),
        types=dict(x_ptr=x_ty, ws_ptr="*i64", offsets_ptr="*i64", values_ptr="*fp32", indices_ptr="*i64", N="i64"),
        ptrs=["x_ptr", "ws_ptr", "offsets_ptr", "values_ptr", "indices_ptr"])))
for p in (0, 7):
    variants.append((f"topk encode pick pass={p}", dict(kernel=T.topk_pick_kernel, warps=4, cx=dict(PASS=p),
        types=dict(ws_ptr="*i64", k="i64"), ptrs=["ws_ptr"])))
variants.append(("topk encode scan", dict(kernel=T.topk_scan_kernel, warps=4, cx=dict(SCAN_BLOCK=T.TOPK_SCAN_BLOCK),
    types=dict(counts_ptr="*i64", tiles="i64"), ptrs=["counts_ptr"])))
json.dump(A.report([(dict(name=name), v) for name, v in variants]), sys.stdout)
"""


@pytest.fixture(scope="module")
def report():
    return A.run_script(SCRIPT)


def test_every_kernel_compiles_for_sm80_and_sm90(report):
    assert [e["name"] for e in report["results"]] == ["block kind=0", "block kind=1", "block kind=2",
                                                      "topk scatter", "topk finish",
                                                      "quantize stochastic=False int4=False",
                                                      "quantize stochastic=True int4=True",
                                                      "fp8 encode bf16=False", "fp8 encode bf16=True"] + [
        f"topk encode {part}" for bf16 in (False, True)
        for part in (f"histogram pass=0 bf16={bf16}", f"histogram pass=7 bf16={bf16}", f"count bf16={bf16}",
                     f"write bf16={bf16}")] + ["topk encode pick pass=0", "topk encode pick pass=7",
                                               "topk encode scan"]
    A.assert_compiled(report, lambda e: e["name"])


def test_codes_are_read_as_bytes_and_the_sums_are_not_contracted(report):
    """The block kernels load the codes with byte loads (the replies are read in place,
    as codes); no kernel has an FMA (the launches' enable_fp_fusion=False), so the GPU
    gives the CPU kernel's bits."""
    for e in report["results"]:
        for arch, r in e["archs"].items():
            if e["name"].startswith("block"):
                assert r["mem"].get("ld.global.b8", 0) > 0, (e["name"], arch, r["mem"])
            if not e["name"].startswith("quantize"):  # the encode has no sum to keep unfused
                assert r["fma"] == 0, (e["name"], arch, r["fma"])
