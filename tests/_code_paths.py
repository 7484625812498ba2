"""Runs chosen tests again under each CPU code path this machine can take, one subprocess each.

Two libraries pick code by instruction set, once per process, from the environment:

* ATen's vectorised kernels and fedopt's C++ CPU kernels: ``ATEN_CPU_CAPABILITY`` =
  ``default`` / ``avx2`` / ``avx512`` (the kernels follow torch's choice, kernel_api.h);
* MKL's GEMMs: ``MKL_ENABLE_INSTRUCTIONS`` = ``AVX2`` / ``AVX512`` -- on Intel CPUs only:
  on others MKL runs its one non-Intel path whatever the variable says (measured on an
  AMD EPYC, Zen 4: the same bits under AVX2, AVX512 and SSE4_2, and
  ``mkl_cbwr_get_auto_branch`` says AUTO).

So a developer on an AVX-512 Intel machine runs every path; on AMD the MKL paths are
skipped, each with its name and why, and the ATen paths run -- but the process's own
ATen path, which the tests cover in-process (skipped, saying so: no second run of it).  ``run_under(path,
nodeids)`` runs the tests in a fresh ``pytest`` (MKL and ATen choose at their first
call, so only a new process can change them) and returns the outcome counts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import _cpu_isa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# path name -> (environment, the instruction set it needs)
PATHS = {
    "aten-default": ({"ATEN_CPU_CAPABILITY": "default"}, "default"),
    "aten-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, "avx2"),
    "aten-avx512": ({"ATEN_CPU_CAPABILITY": "avx512"}, "avx512"),
    "mkl-avx2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, "avx2"),
    "mkl-avx512": ({"MKL_ENABLE_INSTRUCTIONS": "AVX512"}, "avx512"),
}


def why_not(path: str):
    """None if this machine can run ``path``, else why not (the skip reason)."""
    reason = _cpu_isa.why_not(PATHS[path][1])
    if reason is not None:
        return f"{path}: {reason}"
    native = torch.backends.cpu.get_cpu_capability()
    if path.startswith("aten-") and PATHS[path][1].upper() == native and "ATEN_CPU_CAPABILITY" not in os.environ:
        return f"{path}: this process's own path ({native}), where the tests run in-process"
    if path.startswith("mkl-"):
        from fedopt_kernels.backends import mkl

        st = mkl.status()
        if st["mode"] is None:
            return f"{path}: {st['error']}"
        if not st["intel_cpu"]:
            return (f"{path}: MKL runs its one non-Intel code path on this CPU whatever "
                    f"MKL_ENABLE_INSTRUCTIONS says (its auto branch: {st['auto_branch']})")
    return None


def run_under(path: str, nodeids: list) -> dict:
    """Runs ``nodeids`` (relative to the repository) under ``path`` in a new pytest; skips
    with the path's name where this machine cannot take it; fails with pytest's output
    where a test fails.  Returns ``{"passed": n, "skipped": n, ...}``."""
    reason = why_not(path)
    if reason is not None:
        pytest.skip(reason)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(PATHS[path][0])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-o", "addopts=", *nodeids]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"{path}: {' '.join(f'{k}={v}' for k, v in PATHS[path][0].items())}\n{tail}"
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|errors?)", res.stdout)}
    return counts
