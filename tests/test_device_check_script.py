"""scripts/gpu-check.sh on a machine without a GPU: it must still run every step,
record each failure, write the summary and exit non-zero -- the control flow a GPU
machine relies on, checked where it can be (the GPU steps themselves run only there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
STEPS = ["nvidia-smi", "nvidia-smi-q", "info", "pytest-gpu", "pytest-readme", "selftest", "sanitizer-memcheck",
         "sanitizer-racecheck", "sanitizer-initcheck", "bench", "bench-triton"]


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real thing: make gpu-check")
def test_without_a_gpu_every_step_runs_and_the_check_fails(tmp_path):
    out = tmp_path / "check"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable,
               GPU_CHECK_SKIP="pytest-gpu pytest-readme bench bench-triton",  # minutes each; no GPU to test here
               PATH="/usr/bin:/bin")  # no nvidia-smi / compute-sanitizer, whatever this machine has
    env["TRITON_INTERPRET"] = "1"  # the script must unset it (the GPU runs compiled kernels)
    p = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    summary = (out / "summary.txt").read_text()
    status = {line.split()[0]: line.split()[1] for line in summary.splitlines()[1:] if line.strip()
              and not line.startswith("gpu-check:")}
    assert list(status) == STEPS
    assert status["info"] == "ok" and status["pytest-gpu"] == "SKIP" and status["bench"] == "SKIP"
    assert status["selftest"] == "FAIL(2)"  # --device cuda without CUDA is a usage error
    assert all(status[s].startswith("FAIL") for s in ("nvidia-smi", "sanitizer-memcheck", "sanitizer-initcheck"))
    info = json.loads((out / "info.json").read_text())
    assert info["triton_interpret"] is False and info["torch"] == torch.__version__
    assert "--device cuda" in (out / "selftest.txt").read_text()
    assert summary in p.stdout and "11 steps, 6 failed" in summary
