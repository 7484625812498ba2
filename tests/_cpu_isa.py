"""Runs a test module's results under every CPU instruction set the kernels dispatch to.

The C++ CPU kernels are compiled for DEFAULT, AVX2 and AVX-512 and picked once per
process from ``ATEN_CPU_CAPABILITY`` (kernel_api.h), so comparing the builds takes one
subprocess per level.  ``results_at(module, function, level)`` imports ``module`` from
tests/ in one, calls ``module.<function>(dtype)`` for every dtype of ``module.DTYPES``
and returns the sha256 of each result's bits; ``assert_level_agrees_with_default``
compares one level with DEFAULT, and skips -- naming the level -- where this CPU
cannot run it (tests/_code_paths.py runs whole tests under each path the same way).
"""

from __future__ import annotations

import functools
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

LEVELS = ("default", "avx2", "avx512")
_RANK = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}


def why_not(level: str):
    """None if this machine runs ATEN_CPU_CAPABILITY=``level``, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{level}: x86-64 instruction sets, this is {platform.machine()}"
    best = torch.backends.cpu.get_cpu_capability()
    if _RANK.get(best, -1) < _RANK[level.upper()]:
        return f"{level}: this CPU's best instruction set for torch is {best}"
    return None


@functools.lru_cache(maxsize=None)
def results_at(module: str, function: str, level: str) -> tuple:
    """The sha256 of each dtype's results, computed in a process run at ``level``."""
    script = _SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"), module=module, function=function)
    env = dict(os.environ, ATEN_CPU_CAPABILITY=level, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.split()
    assert lines[:2] == [level.upper()] * 2, f"ATEN_CPU_CAPABILITY={level}: torch {lines[0]}, kernels {lines[1]}"
    return tuple(lines[2:])


def assert_level_agrees_with_default(module: str, function: str, level: str) -> None:
    """``level``'s build gives DEFAULT's bits (skipped, with the level's name, where this
    CPU cannot run it)."""
    reason = why_not(level)
    if reason is not None:
        pytest.skip(reason)
    got, default = results_at(module, function, level), results_at(module, function, "default")
    assert len(got) == len(default) > 0
    assert got == default, f"{level} differs from default"
