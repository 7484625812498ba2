"""The accuracy table of docs/robustness.md: its cells from hand-made runs, and one
real run through the benchmark's entry equal to the simulator's own."""

from __future__ import annotations

from fedopt_kernels.benchmarks import robust_accuracy as B
from fedopt_kernels.fl import Simulation, SimulationConfig


def test_table_cells_are_the_mean_and_range_over_seeds_in_percent():
    results = {("mean", "none", 0.0): [0.9, 0.8, 0.85], ("mean", "scale", 0.3): [0.5]}
    text = B.table(results, ["mean"], [("none", 0.0), ("scale", 0.3)])
    assert text.splitlines() == ["| aggregator | no attack | scale 30% |", "|---|---:|---:|",
                                 "| mean | 85.0 (80-90) | 50.0 |"]


def test_a_cell_is_the_final_accuracy_of_the_simulated_run():
    got = B.run_cell("multi-krum", "scale", 0.3, seed=0, rounds=1)
    cfg = SimulationConfig(dataset="digits", clients=20, per_round=10, rounds=1, seed=0, aggregator="multi-krum",
                           byzantine_f=3, attack="scale", attack_fraction=0.3)
    assert got == Simulation(cfg).run().records[-1]["test_accuracy"]
