"""Cross-device scale: round time and peak resident memory against the population and
the clients per round (``fedopt bench --only scale``, or ``python -m
fedopt_kernels.benchmarks.scale``).

Each case runs in a fresh process (so its peak RSS, ``ru_maxrss``, is its own): a
:class:`~fedopt_kernels.fl.Simulation` of ``--rounds`` rounds (default 2; the first
traces the batched engine's shapes), reporting the setup time (dataset, partition,
model, engine), the median time of the rounds after the first, and the peak RSS.
Cases:

* ``population``: 10^2 .. 10^5 clients, 100 per round (``synthetic-lazy``);
* ``per_round``: 10 .. 1,000 clients per round of 10^4 (with ``--memory-budget``);
* ``issue``: the issue's measurement, 20,000 clients, 50 per round, ``synthetic``
  (the eager dataset) and ``synthetic-lazy``, FedAvg and SCAFFOLD.

Plus, in this process (``sampling``), the client sampling and the partitions of 10^5
clients: the natural one of ``synthetic-lazy``, and the Dirichlet(0.3) and IID splits of
10^5 and 10^6 samples (the target: each well under a second).  ``--quick`` (the
suite's ``--quick``, and the tests): 10^2 and 10^3 clients, 10 and 100 per round, the
partitions of 10^3 clients, no ``issue`` case.  ``--json PATH`` writes the rows.
Timings of a loaded machine vary: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

COMMON = dict(model="mlp", local_steps=5, max_samples_per_client=1000, eval_every=1000)


def _one(spec: dict) -> dict:
    """Run one case in this process; the row to print."""
    import torch

    from ..fl import Simulation, SimulationConfig

    torch.set_num_threads(int(spec.pop("threads", 1)))
    rounds = int(spec.pop("rounds", 2))
    t0 = time.perf_counter()
    sim = Simulation(SimulationConfig(rounds=rounds, **spec))
    setup = time.perf_counter() - t0
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        sim.run_round()
        times.append(time.perf_counter() - t)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"setup_s": setup, "first_round_s": times[0],
            "round_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
            "peak_rss_mb": rss, "chunk": sim.results.meta.get("round_chunk"), "numel": sim.numel}


def sampling_and_partition(clients: int = 100_000, per_round: int = 1000, samples=(100_000, 1_000_000)) -> dict:
    """Seconds to build the population of ``synthetic-lazy`` (sizes and index table),
    its natural partition, to sample a round, and to split ``samples`` labelled samples
    (10 classes) over the ``clients`` by Dirichlet(0.3) and IID."""
    import numpy as np

    from ..fl.datasets.data import synthetic_lazy
    from ..fl.datasets.partition import dirichlet_partition, iid_partition, natural_partition
    from ..fl.run.simulation import sample_clients

    t = time.perf_counter()
    ds = synthetic_lazy(num_clients=clients, seed=0, test_clients=1)
    t_data = time.perf_counter() - t
    t = time.perf_counter()
    part = natural_partition(ds.client_indices)
    sizes = part.sizes
    t_part = time.perf_counter() - t
    t = time.perf_counter()
    for r in range(1, 11):
        sample_clients(0, r, clients, per_round)
    t_sample = (time.perf_counter() - t) / 10
    row = {"clients": clients, "dataset_s": t_data, "partition_s": t_part, "sample_s": t_sample,
           "total_samples": int(sum(sizes))}
    for n in samples:
        labels = np.random.default_rng(0).integers(0, 10, n)
        t = time.perf_counter()
        part = dirichlet_partition(labels, clients, 0.3, seed=0)
        row[f"dirichlet_{n}_s"] = time.perf_counter() - t
        row[f"dirichlet_{n}_min"] = min(part.sizes)
        t = time.perf_counter()
        iid_partition(n, clients, seed=0)
        row[f"iid_{n}_s"] = time.perf_counter() - t
    return row


def cases(which, quick: bool = False) -> list:
    out = []
    if "population" in which:
        for m in (100, 1_000) if quick else (100, 1_000, 10_000, 100_000):
            out.append(("population", dict(COMMON, dataset="synthetic-lazy", clients=m, per_round=min(m, 100))))
    if "per_round" in which:
        for c in (10, 100) if quick else (10, 100, 1000):
            out.append(("per_round", dict(COMMON, dataset="synthetic-lazy", clients=1_000 if quick else 10_000,
                                          per_round=c, memory_budget="512M")))
    if "issue" in which and not quick:
        for ds in ("synthetic", "synthetic-lazy"):
            for algo in ("fedavg", "scaffold"):
                out.append(("issue", dict(model="mlp", local_steps=5, dataset=ds, clients=20_000, per_round=50,
                                          algo=algo, eval_every=1000)))
    return out


CASES = ("sampling", "population", "per_round", "issue")


def run(*, only=CASES, quick: bool = False, rounds: int = 2, threads: int = 1, echo=None) -> list:
    """The rows of the cases in ``only`` (``echo(row)`` as each finishes), each tagged
    ``"benchmark": "scale"``."""
    which = set(only)
    rows = []

    def done(row):
        row = {"benchmark": "scale", **row}
        rows.append(row)
        if echo is not None:
            echo(row)

    if "sampling" in which:
        done({"case": "sampling", **(sampling_and_partition(1_000, 100, (10_000,)) if quick
                                      else sampling_and_partition())})
    for name, spec in cases(which, quick):
        spec = dict(spec, rounds=rounds, threads=threads)
        res = subprocess.run([sys.executable, "-m", "fedopt_kernels.benchmarks.scale", "--one", json.dumps(spec)],
                             capture_output=True, text=True)
        row = {"case": name, **{k: v for k, v in spec.items() if k in ("dataset", "clients", "per_round", "algo",
                                                                      "memory_budget")}}
        if res.returncode != 0:
            row["error"] = res.stderr.strip().splitlines()[-1:] or ["failed"]
        else:
            row.update(json.loads(res.stdout.strip().splitlines()[-1]))
        done(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(CASES))
    p.add_argument("--quick", action="store_true", help="small sizes (seconds, not minutes)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(_one(json.loads(args.one))))
        return 0
    rows = run(only=args.only.split(","), quick=args.quick, rounds=args.rounds, threads=args.threads,
               echo=lambda row: print(json.dumps(row), flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
