"""``ServerOptimizer``: the common machinery of the server optimizers.

A server optimizer owns the GLOBAL model's parameters (a ``torch.optim.Optimizer``
over them, with param groups and ``state_dict``) and, once per round, takes the
clients' updates ``D_i = x_start - x_end_i``:

* as a ``[C, N]`` tensor, or a sequence of ``C`` flat vectors (no stacking copy is
  made), ``N`` the number of elements of all parameters of all groups, in the
  optimizer's order: groups in order, parameters in order within a group.  An
  optimizer built from ``model.parameters()`` has the order of
  :func:`fedopt_kernels.utils.module_to_vector` (``named_parameters()``);
* with client weights ``w_i`` (data sizes, say; uniform by default), normalised to
  ``p_i = w_i / sum_j w_j``.

``step(updates, weights)`` validates everything, then calls the fused
:func:`fedopt_kernels.ops.aggregate` ONCE: it returns the mean update
``D = sum_i p_i D_i`` together with every ``||D_i||^2`` and ``||D||^2`` -- all that
FedExP and ASNES need -- and the robustness decisions, taken on the device:

* ``nonfinite="exclude"`` (default): a client whose update holds NaN/Inf gets weight 0,
  the others are renormalised; it never reaches the model.  If every client is
  excluded the round is *skipped*: parameters and optimizer state keep their exact
  bits.  The skip is a ``torch.where`` on the device, so a step never synchronises
  the host with the device (no ``.item()``).  ``"propagate"``: plain IEEE arithmetic.
* ``max_client_norm=M``: each update is scaled by ``min(1, M / (||D_i|| + 1e-6))``
  before averaging (norm bounding, a standard defence against poisoned updates; the
  weights are not renormalised afterwards, so bounding shrinks the step).

Where the updates come from is the optimizer's *aggregator*
(:mod:`fedopt_kernels.server.aggregation`): :class:`LocalAggregator` (the default)
averages this process's clients;
:class:`fedopt_kernels.distributed.DistributedAggregator` (or the
:class:`~fedopt_kernels.distributed.DistributedServerOptimizer` wrapper) makes
``step(local_updates, local_weights)`` on every rank aggregate the union of all ranks'
updates (the same ``D``, statistics and decisions on every rank) and apply the
identical step to every rank's copy of the global model.  This layer does not import
the distributed one.

The subclasses then apply their formula to the per-tensor views of ``D`` with ONE fused
:func:`fedopt_kernels.ops.server_update_` per param group (one pass over params, ``D``
and the state; the skip decision read on the device).  Their state
lives in ``self.state[param]`` (plain tensors, like ``torch.optim``), so
``state_dict()``/``load_state_dict()`` round-trip and a restored optimizer continues
bit for bit.  ``step`` returns a :class:`ServerStats` of tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Union

import torch
from torch.optim import Optimizer

from ..ops import ClientPieces, server_update_
from ..ops.validation import acc_dtype, check_backend, check_real
from ..optim.eager_base import EagerOptimizer
from .aggregation import Aggregator, LocalAggregator, RoundAggregate, refuse_dtensor
from .round_stats import ServerRoundStats

Updates = Union[torch.Tensor, Sequence[torch.Tensor], ClientPieces]
NONFINITE = ("exclude", "propagate")


@dataclass(frozen=True)
class ServerStats:
    """Statistics of one server round, as tensors on the parameters' device.

    * ``update_sq_norm``: ``||D||^2`` of the mean update that was applied (after
      exclusion and norm bounding).
    * ``client_sq_norms`` ``[C]``: ``||D_i||^2`` of each update as sent (NaN/Inf for a
      non-finite one).
    * ``excluded`` ``[C]`` bool: updates left out because they hold NaN/Inf.
    * ``weights`` ``[C]``: the effective weights of the mean (normalised, after
      exclusion and norm bounding).
    * ``skipped``: bool, nothing was applied (every client excluded, or device-resident
      weights that do not sum to a positive finite number).
    * ``num_clients``: int64, how many updates entered the mean.
    * ``mean_client_sq_norm``: ``sum_i p_i ||D_i||^2`` over the updates that entered
      (after norm bounding), the numerator of FedExP's step size.
    * ``lr_scale``: the adaptive factor multiplying the server lr this round (1 for the
      non-adaptive methods, ``eta_g`` for FedExP, the gain ratio ``r`` for ASNES).
    * ASNES only (else None): ``gain_ratio`` (= ``lr_scale``), ``sigma2``, ``nu2``.
    """

    update_sq_norm: torch.Tensor
    client_sq_norms: torch.Tensor
    excluded: torch.Tensor
    weights: torch.Tensor
    skipped: torch.Tensor
    num_clients: torch.Tensor
    mean_client_sq_norm: torch.Tensor
    lr_scale: torch.Tensor
    gain_ratio: Optional[torch.Tensor] = None
    sigma2: Optional[torch.Tensor] = None
    nu2: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class RoundInfo:
    """What a subclass gets besides the mean update (all 0-d/[C] tensors, no sync)."""

    p: torch.Tensor  # [C] normalised weights of the updates that entered (0 for excluded)
    skip: torch.Tensor  # bool 0-d
    sq_norm: torch.Tensor  # ||D||^2
    mean_sq: torch.Tensor  # sum_i p_i ||D_i||^2 (after bounding)
    sum_p_sq: torch.Tensor  # sum_i p_i^2
    num_clients: torch.Tensor  # int64


def commit_(dst: torch.Tensor, new: torch.Tensor, skip: torch.Tensor) -> None:
    """``dst <- new`` unless ``skip`` (a 0-d bool tensor): exact bits kept on a skip.

    One elementwise pass on the device whatever ``skip`` is (no host sync).
    """
    torch.where(skip, dst, new.to(dst.dtype), out=dst)


def state_buffers(optimizer: Optimizer, params, key: str, init) -> List[torch.Tensor]:
    """``optimizer.state[p][key]`` for every ``p`` of ``params``, created by ``init(p)`` the
    first time."""
    bufs = []
    for p in params:
        state = optimizer.state[p]
        if key not in state:
            state[key] = init(p)
        bufs.append(state[key])
    return bufs


def _is_numbers(value) -> bool:
    """A hyperparameter that is a number or a tuple/list of numbers (not a bool)."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    return bool(items) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items)


