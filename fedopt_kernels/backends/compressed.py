"""The compressed decode-aggregate's two backend ops, on every backend.

``block_decode_aggregate(codes, scales, kind, block, numel, weights, gamma, gamma_tensor, out, skip)
-> (client_sq_norms, sq_norm)``
    ``out = gamma * sum_i weights[i] * x^_i`` with ``x^_i[j] = scales[i][j // block] *
    q_i[j]`` read in place from the codes (schema and semantics: csrc/registration.cpp;
    oracle: python_ref/compression.py).  ``codes`` / ``scales`` a list of ``C`` 1-D
    tensors (or one 2-D tensor each); ``kind`` 0 int8 (int8 codes ``[N]``), 1 int4 (uint8
    ``[ceil(N/2)]``), 2 fp8 e4m3fn (uint8 bits ``[N]``); scales float32.  ``weights``
    ``[C]``, ``out`` ``[N]`` and the statistics float32 on the data's device; ``skip`` as
    ``aggregate``'s.  ``out`` is bit for bit ``aggregate`` over the decoded rows.

``topk_decode_aggregate(values, indices, numel, weights, gamma, gamma_tensor, out, skip)
-> (client_sq_norms, sq_norm)``
    The same for top-k replies: ``values[i]`` float32 ``[k_i]`` at ``indices[i]`` int64
    ``[k_i]`` (strictly increasing in ``[0, numel)``).

``block_quantize``: the client's fused block encode (int8, int4, fp8).  ``topk_encode``:
fused on the CPU; python_ref's torch formulation on the update's device for triton and
cuda (docs/compression.md).

As :mod:`.robust`, the table here is looked up after
:func:`fedopt_kernels.backends.resolve` has checked (and loaded) the backend.
"""

from __future__ import annotations

from typing import Callable

import torch

from .hyper import join
from .oracle import compression as _ref

KINDS = {"int8": 0, "int4": 1, "fp8": 2}


def _rows(t):
    return list(t.unbind(0)) if isinstance(t, torch.Tensor) else list(t)


def _stacked(t):
    return t if isinstance(t, torch.Tensor) else torch.stack(list(t))


def _finish_reference(rows, weights, gamma, gamma_tensor, out, skip):
    """python_ref's aggregation over decoded fp32 rows (the reference backend's aggregate)."""
    from . import reference

    if not rows:
        raise ValueError("decode-aggregate needs at least one client")
    return reference.aggregate(rows, weights, gamma, gamma_tensor, out, skip)


def _reference_block(codes, scales, kind, block, numel, weights, gamma, gamma_tensor, out, skip):
    rows = []
    for c, s in zip(_rows(codes), _rows(scales)):
        if kind == 2:
            rows.append(_ref.fp8_decode(c.view(torch.float8_e4m3fn), s, block, numel))
        else:
            rows.append(_ref.dequantize(c, s, "int8" if kind == 0 else "int4", block, numel))
    return _finish_reference(rows, weights, gamma, gamma_tensor, out, skip)


def _reference_topk(values, indices, numel, weights, gamma, gamma_tensor, out, skip):
    rows = [_ref.topk_decode(v.cpu(), i.cpu(), numel).to(v.device) for v, i in zip(_rows(values), _rows(indices))]
    return _finish_reference(rows, weights, gamma, gamma_tensor, out, skip)


def _cpp_block(codes, scales, kind, block, numel, weights, gamma, gamma_tensor, out, skip):
    return torch.ops.fedopt_C.block_decode_aggregate(_rows(codes), _rows(scales), int(kind), int(block), int(numel),
                                                     weights, float(gamma), gamma_tensor, out, skip)


def _cpp_topk(values, indices, numel, weights, gamma, gamma_tensor, out, skip):
    return torch.ops.fedopt_C.topk_decode_aggregate(_rows(values), _rows(indices), int(numel), weights,
                                                    float(gamma), gamma_tensor, out, skip)


TRITON_BLOCK = 1024  # columns per program: 8 per thread at 4 warps, from nothing but this constant
# The kernels launch with enable_fp_fusion=False: ``total + v * w`` stays two roundings
# (Triton would contract it into an FMA), so out has python_ref's bits -- the CPU and CUDA
# kernels' -- on a GPU too.  Memory-bound: the FMA would buy no time.


def _triton_gamma(gamma, gamma_tensor):
    from .triton import _hyper

    return _hyper(gamma, gamma_tensor, per_row=False)


