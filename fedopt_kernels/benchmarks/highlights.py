"""The key lines of a ``fedopt bench --json`` file, for a report: the device and its HBM
peak (the meta row), then per kernel case the fused op against torch's anchor with its
fraction of HBM peak and launches, and the batched engine on the device against the
CPU (:func:`.suite.summary_lines`, what ``fedopt bench`` prints under its tables).

``python -m fedopt_kernels.benchmarks.highlights bench.json [--label NAME]``: prints the
lines, each prefixed by ``NAME: `` when given; exit 1 when the file cannot be read as
the JSON list ``fedopt bench --json`` writes (older files without a meta row are fine).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .suite import device_line, summary_lines


def highlights(rows: list) -> List[str]:
    """The meta row in words (when there is one), then :func:`.suite.summary_lines`."""
    meta = next((r for r in rows if r.get("benchmark") == "meta"), None)
    lines = [device_line(meta)] if meta is not None else []
    return lines + summary_lines([r for r in rows if r.get("benchmark") != "meta"])


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("json_file", help="a file written by fedopt bench --json")
    parser.add_argument("--label", default=None, help="prefix of every line")
    args = parser.parse_args(argv)
    try:
        with open(args.json_file) as f:
            rows = json.load(f)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError("not a list of rows")
        lines = highlights(rows)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"highlights: cannot read {args.json_file}: {exc}", file=sys.stderr)
        return 1
    prefix = f"{args.label}: " if args.label else ""
    for line in lines:
        print(prefix + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
