"""A model's parameters (and, separately, its buffers) as one flat vector.

Federated learning moves whole models around: clients send their trained parameters or
their update ``D_i = x_start - x_end``, the server averages them.  Everything in
``fedopt_kernels.server`` works on ONE flat vector per client, in a fixed order:

* **parameters**: ``module.named_parameters()`` order (registration order; a parameter
  shared by several submodules appears once, under its first name -- the same
  de-duplication ``torch.nn.utils.parameters_to_vector(module.parameters())`` uses);
* **buffers**: ``module.named_buffers()`` order, in a *separate* vector.  By default
  only floating-point buffers (BatchNorm's ``running_mean``/``running_var``); integer
  and bool buffers (BatchNorm's ``num_batches_tracked``) can be taken on their own, in
  an int64 vector, but are never cast to floating point behind the user's back, and a
  layout mixing floating and integer tensors is refused.

A :class:`FlatLayout` records names, shapes, dtypes and offsets, so that a vector can
be checked (length, dtype, device) before it is written back, and two models can be
checked to share one layout.  Writing back casts each slice to its tensor's dtype
(a model with fp16 and fp32 parameters round-trips exactly through an fp32 vector).
"""

from __future__ import annotations

import warnings
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = [
    "FlatLayout", "TensorSlot", "parameters_layout", "buffers_layout", "parameters_to_vector",
    "vector_to_parameters", "buffers_to_vector", "vector_to_buffers", "flatten_parameters_",
]

