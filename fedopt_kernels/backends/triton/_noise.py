"""The counter-based Gaussian noise of differentially private aggregation, as
``@triton.jit`` helpers: python_ref/gaussian_noise.py step for step (the definition and
the oracle; csrc/include/fedopt/gaussian_noise.h is the same steps in C++), so that the
bits are the same as every other backend's::

    normal(key, j) = sqrt(-2 ln u_a) * cos(2 pi u_b),   u = ((x >> 8) | 1) * 2^-24,
    (x0, x1, _, _) = Philox4x32-10(key = (key lo, key hi), counter = (j lo, j hi, 0, 0)),

with ``ln`` and ``cos`` the fixed fp32 polynomials of python_ref (its class ``C`` holds
the constants; here they are the same hex values).

Why the arithmetic goes through :func:`add_rn` / :func:`sub_rn` / :func:`mul_rn` instead
of ``+ - *``: every fp32 operation of the definition is rounded once, never contracted
with its neighbour into an FMA.  A launch with ``enable_fp_fusion=False`` would give
that for a whole kernel -- but the aggregation kernel that draws this noise in its
epilogue must keep summing the clients exactly as it does without noise (its ``q``,
``Q`` and ``gamma * total`` are the contract's "same bits as without noise", and on a
GPU that sum is compiled with contraction, as it always was).  So the noise rounds each
operation itself: on the GPU an explicitly rounded PTX instruction (``mul.rn.f32``,
``add.rn.f32``), which neither LLVM (inline asm is opaque to it) nor ptxas (the PTX ISA:
"mul/add with an explicit rounding modifier are not fused") contracts; under Triton's
interpreter plain NumPy fp32 operations, which are correctly rounded and never fused.
Division and square root are ``div_rn`` / ``sqrt_rn`` (Triton's ``/`` and ``tl.sqrt``
are approximate on NVIDIA GPUs).  Not libdevice's ``__nv_fmul_rn``: Triton links
libdevice with ``nvvm-reflect-ftz`` set, which would flush a subnormal ``std * n`` or
``gamma * total`` of the epilogue to zero.  (No subnormal arises inside ``normal``
itself: its smallest intermediates are around ``2^-75``.)

Integers: Philox works on ``uint32`` -- ``tl.umulhi`` for the high words, the wrapping
``uint32`` product for the low ones -- with the key split from an int64 kernel argument
and the counter from the int64 element index (``0 <= j < 2^63``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _probe():
    pass


# Whether the kernels of this process run in Triton's interpreter: triton.jit decides
# it when a function is defined (TRITON_INTERPRET), so the decision is read off one.
INTERPRETED = tl.constexpr(not isinstance(_probe, triton.runtime.JITFunction))

# Philox4x32 (Salmon et al., SC 2011): multipliers and Weyl key increments (uint32 literals).
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)

# python_ref/gaussian_noise.py class C, exactly (every one an fp32 value, so Triton's fp32
# literal of it is the same number).
TWO_M24 = tl.constexpr(float.fromhex("0x1p-24"))
SQRT2 = tl.constexpr(float.fromhex("0x1.6a09e6p+0"))  # 2 * C.SQRT1_2
LN2_HI = tl.constexpr(float.fromhex("0x1.62e4p-1"))
LN2_LO = tl.constexpr(float.fromhex("0x1.7f7d1cp-20"))
L3 = tl.constexpr(float.fromhex("0x1.555556p-1"))
L5 = tl.constexpr(float.fromhex("0x1.99999ap-2"))
L7 = tl.constexpr(float.fromhex("0x1.24924ap-2"))
L9 = tl.constexpr(float.fromhex("0x1.c71c72p-3"))
L11 = tl.constexpr(float.fromhex("0x1.745d18p-3"))
TWO_PI = tl.constexpr(float.fromhex("0x1.921fb6p+2"))
C2 = tl.constexpr(float.fromhex("-0x1p-1"))
C4 = tl.constexpr(float.fromhex("0x1.555556p-5"))
C6 = tl.constexpr(float.fromhex("-0x1.6c16c2p-10"))
C8 = tl.constexpr(float.fromhex("0x1.a01a02p-16"))
S3 = tl.constexpr(float.fromhex("-0x1.555556p-3"))
S5 = tl.constexpr(float.fromhex("0x1.111112p-7"))
S7 = tl.constexpr(float.fromhex("-0x1.a01a02p-13"))
S9 = tl.constexpr(float.fromhex("0x1.71de3ap-19"))


# --------------------------------------------------------------------------- rounding

@triton.jit
def _rn_asm(op: tl.constexpr, a, b, DT: tl.constexpr):
    """``a op b`` by one PTX instruction with an explicit round-to-nearest modifier
    (constants are cast to ``DT`` first: an asm operand takes a tensor of its type)."""
    a = tl.cast(a, DT)
    b = tl.cast(b, DT)
    if DT == tl.float64:
        return tl.inline_asm_elementwise(op + ".rn.f64 $0, $1, $2;", "=d,d,d", [a, b], dtype=tl.float64,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(op + ".rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def add_rn(a, b, DT: tl.constexpr):
    """``a + b`` in ``DT`` (fp32 or fp64; the operands are of it), rounded once, never
    contracted into an FMA."""
    if INTERPRETED:
        return a + b
    else:
        return _rn_asm("add", a, b, DT)


@triton.jit
def sub_rn(a, b, DT: tl.constexpr):
    """``a - b`` in ``DT``, rounded once, never contracted."""
    if INTERPRETED:
        return a - b
    else:
        return _rn_asm("sub", a, b, DT)


@triton.jit
def mul_rn(a, b, DT: tl.constexpr):
    """``a * b`` in ``DT``, rounded once, never contracted."""
    if INTERPRETED:
        return a * b
    else:
        return _rn_asm("mul", a, b, DT)


# --------------------------------------------------------------------------- Philox

@triton.jit
def philox_x01(key, c0, c1):
    """The first two words ``(x0, x1)`` (uint32) of Philox4x32-10 of the counters
    ``(c0, c1, 0, 0)`` under the key ``(key lo, key hi)``; ``key`` an int64 scalar in
    ``[0, 2^63)``, ``c0`` / ``c1`` the uint32 low / high words of the element indices (a
    block each, or ``c1`` a scalar shared by the block)."""
    key = key.to(tl.int64)
    k0 = key.to(tl.uint32)  # truncation: the low word
    k1 = (key >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0)
    c3 = tl.zeros_like(c0)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, PHILOX_M0)
        lo0 = c0 * PHILOX_M0  # uint32: wraps, the low word of the product
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = c2 * PHILOX_M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + PHILOX_W0
        k1 = k1 + PHILOX_W1
    return c0, c1


# --------------------------------------------------------------------------- Box-Muller

@triton.jit
def uniform_open(x):
    """``((x >> 8) | 1) * 2^-24`` in fp32 for uint32 ``x``: exact, in ``(0, 1)``.  (Through
    int32: the value is below 2^24.)"""
    f = ((x >> 8) | 1).to(tl.int32).to(tl.float32)
    return mul_rn(f, TWO_M24, tl.float32)


@triton.jit
def log_open(u):
    """``ln u`` for fp32 ``u`` in ``(0, 1)`` (a normal number), by python_ref's polynomial."""
    bits = u.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)  # [1, 2)
    big = m > SQRT2  # halve it (exact), e + 1: m in [sqrt(2)/2, sqrt 2)
    m = tl.where(big, mul_rn(m, 0.5, tl.float32), m)
    ef = tl.where(big, e + 1, e).to(tl.float32)
    s = tl.math.div_rn(sub_rn(m, 1.0, tl.float32), add_rn(m, 1.0, tl.float32))
    z = mul_rn(s, s, tl.float32)
    p = add_rn(L9, mul_rn(z, L11, tl.float32), tl.float32)
    p = add_rn(L7, mul_rn(z, p, tl.float32), tl.float32)
    p = add_rn(L5, mul_rn(z, p, tl.float32), tl.float32)
    p = add_rn(L3, mul_rn(z, p, tl.float32), tl.float32)
    ln_m = add_rn(add_rn(s, s, tl.float32), mul_rn(mul_rn(s, z, tl.float32), p, tl.float32), tl.float32)
    lo = add_rn(mul_rn(ef, LN2_LO, tl.float32), ln_m, tl.float32)
    return add_rn(mul_rn(ef, LN2_HI, tl.float32), lo, tl.float32)


