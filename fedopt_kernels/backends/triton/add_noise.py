"""Triton kernel of ``add_noise_``: Gaussian noise added in place to a 1-D contiguous
vector, drawn in the kernel from ``(key, j)`` alone (``_noise.normal``; the definition
and oracle: python_ref/gaussian_noise.py)::

    out[j] = round_to_out_dtype( out[j] (as acc) + std * normal(key, j) )

in the acc dtype of ``out`` (fp32; fp64 for fp64), the product and the sum each rounded
once.  ``std`` is a runtime fp64 argument or one element of a tensor read here
(``STD_KIND``), never on the host.

Program ``p`` owns elements ``[p * BLOCK, (p + 1) * BLOCK)`` (int64 offsets: ``j`` is the
global index, so any ``N`` below 2^63 / the grid limit works); full blocks are unmasked
(16-byte accesses), the last one masked.  Elementwise, so deterministic.  For an fp32 or
fp64 ``out`` this is bit for bit the noise epilogue of ``aggregate_kernel``: aggregating
and then adding noise equals aggregating with noise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _helpers as H
from . import _noise as NZ


@triton.jit
def _add_noise_block(out_ptr, start, N, std, noise_key, ACC: tl.constexpr, BLOCK: tl.constexpr,
                     MASKED: tl.constexpr):
    offs = H.block_offsets(start, BLOCK)
    x = H.load_block(out_ptr, offs, N, ACC, MASKED)
    H.store_block(out_ptr, offs, N, NZ.add_noise(x, std, noise_key, start, ACC, BLOCK), MASKED)


@triton.jit(do_not_specialize=["std_value", "noise_key", "N"])
def add_noise_kernel(out_ptr, std_ptr, skip_ptr, std_value: tl.float64, noise_key: tl.int64, N: tl.int64,
                     ACC: tl.constexpr, STD_KIND: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
    """``out[J] += std * normal(noise_key, J)`` for the elements ``J`` of program ``p``
    (acc dtype ``ACC``; ``std`` = ``std_value`` or ``std_ptr[0]`` by ``STD_KIND``, the
    ``HYPER_*`` kinds).  With ``skip`` true (read here) nothing is written.  Grid:
    ``cdiv(N, BLOCK)``."""
    run = True
    if HAS_SKIP:
        run = tl.load(skip_ptr) == 0
    if run:
        pid = tl.program_id(0).to(tl.int64)
        std = H.load_hyper(std_value, std_ptr, 0, STD_KIND, ACC)
        if (pid + 1) * BLOCK <= N:
            _add_noise_block(out_ptr, pid * BLOCK, N, std, noise_key, ACC, BLOCK, False)
        else:
            _add_noise_block(out_ptr, pid * BLOCK, N, std, noise_key, ACC, BLOCK, True)
