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
  clients (:mod:`torch.func`); the per-parameter gradients are concatenated into a
  preallocated ``[C, N]`` buffer ``G``.  When a group's shapes come back (a later
  round, another group; see *Fixed shapes*) that vmapped gradient is traced once with ``make_fx`` into a
  graph of the plain ATen ops the transforms dispatch to (batched matmuls ...) and the
  graph runs instead: the same ops, the same bits (tested), without the per-op cost
  of the transforms -- a third of a small model's step.  ``trainer.trace = False``
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
alone, never on which clients share its round, its group or (``fl.distributed``) its
rank.

**Fixed shapes.**  A real run samples new clients every round, so the number of a
round's clients at each level changes from round to round.  A group's rows are padded
up to a fixed ladder of counts (:func:`padded_count`: 2, 3, 4, 6, 8, 12, ...; or the
most clients the level can hold in a round), the padding rows being copies of the
group's first client whose results are dropped.  So the shapes of a run come from a
small fixed set -- a few per level -- and each is traced once (below) and then serves
every round that meets it, whatever clients are drawn (``trace_counts`` records
this; a shape met once stays eager: tracing costs about two eager rounds).

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
import math
import os
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from ..ops import nar_step_batched_
from ..utils import parameters_layout
from .client import LocalConfig, RoundStats, ScaffoldState
from .seeds import dropout_seed

