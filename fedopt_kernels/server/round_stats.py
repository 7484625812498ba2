"""What one server step did, by the names of ``fedopt simulate``'s records: the
:class:`ServerRoundStats` every server algorithm's ``round(results, weights)`` returns
(:mod:`.round`), and :func:`read_metrics`, which reads them with one host
synchronisation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

__all__ = ["ServerRoundStats", "read_metrics"]


@dataclass(frozen=True)
class ServerRoundStats:
    """What one server round did (device tensors; nothing read on the host yet).

    * ``excluded`` ``[C]`` bool: the clients the round left out (NaN/Inf results);
    * ``skipped`` 0-d bool: nothing was applied;
    * ``metrics``: the round's statistics by their record names, 0-d or ``[C]`` tensors
      (None where the round has no value): a server optimizer's ``server_lr``,
      ``lr_scale``, ``update_norm``, ``excluded_clients``, ``server_skipped`` (ASNES
      adds ``gain_ratio``, ``sigma2``, ``nu2``); FedLAW's ``gamma``, ``lambda``,
      ``proxy_loss``, ``excluded_clients``, ``server_skipped``;
    * ``stats``: the algorithm's own record of the round (a
      :class:`~fedopt_kernels.server.ServerStats` or a
      :class:`~fedopt_kernels.server.FedLAWRound`).
    """

    excluded: torch.Tensor
    skipped: torch.Tensor
    metrics: Dict[str, Optional[torch.Tensor]]
    stats: object

    def read(self) -> dict:
        """:attr:`metrics` as Python values, with one host synchronisation for the scalars
        (bool, int or float by the tensor's dtype; a ``[C]`` tensor as a list; None
        values left out)."""
        return read_metrics(self.metrics)


def read_metrics(metrics: dict) -> dict:
    """Device tensors -> Python numbers, with one host sync for the scalars (a value that
    is not a tensor is kept, None left out)."""
    out, scalars = {}, []
    for key, value in metrics.items():
        if value is None:
            continue
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            scalars.append((key, value))
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().cpu().tolist()
        else:
            out[key] = value
    if scalars:
        values = torch.stack([v.detach().to(torch.float64).cpu() for _, v in scalars]).tolist()
        for (key, t), v in zip(scalars, values):
            out[key] = bool(v) if t.dtype == torch.bool else (int(v) if not t.is_floating_point() else v)
    return out
