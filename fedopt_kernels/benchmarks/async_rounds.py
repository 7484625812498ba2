"""Synchronous rounds against FedBuff on the virtual clock: accuracy against virtual time
and against client updates, under no, mild and heavy device heterogeneity.

Each case is a ``fedopt_kernels.fl.run.clocked.ClockedRun`` of the same simulator settings
(digits or synthetic, FedAvg or FedAdam on the server, FedNAR clients): ``sync`` samples
``per_round`` clients a round and waits for the slowest; ``fedbuff`` keeps
``concurrency`` clients in flight and steps every ``buffer`` arrivals, with FedBuff's
staleness weight ``(1 + tau)^-1/2``.  Reported per case: the final accuracy, the virtual
time and the number of client updates it took to first reach ``target`` accuracy, and
the client updates trained per wall second (the batched engine's throughput, FedBuff
training each version's clients as one group).  FedBuff's claim (Nguyen et al. 2022,
section 5): under heterogeneous devices it reaches a target accuracy in less virtual
time than synchronous rounds, at the cost of more client updates.  ``python -m
fedopt_kernels.benchmarks.async_rounds [--rounds R] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import List, Optional

__all__ = ["run", "main"]


def _case(dataset: str, algo: str, mode: str, heterogeneity: str, *, rounds: int, clients: int, per_round: int,
          target: float, seed: int) -> dict:
    from ..fl import Simulation, SimulationConfig
    from ..fl.run.clocked import AsyncConfig, ClockConfig, ClockedRun

    cfg = SimulationConfig(dataset=dataset, algo=algo, clients=clients, per_round=per_round, rounds=rounds,
                           local_steps=10, weighting="uniform", seed=seed)
    sim = Simulation(cfg)
    acfg = AsyncConfig(mode=mode, concurrency=per_round, buffer=per_round if mode == "sync" else max(2, per_round // 2),
                       clock=ClockConfig(heterogeneity=heterogeneity))
    t0 = time.perf_counter()
    ClockedRun(sim, acfg).run()
    wall = time.perf_counter() - t0
    recs = sim.results.records
    updates = 0
    reached_t = reached_u = None
    for r in recs[1:]:
        updates += len(r["clients"])
        if reached_t is None and r.get("test_accuracy", 0.0) >= target:
            reached_t, reached_u = r["virtual_time"], updates
    return {"benchmark": "async_rounds", "dataset": dataset, "algo": algo, "mode": mode,
            "heterogeneity": heterogeneity, "final accuracy": recs[-1]["test_accuracy"],
            "virtual s": recs[-1]["virtual_time"], "client updates": updates,
            f"virtual s to {target:.0%}": reached_t, f"updates to {target:.0%}": reached_u,
            "updates / wall s": updates / wall}


def run(*, datasets=("digits",), algos=("fedavg",), rounds: int = 30, clients: int = 50, per_round: int = 10,
        target: float = 0.8, heterogeneity=("none", "mild", "heavy"), seed: int = 0) -> List[dict]:
    rows = []
    for dataset in datasets:
        for algo in algos:
            for h in heterogeneity:
                for mode in ("sync", "fedbuff"):
                    # FedBuff's server steps are half-size buffers: twice the steps for the same updates
                    r = rounds if mode == "sync" else 2 * rounds
                    rows.append(_case(dataset, algo, mode, h, rounds=r, clients=clients, per_round=per_round,
                                      target=target, seed=seed))
    return rows


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30, help="synchronous rounds (FedBuff takes twice the steps)")
    ap.add_argument("--datasets", default="digits", help="comma-separated: digits, synthetic")
    ap.add_argument("--algos", default="fedavg", help="comma-separated server algorithms: fedavg, fedadam")
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = run(datasets=tuple(args.datasets.split(",")), algos=tuple(args.algos.split(",")), rounds=args.rounds,
               target=args.target)
    key_t, key_u = f"virtual s to {args.target:.0%}", f"updates to {args.target:.0%}"
    for r in rows:
        reach = (f"{r[key_t]:.1f} virtual s, {r[key_u]} updates" if r[key_t] is not None else "not reached")
        print(f"{r['dataset']:9} {r['algo']:7} {r['heterogeneity']:6} {r['mode']:8} final {r['final accuracy']:.4f} "
              f"after {r['virtual s']:.1f} virtual s / {r['client updates']} updates; {args.target:.0%}: {reach}; "
              f"{r['updates / wall s']:.1f} updates / wall s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
