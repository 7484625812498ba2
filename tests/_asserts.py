"""The tests' bitwise helpers, once: the raw bits of a tensor, equality to the bit, and
the accumulation dtype the kernels promise.

Imported wherever a test compares bits (the contract suites through ``_contract``, the
op, server and distributed tests), so that "equal to the bit" means one thing everywhere.
"""

from __future__ import annotations

import math

import torch

__all__ = ["acc_of", "bits", "same_bits", "assert_bitwise", "assert_tree_bitwise"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def acc_of(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype the kernels promise: fp64 for fp64 data, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, as integers of its width (so -0.0 != 0.0 and NaN
    payloads count); a bool tensor is its own bits."""
    if t.dtype == torch.bool:
        return t
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` have one shape, one dtype and the same bits."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a).cpu(), bits(b).cpu())


def assert_bitwise(a, b, what="", nan_ok=False):
    """Two tensors, or two lists of tensors, equal to the bit (NaN payloads aside when
    ``nan_ok``); the message names the first elements that differ."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (what, type(a), type(b))
        a, b = [a], [b]
    a, b = list(a), list(b)
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, (what, i, x.dtype, y.dtype, x.shape, y.shape)
        x, y = x.detach().cpu(), y.detach().cpu()
        differ = bits(x) != bits(y)
        if nan_ok and x.dtype != torch.bool:
            differ &= ~(torch.isnan(x) & torch.isnan(y))
        if bool(differ.any()):
            idx = differ.reshape(-1).nonzero().reshape(-1)[:3].tolist()
            raise AssertionError(f"{what}[{i}]: {int(differ.sum())} of {x.numel()} elements differ in their bits, "
                                 f"first at {idx}: {x.reshape(-1)[idx].tolist()} vs {y.reshape(-1)[idx].tolist()}")


def assert_tree_bitwise(a, b, what=""):
    """Two nested dicts / lists / tuples of tensors and plain values equal leaf by leaf:
    tensors to the bit (:func:`assert_bitwise`), other values by ``==`` (NaN equal to
    NaN); the message names the path of the first leaf that differs."""
    if isinstance(a, torch.Tensor):
        assert_bitwise(a, b, what)
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{what}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_tree_bitwise(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_bitwise(x, y, f"{what}[{i}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), f"{what}: {a!r} vs {b!r}"
