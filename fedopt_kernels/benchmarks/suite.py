"""The kernel benchmark suite behind ``fedopt bench`` (and ``python -m fedopt_kernels.benchmarks.suite``).

Prints tables of medians and ratios measured in the same run (kernels; whole simulated
rounds, :mod:`.simulation`); ``--json`` also writes the rows.  ``--quick`` uses fewer
repetitions and skips ``torch.compile``.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Optional

import torch

from .aggregate import bench_aggregate
from .nar_step import bench_nar_step
from .server_update import bench_server_update
from .shapes import numel, resnet18_shapes, small_cnn_shapes

SUITES = ("nar_step", "aggregate", "server", "simulation")
SIM_COLUMNS = (("benchmark", "benchmark"), ("case", "case"), ("ms", "median ms / round"),
               ("vs hand loop", "x faster than hand loop"), ("time / batched", "time / batched"))
KERNEL_COLUMNS = (("benchmark", "benchmark"), ("case", "case"), ("ms", "median ms"), ("vs floor", "speed vs floor"),
                  ("time / fused", "time / fused"), ("of copy bw", "of copy bandwidth"))


def run(*, only=SUITES, backend: Optional[str] = None, device: str = "cpu", quick: bool = False) -> list:
    repeats = 5 if quick else 15
    rows: list = []
    if "nar_step" in only:
        rows += bench_nar_step(resnet18_shapes(), label="ResNet-18 (62 tensors, 11.2M)", backend=backend,
                               device=device, repeats=repeats, include_compile=not quick)
        # 91K parameters fit in cache: time each call warm, as after a backward pass, and
        # also cold (every call after the other candidates' data).
        for warm in (True, False):
            rows += bench_nar_step(small_cnn_shapes(), label=f"small CNN (10 tensors, 91K, {'warm' if warm else 'cold'})",
                                   backend=backend, device=device, repeats=repeats * 4,
                                   include_compile=not quick and warm, warm_cache=warm)
    if "aggregate" in only:
        rows += bench_aggregate(20, numel(resnet18_shapes()), label="20 x ResNet-18 (11.2M)", backend=backend,
                                device=device, repeats=max(3, repeats // 2))
        # 100 x 91K fp32 is 36 MB, about a last-level cache: time it from memory and from cache.
        for cache in ("cold", "warm"):
            rows += bench_aggregate(100, numel(small_cnn_shapes()), label=f"100 x small CNN (91K, {cache})",
                                    backend=backend, device=device, repeats=repeats * 2, cache=cache)
    if "server" in only:
        rows += bench_server_update(resnet18_shapes(), label="ResNet-18 (62 tensors, 11.2M)", backend=backend,
                                    device=device, repeats=max(3, repeats // 2))
        rows += bench_server_update(small_cnn_shapes(), label="small CNN (10 tensors, 91K)", backend=backend,
                                    device=device, repeats=repeats * 4)
    if "simulation" in only:
        from . import simulation

        rows += simulation.run(device=device, backend=backend, quick=quick)
    return rows


def format_rows(rows: list, keys=tuple(k for k, _ in KERNEL_COLUMNS)) -> list:
    def fmt(v):
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    return [[fmt(r.get(k, float("nan"))) for k in keys] for r in rows]


def print_table(rows: list, title: str = "fedopt_kernels benchmarks") -> None:
    """One table for the kernel rows, one for the simulated rounds (their own columns)."""
    kernels = [r for r in rows if "vs hand loop" not in r]
    rounds = [r for r in rows if "vs hand loop" in r]
    for part, columns, name in ((kernels, KERNEL_COLUMNS, title), (rounds, SIM_COLUMNS, f"{title}: simulated rounds")):
        if part or (not rows and columns is KERNEL_COLUMNS):
            _print_one(part, columns, name)


def _print_one(rows: list, columns, title: str) -> None:
    keys = tuple(k for k, _ in columns)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text fallback
        print(title)
        for r in format_rows(rows, keys):
            print(" | ".join(r))
        return
    table = Table(title=title)
    for key, col in columns:
        table.add_column(col, justify="left" if key in ("benchmark", "case") else "right")
    for r in format_rows(rows, keys):
        table.add_row(*r)
    Console(width=150).print(table)


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=SUITES, action="append", help="run only this suite (repeatable)")
    parser.add_argument("--backend", default=None, help="kernel backend of the fused candidates")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no torch.compile")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for every candidate (default: torch's own choice)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_from_args(args)


def run_from_args(args) -> int:
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    rows = run(only=tuple(args.only or SUITES), backend=args.backend, device=args.device, quick=args.quick)
    print_table(rows, title=f"fedopt_kernels benchmarks on {args.device} ({torch.get_num_threads()} threads)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
