"""``fedopt selftest``: what a user with a GPU runs first.

On one device (``--device cuda`` where CUDA is available, else ``cpu``) it runs every
public op on every backend that can run there -- on CPU: reference, the C++ CPU
extension, and Triton in its interpreter -- and compares the results and the
returned statistics with python_ref and with float64 formulas written out
independently of python_ref (``_selftest_checks``), then checks that ``torch.compile`` does not
recompile for a new tensor lr and, on CUDA, that a captured CUDA graph replays with
new lr values.  It prints the environment, one row per (op, backend, case group) and,
if anything failed, a block to paste into a bug report.

Exit status: 0 when every row passed (SKIP rows say why they could not run), 1 when a
row failed (a mismatch, or an exception inside a check: the run goes on with the next
row), 2 for bad arguments.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, List, Optional

import torch

from ._errors import CLIError

TRITON_KERNELS = "fedopt_kernels.backends.triton"


def add_parser(sub) -> None:
    from .. import backends

    p = sub.add_parser(
        "selftest", help="check every op on every backend of this device against python_ref and fp64 formulas",
        description="Run every public op on every backend available for the device and compare it with python_ref "
                    "and with float64 formulas; exit 0 if all pass, 1 on any mismatch, 2 for bad arguments.")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where to run (default: cuda if torch.cuda.is_available(), else cpu)")
    p.add_argument("--backends", default=None, metavar="A,B",
                   help=f"only these backends, comma-separated, of {', '.join(backends.BACKENDS)} "
                        "(default: every one; those that cannot run on the device are reported as SKIP)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the environment and every result here")
    p.add_argument("--quick", action="store_true", help="fewer and smaller cases")
    p.set_defaults(func=run_selftest)


def _device(name: Optional[str]) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: torch.cuda.is_available() is False here (no CUDA device, or a CPU-only torch "
                       f"{torch.__version__}); use --device cpu")
    return torch.device(name)


def _backends(spec: Optional[str], device: torch.device) -> tuple:
    """The backends to run, in the library's order, and whether the user named them."""
    from .. import backends

    if spec is None:
        return backends.BACKENDS, False
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise CLIError(f"--backends: no backend named in {spec!r}; choose from {', '.join(backends.BACKENDS)}")
    for n in names:
        if n not in backends.BACKENDS:
            raise CLIError(f"--backends: unknown backend {n!r}; choose from {', '.join(backends.BACKENDS)}")
        other = {"cpu": "cuda", "cuda": "cpu"}.get(n)
        if other == device.type:
            raise CLIError(f"--backends {n} cannot run with --device {device.type}: the {n} backend runs on "
                           f"{n.upper()} tensors")
    return tuple(b for b in backends.BACKENDS if b in names), True


def _check_json_path(path: Optional[str]) -> None:
    """Fail before the run, not after it, when the report could not be written."""
    if path is None:
        return
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise CLIError(f"--json {path}: the directory {parent} does not exist")
    if Path(path).is_dir():
        raise CLIError(f"--json {path}: is a directory, expected a file name")


def _prepare_triton(device: torch.device) -> tuple:
    """On CPU the Triton kernels can only run in the interpreter, and ``triton.jit``
    reads ``TRITON_INTERPRET`` when a kernel is defined: set it before they are
    imported (as tests/conftest.py does).  Returns ``(restore, note)``."""
    if device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return (lambda: None), None
    if any(m == TRITON_KERNELS or m.startswith(TRITON_KERNELS + ".") for m in sys.modules):
        return (lambda: None), "the Triton kernels were already imported in this process without it"
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"

    def restore():
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
    return restore, "set to 1 by fedopt selftest for --device cpu"


def _finite_or_text(x):
    """Errors for the JSON file: inf/nan as strings ("Infinity" is not JSON)."""
    return x if x is None or math.isfinite(x) else str(x)


def _row(op, backend, case, status, reason=None, rec=None, errors=(), tb=None, seconds=0.0) -> dict:
    return {"op": op, "backend": backend, "case": case, "status": status, "reason": reason,
            "max_abs_err": None if rec is None else _finite_or_text(rec.max_abs),
            "max_rel_err": None if rec is None else _finite_or_text(rec.max_rel),
            "tolerance": None if rec is None else rec.tolerance, "worst": None if rec is None else rec.worst,
            "comparisons": 0 if rec is None else rec.count, "errors": list(errors), "traceback": tb,
            "seconds": round(seconds, 3)}


