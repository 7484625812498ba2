"""``server_update_``: the fused elementwise step of the server optimizers."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..backends.hyper import split
from . import _dispatch, validation as V

RULES = ("sgd", "momentum", "adagrad", "adam", "yogi")
_BUFFERS = {"sgd": (), "momentum": ("exp_avg",), "adagrad": ("exp_avg", "exp_avg_sq"),
            "adam": ("exp_avg", "exp_avg_sq"), "yogi": ("exp_avg", "exp_avg_sq")}


def _check_contiguous_list(tensors, name: str) -> list:
    tensors = V.check_tensor_list(tensors, name)
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            # A kernel pairs the elements of a param with those of its update by memory
            # position, and the update is in the param's logical (row-major) order.
            raise ValueError(f"{name}[{i}] must be contiguous, got strides {t.stride()} for shape "
                             f"{tuple(t.shape)}")
    return tensors


def _check_state(state, name: str, params: list) -> list:
    if state is None:
        raise ValueError(f"{name} is required by this rule (one tensor per param, like the param)")
    state = _check_contiguous_list(state, name)
    if len(state) != len(params):
        raise ValueError(f"{name} has {len(state)} tensors but params has {len(params)}")
    for i, (s, p) in enumerate(zip(state, params)):
        V.check_like(s, p, f"{name}[{i}]", f"params[{i}]")
    return state


def server_update_(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    *,
    rule: str,
    lr,
    gamma=1.0,
    beta1: float = 0.0,
    beta2: float = 0.0,
    tau: float = 0.0,
    nesterov: bool = False,
    exp_avg: Optional[Sequence[torch.Tensor]] = None,
    exp_avg_sq: Optional[Sequence[torch.Tensor]] = None,
    skip: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> None:
    r"""One server-optimizer step in place, in ONE pass over the data, on the round's
    mean update ``D`` (``updates[i]`` is the part of ``D`` for ``params[i]``).

    Per element, in the acc dtype (python_ref/server_optimizers.py,
    csrc/include/fedopt/math.h)::

        "sgd":      x <- gamma (x - lr D)                              FedAvg, FedExP
        "momentum": b <- beta1 b + D ; x <- x - lr b
                    (nesterov: x <- x - lr (beta1 b + D))              FedAvgM, ASNES
        "adagrad":  m <- beta1 m + (1 - beta1) D ; v <- v + D^2
        "adam":     ...                            v <- beta2 v + (1 - beta2) D^2
        "yogi":     ...                            v <- v - (1 - beta2) D^2 sign(v - D^2)
                    x <- x - lr m / (sqrt(v) + tau)                    FedAdagrad/Adam/Yogi

    ``b``/``m`` live in ``exp_avg`` and ``v`` in ``exp_avg_sq`` (one tensor per param, in
    the params' dtype; "momentum" needs ``exp_avg``, the adaptive rules both).  A step
    reads x, D and the state once and writes x and the state once: 3 words per
    parameter for "sgd", 5 for "momentum", 7 for the adaptive rules, where an unfused
    torch composition moves 4-5 times as much.

    Args:
        params: contiguous tensors of one floating dtype on one device.
        updates: one contiguous tensor per param with its number of elements, in the acc
            dtype (float32; float64 for float64 params): typically views of one flat
            ``D`` as produced by :func:`aggregate`.
        lr, gamma: numbers (``lr >= 0``, ``gamma > 0``) or 0-d tensors on the device
            (e.g. FedExP's and ASNES's adaptive server lr, never read on the host).
        beta1, beta2: in ``[0, 1)``; ``tau > 0`` for the adaptive rules.
        skip: None or a one-element bool tensor on the device: when True nothing is
            written (a skipped round keeps the exact bits), decided without a host sync.
        backend: ``"reference"``, ``"cpu"``, ``"triton"``, ``"cuda"`` or None.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    params = _check_contiguous_list(params, "params")
    updates = _check_contiguous_list(updates, "updates")
    if len(updates) != len(params):
        raise ValueError(f"updates has {len(updates)} tensors but params has {len(params)}")
    if not params:
        return
    device = V.check_same_device(params, "params")
    dtype = params[0].dtype
    acc = V.acc_dtype(dtype)
    for i, (p, d) in enumerate(zip(params, updates)):
        if p.dtype != dtype:
            raise ValueError(f"params must share one dtype: params[0] is {dtype}, params[{i}] is {p.dtype}")
        if d.numel() != p.numel():
            raise ValueError(f"updates[{i}] has {d.numel()} elements but params[{i}] has {p.numel()}")
        if d.dtype != acc:
            raise ValueError(f"updates[{i}] has dtype {d.dtype}; updates must be in the accumulation dtype "
                             f"{acc} of {dtype} params")
        if d.device != device:
            raise ValueError(f"updates[{i}] is on {d.device} but params are on {device}")
    needs = _BUFFERS[rule]
    m = _check_state(exp_avg, "exp_avg", params) if "exp_avg" in needs else []
    v = _check_state(exp_avg_sq, "exp_avg_sq", params) if "exp_avg_sq" in needs else []
    lr = V.check_hyper(lr, "lr", device, acc)
    if isinstance(gamma, torch.Tensor):
        gamma = V.check_hyper(gamma, "gamma", device, acc)
    else:
        gamma = V.check_real(gamma, "gamma", low=0.0, low_open=True)
    beta1 = V.check_real(beta1, "beta1", low=0.0, high=1.0, high_open=True)
    beta2 = V.check_real(beta2, "beta2", low=0.0, high=1.0, high_open=True)
    tau = V.check_real(tau, "tau", low=0.0, low_open=rule in ("adagrad", "adam", "yogi"))
    if skip is not None:
        skip = V.check_scalar_tensor(skip, "skip", device)
        if skip.dtype != torch.bool:
            raise ValueError(f"skip must be a bool tensor, got {skip.dtype}")
    V.check_backend(backend)
    rule_id = RULES.index(rule)
    _dispatch.kernel("server_update_", backend, device)(params, updates, m, v, rule_id, *split(lr), *split(gamma),
                                                        beta1, beta2, tau, bool(nesterov), skip)
