"""Flower ``ArrayRecord`` <-> flat torch vectors, one copy per array.

A Flower :class:`~flwr.app.Array` holds a NumPy ``.npy`` image in ``Array.data``
(``stype == "numpy.ndarray"``): a small header (magic, dtype, shape) then the raw
elements.  ``Array.numpy()`` runs ``np.load`` on it (one copy), and Flower's own
strategies then do per-layer NumPy arithmetic on the results (``value * weight``,
``+=``: a temporary and two more passes per layer and client).  Here instead:

* **reading** (:func:`stack_arrayrecords`, :func:`arrayrecord_to_vector`): the header
  is parsed once per distinct header (cached), the elements are viewed in place with
  ``np.frombuffer`` (no copy) and read ONCE, straight into their slice of a
  preallocated row of a ``[C, N]`` tensor (``np.copyto`` into the tensor's memory, a
  dtype cast folded into that copy if needed).  With ``subtract_from=x_global`` that
  same pass writes ``x_global - x_i`` (the client update) instead of ``x_i``.  No
  per-layer arithmetic: the rows go to the fused aggregation as they are.  Large
  stacks are filled by several threads (NumPy releases the GIL).
* **writing** (:func:`tensors_to_arrayrecord`): each tensor becomes one ``bytes`` of
  ``header + elements`` (one copy; the header is the one ``np.save`` writes, so
  ``Array.numpy()`` and ``np.load`` read it).

The order of a flat vector is a :class:`~fedopt_kernels.utils.FlatLayout`'s: for a
model's parameters, ``named_parameters()`` order, the order every server optimizer of
``fedopt_kernels.server`` expects.  Arrays are looked up BY NAME (the record's own
key order does not matter) and every name and shape is checked before anything is
copied: a record from another model is refused with a message naming the array.
"""

from __future__ import annotations

import io
import math
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import nn

from ...ops import ClientPieces
from ...utils.flat import FlatLayout, parameters_layout

__all__ = [
    "NUMPY_STYPE", "array_view", "tensor_to_array", "tensors_to_arrayrecord", "model_to_arrayrecord",
    "arrayrecord_to_vector", "stack_arrayrecords", "arrayrecords_as_pieces", "load_arrayrecord_", "check_arrayrecord",
    "vector_to_named_tensors", "records_numel",
]

NUMPY_STYPE = "numpy.ndarray"  # flwr.common.constant.SType.NUMPY

_TORCH_TO_NUMPY = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_,
}

# header bytes -> (dtype, shape, fortran_order, offset of the elements, number of elements)
_Header = Tuple[np.dtype, Tuple[int, ...], bool, int, int]
_HEADER_CACHE: Dict[bytes, _Header] = {}
_HEADER_CACHE_MAX = 4096
# (dtype str, shape) -> header bytes
_WRITE_CACHE: Dict[Tuple[str, Tuple[int, ...]], bytes] = {}
# Filling rows in parallel pays off from this many elements per call (NumPy releases the GIL).
PARALLEL_MIN_ELEMENTS = 1 << 23
_POOLS: Dict[int, ThreadPoolExecutor] = {}


# ----------------------------------------------------------------------------- reading
def _parse_header(data: bytes) -> _Header:
    """``(dtype, shape, fortran_order, offset, count)`` of an ``.npy`` image (cached by header)."""
    if len(data) < 10 or data[:6] != b"\x93NUMPY":
        raise ValueError("not an .npy image (bad magic)")
    major = data[6]
    if major == 1:
        end = 10 + int.from_bytes(data[8:10], "little")
    elif major in (2, 3):
        end = 12 + int.from_bytes(data[8:12], "little")
    else:
        raise ValueError(f"unsupported .npy format version {major}")
    key = data[:end]
    hit = _HEADER_CACHE.get(key)
    if hit is not None:
        return hit
    fp = io.BytesIO(key)
    version = np.lib.format.read_magic(fp)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
    if dtype.hasobject:
        raise ValueError("object arrays are not model weights")
    shape = tuple(int(s) for s in shape)
    parsed = (dtype, shape, bool(fortran), end, math.prod(shape))
    if len(_HEADER_CACHE) >= _HEADER_CACHE_MAX:
        _HEADER_CACHE.clear()
    _HEADER_CACHE[key] = parsed
    return parsed


