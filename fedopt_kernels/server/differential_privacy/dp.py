r"""Differentially private aggregation: DP-FedAvg with fixed or adaptive clipping.

:class:`DPAggregator` is an :class:`~fedopt_kernels.server.aggregation.Aggregator`: give
it to a server optimizer (``FedAvg(params, aggregator=DPAggregator(...))``, or
``optimizer.aggregator = ...``) and every ``step`` aggregates with user-level
differential privacy, whatever the optimizer's step then does with the mean update
``D`` (post-processing: FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad).

**DP-FedAvg** (McMahan, Ramage, Talwar & Zhang 2018, "Learning Differentially Private
Recurrent Language Models", Algorithm 1 with the fixed-denominator estimator
``f_f``): each client's update is clipped to norm ``C``, the clipped updates are summed
with weights ``w_i in [0, 1]`` (1 by default; a weight capped at 1, as their
``min(n_k / w_hat, 1)``, keeps the sensitivity at ``C``), Gaussian noise of std
``z C`` is added and the sum divided by the expected number of clients ``m``::

    D = (1 / m) (sum_i w_i min(1, C / (||D_i|| + 1e-6)) D_i + N(0, (z C)^2 I))

Clipping, summing and the noise are the fused aggregation pass
(:func:`fedopt_kernels.ops.dp_noise.clipped_sum`: two passes of
:func:`~fedopt_kernels.ops.aggregate`'s kernel, the norms of the first deciding the
factors of the second, on the device; each writes ``out`` with the noise drawn inside
the kernel from a counter-based generator keyed by ``(seed, round)``:
:func:`dp_noise_key`).  A client holding NaN/Inf enters with weight 0 and the others
keep theirs (a rescaled mean would let one client move every weight).

**Adaptive clipping** (Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially
Private Learning with Adaptive Clipping", Algorithm 1), ``target_quantile=gamma``: the
clip follows the ``gamma``-quantile of the update norms, estimated with privacy.  Each
round, with ``b_i = 1[||D_i|| <= C]`` (before clipping):

* ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Algorithm 1, line 3) is the noise
  multiplier of the update, so that the update (sensitivity ``C``, noise ``z_Delta C``)
  and the clip count (sensitivity ``1/2``, noise ``sigma_b``) compose to one Gaussian
  mechanism of multiplier ``z`` (their section 3.1: ``z^-2 = z_Delta^-2 + (2
  sigma_b)^-2``); it needs ``2 sigma_b > z``;
* ``D = (1 / m) (sum_i clip(D_i) + N(0, (z_Delta C)^2 I))``;
* ``b_bar = (1 / m) (sum_i (b_i - 1/2) + N(0, sigma_b^2)) + 1/2`` -- Algorithm 1's
  ``(1 / m) (sum_i b_i + N(0, sigma_b^2))`` with each ``b_i`` centred, which is what
  gives the count the sensitivity ``1/2`` the formula above assumes (the two are equal
  when exactly ``m`` clients take part);
* ``C <- C exp(-eta_C (b_bar - gamma))`` (the geometric update, Algorithm 1's last
  line; their recommended ``eta_C = 0.2``, ``gamma = 0.5``, ``sigma_b = m / 20``).

The clip used by a round is the one before its update.  The privacy of ``T`` rounds is
that of ``T`` sampled Gaussian mechanisms of multiplier ``z``:
:class:`~fedopt_kernels.server.differential_privacy.privacy_accountant.PrivacyAccountant`.

**Client-side clipping** (``mode="client"``): the clients clip their own updates before
sending them (:func:`~fedopt_kernels.ops.dp_noise.clip_updates_` with
:attr:`DPAggregator.clip`), so the server never sees an unclipped update, and the
server adds the noise.  The server still passes every update through the same norm
bound, so a client that did not clip cannot void the guarantee; the clients clip to a
hair under ``C`` (``C (1 - 1e-5)``), so for honest clients that bound changes no weight
and the server reads the data once.  Adaptive clipping
needs each client's bit ``b_i`` besides its update, which this aggregator's interface
does not carry: client mode takes a fixed clip.

Settings that would void the guarantee are refused with the reason: weights outside
``[0, 1]`` (data sizes without a bound), a server step that reads per-client statistics
the mechanism does not privatise (FedExP's and ASNES's step sizes), ``2 sigma_b <= z``.

Floating point: the guarantee is that of the real-valued mechanism; the clipped norm
is ``||D_i|| C / (||D_i|| + 1e-6)``, under ``C`` by more than fp32 rounding of the norm
for ``C`` of order 1, and the noise is torch's sampler (not a discrete or
floating-point-hardened Gaussian).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from ...ops import validation as V
from ...ops.aggregate import AggregateStats, host_to_device
from ...ops.dp_noise import clipped_sum, gaussian_noise_
from ..aggregation import CheckedWeights, RoundAggregate, check_weight_tensor, refuse_dtensor, weight_numbers

if TYPE_CHECKING:  # pragma: no cover
    from .. import ServerOptimizer

__all__ = ["DPAggregator", "DPRound", "MODES", "effective_noise_multiplier", "dp_noise_seed", "dp_noise_key",
           "refuse_client_statistics"]

MODES = ("server", "client")
DP_NOISE_PURPOSE = 9  # fedopt_kernels.fl.seeds.Purpose.DP_NOISE: part of the reproducibility contract


def _round_words(seed: int, round_number: int):
    return np.random.SeedSequence([int(seed), DP_NOISE_PURPOSE, int(round_number)]).generate_state(2, np.uint64)


def dp_noise_seed(seed: int, round_number: int) -> int:
    """The seed of the ``torch.Generator`` of round ``round_number``'s clip-count noise
    (adaptive clipping): a stable function of ``(seed, round)`` alone (as
    :func:`fedopt_kernels.fl.seeds.derive_seed`), so a resumed run draws what an
    uninterrupted one would."""
    return int(_round_words(seed, round_number)[0] >> np.uint64(1))


def dp_noise_key(seed: int, round_number: int) -> int:
    """The key (in ``[0, 2^63)``) of round ``round_number``'s update noise, drawn inside
    the aggregation kernel (:mod:`fedopt_kernels.ops.dp_noise`): the second word of the
    round's seed sequence, so it is not :func:`dp_noise_seed` -- torch's CUDA generator
    is the same Philox, and element 0 of the update noise would then share its counter
    with the clip count's draw."""
    return int(_round_words(seed, round_number)[1] >> np.uint64(1))


