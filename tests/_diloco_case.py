"""The DiLoCo tests' shared case: a small model, each worker's data, and the reference
loop (python_ref/diloco.py) over the same workers in one process.  Used by
test_diloco.py (islands of one rank) and test_diloco_islands.py (islands of 2 ranks)."""

from __future__ import annotations

import torch
from torch import nn

import python_ref.diloco as R

H = 3
STEPS = 8  # two outer rounds and two steps into the third


def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def batch_size(k):
    return 4 + 3 * k  # the workers' batches differ: token weighting matters


def inner_step_fn(models, opts):
    """``inner_step(k, t)``: worker k's t-th AdamW step on its own data; returns its tokens."""

    def inner_step(k, t):
        g = torch.Generator().manual_seed(1000 * k + t)
        n = batch_size(k)
        x = torch.randn(n, 5, generator=g, dtype=torch.float64).to(next(models[k].parameters()).dtype)
        y = torch.randn(n, 3, generator=g, dtype=torch.float64).to(x.dtype)
        opts[k].zero_grad()
        nn.functional.mse_loss(models[k](x), y).backward()
        return n

    return inner_step


def reference_workers(world):
    """``world`` AdamW workers of the case's model for the python_ref loops: the models
    and their inner step (the batch's backward, then the worker's optimizer step)."""
    models = [make_model() for _ in range(world)]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in models]
    step = inner_step_fn(models, opts)

    def inner(k, t):
        n = step(k, t)
        opts[k].step()
        return n

    return models, inner


def reference(steps, weighted, world=2, **kw):
    models, inner = reference_workers(world)
    theta, m = R.diloco_loop([list(mm.parameters()) for mm in models], inner, H=H, steps=steps, weighted=weighted,
                             **kw)
    return theta, m, [[p.detach().clone() for p in mm.parameters()] for mm in models]


def params_of(diloco):
    return [p.detach().clone() for p in diloco.params]


def momentum_of(diloco):
    opt = diloco.outer_optimizer
    return torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in diloco.params])
