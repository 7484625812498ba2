"""The kernel benchmark suite behind ``fedopt bench`` (and ``python -m fedopt_kernels.benchmarks.suite``).

Prints one table of medians and ratios measured in the same run; ``--json`` also
writes the rows.  ``--quick`` uses fewer repetitions and skips ``torch.compile``.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Optional

import torch

from .aggregate import bench_aggregate
from .nar_step import bench_nar_step
from .shapes import numel, resnet18_shapes, small_cnn_shapes

SUITES = ("nar_step", "aggregate")


def run(*, only=SUITES, backend: Optional[str] = None, device: str = "cpu", quick: bool = False) -> list:
    repeats = 5 if quick else 15
    rows: list = []
    if "nar_step" in only:
        rows += bench_nar_step(resnet18_shapes(), label="ResNet-18 (62 tensors, 11.2M)", backend=backend,
                               device=device, repeats=repeats, include_compile=not quick)
        rows += bench_nar_step(small_cnn_shapes(), label="small CNN (10 tensors, 91K)", backend=backend,
                               device=device, repeats=repeats * 4, include_compile=not quick)
    if "aggregate" in only:
        rows += bench_aggregate(20, numel(resnet18_shapes()), label="20 x ResNet-18 (11.2M)", backend=backend,
                                device=device, repeats=max(3, repeats // 2))
        rows += bench_aggregate(100, numel(small_cnn_shapes()), label="100 x small CNN (91K)", backend=backend,
                                device=device, repeats=repeats * 2)
    return rows


def format_rows(rows: list) -> list:
    def fmt(v):
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    return [[fmt(r[k]) for k in ("benchmark", "case", "ms", "vs floor", "time / fused")] for r in rows]


def print_table(rows: list, title: str = "fedopt_kernels benchmarks") -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text fallback
        print(title)
        for r in format_rows(rows):
            print(" | ".join(r))
        return
    table = Table(title=title)
    for col in ("benchmark", "case", "median ms", "speed vs floor", "time / fused"):
        table.add_column(col, justify="left" if col in ("benchmark", "case") else "right")
    for r in format_rows(rows):
        table.add_row(*r)
    Console(width=150).print(table)


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=SUITES, action="append", help="run only this suite (repeatable)")
    parser.add_argument("--backend", default=None, help="kernel backend of the fused candidates")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no torch.compile")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_from_args(args)


def run_from_args(args) -> int:
    rows = run(only=tuple(args.only or SUITES), backend=args.backend, device=args.device, quick=args.quick)
    print_table(rows, title=f"fedopt_kernels benchmarks on {args.device} ({torch.get_num_threads()} threads)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
