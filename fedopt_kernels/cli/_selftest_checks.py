"""The selftest's matrix: every public op, checked on one backend and device.

Each check is one row of the report (op, case group) and runs a compact set of cases
-- fp32/fp16/bf16/fp64, odd sizes, an empty tensor inside a list, several clients,
non-finite input that must be skipped or excluded -- comparing every output (params,
buffers, ``out`` AND the returned statistics) with two oracles:

* python_ref, through the same op with ``backend="reference"`` on copies of the same
  inputs (skipped when the backend under test is the reference itself), and
* the float64 formulas of ``_selftest_fp64`` written independently of python_ref, so
  that a wrong python_ref fails the reference backend's rows.

Sizes are small: the whole matrix must run in seconds on CPU, where the Triton
kernels run in the interpreter.  A check raises :class:`NotApplicable` to report a
row as SKIP with the reason; any other exception is that row's FAIL.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple

import torch

from .. import ops
from . import _selftest_fp64 as F
from ._selftest_compare import Record, Tol, acc_dtype, data_tol, dot_tol, stat_tol

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
REFERENCE = "reference"


class NotApplicable(Exception):
    """This row cannot run here (e.g. CUDA graphs without CUDA); the message says why."""


class Ctx(NamedTuple):
    backend: str
    device: torch.device
    quick: bool


class Check(NamedTuple):
    op: str
    case: str
    run: Callable[[Ctx, Record], None]
    backends: tuple = ()  # only these backends (empty: all)


CHECKS: List[Check] = []


def check(op: str, case: str, backends: tuple = ()):
    def register(fn):
        CHECKS.append(Check(op, case, fn, backends))
        return fn
    return register


# ----------------------------------------------------------------------- inputs

def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class _Data:
    """Deterministic inputs: a CPU generator per row, then moved to the device."""

    def __init__(self, ctx: Ctx, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.device = ctx.device

    def randn(self, shape, dtype, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.gen, dtype=torch.float64) * scale).to(dtype).to(self.device)

    def rand(self, shape, dtype, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
        x = torch.rand(shape, generator=self.gen, dtype=torch.float64) * (high - low) + low
        return x.to(dtype).to(self.device)


def _shapes(ctx: Ctx):
    """Odd sizes, a 2-D tensor and an empty one inside the list."""
    return [(1,), (0,), (257,), (17, 13)] if ctx.quick else [(1,), (0,), (257,), (17, 13), (4099,)]


def _clones(tensors):
    return [t.clone() for t in tensors]


def _compare_list(rec: Record, what: str, actual, expected, tol: Tol) -> None:
    for i, (a, e) in enumerate(zip(actual, expected)):
        rec.close(f"{what}[{i}]", a, e, tol)


# ------------------------------------------------------------------- nar_step_

_NAR_CASES = (  # (mode, momentum, clip): clip "half" = max_norm at half the norm (s = 0.5)
    ("co", 0.0, "half"), ("co", 0.0, "inf"), ("grad", 0.0, "half"), ("none", 0.0, "half"), ("co", 0.9, "half"))


def _clip_norm(groups, mode: str) -> float:
    return F.nar_step(groups, max_norm=float("inf"), mode=mode).norm


@check("nar_step_", "4 dtypes x modes co/grad/none/momentum, sizes 1,0,257,17x13,4099")
def nar_step_matrix(ctx: Ctx, rec: Record) -> None:
    data = _Data(ctx, 1)
    for dtype in DTYPES:
        for k, (mode, momentum, clip) in enumerate(_NAR_CASES):
            params = [data.randn(s, dtype) for s in _shapes(ctx)]
            grads = [data.randn(s, dtype) for s in _shapes(ctx)]
            bufs = [data.randn(s, dtype, 0.1) for s in _shapes(ctx)] if momentum else None
            wd = 0.01
            # a 0-d tensor lr / weight decay in some cases: the other path into the kernels
            lr = torch.tensor(0.5, dtype=acc_dtype(dtype), device=ctx.device) if k % 2 else 0.5
            g64 = F.NarGroup64(params, grads, 0.5, wd, momentum, bufs)
            max_norm = float("inf") if clip == "inf" else 0.5 * _clip_norm([g64], mode)
            want = F.nar_step([g64], max_norm=max_norm, mode=mode)
            tag = f"{_dt(dtype)} mode={mode}{' momentum' if momentum else ''}{' lr tensor' if k % 2 else ''}"

            def run(backend):
                p, b = _clones(params), (_clones(bufs) if bufs else None)
                st = ops.nar_step_(p, grads, lr=lr, weight_decay=wd, max_norm=max_norm, mode=mode,
                                   momentum=momentum, momentum_buffers=b, backend=backend)
                return p, b, st

            p, b, st = run(ctx.backend)
            _compare_list(rec, f"params {tag} vs fp64 formula, tensor", p, want.params[0], data_tol(dtype))
            if b:
                _compare_list(rec, f"momentum_buffers {tag} vs fp64 formula, tensor", b, want.bufs[0], data_tol(dtype))
            rec.close(f"stats.norm {tag} vs fp64 formula", st.norm, want.norm, stat_tol(dtype))
            rec.close(f"stats.scale {tag} vs fp64 formula", st.scale, want.scale, stat_tol(dtype))
            rec.true(f"stats.skipped {tag}", not bool(st.skipped), "a finite step was reported skipped")
            if ctx.backend != REFERENCE:
                rp, rb, rst = run(REFERENCE)
                _compare_list(rec, f"params {tag} vs python_ref, tensor", p, rp, data_tol(dtype))
                if b:
                    _compare_list(rec, f"momentum_buffers {tag} vs python_ref, tensor", b, rb, data_tol(dtype))
                rec.close(f"stats.norm {tag} vs python_ref", st.norm, rst.norm, stat_tol(dtype))
                rec.close(f"stats.scale {tag} vs python_ref", st.scale, rst.scale, stat_tol(dtype))


@check("nar_step_", "NaN/Inf gradient or param skips the step (bit-identical)")
def nar_step_skip(ctx: Ctx, rec: Record) -> None:
    data = _Data(ctx, 2)
    for dtype in DTYPES:
        for mode, momentum, where, value in (("co", 0.0, "grads", float("nan")), ("grad", 0.9, "grads", float("inf")),
                                             ("none", 0.0, "grads", float("nan")), ("co", 0.9, "params", float("nan"))):
            params = [data.randn(s, dtype) for s in _shapes(ctx)]
            grads = [data.randn(s, dtype) for s in _shapes(ctx)]
            bufs = [data.randn(s, dtype, 0.1) for s in _shapes(ctx)] if momentum else None
            (grads if where == "grads" else params)[2].view(-1)[100] = value
            before_p, before_b = _clones(params), (_clones(bufs) if bufs else [])
            tag = f"{_dt(dtype)} mode={mode} {value} in {where}"
            st = ops.nar_step_(params, grads, lr=0.5, weight_decay=0.01, max_norm=1.0, mode=mode, momentum=momentum,
                               momentum_buffers=bufs, backend=ctx.backend)
            rec.true(f"stats.skipped {tag}", bool(st.skipped), "the step was not skipped")
            rec.true(f"stats.norm {tag}", not bool(torch.isfinite(st.norm)), f"norm {float(st.norm)} is finite")
            # A NaN param may come back as another NaN: torch's own vectorised fp32 -> bf16
            # conversion turns NaN 0x7fc0 into 0xffff, so not even python_ref keeps the
            # payload; every other value keeps its bits.
            nan_ok = where == "params"
            for i, (p, p0) in enumerate(zip(params, before_p)):
                rec.bitwise(f"params[{i}] {tag}", p, p0, any_nan=nan_ok)
            for i, (b, b0) in enumerate(zip(bufs or [], before_b)):
                rec.bitwise(f"momentum_buffers[{i}] {tag}", b, b0)


# ------------------------------------------------------------- nar_step_groups_

def _two_groups(data: _Data, ctx: Ctx, dtypes):
    """Weights with decay and momentum; biases without (the usual FedNAR setup)."""
    sa, sb = [(257,), (17, 13)], [(0,), (1,)] + ([] if ctx.quick else [(4099,)])
    pa = [data.randn(s, dtypes[i % len(dtypes)]) for i, s in enumerate(sa)]
    pb = [data.randn(s, dtypes[(i + 1) % len(dtypes)]) for i, s in enumerate(sb)]
    ga, gb = [data.randn(p.shape, p.dtype) for p in pa], [data.randn(p.shape, p.dtype) for p in pb]
    ba = [data.randn(p.shape, p.dtype, 0.1) for p in pa]
    return (F.NarGroup64(pa, ga, 0.5, 0.01, 0.9, ba), F.NarGroup64(pb, gb, 0.2, 0.0, 0.0, None))


def _run_groups(groups64, mode, max_norm, backend):
    copies = [(_clones(g.params), _clones(g.bufs) if g.bufs else None) for g in groups64]
    groups = [ops.NarGroup(p, g.grads, lr=g.lr, weight_decay=g.weight_decay, momentum=g.momentum, momentum_buffers=b)
              for (p, b), g in zip(copies, groups64)]
    st = ops.nar_step_groups_(groups, max_norm=max_norm, mode=mode, backend=backend)
    return copies, st


def _check_groups(ctx: Ctx, rec: Record, groups64, tag: str, stats_dtype: torch.dtype) -> None:
    for mode in ("co", "grad"):
        max_norm = 0.5 * _clip_norm(groups64, mode)
        want = F.nar_step(groups64, max_norm=max_norm, mode=mode)
        got, st = _run_groups(groups64, mode, max_norm, ctx.backend)
        ref = _run_groups(groups64, mode, max_norm, REFERENCE) if ctx.backend != REFERENCE else None
        for k, (p, b) in enumerate(got):
            for i, t in enumerate(p):
                name = f"groups[{k}].params[{i}] {_dt(t.dtype)} {tag} mode={mode}"
                rec.close(f"{name} vs fp64 formula", t, want.params[k][i], data_tol(t.dtype))
                if ref:
                    rec.close(f"{name} vs python_ref", t, ref[0][k][0][i], data_tol(t.dtype))
            for i, t in enumerate(b or []):
                name = f"groups[{k}].momentum_buffers[{i}] {_dt(t.dtype)} {tag} mode={mode}"
                rec.close(f"{name} vs fp64 formula", t, want.bufs[k][i], data_tol(t.dtype))
                if ref:
                    rec.close(f"{name} vs python_ref", t, ref[0][k][1][i], data_tol(t.dtype))
        for field in ("norm", "scale"):
            rec.close(f"stats.{field} {tag} mode={mode} vs fp64 formula", getattr(st, field), getattr(want, field),
                      stat_tol(stats_dtype))
            if ref:
                rec.close(f"stats.{field} {tag} mode={mode} vs python_ref", getattr(st, field),
                          getattr(ref[1], field), stat_tol(stats_dtype))
        rec.true(f"stats.skipped {tag} mode={mode}", not bool(st.skipped), "a finite step was reported skipped")


@check("nar_step_groups_", "2 groups (lr, wd, momentum each) under one norm, 4 dtypes")
def nar_step_groups(ctx: Ctx, rec: Record) -> None:
    data = _Data(ctx, 3)
    for dtype in DTYPES:
        _check_groups(ctx, rec, _two_groups(data, ctx, [dtype]), _dt(dtype), dtype)


@check("nar_step_groups_", "mixed fp32/fp16/bf16 tensors under one norm")
def nar_step_groups_mixed(ctx: Ctx, rec: Record) -> None:
    data = _Data(ctx, 4)
    _check_groups(ctx, rec, _two_groups(data, ctx, [torch.float32, torch.float16, torch.bfloat16]), "mixed",
                  torch.float32)


# ------------------------------------------------------------ nar_step_batched_

@check("nar_step_batched_", "C=3 rows (clipped, NaN row skipped, unclipped), per-row lr, C=1, 4 dtypes")
def nar_step_batched(ctx: Ctx, rec: Record) -> None:
    data = _Data(ctx, 5)
    for dtype in DTYPES:
        acc = acc_dtype(dtype)
        shapes = [(3, 257)] + ([] if ctx.quick else [(1, 4099)])
        for C, N in shapes:
            for mode, momentum in (("co", 0.0), ("grad", 0.0), ("co", 0.9)):
                X = data.randn((C, N), dtype)
                G = data.randn((C, N), dtype)
                B = data.randn((C, N), dtype, 0.1) if momentum else None
                if C == 3:
                    G[1, 100] = float("nan")  # this row is skipped, the others step
                    G[2] *= 0.05  # small: not clipped
                lrs = [0.5, 0.3, 0.1][:C]
                lr = torch.tensor(lrs, dtype=acc, device=ctx.device)
                rows64 = [F.NarGroup64([X[i]], [G[i]], lrs[i], 0.01, momentum, [B[i]] if momentum else None)
                          for i in range(C)]
                max_norm = 0.5 * _clip_norm(rows64[:1], mode)
                want = [F.nar_step([r], max_norm=max_norm, mode=mode) for r in rows64]
                tag = f"{_dt(dtype)} [{C}, {N}] mode={mode}{' momentum' if momentum else ''}"

                def run(backend):
                    x, b = X.clone(), (B.clone() if momentum else None)
                    st = ops.nar_step_batched_(x, G, lr=lr, weight_decay=0.01, max_norm=max_norm, mode=mode,
                                               momentum=momentum, momentum_buffers=b, backend=backend)
                    return x, b, st

                x, b, st = run(ctx.backend)
                ref = run(REFERENCE) if ctx.backend != REFERENCE else None
                for i, w in enumerate(want):
                    row = f"{tag} row {i}"
                    rec.true(f"stats.skipped[{i}] {tag}", bool(st.skipped[i]) == w.skipped,
                             f"got {bool(st.skipped[i])}, expected {w.skipped}")
                    if w.skipped:
                        rec.bitwise(f"X {row} (skipped)", x[i], X[i])
                        if momentum:
                            rec.bitwise(f"momentum_buffers {row} (skipped)", b[i], B[i])
                        continue
                    rec.close(f"X {row} vs fp64 formula", x[i], w.params[0][0], data_tol(dtype))
                    if momentum:
                        rec.close(f"momentum_buffers {row} vs fp64 formula", b[i], w.bufs[0][0], data_tol(dtype))
                    rec.close(f"stats.norm[{i}] {tag} vs fp64 formula", st.norm[i], w.norm, stat_tol(dtype))
                    rec.close(f"stats.scale[{i}] {tag} vs fp64 formula", st.scale[i], w.scale, stat_tol(dtype))
                    if ref:
                        rec.close(f"X {row} vs python_ref", x[i], ref[0][i], data_tol(dtype))
                        if momentum:
                            rec.close(f"momentum_buffers {row} vs python_ref", b[i], ref[1][i], data_tol(dtype))
                        rec.close(f"stats.norm[{i}] {tag} vs python_ref", st.norm[i], ref[2].norm[i], stat_tol(dtype))
                        rec.close(f"stats.scale[{i}] {tag} vs python_ref", st.scale[i], ref[2].scale[i],
                                  stat_tol(dtype))


# -------------------------------------------------------------------- aggregate

def _clients(data: _Data, C: int, N: int, dtype, as_list: bool):
    X = data.randn((C, N), dtype)
    return (list(X.unbind(0)) if as_list else X), list(X.unbind(0))


def _agg_cases(ctx: Ctx, data: _Data):
    """The cases of the aggregation ops in every dtype, as ``(dtype, C, N, gamma as a
    tensor?, clients, rows, tag)``: C=3 as one [C, N] tensor, C=33 as a list, C=1.  A
    case's clients are drawn from ``data`` when the loop reaches it, so the caller's
    draws for a case come right after them."""
    big = 257 if ctx.quick else 4099
    for dtype in DTYPES:
        # (C, N, clients as a list?, gamma as a tensor?)
        for C, N, as_list, gamma_tensor in ((3, 257, False, False), (33, big, True, True), (1, 1, False, False)):
            clients, rows = _clients(data, C, N, dtype, as_list)
            yield dtype, C, N, gamma_tensor, clients, rows, f"{_dt(dtype)} C={C} N={N}{' list' if as_list else ''}"


def _check_aggregate(rec: Record, tag: str, dtype, got, ref, rows, w_used, gamma: float, excluded_expected):
    out, st = got
    eff = F.robust_weights(w_used, F.aggregate(rows, [1.0] * len(rows), 1.0).client_sq_norms) \
        if any(excluded_expected) else w_used
    want = F.aggregate(rows, eff, gamma)
    if all(excluded_expected):
        want = F.AggregateResult64(torch.zeros(out.numel(), dtype=torch.float64), want.client_sq_norms, 0.0)
    rec.close(f"out {tag} vs fp64 formula", out, want.out, data_tol(dtype))
    rec.close(f"stats.client_sq_norms {tag} vs fp64 formula", st.client_sq_norms, want.client_sq_norms,
              stat_tol(dtype))
    rec.close(f"stats.sq_norm {tag} vs fp64 formula", st.sq_norm, want.sq_norm, stat_tol(dtype))
    rec.true(f"stats.excluded {tag}", st.excluded.cpu().tolist() == list(excluded_expected),
             f"got {st.excluded.cpu().tolist()}, expected {list(excluded_expected)}")
    rec.close(f"stats.weights {tag} vs fp64 formula", st.weights, eff, stat_tol(dtype))
    rec.true(f"stats.all_excluded {tag}", bool(st.all_excluded) == all(excluded_expected))
    if ref is not None:
        rout, rst = ref
        rec.close(f"out {tag} vs python_ref", out, rout, data_tol(dtype))
        for field in ("client_sq_norms", "sq_norm", "weights"):
            rec.close(f"stats.{field} {tag} vs python_ref", getattr(st, field), getattr(rst, field), stat_tol(dtype))


def _run_aggregate(ctx: Ctx, clients, w, gamma, backend):
    return ops.aggregate(clients, w, gamma=gamma, backend=backend)


@check("aggregate", "C=3 [C,N], C=33 list with tensor gamma, C=1, 4 dtypes")
def aggregate_matrix(ctx: Ctx, rec: Record) -> None:
    data = _Data(ctx, 6)
    for dtype, C, N, gamma_tensor, clients, rows, tag in _agg_cases(ctx, data):
        acc = acc_dtype(dtype)
        w = torch.rand(C, generator=data.gen, dtype=torch.float64) + 0.05  # not normalised
        w_used = [float(x) for x in w.to(acc).double()]  # the op works with acc-dtype weights
        gamma = torch.tensor(1.1, dtype=acc, device=ctx.device) if gamma_tensor else 0.9
        gamma_used = float(gamma.double()) if gamma_tensor else gamma
        got = _run_aggregate(ctx, clients, w, gamma, ctx.backend)
        ref = _run_aggregate(ctx, clients, w, gamma, REFERENCE) if ctx.backend != REFERENCE else None
        _check_aggregate(rec, tag, dtype, got, ref, rows, w_used, gamma_used, [False] * C)


@check("aggregate", "NaN/Inf client excluded, all clients excluded, N=0")
def aggregate_edges(ctx: Ctx, rec: Record) -> None:
    data = _Data(ctx, 7)
    for dtype in DTYPES:
        acc = acc_dtype(dtype)
        for name, C, N, bad in (("NaN client", 4, 257, (2,)), ("Inf client", 3, 33, (0,)),
                                ("all excluded", 2, 65, (0, 1)), ("N=0", 3, 0, ())):
            X = data.randn((C, N), dtype)
            for i in bad:
                X[i, N // 2] = float("nan") if name != "Inf client" else float("inf")
            rows = list(X.unbind(0))
            w = torch.rand(C, generator=data.gen, dtype=torch.float64) + 0.05
            w_used = [float(x) for x in w.to(acc).double()]
            tag = f"{_dt(dtype)} {name} C={C} N={N}"
            got = _run_aggregate(ctx, X, w, 0.9, ctx.backend)
            ref = _run_aggregate(ctx, X, w, 0.9, REFERENCE) if ctx.backend != REFERENCE else None
            gamma_used = float(torch.tensor(0.9, dtype=acc).double())
            _check_aggregate(rec, tag, dtype, got, ref, rows, w_used, gamma_used, [i in bad for i in range(C)])


# ------------------------------------------------------------------ client_dots

@check("client_dots", "C=3 [C,N], C=33 list, 4 dtypes")
def client_dots(ctx: Ctx, rec: Record) -> None:
    data = _Data(ctx, 8)
    for dtype, C, N, _, clients, rows, tag in _agg_cases(ctx, data):
        g = data.randn((N,), acc_dtype(dtype))
        want = F.client_dots(rows, g)
        tol = dot_tol(dtype, float(max((F.f64(r).abs() * F.f64(g).abs()).sum() for r in rows)))
        got = ops.client_dots(clients, g, backend=ctx.backend)
        rec.close(f"dots {tag} vs fp64 formula", got, want, tol)
        if ctx.backend != REFERENCE:
            rec.close(f"dots {tag} vs python_ref", got, ops.client_dots(clients, g, backend=REFERENCE), tol)


# ----------------------------------------------------------------- weighted_sum

@check("weighted_sum", "forward and grads w.r.t. weights and gamma, C=3/33, 4 dtypes")
def weighted_sum(ctx: Ctx, rec: Record) -> None:
    data = _Data(ctx, 9)
    for dtype, C, N, _, clients, rows, tag in _agg_cases(ctx, data):
        acc = acc_dtype(dtype)
        w0 = data.rand((C,), acc, 0.05, 1.0)
        G = data.randn((N,), dtype)

        def run(backend):
            w = w0.clone().requires_grad_(True)
            gamma = torch.tensor(0.9, dtype=acc, device=ctx.device, requires_grad=True)
            out = ops.weighted_sum(clients, w, gamma, backend=backend)
            out.backward(G)
            return out.detach(), w.grad, gamma.grad

        out, gw, gg = run(ctx.backend)
        a = [float(x) for x in w0.cpu().double()]
        gamma = float(torch.tensor(0.9, dtype=acc).double())
        want_w, want_gamma = F.weighted_sum_grads(rows, a, gamma, G)
        mags = [float((F.f64(r).abs() * F.f64(G).abs()).sum()) for r in rows]
        tol_w = dot_tol(dtype, gamma * max(mags))
        tol_gamma = dot_tol(dtype, sum(x * m for x, m in zip(a, mags)))
        rec.close(f"out {tag} vs fp64 formula", out, F.aggregate(rows, a, gamma).out, data_tol(dtype))
        rec.close(f"d/dweights {tag} vs fp64 formula", gw, want_w, tol_w)
        rec.close(f"d/dgamma {tag} vs fp64 formula", gg, want_gamma, tol_gamma)
        if ctx.backend != REFERENCE:
            rout, rgw, rgg = run(REFERENCE)
            rec.close(f"out {tag} vs python_ref", out, rout, data_tol(dtype))
            rec.close(f"d/dweights {tag} vs python_ref", gw, rgw, tol_w)
            rec.close(f"d/dgamma {tag} vs python_ref", gg, rgg, tol_gamma)


# ---------------------------------------------------------------- server_update_

_SERVER_HYPER = {"sgd": dict(lr=0.5, gamma=0.9), "momentum": dict(lr=0.5, beta1=0.9),
                 "adagrad": dict(lr=0.1, beta1=0.9, tau=1e-3), "adam": dict(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3),
                 "yogi": dict(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)}
_SERVER_STATE = {"sgd": (), "momentum": ("exp_avg",), "adagrad": ("exp_avg", "exp_avg_sq"),
                 "adam": ("exp_avg", "exp_avg_sq"), "yogi": ("exp_avg", "exp_avg_sq")}


def _server_inputs(data: _Data, ctx: Ctx, rule: str, dtype):
    """Params, their update as views at odd offsets of ONE flat vector (as a server gets
    from the aggregation), and state like a few rounds in (v > 0)."""
    shapes = _shapes(ctx)
    params = [data.randn(s, dtype) for s in shapes]
    sizes = [p.numel() for p in params]
    flat = data.randn((1 + sum(sizes),), acc_dtype(dtype))
    updates, at = [], 1  # offset 1: every view starts misaligned
    for n in sizes:
        updates.append(flat[at:at + n])
        at += n
    state = {}
    if "exp_avg" in _SERVER_STATE[rule]:
        state["exp_avg"] = [data.randn(s, dtype, 0.5) for s in shapes]
    if "exp_avg_sq" in _SERVER_STATE[rule]:
        state["exp_avg_sq"] = [data.rand(s, dtype, 0.05, 2.0) for s in shapes]
    return params, updates, state


def _server_variants(rule: str, dtype, device):
    """Float hyperparameters, then lr (and gamma) as 0-d device tensors with skip=False."""
    acc = acc_dtype(dtype)
    h = dict(_SERVER_HYPER[rule])
    yield "floats", h, False
    t = dict(h, lr=torch.tensor(h["lr"], dtype=acc, device=device))
    if "gamma" in h:
        t["gamma"] = torch.tensor(h["gamma"], dtype=acc, device=device)
    yield "tensor lr, skip=False", t, True
    if rule == "momentum":
        yield "nesterov", dict(h, nesterov=True), False


def _check_rule(ctx: Ctx, rec: Record, rule: str) -> None:
    data = _Data(ctx, 10 + list(_SERVER_HYPER).index(rule))
    for dtype in DTYPES:
        for variant, hyper, with_skip in _server_variants(rule, dtype, ctx.device):
            params, updates, state = _server_inputs(data, ctx, rule, dtype)
            skip = torch.tensor(False, device=ctx.device) if with_skip else None

            def run(backend):
                p, s = _clones(params), {k: _clones(v) for k, v in state.items()}
                ops.server_update_(p, updates, rule=rule, skip=skip, backend=backend, **hyper, **s)
                return p, s

            p, s = run(ctx.backend)
            ref = run(REFERENCE) if ctx.backend != REFERENCE else None
            h = {k: float(v) for k, v in hyper.items()}
            tag = f"{_dt(dtype)} {variant}"
            for i in range(len(params)):
                m0 = state["exp_avg"][i] if "exp_avg" in state else None
                v0 = state["exp_avg_sq"][i] if "exp_avg_sq" in state else None
                x, m, v = F.server_update(rule, params[i], updates[i], m0, v0, lr=h["lr"], gamma=h.get("gamma", 1.0),
                                          beta1=h.get("beta1", 0.0), beta2=h.get("beta2", 0.0), tau=h.get("tau", 0.0),
                                          nesterov=bool(h.get("nesterov", False)))
                rec.close(f"params[{i}] {tag} vs fp64 formula", p[i], x, data_tol(dtype))
                for name, want in (("exp_avg", m), ("exp_avg_sq", v)):
                    if name in s:
                        rec.close(f"{name}[{i}] {tag} vs fp64 formula", s[name][i], want, data_tol(dtype))
                if ref:
                    rec.close(f"params[{i}] {tag} vs python_ref", p[i], ref[0][i], data_tol(dtype))
                    for name in s:
                        rec.close(f"{name}[{i}] {tag} vs python_ref", s[name][i], ref[1][name][i], data_tol(dtype))


def _register_rules() -> None:
    for rule in ops.RULES:  # every rule the ops layer exposes
        extra = ", nesterov" if rule == "momentum" else ""
        check("server_update_", f"rule {rule}: 4 dtypes, odd-offset update views, float and tensor lr{extra}")(
            lambda ctx, rec, rule=rule: _check_rule(ctx, rec, rule))


_register_rules()


@check("server_update_", "skip=True writes nothing, every rule (bit-identical)")
def server_update_skip(ctx: Ctx, rec: Record) -> None:
    data = _Data(ctx, 20)
    for rule in ops.RULES:
        for dtype in DTYPES:
            params, updates, state = _server_inputs(data, ctx, rule, dtype)
            before = {"params": _clones(params), **{k: _clones(v) for k, v in state.items()}}
            ops.server_update_(params, updates, rule=rule, skip=torch.tensor(True, device=ctx.device),
                               backend=ctx.backend, **_SERVER_HYPER[rule], **state)
            for name, tensors in (("params", params), *state.items()):
                for i, (t, t0) in enumerate(zip(tensors, before[name])):
                    rec.bitwise(f"{name}[{i}] {_dt(dtype)} rule {rule}", t, t0)


# ------------------------------------------------------------------- compressed

_QMAX = {"int8": 127.0, "int4": 7.0}


def _decode64(reply) -> torch.Tensor:
    """The float64 vector a reply stands for, from the codec's definition (not python_ref):
    x_j = s[j // block] * q_j, q int8, a signed nibble (low first) or an e4m3 value; top-k
    the values at their indices, 0 elsewhere."""
    n = reply.numel
    if reply.codec == "topk":
        out = torch.zeros(n, dtype=torch.float64)
        out[reply.indices.cpu()] = reply.codes.cpu().double()
        return out
    c = reply.codes.cpu()
    if reply.codec == "int8":
        q = c.double()
    elif reply.codec == "int4":
        b = c.view(torch.int8).to(torch.int64)
        lo, hi = ((b & 0xF) ^ 8) - 8, (((b >> 4) & 0xF) ^ 8) - 8
        q = torch.stack([lo, hi], 1).reshape(-1)[:n].double()
    else:
        q = c.view(torch.float8_e4m3fn).double()
    s = reply.scales.cpu().double().repeat_interleave(reply.block)[:n]
    return s * q


@check("compressed encode", "int8/int4 (nearest, stochastic), fp8, top-k; N 0/1/33/1000, fp32/fp16/bf16")
def compressed_encode(ctx: Ctx, rec: Record) -> None:
    from ..ops import compressed as CM

    data = _Data(ctx, 40)
    sizes = (0, 1, 33, 1000)  # 1000: several blocks and a ragged one; no larger, Triton's interpreter
    B = 128  # runs one program per block (~10 s for this row on 2 loaded cores)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for N in sizes:
            x = data.randn((N,), dtype)
            x64 = x.double().cpu()
            for codec, stochastic in (("int8", False), ("int8", True), ("int4", False), ("int4", True),
                                      ("fp8", False), ("topk", False)):
                tag = f"{codec}{' stochastic' if stochastic else ''} {_dt(dtype)} N={N}"
                kw = dict(fraction=0.25) if codec == "topk" else dict(block=B, stochastic=stochastic, key=9, client=3)
                got = CM.encode(x, codec, backend=ctx.backend, **kw)
                if ctx.backend != REFERENCE:
                    ref = CM.encode(x, codec, backend=REFERENCE, **kw)
                    rec.bitwise(f"codes {tag} vs python_ref", got.codes, ref.codes)
                    if codec == "topk":
                        rec.bitwise(f"indices {tag} vs python_ref", got.indices, ref.indices)
                    else:
                        rec.bitwise(f"scales {tag} vs python_ref", got.scales, ref.scales)
                err = (_decode64(got) - x64).abs()
                amax = torch.nn.functional.pad(x64.abs(), (0, -N % B)).reshape(-1, B).amax(1)
                if codec in _QMAX:
                    # s = max|x| / qmax per block; |x^ - x| <= s/2 (nearest), < s (stochastic), plus
                    # x / s rounded once in fp32 (<= qmax 2^-24 s) and s q once (<= qmax 2^-24 s)
                    qmax = _QMAX[codec]
                    rec.close(f"scales {tag} vs max|x|/qmax", got.scales, amax / qmax, Tol(1e-6, 1e-30))
                    s64 = got.scales.cpu().double().repeat_interleave(B)[:N]
                    bound = s64 * ((1.0 if stochastic else 0.5) + qmax * 2.0 ** -23)
                    rec.true(f"|x^ - x| {tag} within {'s' if stochastic else 's/2'}", bool((err <= bound).all()))
                elif codec == "fp8":  # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the block's max
                    bound = amax.repeat_interleave(B)[:N] * 2.0 ** -4
                    rec.true(f"|x^ - x| {tag} within 2^-4 max|x|", bool((err <= bound * (1 + 1e-6)).all()))
                else:  # the k largest |x|, ties to the lower index: every value kept is >= every value dropped
                    kept = got.indices.cpu()
                    mask = torch.ones(N, dtype=torch.bool)
                    mask[kept] = False
                    rec.true(f"top-k {tag} keeps the largest |x|",
                             not N or not mask.any() or not kept.numel()
                             or float(x64.abs()[kept].min()) >= float(x64.abs()[mask].max()))
                    rec.bitwise(f"top-k values {tag} are x at the indices", got.codes.cpu(),
                                x.float().cpu()[kept])


@check("compressed decode_aggregate", "int8/int4/fp8/top-k, C=3 with a weight 0, N 1/33/4099, gamma 0.5")
def compressed_decode_aggregate(ctx: Ctx, rec: Record) -> None:
    from ..ops import compressed as CM

    data = _Data(ctx, 41)
    sizes = (1, 33, 1000) if ctx.quick else (1, 33, 1000, 4099)
    w = torch.tensor([0.5, 0.0, 0.25], device=ctx.device)
    for N in sizes:
        xs = [data.randn((N,), torch.float32) for _ in range(3)]
        for codec in ("int8", "int4", "fp8", "topk"):
            kw = dict(fraction=0.3) if codec == "topk" else dict(block=32, key=4, client=0)
            replies = [CM.encode(x, codec, **kw) for x in xs]
            tag = f"{codec} N={N}"
            out, st = CM.decode_aggregate(replies, w, gamma=0.5, nonfinite="propagate", backend=ctx.backend)
            rows = [_decode64(r) for r in replies]
            want = 0.5 * sum(float(wi) * r for wi, r in zip(w.cpu(), rows))
            rec.close(f"out {tag} vs fp64 decode", out, want, data_tol(torch.float32))
            rec.close(f"client_sq_norms {tag} vs fp64", st.client_sq_norms,
                      torch.stack([r.pow(2).sum() for r in rows]), stat_tol(torch.float32))
            rec.close(f"sq_norm {tag} vs fp64", st.sq_norm, (want / 0.5).pow(2).sum(), stat_tol(torch.float32))
            if ctx.backend != REFERENCE:
                ref, _ = CM.decode_aggregate(replies, w, gamma=0.5, nonfinite="propagate", backend=REFERENCE)
                rec.bitwise(f"out {tag} vs python_ref", out, ref)


# ---------------------------------------------------------- compile, CUDA graphs

@check("torch.compile", "nar_step_ with a 0-d tensor lr, 3 values: one frame, equal to eager")
def compile_no_recompile(ctx: Ctx, rec: Record) -> None:
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    data = _Data(ctx, 30)
    params = [data.randn((257,), torch.float32), data.randn((17, 13), torch.float32)]
    grads = [data.randn(p.shape, torch.float32) for p in params]
    lr = torch.tensor(0.1, device=ctx.device)
    backend = ctx.backend

    def step(ps, gs, lr):
        return ops.nar_step_(ps, gs, lr=lr, weight_decay=0.01, max_norm=1.0, backend=backend)

    torch._dynamo.reset()  # a fresh cache: earlier compiles of `step` must not count or hit
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    try:
        for value in (0.1, 0.05, 0.2):
            lr.fill_(value)
            pc, pe = _clones(params), _clones(params)
            sc, se = compiled(pc, grads, lr), step(pe, grads, lr)
            for i, (a, b) in enumerate(zip(pc, pe)):
                rec.bitwise(f"params[{i}] lr={value} compiled vs eager", a, b)
            rec.bitwise(f"stats.norm lr={value} compiled vs eager", sc.norm, se.norm)
            rec.bitwise(f"stats.scale lr={value} compiled vs eager", sc.scale, se.scale)
            # equal to eager means something only if the step did move the params
            rec.true(f"params[0] lr={value} changed by the compiled step", not torch.equal(pc[0], params[0]))
        rec.true("frames compiled for 3 lr values", counter.frame_count == 1,
                 f"{counter.frame_count} frames (a new lr recompiled)")
    finally:
        torch._dynamo.reset()


@check("cuda graph", "nar_step_batched_ on [1, N] captured, replayed with 3 tensor lr values", ("cuda", "triton"))
def cuda_graph_replay(ctx: Ctx, rec: Record) -> None:
    if ctx.device.type != "cuda":
        raise NotApplicable("n/a (no CUDA)")
    data = _Data(ctx, 31)
    N = 4099 if ctx.quick else 100_003
    x0, g = data.randn((1, N), torch.float32), data.randn((1, N), torch.float32)
    X, lr = x0.clone(), torch.tensor(0.1, device=ctx.device)
    kw = dict(weight_decay=0.01, max_norm=1.0, backend=ctx.backend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles, caches fill) off the capture stream
        for _ in range(2):
            ops.nar_step_batched_(X.clone(), g, lr=lr, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stats = ops.nar_step_batched_(X, g, lr=lr, **kw)
    for value in (0.1, 0.05, 0.2):
        X.copy_(x0)
        lr.fill_(value)
        graph.replay()
        expected = x0.clone()
        est = ops.nar_step_batched_(expected, g, lr=value, **kw)
        torch.cuda.synchronize()
        rec.close(f"X after replay lr={value} vs eager", X, expected, data_tol(torch.float32))
        rec.close(f"stats.norm replay lr={value} vs eager", stats.norm, est.norm, stat_tol(torch.float32))
        rec.close(f"stats.scale replay lr={value} vs eager", stats.scale, est.scale, stat_tol(torch.float32))
