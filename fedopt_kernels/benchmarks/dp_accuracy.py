"""Final test accuracy of DP-FedAvg against the privacy spent, on the shipped ``digits``
data: the accuracy-vs-epsilon table of docs/privacy.md.

Every row is one ``fedopt simulate`` run per seed (100 clients, 20 per round sampled
without replacement, 30 rounds, uniform weights, the other settings at their defaults)
with ``--dp-clip`` / ``--dp-noise-multiplier`` / ``--dp-target-quantile`` set; a row prints
the mean final accuracy over the seeds (and the range), and the epsilon at
``--dp-delta`` after the last round as ``results.json`` records it (``dp_epsilon``: the
RDP accountant of dp-accounting, fixed-size sampling; the same for every seed).  The
first row is FedAvg without DP (same uniform weights), the second clipping alone
(no noise: no privacy, epsilon infinite).  Each run takes a few seconds on one CPU
thread.

Run: ``python -m fedopt_kernels.benchmarks.dp_accuracy [--seeds 0 1 2] [--rounds 30]
[--settings none clip z0.3 ...] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Dict, List, Optional, Tuple

import torch

CLIP = 0.5  # fixed clip: about the clients' median update norm in the first rounds here
DELTA = 1e-3  # below 1 / clients, as the accountant's guarantee needs
# each row of the table: its label and the DP settings it runs with
SETTINGS: Dict[str, dict] = {
    "none": {},
    "clip": dict(dp_clip=CLIP),
    "z0.3": dict(dp_clip=CLIP, dp_noise_multiplier=0.3, dp_delta=DELTA),
    "z0.6": dict(dp_clip=CLIP, dp_noise_multiplier=0.6, dp_delta=DELTA),
    "z1.0": dict(dp_clip=CLIP, dp_noise_multiplier=1.0, dp_delta=DELTA),
    "z2.0": dict(dp_clip=CLIP, dp_noise_multiplier=2.0, dp_delta=DELTA),
    "adaptive z1.0": dict(dp_clip=CLIP, dp_noise_multiplier=1.0, dp_delta=DELTA, dp_target_quantile=0.5),
}
BASE = dict(dataset="digits", clients=100, per_round=20, rounds=30, weighting="uniform")


def run_row(setting: str, seed: int, rounds: int) -> Tuple[float, Optional[float], Optional[float]]:
    """``(final accuracy, epsilon after the last round or None, last clip or None)`` of one run."""
    from ..fl import Simulation, SimulationConfig

    res = Simulation(SimulationConfig(**dict(BASE, rounds=rounds, seed=seed, **SETTINGS[setting]))).run()
    last = res.records[-1]
    return float(last["test_accuracy"]), last.get("dp_epsilon"), last.get("dp_clip")


def describe(setting: str) -> str:
    s = SETTINGS[setting]
    if not s:
        return "FedAvg, no DP"
    z = s.get("dp_noise_multiplier", 0.0)
    clip = f"adaptive (median, from {s['dp_clip']:g})" if "dp_target_quantile" in s else f"{s['dp_clip']:g}"
    return f"z = {z:g}, clip {clip}"


def table(results: Dict[str, List[Tuple[float, Optional[float], Optional[float]]]], delta: float) -> str:
    """A markdown table: accuracy in % (mean over seeds, range) and epsilon at ``delta``."""
    lines = [f"| setting | final accuracy % | epsilon at delta = {delta:g} |", "|---|---:|---:|"]
    for setting, runs in results.items():
        accs = [a for a, _, _ in runs]
        cell = f"{100 * statistics.mean(accs):.1f}" + (f" ({100 * min(accs):.1f}-{100 * max(accs):.1f})"
                                                       if len(accs) > 1 else "")
        eps = [e for _, e, _ in runs if e is not None]
        if not SETTINGS[setting]:
            eps_cell = "-- (no DP)"
        elif not eps:
            eps_cell = "infinite (no noise)"
        else:
            eps_cell = f"{eps[0]:.3g}"
            assert all(math.isclose(e, eps[0], rel_tol=1e-12) for e in eps), eps  # a function of z, q and T
        lines.append(f"| {describe(setting)} | {cell} | {eps_cell} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=BASE["rounds"])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write every run's accuracy and epsilon here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    results: Dict[str, List[Tuple[float, Optional[float], Optional[float]]]] = {}
    runs = []
    for setting in a.settings:
        for seed in a.seeds:
            acc, eps, clip = run_row(setting, seed, a.rounds)
            results.setdefault(setting, []).append((acc, eps, clip))
            runs.append(dict(setting=setting, seed=seed, accuracy=acc, epsilon=eps, last_clip=clip))
    print(table(results, DELTA))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(settings=dict(BASE, rounds=a.rounds, delta=DELTA), rows=SETTINGS, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