class TensorSlot(NamedTuple):
    """Where one named tensor lives in the flat vector."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    numel: int


def _is_integer_like(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


class FlatLayout:
    """The order, shapes, dtypes and offsets of named tensors packed into one vector.

    ``dtype`` is the vector's dtype: given, or the promotion of all tensor dtypes
    (so packing never loses precision).  ``device`` is the tensors' common device.
    """

    def __init__(self, slots: Sequence[TensorSlot], dtype: torch.dtype, device: torch.device):
        self.slots: Tuple[TensorSlot, ...] = tuple(slots)
        self.dtype = dtype
        self.device = torch.device(device)
        self.numel = sum(s.numel for s in self.slots)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_named_tensors(cls, named: Iterable[Tuple[str, torch.Tensor]], *, dtype: Optional[torch.dtype] = None,
                           device=None) -> "FlatLayout":
        named = list(named)
        floating = [n for n, t in named if t.is_floating_point()]
        integer = [n for n, t in named if _is_integer_like(t.dtype)]
        complex_ = [n for n, t in named if t.is_complex()]
        if complex_:
            raise TypeError(f"complex tensors cannot be flattened into a real vector: {complex_}")
        if floating and integer:
            # Mixing would cast integer counters to float (or floats to int): refuse.
            raise TypeError(
                f"cannot pack floating tensors ({floating[:3]}...) and integer tensors ({integer[:3]}...) "
                "into one vector; flatten them separately")
        devices = {t.device for _, t in named}
        if len(devices) > 1:
            raise ValueError(f"all tensors must be on one device to share a flat vector, "
                             f"got {sorted(map(str, devices))}")
        if device is None:
            device = devices.pop() if devices else torch.device("cpu")
        if dtype is None:
            if integer:
                dtype = torch.int64
            elif named:
                dtype = named[0][1].dtype
                for _, t in named[1:]:
                    dtype = torch.promote_types(dtype, t.dtype)
            else:
                dtype = torch.get_default_dtype()
        else:
            if integer and dtype.is_floating_point:
                raise TypeError(f"integer tensors {integer[:3]} would be cast to {dtype}; use an integer dtype")
            if floating and not dtype.is_floating_point:
                raise TypeError(f"floating tensors {floating[:3]} cannot be packed into a {dtype} vector")
        slots, offset = [], 0
        for name, t in named:
            slots.append(TensorSlot(name, t.shape, t.dtype, offset, t.numel()))
            offset += t.numel()
        return cls(slots, dtype, device)

    # ---------------------------------------------------------------- inspection
    @property
    def names(self) -> List[str]:
        return [s.name for s in self.slots]

    def __len__(self) -> int:
        return len(self.slots)

    def __eq__(self, other) -> bool:
        return (isinstance(other, FlatLayout) and self.dtype == other.dtype
                and [(s.name, tuple(s.shape), s.dtype) for s in self.slots]
                == [(s.name, tuple(s.shape), s.dtype) for s in other.slots])

    def __repr__(self) -> str:
        return f"FlatLayout({len(self.slots)} tensors, numel={self.numel}, dtype={self.dtype}, device={self.device})"

    def check_vector(self, vec, name: str = "vector", *, dtype: bool = True, device: bool = True) -> torch.Tensor:
        """Raise a clear error unless ``vec`` is a 1-D tensor of this layout's length
        (and, optionally, its dtype and device)."""
        if not isinstance(vec, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(vec).__name__}")
        if vec.dim() != 1:
            raise ValueError(f"{name} must be a 1-D vector, got shape {tuple(vec.shape)}")
        if vec.numel() != self.numel:
            raise ValueError(f"{name} has {vec.numel()} elements but the model has {self.numel} "
                             f"({len(self.slots)} tensors); was it flattened from another model?")
        if dtype and vec.dtype != self.dtype:
            raise ValueError(f"{name} has dtype {vec.dtype} but the layout's vector dtype is {self.dtype}")
        if device and vec.device != self.device:
            raise ValueError(f"{name} is on {vec.device} but the model is on {self.device}")
        return vec

    # ---------------------------------------------------------------- packing
    def flatten(self, tensors: Sequence[torch.Tensor], *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Pack ``tensors`` (in this layout's order) into a new vector, or into ``out``."""
        tensors = list(tensors)
        self._check_tensors(tensors, "tensors")
        if out is None:
            out = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        else:
            self.check_vector(out, "out")
        with torch.no_grad():
            for s, t in zip(self.slots, tensors):
                out[s.offset:s.offset + s.numel].view(s.shape).copy_(t)
        return out

    def unflatten(self, vec: torch.Tensor, *, cast: bool = False) -> Dict[str, torch.Tensor]:
        """``{name: view}``: views of ``vec`` with the tensors' shapes, no copy.

        The views keep ``vec``'s autograd history (this is how FedLAW feeds an
        aggregated vector to ``torch.func.functional_call``).  With ``cast=True`` a
        slice whose tensor has another dtype is converted (a copy, still
        differentiable); otherwise views keep the vector's dtype.
        """
        self.check_vector(vec, "vec", dtype=False, device=False)
        views = {}
        for s in self.slots:
            v = vec[s.offset:s.offset + s.numel].view(s.shape)
            if cast and v.dtype != s.dtype:
                v = v.to(s.dtype)
            views[s.name] = v
        return views

    def copy_to(self, vec: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Write ``vec`` back into ``tensors`` (each slice cast to its tensor's dtype).

        Everything is checked before anything is written.
        """
        tensors = list(tensors)
        self.check_vector(vec, "vec", dtype=False)
        self._check_tensors(tensors, "tensors")
        if vec.is_floating_point() != self.dtype.is_floating_point:
            raise TypeError(f"vec has dtype {vec.dtype} but the layout holds {self.dtype} tensors")
        with torch.no_grad():
            for s, t in zip(self.slots, tensors):
                t.copy_(vec[s.offset:s.offset + s.numel].view(s.shape))

    def _check_tensors(self, tensors: List[torch.Tensor], name: str) -> None:
        if len(tensors) != len(self.slots):
            raise ValueError(f"{name} holds {len(tensors)} tensors but the layout has {len(self.slots)}")
        for s, t in zip(self.slots, tensors):
            if t.shape != s.shape:
                raise ValueError(f"{name}: {s.name!r} has shape {tuple(t.shape)}, the layout says {tuple(s.shape)}")
            if t.device != self.device:
                raise ValueError(f"{name}: {s.name!r} is on {t.device}, the layout on {self.device}")


# -------------------------------------------------------------------- module helpers
def _named_params(module: nn.Module, trainable_only: bool):
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad or not trainable_only]


def _named_buffers(module: nn.Module, kind: str):
    if kind not in ("floating", "integer"):
        raise ValueError(f"kind must be 'floating' or 'integer', got {kind!r}")
    if kind == "floating":
        return [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    return [(n, b) for n, b in module.named_buffers() if _is_integer_like(b.dtype)]


def parameters_layout(module: nn.Module, *, trainable_only: bool = False, dtype=None) -> FlatLayout:
    """Layout of ``module``'s parameters in ``named_parameters()`` order."""
    return FlatLayout.from_named_tensors(_named_params(module, trainable_only), dtype=dtype)


def buffers_layout(module: nn.Module, *, kind: str = "floating", dtype=None) -> FlatLayout:
    """Layout of ``module``'s floating (default) or integer buffers, ``named_buffers()`` order."""
    return FlatLayout.from_named_tensors(_named_buffers(module, kind), dtype=dtype)


def module_to_vector(module: nn.Module, *, trainable_only: bool = False, dtype=None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A new flat vector (or ``out``) holding ``module``'s parameters (detached), in
    ``named_parameters()`` order.  Takes the module itself, unlike
    ``torch.nn.utils.parameters_to_vector``, which takes an iterable of tensors."""
    _check_module(module, "module_to_vector")
    named = _named_params(module, trainable_only)
    layout = FlatLayout.from_named_tensors(named, dtype=dtype)
    return layout.flatten([p for _, p in named], out=out)


def vector_to_module(vec: torch.Tensor, module: nn.Module, *, trainable_only: bool = False) -> None:
    """Write ``vec`` into ``module``'s parameters (checked first; no autograd record)."""
    _check_module(module, "vector_to_module")
    named = _named_params(module, trainable_only)
    layout = FlatLayout.from_named_tensors(named, dtype=vec.dtype if vec.is_floating_point() else None)
    layout.copy_to(vec, [p for _, p in named])


def _check_module(module, fn: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{fn} takes an nn.Module, got {type(module).__name__}; for an iterable of tensors use "
                        f"torch.nn.utils.{'parameters_to_vector' if fn == 'module_to_vector' else 'vector_to_parameters'}")


def parameters_to_vector(module: nn.Module, **kw) -> torch.Tensor:
    """Deprecated name of :func:`module_to_vector` (it shadowed torch's
    ``parameters_to_vector``, which takes tensors, not a module)."""
    warnings.warn("fedopt_kernels.utils.parameters_to_vector is renamed module_to_vector (it takes a module, "
                  "unlike torch.nn.utils.parameters_to_vector)", DeprecationWarning, stacklevel=2)
    return module_to_vector(module, **kw)


def vector_to_parameters(vec: torch.Tensor, module: nn.Module, **kw) -> None:
    """Deprecated name of :func:`vector_to_module`."""
    warnings.warn("fedopt_kernels.utils.vector_to_parameters is renamed vector_to_module (it takes a module, "
                  "unlike torch.nn.utils.vector_to_parameters)", DeprecationWarning, stacklevel=2)
    vector_to_module(vec, module, **kw)


def buffers_to_vector(module: nn.Module, *, kind: str = "floating", dtype=None,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A flat vector of ``module``'s floating (default) or integer (int64) buffers."""
    named = _named_buffers(module, kind)
    layout = FlatLayout.from_named_tensors(named, dtype=dtype)
    return layout.flatten([b for _, b in named], out=out)


def vector_to_buffers(vec: torch.Tensor, module: nn.Module, *, kind: str = "floating") -> None:
    """Write ``vec`` into ``module``'s floating (default) or integer buffers."""
    named = _named_buffers(module, kind)
    layout = FlatLayout.from_named_tensors(named, dtype=vec.dtype if kind == "floating" and vec.is_floating_point()
                                           else None)
    layout.copy_to(vec, [b for _, b in named])


def flatten_parameters_(module: nn.Module) -> torch.Tensor:
    """Move ``module``'s parameters into ONE flat storage and return it.

    Every parameter's ``.data`` becomes a view of the returned vector (in
    ``named_parameters()`` order), so ``vec`` *is* the model: reading it is free and
    writing it (e.g. ``aggregate(..., out=vec)``) updates the model in place.  The
    ``nn.Parameter`` objects are kept (optimizers holding them stay valid).  All
    parameters must share one dtype and device.
    """
    named = _named_params(module, False)
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) > 1:
        raise TypeError(f"flatten_parameters_ needs one parameter dtype, got {sorted(map(str, dtypes))}")
    layout = FlatLayout.from_named_tensors(named)
    vec = layout.flatten([p for _, p in named])
    with torch.no_grad():
        for s, (_, p) in zip(layout.slots, named):
            p.data = vec[s.offset:s.offset + s.numel].view(s.shape)
    return vec
