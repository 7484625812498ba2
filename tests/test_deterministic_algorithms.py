"""fedopt_kernels under PyTorch's own switch, ``torch.use_deterministic_algorithms(True)``.

docs/determinism.md says the library keeps PyTorch's promise and goes further.  Here
the promise itself: with the switch on, every path a simulated run takes -- local
training on both engines, the fused FedNAR steps, aggregation, the server optimisers
(FedAdam, FedExP, SCAFFOLD, FedLAW's proxy training), the robust rules, DP clipping and
noise -- runs (torch refuses no op of ours, nor one we call, as nondeterministic) and
gives the same bits as with it off.  The oracle is the same run with the switch off:
fedopt's kernels are deterministic whether asked or not, so the switch has nothing to
change in them.

On the CPU the comparison has teeth besides the refusals: under the switch torch fills
the memory of every new tensor (``torch.empty``, ``at::empty`` in the C++ kernels) with
NaN (``torch.utils.deterministic.fill_uninitialized_memory``), so a path that reads a
row it never wrote -- as the chunked rounds with BatchNorm models once did -- gives
other bits with the switch on than off.  The chunked rounds (folded, and kept whole
for a robust rule) are among the runs.

On a CUDA machine (the device check's GPU tests) the same runs on the GPU too, where
torch refuses its nondeterministic CUDA ops (``index_add_``, ``scatter_add_``, ...)
under the switch, in a subprocess that sets ``CUBLAS_WORKSPACE_CONFIG`` before cuBLAS
starts, as torch asks of a deterministic cuBLAS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_tree

from fedopt_kernels.fl import Simulation, SimulationConfig

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(dataset="digits", hidden=(32,), clients=10, per_round=4, rounds=2, local_steps=4, batch_size=32,
             lr=0.05, weight_decay=1e-3, max_norm=1.0)
RUNS = {
    "fedavg-co-batched": dict(algo="fedavg", nar="co", engine="batched"),
    "fedadam-grad-sequential": dict(algo="fedadam", nar="grad", engine="sequential"),
    "fedexp": dict(algo="fedexp", engine="batched"),
    "scaffold": dict(algo="scaffold", engine="sequential"),
    "fedlaw": dict(algo="fedlaw", engine="sequential"),
    "median": dict(algo="fedavg", aggregator="median", engine="batched"),
    "dp-noise": dict(algo="fedavg", dp_clip=0.5, dp_noise_multiplier=0.5, dp_delta=1e-5, weighting="uniform",
                     engine="batched"),
    "trimmed-mean-cnn": dict(algo="fedavgm", aggregator="trimmed-mean", model="cnn", hidden=(8,),
                             engine="batched"),
    # under a memory budget: a BatchNorm model's round folded chunk by chunk (its
    # statistics too), and a robust rule's round trained in chunks that keep their rows
    "batchnorm-folded-chunks": dict(dataset="synthetic", clients=30, per_round=9, partition="dirichlet",
                                    weighting="size", algo="fedyogi", engine="sequential", memory_budget="42K",
                                    max_weight_share=0.2, batchnorm=True),
    "trimmed-mean-chunks": dict(dataset="synthetic-lazy", clients=200, per_round=9, hidden=(16,),
                                max_samples_per_client=50, aggregator="trimmed-mean", trim_beta=0.2,
                                memory_budget="100K", engine="batched"),
}


def _batchnorm_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(60, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 10))


def run_both(name: str, device: str) -> dict:
    """Run ``RUNS[name]`` with the switch on, then off; their state dicts (the model, the
    server's and the rule's state, every record but the wall times), and the model each
    started from."""
    states = {}
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for on in (True, False):
            torch.use_deterministic_algorithms(on)
            if on:  # what gives the comparison its teeth on the CPU: new memory is NaN under the switch
                assert torch.isnan(torch.empty(5)).all()
            config = {**SMALL, **RUNS[name], "device": device}
            model = _batchnorm_mlp if config.pop("batchnorm", False) else None
            sim = Simulation(SimulationConfig(**config), model=model)
            if "memory_budget" in config:  # a chunked run: chunks of 2 or more clients, several a round
                assert 2 <= sim._chunk < config["per_round"], sim._chunk
            start = sim.x_global.clone()
            sim.run()
            state = sim.state_dict()
            state["start"] = start
            for timed in (*state["results"]["records"], state["results"]["summary"]):
                timed.pop("wall_time", None)  # the seconds each took
            state.pop("elapsed")
            states[on] = state
    finally:
        torch.use_deterministic_algorithms(before)
    return states


def check(name: str, device: str) -> None:
    """``RUNS[name]`` on ``device`` with the switch on equals it with the switch off, and
    both ran every round: the global model moved from its start."""
    states = run_both(name, device)
    assert_same_tree(states[True], states[False], name, nan_equal=True)
    state = states[True]
    assert state["round"] == SMALL["rounds"] and len(state["results"]["records"]) == SMALL["rounds"] + 1
    assert not torch.equal(state["x_global"], state["start"])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_under_the_switch_runs_and_gives_the_same_bits(name):
    check(name, "cpu")


def test_the_same_on_a_cuda_device():
    """Every run of RUNS on the GPU, in one subprocess (one CUDA start-up for all of
    them: the device check's GPU step has a budget)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {name: "same bits" for name in RUNS}


if __name__ == "__main__":  # the CUDA test's subprocess
    for _name in RUNS:
        check(_name, "cuda")
    print(json.dumps({name: "same bits" for name in RUNS}))
