"""DP-FedAvg in Flower: the fused strategy with its ``dp_*`` arguments (the simulator's
:class:`~fedopt_kernels.server.differential_privacy.dp.DPAggregator` and accountant) against Flower's own
server-side DP wrappers around its ``FedAvg`` (``DifferentialPrivacyServerSideFixedClipping``
and ``...AdaptiveClipping``).

One round's ``aggregate_train`` on the SAME ``C`` client replies
(:func:`~fedopt_kernels.benchmarks.flower.make_replies`, every reply given the same
``num-examples`` so that Flower's FedAvg is the uniform mean DP-FedAvg divides by
``m = C``), timed interleaved (medians, same run).  Both sides decode the replies, clip
each client's update ``x_i - x`` to the clip ``C``, average, add Gaussian noise of std
``z C / m`` to the new global model and encode it.  The fused side is ``FedAvg`` (``lr =
1``, uniform weighting) with ``dp_clip=C, dp_noise_multiplier=z, dp_num_clients=m`` (every
node sampled, so ``m`` is the divisor; with noise ``dp_delta`` too, so its round also
reports epsilon, which Flower's wrappers do not): its global model ``x - (1/m) sum_i clip(x - x_i) + noise`` is
Flower's up to the noise and rounding (and, for adaptive clipping, the noise's scale: see
:func:`agreement`).

:func:`agreement` checks that before timing: with ``z = 0`` the two new global models
are both within fp32 rounding of the float64 oracle (:func:`oracle`), and with ``z > 0`` the noise each side adds
(its global model minus its noiseless one) has the std ``z C / m`` (both estimated over
all ``N`` coordinates).  Differences that are not rounding: Flower's clip factor is
``min(1, C / ||u||)``, ours ``min(1, C / (||u|| + 1e-6))`` (a relative ``1e-6 / ||u||``);
Flower draws float64 normals with numpy's global generator per array, ours a seeded
torch generator (reproducible; fp32).

Run ``python -m fedopt_kernels.benchmarks.flower_dp [--clients 20] [--model resnet18]
[--noise 1.0] [--clip 10]``.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Tuple

import torch

from .flower import MODELS, ShapesModel, comparison_parser, flat_arrays, format_row, make_replies, speedup_row
from .timing import interleaved

NUM_EXAMPLES = 100  # every reply's weight: Flower's FedAvg is then the uniform mean
DELTA = 1e-5  # the fused side's dp_delta with noise (epsilon in its metrics)


def equal_weight_replies(shapes, C: int, *, seed: int = 0, scale: float = 1e-2):
    """:func:`make_replies` with every reply's ``num-examples`` set to :data:`NUM_EXAMPLES`."""
    global_arrays, replies = make_replies(shapes, C, seed=seed, scale=scale)
    for m in replies:
        m.content["metrics"]["num-examples"] = NUM_EXAMPLES
    return global_arrays, replies


def pairs(C: int, z: float, clip: float, count_stddev=None) -> Dict[str, Tuple[Callable, dict]]:
    """``name: (Flower strategy factory (z), the fused strategy's dp_* keyword arguments)``;
    ``count_stddev``: adaptive clipping's ``sigma_b`` on both sides (None: ``C / 20``,
    both sides' default)."""
    sb = C / 20 if count_stddev is None else count_stddev
    from flwr.serverapp import strategy as F

    def flwr_fixed(noise):
        return F.DifferentialPrivacyServerSideFixedClipping(F.FedAvg(fraction_evaluate=0.0), noise, clip, C)

    def flwr_adaptive(noise):
        return F.DifferentialPrivacyServerSideAdaptiveClipping(F.FedAvg(fraction_evaluate=0.0), noise, C,
                                                               initial_clipping_norm=clip, target_clipped_quantile=0.5,
                                                               clip_norm_lr=0.2, clipped_count_stddev=sb)

    return {
        f"server-side fixed clip C={clip:g} z={z:g}": (flwr_fixed, dict(dp_clip=clip, dp_num_clients=C)),
        f"server-side adaptive clip C0={clip:g} z={z:g}": (flwr_adaptive, dict(dp_clip=clip, dp_num_clients=C,
                                                                                dp_target_quantile=0.5,
                                                                                dp_clip_lr=0.2,
                                                                                dp_clip_count_stddev=sb)),
    }


