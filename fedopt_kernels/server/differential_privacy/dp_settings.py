"""Which DP-FedAvg settings a run may use: the one set of refusals of ``fedopt simulate
--dp-*`` (:meth:`SimulationConfig.validate <fedopt_kernels.fl.run.config.SimulationConfig.validate>`)
and of the Flower strategies' ``dp_*`` arguments
(:class:`~fedopt_kernels.integrations.flower.FusedStrategy` and its privacy concern).

Both name a setting their own way (``dp-clip`` on the command line, ``dp_clip`` in
Python), so :func:`check_dp_settings` takes the names to print; the reasons are the
same words.  A setting is refused when it would void the guarantee (an unbounded
weight, a server step that reads what the mechanism does not privatise, noise without a
``delta`` to report epsilon at, a ``delta`` of ``1/n`` or more, adaptive clipping whose
count gets no share of the noise) or cannot mean anything (a DP setting without a
clip).  No torch here: the config imports it.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

__all__ = ["DP_MODES", "DP_REFUSED_ALGOS", "CLI_NAMES", "PYTHON_NAMES", "check_dp_settings", "robust_with_dp_error"]

DP_MODES = ("server", "client")  # server/differential_privacy/dp.py: who clips
# server steps that read what DP does not privatise (server/differential_privacy/dp.py), with the reason
DP_REFUSED_ALGOS = {
    "fedexp": "its step size reads every client's ||D_i||^2",
    "asnes": "its gain ratio reads every client's ||D_i||^2",
    "fedlaw": "it learns the aggregation weights from every client's model on a proxy set",
    "scaffold": "its control variates carry every client's update unclipped and without noise",
}
# how each setting is named in the messages: fedopt simulate's flags (without "--") ...
CLI_NAMES: Dict[str, str] = {
    "dp_clip": "dp-clip", "dp_noise_multiplier": "dp-noise-multiplier", "dp_target_quantile": "dp-target-quantile",
    "dp_delta": "dp-delta", "dp_mode": "dp-mode", "dp_clip_lr": "dp-clip-lr",
    "dp_clip_count_stddev": "dp-clip-count-stddev", "clients": "clients", "per_round": "per-round",
    "weighting": "weighting", "algo": "algo", "aggregator": "aggregator",
}
# ... and the Flower strategies' keyword arguments (n: dp_num_clients, m: the nodes sampled per round)
PYTHON_NAMES: Dict[str, str] = {
    **{k: k for k in CLI_NAMES}, "clients": "dp_num_clients",
    "per_round": "the nodes sampled per round",
}


def _real(value, name: str, low=-math.inf, high=math.inf, low_open=False, high_open=False) -> None:
    """``fedopt simulate``'s number check (fl/run/config.py), by ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    bad = not math.isfinite(value)
    bad = bad or (value <= low if low_open else value < low) or (value >= high if high_open else value > high)
    if bad:
        lo = "" if low == -math.inf else (f"> {low:g}" if low_open else f">= {low:g}")
        hi = "" if high == math.inf else (f"< {high:g}" if high_open else f"<= {high:g}")
        raise ValueError(f"{name} must be {' and '.join(s for s in (lo, hi) if s)}, got {value}")


def robust_with_dp_error(rule: str, names: Dict[str, str] = CLI_NAMES) -> str:
    """Why a robust aggregation rule and DP-FedAvg do not go together."""
    return (f"{names['aggregator']} {rule} cannot be combined with {names['dp_clip']}: DP-FedAvg's sensitivity "
            "argument is for the clipped weighted sum (one client moves it by at most clip / m), which a robust rule "
            f"does not compute; use {names['aggregator']} mean with {names['dp_clip']}")


