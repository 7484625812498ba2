"""What the backend contract suite (tests/test_contract_*.py) shares: the backend under
test, the data it runs on, and how close each backend must come to its oracle.

The suite calls the backend modules themselves (``backends.resolve(name, device)``: the
seven functions of the contract in fedopt_kernels/backends/__init__.py, arguments as
the ops layer passes them), never ``ops.*``: the ops layer is tested on its own
(tests/test_nar_step.py, test_aggregate.py, test_server_update.py, ...), and the raw
``torch.ops.fedopt_C`` ops' own argument checks with their builds
(tests/test_cpu_kernels.py, test_cuda_extension.py).

Sizes.  A case names the sizes that reach the kernels' paths (tails, several chunks or
threads, grown chunk sizes, the GPU kernels' tile and grid shapes) and runs them on
every backend (``Backend.size``), except on the two backends that pay per element or
per tensor in Python: Triton in its interpreter (CPU tensors, about 10 us per element
and 0.02-0.1 s per launch) and the reference backend (python_ref, which has no chunks,
tiles or threads to reach) run the smaller size the case gives, still several chunks
with a ragged tail; and where a size only reaches a GPU launch path (100 clients of
62,000 columns, 16M-element tensors), a case may give the CPU kernels a smaller one
that still spans their chunks and threads.

Tolerances.  How close a backend comes to python_ref (or to the server-update oracle)
is a property of the backend, stated once here (the strictest each backend has been
held to); a case asserts more only where the backend promises it (e.g. bitwise
python_ref where it rounds as python_ref does).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from _asserts import acc_of, assert_bitwise, bits, same_bits  # noqa: F401 - the contract suites' helpers

from fedopt_kernels import backends
from fedopt_kernels.backends.hyper import split

MODES = {"co": 0, "grad": 1, "none": 2}  # the contract's integer modes
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LOW = [torch.float32, torch.float16, torch.bfloat16]

# No FMA contraction and python_ref's operation order in the elementwise parts: an
# unclipped FedNAR step (and a scaled one given the same scale) and the aggregation's
# output equal python_ref's to the bit.  (The CUDA aggregation contracts its weighted
# sums into FMAs -- the FedNAR and server-update math no longer does since issue 47, but
# that is unverified on a GPU so far; Triton's FedNAR and aggregation kernels may on a GPU.)
ROUNDS_LIKE_PYTHON_REF = ("reference", "cpu")
# Kernels whose sums do not depend on the layout of the same values (a list of 1-D
# clients or one [C, N] tensor, aligned or not): fixed per-column order.  python_ref's
# are torch's reductions, which may differ in the last bit between layouts.
LAYOUT_FREE_SUMS = ("cpu", "triton", "cuda")


class Backend:
    """One backend under test: its module's functions as attributes, its name and the
    device its tensors live on here."""

    def __init__(self, name: str, device: torch.device):
        self.name, self.device = name, device
        self.module = backends.resolve(name, device)
        self.interpreted = name == "triton" and backends.triton_interpret_mode()

    def __getattr__(self, attr):
        return getattr(self.module, attr)

    # The suite's cases give a hyperparameter as a number or a tensor, as the public ops
    # take it; these split it into the contract's (value, tensor) pair exactly as the
    # ops layer does (backends.hyper.split) and call the backend with the pairs.
    def nar_step_(self, params, grads, bufs, lr, wd, *rest):
        return self.module.nar_step_(params, grads, bufs, *split(lr), *split(wd), *rest)

    def nar_sq_norm(self, params, grads, wd, *rest):
        return self.module.nar_sq_norm(params, grads, *split(wd), *rest)

    def nar_apply_(self, params, grads, bufs, sq, lr, wd, *rest):
        return self.module.nar_apply_(params, grads, bufs, sq, *split(lr), *split(wd), *rest)

    def nar_step_batched_(self, X, G, B, lr, wd, *rest):
        return self.module.nar_step_batched_(X, G, B, *split(lr), *split(wd), *rest)

    def aggregate(self, clients, weights, gamma, out, skip):
        return self.module.aggregate(clients, weights, *split(gamma), out, skip)

    def server_update_(self, params, updates, exp_avg, exp_avg_sq, rule, lr, gamma, *rest):
        return self.module.server_update_(params, updates, exp_avg, exp_avg_sq, rule, *split(lr), *split(gamma), *rest)

    def __repr__(self):
        return f"Backend({self.name!r}, {self.device})"

    def size(self, full, small, host=None):
        """``full``; ``small`` under Triton's interpreter and on the reference backend;
        ``host`` (if given) on the CPU kernels."""
        if self.small:
            return small
        if host is not None and self.name == "cpu":
            return host
        return full

    @property
    def small(self) -> bool:
        """Whether this backend runs a case's ``small`` sizes."""
        return self.interpreted or self.name == "reference"

    @property
    def rounds_like_python_ref(self) -> bool:
        return self.name in ROUNDS_LIKE_PYTHON_REF

    @property
    def layout_free_sums(self) -> bool:
        return self.name in LAYOUT_FREE_SUMS


