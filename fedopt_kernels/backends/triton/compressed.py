"""Triton kernels of the compressed decode-aggregate (oracle: python_ref/compression.py).

``block_decode_aggregate_kernel``: program ``p`` owns columns ``[p BLOCK, (p + 1) BLOCK)``
and loops over the clients in order; it reads each client's codes and block scales in
place, decodes ``v = s_b * q`` in registers (no dense copy of a reply) and adds
``where(w != 0, v, 0) * w`` to the column total -- python_ref's operations in its order,
launched without FP contraction (backends/compressed.py), so ``out`` has the bits of the
reference, CPU and CUDA kernels.  Per-client
``sum v^2`` and ``sum total^2`` go to one partial per (client, program), summed in a
fixed order by ``row_sum_kernel`` (aggregate.py): deterministic, no float atomics.

Codes: ``[C, L]`` (int8 codes; int4 nibble pairs as int8 bytes, low nibble first; fp8
e4m3fn as uint8 bits, decoded here by integer arithmetic -- exact, the same values as
torch's conversion, and independent of the GPU's fp8 support).

Top-k: ``topk_scatter_kernel`` adds one client's ``w * value`` at its (strictly
increasing, so distinct) indices into an fp32 accumulator, one launch per client in
client order (no two programs of a launch touch one column: no atomics); then
``topk_finish_kernel`` writes ``out = gamma * acc`` and the partials of ``||acc||^2``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _helpers as H


@triton.jit
def fp8_e4m3fn_to_f32(b):
    """fp8 e4m3fn bits (int32 in [0, 256)) -> fp32, exactly: normal numbers by their bits,
    subnormals as ``m 2^-9`` (an exact product), 0x7f / 0xff NaN."""
    sign = (b >> 7) & 1
    e = (b >> 3) & 0xF
    m = b & 7
    normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.int32, bitcast=True).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # 2^-9
    sub = tl.where(sign == 1, -sub, sub)
    v = tl.where(e == 0, sub, normal)
    return tl.where((e == 15) & (m == 7), float("nan"), v)


@triton.jit
def _decode(codes_ptr, scales_ptr, i, offs, mask, L, NB, block, KIND: tl.constexpr):
    """Client ``i``'s decoded values ``s_b * q`` at columns ``offs`` (fp32, 0 where masked)."""
    row = codes_ptr + i * L
    if KIND == 1:
        byte = tl.load(row + offs // 2, mask=mask, other=0).to(tl.int32)  # int8 -> sign-extended
        q = tl.where(offs % 2 == 0, (byte << 28) >> 28, byte >> 4).to(tl.float32)
    elif KIND == 2:
        q = fp8_e4m3fn_to_f32(tl.load(row + offs, mask=mask, other=0).to(tl.int32))
    else:
        q = tl.load(row + offs, mask=mask, other=0).to(tl.float32)
    s = tl.load(scales_ptr + i * NB + offs // block, mask=mask, other=0.0)
    return tl.where(mask, s * q, 0.0)


@triton.jit(do_not_specialize=["gamma_value", "C", "N", "L", "NB", "block", "nblk"])
def block_decode_aggregate_kernel(codes_ptr, scales_ptr, w_ptr, out_ptr, part_ptr, skip_ptr, gamma_ptr,
                                  gamma_value: tl.float64, C: tl.int64, N: tl.int64, L: tl.int64, NB: tl.int64,
                                  block: tl.int64, nblk: tl.int64, KIND: tl.constexpr, HAS_SKIP: tl.constexpr,
                                  GAMMA_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """For the columns ``J`` of program ``p``, in fp32::

        v_i[J]     = scales[i, J // block] * q_i[J]
        total_J    = sum_i (w_i * v_i[J] if w_i != 0 else 0)     (i = 0, 1, ... in order)
        out[J]     = gamma * total_J
        part[i, p] = sum_J v_i[J]^2,   part[C, p] = sum_J total_J^2

    With ``skip`` true nothing is read or written.  Grid: ``nblk``.
    """
    run = True
    if HAS_SKIP:
        run = tl.load(skip_ptr) == 0
    if run:
        pid = tl.program_id(0).to(tl.int64)
        gamma = H.load_hyper(gamma_value, gamma_ptr, 0, GAMMA_KIND, tl.float32)
        offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < N
        total = tl.zeros([BLOCK], tl.float32)
        for c in range(C):
            i = tl.cast(c, tl.int64)
            v = _decode(codes_ptr, scales_ptr, i, offs, mask, L, NB, block, KIND)
            w = tl.load(w_ptr + i).to(tl.float32)
            tl.store(part_ptr + i * nblk + pid, tl.sum(v * v, axis=0))
            total = total + tl.where(w != 0.0, v, 0.0) * w
        tl.store(part_ptr + tl.cast(C, tl.int64) * nblk + pid, tl.sum(total * total, axis=0))
        tl.store(out_ptr + offs, gamma * total, mask=mask)


@triton.jit(do_not_specialize=["k", "i", "nkblk", "N"])
def topk_scatter_kernel(values_ptr, indices_ptr, w_ptr, acc_ptr, part_ptr, i: tl.int64, k: tl.int64,
                        nkblk: tl.int64, N: tl.int64, BLOCK: tl.constexpr):
    """``acc[idx[t]] = acc[idx[t]] + w_i * val[t]`` (where ``w_i != 0``) for the ``t`` of
    program ``p``; ``part[i, p] = sum_t val[t]^2``.  Grid: ``ceil(k / BLOCK)``."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = t < k
    val = tl.load(values_ptr + t, mask=mask, other=0.0)
    idx = tl.load(indices_ptr + t, mask=mask, other=0)
    w = tl.load(w_ptr + i).to(tl.float32)
    tl.store(part_ptr + i * nkblk + pid, tl.sum(val * val, axis=0))
    if w != 0.0:
        # an index outside [0, N) is never written (memory safety without a host check;
        # the ops layer refuses such a reply, with its reason, before the launch)
        inside = mask & (idx >= 0) & (idx < N)
        a = tl.load(acc_ptr + idx, mask=inside, other=0.0)
        tl.store(acc_ptr + idx, a + val * w, mask=inside)


@triton.jit(do_not_specialize=["gamma_value", "N"])
def topk_finish_kernel(acc_ptr, out_ptr, part_ptr, skip_ptr, gamma_ptr, gamma_value: tl.float64, N: tl.int64,
                       HAS_SKIP: tl.constexpr, GAMMA_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """``out[J] = gamma * acc[J]``, ``part[p] = sum_J acc[J]^2``; nothing written when skipped."""
    run = True
    if HAS_SKIP:
        run = tl.load(skip_ptr) == 0
    if run:
        pid = tl.program_id(0).to(tl.int64)
        gamma = H.load_hyper(gamma_value, gamma_ptr, 0, GAMMA_KIND, tl.float32)
        offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < N
        a = tl.load(acc_ptr + offs, mask=mask, other=0.0)
        tl.store(part_ptr + pid, tl.sum(a * a, axis=0))
        tl.store(out_ptr + offs, gamma * a, mask=mask)


# --------------------------------------------------------------------------------------
# The client's fused encode: block quantization to int8 / int4 (python_ref.compression.quantize)

@triton.jit
def philox_x0(key, c0, c1, c2, c3):
    """``x0`` (uint32) of Philox4x32-10 of the counters ``(c0, c1, c2, c3)`` (uint32 blocks)
    under ``(key lo, key hi)``: python_ref's ``philox4x32_10`` step for step (``_noise.py``
    has the ``(j, 0, 0)`` form of the DP noise)."""
    key = key.to(tl.int64)
    k0 = key.to(tl.uint32)
    k1 = (key >> 32).to(tl.uint32)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0


@triton.jit
def _round_code(x, s, j, key, client, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The code (fp32 integer value) of ``x`` under scale ``s`` at element ``j`` (int64)."""
    t = tl.where(s == 0.0, 0.0, tl.math.div_rn(x, s))
    f = tl.floor(t)
    if STOCHASTIC:
        c0 = (j & 0xFFFFFFFF).to(tl.uint32)
        c1 = (j >> 32).to(tl.uint32)
        c2 = tl.zeros_like(c0) + client.to(tl.uint32)
        c3 = tl.zeros_like(c0) + 0x51  # python_ref's STREAM_ROUNDING
        u = (philox_x0(key, c0, c1, c2, c3) >> 8).to(tl.int32).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
        q = f + tl.where(u < t - f, 1.0, 0.0)
    else:  # round half to even, exactly: d = t - f is exact for |t| < 2^23
        d = t - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
        q = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(odd, f + 1.0, f)))
    q = tl.where(q != q, 0.0, q)  # NaN (a NaN value or scale: a reply the server refuses) codes 0
    return tl.minimum(tl.maximum(q, -QMAX), QMAX)


