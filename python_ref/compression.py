"""Compressed client updates: every codec and the decode-aggregate (the oracle).

DESIGN.md, "Compressed updates".  A client encodes its update ``x`` (length ``N``); the
server aggregates ``out = gamma * sum_i p_i decode(code_i)``.  Decoding is linear in
the codes, so the kernels fold it into the weighted pass; this module states each
codec plainly, in fp32 with each operation rounded once, and the decode-aggregate as
:func:`python_ref.aggregation.aggregate` over the decoded rows -- so a fused kernel
that decodes ``v = s_b * q`` and adds ``p_i * v`` in client order gives the same bits.

Block quantization (int8: ``Q = 127``; int4: ``Q = 7``), blocks of ``B`` consecutive
values (the last one may be shorter)::

    s_b = max_{j in b} |x_j| / Q                  (fp32, one rounding)
    t_j = x_j / s_b                               (0 when s_b == 0)
    deterministic:  q_j = round_half_even(t_j)    |x_j - s_b q_j| <= s_b / 2 (+ rounding of t_j)
    stochastic:     q_j = floor(t_j) + [u_j < t_j - floor(t_j)],  E[s_b q_j] = x_j
    decode:         x^_j = s_b * q_j              (fp32, one rounding)

(Alistarh et al., "QSGD", NeurIPS 2017, with one scale per block as bitsandbytes and
torchao do.)  ``u_j`` is the uniform of :func:`rounding_uniform`: Philox4x32-10 of
python_ref/gaussian_noise.py keyed by the round's key, counter ``(j, client, STREAM)``:
a function of (seed, round, client, element) alone, as the DP noise.  ``u`` lies on the
grid ``2^-24 Z`` in ``[0, 1)``, so ``P(u < f) = ceil(2^24 f) / 2^24``: exact when ``f``
is a multiple of ``2^-24`` (``|t| >= 1/2``), biased by less than ``2^-24 s_b`` otherwise.
q is clamped to ``[-Q, Q]`` (``t`` can exceed ``Q`` by one rounding of ``s_b``).

int4 codes are packed two per byte, two's-complement nibbles: element ``2m`` in the low
nibble of byte ``m``, ``2m + 1`` in the high one (0 past the end).

FP8 (e4m3fn, max 448) with one scale per row of ``B`` values, as torchft's DiLoCo
quantizes pseudo-gradients row-wise: ``s_b = max|x| / 448``, ``code = e4m3(x / s_b)``
(round to nearest even, clamped to +-448), ``x^ = s_b * float(code)``.

Top-k (Aji & Heafield 2017; Stich et al. 2018): the ``k`` largest ``|x_j|``, ties
broken by the lower index; indices sorted ascending (int64), values in fp32.

Error feedback (Seide et al. 2014; Karimireddy et al., EF-SGD, ICML 2019): with the
client's residual ``e``, ``a = e + D``; the client sends ``C(a)`` and keeps
``e <- a - decode(C(a))``.

Randomized Hadamard rotation (Suresh et al. 2017; DRIVE, Vargaftik et al. 2021): per
block of ``R`` values (``R`` a power of two; the vector zero-padded to a multiple of
``R``), ``y = H_R diag(r) x / sqrt(R)`` with Rademacher signs ``r_j`` from the round's
key (the same for every client, so the server rotates the AGGREGATE back once:
``x = diag(r) H_R y / sqrt(R)``, H symmetric and ``H H = R I``).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from .aggregation import aggregate as _aggregate
from .gaussian_noise import philox4x32_10

__all__ = [
    "LEVELS", "FP8_MAX", "STREAM_ROUNDING", "STREAM_SIGNS", "rounding_uniform", "rademacher",
    "num_blocks", "block_scales", "quantize", "dequantize", "pack_int4", "unpack_int4",
    "fp8_encode", "fp8_decode", "topk_k", "topk_encode", "topk_decode", "error_feedback",
    "hadamard_rotate", "hadamard_unrotate", "decode_aggregate",
]

LEVELS = {"int8": 127, "int4": 7}
FP8_MAX = 448.0
# The Philox counter's last word names the stream, so the draws of one key never meet
# the DP noise's (which uses 0) nor each other's.
STREAM_ROUNDING = 0x51
STREAM_SIGNS = 0x52
_MASK32 = 0xFFFFFFFF


def _counter(j: torch.Tensor, word2: int, stream: int):
    j = j.to(torch.int64)
    return j & _MASK32, j >> 32, torch.full_like(j, word2 & _MASK32), torch.full_like(j, stream)


def rounding_uniform(key: int, client: int, j: torch.Tensor) -> torch.Tensor:
    """The uniform of element ``j`` (int64 tensor) of client ``client``'s stochastic
    rounding under ``key``: ``(x0 >> 8) * 2^-24`` in ``[0, 1)``, ``x0`` the first word
    of Philox4x32-10(key, (j mod 2^32, j >> 32, client, STREAM_ROUNDING)); fp32, exact."""
    x0, _, _, _ = philox4x32_10(key, *_counter(j, client, STREAM_ROUNDING))
    return (x0 >> 8).to(torch.float32) * (2.0 ** -24)


def rademacher(key: int, j: torch.Tensor) -> torch.Tensor:
    """Sign ``r_j = 1 - 2 (x0 & 1)`` (fp32) of the rotation under ``key``."""
    x0, _, _, _ = philox4x32_10(key, *_counter(j, 0, STREAM_SIGNS))
    return (1 - 2 * (x0 & 1)).to(torch.float32)


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def _padded_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (fp32, [N]) zero-padded to ``[num_blocks, block]``."""
    nb = num_blocks(x.numel(), block)
    return torch.cat([x, x.new_zeros(nb * block - x.numel())]).view(nb, block)