# ----------------------------------------------------------------------------- bits

def clone(ts):
    return [t.clone() for t in ts]


# ----------------------------------------------------------------------------- data

def randn(shape, dtype, device, gen, scale=1.0, memory_format=None):
    """Normal values drawn in fp64 on the CPU (the same on every machine), then cast."""
    t = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    if memory_format is not None and len(shape) == 4:
        t = t.contiguous(memory_format=memory_format)
    return t.to(device)


def make_lists(shapes, dtype, device, *, seed=0, gscale=1.0, pscale=1.0, memory_format=None):
    """params, grads, momentum buffers of ``shapes``."""
    gen = torch.Generator().manual_seed(seed)
    params = [randn(s, dtype, device, gen, pscale, memory_format) for s in shapes]
    grads = [randn(s, dtype, device, gen, gscale, memory_format) for s in shapes]
    bufs = [randn(s, dtype, device, gen, 1.0, memory_format) for s in shapes]
    return params, grads, bufs


def views_at_offset(values, offset=1, guard=7.0):
    """Each tensor of ``values`` as a view at element ``offset`` of its own buffer (not
    16-byte aligned for offset 1), guarded by ``guard`` before and after."""
    out = []
    for v in values:
        buf = torch.full((v.numel() + offset + 1,), guard, dtype=v.dtype, device=v.device)
        buf[offset:offset + v.numel()] = v.reshape(-1)
        out.append(buf[offset:offset + v.numel()].view(v.shape))
    return out


def guards_untouched(views, offset=1, guard=7.0):
    for v in views:
        buf = v._base
        assert bool((buf[:offset] == guard).all()) and float(buf[-1]) == guard, "wrote outside the view"


# ----------------------------------------------------------------------------- tolerances