def array_view(array: Array) -> np.ndarray:
    """A read-only NumPy view of ``array``'s elements, without copying them.

    Arrays in another serialisation than NumPy's fall back to ``array.numpy()``.
    """
    if array.stype != NUMPY_STYPE:
        return np.asarray(array.numpy())
    data = array.data
    dtype, shape, fortran, offset, count = _parse_header(data)
    if len(data) - offset < count * dtype.itemsize:
        raise ValueError(f"array of shape {shape} and dtype {dtype} is truncated")
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    if fortran:
        return flat.reshape(shape[::-1]).T
    return flat.reshape(shape)


def _views(record: ArrayRecord, layout: FlatLayout, name: str,
           allow_extra: Optional[Iterable[str]] = None) -> List[np.ndarray]:
    """Checked views of ``record``'s arrays in ``layout``'s order (each header parsed once)."""
    if not isinstance(record, ArrayRecord):
        raise TypeError(f"{name} must be a flwr.app.ArrayRecord, got {type(record).__name__}")
    missing = [s.name for s in layout.slots if s.name not in record]
    if missing:
        raise ValueError(f"{name} lacks the array(s) {missing[:5]} of the model (it has {list(record.keys())[:5]}"
                         "...); was it made from another model?")
    if allow_extra is not None:
        known = {s.name for s in layout.slots} | set(allow_extra)
        unknown = [k for k in record.keys() if k not in known]
        if unknown:
            raise ValueError(f"{name} holds array(s) {unknown[:5]} that the model does not have")
    floating = layout.dtype.is_floating_point
    views = []
    for s in layout.slots:
        try:
            v = array_view(record[s.name])
        except ValueError as exc:
            raise ValueError(f"{name}[{s.name!r}]: {exc}") from None
        if v.shape != tuple(s.shape):
            raise ValueError(f"{name}[{s.name!r}] has shape {v.shape} but the model's {s.name!r} has shape "
                             f"{tuple(s.shape)}")
        kind = v.dtype.kind
        if kind not in "fiub" or (floating and kind != "f"):
            raise ValueError(f"{name}[{s.name!r}] has dtype {v.dtype}, expected a {layout.dtype} array")
        views.append(v)
    return views


def check_arrayrecord(record: ArrayRecord, layout: FlatLayout, name: str = "record",
                      *, allow_extra: Optional[Iterable[str]] = None) -> None:
    """Raise ``ValueError`` unless ``record`` holds every tensor of ``layout`` (by name,
    with the layout's shape and a dtype of its kind) and no key outside ``layout`` and
    ``allow_extra`` (when given)."""
    _views(record, layout, name, allow_extra)


def _numpy_of(t: torch.Tensor, name: str) -> np.ndarray:
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor to be filled from ArrayRecords, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t.detach().numpy()


def _fill(dst: np.ndarray, views: List[np.ndarray], layout: FlatLayout, base: Optional[np.ndarray]) -> None:
    """``dst`` (flat) <- the views (or ``base - views``), one pass per array."""
    for s, v in zip(layout.slots, views):
        d = dst[s.offset:s.offset + s.numel].reshape(s.shape)
        if base is None:
            np.copyto(d, v, casting="same_kind")
        else:
            np.subtract(base[s.offset:s.offset + s.numel].reshape(s.shape), v, out=d, casting="same_kind")


def _base(subtract_from: Optional[torch.Tensor], layout: FlatLayout) -> Optional[np.ndarray]:
    if subtract_from is None:
        return None
    layout.check_vector(subtract_from, "subtract_from", device=False)
    return _numpy_of(subtract_from, "subtract_from")