def block_scales(x: torch.Tensor, block: int, qmax: float) -> torch.Tensor:
    """``s_b = max|x_b| / qmax`` per block (fp32, one rounding)."""
    xb = _padded_blocks(x.reshape(-1).to(torch.float32), block)
    amax = xb.abs().amax(dim=1) if xb.shape[0] else xb.new_zeros(0)
    return amax / torch.tensor(qmax, dtype=torch.float32)


def quantize(x: torch.Tensor, bits: str, block: int, *, stochastic: bool = False, key: int = 0,
             client: int = 0):
    """``(codes, scales)`` of ``x`` (any float dtype, taken as fp32): int8 codes ``[N]``
    for ``bits="int8"``, packed uint8 ``[ceil(N/2)]`` for ``"int4"``; fp32 scales
    ``[ceil(N/B)]``."""
    qmax = LEVELS[bits]
    x = x.reshape(-1).to(torch.float32)
    n = x.numel()
    s = block_scales(x, block, qmax)
    s_elem = s.repeat_interleave(block)[:n]
    safe = torch.where(s_elem == 0, torch.ones_like(s_elem), s_elem)
    t = torch.where(s_elem == 0, torch.zeros_like(x), x / safe)
    if stochastic:
        f = torch.floor(t)
        u = rounding_uniform(key, client, torch.arange(n, dtype=torch.int64))
        q = f + (u < (t - f)).to(torch.float32)
    else:
        q = torch.round(t)  # half to even
    q = torch.where(torch.isnan(q), 0.0, q)  # a NaN value (its scale is NaN: a reply the server refuses) codes 0
    q = q.clamp(-qmax, qmax).to(torch.int8)
    return (q if bits == "int8" else pack_int4(q)), s


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in ``[-8, 7]`` -> uint8 bytes, two nibbles each (low = even element)."""
    q = q.to(torch.int16)
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    nib = q & 0xF
    return (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` signed nibbles of ``packed`` (int8 values)."""
    b = packed.to(torch.int16)
    nib = torch.stack([b & 0xF, (b >> 4) & 0xF], dim=1).reshape(-1)[:n]
    return torch.where(nib >= 8, nib - 16, nib).to(torch.int8)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: str, block: int, n: int) -> torch.Tensor:
    """``x^_j = s_b * q_j`` (fp32)."""
    q = codes if bits == "int8" else unpack_int4(codes, n)
    return scales.to(torch.float32).repeat_interleave(block)[:n] * q.to(torch.float32)


