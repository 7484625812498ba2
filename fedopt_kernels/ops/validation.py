"""Argument checks shared by the public ops, and by every layer above them (optimizers,
schedulers, the simulator's settings): one place for what a valid number, tensor or
backend name is, and how a refusal reads.

Every check runs before any data is touched, so a rejected call modifies nothing, and
every message names the argument and says what was expected.  Checks only read tensor
metadata (shape, dtype, device, strides): no device synchronisation.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Callable, Optional, Sequence, TypeVar

import torch

from ..backends.dtypes import FLOAT_DTYPES, acc_dtype  # noqa: F401 - re-exported: the one dtype rule
from ._dtensor import is_dtensor  # noqa: F401 - re-exported: the layers above refuse or split DTensors

T = TypeVar("T")


def refuse_dtensor(t, name: str, *, who: str = "this op", what: str = "pass {name}.full_tensor() instead") -> None:
    """Refuse a ``DTensor`` (FSDP2, tensor parallelism) by name where ``who`` works on
    the full, unsharded state: it holds one rank's shard of that state, and mixed with
    plain tensors it would fail inside torch with no name attached."""
    if is_dtensor(t):
        raise ValueError(f"{name} is a DTensor (placements {tuple(t.placements)}): {who} works on the full, "
                         f"unsharded state; {what.format(name=name)}")


def check_backend(backend: Optional[str], name: str = "backend") -> Optional[str]:
    """``backend`` if it names a backend (``"reference"``, ``"cpu"``, ``"triton"``,
    ``"cuda"``) or is None (chosen by device); else ``ValueError`` naming the choices.
    Whether it can run on a given device is decided when it is resolved."""
    from ..backends import BACKENDS

    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"{name} must be one of {BACKENDS} or None, got {backend!r}")
    return backend


def is_dense_non_overlapping(t: torch.Tensor) -> bool:
    """True if the elements of ``t`` fill ``[data_ptr, data_ptr + numel)`` exactly once
    (some permutation of the dims is contiguous), like ``channels_last`` tensors."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def check_untracked(tensors, name: str, *, written: bool) -> None:
    """Refuse tensors autograd would have to record, as torch's in-place ops do: the fused
    ops are not differentiable and update ``written`` tensors in place.  Free under
    ``torch.no_grad()`` (where optimizers call them): nothing is looked at then."""
    if tensors is None or not torch.is_grad_enabled():
        return
    if isinstance(tensors, torch.Tensor):
        tensors, index = [tensors], False
    else:
        index = True
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            at = f"{name}[{i}]" if index else name
            if written:
                raise RuntimeError(
                    f"{at} requires grad and would be updated in place outside torch.no_grad() (a leaf Variable "
                    f"that requires grad cannot be used in an in-place operation): call the op under "
                    f"torch.no_grad(), as torch.optim optimizers do")
            raise RuntimeError(
                f"{at} requires grad, but the fused op is not differentiable: call it under torch.no_grad() "
                f"or pass {at}.detach()")


