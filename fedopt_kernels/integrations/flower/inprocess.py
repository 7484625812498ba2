"""A Flower ``Grid`` that runs a ``ClientApp`` in this process, for tests and benchmarks.

Each message is delivered as the SuperLink would deliver it: serialized to Flower's
protobuf and parsed back (:func:`flwr.common.serde.message_to_proto` /
``message_from_proto``), so a ClientApp or mod that mutates what it receives (SecAgg+'s
``secaggplus_mod`` pops its stage from the config) cannot reach the sender's objects, and
the bytes each way are counted (:attr:`InProcessGrid.bytes_down`, :attr:`bytes_up`).  One
node per partition (``node_config["partition-id"]``), each with its own persistent
``Context.state``.  ``tamper(stage, partition, reply, state) -> reply or None`` may
replace or drop a node's reply (``stage``: the message's ``"stage"`` config entry where it
has one, else its message type), to test how a server takes a bad actor.
"""

from __future__ import annotations

import types
import uuid
from typing import Callable, Dict, List, Optional

from flwr.app import Context, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.serverapp import Grid

__all__ = ["InProcessGrid"]


class InProcessGrid(Grid):
    """``InProcessGrid(app, num_nodes, run_config=None, tamper=None)``: see the module."""

    def __init__(self, app, num_nodes: int, run_config: Optional[dict] = None,
                 tamper: Optional[Callable] = None, run_id: int = 1):
        from flwr.supercore.task_identity import TaskIdentity

        # Messages built in this process take their run, task and source from it (Flower
        # sets it per process in a deployment): the server's, node 0
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = run_id, 1, 0
        self.app = app
        self.nodes = [9001 + 13 * i for i in range(num_nodes)]
        self.contexts: Dict[int, Context] = {
            nid: Context(run_id=run_id, node_id=nid, node_config={"partition-id": i, "num-partitions": num_nodes},
                         state=RecordDict(), run_config=dict(run_config or {}))
            for i, nid in enumerate(self.nodes)}
        self.tamper = tamper
        self.tamper_state: dict = {}
        self.bytes_down = 0  # serialized messages sent to the nodes
        self.bytes_up = 0  # serialized replies
        self._run = types.SimpleNamespace(run_id=run_id)

    # ------------------------------------------------------------------ Grid
    def set_run(self, run_id):  # noqa: D102
        self._run = types.SimpleNamespace(run_id=run_id)

    @property
    def run(self):  # noqa: D102
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: D102
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)

    def get_node_ids(self):  # noqa: D102
        return list(self.nodes)

    def push_messages(self, messages):  # pragma: no cover - send_and_receive does it all
        raise NotImplementedError("InProcessGrid delivers through send_and_receive")

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError("InProcessGrid delivers through send_and_receive")

    def send_and_receive(self, messages, *, timeout=None) -> List[Message]:  # noqa: D102
        replies = []
        for m in messages:
            m.metadata.__dict__.update(_message_id=uuid.uuid4().hex, _src_node_id=0, _run_id=self._run.run_id)
            wire = message_to_proto(m)
            self.bytes_down += wire.ByteSize()
            node = m.metadata.dst_node_id
            reply = self.app(message_from_proto(wire), self.contexts[node])
            if self.tamper is not None:
                reply = self.tamper(_stage(m), self.nodes.index(node), reply, self.tamper_state)
            if reply is None:
                continue
            reply.metadata.__dict__.update(_message_id=uuid.uuid4().hex)
            wire = message_to_proto(reply)
            self.bytes_up += wire.ByteSize()
            replies.append(message_from_proto(wire))
        return replies[::-1]  # arrival order must not matter


def _stage(message: Message) -> str:
    for record in message.content.config_records.values():
        if "stage" in record:
            return str(record["stage"])
    return message.metadata.message_type
