"""No flag of the command line may be abbreviated (issue 48).

argparse's default takes any unambiguous prefix of a flag: ``--roun 1`` ran one round,
and ``--mode fedbuff`` was read as ``--model fedbuff`` before ``--mode`` existed.  A prefix that works today
changes meaning the day a new flag shares it, so every parser refuses abbreviations and
the error suggests the full flags.
"""

import argparse

import pytest

from fedopt_kernels.cli import build_parser, main


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_parser_refuses_abbreviations():
    parsers = list(_parsers(build_parser()))
    assert len(parsers) >= 6  # fedopt, simulate, compare, bench, info, selftest
    assert [p.prog for p in parsers if p.allow_abbrev] == []


@pytest.mark.parametrize("argv, unknown, suggested", [
    (["simulate", "--roun", "1"], "--roun", "--rounds"),
    (["simulate", "--roun=1"], "--roun", "--rounds"),
    (["simulate", "--mod", "fedbuff"], "--mod", "--mode or --model"),  # once read as --model
    (["compare", "--algos", "fedavg:co", "--round", "2"], "--round", "--rounds"),
])
def test_a_prefix_is_refused_and_the_full_flag_suggested(capsys, tmp_path, argv, unknown, suggested):
    out = tmp_path / "run"
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0  # one line
    assert f"unrecognized arguments: {unknown}" in err
    assert f"did you mean {suggested}" in err
    assert not out.exists()  # nothing ran


def test_full_flags_still_parse():
    args = build_parser().parse_args(["simulate", "--rounds", "3", "--model", "mlp"])
    assert (args.rounds, args.model) == (3, "mlp")


def test_the_module_entry_points_refuse_abbreviations_too():
    """The benchmarks' and scripts' own ``python -m`` parsers are command lines a user
    keeps in scripts as well: each plain argparse parser says ``allow_abbrev=False``."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for folder in ("fedopt_kernels", "scripts", "tools"):
        for path in sorted((root / folder).rglob("*.py")):
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if "argparse.ArgumentParser(" in line and "allow_abbrev=False" not in line:
                    offenders.append(f"{path.relative_to(root)}:{no}")
    assert offenders == []
