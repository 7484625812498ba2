"""The ``fedopt`` command line (also ``python -m fedopt_kernels``).

Subcommands:

``fedopt simulate``  one federated simulation: progress bar with the current accuracy,
                     a summary table, results.json/.csv and PNG plots in ``--out``.
``fedopt compare``   several algorithms on the same partition and client sequence;
                     one comparison plot and one table.
``fedopt bench``     the kernel benchmark suite's table (``--only scale``: cross-device scale;
                     ``--only diloco``: DiLoCo vs DDP on a char GPT).
``fedopt info``      versions, devices, which backends are built/available and why not.
``fedopt selftest``  every op on every backend of this device against python_ref and fp64
                     formulas, torch.compile and CUDA graphs; exit 1 on any mismatch.

``simulate`` and ``compare`` come with the ``sim`` extra (``pip install
fedopt_kernels[sim]``), ``bench`` with the ``bench`` extra (the benchmark lab, out of the
core); without it they say so (exit status 1), and ``info`` and ``selftest`` run as they
are (plain-text tables where rich is not installed).

Errors (unknown names, impossible settings, malformed config files, unusable output
directories) print one line ``fedopt: error: ...`` and exit with status 2 (1 for a
failure while running); Ctrl-C stops a run after writing the results so far (130).
"""

from __future__ import annotations

import signal
import sys
from typing import Optional, Sequence

from .. import extras
from ._errors import ArgumentParser, CLIError

__all__ = ["main", "build_parser", "CLIError"]

SIM_COMMANDS = ("simulate", "compare", "bench")  # they come with an extra: COMMAND_EXTRA
COMMAND_EXTRA = {"simulate": "sim", "compare": "sim", "bench": "bench"}


def build_parser() -> ArgumentParser:
    from .. import __version__

    parser = ArgumentParser(prog="fedopt", description="Fused federated optimizers: simulate, compare, benchmark.")
    parser.add_argument("--version", action="version", version=f"fedopt_kernels {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{simulate,compare,bench,info,selftest}")
    if extras.missing("sim"):
        for name, what in zip(SIM_COMMANDS[:2], ("run one federated simulation",
                                                 "run several algorithms on the same partition and clients")):
            _needs_extra(sub, name, what)
    else:
        from .simulate import add_compare_parser, add_simulate_parser

        add_simulate_parser(sub)
        add_compare_parser(sub)
    if extras.missing("bench"):
        _needs_extra(sub, "bench", "run the kernel benchmark suite and print its table")
    else:
        from ..benchmarks import suite

        bench = sub.add_parser("bench", help="run the kernel benchmark suite and print its table",
                               description="Run the kernel benchmark suite (fedopt_kernels.benchmarks.suite).")
        suite.build_parser(bench)
        bench.set_defaults(func=_run_bench)

    info = sub.add_parser("info", help="versions, devices and kernel backends",
                          description="Print versions, which backends are built and available here, and why not.")
    info.add_argument("--json", action="store_true", help="print as JSON")
    info.set_defaults(func=_run_info)

    from .selftest import add_parser as add_selftest_parser

    add_selftest_parser(sub)
    return parser


def _needs_extra(sub, name: str, what: str) -> None:
    """Subcommand ``name`` of an extra that is not installed: listed by --help; running
    it says what to install (:func:`_refuse_without_extra`)."""
    sub.add_parser(name, help=f"{what} (needs fedopt_kernels[{COMMAND_EXTRA[name]}])")


def _refuse_without_extra(argv: Sequence[str]) -> None:
    """``fedopt simulate|compare|bench ...`` without its extra: what to install (before
    parsing: their options are not known without it)."""
    if argv and argv[0] in SIM_COMMANDS:
        text = extras.message(COMMAND_EXTRA[argv[0]], f"fedopt {argv[0]}")
        if text is not None:
            raise CLIError(text, code=1)


def _run_bench(args) -> int:
    from ..benchmarks import suite

    return suite.run_from_args(args)


def _run_info(args) -> int:
    from .info import run_info

    return run_info(args)


def _interrupted_status(exc: KeyboardInterrupt) -> int:
    """``128 + signum`` (130 for Ctrl-C): the simulator's ``exit_status``; without the
    sim extra nothing but Ctrl-C stops a command."""
    try:
        from ..fl.run.interrupts import exit_status
    except ImportError:
        return 128 + int(signal.SIGINT)
    return exit_status(exc)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``fedopt`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        _refuse_without_extra(argv)
        args = parser.parse_args(argv)
        if getattr(args, "func", None) is None:
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"fedopt: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt as exc:
        print("fedopt: interrupted", file=sys.stderr)
        return _interrupted_status(exc)
    except BrokenPipeError:  # e.g. `fedopt info | head`
        return 1
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback; FEDOPT_DEBUG=1 shows it
        import os

        if os.environ.get("FEDOPT_DEBUG"):
            raise
        msg = " ".join(str(exc).split()) or type(exc).__name__
        print(f"fedopt: error: {type(exc).__name__}: {msg} (set FEDOPT_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