def arrayrecord_to_vector(record: ArrayRecord, layout: FlatLayout, *, out: Optional[torch.Tensor] = None,
                          name: str = "record", subtract_from: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tensors of ``layout`` (by name) from ``record`` as ONE flat CPU vector of
    ``layout.dtype`` (into ``out`` if given): one copy per array.  With
    ``subtract_from=x`` (a flat vector of the layout) the result is ``x - record``,
    computed in that same single pass."""
    views = _views(record, layout, name)
    if out is None:
        out = torch.empty(layout.numel, dtype=layout.dtype)
    else:
        layout.check_vector(out, "out", device=False)
    _fill(_numpy_of(out, "out"), views, layout, _base(subtract_from, layout))
    return out


def stack_arrayrecords(records: Sequence[ArrayRecord], layout: FlatLayout, *, out: Optional[torch.Tensor] = None,
                       names: Optional[Sequence[str]] = None, subtract_from: Optional[torch.Tensor] = None,
                       workers: Optional[int] = None) -> torch.Tensor:
    """``[C, N]``: row ``i`` is ``records[i]``'s tensors of ``layout`` flattened in the
    layout's order (or ``subtract_from - records[i]``: the client updates
    ``D_i = x_global - x_i`` straight from the client models, in the same pass).

    Every record is checked first (names, shapes, dtypes; ``names`` label the records
    in errors); then each array is read once, into its slice of its row of ``out`` (a
    preallocated contiguous CPU ``[C, N]`` tensor, if given).  Rows are filled by
    ``workers`` threads (default: ``torch.get_num_threads()`` when there are at least
    :data:`PARALLEL_MIN_ELEMENTS` elements).
    """
    C = len(records)
    if C == 0:
        raise ValueError("records must hold at least one ArrayRecord")
    names = list(names) if names is not None else [f"records[{i}]" for i in range(C)]
    views = [_views(rec, layout, nm) for rec, nm in zip(records, names)]
    if out is None:
        out = torch.empty(C, layout.numel, dtype=layout.dtype)
    elif tuple(out.shape) != (C, layout.numel) or out.dtype != layout.dtype:
        raise ValueError(f"out must be a [{C}, {layout.numel}] {layout.dtype} tensor, got {tuple(out.shape)} "
                         f"{out.dtype}")
    dst = _numpy_of(out, "out")
    base = _base(subtract_from, layout)
    if workers is None:
        workers = torch.get_num_threads() if C * layout.numel >= PARALLEL_MIN_ELEMENTS else 1
    workers = max(1, min(int(workers), C))
    if workers == 1:
        for i in range(C):
            _fill(dst[i], views[i], layout, base)
    else:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="fedopt-records")
        for f in [pool.submit(_fill, dst[i], views[i], layout, base) for i in range(C)]:
            f.result()
    return out


def arrayrecords_as_pieces(records: Sequence[ArrayRecord], layout: FlatLayout, *,
                           names: Optional[Sequence[str]] = None,
                           subtract_from: Optional[torch.Tensor] = None) -> Optional[ClientPieces]:
    """The records' tensors of ``layout`` as :class:`~fedopt_kernels.ops.ClientPieces`
    read in place -- tensors over the replies' own bytes, no copy -- with
    ``subtract_from`` (``x_global``: the pieces then stand for the updates
    ``x_global - x_i``), or None where a record cannot be read in place: an array of
    another dtype than the layout's (it needs a conversion) or in Fortran order.  Every
    record is checked as :func:`stack_arrayrecords` checks it (the same errors)."""
    names = list(names) if names is not None else [f"records[{i}]" for i in range(len(records))]
    views = [_views(rec, layout, nm) for rec, nm in zip(records, names)]
    want = _TORCH_TO_NUMPY.get(layout.dtype)
    if want is None or any(v.dtype != want or not v.flags.c_contiguous for vs in views for v in vs):
        return None
    with warnings.catch_warnings():
        # a reply's bytes are read-only; the pieces are only ever read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        pieces = [[torch.from_numpy(v) for v in vs] for vs in views]
    return ClientPieces(pieces, subtract_from=subtract_from, name="replies")


def load_arrayrecord_(model: nn.Module, record: ArrayRecord, *, strict: bool = True) -> None:
    """Copy ``record`` into ``model``'s parameters and buffers by name (one copy per
    array, no intermediate tensors).  ``strict``: every parameter must be present and
    every key of ``record`` must be one of ``model.state_dict()``'s."""
    state = model.state_dict(keep_vars=True)
    if strict:
        check_arrayrecord(record, parameters_layout(model), "record", allow_extra=state.keys())
    with torch.no_grad():
        for key, arr in record.items():
            t = state.get(key)
            if t is None:
                if strict:
                    raise ValueError(f"record holds {key!r}, which the model does not have")
                continue
            src = array_view(arr)
            if tuple(src.shape) != tuple(t.shape):
                raise ValueError(f"record[{key!r}] has shape {tuple(src.shape)}, the model's has {tuple(t.shape)}")
            if t.device.type == "cpu" and t.is_contiguous() and t.dtype in _TORCH_TO_NUMPY:
                np.copyto(t.detach().numpy(), src, casting="same_kind")
            else:
                t.copy_(torch.from_numpy(np.array(src)))


