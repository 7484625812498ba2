"""Shared ``@triton.jit`` helpers: the FedNAR and server-update math of
csrc/include/fedopt/math.h, plus the pointer-table and fixed-order-reduction idioms
every kernel of this backend uses.

Everything that decides a *value* lives here (same split as math.h: kernels only move
data).  Plain-Python reference of the math (python_ref/fednar.py),
everything in the acc dtype ``ACC`` (fp32; fp64 for fp64 data)::

    norm_term(x, g)   = g + wd * x            if MODE == co   else g
    clip_scale(n)     = 1                      if MODE == none
                        min(1, A / (n + 1e-6)) otherwise  (NaN n -> NaN, as torch.clamp)
    skip(n, fi)       = not isfinite(n) or fi != 0
    direction(x, g)   = s * (g + wd * x)       if MODE == co   else s * g + wd * x
    update(x, g, b):  d = direction(x, g)
                      momentum:     b <- beta * b + d ;  x <- x - lr * b
                      no momentum:  x <- x - lr * d

Differences from math.h, on purpose: the clip scale of a NaN norm is NaN (python_ref
uses ``torch.clamp``, which propagates NaN; math.h's ``s < 1 ? s : 1`` gives 1).  The
step is skipped then, so only the reported ``scale`` statistic differs.

Server update (math.h ``server_update_*``; ``RULE`` is a constexpr, the values of
math.h ``ServerRule``), in ``ACC``, each operation separately rounded, in this order::

    sgd (0):       x <- gamma * (x - lr * D)
    momentum (1):  b <- beta1 * b + D ;  s = beta1 * b + D if nesterov else b
                   x <- x - lr * s
    adaptive:      m <- beta1 * m + (1 - beta1) * D ;  d2 = D * D
                   adagrad (2): v <- v + d2
                   adam (3):    v <- beta2 * v + (1 - beta2) * d2
                   yogi (4):    v <- v - (1 - beta2) * d2 * sign(v - d2)
                   x <- x - lr * (m / (sqrt(v) + tau))

"Separately rounded" needs the launch option ``enable_fp_fusion=False`` on the GPU
(the server kernel passes it): by default LLVM and ptxas contract ``a * b + c`` into
one FMA, which rounds once.  The interpreter (numpy) never contracts.

Divisions and the square root use the IEEE round-to-nearest forms (``div_rn``,
``sqrt_rn``): Triton's ``/`` and ``tl.sqrt`` on fp32 are approximate on NVIDIA GPUs.
The FedNAR kernels run them once per program; the adaptive server rules run one of
each per element (as the C++ kernels, which nvcc compiles with IEEE division and
square root), which the memory-bound kernel hides.
"""

from __future__ import annotations

import triton
import triton.language as tl

MODE_CO = tl.constexpr(0)
MODE_GRAD = tl.constexpr(1)
MODE_NONE = tl.constexpr(2)

# How a hyperparameter reaches a kernel (``*_KIND`` constexprs).
HYPER_FLOAT = tl.constexpr(0)  # a runtime fp64 kernel argument (a new value never recompiles)
HYPER_SCALAR = tl.constexpr(1)  # a 0-d tensor, loaded in the kernel
HYPER_ROW = tl.constexpr(2)  # a [C] tensor (one value per group), loaded in the kernel

# math.h ServerRule (the ``rule`` integer of the server_update_ schema).
SERVER_SGD = tl.constexpr(0)
SERVER_MOMENTUM = tl.constexpr(1)
SERVER_ADAGRAD = tl.constexpr(2)
SERVER_ADAM = tl.constexpr(3)
SERVER_YOGI = tl.constexpr(4)

# Chunk rows (backends/_chunks.py): [ptr0, ptr1, ptr2, ptr3, len, group, flags, 0].
ROW_COLS = tl.constexpr(8)
COL_LEN = tl.constexpr(4)
COL_GROUP = tl.constexpr(5)
COL_FLAGS = tl.constexpr(6)
FLAG_ALIGNED16 = tl.constexpr(1)

CLIP_EPS = tl.constexpr(1e-6)  # as torch.nn.utils.clip_grad_norm_ (math.h kClipEps)
_INF = tl.constexpr(float("inf"))


# --------------------------------------------------------------------------- plumbing

@triton.jit
def scalar_arg(value, ACC: tl.constexpr):
    """A float kernel argument (declared fp64) as an ``ACC`` scalar.

    Rounds fp64 -> fp32 exactly as torch rounds a Python float against an fp32 tensor;
    works for the interpreter too (where ``value`` is a plain Python float).
    """
    return tl.full((), value, ACC)


