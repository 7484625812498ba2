"""Robust aggregation in Flower: the fused strategies with ``aggregator=`` against
Flower's own ``FedMedian``, ``FedTrimmedAvg``, ``Krum`` and ``MultiKrum``.

One round's ``aggregate_train`` on the SAME ``C`` client replies
(:func:`~fedopt_kernels.benchmarks.flower.make_replies`), timed interleaved (medians,
same run).  Each pair computes the same global model: Flower's rules take the median /
trimmed mean / Krum selection of the client models, the fused strategy (FedAvg,
``lr = 1``) of the updates ``x - x_i``, whose global model ``x - agg(x - x_i)`` is the
same up to rounding (:func:`bench` checks it before timing for the median and the
trimmed mean; Krum's pick among these equally spread replies is a near-tie that
Flower's float32 distances between models and our float64 Gram matrix of updates may
break differently -- tests/test_flower_robust.py compares the two Krums on replies
that Krum can tell apart).  Both sides decode the
replies and encode the new global ``ArrayRecord``.

Run ``python -m fedopt_kernels.benchmarks.flower_robust [--clients 20] [--model resnet18]``.
"""

from __future__ import annotations

import math
from typing import Dict, List

from .flower import MODELS, ShapesModel, comparison_parser, flat_arrays, format_row, make_replies, speedup_row
from .timing import interleaved


def pairs(C: int, f: int, beta: float) -> Dict[str, tuple]:
    """``name: (Flower strategy factory, fused strategy keyword arguments)``."""
    from flwr.serverapp import strategy as F

    kw = dict(fraction_evaluate=0.0)
    return {
        "median": (lambda: F.FedMedian(**kw), dict(aggregator="median")),
        f"trimmed mean beta={beta}": (lambda: F.FedTrimmedAvg(beta=beta, **kw),
                                      dict(aggregator="trimmed-mean", trim_beta=beta)),
        f"Krum f={f}": (lambda: F.Krum(num_malicious_nodes=f, **kw), dict(aggregator="krum", byzantine_f=f)),
        f"Multi-Krum f={f} m={C - f}": (lambda: F.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=C - f, **kw),
                                        dict(aggregator="multi-krum", byzantine_f=f, krum_m=C - f)),
    }


def bench(C: int = 20, model: str = "resnet18", *, f: int = 4, beta: float = 0.2, repeats: int = 3,
          warmup: int = 1, check: bool = True) -> List[dict]:
    """Median ms of one ``aggregate_train`` of each pair; ``check``: first assert that
    both sides give the same global model for the median and the trimmed mean (relative
    tolerance 1e-5 of its scale)."""
    import logging

    from ..integrations import flower as fk

    logging.getLogger("flwr").setLevel(logging.WARNING)
    shapes = MODELS[model]()
    N = sum(math.prod(s) for s in shapes)
    global_arrays, replies = make_replies(shapes, C)
    # Flower's robust strategies pop the arrays out of the replies they aggregate: every
    # call first puts the same Array objects back (a few dict insertions, no data copied)
    kept = [[(rec, dict(rec.items())) for rec in m.content.array_records.values()] for m in replies]

    def restored():
        for recs in kept:
            for rec, items in recs:
                for k, a in items.items():
                    rec[k] = a
        return replies

    rnd = iter(range(1, 10 ** 9))
    candidates, names = {}, []
    for name, (flwr_factory, ours_kw) in pairs(C, f, beta).items():
        flwr_s = flwr_factory()
        ours = fk.FedAvg(ShapesModel(shapes), fraction_evaluate=0.0, **ours_kw)
        ours.load_global_arrays(global_arrays)
        if check and "Krum" not in name:
            want, _ = flwr_s.aggregate_train(next(rnd), restored())
            got, _ = ours.aggregate_train(next(rnd), restored())
            ours.load_global_arrays(global_arrays)
            w, g = flat_arrays(want), flat_arrays(got)
            err = float((w - g).abs().max())
            if err > 1e-5 * float(w.abs().max()):
                raise AssertionError(f"{name}: the fused strategy differs from Flower's by {err:g}")
        candidates[f"flwr {name}"] = lambda s=flwr_s: s.aggregate_train(next(rnd), restored())
        candidates[f"fused {name}"] = lambda s=ours: s.aggregate_train(next(rnd), restored())
        names.append(name)
    times = interleaved(candidates, repeats=repeats, warmup=warmup)
    label = f"{C} x {model} ({N / 1e6:.3g}M params)"
    return [speedup_row(f"flower robust aggregate_train {label}", n, times[f"flwr {n}"], times[f"fused {n}"])
            for n in names]


def main(argv=None) -> int:
    parser = comparison_parser(__doc__, repeats=3)
    parser.add_argument("--f", type=int, default=4, help="Byzantine clients for Krum and Multi-Krum")
    parser.add_argument("--beta", type=float, default=0.2, help="trimmed mean's beta (Flower's default 0.2)")
    args = parser.parse_args(argv)
    for r in bench(args.clients, args.model, f=args.f, beta=args.beta, repeats=args.repeats):
        print(format_row(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
