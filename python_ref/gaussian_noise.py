"""The counter-based Gaussian noise of differentially private aggregation -- the oracle.

Every backend draws element ``j`` of a noise vector from ``(key, j)`` alone, inside its
aggregation kernel; this module is the definition they are tested against, BIT FOR BIT
(fp32, every backend, every CPU ISA).  It is built only from operations that IEEE 754
rounds exactly the same everywhere -- integer arithmetic, fp32 ``+ - * /`` and ``sqrt``
each rounded once (no fused multiply-add), exact bit manipulation -- so no backend's
``log``/``cos`` (which differ by an ulp between libm, SLEEF, CUDA and Triton) enters.

``normal(key, j)``, for a 64-bit ``key`` and an element index ``0 <= j < 2^63``:

1. **Philox4x32-10** (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
   SC 2011; the generator of cuRAND, of torch on CUDA and of ``tl.randn``): key
   ``(k0, k1) = (key mod 2^32, key >> 32)``, counter ``(j mod 2^32, j >> 32, 0, 0)``,
   ten rounds; the first two output words ``x0, x1`` are used.
2. **Uniforms** in the open interval: ``u = ((x >> 8) | 1) * 2^-24`` for ``x0`` and
   ``x1``: a multiple of ``2^-24``, odd, so exactly representable, never 0 or 1, and
   symmetric about 1/2.
3. **Box-Muller**: ``n = sqrt(-2 ln u_a) * cos(2 pi u_b)``, with ``ln`` and ``cos``
   written here as polynomials evaluated in fp32 in a fixed order (below).  The largest
   value is ``sqrt(-2 ln 2^-24) = 5.77``: the tails beyond 5.77 sigma (probability
   ``8e-9`` per element) are cut, as any 24-bit Box-Muller cuts them.

``ln u``: ``u = 2^e m`` with ``m`` in ``[sqrt(2)/2, sqrt(2))`` (exact, from the bits),
``s = (m - 1) / (m + 1)``, ``ln m = 2s + s z (2/3 + z (2/5 + z (2/7 + z (2/9 + z 2/11))))``
with ``z = s^2`` (``|s| <= 0.1716``: the next term is below 1e-10 relative), and
``ln u = e ln2_hi + (e ln2_lo + ln m)`` (``ln2_hi`` has 15 significant bits, so
``e ln2_hi`` is exact).  Measured against float64 ``log``: within 2 ulp.

``cos(2 pi v)``: with ``a = |v - 1/2|`` (exact) ``cos(2 pi v) = -cos(2 pi a)``;
``b = min(a, 1/2 - a)`` (exact, ``cos(2 pi a) = -cos(2 pi b)`` when ``a > 1/4``), then
``cos(2 pi b)`` is ``cos(x)`` of ``x = 2 pi b`` for ``b <= 1/8`` and ``sin(x)`` of ``x =
2 pi (1/4 - b)`` otherwise, both on ``[0, pi/4]`` by their Taylor polynomials to ``x^8``
and ``x^9`` (remainders below 3e-8).

Every constant is an fp32 value given exactly (``float.fromhex``), so a kernel that
writes it as a literal gets the same bits.
"""

from __future__ import annotations

import torch

__all__ = ["philox4x32_10", "uniform_open", "normal", "noise", "C"]

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF


def _f32(hexstr: str) -> float:
    """An fp32 constant, given exactly: the check that it IS an fp32 value."""
    v = float.fromhex(hexstr)
    assert torch.tensor(v, dtype=torch.float32).item() == v, hexstr
    return v


class C:
    """The fp32 constants of :func:`normal`, exactly (kernels write these hex literals)."""

    TWO_M24 = _f32("0x1p-24")
    SQRT1_2 = _f32("0x1.6a09e6p-1")  # 0.70710677 (m above 2 * this is halved: m < sqrt 2)
    LN2_HI = _f32("0x1.62e4p-1")  # 0.693145751953125: 15 significant bits, e * LN2_HI exact
    LN2_LO = _f32("0x1.7f7d1cp-20")  # ln 2 - LN2_HI, rounded to fp32
    # ln m = 2s + s z (L3 + z (L5 + z (L7 + z (L9 + z L11)))): 2/3, 2/5, 2/7, 2/9, 2/11
    L3 = _f32("0x1.555556p-1")
    L5 = _f32("0x1.99999ap-2")
    L7 = _f32("0x1.24924ap-2")
    L9 = _f32("0x1.c71c72p-3")
    L11 = _f32("0x1.745d18p-3")
    TWO_PI = _f32("0x1.921fb6p+2")
    # cos x = 1 + z (C2 + z (C4 + z (C6 + z C8))): -1/2, 1/24, -1/720, 1/40320
    C2 = _f32("-0x1p-1")
    C4 = _f32("0x1.555556p-5")
    C6 = _f32("-0x1.6c16c2p-10")
    C8 = _f32("0x1.a01a02p-16")
    # sin x = x + x z (S3 + z (S5 + z (S7 + z S9))): -1/6, 1/120, -1/5040, 1/362880
    S3 = _f32("-0x1.555556p-3")
    S5 = _f32("0x1.111112p-7")
    S7 = _f32("-0x1.a01a02p-13")
    S9 = _f32("0x1.71de3ap-19")


