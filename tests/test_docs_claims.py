"""Issue 33, item 5: claims of the README, the docs/ pages and the docstrings, checked
against the code.

Each test names the sentence it checks; each failed against the sentence as it stood
(or against the code, where the code was changed to match).
"""

from __future__ import annotations

import pytest
import torch

try:
    import flwr  # noqa: F401

    HAVE_FLWR = True
except ImportError:
    HAVE_FLWR = False


def _compile_count(lrs, tensor_lr: bool) -> int:
    """Frames Dynamo compiles for ``FedNAR.step`` over the lr values ``lrs``."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from fedopt_kernels.optim import FedNAR

    torch._dynamo.reset()
    w = torch.nn.Parameter(torch.randn(10))
    lr = torch.tensor(lrs[0]) if tensor_lr else lrs[0]
    opt = FedNAR([w], lr=lr)
    counter = CompileCounter()
    step = torch.compile(opt.step, backend=counter)
    for value in lrs:
        if tensor_lr:
            lr.fill_(value)
        else:
            opt.param_groups[0]["lr"] = value
        w.grad = torch.ones(10)
        step()
    torch._dynamo.reset()
    return counter.frame_count


def test_a_changing_float_lr_recompiles_for_every_value_a_tensor_lr_never():
    """docs/compile.md (from the README), "torch.compile and CUDA graphs": "A Python-float
    lr that changes between compiled steps recompiles for every new value ... Hold a changing lr in a 0-d
    tensor: one compile for every value" (it said: "recompiles once with the float as
    a symbol")."""
    lrs = [0.1, 0.0998, 0.0996, 0.0994, 0.0992]
    assert _compile_count(lrs, tensor_lr=False) == len(lrs)
    assert _compile_count(lrs, tensor_lr=True) == 1
    assert _compile_count([0.1, 0.1, 0.1], tensor_lr=False) == 1  # the same float: no recompile


def test_compare_writes_each_runs_results_and_one_plot(tmp_path):
    """README, `make demo`: compare writes `compare.{png,csv,json}` plus one folder per
    run with its `results.json/.csv` (it said "and plots", which it never drew) and,
    since issue 41, its `checkpoint.pt` (`fedopt compare --resume`)."""
    from fedopt_kernels.cli import main

    out = tmp_path / "cmp"
    threads = torch.get_num_threads()
    try:
        code = main(["compare", "--dataset", "digits", "--hidden", "8", "--clients", "4", "--per-round", "2",
                     "--rounds", "1", "--local-steps", "1", "--quiet", "--threads", "1", "--algos",
                     "fedavg,fedprox", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # --threads sets the process's; later tests' bits may depend on it
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["compare.csv", "compare.json", "compare.png", "fedavg",
                                                      "fedprox"]
    for run in ("fedavg", "fedprox"):
        assert sorted(p.name for p in (out / run).iterdir()) == ["checkpoint.pt", "results.csv", "results.json"]


@pytest.mark.skipif(not HAVE_FLWR, reason="flwr is not installed")
def test_flower_aggregate_train_reads_replies_in_place_by_default(monkeypatch):
    """fedopt_kernels.integrations.flower's docstring: on a CPU server aggregate_train
    reads the replies' arrays in place by default, and copies them into one [C, N]
    tensor with read_in_place=False (it said it always copies)."""
    import test_flower_bad_replies as fb  # tests/ is on sys.path (pytest's rootdir conftest)
    from fedopt_kernels.integrations.flower import replies as strategy_module  # where the replies are read

    calls = []
    real = strategy_module.stack_arrayrecords

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(strategy_module, "stack_arrayrecords", counting)
    s = fb._strategy("fedavg")
    s.aggregate_train(1, [fb._reply(s.model, c) for c in range(3)])
    assert calls == []  # read in place: no [C, N] copy
    s = fb._strategy("fedavg", read_in_place=False)
    s.aggregate_train(1, [fb._reply(s.model, c) for c in range(3)])
    assert calls == [1]
    import fedopt_kernels.integrations.flower as fk

    assert "in place" in fk.__doc__ and "read_in_place=False" in fk.__doc__


def test_the_fl_quick_start_runs_in_a_fresh_directory(tmp_path, monkeypatch):
    """fedopt_kernels.fl's docstring quick start, as written (2 rounds instead of 30),
    in a directory without results/ (it raised FileNotFoundError there)."""
    import fedopt_kernels.fl as fl

    code = fl.__doc__.split("Quick start::")[1].split("Pieces:")[0]
    code = "\n".join(line[4:] for line in code.splitlines() if line.strip())
    assert "rounds=30" in code and 'results.write("results/")' in code
    monkeypatch.chdir(tmp_path)
    before = torch.get_num_threads()
    try:
        exec(code.replace("rounds=30", "rounds=2"), {})
    finally:
        torch.set_num_threads(before)
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [
        "accuracy_loss.png", "clipping.png", "results.csv", "results.json", "server.png"]


def _claims_commands(page="docs/claims.md"):
    """Every ``fedopt ...`` command of ``page``'s bash blocks (continuation lines joined,
    the loop variables given their first value)."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / page).read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        block = block.replace("\\\n", " ")
        loops = dict(re.findall(r"for (\w+) in (\S+)", block))
        for line in block.splitlines():
            line = line.strip()
            if not line.startswith("fedopt "):
                continue
            for var, first in loops.items():
                line = line.replace(f"${var}", first)
            commands.append(shlex.split(line, comments=True)[1:])
    return commands


def test_every_command_on_the_claims_page_is_accepted_by_the_cli():
    """docs/claims.md: each command it says produced its numbers parses, and those with
    --recipe resolve to a configuration (a flag renamed or a recipe removed fails here)."""
    from fedopt_kernels.cli import build_parser
    from fedopt_kernels.cli._options import build_settings

    commands = _claims_commands()
    assert len(commands) >= 8 and sum("--recipe" in c for c in commands) >= 5
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv)
        vars(args).pop("distributed", None)
        config, _ = build_settings(args)
        if "--recipe" in argv:
            assert config.recipe == argv[argv.index("--recipe") + 1]


def test_every_simulate_command_of_the_readme_is_accepted_by_the_cli():
    """README.md's quick start: each ``fedopt simulate``/``compare`` command parses and
    resolves to a valid configuration (recipe, DP, attack and scale flags included)."""
    from fedopt_kernels.cli import build_parser
    from fedopt_kernels.cli._options import build_settings

    commands = [c for c in _claims_commands("README.md") if c[0] in ("simulate", "compare")]
    assert len(commands) >= 5 and any("--recipe" in c for c in commands)
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv)
        vars(args).pop("distributed", None)
        config, _ = build_settings(args)
        config.validate()
        if "--recipe" in argv:
            assert config.recipe == argv[argv.index("--recipe") + 1]
        if "--dp-clip" in argv:
            assert config.dp_clip == float(argv[argv.index("--dp-clip") + 1]) and config.attack == "signflip"
        if "--memory-budget" in argv:
            assert config.clients == 100000 and config.memory_budget_bytes == 256 * 2 ** 20
