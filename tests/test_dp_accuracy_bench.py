"""The accuracy-vs-epsilon table of docs/privacy.md: its rows from hand-made runs, and one
real run through the benchmark's entry equal to the simulator's own, its epsilon the
accountant's (dp-accounting called directly)."""

from __future__ import annotations

import pytest

from fedopt_kernels.benchmarks import dp_accuracy as B
from fedopt_kernels.fl import Simulation, SimulationConfig


def test_rows_are_the_mean_and_range_over_seeds_and_the_epsilon_of_the_last_round():
    results = {"none": [(0.9, None, None), (0.8, None, None)], "clip": [(0.85, None, 0.5)],
               "z1.0": [(0.5, 12.25, 0.5), (0.7, 12.25, 0.5)]}
    assert B.table(results, 1e-3).splitlines() == [
        "| setting | final accuracy % | epsilon at delta = 0.001 |", "|---|---:|---:|",
        "| FedAvg, no DP | 85.0 (80.0-90.0) | -- (no DP) |",
        "| z = 0, clip 0.5 | 85.0 | infinite (no noise) |",
        "| z = 1, clip 0.5 | 60.0 (50.0-70.0) | 12.2 |"]
    with pytest.raises(AssertionError):  # epsilon is a function of z, q and T: seeds cannot disagree on it
        B.table({"z1.0": [(0.5, 12.0, 0.5), (0.7, 13.0, 0.5)]}, 1e-3)


def test_a_row_is_the_simulated_run_and_its_epsilon_the_accountants():
    pytest.importorskip("dp_accounting", reason="needs the privacy extra: pip install fedopt_kernels[privacy]")
    import dp_accounting

    acc, eps, clip = B.run_row("adaptive z1.0", seed=0, rounds=2)
    cfg = SimulationConfig(dataset="digits", clients=100, per_round=20, rounds=2, seed=0, weighting="uniform",
                           dp_clip=0.5, dp_noise_multiplier=1.0, dp_delta=1e-3, dp_target_quantile=0.5)
    last = Simulation(cfg).run().records[-1]
    assert (acc, eps, clip) == (last["test_accuracy"], last["dp_epsilon"], last["dp_clip"])
    assert clip != 0.5  # adaptive: the clip moved
    # fixed-size sampling of 20 of 100 without replacement, replace-one neighbours (the sum
    # moves by up to 2C, so noise z C is z / 2 times the sensitivity): two rounds
    rdp = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    rdp.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(100, 20, dp_accounting.GaussianDpEvent(0.5)), 2))
    assert eps == pytest.approx(rdp.get_epsilon(1e-3), rel=1e-9)
