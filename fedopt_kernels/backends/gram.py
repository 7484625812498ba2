"""The clients' Gram matrix ``G = X X^T`` by torch operations: the ``client_gram`` of the
reference, triton and cuda backends (and of the cpu backend for rows of mixed dtypes,
which its C++ kernel does not take).  Contract and error bounds:
:func:`fedopt_kernels.ops.robust_aggregate.client_gram`.

Both forms read the clients in fixed blocks of columns and add the blocks' ``[K, K]``
results in float64 in a fixed order: deterministic, independent of threads.
``clients`` is a ``[K, N]`` tensor or a list of ``K`` 1-D tensors (possibly of several
dtypes: the ops layer appends a reference point of its own dtype as the last row).
"""

from __future__ import annotations

import torch

from .dtypes import acc_dtype

GRAM_CHUNK = 1 << 15  # columns per float64 block of the reference backend's Gram pass (C x 32K doubles)
# The other backends' Gram blocks (the CPU kernel's kGramBlock; triton, cuda: one batched
# product of GRAM_BATCH such blocks at a time, each block summed in the acc dtype)
GRAM_BLOCK = 256
GRAM_BATCH = 128
# Roundings in the acc dtype that a term x_ik x_jk of the CPU kernel's Gram matrix goes
# through (csrc/cpu/robust_kernels.h): fp32 acc 10, fp64 acc 13
GRAM_ACC_OPS = {torch.float32: 10, torch.float64: 13}


def _shape(clients):
    """``(K, N, acc dtype, device)``; the acc dtype of a list of several dtypes is that of
    the first row (the clients'; an appended reference point is converted to it)."""
    if isinstance(clients, torch.Tensor):
        return clients.shape[0], clients.shape[1], acc_dtype(clients.dtype), clients.device
    first = clients[0]
    return len(clients), first.shape[0], acc_dtype(first.dtype), first.device


def _row_block(X, j0: int, j1: int, dtype=torch.float64) -> torch.Tensor:
    if isinstance(X, torch.Tensor):
        return X[:, j0:j1].to(dtype)
    return torch.stack([r[j0:j1].to(dtype) for r in X])


def _symmetric(G: torch.Tensor) -> torch.Tensor:
    return torch.triu(G) + torch.triu(G, 1).T


def gram_float64(clients) -> torch.Tensor:
    """Float64 products of float64 blocks of :data:`GRAM_CHUNK` columns (products of
    fp32/fp16/bf16 values are exact in float64)."""
    K, N, _, device = _shape(clients)
    G = torch.zeros(K, K, dtype=torch.float64, device=device)
    for j0 in range(0, N, GRAM_CHUNK):
        j1 = min(N, j0 + GRAM_CHUNK)
        blk = _row_block(clients, j0, j1)
        G += blk @ blk.T
    return _symmetric(G)


def gram_blocks(clients) -> torch.Tensor:
    """Each block of :data:`GRAM_BLOCK` columns in the acc dtype by one batched product
    of :data:`GRAM_BATCH` blocks, the blocks' ``[K, K]`` results added in float64.  Any
    order of a block's sum: ``|error| <= (gamma_256(u_acc) + gamma_n(2^-53)) sum_k
    |x_ik x_jk|``."""
    K, N, acc, device = _shape(clients)
    G = torch.zeros(K, K, dtype=torch.float64, device=device)
    step = GRAM_BLOCK * GRAM_BATCH
    for j0 in range(0, N, step):
        j1 = min(N, j0 + step)
        nb = -(-(j1 - j0) // GRAM_BLOCK)
        blk = torch.zeros(K, nb * GRAM_BLOCK, dtype=acc, device=device)
        blk[:, :j1 - j0] = _row_block(clients, j0, j1, acc)
        B = blk.view(K, nb, GRAM_BLOCK).transpose(0, 1)
        G += torch.bmm(B, B.transpose(1, 2)).double().sum(dim=0)
    return _symmetric(G)


def client_gram(clients, float64_products: bool) -> torch.Tensor:
    """The triton and cuda backends' ``client_gram``: :func:`gram_blocks`, or
    :func:`gram_float64` with ``float64_products``."""
    return gram_float64(clients) if float64_products else gram_blocks(clients)
