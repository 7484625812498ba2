"""What MKL's strict reproducibility mode costs a real simulation round, measured A/B.

MKL fixes its mode for the whole process at its first computation, so the two arms run
in two processes: one as fedopt_kernels sets it (``AUTO,STRICT``), one with
``FEDOPT_MKL_STRICT=0`` (MKL's default, CNR off).  Both run the same real run (the
benchmark's recipe: ``per_round`` of ``clients`` digits clients sampled anew each round,
the default engine); the parent alternates them round by round, so that both see the
same load on a shared machine, and prints the median ms per round of rounds 2.. of each,
their ratio, and the median of the per-round ratios (each round's two arms run back to
back: the figure least moved by other load).  Usage (from the repository root)::

    python tools/mkl_strict_ab.py [--model mlp|cnn] [--rounds 30] [--clients 100] [--per-round 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = r"""
import sys, time, torch
from fedopt_kernels.backends import mkl
from fedopt_kernels.benchmarks.simulation import _real_simulation
torch.set_num_threads({threads})
sim = _real_simulation({model!r}, {clients}, {per_round}, "cpu", None)
print("mode", mkl.status()["mode"], flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    sim.run_round()
    print(f"{{(time.perf_counter() - start) * 1e3:.3f}}", flush=True)
"""


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mlp", choices=("mlp", "cnn"))
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-round", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = CHILD.format(model=a.model, clients=a.clients, per_round=a.per_round, threads=a.threads)
    arms = {}
    for name, extra in (("strict", {}), ("off", {"FEDOPT_MKL_STRICT": "0"})):
        env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
        env.update(extra, PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""))
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, cwd=root)
        mode = proc.stdout.readline().split()
        arms[name] = (proc, " ".join(mode[1:]), [])
    for r in range(a.rounds + 1):
        for proc, _, times in (arms.values() if r % 2 == 0 else reversed(list(arms.values()))):
            proc.stdin.write("round\n")
            proc.stdin.flush()
            times.append(float(proc.stdout.readline()))
    for proc, _, _ in arms.values():
        proc.stdin.close()
        proc.wait()
    med = {name: statistics.median(t[1:]) for name, (_, _, t) in arms.items()}
    for name, (_, mode, t) in arms.items():
        print(f"{a.model} {a.per_round} of {a.clients}, {a.threads} threads, MKL {mode}: median {med[name]:.2f} ms "
              f"per round (rounds 2-{a.rounds + 1}), first round {t[0]:.0f} ms")
    pairs = [s / o for s, o in zip(arms["strict"][2][1:], arms["off"][2][1:])]
    q = statistics.quantiles(pairs, n=4)
    print(f"strict / off: {med['strict'] / med['off']:.3f} (medians); per round, the pair run back to back: "
          f"median {statistics.median(pairs):.3f}, quartiles {q[0]:.3f}-{q[2]:.3f}")


if __name__ == "__main__":
    main()
