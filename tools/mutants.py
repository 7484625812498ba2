#!/usr/bin/env python3
"""Mutation check: does the test suite see a wrong formula?

Each mutant below changes ONE formula the way a real bug would (eps dropped or moved,
the norm taken per tensor, weight decay outside the clip, a wrong sign, gamma applied
twice, size weights where the rule is uniform, a bias correction added, a partial sum
skipped, ...) in python_ref, csrc/include/fedopt/math.h, the CPU kernels or the Triton
helpers.  For every mutant the script copies the repository (its git-tracked files) to
a temporary directory, applies the change, rebuilds the C++ CPU extension there if a
C++ file changed (the CUDA extension is copied as it is: it cannot run here), and runs
the fast test tier (``pytest -m "not slow" -x``), the mutant's most relevant test files
first.  A mutant is KILLED when a test fails (pytest exit 1); a build failure or any
other pytest exit (collection error, no tests) is an ERROR, never counted as killed.

    .venv/bin/python tools/mutants.py                  # every mutant (~13 min on 2 cores)
    .venv/bin/python tools/mutants.py --list
    .venv/bin/python tools/mutants.py --only eps-dropped-ref,yogi-sign-cpp --keep

Exit status 0 only when every mutant is killed.  tests/test_mutants_apply.py checks in
the normal suite that every mutant still applies to the current sources.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parents[1]

# The kinds the mutation check must cover (tests/test_mutants_apply.py checks each is present).
REQUIRED_KINDS = ("eps dropped or moved", "norm per tensor", "weight decay outside the clip", "wrong sign",
                  "gamma applied twice", "size weights instead of uniform", "bias correction added",
                  "partial sum skipped")


@dataclass(frozen=True)
class Mutant:
    id: str
    kind: str
    file: str           # relative to the repository root
    find: str           # must occur exactly once in `file`
    replace: str
    description: str
    tests: Tuple[str, ...] = field(default=())  # run first (then the whole fast tier)

    @property
    def cpp(self) -> bool:
        return self.file.startswith("csrc/")


NAR_TESTS = ("tests/test_nar_step.py", "tests/test_nar_step_batched.py", "tests/test_contract_nar_step.py")
AGG_TESTS = ("tests/test_aggregate.py", "tests/test_weighted_sum.py")
SRV_TESTS = ("tests/test_server_update.py", "tests/test_contract_server_update.py", "tests/test_server_optimizers.py")

MUTANTS: List[Mutant] = [
    # ---------------------------------------------------------------- FedNAR's clip
    Mutant("eps-dropped-ref", "eps dropped or moved", "python_ref/fednar.py",
           "torch.clamp(max_norm / (norm + EPS), max=1.0)", "torch.clamp(max_norm / norm, max=1.0)",
           "python_ref: s = min(1, A / n), no eps", NAR_TESTS),
    Mutant("eps-moved-cpp", "eps dropped or moved", "csrc/include/fedopt/math.h",
           "acc_t s = max_norm / (norm + acc_t(kClipEps));", "acc_t s = max_norm / norm + acc_t(kClipEps);",
           "math.h: s = A / n + eps (eps outside the division)", NAR_TESTS),
    Mutant("eps-dropped-triton", "eps dropped or moved", "fedopt_kernels/backends/triton/_helpers.py",
           "s = div_rn(max_norm, norm + CLIP_EPS, ACC)", "s = div_rn(max_norm, norm, ACC)",
           "Triton helper: s = A / n, no eps", NAR_TESTS),
    Mutant("clamp-dropped-cpp", "scale not clamped", "csrc/include/fedopt/math.h",
           "return s > acc_t(1) ? acc_t(1) : s;", "return s;",
           "math.h: s = A / (n + eps) also below the threshold (no min with 1)", NAR_TESTS),
    Mutant("norm-per-tensor-ref", "norm per tensor", "python_ref/fednar.py",
           "    params, grads = list(params), list(grads)\n    if not params:\n"
           "        raise ValueError(\"params must contain at least one tensor\")\n    dtype = compute_dtype",
           "    params, grads = list(params), list(grads)\n    if len(params) > 1:  # MUTANT: one norm per tensor\n"
           "        for k in range(len(params)):\n"
           "            out = nar_step_([params[k]], [grads[k]], lr=lr, weight_decay=weight_decay, max_norm=max_norm,\n"
           "                            mode=mode, momentum=momentum, grad_scale=grad_scale, found_inf=found_inf,\n"
           "                            momentum_buffers=None if momentum_buffers is None else [momentum_buffers[k]])\n"
           "        return out\n    if not params:\n"
           "        raise ValueError(\"params must contain at least one tensor\")\n    dtype = compute_dtype",
           "python_ref: each tensor clipped on its own norm", NAR_TESTS),
    Mutant("wd-outside-clip-ref", "weight decay outside the clip", "python_ref/fednar.py",
           "d = scale * (g + wd * x) if mode == \"co\" else scale * g + wd * x", "d = scale * g + wd * x",
           "python_ref: mode co applies the decay outside the clip", NAR_TESTS),
    Mutant("wd-outside-clip-cpp", "weight decay outside the clip", "csrc/include/fedopt/math.h",
           "return p.mode == NarMode::kCo ? scale * (g + p.weight_decay * x)",
           "return p.mode == NarMode::kCo ? scale * g + p.weight_decay * x",
           "math.h: mode co applies the decay outside the clip", NAR_TESTS),
    Mutant("wd-outside-clip-triton", "weight decay outside the clip", "fedopt_kernels/backends/triton/_helpers.py",
           "        return scale * (g + wd * x)\n", "        return scale * g + wd * x\n",
           "Triton helper: mode co applies the decay outside the clip", NAR_TESTS),
    Mutant("norm-without-wd-cpp", "norm of the wrong vector", "csrc/include/fedopt/math.h",
           "return p.mode == NarMode::kCo ? g + p.weight_decay * x : g;", "return g;",
           "math.h: mode co clips on ||g|| instead of ||g + wd x||", NAR_TESTS),
    Mutant("wd-sign-ref", "wrong sign", "python_ref/fednar.py",
           "v = g + wd * x if mode == \"co\" else g", "v = g - wd * x if mode == \"co\" else g",
           "python_ref: the norm of g - wd x", NAR_TESTS),
    Mutant("skip-ignored-cpp", "non-finite skip ignored", "csrc/include/fedopt/math.h",
           "return found_inf || !is_finite(norm);", "return found_inf;",
           "math.h: a NaN/Inf norm no longer skips the step", NAR_TESTS),
    Mutant("momentum-order-triton", "momentum order", "fedopt_kernels/backends/triton/_helpers.py",
           "    b = momentum * b + nar_direction(x, g, scale, wd, MODE)\n    return x - lr * b, b\n",
           "    x_new = x - lr * b\n    b = momentum * b + nar_direction(x, g, scale, wd, MODE)\n    return x_new, b\n",
           "Triton helper: x moves along the OLD momentum buffer", NAR_TESTS),
    # ---------------------------------------------------------------- partial sums
    Mutant("partial-skipped-cpu-nar", "partial sum skipped", "csrc/cpu/nar_step.cpp",
           "for (int64_t c = table.group_begin[i]; c < table.group_begin[i + 1]; ++c) sum += partials[c];",
           "for (int64_t c = table.group_begin[i] + 1; c < table.group_begin[i + 1]; ++c) sum += partials[c];",
           "CPU nar_step: the first chunk's partial sum of squares is left out", NAR_TESTS),
    Mutant("partial-skipped-cpu-agg", "partial sum skipped", "csrc/cpu/aggregate.cpp",
           "for (int64_t c = 0; c < nc; ++c) s += sum_partials[c];",
           "for (int64_t c = 1; c < nc; ++c) s += sum_partials[c];",
           "CPU aggregate: ||sum w_i X_i||^2 misses the first chunk", AGG_TESTS),
    Mutant("partial-skipped-triton", "partial sum skipped", "fedopt_kernels/backends/triton/_helpers.py",
           "    for s in range(begin, end, PBLOCK):", "    for s in range(begin + 1, end, PBLOCK):",
           "Triton sum_range: the first partial is left out", NAR_TESTS),
    # ---------------------------------------------------------------- aggregation and the server
    Mutant("gamma-twice-ref", "gamma applied twice", "python_ref/aggregation.py",
           "out = torch.as_tensor(gamma, dtype=dtype, device=total.device) * total",
           "out = torch.as_tensor(gamma, dtype=dtype, device=total.device) ** 2 * total",
           "python_ref aggregate: gamma^2 * sum w_i X_i", AGG_TESTS),
    Mutant("gamma-twice-cpp", "gamma applied twice", "csrc/include/fedopt/math.h",
           "x = p.gamma * (x - p.lr * d);", "x = p.gamma * p.gamma * (x - p.lr * d);",
           "math.h server sgd: gamma^2 (x - lr D)", SRV_TESTS),
    Mutant("size-weights-fedexp", "size weights instead of uniform", "fedopt_kernels/server/weighting.py",
           "    \"fedexp\": \"uniform\",", "    \"fedexp\": \"size\",",
           "FedExP averages by data size (the paper: uniform)", ("tests/test_paper_defaults.py",)),
    Mutant("size-weights-scaffold", "size weights instead of uniform", "fedopt_kernels/server/weighting.py",
           "    \"scaffold\": \"uniform\",", "    \"scaffold\": \"size\",",
           "SCAFFOLD averages by data size (the paper: uniform)", ("tests/test_paper_defaults.py",)),
    Mutant("bias-correction-ref", "bias correction added", "python_ref/server_optimizers.py",
           "    v = b2 * v + (1 - b2) * D * D\n    return x - lr * m / (torch.sqrt(v) + tau), m, v",
           "    v = b2 * v + (1 - b2) * D * D\n    return x - lr * (m / (1 - b1)) / (torch.sqrt(v / (1 - b2)) + tau), m, v",
           "python_ref FedAdam with Adam's bias correction (FedAdam has none)", SRV_TESTS),
    Mutant("bias-correction-cpp", "bias correction added", "csrc/include/fedopt/math.h",
           "x = x - p.lr * (m / (sqrt_of(v) + p.tau));",
           "x = x - p.lr * ((m / (acc_t(1) - p.beta1)) / (sqrt_of(v) + p.tau));",
           "math.h adaptive rules with a first-moment bias correction", SRV_TESTS),
    Mutant("yogi-sign-cpp", "wrong sign", "csrc/include/fedopt/math.h",
           "v = v - (acc_t(1) - p.beta2) * d2 * sign_of(v - d2);",
           "v = v + (acc_t(1) - p.beta2) * d2 * sign_of(v - d2);",
           "math.h Yogi: v + (1 - b2) D^2 sign(v - D^2)", SRV_TESTS),
    Mutant("fedlaw-no-softmax-ref", "lambda not a softmax", "python_ref/fedlaw.py",
           "run([logits, s], lambda: torch.exp(s), lambda: torch.softmax(logits, 0), server_epochs, step_lr)",
           "run([logits, s], lambda: torch.exp(s), lambda: logits, server_epochs, step_lr)",
           "python_ref FedLAW: lambda = the raw logits", ("tests/test_fedlaw.py",)),
    Mutant("feddecay-exponent", "off by one", "fedopt_kernels/lr_scheduler/feddecay.py",
           "return 1.0 if k == 0 else float(beta) ** k", "return 1.0 if k == 0 else float(beta) ** (k + 1)",
           "FedDecay: beta^(k+1) after the first step", ("tests/test_lr_scheduler.py",)),
]


def check_applies(m: Mutant, root: Path = REPO) -> str:
    text = (root / m.file).read_text()
    count = text.count(m.find)
    if count != 1:
        raise ValueError(f"mutant {m.id}: its snippet occurs {count} times in {m.file} (must be once)")
    if m.replace == m.find:
        raise ValueError(f"mutant {m.id}: the replacement is the snippet itself")
    return text.replace(m.find, m.replace)


def copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    for rel in files.decode().split("\0"):
        if not rel:
            continue
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    for so in (REPO / "fedopt_kernels").glob("*.so"):
        shutil.copy2(so, dst / "fedopt_kernels" / so.name)


def pytest(root: Path, paths, timeout: float) -> Tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    env.pop("FEDOPT_BACKEND", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow",
           "-o", "addopts=", "--tb=no", "-rf", *paths]
    try:
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "timeout"
    return p.returncode, p.stdout + p.stderr


def run_tests(root: Path, first: Tuple[str, ...], timeout: float, whole_tier: bool = True) -> Tuple[int, str]:
    """The mutant's own test files first (a killed mutant usually ends there, in seconds),
    then, if they all pass, the whole fast tier."""
    rc, out = pytest(root, first, timeout)
    if rc != 0 or not whole_tier:
        return rc, out
    return pytest(root, ["tests"], timeout)


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("FAILED ") or line.startswith("ERROR "):
            return line.split(" ", 1)[1].split(" - ")[0]
    return "?"


def build_cpu(root: Path) -> Tuple[bool, str]:
    env = dict(os.environ, FEDOPT_BUILD_CUDA="0", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    p = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root, env=env,
                       capture_output=True, text=True)
    return p.returncode == 0, (p.stdout + p.stderr)[-3000:]


def run_one(m: Mutant, keep: bool, timeout: float, tests: Tuple[str, ...]) -> Tuple[str, str, float]:
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f"mutant-{m.id}-"))
    try:
        copy_tree(tmp)
        if m is not BASELINE:
            (tmp / m.file).write_text(check_applies(m, tmp))
        if m.cpp:
            ok, log = build_cpu(tmp)
            if not ok:
                return "ERROR", f"build failed: {log.splitlines()[-1] if log else ''}", time.monotonic() - start
        rc, out = run_tests(tmp, tests or m.tests, timeout, whole_tier=m is not BASELINE)
        if rc == 1:
            return "killed", first_failure(out), time.monotonic() - start
        if rc == 0:
            return "SURVIVED", "every test passed", time.monotonic() - start
        return "ERROR", f"pytest exit {rc}: {out.strip().splitlines()[-1] if out.strip() else ''}", \
            time.monotonic() - start
    finally:
        if keep:
            print(f"  kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


# The unmutated copy, run first on the mutants' first test files: they must pass there,
# or every "killed" below would mean nothing.
BASELINE = Mutant("baseline", "none", "python_ref/fednar.py", "", "", "the unmutated tree", NAR_TESTS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--only", default="", help="comma-separated mutant ids")
    ap.add_argument("--tests", nargs="*", default=None, help="test paths to run first instead of each mutant's own")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per mutant's test run")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    args = ap.parse_args(argv)
    chosen = MUTANTS
    if args.only:
        ids = set(args.only.split(","))
        unknown = ids - {m.id for m in MUTANTS}
        if unknown:
            ap.error(f"unknown mutant ids: {sorted(unknown)}")
        chosen = [m for m in MUTANTS if m.id in ids]
    if args.list:
        for m in chosen:
            print(f"{m.id:26s} {m.kind:32s} {m.file}: {m.description}")
        return 0
    for m in chosen:
        check_applies(m)
    tests = tuple(args.tests) if args.tests is not None else ()
    if not args.no_baseline:
        status, detail, secs = run_one(BASELINE, args.keep, args.timeout, tests or NAR_TESTS)
        print(f"baseline: {status} ({detail}, {secs:.0f} s)", flush=True)
        if status != "SURVIVED":
            print("the unmutated tree does not pass its tests: fix that first", file=sys.stderr)
            return 2
    rows = []
    print(f"| id | kind | target | change | result | s |\n|---|---|---|---|---|---:|", flush=True)
    for m in chosen:
        status, detail, secs = run_one(m, args.keep, args.timeout, tests)
        result = f"killed by `{detail}`" if status == "killed" else f"**{status}** ({detail})"
        rows.append(status)
        print(f"| {m.id} | {m.kind} | `{m.file}` | {m.description} | {result} | {secs:.0f} |", flush=True)
    killed = rows.count("killed")
    print(f"\n{killed} of {len(rows)} mutants killed", flush=True)
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