def check_tensor(t, name: str, *, dims: Optional[int] = None) -> torch.Tensor:
    """A dense real floating tensor whose memory is one flat block."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.is_complex():
        raise ValueError(f"{name} must be real, got complex dtype {t.dtype}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must have a floating dtype in {FLOAT_DTYPES}, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    # Kernels treat each tensor's memory as one flat array, which is right for any
    # layout without gaps or overlaps (contiguous, channels_last, ...).
    if not t.is_contiguous() and not is_dense_non_overlapping(t):
        raise ValueError(
            f"{name} must be contiguous (or dense without overlap, e.g. channels_last); "
            f"got shape {tuple(t.shape)} with strides {t.stride()}: call .contiguous() first")
    return t


def check_tensor_list(tensors, name: str) -> list:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        check_tensor(t, f"{name}[{i}]")
    return tensors


_FLOAT_SET = frozenset(FLOAT_DTYPES)


def lists_match_fast(params, grads, bufs) -> bool:
    """True when ``params``/``grads`` (and ``bufs`` unless None) are equally long,
    non-empty lists or tuples of contiguous strided tensors of one floating dtype on one
    device with matching shapes: the common case, checked in one tight pass (~1 us per
    tensor).  False means "run the detailed checks", never "invalid" by itself."""
    if not isinstance(params, (list, tuple)) or not isinstance(grads, (list, tuple)) or not params:
        return False
    if len(grads) != len(params) or (bufs is not None and (not isinstance(bufs, (list, tuple))
                                                           or len(bufs) != len(params))):
        return False
    try:
        p0 = params[0]
        dtype, device = p0.dtype, p0.device
        if dtype not in _FLOAT_SET:
            return False
        strided = torch.strided
        for i, p in enumerate(params):
            g = grads[i]
            if (p.dtype != dtype or g.dtype != dtype or p.layout != strided or g.layout != strided
                    or p.device != device or g.device != device or p.shape != g.shape
                    or not p.is_contiguous() or not g.is_contiguous()):
                return False
            if bufs is not None:
                b = bufs[i]
                if (b.dtype != dtype or b.layout != strided or b.device != device or b.shape != p.shape
                        or not b.is_contiguous()):
                    return False
    except (AttributeError, TypeError, RuntimeError):  # not tensors: the detailed checks say so
        return False
    return True


def check_like(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str, *, strides: bool = True) -> None:
    """``t`` must match ``ref`` in shape, dtype and device (and memory layout)."""
    if t.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}")
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
    if strides and t.numel() > 1 and t.stride() != ref.stride():
        raise ValueError(
            f"{name} has strides {t.stride()} but {ref_name} has strides {ref.stride()}; "
            "they must share one memory layout")


def check_same_device(tensors: Sequence[torch.Tensor], name: str) -> torch.device:
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != device:
            raise ValueError(f"{name} must all be on one device: {name}[0] is on {device}, {name}[{i}] on {t.device}")
    return device


def check_values(now: Callable[[], T], in_graph: Optional[Callable[[], object]], message: str = "",
                 traced: Optional[T] = None) -> Optional[T]:
    """A check that reads VALUES, in the one place that knows whether they are known.

    Eager, ``now()`` runs: it reads the values, raises the message naming the argument,
    and its result is returned.  Under ``torch.compile`` values are not known while
    tracing (a Python branch on them would break the graph): ``in_graph()`` -- a bool,
    symbolic or not, or a bool tensor -- becomes a check of the compiled graph
    (``torch._check``, ``torch._assert_async``) that fails with ``message`` when the graph
    runs, and ``traced`` is returned.  ``in_graph=None``: the check has no graph form
    (memory addresses, which fake tensors lack)."""
    if not torch.compiler.is_compiling():
        return now()
    if in_graph is not None:
        ok = in_graph()
        if isinstance(ok, torch.Tensor):
            torch._assert_async(ok, message)
        else:
            # The message is bound as a default argument, not a closure: dynamo (torch 2.11)
            # refuses a torch._check message function that references a non-local variable.
            torch._check(ok, lambda message=message: message)
    return traced


def check_real(value, name: str, *, low=None, high=None, low_open=False, high_open=False,
               allow_inf=False) -> float:
    """A Python number within the given bounds."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    lo = "" if low is None else (f"{name} > {low}" if low_open else f"{name} >= {low}")
    hi = "" if high is None else (f"{name} < {high}" if high_open else f"{name} <= {high}")
    bounds = " and ".join(b for b in (lo, hi) if b)

    def now() -> float:
        v = float(value)
        if math.isnan(v) or (math.isinf(v) and not allow_inf):
            raise ValueError(f"{name} must be finite, got {v}")
        bad_low = low is not None and (v <= low if low_open else v < low)
        bad_high = high is not None and (v >= high if high_open else v > high)
        if bad_low or bad_high:
            raise ValueError(f"{name} must satisfy {bounds}, got {v}")
        return v

    def in_graph():
        # Under torch.compile a Python number is a constant of the trace (dynamo
        # specialises floats, so every new value recompiles) or, with dynamic shapes
        # for floats, a symbol: then the bounds become a check of the compiled graph
        # (math.isnan cannot be traced; NaN fails every comparison, so it is refused
        # all the same).  A number that changes every step belongs in a 0-d tensor.
        ok = value == value
        if low is not None:
            ok = ok & ((value > low) if low_open else (value >= low))
        if high is not None:
            ok = ok & ((value < high) if high_open else (value <= high))
        if not allow_inf:
            ok = ok & (value < math.inf) & (value > -math.inf)
        return ok

    return check_values(now, in_graph, f"{name} must be finite{' and satisfy ' + bounds if bounds else ''}",
                        traced=value)


def check_hyper(value, name: str, device: torch.device, dtype: torch.dtype, *, low=0.0,
                sizes=((),)):
    """A hyperparameter given as a number or as a tensor (kept on the device).

    A tensor's *value* cannot be checked without a device sync; its shape, dtype and
    device are.  It is returned converted to ``dtype`` on ``device``.
    """
    if isinstance(value, torch.Tensor):
        if tuple(value.shape) not in [tuple(s) for s in sizes]:
            raise ValueError(f"{name} as a tensor must have shape in {list(sizes)}, got {tuple(value.shape)}")
        if not value.is_floating_point():
            raise ValueError(f"{name} as a tensor must be floating point, got {value.dtype}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the data is on {device}")
        return value.to(dtype)
    return check_real(value, name, low=low)


def check_scalar_tensor(t, name: str, device: torch.device) -> Optional[torch.Tensor]:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        raise ValueError(f"{name} must be None or a one-element tensor")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the data is on {device}")
    return t.reshape(())
