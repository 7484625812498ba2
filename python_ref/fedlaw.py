"""FedLAW's server loop, written as literally as possible (the oracle).

Source: Li et al., "Revisiting Weighted Aggregation in Federated Learning with Neural
Networks", ICML 2023 ([FedLAW] in the README's references) and the authors' released code
(``ZexiLee/ICML-2023-FedLAW``, ``server_funct.py: fedlaw_optimization``).

The server receives the clients' full parameter vectors ``w_i`` and learns, on a small
proxy dataset, the shrinking factor ``gamma`` and the relative weights ``lambda`` of

    w_g = gamma * sum_i lambda_i w_i,   gamma > 0, lambda_i >= 0, sum_i lambda_i = 1   (eq. 3)
    {gamma*, lambda*} = argmin L_proxy(gamma * sum_i lambda_i w_i)                      (eq. 8-9)

(Algorithm 1, lines 10-15).  Parameterisation (Appendix C, "exponential" base function,
the one used in the experiments): ``lambda = softmax(x)``, ``gamma = exp(s)``;
initialisation (Algorithm 1 line 10): ``x = log(|D_i| / |D|)``, ``s = 0``.  Optimiser
(Appendix D.6 and the code): Adam(lr=0.01, betas=(0.5, 0.999)) for ``E_s`` server
epochs over the proxy loader, with the code's StepLR(step_size=20, gamma=0.5) per epoch.

Variants (sections 4, 5, 6): ``learn="gamma"`` (adaptive GWS, eq. 5: lambda fixed to
the data-size weights), ``"lambda"`` (attentive LAW, eq. 7: gamma = 1), ``"both"``
(FedLAW, eq. 8).

SWA (section 6.1 "With SWA"; the code's ``whether_swa == 'swa'`` branch): a two-stage
strategy.  The paper's text optimises gamma first; the released code (comment "for
SWA: first lambdas then gamma") optimises the logits first, with stochastic weight
averaging of the logits, then gamma with lambda fixed; the paper notes the reversed
order "also works".  We follow the code: stage 1, ``ceil(E_s/2)`` epochs of Adam on the
logits with CosineAnnealingLR(T_max=100) for epochs ``<= swa_start`` and SWALR(swa_lr)
afterwards, the logits being averaged (equal weights) at the end of every epoch
``> swa_start`` (``swa_start = 5``, ``swa_lr = 0.05`` in the code); stage 2,
``floor(E_s/2)`` epochs of Adam on ``s`` with StepLR, ``lambda = softmax(averaged
logits)``.  With ``learn="lambda"`` only stage 1 runs, for ``E_s`` epochs.

Model: the forward is ``functional_call(model, params)`` on views of the aggregated
vector; buffers are the model's own (BN running statistics are not aggregated).  The
code runs the proxy passes in train mode, which updates those running statistics;
``train_mode=False`` uses eval mode (running statistics read, never written).

Plain PyTorch: the aggregate is an explicit sum ``sum_i gamma * lambda_i * w_i`` and
autograd differentiates it.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.func import functional_call


def _aggregate(client_params: Sequence[torch.Tensor], gamma, lam) -> torch.Tensor:
    out = gamma * lam[0] * client_params[0]
    for i in range(1, len(client_params)):
        out = out + gamma * lam[i] * client_params[i]
    return out


def _unflatten(model: nn.Module, vec: torch.Tensor) -> dict:
    params, offset = {}, 0
    for name, p in model.named_parameters():
        params[name] = vec[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
    return params


def proxy_loss(model: nn.Module, client_params: Sequence[torch.Tensor], gamma, lam, proxy_loader: Iterable,
               loss_fn: Callable) -> torch.Tensor:
    """Mean over batches of ``loss_fn`` at ``gamma * sum_i lam_i w_i`` (no grad, model's mode)."""
    with torch.no_grad():
        vec = _aggregate(client_params, gamma, lam)
        losses = [loss_fn(functional_call(model, _unflatten(model, vec), (x,)), y) for x, y in proxy_loader]
    return torch.stack(losses).mean()


def fedlaw(
    model: nn.Module,
    client_params: Sequence[torch.Tensor],
    data_sizes: Sequence[float],
    proxy_loader: Iterable,
    loss_fn: Callable,
    *,
    learn: str = "both",
    server_epochs: int = 20,
    lr: float = 0.01,
    betas: Tuple[float, float] = (0.5, 0.999),
    lr_step: Optional[Tuple[int, float]] = (20, 0.5),
    swa: bool = False,
    swa_start: int = 5,
    swa_lr: float = 0.05,
    train_mode: bool = True,
):
    """Learn ``(gamma, lambda)`` for one round; returns them (0-d and ``[C]`` tensors).

    ``client_params`` are flat vectors in ``model.named_parameters()`` order.  The model
    itself is not modified (except BN running statistics in train mode).
    """
    device = client_params[0].device
    sizes = torch.tensor([float(n) for n in data_sizes], dtype=torch.float32, device=device)
    lam0 = sizes / sizes.sum()
    logits = torch.log(lam0).clone().requires_grad_(True)  # Algorithm 1 line 10
    s = torch.zeros((), device=device, requires_grad=True)
    was_training = model.training
    model.train(train_mode)

    def run(opt_params, gamma_fn, lam_fn, epochs, scheduler_fn, after_epoch=None):
        opt = torch.optim.Adam(opt_params, lr=lr, betas=betas)
        sched = scheduler_fn(opt)
        for epoch in range(epochs):
            for x, y in proxy_loader:
                x, y = x.to(device), y.to(device)
                opt.zero_grad()
                vec = _aggregate(client_params, gamma_fn(), lam_fn())  # eq. 8
                loss = loss_fn(functional_call(model, _unflatten(model, vec), (x,)), y)
                loss.backward()
                opt.step()
            if after_epoch is not None:
                after_epoch(epoch, opt, sched)
            elif sched is not None:
                sched.step()

    def step_lr(opt):
        return None if lr_step is None else torch.optim.lr_scheduler.StepLR(opt, step_size=lr_step[0],
                                                                             gamma=lr_step[1])

    one = torch.ones((), device=device)
    try:
        if not swa:
            if learn == "both":
                run([logits, s], lambda: torch.exp(s), lambda: torch.softmax(logits, 0), server_epochs, step_lr)
            elif learn == "gamma":
                run([s], lambda: torch.exp(s), lambda: lam0, server_epochs, step_lr)
            else:
                run([logits], lambda: one, lambda: torch.softmax(logits, 0), server_epochs, step_lr)
            gamma = torch.exp(s.detach()) if learn != "lambda" else one
            lam = torch.softmax(logits.detach(), 0) if learn != "gamma" else lam0
            return gamma, lam

        # SWA: stage 1, the logits with weight averaging; stage 2, gamma.
        e1 = server_epochs if learn == "lambda" else math.ceil(server_epochs / 2)
        e2 = server_epochs // 2
        avg = {"value": None, "n": 0}
        schedulers = {}

        def swa_schedulers(opt):
            schedulers["cos"] = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
            schedulers["swa"] = torch.optim.swa_utils.SWALR(opt, swa_lr=swa_lr)
            return None

        def swa_after_epoch(epoch, opt, sched):
            if epoch > swa_start:
                cur, n = logits.detach(), avg["n"]
                avg["value"] = cur.clone() if n == 0 else avg["value"] + (cur - avg["value"]) / (n + 1)
                avg["n"] = n + 1
                schedulers["swa"].step()
            else:
                schedulers["cos"].step()

        run([logits], lambda: one, lambda: torch.softmax(logits, 0), e1, swa_schedulers, swa_after_epoch)
        final_logits = avg["value"] if avg["n"] > 0 else logits.detach()
        lam = torch.softmax(final_logits, 0)
        if learn == "lambda":
            return one, lam
        run([s], lambda: torch.exp(s), lambda: lam, e2, step_lr)
        return torch.exp(s.detach()), lam
    finally:
        model.train(was_training)
