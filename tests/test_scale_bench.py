"""``fedopt bench --only scale`` (issue 32): the cross-device scale benchmark as a suite
of the bench command, with a quick size.  No time is asserted: the rows' sizes and
counts are checked against values computed here."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedopt_kernels.benchmarks import scale, suite
from fedopt_kernels.cli import main
from fedopt_kernels.fl.datasets.data import synthetic_lazy


def test_scale_is_named_not_default():
    parser = suite.build_parser()
    assert parser.parse_args(["--only", "scale"]).only == ["scale"]
    assert "scale" not in suite.SUITES  # minutes of fresh processes: only when named


def test_sampling_row_counts_what_it_timed():
    row = scale.sampling_and_partition(300, 20, (3_000,))
    want = synthetic_lazy(num_clients=300, seed=0, test_clients=1)
    assert row["clients"] == 300 and row["total_samples"] == want.num_train
    # the default min_size of 3,000 samples over 300 clients: max(1, min(10, 3000 // 3000)) = 1
    assert row["dirichlet_3000_min"] >= 1
    for key in ("dataset_s", "partition_s", "sample_s", "dirichlet_3000_s", "iid_3000_s"):
        assert row[key] >= 0


def test_scale_rows_print_as_a_table_and_a_line(capsys):
    rows = [{"benchmark": "scale", "case": "sampling", "clients": 100_000, "dataset_s": 0.05, "partition_s": 0.002,
             "sample_s": 0.025, "total_samples": 7, "dirichlet_100000_s": 0.71, "dirichlet_100000_min": 1,
             "iid_100000_s": 0.2},
            {"benchmark": "scale", "case": "population", "clients": 1000, "per_round": 100, "chunk": None,
             "setup_s": 0.5, "first_round_s": 9.0, "round_s": 1.25, "peak_rss_mb": 750.0},
            {"benchmark": "scale", "case": "per_round", "clients": 10_000, "per_round": 1000, "error": ["MemoryError"]}]
    suite.print_table(rows)
    table = capsys.readouterr().out
    assert "cross-device scale" in table and "1.25" in table and "750" in table and "MemoryError" not in table
    lines = suite.summary_lines(rows)
    assert lines == [
        "scale: 100,000 clients: population 0.05 s, natural partition 2 ms, sampling a round 25 ms; "
        "100,000 samples: Dirichlet(0.3) 0.71 s (min 1), IID 0.2 s",
        "scale: per_round (10000 clients, 1000 per round) failed: MemoryError"]


def _mlp_numel(inputs, hidden, classes):
    sizes = [inputs, *hidden, classes]
    return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


@pytest.mark.slow
def test_fedopt_bench_scale_quick_end_to_end(tmp_path, capsys):
    """The quick size through the CLI: every case ran in its own process and reports its
    sizes, the model's parameter count and a positive peak RSS; the table is printed."""
    out = tmp_path / "scale.json"
    assert main(["bench", "--only", "scale", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [r for r in json.loads(out.read_text()) if r.get("benchmark") == "scale"]
    want = [(c, kw["clients"], kw["per_round"]) for c, kw in scale.cases(set(scale.CASES), quick=True)]
    cases = [r for r in rows if r["case"] != "sampling"]
    assert [(r["case"], r["clients"], r["per_round"]) for r in cases] == want
    assert all("error" not in r for r in rows)
    numel = _mlp_numel(60, (200, 200), 10)  # synthetic: 60 features, 10 classes; the mlp's default widths
    for r in cases:
        assert r["numel"] == numel and r["peak_rss_mb"] > 0 and r["round_s"] > 0 and r["chunk"] is None
    sampling = [r for r in rows if r["case"] == "sampling"]
    assert len(sampling) == 1 and sampling[0]["clients"] == 1_000 and sampling[0]["dirichlet_10000_min"] >= 1
    assert "cross-device scale" in printed and "scale: 1,000 clients" in printed
    assert np.isfinite([r["setup_s"] for r in cases]).all()