def _mulhilo(a: torch.Tensor, m: int):
    """``(hi, lo)`` 32-bit halves of ``a * m`` (``a``: int64 holding uint32 values; ``m`` a
    uint32 constant), in int64 arithmetic that never overflows: ``m`` in 16-bit limbs."""
    mh, ml = m >> 16, m & 0xFFFF
    p_lo = a * ml  # < 2^48
    t = a * mh + (p_lo >> 16)  # a * m = t * 2^16 + (p_lo mod 2^16); t < 2^49
    return t >> 16, ((t & 0xFFFF) << 16) | (p_lo & 0xFFFF)


def philox4x32_10(key: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor):
    """Philox4x32 with 10 rounds on int64 tensors holding uint32 words; ``key`` a
    Python int in ``[0, 2^64)``.  Returns the four output words (int64, uint32 values)."""
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def _rn(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to fp32.  Each fp32 operation below is done in float64 and
    rounded once: for ``+ - * /`` and ``sqrt`` of fp32 operands that IS the correctly
    rounded fp32 result (float64 has more than 2 * 24 + 2 bits), whatever kernel torch
    picks for fp32 (its vectorised fp32 ``sqrt`` on the CPU is off by an ulp at times)."""
    return x.to(torch.float32)


def _add(a, b):
    return _rn(torch.as_tensor(a, dtype=torch.float64) + torch.as_tensor(b, dtype=torch.float64))


def _sub(a, b):
    return _rn(torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64))


def _mul(a, b):
    return _rn(torch.as_tensor(a, dtype=torch.float64) * torch.as_tensor(b, dtype=torch.float64))


def _div(a, b):
    return _rn(torch.as_tensor(a, dtype=torch.float64) / torch.as_tensor(b, dtype=torch.float64))


def uniform_open(x: torch.Tensor) -> torch.Tensor:
    """``((x >> 8) | 1) * 2^-24`` in fp32: exact, in ``(0, 1)``."""
    return _mul(((x >> 8) | 1).to(torch.float32), C.TWO_M24)


def _log(u: torch.Tensor) -> torch.Tensor:
    """``ln u`` for fp32 ``u`` in ``(0, 1)`` (normal numbers), by the module's polynomial."""
    bits = u.view(torch.int32)
    e = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)  # [1, 2)
    big = m > 2 * C.SQRT1_2  # m >= sqrt 2: halve it (exact), e + 1
    m = torch.where(big, _mul(m, 0.5), m)
    e = torch.where(big, e + 1, e).to(torch.float32)
    s = _div(_sub(m, 1.0), _add(m, 1.0))
    z = _mul(s, s)
    p = _add(C.L9, _mul(z, C.L11))
    p = _add(C.L7, _mul(z, p))
    p = _add(C.L5, _mul(z, p))
    p = _add(C.L3, _mul(z, p))
    ln_m = _add(_add(s, s), _mul(_mul(s, z), p))
    return _add(_mul(e, C.LN2_HI), _add(_mul(e, C.LN2_LO), ln_m))


def _cos_2pi(v: torch.Tensor) -> torch.Tensor:
    """``cos(2 pi v)`` for fp32 ``v`` in ``(0, 1)``, a multiple of ``2^-24``."""
    a = _sub(v, 0.5).abs()  # exact; cos(2 pi v) = -cos(2 pi a)
    far = a > 0.25
    b = torch.where(far, _sub(0.5, a), a)  # exact; cos(2 pi a) = -cos(2 pi b) when far
    use_sin = b > 0.125
    x = _mul(torch.where(use_sin, _sub(0.25, b), b), C.TWO_PI)  # [0, pi/4]
    z = _mul(x, x)
    c = _add(C.C6, _mul(z, C.C8))
    c = _add(C.C4, _mul(z, c))
    c = _add(C.C2, _mul(z, c))
    c = _add(1.0, _mul(z, c))
    s = _add(C.S7, _mul(z, C.S9))
    s = _add(C.S5, _mul(z, s))
    s = _add(C.S3, _mul(z, s))
    s = _add(x, _mul(_mul(x, z), s))
    r = torch.where(use_sin, s, c)  # cos(2 pi b)
    return torch.where(far, r, -r)  # -cos(2 pi a)


def normal(key: int, j: torch.Tensor) -> torch.Tensor:
    """Element ``j`` (an int64 tensor of indices ``>= 0``) of the noise of ``key``: fp32
    standard normals, by the module's definition."""
    if not 0 <= key < 1 << 64:
        raise ValueError(f"key must be in [0, 2^64), got {key}")
    j = j.to(torch.int64)
    zero = torch.zeros_like(j)
    x0, x1, _, _ = philox4x32_10(key, j & _MASK32, j >> 32, zero, zero)
    ua, ub = uniform_open(x0), uniform_open(x1)
    r = _rn(torch.sqrt(_mul(-2.0, _log(ua)).to(torch.float64)))
    return _mul(r, _cos_2pi(ub))


def noise(key: int, n: int, *, start: int = 0, chunk: int = 1 << 20) -> torch.Tensor:
    """Elements ``[start, start + n)`` of the noise of ``key`` (fp32, CPU), in chunks."""
    out = torch.empty(n, dtype=torch.float32)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        out[lo:hi] = normal(key, torch.arange(start + lo, start + hi, dtype=torch.int64))
    return out
