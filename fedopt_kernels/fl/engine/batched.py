"""The batched client engine: all of a round's clients as ONE computation.

With small models a simulated round costs kernel launches and Python overhead, not
arithmetic: the sequential engine runs ``C x tau`` tiny forward/backward passes one
after another.  The batched engine trains the round's ``C`` clients together:

* **parameters**: the clients' flat vectors are the rows of one ``[C, N]`` tensor ``X``
  -- the rows of the round's update tensor themselves (``Simulation.updates``): each
  row starts as a copy of ``x_global``, is trained in place, and is finally turned into
  ``D_i = x_global - x_end_i`` in place, so the updates reach the server's fused
  aggregation without any copy.  The model sees a row as views
  (:meth:`~fedopt_kernels.utils.FlatLayout.unflatten`'s layout: ``named_parameters()``
  order), batched over the clients.
* **gradients**: ``vmap(grad(loss of functional_call(model, views, batch)))`` over the
  clients (:mod:`torch.func`'s ``vmap``; ``grad`` is
  :func:`~fedopt_kernels.fl.engine.functorch_grad.grad_with_aux`, torch's transform without
  its import of ``torch._dynamo``); the per-parameter gradients are concatenated into a
  preallocated ``[C, N]`` buffer ``G``.  A group's vmapped gradient is traced once
  per shape (see *Fixed shapes*), at its first sighting, with
  :func:`~fedopt_kernels.fl.engine.aten_trace.trace_aten` (what ``make_fx`` records, without
  importing the compiler: a short run imports neither ``torch._dynamo`` nor
  ``torch._inductor``) into a graph
  of the plain ATen ops the transforms dispatch to (batched matmuls ...) and the graph
  runs instead: the same ops, the same bits (tested), without the per-op cost of the
  transforms -- a third of a small model's step.  In padded groups on CPU its
  matrix products then run on each client's real samples only
  (:func:`~fedopt_kernels.fl.engine.graph_passes.ragged_products`; ``trainer.ragged =
  False`` keeps the padded ``bmm``): half the arithmetic of the MLP on digits, the
  same values up to a GEMM's rounding, and a client's bits still its own (tested);
  the bias, ReLU and ReLU gradient around them run on the real rows too, in place
  (:func:`~fedopt_kernels.fl.engine.graph_passes.fused_epilogues`, ``trainer.fuse``; the same
  bits).
  The graph writes its gradients into ``G`` itself
  (:func:`~fedopt_kernels.fl.engine.graph_passes.gradients_into_buffer`: the weight
  gradients computed there, no fresh tensor and no concatenation; the same bits).
  ``trainer.trace = False``
  turns it off (a model whose Python ``forward`` changes with state outside its
  tensors would need that); a failed trace turns it off and is recorded in
  ``trainer.trace_failure``.
* **corrections and step**: FedProx's ``mu (x - x0)`` (``x0 = x_global`` broadcast) and
  SCAFFOLD's ``c - c_i`` rows are added to ``G`` -- before the step, so inside FedNAR's
  clip, as in the sequential engine -- then one
  :func:`~fedopt_kernels.ops.nar_step_batched_` steps every row with its own norm, clip
  and skip flag (per-row learning rates when FedDecay counts epochs, whose length
  differs between clients).
* **statistics** (loss, clipped steps, norms of clipped steps, skipped steps) stay on the
  device and are reduced once per group of clients: no host sync inside the loop.

**Batches.**  Client ``i``'s batch of local step ``k`` is exactly the sequential
engine's: the same generator (seeded :func:`~fedopt_kernels.fl.seeds.batch_seed`), the same
``randperm`` per local epoch, the same dropped ragged tail.  All batches of a round are
drawn up front on the CPU into a ``[tau, C, B]`` index table (moved to the device once);
each step gathers its inputs with one ``index_select`` into ``[C, B, ...]``.  A client
holding fewer than ``batch_size`` samples trains on batches of its size ``b_i < B``
(``B`` = its padded length, below): its row is padded with one of its own samples
and the loss is ``sum_j w_ij l_ij`` with ``w_ij = 1/b_i`` on real samples and ``0`` on
padding -- the sequential mean over its batch, whose gradient the padding cannot touch
(``0 * finite = 0``).  This needs per-sample losses: the torch losses whose ``"mean"`` is
the plain mean of per-element losses (cross-entropy and NLL without class weights,
MSE, L1, smooth L1, Huber, BCE, BCE-with-logits, soft margin, KL divergence) get them
from a ``reduction="none"`` copy; any other ``loss_fn`` is called as given under
``vmap`` on unpadded batches, the clients being grouped by batch size.

**Padded lengths, fixed shapes, groups.**  Which clients share a batched call, at
which padded batch length and in how many rows is decided before any arithmetic by
:class:`~fedopt_kernels.fl.engine.round_plan.RoundPlanner` (see :mod:`~fedopt_kernels.fl.engine.round_plan`):
a few padded lengths ("levels") chosen once from ALL clients' sizes, so a client's
padded length -- and with it all of its arithmetic -- depends on its own size alone,
never on which clients share its round, its group or (``fl.distributed_simulation``)
its rank;
group row counts from a fixed ladder, so a real run meets a few shapes, each traced
once (``trace_counts``); groups bounded by ``client_batch`` or the free memory, with
the same result as one group: every row's arithmetic depends only on its own client,
and a group is never a single client -- a lone client is computed beside a copy of
itself, because batch-1 matrix products take another BLAS path than batched ones.  On
CPU this makes grouped results bitwise identical to one group (tested); batched GEMM
libraries on GPUs may pick kernels by batch count, so there expect fp32 rounding
differences.

**Fallback.**  Models ``vmap`` cannot batch -- BatchNorm (or InstanceNorm) tracking
running statistics in training mode, data-dependent Python control flow, ``.item()``
inside ``forward`` -- run on the sequential engine instead, with a one-line
:class:`EngineFallbackWarning` and the reason recorded in the results' meta: BatchNorm
is detected up front, anything else by the first batched round failing (it is then
redone sequentially; a failing round only ever writes scratch buffers).

**Random layers.**  Dropout and other random ops run under ``vmap(randomness=
"different")`` from the global RNG seeded per round and group: reproducible for a given
seed and ``client_batch``, but the masks are not the sequential engine's (which seeds
each client's own stream) -- equal in distribution, not in value.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ...ops import nar_step_batched_
from ...ops.ragged_bmm import ragged_bmm_uses_blas, ragged_graph_ops
from ...ops.validation import acc_dtype
from ...utils import parameters_layout
from .aten_trace import drop_values, trace_aten
from .client import LocalConfig, RoundStats, ScaffoldState
from .functorch_grad import grad_with_aux
from .graph_passes import (GRADIENT_BUFFER, RAGGED_LENGTHS, channels_last_pools, drop_identity_ops, fused_epilogues,
                           gradients_into_buffer, graph_signature, ragged_products, sample_dims)
from .round_plan import Group, RoundPlanner
from ..seeds import dropout_seed

__all__ = ["BatchedTrainer", "BatchedUnsupported", "EngineFallbackWarning", "unsupported_reason",
           "per_sample_loss", "client_batches"]


# torch losses whose reduction="mean" is the plain mean of the reduction="none" output
_MEAN_OF_ELEMENTS = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss,
                     nn.SoftMarginLoss, nn.KLDivLoss)


class EngineFallbackWarning(UserWarning):
    """The batched engine cannot run this model; the sequential engine runs it."""


class BatchedUnsupported(RuntimeError):
    """Raised by :meth:`BatchedTrainer.train_round` when the model fails under ``vmap``
    in its first round (the caller falls back to the sequential engine)."""


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot be trained under ``vmap`` (None when nothing is known to stop it).

    Only what can be seen without running it: normalisation layers that update running
    statistics in training mode (their in-place buffer updates cannot be batched, and
    the sequential engine averages those buffers).
    """
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            where = f"module {name!r}" if name else "the model"
            return (f"{where} ({type(m).__name__}) updates running statistics in training mode, "
                    "which torch.func.vmap cannot batch")
    return None


