"""ClientApp: FedNAR local training (fused kernels) on this node's digits partition."""

from __future__ import annotations

from flwr.app import Context
from flwr.clientapp import ClientApp

from fedopt_kernels.integrations.flower import FedNARClient, local_config_from_run_config

from .task import client_data, make_model, test_data


def _model(context: Context):
    return make_model(int(context.run_config["seed"]), int(context.run_config["hidden"]))


def _train_data(context: Context):
    rc, nc = context.run_config, context.node_config
    return client_data(int(rc["seed"]), int(nc["partition-id"]), int(nc["num-partitions"]), float(rc["alpha"]))


def _test_data(context: Context):
    return test_data(int(context.run_config["seed"]))


def _local_config(context: Context):
    cfg = local_config_from_run_config(context.run_config)
    if context.run_config.get("algo") == "fedprox" and cfg.prox_mu == 0.0:
        cfg.prox_mu = 0.01  # the simulator's default mu
    return cfg


client = FedNARClient(model_fn=_model, data_fn=_train_data, eval_data_fn=_test_data, config=_local_config)

app = ClientApp()
app.train()(client.train)
app.evaluate()(client.evaluate)
