"""How the selftest judges one row: tolerances per dtype and the comparisons' record.

A row (one op, one backend, one group of cases) makes many comparisons -- every
tensor of every case against python_ref and against the fp64 formula -- and reports
the worst one (the largest error relative to what its tolerance allows) together
with every comparison that failed, each named (which tensor, dtype, case, oracle).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional

import torch


class Tol(NamedTuple):
    """Elementwise ``|actual - expected| <= atol + rtol * |expected|``."""

    rtol: float
    atol: float

    def __str__(self) -> str:
        return f"rtol={self.rtol:.0e} atol={self.atol:.0e}"


# Values stored in the data dtype (parameters, buffers, ``out``): a kernel accumulates
# in fp32 (fp64) and rounds once at the end, so it may differ from another backend or
# from the exact value by about one unit in the last place of the data dtype -- rtol
# is two ulps (fp16 2^-10, bf16 2^-7 relative); the data are O(1), so atol is as loose.
_DATA = {torch.float32: Tol(1e-5, 1e-5), torch.float16: Tol(2e-3, 2e-3),
         torch.bfloat16: Tol(1.6e-2, 1.6e-2), torch.float64: Tol(1e-10, 1e-10)}
# Reductions returned in the acc dtype (norms, squared norms, scales): fp32 sums of a
# few thousand squares in a different order agree to ~1e-6 relative.
_STATS = {torch.float32: Tol(2e-5, 1e-6), torch.float64: Tol(1e-10, 1e-12)}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the ops accumulate: fp64 for fp64 data, fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def data_tol(dtype: torch.dtype) -> Tol:
    return _DATA[dtype]


def stat_tol(dtype: torch.dtype) -> Tol:
    """The tolerance of a reduction over data of ``dtype`` (it is in the acc dtype)."""
    return _STATS[acc_dtype(dtype)]


def dot_tol(dtype: torch.dtype, magnitude: float) -> Tol:
    """An inner product ``<a, b>`` may cancel: its rounding error is bounded by
    ``eps * sum_j |a_j b_j|`` (times a small factor for the summation), not by its
    value; ``magnitude`` is that sum."""
    eps = torch.finfo(acc_dtype(dtype)).eps
    return Tol(_STATS[acc_dtype(dtype)].rtol, 8 * eps * magnitude)


def _flat64(t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t, dtype=torch.float64)
    return t.detach().to("cpu", torch.float64).reshape(-1)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


class Record:
    """Every comparison of one row: the worst one and the failures."""

    def __init__(self):
        self.count = 0
        self.failures: List[str] = []
        self.worst_ratio = -1.0
        self.max_abs: Optional[float] = None
        self.max_rel: Optional[float] = None
        self.tolerance: Optional[str] = None
        self.worst: Optional[str] = None

    def _note(self, what: str, ratio: float, max_abs: float, max_rel: float, tol: str) -> None:
        self.count += 1
        if ratio > self.worst_ratio:
            self.worst_ratio, self.worst, self.tolerance = ratio, what, tol
            self.max_abs, self.max_rel = max_abs, max_rel

    def close(self, what: str, actual, expected, tol: Tol) -> None:
        """Elementwise within ``tol``; NaN only where NaN is expected, equal infinities."""
        a, b = _flat64(actual), _flat64(expected)
        if a.shape != b.shape:
            self._note(what, math.inf, math.inf, math.inf, str(tol))
            self.failures.append(f"{what}: {a.numel()} values, expected {b.numel()}")
            return
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            i = int((nan_a != nan_b).nonzero()[0])
            self._note(what, math.inf, math.inf, math.inf, str(tol))
            self.failures.append(f"{what}: got {_fmt(a[i])} at [{i}], expected {_fmt(b[i])}")
            return
        same = (a == b) | nan_a  # also equal infinities, whose difference is NaN
        diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
        allowed = tol.atol + tol.rtol * b.abs().nan_to_num(posinf=0.0, neginf=0.0)
        if a.numel() == 0:
            self._note(what, 0.0, 0.0, 0.0, str(tol))
            return
        ratio = diff / allowed
        i = int(ratio.argmax())
        # relative error, with |expected| floored where the absolute tolerance takes over
        floor = tol.atol / tol.rtol
        rel = float((diff / b.abs().clamp_min(floor)).max())
        self._note(what, float(ratio[i]), float(diff.max()), rel, str(tol))
        if ratio[i] > 1:
            self.failures.append(
                f"{what}: max abs err {_fmt(diff.max())}, at [{i}] got {_fmt(a[i])} expected {_fmt(b[i])} "
                f"({tol})")

    def bitwise(self, what: str, actual: torch.Tensor, expected: torch.Tensor, any_nan: bool = False) -> None:
        """The very same bits (a skipped step must not touch its tensors); with
        ``any_nan`` a NaN may come back as any NaN."""
        a = actual.detach().cpu().contiguous().reshape(-1)
        b = expected.detach().cpu().contiguous().reshape(-1)
        if any_nan and a.shape == b.shape:
            both = torch.isnan(a) & torch.isnan(b)
            a, b = a.masked_fill(both, 0), b.masked_fill(both, 0)
        equal = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        self._note(what, 0.0 if equal else math.inf, 0.0 if equal else math.inf,
                   0.0 if equal else math.inf, "bitwise")
        if not equal:
            changed = (a.view(torch.uint8) != b.view(torch.uint8)).sum() if a.shape == b.shape else "shape"
            self.failures.append(f"{what}: not bit-identical ({changed} bytes differ)")

    def true(self, what: str, condition: bool, detail: str = "") -> None:
        """A flag or count that must hold exactly (skipped, excluded, frame count)."""
        self._note(what, 0.0 if condition else math.inf, 0.0, 0.0, "exact")
        if not condition:
            self.failures.append(f"{what}{': ' + detail if detail else ''}")
