r"""``DiLoCo``: a model trained across islands, its outer step a server optimizer.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1) is FedAvg with a server
optimizer, run on the workers of a ``torch.distributed`` group.  Each worker (an
island: one process, or a DDP group of its own) takes ``H`` inner steps alone with
its inner optimizer (AdamW in the paper); then, with ``theta`` the global parameters
every worker started the round from (kept here as the *snapshot*)::

    Delta_k = theta - theta_k                                (outer gradient of worker k)
    Delta   = sum_k p_k Delta_k         p_k = tokens_k / sum_j tokens_j  (1/K without tokens)
    m <- mu m + Delta ;  theta <- theta - eta (mu m + Delta)  (outer Nesterov SGD, eta 0.7, mu 0.9)

and every worker continues from the new ``theta``.  The outer step is any
:class:`~fedopt_kernels.server.ServerOptimizer` (the default is
:class:`~fedopt_kernels.server.FedAvgM` with ``nesterov=True`` and the paper's values):
a federated server step is the same map.

One sync, as the code runs it:

1. the aggregation pass forms the outer gradient from the snapshot while it reads the
   parameters (:class:`~fedopt_kernels.ops.ClientPieces` with ``subtract_from``: no
   ``Delta_k`` vector is materialised) and averages every worker's, through the outer
   optimizer's distributed form (:func:`~fedopt_kernels.distributed.distributed_form`):
   ``mode="ordered"`` is bitwise the one-process mean for any number of workers,
   ``"all_reduce"`` one packed all-reduce;
2. the parameters are reset to the snapshot (a copy) and the fused
   :func:`~fedopt_kernels.ops.server_update_` pass applies the outer step to them (and
   to the outer state);
3. the snapshot takes the new parameters (a copy).

``codec="fp8"`` / ``"int4"`` / ``"int8"`` quantizes the exchange: each worker encodes
its ``Delta_k`` with :mod:`fedopt_kernels.ops.compressed`'s block codec (``codec_block``
values per fp32 scale), the codes, scales and token weights are all-gathered, and the
fused decode-aggregate forms the token-weighted mean on every worker, the same bits
(:mod:`~fedopt_kernels.distributed.quantized_exchange`); then the outer step as above.

A ``codec`` object (with ``encode(delta) -> payload`` and ``decode(payload) ->
delta``, payload a tensor or tuple of tensors whose shapes depend only on ``N``)
replaces step 1's exchange: each worker encodes its ``Delta_k`` (fp32), the payloads
are all-gathered, and every worker decodes all of them and averages them with the
outer optimizer's own (local) aggregation -- the same bits on every worker.  ``None``:
fp32, no codec.

Trade-offs, candidly: the snapshot costs one copy of the parameters (on their
device; torchft keeps it on the host); steps 2 and 3 are plain copies around the
fused step, 4 words per parameter that a kernel writing model and snapshot in one
pass would save.  Floating buffers (BatchNorm statistics) are not synced, as in the
paper's transformers and torchft.  FSDP2-sharded (DTensor) parameters: a sync moves
each rank's LOCAL shards (the snapshot and the outer state are shards too); ``group``
must then hold the ranks that own the same shard in every island (the replicate
dimension of a 2-D mesh), as HSDP's replicate group.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import defaults as D
from ..ops import ClientPieces
from ..ops.validation import is_dtensor
from ..server import FedAvgM, LocalAggregator, ServerOptimizer, ServerStats
from . import comm
from .aggregate import MODES
from .quantized_exchange import check_exchange_codec, start_exchange
from .server_optimizer import distributed_form

__all__ = ["DiLoCo", "SyncRecord", "check_sync_every", "model_parameters", "check_codec"]


@dataclass(frozen=True)
class SyncRecord:
    """One outer step, as every worker saw it.

    * ``step``: the inner step after which it ran (1-based, counted since the start);
    * ``outer_round``: how many outer steps came before it;
    * ``payload_bytes``: what this worker put on the wire for it (its outer gradient,
      encoded by the codec if any; an all-reduce moves about twice this per worker);
    * ``tokens``: this worker's weight (tokens since the previous sync; None: uniform);
    * ``stats``: the outer optimizer's :class:`~fedopt_kernels.server.ServerStats` (its
      ``excluded`` / ``skipped`` tell whether a worker's non-finite outer gradient was
      left out, or the whole step skipped);
    * ``left_out``: workers left out of this sync, ``(rank, reason)`` (empty when all
      took part);
    * ``committed``: False when a torchft ``Manager`` refused the step (a peer failed
      during the exchange): the worker was reset to the snapshot, no outer step was
      taken (``stats`` is None), and the round is trained again;
    * ``participants``: how many workers' outer gradients entered (torchft: the
      quorum's; else the group's size).
    """

    step: int
    outer_round: int
    payload_bytes: int
    tokens: Optional[float]
    stats: Optional[ServerStats]
    left_out: Tuple[Tuple[int, str], ...] = ()
    committed: bool = True
    participants: Optional[int] = None


def check_sync_every(H, name: str = "sync_every") -> int:
    """``H``, the inner steps per outer round: an int >= 1."""
    if isinstance(H, bool) or not isinstance(H, int):
        raise TypeError(f"{name} must be an int (inner steps per outer round), got {type(H).__name__}")
    if H < 1:
        raise ValueError(f"{name} must be >= 1 (inner steps per outer round), got {H}")
    return H


def model_parameters(model: nn.Module) -> List[torch.Tensor]:
    """The tensors a DiLoCo sync moves: ``model.parameters()`` (each once; a DDP wrapper
    gives its module's), or for FSDP2-sharded (DTensor) parameters their LOCAL shards
    (``p.to_local().detach()``: plain tensors sharing the shard's storage, so the outer
    step written into them is the parameter's), checked to be dense contiguous floating
    tensors."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    if not params:
        raise ValueError("model has no parameters")
    sharded = [is_dtensor(p) for p in params]
    if any(sharded) and not all(sharded):
        raise ValueError("the model mixes DTensor (FSDP2) and plain parameters: shard all of them or none")
    if all(sharded):
        params = [p.to_local().detach() for p in params]
    for i, p in enumerate(params):
        if not p.is_floating_point() or p.layout != torch.strided or not p.is_contiguous():
            raise ValueError(f"parameter {i}{' (local shard)' if sharded[i] else ''} must be a dense contiguous "
                             f"floating tensor, got {p.dtype} {p.layout} contiguous={p.is_contiguous()}")
    return params


def check_codec(codec, block: int = 256) -> None:
    """None, a codec name of :data:`~.quantized_exchange.EXCHANGE_CODECS` (with its
    ``block``), or an object with callable ``encode`` and ``decode``."""
    if codec is None:
        return
    if isinstance(codec, str):
        check_exchange_codec(codec, block)
        return
    if not (callable(getattr(codec, "encode", None)) and callable(getattr(codec, "decode", None))):
        raise TypeError(f"codec must be None (fp32) or an object with encode(delta) and decode(payload) methods, "
                        f"got {type(codec).__name__}")


def _outer_params(outer: ServerOptimizer) -> List[torch.Tensor]:
    return [p for g in outer.param_groups for p in g["params"]]


def check_outer(outer, params: Sequence[torch.Tensor], what: str = "outer_optimizer") -> List[torch.Tensor]:
    """``outer`` is a server optimizer over exactly ``params`` (each once, any order),
    and the state it holds has the shapes, dtypes and devices of its parameters.
    Returns its parameters in its own order (the order of a flat outer gradient)."""
    if not isinstance(outer, ServerOptimizer):
        raise TypeError(f"{what} must be a fedopt_kernels.server.ServerOptimizer (FedAvgM(..., nesterov=True) is "
                        f"DiLoCo's), got {type(outer).__name__}")
    mine = _outer_params(outer)
    ids = [id(p) for p in mine]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} holds a parameter twice")
    wanted = {id(p): i for i, p in enumerate(params)}
    foreign = [j for j, p in enumerate(mine) if id(p) not in wanted]
    missing = sorted(set(wanted.values()) - {wanted[i] for i in ids if i in wanted})
    if foreign or missing:
        raise ValueError(f"{what} must hold exactly the model's parameters: "
                         f"{len(missing)} of the model's are missing (indices {missing[:5]}), "
                         f"{len(foreign)} of its own are not the model's")
    for j, p in enumerate(mine):
        check_state_entry(outer.state.get(p, {}), p, f"{what}'s state of its parameter {j}")
    return mine


def check_state_entry(entry, p: torch.Tensor, what: str) -> None:
    """Every non-scalar tensor of an optimizer state entry has ``p``'s shape, dtype and
    device (scalars: step counters)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{what} must be a dict, got {type(entry).__name__}")
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != p.shape or value.dtype != p.dtype:
                raise ValueError(f"{what}[{key!r}] is {tuple(value.shape)} {value.dtype} but the parameter is "
                                 f"{tuple(p.shape)} {p.dtype}: the state does not belong to this model")


class _ResetAfterAggregation:
    """The outer optimizer's aggregator, then the parameters reset to the snapshot: the
    outer gradient is read from the trained parameters, and the outer step then moves
    the snapshot's values.  Nothing is reset when the aggregation raises."""

    def __init__(self, aggregator, reset):
        self.aggregator, self.reset = aggregator, reset
        self.last_left_out = ()

    def __call__(self, opt, updates, weights, out):
        rnd = self.aggregator(opt, updates, weights, out)
        self.last_left_out = getattr(self.aggregator, "last_left_out", ())
        self.reset()
        return rnd


class DiLoCo:
    """DiLoCo's training loop around a model (see the module docstring).

    Args:
        model: the worker's model (a DDP-wrapped one too); every worker of ``group``
            holds the same architecture.  Its parameters are broadcast from the group's
            rank 0 at construction (``broadcast_initial``), so every worker starts equal.
        inner_optimizer: any ``torch.optim.Optimizer`` over the model's parameters
            (AdamW in the paper; :class:`fedopt_kernels.optim.FedNAR` for a co-clipped
            inner step).
        outer_optimizer: a :class:`~fedopt_kernels.server.ServerOptimizer` over the
            model's parameters, or a factory ``params -> ServerOptimizer`` (called with
            the tensors a sync moves: for an FSDP2 model, the local shards); None:
            ``FedAvgM(lr=0.7, momentum=0.9, nesterov=True)`` ([DiLoCo] section 3,
            :data:`fedopt_kernels.defaults.DILOCO`).
        sync_every: ``H``, inner steps per outer round (default 500, [DiLoCo]).
        group: the process group of the workers (None: the default group).
        mode: ``"ordered"`` (bitwise the one-process mean, any number of workers) or
            ``"all_reduce"`` (one packed all-reduce).
        codec: None (fp32), ``"fp8"`` / ``"int4"`` / ``"int8"`` (the quantized
            exchange) or an encode/decode object (module docstring).
        codec_block: values per scale of a named codec (a multiple of 32; default 256).
        manager: None, or a ``torchft.Manager`` (fault tolerance, duck-typed: its
            ``start_quorum``, ``allreduce``, ``should_commit``, ``num_participants``):
            the exchange is then its fault-tolerant all-reduce of the packed
            ``[w Delta_k, w]`` (a worker that leaves or joins does not stop the others;
            a healing worker adds zeros), and a step the manager does not commit is
            discarded (:attr:`SyncRecord.committed`).  ``group``, ``mode`` and
            ``codec`` do not apply; no ``torch.distributed`` group is needed.  Give the
            manager this object's :meth:`state_dict` / :meth:`load_state_dict` for
            healing.

    Every argument is checked before anything changes (no collective runs before).
    Use: ``loss.backward(); diloco.step(tokens=n); inner_optimizer.zero_grad()``.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Optional[ServerOptimizer] = None, *, sync_every: int = D.DILOCO["sync_every"],
                 group=None, mode: str = "ordered", codec=None, codec_block: int = 256, broadcast_initial: bool = True,
                 manager=None):
        sync_every = check_sync_every(sync_every)
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
        if isinstance(inner_optimizer, ServerOptimizer):
            raise TypeError("inner_optimizer is a server optimizer: it is the outer step, pass it as outer_optimizer")
        params = model_parameters(model)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        check_codec(codec, codec_block)
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"the model's parameters must share one dtype and device (the outer gradient is one "
                             f"vector), got {sorted(map(str, dtypes))} on {sorted(map(str, devices))}")
        if outer_optimizer is not None and not isinstance(outer_optimizer, ServerOptimizer) \
                and callable(outer_optimizer):
            outer_optimizer = outer_optimizer(params)  # a factory, given the tensors a sync moves
        if outer_optimizer is not None:
            order = check_outer(outer_optimizer, params)
        if manager is not None:
            needs = [m for m in ("start_quorum", "allreduce", "should_commit", "num_participants")
                     if not callable(getattr(manager, m, None))]
            if needs:
                raise TypeError(f"manager must be a torchft.Manager (it lacks {needs}), got {type(manager).__name__}")
            if codec is not None:
                raise ValueError("codec with a torchft manager: not supported (its allreduce has should_quantize)")
        else:
            comm.check_initialized("DiLoCo")
        if outer_optimizer is None:
            outer_optimizer = FedAvgM(params, lr=D.DILOCO["outer_lr"], momentum=D.DILOCO["outer_momentum"],
                                      nesterov=True)
            order = params
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.outer_optimizer = outer_optimizer
        self.sync_every = sync_every
        self.group = group
        self.mode = mode
        self.codec = codec
        self.codec_block = codec_block
        self.manager = manager
        self.params: List[torch.Tensor] = list(order)  # the outer optimizer's order
        self.local_step = 0  # inner steps taken
        self.outer_round = 0  # outer steps taken
        self._tokens: Optional[float] = None  # since the last sync; None: no step gave tokens
        self._aggregator = distributed_form(outer_optimizer.aggregator, group, mode=mode)
        if broadcast_initial and manager is None:  # under torchft, the manager heals new workers
            with torch.no_grad():
                for p in self.params:
                    comm.broadcast(p.data, 0, group)
        # the global parameters theta of the current round, flat, in the outer optimizer's order
        self.snapshot = torch.cat([p.detach().reshape(-1) for p in self.params])
        self._snap_views = self._views(self.snapshot)
        self.last_sync: Optional[SyncRecord] = None

    def _views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views

    @property
    def numel(self) -> int:
        return self.snapshot.numel()

    # ------------------------------------------------------------------ the loop
    def step(self, closure=None, *, tokens=None) -> Optional[SyncRecord]:
        """One inner step (``inner_optimizer.step(closure)``) and, after every ``H``-th,
        the outer step (a collective: every worker calls it at the same inner step).

        ``tokens``: this step's batch size in tokens; the outer gradients are weighted
        by the tokens each worker took in the round.  Give it on every step of every
        worker, or never (uniform weights).  Returns the :class:`SyncRecord` when this
        step synced, else None."""
        if tokens is not None:
            if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not math.isfinite(tokens) \
                    or tokens < 0:
                raise ValueError(f"tokens must be a finite number >= 0 (this step's tokens), got {tokens!r}")
            if self._tokens is None and self.local_step % self.sync_every != 0:
                raise ValueError("tokens given on this step but not on the round's earlier ones: give it on every "
                                 "step or never")
        elif self._tokens is not None:
            raise ValueError("tokens missing on this step but given on the round's earlier ones")
        self.inner_optimizer.step(closure)
        self.local_step += 1
        if tokens is not None:
            self._tokens = (self._tokens or 0.0) + float(tokens)
        if self.local_step % self.sync_every == 0:
            return self.sync()
        return None

    def _reset_to_snapshot(self) -> None:
        torch._foreach_copy_(self.params, self._snap_views)

    @torch.no_grad()
    def sync(self) -> SyncRecord:
        """The outer step now (collective; :meth:`step` calls it every ``H`` steps)."""
        tokens = self._tokens
        weights = None if tokens is None else [tokens]
        if self.manager is not None:
            return self._managed_sync(tokens)
        if self.codec is None:
            pieces = ClientPieces([self.params], subtract_from=self.snapshot, name="outer gradient")
            agg = _ResetAfterAggregation(self._aggregator, self._reset_to_snapshot)
            stats = self.outer_optimizer.step(pieces, weights, aggregator=agg)
            payload = self.numel * torch.finfo(self.snapshot.dtype).bits // 8
            left_out = tuple((i, reason) for i, reason, _ in agg.last_left_out)
        elif isinstance(self.codec, str):
            delta = ClientPieces([self.params], subtract_from=self.snapshot).row(0).to(torch.float32)
            exchange = start_exchange(delta, tokens, codec=self.codec, block=self.codec_block, group=self.group,
                                      async_op=False)
            D, left_out = exchange.mean()
            self._reset_to_snapshot()
            stats = self.outer_optimizer.step(D.to(self.snapshot.dtype)[None], aggregator=LocalAggregator())
            payload = exchange.payload_bytes
        else:
            rows, all_weights, payload = self._exchange_encoded(weights)
            self._reset_to_snapshot()
            stats = self.outer_optimizer.step(rows, all_weights, aggregator=LocalAggregator())
            left_out = ()
        torch._foreach_copy_(self._snap_views, self.params)
        return self._record(payload, tokens, stats, left_out=left_out, participants=comm.group_size(self.group))

    def _record(self, payload, tokens, stats, **kw) -> SyncRecord:
        record = SyncRecord(step=self.local_step, outer_round=self.outer_round, payload_bytes=int(payload),
                            tokens=tokens, stats=stats, **kw)
        if record.committed:
            self.outer_round += 1
        self._tokens = None
        self.last_sync = record
        return record

    def _managed_sync(self, tokens) -> SyncRecord:
        """The sync under a torchft ``Manager``: its quorum, its fault-tolerant all-reduce
        of ``[w Delta_k, w]`` (SUM), then the outer step only if it commits."""
        m = self.manager
        m.start_quorum()
        acc = torch.float64 if self.snapshot.dtype == torch.float64 else torch.float32
        n = self.numel
        buf = torch.empty(n + 1, dtype=acc, device=self.snapshot.device)
        buf[:n].copy_(ClientPieces([self.params], subtract_from=self.snapshot).row(0))  # Delta_k
        if tokens is not None:
            buf[:n].mul_(tokens)
        buf[n].fill_(1.0 if tokens is None else tokens)
        m.allreduce(buf, reduce_op=dist.ReduceOp.SUM).wait()
        committed = bool(m.should_commit())
        participants = int(m.num_participants())
        self._reset_to_snapshot()
        if not committed:
            return self._record(buf.numel() * buf.element_size(), tokens, None, committed=False,
                                participants=participants,
                                left_out=((-1, "torchft did not commit this step (a peer failed): discarded"),))
        D = (buf[:n] / buf[n]).to(self.snapshot.dtype)
        stats = self.outer_optimizer.step(D[None], aggregator=LocalAggregator())
        torch._foreach_copy_(self._snap_views, self.params)
        return self._record(buf.numel() * buf.element_size(), tokens, stats, participants=participants)

    def _exchange_encoded(self, weights):
        """Every worker's encoded outer gradient, gathered and decoded (the same rows on
        every worker), their weights, and this worker's payload size in bytes."""
        acc = torch.float64 if self.snapshot.dtype == torch.float64 else torch.float32
        delta = ClientPieces([self.params], subtract_from=self.snapshot).row(0).to(acc)
        payload = self.codec.encode(delta)
        tensors = (payload,) if isinstance(payload, torch.Tensor) else tuple(payload)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError("codec.encode must return a tensor or a tuple of tensors")
        world = comm.group_size(self.group)
        info = [None] * world
        mine = {"shapes": [(tuple(t.shape), str(t.dtype)) for t in tensors], "weights": weights}
        dist.all_gather_object(info, mine, group=comm.object_group(self.group))
        if any(i["shapes"] != mine["shapes"] for i in info):
            raise ValueError("DiLoCo codec: the workers' payloads differ in shape or dtype: "
                             + ", ".join(f"rank {r}: {i['shapes']}" for r, i in enumerate(info)))
        if any((i["weights"] is None) != (weights is None) for i in info):
            raise ValueError("DiLoCo: some workers give tokens and some do not")
        gathered = []
        for t in tensors:
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous(), group=self.group)
            gathered.append(parts)
        rows = []
        for r in range(world):
            parts = tuple(g[r] for g in gathered)
            row = self.codec.decode(parts[0] if isinstance(payload, torch.Tensor) else parts)
            rows.append(row.to(self.snapshot.dtype).reshape(-1).contiguous())
        all_weights = None if weights is None else [i["weights"][0] for i in info]
        return rows, all_weights, sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything a worker needs to continue bit for bit, in the middle of an outer
        round too: its parameters (the trained ones), the snapshot, both optimizers'
        states and the counters."""
        return {
            "sync_every": self.sync_every, "local_step": self.local_step, "outer_round": self.outer_round,
            "tokens": self._tokens, "snapshot": self.snapshot.clone(),
            "params": [p.detach().clone() for p in self.params],
            "inner": copy.deepcopy(self.inner_optimizer.state_dict()),
            "outer": copy.deepcopy(self.outer_optimizer.state_dict()),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output.  Everything is checked before anything
        changes (a mismatched state leaves parameters, snapshot and optimizers as they
        were)."""
        missing = {"sync_every", "local_step", "outer_round", "tokens", "snapshot", "params", "inner",
                   "outer"} - set(state)
        if missing:
            raise ValueError(f"DiLoCo state_dict lacks {sorted(missing)}")
        if state["sync_every"] != self.sync_every:
            raise ValueError(f"the state was saved with sync_every={state['sync_every']} but this DiLoCo has "
                             f"{self.sync_every}")
        snap = state["snapshot"]
        if not isinstance(snap, torch.Tensor) or snap.shape != self.snapshot.shape or snap.dtype != self.snapshot.dtype:
            raise ValueError(f"the state's snapshot must be a [{self.numel}] {self.snapshot.dtype} tensor, got "
                             f"{getattr(snap, 'shape', type(snap).__name__)}")
        saved = state["params"]
        if len(saved) != len(self.params) or any(s.shape != p.shape or s.dtype != p.dtype
                                                  for s, p in zip(saved, self.params)):
            raise ValueError("the state's parameters do not have this model's shapes and dtypes")
        outer = state["outer"]
        for j, p in enumerate(self.params):
            check_state_entry(outer.get("state", {}).get(j, {}), p, f"the state's outer optimizer entry {j}")
        inner_before = copy.deepcopy(self.inner_optimizer.state_dict())
        self.inner_optimizer.load_state_dict(state["inner"])
        try:
            self.outer_optimizer.load_state_dict(outer)
        except Exception:
            self.inner_optimizer.load_state_dict(inner_before)
            raise
        self.snapshot.copy_(snap)
        torch._foreach_copy_(self.params, [s.to(p.device) for s, p in zip(saved, self.params)])
        self.local_step, self.outer_round, self._tokens = state["local_step"], state["outer_round"], state["tokens"]
