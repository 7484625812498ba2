r"""FedBuff: buffered asynchronous aggregation (Nguyen et al., AISTATS 2022, Algorithm 1).

Clients train on the model version they pulled and report whenever they finish; the
server does not wait for a round.  Each arriving update ``Delta_i`` (``x_pulled -
x_end``, the usual ``D_i``) was computed from version ``v_i``; at arrival the server is
at version ``v``, so its staleness is ``tau_i = v - v_i``.  The server adds
``s(tau_i) Delta_i`` to a buffer; after ``K`` arrivals it applies its server optimizer
to the buffered mean and moves to version ``v + 1``::

    Delta_bar = (1 / K) sum_{i in buffer} s(tau_i) Delta_i        (Algorithm 1, lines 10-13)
    x <- ServerOpt(x, Delta_bar) ;  v <- v + 1 ;  buffer <- {}

Staleness weights ``s(tau)`` (``staleness=``):

=================  =========================================================  ==========================
``"constant"``     ``1``                                                      no down-weighting
``"polynomial"``   ``(1 + tau)^{-a}``                                         FedBuff's experiments,
                                                                              ``a = 0.5`` (Section 5)
``"hinge"``        ``1`` if ``tau <= b`` else ``1 / (a (tau - b) + 1)``       FedAsync (Xie et al. 2019),
                                                                              eq. (hinge)
=================  =========================================================  ==========================

The buffer is a ``[K, N]`` tensor written in place: an arrival is ONE scaled copy into
its row (``s(tau) Delta_i``, rounded once to the parameter dtype), and the server step
aggregates the ``K`` rows with the optimizer's own aggregator in one fused pass -- uniform
weights, so the mean is exactly ``Delta_bar``.  Any server optimizer steps on it (FedAvg,
FedAvgM, FedAdam, ...; FedExP's and ASNES's statistics are those of the scaled rows),
and so does any aggregator the optimizer holds: a robust aggregator sees the ``K``
buffered rows; :class:`~fedopt_kernels.server.DPAggregator` clips and noises them.
With DP, one server step is one Gaussian mechanism over the ``K`` clients of the buffer;
which clients fill a buffer depends on their speeds, not on a uniform sample, so the
sampling-amplified accounting of synchronous rounds does not apply: account each step
with ``sampling="all"`` (no amplification) unless the arrival process is modelled.

``state_dict()`` holds the version, the filled rows, their staleness and the
optimizer's state: a run checkpointed in the middle of a buffer resumes bit for bit.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ..ops.validation import check_real

__all__ = ["STALENESS", "staleness_weight", "FedBuffBuffer"]

STALENESS = ("constant", "polynomial", "hinge")


def staleness_weight(tau: int, kind: str = "polynomial", *, a: float = 0.5, b: int = 4) -> float:
    """``s(tau)`` of the table in the module docstring (``a``: the exponent of
    "polynomial", the slope of "hinge"; ``b``: the hinge's free staleness)."""
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
        raise ValueError(f"tau (staleness) must be an int >= 0, got {tau!r}")
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((1.0 + tau) ** (-a))
    if kind == "hinge":
        return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)
    raise ValueError(f"staleness must be one of {', '.join(STALENESS)}, got {kind!r}")


