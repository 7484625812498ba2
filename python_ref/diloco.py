"""DiLoCo and Streaming DiLoCo, written out as plain loops (the oracle).

Sources: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv 2311.08105 (Algorithm 1); Douillard et al., "Streaming DiLoCo with
overlapping communication", arXiv 2501.18512 (Algorithm 1, fragments, overlap tau and
the alpha mixing).

K workers simulated in ONE process, each a model and an inner optimizer of its own.
With the global parameters ``theta`` (one flat fp32 vector per fragment; fp64 for fp64
models), after every H inner steps::

    Delta_k = theta - theta_k                         (the worker's outer gradient)
    Delta   = sum_k p_k Delta_k                        (p_k = tokens_k / sum tokens, or 1/K)
    m <- mu m + Delta ; theta <- theta - eta (mu m + Delta)   (outer Nesterov SGD)
    theta_k <- theta                                   (every worker restarts from theta)

Streaming DiLoCo splits the parameters into P fragments; fragment p sends its outer
gradient at the inner steps t with ``t mod H == offset_p``; the exchanged mean arrives
``tau`` inner steps later, the outer step moves the fragment's global copy, and each
worker MIXES it into the parameters it kept training meanwhile::

    theta_k,p <- alpha theta_k,p + (1 - alpha) theta_p

(With tau = 0 and alpha = 0 a fragment is plain DiLoCo.)

The quantized exchange (``codec`` "fp8", "int4" or "int8", ``block`` values per scale):
each worker's outer gradient is encoded and decoded by python_ref/compression.py, and
the mean is that module's ``decode_aggregate`` of the decoded vectors with the
normalised token weights ``p_k`` (fp32), in worker order -- in both loops.  Every tensor op here is an
out-of-place, separately rounded elementwise op in the accumulation dtype; the inner
steps are whatever ``inner_step`` does.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from . import compression as Q
from .fednar import compute_dtype
from .server_optimizers import fedavgm, normalized_weights

__all__ = ["flat", "pseudo_gradient", "mean_outer_gradient", "outer_nesterov", "mix", "fragment_offsets",
           "syncs_at", "diloco_loop", "streaming_diloco_loop", "quantized_mean"]


def flat(params: Sequence[torch.Tensor], dtype=None) -> torch.Tensor:
    """The parameters as one flat vector (in ``dtype``, default their compute dtype)."""
    dtype = dtype or compute_dtype(params[0].dtype)
    return torch.cat([p.detach().reshape(-1).to(dtype) for p in params])


def pseudo_gradient(theta: torch.Tensor, local: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Delta_k = theta - theta_k`` in ``theta``'s dtype (the compute dtype)."""
    return theta - flat(local, theta.dtype)


def mean_outer_gradient(deltas: Sequence[torch.Tensor], tokens: Optional[Sequence[float]] = None) -> torch.Tensor:
    """``sum_k p_k Delta_k``, an explicit loop from zero in worker order (p in fp64, then
    rounded to the compute dtype, as the aggregation's normalised weights)."""
    p = normalized_weights(None if tokens is None else torch.tensor(tokens, dtype=torch.float64), len(deltas))
    D = torch.zeros_like(deltas[0])
    for pk, dk in zip(p, deltas):
        D = D + pk.to(dk.dtype) * dk
    return D


def quantized_mean(deltas: Sequence[torch.Tensor], tokens: Optional[Sequence[float]], codec: str,
                   block: int) -> torch.Tensor:
    """``sum_k p_k decode(C(Delta_k))`` (fp32; cast to the deltas' dtype): each outer
    gradient through the codec, then the decode-aggregate in worker order."""
    decoded = []
    for d in deltas:
        x, n = d.to(torch.float32), d.numel()
        if codec == "fp8":
            decoded.append(Q.fp8_decode(*Q.fp8_encode(x, block), block, n))
        else:
            decoded.append(Q.dequantize(*Q.quantize(x, codec, block), codec, block, n))
    p = normalized_weights(None if tokens is None else torch.tensor(tokens, dtype=torch.float64), len(deltas))
    out, _, _ = Q.decode_aggregate(decoded, p.to(torch.float32))
    return out.to(deltas[0].dtype)


def outer_nesterov(theta: torch.Tensor, D: torch.Tensor, m: torch.Tensor, *, lr: float, momentum: float):
    """DiLoCo's outer step (Nesterov SGD, torch.optim.SGD's form): ``(theta, m)``."""
    return fedavgm(theta, D, m, lr=lr, momentum=momentum, nesterov=True)


def mix(local: torch.Tensor, glob: torch.Tensor, alpha: float) -> torch.Tensor:
    """Streaming DiLoCo's merge ``alpha local + (1 - alpha) global``."""
    return alpha * local + (1.0 - alpha) * glob


