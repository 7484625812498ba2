"""ClientApp: FedNAR local training (fused kernels) on this node's digits partition."""

from __future__ import annotations

import os
import signal

from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from fedopt_kernels.defaults import FEDPROX_MU
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
        cfg.prox_mu = FEDPROX_MU  # the simulator's default mu (fedopt_kernels.defaults)
    return cfg


client = FedNARClient(model_fn=_model, data_fn=_train_data, eval_data_fn=_test_data, config=_local_config)


def _fault(context: Context):
    """The node config's ``fault``, for trying a federation's fault handling:
    ``"die@R"`` -- in round R this node's SuperNode is killed (SIGKILL) as its training
    starts, so the round loses it mid-way; ``"malformed@R"`` -- in round R the node
    trains but leaves one layer out of its reply.  ``(kind, round)`` or None (no
    fault: the default)."""
    spec = str(context.node_config.get("fault", ""))
    if not spec:
        return None
    kind, _, rnd = spec.partition("@")
    if kind not in ("die", "malformed") or not rnd.isdigit():
        raise ValueError(f"node config fault must be 'die@ROUND' or 'malformed@ROUND', got {spec!r}")
    return kind, int(rnd)


def _supernode_pid() -> int:
    """The ``flower-supernode`` process this ClientApp runs under (Flower 1.41: the
    SuperNode starts a SuperExec, which starts this process)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"flower-supernode" in f.read():
                return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the parent's pid
    raise RuntimeError("fault 'die': this ClientApp does not run under a flower-supernode process")


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    fault = _fault(context)
    server_round = int(msg.content[client.configrecord_key]["server-round"])
    if fault == ("die", server_round):
        os.kill(_supernode_pid(), signal.SIGKILL)  # the node goes silent: no reply, no heartbeat
        os._exit(1)
    reply = client.train(msg, context)
    if fault == ("malformed", server_round):
        arrays = reply.content[client.arrayrecord_key]
        reply.content[client.arrayrecord_key] = ArrayRecord({k: arrays[k] for k in list(arrays.keys())[1:]})
    return reply


app.evaluate()(client.evaluate)
