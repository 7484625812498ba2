"""scripts/sanitizer_driver.py, the program device-check.sh runs under compute-sanitizer:
it runs on CPU (so it is tested here), passes on correct kernels and fails on a wrong one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

from conftest import require_backend
from fedopt_kernels import backends

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "scripts" / "sanitizer_driver.py"


def _load_driver():
    spec = importlib.util.spec_from_file_location("sanitizer_driver", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_driver_runs_every_case_on_the_cpu_backends(tmp_path):
    """A fresh process (the driver sets TRITON_INTERPRET itself for --device cpu)."""
    require_backend("cpu")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, str(DRIVER), "--device", "cpu"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    cases = [c.__name__ for c in _load_driver().CASES]
    names = ["cpu"] + (["triton"] if torch.version.cuda is not None else [])  # triton ships with CUDA torch
    for name in names:
        for case in cases:
            assert any(line.startswith(f"ok    {name:<7} {case} ") for line in p.stdout.splitlines()), (name, case)
    assert f"{len(cases) * len(names)} cases passed, 0 failed" in p.stdout


def test_driver_fails_on_a_wrong_aggregation(capsys, monkeypatch):
    require_backend("cpu")
    driver = _load_driver()
    cpu = backends.resolve("cpu", torch.device("cpu"))
    real = cpu.aggregate

    def gamma_ignored(clients, weights, gamma, out, skip):
        return real(clients, weights, 1.0, out, skip)

    monkeypatch.setattr(cpu, "aggregate", gamma_ignored)
    assert driver.main(["--device", "cpu", "--backends", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  cpu     aggregate_33_clients" in out and "ok    cpu     misaligned_nar_step" in out
    # the two aggregate cases, and weighted_sum whose forward is the aggregation
    assert "FAIL  cpu     client_dots_and_weighted_sum_33" in out and "cases passed, 3 failed" in out
