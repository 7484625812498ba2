"""The bit-exact oracle of ``server_update_``'s contract (csrc/include/fedopt/math.h
``server_update_*``), shared by the kernel tests of every backend.

python_ref/server_optimizers.py is the paper-literal oracle (tests/test_server_update.py
compares every backend to it within a tolerance); this one is the contract's exact
arithmetic, for bitwise checks: one torch op per operation in the acc dtype (CPU tensor
ops round each result once, no FMA), in math.h's order, hyperparameters rounded once to
acc.  One deliberate deviation from plain torch: ``torch.sqrt`` on the CPU is not
correctly rounded in torch 2.14's builds (about 17% of fp32 and 1% of fp64 results one
ulp off, whatever ATEN_CPU_CAPABILITY says), while every kernel's square root is IEEE's,
so this takes numpy's (the sqrt instruction).
"""

from __future__ import annotations

import numpy as np
import torch


def acc_scalar(h, acc: torch.dtype) -> torch.Tensor:
    """A hyperparameter as the kernels see it: a float rounded once to ``acc``, or a
    tensor's value."""
    if isinstance(h, torch.Tensor):
        return h.detach().to("cpu", acc).reshape(())
    return torch.tensor(h, dtype=acc)


def sign_of(a: torch.Tensor) -> torch.Tensor:
    """math.h's sign_of: 1, -1, else ``a`` itself (+-0 and NaN pass through; torch.sign
    gives +0 for -0 and NaN, which only changes NaN payloads and the sign of a zero)."""
    one = torch.ones((), dtype=a.dtype)
    return torch.where(a > 0, one, torch.where(a < 0, -one, a))


def sqrt_rn(a: torch.Tensor) -> torch.Tensor:
    """IEEE (correctly rounded) square root of a CPU tensor."""
    return torch.from_numpy(np.sqrt(a.numpy()))


def server_update_exact(rule: int, nesterov: bool, x, d, m, v, *, lr, gamma, beta1, beta2, tau):
    """New ``(x, m, v)`` in the acc dtype ``d.dtype``, before the store rounding.

    ``x``, ``m``, ``v``: CPU tensors of any float dtype (converted to acc), ``m``/``v``
    None where the rule has no such state (returned as None then); ``d``: the update,
    acc dtype; ``lr``/``gamma``: floats or 0-d tensors; ``rule``: math.h ServerRule.
    """
    acc = d.dtype
    lr, gamma, beta1, beta2, tau = (acc_scalar(h, acc) for h in (lr, gamma, beta1, beta2, tau))
    one = torch.ones((), dtype=acc)
    x = x.to(acc)
    m = None if m is None else m.to(acc)
    v = None if v is None else v.to(acc)
    if rule == 0:
        return gamma * (x - lr * d), m, v
    if rule == 1:
        m = beta1 * m + d
        s = beta1 * m + d if nesterov else m
        return x - lr * s, m, v
    m = beta1 * m + (one - beta1) * d
    d2 = d * d
    if rule == 2:
        v = v + d2
    elif rule == 3:
        v = beta2 * v + (one - beta2) * d2
    else:
        v = v - (one - beta2) * d2 * sign_of(v - d2)
    return x - lr * (m / (sqrt_rn(v) + tau)), m, v
