"""Benchmark of the fused server step (``ops.server_update_``) against unfused ones.

The server's elementwise step after the aggregation: FedAdam on the mean update ``D`` of
a model given as a list of tensors, ``D`` one flat vector (views per tensor), as
:class:`fedopt_kernels.server.FedAdam` runs it.  Timed interleaved, medians.

* ``fused``: ``ops.server_update_(rule="adam")``: one pass, 7 words per parameter.
* ``per-tensor torch ops``: the same formula as separate torch ops per tensor, with the
  device-side skip (``torch.where``) of a server step: what FedAdam ran before the
  fused op (~28 words per parameter, ~12 launches per tensor).
* ``torch._foreach``: the same formula with ``torch._foreach_*`` ops and no skip, the
  best unfused composition (what ``torch.optim.Adam(foreach=True)`` does).
* ``torch.optim.Adam(fused=True)``: PyTorch's own fused Adam on the same tensors (bias
  correction and eps inside the sqrt: not the same formula, the same traffic), the bar:
  the "vs floor" column of these rows is the speed relative to it, and so is "vs torch"
  (it is the torch anchor).

On CUDA each candidate's ``launches`` is counted once the timing is done
(``timing.defer_launch_columns``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops
from .timing import defer_launch_columns, interleaved, ratio_rows

B1, B2, TAU, LR = 0.9, 0.99, 1e-3, 1e-2
TORCH_ANCHOR = "torch.optim.Adam(fused=True)"


def bench_server_update(shapes, *, label: str, backend: Optional[str] = None, device="cpu",
                        repeats: int = 11, deferred: Optional[list] = None) -> list:
    """Rows of the candidates above on ``shapes``; ``deferred``: where the launch counting
    waits (``timing.defer_launch_columns``)."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).to(device) for s in shapes]
    N = sum(p.numel() for p in params)
    D = (torch.randn(N, generator=g) * 0.01).to(device)
    views, at = [], 0
    for p in params:
        views.append(D[at:at + p.numel()].view(p.shape))
        at += p.numel()
    m = [torch.zeros_like(p) for p in params]
    v = [torch.full_like(p, TAU * TAU) for p in params]
    skip = torch.zeros((), dtype=torch.bool, device=device)

    def per_tensor():
        for p, d, mi, vi in zip(params, views, m, v):
            m_new = torch.add(mi * B1, d, alpha=1 - B1)
            v_new = torch.add(vi * B2, d * d, alpha=1 - B2)
            denom = torch.sqrt(v_new).add_(TAU)
            x_new = p - (m_new / denom).mul_(LR)
            torch.where(skip, mi, m_new, out=mi)
            torch.where(skip, vi, v_new, out=vi)
            torch.where(skip, p, x_new, out=p)

    def foreach():
        torch._foreach_mul_(m, B1)
        torch._foreach_add_(m, views, alpha=1 - B1)
        torch._foreach_mul_(v, B2)
        torch._foreach_addcmul_(v, views, views, value=1 - B2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_add_(denom, TAU)
        torch._foreach_addcdiv_(params, m, denom, value=-LR)

    adam_params = [p.clone().requires_grad_(True) for p in params]
    for p, d in zip(adam_params, views):
        p.grad = d.clone()
    torch_fused = torch.optim.Adam(adam_params, lr=LR, betas=(B1, B2), eps=TAU, fused=True)

    candidates = {
        "fused": lambda: ops.server_update_(params, views, rule="adam", lr=LR, beta1=B1, beta2=B2, tau=TAU,
                                            exp_avg=m, exp_avg_sq=v, skip=skip, backend=backend),
        "per-tensor torch ops (+ skip)": per_tensor,
        "torch._foreach (no skip)": foreach,
        TORCH_ANCHOR: torch_fused.step,
    }
    times = interleaved(candidates, repeats=repeats, device=device)
    # minimum traffic of the Adam step: read x, D, m, v; write x, m, v (fp32)
    rows = ratio_rows(f"server FedAdam step {label}", times, base=TORCH_ANCHOR, fused="fused",
                      traffic_bytes=7 * 4 * N, device=device, torch_anchor=TORCH_ANCHOR)
    return defer_launch_columns(rows, candidates, device, deferred)
