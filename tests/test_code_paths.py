"""The determinism tests again under every CPU code path this machine offers.

A client's bits must be its own on every path a user's CPU may run: ATen's and the
kernels' DEFAULT / AVX2 / AVX-512 builds (``ATEN_CPU_CAPABILITY``) and MKL's AVX2 /
AVX-512 GEMMs (``MKL_ENABLE_INSTRUCTIONS``, Intel CPUs only).  Each path is a fresh
pytest of the tests below (tests/_code_paths.py); a path this machine cannot take is
skipped with its name.  The tests themselves run in-process on the native path.
"""

import os

import pytest
import torch

from _code_paths import PATHS, run_under

DETERMINISM = [
    "tests/test_ragged_bmm.py::test_a_clients_bits_do_not_depend_on_where_its_operands_lie",
    "tests/test_ragged_bmm.py::test_a_clients_bits_do_not_depend_on_who_shares_the_call",
    "tests/test_batched_engine.py::test_a_clients_update_does_not_depend_on_its_place_in_the_round",
    "tests/test_mkl_cnr.py::test_strict_mode_gives_one_bit_pattern_wherever_the_operands_lie",
    "tests/test_code_paths.py::test_this_process_runs_the_path_it_was_asked_for",
]


@pytest.mark.parametrize("path", list(PATHS))
def test_a_clients_bits_are_its_own_on_every_code_path(path):
    counts = run_under(path, DETERMINISM)
    # 12 placement cases, 3 grouping cases, 2 models, 1 MKL check, 1 self-check: all ran
    assert counts.get("passed") == 19 and not counts.get("skipped"), counts


def test_this_process_runs_the_path_it_was_asked_for():
    """Run under a path by the test above: the process took the instruction set asked for
    (torch and the kernels for ATEN_CPU_CAPABILITY; for MKL_ENABLE_INSTRUCTIONS, MKL's
    strict mode is on, the rest is MKL's own choice)."""
    asked = os.environ.get("ATEN_CPU_CAPABILITY")
    if asked is not None:
        assert torch.backends.cpu.get_cpu_capability() == asked.upper()
        assert torch.ops.fedopt_C.cpu_isa() == asked.upper()
    from fedopt_kernels.backends import mkl

    st = mkl.status()
    if st["mode"] is not None:
        assert st["strict"], st
