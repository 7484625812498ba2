"""ServerApp: FedBuff (FedAdam, polynomial staleness) over every connected node."""

import time
from pathlib import Path

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedopt_kernels import server as srv
from fedopt_kernels.integrations.flower.fedbuff import FedBuffFlowerLoop
from fedopt_kernels.server.fedbuff import FedBuffBuffer
from fedopt_kernels.utils.flat import FlatLayout

from .task import initial_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    named = initial_model()
    params = [torch.nn.Parameter(t.clone()) for _, t in named]
    buffer = FedBuffBuffer(srv.FedAdam(params, lr=0.05), int(rc["buffer"]), staleness="polynomial")
    nodes = []
    for _ in range(600):  # the SuperNodes connect on their own time
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= 3:
            break
        time.sleep(0.1)
    loop = FedBuffFlowerLoop(buffer, FlatLayout.from_named_tensors(named), concurrency=len(nodes),
                             deadline=float(rc["deadline"]))
    loop.run(grid, nodes, steps=int(rc["steps"]))
    torch.save({"log": loop.log, "updates": loop.updates, "dropped": loop.dropped, "version": buffer.version,
                "model": torch.cat([p.detach().reshape(-1) for p in params])},
               Path(str(rc["save-path"])) / "run.pt")
    print("FedBuff execution finished", flush=True)
