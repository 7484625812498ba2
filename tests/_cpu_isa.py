"""Runs a test module's results under every CPU instruction set the kernels dispatch to.

The C++ CPU kernels are compiled for DEFAULT, AVX2 and AVX-512 and picked once per
process from ``ATEN_CPU_CAPABILITY`` (kernel_api.h), so comparing the builds takes one
subprocess per level.  ``results_per_isa(module, function)`` imports ``module`` from
tests/ in each, calls ``module.<function>(dtype)`` for every dtype of ``module.DTYPES``
and returns the sha256 of each result's bits, per level; the caller asserts they agree.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import hashlib, sys, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import {module} as t
import fedopt_kernels.backends.cpu
print(torch.backends.cpu.get_cpu_capability(), torch.ops.fedopt_C.cpu_isa())
for dtype in t.DTYPES:
    h = hashlib.sha256()
    for r in t.{function}(dtype):
        h.update(r.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    print(h.hexdigest())
"""

x86_only = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                              reason="x86-64 instruction sets")


def isa_levels() -> list:
    """The ATEN_CPU_CAPABILITY levels this machine can run (skips with fewer than two)."""
    best = torch.backends.cpu.get_cpu_capability()
    levels = {"DEFAULT": ["default"], "AVX2": ["default", "avx2"], "AVX512": ["default", "avx2", "avx512"]}.get(best)
    if levels is None or len(levels) < 2:
        pytest.skip(f"only one instruction set available here ({best})")
    return levels


def results_per_isa(module: str, function: str) -> dict:
    """``{level: [sha256 per dtype]}``, each level run in its own process."""
    script = _SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"), module=module, function=function)
    outputs = {}
    for level in isa_levels():
        env = dict(os.environ, ATEN_CPU_CAPABILITY=level, PYTHONPATH=ROOT)
        res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        lines = res.stdout.split()
        assert lines[:2] == [level.upper()] * 2, f"ATEN_CPU_CAPABILITY={level}: torch {lines[0]}, kernels {lines[1]}"
        outputs[level] = lines[2:]
    return outputs
