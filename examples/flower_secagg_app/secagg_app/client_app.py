"""ClientApp: FedNAR local training answering SecAgg+ (``secaggplus_mod``)."""

from __future__ import annotations

import os
import signal

from flwr.app import Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.clientapp import ClientApp
from flwr.compat.common import recorddict_compat as compat

from fedopt_kernels.integrations.flower.secagg import SecAggFedNARClient

from .task import client_data, make_model

client = SecAggFedNARClient(model_fn=lambda context: make_model(int(context.run_config["width"])),
                            data_fn=lambda context: client_data(int(context.node_config["partition-id"])))


def _secaggplus_if_asked(msg: Message, context: Context, call_next) -> Message:
    """``secaggplus_mod`` for SecAgg+'s messages (they carry its config record); a plain
    legacy fit (``secure-aggregation = false``) goes straight to train."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


# secaggplus_mod runs the protocol's stages; train runs at its collect_masked_vectors stage
# (client.app() is this app without the fault and the plain mode)
app = ClientApp(mods=[_secaggplus_if_asked])


def _supernode_pid() -> int:
    """The ``flower-supernode`` process this ClientApp runs under (SuperNode -> SuperExec -> here)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"flower-supernode" in f.read():
                return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("fault 'die': this ClientApp does not run under a flower-supernode process")


# SecAgg+'s stages before training (setup, share_keys) have run when train is called: a
# node configured with ``fault="die@R"`` has shared its key shares and dies here in
# round R -- the dropout SecAgg+ tolerates up to its reconstruction threshold.
@app.train()
def train(msg: Message, context: Context) -> Message:
    spec = str(context.node_config.get("fault", ""))
    if spec:
        kind, _, rnd = spec.partition("@")
        if kind != "die" or not rnd.isdigit():
            raise ValueError(f"node config fault must be 'die@ROUND', got {spec!r}")
        config = compat.recorddict_to_fitins(msg.content, keep_input=True).config
        if int(config.get("server-round", 0)) == int(rnd):
            os.kill(_supernode_pid(), signal.SIGKILL)  # no reply, no heartbeat
            os._exit(1)
    return client.train(msg, context)
