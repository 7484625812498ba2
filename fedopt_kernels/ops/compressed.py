"""Compressed client updates: encode on the client, decode inside the aggregation.

A reply is a :class:`CompressedUpdate`; :func:`decode_aggregate` computes ``out = gamma *
sum_i w_i x^_i`` reading every reply's codes in place (no dense fp32 copy of a reply),
with the statistics of :func:`~fedopt_kernels.ops.aggregate` (``||x^_i||^2``,
``||sum||^2``) taken from the DECODED values, and the same robustness (``nonfinite``,
``max_client_norm``) in the same two passes.  ``out`` is bit for bit
``aggregate(decoded rows)`` on the same backend.  The math: python_ref/compression.py.

:func:`check_reply` is the server's validator: the reason a malformed reply must be left
out (wrong codec or block, a length that does not match the model, a wrong number of
scales, a NaN/Inf or negative scale, top-k indices out of range, repeated or unsorted,
non-finite top-k values), or None; an fp8 NaN code decodes to NaN and is left out by the
aggregation's non-finite exclusion.  It reads the reply's values:
replies arrive in host memory, where reading costs no device synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from . import _dispatch, validation as V
from .aggregate import AggregateStats, check_gamma, check_out, check_weights, norm_bound_factors, robust_weights, NONFINITE
from ..backends import compressed as _codec
from ..backends.hyper import split

__all__ = ["CODECS", "CompressedUpdate", "encode", "decode", "check_reply", "decode_aggregate", "hadamard_rotate",
           "hadamard_unrotate", "code_numel", "num_scales", "block_reply_layout", "topk_count", "CODE_DTYPES"]

CODECS = ("int8", "int4", "fp8", "topk")
_BLOCK_CODECS = ("int8", "int4", "fp8")
CODE_DTYPES = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}  # a block reply's codes


@dataclass(frozen=True)
class CompressedUpdate:
    """One client's compressed update of a vector of ``numel`` values.

    * block codecs (``"int8"``, ``"int4"``, ``"fp8"``): ``codes`` (int8 ``[N]``; uint8
      ``[ceil(N/2)]``, two int4 nibbles per byte, low first; float8_e4m3fn ``[N]``) and
      ``scales`` (float32 ``[ceil(N/block)]``);
    * ``"topk"``: ``codes`` the kept values (float32 ``[k]``), ``indices`` (int64 ``[k]``,
      strictly increasing).
    """

    codec: str
    numel: int
    codes: torch.Tensor
    scales: Optional[torch.Tensor] = None
    indices: Optional[torch.Tensor] = None
    block: int = 0

    def nbytes(self) -> int:
        """Bytes on the wire (the tensors' payload)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.indices) if t is not None)


def code_numel(codec: str, numel: int) -> int:
    return (numel + 1) // 2 if codec == "int4" else numel


def num_scales(numel: int, block: int) -> int:
    return -(-numel // block)


def block_reply_layout(codec: str, numel: int, block: int):
    """``((codes dtype, count), (scales dtype, count))`` of a block codec's reply of
    ``numel`` values: what ``encode(out=)`` takes and ``check_reply`` expects."""
    return (CODE_DTYPES[codec], code_numel(codec, numel)), (torch.float32, num_scales(numel, block))


def topk_count(numel: int, fraction: float) -> int:
    """How many values top-k keeps of ``numel``: ``ceil(fraction numel)``, at least 1."""
    return _codec.topk_k(numel, float(fraction))


def _check_codec(codec, block):
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    if codec != "topk" and (isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 32):
        raise ValueError(f"block must be a positive multiple of 32, got {block!r}")


def encode(update: torch.Tensor, codec: str, *, block: int = 256, stochastic: bool = False, key: int = 0,
           client: int = 0, fraction: Optional[float] = None, k: Optional[int] = None,
           backend: Optional[str] = None, out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
           ) -> CompressedUpdate:
    """Encode ``update`` (a float tensor, taken flat as fp32).  Block codecs: ``block``
    values per scale; int8/int4 ``stochastic`` rounding draws its uniforms from
    ``(key, client, element)`` (python_ref/compression.py; ``key`` in ``[0, 2^63)``); fp8
    rounds to e4m3fn half to even.  Every block codec runs the backend's fused encode
    (``block_quantize``).  Top-k keeps ``k`` values, or
    ``ceil(fraction * N)``.

    ``out`` (block codecs): ``(codes, scales)`` to write the reply into -- contiguous 1-D
    tensors on the update's device, of :func:`block_reply_layout`'s dtypes and sizes (a
    round's :class:`~fedopt_kernels.compression.reply_arena.ReplyArena` hands them out);
    the reply then holds them.  The same bits as without ``out``; checked before anything
    is written."""
    _check_codec(codec, block)
    V.check_tensor(update, "update")
    if not update.is_floating_point():
        raise TypeError(f"update must be a floating-point tensor, got {update.dtype}")
    n = update.numel()
    if codec == "topk":
        if (k is None) == (fraction is None):
            raise ValueError("top-k needs exactly one of k= or fraction=")
        if fraction is not None:
            V.check_real(fraction, "fraction", low=0.0, low_open=True, high=1.0)
            k = _codec.topk_k(n, float(fraction))
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
            raise ValueError(f"k must be an int in [0, {n}], got {k!r}")
        if out is not None:
            raise ValueError("out is for the block codecs (int8, int4, fp8); top-k's replies are allocated by "
                             "its encode")
        V.check_backend(backend)
        values, indices = _dispatch.kernel("topk_encode", backend, update.device)(update.reshape(-1), k)
        return CompressedUpdate("topk", n, values, indices=indices)
    if stochastic and codec == "fp8":
        raise ValueError("stochastic rounding is defined for int8 and int4, not fp8")
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 1 << 63:
        raise ValueError(f"key must be an int in [0, 2^63), got {key!r}")
    if isinstance(client, bool) or not isinstance(client, int) or not 0 <= client < 1 << 32:
        raise ValueError(f"client must be an int in [0, 2^32), got {client!r}")
    V.check_backend(backend)
    if out is not None:
        codes, scales = _check_encode_out(out, codec, n, block, update.device)
        run = _dispatch.kernel("block_quantize_into", backend, update.device)
        run(update.reshape(-1), _codec.KINDS[codec], block, bool(stochastic), key, client,
            codes.view(torch.uint8) if codec == "fp8" else codes, scales)
        return CompressedUpdate(codec, n, codes, scales=scales, block=block)
    run = _dispatch.kernel("block_quantize", backend, update.device)
    codes, scales = run(update.reshape(-1), _codec.KINDS[codec], block, bool(stochastic), key, client)
    if codec == "fp8":
        codes = codes.view(torch.float8_e4m3fn)  # the kernels write the code bits as uint8
    return CompressedUpdate(codec, n, codes, scales=scales, block=block)


def _check_encode_out(out, codec: str, n: int, block: int, device: torch.device):
    """``out`` as ``(codes, scales)`` if it can hold ``codec``'s reply of ``n`` values, else a
    ValueError that names what is wrong."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise ValueError(f"out must be a (codes, scales) pair of tensors, got {type(out).__name__}")
    for name, t, (dtype, numel) in zip(("codes", "scales"), out, block_reply_layout(codec, n, block)):
        if t.dtype != dtype or t.dim() != 1 or t.numel() != numel or not t.is_contiguous() or t.device != device:
            raise ValueError(f"out's {name} must be a contiguous 1-D {dtype} tensor of {numel} values on {device} "
                             f"for a {codec} reply of {n} values (block {block}), got {t.dtype} "
                             f"{tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'} on {t.device}")
    return out[0], out[1]


def decode(reply: CompressedUpdate) -> torch.Tensor:
    """The dense fp32 vector a reply stands for (error feedback's ``decode(C(a))``; tests)."""
    if reply.codec == "topk":
        return _codec.decode_topk(reply.codes, reply.indices, reply.numel)
    return _codec.decode_block(reply.codes, reply.scales, reply.codec, reply.block, reply.numel)


def check_reply(reply, numel: int, *, codec: Optional[str] = None, block: Optional[int] = None,
                values: bool = True) -> Optional[str]:
    """Why ``reply`` cannot be aggregated into a model of ``numel`` values (with the
    round's ``codec`` and ``block`` when given), or None when it can.  ``values=False``
    checks the layout only (types, lengths), not the scales' and indices' values."""
    if not isinstance(reply, CompressedUpdate):
        return f"a compressed reply must be a CompressedUpdate, got {type(reply).__name__}"
    if reply.codec not in CODECS:
        return f"unknown codec {reply.codec!r} (expected one of {CODECS})"
    if codec is not None and reply.codec != codec:
        return f"codec {reply.codec!r} does not match the round's {codec!r}"
    if reply.numel != numel:
        return f"the reply describes {reply.numel} values but the model has {numel}"
    c = reply.codes
    if not isinstance(c, torch.Tensor) or c.dim() != 1 or not c.is_contiguous():
        return "codes must be a contiguous 1-D tensor"
    if reply.codec == "topk":
        ix = reply.indices
        if c.dtype != torch.float32:
            return f"top-k values must be float32, got {c.dtype}"
        if not isinstance(ix, torch.Tensor) or ix.dtype != torch.int64 or ix.dim() != 1 or not ix.is_contiguous():
            return "top-k indices must be a contiguous 1-D int64 tensor"
        if ix.numel() != c.numel():
            return f"{c.numel()} top-k values but {ix.numel()} indices"
        if values and ix.numel():
            ixc = ix.cpu()
            if int(ixc.min()) < 0 or int(ixc.max()) >= numel:
                return f"top-k indices out of range [0, {numel}): min {int(ixc.min())}, max {int(ixc.max())}"
            if ix.numel() > 1 and not bool((ixc[1:] > ixc[:-1]).all()):
                d = ixc[1:] - ixc[:-1]
                where = int((d <= 0).nonzero()[0])
                what = "repeated" if int(d[where]) == 0 else "not sorted"
                return f"top-k indices {what} at position {where + 1} (index {int(ixc[where + 1])})"
            if not bool(torch.isfinite(c).all()):
                return "top-k values hold NaN/Inf"
        return None
    if block is not None and reply.block != block:
        return f"block {reply.block} does not match the round's {block}"
    if isinstance(reply.block, bool) or not isinstance(reply.block, int) or reply.block <= 0 or reply.block % 32:
        return f"block must be a positive multiple of 32, got {reply.block!r}"
    want = CODE_DTYPES[reply.codec]
    if c.dtype != want:
        return f"{reply.codec} codes must be {want}, got {c.dtype}"
    if c.numel() != code_numel(reply.codec, numel):
        return f"{c.numel()} codes for {numel} values (expected {code_numel(reply.codec, numel)})"
    s = reply.scales
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.dim() != 1 or not s.is_contiguous():
        return "scales must be a contiguous 1-D float32 tensor"
    nb = num_scales(numel, reply.block)
    if s.numel() != nb:
        return f"{s.numel()} scales for {numel} values in blocks of {reply.block} (expected {nb})"
    if not values:
        return None
    sc = s.cpu()
    if nb and not bool(torch.isfinite(sc).all()):
        return f"a NaN/Inf scale at block {int((~torch.isfinite(sc)).nonzero()[0])}"
    if nb and bool((sc < 0).any()):
        return f"a negative scale at block {int((sc < 0).nonzero()[0])}"
    # An fp8 NaN code is not looked for here (a scan of every code, as long as the
    # aggregation itself): it decodes to NaN, and the aggregation's non-finite exclusion
    # leaves the client out, as it leaves out an fp32 update holding a NaN.
    return None


def _check_round(replies: Sequence[CompressedUpdate], values: bool = True):
    """The common (codec, block, numel, device) of the replies; each reply valid."""
    if isinstance(replies, CompressedUpdate) or not isinstance(replies, (list, tuple)) or not replies:
        raise ValueError("replies must be a non-empty list of CompressedUpdate")
    first = replies[0]
    if not isinstance(first, CompressedUpdate):
        raise ValueError(f"replies[0]: a compressed reply must be a CompressedUpdate, got {type(first).__name__}")
    for i, r in enumerate(replies):
        why = check_reply(r, first.numel, codec=first.codec, block=first.block if first.codec != "topk" else None,
                          values=values)
        if why is not None:
            raise ValueError(f"replies[{i}]: {why}")
        if r.codes.device != first.codes.device:
            raise ValueError(f"replies[{i}] is on {r.codes.device} but replies[0] on {first.codes.device}")
    return first.codec, first.block, first.numel, first.codes.device


def decode_aggregate(replies: Sequence[CompressedUpdate], weights, *, gamma=1.0, out: Optional[torch.Tensor] = None,
                     nonfinite: str = "exclude", max_client_norm: Optional[float] = None,
                     backend: Optional[str] = None, checked: bool = False):
    r"""``out = gamma * sum_i weights[i] * decode(replies[i])`` and its statistics, every
    reply read in place by the backend's fused decode-aggregate.  ``weights``,
    ``gamma``, ``nonfinite`` and ``max_client_norm`` as :func:`~fedopt_kernels.ops.aggregate`
    (the norms are those of the decoded updates); ``out`` float32 ``[N]``.
    Every reply is validated first (:func:`check_reply`; a malformed one raises with
    its reason -- a round leaves it out before calling this).  ``checked=True``: the
    caller has just run :func:`check_reply` on every reply (as a round does, to leave the
    malformed ones out with their reasons), so only their layout is checked again, not
    their values.  Either way nothing unsafe reaches a kernel: the kernels never write
    outside ``out`` whatever the indices, and a NaN/Inf that decodes is excluded by
    ``nonfinite="exclude"``.

    Returns ``(out, AggregateStats)``.
    """
    codec, block, N, device = _check_round(replies, values=not checked)
    C = len(replies)
    w = check_weights(weights, C, device, torch.float32)
    gamma = check_gamma(gamma, device, torch.float32)
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    if max_client_norm is not None:
        max_client_norm = V.check_real(max_client_norm, "max_client_norm", low=0.0, low_open=True)
    out = check_out(out, N, torch.float32, device, who="decode_aggregate")
    V.check_backend(backend)
    if codec == "topk":
        run = _dispatch.kernel("topk_decode_aggregate", backend, device)
        a, b = [r.codes for r in replies], [r.indices for r in replies]
        call = lambda w_, skip: run(a, b, N, w_, *split(gamma), out, skip)  # noqa: E731
    else:
        run = _dispatch.kernel("block_decode_aggregate", backend, device)
        a = [r.codes.view(torch.uint8) if codec == "fp8" else r.codes for r in replies]
        b = [r.scales for r in replies]
        kind = _codec.KINDS[codec]
        call = lambda w_, skip: run(a, b, kind, block, N, w_, *split(gamma), out, skip)  # noqa: E731
    q, Q = call(w, None)
    if nonfinite == "exclude" or max_client_norm is not None:
        eff, excluded = robust_weights(w, q, nonfinite == "exclude", None)
        if max_client_norm is not None:
            eff = eff * norm_bound_factors(q, excluded, max_client_norm)
        same = (eff == w).all()
        _, Q2 = call(eff, same)
        Q = torch.where(same, Q, Q2)
    else:
        eff, excluded = w, torch.zeros(C, dtype=torch.bool, device=device)
    return out, AggregateStats(q, Q, excluded, eff, excluded.all())


def _check_rotation(block):
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"the rotation block must be a power of two, got {block!r}")


def hadamard_rotate(x: torch.Tensor, key: int, block: int = 1024) -> torch.Tensor:
    """``H_R diag(r) x / sqrt(R)`` per block of ``R = block`` values (python_ref/compression.py),
    fp32, zero-padded to a multiple of R; ``r`` from ``key`` (one key per round)."""
    _check_rotation(block)
    return _codec.hadamard_rotate(x.reshape(-1), int(key), block)


def hadamard_unrotate(y: torch.Tensor, key: int, block: int, numel: int) -> torch.Tensor:
    """The inverse of :func:`hadamard_rotate`, the first ``numel`` values (once, on the aggregate)."""
    _check_rotation(block)
    if y.numel() != block * math.ceil(numel / block):
        raise ValueError(f"y must have {block * math.ceil(numel / block)} values (numel {numel} padded to blocks of "
                         f"{block}), got {y.numel()}")
    return _codec.hadamard_unrotate(y, int(key), block, numel)
