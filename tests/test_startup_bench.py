"""The start-up suite of ``fedopt bench`` (issue 48, item 3): what it computes from the
times of the processes, checked on hand-made times (no wall clock asserted), and the
command lines it times really run."""

import subprocess

from fedopt_kernels.benchmarks import startup, suite


def test_beyond_torch_is_the_median_of_paired_differences(monkeypatch):
    # per repetition: import torch, simulate without plots, simulate with plots
    times = iter([0, 0, 0,                       # the warm-up pass
                  1.0, 2.0, 3.5,
                  1.2, 2.6, 3.0,                 # a noisy repetition hits all three
                  1.1, 2.3, 3.3])
    monkeypatch.setattr(startup, "_timed", lambda cmd: (next(times), "torch._dynamo" if "-c" in cmd[1:2] else None))
    rows = startup.run(repeats=3)
    by = {r["case"]: r for r in rows}
    assert by["import torch"]["s"] == 1.1
    assert by["simulate, no plots"]["s"] == 2.3
    # differences 1.0, 1.4, 1.2 -> 1.2 (not 2.3 - 1.1 = 1.2 by luck: see the plots row)
    assert abs(by["simulate, no plots"]["beyond torch s"] - 1.2) < 1e-12
    # differences 2.5, 1.8, 2.2 -> 2.2, where the medians' difference would be 3.3 - 1.1
    assert abs(by["simulate, plots"]["beyond torch s"] - 2.2) < 1e-12
    assert by["simulate, plots"]["target s"] == 3.0 and by["simulate, no plots"]["target s"] == 1.5
    line = suite.summary_lines(rows)[0]
    assert line.startswith("startup: a one-round simulate is 1.20 s beyond import torch (1.10 s)")
    assert "2.20 s with them (target 3 s)" in line


def test_the_timed_commands_run(tmp_path):
    cmds = startup._commands(tmp_path)
    assert set(cmds) == {"import torch", "simulate, no plots", "simulate, plots"}
    proc = subprocess.run(cmds["simulate, no plots"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "a" / "results.json").exists() and not list((tmp_path / "a").glob("*.png"))
    heavy = [ln for ln in proc.stderr.splitlines() if ln.startswith("HEAVY:")]
    assert heavy and "matplotlib" not in heavy[-1]  # --no-plots imports no matplotlib
    # nor the compiler (item 1): the batched engine's gradient and trace import neither
    assert "torch._dynamo" not in heavy[-1] and "torch._inductor" not in heavy[-1], heavy[-1]
