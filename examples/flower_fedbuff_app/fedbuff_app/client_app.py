"""ClientApp: sleep ``delay`` seconds (node config), then reply with the update and its version."""

import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedopt_kernels.integrations.flower.records import (arrayrecord_to_vector, tensors_to_arrayrecord,
                                                         vector_to_named_tensors)
from fedopt_kernels.utils.flat import FlatLayout

from .task import client_update, initial_model

app = ClientApp()
LAYOUT = FlatLayout.from_named_tensors(initial_model())


@app.train()
def train(msg: Message, context: Context) -> Message:
    x = arrayrecord_to_vector(msg.content["arrays"], LAYOUT)
    time.sleep(float(context.node_config.get("delay", 0.0)))
    upd = client_update(x, int(context.node_config["partition-id"]))
    content = RecordDict({"update": tensors_to_arrayrecord(vector_to_named_tensors(upd, LAYOUT)),
                          "config": ConfigRecord({"version": int(msg.content["config"]["version"])})})
    return Message(content=content, reply_to=msg)