def fragment_offsets(H: int, P: int) -> List[int]:
    """The staggered schedule: fragment p syncs at the steps ``t`` with ``t mod H = p H / P``
    (integer division)."""
    return [(p * H) // P for p in range(P)]


def syncs_at(t: int, H: int, offsets: Sequence[int]) -> List[int]:
    """The fragments whose outer gradient is sent after inner step ``t`` (1-based)."""
    return [p for p, o in enumerate(offsets) if t >= 1 and t % H == o % H]


def _write(params: Sequence[torch.Tensor], vec: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(vec[offset:offset + p.numel()].view(p.shape).to(p.dtype))
            offset += p.numel()


def diloco_loop(workers: Sequence[Sequence[torch.Tensor]], inner_step: Callable[[int, int], Optional[float]], *,
                H: int, steps: int, lr: float = 0.7, momentum: float = 0.9, weighted: bool = False,
                codec: Optional[str] = None, block: int = 256):
    """Run DiLoCo for ``steps`` inner steps on K simulated workers.

    ``workers[k]`` is worker k's parameter list (all workers start equal);
    ``inner_step(k, t)`` takes worker k's inner step number t (1-based) in place and
    returns its token count (used when ``weighted``).  Returns ``(theta, m)``, the global
    vector and the outer momentum, after the last sync (the workers' params are left
    as the loop leaves them)."""
    theta = flat(workers[0])
    m = torch.zeros_like(theta)
    tokens = [0.0] * len(workers)
    for t in range(1, steps + 1):
        for k in range(len(workers)):
            n = inner_step(k, t)
            tokens[k] += float(n or 0)
        if t % H == 0:
            deltas = [pseudo_gradient(theta, w) for w in workers]
            if codec is None:
                D = mean_outer_gradient(deltas, tokens if weighted else None)
            else:
                D = quantized_mean(deltas, tokens if weighted else None, codec, block)
            theta, m = outer_nesterov(theta, D, m, lr=lr, momentum=momentum)
            for w in workers:
                _write(w, theta)
            tokens = [0.0] * len(workers)
    return theta, m


def streaming_diloco_loop(workers: Sequence[Sequence[torch.Tensor]], fragments: Sequence[Sequence[int]],
                          inner_step: Callable[[int, int], Optional[float]], *, H: int, steps: int, tau: int,
                          alpha: float, offsets: Optional[Sequence[int]] = None, lr: float = 0.7,
                          momentum: float = 0.9, weighted: bool = False, codec: Optional[str] = None,
                          block: int = 256):
    """Streaming DiLoCo for ``steps`` inner steps on K simulated workers.

    ``fragments[p]`` lists the indices (into each worker's parameter list) of fragment
    p.  The outer gradient of fragment p is formed after inner step ``t`` with
    ``t mod H == offsets[p]``, weighted by the tokens the worker took since that
    fragment's previous send; it is applied after inner step ``t + tau`` (an exchange
    still in flight at ``steps`` is not applied).  Returns ``(thetas, ms)`` per fragment."""
    K, P = len(workers), len(fragments)
    offsets = list(offsets) if offsets is not None else fragment_offsets(H, P)
    frag = [[[w[i] for i in fragments[p]] for p in range(P)] for w in workers]
    thetas = [flat(frag[0][p]) for p in range(P)]
    ms = [torch.zeros_like(th) for th in thetas]
    tokens = [[0.0] * P for _ in range(K)]
    in_flight = {}  # step at which to apply -> [(p, D)]
    for t in range(1, steps + 1):
        for k in range(K):
            n = float(inner_step(k, t) or 0)
            for p in range(P):
                tokens[k][p] += n
        for p in syncs_at(t, H, offsets):
            deltas = [pseudo_gradient(thetas[p], frag[k][p]) for k in range(K)]
            w = [tokens[k][p] for k in range(K)]
            mean = _mean_by_sum(deltas, w if weighted else None) if codec is None else \
                quantized_mean(deltas, w if weighted else None, codec, block)
            in_flight.setdefault(t + tau, []).append((p, mean))
            for k in range(K):
                tokens[k][p] = 0.0
        for p, D in in_flight.pop(t, []):
            thetas[p], ms[p] = outer_nesterov(thetas[p], D, ms[p], lr=lr, momentum=momentum)
            for k in range(K):
                _write(frag[k][p], mix(flat(frag[k][p], thetas[p].dtype), thetas[p], alpha))
    return thetas, ms


def _mean_by_sum(deltas: Sequence[torch.Tensor], tokens: Optional[Sequence[float]]) -> torch.Tensor:
    """The streaming exchange's mean: one sum of ``w_k Delta_k`` (an all-reduce), divided
    by ``sum_k w_k`` (``w_k = 1`` unweighted).  Summed in worker order."""
    w = [1.0] * len(deltas) if tokens is None else list(tokens)
    S = torch.zeros_like(deltas[0])
    for wk, dk in zip(w, deltas):
        S = S + torch.tensor(wk, dtype=dk.dtype) * dk
    return S / torch.tensor(sum(w), dtype=deltas[0].dtype)