_MANTISSA = {torch.float16: (10, -14), torch.bfloat16: (7, -126), torch.float32: (23, -126),
             torch.float64: (52, -1022)}


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at each value of ``t`` (as float64)."""
    mant, emin = _MANTISSA[dtype]
    a = t.double().abs()
    e = torch.floor(torch.log2(torch.clamp(a, min=2.0 ** emin)))
    return torch.pow(2.0, e - mant)


def _close_in_ulps(ours: torch.Tensor, ref: torch.Tensor, *, ulps: int = 2, rtol: float = 1e-5, magnitude=None):
    """fp16/bf16: within ``ulps`` units in the last place of the dtype; fp32: rtol; fp64:
    1e-12; each plus an absolute floor of the same relative size of the largest value
    (of ``ref``, or ``magnitude``: it covers cancellation, x - lr * d ~ 0, after an fp32
    clip scale ~1e-6 off)."""
    o, r = ours.double(), ref.double()
    assert torch.equal(torch.isnan(o), torch.isnan(r))
    fin = torch.isfinite(r)
    assert torch.equal(o[~fin & ~torch.isnan(r)], r[~fin & ~torch.isnan(r)])
    o, r = o[fin], r[fin]
    r_tol = 1e-12 if ours.dtype == torch.float64 else rtol
    floor = r_tol * (r.abs().max() if r.numel() else 0.0)
    if magnitude is not None:
        floor = r_tol * magnitude
    if ours.dtype in (torch.float16, torch.bfloat16):
        tol = ulps * ulp(r, ours.dtype) + floor
    else:
        tol = r_tol * r.abs() + floor
    bad = (o - r).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements off, e.g. {o[bad][:3].tolist()} vs {r[bad][:3].tolist()}"


def assert_values_close(be: Backend, actual: torch.Tensor, expected: torch.Tensor, *, magnitude=None):
    """A result tensor (params, buffers, an aggregate) against python_ref's, same dtype
    and shape: the reference backend IS python_ref (bitwise); the CPU kernels within
    2 ulps (fp16/bf16), 1e-5 (fp32), 1e-12 (fp64) and torch's default tolerance; Triton
    and CUDA within torch's default tolerance of the dtype (1e-13 for Triton's fp64)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        (actual.dtype, expected.dtype, actual.shape, expected.shape)
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if be.name == "reference":
        assert_bitwise([a], [e], "python_ref")
    elif be.name == "cpu":
        _close_in_ulps(a, e, magnitude=magnitude)
        torch.testing.assert_close(a, e, equal_nan=True)
    elif be.name == "triton" and a.dtype == torch.float64:
        torch.testing.assert_close(a, e, rtol=1e-13, atol=1e-15, equal_nan=True)
    else:
        torch.testing.assert_close(a, e, equal_nan=True)


def _norm_tol(be: Backend, dtype: torch.dtype):
    """(rtol, atol) of a norm-like statistic (a sum of squares or its root, the clip
    scale) of data of ``dtype`` against python_ref's."""
    fp64 = dtype == torch.float64
    if be.name == "cpu":
        return (1e-12 if fp64 else 1e-5), 1e-30
    if be.name == "triton":
        return (1e-13 if fp64 else 2e-5), (0.0 if fp64 else 1e-6)
    return 2e-5, 1e-6  # cuda


def assert_norms_close(be: Backend, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *,
                       atol=None):
    """Sums of squares, norms or scales (acc dtype) against python_ref's."""
    a, e = actual.detach().cpu(), expected.detach().cpu().to(actual.dtype)
    assert a.shape == e.shape, (a.shape, e.shape)
    if be.name == "reference":
        assert_bitwise([a], [e], "python_ref")
        return
    rtol, default_atol = _norm_tol(be, dtype)
    torch.testing.assert_close(a, e, rtol=rtol, atol=default_atol if atol is None else atol, equal_nan=True)


def stats(result) -> SimpleNamespace:
    """``(norm, scale, skipped)`` of a backend call, by name."""
    norm, scale, skipped = result
    return SimpleNamespace(norm=norm, scale=scale, skipped=skipped)


def assert_stats_close(be: Backend, st, st_ref, dtype: torch.dtype, *, shape=()):
    """FedNAR statistics: acc dtype, shape, the backend's device; norm and scale close to
    python_ref's (NaN where python_ref has NaN), skipped equal."""
    acc = acc_of(dtype)
    assert st.norm.dtype == acc and st.scale.dtype == acc and st.skipped.dtype == torch.bool
    assert st.norm.shape == shape and st.scale.shape == shape and st.skipped.shape == shape
    assert st.norm.device.type == be.device.type
    assert_norms_close(be, st.norm, st_ref.norm, dtype)
    if be.name == "triton" and dtype != torch.float64:
        # Triton has been held to a tighter absolute floor on the scale (<= 1).
        torch.testing.assert_close(st.scale.cpu(), st_ref.scale.cpu().to(acc), rtol=2e-5, atol=1e-7, equal_nan=True)
    else:
        assert_norms_close(be, st.scale, st_ref.scale, dtype)
    assert torch.equal(st.skipped.cpu(), torch.as_tensor(st_ref.skipped).cpu())