def effective_noise_multiplier(noise_multiplier: float, clip_count_stddev: float) -> float:
    """``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` ([Andrew et al. 2021] Algorithm 1):
    the update's share of a total noise multiplier ``z`` when the clip count is noised
    with std ``sigma_b``.  Raises unless ``2 sigma_b > z`` (else the count alone would
    spend the whole budget)."""
    z = V.check_real(noise_multiplier, "noise_multiplier", low=0.0, low_open=True)
    sb = V.check_real(clip_count_stddev, "clip_count_stddev", low=0.0)
    if not 2 * sb > z:
        raise ValueError(f"clip_count_stddev must exceed noise_multiplier / 2 = {z / 2:g} (z_Delta = (z^-2 - "
                         f"(2 sigma_b)^-2)^-1/2 needs 2 sigma_b > z), got {sb:g}: raise it (Andrew et al. suggest "
                         "expected clients / 20) or lower the noise multiplier")
    return (z ** -2 - (2 * sb) ** -2) ** -0.5


def refuse_client_statistics(optimizer) -> None:
    """Refuse a server optimizer whose step reads the clients' individual norms: FedExP's
    step size and ASNES's gain ratio are functions of every ``||D_i||^2``, which the
    DP mechanism does not privatise."""
    from ..asnes import ASNES
    from ..fedexp import FedExP

    if isinstance(optimizer, (FedExP, ASNES)):
        raise ValueError(f"{type(optimizer).__name__} cannot aggregate with differential privacy: its step size "
                         "reads every client's ||D_i||^2, which the mechanism does not privatise (that would void "
                         "the guarantee); use FedAvg, FedAvgM, FedAdam, FedYogi or FedAdagrad")


