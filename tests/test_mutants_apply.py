"""tools/mutants.py stays in step with the sources: every mutant still applies (its
snippet occurs exactly once), ids are unique, and every kind of bug the mutation check
promises is covered.  (Running the mutants takes minutes per C++ rebuild: see
docs/development.md.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "mutants.py"
spec = importlib.util.spec_from_file_location("fedopt_mutants", TOOL)
mutants = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mutants  # dataclasses look their module up there
spec.loader.exec_module(mutants)


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.id)
def test_mutant_applies_to_the_current_sources(m):
    mutated = mutants.check_applies(m)
    original = (mutants.REPO / m.file).read_text()
    assert mutated != original and mutated.count(m.replace) >= 1


def test_the_table_covers_every_required_kind():
    ids = [m.id for m in mutants.MUTANTS]
    assert len(ids) == len(set(ids)) and len(ids) >= 15
    kinds = {m.kind for m in mutants.MUTANTS}
    assert set(mutants.REQUIRED_KINDS) <= kinds
    targets = {m.file.split("/")[0] for m in mutants.MUTANTS}
    assert {"python_ref", "csrc", "fedopt_kernels"} <= targets
    assert any(m.file == "csrc/include/fedopt/math.h" for m in mutants.MUTANTS)
    assert any(m.file.startswith("csrc/cpu/") for m in mutants.MUTANTS)
    assert any(m.file.endswith("triton/_helpers.py") for m in mutants.MUTANTS)


def test_a_mutant_that_does_not_apply_is_an_error(tmp_path):
    m = mutants.Mutant("x", "wrong sign", "f.py", "a + b", "a - b", "test")
    (tmp_path / "f.py").write_text("a + b\na + b\n")
    with pytest.raises(ValueError, match="occurs 2 times"):
        mutants.check_applies(m, tmp_path)