@triton.jit
def load_hyper(value, ptr, group, KIND: tl.constexpr, ACC: tl.constexpr):
    """Hyperparameter of ``group``: the float ``value``, ``ptr[0]`` or ``ptr[group]``."""
    if KIND == HYPER_FLOAT:
        return scalar_arg(value, ACC)
    elif KIND == HYPER_SCALAR:
        return tl.load(ptr).to(ACC)
    else:
        return tl.load(ptr + group).to(ACC)


@triton.jit
def table_ptr(addr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """An int64 address (from a chunk table, or a base address plus a row offset) as a
    ``DTYPE`` pointer.

    An address carries no alignment information, so without a hint every access through
    it compiles to scalar loads.  With ``ALIGNED`` (the table's flag, or the caller's
    run-time check, says it is 16-byte aligned) the hint lets the compiler emit 16-byte
    vector accesses (``ld.global.v4``).  The pointer must be made here, where the hint
    is attached: ``tl.multiple_of`` annotates the op that defines its argument, so a
    pointer made by the caller and hinted in a callee (a function argument) or outside
    a run-time branch would not be vectorised in that branch alone.
    """
    p = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def block_offsets(start, BLOCK: tl.constexpr):
    """int64 offsets ``start + [0, BLOCK)``; ``start`` is a multiple of BLOCK (hinted, so
    an aligned base keeps every block aligned)."""
    start = tl.multiple_of(start, BLOCK)
    return start + tl.arange(0, BLOCK).to(tl.int64)


@triton.jit
def load_block(ptr, offs, n, ACC: tl.constexpr, MASKED: tl.constexpr):
    """``ptr[offs]`` in ``ACC``; with ``MASKED`` lanes ``>= n`` read as 0.

    Full blocks are loaded without a mask: a mask of unknown constancy forbids vector
    loads, so every kernel splits its range into unmasked full blocks and one masked
    tail.
    """
    if MASKED:
        v = tl.load(ptr + offs, mask=offs < n, other=0.0)
    else:
        v = tl.load(ptr + offs)
    return v.to(ACC)


@triton.jit
def load_f32(ptr, offs, mask, BF16_BITS: tl.constexpr):
    """The values at ``offs`` widened to fp32 (0 where masked).  ``BF16_BITS``: ``ptr``
    holds bf16 values given as their int16 bits, widened by a 16-bit shift -- exact, where
    the interpreter's own bf16 -> fp32 conversion gets subnormals wrong (the wrappers pass
    ``x.view(torch.int16)``; compiled, both give the same bits)."""
    if BF16_BITS:
        return (tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_block(ptr, offs, n, value, MASKED: tl.constexpr):
    """``ptr[offs] = value`` cast to the pointee dtype (round to nearest even)."""
    v = value.to(ptr.dtype.element_ty)
    if MASKED:
        tl.store(ptr + offs, v, mask=offs < n)
    else:
        tl.store(ptr + offs, v)


@triton.jit
def sum_range(ptr, begin, end, ACC: tl.constexpr, PBLOCK: tl.constexpr):
    """``sum(ptr[begin:end])`` in a fixed order that depends only on (begin, end).

    Sequential over PBLOCK-wide slices, lane-wise accumulation, then one tree
    reduction of fixed shape: bitwise reproducible, and the same in every program that
    calls it with the same range (the redundant combine of the update kernels relies on
    that).
    """
    acc = tl.zeros([PBLOCK], ACC)
    for s in range(begin, end, PBLOCK):
        offs = s + tl.arange(0, PBLOCK).to(tl.int64)
        acc += tl.load(ptr + offs, mask=offs < end, other=0.0).to(ACC)
    return tl.sum(acc, axis=0)


@triton.jit
def sqrt_rn(x, ACC: tl.constexpr):
    """Correctly rounded square root (``sqrt_rn`` is fp32-only; fp64 sqrt always is)."""
    if ACC == tl.float32:
        return tl.math.sqrt_rn(x)
    else:
        return tl.sqrt(x)


@triton.jit
def div_rn(a, b, ACC: tl.constexpr):
    """Correctly rounded ``a / b`` (``div_rn`` is fp32-only; fp64 division always is)."""
    if ACC == tl.float32:
        return tl.math.div_rn(a, b)
    else:
        return a / b


# --------------------------------------------------------------------------- math.h

@triton.jit
def nar_norm_term(x, g, wd, MODE: tl.constexpr):
    """math.h ``nar_norm_term``: the vector whose norm is clipped on."""
    if MODE == MODE_CO:
        return g + wd * x
    else:
        return g


@triton.jit
def nar_clip_scale(norm, max_norm, MODE: tl.constexpr, ACC: tl.constexpr):
    """math.h ``nar_clip_scale``: ``min(1, A / (n + eps))``; 1 in mode none."""
    if MODE == MODE_NONE:
        return tl.full((), 1.0, ACC)
    else:
        s = div_rn(max_norm, norm + CLIP_EPS, ACC)
        return tl.where(s > 1.0, tl.full((), 1.0, ACC), s)


@triton.jit
def nar_norm_ok(norm):
    """Negation of math.h ``nar_skip`` without ``found_inf`` (the kernels add that):
    ``norm`` is ``>= 0`` or NaN, so ``norm < inf`` is ``isfinite(norm)``."""
    return norm < _INF


@triton.jit
def nar_direction(x, g, scale, wd, MODE: tl.constexpr):
    """math.h ``nar_direction``: ``s (g + wd x)`` in mode co, ``s g + wd x`` otherwise."""
    if MODE == MODE_CO:
        return scale * (g + wd * x)
    else:
        return scale * g + wd * x


@triton.jit
def nar_unscale(g, inv_grad_scale, HAS_GS: tl.constexpr):
    """math.h ``nar_unscale``: ``g * (1 / grad_scale)`` (exact for GradScaler's powers of two)."""
    if HAS_GS:
        return g * inv_grad_scale
    else:
        return g


@triton.jit
def nar_inv_grad_scale(gs_ptr, HAS_GS: tl.constexpr, ACC: tl.constexpr):
    """``1 / grad_scale`` (NarParams.inv_grad_scale), 1 when there is no grad scale."""
    if HAS_GS:
        return div_rn(tl.full((), 1.0, ACC), tl.load(gs_ptr).to(ACC), ACC)
    else:
        return tl.full((), 1.0, ACC)


@triton.jit
def nar_update_plain(x, g, scale, lr, wd, MODE: tl.constexpr):
    """math.h ``nar_update_plain``: ``x - lr * d``."""
    return x - lr * nar_direction(x, g, scale, wd, MODE)


@triton.jit
def nar_update_momentum(x, g, b, scale, lr, wd, momentum, MODE: tl.constexpr):
    """math.h ``nar_update_momentum``: ``b <- beta b + d ; x <- x - lr b``; returns (x, b)."""
    b = momentum * b + nar_direction(x, g, scale, wd, MODE)
    return x - lr * b, b


@triton.jit
def nar_update(x, g, b, scale, lr, wd, momentum, MODE: tl.constexpr, HAS_MOM: tl.constexpr):
    """math.h ``nar_update`` (momentum decided at compile time): returns ``(x_new, b_new)``,
    ``b`` untouched without momentum."""
    if HAS_MOM:
        x, b = nar_update_momentum(x, g, b, scale, lr, wd, momentum, MODE)
    else:
        x = nar_update_plain(x, g, scale, lr, wd, MODE)
    return x, b


@triton.jit
def server_update_sgd(x, d, lr, gamma):
    """math.h ``server_update_sgd``: ``gamma * (x - lr * D)``."""
    return gamma * (x - lr * d)


@triton.jit
def server_update_momentum(x, d, b, lr, beta1, NESTEROV: tl.constexpr):
    """math.h ``server_update_momentum``: ``b <- beta1 b + D`` then ``x - lr * s`` with
    ``s = beta1 b + D`` (nesterov, on the new ``b``) or ``b``; returns ``(x, b)``."""
    b = beta1 * b + d
    if NESTEROV:
        s = beta1 * b + d
    else:
        s = b
    return x - lr * s, b


@triton.jit
def sign_of(a):
    """math.h ``sign_of`` (as torch.sign): 1, -1, or ``a`` itself for +-0 and NaN."""
    return tl.where(a > 0.0, 1.0, tl.where(a < 0.0, -1.0, a)).to(a.dtype)


@triton.jit
def server_update_adaptive(x, d, m, v, lr, beta1, beta2, tau, RULE: tl.constexpr, ACC: tl.constexpr):
    """math.h ``server_update_adaptive`` (rule decided at compile time); returns
    ``(x, m, v)``.  ``1 - beta1`` / ``1 - beta2`` are scalar expressions, so they are
    computed once (the same value math.h computes per element)."""
    m = beta1 * m + (1.0 - beta1) * d
    d2 = d * d
    if RULE == SERVER_ADAGRAD:
        v = v + d2
    elif RULE == SERVER_ADAM:
        v = beta2 * v + (1.0 - beta2) * d2
    else:
        v = v - (1.0 - beta2) * d2 * sign_of(v - d2)
    root = sqrt_rn(v, ACC)
    x = x - lr * div_rn(m, root + tau, ACC)
    return x, m, v
