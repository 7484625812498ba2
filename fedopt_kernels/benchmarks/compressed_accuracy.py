"""Accuracy against rounds of compressed client updates, with and without error feedback,
and the bytes a round sends up against fp32: the tables of docs/compression.md and
docs/benchmarks.md (issue 42).

Every cell is one ``fedopt simulate`` run with ``--compress`` (and ``--error-feedback``,
``--compress-stochastic``) set, the other settings those of :data:`BASE` (FedAvg, 10
clients, 5 per round); the test accuracy is read at the rounds of :data:`CHECKPOINTS`.
``bytes up / round`` is the mean of the records' ``bytes_up`` (codes + scales + indices
of the replies aggregated), ``x fewer`` its ratio to ``bytes_up_fp32`` (the same clients'
updates as fp32).

Run: ``python -m fedopt_kernels.benchmarks.compressed_accuracy [--rounds 20]
[--datasets digits synthetic] [--seed 0] [--json FILE]``; ``fedopt bench --only
compressed_accuracy`` gives the same rows (``--quick``: 5 rounds, digits).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List, Sequence

# (label, settings): each codec, the biased ones with and without error feedback
CODECS: List[tuple] = [
    ("fp32", dict(compress="none")),
    ("int8", dict(compress="int8")),
    ("int8 + EF", dict(compress="int8", error_feedback=True)),
    ("int4", dict(compress="int4")),
    ("int4 + EF", dict(compress="int4", error_feedback=True)),
    ("int4 stochastic", dict(compress="int4", compress_stochastic=True)),
    ("int4 stochastic + rotation", dict(compress="int4", compress_stochastic=True, compress_rotate=True)),
    ("fp8", dict(compress="fp8")),
    ("fp8 + EF", dict(compress="fp8", error_feedback=True)),
    ("top-k 10%", dict(compress="topk:0.1")),
    ("top-k 10% + EF", dict(compress="topk:0.1", error_feedback=True)),
    ("top-k 1%", dict(compress="topk:0.01")),
    ("top-k 1% + EF", dict(compress="topk:0.01", error_feedback=True)),
]
BASE = dict(algo="fedavg", clients=10, per_round=5)
DATASETS = {"digits": dict(dataset="digits"),
            "synthetic": dict(dataset="synthetic", partition="natural", max_samples_per_client=200, hidden=(64,))}
CHECKPOINTS = (1, 5, 10, 20)
# the cells of the docs' tables (the machine of this issue was too loaded for all 13 x 2)
SHORT = ("fp32", "int8", "int8 + EF", "int4", "int4 + EF", "fp8", "top-k 1%", "top-k 1% + EF")


def run_cell(dataset: str, label: str, rounds: int, seed: int = 0) -> dict:
    """One run: its row (accuracy at the checkpoints, bytes per round, wall time)."""
    from ..fl import Simulation, SimulationConfig

    settings = dict(CODECS)[label]
    cfg = SimulationConfig(**dict(BASE, **DATASETS[dataset], rounds=rounds, seed=seed, **settings))
    t0 = time.perf_counter()
    res = Simulation(cfg).run()
    wall = time.perf_counter() - t0
    acc = {r["round"]: r["test_accuracy"] for r in res.records if "test_accuracy" in r}
    rec = [r for r in res.records if r["round"] > 0]
    fp32 = sum(4 * res.meta["num_parameters"] * len(r["clients"]) for r in rec) / len(rec)
    up = sum(r["bytes_up"] for r in rec) / len(rec) if cfg.compress != "none" else fp32
    row = {"benchmark": "compressed_accuracy", "case": f"{dataset}: {label}", "dataset": dataset, "codec": label,
           "rounds": rounds, "seed": seed, "params": res.meta["num_parameters"], "bytes_up": up,
           "bytes_up_fp32": fp32, "x fewer bytes": fp32 / up, "final_acc": rec[-1]["test_accuracy"],
           "wall_s": wall}
    for c in CHECKPOINTS:
        if c <= rounds:
            row[f"acc@{c}"] = acc[c]
    return row


def run(*, rounds: int = 20, datasets: Sequence[str] = tuple(DATASETS), codecs: Sequence[str] = None,
        seed: int = 0) -> List[dict]:
    return [run_cell(ds, label, rounds, seed) for ds in datasets for label in (codecs or [c for c, _ in CODECS])]


def table(rows: List[dict]) -> str:
    """A markdown table per dataset: accuracy (%) at the checkpoints, bytes up per round."""
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        part = [r for r in rows if r["dataset"] == ds]
        checks = [c for c in CHECKPOINTS if f"acc@{c}" in part[0]]
        out.append(f"**{ds}** ({part[0]['params']:,} parameters, {part[0]['rounds']} rounds, seed {part[0]['seed']})\n")
        out.append("| codec | " + " | ".join(f"acc @ {c}" for c in checks)
                   + " | bytes up / round | x fewer than fp32 |")
        out.append("|---|" + "---:|" * (len(checks) + 2))
        for r in part:
            cells = [f"{100 * r[f'acc@{c}']:.1f}" for c in checks]
            out.append(f"| {r['codec']} | " + " | ".join(cells) + f" | {r['bytes_up'] / 1e3:,.0f} kB | "
                       f"{r['x fewer bytes']:.2f} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--codecs", nargs="+", default=None, choices=[c for c, _ in CODECS])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows: Dict = []
    for ds in args.datasets:
        for label in args.codecs or [c for c, _ in CODECS]:
            rows.append(run_cell(ds, label, args.rounds, args.seed))
            r = rows[-1]
            print(f"{r['case']}: final {100 * r['final_acc']:.1f}%, {r['x fewer bytes']:.2f}x fewer bytes, "
                  f"{r['wall_s']:.1f} s", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=2)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