def per_sample_loss(loss_fn) -> Optional[nn.Module]:
    """A ``reduction="none"`` copy of ``loss_fn`` when its ``"mean"`` is the plain mean
    of the per-element losses (so padded batches can be masked), else None."""
    if not isinstance(loss_fn, nn.modules.loss._Loss) or getattr(loss_fn, "reduction", None) != "mean":
        return None
    if type(loss_fn) in (nn.CrossEntropyLoss, nn.NLLLoss):
        # class weights make "mean" a weighted mean; an ignore_index that can occur
        # (labels are >= 0) removes samples from the denominator
        if loss_fn.weight is not None or loss_fn.ignore_index >= 0:
            return None
    elif type(loss_fn) not in _MEAN_OF_ELEMENTS:
        return None
    if getattr(loss_fn, "_forward_hooks", None) or getattr(loss_fn, "_forward_pre_hooks", None):
        return None
    clone = copy.copy(loss_fn)
    clone.reduction = "none"
    return clone


def client_batches(indices: torch.Tensor, seed: int, batch_size: int, steps: int) -> torch.Tensor:
    """``[steps, b]`` sample indices of a client's local steps, ``b = min(batch_size, n)``:
    exactly the batches of :meth:`LocalTrainer._batches` (a fresh ``randperm`` of the
    client's samples per local epoch from a generator seeded ``seed``, the ragged tail of
    each epoch dropped)."""
    indices = indices.cpu()
    n = indices.numel()
    if n == 0:
        raise ValueError("a client without samples cannot train")
    bs = min(batch_size, n)
    per_epoch = n // bs
    generator = torch.Generator().manual_seed(seed)
    # one randperm per epoch (the generator's stream), then ONE gather for all epochs:
    # a small client draws a permutation every step, and per-epoch indexing was ~2/3 of
    # this function's time (3 -> 1 ms for a round of 20 digits clients)
    perms = torch.stack([torch.randperm(n, generator=generator) for _ in range(-(-steps // per_epoch))])
    return indices[perms[:, :per_epoch * bs]].view(-1, bs)[:steps]


def _soft_target_smoothing(loss_fn) -> Optional[float]:
    """The label smoothing of a plain ``nn.CrossEntropyLoss`` (mean, no class weights, no
    reachable ignore_index), whose loss is then ``-(log_softmax(out) * T).sum()`` with
    weighted soft targets ``T``; None for any other loss."""
    if (type(loss_fn) is nn.CrossEntropyLoss and loss_fn.reduction == "mean" and loss_fn.weight is None
            and loss_fn.ignore_index < 0 and not loss_fn._forward_hooks and not loss_fn._forward_pre_hooks):
        return float(loss_fn.label_smoothing)
    return None


class BatchedTrainer:
    """Trains a round's clients together (see the module docstring).

    The loss of a client is computed in one of three forms, chosen per round:

    * ``"soft"`` (``nn.CrossEntropyLoss``, the simulator's default): ``-(log_softmax(out)
      * T).sum()`` with targets ``T = w_j onehot(y_j)`` (label smoothing included) built
      outside ``vmap`` -- cheaper than ``cross_entropy`` under ``vmap`` (whose batching
      rule is a Python decomposition) and the same gradient;
    * ``"masked"`` (other losses with per-sample values, rounds with padded batches):
      ``sum_j w_j l_j`` of the ``reduction="none"`` loss;
    * ``"plain"``: ``loss_fn(out, y)`` as given (unpadded batches of one size).

    Args:
        model: a module of the simulation's architecture, called through
            :func:`torch.func.functional_call` (its own parameters are only used to
            count activations for the memory estimate).
        loss_fn: ``loss_fn(outputs, labels)``, a mean over the batch.
        x_train, y_train: the training set on the device.
        config: the :class:`LocalConfig` of the sequential engine.
        num_classes: the number of classes (for the soft targets; None: from ``y_train``).
        buffers: the module's buffers to use, by name (the global model's, which the
            simulator updates in place); None: the module's own.
        seed: the simulation's seed (random layers).
        client_batch, population_sizes, round_clients, call_cost_flops: how rounds are
            cut into groups, see :class:`~fedopt_kernels.fl.engine.round_plan.RoundPlanner`
            (the trainer's :attr:`planner`).
    """

    def __init__(self, model: nn.Module, loss_fn, x_train: torch.Tensor, y_train: torch.Tensor, config: LocalConfig,
                 *, num_classes: Optional[int] = None, buffers: Optional[Dict[str, torch.Tensor]] = None,
                 client_batch: int = 0, seed: int = 0, population_sizes: Optional[Sequence[int]] = None,
                 round_clients: Optional[int] = None, call_cost_flops: Optional[float] = None):
        from torch.func import vmap

        grad = grad_with_aux  # torch.func.grad(f, has_aux=True), without importing torch._dynamo

        self.model = model
        self.loss_fn = loss_fn
        self.x_train, self.y_train = x_train, y_train
        self.config = config
        self.seed = int(seed)
        self.layout = parameters_layout(model)
        self.numel = self.layout.numel
        self.buffers = dict(model.named_buffers()) if buffers is None else buffers
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        self._slots = [(s.name, s.offset, s.numel, s.shape, s.name in trainable) for s in self.layout.slots]
        self._frozen = any(not t for *_, t in self._slots)
        self._per_sample = per_sample_loss(loss_fn)
        self._soft_targets = None
        smoothing = _soft_target_smoothing(loss_fn)
        if smoothing is not None and y_train.dim() == 1 and x_train.is_floating_point():
            k = int(num_classes) if num_classes is not None else int(y_train.max()) + 1
            eye = torch.eye(k, device=x_train.device, dtype=self.layout.dtype)
            self._soft_targets = eye * (1.0 - smoothing) + smoothing / k if smoothing else eye
        # padding is invisible to a client's loss only if the loss can be masked and no
        # layer mixes the samples of a batch (BatchNorm on batch statistics)
        self._mixes_batch = next((type(m).__name__ for m in model.modules()
                                  if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
        self._can_pad = (self._soft_targets is not None or self._per_sample is not None) and not self._mixes_batch
        extra_rows = int(config.momentum != 0.0) + int(config.prox_mu != 0.0) + int(config.scaffold)
        self.planner = RoundPlanner(model, x_train[:1], batch_size=config.batch_size, numel=self.numel,
                                    element_size=self.layout.dtype.itemsize, extra_rows=extra_rows,
                                    can_pad=self._can_pad, soft_targets=self._soft_targets is not None,
                                    client_batch=client_batch, population_sizes=population_sizes,
                                    round_clients=round_clients, call_cost_flops=call_cost_flops)
        self.verified = False  # a first round ran: later errors are real errors, not "vmap cannot"
        self._grad = {
            "soft": vmap(grad(self._soft_loss), in_dims=(0, 0, None, 0, 0), randomness="different"),
            "masked": vmap(grad(self._masked_loss), in_dims=(0, 0, None, 0, 0, 0), randomness="different"),
            "plain": vmap(grad(self._plain_loss), in_dims=(0, 0, None, 0, 0), randomness="different"),
        }
        self.trace = True  # see _traced_grad
        self.fuse = True  # ragged layers' bias, ReLU and its gradient on the real rows (see _traced_grad)
        self.ragged = True  # padded groups' traced products on the real samples only (see _traced_grad)
        self._traced: Dict[tuple, object] = {}
        self._sample_dims: Dict[tuple, tuple] = {}  # (mode, batch) -> (graph_signature, sample_dims)
        self.trace_counts: Dict[tuple, int] = {}  # times each shape (mode, rows, batch) was traced
        self.trace_failure: Optional[str] = None

    # ------------------------------------------------------------------ the vmapped losses (one client)
    def _forward(self, params, frozen, buffers, xb):
        from torch.func import functional_call

        return functional_call(self.model, ({**params, **frozen} if frozen else params, buffers), (xb,))

    def _soft_loss(self, params, frozen, buffers, xb, targets):
        out = self._forward(params, frozen, buffers, xb)
        if out.shape != targets.shape:
            raise ValueError(f"the soft-target cross-entropy needs [batch, classes] outputs of shape "
                             f"{tuple(targets.shape)}, the model gives {tuple(out.shape)}")
        loss = -(out.log_softmax(-1) * targets).sum()
        return loss, loss.detach()

    def _masked_loss(self, params, frozen, buffers, xb, yb, wb):
        per = self._per_sample(self._forward(params, frozen, buffers, xb), yb)
        if per.dim() > 1:
            per = per.reshape(per.shape[0], -1).mean(1)
        loss = (per * wb).sum()
        return loss, loss.detach()

    def _plain_loss(self, params, frozen, buffers, xb, yb):
        loss = self.loss_fn(self._forward(params, frozen, buffers, xb), yb)
        return loss, loss.detach()

    def _traced_grad(self, key: tuple, mode: str, example: tuple):
        """The vmapped gradient of ``mode`` for the shapes ``key``, traced once into a
        graph of plain ATen ops (:func:`~.aten_trace.trace_aten`, on the real
        arguments, the RNG state put back after it): running that graph skips the per-op
        dispatch of the torch.func transforms -- about a third of a small model's step
        -- and gives the same bits, except where :func:`~.graph_passes.ragged_products`
        (``self.ragged``, padded groups) runs the matrix products on the real samples
        only: the same values up to a GEMM's rounding.  Traced at a shape's first
        sighting, so every group of a shape runs the same code whichever round or group
        meets it first; the first round too, so that the shapes it meets are traced
        there and a run's later rounds run at their steady speed (over a run this moves
        the traces' cost rather than saving it).  A model the transforms cannot batch
        fails its trace as it would fail eagerly: tracing is then off and the round
        runs eagerly, whose failure is the first round's :class:`BatchedUnsupported`.
        None: run the transforms eagerly (tracing off or failed)."""
        fn = self._traced.get(key)
        if fn is not None or not self.trace:
            return fn
        try:
            vmapped = self._grad[mode]
            devices = [example[3].device] if example[3].device.type == "cuda" else []

            def trace(*args):  # the real call must not move the RNG the graph's first run draws from
                with torch.random.fork_rng(devices=devices):
                    return trace_aten(vmapped, *args)

            fn = trace(*example)
            bmm = torch.ops.aten.bmm.default
            if (self.ragged and mode != "plain" and ragged_bmm_uses_blas(self.layout.dtype, example[3].device)
                    and any(n.target is bmm for n in fn.graph.nodes)):  # else no second trace
                B = key[2]
                # the products' sample dimensions: from a second trace at B + 1, once per
                # loss and padded length (graphs of other row counts share them)
                signature = graph_signature(fn)
                found = self._sample_dims.get((mode, B))
                if found is None or found[0] != signature:
                    longer = (*example[:3], *(torch.cat([t, t[:, :1]], 1) for t in example[3:]))
                    found = (signature, sample_dims(fn, trace(*longer), B))
                    self._sample_dims[(mode, B)] = found
                ragged_products(fn, found[1], B)
            drop_identity_ops(fn)
            channels_last_pools(fn)
            kernels = ragged_graph_ops()
            if (self.fuse and kernels is not None
                    and any(n.target is kernels.bmm for n in fn.graph.nodes)):
                fused_epilogues(fn)  # after drop_identity_ops: the fused ops mutate
            gradients_into_buffer(fn, [(o, k, s) for _, o, k, s, t in self._slots if t], self.numel)
            fn.recompile()  # once, after every pass
            drop_values(fn)  # the traced call's tensors
        except Exception as exc:  # noqa: BLE001 - tracing is an optimisation: stay eager
            self.trace = False
            self.trace_failure = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            return None
        if len(self._traced) >= 128:
            self._traced.pop(next(iter(self._traced)))
        self._traced[key] = fn
        self.trace_counts[key] = self.trace_counts.get(key, 0) + 1
        return fn

    # ------------------------------------------------------------------ a round
    def train_round(self, x_global: torch.Tensor, client_indices: Sequence[torch.Tensor], *, round_index: int,
                    seeds: Sequence[int], out: torch.Tensor, stats: RoundStats,
                    clients: Optional[Sequence[int]] = None, scaffold: Optional[ScaffoldState] = None,
                    on_group: Optional[Callable[[int], None]] = None,
                    starts: Optional[torch.Tensor] = None,
                    round_indices: Optional[Sequence[int]] = None) -> List[float]:
        """Train the round's clients (``client_indices[i]``, batch seeds ``seeds[i]``) from
        ``x_global``; writes ``D_i = x_global - x_end_i`` into ``out[i]`` (``[C, N]``) and
        accumulates ``stats``.  Returns each client's sum of local lrs (SCAFFOLD's
        ``K eta_l``, recorded into ``scaffold`` for ``clients[i]``).  ``on_group(done)``,
        if given, is called after each group with the number of clients trained so far
        (a progress report: a count, no host sync).

        ``starts`` (``[C, N]``) and ``round_indices`` (``C`` ints): clients that start from
        DIFFERENT models at different points of the schedule (FedBuff's clients, each on
        the version it pulled): row ``i`` trains from ``starts[i]`` with the local lr and
        weight decay of round ``round_indices[i]``, and ``D_i = starts[i] - x_end_i``;
        ``x_global`` and ``round_index`` are then unused but for the dropout seed (the
        group's first row's round).  A row's arithmetic depends on its own start, round
        and client alone, so on CPU every client's bits are those of training it in a
        group of its own version (tested); only a model with dropout draws its masks per
        group, as it already does.

        In the first round any exception is re-raised as :class:`BatchedUnsupported`
        (the model cannot be batched; nothing but ``out`` and ``stats`` was written).
        """
        if self.verified:
            return self._train_round(x_global, client_indices, round_index, seeds, out, stats, clients, scaffold,
                                     on_group, starts, round_indices)
        try:
            result = self._train_round(x_global, client_indices, round_index, seeds, out, stats, clients, scaffold,
                                       on_group, starts, round_indices)
        except Exception as exc:  # noqa: BLE001 - any failure of the first round means "cannot batch"
            msg = " ".join(str(exc).split())
            if len(msg) > 200:
                msg = msg[:197] + "..."
            raise BatchedUnsupported(f"{type(exc).__name__}: {msg}") from exc
        self.verified = True
        return result

    def _train_round(self, x_global, client_indices, round_index, seeds, out, stats, clients, scaffold,
                     on_group=None, starts=None, round_indices=None):
        cfg = self.config
        C = len(client_indices)
        if out.shape != (C, self.numel):
            raise ValueError(f"out must have shape {(C, self.numel)}, got {tuple(out.shape)}")
        if scaffold is not None and clients is None:
            raise ValueError("scaffold needs the clients' ids")
        if starts is not None and (starts.shape != (C, self.numel) or starts.dtype != out.dtype):
            raise ValueError(f"starts must be a {out.dtype} tensor of shape {(C, self.numel)}, got "
                             f"{starts.dtype} {tuple(starts.shape)}")
        if round_indices is not None and len(round_indices) != C:
            raise ValueError(f"round_indices must have one round per client ({C}), got {len(round_indices)}")
        rounds = [round_index] * C if round_indices is None else [int(r) for r in round_indices]
        mixed = len(set(rounds)) > 1  # clients at different points of the schedule: per-row lr and wd
        batches = [client_batches(ix, s, cfg.batch_size, cfg.steps) for ix, s in zip(client_indices, seeds)]
        sizes = [int(ix.numel()) for ix in client_indices]
        if C:
            round_index = rounds[0]
        # the local lrs, exactly as the sequential engine computes them (Python floats)
        if cfg.decay_per == "step" and not mixed:
            step_lrs = [cfg.lr_at(round_index, k) for k in range(cfg.steps)]
            lrs = [step_lrs] * C
        elif cfg.decay_per == "step":
            step_lrs = None
            lrs = [[cfg.lr_at(r, k) for k in range(cfg.steps)] for r in rounds]
        else:  # FedDecay per epoch: epochs have client-dependent lengths
            step_lrs = None
            lrs = [[cfg.lr_at(r, k // (n // min(cfg.batch_size, n))) for k in range(cfg.steps)]
                   for n, r in zip(sizes, rounds)]
        lr_sums = []
        for row in lrs:
            total = 0.0
            for lr in row:
                total += lr
            lr_sums.append(total)
        wd = cfg.weight_decay_at(round_index)
        wds = [cfg.weight_decay_at(r) for r in rounds] if mixed else None
        self.model.train()
        done = 0
        for gi, group in enumerate(self.planner.plan(sizes)):
            if wds is not None:  # the group's rows' weight decays, as the lrs below (acc dtype)
                wd = torch.tensor([wds[r] for r in group.rows], dtype=torch.float64)
                wd = wd.to(device=x_global.device, dtype=acc_dtype(x_global.dtype))
            self._train_group(group, gi, x_global, batches, sizes, step_lrs, lrs, wd, out, stats, clients, scaffold,
                              rounds[group.rows[0]] if C else round_index, starts)
            if scaffold is not None:
                for r in group.rows[:group.real]:
                    scaffold.client_update(clients[r], out[r], lr_sums[r])
            done += group.real
            if on_group is not None:
                on_group(done)
        return lr_sums

    def _train_group(self, group: Group, group_index: int, x_global, batches, sizes, step_lrs, lrs, wd, out, stats,
                     clients, scaffold, round_index, starts=None):
        cfg = self.config
        device, dtype = x_global.device, x_global.dtype
        rows, c, B = group.rows, len(group.rows), group.batch
        contiguous = group.real == c and rows == list(range(rows[0], rows[0] + c))
        # each row's start: x_global broadcast, or (FedBuff) the version its client pulled
        x0 = x_global if starts is None else starts[torch.tensor(rows, device=starts.device)]
        # the group's parameters: the rows of `out` themselves when they are contiguous
        X = out[rows[0]:rows[0] + c] if contiguous else torch.empty(c, self.numel, device=device, dtype=dtype)
        X.copy_(x0.expand(c, -1))
        G = torch.empty_like(X)
        # [steps, c * B] sample indices; padding repeats the client's first sample of the batch
        idx = torch.empty(cfg.steps, c, B, dtype=torch.int64)
        for j, r in enumerate(rows):
            b = batches[r]
            idx[:, j, :b.shape[1]] = b
            if b.shape[1] < B:
                idx[:, j, b.shape[1]:] = b[:, :1]
        idx = idx.view(cfg.steps, c * B).to(device)
        weights = None
        lengths = torch.full((c,), B, dtype=torch.int64)  # the real samples of each row's batches
        if group.mode != "plain":  # 1/b_i on a client's real samples, 0 on padding
            w = torch.zeros(c, B, dtype=dtype)
            for j, r in enumerate(rows):
                b = lengths[j] = min(cfg.batch_size, sizes[r])
                w[j, :b] = 1.0 / b
            weights = w.to(device)
        lr_rows = None
        if step_lrs is None:
            acc = acc_dtype(dtype)
            lr_rows = torch.tensor([[lrs[r][k] for r in rows] for k in range(cfg.steps)], dtype=torch.float64)
            lr_rows = lr_rows.to(device=device, dtype=acc)
        tmp = torch.empty_like(X) if cfg.prox_mu != 0.0 else None
        corr = None
        if scaffold is not None:
            corr = torch.sub(scaffold.c, scaffold.controls([clients[r] for r in rows]))
        momentum_buffers = torch.zeros_like(X) if cfg.momentum != 0.0 else None
        params = {n: X[:, o:o + k].view(c, *s) for n, o, k, s, t in self._slots if t}
        frozen = {n: X[:, o:o + k].view(c, *s).detach() for n, o, k, s, t in self._slots if not t}
        grad_fn = self._grad[group.mode]
        key = (group.mode, c, B)
        traced = None
        G_parts = [G[:, o:o + k] for _, o, k, _, _ in self._slots]
        in_shape, y_shape = self.x_train.shape[1:], self.y_train.shape[1:]
        targets_w = weights.view(c * B, 1) if group.mode == "soft" else None
        losses, norms, scales, skipped = [], [], [], []
        devices = [device] if device.type == "cuda" else []
        first = clients[rows[0]] if clients is not None else rows[0]
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(dropout_seed(self.seed, round_index + 1, group_index, first))
            for k in range(cfg.steps):
                ib = idx[k]
                xb = self.x_train.index_select(0, ib).view(c, B, *in_shape)
                yb = self.y_train.index_select(0, ib)
                if group.mode == "soft":
                    args = (params, frozen, self.buffers, xb,
                            self._soft_targets.index_select(0, yb).mul_(targets_w).view(c, B, -1))
                elif group.mode == "masked":
                    args = (params, frozen, self.buffers, xb, yb.view(c, B, *y_shape), weights)
                else:
                    args = (params, frozen, self.buffers, xb, yb.view(c, B, *y_shape))
                if k == 0:
                    traced = self._traced_grad(key, group.mode, args)
                    if hasattr(traced, RAGGED_LENGTHS):
                        setattr(traced, RAGGED_LENGTHS, lengths)
                    in_buffer = hasattr(traced, GRADIENT_BUFFER)
                    if in_buffer:  # the graph writes the trainable parameters' gradients into G itself
                        setattr(traced, GRADIENT_BUFFER, G)
                grads, loss = (traced or grad_fn)(*args)
                with torch.no_grad():
                    self._gather(grads, G, G_parts, c, written=in_buffer)
                    if tmp is not None:  # FedProx: g += mu (x - x0)
                        torch.sub(X, x0, out=tmp)
                        G.add_(tmp, alpha=cfg.prox_mu)
                    if corr is not None:  # SCAFFOLD: g += c - c_i
                        G.add_(corr)
                    st = nar_step_batched_(X, G, lr=step_lrs[k] if lr_rows is None else lr_rows[k], weight_decay=wd,
                                           max_norm=cfg.max_norm, mode=cfg.nar, momentum=cfg.momentum,
                                           momentum_buffers=momentum_buffers, backend=cfg.backend)
                losses.append(loss)
                norms.append(st.norm)
                scales.append(st.scale)
                skipped.append(st.skipped)
        with torch.no_grad():
            real = group.real
            acc = stats.loss_sum.dtype
            zero = torch.zeros((), dtype=acc, device=device)
            step_losses = torch.stack(losses)[:, :real].to(acc)
            sk = torch.stack(skipped)[:, :real]
            # a client with a skipped (non-finite) step or a non-finite loss is left out of the round: its
            # update becomes NaN below (the server step excludes it) and its steps do not count (RoundStats)
            bad = sk.any(dim=0) | ~torch.isfinite(step_losses).all(dim=0)
            stats.loss_sum += torch.where(bad, zero, step_losses).sum()
            clipped = (torch.stack(scales)[:, :real] < 1) & ~sk & ~bad
            stats.clipped += clipped.to(acc).sum()
            stats.clipped_norm_sum += torch.where(clipped, torch.stack(norms)[:, :real].to(acc), zero).sum()
            stats.skipped += (sk & ~bad).to(acc).sum()
            stats.steps += cfg.steps * real
            stats.uncounted += bad.to(acc).sum() * float(cfg.steps)
            stats.nonfinite += [(clients[r] if clients is not None else r, bad[j]) for j, r in enumerate(rows[:real])]
            X[:real].masked_fill_(bad[:, None], float("nan"))  # before D_i = x0 - x_end: NaN stays NaN
            if contiguous:
                torch.sub(x0, X, out=X)  # D_i = x0 - x_end, in place in the round's updates
            else:  # the real rows (padding dropped) into their places in the round's updates
                ids = torch.tensor(rows[:real], device=device)
                out.index_copy_(0, ids, torch.sub(x0 if x0.dim() == 1 else x0[:real], X[:real]))

    def _gather(self, grads, G, G_parts, c, *, written: bool = False) -> None:
        """The per-parameter gradients into the flat ``[c, N]`` buffer (frozen
        parameters get zero, as in the sequential engine, where they get no gradient),
        every step: the FedProx and SCAFFOLD terms are added to all of ``G``.
        ``written``: a traced graph already wrote the trainable parameters' parts
        (:func:`~fedopt_kernels.fl.engine.graph_passes.gradients_into_buffer`)."""
        if not self._frozen:
            if not written:
                torch.cat([grads[n].reshape(c, -1) for n, *_ in self._slots], dim=1, out=G)
            return
        for (n, _, _, _, t), part in zip(self._slots, G_parts):
            if not t:
                part.zero_()
            elif not written:
                part.copy_(grads[n].reshape(c, -1))
