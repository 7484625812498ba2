"""Issue 33, item 5: how closely the batched and the sequential engine agree, as measured.

The bound of docs/simulator.md ("Batched against sequential"), asserted here: from the
SAME state (the sequential run's checkpoint loaded into the batched simulator before
every round) one round of the two engines gives global models within ``1e-3 * max|x|``
of each other, for every algorithm
and both models -- and most rounds agree to fp32 rounding (``<= 1e-6 * max|x|``).

Why per round and not over a run: the two engines round differently (batched products
and grouped convolutions against per-client ones: ~1 ulp per operation), and a round
turns a difference at a branch -- a step whose norm sits at the clip threshold, a ReLU
or max-pool tie, ASNES's gain ratio, whose variance estimate is a difference of two
nearly equal sums -- into a larger one (measured at the defaults, one round from a
common state: up to 1.1e-4 * max|x| for the CNN under fedavg, 2.1e-4 for ASNES's MLP;
1 ulp in the other rounds).  Left to run, the two trajectories then drift apart as two
runs of one engine do from a one-ulp perturbation (the table of docs/simulator.md): the honest
bound is the per-round one.  The margin (1e-3, 5x the worst measured) leaves room for
other machines' GEMM code paths.
"""

from __future__ import annotations

import pytest
import torch

from fedopt_kernels.fl import Simulation, SimulationConfig

pytestmark = pytest.mark.usefixtures("one_thread")

ROUNDS = 3
SMALL = dict(dataset="digits", clients=10, per_round=5, local_steps=10, rounds=ROUNDS, seed=0, fedlaw_epochs=2,
             proxy_size=50)
PER_ROUND_BOUND = 1e-3   # relative to max|x|; worst measured at the defaults 2.1e-4 (ASNES, MLP)
ROUNDING = 1e-6          # "agree to fp32 rounding": 1-2 ulp of max|x| ~ 0.3 is ~1e-7 relative


def per_round_distances(model: str, algo: str):
    """``max|x_batched - x_seq| / max|x_seq|`` after each round, each round from the
    sequential run's state."""
    cfg = dict(SMALL, algo=algo, model=model)
    seq = Simulation(SimulationConfig(**cfg, engine="sequential"))
    bat = Simulation(SimulationConfig(**cfg, engine="batched"))
    assert bat.batched is not None, "the batched engine must really run"
    out = []
    for _ in range(ROUNDS):
        bat.load_state_dict(seq.state_dict())
        seq.run_round()
        bat.run_round()
        out.append(((bat.x_global - seq.x_global).abs().max() / seq.x_global.abs().max()).item())
    return out


@pytest.mark.parametrize("model, algo", [
    ("mlp", "fedavg"), ("mlp", "fedprox"), ("mlp", "scaffold"), ("mlp", "fedadam"), ("mlp", "fedexp"),
    ("mlp", "asnes"), ("mlp", "fedlaw"),
    ("cnn", "fedavg"), ("cnn", "fedprox"), ("cnn", "scaffold"), ("cnn", "asnes"), ("cnn", "fedlaw"),
])
def test_one_round_from_a_common_state_agrees(model, algo):
    d = per_round_distances(model, algo)
    assert max(d) <= PER_ROUND_BOUND, d
    assert sum(v <= ROUNDING for v in d) >= 2, d  # most rounds agree to rounding