class _Sides:
    """One pair's two strategies over the same replies, each call from the same global model."""

    def __init__(self, shapes, global_arrays, replies, flwr_factory, ours_kw, z: float, seed: int = 0):
        from ..integrations import flower as fk

        self.global_arrays, self.replies = global_arrays, replies
        # Flower's wrapper replaces each reply's ArrayRecord by its clipped one: every call
        # first puts the original records back (dict assignments, no data copied)
        self.kept = [(m, dict(m.content.array_records.items())) for m in replies]
        self.flwr = flwr_factory(z)
        self.flwr.current_arrays = global_arrays  # what configure_train would have set
        noise = dict(dp_noise_multiplier=z, dp_delta=DELTA) if z > 0 else {}
        self.ours = fk.FedAvg(ShapesModel(shapes), lr=1.0, fraction_evaluate=0.0, weighting="uniform",
                              min_train_nodes=1, dp_seed=seed, **noise, **ours_kw)
        self.dp = self.ours.privacy.aggregator
        self.ours.load_global_arrays(global_arrays)
        self.rounds = iter(range(1, 10 ** 9))

    def restored(self):
        for m, records in self.kept:
            for name, rec in records.items():
                m.content[name] = rec
        return self.replies

    def run_flwr(self):
        return self.flwr.aggregate_train(next(self.rounds), self.restored())[0]

    def run_ours(self):
        out = self.ours.aggregate_train(next(self.rounds), self.restored())[0]
        self.ours.load_global_arrays(self.global_arrays)  # the next call starts from the same model
        return out


def oracle(global_arrays, replies, clip: float):
    """``(x0 + (1/m) sum_i min(1, C / ||u_i||) u_i, bound)`` in float64 from the replies
    (``u_i = x_i - x0``), and the rounding bound of an fp32 computation of it: at most
    ``C + 4`` roundings per coordinate (a client's update, its clip, ``x + it``, its
    weight, the ``C - 1`` additions, the division) of values no larger than ``|x0| +
    max_i |u_i|``, so ``(C + 4) u (|x0| + max_i |u_i|)`` with ``u = 2^-24``."""
    x0 = flat_arrays(global_arrays).double()
    total, biggest = torch.zeros_like(x0), torch.zeros_like(x0)
    for r in replies:
        u = flat_arrays(r.content["arrays"]).double() - x0
        total += min(1.0, clip / float(u.norm())) * u
        torch.maximum(biggest, u.abs(), out=biggest)
    m = len(replies)
    return x0 + total / m, (m + 4) * 2.0 ** -24 * (x0.abs() + biggest)


