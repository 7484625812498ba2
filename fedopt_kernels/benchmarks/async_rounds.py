"""Synchronous rounds against FedBuff on the virtual clock: accuracy against virtual time
and against client updates, under no, mild and heavy device heterogeneity.

Each case is a ``fedopt_kernels.fl.run.clocked.ClockedRun`` of the same simulator settings
(digits or synthetic, FedAvg or FedAdam on the server, FedNAR clients): ``sync`` samples
``per_round`` clients a round and waits for the slowest; ``fedbuff`` keeps
``concurrency`` clients in flight and steps every ``buffer`` arrivals, with FedBuff's
staleness weight ``(1 + tau)^-1/2``.  Reported per case: the final accuracy, the virtual
time and the number of client updates it took to first reach ``target`` accuracy, and
the client updates trained per wall second (the batched engine's throughput; FedBuff
trains each version's clients as one group, ``--groupings version,in_flight`` adds the
groups of every client in flight whatever its version, for comparison).  ``--seeds 0,1,2``
repeats every case (the devices and the data drawn from the seed); :func:`summary`
gives each case's mean and spread.  FedBuff's claim (Nguyen et al. 2022,
section 5): under heterogeneous devices it reaches a target accuracy in less virtual
time than synchronous rounds, at the cost of more client updates.  ``python -m
fedopt_kernels.benchmarks.async_rounds [--rounds R] [--seeds S] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import List, Optional

__all__ = ["run", "summary", "main"]


def _case(dataset: str, algo: str, mode: str, heterogeneity: str, *, rounds: int, clients: int, per_round: int,
          target: float, seed: int, grouping: str = "version") -> dict:
    from ..fl import Simulation, SimulationConfig
    from ..fl.run.clocked import AsyncConfig, ClockConfig, ClockedRun

    cfg = SimulationConfig(dataset=dataset, algo=algo, clients=clients, per_round=per_round, rounds=rounds,
                           local_steps=10, weighting="uniform", seed=seed)
    sim = Simulation(cfg)
    acfg = AsyncConfig(mode=mode, concurrency=per_round, buffer=per_round if mode == "sync" else max(2, per_round // 2),
                       clock=ClockConfig(heterogeneity=heterogeneity))
    t0 = time.perf_counter()
    ClockedRun(sim, acfg, grouping=grouping).run()
    wall = time.perf_counter() - t0
    recs = sim.results.records
    updates = 0
    reached_t = reached_u = None
    for r in recs[1:]:
        updates += len(r["clients"])
        if reached_t is None and r.get("test_accuracy", 0.0) >= target:
            reached_t, reached_u = r["virtual_time"], updates
    return {"benchmark": "async_rounds", "dataset": dataset, "algo": algo, "mode": mode, "seed": seed,
            "grouping": grouping if mode == "fedbuff" else None,
            "heterogeneity": heterogeneity, "final accuracy": recs[-1]["test_accuracy"],
            "virtual s": recs[-1]["virtual_time"], "client updates": updates,
            f"virtual s to {target:.0%}": reached_t, f"updates to {target:.0%}": reached_u,
            "updates / wall s": updates / wall,
            # (virtual s, updates, accuracy) of every record: any other target, read afterwards
            "curve": [(r.get("virtual_time", 0.0), sum(len(q["clients"]) for q in recs[1:i + 1]),
                       r.get("test_accuracy")) for i, r in enumerate(recs)]}


def run(*, datasets=("digits",), algos=("fedavg",), rounds: int = 30, clients: int = 50, per_round: int = 10,
        target=0.8, heterogeneity=("none", "mild", "heavy"), seeds=(0,), groupings=("version",),
        on_row=None) -> List[dict]:
    """``target``: an accuracy, or ``{dataset: accuracy}``.  The modes of a case run one
    after another (the same machine load for the throughput ratio), each case's seeds
    together; ``on_row(row)`` is called as each run ends."""
    rows = []
    for dataset in datasets:
        goal = target[dataset] if isinstance(target, dict) else target
        for algo in algos:
            for h in heterogeneity:
                for seed in seeds:
                    for mode, grouping in [("sync", None)] + [("fedbuff", g) for g in groupings]:
                        # FedBuff's server steps are half-size buffers: twice the steps for the same updates
                        r = rounds if mode == "sync" else 2 * rounds
                        row = _case(dataset, algo, mode, h, rounds=r, clients=clients, per_round=per_round,
                                    target=goal, seed=seed, grouping=grouping or "version")
                        row["target"] = goal
                        rows.append(row)
                        if on_row is not None:
                            on_row(row)
    return rows


def summary(rows: List[dict]) -> List[dict]:
    """One row per case (dataset, algo, heterogeneity, mode, grouping) over its seeds:
    the mean and the sample standard deviation (``+-``) of the final accuracy, of the
    virtual time and the updates to the target (over the seeds that reached it; how many
    did is ``reached``) and of the updates per wall second."""
    import statistics

    def stat(xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            return None, None
        return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)

    cases = {}
    for r in rows:
        cases.setdefault((r["dataset"], r["algo"], r["heterogeneity"], r["mode"], r["grouping"]), []).append(r)
    out = []
    for (dataset, algo, h, mode, grouping), rs in cases.items():
        goal = rs[0]["target"]
        kt, ku = f"virtual s to {goal:.0%}", f"updates to {goal:.0%}"
        row = {"dataset": dataset, "algo": algo, "heterogeneity": h, "mode": mode, "grouping": grouping,
               "seeds": len(rs), "target": goal, "reached": sum(r[kt] is not None for r in rs)}
        for name, key in (("final accuracy", "final accuracy"), ("virtual s to target", kt),
                          ("updates to target", ku), ("updates / wall s", "updates / wall s"),
                          ("virtual s", "virtual s")):
            row[name], row[name + " +-"] = stat([r[key] for r in rs])
        out.append(row)
    return out


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30, help="synchronous rounds (FedBuff takes twice the steps)")
    ap.add_argument("--datasets", default="digits", help="comma-separated: digits, synthetic")
    ap.add_argument("--algos", default="fedavg", help="comma-separated server algorithms: fedavg, fedadam")
    ap.add_argument("--target", default="digits=0.8,synthetic=0.7",
                    help="an accuracy, or dataset=accuracy pairs, comma-separated")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--heterogeneity", default="none,mild,heavy")
    ap.add_argument("--groupings", default="version", help="FedBuff's: version, in_flight (comma-separated)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if "=" in args.target:
        target = {k: float(v) for k, v in (kv.split("=") for kv in args.target.split(","))}
    else:
        target = float(args.target)
    rows = run(datasets=tuple(args.datasets.split(",")), algos=tuple(args.algos.split(",")), rounds=args.rounds,
               target=target, clients=args.clients, per_round=args.per_round,
               heterogeneity=tuple(args.heterogeneity.split(",")), seeds=tuple(int(s) for s in args.seeds.split(",")),
               groupings=tuple(args.groupings.split(",")), on_row=_print)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": rows, "summary": summary(rows)}, f, indent=1)
    return 0


def _print(r: dict) -> None:
    key_t, key_u = f"virtual s to {r['target']:.0%}", f"updates to {r['target']:.0%}"
    reach = (f"{r[key_t]:.1f} virtual s, {r[key_u]} updates" if r[key_t] is not None else "not reached")
    print(f"seed {r['seed']} {r['dataset']:9} {r['algo']:7} {r['heterogeneity']:6} {r['mode']:8} "
          f"{r['grouping'] or '':9} final {r['final accuracy']:.4f} after {r['virtual s']:.1f} virtual s / "
          f"{r['client updates']} updates; {r['target']:.0%}: {reach}; {r['updates / wall s']:.1f} updates / wall s",
          flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