def check_dp_settings(*, clip: Optional[float], noise_multiplier: float = 0.0, target_quantile: Optional[float] = None,
                      delta: Optional[float] = None, mode: str = "server", algo: str, weighting: str,
                      resolved_weighting: str, clients: int, per_round: int, clip_lr: Optional[float] = None,
                      clip_count_stddev: Optional[float] = None, names: Dict[str, str] = CLI_NAMES) -> bool:
    """Raise ``ValueError`` (naming the setting by ``names``) for DP settings that are out
    of range, meaningless or would void the guarantee; return whether DP is on.

    ``clients``: ``n``, the population sampled from; ``per_round``: ``m``, the clients
    per round (the mechanism's divisor, the accountant's sample); ``algo``: the server
    algorithm's name (``fedopt simulate``'s); ``weighting`` as given and
    ``resolved_weighting`` (``"size"`` or ``"uniform"``); ``clip_lr`` and
    ``clip_count_stddev``: adaptive clipping's ``eta_C`` and ``sigma_b`` where the caller
    offers them (None: :class:`~fedopt_kernels.server.differential_privacy.dp.DPAggregator`'s defaults, 0.2
    and ``m / 20``)."""
    n = names
    if mode not in DP_MODES:
        raise ValueError(f"unknown {n['dp_mode']} {mode!r}; choose one of {', '.join(DP_MODES)}")
    if clip is not None:
        _real(clip, n["dp_clip"], 0.0, low_open=True)
    _real(noise_multiplier, n["dp_noise_multiplier"], 0.0)
    if target_quantile is not None:
        _real(target_quantile, n["dp_target_quantile"], 0.0, 1.0, low_open=True, high_open=True)
    if delta is not None:
        _real(delta, n["dp_delta"], 0.0, 1.0, low_open=True, high_open=True)
    if clip_lr is not None:
        _real(clip_lr, n["dp_clip_lr"], 0.0, low_open=True)
    if clip_count_stddev is not None:
        _real(clip_count_stddev, n["dp_clip_count_stddev"], 0.0)
    z = noise_multiplier
    if clip is None:
        given = [n[name] for name, on in (("dp_noise_multiplier", z > 0),
                                          ("dp_target_quantile", target_quantile is not None),
                                          ("dp_delta", delta is not None),
                                          ("dp_mode", mode != "server"),
                                          ("dp_clip_lr", clip_lr is not None),
                                          ("dp_clip_count_stddev", clip_count_stddev is not None)) if on]
        if given:
            raise ValueError(f"{given[0]} needs {n['dp_clip']} (the clip C, the initial clip with "
                             f"{n['dp_target_quantile']}): differential privacy clips every update to it")
        return False
    if algo in DP_REFUSED_ALGOS:
        raise ValueError(f"{n['dp_clip']} cannot be used with {n['algo']} {algo}: {DP_REFUSED_ALGOS[algo]}, which "
                         "the DP mechanism does not privatise (that would void the guarantee)")
    if resolved_weighting == "size":
        raise ValueError(f"{n['dp_clip']} with {n['weighting']} {weighting} (data-size weights for {algo}): a "
                         "client's weight has no bound, so neither has its influence on the sum, which voids "
                         f"the guarantee; use {n['weighting']} uniform")
    if z > 0 and delta is None:
        raise ValueError(f"{n['dp_noise_multiplier']} {z:g} needs {n['dp_delta']}, the delta at which epsilon is "
                         f"reported each round (e.g. 1e-5, below 1/{n['clients']} = {1 / clients:.3g})")
    if z == 0 and delta is not None:
        raise ValueError(f"{n['dp_delta']} asks for epsilon, but {n['dp_noise_multiplier']} is 0: without noise the "
                         f"clipped mean is not private (epsilon is infinite); set {n['dp_noise_multiplier']} > 0")
    if delta is not None and delta >= 1 / clients:
        raise ValueError(f"{n['dp_delta']} {delta:g} must be below 1/{n['clients']} = {1 / clients:.3g}: a "
                         "delta of 1/n allows one client's data to be released whole")
    if target_quantile is None:
        adaptive_only = [n[name] for name, v in (("dp_clip_lr", clip_lr), ("dp_clip_count_stddev", clip_count_stddev))
                         if v is not None]
        if adaptive_only:
            raise ValueError(f"{adaptive_only[0]} is a parameter of adaptive clipping: give "
                             f"{n['dp_target_quantile']} too")
        return True
    if mode == "client":
        raise ValueError(f"{n['dp_target_quantile']} (adaptive clipping) needs every client's unclipped bit, "
                         f"which {n['dp_mode']} client does not send: use {n['dp_mode']} server or a fixed "
                         f"{n['dp_clip']}")
    if clip_count_stddev is None:
        sigma_b, what = per_round / 20, f"{n['per_round']} / 20"  # Andrew et al. 2021's, dp.py's default
        fix = f"raise {n['per_round']}"
    else:
        sigma_b, what = clip_count_stddev, n["dp_clip_count_stddev"]
        fix = f"raise {n['dp_clip_count_stddev']}"
    if z > 0 and not 2 * sigma_b > z:
        raise ValueError(f"{n['dp_noise_multiplier']} {z:g} leaves adaptive clipping's count no share of the "
                         f"noise at {per_round} clients per round: the count's noise ({what} = "
                         f"{sigma_b:g}) must exceed {n['dp_noise_multiplier']} / 2 (z_Delta = (z^-2 - (2 sigma_b)^-2)"
                         f"^-1/2); use {n['dp_noise_multiplier']} < {2 * sigma_b:g} or {fix}")
    return True