def agreement(shapes, C: int, z: float, clip: float, *, seed: int = 0, count_stddev=None) -> List[dict]:
    """Per pair: each side's largest distance from the float64 :func:`oracle` of the
    noiseless new global model, as a fraction of the oracle's rounding bound (``z = 0``;
    at most 1 means within the bound), how many replies were clipped, and at ``z > 0`` the std of the
    noise each side added (its global model minus its noiseless one) against the
    mechanism's ``z_Delta C / m`` (``z_Delta = z`` for a fixed clip, Andrew et al.'s
    share of ``z`` under adaptive clipping; ``C`` the clip the round clipped with), with,
    for adaptive clipping, Flower's clip after the round (its noise is scaled by that
    one: see docs/privacy.md)."""
    import numpy as np

    from ..server.differential_privacy.dp import effective_noise_multiplier

    global_arrays, replies = equal_weight_replies(shapes, C, seed=seed)
    x0 = flat_arrays(global_arrays).double()
    exact, bound = oracle(global_arrays, replies, clip)
    clipped = sum(float(torch.linalg.vector_norm(flat_arrays(r.content["arrays"]).double() - x0)) > clip
                  for r in replies)
    rows = []
    for name, (factory, kw) in pairs(C, z, clip, count_stddev).items():
        quiet = _Sides(shapes, global_arrays, replies, factory, kw, 0.0, seed)
        want, got = flat_arrays(quiet.run_flwr()), flat_arrays(quiet.run_ours())
        row = {"case": name, "clipped": clipped,
               "flwr error / bound": float(((want.double() - exact).abs() / bound).max()),
               "fused error / bound": float(((got.double() - exact).abs() / bound).max())}
        if z > 0:
            np.random.seed(seed)  # Flower draws from numpy's global generator
            noisy = _Sides(shapes, global_arrays, replies, factory, kw, z, seed)
            row["flwr noise std"] = float((flat_arrays(noisy.run_flwr()).double() - want.double()).std())
            row["fused noise std"] = float((flat_arrays(noisy.run_ours()).double() - got.double()).std())
            adaptive = "dp_target_quantile" in kw
            z_update = effective_noise_multiplier(z, kw["dp_clip_count_stddev"]) if adaptive else z
            row["mechanism std"] = z_update * clip / C
            if adaptive:
                row["flwr clip after"] = float(noisy.flwr.clipping_norm)
                row["flwr std / (z_Delta C_after / m)"] = row["flwr noise std"] / (
                    z_update * row["flwr clip after"] / C)
        rows.append(row)
    return rows


def bench(C: int = 20, model: str = "resnet18", *, z: float = 1.0, clip: float = 10.0, repeats: int = 3,
          warmup: int = 1, check: bool = True) -> List[dict]:
    """Median ms of one ``aggregate_train`` of each pair at noise multiplier ``z``;
    ``check``: first :func:`agreement` (and raise if either side's noiseless model is off
    the float64 :func:`oracle` by more than its rounding bound, or the fused side's noise std is off the mechanism's by more than
    2%; Flower's is reported, not checked: under adaptive clipping it is scaled by the
    next round's clip)."""
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    shapes = MODELS[model]()
    N = sum(math.prod(s) for s in shapes)
    checks = {}
    if check:
        for row in agreement(shapes, C, z, clip):
            if row["flwr error / bound"] > 1 or row["fused error / bound"] > 1:
                raise AssertionError(f"{row['case']}: a side is off the float64 oracle: {row}")
            if z > 0 and abs(row["fused noise std"] / row["mechanism std"] - 1) > 0.02:
                raise AssertionError(f"{row['case']}: the fused noise std is off: {row}")
            checks[row["case"]] = row
    global_arrays, replies = equal_weight_replies(shapes, C)
    candidates, names = {}, []
    for name, (factory, kw) in pairs(C, z, clip).items():
        sides = _Sides(shapes, global_arrays, replies, factory, kw, z)
        candidates[f"flwr {name}"] = sides.run_flwr
        candidates[f"fused {name}"] = sides.run_ours
        names.append(name)
    times = interleaved(candidates, repeats=repeats, warmup=warmup)
    label = f"{C} x {model} ({N / 1e6:.3g}M params)"
    return [speedup_row(f"flower DP aggregate_train {label}", n, times[f"flwr {n}"], times[f"fused {n}"],
                        **{k: v for k, v in checks.get(n, {}).items() if k != "case"})
            for n in names]


def main(argv=None) -> int:
    parser = comparison_parser(__doc__, repeats=3)
    parser.add_argument("--noise", type=float, default=1.0, help="noise multiplier z (timed, and its std checked)")
    parser.add_argument("--clip", type=float, default=10.0,
                        help="clip C (the initial clip for adaptive clipping); the replies' update norms are ~34")
    args = parser.parse_args(argv)
    for r in bench(args.clients, args.model, z=args.noise, clip=args.clip, repeats=args.repeats):
        print(format_row(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
