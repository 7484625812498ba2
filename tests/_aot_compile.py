"""Ahead-of-time compile every Triton kernel variant of the triton backend for sm_80 and
sm_90 (no GPU needed) and print one JSON report on stdout.

Run with TRITON_INTERPRET unset (under the interpreter ``triton.jit`` returns an
interpreted function that cannot be compiled); tests/test_triton_aot.py runs it in a
subprocess.  ``python tests/_aot_compile.py [--quick]`` also works by hand.

For every variant and arch it records: PTX and cubin produced, the global load/store
instructions of the PTX by kind, the number of FMA instructions of the PTX, and (sm_90a,
and sm_80 too) ptxas' registers and spill bytes.  Variants compile with the options
their launch passes (``options``: the server kernel launches with
``enable_fp_fusion=False``).  Signatures mirror what the launches in
fedopt_kernels/backends/triton/__init__.py pass: pointer arguments the runtime sees as
16-byte aligned (torch allocations) carry the ``tt.divisibility = 16`` attribute the JIT
would specialize them with; pointers read from tables, or offset by run-time row
strides, get their alignment only through the per-chunk hint of the 16-byte body.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import importlib  # noqa: E402

import fedopt_kernels.backends.triton as TB  # noqa: E402

# The package's ``aggregate`` attribute is the contract function (it shadows the
# submodule of the same name), so the kernel modules are fetched by their full names.
A = importlib.import_module("fedopt_kernels.backends.triton.aggregate")
N = importlib.import_module("fedopt_kernels.backends.triton.nar_step")
S = importlib.import_module("fedopt_kernels.backends.triton.server_update")
AN = importlib.import_module("fedopt_kernels.backends.triton.add_noise")

def _find_ptxas() -> str:
    """``PTXAS``, else the CUDA 13.0 toolkit's, else the first ``ptxas`` of a CUDA
    toolkit (``CUDA_HOME``, PATH, ``/usr/local/cuda*``), else the one Triton bundles --
    a GPU machine may keep its toolkit elsewhere than this one does."""
    import glob
    import shutil

    if os.environ.get("PTXAS"):
        return os.environ["PTXAS"]
    candidates = ["/usr/local/cuda-13.0/bin/ptxas"]
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "ptxas"))
    candidates += [shutil.which("ptxas") or "", "/usr/local/cuda/bin/ptxas",
                   *sorted(glob.glob("/usr/local/cuda-*/bin/ptxas"), reverse=True),
                   os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")]
    return next((c for c in candidates if c and os.path.exists(c)), candidates[0])


PTXAS = _find_ptxas()
ARCHS = (80, 90)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
D16 = [["tt.divisibility", 16]]
TY = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def _sig(fn, types: dict, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in constexprs else types[name]
    return sig


def _attrs(fn, aligned_ptrs) -> dict:
    return {(fn.arg_names.index(n),): D16 for n in aligned_ptrs}


def variants(quick: bool = False):
    """Every kernel, every data dtype x layout (chunk table or table-free rows), and the
    other constexpr flags so that each of their values is compiled at least once per
    dtype.  Each variant holds both the 16-byte and the scalar body (chosen per chunk at
    run time)."""
    out = []
    for dt in DTYPES:
        acc = TB.acc_dtype(dt)
        a = "*" + TY[acc]
        d = "*" + TY[dt]
        block, warps = TB.launch_config(dt)
        base = dict(DTYPE=TB.TL_DTYPES[dt], ACC=TB.TL_DTYPES[acc], BLOCK=block)
        esize = TB.ESIZES[dt]
        for rows in (False, True):
            # ---- FedNAR norm: (MODE, WD_KIND, HAS_GS); grad and none compile alike.
            fn = N.nar_norm_kernel
            nblock, nwarps = TB.norm_launch_config(dt)
            # rows mode passes the part buffer for the table pointers (never read)
            types = dict(tab_ptr="*i64" if not rows else a, groups_ptr="*i64" if not rows else a,
                         part_ptr=a, wd_ptr=a, gs_ptr=a, wd_value="fp64", x_base="i64", g_base="i64",
                         row_len="i64", row_chunks="i64", chunk="i64", mis="i64")
            flags = [(0, 0, False), (1, 1, True), (0, 2, True), (2, 0, False)]
            for mode, wdk, gs in flags[:2] if quick else flags:
                cx = dict(base, BLOCK=nblock, ESIZE=esize, MODE=mode, WD_KIND=wdk, HAS_GS=gs, ROWS=rows)
                out.append(dict(kernel=fn, cx=cx, types=types, warps=nwarps, dtype=dt, layout=_layout(rows),
                                ptrs=[n for n in types if n.endswith("_ptr")]))
            # ---- FedNAR update: (MODE, LR_KIND, WD_KIND, HAS_MOM, HAS_GS, HAS_FI, FINALIZED)
            fn = N.nar_update_kernel
            flags = [(0, 0, 0, False, False, False, False), (0, 1, 1, True, True, True, False),
                     (1, 2, 2, True, False, True, True), (1, 0, 0, False, True, False, False),
                     (2, 1, 0, True, False, False, False), (2, 0, 2, False, True, True, True)]
            for mode, lrk, wdk, mom, gs, fi, fin in flags[:2] if quick else flags:
                if rows and fin:
                    continue  # a row has at most ~1025 partials: never finalized
                types = dict(tab_ptr="*i64" if not rows else a, groups_ptr="*i64" if not rows else a,
                             part_ptr=a, norm_ptr=a, scale_ptr=a,
                             skip_ptr="*i1", lr_ptr=a, wd_ptr=a, gs_ptr=a, fi_ptr="*fp32", lr_value="fp64",
                             wd_value="fp64", max_norm="fp64", momentum="fp64", x_base="i64", g_base="i64",
                             b_base="i64", row_len="i64", row_chunks="i64", chunk="i64", mis="i64")
                cx = dict(base, ESIZE=esize, MODE=mode, LR_KIND=lrk, WD_KIND=wdk, HAS_MOM=mom, HAS_GS=gs,
                          HAS_FI=fi, FINALIZED=fin, ROWS=rows, PBLOCK=TB.PBLOCK)
                out.append(dict(kernel=fn, cx=cx, types=types, warps=warps, dtype=dt, layout=_layout(rows),
                                ptrs=[n for n in types if n.endswith("_ptr")]))
            # ---- aggregate: out in the clients' dtype or in acc; (HAS_SKIP, GAMMA_KIND,
            # NOISE, STD_KIND): the DP noise epilogue with the std a float, an acc tensor or
            # an fp64 tensor (an fp32 acc converts it).  The widest tile (large N);
            # narrower tiles only change BLOCK / num_warps.
            fn = A.aggregate_kernel
            # (out dtype, HAS_SKIP, GAMMA_KIND, NOISE, STD_KIND, std tensor dtype or None)
            flags = [(dt, False, 0, False, 0, None), (acc, True, 1, False, 0, None), (dt, False, 0, True, 0, None),
                     (acc, True, 1, True, 1, acc), (dt, True, 0, True, 1, torch.float64)]
            for out_dt, en, gk, noise, sk, std_dt in flags[:1] + flags[2:3] if quick else flags:
                types = dict(ctab_ptr=a if rows else "*i64", w_ptr=a,
                             out_ptr="*" + TY[out_dt], part_ptr=a, skip_ptr="*i1" if en else a, gamma_ptr=a,
                             std_ptr="*" + TY[std_dt] if std_dt is not None else a, gamma_value="fp64",
                             std_value="fp64", noise_key="i64", x_base="i64", C="i64", N="i64", nblk="i64", mis="i64")
                cx = dict(base, ESIZE=esize, TWO_D=rows, HAS_SKIP=en, GAMMA_KIND=gk, NOISE=noise, STD_KIND=sk)
                out.append(dict(kernel=fn, cx=cx, types=types, warps=warps, dtype=dt, layout=_layout(rows),
                                ptrs=["ctab_ptr", "w_ptr", "out_ptr", "part_ptr", "skip_ptr", "gamma_ptr",
                                      "std_ptr"]))
            # ---- client_dots: g in the clients' dtype or in acc
            fn = A.client_dots_kernel
            for g_dt in ((dt,) if quick else tuple(dict.fromkeys((dt, acc)))):
                types = dict(ctab_ptr=a if rows else "*i64", g_ptr="*" + TY[g_dt],
                             part_ptr=a, x_base="i64", C="i64", N="i64", nblk="i64", mis="i64")
                cx = dict(base, ESIZE=esize, TWO_D=rows)
                out.append(dict(kernel=fn, cx=cx, types=types, warps=warps, dtype=dt, layout=_layout(rows),
                                ptrs=["ctab_ptr", "g_ptr", "part_ptr"]))
        # ---- server update: (RULE, NESTEROV, LR_KIND, GAMMA_KIND, HAS_SKIP); absent
        # tensors are replaced by the (int64) table at launch, hence their types.
        fn = S.server_update_kernel
        flags = [(0, False, 0, 0, False), (4, False, 1, 0, True), (0, False, 1, 1, True),
                 (1, False, 0, 0, True), (1, True, 1, 0, False), (2, False, 0, 0, False),
                 (3, False, 1, 0, True)]
        for rule, nest, lrk, gk, sk in flags[:2] if quick else flags:
            types = dict(tab_ptr="*i64", lr_ptr=a if lrk else "*i64", gamma_ptr=a if gk else "*i64",
                         skip_ptr="*i1" if sk else "*i64", lr_value="fp64", gamma_value="fp64",
                         beta1="fp64", beta2="fp64", tau="fp64")
            sblock, swarps = TB.server_launch_config(dt, rule)
            cx = dict(base, BLOCK=sblock, RULE=rule, NESTEROV=nest, LR_KIND=lrk, GAMMA_KIND=gk, HAS_SKIP=sk)
            out.append(dict(kernel=fn, cx=cx, types=types, warps=swarps, dtype=dt, layout="table",
                            ptrs=["tab_ptr", "lr_ptr", "gamma_ptr", "skip_ptr"],
                            options=dict(enable_fp_fusion=False)))
    # ---- add_noise_: every out dtype, the std a float (the std pointer is out then) or a
    # tensor (fp32 or fp64, whatever the acc), with and without the skip flag
    for dt in DTYPES:
        acc = TB.acc_dtype(dt)
        block, warps = TB.noise_launch_config(dt)
        for sk, std_t in ((0, "*" + TY[dt]), (1, "*fp32"), (1, "*fp64"))[:1 if quick else 3]:
            for skip in (False, True)[:1 if quick else 2]:
                out.append(dict(kernel=AN.add_noise_kernel,
                                cx=dict(ACC=TB.TL_DTYPES[acc], STD_KIND=sk, HAS_SKIP=skip, BLOCK=block),
                                types=dict(out_ptr="*" + TY[dt], std_ptr=std_t,
                                           skip_ptr="*i1" if skip else "*" + TY[dt], std_value="fp64",
                                           noise_key="i64", N="i64"),
                                warps=warps, dtype=dt, layout=None, ptrs=["out_ptr", "std_ptr", "skip_ptr"],
                                options=dict(enable_fp_fusion=False)))
    # ---- finalize kernels (no data dtype, no table pointers)
    # group_sum_kernel runs with the update kernel's num_warps (one reduction tree for
    # both ways of summing a group): one variant per (acc dtype, warps) the launches use.
    for acc, warps in dict.fromkeys((TB.acc_dtype(dt), TB.launch_config(dt)[1])
                                    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)):
        a = "*" + TY[acc]
        for rows in (False, True):  # the list forms' group table, the [C, N] form's rows
            out.append(dict(kernel=N.group_sum_kernel, cx=dict(ACC=TB.TL_DTYPES[acc], PBLOCK=TB.PBLOCK, ROWS=rows),
                            types=dict(groups_ptr=a if rows else "*i64", part_ptr=a, sums_ptr=a, row_chunks="i64"),
                            warps=warps, dtype=acc, layout="rows" if rows else "table",
                            ptrs=["groups_ptr", "part_ptr", "sums_ptr"]))
    for acc in (torch.float32, torch.float64):
        a = "*" + TY[acc]
        fn = A.row_sum_kernel
        for en in (False, True):
            out.append(dict(kernel=fn, cx=dict(ACC=TB.TL_DTYPES[acc], HAS_SKIP=en, PBLOCK=TB.PBLOCK),
                            types=dict(part_ptr=a, q_ptr=a, total_ptr=a, skip_ptr="*i1" if en else a, nblk="i64",
                                       C="i64"),
                            warps=TB.SMALL_NUM_WARPS, dtype=acc, layout=None,
                            ptrs=["part_ptr", "q_ptr", "total_ptr", "skip_ptr"]))
    return out


def _layout(rows: bool) -> str:
    return "rows" if rows else "table"


_MEM = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st)\.global\.[\w.]+)")
_FMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?fma\.", re.M)
# Explicitly rounded add/sub/mul (the DP noise's own rounding, _noise.py) and approximate
# instructions (div/sqrt/ex2... .approx: the noise must use none).
_RN = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:add|sub|mul)\.rn\.f(?:32|64)\s", re.M)
_APPROX = re.compile(r"^\s*(?:@!?%p\d+\s+)?\w+\.approx\.", re.M)


def mem_ops(ptx: str) -> dict:
    counts = collections.Counter()
    for line in ptx.splitlines():
        m = _MEM.match(line)
        if m:
            counts[m.group(1)] += 1
    return dict(counts)


def ptxas_info(ptx: str, arch: str, fmad: bool = True) -> dict:
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        # --fmad=false as Triton passes it to ptxas for enable_fp_fusion=False launches
        r = subprocess.run([PTXAS, f"-arch={arch}", "-v"] + ([] if fmad else ["--fmad=false"])
                           + [src, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill_st = re.search(r"(\d+) bytes spill stores", text)
    spill_ld = re.search(r"(\d+) bytes spill loads", text)
    return dict(rc=r.returncode, registers=int(regs.group(1)) if regs else None,
                spill_stores=int(spill_st.group(1)) if spill_st else None,
                spill_loads=int(spill_ld.group(1)) if spill_ld else None,
                log=text[-2000:] if r.returncode else "")


def compile_one(v, cc: int) -> dict:
    fn = v["kernel"]
    src = ASTSource(fn=fn, signature=_sig(fn, v["types"], v["cx"]), constexprs=v["cx"],
                    attrs=_attrs(fn, v["ptrs"]))
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                       options=dict(v.get("options", {}), num_warps=v["warps"]))
    ptx = k.asm["ptx"]
    rec = dict(ptx_bytes=len(ptx), cubin_bytes=len(k.asm.get("cubin", b"")), mem=mem_ops(ptx),
               fma=len(_FMA.findall(ptx)), rn=len(_RN.findall(ptx)), approx=len(_APPROX.findall(ptx)),
               target=re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1))
    if os.path.exists(PTXAS):
        rec["ptxas"] = ptxas_info(ptx, "sm_90a" if cc == 90 else "sm_80",
                                  fmad=v.get("options", {}).get("enable_fp_fusion", True))
    return rec


def compile_archs(v) -> dict:
    """``sm_XX`` -> :func:`compile_one` for every arch, or ``{"error": ...}`` where the
    compile raised (reported: the test fails on it, naming the variant)."""
    archs = {}
    for cc in ARCHS:
        try:
            archs[f"sm_{cc}"] = compile_one(v, cc)
        except Exception as exc:
            archs[f"sm_{cc}"] = dict(error=f"{type(exc).__name__}: {exc}"[-3000:])
    return archs


def report(named) -> dict:
    """The JSON report of ``named`` = ``[(entry, variant)]``: each entry (a dict naming the
    variant) with ``archs`` from :func:`compile_archs`; ``ptxas`` whether ptxas ran."""
    return dict(ptxas=os.path.exists(PTXAS), results=[dict(entry, archs=compile_archs(v)) for entry, v in named])


# ------------------------------------------------------------ the tests' side
# (tests/test_robust_triton_aot.py, tests/test_compressed_triton_aot.py: a script that
# builds its variants and prints report(...), run here without the interpreter)

def run_script(script: str, timeout: int = 1500) -> dict:
    """Runs ``script`` (python source; ``sys.argv[1:]`` = the repository root and tests/,
    for its imports) in a subprocess with TRITON_INTERPRET unset (under the interpreter
    ``triton.jit`` gives a function that cannot be compiled) and returns its JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script, ROOT, os.path.join(ROOT, "tests")], capture_output=True,
                          text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def assert_compiled(rep: dict, name_of) -> None:
    """Every entry of a :func:`report` compiled for every arch: no error, PTX and a cubin,
    the arch's target (sm_90a for sm_90), and ptxas (where it ran) without a failure.
    ``name_of(entry)`` names the variant in the messages."""
    for e in rep["results"]:
        for arch, r in e["archs"].items():
            name = f"{name_of(e)} {arch}"
            assert "error" not in r, f"{name}: {r.get('error')}"
            assert r["ptx_bytes"] > 0 and r["cubin_bytes"] > 0, name
            assert r["target"] == ("sm_90a" if arch == "sm_90" else "sm_80"), name
            if rep["ptxas"]:
                assert r["ptxas"]["rc"] == 0, (name, r["ptxas"]["log"])


_QUICK = False


def run_variant(index: int) -> dict:
    v = variants(_QUICK)[index]
    entry = dict(kernel=v["kernel"].__name__, dtype=str(v["dtype"]).replace("torch.", ""),
                 layout=v["layout"], warps=v["warps"], options=v.get("options", {}),
                 constexprs={k: (str(x) if isinstance(x, tl.dtype) else x) for k, x in v["cx"].items()})
    return dict(entry, archs=compile_archs(v))


def main():
    global _QUICK
    _QUICK = "--quick" in sys.argv
    jobs = int(os.environ.get("FEDOPT_AOT_JOBS", min(4, os.cpu_count() or 1)))
    count = len(variants(_QUICK))
    if jobs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(jobs) as pool:
            results = pool.map(run_variant, range(count), chunksize=1)
    else:
        results = [run_variant(i) for i in range(count)]
    json.dump(dict(triton=triton.__version__, ptxas=os.path.exists(PTXAS), ptxas_path=PTXAS, results=results),
              sys.stdout)


if __name__ == "__main__":
    main()
