"""Ahead-of-time compilation of every Triton kernel variant for sm_80 and sm_90 (no GPU
needed): PTX and cubin are produced, every data kernel holds both a 16-byte vector body
and a scalar body (vector width is chosen per chunk at run time), ptxas reports no
spills, and kernels launched without FP contraction (the server update, add_noise_) have
no FMA in their PTX.  The DP noise (issue 31) rounds every operation itself: the
aggregation's noise variants contract nothing more than its plain ones and use no
approximate instruction.

The compile runs in a subprocess (tests/_aot_compile.py) with TRITON_INTERPRET unset:
under the interpreter ``triton.jit`` returns interpreted functions that cannot be
compiled, and conftest.py sets it for the other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import import_triton_module

import_triton_module("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_aot_compile.py")
# Kernels that stream data through a pointer table or row strides (both bodies).
TABLE_KERNELS = {"nar_norm_kernel", "nar_update_kernel", "aggregate_kernel", "client_dots_kernel",
                 "server_update_kernel"}
# Kernels that write their data in place through the table (vector stores in the 16-byte body).
UPDATE_KERNELS = {"nar_update_kernel", "server_update_kernel"}
# Kernels whose contract rounds every operation separately (launched with
# enable_fp_fusion=False): no fma.* in their PTX.
NO_FMA_KERNELS = {"server_update_kernel", "add_noise_kernel"}
MAX_REGISTERS = 96  # streaming kernels: keep occupancy high (64K regs / 256 threads / 2 CTAs = 128)


def _vector_load(dtype: str) -> str:
    # 16 bytes per access: 4 x b32 (4 floats or 8 halves), or 2 x b64 (2 doubles)
    return "ld.global.v2.b64" if dtype == "float64" else "ld.global.v4.b32"


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _entries(report):
    return [(e, arch, r) for e in report["results"] for arch, r in e["archs"].items()]


def _name(e, arch):
    cx = {k: v for k, v in e["constexprs"].items() if k not in ("DTYPE", "ACC", "BLOCK", "PBLOCK")}
    return f"{e['kernel']}[{e['dtype']}, {arch}, {cx}]"


def test_every_variant_compiles_to_ptx_and_cubin(report):
    kernels = {e["kernel"] for e in report["results"]}
    assert kernels == TABLE_KERNELS | {"group_sum_kernel", "row_sum_kernel", "add_noise_kernel"}
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for k in TABLE_KERNELS - {"server_update_kernel"}:
            layouts = {e["layout"] for e in report["results"] if e["kernel"] == k and e["dtype"] == dtype}
            assert layouts == {"table", "rows"}, (k, dtype, layouts)
    for e, arch, r in _entries(report):
        assert "error" not in r, f"{_name(e, arch)}: {r.get('error')}"
        assert r["ptx_bytes"] > 0 and r["cubin_bytes"] > 0, _name(e, arch)
        assert r["target"] == ("sm_90a" if arch == "sm_90" else "sm_80"), (_name(e, arch), r["target"])


def _scalar_load(dtype: str) -> str:
    return {"float16": "ld.global.b16", "bfloat16": "ld.global.b16", "float32": "ld.global.b32",
            "float64": "ld.global.b64"}[dtype]


def test_every_data_kernel_has_a_vector_and_a_scalar_body(report):
    """Per-chunk vector width: the 16-byte body (``ld/st.global.v*``) and the scalar
    fallback (plain loads of the data dtype) are both in every variant."""
    for e, arch, r in _entries(report):
        if e["kernel"] not in TABLE_KERNELS:
            continue
        vec, scalar = _vector_load(e["dtype"]), _scalar_load(e["dtype"])
        assert r["mem"].get(vec, 0) > 0, f"{_name(e, arch)} has no {vec}: {r['mem']}"
        assert r["mem"].get(scalar, 0) > 0, f"{_name(e, arch)} has no scalar {scalar}: {r['mem']}"
        if e["kernel"] in UPDATE_KERNELS:
            st = vec.replace("ld.", "st.")
            assert r["mem"].get(st, 0) > 0, f"{_name(e, arch)} has no {st}: {r['mem']}"


def test_separately_rounded_kernels_have_no_fma(report):
    seen = set()
    for e, arch, r in _entries(report):
        if e["kernel"] in NO_FMA_KERNELS:
            seen.add(e["kernel"])
            assert e["options"].get("enable_fp_fusion") is False, _name(e, arch)
            assert r["fma"] == 0, f"{_name(e, arch)} contracts into {r['fma']} fma instructions"
    assert seen == NO_FMA_KERNELS


def test_ptxas_registers_and_no_spills(report):
    if not report["ptxas"]:
        # triton ships ptxas (triton/backends/nvidia/bin): missing means a broken install
        pytest.fail("ptxas not found: triton's bundled one is missing (set PTXAS=/path/to/ptxas)")
    for e, arch, r in _entries(report):
        info = r["ptxas"]
        assert info["rc"] == 0, f"{_name(e, arch)}: {info['log']}"
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (_name(e, arch), info)
        assert info["registers"] <= MAX_REGISTERS, (_name(e, arch), info["registers"])


def _noise_twin_key(e, arch):
    """What an aggregation variant with noise shares with its noise-free twin."""
    cx = e["constexprs"]
    return (e["dtype"], e["layout"], arch, cx["HAS_SKIP"], cx["GAMMA_KIND"], cx["BLOCK"])


def test_noise_epilogue_rounds_every_operation_itself(report):
    """The aggregation runs with FP contraction on (its sum keeps the bits it had), so
    the noise must not be contracted by LLVM or ptxas: a noise variant has exactly the
    FMAs of its noise-free twin (those of the clients' sum), explicitly rounded
    add/sub/mul instructions (_noise.py's ``.rn`` asm), and no approximate division,
    square root or transcendental."""
    plain = {}
    for e, arch, r in _entries(report):
        if e["kernel"] == "aggregate_kernel" and not e["constexprs"]["NOISE"]:
            plain[_noise_twin_key(e, arch)] = r
    twins = set()
    for e, arch, r in _entries(report):
        if e["kernel"] != "aggregate_kernel" or not e["constexprs"]["NOISE"]:
            continue
        assert r["rn"] > 0, f"{_name(e, arch)}: no explicitly rounded add/sub/mul in its PTX"
        assert r["approx"] == 0, f"{_name(e, arch)}: {r['approx']} approximate instructions"
        twin = plain.get(_noise_twin_key(e, arch))
        if twin is not None:
            twins.add((e["dtype"], e["layout"]))
            assert r["fma"] == twin["fma"], f"{_name(e, arch)}: {r['fma']} FMAs, without noise {twin['fma']}"
    assert {d for d, _ in twins} == {"float16", "bfloat16", "float32", "float64"}, twins
    for e, arch, r in _entries(report):
        if e["kernel"] == "add_noise_kernel":
            assert r["approx"] == 0 and r["rn"] > 0, (_name(e, arch), r["approx"], r["rn"])
            # one 16-byte access per thread for 4-byte data, two for fp64 (4 per thread)
            if e["dtype"] in ("float32", "float64"):
                vec = _vector_load(e["dtype"])
                assert r["mem"].get(vec, 0) > 0 and r["mem"].get(vec.replace("ld.", "st."), 0) > 0, \
                    (_name(e, arch), r["mem"])
