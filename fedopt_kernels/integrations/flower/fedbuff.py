"""FedBuff on Flower's Message API: a server loop for a ServerApp's ``grid``.

Flower's strategies are synchronous (send to a sample, wait for all).  FedBuff
(:mod:`fedopt_kernels.server.fedbuff`) is not: this loop keeps ``concurrency`` nodes
busy, each training on the model version it was sent, and steps the server when ``K``
replies are buffered.  Every reply is weighted by the staleness rule of
:class:`~fedopt_kernels.server.FedBuffBuffer` (reused, not rewritten), and the server
step is that buffer's fused step.

Messages (``message_type="train"``):

* out: ``{"arrays": ArrayRecord (the model), "config": ConfigRecord({"version": v})}``
* back: ``{"update": ArrayRecord (Delta = x_pulled - x_end, by parameter name),
  "config": ConfigRecord({"version": v})}``

``grid.push_messages`` then ``grid.pull_messages`` polled with a short sleep: the loop
never blocks on one node.  A node with no reply after ``deadline`` seconds is dropped
with a recorded reason; so is a node whose reply is an error or malformed (screened
before anything touches the buffer: wrong names/shapes, non-finite values, a version
that was never sent to it).  The record :attr:`FedBuffFlowerLoop.log` lists each
buffered reply as ``(node, version, staleness)`` in arrival order: replaying those
updates through a fresh ``FedBuffBuffer`` reproduces the model bit for bit.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch
from flwr.app import ConfigRecord, Message, RecordDict

from ...server.fedbuff import FedBuffBuffer
from ...utils.flat import FlatLayout
from .records import arrayrecord_to_vector, tensors_to_arrayrecord, vector_to_named_tensors

__all__ = ["FedBuffFlowerLoop"]


class FedBuffFlowerLoop:
    """Drive FedBuff over a Flower ``grid`` (module docstring).

    ``buffer``: a :class:`FedBuffBuffer` over the global model's parameters;
    ``layout``: their :class:`FlatLayout` (names, shapes, order of the optimizer);
    ``concurrency``: nodes training at once; ``deadline``: seconds a node may take
    before it is dropped; ``poll``: seconds between pulls.
    """

    def __init__(self, buffer: FedBuffBuffer, layout: FlatLayout, *, concurrency: int, deadline: float = 30.0,
                 poll: float = 0.02):
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
        if not deadline > 0:
            raise ValueError(f"deadline must be > 0 seconds, got {deadline!r}")
        if layout.numel != buffer.N:
            raise ValueError(f"layout has {layout.numel} elements, the buffer's model {buffer.N}")
        self.buffer, self.layout = buffer, layout
        self.concurrency, self.deadline, self.poll = concurrency, float(deadline), float(poll)
        self.params = [p for g in buffer.optimizer.param_groups for p in g["params"]]
        self.log: List[Tuple[int, int, int]] = []  # (node, pulled version, staleness), buffered order
        self.updates: List[torch.Tensor] = []  # the buffered updates, same order (for replay/audit)
        self.dropped: Dict[int, str] = {}  # node -> why it was dropped

    def _model_message(self, grid, node: int) -> Message:
        vec = torch.cat([p.detach().reshape(-1) for p in self.params])
        arrays = tensors_to_arrayrecord(vector_to_named_tensors(vec, self.layout))
        content = RecordDict({"arrays": arrays, "config": ConfigRecord({"version": self.buffer.version})})
        return grid.create_message(content, "train", node, f"fedbuff-v{self.buffer.version}")

    def _screen(self, msg: Message, sent_version: int) -> Tuple[Optional[torch.Tensor], str]:
        """The reply's update, or None and why it is refused (nothing buffered then)."""
        if msg.has_error():
            return None, f"error reply: {msg.error.reason}"
        try:
            version = int(msg.content["config"]["version"])
            update = arrayrecord_to_vector(msg.content["update"], self.layout, name="update")
        except Exception as exc:  # a malformed record: name the cause, keep the loop alive
            return None, f"malformed reply: {exc}"
        if version != sent_version:
            return None, f"reply claims version {version}, the node was sent {sent_version}"
        if not bool(torch.isfinite(update).all()):
            return None, "non-finite update"
        return update.to(self.buffer.rows.dtype), ""

    def run(self, grid, nodes: List[int], *, steps: int) -> None:
        """Run until the buffer has taken ``steps`` server steps (or no node is left)."""
        idle = list(nodes)
        inflight: Dict[str, Tuple[int, int, float]] = {}  # message id -> (node, version, sent at)

        def dispatch():
            while idle and len(inflight) < self.concurrency:
                node = idle.pop(0)
                version = self.buffer.version
                (mid,) = list(grid.push_messages([self._model_message(grid, node)]))
                inflight[mid] = (node, version, time.monotonic())

        target = self.buffer.version + steps
        dispatch()
        while self.buffer.version < target and inflight:
            replies = list(grid.pull_messages(list(inflight)))
            for msg in replies:
                mid = msg.metadata.reply_to_message_id
                if mid not in inflight:
                    continue
                node, version, _ = inflight.pop(mid)
                update, why = self._screen(msg, version)
                if update is None:
                    self.dropped[node] = why
                    continue
                tau = self.buffer.version - version
                self.log.append((node, version, tau))
                self.updates.append(update)
                self.buffer.add(update, version, client=node)
                idle.append(node)  # freed: it gets the (possibly new) model next
                if self.buffer.version >= target:
                    break
            now = time.monotonic()
            for mid, (node, version, sent) in list(inflight.items()):
                if now - sent > self.deadline:
                    del inflight[mid]
                    self.dropped[node] = f"no reply within {self.deadline:g} s (sent version {version})"
            if self.buffer.version < target:
                dispatch()
                if not replies:
                    time.sleep(self.poll)
