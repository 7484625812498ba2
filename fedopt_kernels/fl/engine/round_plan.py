"""How a round's clients are laid out for the batched engine: padded batch lengths,
groups and their shapes -- decided before any arithmetic, by :class:`RoundPlanner`.

The batched engine (:mod:`~fedopt_kernels.fl.engine.batched`) trains a round's clients as a few
batched calls per local step; this module decides which clients share a call, at which
padded batch length, in how many rows.  It only counts: sizes, memory and FLOPs.

**Padded lengths.**  Padding costs arithmetic: with 100 clients of ``digits`` most hold
~15 samples, the largest 32.  A few padded batch lengths ("levels") are chosen once
from the batch sizes of ALL clients (:func:`batch_bins`: fewest padded samples, plus a
penalty for each extra batched call per step: its fixed cost -- Python, dispatch,
the gather and the fused step -- in samples of the model's arithmetic, against a
round's padded samples; so a small model on few clients per round trains as one
level, a larger one or a larger round as several); a client is padded to the smallest
level that holds its batch, and the clients of one level form one batched call per
local step.  A loss that cannot be masked, or a model with BatchNorm layers (batch
statistics would see the padding), gets one level per batch size.  So a
client's padded length -- and with it all of its arithmetic -- depends on its own size
alone, never on which clients share its round, its group or
(``fl.distributed_simulation``) its rank.

**Fixed shapes.**  A real run samples new clients every round, so the number of a
round's clients at each level changes from round to round.  A group's rows are padded
up to a fixed ladder of counts (:func:`padded_count`: 2, 3, 4, 6, 8, 12, ...; or the
most clients the level can hold in a round), the padding rows being copies of the
group's first client whose results are dropped.  So the shapes of a run come from a
small fixed set -- a few per level -- and each is traced once (by the engine,
:mod:`~fedopt_kernels.fl.engine.batched`) and then serves
every round that meets it, whatever clients are drawn (``trace_counts`` records
this; tracing costs a few eager rounds, once per shape).

**Groups (memory).**  ``C`` copies of the model, their gradients, batches and
activations must fit.  ``client_batch`` bounds how many clients are trained at once
(``0``: chosen from the free memory -- ``/proc/meminfo``'s MemAvailable or
``os.sysconf`` on CPU, ``torch.cuda.mem_get_info`` on CUDA -- and a conservative
per-client estimate, :func:`estimate_client_bytes`); each level is cut into groups of at
most that many clients, computed one after another.  The result is the same as with
one group: every row's arithmetic depends only on its own client (above), and a group
is never a single client -- a lone client is computed beside a copy of itself, because
batch-1 matrix products take another BLAS path than batched ones.  On
CPU this makes grouped results bitwise identical to one group (tested); batched GEMM
libraries on GPUs may pick kernels by batch count, so there expect fp32 rounding
differences.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

__all__ = ["RoundPlanner", "Group", "batch_bins", "padded_count", "estimate_client_bytes", "available_memory",
           "activation_numel"]


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on ``device`` (a best effort, no psutil)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(cached, 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not POSIX: assume 4 GiB
        return 4 << 30


def activation_numel(model: nn.Module, sample: torch.Tensor) -> int:
    """Elements of every module output for one sample (a proxy for what autograd keeps)."""
    total = [0]

    def hook(_module, _inputs, output):
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor):
                total[0] += t.numel()

    handles = [m.register_forward_hook(hook) for m in model.modules() if not any(True for _ in m.children())]
    try:
        with torch.no_grad():
            out = model(sample)
        total[0] += out.numel() if isinstance(out, torch.Tensor) else 0
    finally:
        for h in handles:
            h.remove()
    return total[0]


def estimate_client_bytes(numel: int, batch: int, input_numel: int, activation_numel: int, *, element_size: int = 4,
                          extra_rows: int = 0) -> int:
    """A conservative estimate of the memory one client of a group needs: its rows of
    ``X``, ``G`` and the per-parameter gradients ``vmap`` returns, weight transposes and
    temporaries (6 rows of ``N``, plus ``extra_rows`` for momentum, FedProx, SCAFFOLD),
    its batch, and its activations with their gradients (4 x the module outputs), all
    times 1.5."""
    rows = (6 + extra_rows) * numel
    per_batch = batch * (input_numel + 4 * activation_numel + 8)
    return int(1.5 * element_size * (rows + per_batch))


def batch_bins(batch_sizes: Sequence[int], *, penalty: float = 1 / 16) -> List[tuple]:
    """Bins ``[(rows, B), ...]`` of clients by batch size, largest ``B`` first: each bin
    pads its clients' batches to its largest one, ``B``.

    A bin costs its padded samples ``len(rows) * B`` plus ``penalty * C * max(b)``
    (one more batched call per local step); the bins minimise the total (dynamic
    programming over the sorted distinct sizes).  ``penalty=inf`` gives one bin; ``0``
    one bin per distinct size (no padding at all).  The bins depend on the round's batch
    sizes only, never on how its clients are later grouped for memory.
    """
    bs = list(batch_sizes)
    values = sorted(set(bs))
    if math.isinf(penalty):
        return [(list(range(len(bs))), values[-1])]
    counts = [bs.count(v) for v in values]
    extra = penalty * len(bs) * values[-1]
    best, cut = [0.0] + [math.inf] * len(values), [0] * (len(values) + 1)
    for j in range(1, len(values) + 1):
        n = 0
        for i in range(j, 0, -1):  # a bin of values[i-1 .. j-1], padded to values[j-1]
            n += counts[i - 1]
            cost = best[i - 1] + n * values[j - 1] + extra
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    bins, j = [], len(values)
    while j > 0:
        lo, hi = values[cut[j]], values[j - 1]
        bins.append(([r for r, b in enumerate(bs) if lo <= b <= hi], hi))
        j = cut[j]
    return bins


def padded_count(n: int, limit: Optional[int] = None) -> int:
    """The rows of a group of ``n`` clients: the smallest of 2, 3, 4, 6, 8, 12, 16, 24,
    ... (``2^k`` and ``3 * 2^(k-1)``: at most a third of the rows are padding) that
    holds ``n``, but no more than ``limit`` (the most clients the group can ever have
    in this run) when that still holds ``n`` -- never below 2 (a lone client is
    computed beside a copy of itself, see :class:`~fedopt_kernels.fl.engine.batched.BatchedTrainer`)."""
    if n < 1:
        raise ValueError(f"a group needs at least one client, got {n}")
    rows = 2
    while rows < n:
        rows = rows * 3 // 2 if rows & (rows - 1) == 0 else rows * 4 // 3
    if limit is not None and n <= limit < rows:
        rows = limit
    return max(rows, 2)


class Group:
    """Rows of the round trained together: ``rows`` (indices into the round's clients;
    the first ``real`` are distinct, the rest copies of the first, padding the group to
    :func:`padded_count` rows), the padded batch length and the loss form (``"soft"``,
    ``"masked"`` or ``"plain"``, see :class:`~fedopt_kernels.fl.engine.batched.BatchedTrainer`)."""

    __slots__ = ("rows", "real", "batch", "mode")

    def __init__(self, rows: List[int], real: int, batch: int, mode: str):
        self.rows, self.real, self.batch, self.mode = rows, real, batch, mode



class RoundPlanner:
    """The groups of every round of a run (see the module docstring).

    Args:
        model: the simulation's module (its FLOPs and activations are counted on one
            sample; its parameters are not used).
        sample: one training input, ``[1, ...]``, on the training device.
        batch_size: the local batch size (a client of ``n`` samples trains on batches
            of ``min(batch_size, n)``).
        numel, element_size: the flat parameter vector's length and element size.
        extra_rows: ``[N]`` rows a client keeps besides its parameters and gradient
            (momentum, FedProx's anchor, SCAFFOLD's control variate).
        can_pad: whether a batch may be padded (the loss can be masked and no layer
            mixes a batch's samples); False: one level per batch size.
        soft_targets: whether the loss is the soft-target cross-entropy (every group's
            mode is then ``"soft"``; else ``"plain"`` for unpadded levels, ``"masked"``).
        client_batch: most clients per group (0: from the free memory).
        population_sizes: every client's number of samples (the padded batch lengths
            are chosen once from them, so a client's arithmetic never depends on which
            clients share its round); None: chosen per round.
        round_clients: how many clients a round trains (the run's ``per_round``): the
            levels weigh an extra batched call against a round's work, and a level's
            groups are never padded past what a round can put in it; None: the
            levels use the fixed :attr:`bin_penalty`.
        call_cost_flops: the fixed cost of one batched call per local step, in floating
            point operations of the model's arithmetic (None: :attr:`CALL_COST_FLOPS`
            of the device type).
    """

    #: The fixed cost of a batched call (a group's local step: Python and op dispatch,
    #: the gradient gather, the fused step) in FLOPs of arithmetic it could have done
    #: instead.  CPU: fitted on 2 cores to the measured best levels of the MLP and the
    #: SimpleCNN on digits at 20 of 100 and 100 of 200 clients per round (about 2-5 ms of
    #: a ~50 GFLOP/s core pair).  CUDA: an estimate (about 1 ms of launches against tens
    #: of TFLOP/s), not yet measured on a GPU.
    CALL_COST_FLOPS = {"cpu": 2.5e8, "cuda": 5e10}

    def __init__(self, model: nn.Module, sample: torch.Tensor, *, batch_size: int, numel: int, element_size: int = 4,
                 extra_rows: int = 0, can_pad: bool = True, soft_targets: bool = False, client_batch: int = 0,
                 population_sizes: Optional[Sequence[int]] = None, round_clients: Optional[int] = None,
                 call_cost_flops: Optional[float] = None):
        if round_clients is not None and int(round_clients) < 1:
            raise ValueError(f"round_clients must be a positive number of clients, got {round_clients!r}")
        self.model, self.sample = model, sample
        self.batch_size, self.numel = int(batch_size), int(numel)
        self.element_size, self.extra_rows = int(element_size), int(extra_rows)
        self.can_pad, self.soft_targets = bool(can_pad), bool(soft_targets)
        self.client_batch = int(client_batch)
        self.round_clients = int(round_clients) if round_clients is not None else None
        self.bin_penalty = 1 / 16  # see batch_bins; the levels' penalty without round_clients
        self.device = sample.device
        if call_cost_flops is None:  # an accelerator not listed: like CUDA, launches against fast arithmetic
            call_cost_flops = self.CALL_COST_FLOPS.get(self.device.type, self.CALL_COST_FLOPS.get("cuda", 5e10))
        self.call_cost_flops = float(call_cost_flops)
        self._sample_flops: Optional[float] = None
        self._activation: Optional[int] = None
        self._group_caps: Dict[int, int] = {}  # clients per group at a padded length, fixed once per run
        self.last_group_size: Optional[int] = None  # the most real clients in a group of the last plan
        self.set_population(population_sizes)

    def _counting(self, count, fallback):
        """``count(model, sample)`` in eval mode (an estimate: ``fallback`` if it fails)."""
        was = self.model.training
        self.model.eval()
        try:
            return count(self.model, self.sample)
        except Exception:  # noqa: BLE001 - an estimate only; the round reports real errors
            return fallback
        finally:
            self.model.train(was)

    def client_bytes(self, batch: int) -> int:
        """The estimated memory of one client of a group (:func:`estimate_client_bytes`)."""
        if self._activation is None:
            self._activation = self._counting(activation_numel, 0)
        return estimate_client_bytes(self.numel, batch, math.prod(self.sample.shape[1:]), self._activation,
                                     element_size=self.element_size, extra_rows=self.extra_rows)

    def group_size(self, clients: int, batch: int) -> int:
        """Clients per group for a round of ``clients`` clients and padded batch ``batch``:
        ``client_batch``, or (0) as many as half the free memory holds (80% on CUDA) at
        :meth:`client_bytes` each."""
        if self.client_batch > 0:
            return max(1, min(self.client_batch, clients))
        device = self.device
        budget = available_memory(device) * (0.8 if device.type == "cuda" else 0.5)
        return max(1, min(clients, int(budget // max(self.client_bytes(batch), 1))))

    def levels(self, sizes: Sequence[int]) -> List[tuple]:
        """``[(B, uniform), ...]`` ascending: the padded batch lengths for clients of
        ``sizes`` samples (the bins of :func:`batch_bins`; one per batch size when the
        loss cannot be masked); ``uniform``: a single batch size pads to ``B`` (no
        padding, the loss as given).

        An extra level costs one more batched call per local step of every round:
        ``call_cost_flops / sample_flops`` samples of arithmetic, against the
        ``round_clients * max(b)`` padded samples of a round's step at the largest
        length (so :func:`batch_bins`' ``penalty`` is their ratio; the population's
        padding stands for a round's, scaled).  Without ``round_clients``:
        :attr:`bin_penalty`."""
        bs = [min(self.batch_size, n) for n in sizes]
        if not self.can_pad:
            penalty = 0.0
        elif self.round_clients is None:
            penalty = self.bin_penalty
        else:
            penalty = self.call_cost_flops / self.sample_flops() / (self.round_clients * max(bs))
        bins = batch_bins(bs, penalty=penalty)
        return sorted((B, len({bs[r] for r in rows}) == 1) for rows, B in bins)

    def set_population(self, sizes: Optional[Sequence[int]]) -> None:
        """Fix the padded lengths (:meth:`levels`) and each level's most clients per
        round from every client's number of samples (None: chosen per round)."""
        self._levels = self.levels(sizes) if sizes is not None else None
        # the most clients of a round each level can hold: no group of it is padded past that
        self._level_limit: Dict[int, int] = {}
        for n in sizes or ():
            B = self._level_of(min(self.batch_size, n), self._levels)[0]
            self._level_limit[B] = self._level_limit.get(B, 0) + 1
        if self.round_clients is not None:
            self._level_limit = {B: min(k, self.round_clients) for B, k in self._level_limit.items()}

    def sample_flops(self) -> float:
        """FLOPs of one sample's local step: 3x the forward's (forward, and a backward
        of about twice that), counted once with torch's FLOP formulas on one training
        sample (:func:`~fedopt_kernels.fl.engine._flops.forward_flops`: matrix products and
        convolutions; at least ``6 N`` for a model of ``N`` parameters)."""
        if self._sample_flops is None:
            from ._flops import forward_flops

            forward = self._counting(forward_flops, 0)
            self._sample_flops = float(max(3 * forward, 6 * self.numel, 1))
        return self._sample_flops

    def _level_of(self, b: int, levels: List[tuple]) -> tuple:
        """The level a client of batch size ``b`` is padded to (its own size when the
        loss cannot be masked and no level has exactly that size)."""
        return next((lv for lv in levels if lv[0] >= b and (self.can_pad or lv[0] == b)), (b, True))

    def _group_cap(self, clients: int, batch: int) -> int:
        """Clients per group at padded length ``batch``: :meth:`group_size` for a round
        of ``round_clients`` (or ``clients``) clients, decided once per run so that the
        groups' shapes do not follow the free memory from round to round."""
        cap = self._group_caps.get(batch)
        if cap is None:
            cap = self.group_size(self.round_clients or clients, batch)
            if self.round_clients is not None:
                self._group_caps[batch] = cap
        return cap

    def plan(self, sizes: Sequence[int]) -> List[Group]:
        """The groups of a round whose clients hold ``sizes`` samples (see the module
        docstring): clients by padded batch length (:meth:`levels` of the population
        when known, else of this round), each level cut into groups of at most
        :meth:`_group_cap` clients, each group padded to :func:`padded_count` rows with
        copies of its first client (so a lone client is doubled)."""
        bs = [min(self.batch_size, n) for n in sizes]
        levels = self._levels if self._levels is not None else self.levels(sizes)
        by_level: Dict[tuple, List[int]] = {}
        for r, b in enumerate(bs):
            by_level.setdefault(self._level_of(b, levels), []).append(r)
        groups, self.last_group_size = [], 0
        for (batch, uniform), rows in sorted(by_level.items(), reverse=True):
            mode = "soft" if self.soft_targets else "plain" if uniform else "masked"
            size = self._group_cap(len(rows), batch)
            limit = min(size, self._level_limit.get(batch, size))
            for start in range(0, len(rows), size):
                chunk = rows[start:start + size]
                real = len(chunk)
                self.last_group_size = max(self.last_group_size, real)
                chunk = chunk + chunk[:1] * (padded_count(real, limit) - real)
                groups.append(Group(chunk, real, batch, mode))
        return groups