def fp8_encode(x: torch.Tensor, block: int):
    """``(codes float8_e4m3fn [N], scales fp32 [ceil(N/B)])``: per-row scales ``max|x| / 448``."""
    x = x.reshape(-1).to(torch.float32)
    n = x.numel()
    s = block_scales(x, block, FP8_MAX)
    s_elem = s.repeat_interleave(block)[:n]
    safe = torch.where(s_elem == 0, torch.ones_like(s_elem), s_elem)
    t = torch.where(s_elem == 0, torch.zeros_like(x), x / safe).clamp(-FP8_MAX, FP8_MAX)
    return t.to(torch.float8_e4m3fn), s


def fp8_decode(codes: torch.Tensor, scales: torch.Tensor, block: int, n: int) -> torch.Tensor:
    return scales.to(torch.float32).repeat_interleave(block)[:n] * codes.to(torch.float32)


def topk_k(n: int, fraction: float) -> int:
    """How many values top-k keeps of ``n``: ``ceil(fraction n)`` (at least 1 when ``n > 0``)."""
    return min(n, max(1, math.ceil(fraction * n))) if n else 0


def topk_encode(x: torch.Tensor, k: int):
    """``(values fp32 [k], indices int64 [k] ascending)``: the k largest ``|x_j|``, a tie
    to the lower index (a stable descending sort keeps equal keys in index order)."""
    x = x.reshape(-1).to(torch.float32)
    order = torch.sort(x.abs(), descending=True, stable=True).indices[:k]
    idx = torch.sort(order).values
    return x[idx], idx


def topk_decode(values: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float32)
    out[indices.to(torch.int64)] = values.to(torch.float32)
    return out


def error_feedback(encode: Callable, decode: Callable, residual: torch.Tensor, update: torch.Tensor):
    """``a = e + D``; returns ``(code, e_new)`` with ``code = encode(a)`` and
    ``e_new = a - decode(code)`` (fp32)."""
    a = residual.to(torch.float32) + update.reshape(-1).to(torch.float32)
    code = encode(a)
    return code, a - decode(code)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform of each row of ``x`` ``[m, R]`` (Sylvester order)."""
    m, r = x.shape
    h = 1
    while h < r:
        y = x.view(m, r // (2 * h), 2, h)
        x = torch.cat([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], dim=2).view(m, r)
        h *= 2
    return x


def hadamard_rotate(x: torch.Tensor, key: int, block: int) -> torch.Tensor:
    """``y = H_R diag(r) x / sqrt(R)`` per block of ``R = block`` (a power of two), ``x``
    zero-padded to a multiple of R; returns fp32 ``[ceil(N/R) R]``."""
    x = x.reshape(-1).to(torch.float32)
    xb = _padded_blocks(x, block)
    r = rademacher(key, torch.arange(xb.numel(), dtype=torch.int64)).view_as(xb)
    return (_fwht(xb * r) / math.sqrt(block)).reshape(-1)


def hadamard_unrotate(y: torch.Tensor, key: int, block: int, n: int) -> torch.Tensor:
    """``x = diag(r) H_R y / sqrt(R)``, the first ``n`` values (the inverse of :func:`hadamard_rotate`)."""
    yb = y.reshape(-1).to(torch.float32).view(-1, block)
    r = rademacher(key, torch.arange(yb.numel(), dtype=torch.int64)).view_as(yb)
    return (_fwht(yb) / math.sqrt(block) * r).reshape(-1)[:n]


def decode_aggregate(decoded: Sequence[torch.Tensor], weights: torch.Tensor, gamma=1.0):
    """``(out, q, Q)`` of ``gamma * sum_i p_i x^_i`` over the decoded fp32 replies ``x^_i``:
    python_ref/aggregation.py, ``acc + p_i x^_i`` client after client (``q_i = ||x^_i||^2``)."""
    return _aggregate(list(decoded), weights, gamma)