@triton.jit
def cos_2pi(v):
    """``cos(2 pi v)`` for fp32 ``v`` in ``(0, 1)``, a multiple of ``2^-24``, by python_ref's
    reduction to ``[0, pi/4]`` and its Taylor polynomials."""
    a = tl.abs(sub_rn(v, 0.5, tl.float32))  # exact; cos(2 pi v) = -cos(2 pi a)
    far = a > 0.25
    b = tl.where(far, sub_rn(0.5, a, tl.float32), a)  # exact; cos(2 pi a) = -cos(2 pi b) when far
    use_sin = b > 0.125
    x = mul_rn(tl.where(use_sin, sub_rn(0.25, b, tl.float32), b), TWO_PI, tl.float32)  # [0, pi/4]
    z = mul_rn(x, x, tl.float32)
    c = add_rn(C6, mul_rn(z, C8, tl.float32), tl.float32)
    c = add_rn(C4, mul_rn(z, c, tl.float32), tl.float32)
    c = add_rn(C2, mul_rn(z, c, tl.float32), tl.float32)
    c = add_rn(1.0, mul_rn(z, c, tl.float32), tl.float32)
    s = add_rn(S7, mul_rn(z, S9, tl.float32), tl.float32)
    s = add_rn(S5, mul_rn(z, s, tl.float32), tl.float32)
    s = add_rn(S3, mul_rn(z, s, tl.float32), tl.float32)
    s = add_rn(x, mul_rn(mul_rn(x, z, tl.float32), s, tl.float32), tl.float32)
    r = tl.where(use_sin, s, c)  # cos(2 pi b)
    return tl.where(far, r, -r)  # -cos(2 pi a)


