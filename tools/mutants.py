#!/usr/bin/env python3
"""Mutation check: does the test suite see a wrong formula?

Each mutant (tools/mutants.toml) changes ONE formula the way a real bug would (eps dropped or moved,
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
import tomllib
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


TABLE = REPO / "tools" / "mutants.toml"  # the mutants themselves: data, apart from this runner


def load_mutants(path: Path = TABLE) -> List[Mutant]:
    """The mutants of ``path`` (see its header for the fields), in file order."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    sets = {name: tuple(files) for name, files in data.get("tests", {}).items()}
    mutants = []
    for entry in data["mutant"]:
        tests = entry.get("tests", ())
        tests = sets[tests] if isinstance(tests, str) else tuple(tests)
        mutants.append(Mutant(entry["id"], entry["kind"], entry["file"], entry["find"], entry["replace"],
                              entry["description"], tests))
    return mutants


MUTANTS: List[Mutant] = load_mutants()


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
BASELINE = Mutant("baseline", "none", "python_ref/fednar.py", "", "", "the unmutated tree", MUTANTS[0].tests)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
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
        status, detail, secs = run_one(BASELINE, args.keep, args.timeout, tests or BASELINE.tests)
        print(f"baseline: {status} ({detail}, {secs:.0f} s)", flush=True)
        if status != "SURVIVED":
            print("the unmutated tree does not pass its tests: fix that first", file=sys.stderr)
            return 2
    rows = []
    print("| id | kind | target | change | result | s |\n|---|---|---|---|---|---:|", flush=True)
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
