"""A round's memory bounded by a chunk: the clients trained in chunks, each chunk's
updates folded into the running weighted sum the server step applies.

Without a budget a round holds every update ``D_i`` of its ``C`` clients as one
``[C, N]`` tensor until the server step (1,000 clients of a ResNet-18: 45 GB).  With
``memory_budget`` the simulator trains ``K`` clients at a time (``K`` from the budget,
:func:`chunk_clients`) into a ``[K, N]`` buffer and, for the algorithms whose server
step starts from a weighted sum -- FedAvg, FedProx, SCAFFOLD, FedAvgM, FedAdam, FedYogi,
FedAdagrad, FedExP, ASNES (:data:`FOLDABLE`) -- folds each chunk into :class:`RoundFold`:

* **the sum, bit for bit.**  Every aggregation kernel computes, per element,
  ``t = 0; t = t + p_i D_i`` for ``i = 0 .. C-1`` in the accumulation dtype, a chain of
  roundings that cannot be regrouped.  So the fold continues ONE running sum: a chunk
  runs the same fused kernel on ``[t] + its rows`` with weights ``[1] + theirs``
  (``0 + 1 * t == t`` exactly, then the very additions of the unchunked round) -- the
  trick of :mod:`fedopt_kernels.distributed.aggregate`'s ``"ordered"`` mode, with
  chunks in place of ranks.  ``p_i`` are the round's normalised weights, known before
  any client trains (data sizes or uniform, :func:`round_weights`).  ``||D_i||^2``
  depends on row ``i`` alone and ``||D||^2`` on the final sum alone, so the statistics
  FedExP and ASNES read are the unchunked round's too: **the result equals the
  unchunked round bit for bit** (tested for every algorithm above, both engines).
* **left-out clients: a stated bound.**  A NaN/Inf update (``nonfinite``) gets weight 0
  in its chunk (the chunk is redone from the running sum before it) and the final sum
  is rescaled by ``sum p / sum p_kept``; the unchunked kernel instead re-sums every row
  with the rescaled weights.  The two differ by rounding only: elementwise
  ``|D_chunked - D| <= (C + 2) u sum_i |p'_i D_i|`` (``u = 2^-24`` in fp32, ``p'`` the
  rescaled weights; asserted by the tests).
* **SCAFFOLD's control variates** are folded the same way
  (:meth:`~fedopt_kernels.fl.engine.client.ScaffoldState.fold_chunk`): each chunk's
  ``c_i^+`` are staged and ``sum dc_i`` accumulated in the round's client order, then
  committed with the round -- the same additions, the same bits.

* **floating buffers** (BatchNorm statistics) are folded beside the updates: each
  chunk's buffer rows, with the round's weights (``max_weight_share`` included) and the
  clients its update fold excluded, go into
  :class:`~fedopt_kernels.server.weighting.BufferAverage`, the running form of the
  rule every round applies (:func:`~fedopt_kernels.server.weighting.average_buffers`,
  a row at a time in round order): the unchunked round's buffers bit for bit, with
  clients left out as NaN/Inf too (the exclusion only zeroes a weight; the total is
  divided at the end).  A client whose training failed weighs the others as the update
  fold does: the round's capped weights without it, not capped again.

FedLAW (and any aggregator that ranks or re-weights clients from all updates at once)
cannot fold: its clients still train in chunks, their updates kept in the round's
``[C, N]`` table, which ``client_state_dir`` puts in a memory-mapped file.

The fold is a :class:`~fedopt_kernels.server.aggregation.RunningAggregate`: the round
(:class:`~fedopt_kernels.server.ServerRound`) hands it to the server optimizer's step as
its aggregation (``ServerOptimizer.step(..., aggregator=)``), with the weights it was
built with (the round's, formed once before the clients trained).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.aggregate import AggregateStats, aggregate_runner, robust_weights
from ...ops.validation import acc_dtype
from ...server.aggregation import RoundAggregate, RunningAggregate, normalize_weights

__all__ = ["FOLDABLE", "RoundFold", "chunk_clients", "parse_bytes"]

# algorithms whose server step starts from the round's weighted sum of updates
FOLDABLE = ("fedavg", "fedprox", "scaffold", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedexp", "asnes")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_bytes(value) -> int:
    """``4G``, ``512MB``, ``1.5GiB`` or a number of bytes -> bytes (binary units)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 4G, 512M or a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        n = float(value)
    else:
        text = str(value).strip().lower().replace(" ", "")
        i = len(text)
        while i and not (text[i - 1].isdigit() or text[i - 1] == "."):
            i -= 1
        unit = text[i:]
        if unit not in _UNITS or not text[:i]:
            raise ValueError(f"expected a size such as 4G, 512M or a number of bytes, got {value!r}")
        try:
            n = float(text[:i]) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"expected a size such as 4G, 512M or a number of bytes, got {value!r}") from None
    if not (n >= 1 and n < float("inf")):
        raise ValueError(f"a memory budget must be at least 1 byte, got {value!r}")
    return int(n)


