"""The Flower-vs-simulator whole-run comparison (fedopt_kernels.benchmarks.flower_run)
stays runnable: a real ``flwr run`` of examples/flower_app on Flower's Ray simulation
runtime and a ``fedopt simulate`` subprocess, at a tiny size.

* Same workload for real: with every client in every round and the sequential engine
  the two runs give the same test accuracy every round and the same final model, bit
  for bit.
* The timing configuration (2 of 4 clients a round, Flower's own sampling; the
  simulator's default engine), through the command line and its ``--json``: both runs
  finish, each reports one time per round, 2 clients trained per round, positive
  times, the ratio row is the quotient of the two.

No wall-clock thresholds.  Skipped, like tests/test_flower.py, only on Python 3.10
(flwr 1.41 cannot be installed there); elsewhere a missing flwr fails them.
"""

from __future__ import annotations

import json

import pytest
import torch
from _flwr import needs_flwr

from fedopt_kernels.benchmarks import flower_run as FR

TINY = dict(clients=4, rounds=2, local_steps=3, hidden=16)


def test_fraction_train_samples_exactly_per_round():
    """Flower's FedAvg samples int(clients * fraction_train) nodes (at least 2)."""
    for clients in range(2, 201):
        for per_round in range(2, clients + 1):
            f = FR.fraction_train(clients, per_round)
            assert int(clients * f) == per_round and f <= 1.0, (clients, per_round, f)
    for bad in ((10, 1), (10, 11)):
        with pytest.raises(ValueError, match="min_train_nodes"):
            FR.fraction_train(*bad)


def _check_run(run, per_round: int):
    assert len(run.round_s) == TINY["rounds"] and len(run.accuracy) == TINY["rounds"] + 1
    assert run.sampled == [per_round] * TINY["rounds"]
    assert all(t > 0 for t in run.round_s)
    assert run.wall_s > sum(run.round_s) > 0  # the whole run holds start-up, data and shutdown too
    assert all(0.0 <= a <= 1.0 for a in run.accuracy)


@needs_flwr
@pytest.mark.slow
def test_same_workload_bitwise(tmp_path, monkeypatch):
    """All 4 clients every round, sequential engine: Flower's run and fedopt simulate's
    have the same per-round accuracies and final model."""
    # One torch thread in every process, as simulate's sequential engine runs: MKL's strict mode
    # (backends/mkl.py) gives a product's bits for a fixed thread count, and Flower's
    # processes would otherwise run torch's default (docs/determinism.md).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    res = FR.compare(workdir=tmp_path, per_round=4, engine="sequential", **TINY)
    (fl,), (fo,) = res["flower"], res["fedopt"]
    _check_run(fl, 4)
    _check_run(fo, 4)
    assert fo.extra["engine"] == "sequential"
    assert fl.accuracy == fo.accuracy
    flower_state = torch.load(tmp_path / "flower_0" / "final_model.pt", weights_only=True)
    x_flower = torch.cat([v.flatten() for v in flower_state.values()])
    x_fedopt = torch.load(tmp_path / "fedopt_0" / "checkpoint.pt", weights_only=True)["x_global"]
    assert torch.equal(x_flower, x_fedopt), (x_flower - x_fedopt).abs().max()


@needs_flwr
@pytest.mark.slow
def test_timing_run_from_the_command_line(tmp_path, capsys):
    """2 of 4 clients a round (Flower samples its own), the simulator's default engine."""
    out = tmp_path / "cmp.json"
    argv = ["--clients", "4", "--per-round", "2", "--rounds", "2", "--local-steps", "3", "--hidden", "16",
            "--workdir", str(tmp_path / "runs"), "--json", str(out)]
    assert FR.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| Flower (Ray simulation) |" in printed and "| ratio flower / fedopt |" in printed
    res = json.loads(out.read_text())
    assert res["workload"] == {**FR.WORKLOAD, **TINY, "per_round": 2}
    (fl,), (fo,) = res["flower"], res["fedopt"]
    assert fo["engine"] == "batched"
    for run in (fl, fo):
        assert len(run["round_s"]) == 2 and run["sampled"] == [2, 2]
        assert all(t > 0 for t in run["round_s"]) and run["wall_s"] > sum(run["round_s"])
        assert len(run["accuracy"]) == 3
    assert fl["accuracy"][0] == fo["accuracy"][0]  # the same initial model on the same test set
    flower_row, fedopt_row, ratio = res["rows"]
    assert flower_row["whole run s"] == fl["wall_s"] and fedopt_row["whole run s"] == fo["wall_s"]
    assert ratio["whole run s"] == pytest.approx(fl["wall_s"] / fo["wall_s"])
    assert flower_row["rounds"] == fedopt_row["rounds"] == 2
    assert res["superlink_start_s"] > 0
