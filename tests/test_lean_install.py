"""The kernel core installs lean: ``pip install fedopt_kernels`` needs torch and numpy
only (setup.py's REQUIREMENTS); the simulator, its plots and the benchmarks come with the
``sim`` extra (pyproject.toml, ``fedopt_kernels/extras.py``).

A lean install is faked in a subprocess by making the sim extra's modules unimportable
(``sys.modules[name] = None``): there the core, ``fedopt info`` and ``fedopt selftest``
run (plain-text tables without rich), and importing the simulator or the benchmarks, or
running ``fedopt simulate`` / ``compare`` / ``bench``, says what to install.
(tests/test_wheel.py installs the real wheel into a venv that lacks the extra.)
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SIM = ("sklearn", "matplotlib", "rich")
INSTALL = "pip install fedopt_kernels[sim]"


def lean(code: str, *, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where the sim extra is not installed."""
    prologue = f"import sys\nsys.modules.update(dict.fromkeys({SIM!r}))\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               COLUMNS="200")
    return subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_setup_requires_torch_and_numpy_only():
    tree = ast.parse((REPO / "setup.py").read_text())
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") ==
               "REQUIREMENTS"]
    assert [r.split(">")[0].split("=")[0] for r in ast.literal_eval(node.value)] == ["numpy"]


def test_the_sim_extra_lists_what_extras_py_checks():
    import tomllib

    from fedopt_kernels.extras import EXTRAS

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [r.split(">")[0] for r in extras["sim"]] == [dist for dist, _ in EXTRAS["sim"]]
    assert "fedopt_kernels[sim]" in extras["test"] and "fedopt_kernels[sim]" in extras["flower"]
    # the benchmark lab is behind its own extra, which brings what its suites run (the simulator)
    assert extras["bench"] == ["fedopt_kernels[sim]"] and EXTRAS["bench"] == EXTRAS["sim"]
    assert "fedopt_kernels[bench]" in extras["test"]
    assert '".[sim,test]"' in (REPO / "Makefile").read_text()  # make demo / make test install it


@pytest.mark.parametrize("module, part, extra", [("fedopt_kernels.fl", "fedopt_kernels.fl (the simulator)", "sim"),
                                                 ("fedopt_kernels.benchmarks.suite", "fedopt_kernels.benchmarks",
                                                  "bench")])
def test_importing_an_optional_part_without_its_extra_says_what_to_install(module, part, extra):
    proc = lean(f"""
        import fedopt_kernels
        from fedopt_kernels.extras import MissingExtraError
        try:
            import {module}
        except MissingExtraError as exc:
            assert isinstance(exc, ImportError)
            print(exc)
        else:
            raise SystemExit("imported")
        """)
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout.strip()
    assert said.startswith(part) and said.endswith(f"pip install fedopt_kernels[{extra}]"), said
    assert "needs scikit-learn, matplotlib and rich, which are not installed" in said


def test_one_missing_distribution_is_named_alone():
    proc = lean("""
        del sys.modules["sklearn"], sys.modules["rich"]  # only matplotlib missing
        from fedopt_kernels.extras import message
        print(message("sim", "x"))
        """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"x needs matplotlib, which is not installed: {INSTALL}"


def test_the_core_info_and_selftest_run_lean(tmp_path):
    report = tmp_path / "selftest.json"
    proc = lean(f"""
        import torch
        from fedopt_kernels import ops
        from fedopt_kernels.cli import main
        x, g = [torch.ones(5)], [torch.ones(5)]
        ops.nar_step_(x, g, lr=0.1, backend="reference")
        assert main(["info"]) == 0
        assert main(["selftest", "--device", "cpu", "--backends", "reference", "--quick",
                     "--json", {str(report)!r}]) == 0
        for name in {SIM!r}:
            assert sys.modules[name] is None, name  # nothing got past the block
        """)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kernel backends" in proc.stdout and "optional integrations" in proc.stdout
    assert f"not installed: {INSTALL}" in proc.stdout  # the sim rows of fedopt info
    rows = json.loads(report.read_text())["results"]
    assert rows and all(r["status"] == "PASS" for r in rows)


@pytest.mark.parametrize("command", [["simulate", "--rounds", "1"], ["compare", "--algos", "fedavg"],
                                     ["bench", "--only", "nar_step"]])
def test_the_sim_commands_say_what_to_install(command):
    proc = lean(f"""
        from fedopt_kernels.cli import main
        sys.exit(main({command!r}))
        """)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    extra = "bench" if command[0] == "bench" else "sim"  # the benchmark lab has its own extra
    assert proc.stderr.strip() == (f"fedopt: error: fedopt {command[0]} needs scikit-learn, matplotlib and rich, "
                                   f"which are not installed: pip install fedopt_kernels[{extra}]")