def _triton_block(codes, scales, kind, block, numel, weights, gamma, gamma_tensor, out, skip):
    from .triton import PBLOCK, SMALL_NUM_WARPS, _on
    from .triton.aggregate import row_sum_kernel
    from .triton.compressed import block_decode_aggregate_kernel
    import triton.language as tl

    X = _stacked(codes)  # a copy of the CODES when given as a list (1/4 or 1/8 of fp32's bytes), never decoded
    if kind == 1:
        X = X.view(torch.int8)  # nibbles are sign-extended from the byte
    S = _stacked(scales).contiguous()
    C, L = X.shape
    N = int(numel)
    nblk = -(-N // TRITON_BLOCK)
    device = out.device
    q = torch.empty(C, dtype=torch.float32, device=device)
    total = torch.empty((), dtype=torch.float32, device=device)
    part = torch.zeros((C + 1) * max(nblk, 1), dtype=torch.float32, device=device)
    g_kind, g_f, g_t = _triton_gamma(gamma, gamma_tensor)
    has_skip = skip is not None
    with _on(device):
        if nblk > 0:
            block_decode_aggregate_kernel[(nblk,)](
                X.contiguous(), S, weights.contiguous(), out, part, skip if has_skip else part,
                g_t if g_t is not None else part, g_f, C, N, L, S.shape[1], int(block), nblk,
                KIND=int(kind), HAS_SKIP=has_skip, GAMMA_KIND=g_kind, BLOCK=TRITON_BLOCK, num_warps=4,
                enable_fp_fusion=False)
        row_sum_kernel[(C + 1,)](part, q, total, skip if has_skip else part, max(nblk, 1), C, ACC=tl.float32,
                                 HAS_SKIP=has_skip, PBLOCK=PBLOCK, num_warps=SMALL_NUM_WARPS)
    return q, total


def _triton_topk(values, indices, numel, weights, gamma, gamma_tensor, out, skip):
    from .triton import PBLOCK, SMALL_NUM_WARPS, _on
    from .triton.aggregate import row_sum_kernel
    from .triton.compressed import topk_finish_kernel, topk_scatter_kernel
    import triton.language as tl

    vals, idxs = _rows(values), _rows(indices)
    C, N = len(vals), int(numel)
    device = out.device
    nkblk = max([-(-v.numel() // TRITON_BLOCK) for v in vals] + [-(-N // TRITON_BLOCK), 1])
    part = torch.zeros((C + 1) * nkblk, dtype=torch.float32, device=device)
    acc = torch.zeros(N, dtype=torch.float32, device=device)
    q = torch.empty(C, dtype=torch.float32, device=device)
    total = torch.empty((), dtype=torch.float32, device=device)
    g_kind, g_f, g_t = _triton_gamma(gamma, gamma_tensor)
    has_skip = skip is not None
    w = weights.contiguous()
    with _on(device):
        for i, (v, ix) in enumerate(zip(vals, idxs)):  # client order: the sum's order
            if v.numel():
                topk_scatter_kernel[(-(-v.numel() // TRITON_BLOCK),)](
                    v.contiguous(), ix.contiguous(), w, acc, part, i, v.numel(), nkblk, N, BLOCK=TRITON_BLOCK,
                    num_warps=4, enable_fp_fusion=False)
        if N:
            topk_finish_kernel[(-(-N // TRITON_BLOCK),)](
                acc, out, part[C * nkblk:], skip if has_skip else part, g_t if g_t is not None else part, g_f, N,
                HAS_SKIP=has_skip, GAMMA_KIND=g_kind, BLOCK=TRITON_BLOCK, num_warps=4, enable_fp_fusion=False)
        row_sum_kernel[(C + 1,)](part, q, total, skip if has_skip else part, nkblk, C, ACC=tl.float32,
                                 HAS_SKIP=has_skip, PBLOCK=PBLOCK, num_warps=SMALL_NUM_WARPS)
    return q, total


def _reference_quantize(x, kind, block, stochastic, key, client):
    if kind == 2:
        codes, scales = _ref.fp8_encode(x, block)
        return codes.view(torch.uint8), scales
    codes, scales = _ref.quantize(x.cpu(), "int8" if kind == 0 else "int4", block, stochastic=stochastic, key=key,
                                  client=client)
    return codes.to(x.device), scales.to(x.device)


def _reference_quantize_into(x, kind, block, stochastic, key, client, codes, scales):
    got_codes, got_scales = _reference_quantize(x, kind, block, stochastic, key, client)
    codes.copy_(got_codes)
    scales.copy_(got_scales)


def _cpp_quantize(x, kind, block, stochastic, key, client):
    return torch.ops.fedopt_C.block_quantize(x, int(kind), int(block), bool(stochastic), int(key), int(client))


def _cpp_quantize_into(x, kind, block, stochastic, key, client, codes, scales):
    torch.ops.fedopt_C.block_quantize_into(x, int(kind), int(block), bool(stochastic), int(key), int(client), codes,
                                           scales)


_BLOCK = {"reference": _reference_block, "cpu": _cpp_block, "cuda": _cpp_block, "triton": _triton_block}
_TOPK = {"reference": _reference_topk, "cpu": _cpp_topk, "cuda": _cpp_topk, "triton": _triton_topk}


def _triton_encode_input(x):
    """``(tensor, BF16_BITS)`` for a Triton encode kernel: ``x`` contiguous, bf16 as its
    int16 bits (the kernels widen them by a shift: ``triton._helpers.load_f32``)."""
    bf16 = x.dtype == torch.bfloat16
    return (x.contiguous().view(torch.int16) if bf16 else x.contiguous()), bf16


def _triton_quantize(x, kind, block, stochastic, key, client):
    N = x.numel()
    codes = torch.empty((N + 1) // 2 if kind == 1 else N, dtype=torch.int8 if kind == 0 else torch.uint8,
                        device=x.device)
    scales = torch.empty(-(-N // block), dtype=torch.float32, device=x.device)
    _triton_quantize_into(x, kind, block, stochastic, key, client, codes, scales)
    return codes, scales


def _triton_quantize_into(x, kind, block, stochastic, key, client, codes, scales):
    import triton

    from .triton import _on
    from .triton.compressed import block_quantize_kernel

    N = x.numel()
    nb = -(-N // block)
    if nb and kind == 2:
        from .triton.compressed import fp8_encode_kernel

        xs, bf16 = _triton_encode_input(x)
        with _on(x.device):
            fp8_encode_kernel[(nb,)](xs, codes, scales, N, int(block), BLOCK=triton.next_power_of_2(block),
                                     BF16_BITS=bf16, num_warps=4)
    elif nb:
        half = 1 << max(0, (block // 2 - 1).bit_length())  # the next power of two >= block / 2
        xs, bf16 = _triton_encode_input(x)
        with _on(x.device):
            block_quantize_kernel[(nb,)](xs, codes, scales, N, int(block), int(key), int(client),
                                         QMAX=127.0 if kind == 0 else 7.0, INT4=kind == 1,
                                         STOCHASTIC=bool(stochastic), HALF=half, BF16_BITS=bf16, num_warps=4)


# The client's fused encode (kind 0 int8 / 1 int4 / 2 fp8): C++ on the CPU
# (csrc/cpu/compressed_aggregate.cpp, compressed_encode.cpp) and on CUDA
# (csrc/cuda/kernels/compressed_encode.cuh), Triton.
_QUANTIZE = {"reference": _reference_quantize, "cpu": _cpp_quantize, "cuda": _cpp_quantize,
             "triton": _triton_quantize}
_QUANTIZE_INTO = {"reference": _reference_quantize_into, "cpu": _cpp_quantize_into, "cuda": _cpp_quantize_into,
                  "triton": _triton_quantize_into}


def block_quantize(name: str) -> Callable:
    """Backend ``name``'s ``block_quantize(x, kind, block, stochastic, key, client) -> (codes,
    scales)`` (kind 0 int8, 1 int4: python_ref.compression.quantize's bits; kind 2 fp8,
    codes the uint8 bits of float8_e4m3fn, not stochastic: python_ref's fp8_encode bits;
    ``x`` 1-D float)."""
    return _QUANTIZE[name]


def block_quantize_into(name: str) -> Callable:
    """Backend ``name``'s ``block_quantize_into(x, kind, block, stochastic, key, client, codes,
    scales)``: :func:`block_quantize`'s bits written into ``codes`` and ``scales`` (checked by
    the caller: ops/compressed.py's ``encode(out=)``)."""
    return _QUANTIZE_INTO[name]


def block_decode_aggregate(name: str) -> Callable:
    """Backend ``name``'s ``block_decode_aggregate`` (the name already resolved and checked)."""
    return _BLOCK[name]


def topk_decode_aggregate(name: str) -> Callable:
    """Backend ``name``'s ``topk_decode_aggregate`` (the name already resolved and checked)."""
    return _TOPK[name]


# ---------------------------------------------------------------------------------------
# the client's encoders (python_ref's formulation, on the update's device)

topk_k = _ref.topk_k  # how many values top-k keeps of n: ceil(fraction n), at least 1


def _torch_topk_encode(x, k):
    """python_ref's formulation (a stable sort of |x|) on the update's device."""
    return _ref.topk_encode(x, int(k))


def _cpp_topk_encode(x, k):
    return torch.ops.fedopt_C.topk_encode(x, int(k))


def _triton_topk_encode(x, k):
    """The radix select of backends/triton/topk_encode.py: 8 histogram + pick passes, then
    count, scan and write; every decision stays on the device (no host sync)."""
    from .triton import _on
    from .triton import topk_encode as K

    if x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"topk_encode: x must be a 1-D floating-point tensor, got {x.dtype} {tuple(x.shape)}")
    N, k = x.numel(), int(k)
    if not 0 <= k <= N:
        raise ValueError(f"topk_encode: k must be in [0, {N}], got {k}")
    if N > 1 << 32:
        raise ValueError(f"topk_encode: the Triton top-k encode takes at most 2^32 elements (the index is 32 bits "
                         f"of the key), got x with {N}")
    device = x.device
    if k == 0:
        return torch.empty(0, dtype=torch.float32, device=device), torch.empty(0, dtype=torch.int64, device=device)
    if k == N:
        return x.to(torch.float32).clone(), torch.arange(N, dtype=torch.int64, device=device)
    xs, bf16 = _triton_encode_input(x)
    tiles = -(-N // K.TOPK_BLOCK)
    head = K.TOPK_STATE.value + K.TOPK_PASSES * K.TOPK_BINS.value
    ws = torch.zeros(head + tiles, dtype=torch.int64, device=device)  # one memset: state, histograms, tile counts
    offsets = ws[head:]
    values = torch.empty(k, dtype=torch.float32, device=device)
    indices = torch.empty(k, dtype=torch.int64, device=device)
    with _on(device):
        for p in range(K.TOPK_PASSES):
            K.topk_histogram_kernel[(tiles,)](xs, ws, N, PASS=p, BLOCK=K.TOPK_BLOCK, BF16_BITS=bf16, num_warps=4)
            K.topk_pick_kernel[(1,)](ws, k, PASS=p, num_warps=4)
        K.topk_count_kernel[(tiles,)](xs, ws, offsets, N, BLOCK=K.TOPK_BLOCK, BF16_BITS=bf16, num_warps=4)
        K.topk_scan_kernel[(1,)](offsets, tiles, SCAN_BLOCK=K.TOPK_SCAN_BLOCK, num_warps=4)
        K.topk_write_kernel[(tiles,)](xs, ws, offsets, values, indices, N, BLOCK=K.TOPK_BLOCK, BF16_BITS=bf16,
                                      num_warps=4)
    return values, indices


# The client's top-k encode: fused on every backend but the reference -- a selection, not a
# sort: a radix select on the CPU (csrc/cpu/compressed_encode.cpp), in Triton
# (backends/triton/topk_encode.py) and on CUDA (csrc/cuda/kernels/topk_encode.cuh), those
# last two one algorithm (docs/compression.md).
_TOPK_ENCODE = {"reference": _torch_topk_encode, "cpu": _cpp_topk_encode, "cuda": _cpp_topk_encode,
                "triton": _triton_topk_encode}


def topk_encode(name: str) -> Callable:
    """Backend ``name``'s ``topk_encode(x, k) -> (values float32 [k], indices int64 [k]
    ascending)``: the k largest ``|x|``, a tie to the lower index (python_ref's bits)."""
    return _TOPK_ENCODE[name]


def decode_block(codes, scales, codec: str, block: int, numel: int) -> torch.Tensor:
    if codec == "fp8":
        return _ref.fp8_decode(codes, scales, block, numel)
    return _ref.dequantize(codes, scales, codec, block, numel)


def decode_topk(values, indices, numel: int) -> torch.Tensor:
    return _ref.topk_decode(values.cpu(), indices.cpu(), numel).to(values.device)


def hadamard_rotate(x, key: int, block: int):
    return _ref.hadamard_rotate(x.cpu(), key, block).to(x.device)


def hadamard_unrotate(y, key: int, block: int, numel: int):
    return _ref.hadamard_unrotate(y.cpu(), key, block, numel).to(y.device)