def chunk_clients(budget: int, per_client: int, fixed: int = 0) -> int:
    """How many clients fit ``budget`` bytes at ``per_client`` bytes each after
    ``fixed`` bytes (at least 2: the batched engine never trains a lone client)."""
    return max(2, (int(budget) - int(fixed)) // max(int(per_client), 1))


class RoundFold(RunningAggregate):
    """The round's running weighted sum of updates, chunk by chunk (module docstring).

    Args:
        optimizer: the round's :class:`~fedopt_kernels.server.ServerOptimizer` (its
            backend and ``nonfinite`` rule; ``max_client_norm`` must be None).
        weights: the clients' weights in round order: the round's
            :class:`~fedopt_kernels.server.aggregation.CheckedWeights`
            (:meth:`~fedopt_kernels.server.ServerRound.weights`, only normalised here),
            None for uniform.
        num_clients: ``C``, the clients that will be folded.
        numel, device, dtype: the updates' length, device and dtype (fp32 / fp64: the
            running sum enters the kernel as a client, so it must share their dtype).
    """

    def __init__(self, optimizer, weights, num_clients: int, numel: int, device, dtype):
        if optimizer.max_client_norm is not None:
            raise ValueError("a folded round cannot bound client norms (max_client_norm needs every update)")
        acc = acc_dtype(dtype)
        if acc != dtype:
            raise ValueError(f"a folded round needs fp32/fp64 updates, got {dtype}")
        self.C, self.numel, self.device, self.dtype = int(num_clients), int(numel), torch.device(device), dtype
        self.p, self.valid = normalize_weights(weights, self.C, self.device, acc)
        self.run = aggregate_runner(optimizer.backend, self.device)
        self.exclude = optimizer.nonfinite == "exclude"
        self.t: Optional[torch.Tensor] = None  # the running sum
        self._spare = torch.empty(self.numel, dtype=acc, device=self.device)
        self._one = torch.ones(1, dtype=acc, device=self.device)
        self._q = torch.full((self.C,), float("nan"), dtype=acc, device=self.device)
        self._kept: list = []  # positions (in round order) of the clients folded
        # on the CPU reading a flag is free; on an accelerator the redo decides on the device
        self._host_decides = self.device.type == "cpu"

    def add(self, rows: torch.Tensor, positions) -> torch.Tensor:
        """Fold ``rows`` (``[k, N]``): the updates of the clients at ``positions``
        (ascending, in round order; a client that could not train has no row and is
        left out of the round, see :meth:`finish`).  Returns their ``[k]`` bool mask of
        updates left out (NaN/Inf)."""
        positions = [int(i) for i in positions]
        k = rows.shape[0]
        if k != len(positions):
            raise ValueError(f"{k} rows for {len(positions)} positions")
        if k == 0:
            return torch.zeros(0, dtype=torch.bool, device=self.device)
        if (self._kept and positions[0] <= self._kept[-1]) or positions[-1] >= self.C:
            raise ValueError("positions must follow the clients already folded, within the round")
        index = torch.tensor(positions, device=self.device)
        w = self.p.index_select(0, index)
        src = list(rows.unbind(0))
        if self.t is not None:
            src = [self.t] + src
            w_all = torch.cat([self._one, w])
        else:
            w_all = w
        q, _ = self.run(src, w_all, 1.0, self._spare, None)
        if self.t is not None:
            q = q[1:]
        bad = ~torch.isfinite(q) if self.exclude else torch.zeros(k, dtype=torch.bool, device=self.device)
        if self.exclude:
            kept_w = torch.where(bad, torch.zeros_like(w), w)
            again = torch.cat([self._one, kept_w]) if self.t is not None else kept_w
            if self._host_decides:
                if bool(bad.any()):
                    self.run(src, again, 1.0, self._spare, None)
            else:
                self.run(src, again, 1.0, self._spare, ~bad.any())
        if self.t is None:
            self.t, self._spare = self._spare, torch.empty_like(self._spare)
        else:
            self.t, self._spare = self._spare, self.t
        self._q.index_copy_(0, index, q.to(self._q.dtype))
        self._kept += positions
        return bad

    def finish(self, out: torch.Tensor) -> RoundAggregate:
        """Write the mean update into ``out`` and describe the round as the unchunked
        aggregation of the clients folded would
        (:class:`~fedopt_kernels.server.aggregation.RoundAggregate`, in their order)."""
        if not self._kept:
            raise ValueError("the fold holds no client")
        p, q = self.p, self._q
        if len(self._kept) < self.C:  # clients that could not train: out of the round, the rest renormalised
            index = torch.tensor(self._kept, device=self.device)
            p, q = p.index_select(0, index), q.index_select(0, index)
            p = p / p.sum()
        eff, excluded = robust_weights(p, q, self.exclude, None)
        zero = torch.zeros((), dtype=p.dtype, device=self.device)
        kept_total = torch.where(excluded, zero, self.p.index_select(
            0, torch.tensor(self._kept, device=self.device))).sum()
        # the folded sum used the round's p: rescale to the clients kept (exactly 1 when none was left out)
        ratio = torch.where(kept_total != 0, self.p.sum() / kept_total, zero) if len(self._kept) == self.C else \
            torch.where(kept_total != 0, 1.0 / kept_total, zero)
        _, Q = self.run([self.t], ratio.reshape(1).to(self.t.dtype), 1.0, out, None)
        stats = AggregateStats(q, Q, excluded, eff, excluded.all())
        return RoundAggregate.of(p, stats, self.valid, None)

    def aggregator(self):
        """An :class:`~fedopt_kernels.server.aggregation.Aggregator` that hands the
        server step this fold (the updates it is called with are ignored: None)."""
        fold = self

        def folded(optimizer, updates, weights, out):
            return fold.finish(out)

        return folded