@dataclass(frozen=True)
class DPRound:
    """One DP round, as tensors on the device (read them once, when recording).

    * ``clip``: the clip ``C`` the round used (float64);
    * ``noise_std``: the std of the noise in the mean update, ``z_Delta C / m`` (0
      without noise);
    * ``unclipped_fraction``: the privatised ``b_bar`` (adaptive clipping), else None;
    * ``next_clip``: the clip of the next round.
    """

    clip: torch.Tensor
    noise_std: torch.Tensor
    unclipped_fraction: Optional[torch.Tensor]
    next_clip: torch.Tensor


class DPAggregator:
    """DP-FedAvg aggregation (see the module docstring).

    Args:
        clip: ``C > 0``, the clip (the initial clip with ``target_quantile``).
        noise_multiplier: ``z >= 0`` (0: clipping without noise, no privacy).
        expected_clients: ``m > 0``, the divisor of the sum (the expected number of
            clients per round; with weights, their expected total weight).
        target_quantile: ``gamma`` in ``(0, 1)`` for adaptive clipping; None: fixed.
        clip_lr: ``eta_C > 0`` of the geometric clip update (default 0.2).
        clip_count_stddev: ``sigma_b >= 0`` (default ``expected_clients / 20``); with
            noise it must exceed ``z / 2``.
        mode: ``"server"`` (the server clips) or ``"client"`` (the clients clip).
        seed: the seed of the noise: round ``t``'s update noise has the key
            ``dp_noise_key(seed, t)``, adaptive clipping's count noise comes from a
            generator seeded with ``dp_noise_seed(seed, t)``.
    """

    def __init__(self, *, clip: float, noise_multiplier: float, expected_clients: float,
                 target_quantile: Optional[float] = None, clip_lr: float = 0.2,
                 clip_count_stddev: Optional[float] = None, mode: str = "server", seed: int = 0):
        self.initial_clip = V.check_real(clip, "clip", low=0.0, low_open=True)
        self.noise_multiplier = V.check_real(noise_multiplier, "noise_multiplier", low=0.0)
        self.expected_clients = V.check_real(expected_clients, "expected_clients", low=0.0, low_open=True)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.seed = seed
        self.target_quantile = None
        self.clip_lr = V.check_real(clip_lr, "clip_lr", low=0.0, low_open=True)
        self.clip_count_stddev = 0.0
        self.update_noise_multiplier = self.noise_multiplier  # z_Delta
        if target_quantile is not None:
            if mode == "client":
                raise ValueError("target_quantile (adaptive clipping) needs every client's unclipped bit b_i, which "
                                 "client-side clipping does not send here: use mode='server' or a fixed clip")
            self.target_quantile = V.check_real(target_quantile, "target_quantile", low=0.0, high=1.0,
                                                low_open=True, high_open=True)
            sb = self.expected_clients / 20 if clip_count_stddev is None else clip_count_stddev
            self.clip_count_stddev = V.check_real(sb, "clip_count_stddev", low=0.0)
            if self.noise_multiplier > 0:
                self.update_noise_multiplier = effective_noise_multiplier(self.noise_multiplier,
                                                                          self.clip_count_stddev)
        elif clip_count_stddev is not None:
            raise ValueError("clip_count_stddev is the noise of adaptive clipping's count: give target_quantile too")
        self.rounds = 0
        self._clip = torch.tensor(self.initial_clip, dtype=torch.float64)  # moves to the data's device
        self.last: Optional[DPRound] = None

    @property
    def adaptive(self) -> bool:
        return self.target_quantile is not None

    @property
    def clip(self) -> torch.Tensor:
        """The clip the next round uses (a float64 0-d tensor on the data's device once a
        round ran; reading its value synchronises)."""
        return self._clip

    # ------------------------------------------------------------------ the round
    def check_weights(self, weights, C: int) -> Optional[torch.Tensor]:
        """``None`` (every client 1) or ``[C]`` host weights in ``[0, 1]`` as float64
        (:class:`CheckedWeights`, the round's: their form and sign were checked where they
        entered; the bound in ``[0, 1]``, DP's own, is checked here)."""
        if weights is None:
            return None
        refuse_dtensor(weights, "weights")
        if isinstance(weights, CheckedWeights):
            if len(weights) != C:
                raise ValueError(f"weights has {len(weights)} entries but there are {C} clients")
            w = weights.values.detach().to("cpu", torch.float64)
        elif isinstance(weights, torch.Tensor):
            if weights.device.type != "cpu":
                raise ValueError("weights under differential privacy must be host numbers (a list or a CPU tensor): "
                                 "their bound in [0, 1] is checked by value, which on a device would synchronise")
            check_weight_tensor(weights, C, weights.device)
            w = weights.detach().to(torch.float64)
        else:
            w = torch.tensor(weight_numbers(weights, C), dtype=torch.float64)
        bad = ~(torch.isfinite(w) & (w >= 0) & (w <= 1))
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(f"weights must lie in [0, 1] under differential privacy, got {w[i].item():g} at index "
                             f"{i}: a weight without a fixed bound (data sizes) lets one client's influence on the sum "
                             "grow without bound, which voids the guarantee; cap the weights (McMahan et al. 2018: "
                             "min(n_k / w_hat, 1)) or pass none")
        return w

    def __call__(self, optimizer: "ServerOptimizer", updates, weights, out: torch.Tensor) -> RoundAggregate:
        refuse_client_statistics(optimizer)
        rows, C = optimizer.check_updates(updates)
        w = self.check_weights(weights, C)
        if w is not None and w.numel() and not bool((w > 0).any()):  # the rest of the op's check, which trusts w
            raise ValueError("weights must not all be zero")
        device, acc = out.device, out.dtype
        m = self.expected_clients
        clip = self.clip_on(device)
        # the clip step and the update's noise: (1/m) sum_i w_i clip(D_i) + N(0, (z_Delta C / m)^2 I)
        # into out, every norm and factor
        key, std = self.update_noise(clip)
        checked = None if w is None else CheckedWeights(w)  # checked by value just above: the op trusts them
        _, st = clipped_sum(rows, clip, weights=checked, scale=1.0 / m, out=out, noise_key=key, noise_std=std,
                            backend=optimizer.backend)
        b_bar, next_clip = self.privatise_count(st.unclipped, clip, out.device)
        base = torch.ones(C, dtype=acc, device=device) if w is None else host_to_device(w.to(acc), device, "weights")
        sq_norm = torch.dot(out.to(acc), out.to(acc)) if out.dtype != acc else torch.dot(out, out)
        return self.close_round(clip, base, excluded=st.excluded, factors=st.factors,
                                client_sq_norms=st.client_sq_norms, weights=st.weights / m, sq_norm=sq_norm,
                                b_bar=b_bar, next_clip=next_clip)

    # The two steps after the clipped sum, shared with the distributed form
    # (fedopt_kernels.distributed.dp), which computes that sum over the ranks.
    def clip_on(self, device) -> torch.Tensor:
        """The clip of this round as a float64 0-d tensor on ``device``."""
        return host_to_device(self._clip, device, "the DP clip") if self._clip.device != device else self._clip

    def update_noise(self, clip: torch.Tensor):
        """``(key, std)`` of this round's update noise (``key`` None without noise): the
        noise of std ``z_Delta C / m`` added to the mean update, drawn inside the
        aggregation kernel from round ``t``'s key (:func:`dp_noise_key`)."""
        if not self.noise_multiplier > 0:
            return None, 0.0
        return dp_noise_key(self.seed, self.rounds + 1), self.noise_std(clip)

    def add_update_noise_(self, out: torch.Tensor, clip: torch.Tensor, backend=None) -> None:
        """The update noise of :meth:`update_noise` added to a sum already made (the
        distributed round, whose sum ends on one rank): the same bits as the fused pass
        for an fp32/fp64 ``out``."""
        key, std = self.update_noise(clip)
        if key is not None:
            gaussian_noise_(out, std, key, backend=backend)

    def privatise_count(self, unclipped: torch.Tensor, clip: torch.Tensor, device):
        """Adaptive clipping's privatised count ``b_bar`` and the next clip, the count's
        noise from round ``t``'s generator (``dp_noise_seed(seed, t)``).  Returns ``(b_bar
        or None, next clip)``; ``unclipped``: ``[C]`` bools ``||D_i|| <= C``."""
        if not self.adaptive:
            return None, clip
        m = self.expected_clients
        count = (unclipped.to(torch.float64) - 0.5).sum()
        if self.clip_count_stddev > 0:
            gen = torch.Generator(device=device).manual_seed(dp_noise_seed(self.seed, self.rounds + 1))
            count = count + self.clip_count_stddev * torch.randn((), generator=gen, device=device,
                                                                 dtype=torch.float64)
        b_bar = count / m + 0.5
        return b_bar, clip * torch.exp(-self.clip_lr * (b_bar - self.target_quantile))

    def noise_std(self, clip: torch.Tensor) -> torch.Tensor:
        """``z_Delta C / m``: the std of the noise in the mean update."""
        return (self.update_noise_multiplier / self.expected_clients) * clip

    def close_round(self, clip: torch.Tensor, base: torch.Tensor, *, excluded: torch.Tensor, factors: torch.Tensor,
                    client_sq_norms: torch.Tensor, weights: torch.Tensor, sq_norm: torch.Tensor,
                    b_bar: Optional[torch.Tensor], next_clip: torch.Tensor) -> RoundAggregate:
        """The round's :class:`~fedopt_kernels.server.aggregation.RoundAggregate` (``p_i =
        w_i / m`` but 0 for an excluded client, the clip factors as bounds) from the
        clients' ``base`` weights (acc dtype) and what the clip step found; records the
        round (:attr:`last`) and moves on to the next clip."""
        m = self.expected_clients
        zero = torch.zeros((), dtype=base.dtype, device=base.device)
        p = torch.where(excluded, zero, base / m)
        bound = torch.where(p > 0, factors, zero)
        all_excluded = excluded.all()
        # with noise the mechanism's output is applied whatever the clients sent: skipping
        # a round because every client was left out would itself depend on their data
        skip = all_excluded if self.noise_multiplier == 0 else torch.zeros((), dtype=torch.bool, device=base.device)
        stats = AggregateStats(client_sq_norms=client_sq_norms, sq_norm=sq_norm, excluded=excluded, weights=weights,
                               all_excluded=all_excluded)
        std = self.noise_std(clip)
        self.last = DPRound(clip=clip, noise_std=std if self.noise_multiplier > 0 else torch.zeros_like(std),
                            unclipped_fraction=b_bar, next_clip=next_clip)
        self._clip = next_clip
        self.rounds += 1
        return RoundAggregate(stats=stats, p=p, bound=bound, skip=skip)

    # ------------------------------------------------------------------ records and state
    def record(self) -> dict:
        """The last round's privatised numbers as Python floats (one host read):
        ``dp_clip``, ``dp_noise_std`` and, adaptive, ``dp_unclipped_fraction``."""
        if self.last is None:
            return {}
        keys = ["dp_clip", "dp_noise_std"] + (["dp_unclipped_fraction"] if self.adaptive else [])
        vals = [self.last.clip, self.last.noise_std] + ([self.last.unclipped_fraction] if self.adaptive else [])
        values = torch.stack([v.detach().to(torch.float64).cpu() for v in vals]).tolist()
        return dict(zip(keys, values))

    def to_dict(self) -> dict:
        """The settings, for ``results.json``."""
        out = {"mode": self.mode, "clip": self.initial_clip, "noise_multiplier": self.noise_multiplier,
               "expected_clients": self.expected_clients, "seed": self.seed}
        if self.adaptive:
            out.update(target_quantile=self.target_quantile, clip_lr=self.clip_lr,
                       clip_count_stddev=self.clip_count_stddev, update_noise_multiplier=self.update_noise_multiplier)
        return out

    def state_dict(self) -> dict:
        """The rounds done and the current clip (tensors and plain values only)."""
        return {"rounds": self.rounds, "clip": self._clip.detach().to("cpu", torch.float64).clone()}

    def load_state_dict(self, state: dict) -> None:
        rounds, clip = state.get("rounds"), state.get("clip")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"the DP state must hold rounds, an integer >= 0, got {rounds!r}")
        clip = torch.as_tensor(clip, dtype=torch.float64).reshape(())
        if not (torch.isfinite(clip) and clip > 0):
            raise ValueError(f"the DP state's clip must be a finite number > 0, got {clip.item()!r}")
        self.rounds, self._clip = rounds, clip.clone()

    def __repr__(self) -> str:
        return "DPAggregator(" + ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items()) + ")"