@triton.jit
def _box_muller(x0, x1):
    """``sqrt(-2 ln u(x0)) * cos(2 pi u(x1))`` in fp32 (python_ref.gaussian_noise.normal)."""
    r = tl.math.sqrt_rn(mul_rn(-2.0, log_open(uniform_open(x0)), tl.float32))
    return mul_rn(r, cos_2pi(uniform_open(x1)), tl.float32)


@triton.jit
def normal(key, j):
    """Elements ``j`` (an int64 block of indices ``>= 0``) of the standard normal noise
    of ``key`` (an int64 scalar): fp32, python_ref.gaussian_noise.normal's bits."""
    j = j.to(tl.int64)
    x0, x1 = philox_x01(key, j.to(tl.uint32), (j >> 32).to(tl.uint32))
    return _box_muller(x0, x1)


@triton.jit
def normal_block(key, start, BLOCK: tl.constexpr):
    """``normal(key, start + [0, BLOCK))`` for an int64 ``start``, as a ``[BLOCK]`` block.

    Drawn in two halves -- the even and the odd elements, each thread's own -- one
    after the other in a loop, because the aggregation computes this after its client
    loop with the running total still in registers: all of a thread's elements at once
    (ten Philox rounds of four words each) took ptxas to 64 registers with 4-8 bytes of
    spills for 16-bit clients (Triton 3.6 and 3.8 alike, before or after the client
    loop); half at a time fits without.  The halves cost one layout conversion
    through shared memory per block (the split and the join).
    """
    j = start.to(tl.int64) + tl.arange(0, BLOCK).to(tl.int64)
    j_even, j_odd = tl.split(tl.reshape(j, [BLOCK // 2, 2]))
    n_even = tl.zeros([BLOCK // 2], tl.float32)
    n_odd = tl.zeros([BLOCK // 2], tl.float32)
    for h in range(2):  # a loop, not tl.static_range: unrolled, the halves would overlap again
        n = normal(key, tl.where(h == 0, j_even, j_odd))
        n_even = tl.where(h == 0, n, n_even)
        n_odd = tl.where(h == 0, n_odd, n)
    return tl.reshape(tl.join(n_even, n_odd), [BLOCK])


@triton.jit
def add_noise(value, std, key, start, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """``value + std * n_j`` for ``j`` in ``start + [0, BLOCK)``, in ``ACC`` (fp32, or fp64
    with ``n_j`` widened exactly), the product and the sum each rounded once: the
    contract's noise epilogue.  ``value`` a ``[BLOCK]`` block of ``ACC``, ``std`` an
    ``ACC`` scalar."""
    n = normal_block(key, start, BLOCK).to(ACC)
    return add_rn(value, mul_rn(std, n, ACC), ACC)
