"""scripts/device-check.sh's control flow on a machine without a GPU: what a lent GPU
machine relies on, checked where it can be (the GPU steps themselves run only there;
tests/test_oldest_torch.py runs the whole dry run, build included, on torch 2.11).

* every GPU step is reported SKIP(no CUDA), the CPU parts run, the exit status is 0;
* a hung step is killed at its limit, and the steps that no longer fit the budget are
  SKIP(budget), which fails the check: one hang cannot spend the lease;
* OUT_DIR holds at most 8 files, the summary is rewritten after every step and the
  logs are one archive;
* ``make gpu-check``'s profile (``DEVICE_CHECK_PROFILE=full``) lists its extra steps.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device-check.sh"
LEASE_GPU_STEPS = ["selftest", "pytest-gpu", "sanitizer-memcheck", "gpu-harness", "bench", "bench-triton"]
FULL_GPU_STEPS = ["selftest", "pytest-gpu", "nvidia-smi-q", "pytest-readme", "sanitizer-memcheck",
                  "sanitizer-racecheck", "sanitizer-initcheck", "gpu-harness", "bench", "bench-triton"]

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real thing: make device-check")


def _run(out: Path, tmp_path: Path, **env_extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, DEVICE_CHECK_BUILD="0", PATH="/usr/bin:/bin",
               TRITON_INTERPRET="1")  # the script must unset it (the GPU runs compiled kernels)
    env.pop("PYTHONPATH", None)
    env.update(env_extra)
    return subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)


def _status(summary: str) -> dict:
    """``{step: status}`` from the summary's table (the lines after its header)."""
    rows = {}
    for line in summary.splitlines()[2:]:
        if not line.strip():
            break
        parts = line.split()
        rows[parts[0]] = " ".join(parts[1:-2])
    return rows


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_usage_errors_exit_2(tmp_path):
    assert subprocess.run(["bash", str(SCRIPT)], capture_output=True).returncode == 2
    res = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "o")], capture_output=True, text=True,
                         env=dict(os.environ, DEVICE_CHECK_PROFILE="fast"))
    assert res.returncode == 2 and "DEVICE_CHECK_PROFILE must be lease or full" in res.stderr
    res = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "o")], capture_output=True, text=True,
                         env=dict(os.environ, DEVICE_CHECK_BUDGET="8m"))
    assert res.returncode == 2 and "DEVICE_CHECK_BUDGET must be a whole number" in res.stderr


@no_gpu
def test_without_a_gpu_the_gpu_steps_skip_and_the_cpu_parts_pass(tmp_path):
    out = tmp_path / "check"
    p = _run(out, tmp_path)
    summary = (out / "summary.txt").read_text()
    assert p.returncode == 0, p.stdout + p.stderr
    status = _status(summary)
    assert status == {"env": "ok", "info": "ok", **{s: "SKIP(no CUDA)" for s in LEASE_GPU_STEPS}}, summary
    assert "8 steps, 0 failed, 6 skipped" in summary and "dry run" in summary
    assert summary in p.stdout
    files = sorted(f.name for f in out.iterdir())
    assert files == ["info.json", "logs.tar.gz", "summary.txt"], files
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
        env_log = tar.extractfile("logs/env.txt").read().decode()
    assert names == ["logs/env.txt", "logs/info.txt"]
    assert f"torch {torch.__version__}" in env_log
    info = (out / "info.json").read_text()
    assert '"triton_interpret": false' in info  # TRITON_INTERPRET=1 from the caller was unset


@no_gpu
def test_the_build_jobs_are_the_cores_whatever_omp_num_threads_says(tmp_path):
    """GNU nproc reports OMP_NUM_THREADS when it is set: a shell exporting
    OMP_NUM_THREADS=1 must not make the build run on one core of the lease."""
    out = tmp_path / "check"
    p = _run(out, tmp_path, OMP_NUM_THREADS="1", OMP_THREAD_LIMIT="1")
    assert p.returncode == 0, p.stdout + p.stderr
    with tarfile.open(out / "logs.tar.gz") as tar:
        env_log = tar.extractfile("logs/env.txt").read().decode()
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT")}
    cores = subprocess.run(["nproc"], env=clean, capture_output=True, text=True, check=True).stdout.strip()
    assert f"jobs: {cores}" in env_log, env_log


@no_gpu
def test_the_full_profile_lists_gpu_checks_extra_steps(tmp_path):
    out = tmp_path / "check"
    p = _run(out, tmp_path, DEVICE_CHECK_PROFILE="full", DEVICE_CHECK_SKIP="info")
    summary = (out / "summary.txt").read_text()
    assert p.returncode == 0, summary
    status = _status(summary)
    assert list(status) == ["env", "info", *FULL_GPU_STEPS], summary
    assert status["info"] == "SKIP(asked)"
    assert all(status[s] == "SKIP(no CUDA)" for s in FULL_GPU_STEPS)


@no_gpu
def test_a_hung_step_is_killed_at_its_limit_and_the_rest_still_runs(tmp_path):
    # A python that hangs in `fedopt info` and is itself otherwise.
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/bash\ncase \" $* \" in *' info '*) exec sleep 600;; esac\nexec {sys.executable} \"$@\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "check"
    p = _run(out, tmp_path, PYTHON=str(fake), DEVICE_CHECK_LIMITS="env=120 info=3")
    summary = (out / "summary.txt").read_text()
    assert p.returncode == 1, summary
    status = _status(summary)
    assert status["env"] == "ok" and status["info"] == "TIMEOUT(3s)", summary
    assert all(status[s] == "SKIP(no CUDA)" for s in LEASE_GPU_STEPS), summary
    assert "1 failed" in summary and "== info TIMEOUT(3s): last lines of logs/info.txt" in summary


@no_gpu
def test_steps_that_no_longer_fit_the_budget_are_left_out_and_the_check_fails(tmp_path):
    out = tmp_path / "check"
    p = _run(out, tmp_path, DEVICE_CHECK_BUDGET="5")
    summary = (out / "summary.txt").read_text()
    assert p.returncode == 1, summary
    status = _status(summary)
    assert status["env"] == status["info"] == "SKIP(budget)", summary
    assert "2 step(s) left out for lack of time" in summary