def _run_check(chk, ctx) -> dict:
    from ._selftest_checks import NotApplicable
    from ._selftest_compare import Record

    rec = Record()
    t0 = time.perf_counter()
    try:
        chk.run(ctx, rec)
    except NotApplicable as exc:
        return _row(chk.op, ctx.backend, chk.case, "SKIP", reason=str(exc), seconds=time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - one broken check is one FAIL row; the others still run
        msg = " ".join(str(exc).split()) or type(exc).__name__
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
        return _row(chk.op, ctx.backend, chk.case, "FAIL", rec=rec, errors=[f"{type(exc).__name__}: {msg} ({where})"],
                    tb=traceback.format_exc(), seconds=time.perf_counter() - t0)
    status = "FAIL" if rec.failures else "PASS"
    if rec.count == 0 and status == "PASS":  # a check that compared nothing proves nothing
        status, rec.failures = "FAIL", ["no comparison was made"]
    return _row(chk.op, ctx.backend, chk.case, status, rec=rec, errors=rec.failures[:20],
                seconds=time.perf_counter() - t0)


def run_checks(device: torch.device, names: tuple, explicit: bool, quick: bool,
               progress: Callable[[str], None] = lambda s: None) -> List[dict]:
    """Every check on every backend in ``names``, ordered by op, then backend."""
    from .. import backends
    from ._selftest_checks import CHECKS, Ctx

    results = []
    for name in names:
        reason = backends.why_unavailable(name, device)
        if reason is not None:
            if explicit:  # asked for by name: not being able to check it is a failure
                results.append(_row("(every op)", name, "backend requested with --backends", "FAIL",
                                    errors=[f"backend {name!r} is not available on {device.type}: {reason}"]))
            else:
                results.append(_row("(every op)", name, "backend unavailable on this device", "SKIP", reason=reason))
            continue
        progress(f"fedopt selftest: checking the {name} backend on {device.type} ...")
        ctx = Ctx(name, device, quick)
        for chk in CHECKS:
            if not chk.backends or name in chk.backends:
                results.append(_run_check(chk, ctx))
    order = {c.op: i for i, c in reversed(list(enumerate(CHECKS)))}
    results.sort(key=lambda r: (order.get(r["op"], -1), backends.BACKENDS.index(r["backend"])))
    return results


def _command_line(args, device: torch.device) -> List[str]:
    """The command as run, for the bug report (with the device it resolved to)."""
    argv = ["selftest", "--device", device.type]
    if args.backends:
        argv += ["--backends", args.backends]
    if args.quick:
        argv.append("--quick")
    if args.json:
        argv += ["--json", args.json]
    return argv


def run_selftest(args) -> int:
    from .. import backends
    from . import _selftest_report as report
    from .info import environment

    device = _device(args.device)
    names, explicit = _backends(args.backends, device)
    _check_json_path(args.json)
    start = time.perf_counter()
    restore, note = _prepare_triton(device)
    try:
        env = environment()
        env["triton_interpret_note"] = note
        env["device"] = str(device)
        env["backends_on_device"] = {n: backends.why_unavailable(n, device) for n in names}
        results = run_checks(device, names, explicit, args.quick,
                             progress=lambda s: print(s, file=sys.stderr, flush=True))
    finally:
        restore()
    seconds = time.perf_counter() - start
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    status = 1 if counts["FAIL"] else 0
    summary = (f"fedopt selftest on {device.type}: {counts['PASS']} passed, {counts['FAIL']} failed, "
               f"{counts['SKIP']} skipped in {seconds:.1f} s -> exit status {status}")
    report.print_results(env, results, summary)
    argv = _command_line(args, device)
    if status:
        print(file=sys.stdout)
        print(report.bug_report(env, results, argv))
    if args.json:
        doc = {"command": "fedopt selftest", "argv": argv, "device": str(device), "quick": bool(args.quick),
               "env": env, "results": results, "summary": {**counts, "seconds": round(seconds, 2)},
               "exit_status": status}
        try:
            Path(args.json).expanduser().write_text(json.dumps(doc, indent=1) + "\n")
        except OSError as exc:
            raise CLIError(f"--json {args.json}: cannot write it ({exc})", code=1) from None
    return status
