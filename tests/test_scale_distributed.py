"""``--memory-budget`` with ``--distributed`` (issue 32): refused, with an error naming
the flag, before any round -- it used to be ignored with a warning, a promised bound the
run did not keep."""

import pytest
import torch.distributed as dist

from fedopt_kernels.cli import main
from fedopt_kernels.fl import SimulationConfig
from fedopt_kernels.fl.run.config import ConfigError

BASE = dict(dataset="synthetic-lazy", clients=50, per_round=6, rounds=1, local_steps=1, hidden=(8,),
            max_samples_per_client=40, seed=0)


@pytest.fixture
def group_of_one(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_distributed_simulation_refuses_a_memory_budget(group_of_one):
    from fedopt_kernels.fl.run.distributed_simulation import DistributedSimulation

    with pytest.raises(ConfigError, match="memory-budget is not supported with --distributed"):
        DistributedSimulation(SimulationConfig(**BASE, memory_budget="1M"))
    sim = DistributedSimulation(SimulationConfig(**BASE))  # the same run without a budget trains
    sim.run()
    assert sim.round == 1 and "memory_budget" not in sim.results.meta


def test_fedopt_simulate_distributed_memory_budget_is_one_line(group_of_one, tmp_path, capsys):
    argv = ["simulate", "--distributed", "--dataset", "synthetic-lazy", "--clients", "50", "--per-round", "6",
            "--rounds", "1", "--local-steps", "1", "--memory-budget", "1M", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedopt: error: memory-budget is not supported with --distributed")
    assert not (tmp_path / "o" / "results.json").exists()