@triton.jit(do_not_specialize=["N", "block", "key", "client"])
def block_quantize_kernel(x_ptr, codes_ptr, scales_ptr, N: tl.int64, block: tl.int64, key: tl.int64,
                          client: tl.int64, QMAX: tl.constexpr, INT4: tl.constexpr, STOCHASTIC: tl.constexpr,
                          HALF: tl.constexpr, BF16_BITS: tl.constexpr):
    """Block ``b`` (one program): ``s_b = max|x_b| / QMAX`` (NaN if the block holds one),
    codes of its even and odd elements (``HALF`` = half the block, a power of two);
    int8 stored as they are, int4 as one byte per pair (low nibble the even element).
    ``BF16_BITS``: ``x`` is bf16 given as its int16 bits (``H.load_f32``)."""
    b = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, HALF).to(tl.int64)
    je = b * block + 2 * p
    jo = je + 1
    me = (2 * p < block) & (je < N)
    mo = (2 * p + 1 < block) & (jo < N)
    xe = H.load_f32(x_ptr, je, me, BF16_BITS)
    xo = H.load_f32(x_ptr, jo, mo, BF16_BITS)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=0), tl.max(tl.abs(xo), axis=0))
    has_nan = tl.max(tl.where((xe != xe) | (xo != xo), 1, 0), axis=0) > 0
    amax = tl.where(has_nan, float("nan"), amax)
    s = tl.math.div_rn(amax, QMAX)
    tl.store(scales_ptr + b, s)
    qe = _round_code(xe, s, je, key, client, QMAX, STOCHASTIC).to(tl.int32)
    qo = _round_code(xo, s, jo, key, client, QMAX, STOCHASTIC).to(tl.int32)
    if INT4:
        byte = (qe & 0xF) | ((qo & 0xF) << 4)
        tl.store(codes_ptr + b * (block // 2) + p, byte.to(tl.uint8), mask=me)
    else:
        tl.store(codes_ptr + je, qe.to(tl.int8), mask=me)
        tl.store(codes_ptr + jo, qo.to(tl.int8), mask=mo)


@triton.jit
def f32_to_fp8_e4m3fn(t):
    """fp32 -> fp8 e4m3fn bits (int32 in [0, 256)): c10's conversion (the one torch's
    ``.to(float8_e4m3fn)`` runs; csrc/include/fedopt/fp8_e4m3.h) step for step: NaN (and
    ``|t| >= 480``) 0x7f; below 2^-6 the bits of ``|t| + 2^14`` less those of 2^14 (the
    fp32 addition rounds to a multiple of 2^-9, half to even); else the exponent rebiased
    and the mantissa rounded to 3 bits half to even by integer adds; the sign bit last."""
    u = t.to(tl.int32, bitcast=True)
    sign = u & -2147483648  # 0x80000000
    u = u ^ sign  # |t|: non-negative as an int32
    sub = (u.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    nrm = (u + (-120 << 23) + 0x7FFFF + ((u >> 20) & 1)) >> 20
    r = tl.where(u >= (1087 << 20), 0x7F, tl.where(u < (121 << 23), sub, nrm))
    return (r & 0xFF) | ((sign >> 24) & 0x80)


@triton.jit(do_not_specialize=["N", "block"])
def fp8_encode_kernel(x_ptr, codes_ptr, scales_ptr, N: tl.int64, block: tl.int64, BLOCK: tl.constexpr,
                      BF16_BITS: tl.constexpr):
    """Block ``b`` (one program; ``BLOCK`` the next power of two >= ``block``):
    ``s_b = max|x_b| / 448`` (NaN if the block holds one), ``t = x / s_b`` (+0 where
    ``s_b == 0``), clamped to +-448 keeping a NaN, stored as e4m3fn bits: python_ref's
    fp8_encode, one rounding per step (``div_rn``).  ``BF16_BITS``: ``x`` is bf16 given
    as its int16 bits (``H.load_f32``)."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK).to(tl.int64)
    j = b * block + i
    m = (i < block) & (j < N)
    x = H.load_f32(x_ptr, j, m, BF16_BITS)
    a = (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)  # torch.abs clears the sign
    has_nan = tl.max(tl.where(a != a, 1, 0), axis=0) > 0
    amax = tl.where(has_nan, float("nan"), tl.max(a, axis=0))
    s = tl.math.div_rn(amax, 448.0)
    t = tl.where(s == 0.0, 0.0, tl.math.div_rn(x, tl.where(s == 0.0, 1.0, s)))
    t = tl.where(t > 448.0, 448.0, tl.where(t < -448.0, -448.0, t))  # a NaN passes through
    tl.store(scales_ptr + b, s)
    tl.store(codes_ptr + j, f32_to_fp8_e4m3fn(t).to(tl.uint8), mask=m)
