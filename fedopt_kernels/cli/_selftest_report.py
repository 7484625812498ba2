"""What ``fedopt selftest`` prints: the environment, the results table, the summary
and, on a failure, a block to paste into a bug report.

The table is a rich table on a terminal and aligned plain text otherwise (a log, a
pipe, a CI job), where rich would cut the rows to 80 columns.
"""

from __future__ import annotations

import sys
from typing import List

from ._tables import have_rich, plain, print_table
from .info import driver_text, extensions_text

BUG_REPORT_HEADER = "Please paste this into a bug report:"


def env_lines(env: dict) -> List[str]:
    """The environment report, one ``name: value`` line each (also in the bug report)."""
    rows = [("fedopt_kernels", env["fedopt_kernels"]),
            ("python", f"{env['python']} ({env['platform']})"),
            ("torch", f"{env['torch']} (CUDA build: {env['torch_cuda'] or 'no, CPU-only'})")]
    if env["gpus"]:
        rows.append(("CUDA driver", driver_text(env["cuda_driver"])))
        for g in env["gpus"]:
            rows.append((f"GPU {g['index']}", f"{g['name']}, compute capability {g['capability']}, "
                                              f"{g['memory_gib']} GiB, {g['multiprocessors']} SMs"))
    else:
        rows.append(("GPU", "none (torch.cuda.is_available() is False)"))
    rows.append(("extensions", extensions_text(env["extensions"])))
    rows.append(("triton", env["triton"] or f"not available ({env['triton_error']})"))
    interpret = "1 (Triton kernels run on CPU tensors in the interpreter)" if env["triton_interpret"] else "unset/0"
    if env.get("triton_interpret_note"):
        interpret += f"; {env['triton_interpret_note']}"
    rows.append(("TRITON_INTERPRET", interpret))
    rows.append(("device", env["device"]))
    backends = ", ".join(n if r is None else f"{n} (no: {r})" for n, r in env["backends_on_device"].items())
    rows.append(("backends", backends))
    width = max(len(k) for k, _ in rows)
    return [f"{k:<{width}}  {v}" for k, v in rows]


def _num(x) -> str:
    if x is None:
        return "-"
    return x if isinstance(x, str) else f"{x:.2e}"


def status_text(r: dict) -> str:
    return f"SKIP({r['reason']})" if r["status"] == "SKIP" else r["status"]


_COLUMNS = ("op", "backend", "cases", "status", "max abs err", "max rel err", "tolerance")


def _cells(r: dict) -> list:
    return [r["op"], r["backend"], r["case"], status_text(r), _num(r["max_abs_err"]), _num(r["max_rel_err"]),
            r["tolerance"] or "-"]


def plain_table(results: List[dict]) -> str:
    return plain(_COLUMNS, [_cells(r) for r in results])


def print_results(env: dict, results: List[dict], summary: str, stream=None) -> None:
    stream = stream or sys.stdout
    print("\n".join(env_lines(env)), file=stream)
    print(file=stream)
    if stream.isatty() and have_rich():
        colour = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}
        rows = []
        for r in results:
            cells = list(_cells(r))
            cells[3] = (cells[3], colour[r["status"]])
            rows.append(cells)
        print_table("fedopt selftest", _COLUMNS, rows, no_wrap=("op", "backend", "max abs err", "max rel err"),
                    stream=stream, use_rich=True)
    else:
        print(plain_table(results), file=stream)
    print(file=stream)
    print(summary, file=stream)


def bug_report(env: dict, results: List[dict], argv: List[str]) -> str:
    """The environment and every failing row with its errors, ready to paste."""
    lines = [BUG_REPORT_HEADER, "-" * 72, "$ fedopt " + " ".join(argv)]
    lines += env_lines(env)
    lines.append("")
    for r in results:
        if r["status"] != "FAIL":
            continue
        lines.append(f"FAIL  {r['op']}  backend={r['backend']}  cases: {r['case']}")
        for e in r["errors"]:
            lines.append(f"    {e}")
        if r.get("traceback"):
            lines += ["    " + t for t in r["traceback"].rstrip().splitlines()[-8:]]
    lines.append("-" * 72)
    return "\n".join(lines)
