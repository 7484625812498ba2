"""Start-up of a short run: the whole ``fedopt simulate`` command, paired against ``import torch``.

A new user's first command is a one-round run, and most of its time is start-up, not
training.  This suite times whole processes -- ``python -c "import torch"`` and a one-round
``fedopt simulate`` with and without its plots -- interleaved in the same repetitions (a
burst of noise hits all three alike), and reports each command's median and its time
beyond ``import torch`` (the median of the per-repetition differences), against the
targets of issue 48: 1.5 s beyond torch without plots, 3 s with them.  It also reports
which heavy modules such a run imports (``torch._dynamo``, matplotlib), read in the run
itself.  Nothing here is asserted: the numbers are a report.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

# a one-round run on the shipped digits: what the README's first command costs to start
SHORT_RUN = ("simulate", "--rounds", "1", "--clients", "5", "--per-round", "2")
TARGETS_S = {"simulate, no plots": 1.5, "simulate, plots": 3.0}  # beyond `import torch` (issue 48)
HEAVY = ("torch._dynamo", "torch._inductor", "matplotlib", "sklearn")

STARTUP_COLUMNS = (("case", "case"), ("s", "median s"), ("beyond torch s", "beyond import torch, s"),
                   ("target s", "target beyond torch, s"), ("heavy imports", "heavy modules imported"))


def _commands(out: Path) -> Dict[str, List[str]]:
    py = sys.executable
    probe = (f"import sys, runpy; sys.argv = ['fedopt', *sys.argv[1:]]\n"
             f"try:\n    runpy.run_module('fedopt_kernels', run_name='__main__')\n"
             f"except SystemExit:\n    pass\n"
             f"print('HEAVY:' + ','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)")
    return {
        "import torch": [py, "-c", "import torch"],
        "simulate, no plots": [py, "-c", probe, *SHORT_RUN, "--no-plots", "--out", str(out / "a")],
        "simulate, plots": [py, "-c", probe, *SHORT_RUN, "--out", str(out / "b")],
    }


def _timed(cmd: Sequence[str]) -> tuple:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])}... failed: {proc.stderr.strip()[-500:]}")
    heavy = [ln for ln in proc.stderr.splitlines() if ln.startswith("HEAVY:")]
    return dt, (heavy[-1][len("HEAVY:"):] if heavy else None)


def run(*, quick: bool = False, repeats: int = 0) -> list:
    """Rows: one per command, with its median wall time, the median of its per-repetition
    difference to ``import torch`` and the heavy modules the run imported."""
    repeats = repeats or (3 if quick else 7)
    with tempfile.TemporaryDirectory(prefix="fedopt-startup-") as tmp:
        cmds = _commands(Path(tmp))
        for cmd in cmds.values():  # warm the file cache and the byte-code caches once
            _timed(cmd)
        times: Dict[str, List[float]] = {k: [] for k in cmds}
        heavy: Dict[str, str] = {}
        for _ in range(repeats):
            for name, cmd in cmds.items():
                dt, imported = _timed(cmd)
                times[name].append(dt)
                if imported is not None:
                    heavy[name] = imported or "none"
    base = times["import torch"]
    rows = []
    for name, ts in times.items():
        row = {"benchmark": "startup", "case": name, "s": statistics.median(ts), "repeats": repeats}
        if name != "import torch":
            row["beyond torch s"] = statistics.median(t - b for t, b in zip(ts, base))
            row["target s"] = TARGETS_S[name]
            row["heavy imports"] = heavy.get(name, "?")
        rows.append(row)
    return rows


def summary_line(rows: list) -> str:
    """The suite in one line, e.g. "startup: a one-round simulate is 1.4 s beyond import
    torch (1.07 s) without plots (target 1.5 s), 2.0 s with them (target 3 s)"."""
    by = {r["case"]: r for r in rows if r.get("benchmark") == "startup"}
    if not by:
        return ""
    a, b = by["simulate, no plots"], by["simulate, plots"]
    return (f"startup: a one-round simulate is {a['beyond torch s']:.2f} s beyond import torch "
            f"({by['import torch']['s']:.2f} s) without plots (target {a['target s']:g} s), "
            f"{b['beyond torch s']:.2f} s with them (target {b['target s']:g} s); it imports "
            f"{a['heavy imports']}")