def _is_valid_numbers(value) -> bool:
    """A tensor, or numbers that are all finite and >= 0."""
    if isinstance(value, torch.Tensor):
        return True
    items = value if isinstance(value, (tuple, list)) else (value,)
    return _is_numbers(value) and all(math.isfinite(v) and v >= 0 for v in items)


def check_nonneg(value, name: str, *, low_open: bool = False, high: Optional[float] = None,
                 high_open: bool = False) -> None:
    """Constructor check of a hyperparameter (tensors are accepted unchecked)."""
    if isinstance(value, torch.Tensor):
        return
    check_real(value, name, low=0, low_open=low_open, high=high, high_open=high_open)


class ServerOptimizer(EagerOptimizer):
    """Base class of the server optimizers (see the module docstring).

    Subclasses implement :meth:`_server_step`.  Every hyperparameter that can differ
    per param group lives in ``param_groups`` (so LR schedulers and ``state_dict``
    see it); ``nonfinite``, ``max_client_norm`` and ``backend`` concern the one
    aggregation of the round and are constructor options, as is ``aggregator``
    (:mod:`fedopt_kernels.server.aggregation`: None, this process's clients through
    :class:`LocalAggregator`; a :class:`~fedopt_kernels.distributed.DistributedAggregator`
    for the clients of every rank).
    """

    takes = "updates"  # a round hands it D_i = x_global - x_i (fedopt_kernels.server.round)
    keeps_buffers = False  # the caller averages the clients' floating buffers with the round's weights
    # whether the step reads sum_i p_i ||D_i||^2 (FedExP, ASNES): a secure sum must carry it
    needs_client_sq_norms = False

    def __init__(self, params, defaults: dict, *, nonfinite: str = "exclude",
                 max_client_norm: Optional[float] = None, backend: Optional[str] = None,
                 aggregator: Optional[Aggregator] = None):
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        if max_client_norm is not None:
            check_nonneg(max_client_norm, "max_client_norm", low_open=True)
            if isinstance(max_client_norm, torch.Tensor):
                raise TypeError("max_client_norm must be a Python number")
            max_client_norm = float(max_client_norm)
        check_backend(backend)
        if aggregator is not None and not callable(aggregator):
            raise TypeError(f"aggregator must be callable (see fedopt_kernels.server.aggregation), got "
                            f"{type(aggregator).__name__}")
        self.nonfinite = nonfinite
        self.max_client_norm = max_client_norm
        self.backend = backend
        self.aggregator: Aggregator = aggregator if aggregator is not None else LocalAggregator()
        super().__init__(params, defaults)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the parameters (and so of the updates ``step`` takes)."""
        return self._params()[0].dtype

    # ------------------------------------------------------------------ params
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            params = self._params()
            for i, p in enumerate(params):
                refuse_dtensor(p, f"parameter {i} of the optimizer",
                               "build it over the parameters of an unsharded copy of the global model "
                               "(a DTensor's full_tensor())")
            for p in params:
                first = params[0]
                if p.layout != torch.strided:
                    raise ValueError("server optimizers need dense (strided) parameters")
                if not p.is_floating_point():
                    raise ValueError(f"parameters must be floating point, got {p.dtype}")
                if p.dtype != first.dtype:
                    raise ValueError(f"all parameters must share one dtype (they are averaged as one vector), "
                                     f"got {first.dtype} and {p.dtype}")
                if p.device != first.device:
                    raise ValueError(f"all parameters must be on one device, got {first.device} and {p.device}")
        except ValueError:
            self.param_groups.pop()  # a rejected group leaves the optimizer as it was
            raise

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim``'s, checked first so that a rejected state changes nothing: the
        same number of groups and parameters, and each hyperparameter a finite number
        ``>= 0`` (or a tuple of them, or a tensor) where this optimizer has one.  A key
        the saved groups lack (a checkpoint of an older version) keeps this optimizer's
        value."""
        saved = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.param_groups):
            raise ValueError(f"the state_dict has {len(saved) if isinstance(saved, (list, tuple)) else 'no'} param "
                             f"groups but this optimizer has {len(self.param_groups)}")
        groups = []
        for k, (mine, theirs) in enumerate(zip(self.param_groups, saved)):
            if len(theirs.get("params", ())) != len(mine["params"]):
                raise ValueError(f"param group {k} of the state_dict has {len(theirs.get('params', ()))} "
                                 f"parameters but this optimizer's has {len(mine['params'])}")
            group = {key: value for key, value in mine.items() if key != "params"}
            group.update(theirs)
            for key, value in group.items():
                if key in mine and key != "params" and _is_numbers(mine[key]) and not _is_valid_numbers(value):
                    raise ValueError(f"param group {k} of the state_dict has {key}={value!r}: expected "
                                     f"{'numbers' if isinstance(mine[key], (tuple, list)) else 'a number'} "
                                     f"finite and >= 0 (or a tensor), as this optimizer's {mine[key]!r}")
            groups.append(group)
        super().load_state_dict({**state_dict, "param_groups": groups})

    def _params(self) -> List[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @property
    def numel(self) -> int:
        """``N``: the length every client update must have."""
        return sum(p.numel() for p in self._params())

    def param_names(self) -> Optional[List[str]]:
        """The names of the parameters in this optimizer's order (the order of a flat
        update), when it was built from ``model.named_parameters()``; else None."""
        names = [n for g in self.param_groups for n in g.get("param_names", [])]
        return names if len(names) == len(self._params()) else None

    def flatten_update(self, update: Mapping, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One client's update as the flat ``[N]`` vector :meth:`step` takes, in THIS
        optimizer's parameter order (param groups in order, parameters in group order,
        which need not be the model's order).

        ``update`` maps every parameter to its update tensor, keyed by the parameter
        itself, or by its name when the optimizer was built from
        ``model.named_parameters()`` (a ``{name: x_global - x_client}`` dict, e.g. from
        two ``state_dict()`` s).  A missing, unknown or misshapen entry raises, naming
        it.  :meth:`step` also takes a list of such mappings directly.
        """
        return self._flatten(self._update_tensors(update), out)

    def _flatten(self, tensors: List[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Checked update tensors (:meth:`_update_tensors`) copied into one flat vector."""
        first = self._params()[0]
        if out is None:
            out = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        offset = 0
        for t in tensors:
            out[offset:offset + t.numel()].view(t.shape).copy_(t)
            offset += t.numel()
        return out

    def _update_tensors(self, update: Mapping) -> List[torch.Tensor]:
        """The tensors of a named ``update`` in this optimizer's order, every entry
        checked (see :meth:`flatten_update`)."""
        params = self._params()
        if not isinstance(update, Mapping):
            raise TypeError(f"update must be a mapping from parameters (or their names) to tensors, "
                            f"got {type(update).__name__}")
        names = self.param_names()
        by_name = bool(update) and all(isinstance(k, str) for k in update)
        if by_name and names is None:
            raise ValueError("update is keyed by name but this optimizer has no parameter names: build it from "
                             "model.named_parameters(), or key the update by the parameter tensors")
        keys = names if by_name else params
        label = (lambda i: repr(names[i])) if by_name else (lambda i: f"parameter {i} of the optimizer")
        known = set(keys) if by_name else {id(p) for p in params}
        for k in update:
            if (k not in known) if by_name else (id(k) not in known):
                raise ValueError(f"update has an entry {k!r} that is not a parameter of this optimizer"
                                 if by_name else "update has an entry for a tensor that is not a parameter of "
                                 "this optimizer")
        lookup = update if by_name else {id(k): v for k, v in update.items()}
        tensors = []
        for i, (key, p) in enumerate(zip(keys, params)):
            t = lookup.get(key if by_name else id(key))
            if t is None:
                raise ValueError(f"update has no entry for {label(i)}")
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"update for {label(i)} must be a tensor of shape {tuple(p.shape)}, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            tensors.append(t)
        return tensors

    # ------------------------------------------------------------------ validation
    def check_updates(self, updates: Updates, *, allow_empty: bool = False):
        """``(rows, C)`` of valid ``updates`` (as :meth:`step` documents them, named updates
        flattened in this optimizer's order), for an aggregator; ``allow_empty``: ``C == 0``
        is accepted (a rank of a distributed round may hold no client: a ``[0, N]`` tensor
        or an empty list)."""
        params = self._params()
        if not params:
            raise ValueError("the optimizer has no parameters")
        dtype, device = params[0].dtype, params[0].device
        N = sum(p.numel() for p in params)
        def check_one(t, name, dims):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            refuse_dtensor(t, name)
            if t.dim() != dims:
                shape = "[C, N]" if dims == 2 else "[N]"
                raise ValueError(f"{name} must be {dims}-D {shape}, got shape {tuple(t.shape)}")
            if t.shape[-1] != N:
                raise ValueError(f"{name} has length {t.shape[-1]} per client but the model has {N} parameters "
                                 "(updates must be flat vectors in the optimizer's parameter order)")
            if t.dtype != dtype:
                raise ValueError(f"{name} has dtype {t.dtype} but the parameters have dtype {dtype}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but the parameters are on {device}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous: call .contiguous() first")

        if isinstance(updates, ClientPieces):
            if updates.numel != N:
                raise ValueError(f"updates have length {updates.numel} per client but the model has {N} parameters "
                                 "(updates must be flat vectors in the optimizer's parameter order)")
            if updates.dtype != dtype or updates.device != device:
                raise ValueError(f"updates are {updates.dtype} on {updates.device} but the parameters are {dtype} on "
                                 f"{device}")
            return updates, len(updates)
        if isinstance(updates, (list, tuple)) and updates and all(isinstance(u, Mapping) for u in updates):
            index = {id(p): j for j, p in enumerate(self._params())}
            for i, u in enumerate(updates):
                for key, t in u.items():
                    label = repr(key) if isinstance(key, str) else f"parameter {index.get(id(key), '?')}"
                    refuse_dtensor(t, f"updates[{i}][{label}]")
            # named updates, in this optimizer's order: read in place where every entry is a
            # contiguous tensor of the parameters' dtype and device, else flattened (a copy,
            # which also converts)
            named = [self._update_tensors(u) for u in updates]
            if all(t.dtype == dtype and t.device == device and t.is_contiguous() for ts in named for t in ts):
                return ClientPieces(named, name="updates"), len(named)
            updates = [self._flatten(ts) for ts in named]
        if isinstance(updates, torch.Tensor):
            if updates.dim() == 1:
                raise ValueError(f"updates as a tensor must be 2-D [C, N], got shape {tuple(updates.shape)}; "
                                 "for one client pass updates[None] or [update]")
            check_one(updates, "updates", 2)
            if updates.shape[0] == 0 and not allow_empty:
                raise ValueError("updates must hold at least one client")
            return updates, updates.shape[0]
        if not isinstance(updates, (list, tuple)):
            raise TypeError(f"updates must be a [C, N] tensor or a list/tuple of flat vectors, "
                            f"got {type(updates).__name__}")
        if len(updates) == 0 and not allow_empty:
            raise ValueError("updates must hold at least one client")
        for i, u in enumerate(updates):
            check_one(u, f"updates[{i}]", 1)
        return list(updates), len(updates)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, updates: Updates, weights=None, *, aggregator: Optional[Aggregator] = None) -> ServerStats:
        """Apply one round of client ``updates`` (``[C, N]``, ``C`` flat vectors, or
        :class:`~fedopt_kernels.ops.ClientPieces`: each client's per-layer tensors, read
        in place), weighted by ``weights`` (``[C]``; uniform if None).  Returns
        :class:`ServerStats`.

        A flat update follows THIS optimizer's parameter order (param groups in order),
        which is not the model's when the groups reorder it: build it with
        :meth:`flatten_update`, or pass ``C`` mappings ``{name or parameter: tensor}``
        and the optimizer reads them in its own order, checking every entry -- in place
        (no ``[C, N]`` copy) where every entry already has the parameters' dtype and
        device and is contiguous.

        All arguments are checked before anything is written: a rejected call changes
        neither the parameters nor the state.  Weights given as Python numbers or CPU
        tensors are checked by value (finite, ``>= 0``, not all zero); weights already on
        an accelerator are not (that would synchronise): there, a total that is not a
        positive finite number skips the round (``stats.skipped``), and negative
        entries are the caller's responsibility.

        ``aggregator`` (None: :attr:`aggregator`, set at construction) gathers and
        averages the updates: see :mod:`fedopt_kernels.server.aggregation`.
        """
        params = self._params()
        if not params:
            raise ValueError("the optimizer has no parameters")
        dtype, device = params[0].dtype, params[0].device
        D = torch.empty(sum(p.numel() for p in params), dtype=acc_dtype(dtype), device=device)
        round_ = (aggregator if aggregator is not None else self.aggregator)(self, updates, weights, D)
        st = round_.stats
        info = self._round_info(round_)
        d_views, offset = [], 0
        for group in self.param_groups:
            views = []
            for p in group["params"]:
                views.append(D[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
            d_views.append(views)
        extra = self._server_step(d_views, info)
        return ServerStats(
            update_sq_norm=st.sq_norm, client_sq_norms=st.client_sq_norms, excluded=st.excluded,
            weights=st.weights, skipped=info.skip, num_clients=info.num_clients,
            mean_client_sq_norm=info.mean_sq, **extra)

    def round(self, updates: Updates, weights=None, *, aggregator: Optional[Aggregator] = None) -> ServerRoundStats:
        """One round of :mod:`fedopt_kernels.server.round`: :meth:`step`, and its
        statistics by their record names (:meth:`round_stats`)."""
        return self.round_stats(self.step(updates, weights, aggregator=aggregator))

    def round_stats(self, st: ServerStats) -> ServerRoundStats:
        """A :class:`ServerStats` as the :class:`~fedopt_kernels.server.round.ServerRoundStats` of
        every server round: ``server_lr`` (the first group's lr times ``lr_scale``, in
        float64), ``lr_scale``, ``update_norm`` (``||D||``, in float64),
        ``excluded_clients``, ``server_skipped`` and, for ASNES, ``gain_ratio``,
        ``sigma2``, ``nu2``.  No host synchronisation."""
        lr = self.param_groups[0]["lr"]
        lr = lr.to(torch.float64) if isinstance(lr, torch.Tensor) else lr
        metrics = {
            "server_lr": st.lr_scale.to(torch.float64) * lr,
            "lr_scale": st.lr_scale,
            "update_norm": st.update_sq_norm.to(torch.float64).sqrt(),
            "excluded_clients": st.excluded.sum(),
            "server_skipped": st.skipped,
        }
        if st.gain_ratio is not None:
            metrics.update(gain_ratio=st.gain_ratio, sigma2=st.sigma2, nu2=st.nu2)
        return ServerRoundStats(excluded=st.excluded, skipped=st.skipped, metrics=metrics, stats=st)

    @staticmethod
    def _round_info(round_: RoundAggregate) -> RoundInfo:
        p, st = round_.p, round_.stats
        zero = torch.zeros((), dtype=p.dtype, device=p.device)
        q = torch.where(p > 0, st.client_sq_norms.to(p.dtype), zero)  # excluded NaNs never multiply
        if round_.bound is not None:  # the bounded update is s_i D_i: its squared norm s_i^2 q_i
            q = q * round_.bound * round_.bound
        mean_sq = (p * q).sum() if round_.mean_sq is None else round_.mean_sq.to(p.dtype)
        return RoundInfo(p=p, skip=round_.skip, sq_norm=st.sq_norm, mean_sq=mean_sq, sum_p_sq=(p * p).sum(),
                         num_clients=(p > 0).sum())

    def _update(self, params: List[torch.Tensor], views: List[torch.Tensor], rule: str, skip: torch.Tensor, *,
                exp_avg: Optional[List[torch.Tensor]] = None, exp_avg_sq: Optional[List[torch.Tensor]] = None,
                **hyper) -> None:
        """The elementwise step of one param group: one fused :func:`~fedopt_kernels.ops.server_update_`
        (one pass over params, ``D`` and the state) on this optimizer's backend.

        The kernels pair a parameter's elements with ``D``'s by memory position, and ``D``
        is in logical (row-major) order, so a non-contiguous parameter (``channels_last``)
        is stepped on contiguous copies of itself and its state, written back after.
        """
        tensors = [params] + [s for s in (exp_avg, exp_avg_sq) if s is not None]
        if all(t.is_contiguous() for group in tensors for t in group):
            server_update_(params, views, rule=rule, skip=skip, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                           backend=self.backend, **hyper)
            return
        copies = [[t.contiguous() for t in group] for group in tensors]
        m_copy = copies[1] if exp_avg is not None else None
        v_copy = copies[-1] if exp_avg_sq is not None else None
        server_update_(copies[0], views, rule=rule, skip=skip, exp_avg=m_copy, exp_avg_sq=v_copy,
                       backend=self.backend, **hyper)
        for group, group_copies in zip(tensors, copies):
            for t, c in zip(group, group_copies):
                if c.data_ptr() != t.data_ptr():
                    t.copy_(c)

    def _server_step(self, d_views: List[List[torch.Tensor]], info: RoundInfo) -> dict:
        """Update params and state from the per-group views of ``D``; return the extra
        fields of :class:`ServerStats` (at least ``lr_scale``)."""
        raise NotImplementedError