class FedBuffBuffer:
    """The server side of FedBuff around a server optimizer (module docstring).

    ``optimizer``: a :class:`~fedopt_kernels.server.ServerOptimizer` over the global
    model's parameters; ``buffer_size``: ``K``; ``staleness``, ``a``, ``b``: ``s(tau)``.

    ``add(update, version, client=None)`` takes one client's flat update (``[N]``, the
    optimizer's parameter order) computed from global version ``version``; it returns
    what the server step returned when this arrival filled the buffer, else None.
    :attr:`version` counts the server steps taken.  ``step(rows, clients)``: the server
    step on the buffered rows (default ``optimizer.step(rows)``; the simulator hands its
    whole server round, so robust rules, DP and the record apply to the buffer).
    """

    def __init__(self, optimizer, buffer_size: int, *, staleness: str = "polynomial", a: float = 0.5, b: int = 4,
                 max_staleness: Optional[int] = None, step: Optional[Callable] = None):
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
        if staleness not in STALENESS:
            raise ValueError(f"staleness must be one of {', '.join(STALENESS)}, got {staleness!r}")
        check_real(a, "a", low=0.0)
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"b must be an int >= 0, got {b!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got {max_staleness!r}")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not params:
            raise ValueError("the optimizer has no parameters")
        self.optimizer = optimizer
        self.K, self.kind, self.a, self.b, self.max_staleness = buffer_size, staleness, a, b, max_staleness
        self.N = sum(p.numel() for p in params)
        self.rows = torch.zeros(buffer_size, self.N, dtype=params[0].dtype, device=params[0].device)
        self.filled = 0
        self.version = 0
        self.staleness: List[int] = []  # tau of each filled row
        self.clients: List = []  # who sent each filled row (ids for the round's record)
        self.dropped_stale = 0  # arrivals older than max_staleness, left out
        # the server step on the filled rows: the optimizer's own, or the caller's round
        # (the simulator's ServerRound: robust rule, DP and the record), step(rows, clients)
        self._step = step

    def weight(self, tau: int) -> float:
        return staleness_weight(tau, self.kind, a=self.a, b=self.b)

    @torch.no_grad()
    def add(self, update: torch.Tensor, version: int, client=None):
        """Buffer ``s(v - version) * update``; step when the buffer is full (see class)."""
        if not isinstance(update, torch.Tensor) or update.dim() != 1 or update.numel() != self.N:
            shape = tuple(update.shape) if isinstance(update, torch.Tensor) else type(update).__name__
            raise ValueError(f"update must be a flat [{self.N}] tensor (the model's parameters), got {shape}")
        if update.dtype != self.rows.dtype or update.device != self.rows.device:
            raise ValueError(f"update must be {self.rows.dtype} on {self.rows.device}, got {update.dtype} on "
                             f"{update.device}")
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= self.version:
            raise ValueError(f"version must be an int in [0, {self.version}] (the versions served so far), "
                             f"got {version!r}")
        tau = self.version - version
        if self.max_staleness is not None and tau > self.max_staleness:
            self.dropped_stale += 1
            return None
        torch.mul(update, self.weight(tau), out=self.rows[self.filled])
        self.staleness.append(tau)
        self.clients.append(client)
        self.filled += 1
        if self.filled < self.K:
            return None
        return self.flush()

    def flush(self):
        """The server step on the rows buffered so far (the buffer's mean), then an empty
        buffer and the next version.  None if the buffer is empty."""
        if self.filled == 0:
            return None
        rows = self.rows[:self.filled]
        stats = self.optimizer.step(rows) if self._step is None else self._step(rows, list(self.clients))
        self.version += 1
        self.filled = 0
        self.staleness, self.clients = [], []
        return stats

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"version": self.version, "filled": self.filled, "staleness": list(self.staleness),
                "clients": list(self.clients),
                "rows": self.rows[:self.filled].clone(), "dropped_stale": self.dropped_stale,
                "optimizer": self.optimizer.state_dict(),
                "settings": {"K": self.K, "kind": self.kind, "a": self.a, "b": self.b,
                             "max_staleness": self.max_staleness}}

    def load_state_dict(self, state: dict) -> None:
        settings = {"K": self.K, "kind": self.kind, "a": self.a, "b": self.b, "max_staleness": self.max_staleness}
        if state.get("settings") != settings:
            raise ValueError(f"the checkpoint's FedBuff settings {state.get('settings')} differ from this buffer's "
                             f"{settings}")
        rows = state["rows"]
        if rows.shape[1:] != (self.N,) or rows.shape[0] != state["filled"] or state["filled"] >= self.K:
            raise ValueError(f"the checkpoint's buffer has shape {tuple(rows.shape)} and {state['filled']} rows "
                             f"filled; this buffer takes up to {self.K - 1} rows of {self.N}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.rows.zero_()
        self.rows[:rows.shape[0]].copy_(rows)
        self.filled, self.version = int(state["filled"]), int(state["version"])
        self.staleness = [int(t) for t in state["staleness"]]
        self.clients = list(state.get("clients", [None] * self.filled))
        self.dropped_stale = int(state["dropped_stale"])

    def __repr__(self) -> str:
        return (f"FedBuffBuffer(K={self.K}, staleness={self.kind!r}, a={self.a:g}, b={self.b}, version={self.version}, "
                f"filled={self.filled})")
