"""The simulator as a coordinator of parts (issue 46 item 4): each part owns its state and
its piece of the checkpoint, whose keys are those of every earlier version, and the names
the simulator has always offered read and write the part that owns them.

Oracles: an uninterrupted run of the same settings (a resume must give its bits), the
checkpoint layout written out here as it was before the parts existed, and the parts'
own attributes."""

import io

import pytest
import torch

from fedopt_kernels.fl import Simulation, SimulationConfig

# the checkpoint's keys before the simulator was cut into parts, in their order
OLD_LAYOUT = ["version", "config", "round", "elapsed", "x_global", "buffers", "server", "scaffold", "results", "dp",
              "robust", "local_momentum", "error_feedback"]

BASE = dict(dataset="digits", clients=6, per_round=3, rounds=3, local_steps=2, hidden=(8,), seed=5, engine="sequential")
# each case puts state into a different part's piece: the server's, DP's, the robust rule's, the clients'
CASES = {
    "scaffold": dict(algo="scaffold"),
    "fedadam_dp_adaptive": dict(algo="fedadam", dp_clip=1.0, dp_noise_multiplier=0.2, dp_target_quantile=0.5,
                                weighting="uniform", dp_delta=1e-5),
    "centered_clip": dict(aggregator="centered-clip", cclip_tau=1.0),
    "error_feedback_momentum": dict(compress="int8", error_feedback=True, momentum=0.5, carry_momentum=True),
}


def _tensors_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_tensors_equal, a, b))
    return a == b or (a != a and b != b)


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_of_the_old_layout_resumes_bit_for_bit(case):
    cfg = SimulationConfig(**BASE, **CASES[case])
    whole = Simulation(cfg)
    whole.run()
    first = Simulation(cfg)
    first.run(2)
    state = first.state_dict()
    assert list(state) == OLD_LAYOUT
    piece = {"scaffold": "scaffold", "fedadam_dp_adaptive": "dp", "centered_clip": "robust",
             "error_feedback_momentum": "error_feedback"}[case]
    assert state[piece] is not None  # the part did write its piece
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    resumed = Simulation(cfg)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    resumed.run()
    assert torch.equal(resumed.x_global, whole.x_global)
    a, b = resumed.state_dict(), whole.state_dict()
    for key in OLD_LAYOUT:
        if key not in ("elapsed", "results"):
            assert _tensors_equal(a[key], b[key]), key
    assert [r["test_accuracy"] for r in resumed.results.records] == [r["test_accuracy"] for r in whole.results.records]
    if case == "error_feedback_momentum":
        assert b["local_momentum"]  # carried momentum took part


def test_the_simulators_names_read_and_write_the_part_that_owns_them():
    sim = Simulation(SimulationConfig(**{**BASE, "engine": "batched"}, algo="scaffold"))
    assert sim.dataset is sim.population.dataset and sim.client_sizes is sim.population.client_sizes
    assert sim.updates is sim.training.updates and sim.scaffold is sim.training.scaffold
    assert sim.privacy is sim.server.privacy and sim.trainer is sim.training.trainer
    assert sim.training.scaffold is sim.server.round.client_state  # one SCAFFOLD state, shared by the two parts
    engine = sim.batched
    assert engine is not None
    sim.batched = None  # a write lands in the part
    assert sim.training.batched is None
    sim.batched = engine
    calls = []
    sim.progress = lambda r, done, total: calls.append((r, done, total))
    sim.run_round()
    assert sim.training.progress is not None and calls[0] == (1, 0, 3) and calls[-1] == (1, 3, 3)
    assert sim.sample_clients(2) == sim.population.sample_clients(2)
    assert sim.evaluate() == sim.evaluation.evaluate()
