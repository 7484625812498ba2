"""Final test accuracy of FedAvg and the robust aggregators under attack, on the shipped
``digits`` data: the table of docs/robustness.md.

Every cell is one ``fedopt simulate`` run (20 clients, 10 per round, 20 rounds, the
other settings at their defaults) per seed, with ``--aggregator`` and ``--attack`` set;
a cell prints the mean over the seeds and the range.  Each run takes a few seconds on
one CPU thread.

Run: ``python -m fedopt_kernels.benchmarks.robust_accuracy [--seeds 0 1 2] [--rounds 20]
[--aggregators mean median ...] [--attacks none:0 signflip:0.2 ...] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Dict, List, Sequence, Tuple

import torch

# each aggregator of the table with the parameters it was run with
AGGREGATORS: Dict[str, dict] = {
    "mean": {},
    "median": dict(aggregator="median"),
    "trimmed-mean": dict(aggregator="trimmed-mean", trim_beta=0.3),
    "krum": dict(aggregator="krum", byzantine_f=3),
    "multi-krum": dict(aggregator="multi-krum", byzantine_f=3),
    "geomed": dict(aggregator="geomed"),
    "centered-clip": dict(aggregator="centered-clip", cclip_tau=0.25, cclip_iters=3),
}
ATTACKS: List[Tuple[str, float]] = [("none", 0.0), ("signflip", 0.2), ("signflip", 0.3), ("alie", 0.2),
                                    ("alie", 0.3), ("scale", 0.2), ("scale", 0.3)]
BASE = dict(dataset="digits", clients=20, per_round=10, rounds=20)


def run_cell(aggregator: str, attack: str, fraction: float, seed: int, rounds: int) -> float:
    """The final test accuracy of one run."""
    from ..fl import Simulation, SimulationConfig

    kw = dict(BASE, rounds=rounds, seed=seed, **AGGREGATORS[aggregator])
    if attack != "none":
        kw.update(attack=attack, attack_fraction=fraction)
    res = Simulation(SimulationConfig(**kw)).run()
    return float(res.records[-1]["test_accuracy"])


def table(results: Dict[Tuple[str, str, float], List[float]], aggregators: Sequence[str],
          attacks: Sequence[Tuple[str, float]]) -> str:
    """A markdown table: accuracy in %, the mean over seeds and (with several) the range."""
    head = ["no attack" if a == "none" else f"{a} {round(f * 100)}%" for a, f in attacks]
    lines = ["| aggregator | " + " | ".join(head) + " |", "|---|" + "---:|" * len(attacks)]
    for agg in aggregators:
        cells = []
        for a, f in attacks:
            v = results[(agg, a, f)]
            cell = f"{100 * statistics.mean(v):.1f}"
            cells.append(cell + (f" ({100 * min(v):.0f}-{100 * max(v):.0f})" if len(v) > 1 else ""))
        lines.append(f"| {agg} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _attack(text: str) -> Tuple[str, float]:
    kind, _, frac = text.partition(":")
    return kind, float(frac or 0)


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=BASE["rounds"])
    p.add_argument("--aggregators", nargs="+", default=list(AGGREGATORS), choices=list(AGGREGATORS))
    p.add_argument("--attacks", type=_attack, nargs="+", default=ATTACKS, metavar="KIND:FRACTION")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write every run's accuracy here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    results: Dict[Tuple[str, str, float], List[float]] = {}
    runs = []
    for attack, frac in a.attacks:
        for agg in a.aggregators:
            for seed in a.seeds:
                acc = run_cell(agg, attack, frac, seed, a.rounds)
                results.setdefault((agg, attack, frac), []).append(acc)
                runs.append(dict(aggregator=agg, attack=attack, fraction=frac, seed=seed, accuracy=acc))
    print(table(results, a.aggregators, a.attacks))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(settings=dict(BASE, rounds=a.rounds), aggregators=AGGREGATORS, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
