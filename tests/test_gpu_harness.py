"""The CUDA kernels executed without torch: tools/gpu_harness runs each kernel family
through its host launcher (csrc/cuda/kernels/*.cuh) on whatever CUDA runtime is loaded
-- a GPU's, or a PTX simulator's named by ``FEDOPT_CUDA_SIM_ENV`` (tests/_gpu_harness.py
says how) -- and the results are held to python_ref under the backend contract's rules
for the CUDA backend (tests/_contract.py): values within torch's default tolerance of
the dtype, norms within 2e-5, and bit for bit where the contract promises bits (the
DP noise, the server update, a skipped step, the finalize pass, nar_apply_ after
nar_sq_norm, the codecs' decode-aggregate out and the client's int8/int4 encode).

``test_harness_builds`` runs wherever nvcc exists (CI has it): the harness compiles
against the launchers alone (no torch header) and carries PTX for every requested arch.
Every other test needs a runtime with a device and skips, saying why, without one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import _gpu_harness as H
from _contract import (Backend, acc_of, assert_bitwise, assert_norms_close, assert_stats_close, assert_values_close,
                       bits, ulp)
from _server_update_oracle import server_update_exact

from fedopt_kernels.backends import compressed as compressed_backend
from fedopt_kernels.backends import reference as reference_backend
from fedopt_kernels.ops import compressed as C_ops
from python_ref import compression as codec_ref
from python_ref import gaussian_noise as noise_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# The CUDA backend's tolerances, for results that come back as CPU tensors.
GPU = SimpleNamespace(name="cuda", device=torch.device("cpu"))
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def binary():
    if H.find_nvcc() is None:
        pytest.skip("no nvcc: the harness cannot be built here (FEDOPT_NVCC, /usr/local/cuda-13.0, CUDA_HOME, PATH)")
    return H.build("add_noise") if H.split() else H.build()  # split: the families are built as the cases need them


def test_harness_builds(binary):
    """nvcc builds the harness from the launchers alone (no torch header), with the PTX of
    every arch asked for and every kernel family in it, and the program starts:
    ``--probe`` answers 0 (a device) or 3 (none), or the loader finds no libcudart at all
    (127) -- never a crash."""
    image = binary.read_bytes()
    for a in H.archs():
        if not a.startswith("sm_"):
            assert f".target sm_{a}".encode() in image, a
    kernels = (b"nar_norm_kernel", b"nar_update_kernel", b"nar_group_sum_kernel", b"rows_kernel",
               b"finalize_rows_kernel", b"add_noise_kernel", b"server_update_kernel", b"coordinate_select_kernel",
               b"block_decode_aggregate_kernel", b"topk_scatter_kernel", b"topk_finish_kernel",
               b"codec_row_sums_kernel", b"block_quantize_kernel", b"topk_histogram_kernel",
               b"topk_pick_kernel", b"topk_count_kernel", b"topk_scan_kernel", b"topk_write_kernel",
               b"topk_all_kernel")
    for kernel in kernels if not H.split() else (b"add_noise_kernel",):
        assert kernel in image, kernel
    includes = re.findall(r"^#include\s*[<\"]([^>\"]+)", "".join(p.read_text() for p in H.DEPENDS), re.M)
    assert includes and not [i for i in includes if i.split("/")[0] in ("ATen", "torch", "c10")], includes
    # (in this process's environment: a simulator's needs its files, which the cases get)
    r = subprocess.run([str(binary), "--probe"], capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 3, 127), (r.returncode, r.stdout, r.stderr)


@pytest.fixture(scope="module")
def run(binary, tmp_path_factory):
    ok, said = H.probe(binary, str(tmp_path_factory.mktemp("probe")))
    if not ok:
        pytest.skip(f"no CUDA runtime that can run kernels here ({said}): run on a GPU, or name a simulator's "
                    "environment with FEDOPT_CUDA_SIM_ENV (tests/_gpu_harness.py)")
    runner = H.Runner(binary, tmp_path_factory.mktemp("cases"))
    runner.device = said
    yield runner
    report = os.environ.get("FEDOPT_HARNESS_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(f"{said}: {runner.count} harness runs, {runner.seconds:.1f} s\n")


REF = Backend("reference", CPU)


def randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def name(dtype):
    return H.DTYPE_NAMES[dtype]


# ----------------------------------------------------------------------------- FedNAR

NAR_HYPER = dict(weight_decay=0.01, max_norm=20.0)


def nar_rows(run, dtype, mode, momentum, C, N, *, lr=0.1, seed=0):
    """nar_step_batched_ on [C, N] through the harness and python_ref."""
    acc = acc_of(dtype)
    X, G, B = randn((C, N), dtype, seed), randn((C, N), dtype, seed + 1), randn((C, N), dtype, seed + 2)
    rows_scale = torch.linspace(0.05, 1.0, C, dtype=torch.float64)[:, None]  # some rows clipped, some not
    G = (G.double() * rows_scale).to(dtype)
    lr_t = lr if isinstance(lr, float) else lr.to(acc)
    Xr, Gr, Br = X.clone(), G.clone(), B.clone()
    st = REF.nar_step_batched_(Xr, Gr, Br if momentum else None, lr_t, NAR_HYPER["weight_decay"],
                               NAR_HYPER["max_norm"], mode, momentum, None, None)
    keys = dict(kernel="nar", dtype=name(dtype), layout="rows", phase="step", C=C, N=N, numel=C * N, mode=mode,
                lr=lr if isinstance(lr, float) else 0.0, momentum=momentum, **NAR_HYPER)
    inputs = dict(x=X, g=G)
    if momentum:
        inputs["b"] = B
    if not isinstance(lr, float):
        inputs["lr"], keys["lr_numel"] = lr_t, C
    outs = dict(x=(dtype, (C, N)), norm=(acc, (C,)), scale=(acc, (C,)), skipped=(torch.bool, (C,)))
    if momentum:
        outs["b"] = (dtype, (C, N))
    got = run.run(keys, inputs, outs)
    assert_values_close(GPU, got["x"], Xr)
    if momentum:
        assert_values_close(GPU, got["b"], Br)
    assert_stats_close(GPU, SimpleNamespace(norm=got["norm"], scale=got["scale"], skipped=got["skipped"]),
                       _stats(st), dtype, shape=(C,))
    assert not got["skipped"].any()
    return got


def _stats(st):
    norm, scale, skipped = st
    return SimpleNamespace(norm=norm, scale=scale, skipped=skipped)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", [0, 1, 2], ids=["co", "grad", "none"])
def test_nar_rows(run, dtype, mode):
    """[C, N] rows of 4099 elements: 3 chunks per row (2048, 2048 and a masked tail of
    3), rows whose byte size is not a multiple of 16 (fp32, fp16, bf16: aligned and
    misaligned rows, the 16-byte and the scalar body), momentum in mode co, a per-row lr
    tensor in mode grad."""
    lr = torch.linspace(0.05, 0.2, 3, dtype=torch.float64) if mode == 1 else 0.1
    nar_rows(run, dtype, mode, 0.9 if mode == 0 else 0.0, 3, 4099, lr=lr)


# A list of tensors at element offsets of one flat buffer: misaligned starts, an empty
# tensor, a single element, a tail chunk.
LIST_SIZES = [5000, 1, 0, 2053, 77]
LIST_OFFSETS = [1, 5003, 5005, 5009, 7070]
LIST_NUMEL = 7200


def nar_list_inputs(dtype, seed=0):
    flat = [randn((LIST_NUMEL,), dtype, seed + k) for k in range(3)]
    flat[1] = (flat[1].double() * 0.3).to(dtype)
    return flat


def views(flat):
    return [flat[o:o + n] for o, n in zip(LIST_OFFSETS, LIST_SIZES)]


def nar_list_run(run, dtype, flat, *, phase="step", mode=0, momentum=0.9, finalize=0, extra=None, inputs=None):
    acc = acc_of(dtype)
    keys = dict(kernel="nar", dtype=name(dtype), layout="list", phase=phase, numel=LIST_NUMEL, sizes=LIST_SIZES,
                offsets=LIST_OFFSETS, mode=mode, lr=0.1, momentum=momentum, finalize=finalize, **NAR_HYPER)
    keys.update(extra or {})
    ins = dict(x=flat[0], g=flat[1])
    if momentum:
        ins["b"] = flat[2]
    ins.update(inputs or {})
    outs = dict(x=(dtype, (LIST_NUMEL,)), norm=(acc, (1,)), scale=(acc, (1,)), skipped=(torch.bool, (1,)))
    if momentum:
        outs["b"] = (dtype, (LIST_NUMEL,))
    return run.run(keys, ins, outs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nar_list_step_finalize_and_the_two_passes(run, dtype):
    """nar_step_ over a list (one group of 5 chunks, misaligned views, the gaps between
    them untouched) against python_ref; the finalize pass and nar_sq_norm + nar_apply_
    give the same bits as the plain step."""
    flat = nar_list_inputs(dtype)
    ref = [t.clone() for t in flat]
    st = REF.nar_step_(views(ref[0]), views(ref[1]), views(ref[2]), 0.1, NAR_HYPER["weight_decay"],
                       NAR_HYPER["max_norm"], 0, 0.9, None, None)
    got = nar_list_run(run, dtype, flat)
    assert_values_close(GPU, got["x"], ref[0])
    assert_values_close(GPU, got["b"], ref[2])
    assert_stats_close(GPU, SimpleNamespace(norm=got["norm"][0], scale=got["scale"][0], skipped=got["skipped"][0]),
                       _stats(st), dtype)
    fin = nar_list_run(run, dtype, flat, finalize=1)
    assert_bitwise([fin[k] for k in ("x", "b", "norm", "scale")], [got[k] for k in ("x", "b", "norm", "scale")],
                   "finalize pass vs redundant combine")
    sq = nar_list_run(run, dtype, flat, phase="norm")["norm"]
    assert_norms_close(GPU, sq[0], REF.nar_sq_norm(views(flat[0]), views(flat[1]), NAR_HYPER["weight_decay"], 0,
                                                   None), dtype)
    applied = nar_list_run(run, dtype, flat, phase="apply", inputs=dict(sq=sq))
    assert_bitwise([applied[k] for k in ("x", "b", "norm", "scale")], [got[k] for k in ("x", "b", "norm", "scale")],
                   "nar_apply_(nar_sq_norm) vs nar_step_")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nar_list_grad_scale_and_found_inf(run, dtype):
    """A GradScaler scale (read on the device) against python_ref; found_inf set: the
    step is skipped and no bit of params or buffers changes."""
    acc = acc_of(dtype)
    flat = nar_list_inputs(dtype, seed=5)
    ref = [t.clone() for t in flat]
    gs = torch.tensor([4.0], dtype=acc)
    st = REF.nar_step_(views(ref[0]), views(ref[1]), views(ref[2]), 0.1, NAR_HYPER["weight_decay"],
                       NAR_HYPER["max_norm"], 1, 0.9, gs.reshape(()), None)
    got = nar_list_run(run, dtype, flat, mode=1, inputs=dict(grad_scale=gs))
    assert_values_close(GPU, got["x"], ref[0])
    assert_stats_close(GPU, SimpleNamespace(norm=got["norm"][0], scale=got["scale"][0], skipped=got["skipped"][0]),
                       _stats(st), dtype)
    skipped = nar_list_run(run, dtype, flat, extra=dict(found_kind=1),
                           inputs=dict(found_inf=torch.tensor([1.0], dtype=torch.float32)))
    assert bool(skipped["skipped"][0])
    assert_bitwise([skipped["x"], skipped["b"]], [flat[0], flat[2]], "found_inf: nothing written")


# ----------------------------------------------------------------------------- aggregation

def agg_run(run, dtype, X, w, *, layout, out_acc, gamma=0.9, gamma_tensor=False, skip=None, noise=None, offset=0):
    C, N = X.shape
    acc = acc_of(dtype)
    out_dtype = acc if out_acc else dtype
    keys = dict(kernel="aggregate", dtype=name(dtype), C=C, N=N, layout=layout, out_acc=out_acc,
                gamma=0.0 if gamma_tensor else gamma, offset_X=offset, offset_out=offset)
    ins = dict(X=X, w=w, out=torch.full((N,), 7.0, dtype=out_dtype))
    if gamma_tensor:
        ins["gamma"] = torch.tensor([gamma], dtype=acc)
    if skip is not None:
        ins["skip"] = torch.tensor([skip])
    if noise is not None:
        keys["noise_key"], keys["noise_std"] = noise
    got = run.run(keys, ins, dict(out=(out_dtype, (N,)), sq_norms=(acc, (C,)), sq_norm=(acc, ())))
    return got


# One column; 33 fp32 blocks of 32 x 1 tiles with a masked tail; 256 x 2 tiles (not on a
# simulator, where 37 clients of 70001 columns take minutes per dtype).
AGG_SIZES = [1, 4099] + ([] if os.environ.get("FEDOPT_CUDA_SIM_ENV") else [70001])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["2d", "list"])
def test_aggregate(run, dtype, layout):
    """out = gamma * sum_i w_i X_i and the norms against python_ref: a zero weight on a
    client holding NaN (never multiplied), 37 clients (two batches of 32), misaligned
    list clients and out, out in the data and the acc dtype, gamma as a tensor."""
    acc = acc_of(dtype)
    for N in AGG_SIZES:
        for C, out_acc in ((5, False), (37, True)):
            X = randn((C, N), dtype, N + C)
            X[1, N // 2] = float("nan")
            w = torch.linspace(0.1, 1.0, C, dtype=acc)
            w[1] = 0.0
            offset = 1 if layout == "list" else 0
            got = agg_run(run, dtype, X, w, layout=layout, out_acc=out_acc, gamma_tensor=out_acc, offset=offset)
            out = torch.full((N,), 7.0, dtype=acc if out_acc else dtype)
            clients = X if layout == "2d" else [X[i].clone() for i in range(C)]
            q, Q = REF.aggregate(clients, w, torch.tensor(0.9, dtype=acc) if out_acc else 0.9, out, None)
            assert_values_close(GPU, got["out"], out)
            assert_norms_close(GPU, got["sq_norms"], q, dtype)
            assert_norms_close(GPU, got["sq_norm"], Q, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_aggregate_skip_and_noise(run, dtype):
    """skip: out untouched, zero norms.  DP noise: the noiseless sum (acc) plus
    python_ref's noise, rounded once, bit for bit; the norms those without noise."""
    acc = acc_of(dtype)
    N, C = 4099, 5
    X = randn((C, N), dtype, 11)
    w = torch.tensor([0.5, 0.0, 1.0, 0.25, 0.75], dtype=acc)
    skipped = agg_run(run, dtype, X, w, layout="2d", out_acc=False, skip=True)
    assert_bitwise(skipped["out"], torch.full((N,), 7.0, dtype=dtype), "skip: out untouched")
    assert_bitwise([skipped["sq_norms"], skipped["sq_norm"]], [torch.zeros(C, dtype=acc), torch.zeros((), dtype=acc)])
    plain = agg_run(run, dtype, X, w, layout="2d", out_acc=True)
    key, std = 2**40 + 17, 0.6
    noisy = agg_run(run, dtype, X, w, layout="list", out_acc=False, noise=(key, std))
    want = (plain["out"] + torch.tensor(std, dtype=acc) * noise_ref.noise(key, N).to(acc)).to(dtype)
    assert_bitwise(noisy["out"], want, "aggregate with noise")
    assert_bitwise([noisy["sq_norms"], noisy["sq_norm"]], [plain["sq_norms"], plain["sq_norm"]])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_client_dots(run, dtype):
    acc = acc_of(dtype)
    for N, g_acc, layout in ((4099, False, "2d"), (AGG_SIZES[-1], True, "list"), (1, False, "list")):
        C = 6
        X, g = randn((C, N), dtype, N), randn((N,), acc if g_acc else dtype, N + 1)
        got = run.run(dict(kernel="client_dots", dtype=name(dtype), C=C, N=N, layout=layout, g_acc=g_acc,
                           offset_X=1 if layout == "list" else 0),
                      dict(X=X, g=g), dict(dots=(acc, (C,))))
        assert_norms_close(GPU, got["dots"], REF.client_dots(X if layout == "2d" else list(X), g), dtype,
                           atol=1e-5 * float(N) ** 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_noise(run, dtype):
    """out += std * normal(key, j), bit for bit python_ref's, std a float or a tensor;
    skip leaves out untouched."""
    acc = acc_of(dtype)
    key = 12345
    for N in (1, 17, 4099):
        for std_tensor in (False, True):
            out = randn((N,), dtype, N)
            keys = dict(kernel="add_noise", dtype=name(dtype), N=N, noise_key=key,
                        noise_std=0.0 if std_tensor else 0.37, offset_out=N % 2)
            ins = dict(out=out)
            if std_tensor:
                ins["noise_std"] = torch.tensor([0.37], dtype=acc)
            got = run.run(keys, ins, dict(out=(dtype, (N,))))["out"]
            want = (out.to(acc) + torch.tensor(0.37, dtype=acc) * noise_ref.noise(key, N).to(acc)).to(dtype)
            assert_bitwise(got, want, f"add_noise N={N}")
    out = randn((99,), dtype, 3)
    got = run.run(dict(kernel="add_noise", dtype=name(dtype), N=99, noise_key=key, noise_std=1.0),
                  dict(out=out, skip=torch.tensor([True])), dict(out=(dtype, (99,))))["out"]
    assert_bitwise(got, out, "add_noise skipped")


# ----------------------------------------------------------------------------- server update

SERVER_RULES = {"sgd": (0, False), "momentum": (1, False), "nesterov": (1, True), "adagrad": (2, False),
                "adam": (3, False), "yogi": (4, False)}
SERVER_HYPER = dict(lr=0.05, gamma=1.3, beta1=0.9, beta2=0.99, tau=1e-3)  # inexact in fp32
SERVER_SIZES = [3000, 5, 0, 2051, 1]


def server_update_want(code, nesterov, x, m, v, d, offs, doffs, acc, dtype):
    """The exact oracle (each op rounded once, no FMA) of one rule applied to every view
    ``x[o:o+n]`` (``D`` at ``d[od:od+n]``) of SERVER_SIZES: the whole ``x``, ``m``, ``v``
    after it, in ``dtype`` (the gaps between the views unchanged)."""
    want = {"x": x.clone(), "m": m.clone(), "v": v.clone()}
    for o_, od_, n in zip(offs, doffs, SERVER_SIZES):
        xs, ms, vs = (t[o_:o_ + n].to(acc) for t in (x, m, v))
        nx, nm, nv = server_update_exact(code, nesterov, xs, d[od_:od_ + n], ms if code >= 1 else None,
                                         vs if code >= 2 else None, **SERVER_HYPER)
        want["x"][o_:o_ + n] = nx.to(dtype)
        if code >= 1:
            want["m"][o_:o_ + n] = nm.to(dtype)
        if code >= 2:
            want["v"][o_:o_ + n] = nv.to(dtype)
    return want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", list(SERVER_RULES))
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "views"])
def test_server_update(run, dtype, rule, aligned):
    """Every rule against the exact oracle (each op rounded once, no FMA), bit for bit:
    chunk-aligned tensors (the 16-byte bodies) or views at odd offsets (the scalar
    bodies, D misaligned too)."""
    acc = acc_of(dtype)
    code, nesterov = SERVER_RULES[rule]
    step_x = 16 // torch.empty((), dtype=dtype).element_size()
    step_d = 16 // torch.empty((), dtype=acc).element_size()
    offs, doffs, o, od = [], [], 0 if aligned else 1, 0 if aligned else 1
    for n in SERVER_SIZES:
        if aligned:
            o, od = -(-o // step_x) * step_x, -(-od // step_d) * step_d
        offs.append(o)
        doffs.append(od)
        o, od = o + n + 1, od + n + 1
    total, dtotal = o + 1, od + 1
    g = torch.Generator().manual_seed(code)
    x = torch.randn(total, generator=g, dtype=torch.float64).to(dtype)
    d = (torch.randn(dtotal, generator=g, dtype=torch.float64) * 0.3).to(acc)
    m = (torch.randn(total, generator=g, dtype=torch.float64) * 0.1).to(dtype)
    v = (torch.rand(total, generator=g, dtype=torch.float64) * 0.05 + 1e-4).to(dtype)
    d[3::11] = 0.5
    v[3::11] = 0.25  # Yogi ties: v == d^2 (where the views line up)
    keys = dict(kernel="server_update", dtype=name(dtype), rule=code, nesterov=nesterov, numel=total, d_numel=dtotal,
                sizes=SERVER_SIZES, offsets=offs, d_offsets=doffs, **SERVER_HYPER)
    ins = dict(x=x, d=d)
    outs = dict(x=(dtype, (total,)))
    if code >= 1:
        ins["m"], outs["m"] = m, (dtype, (total,))
    if code >= 2:
        ins["v"], outs["v"] = v, (dtype, (total,))
    got = run.run(keys, ins, outs)
    want = server_update_want(code, nesterov, x, m, v, d, offs, doffs, acc, dtype)
    for k in outs:
        assert_bitwise(got[k], want[k], f"{rule} {k}", nan_ok=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_server_update_skip_and_tensor_hyper(run, dtype):
    """skip (read on the device) writes nothing; lr and gamma as tensors give the bits
    of the same floats."""
    acc = acc_of(dtype)
    n = 4100
    x, d = randn((n,), dtype, 1), randn((n,), acc, 2, 0.3)
    base = dict(kernel="server_update", dtype=name(dtype), rule=0, numel=n, d_numel=n, sizes=[n], offsets=[0],
                d_offsets=[0], **SERVER_HYPER)
    skipped = run.run(base, dict(x=x, d=d, skip=torch.tensor([True])), dict(x=(dtype, (n,))))["x"]
    assert_bitwise(skipped, x, "skipped")
    floats = run.run(base, dict(x=x, d=d), dict(x=(dtype, (n,))))["x"]
    tensors = run.run(dict(base, lr=0.0, gamma=0.0),
                      dict(x=x, d=d, lr=torch.tensor([SERVER_HYPER["lr"]], dtype=acc),
                           gamma=torch.tensor([SERVER_HYPER["gamma"]], dtype=acc)), dict(x=(dtype, (n,))))["x"]
    assert_bitwise(tensors, floats, "tensor vs float hyperparameters")
    assert not torch.equal(floats, x)


# ----------------------------------------------------------------------------- robust select

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", [0, 1], ids=["trim", "closest"])
def test_coordinate_select(run, dtype, mode):
    """The coordinate-wise trimmed mean / closest-to-median mean of the kept clients
    against the reference; a left-out client's Inf is ignored, a kept client's NaN
    flagged and ordered after every number (+inf included: python_ref's sort; the
    insertion sort left it where it was inserted, found here on the PTX simulator, issue
    40); 40 clients take the 128-slot kernel, 5 the 32-slot one."""
    acc = acc_of(dtype)
    ref_select = reference_backend.coordinate_select
    for C, N, count, out_acc in ((5, 1000, 1, False), (40, 777, 7, True)):
        X = randn((C, N), dtype, C)
        keep = torch.ones(C, dtype=torch.bool)
        keep[2] = False
        X[2, 10] = float("inf")
        X[3, 20] = float("nan")                  # one kept NaN
        X[0, 21] = X[4, 21] = float("nan")       # two
        X[1, 22] = float("nan")                  # a kept NaN above a kept +inf
        X[4, 22] = float("inf")
        X[2, 23] = float("nan")                  # a left-out NaN
        out_dtype = acc if out_acc else dtype
        got = run.run(dict(kernel="coordinate_select", dtype=name(dtype), C=C, N=N, mode=mode, out_acc=out_acc),
                      dict(X=X, keep=keep, count=torch.tensor([count]), out=torch.full((N,), 7.0, dtype=out_dtype)),
                      dict(out=(out_dtype, (N,)), bad=(torch.int32, (C,))))
        want = torch.full((N,), 7.0, dtype=out_dtype)
        flags = ref_select(X, keep, torch.tensor([count]), mode, want, None)
        assert torch.equal(got["bad"] != 0, flags), (got["bad"], flags)
        assert_values_close(GPU, got["out"], want)


# ----------------------------------------------------------------------------- codecs

def codec_run(run, replies, w, *, gamma=0.5, gamma_tensor=False, skip=None):
    """One decode-aggregate case from python_ref-encoded replies (fp32 out starting at
    7.0); returns the harness's out, q, total."""
    C, N = len(replies), replies[0].numel
    keys = dict(kernel="compressed", dtype="fp32", C=C, N=N, gamma=float(gamma))
    ins = dict(w=w, out=torch.full((N,), 7.0))
    if gamma_tensor:
        ins["gamma_t"] = torch.tensor([gamma], dtype=torch.float32)
        keys["gamma"] = 123.0  # the tensor wins
    if skip is not None:
        ins["skip"] = torch.tensor([skip])
    if replies[0].codec == "topk":
        keys.update(codec="topk", ks=[r.codes.numel() for r in replies])
        ins.update(values=torch.cat([r.codes for r in replies]), indices=torch.cat([r.indices for r in replies]))
    else:
        keys.update(codec="block", block=replies[0].block, kind=compressed_backend.KINDS[replies[0].codec])
        ins.update(codes=torch.stack([r.codes.view(torch.uint8) for r in replies]),
                   scales=torch.stack([r.scales for r in replies]))
    return run.run(keys, ins, dict(out=(torch.float32, (N,)), q=(torch.float32, (C,)),
                                   total=(torch.float32, ())))


def codec_reference(replies, w, gamma=0.5, skip=None):
    """python_ref's decode-aggregate (the reference backend's op) on the same replies."""
    N = replies[0].numel
    out = torch.full((N,), 7.0)
    sk = None if skip is None else torch.tensor([skip])
    if replies[0].codec == "topk":
        q, Q = compressed_backend.topk_decode_aggregate("reference")(
            [r.codes for r in replies], [r.indices for r in replies], N, w, gamma, None, out, sk)
    else:
        # the codes as ops.compressed.decode_aggregate passes them (fp8 as its uint8 bits)
        q, Q = compressed_backend.block_decode_aggregate("reference")(
            [r.codes.view(torch.uint8) if r.codec == "fp8" else r.codes for r in replies], [r.scales for r in replies],
            compressed_backend.KINDS[replies[0].codec], replies[0].block, N, w, gamma, None, out, sk)
    return out, q, Q


CODEC_CASES = [("int8", False), ("int8", True), ("int4", False), ("int4", True), ("fp8", False), ("topk", False)]


@pytest.mark.parametrize("codec,stochastic", CODEC_CASES, ids=[f"{c}{'-sr' if s else ''}" for c, s in CODEC_CASES])
def test_decode_aggregate(run, codec, stochastic):
    """The codecs' fused decode-aggregate (int8/int4 nearest-even and stochastic, fp8,
    top-k) against python_ref's, replies encoded by python_ref: 3 clients (one of weight
    0), odd sizes (one tile with a masked tail; two tiles, the last block partial), out
    bit for bit (both sum w_i * s_b q_ij in client order, rounding each operation),
    the norms within the contract's tolerance (the kernel sums them in a tree).  A NaN
    scale (block codecs; python_ref's validator refuses such a reply, the kernel must
    still decode it as python_ref does) or a non-finite top-k value makes that client's
    norm NaN and the columns it touches NaN."""
    w = torch.tensor([0.75, 0.0, 1.5])
    for N, block in ((37, 32), (1000 + 29, 64)):
        xs = [randn((N,), torch.float32, 100 + i) * (i + 1) for i in range(3)]
        if codec == "topk":
            replies = [C_ops.encode(x, "topk", k=k, backend="reference") for x, k in zip(xs, (5, N // 3, 1))]
        else:
            replies = [C_ops.encode(x, codec, block=block, stochastic=stochastic, key=77, client=i,
                                    backend="reference") for i, x in enumerate(xs)]
        for gamma_tensor in (False, True):
            got = codec_run(run, replies, w, gamma_tensor=gamma_tensor)
            out, q, Q = codec_reference(replies, w)
            assert_bitwise(got["out"], out, f"{codec} N={N} out")
            assert_norms_close(GPU, got["q"], q, torch.float32)
            assert_norms_close(GPU, got["total"], Q, torch.float32)
    # a NaN scale / a NaN top-k value in client 2 (weight 1.5): NaN where it lands
    bad = replies[2]
    if codec == "topk":
        v = bad.codes.clone()
        v[0] = float("nan")
        bad = dataclasses.replace(bad, codes=v)
    else:
        s = bad.scales.clone()
        s[1] = float("nan")
        bad = dataclasses.replace(bad, scales=s)
    replies = [replies[0], replies[1], bad]
    got = codec_run(run, replies, w)
    out, q, Q = codec_reference(replies, w)
    assert torch.isnan(out).any() and torch.isnan(q[2]) and not torch.isnan(q[:2]).any()
    assert_bitwise(got["out"], out, f"{codec} with a NaN", nan_ok=True)
    assert torch.equal(torch.isnan(got["q"]), torch.isnan(q)) and torch.isnan(got["total"])
    assert_norms_close(GPU, got["q"][:2], q[:2], torch.float32)


def test_decode_aggregate_skip(run):
    """skip (read on the device): out untouched, zero norms."""
    x = randn((300,), torch.float32, 5)
    replies = [C_ops.encode(x, "int8", block=32, backend="reference"),
               C_ops.encode(x, "int8", block=32, stochastic=True, key=3, client=1, backend="reference")]
    w = torch.tensor([1.0, 2.0])
    got = codec_run(run, replies, w, skip=True)
    assert_bitwise(got["out"], torch.full((300,), 7.0), "skip: out untouched")
    assert_bitwise([got["q"], got["total"]], [torch.zeros(2), torch.zeros(())], "skip: zero norms")
    topk = [C_ops.encode(x, "topk", k=9, backend="reference")] * 2
    got = codec_run(run, topk, w, skip=True)
    assert_bitwise(got["out"], torch.full((300,), 7.0), "top-k skip: out untouched")
    assert_bitwise([got["q"], got["total"]], [torch.zeros(2), torch.zeros(())], "top-k skip: zero norms")


QUANT_CASES = [(bits, sr) for bits in ("int8", "int4") for sr in (False, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,stochastic", QUANT_CASES, ids=[f"{b}{'-sr' if s else ''}" for b, s in QUANT_CASES])
def test_block_quantize(run, dtype, bits, stochastic):
    """The client's CUDA encode against python_ref's quantize, bit for bit (codes and
    scales): odd sizes (a partial last block, an odd int4 tail), a block of zeros
    (scale 0: codes 0), a block holding a NaN (NaN scale, codes 0), exact ties (scale 1:
    x.5 rounds half to even), a 64-bit key and the largest client id."""
    for N, block, key, client in ((37, 32, 77, 0), (1000 + 29, 64, (1 << 62) + 5, (1 << 32) - 1), (0, 32, 1, 2)):
        x = randn((N,), torch.float64, N + block, scale=3.0)
        if N > 500:
            x[64:128] = 0.0                                   # block 1: all zeros
            x[200] = float("nan")                             # block 3: a NaN
            x[256:320] = torch.arange(64, dtype=torch.float64) - 40.5 if bits == "int8" else 0.0
            x[256] = 127.0 if bits == "int8" else 7.0         # block 4: scale exactly 1, ties at .5
            if bits == "int4":
                x[257:263] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -6.5], dtype=torch.float64)
        x = x.to(dtype)
        got = run.run(dict(kernel="quantize", dtype=name(dtype), N=N, block=block, int4=bits == "int4",
                           stochastic=stochastic, key=key, client=client), dict(x=x),
                      dict(codes=(torch.uint8, ((N + 1) // 2 if bits == "int4" else N,)),
                           scales=(torch.float32, (-(-N // block),))))
        codes, scales = codec_ref.quantize(x, bits, block, stochastic=stochastic, key=key, client=client)
        assert_bitwise(got["codes"], codes.view(torch.uint8), f"{bits} N={N} codes")
        assert_bitwise(got["scales"], scales, f"{bits} N={N} scales", nan_ok=True)
        if N > 500:
            assert torch.isnan(scales[3]) and scales[1] == 0 and scales[4] == 1


def test_fp8_encode(run):
    """The client's CUDA fp8 encode (block_quantize kind 2) against python_ref's
    fp8_encode, bit for bit: scales (a NaN scale any NaN) and every code, up to the sign
    of a NaN code (the GPU's Inf / Inf is +NaN, x86's -NaN: both decode to NaN).  Odd
    sizes and a tail block, an all-zero block, -0.0, subnormals, Inf and NaN, every one
    of the 256 codes (tests/test_compressed_encode.py's inputs), ties to even, empty."""
    from test_compressed_encode import edge_input, every_code_input

    for x, block in ((edge_input(1000 + 7, torch.float32), 96), (edge_input(31, torch.float32), 32),
                     (every_code_input(), 256), (torch.zeros(0), 32)):
        N = x.numel()
        got = run.run(dict(kernel="encode_fp8", dtype="fp32", N=N, block=block), dict(x=x),
                      dict(codes=(torch.uint8, (N,)), scales=(torch.float32, (-(-N // block),))))
        codes, scales = codec_ref.fp8_encode(x, block)
        want = codes.view(torch.uint8)
        nan = (want & 0x7F) == 0x7F
        assert bool((((got["codes"] & 0x7F) == 0x7F) == nan).all()), f"fp8 N={N}: NaN codes"
        assert_bitwise(torch.where(nan, 0x7F, got["codes"]), torch.where(nan, 0x7F, want), f"fp8 N={N} codes")
        assert_bitwise(got["scales"], scales, f"fp8 N={N} scales", nan_ok=True)


def topk_harness_input(N: int, dtype) -> torch.Tensor:
    """|x| from a few levels (so the k-th largest sits in a tie group and the selection
    goes down into the index digits), both signs, +-0, +-Inf, NaNs of both signs, fp32
    subnormals (0 in fp16 / bf16) and fp16 subnormals, a few distinct values."""
    g = torch.Generator().manual_seed(N + 7)
    levels = torch.tensor([0.0, 0.25, 1.0, 3.0, 1e-3, 1e-40, 6e-6], dtype=torch.float64)
    sign = torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0).double()
    x = levels[torch.randint(0, len(levels), (N,), generator=g)] * sign
    x[3], x[17], x[30] = float("nan"), -float("nan"), float("inf")
    x[11], x[12], x[N - 1] = -float("inf"), -0.0, float("nan")
    x[20:40] = torch.randn(20, generator=g, dtype=torch.float64) * 10
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_encode(run, dtype):
    """The client's CUDA top-k encode (a radix select over (|x| as fp32, ~index) keys)
    against python_ref's stable sort, bit for bit: indices, and values up to a NaN's
    payload (python_ref keeps x's NaN; the conversion to fp32 may give another NaN).  Two
    compaction tiles (N = 4096 + 905, odd), k = 0, 1, N - 1, N and k's that cut tie groups
    (so the selection reaches the index digits); NaN above +Inf, -0 equal to +0; distinct
    values (the selection ends within the magnitude's digits); empty; and the 64-bit
    index digits (the path of N > 2^32) forced on the tie cuts."""
    N = 4096 + 905
    x = topk_harness_input(N, dtype)
    order = P_sorted_magnitudes(x)
    distinct = randn((2 * 1024 + 1,), dtype, 42)  # no ties: the magnitude's digits decide
    cases = [(x, k, 0) for k in (0, 1, 2, N // 2, N - 1, N)] + [(distinct, 20, 0), (distinct, 1000, 0), (x[:0], 0, 0)]
    cases += [(x, 2, 1), (x, N // 2, 1)]  # the 64-bit index digits (taken above 2^32 elements) on the same ties
    for x_, k, index64 in cases:
        n = x_.numel()
        got = run.run(dict(kernel="topk_encode", dtype=name(dtype), N=n, k=k, index64=index64), dict(x=x_),
                      dict(values=(torch.float32, (k,)), indices=(torch.int64, (k,))))
        values, indices = codec_ref.topk_encode(x_, k)
        assert_bitwise(got["indices"], indices, f"{name(dtype)} N={n} k={k} indices")
        assert_bitwise(got["values"], values, f"{name(dtype)} N={n} k={k} values", nan_ok=True)
    # the cuts fall inside groups of equal keys, so the selection reached the index digits:
    # k = 2 between the NaNs (at 3, 17, N - 1), k = N // 2 among equal finite magnitudes
    assert all(v != v for v in order[:3]) and order[N // 2 - 1] == order[N // 2], order[:3]


def test_topk_scan_over_many_tiles(run):
    """The compaction's tile offsets (topk_scan_kernel) over 5000 tiles, three steps of
    its block (2048 tiles each, the running total carried): the exclusive prefix sums of
    the counts, which include 0, the largest a tile can hold (4096) and totals > 2^32."""
    g = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 4097, (5000,), generator=g, dtype=torch.int64)
    counts[:7] = 0
    counts[2047:2050] = 4096
    counts[4000] = 1 << 33  # not a tile's count, but the carry is 64-bit
    got = run.run(dict(kernel="topk_scan", dtype="fp32", tiles=5000), dict(counts=counts),
                  dict(counts=(torch.int64, (5000,))))["counts"]
    want = torch.cumsum(counts, 0) - counts
    assert torch.equal(got, want), (got != want).nonzero()[:5].reshape(-1).tolist()


def P_sorted_magnitudes(x):
    return torch.sort(x.to(torch.float32).abs(), descending=True, stable=True).values.tolist()


# ----------------------------------------------------------------------------- compiled Triton

def triton_archs(run) -> list[int]:
    """``FEDOPT_HARNESS_TRITON_ARCHS`` (e.g. ``80 90``), else the device's: sm_90 and up
    take Triton's sm_90 code, sm_80 to sm_89 its sm_80 code."""
    if os.environ.get("FEDOPT_HARNESS_TRITON_ARCHS"):
        return [int(a) for a in os.environ["FEDOPT_HARNESS_TRITON_ARCHS"].split()]
    m = re.search(r"sm_(\d)(\d)", run.device)
    return [90 if m and int(m.group(1)) >= 9 else 80]


def aot(spec: dict) -> dict:
    """tests/_triton_aot_case.py in a subprocess without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(H.ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(H.ROOT / "tests" / "_triton_aot_case.py")], input=json.dumps(spec),
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def run_triton(run, compiled: dict, grid: int, arrays: list, args: list, outputs: dict):
    """Launches the compiled kernel: ``args`` are the kernel's own arguments; the scratch
    pointers Triton appends (the PTX entry's extra parameters) get null."""
    extra = len(compiled["params"]) - len(args)
    assert extra >= 0, (compiled["params"], args)
    keys = dict(kernel="triton", module="kernel.ptx", name=compiled["name"], grid=[grid, 1, 1],
                block=32 * compiled["num_warps"], shared=compiled["shared"])
    inputs = dict(arrays)
    lines = [[n, t.numel() * t.element_size(), 0, *(["out"] if n in outputs else [])] for n, t in arrays]
    return run.run(keys, inputs, outputs, args=args + [["null"]] * extra,
                   files={"kernel.ptx": compiled["ptx"].encode()},
                   arrays=lines)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of their float dtype (finite values): the
    sign-magnitude bit patterns mapped onto a monotonic integer line."""
    def ordered(t):
        i = bits(t).long()
        lowest = -(1 << (8 * t.element_size() - 1))
        return torch.where(i < 0, lowest - i, i)

    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_add_noise_compiled(run, dtype):
    """Triton's add_noise_kernel as compiled for the device: bit for bit python_ref's
    noise (the contract of every backend) and the interpreter's result."""
    import fedopt_kernels.backends.triton as TB

    acc = acc_of(dtype)
    block, warps = TB.noise_launch_config(dtype)
    N, key, std = 2 * block + 77, 987654321, 0.37  # two full blocks and a masked tail
    out = randn((N,), dtype, 4)
    want = (out.to(acc) + torch.tensor(std, dtype=acc) * noise_ref.noise(key, N).to(acc)).to(dtype)
    interp = out.clone()
    Backend("triton", CPU).module.add_noise_(interp, key, std, None)
    assert_bitwise(interp, want, "interpreter vs python_ref")
    for arch in triton_archs(run):
        compiled = aot(dict(module="fedopt_kernels.backends.triton.add_noise", kernel="add_noise_kernel",
                            types=dict(out_ptr="*" + TRITON_TY[dtype], std_ptr="*" + TRITON_TY[dtype],
                                       skip_ptr="*" + TRITON_TY[dtype], std_value="fp64", noise_key="i64", N="i64"),
                            constexprs=dict(ACC=TRITON_TY[acc], STD_KIND=0, HAS_SKIP=False, BLOCK=block),
                            aligned=["out_ptr", "std_ptr", "skip_ptr"], warps=warps,
                            options=dict(enable_fp_fusion=False), arch=arch))
        got = run_triton(run, compiled, -(-N // block), [["out", out]],
                         [["ptr", "out"], ["ptr", "out"], ["ptr", "out"], ["f64", std], ["i64", key], ["i64", N]],
                         dict(out=(dtype, (N,))))["out"]
        assert_bitwise(got, want, f"compiled sm_{arch} vs python_ref")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_nar_norm_rows_compiled(run, dtype, record_property):
    """Triton's nar_norm_kernel ([C, N] rows, mode co) as compiled for the device: each
    chunk's partial sum of squares against float64 (rtol 2e-5, 1e-13 for fp64) and
    against the interpreter's, in ulps of the acc dtype (the compiled code contracts
    g + wd * x into an FMA and sums in its own tree; the interpreter rounds each numpy
    op): at most 4 ulps apart, the largest difference recorded."""
    import importlib

    import fedopt_kernels.backends.triton as TB
    from fedopt_kernels.backends import _chunks

    NS = importlib.import_module("fedopt_kernels.backends.triton.nar_step")
    acc = acc_of(dtype)
    C, N, wd = 3, 4099, 0.01
    X, G = randn((C, N), dtype, 21), randn((C, N), dtype, 22)
    chunk = _chunks.chunk_size_for(N)
    row_chunks = -(-N // chunk)
    nblock, nwarps = TB.norm_launch_config(dtype)
    mis = _chunks.rows_misalignment([X.data_ptr(), G.data_ptr()])
    assert mis == 0, "the CPU tensors must be 16-byte aligned like the device arrays"
    cx = dict(ESIZE=TB.ESIZES[dtype], MODE=0, WD_KIND=0, HAS_GS=False, ROWS=True, BLOCK=nblock)
    interp = torch.zeros(C * row_chunks, dtype=acc)
    NS.nar_norm_kernel[(C * row_chunks,)](interp, interp, interp, interp, interp, wd, X.data_ptr(), G.data_ptr(), N,
                                          row_chunks, chunk, 0, num_warps=nwarps, DTYPE=TB.TL_DTYPES[dtype],
                                          ACC=TB.TL_DTYPES[acc], **cx)
    # float64 oracle per chunk
    v = G.double() + wd * X.double()
    exact = torch.stack([(v[r, k * chunk:(k + 1) * chunk] ** 2).sum() for r in range(C) for k in range(row_chunks)])
    rtol = 1e-13 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(interp.double(), exact, rtol=rtol, atol=0.0)
    a = "*" + TRITON_TY[acc]
    for arch in triton_archs(run):
        compiled = aot(dict(module="fedopt_kernels.backends.triton.nar_step", kernel="nar_norm_kernel",
                            types=dict(tab_ptr=a, groups_ptr=a, part_ptr=a, wd_ptr=a, gs_ptr=a, wd_value="fp64",
                                       x_base="i64", g_base="i64", row_len="i64", row_chunks="i64", chunk="i64",
                                       mis="i64"),
                            constexprs=dict(cx, DTYPE=TRITON_TY[dtype], ACC=TRITON_TY[acc]),
                            aligned=["tab_ptr", "groups_ptr", "part_ptr", "wd_ptr", "gs_ptr"], warps=nwarps, arch=arch))
        part = torch.zeros(C * row_chunks, dtype=acc)
        got = run_triton(run, compiled, C * row_chunks, [["part", part], ["x", X], ["g", G]],
                         [["ptr", "part"]] * 5 + [["f64", wd], ["addr", "x"], ["addr", "g"], ["i64", N],
                                                  ["i64", row_chunks], ["i64", chunk], ["i64", 0]],
                         dict(part=(acc, (C * row_chunks,))))["part"]
        torch.testing.assert_close(got.double(), exact, rtol=rtol, atol=0.0)
        diff = ulps(got, interp)
        record_property(f"nar_norm_ulps_sm_{arch}", diff.tolist())
        report = os.environ.get("FEDOPT_HARNESS_REPORT")
        if report:
            with open(report, "a") as f:
                f.write(f"nar_norm_kernel {dtype} sm_{arch}: compiled vs interpreter ulps per chunk {diff.tolist()}\n")
        assert int(diff.max()) <= 4, diff.tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_aggregate_compiled(run, dtype):
    """Triton's aggregate_kernel ([C, N] clients, gamma a float) as compiled for the
    device: out against python_ref under the CUDA rules, and against the interpreter's
    out: the compiled sum contracts w * x + s into FMAs (the contract allows it on a
    GPU), so the two differ by rounding errors of the size of the terms, eps(acc) *
    gamma * sum_i |w_i x_i| (many ulps of a sum that cancels to near 0): within 4 of
    those plus 1 ulp of the out dtype; the ulp counts are recorded."""
    import fedopt_kernels.backends.triton as TB
    from fedopt_kernels.backends import _chunks

    acc = acc_of(dtype)
    C, N, gamma = 5, 4099, 0.9
    X = randn((C, N), dtype, 31)
    w = torch.tensor([0.5, 0.0, 1.0, 0.25, 0.75], dtype=acc)
    block, warps, nblk = TB.aggregate_tiling(N, dtype)
    assert _chunks.rows_misalignment([X.data_ptr()]) == 0, "aligned like the device arrays"
    want = torch.full((N,), 7.0, dtype=dtype)
    REF.aggregate(X, w, gamma, want, None)
    interp = torch.full((N,), 7.0, dtype=dtype)
    Backend("triton", CPU).aggregate(X, w, gamma, interp, None)
    assert_values_close(GPU, interp, want)
    a, d = "*" + TRITON_TY[acc], "*" + TRITON_TY[dtype]
    for arch in triton_archs(run):
        compiled = aot(dict(module="fedopt_kernels.backends.triton.aggregate", kernel="aggregate_kernel",
                            types=dict(ctab_ptr=a, w_ptr=a, out_ptr=d, part_ptr=a, skip_ptr=a, gamma_ptr=a, std_ptr=a,
                                       gamma_value="fp64", std_value="fp64", noise_key="i64", x_base="i64", C="i64",
                                       N="i64", nblk="i64", mis="i64"),
                            constexprs=dict(DTYPE=TRITON_TY[dtype], ESIZE=TB.ESIZES[dtype], ACC=TRITON_TY[acc],
                                            TWO_D=True, HAS_SKIP=False, GAMMA_KIND=0, NOISE=False, STD_KIND=0,
                                            BLOCK=block),
                            aligned=["ctab_ptr", "w_ptr", "out_ptr", "part_ptr", "skip_ptr", "gamma_ptr", "std_ptr"],
                            warps=warps, arch=arch))
        part = torch.zeros((C + 1) * nblk, dtype=acc)
        got = run_triton(run, compiled, nblk, [["part", part], ["w", w], ["out", torch.full((N,), 7.0, dtype=dtype)],
                                               ["X", X]],
                         [["ptr", "part"], ["ptr", "w"], ["ptr", "out"], ["ptr", "part"], ["ptr", "part"],
                          ["ptr", "part"], ["ptr", "part"], ["f64", gamma], ["f64", 0.0], ["i64", 0], ["addr", "X"],
                          ["i64", C], ["i64", N], ["i64", nblk], ["i64", 0]],
                         dict(out=(dtype, (N,))))["out"]
        assert_values_close(GPU, got, want)
        diff = ulps(got, interp)
        report = os.environ.get("FEDOPT_HARNESS_REPORT")
        if report:
            with open(report, "a") as f:
                f.write(f"aggregate_kernel {dtype} sm_{arch}: compiled vs interpreter: max {int(diff.max())} ulp, "
                        f"{int((diff > 0).sum())} of {N} elements differ\n")
        terms = gamma * (w.double().abs()[:, None] * X.double().abs()).sum(0)
        tol = 4 * torch.finfo(acc).eps * terms + ulp(want, dtype)
        excess = (got.double() - interp.double()).abs() - tol
        assert float(excess.max()) <= 0, float(excess.max())


TRITON_TY = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


# ----------------------------------------------------------------------------- compiled Triton, table-driven
#
# The Triton backend's own wrappers (their chunk and client tables built by _tables.py,
# their launch configurations, dummies and follow-up launches) with every kernel
# compiled for the device and run by the harness, the tables' host addresses replaced by
# device addresses (tests/_triton_on_harness.py says how).  Each result is held to
# python_ref under the CUDA rules, bit for bit where the contract promises bits, and
# against the interpreter's run of the same wrapper in ulps (reported).

def _ulps_report(what, got, interp):
    """The largest |compiled - interpreter| in ulps over the elements finite in both
    (NaNs in the same places), written to FEDOPT_HARNESS_REPORT."""
    got, interp = got.reshape(-1), interp.reshape(-1)
    assert torch.equal(torch.isnan(got), torch.isnan(interp)), what
    fin = torch.isfinite(got) & torch.isfinite(interp)
    diff = ulps(got[fin], interp[fin]) if bool(fin.any()) else torch.zeros(1, dtype=torch.long)
    worst, differ = int(diff.max()), int((diff > 0).sum())
    report = os.environ.get("FEDOPT_HARNESS_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(f"{what}: compiled vs interpreter: max {worst} ulp, {differ} of {got.numel()} differ\n")
    return worst


def _on_harness(run, arch, tensors):
    from _triton_on_harness import on_harness

    return on_harness(run, arch, aot, tensors)


TRI = Backend("triton", CPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_tables_nar_list_compiled(run, dtype, monkeypatch):
    """nar_step_ over a list (one group of 7 chunks from the chunk table: views at odd
    offsets, an empty tensor, a single element, masked tails; the gaps between the
    views untouched) compiled: nar_norm_kernel + nar_update_kernel against python_ref;
    with the group-sum pass forced (group_sum_kernel, FINALIZED) and as nar_sq_norm +
    nar_apply_, bit for bit the plain step (the contract of every backend); each against
    the interpreter in ulps."""
    flat = nar_list_inputs(dtype)
    ref = [t.clone() for t in flat]
    args = (0.1, NAR_HYPER["weight_decay"], NAR_HYPER["max_norm"], 0, 0.9, None, None)
    st = REF.nar_step_(views(ref[0]), views(ref[1]), views(ref[2]), *args)
    interp = [t.clone() for t in flat]
    ist = TRI.nar_step_(views(interp[0]), views(interp[1]), views(interp[2]), *args)
    for arch in triton_archs(run):
        got = [t.clone() for t in flat]
        with _on_harness(run, arch, got) as log:
            gst = TRI.nar_step_(views(got[0]), views(got[1]), views(got[2]), *args)
        assert [k for k, _, _ in log] == ["nar_norm_kernel", "nar_update_kernel"], log
        assert all(r == 7 * 3 for _, _, r in log), log  # 7 chunk rows of x, g, b addresses
        assert_values_close(GPU, got[0], ref[0])
        assert_values_close(GPU, got[2], ref[2])
        assert_stats_close(GPU, _stats(gst), _stats(st), dtype)
        assert_bitwise([got[1]], [flat[1]], "g untouched")
        # The compiled update contracts b = mu b + (s g + wd x) and x - lr b into FMAs (the
        # contract allows it on a GPU; the interpreter rounds every numpy op), so the two
        # differ by rounding errors of the terms, not of the result: within 4 eps(acc) of
        # them plus 1 ulp of the dtype (many ulps of a result that cancels to near 0).
        acc = acc_of(dtype)
        x0, g0, b0 = (t.to(acc).abs() for t in flat)
        s = float(gst[1])
        terms_b = 0.9 * b0 + s * g0 + NAR_HYPER["weight_decay"] * x0
        for k, what, terms in ((0, "x", x0 + 0.1 * terms_b), (2, "b", terms_b)):
            _ulps_report(f"nar_step_ list {what} {dtype} sm_{arch}", got[k], interp[k])
            tol = 4 * torch.finfo(acc).eps * terms.double() + ulp(interp[k], dtype)
            excess = (got[k].double() - interp[k].double()).abs() - tol
            assert float(excess.max()) <= 0, (what, float(excess.max()))
        _ulps_report(f"nar_step_ list norm {dtype} sm_{arch}", gst[0], ist[0])

        monkeypatch.setenv("FEDOPT_MAX_REDUNDANT_PARTIALS", "0")
        fin = [t.clone() for t in flat]
        with _on_harness(run, arch, fin) as log:
            fst = TRI.nar_step_(views(fin[0]), views(fin[1]), views(fin[2]), *args)
        monkeypatch.delenv("FEDOPT_MAX_REDUNDANT_PARTIALS")
        assert [k for k, _, _ in log] == ["nar_norm_kernel", "group_sum_kernel", "nar_update_kernel"], log
        assert_bitwise([fin[0], fin[2], fst[0], fst[1]], [got[0], got[2], gst[0], gst[1]],
                       f"sm_{arch} group-sum pass vs redundant combine")

        two = [t.clone() for t in flat]
        with _on_harness(run, arch, two) as log:
            sq = TRI.nar_sq_norm(views(two[0]), views(two[1]), NAR_HYPER["weight_decay"], 0, None)
            ast = TRI.nar_apply_(views(two[0]), views(two[1]), views(two[2]), sq, *args[:2], *args[2:])
        assert [k for k, _, _ in log] == ["nar_norm_kernel", "group_sum_kernel", "nar_update_kernel"], log
        assert_norms_close(GPU, sq, REF.nar_sq_norm(views(flat[0]), views(flat[1]), NAR_HYPER["weight_decay"], 0,
                                                    None), dtype)
        assert_bitwise([two[0], two[2], ast[0], ast[1]], [got[0], got[2], gst[0], gst[1]],
                       f"sm_{arch} nar_apply_(nar_sq_norm) vs nar_step_")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_tables_server_update_compiled(run, dtype):
    """server_update_ over a list (the 4-pointer chunk table: x, D, exp_avg, exp_avg_sq)
    compiled, every rule, tensors alternately at 16-byte aligned and odd offsets (both
    bodies in one launch): bit for bit the exact oracle (each op rounded once; the
    wrapper compiles it without FMA contraction), hence the interpreter."""
    acc = acc_of(dtype)
    step_x = 16 // torch.empty((), dtype=dtype).element_size()
    step_d = 16 // torch.empty((), dtype=acc).element_size()
    offs, doffs, o, od = [], [], 0, 0
    for k, n in enumerate(SERVER_SIZES):
        if k % 2 == 0:
            o, od = -(-o // step_x) * step_x, -(-od // step_d) * step_d
        offs.append(o)
        doffs.append(od)
        o, od = o + n + 1, od + n + 1
    g = torch.Generator().manual_seed(7)
    x = torch.randn(o + 1, generator=g, dtype=torch.float64).to(dtype)
    d = (torch.randn(od + 1, generator=g, dtype=torch.float64) * 0.3).to(acc)
    m = (torch.randn(o + 1, generator=g, dtype=torch.float64) * 0.1).to(dtype)
    v = (torch.rand(o + 1, generator=g, dtype=torch.float64) * 0.05 + 1e-4).to(dtype)
    d[3::11] = 0.5
    v[3::11] = 0.25

    def vs(t, oo):
        return [t[a:a + n] for a, n in zip(oo, SERVER_SIZES)]

    h = SERVER_HYPER
    for rule, (code, nesterov) in SERVER_RULES.items():
        want = server_update_want(code, nesterov, x, m, v, d, offs, doffs, acc, dtype)
        interp = [x.clone(), m.clone(), v.clone()]
        TRI.server_update_(vs(interp[0], offs), vs(d, doffs), vs(interp[1], offs), vs(interp[2], offs), code,
                           h["lr"], h["gamma"], h["beta1"], h["beta2"], h["tau"], nesterov, None)
        assert_bitwise(interp, [want["x"], want["m"], want["v"]], f"{rule} interpreter", nan_ok=True)
        for arch in triton_archs(run):
            got = [x.clone(), m.clone(), v.clone()]
            with _on_harness(run, arch, [*got, d]) as log:
                TRI.server_update_(vs(got[0], offs), vs(d, doffs), vs(got[1], offs), vs(got[2], offs), code,
                                   h["lr"], h["gamma"], h["beta1"], h["beta2"], h["tau"], nesterov, None)
            assert [k for k, _, _ in log] == ["server_update_kernel"], log
            assert_bitwise(got, [want["x"], want["m"], want["v"]], f"{rule} {dtype} sm_{arch}", nan_ok=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_tables_clients_compiled(run, dtype):
    """A list of clients (the client table: addresses and alignment flags, clients at
    odd offsets and aligned ones) compiled: aggregate_kernel + row_sum_kernel (out, the
    norms) and client_dots_kernel + row_sum_kernel, against python_ref under the CUDA
    rules and against the interpreter in ulps; 4099 columns (two tiles, a masked tail)."""
    acc = acc_of(dtype)
    C, N = 5, 4099
    buf = randn((C * (N + 1) + 1,), dtype, 41)
    clients = [buf[1 + i * (N + 1):1 + i * (N + 1) + N] if i % 2 else buf[i * (N + 1):i * (N + 1) + N]
               for i in range(C)]
    clients[3] = randn((N,), dtype, 42)  # its own allocation
    w = torch.tensor([0.5, 0.0, 1.0, 0.25, 0.75], dtype=acc)
    g = randn((N,), dtype, 43)
    want = torch.full((N,), 7.0, dtype=dtype)
    q, Q = REF.aggregate(clients, w, 0.9, want, None)
    interp = torch.full((N,), 7.0, dtype=dtype)
    iq, _ = TRI.aggregate(clients, w, 0.9, interp, None)
    dots_ref, idots = REF.client_dots(clients, g), TRI.client_dots(clients, g)
    for arch in triton_archs(run):
        out = torch.full((N,), 7.0, dtype=dtype)
        with _on_harness(run, arch, [buf, clients[3]]) as log:
            gq, gQ = TRI.aggregate(clients, w, 0.9, out, None)
            dots = TRI.client_dots(clients, g)
        assert [k for k, _, _ in log] == ["aggregate_kernel", "row_sum_kernel", "client_dots_kernel",
                                          "row_sum_kernel"], log
        assert log[0][2] == C and log[2][2] == C, log  # one address per client
        assert_values_close(GPU, out, want)
        assert_norms_close(GPU, gq, q, dtype)
        assert_norms_close(GPU, gQ, Q, dtype)
        assert_norms_close(GPU, dots, dots_ref, dtype, atol=1e-5 * float(N) ** 0.5)
        _ulps_report(f"aggregate list out {dtype} sm_{arch}", out, interp)
        _ulps_report(f"aggregate list q {dtype} sm_{arch}", gq, iq)
        _ulps_report(f"client_dots list {dtype} sm_{arch}", dots, idots)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_coordinate_select_compiled(run, dtype):
    """coordinate_select (trimmed mean and closest-to-median mean of the kept clients,
    a left-out client's Inf and NaN, kept NaNs ordered after +inf) compiled, 5 clients
    (the 32-slot tile) and 40 (128): flags equal and out against python_ref under the
    CUDA rules; against the interpreter in ulps.  (On GPGPU-Sim it needed
    ``redux.sync.max.s32`` and ``setp`` on .f16/.bf16, added beside the project.)"""
    acc = acc_of(dtype)
    for C, N, count, mode in ((5, 300, 1, 0), (40, 130, 7, 1)):
        X = randn((C, N), dtype, C)
        keep = torch.ones(C, dtype=torch.bool)
        keep[2] = False
        X[2, 10] = float("inf")
        X[3, 20] = float("nan")
        X[0, 21] = X[4, 21] = float("nan")
        X[1, 22] = float("nan")
        X[4, 22] = float("inf")
        X[2, 23] = float("nan")
        count_t = torch.tensor([count])
        want = torch.full((N,), 7.0, dtype=acc)
        flags = reference_backend.coordinate_select(X, keep, count_t, mode, want, None)
        interp = torch.full((N,), 7.0, dtype=acc)
        iflags = TRI.coordinate_select(X, keep, count_t, mode, interp, None)
        assert torch.equal(iflags, flags)
        for arch in triton_archs(run):
            out = torch.full((N,), 7.0, dtype=acc)
            with _on_harness(run, arch, []) as log:
                got_flags = TRI.coordinate_select(X, keep, count_t, mode, out, None)
            assert [k for k, _, _ in log] == ["coordinate_select_kernel"], log
            assert torch.equal(got_flags, flags), (got_flags, flags)
            assert_values_close(GPU, out, want)
            _ulps_report(f"coordinate_select C={C} mode={mode} {dtype} sm_{arch}", out, interp)
            # the selected values' sum is tl.sum's tree compiled and numpy's order
            # interpreted: apart by rounding errors of the terms, at most max |x| of the
            # column's kept values each (many ulps of a mean near 0)
            kept = torch.where(keep[:, None] & torch.isfinite(X), X.double().abs(), 0.0).amax(0)
            tol = 4 * torch.finfo(acc).eps * kept + ulp(interp, acc)
            fin = torch.isfinite(out) & torch.isfinite(interp)
            excess = (out.double() - interp.double()).abs()[fin] - tol[fin]
            assert float(excess.max()) <= 0, float(excess.max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_tables_variants_compiled(run, dtype):
    """The other compiled variants of the table-driven kernels: the list aggregation with
    DP noise (std a tensor, a 63-bit key: the noiseless compiled sum in the acc dtype plus
    python_ref's noise, rounded once, bit for bit, the norms unchanged) and with skip
    (out untouched, zero norms); server_update_ with lr and gamma as tensors (the bits of
    the same floats) and with skip (nothing written); nar_step_ over a list with a grad
    scale read on the device (mode grad, against python_ref) and with found_inf (skipped,
    nothing written)."""
    from fedopt_kernels.backends.hyper import split

    acc = acc_of(dtype)
    C, N = 5, 4099
    X = randn((C, N), dtype, 51)
    clients = [X[i].clone() for i in range(C)]
    w = torch.tensor([0.5, 0.0, 1.0, 0.25, 0.75], dtype=acc)
    key, std = (1 << 63) - 1, torch.tensor(0.6, dtype=acc)
    n, sx, sd = 4100, randn((4100,), dtype, 52), randn((4100,), acc, 53, 0.3)
    h = SERVER_HYPER
    flat = nar_list_inputs(dtype, seed=5)
    gs = torch.tensor(4.0, dtype=acc)
    args = (0.1, NAR_HYPER["weight_decay"], NAR_HYPER["max_norm"], 1, 0.9)
    ref = [t.clone() for t in flat]
    st = REF.nar_step_(views(ref[0]), views(ref[1]), views(ref[2]), *args, gs, None)
    for arch in triton_archs(run):
        plain, noisy = torch.full((N,), 7.0, dtype=acc), torch.full((N,), 7.0, dtype=dtype)
        skipped = torch.full((N,), 7.0, dtype=dtype)
        fx, tx, kx = sx.clone(), sx.clone(), sx.clone()
        got, held = [t.clone() for t in flat], [t.clone() for t in flat]
        with _on_harness(run, arch, [*clients, *got, *held, fx, tx, kx, sd]) as log:
            q0, Q0 = TRI.module.aggregate(clients, w, 0.9, None, plain, None)
            q, Q = TRI.module.aggregate(clients, w, 0.9, None, noisy, None, key, *split(std))
            qs, Qs = TRI.module.aggregate(clients, w, 0.9, None, skipped, torch.tensor(True))
            TRI.server_update_([fx], [sd], [], [], 0, h["lr"], h["gamma"], h["beta1"], h["beta2"], h["tau"], False,
                               None)
            TRI.server_update_([tx], [sd], [], [], 0, torch.tensor(h["lr"], dtype=acc),
                               torch.tensor(h["gamma"], dtype=acc), h["beta1"], h["beta2"], h["tau"], False, None)
            TRI.server_update_([kx], [sd], [], [], 0, h["lr"], h["gamma"], h["beta1"], h["beta2"], h["tau"], False,
                               torch.tensor(True))
            gst = TRI.nar_step_(views(got[0]), views(got[1]), views(got[2]), *args, gs, None)
            fst = TRI.nar_step_(views(held[0]), views(held[1]), views(held[2]), *args, None, torch.tensor(1.0))
        assert len(log) == 3 * 2 + 3 + 2 * 2, log
        want = (plain + std * noise_ref.noise(key, N).to(acc)).to(dtype)
        assert_bitwise(noisy, want, f"sm_{arch} aggregate with noise")
        assert_bitwise([q, Q], [q0, Q0], "norms with and without the noise")
        assert_bitwise(skipped, torch.full((N,), 7.0, dtype=dtype), "skip: out untouched")
        assert_bitwise([qs, Qs], [torch.zeros(C, dtype=acc), torch.zeros((), dtype=acc)], "skip: zero norms")
        assert_bitwise(tx, fx, f"sm_{arch} tensor vs float lr and gamma")
        assert not torch.equal(fx, sx)
        assert_bitwise(kx, sx, "server update skipped")
        assert_values_close(GPU, got[0], ref[0])
        assert_values_close(GPU, got[2], ref[2])
        assert_stats_close(GPU, _stats(gst), _stats(st), dtype)
        assert bool(fst[2])
        assert_bitwise(held, flat, "found_inf: nothing written")


def _codes_bits(codes):
    return codes.view(torch.uint8) if codes.dtype != torch.int8 else codes


@pytest.mark.parametrize("codec,stochastic", CODEC_CASES, ids=[f"{c}{'-sr' if s else ''}" for c, s in CODEC_CASES])
def test_triton_codecs_compiled(run, codec, stochastic):
    """The Triton codec kernels compiled, through the backend's own wrappers
    (backends/compressed.py, backend "triton"): the client's encode
    (block_quantize_kernel, int8/int4 nearest and stochastic; fp8_encode_kernel) bit for
    bit python_ref's codes and scales (fp8 NaN codes up to their sign, as
    test_fp8_encode); the decode-aggregate (block_decode_aggregate_kernel or
    topk_scatter_kernel + topk_finish_kernel, then row_sum_kernel) out bit for bit
    python_ref's (compiled without FMA contraction), the norms under the CUDA rules and
    against the interpreter in ulps (reported).  fp32 updates (the op widens), N = 1029:
    two programs of 1024 columns, the second a masked tail, 17 blocks of 64, the last
    partial (an odd int4 tail); 3 clients, one of weight 0; the encode of an edge input
    too (a zero block, a NaN block, ties; fp8: -0.0, subnormals, Inf, NaN); gamma a float,
    then a tensor with a NaN scale / a NaN top-k value in client 2."""
    from test_compressed_encode import edge_input

    N, block, key = 1029, 64, (1 << 62) + 5
    w = torch.tensor([0.75, 0.0, 1.5])
    xs = [randn((N,), torch.float32, 100 + i) * (i + 1) for i in range(3)]
    xs[0][64:128] = 0.0
    kind = compressed_backend.KINDS.get(codec)
    if codec == "fp8":
        edge = edge_input(N, torch.float32)
    else:
        edge = randn((N,), torch.float32, 9, scale=3.0)
        edge[200] = float("nan")                                # block 3: NaN scale, codes 0
        qmax = 127.0 if codec == "int8" else 7.0
        edge[256:320] = (torch.arange(64) - 40.5).clamp(-qmax, qmax) if codec == "int8" else 0.0
        edge[256] = qmax                                        # block 4: scale 1, ties at .5
        if codec == "int4":
            edge[257:263] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -6.5])
    if codec == "topk":
        replies = [C_ops.encode(x, "topk", k=k, backend="reference") for x, k in zip(xs, (5, N // 3, 1))]
    else:
        replies = [C_ops.encode(x, codec, block=block, stochastic=stochastic, key=key, client=i, backend="reference")
                   for i, x in enumerate(xs)]
    bad = replies[2]
    if codec == "topk":
        v = bad.codes.clone()
        v[0] = float("nan")
        bad = dataclasses.replace(bad, codes=v)
    else:
        s = bad.scales.clone()
        s[1] = float("nan")
        bad = dataclasses.replace(bad, scales=s)
    rounds = [(replies, 0.5, None), ([replies[0], replies[1], bad], 0.5, torch.tensor(0.5))]

    def decode_aggregate(backend, reps, gamma, gamma_t):
        out = torch.full((N,), 7.0)
        if codec == "topk":
            q, Q = compressed_backend.topk_decode_aggregate(backend)(
                [r.codes for r in reps], [r.indices for r in reps], N, w, gamma, gamma_t, out, None)
        else:
            q, Q = compressed_backend.block_decode_aggregate(backend)(
                [r.codes.view(torch.uint8) if codec == "fp8" else r.codes for r in reps], [r.scales for r in reps],
                kind, block, N, w, gamma, gamma_t, out, None)
        return out, q, Q

    want = [decode_aggregate("reference", *r) for r in rounds]
    interp = [decode_aggregate("triton", *r) for r in rounds]
    assert torch.isnan(want[1][0]).any() and torch.isnan(want[1][1][2]) and not torch.isnan(want[1][1][:2]).any()
    encode_inputs = [(x, i) for i, x in enumerate(xs)] + [(edge, 7)] if codec != "topk" else []
    quantize = compressed_backend.block_quantize
    for arch in triton_archs(run):
        for x, client in encode_inputs:
            ref_codes, ref_scales = quantize("reference")(x, kind, block, stochastic, key, client)
            with _on_harness(run, arch, []) as log:
                codes, scales = quantize("triton")(x, kind, block, stochastic, key, client)
            assert [k for k, _, _ in log] == ["fp8_encode_kernel" if codec == "fp8" else "block_quantize_kernel"]
            assert codes.dtype == ref_codes.dtype and scales.dtype == torch.float32
            got_c, want_c = _codes_bits(codes), _codes_bits(ref_codes)
            if codec == "fp8":  # a NaN code up to its sign (the GPU's Inf / Inf is +NaN, x86's -NaN)
                nan = (want_c & 0x7F) == 0x7F
                assert torch.equal((got_c & 0x7F) == 0x7F, nan), f"sm_{arch} fp8 client {client}: NaN codes"
                got_c, want_c = torch.where(nan, 0x7F, got_c), torch.where(nan, 0x7F, want_c)
            assert_bitwise(got_c, want_c, f"sm_{arch} {codec} client {client} codes")
            assert_bitwise(scales, ref_scales, f"sm_{arch} {codec} client {client} scales", nan_ok=True)
        for r, (out_w, q_w, Q_w), (out_i, q_i, Q_i) in zip(rounds, want, interp):
            with _on_harness(run, arch, []) as log:
                out, q, Q = decode_aggregate("triton", *r)
            kernels = [k for k, _, _ in log]
            if codec == "topk":
                assert kernels == ["topk_scatter_kernel"] * 3 + ["topk_finish_kernel", "row_sum_kernel"], kernels
            else:
                assert kernels == ["block_decode_aggregate_kernel", "row_sum_kernel"], kernels
            what = (f"sm_{arch} {codec}{'-sr' if stochastic else ''} "
                    f"{'gamma tensor, a NaN in client 2' if r[2] is not None else 'gamma float'}")
            assert_bitwise(out, out_w, f"{what} out", nan_ok=True)
            assert torch.equal(torch.isnan(q), torch.isnan(q_w)) and bool(torch.isnan(Q)) == bool(torch.isnan(Q_w))
            fin = ~torch.isnan(q_w)
            assert_norms_close(GPU, q[fin], q_w[fin], torch.float32)
            if not bool(torch.isnan(Q_w)):
                assert_norms_close(GPU, Q, Q_w, torch.float32)
            _ulps_report(f"{what} q", q, q_i)
            _ulps_report(f"{what} total", Q.reshape(1), Q_i.reshape(1))
