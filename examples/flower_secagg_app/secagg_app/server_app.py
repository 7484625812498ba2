"""ServerApp: FedAvg's fused server step on the unmasked sum of Flower's SecAgg+.

SecAgg+ runs in Flower 1.41 as a legacy workflow: a ``LegacyContext`` around the
strategy and ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))``
(:func:`fedopt_kernels.integrations.flower.secagg.secaggplus_workflow`, whose masked
vectors are screened first).  The server sees only the masked vectors and their sum.

``secure-aggregation = false`` runs the same strategy and clients without SecAgg+
(Flower's plain legacy fit): the server sees each ``D_i`` and hands their weighted
mean to the same step -- the plain round a secure one is measured against."""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from flwr.app import Context
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import LegacyContext, ServerConfig
from flwr.server.workflow import DefaultWorkflow
from flwr.serverapp import Grid, ServerApp

from fedopt_kernels import server
from fedopt_kernels.integrations.flower import secagg

from .task import make_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    model = make_model(int(rc["width"]))
    nodes = int(rc["num-nodes"])
    strategy = secagg.SecAggPlusFusedStrategy(model, server.FedAvg(model.parameters(), lr=float(rc["server-lr"])),
                                              min_train_nodes=nodes, weighting="uniform")
    workflow = secagg.secaggplus_workflow(strategy, num_shares=float(rc["num-shares"]),
                                          reconstruction_threshold=float(rc["reconstruction-threshold"]),
                                          timeout=float(rc["timeout"]))
    secure = bool(rc.get("secure-aggregation", True))
    if not secure:
        workflow = DefaultWorkflow()
    # what each round's step took and gave, and when each round ended, for the record
    # (the test's oracle and the benchmark read it)
    means, globals_ = [], [torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])]
    stamps = [time.time()]
    step = strategy.aggregate_fit

    def aggregate_fit(server_round, results, failures):
        if not secure and results:  # the plain round: the weighted mean of the D_i, as SecAgg+ reveals it
            w = np.array([res.num_examples for _, res in results], dtype=np.float64)
            per = [parameters_to_ndarrays(res.parameters) for _, res in results]
            mean = [sum(wi * a[j].astype(np.float64) for wi, a in zip(w, per)) / w.sum()
                    for j in range(len(per[0]))]
            results = [(proxy, FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters(
                [m.astype(np.float32) for m in mean]), int(res.num_examples), {})) for proxy, res in results]
        out = step(server_round, results, failures)
        means.append(strategy.last_mean.clone())
        globals_.append(torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]))
        stamps.append(time.time())
        return out

    strategy.aggregate_fit = aggregate_fit
    workflow(grid, LegacyContext(context, config=ServerConfig(num_rounds=int(rc["num-server-rounds"])),
                                 strategy=strategy))
    save = str(rc.get("save-path", ""))
    if save:
        os.makedirs(save, exist_ok=True)
        torch.save({"means": means, "globals": globals_, "history": strategy.history,
                    "stamps": stamps,
                    "rejected": list(getattr(workflow.fit_workflow, "rejected", []))}, os.path.join(save, "secagg.pt"))
    print("fedopt secagg run finished", flush=True)
