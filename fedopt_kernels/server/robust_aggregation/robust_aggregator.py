r"""Byzantine-robust aggregation as a choice of the aggregation seam.

:class:`RobustAggregator` is an :class:`~fedopt_kernels.server.aggregation.Aggregator`:
give it to a server optimizer (``FedAvg(params, aggregator=RobustAggregator("median"))``
or ``optimizer.aggregator = ...``) and every ``step`` writes the round's robust
aggregate (:func:`fedopt_kernels.server.robust_aggregation.robust.robust_aggregate`, one rule by name) into
``D``; the optimizer's step then does with ``D`` what it does with the mean -- FedAvg
moves the parameters by ``-lr D``, FedAdam feeds ``D`` to its moments, and so on
(FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad).

Rules and parameters (:data:`~fedopt_kernels.server.robust_aggregation.robust.RULES`)::

    mean            (LocalAggregator: the optimizer's own weighted mean)
    median          --
    trimmed-mean    beta
    krum            f
    multi-krum      f, m
    bulyan          f
    geomed          nu, tol, max_iter
    centered-clip   tau, iterations          (the previous aggregate is the reference)
    norm-bound      radius | median_factor

The clients' weights (data sizes, say) enter the rules that are defined with weights
(``mean``, ``multi-krum``, ``geomed``, ``norm-bound``); the others are defined without
them (coordinate-wise median and trimmed mean [Yin18], Krum [Blanchard17], Bulyan, centered
clipping [Karimireddy21]): there the weights are checked as ``step`` documents and not
used -- which :attr:`RobustAggregator.weighted` says.

What the round hands the step (:class:`~fedopt_kernels.server.aggregation.RoundAggregate`):
``stats.sq_norm = ||D||^2`` of the robust aggregate; ``stats.excluded`` the clients left
out for holding NaN/Inf (every rule leaves them out); ``stats.client_sq_norms`` every
``||D_i||^2`` as sent (the diagonal of the rule's Gram matrix where it has one, else
one extra read of the updates, so the round's statistics keep their meaning);
``stats.weights`` each client's coefficient in ``D`` where ``D`` is a weighted sum of
the clients (Krum, Multi-Krum, geomed, centered clipping, norm bounding),
else ``1/m`` over the ``m`` clients whose values entered (median, trimmed mean, Bulyan);
``p`` those weights normalised over the clients that entered; ``skip`` when no client
was usable.  FedExP and ASNES are refused: their step sizes are functions of
``sum_i p_i ||D_i||^2`` and ``||D||^2`` that hold for the weighted mean ``D = sum_i p_i
D_i`` (FedExP's extrapolation bound, ASNES's variance estimate), which a robust
aggregate is not.  So are ``max_client_norm`` (use the ``norm-bound`` rule) and
``nonfinite="propagate"`` (every robust rule leaves NaN/Inf clients out).

Updates given as :class:`~fedopt_kernels.ops.ClientPieces` (a Flower reply's arrays)
are read in place where the backend can (the CPU backend; not centered clipping once it
has a reference point), else stacked once into a ``[C, N]`` buffer kept from round to
round.

Centered clipping starts each round from the previous round's aggregate (zeros before
the first); :meth:`RobustAggregator.state_dict` saves it, so a restored run continues
bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...defaults import TRIM_BETA
from ...ops import validation as V
from ..aggregation import CheckedWeights, LocalAggregator, RoundAggregate, normalize_weights
from ...ops.aggregate import AggregateStats, aggregate_runner
from ...ops.client_pieces import ClientPieces
from ...ops.robust_aggregate import reads_pieces
from .robust import _PARAMS, RULES, RobustResult, robust_aggregate

__all__ = ["RobustAggregator", "WEIGHTED_RULES", "SELECTING_RULES", "refuse_robust_statistics", "AGGREGATORS",
           "AGGREGATOR_PARAMS", "robust_rule"]

# the rules by the names of fedopt simulate's --aggregator and the Flower robust concern
AGGREGATORS = ("mean",) + tuple(r for r in RULES if r != "mean")
# each rule parameter by its user-facing name (--trim-beta, trim_beta=): (the rules it applies to, its name here)
AGGREGATOR_PARAMS = {
    "trim_beta": (("trimmed-mean",), "beta"),
    "byzantine_f": (("krum", "multi-krum", "bulyan"), "f"),
    "krum_m": (("multi-krum",), "m"),
    "geomed_iters": (("geomed",), "max_iter"),
    "geomed_tol": (("geomed",), "tol"),
    "cclip_tau": (("centered-clip",), "tau"),
    "cclip_iters": (("centered-clip",), "iterations"),
    "norm_bound_radius": (("norm-bound",), "radius"),
}

WEIGHTED_RULES = ("mean", "multi-krum", "geomed", "norm-bound")  # defined with client weights
SELECTING_RULES = ("krum", "multi-krum", "bulyan")  # keep some clients and drop the rest
_STATE_PARAMS = {"weights", "reference"}  # given by the round, not by the user


def refuse_robust_statistics(optimizer, rule: str) -> None:
    """Refuse a server optimizer whose step size reads statistics that only hold for
    the weighted mean (FedExP, ASNES), and options that a robust rule replaces."""
    from ..asnes import ASNES
    from ..fedexp import FedExP

    if isinstance(optimizer, (FedExP, ASNES)):
        raise ValueError(f"{type(optimizer).__name__} cannot aggregate with the robust rule {rule!r}: its step size "
                         "is a function of sum_i p_i ||D_i||^2 and ||D||^2 that holds for the weighted mean "
                         "D = sum_i p_i D_i, which a robust aggregate is not; use FedAvg, FedAvgM, FedAdam, FedYogi "
                         "or FedAdagrad")
    if optimizer.max_client_norm is not None:
        raise ValueError(f"max_client_norm bounds the clients of the weighted mean; with the robust rule {rule!r} "
                         "leave it unset (the rule 'norm-bound' is norm bounding as an aggregator)")
    if optimizer.nonfinite != "exclude":
        raise ValueError(f"nonfinite={optimizer.nonfinite!r} cannot be honoured by the robust rule {rule!r}: every "
                         "robust rule leaves NaN/Inf clients out (use nonfinite='exclude')")


def _check_params(rule: str, params: dict) -> dict:
    """The rule's parameters checked by name and value on the host (the checks that
    need the number of clients -- Krum's ``C > 2f + 2`` -- run in the op, before it
    reads anything)."""
    if rule not in _PARAMS:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    takes = _PARAMS[rule] - _STATE_PARAMS
    unknown = sorted(set(params) - takes)
    if unknown:
        raise TypeError(f"rule {rule!r} does not take {', '.join(unknown)} (it takes "
                        f"{', '.join(sorted(takes)) or 'no parameters'}"
                        f"{'; the weights come from each step' if 'weights' in unknown else ''})")
    for name in ("f", "m", "max_iter", "iterations"):
        v = params.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    low = {"f": 0, "m": 1, "max_iter": 0, "iterations": 1}
    for name, lo in low.items():
        if params.get(name) is not None and params[name] < lo:
            raise ValueError(f"{name} must be >= {lo}, got {params[name]}")
    if "beta" in params:
        V.check_real(params["beta"], "beta", low=0.0, high=0.5, high_open=True)
    for name in ("nu", "tau", "radius", "median_factor"):
        if params.get(name) is not None:
            V.check_real(params[name], name, low=0.0, low_open=True)
    if "tol" in params:
        V.check_real(params["tol"], "tol", low=0.0)
    if rule in ("krum", "multi-krum", "bulyan") and "f" not in params:
        raise TypeError(f"rule {rule!r} needs f, the number of Byzantine clients it tolerates")
    if rule == "trimmed-mean" and "beta" not in params:
        raise TypeError("rule 'trimmed-mean' needs beta, the fraction trimmed at each end")
    if rule == "centered-clip" and "tau" not in params:
        raise TypeError("rule 'centered-clip' needs tau, the clipping radius")
    if rule == "norm-bound" and (params.get("radius") is None) == (params.get("median_factor") is None):
        raise ValueError("rule 'norm-bound' needs exactly one of radius (a fixed bound) and median_factor (a "
                         "multiple of the clients' median norm)")
    return dict(params)


def robust_rule(rule: str, **named) -> Optional["RobustAggregator"]:
    """The aggregation of ``rule`` (:data:`AGGREGATORS`) with its parameters by their
    user-facing names (:data:`AGGREGATOR_PARAMS`: ``trim_beta``, ``byzantine_f``, ...;
    None values are not given), as a :class:`RobustAggregator`; None for ``"mean"``
    (the optimizer's own weighted mean).  A parameter of another rule is refused by
    name; the trimmed mean's beta defaults to :data:`fedopt_kernels.defaults.TRIM_BETA`."""
    if rule not in AGGREGATORS:
        raise ValueError(f"aggregator must be one of {', '.join(AGGREGATORS)}, got {rule!r}")
    params = {}
    for name, value in named.items():
        if name not in AGGREGATOR_PARAMS:
            raise TypeError(f"unknown robust aggregation parameter {name!r} (one of {', '.join(AGGREGATOR_PARAMS)})")
        if value is None:
            continue
        rules, param = AGGREGATOR_PARAMS[name]
        if rule not in rules:
            raise ValueError(f"{name} applies to aggregator {' / '.join(rules)}, got aggregator {rule!r}")
        params[param] = value
    if rule == "mean":
        return None
    if rule == "trimmed-mean":
        params.setdefault("beta", TRIM_BETA)
    return RobustAggregator(rule, **params)


class RobustAggregator:
    """Aggregate each round with the robust ``rule`` (see the module docstring).

    Args:
        rule: one of :data:`~fedopt_kernels.server.robust_aggregation.robust.RULES`.
        params: the rule's parameters, by the names of
            :func:`~fedopt_kernels.server.robust_aggregation.robust.robust_aggregate` (``beta``; ``f``,
            ``m``; ``nu``, ``tol``, ``max_iter``; ``tau``, ``iterations``; ``radius``,
            ``median_factor``).

    :attr:`last` is the last round's :class:`~fedopt_kernels.server.robust_aggregation.robust.RobustResult`
    (device tensors: which clients were selected and excluded).
    """

    def __init__(self, rule: str = "median", **params):
        self.params = _check_params(rule, params)
        self.rule = rule
        self.rounds = 0
        self._reference: Optional[torch.Tensor] = None  # centered clipping's previous aggregate
        self.last: Optional[RobustResult] = None
        self._rows: Optional[torch.Tensor] = None  # the [C, N] buffer ClientPieces are stacked into
        self._scratch: Optional[torch.Tensor] = None  # the [N] output of the client-norm pass over pieces

    @property
    def weighted(self) -> bool:
        """Whether the rule uses the clients' weights (else it checks and ignores them)."""
        return self.rule in WEIGHTED_RULES

    @property
    def selects(self) -> bool:
        """Whether the rule keeps some clients and drops the others (Krum, Multi-Krum, Bulyan)."""
        return self.rule in SELECTING_RULES

    def __call__(self, optimizer, updates, weights, out: torch.Tensor) -> RoundAggregate:
        if self.rule == "mean":
            self.rounds += 1
            return LocalAggregator()(optimizer, updates, weights, out)
        refuse_robust_statistics(optimizer, self.rule)
        rows, C = optimizer.check_updates(updates)
        device, acc = out.device, out.dtype
        p_in, valid = normalize_weights(weights, C, device, acc)  # checked even where the rule ignores them
        pieces = isinstance(rows, ClientPieces)
        if pieces and not (reads_pieces(optimizer.backend, device)
                           and (self.rule != "centered-clip" or self._reference is None)):
            rows = self._stack(rows)  # the backend reads [C, N] rows: stacked once, into a kept buffer
            pieces = False
        params = dict(self.params)
        if self.weighted:  # checked (or, on a device, not read) by normalize_weights: the op trusts them
            params["weights"] = CheckedWeights(p_in)
        if self.rule == "centered-clip" and self._reference is not None:
            ref = self._reference
            if ref.shape[0] != out.shape[0]:
                raise ValueError(f"the centered-clipping reference has {ref.shape[0]} values but the updates have "
                                 f"{out.shape[0]}: load a state saved for this model")
            params["reference"] = ref.to(device=device, dtype=acc)
        res = robust_aggregate(rows, self.rule, out=out, backend=optimizer.backend, **params)
        if res.client_sq_norms is not None:  # the rule's own (a Gram matrix's diagonal)
            client_sq = res.client_sq_norms.to(acc)
        elif pieces:  # one pass of the aggregation kernel over the pieces, for its client norms
            client_sq = self._pieces_sq_norms(rows, optimizer.backend, acc)
        elif isinstance(rows, torch.Tensor):
            client_sq = torch.linalg.vector_norm(rows, dim=1, dtype=acc).square()
        else:
            client_sq = torch.stack([torch.linalg.vector_norm(r, dtype=acc) for r in rows]).square()
        zero = torch.zeros((), dtype=acc, device=device)
        entered = res.selected & ~res.excluded
        if res.weights is not None:
            w = torch.where(entered, res.weights.to(acc), zero)
        else:
            n = entered.sum().clamp_min(1).to(acc)
            w = torch.where(entered, 1 / n, zero)
        stats = AggregateStats(client_sq_norms=client_sq, sq_norm=torch.dot(out, out), excluded=res.excluded,
                               weights=w, all_excluded=res.all_excluded)
        # p: the clients that entered, renormalised (w is already 0 for the others); no norm bound
        agg = RoundAggregate.of(w, stats, valid, None)
        self.finish_round(res, agg.skip, out)
        return agg

    def finish_round(self, res: RobustResult, skip: torch.Tensor, out: torch.Tensor) -> None:
        """The rule's state after a round whose aggregate is ``out``: the selection it
        records, the round count, and centered clipping's next reference (this round's
        aggregate, unless the round was ``skip``-ped).  The distributed form calls it on
        the ranks that did not run the rule."""
        if self.rule == "centered-clip":
            prev = (self._reference.to(device=out.device, dtype=out.dtype) if self._reference is not None
                    else torch.zeros_like(out))
            self._reference = torch.where(skip, prev, out)
        self.last = res
        self.rounds += 1

    def _pieces_sq_norms(self, pieces, backend, acc) -> torch.Tensor:
        """Every ``||x_i||^2`` of clients read in place: the aggregation kernel's client
        norms (weights 0, so nothing is added; its ``[N]`` output a scratch buffer kept
        from round to round), without the ``[C, N]`` rows."""
        N = pieces.numel
        buf = self._scratch
        if buf is None or buf.shape[0] != N or buf.dtype != acc or buf.device != pieces.device:
            buf = self._scratch = torch.empty(N, dtype=acc, device=pieces.device)
        q, _ = aggregate_runner(backend, pieces.device)(pieces, torch.zeros(len(pieces), dtype=acc,
                                                                            device=pieces.device), 1.0, buf, None)
        return q

    def _stack(self, pieces) -> torch.Tensor:
        """``pieces`` (:class:`~fedopt_kernels.ops.ClientPieces`) as ``[C, N]`` rows, in a
        buffer kept from round to round: a fresh ``C x N`` allocation each round costs
        more in first-touch page faults than the copy itself (2.4 s against 0.3 s for 20
        ResNet-18 updates, measured on the 2-core test machine)."""
        return pieces.stack(out=self.kept_rows(len(pieces), pieces.numel, pieces.dtype, pieces.device))

    def kept_rows(self, C: int, N: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A ``[C, N]`` buffer kept from round to round (grown, or remade for another
        ``N``, dtype or device): where the rows are stacked or gathered."""
        buf = self._rows
        if buf is None or buf.shape[0] < C or buf.shape[1] != N or buf.dtype != dtype or buf.device != device:
            buf = self._rows = torch.empty(C, N, dtype=dtype, device=device)
        return buf[:C]

    # ------------------------------------------------------------------ records and state
    def record(self, clients=None) -> dict:
        """The last round's selection (one host read): for the selecting rules,
        ``robust_selected`` (the client ids of ``clients``, else row positions, whose
        updates entered) and ``robust_bound_met`` (no more than ``f`` clients were left
        out for NaN/Inf, so the rule's guarantee held)."""
        if self.last is None or not self.selects:
            return {}
        sel = (self.last.selected & ~self.last.excluded).cpu().tolist()
        ids = list(range(len(sel))) if clients is None else list(clients)
        return {"robust_selected": [c for c, s in zip(ids, sel) if s],
                "robust_bound_met": bool(self.last.bound_met.cpu())}

    def to_dict(self) -> dict:
        """The rule and its parameters, for ``results.json``."""
        return {"rule": self.rule, **self.params, "weighted": self.weighted}

    def state_dict(self) -> dict:
        """The rounds done and centered clipping's reference point (tensors and plain
        values only)."""
        ref = None if self._reference is None else self._reference.detach().cpu().clone()
        return {"rule": self.rule, "rounds": self.rounds, "reference": ref}

    def load_state_dict(self, state: dict) -> None:
        rule, rounds, ref = state.get("rule"), state.get("rounds"), state.get("reference")
        if rule != self.rule:
            raise ValueError(f"the state was saved by the rule {rule!r}, this aggregator runs {self.rule!r}")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"the robust aggregator's state must hold rounds, an integer >= 0, got {rounds!r}")
        if ref is not None:
            if not isinstance(ref, torch.Tensor) or ref.dim() != 1 or not ref.is_floating_point():
                raise ValueError("the robust aggregator's reference must be a 1-D floating tensor (the previous "
                                 "aggregate)")
            if not torch.isfinite(ref).all():
                raise ValueError("the robust aggregator's reference holds NaN/Inf")
            ref = ref.clone()
        self.rounds, self._reference = rounds, ref

    def __repr__(self) -> str:
        return "RobustAggregator(" + ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items()
                                               if k != "weighted") + ")"