__all__ = ["BatchedTrainer", "BatchedUnsupported", "EngineFallbackWarning", "unsupported_reason",
           "per_sample_loss", "client_batches", "batch_bins", "padded_count", "estimate_client_bytes",
           "available_memory"]


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
    epochs = []
    for _ in range(-(-steps // per_epoch)):
        perm = indices[torch.randperm(n, generator=generator)]
        epochs.append(perm[:per_epoch * bs].view(per_epoch, bs))
    return torch.cat(epochs)[:steps]


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


def _activation_numel(model: nn.Module, sample: torch.Tensor) -> int:
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
    computed beside a copy of itself, see :class:`BatchedTrainer`)."""
    if n < 1:
        raise ValueError(f"a group needs at least one client, got {n}")
    rows = 2
    while rows < n:
        rows = rows * 3 // 2 if rows & (rows - 1) == 0 else rows * 4 // 3
    if limit is not None and n <= limit < rows:
        rows = limit
    return max(rows, 2)


def _drop_identity_ops(gm) -> int:
    """Remove the no-op nodes ``make_fx`` records from the torch.func transforms (views
    and expands to the shape and strides they already have, ``alias``, ``mul(x, 1)``):
    about 40% of a small model's graph, each a dispatch of a few microseconds per step,
    and no arithmetic -- the results are the same bits.  Skipped for a graph with an
    in-place op (a model with ``inplace=True`` layers), where ``mul(x, 1)``'s copy may
    be what keeps a mutation off its input.  Returns the number of nodes removed."""
    aten = torch.ops.aten
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    if any(getattr(getattr(n.target, "_schema", None), "is_mutable", False) for n in nodes):
        return 0
    removed = 0
    for node in nodes:
        src = node.args[0] if node.args else None
        if not isinstance(src, torch.fx.Node):
            continue
        if node.target in (aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.alias.default):
            pass
        elif not (node.target is aten.mul.Scalar and node.args[1] == 1):
            continue
        a, b = node.meta.get("val"), src.meta.get("val")
        if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.stride() == b.stride()):
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            removed += 1
    if removed:
        graph.lint()
        gm.recompile()
    return removed


def _channels_last_pools(gm) -> int:
    """Run the graph's CPU ``max_pool2d_with_indices`` on a channels-last copy of its
    input and give its outputs back contiguous.  torch's NCHW CPU kernel is slow on the
    small planes of a batched round -- about 1.2 ms for ``[128, 32, 8, 8]`` on 2 cores
    against 0.13 ms for the channels-last kernel plus the copy -- and the two return the
    same values and indices (ties and NaN included; checked in the tests), so the
    graph's results keep their bits.  Returns the number of pools rewritten."""
    aten = torch.ops.aten
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.max_pool2d_with_indices.default:
            continue
        x = node.args[0]
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not (isinstance(val, torch.Tensor) and val.dim() == 4 and val.device.type == "cpu"
                and val.is_contiguous() and not val.is_contiguous(memory_format=torch.channels_last)):
            continue
        with graph.inserting_before(node):
            cl = graph.call_function(aten.clone.default, (x,), {"memory_format": torch.channels_last})
        node.replace_input_with(x, cl)
        for user in list(node.users):  # the getitem nodes of (values, indices)
            with graph.inserting_after(user):
                back = graph.call_function(aten.clone.default, (user,), {"memory_format": torch.contiguous_format})
            user.replace_all_uses_with(back, delete_user_cb=lambda u, back=back: u is not back)
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


class _Group:
    """Rows of the round trained together: ``rows`` (indices into the round's clients;
    the first ``real`` are distinct, the rest copies of the first, padding the group to
    :func:`padded_count` rows), the padded batch length and the loss form (``"soft"``,
    ``"masked"`` or ``"plain"``, see :class:`BatchedTrainer`)."""

    __slots__ = ("rows", "real", "batch", "mode")

    def __init__(self, rows: List[int], real: int, batch: int, mode: str):
        self.rows, self.real, self.batch, self.mode = rows, real, batch, mode


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
        client_batch: most clients per group (0: from the free memory).
        seed: the simulation's seed (random layers).
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

    def __init__(self, model: nn.Module, loss_fn, x_train: torch.Tensor, y_train: torch.Tensor, config: LocalConfig,
                 *, num_classes: Optional[int] = None, buffers: Optional[Dict[str, torch.Tensor]] = None,
                 client_batch: int = 0, seed: int = 0, population_sizes: Optional[Sequence[int]] = None,
                 round_clients: Optional[int] = None, call_cost_flops: Optional[float] = None):
        from torch.func import grad, vmap

        self.model = model
        self.loss_fn = loss_fn
        self.x_train, self.y_train = x_train, y_train
        self.config = config
        self.client_batch = int(client_batch)
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
        if round_clients is not None and int(round_clients) < 1:
            raise ValueError(f"round_clients must be a positive number of clients, got {round_clients!r}")
        self.round_clients = int(round_clients) if round_clients is not None else None
        self.bin_penalty = 1 / 16  # see batch_bins; the levels' penalty without round_clients
        device_type = x_train.device.type
        if call_cost_flops is None:  # an accelerator not listed: like CUDA, launches against fast arithmetic
            call_cost_flops = self.CALL_COST_FLOPS.get(device_type, self.CALL_COST_FLOPS.get("cuda", 5e10))
        self.call_cost_flops = float(call_cost_flops)
        self._sample_flops: Optional[float] = None
        self._group_caps: Dict[int, int] = {}  # clients per group at a padded length, fixed once per run
        self.set_population(population_sizes)
        self.verified = False  # a first round ran: later errors are real errors, not "vmap cannot"
        self.last_group_size: Optional[int] = None
        self._activation: Optional[int] = None
        self._grad = {
            "soft": vmap(grad(self._soft_loss, has_aux=True), in_dims=(0, 0, None, 0, 0), randomness="different"),
            "masked": vmap(grad(self._masked_loss, has_aux=True), in_dims=(0, 0, None, 0, 0, 0),
                           randomness="different"),
            "plain": vmap(grad(self._plain_loss, has_aux=True), in_dims=(0, 0, None, 0, 0), randomness="different"),
        }
        self.trace = True  # see _traced_grad
        self._traced: Dict[tuple, object] = {}
        self._sightings: Dict[tuple, int] = {}
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
        graph of plain ATen ops (``make_fx``) when these shapes come back (a second
        group of the same shapes, usually the next round): running that graph skips
        the per-op dispatch of the torch.func transforms -- about a third of a small
        model's step -- and gives the same bits.  None: run the transforms eagerly
        (first sighting, before the first round completed, tracing off or failed)."""
        fn = self._traced.get(key)
        if fn is not None or not self.trace or not self.verified:
            return fn
        if self._sightings.get(key, 0) < 2:
            return None
        try:
            from torch.fx.experimental.proxy_tensor import make_fx

            vmapped = self._grad[mode]

            def step(*args):  # a plain function: make_fx would count the bound method's `self`
                return vmapped(*args)

            fn = make_fx(step, tracing_mode="fake")(*example)
            _drop_identity_ops(fn)
            _channels_last_pools(fn)
        except Exception as exc:  # noqa: BLE001 - tracing is an optimisation: stay eager
            self.trace = False
            self.trace_failure = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            return None
        if len(self._traced) >= 128:
            self._traced.pop(next(iter(self._traced)))
        self._traced[key] = fn
        self.trace_counts[key] = self.trace_counts.get(key, 0) + 1
        return fn

    # ------------------------------------------------------------------ planning
    def client_bytes(self, batch: int) -> int:
        """The estimated memory of one client of a group (:func:`estimate_client_bytes`)."""
        cfg = self.config
        if self._activation is None:
            was = self.model.training
            self.model.eval()
            try:
                self._activation = _activation_numel(self.model, self.x_train[:1])
            except Exception:  # noqa: BLE001 - an estimate only; the round reports real errors
                self._activation = 0
            finally:
                self.model.train(was)
        extra = int(cfg.momentum != 0.0) + int(cfg.prox_mu != 0.0) + int(cfg.scaffold)
        return estimate_client_bytes(self.numel, batch, math.prod(self.x_train.shape[1:]), self._activation,
                                     element_size=self.layout.dtype.itemsize, extra_rows=extra)

    def group_size(self, clients: int, batch: int) -> int:
        """Clients per group for a round of ``clients`` clients and padded batch ``batch``:
        ``client_batch``, or (0) as many as half the free memory holds (80% on CUDA) at
        :meth:`client_bytes` each."""
        if self.client_batch > 0:
            return max(1, min(self.client_batch, clients))
        device = self.x_train.device
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
        bs = [min(self.config.batch_size, n) for n in sizes]
        if not self._can_pad:
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
            B = self._level_of(min(self.config.batch_size, n), self._levels)[0]
            self._level_limit[B] = self._level_limit.get(B, 0) + 1
        if self.round_clients is not None:
            self._level_limit = {B: min(k, self.round_clients) for B, k in self._level_limit.items()}

    def sample_flops(self) -> float:
        """FLOPs of one sample's local step: 3x the forward's (forward, and a backward
        of about twice that), counted once with torch's FLOP formulas on one training
        sample (:func:`~fedopt_kernels.fl._flops.forward_flops`: matrix products and
        convolutions; at least ``6 N`` for a model of ``N`` parameters)."""
        if self._sample_flops is None:
            from ._flops import forward_flops

            forward = 0
            was = self.model.training
            self.model.eval()
            try:
                forward = forward_flops(self.model, self.x_train[:1])
            except Exception:  # noqa: BLE001 - an estimate only; the round reports real errors
                pass
            finally:
                self.model.train(was)
            self._sample_flops = float(max(3 * forward, 6 * self.numel, 1))
        return self._sample_flops

    def _level_of(self, b: int, levels: List[tuple]) -> tuple:
        """The level a client of batch size ``b`` is padded to (its own size when the
        loss cannot be masked and no level has exactly that size)."""
        return next((lv for lv in levels if lv[0] >= b and (self._can_pad or lv[0] == b)), (b, True))

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

    def plan(self, sizes: Sequence[int]) -> List[_Group]:
        """The groups of a round whose clients hold ``sizes`` samples (see the module
        docstring): clients by padded batch length (:meth:`levels` of the population
        when known, else of this round), each level cut into groups of at most
        :meth:`_group_cap` clients, each group padded to :func:`padded_count` rows with
        copies of its first client (so a lone client is doubled)."""
        bs = [min(self.config.batch_size, n) for n in sizes]
        levels = self._levels if self._levels is not None else self.levels(sizes)
        by_level: Dict[tuple, List[int]] = {}
        for r, b in enumerate(bs):
            by_level.setdefault(self._level_of(b, levels), []).append(r)
        groups, self.last_group_size = [], 0
        for (batch, uniform), rows in sorted(by_level.items(), reverse=True):
            mode = "soft" if self._soft_targets is not None else "plain" if uniform else "masked"
            size = self._group_cap(len(rows), batch)
            limit = min(size, self._level_limit.get(batch, size))
            for start in range(0, len(rows), size):
                chunk = rows[start:start + size]
                real = len(chunk)
                self.last_group_size = max(self.last_group_size, real)
                chunk = chunk + chunk[:1] * (padded_count(real, limit) - real)
                groups.append(_Group(chunk, real, batch, mode))
        return groups

    # ------------------------------------------------------------------ a round
    def train_round(self, x_global: torch.Tensor, client_indices: Sequence[torch.Tensor], *, round_index: int,
                    seeds: Sequence[int], out: torch.Tensor, stats: RoundStats,
                    clients: Optional[Sequence[int]] = None, scaffold: Optional[ScaffoldState] = None) -> List[float]:
        """Train the round's clients (``client_indices[i]``, batch seeds ``seeds[i]``) from
        ``x_global``; writes ``D_i = x_global - x_end_i`` into ``out[i]`` (``[C, N]``) and
        accumulates ``stats``.  Returns each client's sum of local lrs (SCAFFOLD's
        ``K eta_l``, recorded into ``scaffold`` for ``clients[i]``).

        In the first round any exception is re-raised as :class:`BatchedUnsupported`
        (the model cannot be batched; nothing but ``out`` and ``stats`` was written).
        """
        if self.verified:
            return self._train_round(x_global, client_indices, round_index, seeds, out, stats, clients, scaffold)
        try:
            result = self._train_round(x_global, client_indices, round_index, seeds, out, stats, clients, scaffold)
        except Exception as exc:  # noqa: BLE001 - any failure of the first round means "cannot batch"
            msg = " ".join(str(exc).split())
            if len(msg) > 200:
                msg = msg[:197] + "..."
            raise BatchedUnsupported(f"{type(exc).__name__}: {msg}") from exc
        self.verified = True
        return result

    def _train_round(self, x_global, client_indices, round_index, seeds, out, stats, clients, scaffold):
        cfg = self.config
        C = len(client_indices)
        if out.shape != (C, self.numel):
            raise ValueError(f"out must have shape {(C, self.numel)}, got {tuple(out.shape)}")
        if scaffold is not None and clients is None:
            raise ValueError("scaffold needs the clients' ids")
        batches = [client_batches(ix, s, cfg.batch_size, cfg.steps) for ix, s in zip(client_indices, seeds)]
        sizes = [int(ix.numel()) for ix in client_indices]
        # the local lrs, exactly as the sequential engine computes them (Python floats)
        if cfg.decay_per == "step":
            step_lrs = [cfg.lr_at(round_index, k) for k in range(cfg.steps)]
            lrs = [step_lrs] * C
        else:  # FedDecay per epoch: epochs have client-dependent lengths
            step_lrs = None
            lrs = [[cfg.lr_at(round_index, k // (n // min(cfg.batch_size, n))) for k in range(cfg.steps)]
                   for n in sizes]
        lr_sums = []
        for row in lrs:
            total = 0.0
            for lr in row:
                total += lr
            lr_sums.append(total)
        wd = cfg.weight_decay_at(round_index)
        self.model.train()
        for gi, group in enumerate(self.plan(sizes)):
            self._train_group(group, gi, x_global, batches, sizes, step_lrs, lrs, wd, out, stats, clients, scaffold,
                              round_index)
            if scaffold is not None:
                for r in group.rows[:group.real]:
                    scaffold.client_update(clients[r], out[r], lr_sums[r])
        return lr_sums

    def _train_group(self, group: _Group, group_index: int, x_global, batches, sizes, step_lrs, lrs, wd, out, stats,
                     clients, scaffold, round_index):
        cfg = self.config
        device, dtype = x_global.device, x_global.dtype
        rows, c, B = group.rows, len(group.rows), group.batch
        contiguous = group.real == c and rows == list(range(rows[0], rows[0] + c))
        # the group's parameters: the rows of `out` themselves when they are contiguous
        X = out[rows[0]:rows[0] + c] if contiguous else torch.empty(c, self.numel, device=device, dtype=dtype)
        X.copy_(x_global.expand(c, -1))
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
        if group.mode != "plain":  # 1/b_i on a client's real samples, 0 on padding
            w = torch.zeros(c, B, dtype=dtype)
            for j, r in enumerate(rows):
                b = min(cfg.batch_size, sizes[r])
                w[j, :b] = 1.0 / b
            weights = w.to(device)
        lr_rows = None
        if step_lrs is None:
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            lr_rows = torch.tensor([[lrs[r][k] for r in rows] for k in range(cfg.steps)], dtype=torch.float64)
            lr_rows = lr_rows.to(device=device, dtype=acc)
        tmp = torch.empty_like(X) if cfg.prox_mu != 0.0 else None
        corr = None
        if scaffold is not None:
            ids = torch.tensor([clients[r] for r in rows], device=device)
            corr = torch.sub(scaffold.c, scaffold.c_clients.index_select(0, ids))
        momentum_buffers = torch.zeros_like(X) if cfg.momentum != 0.0 else None
        params = {n: X[:, o:o + k].view(c, *s) for n, o, k, s, t in self._slots if t}
        frozen = {n: X[:, o:o + k].view(c, *s).detach() for n, o, k, s, t in self._slots if not t}
        grad_fn = self._grad[group.mode]
        key = (group.mode, c, B)
        self._sightings[key] = self._sightings.get(key, 0) + 1
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
                grads, loss = (traced or grad_fn)(*args)
                with torch.no_grad():
                    self._gather(grads, G, G_parts, c)
                    if tmp is not None:  # FedProx: g += mu (x - x0)
                        torch.sub(X, x_global, out=tmp)
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
            stats.loss_sum += torch.stack(losses)[:, :real].to(acc).sum()
            sk = torch.stack(skipped)[:, :real]
            clipped = (torch.stack(scales)[:, :real] < 1) & ~sk
            stats.clipped += clipped.to(acc).sum()
            stats.clipped_norm_sum += torch.where(clipped, torch.stack(norms)[:, :real].to(acc),
                                                  torch.zeros((), dtype=acc, device=device)).sum()
            stats.skipped += sk.to(acc).sum()
            stats.steps += cfg.steps * real
            if contiguous:
                torch.sub(x_global, X, out=X)  # D_i = x0 - x_end, in place in the round's updates
            else:  # the real rows (padding dropped) into their places in the round's updates
                ids = torch.tensor(rows[:real], device=device)
                out.index_copy_(0, ids, torch.sub(x_global, X[:real]))

    def _gather(self, grads, G, G_parts, c) -> None:
        """The per-parameter gradients into the flat ``[c, N]`` buffer (frozen
        parameters get zero, as in the sequential engine, where they get no gradient)."""
        if not self._frozen:
            torch.cat([grads[n].reshape(c, -1) for n, *_ in self._slots], dim=1, out=G)
            return
        for (n, _, _, _, t), part in zip(self._slots, G_parts):
            if t:
                part.copy_(grads[n].reshape(c, -1))
            else:
                part.zero_()
