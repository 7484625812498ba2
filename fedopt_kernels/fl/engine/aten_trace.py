"""A function's ATen ops, recorded once on real tensors into an FX graph.

The batched engine runs a group's vmapped gradient as a graph of the plain ATen ops
the torch.func transforms dispatch to (see :mod:`~fedopt_kernels.fl.engine.batched`).
``make_fx`` would record that graph, but it imports ``torch._dynamo`` and
``torch._inductor`` (``proxy_tensor.make_fx`` reads ``torch._inductor.config``; its
tracer imports ``torch._dynamo`` before every trace): about 0.75 s of a short run's
start-up (AMD EPYC, 2 cores), for a run that compiles nothing.

:func:`trace_aten` records the same ops with a :class:`TorchDispatchMode`: the
transforms sit above the Python dispatch key, so the mode sees what ``make_fx``'s
proxy mode sees -- every ATen op with plain tensors -- and one call on the real
arguments yields the graph.  It keeps what the engine's passes
(:mod:`~fedopt_kernels.fl.engine.graph_passes`) read: ``OpOverload`` targets, ``getitem``
nodes for multi-output ops, each node's value in ``meta["val"]`` (the real tensor:
shapes, strides, dtype, device -- drop them with :func:`drop_values` once the passes
are done), ``detach`` recorded as ``alias`` (as ``make_fx`` does), inputs as flattened
placeholders and the same pytree calling convention (the graph takes and returns
``fn``'s nested arguments and result): for the engine's gradients, make_fx's sequence
of ops (``tests/test_aten_trace.py``).  Like ``make_fx``
it eliminates nothing: every op recorded runs (in-place and random ops included).
Differences from ``make_fx``: the function runs once for real (a step's cost, no fake
tensors), and a tensor neither an input nor made by a recorded op -- a constant the
function closes over -- is kept as a graph attribute, whatever its size (``make_fx``
does the same for non-scalars).  Tensor identity is Python object identity, which the
dispatcher preserves for a tensor's whole life; no data-dependent Python control flow
is seen (the graph replays the ops of this one call, which is also ``make_fx``'s
contract): an op that returns a Python number (``.item()``, ``bool(t)``), where such
flow would start, is refused with a RuntimeError, as ``make_fx``'s fake tensors refuse
it (the engine then runs eagerly).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch.fx import Graph, GraphModule
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["trace_aten", "drop_values"]


class _Recorder(TorchDispatchMode):
    """Runs every op and appends it to ``graph``, its tensors mapped to nodes."""

    def __init__(self, graph: Graph, root: torch.nn.Module):
        super().__init__()
        self.graph = graph
        self.root = root
        self.nodes = {}  # id(tensor) -> node
        self.alive = []  # every tensor seen, so that no id is reused while tracing

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # True (the default) wraps __torch_dispatch__ in torch._disable_dynamo, whose first
        # call imports torch._dynamo; this mode never runs under torch.compile.  The
        # opt-out is the one _python_dispatch.py documents (torch 2.11 and 2.14 alike).
        return False

    def node_of(self, t: torch.Tensor):
        node = self.nodes.get(id(t))
        if node is None:  # a constant the function closes over
            name = f"_tensor_constant{sum(1 for _ in self.root.buffers())}"
            self.root.register_buffer(name, t, persistent=False)
            node = self.bind(t, self.graph.get_attr(name))
        return node

    def bind(self, t: torch.Tensor, node):
        self.nodes[id(t)] = node
        self.alive.append(t)
        node.meta["val"] = t
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        values = out if isinstance(out, (tuple, list)) else (out,)
        if not all(x is None or isinstance(x, torch.Tensor) for x in values):
            # a Python number (.item(), bool(t), torch.equal): the caller's control flow may
            # depend on it, which the graph cannot replay -- make_fx's fake tensors refuse too
            raise RuntimeError(f"trace_aten: {func} returns a Python value ({type(values[0]).__name__}): "
                               "data-dependent Python cannot be traced")
        to_node = lambda x: self.node_of(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        # make_fx's default decomposition: detach is recorded as alias (the graph's inputs
        # need no gradient; drop_identity_ops then removes it)
        target = torch.ops.aten.alias.default if func is torch.ops.aten.detach.default else func
        node = self.graph.call_function(target, pytree.tree_map(to_node, args), pytree.tree_map(to_node, kwargs))
        if isinstance(out, torch.Tensor):
            self.bind(out, node)
        elif isinstance(out, (tuple, list)):
            node.meta["val"] = out
            for i, x in enumerate(out):  # make_fx's getitems: undefined (None) results too
                if isinstance(x, torch.Tensor):
                    self.bind(x, self.graph.call_function(operator.getitem, (node, i)))
                elif x is None:
                    self.graph.call_function(operator.getitem, (node, i))
        return out


def trace_aten(fn: Callable[..., Any], *args) -> GraphModule:
    """Call ``fn(*args)`` once and return a graph module of the ATen ops it ran:
    ``gm(*args2)`` replays them on ``args2`` (the same nested structure and tensor
    shapes) and returns ``fn``'s result structure.  Every leaf of ``args`` must be a
    tensor (a placeholder of the graph); every tensor ``fn`` returns must be one of
    them or made by a recorded op (a RuntimeError otherwise: the graph would return
    the traced call's values as constants)."""
    flat, in_spec = pytree.tree_flatten(list(args))
    if not all(isinstance(t, torch.Tensor) for t in flat):
        raise TypeError("trace_aten: every leaf of the arguments must be a tensor, got "
                        + ", ".join(sorted({type(t).__name__ for t in flat if not isinstance(t, torch.Tensor)})))
    graph = Graph()
    root = torch.nn.Module()
    recorder = _Recorder(graph, root)
    for i, t in enumerate(flat):
        recorder.bind(t, graph.placeholder(f"arg{i}_1"))
    with recorder:
        result = fn(*args)
    flat_out, out_spec = pytree.tree_flatten(result)
    unseen = [i for i, t in enumerate(flat_out) if isinstance(t, torch.Tensor) and id(t) not in recorder.nodes]
    if unseen:  # made by no recorded op (e.g. on a thread the mode did not reach): never a constant
        raise RuntimeError(f"trace_aten: outputs {unseen} of {getattr(fn, '__name__', 'the function')} were made "
                           "by no recorded op")
    graph.output([recorder.node_of(t) if isinstance(t, torch.Tensor) else t for t in flat_out])
    graph._codegen = _PyTreeCodeGen(_PyTreeInfo([f"arg{i}" for i in range(len(args))], in_spec, out_spec))
    recorder.alive.clear()
    return GraphModule(root, graph, getattr(fn, "__name__", "traced"))


def drop_values(gm: GraphModule) -> None:
    """Forget the traced values in ``gm``'s ``node.meta["val"]`` (they hold the traced
    call's tensors alive; only graph passes read them)."""
    for node in gm.graph.nodes:
        node.meta.pop("val", None)
