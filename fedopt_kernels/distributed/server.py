"""``DistributedServerOptimizer``: one server step over the client updates of every rank."""

from __future__ import annotations

import torch

from ..ops.aggregate import _runner
from ..server import ServerOptimizer, ServerStats
from . import _comm
from .aggregate import MODES, _aggregate_planned

__all__ = ["DistributedServerOptimizer"]


class DistributedServerOptimizer:
    """Wraps a :class:`~fedopt_kernels.server.ServerOptimizer` (FedAvg, FedAdam, ASNES,
    ...) whose parameters are EVERY rank's copy of the global model, so that

    ``step(local_updates, local_weights)`` -- called on every rank of ``group`` with that
    rank's clients (a ``[C_r, N]`` tensor or ``C_r`` flat vectors, ``C_r >= 0``, and their
    ``C_r`` weights or None) -- takes the step one process would take with all the
    clients (rank 0's first): the weights are normalised over all ranks, the mean update,
    every statistic, exclusion and skip decision are global
    (:func:`~fedopt_kernels.distributed.all_aggregate`), and every rank applies the same
    step to its parameters and state.  With ``mode="ordered"`` (default) parameters,
    state and :class:`~fedopt_kernels.server.ServerStats` are bitwise those of the
    single-process ``optimizer.step`` on the union, for any number of ranks; with
    ``"all_reduce"`` they follow the mean update's tolerance (``all_aggregate``).

    Weights must be of one kind on every rank: all None (uniform over ALL clients), all
    numbers / CPU tensors (their values travel with the host-side exchange and are
    checked and normalised exactly as one process would), or all device tensors
    (gathered on the device; a bad total skips the round as in one process).

    Everything else (``param_groups``, ``state``, ``state_dict()``,
    ``load_state_dict()``, hyperparameters) is the wrapped optimizer's; give LR
    schedulers the wrapped optimizer (:attr:`optimizer`).  Its own ``step`` stays a
    single-process step.
    """

    def __init__(self, optimizer: ServerOptimizer, group=None, *, mode: str = "ordered"):
        if not isinstance(optimizer, ServerOptimizer):
            raise TypeError(f"optimizer must be a fedopt_kernels.server.ServerOptimizer, got "
                            f"{type(optimizer).__name__} (FedLAW learns its weights on a proxy set and has no "
                            "distributed form)")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.optimizer = optimizer
        self.group = group
        self.mode = mode

    def __getattr__(self, name):
        # only called for what this wrapper does not define itself
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"DistributedServerOptimizer({self.optimizer!r}, mode={self.mode!r})"

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, updates, weights=None) -> ServerStats:
        """Collective: this rank's updates and weights; returns the global
        :class:`~fedopt_kernels.server.ServerStats` (identical on every rank)."""
        return self.optimizer._step(updates, weights, self._aggregate)

    # ------------------------------------------------------------------ internals
    def _aggregate(self, opt: ServerOptimizer, updates, weights, out: torch.Tensor):
        params = opt._params()
        dtype, device = params[0].dtype, params[0].device
        acc, N = out.dtype, out.numel()
        error, rows, C_r, kind, values, wdtype = None, [], 0, None, None, None
        try:
            rows, C_r = opt._check_updates(updates, N, dtype, device, allow_empty=True)
            rows = list(rows.unbind(0)) if isinstance(rows, torch.Tensor) else list(rows)
            kind, values, wdtype = _local_weights(weights, C_r, device)
            run = _runner(opt.backend, device)  # raises now, before any collective, if it cannot run
        except Exception as exc:  # noqa: BLE001 - shared with the group, then re-raised
            error = exc
        plan = _comm.exchange(self.group, what="DistributedServerOptimizer.step", count=C_r, N=N, dtype=dtype,
                              device_type=device.type, error=error,
                              extra={"kind": kind, "values": values, "dtype": wdtype})
        kinds = [(e["kind"], e["dtype"]) for e in plan.extras]
        if any(k != kinds[0] for k in kinds):
            raise ValueError("DistributedServerOptimizer.step: the ranks pass different kinds of weights (all None, "
                             "all host numbers, or all device tensors of one dtype): " + ", ".join(
                                 f"rank {r}: {k}" for r, k in enumerate(kinds)))
        C = plan.C
        if kind == "uniform":
            global_w = None
        elif kind == "host":
            global_w = torch.tensor([v for e in plan.extras for v in e["values"]], dtype=torch.float64)
        else:
            global_w = _comm.gather_rows(values.reshape(-1, 1), plan, self.group).reshape(-1)
        # The single-process normalisation, on the union: same p, same validity flag.
        p, valid = opt._check_weights(global_w, C, device, acc)
        _, st = _aggregate_planned(rows, p[plan.start:plan.stop].contiguous(), 1.0, out, plan, self.group,
                                   run=run, nonfinite=opt.nonfinite, max_client_norm=opt.max_client_norm,
                                   mode=self.mode, dtype=dtype, device=device)
        return p, valid, st


def _local_weights(weights, C: int, device: torch.device):
    """``(kind, values, dtype)``: ``("uniform", None, None)``, ``("host", [floats], None)``
    (numbers or a CPU tensor: exact as float64) or ``("device", tensor, dtype)``."""
    if weights is None:
        return "uniform", None, None
    if isinstance(weights, torch.Tensor):
        if weights.is_complex() or weights.dtype == torch.bool:
            raise TypeError(f"weights must be real numbers, got dtype {weights.dtype}")
        if weights.dim() != 1 or weights.numel() != C:
            raise ValueError(f"weights has shape {tuple(weights.shape)} but this rank has {C} clients "
                             "(one weight per local client)")
        if weights.device.type == "cpu":
            return "host", weights.detach().to(torch.float64).tolist(), None
        if weights.device != device:
            raise ValueError(f"weights is on {weights.device} but the parameters are on {device}")
        return "device", weights.detach(), str(weights.dtype)
    try:
        values = [float(v) for v in weights]
    except (TypeError, ValueError):
        raise TypeError(f"weights must be a tensor or a sequence of numbers, got {weights!r}") from None
    if len(values) != C:
        raise ValueError(f"weights has {len(values)} entries but this rank has {C} clients")
    return "host", values, None