# ----------------------------------------------------------------------------- writing
def _header(dtype: np.dtype, shape: Tuple[int, ...]) -> bytes:
    key = (dtype.str, shape)
    h = _WRITE_CACHE.get(key)
    if h is None:
        fp = io.BytesIO()
        d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
        try:
            np.lib.format.write_array_header_1_0(fp, d)
        except ValueError:  # header too long for format 1.0 (huge shapes)
            fp = io.BytesIO()
            np.lib.format.write_array_header_2_0(fp, d)
        h = fp.getvalue()
        if len(_WRITE_CACHE) >= _HEADER_CACHE_MAX:
            _WRITE_CACHE.clear()
        _WRITE_CACHE[key] = h
    return h


def tensor_to_array(tensor: torch.Tensor) -> Array:
    """A Flower :class:`~flwr.app.Array` (NumPy serialisation, readable by
    ``Array.numpy()``) holding ``tensor``'s values: one copy of the elements."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype not in _TORCH_TO_NUMPY:
        raise TypeError(f"tensors of dtype {t.dtype} have no NumPy equivalent (Flower Arrays are NumPy images); "
                        "convert them first (e.g. .float())")
    t = t.contiguous()
    arr = t.numpy()
    shape = tuple(int(s) for s in t.shape)
    header = _header(arr.dtype, shape)
    data = b"".join((header, memoryview(arr.reshape(-1)).cast("B")))
    return Array(dtype=str(arr.dtype), shape=shape, stype=NUMPY_STYPE, data=data)


def tensors_to_arrayrecord(named: Iterable[Tuple[str, torch.Tensor]]) -> ArrayRecord:
    """An ``ArrayRecord`` of ``(name, tensor)`` pairs, in their order."""
    return ArrayRecord({name: tensor_to_array(t) for name, t in named})


def model_to_arrayrecord(model: nn.Module, *, keys: Optional[Sequence[str]] = None) -> ArrayRecord:
    """``ArrayRecord(model.state_dict())`` (parameters and buffers), written with one
    copy per tensor; ``keys`` selects and orders the entries (default: all of
    ``state_dict()``, in its order)."""
    state = model.state_dict()
    if keys is None:
        return tensors_to_arrayrecord(state.items())
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"the model has no tensor(s) {missing[:5]}")
    return tensors_to_arrayrecord((k, state[k]) for k in keys)


def vector_to_named_tensors(vec: torch.Tensor, layout: FlatLayout) -> List[Tuple[str, torch.Tensor]]:
    """``[(name, view)]`` of a flat vector, cast to each slot's dtype (no copy when equal)."""
    return [(name, t if t.dtype == s.dtype else t.to(s.dtype))
            for (name, t), s in zip(layout.unflatten(vec).items(), layout.slots)]


def records_numel(record: Mapping[str, Array]) -> int:
    """Number of elements of every array of ``record`` (from the headers)."""
    return sum(array_view(a).size for a in record.values())
