"""Flower's deployment mode, for real: a SuperLink and 3 SuperNodes as separate processes
on loopback (``flower-superlink --insecure``, ``flower-supernode --insecure
--superlink 127.0.0.1:PORT --node-config "partition-id=i num-partitions=3"``), then
``flwr run examples/flower_app`` on them: the fused FedAvg server and FedNAR clients
for 3 rounds.  The global model after every round (its test accuracy) and at the end
must equal ``fedopt simulate`` on the same clients, data and seeds bit for bit (every
client every round, sequential engine): the strategy aggregates in partition-id
order, so the order in which the replies arrive cannot matter.

Every process is started in its own session and stopped (SIGTERM, then SIGKILL) when
the test ends, pass or fail; only 127.0.0.1 is used.  Skipped only on Python 3.10,
where flwr 1.41 cannot be installed.
"""

from __future__ import annotations

import pytest
import torch
from _flwr import needs_flwr

from fedopt_kernels.benchmarks import flower_run as FR

NODES = 3
WORKLOAD = dict(clients=NODES, per_round=NODES, rounds=3, local_steps=3, hidden=16, batch_size=32, lr=0.05,
                lr_decay=0.998, weight_decay=1e-3, max_norm=10.0, alpha=0.3, seed=0)


@needs_flwr
@pytest.mark.slow
def test_superlink_and_supernodes_as_processes_equal_fedopt_simulate(tmp_path):
    link = FR.start_superlink(tmp_path, simulation=False)
    nodes = []
    try:
        nodes = FR.start_supernodes(link, NODES, tmp_path)
        flower = FR.run_flower(link, tmp_path / "flower", deployment=True, timeout=600, **WORKLOAD)
        assert all(p.poll() is None for p in nodes), "a SuperNode exited during the run"
    finally:
        for proc in nodes:
            FR.stop_process(proc)
        link.stop()
    assert all(p.poll() is not None for p in nodes + [link.proc])  # nothing left running
    fedopt = FR.run_fedopt(tmp_path / "fedopt", engine="sequential", **WORKLOAD)
    assert flower.sampled == [NODES] * WORKLOAD["rounds"] and fedopt.sampled == [NODES] * WORKLOAD["rounds"]
    assert len(flower.accuracy) == WORKLOAD["rounds"] + 1
    assert flower.accuracy == fedopt.accuracy
    state = torch.load(tmp_path / "flower" / "final_model.pt", weights_only=True)
    x_flower = torch.cat([v.flatten() for v in state.values()])
    x_fedopt = torch.load(tmp_path / "fedopt" / "checkpoint.pt", weights_only=True)["x_global"]
    assert torch.equal(x_flower, x_fedopt), (x_flower - x_fedopt).abs().max()
    assert len(set(flower.accuracy)) > 1  # the model moved: a run that trained nothing would also be "equal"
